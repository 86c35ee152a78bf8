"""The vision tower's throughput on a GPU (marked gpu): M3's real-width 32-layer tower with random bf16 weights,
a batch of 16 images of 1344 x 1344 pixels encoded in one call, with the Triton kernels and with the reference path,
in TFLOP/s and as a share of the card's bf16 dense peak. Two grids per image: the raw 1344 x 1344 (96 x 96 patches,
9,216 per image) and what the processor makes of such an image by default (resized to 672 x 672: 48 x 48 patches).
The attention kernel's alternative tiles are timed at the first grid too. Run on a GPU:

    python -m pytest tests/model/test_vision_throughput.py -m gpu -q -s
    python -m tests.model.test_vision_throughput          # the same, without pytest

Writes $OUT/vision_throughput.json when OUT is set; prints a table last.

FLOPs count the multiply-adds of every GEMM and of attention (2 per multiply-add): per patch, the patch embedding
2 x 1176 x 1280, per layer 2 x 1280 x (3 x 1280 + 1280 + 2 x 5120) and, per segment of n patches, 4 x n^2 x 1280 for
q k^T and p v; the projector 2 x (1280 x 6144 + 6144 x 6144) per patch and the merger 2 x (24576 x 6144 + 6144 x
6144) per 4 patches. Norms, RoPE, GELU and the softmax are not counted.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from nanoserve.config import Optimizations
from nanoserve.kernels.configs import Tiles
from nanoserve.model.vision.config import VisionConfig
from nanoserve.model.vision.model import M3VisionModel

BATCH = 16
GRIDS = {"1344x1344 raw (96x96 patches)": (1, 96, 96), "1344x1344 via the processor (48x48 patches)": (1, 48, 48)}
PEAK_BF16 = {"H100": 989.4e12, "H200": 989.4e12, "H20": 148e12, "A100": 312e12, "MI300X": 1307.4e12,
             "MI325X": 1307.4e12, "MI355X": 2516.6e12, "B200": 2250e12}
"""Dense bf16 tensor-core peaks (FLOP/s) by card family, from the vendors' data sheets (no sparsity)."""
ATTENTION_TILES = [Tiles(128, 64, 8, 3), Tiles(64, 64, 4, 3), Tiles(64, 32, 4, 3), Tiles(128, 32, 8, 3),
                   Tiles(128, 128, 8, 2)]
"""The default (first) and the alternatives that compile for sm_90 without spilling registers."""


def tower_flops(cfg: VisionConfig, grids: list[tuple[int, int, int]]) -> float:
    n = sum(t * h * w for t, h, w in grids)
    d, i, p, text = cfg.hidden_size, cfg.intermediate_size, cfg.projector_hidden_size, cfg.text_hidden_size
    per_patch = 2 * cfg.patch_dim * d + cfg.num_hidden_layers * 2 * d * (4 * d + 2 * i) + 2 * (d * p + p * text)
    merger = n // cfg.merge_unit * 2 * (cfg.merge_unit * text * p + p * text)
    attention = cfg.num_hidden_layers * sum(4 * (t * h * w) ** 2 * d for t, h, w in grids)
    return n * per_patch + merger + attention


def peak(name: str) -> float | None:
    return next((v for k, v in sorted(PEAK_BF16.items(), key=lambda kv: -len(kv[0])) if k in name), None)


