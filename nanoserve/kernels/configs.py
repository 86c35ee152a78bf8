"""Tile configurations for the attention kernels (kernels/attention.py, kernels/msa.py, kernels/norm_rope.py), the
one-row GEMV (kernels/gemv.py) and the fused MoE (kernels/moe.py).

One table per kernel, keyed by backend:

- "cuda": chosen on an H200 (Hopper, 132 SMs) at m3-slice shapes by timing them (the tiles over an fp8 KV pool by
  the compile gate's register-spill check on sm_90). The tiles are data: tuned/attention.json (TABLES),
  tuned/moe.json (MOE_TILES) and tuned/gemv.json (GEMV_TILES, GEMV_MXFP8_TILES), each entry with the run that
  chose it (card, torch and Triton versions, command, commit, date, times: kernels/tuned/__init__.py says the
  form), read once at import by `tuned.load`. Decode kernels stream the KV cache: many programs, a few pipeline
  stages. Prefill tiles are the usual flash-attention shapes for head_dim 128.
- "hip": the same kernels on AMD Instinct (MI300X = gfx942, MI355X = gfx950). No entry has run on an AMD card:
  each follows one rule, and the compile gate (scripts/compile_gate.py, docs/rocm.md) compiles every launch of the
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

The "hip" and "interpret" columns are rules, not measurements, and stay in this file beside the rule (the compile
gate checks the "hip" ones); the "cuda" column of every table is read from the data files.

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

from nanoserve.kernels import tuned


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


def attention_tiles(data: dict) -> dict[str, Tiles]:
    """{kernel: Tiles} from a tuned/attention.json-form file ({"tiles": {kernel: [block_m, block_n, warps, stages
    (, tma)]}})."""
    return {name: Tiles(*tile) for name, tile in data["tiles"].items()}


_RULE_TABLES: dict[str, dict[str, Tiles]] = {
    # The "hip" and "interpret" columns of TABLES (by the rules above); "cuda" is tuned/attention.json.
    # Dense decode, one program per (sequence, KV head, split); block_m is derived (the GQA group, >= 16).
    "paged_decode": {"hip": Tiles(0, 64, 4, 2), "interpret": Tiles(0, 32, 1, 1)},
    # Dense prefill, one program per (sequence, query tile, query head).
    "paged_prefill": {"hip": Tiles(128, 32, 4, 2), "interpret": Tiles(32, 32, 1, 1)},
    # The same over an fp8 KV pool (kv_cache_dtype fp8): K is widened in registers, so the bf16 pool's
    # long-context TMA tile needs 255 registers and spills on sm_90 (Triton 3.9), and AMD's 4-wave tile drops to
    # one wave per SIMD (302 registers on gfx942); 8 waves keep two (178 registers; gfx950 three). Compile gate.
    # Its long-context entry (below) loads the fp8 tiles through TMA with 4 warps and 2 stages on CUDA.
    "paged_prefill_fp8": {"hip": Tiles(128, 32, 8, 2), "interpret": Tiles(32, 32, 1, 1)},
    # Merge of flash-decoding splits, one program per (token, query head); block_n = splits read per step.
    "split_combine": {"hip": Tiles(0, 16, 4, 2), "interpret": Tiles(0, 64, 1, 1)},
    # MSA indexer scores; block_n is derived (one whole KV block per step). block_m = (token, index head) rows.
    "msa_score_prefill": {"hip": Tiles(64, 0, 4, 2), "interpret": Tiles(64, 0, 1, 1)},
    "msa_score_decode": {"hip": Tiles(16, 0, 4, 2), "interpret": Tiles(16, 0, 1, 1)},
    # Block top-k over (token, KV group) rows: block_n = block scores of a row held per pass (longer rows loop),
    # block_m = scores a program holds in all (rows per program = block_m // block_n).
    "msa_topk": {"hip": Tiles(4096, 2048, 4, 1), "interpret": Tiles(16384, 256, 1, 1)},
    # Block-sparse attention, one program per (block_m query tokens x the GQA group, KV group, split);
    # block_n = keys per tile of a KV block. Decode: one token, split-K over its selected blocks.
    "sparse_decode": {"hip": Tiles(1, 64, 4, 2), "interpret": Tiles(1, 64, 1, 1)},
    # The same over an fp8 KV pool: with K and V widened in registers the split-K tile spills 16 bytes per thread
    # on sm_90 at 3 stages (Triton 3.9) and none at 1 (compile gate).
    "sparse_decode_fp8": {"hip": Tiles(1, 64, 4, 2), "interpret": Tiles(1, 64, 1, 1)},
    "sparse_prefill": {"hip": Tiles(4, 64, 4, 2), "interpret": Tiles(16, 64, 1, 1)},
    # Block-sparse prefill grouped by KV block (switch msa_sparse_by_block), one program per tile of (token, KV
    # group, slot) pairs that selected one block: block_m = pairs (tokens) per tile, times the GQA group as rows;
    # block_n = keys per tile of the KV block. cuda: the long-context choice at every length.
    "sparse_by_block": {"hip": Tiles(4, 64, 4, 2), "interpret": Tiles(4, 64, 1, 1)},
    # Merge of the by-block partial results, one program per (token, block_m query heads).
    "slot_combine": {"hip": Tiles(8, 0, 4, 1), "interpret": Tiles(4, 0, 1, 1)},
    # Long-context prefill (a sequence of >= LONG_PREFILL_CONTEXT tokens in the step). "cuda": measured on one
    # chunk of 8,192 queries at the end of a 131,072-token context, each against the short-context entry above.
    "paged_prefill_long": {"hip": Tiles(128, 32, 4, 2), "interpret": Tiles(32, 32, 1, 1)},
    "paged_prefill_fp8_long": {"hip": Tiles(128, 32, 8, 2), "interpret": Tiles(32, 32, 1, 1)},
    "msa_score_prefill_long": {"hip": Tiles(64, 0, 4, 2), "interpret": Tiles(64, 0, 1, 1)},
    "sparse_prefill_long": {"hip": Tiles(4, 64, 4, 2), "interpret": Tiles(1, 64, 1, 1)},
    "sparse_by_block_long": {"hip": Tiles(4, 64, 4, 2), "interpret": Tiles(4, 64, 1, 1)},
    # QK-norm + RoPE + cache insert: block_m tokens per program, block_n (token, head) rows per step.
    "qk_norm_rope": {"hip": Tiles(1, 32, 4, 1), "interpret": Tiles(16, 128, 1, 1)},
    # Residual add + RMSNorm, block_m rows per program.
    "add_rmsnorm": {"hip": Tiles(1, 0, 4, 1), "interpret": Tiles(16, 0, 1, 1)},
}
_CUDA_TILES = attention_tiles(tuned.load("attention"))
"""The measured "cuda" column: tuned/attention.json (each entry's run in its "provenance")."""
if _CUDA_TILES.keys() != _RULE_TABLES.keys():
    raise ValueError(f"{tuned.path('attention')}: its kernels differ from configs.TABLES' "
                     f"({sorted(_CUDA_TILES.keys() ^ _RULE_TABLES.keys())})")
TABLES: dict[str, dict[str, Tiles]] = {name: {"cuda": _CUDA_TILES[name], **rules}
                                       for name, rules in _RULE_TABLES.items()}
"""kernel -> backend ("cuda", "hip", "interpret") -> its tiles."""

LONG_PREFILL_CONTEXT = 32768
"""A prefill step whose longest sequence has at least this many tokens uses the `_long` prefill tiles. The long
entries were measured at 128k; at 32k-64k they are the choice of the end-to-end W4-128k run (its chunks past 32k
used them), not of a sweep at those lengths."""


def bucket_tables(data: dict, kinds: tuple[str, ...]) -> dict[str, dict[tuple[int, ...], dict[int, tuple]]]:
    """The bucketed tables `kinds` of a JSON table file ({kind: {"6144,3072,128": {"4096": entry}}}, nested lists
    for tile tuples) as the Python tables hold them: {kind: {(6144, 3072, 128): {4096: entry tuple}}}."""
    return {kind: {tuple(int(v) for v in shape.split(",")):
                   {int(b): tuple(tuple(v) if isinstance(v, list) else v for v in e) for b, e in buckets.items()}
                   for shape, buckets in data.get(kind, {}).items()} for kind in kinds}


MOE_TILES: dict[str, dict[tuple[int, int, int], dict[int, tuple]]] = {
    # Fused MoE (kernels/moe.py): backend -> (hidden, intermediate, routed experts) -> {token bucket:
    # (block_m, group_m, GEMM 1 (block_n, block_k, warps, stages), GEMM 2 (block_n, block_k, warps, stages)
    # [, "tma": the GEMMs load through TMA descriptors, switch moe_tma])}. A batch of T tokens uses the smallest
    # bucket >= T (the largest one beyond). "cuda": tuned/moe.json (NVIDIA H200, bf16, top-4 + the folded shared
    # expert; `scripts/tune_moe.py --write-configs` rewrites it), each bucket's run in its "provenance": buckets
    # 1-256 hand-picked for the copy ceiling, the prefill buckets by coordinate descent.
    "cuda": bucket_tables(tuned.load("moe"), ("moe",))["moe"],
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


GEMV_FILE_KEYS = ("16bit", "mxfp8")


def gemv_tables(data: dict) -> dict[str, dict[tuple[int, int], tuple[int, int, int, int]]]:
    """{"16bit": {(N, K): tile}, "mxfp8": {...}} from a tuned/gemv.json-form file ({"16bit": {"N,K": tile}})."""
    tables = {fmt: {tuple(int(v) for v in shape.split(",")): tuple(int(v) for v in tile)
                    for shape, tile in data.get(fmt, {}).items()} for fmt in GEMV_FILE_KEYS}
    if any(len(shape) != 2 or len(tile) != 4 for t in tables.values() for shape, tile in t.items()):
        raise ValueError('entries are "N,K": [block_n, block_k, warps, stages]')
    return tables


GEMV_TILES: dict[str, dict[tuple[int, int], tuple[int, int, int, int]]] = {
    # One-row GEMV for 16-bit weights (kernels/gemv.py): backend -> (N, K) of the weight -> (block_n, block_k,
    # warps, stages). Only shapes where `scripts/tune_gemv.py` measured the kernel faster than F.linear on the
    # card are listed; every other shape keeps F.linear. The interpreter lists none: the model's CPU runs keep
    # F.linear, and tests/kernels/test_kernel_gemv.py calls the kernel with GEMV_INTERPRETER_TILES.
    # cuda: tuned/gemv.json's "16bit" table (H200; the QKV, o_proj and dense down projections, the MoE router's
    # fp32 weight and the bf16 LM head), each shape with its run and its time against F.linear in "provenance".
    "cuda": gemv_tables(tuned.load("gemv"))["16bit"],
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
    # `scripts/tune_gemv.py --mxfp8` measured it faster than kernels/fp8_linear.py's tuned choice. cuda:
    # tuned/gemv.json's "mxfp8" table (H200, bf16 activations), with the run and times in its "provenance".
    "cuda": gemv_tables(tuned.load("gemv"))["mxfp8"],
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
    """The tile tables in the JSON file named by $variable (as `writer` writes it: top-level keys among `keys`, and
    the "provenance" list of kernels/tuned/__init__.py), as `parse` reads them, or None when the variable is unset.
    Read once per path. A file that is missing, malformed or of another kind is a ValueError naming the variable
    and the file."""
    path = os.environ.get(variable)
    return _read_tuned_file(variable, path, writer, keys, parse) if path else None


@functools.lru_cache(maxsize=None)
def _read_tuned_file(variable: str, path: str, writer: str, keys: tuple[str, ...],
                     parse: Callable[[dict], dict]) -> dict:
    import json

    try:
        with open(path) as f:
            data = json.load(f)
        unknown = set(data) - {*keys, "provenance"}
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)}; this table has {', '.join(keys)}")
        return parse(data)
    except (OSError, ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"{variable}={path}: not a table {writer} wrote ({e})") from None


GEMV_TUNED_CONFIG_ENV = "NANOSERVE_GEMV_TUNED_CONFIG"
"""A JSON file written by `scripts/tune_gemv.py --write FILE` ({"16bit": {"N,K": tile}, "mxfp8": {...}}): its
entries are added to (or replace) the tables above for the device in use - another card's tiles, without editing
code (the form of tuned/gemv.json, which such a file can also replace)."""


def tuned_gemv_tables() -> dict | None:
    """$NANOSERVE_GEMV_TUNED_CONFIG's tables ({"16bit": {(N, K): tile}, "mxfp8": {...}}), or None when unset."""
    return tuned_file(GEMV_TUNED_CONFIG_ENV, "scripts/tune_gemv.py", GEMV_FILE_KEYS, gemv_tables)


def gemv_tiles(n: int, k: int, device: torch.device, mxfp8: bool = False) -> tuple[int, int, int, int] | None:
    """The one-row GEMV's tuned tile for an [n, k] weight on `device` (GEMV_MXFP8_TILES for an MXFP8 weight; a
    $NANOSERVE_GEMV_TUNED_CONFIG file first), or None: the caller keeps F.linear (or, for MXFP8,
    kernels/fp8_linear.py)."""
    override = tuned_gemv_tables()
    if override is not None and (n, k) in override["mxfp8" if mxfp8 else "16bit"]:
        return override["mxfp8" if mxfp8 else "16bit"][(n, k)]
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
