"""M3's clamped SwiGLU-OAI in one launch (switch `fused_swiglu`), for the dense MLP (M3's first layers, and the
shared expert when it is not folded into the fused MoE):

    act = min(gate, limit) * sigmoid(alpha * min(gate, limit)) * (clamp(up, -limit, limit) + 1)

from the gate|up output of the merged projection, [T, 2I] -> [T, I], in fp32 and rounded once to the activation
dtype. The reference (`kernels/reference.py` swiglu_oai, then the cast) is about ten element-wise torch kernels,
each reading and writing the whole [T, I] in fp32: a dozen launches in a one-token decode step, and several times
the bytes of the activation in a prefill. The fused MoE applies the same function in its GEMM epilogue
(`moe._swiglu_store`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024
"""Columns per program (one row per grid row)."""


@triton.jit
def _swiglu_oai_kernel(gu_ptr, out_ptr, inter, stride_gu, stride_out, alpha, limit, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * stride_gu + inter + cols, mask=mask, other=0.0).to(tl.float32)
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    act = gate * tl.sigmoid(alpha * gate) * (up + 1.0)
    tl.store(out_ptr + row * stride_out + cols, act.to(out_ptr.dtype.element_ty), mask=mask)


def swiglu_oai(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gate_up [T, 2I] (gate columns first, then up; rows may be strided) -> act [T, I] in gate_up's dtype."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [tokens, 2 * intermediate], got shape {tuple(gate_up.shape)}")
    if gate_up.stride(1) != 1:
        gate_up = gate_up.contiguous()
    tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
    if tokens:
        _swiglu_oai_kernel[(tokens, triton.cdiv(inter, BLOCK))](
            gate_up, out, inter, gate_up.stride(0), out.stride(0), float(alpha), float(limit), BLOCK=BLOCK)
    return out
