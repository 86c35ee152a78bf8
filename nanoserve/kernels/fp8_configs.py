"""Tile tables of the MXFP8-weight kernels (kernels/fp8_linear.py, the fp8 path of kernels/moe.py).

Each entry names a *variant* (how a weight tile is dequantised and multiplied) and its tiles:

- "acc":    one bf16 dot per 32-column scale block, the [BLOCK_N] scale vector applied to the fp32 accumulator.
- "gather": the whole [BLOCK_K, BLOCK_N] tile dequantised with one scale load per weight (`k // 32` pointers).
- "bcast":  the tile loaded as [BLOCK_N, BLOCK_K] with its [BLOCK_N, BLOCK_K / 32] scales, broadcast over each
            32-column block in registers (one scale load per 32 weights), then x @ W^T.
- "swap":   "bcast"'s dequantised tile as the dot's first operand, W @ x^T (the weight rows fill the MMA's long
            side and the tile can stay in registers; the token rows are the narrow side), transposed at the store.
- "scaled": `tl.dot_scaled` (bf16 activations x e4m3 weights with E8M0 scales): the compiler does the upcast.
- "dequant": (linear only) W dequantised to a transient 16-bit copy by one Triton pass, then F.linear (cuBLAS):
            for prefill-sized batches, where the library GEMM outruns any in-register dequantisation and the extra
            2 bytes per weight are small next to the GEMM.
- "gemv":   no tensor cores: a few token rows times the fp8 tile in fp32 on CUDA cores, each 32-column block
            summed before its scale (one multiply per 32 weights), no shared memory; the linear splits K until the
            grid has `split_waves` programs per multiprocessor. For decode (1-4 rows), where the tensor-core
            variants spend their time dequantising tiles for an MMA that is 94 % padding. The fused MoE runs it
            for batches of up to moe.MOE_GEMV_MAX_TOKENS tokens (each tile's first rows only), else "bcast".

Tables are keyed by backend ("cuda", "hip"), then by the GEMM's shape and a batch bucket; a batch of M rows
(tokens for the MoE) uses the smallest bucket >= M (the largest beyond). Shapes missing from a table use the
heuristics in the kernel files.

Built-in "cuda" entries: NVIDIA H200 at m3-slice widths, measured, so they are data: kernels/tuned/fp8.json, read
once at import, each entry with the run that chose it in its "provenance" (card, torch and Triton versions,
command, commit, date, times). `scripts/tune_fp8.py` measures every variant at a card's shapes and writes a JSON
file of the same form (fp8_tuned.json, which can replace tuned/fp8.json as it is);
`NANOSERVE_FP8_TUNED_CONFIG=<that file>` makes the kernels use its entries over the built-in ones (for another
card, without editing anything). Built-in "hip" entries stay here in Python: M3's shapes at tensor parallel 1-8
and expert parallel 4 and 8, one bucket table per kind chosen by the rule stated in configs.py's docstring (never
timed on an AMD card; the compile gate, scripts/compile_gate.py, checks that they compile and fit gfx942 and gfx950).
"""

from __future__ import annotations

from nanoserve.kernels import tuned
from nanoserve.kernels.configs import M3_EXPERT_SHAPES, bucket_tables, tuned_file

FP8_VARIANTS = ("acc", "gather", "bcast", "swap", "scaled", "dequant", "gemv")
TUNED_CONFIG_ENV = "NANOSERVE_FP8_TUNED_CONFIG"

LinearEntry = tuple  # (variant, block_m, block_n, block_k, num_warps, num_stages[, split_waves])
MoEEntry = tuple  # (variant, block_m, group_m, (up block_n, block_k, warps, stages), (down ...))

FP8_LINEAR_TILES: dict[str, dict[tuple[int, int], dict[int, LinearEntry]]] = {
    # backend -> (N, K) -> {row bucket: entry}. "cuda": tuned/fp8.json's "linear" table: m3-slice's projections
    # (qkv+index 9856 x 6144, o_proj 6144 x 8192, dense gate_up 24576 x 6144, dense down 6144 x 12288) on an H200,
    # the 32-4096-row buckets from two runs of `scripts/tune_fp8.py`, the 1/8/64-row ones re-picked against the
    # CUDA-core "gemv" variant (see its "provenance"; entries within the decode timings' run-to-run spread of each
    # other are not told apart).
    "cuda": bucket_tables(tuned.load("fp8"), ("linear",))["linear"],
}

PREFILL_ROWS = 128
"""A linear of more rows than this is prefill-sized, and takes "dequant": every built-in entry above this bucket
on both backends is "dequant", and a shape missing from the tables takes it too (fp8_linear.select_tiles). So a
prefill runs the very F.linear call - same shapes, same bf16 values - that a model with its weights dequantised at
load runs, whatever the card's SM count or the library's choice of GEMM: native MXFP8 and dequantised weights
agree bit for bit there by construction (docs/mxfp8.md). A $NANOSERVE_FP8_TUNED_CONFIG entry naming another
variant for a prefill bucket is used as given, and gives that up for its shape."""

