"""Tile tables of the MXFP8-weight kernels (kernels/fp8_linear.py, the fp8 path of kernels/moe.py).

Each entry names a *variant* (how a weight tile is dequantised and multiplied) and its tiles:

- "acc":    one bf16 dot per 32-column scale block, the [BLOCK_N] scale vector applied to the fp32 accumulator.
- "gather": the whole [BLOCK_K, BLOCK_N] tile dequantised with one scale load per weight (`k // 32` pointers).
- "bcast":  the tile loaded as [BLOCK_N, BLOCK_K] with its [BLOCK_N, BLOCK_K / 32] scales, broadcast over each
            32-column block in registers (one scale load per 32 weights), then x @ W^T.
- "swap":   "bcast"'s dequantised tile as the dot's first operand, W @ x^T (the weight rows fill the MMA's long
            side and the tile can stay in registers; the token rows are the narrow side), transposed at the store.
- "scaled": `tl.dot_scaled` (bf16 activations x e4m3 weights with E8M0 scales): the compiler does the upcast.

Tables are keyed by backend ("cuda" only so far), then by the GEMM's shape and a batch bucket; a batch of M rows
(tokens for the MoE) uses the smallest bucket >= M (the largest beyond). Shapes missing from a table use the
heuristics in the kernel files. `scripts/tune_fp8.py` measures every variant at a card's shapes and writes a JSON
file of the same form; `NANOSERVE_FP8_TUNED_CONFIG=<that file>` makes the kernels use it over these built-in
entries (for another card, without editing code).

Built-in "cuda" entries: NVIDIA H200 at m3-slice widths (see each table's comment for the run).
"""

from __future__ import annotations

import functools
import json
import os

FP8_VARIANTS = ("acc", "gather", "bcast", "swap", "scaled")
TUNED_CONFIG_ENV = "NANOSERVE_FP8_TUNED_CONFIG"

LinearEntry = tuple  # (variant, block_m, block_n, block_k, num_warps, num_stages)
MoEEntry = tuple  # (variant, block_m, group_m, (up block_n, block_k, warps, stages), (down ...))

FP8_LINEAR_TILES: dict[str, dict[tuple[int, int], dict[int, LinearEntry]]] = {
    # backend -> (N, K) -> {row bucket: entry}
    "cuda": {},
}

FP8_MOE_TILES: dict[str, dict[tuple[int, int, int], dict[int, MoEEntry]]] = {
    # backend -> (hidden, intermediate, routed experts) -> {token bucket: entry}
    "cuda": {},
}


def _key(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


@functools.lru_cache(maxsize=None)
def _tuned_file(path: str) -> dict:
    """{'linear': {...}, 'moe': {...}} from a tune_fp8.py JSON file (keys "N,K" / "H,I,E", buckets as strings)."""
    with open(path) as f:
        data = json.load(f)
    out: dict = {"linear": {}, "moe": {}}
    for kind in out:
        for shape, buckets in data.get(kind, {}).items():
            out[kind][_key(shape)] = {int(b): tuple(tuple(v) if isinstance(v, list) else v for v in e)
                                      for b, e in buckets.items()}
    return out


def _table(kind: str, backend: str) -> dict:
    base = (FP8_LINEAR_TILES if kind == "linear" else FP8_MOE_TILES).get(backend, {})
    path = os.environ.get(TUNED_CONFIG_ENV)
    if not path or backend != "cuda":
        return base
    return {**base, **_tuned_file(path)[kind]}


def bucket_entry(buckets: dict[int, tuple], rows: int) -> tuple:
    """The entry of the smallest bucket >= rows (the largest bucket beyond)."""
    keys = sorted(buckets)
    return buckets[next((b for b in keys if rows <= b), keys[-1])]


def linear_entry(backend: str, n: int, k: int, m: int) -> LinearEntry | None:
    buckets = _table("linear", backend).get((n, k))
    return bucket_entry(buckets, m) if buckets else None


def moe_entry(backend: str, hidden: int, inter: int, experts: int, tokens: int) -> MoEEntry | None:
    buckets = _table("moe", backend).get((hidden, inter, experts))
    return bucket_entry(buckets, tokens) if buckets else None
