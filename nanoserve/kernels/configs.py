"""Tile configurations for the attention kernels (kernels/attention.py, kernels/msa.py, kernels/norm_rope.py), the
one-row GEMV (kernels/gemv.py) and the fused MoE (kernels/moe.py).

One table per kernel, keyed by backend:

- "cuda": chosen for an H200 (Hopper, 132 SMs, 4.26 TB/s measured copy ceiling) at m3-slice shapes with
  `scripts/gpu_attention_bench.py --sweep` (in git at 8277a9c; torch 2.11, Triton 3.6; today `python -m nanoserve.bench
  --micro attention` times the same decode and prefill cases with these tiles, without the sweep), and checked for
  register spills with Triton 3.6's sm_90 compiler. Decode kernels stream the KV cache: many programs, a few pipeline
  stages (dense decode at 128k: BLOCK_N 32-64 with 2-4 warps all within 3%; 8 warps or 128-key tiles were slower).
  Prefill tiles are the usual flash-attention shapes for head_dim 128. Sparse prefill: 8 query tokens per program (128
  rows, 8 warps) ran 1.6-1.8x faster than 1-4 tokens, with random and with smoothly varying index queries.
- "hip": the same kernels on AMD Instinct (MI300X = gfx942, MI355X = gfx950). No entry has run on an AMD card:
  each follows one rule, and the compile gate (tests/compile_gate.py, docs/rocm.md) compiles every launch of the
  engine for gfx942 and gfx950 and fails on a compile error, LDS over budget or a register spill. The rule (for
  the tables here and in fp8_configs.py):
  1. wave-64: `num_warps` counts 64-lane wavefronts (4 waves = 256 lanes: as many threads as 8 CUDA warps);
  2. every tl.dot has M, N, K >= 16 (the MFMA 16x16 minimum), MXFP8 tiles a BLOCK_K multiple of 32; a product of
     a single row (decode GEMV, one token through the MoE) takes the MXFP8 "gemv" variant on the vector ALUs
     instead (a one-row MFMA is 15/16 padding);
  3. at most 32 KiB of LDS per workgroup on gfx942, so two fit in its 64 KiB (Triton's async copies on gfx950 use
     about twice that for the same tile; its 160 KiB still holds two);
  4. occupancy >= 2 waves per SIMD where the tile allows (<= 256 vector + accumulation registers per lane);
  5. at most 2 pipeline stages (the AMD stream pipeliner's useful range);
  6. no TMA descriptors (they lower to plain loads on AMD, where the CUDA TMA tiles spill vector registers) and no
     "scaled" MXFP8 variant (with bf16 activations tl.dot_scaled is decomposed on both chips, and its CUDA tiles
     need 97-196 KiB of LDS); "acc" only on 16-row tiles (at 32 rows its per-block scaling of the accumulator
     takes over 256 registers);
  7. decode (memory-bound): many programs - narrow BLOCK_N, long BLOCK_K within the LDS budget; prefill
     (compute-bound): 64- to 128-row tiles within the budget.
  The dense prefill tile is 128 x 32 (it was 128 x 64: 308 registers, one wave per SIMD on gfx942).
- "interpret": the CPU interpreter used by the tests. No autotuning anywhere: the interpreter runs a program per
  grid cell in Python, so a few large-ish tiles are what keep it quick; warps and stages are ignored there.

Prefill kernels have a second entry, `<kernel>_long`, for steps whose longest sequence reaches
LONG_PREFILL_CONTEXT tokens (a chunk of a long prompt attends to far more keys than it has queries, and the best
tile moves with that ratio): `prefill_kernel` picks the name.

Tiles that depend on the problem (the query-head group of a decode program, the padded head dim, a tile holding a
whole KV block) are derived in the kernel wrappers; these tables hold only the free choices.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Tiles:
    """One launch configuration: a kernel's two free tile sizes (what each means is noted at its table entry;
    0 = derived from the problem by the wrapper), warps (wavefronts on AMD) and software-pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: bool = False
    """Dense prefill only: load K/V tiles through TMA tensor descriptors (attention._kv_descriptors)."""


