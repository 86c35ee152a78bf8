"""How far MXFP8 weights served natively are from the same weights dequantised, and from the unquantised model:
log-probabilities of every position of a few prompts, over the whole vocabulary.

    python -m nanoserve.bench --mxfp8-accuracy                       # m3-slice on a GPU, two 1024-token prompts
    python -m nanoserve.bench --mxfp8-accuracy --model m3-tiny --device cpu --no-cpu-reference-kernels --dtype float16

The same weights are built up to three times, one model resident at a time:

- native: the MXFP8 weights kept as fp8 + scales (`mxfp8_weights` on), run by the kernels the switches select;
- dequantised: the same MXFP8 weights dequantised to the model dtype at load (`mxfp8_weights` off), the reference
  path. Both compute the same model: any difference is the kernels' arithmetic (summation order, the rounding of
  16-bit outputs). No activation is quantised on either path;
- unquantised (a bf16 checkpoint or preset only, quantised to MXFP8 for the other two): the original weights,
  which shows what quantising the weights changed.

Each runs one prefill over each prompt (every position's logits, the LM head in the model dtype, log-softmax in
fp32). Reported per pair: max and mean |difference| of the log-probabilities over all positions x vocabulary,
the max |difference| at the reference's top-1 token, and how often the two top-1 tokens agree.
"""

from __future__ import annotations

import gc
import time

import torch

from nanoserve.bench.report import table
from nanoserve.config import Optimizations

PAIRS = (("native", "dequantised"), ("dequantised", "unquantised"))
"""(compared, reference) pairs of the report."""


def prompt_logprobs(model, prompts: list[list[int]], device: torch.device) -> torch.Tensor:
    """fp32 log-probabilities [sum of prompt lengths, vocab] of one prefill per prompt (a KV pool of its own)."""
    from nanoserve.batch import AttentionMetadata
    from nanoserve.runner.kv_cache import allocate_kv_caches

    bs = model.cfg.index_block_size
    out = []
    for ids in prompts:
        n_blocks = -(-len(ids) // bs)
        kv, index = allocate_kv_caches(model.cfg, n_blocks, bs, model.dtype, device)
        model.bind_kv_caches(kv, index)
        meta = AttentionMetadata.build([len(ids)], [len(ids)], [list(range(n_blocks))], bs, device)
        with torch.inference_mode():
            hidden = model(torch.tensor(ids, device=device), meta.positions, meta)
            out.append(torch.log_softmax(model.compute_logits(hidden), -1))
    return torch.cat(out)


def compare(got: torch.Tensor, want: torch.Tensor) -> dict:
    """The agreement of two [positions, vocab] log-probability tensors (`want` the reference)."""
    d = (got - want).abs()
    top = want.argmax(-1)
    return {"max_abs_logprob_diff": d.max().item(), "mean_abs_logprob_diff": d.mean().item(),
            "max_abs_diff_at_reference_top1": d.gather(1, top[:, None]).max().item(),
            "top1_agreement": (got.argmax(-1) == top).float().mean().item(), "positions": int(top.numel())}


def mxfp8_accuracy(model: str, opts: Optimizations, dtype: torch.dtype, device: torch.device,
                   prompt_len: int = 1024, num_prompts: int = 2, seed: int = 5, unquantised: bool = True) -> dict:
    """Build `model` (a preset or checkpoint directory) natively in MXFP8, dequantised, and (a bf16 one, unless
    `unquantised` is False) unquantised, run the same random prompts through each, and compare (module
    docstring)."""
    from nanoserve.model.loader import checkpoint_quantization
    from nanoserve.presets.catalog import PRESETS
    from nanoserve.presets.resolve import load_model_or_preset, resolve_model_dir

    if prompt_len < 1 or num_prompts < 1:
        raise ValueError(f"prompt_len={prompt_len} and num_prompts={num_prompts} must be at least 1")
    stored = None if model in PRESETS else checkpoint_quantization(resolve_model_dir(model))
    builds = {"native": (opts.replace(mxfp8_weights=True), "mxfp8"),
              "dequantised": (opts.replace(mxfp8_weights=False), "mxfp8")}
    if stored != "mxfp8" and unquantised:
        builds["unquantised"] = (opts, None)
    gen = torch.Generator().manual_seed(seed)
    prompts = None
    logprobs: dict[str, torch.Tensor] = {}
    res: dict = {"model": model, "dtype": str(dtype).removeprefix("torch."), "prompt_len": prompt_len,
                 "num_prompts": num_prompts, "builds": {}, "pairs": {}}
    for label, (build_opts, quant) in builds.items():
        t0 = time.perf_counter()
        m, _ = load_model_or_preset(model, build_opts, dtype, device, quant)
        if prompts is None:  # the same token ids for every build
            prompts = [torch.randint(0, m.cfg.vocab_size, (prompt_len,), generator=gen).tolist()
                       for _ in range(num_prompts)]
        logprobs[label] = prompt_logprobs(m, prompts, device)
        res["builds"][label] = {"weight_format": m.weight_format or str(m.dtype).removeprefix("torch."),
                                "seconds": time.perf_counter() - t0}
        del m
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for got, want in PAIRS:
        if got in logprobs and want in logprobs:
            res["pairs"][f"{got} vs {want}"] = compare(logprobs[got], logprobs[want])
    res["table"] = accuracy_table(res)
    return res


def accuracy_table(res: dict) -> str:
    rows = [[name, r["positions"], f"{r['max_abs_logprob_diff']:.3e}", f"{r['mean_abs_logprob_diff']:.3e}",
             f"{r['max_abs_diff_at_reference_top1']:.3e}", f"{100 * r['top1_agreement']:.2f} %"]
            for name, r in res["pairs"].items()]
    weights = ", ".join(f"{k}: {v['weight_format']}" for k, v in res["builds"].items())
    title = (f"MXFP8 accuracy: {res['model']}, {res['dtype']}, {res['num_prompts']} x {res['prompt_len']}-token "
             f"prompts, full vocabulary ({weights})")
    return table(("compared", "positions", "max |d logprob|", "mean |d logprob|", "max |d| at top-1", "top-1 agree"),
                 rows, title)
