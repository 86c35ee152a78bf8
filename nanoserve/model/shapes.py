"""The weight shapes one tensor-parallel rank multiplies by, read off the model the engine builds for that rank (on
the meta device: shapes and dtypes, no memory). The kernel-tuning scripts time these shapes, so one GPU can tune
the tables for every rank layout: m3-slice has M3's widths, so `tp_size=8` gives the shapes each GPU of an 8-GPU
M3 deployment runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from nanoserve.model.m3_config import M3Config
from nanoserve.parallel_state import get_tp, set_tp


@dataclass(frozen=True)
class RankShapes:
    """What rank 0 of a tensor-parallel layout holds, by kind of product."""

    projections: dict[str, tuple[int, int]]
    """(N, K) of each distinct 2-D weight a decode step multiplies by - attention and dense-MLP projections, the
    MoE router, the LM head - keyed by the first parameter that has it, shortened ("L0 qkv_proj": layer 0's
    self_attn.qkv_proj; the embedding is a lookup: left out)."""
    experts: tuple[int, int, int]
    """The fused MoE's table key: (hidden, intermediate columns per expert on this rank, routed experts on this
    rank)."""
    router: str | None
    """The key of the MoE router in `projections` (fp32 weight, fp32 output), if the model has MoE layers."""
    lm_head: ClassVar[str] = "lm_head"
    """The key of the LM head (bf16, never quantized): the name `_label` gives it."""

    @property
    def quantizable(self) -> dict[str, tuple[int, int]]:
        """The projections an MXFP8 model holds in fp8: all but the router and the LM head."""
        return {k: v for k, v in self.projections.items() if k not in (self.router, self.lm_head)}


def rank_shapes(cfg: M3Config, tp_size: int = 1, expert_parallel: bool = False) -> RankShapes:
    """Build rank 0 of `tp_size` on the meta device and read its weights' shapes."""
    from nanoserve.model.m3 import M3ForCausalLM

    before = get_tp()
    set_tp(0, tp_size, expert_parallel=expert_parallel)
    try:
        model = M3ForCausalLM(cfg, None, torch.bfloat16, "meta")
    finally:
        set_tp(before.rank, before.size, before.group, before.expert_parallel)
    experts = (cfg.hidden_size, 0, 0)
    moe = next((m for m in model.modules() if hasattr(m, "shared_in_stack")), None)
    if moe is not None:  # the expert stack [slots, 2I, H]; its last slot is the shared expert when it is stacked
        slots, two_inter, hidden = moe.w13.shape
        experts = (int(hidden), int(two_inter) // 2, int(slots) - int(moe.shared_in_stack))
    projections: dict[str, tuple[int, int]] = {}
    router = None
    for name, p in model.named_parameters():
        if name.startswith("embed_tokens") or p.dim() != 2 or tuple(p.shape) in projections.values():
            continue
        key = _label(name)
        projections[key] = (int(p.shape[0]), int(p.shape[1]))
        if p.dtype == torch.float32 and name.endswith("mlp.gate"):
            router = key
    return RankShapes(projections, experts, router)


def _label(name: str) -> str:
    """"layers.1.self_attn.qkv_proj.weight" -> "L1 qkv_proj"; "lm_head.weight" -> "lm_head"."""
    parts = name.removesuffix(".weight").split(".")
    if parts[0] != "layers":
        return ".".join(parts)
    rest = [p for p in parts[2:] if p not in ("self_attn", "mlp")]
    return f"L{parts[1]} " + ".".join(rest)