def timed(fn, repeat: int = 3) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def run() -> list[dict]:
    from nanoserve.kernels import vision_attention as va

    card = torch.cuda.get_device_name()
    cfg = VisionConfig()
    model = M3VisionModel(cfg, Optimizations(), torch.bfloat16, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, p in model.named_parameters():
        p.copy_(torch.randn(p.shape, generator=gen, device="cuda") * (0.02 if p.dim() > 1 else 0.1)
                + (1.0 if "norm" in name and name.endswith("weight") else 0.0))
    rows = []
    for label, grid in GRIDS.items():
        grids = [grid] * BATCH
        n = BATCH * grid[0] * grid[1] * grid[2]
        pix = torch.randn(n, cfg.patch_dim, device="cuda", generator=gen)
        flops = tower_flops(cfg, grids)
        outputs = {}
        for path, opts in (("kernels", Optimizations()), ("reference", Optimizations.reference())):
            model.opts = opts
            for m in model.modules():
                if hasattr(m, "opts"):
                    m.opts = opts
            seconds = timed(lambda: outputs.__setitem__(path, model(pix, grids)))
            rows.append({"card": card, "grid": label, "path": path, "batch": BATCH, "patches": n,
                         "seconds": seconds, "tflops": flops / seconds / 1e12,
                         "roof_share": (flops / seconds / peak(card)) if peak(card) else None, "flops": flops})
        diff = (outputs["kernels"].float() - outputs["reference"].float()).abs()
        rows[-1]["kernels_vs_reference_mean_abs"] = diff.mean().item()
        rows[-1]["reference_mean_abs"] = outputs["reference"].float().abs().mean().item()
        assert torch.isfinite(outputs["kernels"]).all()
    # the attention kernel alone, one layer's worth at the raw grid, per tile choice
    grid = GRIDS["1344x1344 raw (96x96 patches)"]
    segs = [grid] * BATCH
    seg_len = grid[1] * grid[2]
    qkv = torch.randn(3, cfg.num_attention_heads, BATCH * seg_len, cfg.head_dim, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(0, BATCH + 1, device="cuda", dtype=torch.int32) * seg_len
    attn_flops = 4 * seg_len ** 2 * cfg.hidden_size * len(segs)
    for tiles in ATTENTION_TILES:
        label = f"tiles {tiles.block_m}x{tiles.block_n}, {tiles.num_warps} warps, {tiles.num_stages} stages"
        try:
            seconds = timed(lambda: va.varlen_attention(qkv, cu, seg_len, cfg.head_dim ** -0.5, tiles))
        except Exception as e:  # a tile that does not compile or fit on this card
            rows.append({"card": card, "grid": "attention only", "path": label, "error": repr(e)[:200]})
            continue
        rows.append({"card": card, "grid": "attention only (one layer, raw grid)", "path": label,
                     "seconds": seconds, "tflops": attn_flops / seconds / 1e12,
                     "roof_share": (attn_flops / seconds / peak(card)) if peak(card) else None})
    return rows


def report(rows: list[dict]) -> str:
    lines = [f"{'what':<46} {'path':<36} {'ms':>9} {'TFLOP/s':>8} {'of peak':>8}"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['grid']:<46} {r['path']:<36} {r['error']}")
            continue
        share = f"{100 * r['roof_share']:.1f}%" if r.get("roof_share") else "-"
        lines.append(f"{r['grid']:<46} {r['path']:<36} {1e3 * r['seconds']:>9.2f} {r['tflops']:>8.1f} {share:>8}")
    return "\n".join(lines)


def save(rows: list[dict]) -> None:
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "vision_throughput.json"), "w") as f:
            json.dump({"rows": rows, "torch": torch.__version__}, f, indent=2)


@pytest.mark.gpu
def test_tower_throughput():
    rows = run()
    save(rows)
    print("\n" + report(rows))
    kernels = [r for r in rows if r.get("path") == "kernels"]
    # bf16 through 32 random layers: the features' mean magnitude is about 9.5, and the bf16 reference path alone is
    # 1.5 % (mean |diff| / mean |ref|) from the fp32 one (measured on the CPU at 2 x 24 x 24 patches), so the kernels
    # may differ from the bf16 reference by that much again: 3 %
    assert all(r["kernels_vs_reference_mean_abs"] < 0.03 * r["reference_mean_abs"]
               for r in rows if "kernels_vs_reference_mean_abs" in r)
    assert kernels and all(r["tflops"] > 0 for r in kernels)


def test_flop_count():
    """The count the throughput is quoted in, for one 1344 x 1344 raw image (the formula in the docstring)."""
    cfg = VisionConfig()
    n = 96 * 96
    layer = 2 * n * 1280 * (4 * 1280 + 2 * 5120) + 4 * n * n * 1280
    expected = 2 * n * 1176 * 1280 + 32 * layer + 2 * n * (1280 * 6144 + 6144 * 6144) \
        + 2 * (n // 4) * (24576 * 6144 + 6144 * 6144)
    assert tower_flops(cfg, [(1, 96, 96)]) == expected
    assert round(expected / 1e12, 2) == 27.25  # TFLOP per image (25.5 of them in the 32 layers); x 16 per batch


if __name__ == "__main__":
    rows = run()
    save(rows)
    print(report(rows))