TABLES: dict[str, dict[str, Tiles]] = {
    # Dense decode, one program per (sequence, KV head, split); block_m is derived (the GQA group, >= 16).
    "paged_decode": {"cuda": Tiles(0, 64, 4, 3), "hip": Tiles(0, 64, 4, 2), "interpret": Tiles(0, 32, 1, 1)},
    # Dense prefill, one program per (sequence, query tile, query head).
    "paged_prefill": {"cuda": Tiles(128, 64, 8, 3), "hip": Tiles(128, 32, 4, 2), "interpret": Tiles(32, 32, 1, 1)},
    # The same over an fp8 KV pool (kv_cache_dtype fp8) at every context length: K is widened in registers, so
    # the long-context TMA tile needs 255 registers and spills on sm_90 (Triton 3.9), and AMD's 4-wave tile drops
    # to one wave per SIMD (302 registers on gfx942); 8 waves keep two (178 registers; gfx950 three). Compile gate.
    "paged_prefill_fp8": {"cuda": Tiles(128, 64, 8, 3), "hip": Tiles(128, 32, 8, 2), "interpret": Tiles(32, 32, 1, 1)},
    # Merge of flash-decoding splits, one program per (token, query head); block_n = splits read per step.
    "split_combine": {"cuda": Tiles(0, 16, 4, 2), "hip": Tiles(0, 16, 4, 2), "interpret": Tiles(0, 64, 1, 1)},
    # MSA indexer scores; block_n is derived (one whole KV block per step). block_m = (token, index head) rows.
    "msa_score_prefill": {"cuda": Tiles(128, 0, 8, 3), "hip": Tiles(64, 0, 4, 2), "interpret": Tiles(64, 0, 1, 1)},
    "msa_score_decode": {"cuda": Tiles(16, 0, 4, 3), "hip": Tiles(16, 0, 4, 2), "interpret": Tiles(16, 0, 1, 1)},
    # Block top-k over (token, KV group) rows: block_n = block scores of a row held per pass (longer rows loop),
    # block_m = scores a program holds in all (rows per program = block_m // block_n).
    "msa_topk": {"cuda": Tiles(4096, 2048, 8, 1), "hip": Tiles(4096, 2048, 4, 1),
                 "interpret": Tiles(16384, 256, 1, 1)},
    # Block-sparse attention, one program per (block_m query tokens x the GQA group, KV group, split);
    # block_n = keys per tile of a KV block. Decode: one token, split-K over its selected blocks.
    "sparse_decode": {"cuda": Tiles(1, 64, 4, 3), "hip": Tiles(1, 64, 4, 2), "interpret": Tiles(1, 64, 1, 1)},
    # The same over an fp8 KV pool: with K and V widened in registers the split-K tile spills 16 bytes per thread
    # on sm_90 at 3 stages (Triton 3.9) and none at 1 (compile gate).
    "sparse_decode_fp8": {"cuda": Tiles(1, 64, 4, 1), "hip": Tiles(1, 64, 4, 2), "interpret": Tiles(1, 64, 1, 1)},
    "sparse_prefill": {"cuda": Tiles(8, 64, 8, 3), "hip": Tiles(4, 64, 4, 2), "interpret": Tiles(16, 64, 1, 1)},
    # Block-sparse prefill grouped by KV block (switch msa_sparse_by_block), one program per tile of (token, KV
    # group, slot) pairs that selected one block: block_m = pairs (tokens) per tile, times the GQA group as rows;
    # block_n = keys per tile of the KV block. cuda: the long-context choice (below); at a 16,384-token context it
    # ran 5.04 / 4.97 ms (random / drifting index queries) against the 8-token sparse_prefill tile's 8.46 / 2.85.
    "sparse_by_block": {"cuda": Tiles(4, 64, 4, 3), "hip": Tiles(4, 64, 4, 2), "interpret": Tiles(4, 64, 1, 1)},
    # Merge of the by-block partial results, one program per (token, block_m query heads) (cuda: see below).
    "slot_combine": {"cuda": Tiles(4, 0, 4, 1), "hip": Tiles(8, 0, 4, 1), "interpret": Tiles(4, 0, 1, 1)},
    # Long-context prefill (a sequence of >= LONG_PREFILL_CONTEXT tokens in the step). "cuda": measured by
    # `scripts/gpu_prefill.py` (in git at 8277a9c; 2026-12-03, H200, Triton 3.6) on one chunk of 8,192 queries at
    # the end of a 131,072-token context, each against the short-context entry above (today `python -m
    # nanoserve.bench --workloads W4 --w4-lens 131072 --profile-prefill W4` times these kernels per call inside
    # the whole 128k prefill, with the table's tiles):
    # - dense: 128 x 128 tiles 85.9 ms (397 TFLOP/s) vs 128 x 64 106.0 ms (322); 64-wide query tiles and 4 warps
    #   were slower, 2 stages within 3%.
    # - MSA scores (+ top-k): 4 warps 3.69 ms vs 8 warps 4.09 ms; 256-row tiles 4.5 ms.
    # - sparse: one query token per program 5.9 ms (random index queries) / 5.6 ms (drifting ones) vs 8 tokens
    #   22.4 / 11.4 ms: at 1,024 candidate blocks the union of several tokens' selections is mostly blocks a
    #   given row does not use, so wider query tiles compute masked rows (2-16 tokens: 10-43 ms).
    # Second pass (2026-12-03, same shape, the same script with SWEEP=1):
    # - dense: K/V through TMA descriptors, 128 x 128, 8 warps, 3 stages 78.7 ms (433 TFLOP/s) vs the same tiles with
    #   pointer loads 84.0 ms (and the kernel before the exponent's folded scale 86.1 ms); TMA 128 x 64 94.7 ms,
    #   2 stages 79.3 ms.
    # - by-block sparse (switch msa_sparse_by_block): 4 tokens per tile, 4 warps 8.55 / 8.32 ms (random / drifting
    #   index queries, with the one-head-per-program merge) vs 8 tokens 9.63 / 9.32, 16 tokens 9.47 / 8.98,
    #   8 tokens with 128-key tiles 9.87 / 9.48; with the 4-head merge (slot_combine) the whole call is
    #   5.16 / 4.98 ms (2 heads 6.97 / 6.73, 8 heads 5.55 / 5.35).
    "paged_prefill_long": {"cuda": Tiles(128, 128, 8, 3, True), "hip": Tiles(128, 32, 4, 2),
                           "interpret": Tiles(32, 32, 1, 1)},
    "msa_score_prefill_long": {"cuda": Tiles(128, 0, 4, 3), "hip": Tiles(64, 0, 4, 2),
                               "interpret": Tiles(64, 0, 1, 1)},
    "sparse_prefill_long": {"cuda": Tiles(1, 64, 4, 3), "hip": Tiles(4, 64, 4, 2), "interpret": Tiles(1, 64, 1, 1)},
    "sparse_by_block_long": {"cuda": Tiles(4, 64, 4, 3), "hip": Tiles(4, 64, 4, 2),
                             "interpret": Tiles(4, 64, 1, 1)},
    # QK-norm + RoPE + cache insert: block_m tokens per program, block_n (token, head) rows per step.
    "qk_norm_rope": {"cuda": Tiles(1, 32, 4, 1), "hip": Tiles(1, 32, 4, 1), "interpret": Tiles(16, 128, 1, 1)},
    # Residual add + RMSNorm, block_m rows per program.
    "add_rmsnorm": {"cuda": Tiles(1, 0, 8, 1), "hip": Tiles(1, 0, 4, 1), "interpret": Tiles(16, 0, 1, 1)},
}

