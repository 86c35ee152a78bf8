"""The quality bench's perplexity: exp of the mean negative log-likelihood of the held-out text, window by window,
equal to what one forward pass over each window gives; the long-context variant counts only the positions past
MSA's top-k x block size (where blocks are really dropped), and a forced selection changes it."""

from __future__ import annotations

import gzip
import json
import math
import random

import pytest

from nanoserve import LLM
from nanoserve.bench import quality
from tests.helpers.engine_utils import direct_logprobs, engine_opts

WORDS = "the key of the serving engine reads blocks of tokens from a paged cache and writes them back".split()


@pytest.fixture(scope="module")
def llm_and_text(tiny_dir, tmp_path_factory):
    llm = LLM(model=tiny_dir, device="cpu", dtype="float32", optimizations=engine_opts(), max_model_len=512,
              kv_cache_tokens=2048, seed=0)
    rng = random.Random(0)
    text = " ".join(rng.choice(WORDS) for _ in range(600))
    held = tmp_path_factory.mktemp("heldout")
    with gzip.open(held / "heldout_text.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(json.dumps({"source": "words", "text": text}) + "\n")
    yield llm, str(held), text
    llm.shutdown()


def expected_ppl(llm, text: str, max_tokens: int, window: int, skip: int) -> float:
    ids = llm.engine.tokenizer.encode(text)[:max_tokens]
    nll, n = 0.0, 0
    for i in range(0, len(ids) - 1, window):
        w = ids[i:i + window]
        if len(w) <= skip + 1:
            continue
        lp = direct_logprobs(llm, w)  # [T, V]: position t predicts w[t + 1]
        for pos in range(max(skip, 1), len(w)):
            nll -= float(lp[pos - 1, w[pos]])
            n += 1
    return math.exp(nll / n)


@pytest.mark.parametrize("window,skip", [(64, 0), (160, 48)])
def test_perplexity_is_the_mean_nll_of_each_window(llm_and_text, window, skip):
    llm, held, text = llm_and_text
    got = quality.perplexity(llm, held, 300, window=window, skip=skip)["words"]
    assert got == pytest.approx(expected_ppl(llm, text, 300, window, skip), rel=1e-4)  # fp32


def test_long_perplexity_reads_selected_blocks(llm_and_text, monkeypatch):
    llm, held, text = llm_and_text
    cfg = llm.engine.model_config
    dense = cfg.index_topk_blocks * cfg.index_block_size  # 3 x 16 on m3-tiny
    monkeypatch.setattr(quality, "LONG_WINDOW", 160)
    learned = quality.long_perplexity(llm, held, 320)
    assert list(learned) == [f"words past {dense}"]
    assert learned[f"words past {dense}"] == pytest.approx(expected_ppl(llm, text, 320, 160, dense), rel=1e-4)
    quality.force_selection(llm, "local")
    try:
        local = quality.long_perplexity(llm, held, 320)
    finally:
        quality.force_selection(llm, None)
    assert local[f"words past {dense}"] != pytest.approx(learned[f"words past {dense}"], rel=1e-6)


class _Answers:
    """An engine stand-in that answers each prompt with a given text, recording the max_tokens it was asked for."""

    def __init__(self, answers):
        self.answers, self.max_tokens = answers, []

    def generate(self, prompts, params, use_tqdm=False):
        from types import SimpleNamespace

        self.max_tokens += [p.max_tokens for p in params]
        return [SimpleNamespace(outputs=[SimpleNamespace(text=self.answers[p], finish_reason="stop")])
                for p in prompts]


def test_arithmetic_is_also_reported_by_thinking_mode():
    from nanoserve.presets.catalog import SHIPPED

    rows = quality.heldout_rows(SHIPPED["m3-mini"], None, 0, flag="--quality")
    off = next(r for r in rows if r["task"] == "arith" and r.get("thinking_mode") == "disabled")
    on = next(r for r in rows if r["task"] == "arith" and r.get("thinking_mode") == "enabled")
    chat = next(r for r in rows if r["task"] == "no_tool")
    answers = {off["prompt"]: f"It is {int(off['expected']['answer']) + 1}.",  # wrong, without a scratchpad
               on["prompt"]: f"digits ...</mm:think>It is {on['expected']['answer']}.",  # right, after thinking
               chat["prompt"]: "Hello."}
    llm = _Answers(answers)
    got = quality.run_tasks(llm, [off, on, chat])
    assert got["arith"] == [False, True]
    assert got["arith (thinking disabled)"] == [False]
    assert got["arith (thinking not disabled)"] == [True]
    assert llm.max_tokens[2] == quality.TASK_TOKENS["no_tool"] >= quality.TASK_TOKENS["arith"]


# -- the held-out requests' grader (nanoserve/bench/heldout) ----------------------------------------------------------
NS = "]<]minimax[>["


def call(name: str, **args) -> str:
    """M3's markup for one call, as the model writes it."""
    params = "".join(f"{NS}<{k}>{v}{NS}</{k}>" for k, v in args.items())
    return f'{NS}<tool_call>\n{NS}<invoke name="{name}">{params}{NS}</invoke>\n{NS}</tool_call>'


def heldout_row(task: str, **where) -> dict:
    from nanoserve.bench.heldout import load_requests

    rows = [r for r in load_requests() if r["task"] == task and all(r.get(k) == v for k, v in where.items())]
    assert rows, (task, where)
    return rows[0]


def graded(row: dict, text: str, finish: str = "stop", state: str = "none") -> dict[str, bool]:
    from nanoserve.bench.heldout.grade import grade, read_answer

    return grade(row, read_answer(row, text, finish, state))


def xml_value(v) -> str:
    return json.dumps(v) if isinstance(v, bool) else str(v)


def test_a_tool_call_is_right_only_with_the_right_tool_and_every_value():
    row = heldout_row("tool_call")
    exp = row["expected"]
    flat = {k: v for k, v in exp["arguments"].items() if not isinstance(v, (dict, list))}
    if flat != exp["arguments"]:  # nested arguments: take a request whose arguments are all scalars
        from nanoserve.bench.heldout import load_requests

        row = next(r for r in load_requests() if r["task"] == "tool_call" and all(
            not isinstance(v, (dict, list)) for v in r["expected"]["arguments"].values()))
        exp = row["expected"]
    args = {k: xml_value(v) for k, v in exp["arguments"].items()}
    assert graded(row, call(exp["name"], **args))["tool_call"]
    assert graded(row, "Sure. " + call(exp["name"], **args))["tool_call"]  # text before the call is fine
    assert graded(row, "</mm:think>" + call(exp["name"], **args), state="open")["tool_call"]
    other = next(t["function"]["name"] for t in row["tools"] if t["function"]["name"] != exp["name"])
    assert not graded(row, call(other, **args))["tool_call"]  # a distractor
    key = next(iter(args))
    assert not graded(row, call(exp["name"], **{**args, key: "wrong"}))["tool_call"]
    assert not graded(row, call(exp["name"], **{k: v for k, v in args.items() if k != key}))["tool_call"]
    assert not graded(row, f"I would call {exp['name']}.")["tool_call"]


def test_converted_values_nested_arguments_and_defaults():
    from nanoserve.bench.heldout.grade import arguments_match

    schema = {"properties": {"n": {"type": "integer"}, "tip": {"type": "integer", "default": 15},
                             "d": {"type": "object"}}}
    assert arguments_match({"n": 2, "d": {"value": 12, "unit": "mi"}}, {"n": 2, "d": {"value": 12.0, "unit": "mi"}},
                           schema)
    assert arguments_match({"n": 2, "tip": 15}, {"n": 2}, schema)  # the default, said or not
    assert not arguments_match({"n": 2, "tip": 20}, {"n": 2}, schema)
    assert not arguments_match({"n": 2, "d": {"value": 12, "unit": "km"}}, {"n": 2, "d": {"value": 12, "unit": "mi"}},
                               schema)
    assert not arguments_match({"n": True}, {"n": 1}, schema)  # a boolean is no number
    assert not arguments_match({"n": 2, "extra": 1}, {"n": 2}, schema)
    row = heldout_row("tool_call", app="fitness")
    from nanoserve.bench.heldout.grade import read_answer

    text = call("log_workout", activity="run", distance=f"{NS}<value>12{NS}</value>{NS}<unit>mi{NS}</unit>")
    ans = read_answer(row, text, "stop", "none")
    assert ans.calls == [("log_workout", {"activity": "run", "distance": {"value": 12, "unit": "mi"}})]


def test_no_call_tool_result_and_out_of_scope():
    row = heldout_row("no_call")
    assert graded(row, "Hello! How can I help?")["no_call"]
    assert not graded(row, "")["no_call"]
    name = row["tools"][0]["function"]["name"]
    assert not graded(row, call(name))["no_call"]
    row = heldout_row("tool_result")
    gold = row["expected"]["contains"]
    assert graded(row, "Done: " + ", ".join(gold) + ".")["tool_result"]
    assert not graded(row, "Done.")["tool_result"]
    assert not graded(row, ", ".join(gold) + call(row["tools"][0]["function"]["name"]))["tool_result"]
    row = heldout_row("out_of_scope")
    for reply in ("I don't know. I have no access to live data.", "I can\u2019t tell you that.",
                  "I'm not sure, I have no way to know that."):
        assert graded(row, reply)["out_of_scope"], reply
    for reply in ("It is 42.", "The answer is Paris.", "I don't know. " + "word " * 80):
        assert not graded(row, reply)["out_of_scope"], reply
    assert not graded(row, "I don't know", finish="length")["out_of_scope"]


def test_passages_arithmetic_and_retrieval():
    row = heldout_row("passage", source="stdlib_docs")
    gold = row["expected"]["gold"]
    assert graded(row, f"It says: {gold.upper()}.")["passage"]  # case and punctuation aside
    assert not graded(row, "It returns a value.")["passage"]
    row = heldout_row("passage", source="glossary")
    assert graded(row, f"That is {row['expected']['gold']}.")["passage"]
    assert not graded(row, "A kind of bird.")["passage"]
    row = heldout_row("arith", thinking_mode="disabled")
    ans = row["expected"]["answer"]
    assert graded(row, f"3 + 4 = 7, write 7.\nResult: {ans}.\nSo it is {ans}.")["arith"]
    assert not graded(row, f"It is {int(ans) + 1}.")["arith"]
    row = heldout_row("arith", thinking_mode="enabled")
    ans = row["expected"]["answer"]
    assert graded(row, f"scratch {int(ans) + 5}</mm:think>It is {ans}.", state="open")["arith"]
    assert not graded(row, f"scratch {ans}</mm:think>It is {int(ans) + 5}.", state="open")["arith"]  # thinking
    row = heldout_row("retrieval_8k")
    assert graded(row, f"The combination is {row['expected']['value']}.")["retrieval_8k"]
    assert not graded(row, "The combination is 000000.")["retrieval_8k"]


def test_well_formed_and_stray_calls():
    from nanoserve.bench.heldout.grade import stray_calls

    row = heldout_row("tool_call")
    name = row["expected"]["name"]
    key = next(iter(row["expected"]["arguments"]))
    assert graded(row, "Hi.")["well_formed"]
    assert not graded(row, "Hi.", finish="length")["well_formed"]
    assert not graded(row, "Hi. [e~[ more")["well_formed"]
    assert stray_calls(row, call(name, **{key: "x"})) == (1, 0)
    assert stray_calls(row, call("edit_game", **{key: "x"})) == (1, 1)  # a tool nobody offered
    assert stray_calls(row, call(name, town="x")) == (1, 1)  # a key the schema lacks
    assert stray_calls(row, call(name, **{key: "x"}) + call("merge_stock")) == (2, 1)
    assert stray_calls(row, "no call here") == (0, 0)


def test_target_table_and_row_selection():
    from nanoserve.bench.heldout.evaluate import HeldoutReport, select_rows, target_table

    rows = [{"task": "a"}] * 5 + [{"task": "retrieval_8k"}] * 5
    assert len(select_rows(rows, 2)) == 4 and len(select_rows(rows, 2, 1)) == 3 and len(select_rows(rows, None)) == 10
    report = HeldoutReport(accuracy={"tool_call": (0.9, 100), "no_call": (0.5, 10)},
                           stray={"constraint off": (3, 40)})
    table = target_table(report, {"fortunes": 40.0}, {"perplexity": {"fortunes": 41.0},
                                                      "accuracy": {"tool_call": {"value": 0.1}}}, True)
    lines = {line.split(" | ")[0].strip("| "): line for line in table.splitlines()}
    assert "90.0 %" in lines["tool calls exact (name and every argument)"] and "| yes |" in \
        lines["tool calls exact (name and every argument)"] and "10.0 %" in lines[
            "tool calls exact (name and every argument)"]
    assert "| no |" in lines["no call when none is needed"]
    assert "3 of 40 calls" in lines["the same without the constraint"]
    assert "| yes |" in lines["perplexity fortunes"]
    assert "n/a" in target_table(report, {}, None, False)


def test_heldout_answers_through_llm_chat(tiny_dir, monkeypatch):
    """The whole path on a real engine (m3-tiny, random weights, a few tokens an answer): requests grouped by their
    tools and thinking mode go through LLM.chat, each answer is parsed and graded, and the report counts every
    request."""
    from nanoserve.bench.heldout import evaluate as ev
    from nanoserve.bench.heldout import load_requests
    from nanoserve.bench.heldout.evaluate import evaluate, select_rows

    monkeypatch.setattr(ev, "TASK_TOKENS", {task: 6 for task in ev.TASK_TOKENS})

    rows = [r for r in select_rows(load_requests(), 1) if not r["task"].startswith("retrieval")]
    llm = LLM(model=tiny_dir, device="cpu", dtype="float32", optimizations=engine_opts(), max_model_len=2048,
              kv_cache_tokens=8192, seed=0, reasoning_parser="minimax_m3")
    try:
        report = evaluate(llm, rows, constraint_on=True)  # tool requests held to the auto call format, then not
    finally:
        llm.shutdown()
    assert {k: n for k, (_, n) in report.accuracy.items() if "(" not in k and k != "well_formed"} == \
        {t: 1 for t in ("tool_call", "no_call", "tool_result", "passage", "arith", "out_of_scope")}
    assert report.accuracy["well_formed"][1] == len(rows) == len(report.answers)
    assert report.stray["constraint on"][0] == 0 and set(report.stray) == {"constraint on", "constraint off"}
    assert report.accuracy["tool_call (constraint off)"][1] == 1


def test_picture_questions_are_frozen_images_with_their_answers():
    """heldout/pictures.jsonl.gz: every task of the picture set, each row a PNG the processor opens (112-224 px a
    side) with its question and answer."""
    import base64
    import io

    from PIL import Image

    from nanoserve.bench.heldout import PICTURES, read_jsonl

    rows = read_jsonl(PICTURES)
    assert {r["task"] for r in rows} == {"digits", "word", "count", "sum", "bars"} and len(rows) >= 100
    for r in rows[::9]:
        head, data = r["image"].split(",", 1)
        assert head == "data:image/png;base64"
        img = Image.open(io.BytesIO(base64.b64decode(data)))
        assert 112 <= min(img.size) and max(img.size) <= 224 and r["question"].endswith("?") and r["answer"]


def test_picture_questions_through_llm_chat(tiny_vl_dir):
    """A model with a vision tower (m3-tiny-vl, random weights) answers picture questions through LLM.chat: one
    row per task with its count, a record per question, and the grade is the first word or number."""
    from nanoserve.bench.heldout import PICTURES, read_jsonl
    from nanoserve.bench.heldout.evaluate import evaluate_pictures, first_word, select_rows

    rows = select_rows(read_jsonl(PICTURES), 1)
    llm = LLM(model=tiny_vl_dir, device="cpu", dtype="float32", optimizations=engine_opts(), max_model_len=2048,
              kv_cache_tokens=8192, seed=0, reasoning_parser="minimax_m3")
    try:
        accuracy, records = evaluate_pictures(llm, rows)
    finally:
        llm.shutdown()
    assert accuracy.keys() == {f"pictures ({t})" for t in ("digits", "word", "count", "sum", "bars")}
    assert all(n == 1 for _, n in accuracy.values()) and len(records) == 5
    assert all(r["ok"] == (first_word(r["content"]) == r["expected"].lower()) for r in records)
    assert first_word(" 4071, I think.") == "4071" and first_word("Garden!") == "garden" and first_word("...") is None
