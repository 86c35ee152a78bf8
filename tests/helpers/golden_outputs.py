"""Recorded outputs of the engine on the CPU: what every step mode, structured outputs, prompt logprobs and each
drafter produced, kept as data (tests/golden_outputs.json) so that a change to the engine's inner structure is
checked against the outputs of the code before it - token for token, text for text, logprobs to LOGPROB_ATOL.

    python -m tests.helpers.golden_outputs --write    record the current code's outputs (only when they are meant
                                                      to change)

Each case is one engine built from a small dict of arguments and a list of requests; `run_case` returns, per
request, its final output as plain JSON data. tests/engine/test_golden_outputs.py runs every case again and
compares.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path
from typing import Any

from nanoserve import LLM, SamplingParams
from nanoserve.sampling import StructuredOutputsParams
from tests.helpers.engine_utils import assert_all_blocks_free, engine_opts, random_tokens

PATH = Path(__file__).resolve().parent / "golden_outputs.json"
LOGPROB_ATOL = 1e-4  # fp32 on the CPU: the same logits, possibly reduced in another order
MAX_MODEL_LEN = 256

MODES = {"sync": dict(overlap_scheduling=False, async_scheduling=False),
         "overlap": dict(overlap_scheduling=True, async_scheduling=False),
         "async": dict(overlap_scheduling=True, async_scheduling=True)}


def mixed_requests() -> list[tuple[list[int], SamplingParams]]:
    """Shared prefixes, one long prompt, greedy rows with and without logprobs, seeded sampled rows, a stop
    string and a stop token: with a small pool and budget they preempt and chunk."""
    rng = random.Random(1234)
    prefix = random_tokens(rng, 70)
    prompts = [prefix + random_tokens(rng, n) for n in (5, 17, 30, 1)] + \
        [random_tokens(rng, n) for n in (12, 45, 150, 90)]
    params = []
    for i, m in enumerate((20, 6, 12, 16, 10, 20, 4, 14)):
        if i % 4 == 3:  # seeded sampling with every filter and logprobs
            params.append(SamplingParams(temperature=0.9, top_p=0.9, top_k=40, min_p=0.01, seed=100 + i,
                                         max_tokens=m, ignore_eos=True, logprobs=2))
        else:
            params.append(SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True,
                                         logprobs=3 if i % 2 else None))
    return list(zip(prompts, params))


def repetitive_prompts() -> list[list[int]]:
    """Prompts whose greedy continuation (m3-tiny's random weights) repeats: drafts are accepted often."""
    rng = random.Random(7)
    motif = [rng.randrange(9, 512) for _ in range(12)]
    return [motif * 4, [rng.randrange(9, 512) for _ in range(40)], motif[:5] * 6 + [rng.randrange(9, 512)],
            [rng.randrange(9, 512) for _ in range(90)]]


def spec_requests() -> list[tuple[list[int], SamplingParams]]:
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    out = [(p, greedy) for p in repetitive_prompts()]
    out.append((repetitive_prompts()[0], SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True,
                                                          logprobs=2)))
    return out


def grammar_requests() -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(99)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 6}},
              "required": ["a", "b"]}
    specs = [StructuredOutputsParams(json=schema), StructuredOutputsParams(regex=r"[a-c]{3,8}x"),
             StructuredOutputsParams(choice=["yes", "no", "maybe"]), None]
    return [(random_tokens(rng, 20 + 7 * i), SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=s))
            for i, s in enumerate(specs)]


def prompt_logprob_requests() -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(5)
    return [(random_tokens(rng, 40), SamplingParams(temperature=0.0, max_tokens=5, prompt_logprobs=2, logprobs=1)),
            (random_tokens(rng, 90), SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=0)),
            (random_tokens(rng, 30), SamplingParams(temperature=0.0, max_tokens=6))]


CHATS = ["Hello! Who are you?", "What is 48 + 37?", "What's the weather like in Paris?"]