M3_LINEAR_SHAPES = (
    # (N, K) of M3's MXFP8 projections on one rank: MSA qkv + index, dense qkv, o_proj, dense gate_up, dense down
    (9856, 6144), (9216, 6144), (6144, 8192), (24576, 6144), (6144, 12288),  # tensor parallel 1
    (4992, 6144), (4608, 6144), (6144, 4096), (12288, 6144), (6144, 6144),  # 2
    (2560, 6144), (2304, 6144), (6144, 2048), (6144, 3072),  # 4 (gate_up 6144 x 6144 as at 2)
    (1536, 6144), (1280, 6144), (6144, 1024), (3072, 6144), (6144, 1536),  # 8
    (6144, 768), (768, 6144), (6144, 384),  # the unfolded shared expert under expert parallel 4 and 8
)
HIP_LINEAR_BUCKETS: dict[int, LinearEntry] = {
    # By the rule in configs.py: one row on the vector ALUs ("gemv", K split over ~4 programs per CU); 8 rows in
    # one 16-row MFMA tile with the accumulator scaled per block ("acc"); 32-128 rows dequantising the weight tile
    # in registers ("bcast": "acc" at 32 rows needs over 256 registers, and so does "bcast" with 128-deep K steps
    # there); prefill batches dequantise W once and call F.linear (hipBLASLt), as on CUDA. All within 32 KiB of
    # LDS and 2 stages.
    1: ('gemv', 1, 32, 256, 4, 1, 4),
    8: ('acc', 16, 64, 128, 4, 2, 8),
    32: ('bcast', 32, 64, 64, 4, 2),
    64: ('bcast', 64, 64, 128, 4, 2, 8),
    128: ('bcast', 64, 128, 64, 4, 2),
    512: ('dequant', 128, 128, 64, 4, 2),
}
FP8_LINEAR_TILES["hip"] = {shape: HIP_LINEAR_BUCKETS for shape in M3_LINEAR_SHAPES}

FP8_MOE_TILES: dict[str, dict[tuple[int, int, int], dict[int, MoEEntry]]] = {
    # backend -> (hidden, intermediate, routed experts) -> {token bucket: entry}. "cuda": tuned/fp8.json's "moe"
    # table: m3-slice's experts (top-4 + the folded shared expert) on an H200 (the runs and times in its
    # "provenance").
    "cuda": bucket_tables(tuned.load("fp8"), ("moe",))["moe"],
}

HIP_MOE_BUCKETS: dict[int, MoEEntry] = {
    # By the rule in configs.py: one token on the vector ALUs ("gemv": 8 weight rows x 512 columns per program, 16
    # fp8 bytes per lane); up to 256 tokens (<= 8 rows per routed expert) 16-row "acc" tiles; 1024 tokens 32-row
    # "bcast" tiles; 4096 and more 64-row "bcast" tiles, never "scaled" (its tiles outgrow the LDS).
    1: ('gemv', 16, 8, (8, 512, 4, 1), (8, 512, 4, 1)),
    256: ('acc', 16, 8, (32, 128, 4, 2), (64, 128, 4, 2)),
    1024: ('bcast', 32, 8, (32, 128, 4, 2), (64, 128, 4, 2)),
    4096: ('bcast', 64, 8, (64, 64, 4, 2), (128, 64, 4, 2)),
}
FP8_MOE_TILES["hip"] = {shape: HIP_MOE_BUCKETS for shape in M3_EXPERT_SHAPES}


def _parse_tuned_file(data: dict) -> dict:
    """{'linear': {...}, 'moe': {...}} from a tune_fp8.py JSON file (keys "N,K" / "H,I,E", buckets as strings)."""
    return bucket_tables(data, ("linear", "moe"))


def tuned_tables() -> dict | None:
    """$NANOSERVE_FP8_TUNED_CONFIG's tables ({'linear': ..., 'moe': ...}), or None when unset."""
    return tuned_file(TUNED_CONFIG_ENV, "scripts/tune_fp8.py", ("linear", "moe", "meta"), _parse_tuned_file)


def _table(kind: str, backend: str) -> dict:
    base = (FP8_LINEAR_TILES if kind == "linear" else FP8_MOE_TILES).get(backend, {})
    tables = tuned_tables() if backend == "cuda" else None
    if tables is None:
        return base
    tuned = tables[kind]
    return {shape: {**base.get(shape, {}), **tuned.get(shape, {})} for shape in {*base, *tuned}}


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
