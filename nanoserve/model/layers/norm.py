"""Gemma RMSNorm (scale by 1 + w, fp32 inside), with an optional fused residual add."""

from __future__ import annotations

import torch
import torch.nn as nn

from nanoserve.config import Optimizations
from nanoserve.kernels import reference, triton_usable
from nanoserve.model.layers.linear import replicated_parameter


class GemmaRMSNorm(nn.Module):
    """y = x * rsqrt(mean(x^2) + eps) * (1 + w). The stored w is the zero-centred offset, as in the checkpoint.

    Called as norm(x) it normalises x (one kernel when `fused_rmsnorm` is on); called as norm(x, residual) it first adds
    x into the residual stream and returns (norm(x + residual), x + residual) - one fused kernel when
    `fused_add_rmsnorm` is on."""

    def __init__(self, dim: int, eps: float, opts: Optimizations, device: torch.device | str):
        super().__init__()
        self.eps = eps
        self.opts = opts
        self.weight = replicated_parameter((dim,), torch.float32, device)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            if self.opts.fused_rmsnorm and triton_usable(x):
                from nanoserve.kernels.norm_rope import fused_rmsnorm

                return fused_rmsnorm(x, self.weight, self.eps)
            return reference.gemma_rmsnorm(x, self.weight, self.eps)
        if self.opts.fused_add_rmsnorm and triton_usable(x):
            from nanoserve.kernels.norm_rope import fused_add_rmsnorm

            return fused_add_rmsnorm(x, residual, self.weight, self.eps)
        return reference.add_gemma_rmsnorm(x, residual, self.weight, self.eps)