LONG_PREFILL_CONTEXT = 32768
"""A prefill step whose longest sequence has at least this many tokens uses the `_long` prefill tiles. The long
entries were measured at 128k; at 32k-64k they are the choice of the end-to-end W4-128k run (its chunks past 32k
used them), not of a sweep at those lengths."""

MOE_TILES: dict[str, dict[tuple[int, int, int], dict[int, tuple]]] = {
    # Fused MoE (kernels/moe.py): backend -> (hidden, intermediate, routed experts) -> {token bucket:
    # (block_m, group_m, GEMM 1 (block_n, block_k, warps, stages), GEMM 2 (block_n, block_k, warps, stages))}.
    # A batch of T tokens uses the smallest bucket >= T (the largest one beyond). NVIDIA H200, bf16, top-4 + the folded
    # shared expert. Buckets 1-256: hand-picked (small BLOCK_M, narrow BLOCK_N and long BLOCK_K while memory-bound),
    # measured at 77-102% of the 4.26 TB/s copy ceiling (2026-12-02, `scripts/gpu_moe_bench.py`, in git at 8277a9c;
    # today `python scripts/tune_moe.py --decode-check` times the 1- and 16-token entries against the same ceiling, and
    # `python -m nanoserve.bench --micro moe` the buckets at 1-4,096 tokens). Bucket 1024: that script's `--sweep-only`
    # coordinate descent (2026-12-02; `scripts/tune_moe.py --tokens 1024` runs the same kind of descent today). Buckets
    # 4096-16384: `scripts/tune_moe.py --tokens 4096,16384,8192` (2026-12-03, H200, Triton 3.6; times of the whole fused
    # MoE with the shared expert, random routing). Buckets 4096 and 16384 again, with TMA descriptor tiles as a
    # coordinate ("tma", switch moe_tma): `OUT=$OUT python3 scripts/tune_moe.py --tokens 4096,16384 --budget 120
    # --decode-check --write-configs` (2026-12-04, H200, Triton 3.6, commit c8a1f5b); the same tiles without TMA took
    # 6.433 ms (4096) and 18.586 ms (16384).
    "cuda": {
        (6144, 3072, 128): {
            1: (16, 1, (32, 256, 4, 4), (64, 256, 4, 3)),
            16: (16, 1, (32, 256, 4, 4), (64, 256, 4, 3)),
            64: (16, 8, (64, 128, 4, 4), (64, 128, 4, 4)),
            256: (32, 8, (64, 128, 4, 4), (64, 128, 4, 4)),
            1024: (64, 1, (256, 64, 8, 3), (128, 64, 4, 3)),  # 3.919 ms
            4096: (64, 32, (256, 64, 8, 3), (256, 64, 8, 4), "tma"),  # 6.283 ms, 369 TFLOP/s (2026-12-04)
            8192: (128, 32, (128, 64, 8, 4), (256, 64, 8, 3)),  # 10.966 ms, 423 TFLOP/s (old 11.994 ms)
            16384: (128, 16, (128, 64, 8, 3), (256, 64, 8, 4), "tma"),  # 16.856 ms, 550 TFLOP/s (2026-12-04)
        },
    },
}
M3_EXPERT_SHAPES = ((6144, 3072, 128), (6144, 1536, 128), (6144, 768, 128), (6144, 384, 128), (6144, 3072, 32),
                    (6144, 3072, 16))
