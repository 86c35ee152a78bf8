"""LayerNorm, optionally fused with the residual add before it, in Triton (switch `fused_layer_norm`; reference:
`reference.layer_norm` and `reference.add_layer_norm`).

The vision tower's encoder layer is `x += attn(ln1(x)); x += mlp(ln2(x))`. Carrying the residual stream apart
from the branch output turns each "add, then norm" into one pass over the rows: `add_layer_norm` reads the branch
output and the residual, stores their sum rounded to the activation dtype (the new residual, as the reference's
`x + residual` rounds it) and writes LayerNorm of that sum. PyTorch takes two kernels (the add and F.layer_norm)
and one more round trip of the [tokens, 1280] activations through memory.

One program normalises BLOCK_M rows, each held whole in registers (BLOCK_D = the row width rounded up to a power
of two, masked): mean, then the biased variance of the centred row, both in fp32, then (x - mean) * rstd * w + b.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanoserve.kernels.configs import backend

ROWS_PER_PROGRAM = {"cuda": (4, 4), "hip": (4, 4), "interpret": (16, 1)}
"""backend -> (rows per program, warps). A 1280-wide row is 2.5 KiB in bf16: four rows per program keep every
warp busy with whole rows and give ~37k programs for a 1344 x 1344 image batch of 16."""


@triton.jit(do_not_specialize=["n_rows"])
def _layer_norm_kernel(x_ptr, res_ptr, w_ptr, b_ptr, y_ptr, res_out_ptr, n_rows, width, eps,
                       stride_x, stride_res, stride_y, stride_res_out,
                       HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < width
    mask = (rows < n_rows)[:, None] & col_ok[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + rows[:, None] * stride_res + cols[None, :], mask=mask, other=0.0)
        x = x + r  # in the activation dtype, as the reference adds
        tl.store(res_out_ptr + rows[:, None] * stride_res_out + cols[None, :], x, mask=mask)
    xf = x.to(tl.float32)
    mean = tl.sum(xf, 1) / width
    centred = tl.where(mask, xf - mean[:, None], 0.0)
    rstd = tl.rsqrt(tl.sum(centred * centred, 1) / width + eps)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = centred * rstd[:, None] * w[None, :] + b[None, :]
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor,
            eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    width = x.shape[-1]
    x2 = x.reshape(-1, width)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty_like(x2)
    res2 = res_out = None
    if residual is not None:
        res2 = residual.reshape(-1, width)
        if res2.stride(-1) != 1:
            res2 = res2.contiguous()
        res_out = torch.empty_like(x2)
    n_rows = x2.shape[0]
    block_m, warps = ROWS_PER_PROGRAM[backend(x.device)]
    if n_rows:
        _layer_norm_kernel[(triton.cdiv(n_rows, block_m),)](
            x2, res2 if res2 is not None else x2, weight, bias, y, res_out if res_out is not None else y,
            n_rows, width, eps, x2.stride(0), res2.stride(0) if res2 is not None else 0, y.stride(0),
            res_out.stride(0) if res_out is not None else 0,
            HAS_RESIDUAL=residual is not None, BLOCK_M=block_m, BLOCK_D=triton.next_power_of_2(width),
            num_warps=warps)
    return y.view(x.shape), (res_out.view(x.shape) if res_out is not None else None)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """`reference.layer_norm` in one launch: x [..., D], weight / bias [D] (fp32)."""
    return _launch(x, None, weight, bias, eps)[0]


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.add_layer_norm` in one launch: (LayerNorm(x + residual), x + residual)."""
    y, res = _launch(x, residual, weight, bias, eps)
    assert res is not None
    return y, res