def cases(mtp_dir: str | None, eagle_dir: str | None) -> dict[str, dict[str, Any]]:
    """name -> engine arguments (`opts`: switches over engine_opts(); the rest LLM's) and the requests."""
    small = dict(num_gpu_blocks_override=24, max_num_batched_tokens=64, max_model_len=192)
    out: dict[str, dict[str, Any]] = {}
    for mode, switches in MODES.items():
        out[f"mixed-{mode}"] = dict(model="m3-tiny", opts=switches, llm=small, requests=mixed_requests)
        out[f"grammar-{mode}"] = dict(model="m3-tiny", opts=switches, llm=dict(max_model_len=MAX_MODEL_LEN),
                                      requests=grammar_requests)
    out["grammar-no-overlap-grammar"] = dict(model="m3-tiny", opts=dict(overlap_grammar=False),
                                             llm=dict(max_model_len=MAX_MODEL_LEN), requests=grammar_requests)
    out["prompt-logprobs"] = dict(model="m3-tiny", opts={}, llm=dict(max_model_len=MAX_MODEL_LEN,
                                                                     max_num_batched_tokens=32),
                                  requests=prompt_logprob_requests)
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    out["spec-ngram"] = dict(model="m3-tiny", opts={}, llm=dict(max_model_len=MAX_MODEL_LEN,
                                                                speculative_config=ngram), requests=spec_requests)
    out["spec-ngram-small-budget"] = dict(model="m3-tiny", opts={}, llm=dict(
        max_model_len=MAX_MODEL_LEN, speculative_config=ngram, max_num_batched_tokens=18), requests=spec_requests)
    if mtp_dir is not None:
        out["spec-mtp"] = dict(model=mtp_dir, opts={}, llm=dict(
            max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=18,
            speculative_config={"method": "mtp", "num_speculative_tokens": 3}), requests=spec_requests)
    if eagle_dir is not None:
        out["spec-eagle3"] = dict(model="m3-tiny", opts={}, llm=dict(
            max_model_len=MAX_MODEL_LEN,
            speculative_config={"method": "eagle3", "model": eagle_dir, "num_speculative_tokens": 3}),
            requests=spec_requests)
    out["m3-mini-chat"] = dict(model="m3-mini", opts={}, llm=dict(max_model_len=1024), chats=CHATS)
    return out


def completion(c) -> dict[str, Any]:
    return {"token_ids": list(c.token_ids), "text": c.text, "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason, "cumulative_logprob": c.cumulative_logprob,
            "logprobs": None if c.logprobs is None else [[[t, v] for t, v in d.items()] for d in c.logprobs]}


def prompt_logprobs(entries) -> list | None:
    if entries is None:
        return None
    return [None if d is None else [[t, lp.logprob, lp.rank] for t, lp in d.items()] for d in entries]


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    """Run one case on a fresh engine; its outputs (and, with speculation, the acceptance counters)."""
    opts = engine_opts(**case["opts"])
    with LLM(case["model"], optimizations=opts, **case["llm"]) as llm:
        if "chats" in case:
            params = SamplingParams(temperature=0.0, max_tokens=64)
            outs = [llm.chat([{"role": "user", "content": text}], params, use_tqdm=False)[0] for text in case["chats"]]
        else:
            requests = case["requests"]()
            outs = llm.generate([{"prompt_token_ids": p} for p, _ in requests], [sp for _, sp in requests],
                                use_tqdm=False)
        result: dict[str, Any] = {"outputs": [{"completions": [completion(c) for c in o.outputs],
                                               "prompt_logprobs": prompt_logprobs(o.prompt_logprobs)} for o in outs]}
        stats = llm.engine.stats
        if stats.spec_decode_num_drafts:
            result["acceptance"] = [stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens,
                                    stats.spec_decode_num_accepted_tokens]
        assert_all_blocks_free(llm)
    return result


def spec_dirs(root: Path) -> tuple[str, str]:
    """An m3-tiny checkpoint with a random MTP module, and a random EAGLE-3 draft for m3-tiny (as the speculative
    decoding tests write them)."""
    import shutil

    from safetensors.torch import save_file

    from nanoserve.presets.catalog import get_preset
    from nanoserve.presets.make_checkpoint import write_checkpoint
    from tests.engine.test_spec_decode import mtp_tensors, write_eagle3_dir

    tiny = root / "m3-tiny"
    preset = get_preset("m3-tiny")
    write_checkpoint(str(tiny), preset.config, preset)
    mtp = root / "m3-tiny-mtp"
    shutil.copytree(tiny, mtp)
    save_file(mtp_tensors(str(tiny)), str(mtp / "mtp.safetensors"), metadata={"format": "pt"})
    eagle = root / "eagle3"
    write_eagle3_dir(eagle)
    return str(mtp), str(eagle)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="record the outputs into tests/golden_outputs.json")
    args = parser.parse_args()
    import os

    import torch

    os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("NANOSERVE_CACHE", str(Path(tmp) / "cache"))
        mtp, eagle = spec_dirs(Path(tmp))
        recorded = {name: run_case(case) for name, case in cases(mtp, eagle).items()}
    if args.write:
        PATH.write_text(json.dumps(recorded, indent=None, separators=(",", ":")) + "\n")
        print(f"wrote {len(recorded)} cases to {PATH}")
    else:
        print(json.dumps({k: len(v["outputs"]) for k, v in recorded.items()}))


if __name__ == "__main__":
    main()
