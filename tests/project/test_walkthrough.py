"""The walkthrough runs on the CPU, on the trained m3-mini, and its narration reports every mechanism it promises -
a prefix-cache hit, a chunked prefill, a preemption, an MSA block selection, an MoE routing - with the numbers the
engine itself counted (engine.stats), so the story cannot drift from what the engine did.

docs/walkthrough.md quotes the walkthrough's output; test_doc_quotes_are_current reruns every quoted command and
checks each quote is still what it prints. After a change to the weights or to the narration, refresh the quotes
with

    python tests/project/test_walkthrough.py --write

(each quote is an excerpt of one step, or the summary: its entries are replaced by the same entries of a new run,
found by step, tag and likeness; an excerpt whose step no longer exists has to be edited by hand).
"""

from __future__ import annotations

import difflib
import io
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "walkthrough.md"

if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # run as a script from a checkout

from nanoserve import walkthrough  # noqa: E402 - after the sys.path line above

RUNS: dict[tuple[str, str, str], tuple[str, walkthrough.Result]] = {}


def narrate(scenario: str, detail: str = "normal", model: str = walkthrough.DEFAULT_MODEL, **kwargs
            ) -> tuple[str, walkthrough.Result]:
    """The narration of one run (runs without pause are deterministic, so each is made once)."""
    key = (scenario, detail, model)
    if kwargs or key not in RUNS:
        out = io.StringIO()
        result = walkthrough.run(scenario, detail, out=out, model=model, **kwargs)
        if kwargs:
            return out.getvalue(), result
        RUNS[key] = out.getvalue(), result
    return RUNS[key]


@pytest.fixture(scope="module")
def everything() -> tuple[str, walkthrough.Result]:
    return narrate("all")


def tagged(text: str, tag: str) -> list[str]:
    """The narration lines carrying [tag] (first line of each, unwrapped)."""
    return re.findall(rf"^  \[{re.escape(tag)}\] *(.*)$", text, re.M)


def unwrap(text: str) -> str:
    """Join wrapped continuation lines (indented past the tag column) onto their line."""
    return re.sub(r"\n {%d}(?=\S)" % walkthrough.INDENT, " ", text)


def test_all_scenario_narrates_each_mechanism_as_the_engine_counted_it(everything):
    text, result = everything
    text = unwrap(text)
    stats = result.engine.stats
    bs = result.engine.block_size

    hits = [int(n) for n in re.findall(r"\[prefix hit\] \w+: reuses (\d+) cached tokens", text)]
    assert hits, "no prefix-cache hit narrated"
    assert sum(hits) == stats.prefix_cache_hits > 0
    # B reads L's document: its first hit is every full block of the prefix the two chats share
    long, other = result.prompts["L"].ids, result.prompts["B"].ids
    common = next(i for i, (a, b) in enumerate(zip(long, other)) if a != b)
    assert re.search(rf"B: reuses {common // bs * bs} cached tokens, blocks [\d ]+ \(computed for L\)", text)

    preempts = tagged(text, "preempt")
    assert len(preempts) == stats.num_preemptions == 1
    assert preempts[0].startswith("L needs another KV block and the pool is empty, so the newest running "
                                  "sequence, B, gives way")
    assert "B (again, after its preemption)" in text

    chunks = tagged(text, "chunk")
    assert len(chunks) >= 2 and all(c.startswith("L: only tokens") for c in chunks)

    assert len(re.findall(r"^--- step \d+ ", text, re.M)) == stats.num_steps == result.narrated.steps
    assert len(tagged(text, "finish")) == sum(stats.finished.values()) == 3
    assert len(tagged(text, "evict")) == result.narrated.evictions
    assert result.narrated.preemptions == stats.num_preemptions
    assert result.narrated.prefix_hit_tokens == stats.prefix_cache_hits

    summary = text[text.index("summary"):]
    assert re.search(rf"preemptions +engine {stats.num_preemptions} +narrated {stats.num_preemptions}", summary)
    assert re.search(rf"prefix-cache hit tokens +engine {stats.prefix_cache_hits} +narrated "
                     rf"{stats.prefix_cache_hits}", summary)


