"""The walkthrough runs on the CPU, and its narration reports every mechanism it promises - a prefix-cache hit, a
chunked prefill, a preemption, an MSA block selection, an MoE routing - with the numbers the engine itself
counted (engine.stats), so the story cannot drift from what the engine did."""

from __future__ import annotations

import io
import re

import pytest

from nanoserve import walkthrough


def narrate(scenario: str, **kwargs) -> tuple[str, walkthrough.Result]:
    out = io.StringIO()
    result = walkthrough.run(scenario, out=out, **kwargs)
    return out.getvalue(), result


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

    hits = [int(n) for n in re.findall(r"\[prefix hit\] \w+: reuses (\d+) cached tokens", text)]
    assert hits, "no prefix-cache hit narrated"
    assert sum(hits) == stats.prefix_cache_hits > 0
    assert "B: reuses 32 cached tokens, blocks 0 1 (computed for A)" in text

    preempts = tagged(text, "preempt")
    assert len(preempts) == stats.num_preemptions == 1
    assert "the newest running sequence, C, gives way" in preempts[0]

    chunks = tagged(text, "chunk")
    assert chunks and all(c.startswith("C: only tokens") for c in chunks)

    assert len(re.findall(r"^--- step \d+ ", text, re.M)) == stats.num_steps == result.narrated.steps
    assert len(tagged(text, "finish")) == sum(stats.finished.values()) == 3
    assert len(tagged(text, "evict")) == result.narrated.evictions > 0
    assert result.narrated.preemptions == stats.num_preemptions
    assert result.narrated.prefix_hit_tokens == stats.prefix_cache_hits

    summary = text[text.index("summary"):]
    assert re.search(rf"preemptions +engine {stats.num_preemptions} +narrated {stats.num_preemptions}", summary)
    assert re.search(rf"prefix-cache hit tokens +engine {stats.prefix_cache_hits} +narrated "
                     rf"{stats.prefix_cache_hits}", summary)


def test_msa_selection_is_narrated_with_scores_that_explain_it(everything):
    """Every narrated selection keeps the query's own block plus the best-scoring others: the recomputed block
    scores printed beside the real selection agree with it."""
    text, result = everything
    text = unwrap(text)
    cfg = result.engine.model_config
    heads = re.findall(r"\[MSA\] +layer (\d+), (\w)'s newest query \(position (\d+)\) sees (\d+) blocks, keeps (\d+)",
                       text)
    assert heads, "no MSA selection that drops blocks was narrated"
    assert all(int(h[0]) == 1 and int(h[4]) == cfg.index_topk_blocks for h in heads)
    selections = re.findall(r"group 0 selects (.*?); drops (.*)", text)
    assert len(selections) == len(heads)
    for picked, dropped in selections:
        own = re.findall(r"(\d+) \(own block, forced\)", picked)
        kept = [float(s) for s in re.findall(r"\d+ \(score (-?[\d.]+)\)", picked)]
        lost = [float(s) for s in re.findall(r"\d+ \((-?[\d.]+)\)", dropped)]
        assert len(own) == 1 and len(kept) == cfg.index_topk_blocks - 1 and lost
        assert min(kept) >= max(lost)


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
    assert re.search(r"A \[0\* 1\* 2\]", text) and re.search(r"B \[0\* 1\* 3\]", text)


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


def test_cli(capsys):
    assert walkthrough.main(["--scenario", "chunk", "-q"]) == 0
    out = capsys.readouterr().out
    assert "scenario 'chunk'" in out and "[chunk]" in out
    with pytest.raises(SystemExit):
        walkthrough.main(["--scenario", "nope"])
    with pytest.raises(ValueError, match="unknown scenario"):
        walkthrough.run("nope")
