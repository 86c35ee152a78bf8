"""The MXFP8 weight format of M3 checkpoints: fp8 e4m3 weights plus one E8M0 exponent per 1x32 block.

A quantized weight `W` [out, in] is stored as `W` (float8_e4m3fn, same shape) and `W_scale_inv` (uint8
[out, in / 32]) with W[o, i] = fp8[o, i] * 2^(S[o, i // 32] - 127). The rule itself, `dequantize_mxfp8`, lives in
kernels/reference.py beside the fp8 kernels it is the reference of; the loader keeps the fp8 weights (the
`mxfp8_weights` switch) or dequantises them with it, and the preset checkpoint maker writes the format with
`quantize_mxfp8` (or `QuantizeOnLoad` serves bf16 weights as MXFP8).
"""

from __future__ import annotations

import torch

from nanoserve.kernels.reference import dequantize_mxfp8  # noqa: F401 - the rule, beside the kernels' other references

MXFP8_BLOCK = 32
E8M0_BIAS = 127
FP8_E4M3_MAX = 448.0


def quantize_mxfp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [out, in] -> (fp8 e4m3 [out, in], uint8 E8M0 exponents [out, in/32]) with W ~= fp8 * 2^(scale - 127).
    Each 1x32 block's scale is the power of two that brings its max |w| within fp8's range."""
    out_f, in_f = w.shape
    if in_f % MXFP8_BLOCK:
        raise ValueError(f"MXFP8 needs the input dim to be a multiple of {MXFP8_BLOCK}, got {in_f}")
    blocks = w.float().reshape(out_f, in_f // MXFP8_BLOCK, MXFP8_BLOCK)
    amax = blocks.abs().amax(-1).clamp(min=2.0 ** -100)
    exp = torch.ceil(torch.log2(amax / FP8_E4M3_MAX)).clamp(-E8M0_BIAS, 127)
    q = (blocks / torch.exp2(exp)[..., None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(out_f, in_f), (exp + E8M0_BIAS).to(torch.uint8)


QUANT_METHODS = ("mxfp8",)
"""`quantization_config.quant_method` values nanoserve reads (and `quantization=` values it accepts)."""
UNQUANTIZED_NAMES = ("embed_tokens", "lm_head", "block_sparse_moe.gate.weight")
"""Matrices an MXFP8 checkpoint keeps in 16/32 bits (its `ignored_layers`); norms and biases are 1-D."""


def is_quantized_matrix(key: str, shape: tuple[int, ...]) -> bool:
    """Does an MXFP8 checkpoint store this tensor as fp8 + scales? Every projection matrix but the ignored ones."""
    return len(shape) == 2 and not any(n in key for n in UNQUANTIZED_NAMES)


def block_columns(cols: slice, width: int) -> tuple[int, int, int, int]:
    """(c0, c1, b0, b1): a contiguous column range and the 32-column scale blocks [b0, b1) that cover it."""
    c0, c1, step = cols.indices(width)
    if step != 1:
        raise ValueError(f"MXFP8 weights can only be read in contiguous column ranges, got step {step}")
    return c0, c1, c0 // MXFP8_BLOCK, -(-c1 // MXFP8_BLOCK)


class QuantizeOnLoad:
    """A 16/32-bit weight source served as if the checkpoint held it in MXFP8 (`quantization="mxfp8"` on a bf16
    checkpoint or a preset drawn on the device): `read_mxfp8` quantises the requested rows and column blocks,
    slicing returns them quantised and dequantised again - so the fp8 and the dequantised path see the same
    weights as they would from a real MXFP8 checkpoint."""

    def __init__(self, source):
        self.source, self.shape = source, tuple(source.shape)

    def read_mxfp8(self, rows: slice, cols: slice) -> tuple[torch.Tensor, torch.Tensor]:
        c0, c1, b0, _ = block_columns(cols, self.shape[1])
        if c0 != b0 * MXFP8_BLOCK:
            raise ValueError(f"MXFP8 weights can only be read from a {MXFP8_BLOCK}-column block start, got {c0}")
        return quantize_mxfp8(self.source[rows, c0:c1])

    def __getitem__(self, index) -> torch.Tensor:
        rows, cols = (index if isinstance(index, tuple) else (index, slice(None)))
        c0, c1, b0, b1 = block_columns(cols, self.shape[1])
        q, s = quantize_mxfp8(self.source[rows, b0 * MXFP8_BLOCK: min(b1 * MXFP8_BLOCK, self.shape[1])])
        w = dequantize_mxfp8(q, s, torch.bfloat16)
        return w[..., c0 - b0 * MXFP8_BLOCK: c1 - b0 * MXFP8_BLOCK]