def test_chats_are_rendered_and_the_document_is_fit_to_blocks(everything):
    """The prompts are chats in the model's template; the long document makes L exactly the MSA top-k plus three
    blocks less one token, and the block said to hold the asked pass key holds it."""
    _, result = everything
    engine, prompts = result.engine, result.prompts
    cfg, bs = engine.model_config, engine.block_size
    text = engine.tokenizer.decode(prompts["A"].ids)
    assert text.startswith("]~!b[") and "Hello! Who are you?" in text and text.endswith("]~b]ai\n</mm:think>")
    assert len(prompts["L"].ids) == (cfg.index_topk_blocks + 3) * bs - 1
    for name, person in (("L", "Kenji Tanaka"), ("B", "Grace Okafor")):
        p, key = prompts[name], dict(walkthrough.PASS_KEYS)[person]
        assert p.ask.question == f"What is the pass key of {person}?"
        start = p.key_block * bs  # the sentence starts in that block
        sentence = f"The pass key of {person} is {key}."
        assert sentence in engine.tokenizer.decode(p.ids[start: start + 2 * bs])
        assert sentence not in engine.tokenizer.decode(p.ids[start + bs: start + 3 * bs])
        assert f". {sentence} " in engine.tokenizer.decode(p.ids)  # between two sentences of the filler


def test_answers_are_words(everything):
    """m3-mini is trained: its answers are text a reader can read (the noise of random weights is not)."""
    text, _ = everything
    answers = [a for _, a in re.findall(r"\[finish\] +\w: \d+ tokens generated \(finish reason '\w+'\): "
                                        r"(['\"])(.*?)(?:\.\.\.)?\1$", unwrap(text), re.M)]  # repr's quotes
    assert len(answers) == 3
    for answer in answers:
        words = answer.split()
        assert words and sum(w.strip(".,!?:;'").isalpha() for w in words) >= 0.7 * len(words), answer


def test_msa_selection_is_narrated_with_scores_that_explain_it(everything):
    """Every narrated selection keeps the query's own block plus the best-scoring others: the recomputed block
    scores printed beside the real selection agree with it."""
    text, result = everything
    text = unwrap(text)
    cfg = result.engine.model_config
    heads = re.findall(r"\[MSA\] +layer (\d+), (\w)'s newest query \(position (\d+)\) sees (\d+) blocks, keeps (\d+)",
                       text)
    assert heads, "no MSA selection that drops blocks was narrated"
    assert {h[1] for h in heads} == {"L", "B"}
    assert all(int(h[0]) == 1 and int(h[4]) == cfg.index_topk_blocks for h in heads)
    selections = re.findall(r"group 0 drops (.*?); keeps its own block (\d+) \(forced\) and (\d+) more, scoring "
                            r"(-?[\d.]+) to (-?[\d.]+)", text)
    assert len(selections) == len(heads)
    for (dropped, _, more, low, high), head in zip(selections, heads):
        lost = [float(s) for s in re.findall(r"\d+ \((-?[\d.]+)\)", dropped)]
        assert int(more) == cfg.index_topk_blocks - 1 and len(lost) == int(head[3]) - cfg.index_topk_blocks
        assert float(low) >= max(lost) and float(high) >= float(low)
    keys = re.findall(r"the pass key (\w) asks for is written in block (\d+): (kept by|dropped by)", text)
    assert len(keys) == len(heads)
    assert all(int(block) == result.prompts[name].key_block for name, block, _ in keys)


def test_moe_routing_is_narrated_per_token(everything):
    text, result = everything
    cfg = result.engine.model_config
    assert len(tagged(text, "MoE")) == result.narrated.moe_routings == result.engine.stats.num_steps
    routes = re.findall(r"^ +\w +\S.* -> ((?:e\d+ [\d.]+(?:, )?)+)$", text, re.M)
    assert routes
    for route in routes:
        pairs = re.findall(r"e(\d+) ([\d.]+)", route)
        assert len(pairs) == cfg.num_experts_per_tok
        assert all(0 <= int(e) < cfg.num_local_experts for e, _ in pairs)
        assert abs(sum(float(w) for _, w in pairs) - 1.0) < 0.03  # renormalised weights (printed to 2 places)


