"""One fused-MoE problem at a model's widths, for the tuner (scripts/tune_moe.py) and the GPU checks
(tests/kernels/test_gpu_kernels.py): expert weights, inputs with a uniform random routing, the fused kernel as the model
calls it, and an fp32 per-expert computation to hold it against.

The weights are the routed experts plus the shared expert as the last slot (M3 folds it into the fused kernel),
drawn N(0, 0.02) like m3-slice's, one expert at a time (no fp32 copy of the whole 14.6 GB stack at m3-slice
widths). Inputs are unit-scale, like a normed hidden state. On the CPU everything is fp32 (Triton's interpreter
computes bf16 wrongly).
"""

from __future__ import annotations

import torch

from nanoserve.kernels import reference
from nanoserve.kernels.moe import MoEConfig, fused_moe

ALPHA, LIMIT, SCALE = 1.702, 7.0, 2.0
"""M3's SwiGLU-OAI constants and routed_scaling_factor."""
WEIGHT_STD = 0.02
BF16_REL_TOL = 2e-2
"""bf16 tolerance on max |kernel - fp32| / max |fp32| (activations and each expert's output are rounded)."""


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref|."""
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max())


class MoEProblem:
    """Expert weights (routed + shared as the last slot) and the inputs of each token count."""

    def __init__(self, hidden: int, inter: int, experts: int, top_k: int, device: str | torch.device,
                 seed: int = 0):
        self.hidden, self.inter, self.experts, self.top_k = hidden, inter, experts, top_k
        self.device = torch.device(device)
        self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        gen = torch.Generator(device=self.device).manual_seed(seed)
        slots = experts + 1
        self.w13 = torch.empty(slots, 2 * inter, hidden, dtype=self.dtype, device=self.device)
        self.w2 = torch.empty(slots, hidden, inter, dtype=self.dtype, device=self.device)
        for e in range(slots):
            self.w13[e].normal_(0.0, WEIGHT_STD, generator=gen)
            self.w2[e].normal_(0.0, WEIGHT_STD, generator=gen)
        self.gen = gen

    @property
    def expert_bytes(self) -> int:
        return 3 * self.hidden * self.inter * self.w13.element_size()

    def inputs(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] and a uniform random routing (weights [T, k] fp32, ids [T, k])."""
        x = torch.randn(tokens, self.hidden, device=self.device, generator=self.gen).to(self.dtype)
        logits = torch.randn(tokens, self.experts, device=self.device, generator=self.gen)
        weights, ids = reference.route(logits, torch.zeros(self.experts, device=self.device), self.top_k)
        return x, weights, ids

    def fused(self, x, weights, ids, fold: bool = True, config: MoEConfig | None = None) -> torch.Tensor:
        """The fused kernel: routed experts, plus the shared expert folded in when `fold`."""
        w13, w2 = (self.w13, self.w2) if fold else (self.w13[: self.experts], self.w2[: self.experts])
        return fused_moe(x, w13, w2, weights, ids, alpha=ALPHA, limit=LIMIT, routed_scaling_factor=SCALE,
                         fold_shared=fold, config=config)

    def exact(self, x, weights, ids, fold: bool = True) -> torch.Tensor:
        """fp32 per-expert computation from the same (rounded) weights and inputs."""
        xf = x.float()
        out = torch.zeros_like(xf)
        for e in ids.unique().tolist():
            token, slot = torch.where(ids == e)
            out.index_add_(0, token, self.expert_fp32(xf[token], e) * weights[token, slot, None])
        out *= SCALE
        return out + self.expert_fp32(xf, self.experts) if fold else out

    def expert_fp32(self, xf: torch.Tensor, e: int) -> torch.Tensor:
        gate_up = xf @ self.w13[e].float().T
        act = reference.swiglu_oai(gate_up[:, : self.inter], gate_up[:, self.inter:], ALPHA, LIMIT)
        return act @ self.w2[e].float().T

    def flops(self, tokens: int, shared: bool = True) -> float:
        return 2.0 * 3 * self.hidden * self.inter * tokens * (self.top_k + int(shared))

    def bytes(self, ids: torch.Tensor, shared: bool = True) -> float:
        """The weights of the distinct experts a call touches."""
        return float((int(ids.unique().numel()) + int(shared)) * self.expert_bytes)