"""M3's (hidden, intermediate, routed experts) on one rank: tensor parallel 1, 2, 4, 8, then expert parallel 4, 8."""
HIP_MOE_BUCKETS: dict[int, tuple] = {
    # By the rule in this module's docstring (compile gate on gfx942: <= 24 KiB of LDS, >= 2 waves per SIMD). A
    # token sends ~1/32 of a row to each of M3's 128 routed experts (top-4), and one to the shared expert's slot.
    # Up to 256 tokens (<= 8 rows per routed expert): 16-row tiles, the narrowest MFMA N (16 gate + 16 up columns)
    # for GEMM 1 and 32 for GEMM 2, so one token's five experts make ~1,000 programs per GEMM for 304 CUs, and
    # 256-deep K steps. 1024 tokens (~32 rows): 32-row tiles. 4096 and more: 64-row tiles, 64 x 64 (GEMM 1) and
    # 128 x 64 (GEMM 2) - 128-row tiles would need 64 KiB of LDS.
    1: (16, 8, (16, 256, 4, 2), (32, 256, 4, 2)),
    256: (16, 8, (16, 256, 4, 2), (32, 256, 4, 2)),
    1024: (32, 8, (32, 128, 4, 2), (64, 128, 4, 2)),
    4096: (64, 8, (64, 64, 4, 2), (128, 64, 4, 2)),
}
MOE_TILES["hip"] = {shape: HIP_MOE_BUCKETS for shape in M3_EXPERT_SHAPES}