def test_block_tables_mark_shared_blocks(everything):
    text, _ = everything
    assert re.search(r"L \[2\* 3\* [\d* ]+\]", text) and re.search(r"B \[2\* 3\* [\d* ]+\]", text)


def test_each_scenario_shows_its_mechanism():
    text, result = narrate("prefix")
    stats = result.engine.stats
    hits = [int(n) for n in re.findall(r"reuses (\d+) cached tokens", text)]
    assert len(hits) == 2 and sum(hits) == stats.prefix_cache_hits
    assert "revived from the free list" in unwrap(text)  # C finds A's blocks after A finished

    text, result = narrate("chunk")
    chunks = tagged(text, "chunk")
    assert len(chunks) >= 2 and result.engine.stats.num_preemptions == 0
    assert "(its last chunk)" in unwrap(text)

    text, result = narrate("preempt")
    assert len(tagged(text, "preempt")) == result.engine.stats.num_preemptions >= 1
    assert "(again, after its preemption)" in text


def test_detail_levels_and_pause():
    low, _ = narrate("prefix", detail="low")
    high, result = narrate("prefix", detail="high")
    assert "[tables]" not in low and "[tables]" in high and "by block id:" in high
    assert len(low) < len(high)
    waits = []
    narrate("prefix", detail="low", pause=True, wait=lambda: waits.append(1))
    assert len(waits) == result.engine.stats.num_steps
    # the tracing hook is removed afterwards: the model is back to zero cost
    model = result.engine.executor.runner.model
    assert all(getattr(layer.self_attn, "trace", None) is None for layer in model.layers)


def test_image_scenario_narrates_the_placeholders_the_encoder_and_its_cache():
    """On m3-tiny-vl (m3-mini has no vision tower): P's picture is encoded in the step whose chunk reaches it and
    used by the next chunk too; Q sends it again after new text, so its features come from the encoder cache; R
    sends another picture with P's text, so only the blocks before the picture are prefix-cache hits."""
    text, result = narrate("image")
    text = unwrap(text)
    stats, bs = result.engine.stats, result.engine.block_size
    assert "model m3-tiny-vl (random weights" in text
    assert re.search(r"\[image\] +P's picture is 20 placeholder tokens, tokens (\d+)-(\d+)", text)
    encodes = tagged(text, "encode")
    assert len(encodes) == stats.encoder_items == 2 and "the rest of its features wait" in encodes[0]
    hits = re.findall(r"\[features\] +(\w)'s picture \(hash \w+\) was encoded before", text)
    assert hits == ["Q"] and stats.encoder_cache_hits == 1
    p, r = result.prompts["P"], result.prompts["R"]
    assert p.ids == [t for t in r.ids] and p.features[0].identifier != r.features[0].identifier
    assert re.search(rf"\[prefix hit\] R: reuses {p.features[0].offset // bs * bs} cached tokens", text)


def test_cli_and_another_model(capsys):
    assert walkthrough.main(["--scenario", "chunk", "-q"]) == 0
    out = capsys.readouterr().out
    assert "scenario 'chunk'" in out and "model m3-mini," in out and "[chunk]" in out
    # m3-tiny (random weights, blocks of 16, top-3): the same story, at its own sizes
    assert walkthrough.main(["--model", "m3-tiny", "-q"]) == 0
    out = unwrap(capsys.readouterr().out)
    assert "model m3-tiny (random weights" in out and "keeps the top 3 blocks" in out
    assert "[chunk]" in out and "[preempt]" in out and "[prefix hit] B:" in out
    for bad in (["--scenario", "nope"], ["--model", "/no/such/checkpoint"]):
        with pytest.raises(SystemExit):
            walkthrough.main(bad)
        assert bad[1] in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown scenario"):
        walkthrough.run("nope")
    with pytest.raises(ValueError, match="too large for the CPU walkthrough"):
        walkthrough.run(model="m3-slice")


# ------------------------------------------------------------------------------------------------------------
# docs/walkthrough.md's quotes: checked here, refreshed by `python tests/project/test_walkthrough.py --write`
# ------------------------------------------------------------------------------------------------------------

