"""The MXFP8 weight format of M3 checkpoints: fp8 e4m3 weights plus one E8M0 exponent per 1x32 block.

A quantized weight `W` [out, in] is stored as `W` (float8_e4m3fn, same shape) and `W_scale_inv` (uint8
[out, in / 32]) with W[o, i] = fp8[o, i] * 2^(S[o, i // 32] - 127). The loader dequantises with
`dequantize_mxfp8`; the preset checkpoint maker writes the format with `quantize_mxfp8`.
"""

from __future__ import annotations

import torch

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


def dequantize_mxfp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Inverse of quantize_mxfp8 (and the checkpoint's rule): W[o, i] = fp8[o, i] * 2^(S[o, i // 32] - 127)."""
    factor = torch.exp2(scale.float() - E8M0_BIAS).repeat_interleave(MXFP8_BLOCK, dim=-1)[..., : q.shape[-1]]
    return (q.float() * factor).to(dtype)