INTERPRETER_SM_COUNT = 4
"""Stand-in multiprocessor count under the interpreter: small, so tests still exercise several splits."""


def backend(device: torch.device) -> str:
    """'interpret', 'hip' or 'cuda': which column of the tables applies to kernels launched on `device`."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return "interpret"
    return "hip" if torch.version.hip else "cuda"


def tiles(kernel: str, device: torch.device) -> Tiles:
    return TABLES[kernel][backend(device)]


GEMV_TILES: dict[str, dict[tuple[int, int], tuple[int, int, int, int]]] = {
    # One-row GEMV for 16-bit weights (kernels/gemv.py): backend -> (N, K) of the weight -> (block_n, block_k,
    # warps, stages). Only shapes where `scripts/tune_gemv.py` measured the kernel faster than F.linear on the
    # card are listed; every other shape keeps F.linear. The interpreter lists none: the model's CPU runs keep
    # F.linear, and tests/test_kernel_gemv.py calls the kernel with GEMV_INTERPRETER_TILES.
    # cuda: H200, bf16, 2026-12-04, commit a1f4387, `python scripts/tune_gemv.py` (us per call, GEMV vs F.linear):
    # QKV 28.3 vs 33.4, QKV + index 29.9 vs 33.7, o_proj 25.2 vs 27.8, dense down 36.4 vs 41.9 (F.linear's
    # split-K kernels plus their reduction); the dense gate/up (69.0 vs 70.5) stays with F.linear. The MoE router
    # (fp32 weight, commit 9ed601d, `--shapes 128x6144`): 2.6 us vs 7.1 for the copy of x + F.linear in fp32.
    # The bf16 LM head (2026-12-05, commit 56dd7df, `--shapes 200064x6144`): 535.0 us (4,595 GB/s) vs 595.9 us
    # (4,125 GB/s), 1.11x; the one-token step of both weight formats reads it (the checkpoint keeps it in bf16).
    "cuda": {
        (128, 6144): (1, 1024, 8, 2),
        (200064, 6144): (2, 2048, 8, 2),
        (9216, 6144): (4, 512, 4, 2),
        (9856, 6144): (16, 256, 8, 2),
        (6144, 8192): (8, 512, 4, 1),
        (6144, 12288): (8, 1024, 8, 1),
    },
    # hip: the cuda entry's shapes and tiles with its threads per program as 64-lane waves (rule 1; the GEMV uses
    # neither LDS nor MFMA). Never timed against hipBLASLt: `--no-triton-gemv` is the way back to F.linear.
    "hip": {
        (128, 6144): (1, 1024, 4, 2),
        (200064, 6144): (2, 2048, 4, 2),
        (9216, 6144): (4, 512, 2, 2),
        (9856, 6144): (16, 256, 4, 2),
        (6144, 8192): (8, 512, 2, 1),
        (6144, 12288): (8, 1024, 4, 1),
    },
    "interpret": {},
}
GEMV_MXFP8_TILES: dict[str, dict[tuple[int, int], tuple[int, int, int, int]]] = {
    # The same for MXFP8 weights (kernels/gemv.py gemv_mxfp8, block_k a multiple of 32): the shapes where
    # `scripts/tune_gemv.py --mxfp8` measured it faster than kernels/fp8_linear.py's tuned choice. cuda: H200,
    # bf16 activations, 2026-12-04, commit bb0843b (us per call, GEMV vs fp8_linear): o_proj 15.1 vs 19.5, MSA QKV
    # + index 16.6 vs 25.4, dense QKV 16.1 vs 45.5, dense down 20.7 vs 37.9, dense gate/up 35.7 vs 39.9.
    "cuda": {
        (6144, 8192): (4, 2048, 4, 1),
        (9856, 6144): (8, 2048, 4, 1),
        (9216, 6144): (8, 2048, 4, 1),
        (6144, 12288): (4, 1024, 4, 1),
        (24576, 6144): (4, 2048, 4, 1),
    },
    # hip: as GEMV_TILES's hip entries, the cuda entries' threads as 64-lane waves.
    "hip": {
        (6144, 8192): (4, 2048, 2, 1),
        (9856, 6144): (8, 2048, 2, 1),
        (9216, 6144): (8, 2048, 2, 1),
        (6144, 12288): (4, 1024, 2, 1),
        (24576, 6144): (4, 2048, 2, 1),
    },
    "interpret": {},
}
GEMV_INTERPRETER_TILES = (16, 64, 1, 1)


def tuned_file(variable: str, writer: str, keys: tuple[str, ...], parse: Callable[[dict], dict]) -> dict | None:
    """The tile tables in the JSON file named by $variable (as `writer` writes it: top-level keys among `keys`),
    as `parse` reads them, or None when the variable is unset. Read once per path. A file that is missing,
    malformed or of another kind is a ValueError naming the variable and the file."""
    path = os.environ.get(variable)
    return _read_tuned_file(variable, path, writer, keys, parse) if path else None


@functools.lru_cache(maxsize=None)
def _read_tuned_file(variable: str, path: str, writer: str, keys: tuple[str, ...],
                     parse: Callable[[dict], dict]) -> dict:
    import json

    try:
        with open(path) as f:
            data = json.load(f)
        unknown = set(data) - set(keys)
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)}; this table has {', '.join(keys)}")
        return parse(data)
    except (OSError, ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"{variable}={path}: not a table {writer} wrote ({e})") from None


GEMV_TUNED_CONFIG_ENV = "NANOSERVE_GEMV_TUNED_CONFIG"
"""A JSON file written by `scripts/tune_gemv.py --write FILE` ({"16bit": {"N,K": tile}, "mxfp8": {...}}): its
entries are added to (or replace) the tables above for the device in use - another card's tiles, without editing
code."""
GEMV_FILE_KEYS = ("16bit", "mxfp8")


def _parse_gemv_file(data: dict) -> dict[str, dict[tuple[int, int], tuple[int, int, int, int]]]:
    tables = {fmt: {tuple(int(v) for v in shape.split(",")): tuple(int(v) for v in tile)
                    for shape, tile in data.get(fmt, {}).items()} for fmt in GEMV_FILE_KEYS}
    if any(len(shape) != 2 or len(tile) != 4 for t in tables.values() for shape, tile in t.items()):
        raise ValueError('entries are "N,K": [block_n, block_k, warps, stages]')
    return tables


def tuned_gemv_tables() -> dict | None:
    """$NANOSERVE_GEMV_TUNED_CONFIG's tables ({"16bit": {(N, K): tile}, "mxfp8": {...}}), or None when unset."""
    return tuned_file(GEMV_TUNED_CONFIG_ENV, "scripts/tune_gemv.py", GEMV_FILE_KEYS, _parse_gemv_file)


def gemv_tiles(n: int, k: int, device: torch.device, mxfp8: bool = False) -> tuple[int, int, int, int] | None:
    """The one-row GEMV's tuned tile for an [n, k] weight on `device` (GEMV_MXFP8_TILES for an MXFP8 weight; a
    $NANOSERVE_GEMV_TUNED_CONFIG file first), or None: the caller keeps F.linear (or, for MXFP8,
    kernels/fp8_linear.py)."""
    tuned = tuned_gemv_tables()
    if tuned is not None and (n, k) in tuned["mxfp8" if mxfp8 else "16bit"]:
        return tuned["mxfp8" if mxfp8 else "16bit"][(n, k)]
    return (GEMV_MXFP8_TILES if mxfp8 else GEMV_TILES)[backend(device)].get((n, k))


def prefill_kernel(kernel: str, longest_context: int) -> str:
    """The table entry of a prefill kernel for a step whose longest sequence has `longest_context` tokens."""
    return f"{kernel}_long" if longest_context >= LONG_PREFILL_CONTEXT else kernel


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Multiprocessors (CUs on AMD) of the device: sizes the split-K grids so one long sequence fills the GPU."""
    if backend(device) == "interpret":
        return INTERPRETER_SM_COUNT
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
