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
