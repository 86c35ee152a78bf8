"""The engine's outputs against a recording of the code before its inner structure changed
(tests/helpers/golden_outputs.py): the three step modes on a batch that preempts and chunks, structured outputs with
and without overlap_grammar, prompt logprobs, each drafter of speculative decoding (ngram, MTP, EAGLE-3) and the
trained m3-mini's chats. Token ids, text, finish and stop reasons must be equal (but for one change made on purpose:
`held_back_tail`); logprobs within LOGPROB_ATOL (fp32). The speculative cases also keep their acceptance counters
(verify steps, draft tokens, accepted ones)."""

from __future__ import annotations

import json

import pytest

from tests.helpers.golden_outputs import LOGPROB_ATOL, PATH, cases, run_case, spec_dirs

RECORDED = json.loads(PATH.read_text())


@pytest.fixture(scope="module")
def all_cases(tmp_path_factory):
    mtp, eagle = spec_dirs(tmp_path_factory.mktemp("golden"))
    return cases(mtp, eagle)


def assert_close(got, want, where: str) -> None:
    """Equal structure and values; floats within LOGPROB_ATOL."""
    if isinstance(want, float) or isinstance(got, float):
        assert got == pytest.approx(want, abs=LOGPROB_ATOL), where
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            assert_close(a, b, f"{where}[{i}]")
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), where
        for key in want:
            assert_close(got[key], want[key], f"{where}.{key}")
    else:
        assert got == want, where


def held_back_tail(got: dict, recorded: dict) -> bool:
    """The one change made on purpose since the recording: a sequence that ends by length inside a character ends
    with the tail its tokens held back, U+FFFD, as vLLM flushes it (engine/detokenizer.py `flush`)."""
    tail = got["text"][len(recorded["text"]):]
    return got["finish_reason"] == "length" and got["text"].startswith(recorded["text"]) and bool(tail) and \
        set(tail) == {"\ufffd"}


def test_every_recorded_case_is_still_run(all_cases):
    assert sorted(all_cases) == sorted(RECORDED)


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_outputs_equal_the_recording(name, all_cases):
    got = run_case(all_cases[name])
    want = RECORDED[name]
    for i, (g, w) in enumerate(zip(got["outputs"], want["outputs"], strict=True)):
        for j, (a, b) in enumerate(zip(g["completions"], w["completions"], strict=True)):
            where = f"{name} request {i} completion {j}"
            for key in ("token_ids", "finish_reason", "stop_reason"):
                assert a[key] == b[key], f"{where}: {key}"
            assert a["text"] == b["text"] or held_back_tail(a, b), f"{where}: text"
            assert_close(a["cumulative_logprob"], b["cumulative_logprob"], f"{where}: cumulative_logprob")
            assert_close(a["logprobs"], b["logprobs"], f"{where}: logprobs")
        assert_close(g["prompt_logprobs"], w["prompt_logprobs"], f"{name} request {i}: prompt_logprobs")
    assert got.get("acceptance") == want.get("acceptance")
