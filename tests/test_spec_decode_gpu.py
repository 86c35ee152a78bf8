"""Speculative decoding on the GPU (marked `gpu`): the Triton kernels, CUDA graphs for the steps without a verify
query, pinned host copies and device-side acceptance, on m3-tiny in fp32.

Greedy output with speculation must equal greedy output without it, for the ngram, MTP and EAGLE-3 drafters, and
every block must come back. A verify query runs through the prefill kernels and a one-token decode through the decode
kernels (or a replayed graph); in fp32 the two agree closely enough that m3-tiny's greedy tokens are the same.
"""

from __future__ import annotations

import pytest

from nanoserve import LLM, SamplingParams
from tests.engine_utils import assert_all_blocks_free
from tests.test_spec_decode import mtp_tensors, repetitive_prompts, tokens_of, write_eagle3_dir

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
ENGINE = dict(device="cuda", dtype="float32", max_model_len=256, gpu_memory_utilization=0.3)


@pytest.fixture(scope="module")
def gpu_mtp_dir(tiny_dir, tmp_path_factory) -> str:
    import shutil

    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("m3-tiny-mtp-gpu")
    shutil.copytree(tiny_dir, path, dirs_exist_ok=True)
    save_file(mtp_tensors(tiny_dir), str(path / "mtp.safetensors"), metadata={"format": "pt"})
    return str(path)


def generate(model: str, **kwargs) -> tuple[list[list[int]], dict]:
    with LLM(model, **ENGINE, **kwargs) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in repetitive_prompts()], GREEDY, use_tqdm=False)
        stats = llm.engine.stats
        assert_all_blocks_free(llm)
        return tokens_of(outs), {"drafts": stats.spec_decode_num_drafts,
                                 "accepted": stats.spec_decode_num_accepted_tokens}


def test_every_drafter_keeps_greedy_output_on_the_gpu(gpu_mtp_dir, tmp_path):
    want, _ = generate(gpu_mtp_dir)
    got, stats = generate(gpu_mtp_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                           "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    assert got == want and stats["accepted"] > 0, stats
    got, stats = generate(gpu_mtp_dir, speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    assert got == want and stats["drafts"] > 0, stats
    write_eagle3_dir(tmp_path / "eagle3")
    got, stats = generate(gpu_mtp_dir, speculative_config={"method": "eagle3", "model": str(tmp_path / "eagle3"),
                                                           "num_speculative_tokens": 3})
    assert got == want and stats["drafts"] > 0, stats
