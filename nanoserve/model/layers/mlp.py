"""The dense SwiGLU-OAI MLP (M3's first layers, and the MoE's shared expert)."""

from __future__ import annotations

import torch
import torch.nn as nn

from nanoserve.config import Optimizations
from nanoserve.kernels import triton_usable
from nanoserve.kernels.reference import swiglu_oai
from nanoserve.model.layers.linear import MergedColumnParallelLinear, OutputPart, RowParallelLinear


class SwiGLUOAIMLP(nn.Module):
    """down(swiglu_oai(gate(x), up(x))). gate|up are one column-parallel GEMM, down is row-parallel.
    With reduce=False the caller does the all-reduce (the MoE sums routed + shared first). quant="mxfp8": fp8
    weights with E8M0 scales (layers/linear.py)."""

    def __init__(self, hidden_size: int, intermediate_size: int, alpha: float, limit: float, dtype: torch.dtype,
                 device: torch.device | str, reduce: bool = True, quant: str | None = None,
                 opts: Optimizations | None = None):
        super().__init__()
        self.alpha, self.limit, self.opts = alpha, limit, opts
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [OutputPart.split("gate", intermediate_size), OutputPart.split("up", intermediate_size)],
            dtype, device, quant, opts)
        self.intermediate_local = self.gate_up_proj.parts["gate"].local_rows
        start, end = self.gate_up_proj.parts["gate"].start, self.gate_up_proj.parts["gate"].end
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, dtype, device, (start, end), reduce,
                                           quant, opts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if (self.opts is None or self.opts.fused_swiglu) and triton_usable(gate_up):
            from nanoserve.kernels.swiglu import swiglu_oai as fused

            return self.down_proj(fused(gate_up, self.alpha, self.limit))
        gate, up = gate_up[:, : self.intermediate_local], gate_up[:, self.intermediate_local:]
        return self.down_proj(swiglu_oai(gate, up, self.alpha, self.limit).to(x.dtype))