QUOTE = re.compile(r"(<!-- output: python -m nanoserve\.walkthrough(?P<args>.*?) -->\s*```text\n)"
                   r"(?P<body>.*?)(```)", re.S)
CONTINUED = " " * walkthrough.INDENT


def _command_output(args: str) -> str:
    args_ = args.split()
    scenario = args_[args_.index("--scenario") + 1] if "--scenario" in args_ else "all"
    detail = "high" if "-v" in args_ else "low" if "-q" in args_ else "normal"
    return narrate(scenario, detail)[0]


def _steps(output: str) -> dict[str, list[list[str]]]:
    """The output as step header -> entries (a [tag] line and its continuation lines); the summary is one."""
    steps: dict[str, list[list[str]]] = {}
    current: list[list[str]] = []
    lines = output.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("--- step "):
            current = steps.setdefault(line, [])
        elif line.startswith("summary ("):
            steps[line] = [lines[i:]]
            break
        elif line.startswith(CONTINUED) and line.strip() and current:
            current[-1].append(line)
        elif line.startswith(("  [", "  (")):
            current.append([line])
    return steps


def _tag(line: str) -> str:
    m = re.match(r"^  (\[[^\]]*\]|\()", line)
    return m.group(1) if m else line


def refresh_quote(body: str, output: str) -> str:
    """The excerpt `body` as `output` prints it now: the same step (by header, or the step whose entries are most
    like the quoted ones), each quoted entry replaced by the most similar entry with its tag there."""
    steps = _steps(output)
    quoted = body.splitlines()
    if quoted[0].startswith("summary ("):
        return "\n".join(next(e for h, e in steps.items() if h.startswith("summary ("))[0]) + "\n"
    entries = [line for line in quoted[1:] if line.startswith(("  [", "  (")) or line == "  ..."]

    def who(line: str) -> str:  # the request a line is about: its first word after the tag
        return line[walkthrough.INDENT:].split(":")[0].split(" ")[0]

    def best(candidates: list[list[str]], line: str) -> tuple[float, list[str] | None]:
        scored = [(difflib.SequenceMatcher(None, line, c[0]).ratio(), c) for c in candidates
                  if _tag(c[0]) == _tag(line) and who(c[0]) == who(line)]
        return max(scored, key=lambda x: x[0], default=(0.0, None))

    def likeness(header: str) -> float:  # a quoted entry missing from the step counts against it
        found = [best(steps[header], line) for line in entries if line != "  ..."]
        return sum(score if entry else -1.0 for score, entry in found) + 0.5 * (header == quoted[0])

    header = max((h for h in steps if h.startswith("--- step")), key=likeness)
    new = [header]
    for line in entries:
        if line == "  ...":
            new.append(line)
            continue
        entry = best(steps[header], line)[1]
        if entry is None:
            raise ValueError(f"docs/walkthrough.md: no {_tag(line)} entry in {header.split(' -')[0]!r} any more; "
                             f"edit the quote by hand:\n{line}")
        new += entry
    return "\n".join(new) + "\n"


def refreshed_doc(doc: str) -> str:
    return QUOTE.sub(lambda m: m.group(1) + refresh_quote(m.group("body"), _command_output(m.group("args")))
                     + m.group(4), doc)


def test_doc_quotes_are_current():
    doc = DOC.read_text()
    assert QUOTE.search(doc), "docs/walkthrough.md quotes no walkthrough output"
    new = refreshed_doc(doc)
    stale = [f"{a}\n    now: {b}" for a, b in zip(doc.splitlines(), new.splitlines()) if a != b]
    assert not stale and doc == new, ("docs/walkthrough.md quotes output the walkthrough no longer prints; run "
                                      "`python tests/project/test_walkthrough.py --write` and reread the prose around "
                                      "the quotes:\n" + "\n".join(stale[:10]))


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        DOC.write_text(refreshed_doc(DOC.read_text()))
        print(f"refreshed the quotes in {DOC.relative_to(ROOT)}")
    else:
        sys.exit("usage: python tests/project/test_walkthrough.py --write   (refresh docs/walkthrough.md's quotes)")
