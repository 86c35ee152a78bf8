"""M3's mixture of experts: an fp32 sigmoid router with a selection-only correction bias, top-k routed SwiGLU-OAI
experts scaled by routed_scaling_factor, plus one always-on shared expert."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from nanoserve.config import Optimizations
from nanoserve.kernels import reference, triton_usable
from nanoserve.model.layers.linear import (
    WeightSource,
    check_shape,
    copy_into,
    linear,
    one_row_gemv,
    read_mxfp8,
    replicated_parameter,
    weight_parameters,
)
from nanoserve.model.layers.mlp import SwiGLUOAIMLP
from nanoserve.model.m3_config import M3Config
from nanoserve.parallel_state import all_reduce, get_tp, shard_range


class M3MoE(nn.Module):
    """Routed experts + shared expert, sharded either way:

    - tensor-parallel experts (default): every rank holds every expert, a slice of its intermediate dim;
    - expert parallel (`enable_expert_parallel`): every rank holds whole experts, a slice of the expert list;
      `expert_map` sends other ranks' experts to -1 (skipped).

    Both end in one all-reduce of (routed * scale + shared). When the shared expert's local shape equals a routed
    expert's, it is stored as one extra slot at the end of w13/w2, so the fused kernel can run it in the same
    launch (`fold_shared_expert`); the reference path computes it from that slot as a plain MLP.

    MXFP8 (quant="mxfp8"): w13 / w2 hold fp8 e4m3 and w13_scale / w2_scale their E8M0 exponents (one per 32
    input columns), sharded exactly like the weights; both paths take them (the fused kernel dequantises in
    registers, the reference per expert).
    """

    trace: Callable[..., None] | None = None
    """Optional tracing hook, for teaching and debugging (set it with M3ForCausalLM.set_trace): called as
    trace("moe_route", topk_ids=, topk_weights=) once the layer has routed (and, with fused routing, run) its
    experts. Eager mode only; None costs one check."""

    def __init__(self, cfg: M3Config, opts: Optimizations, dtype: torch.dtype, device: torch.device | str,
                 quant: str | None = None):
        super().__init__()
        if cfg.n_shared_experts != 1:
            raise ValueError(f"n_shared_experts={cfg.n_shared_experts}: nanoserve supports exactly 1 (M3)")
        tp = get_tp()
        self.opts = opts
        self.cfg = cfg
        self.top_k = cfg.num_experts_per_tok
        self.num_experts = cfg.num_local_experts
        hidden = cfg.hidden_size
        if tp.expert_parallel:
            self.expert_start, self.expert_end = shard_range(cfg.num_local_experts)
            self.inter_start, self.inter_end = 0, cfg.intermediate_size
        else:
            self.expert_start, self.expert_end = 0, cfg.num_local_experts
            self.inter_start, self.inter_end = shard_range(cfg.intermediate_size)
        self.num_local = self.expert_end - self.expert_start
        inter_local = self.inter_end - self.inter_start
        self.shared_start, self.shared_end = shard_range(cfg.shared_intermediate_size)
        self.shared_in_stack = (self.shared_end - self.shared_start) == inter_local
        slots = self.num_local + int(self.shared_in_stack)
        self.w13, self.w13_scale = weight_parameters(2 * inter_local, hidden, dtype, device, quant, (slots,))
        self.w2, self.w2_scale = weight_parameters(hidden, inter_local, dtype, device, quant, (slots,))
        shared = ("shared_gate", "shared_up") if self.shared_in_stack else ()
        self.w13.weight_loader, self.w13.weight_shards = self._load_stacked, ("gate", "up") + shared
        self.w2.weight_loader = self._load_stacked
        self.w2.weight_shards = ("down",) + (("shared_down",) if self.shared_in_stack else ())
        self.shared = None if self.shared_in_stack else SwiGLUOAIMLP(
            hidden, cfg.shared_intermediate_size, cfg.swiglu_alpha, cfg.swiglu_limit, dtype, device, reduce=False,
            quant=quant, opts=opts)
        self.gate = replicated_parameter((cfg.num_local_experts, hidden), torch.float32, device)
        self.e_score_correction_bias = replicated_parameter((cfg.num_local_experts,), torch.float32, device)
        if tp.expert_parallel and tp.size > 1:
            emap = torch.full((cfg.num_local_experts,), -1, dtype=torch.int32)
            emap[self.expert_start: self.expert_end] = torch.arange(self.num_local, dtype=torch.int32)
            self.register_buffer("expert_map", emap.to(device), persistent=False)
        else:
            self.expert_map = None

    # -- forward ------------------------------------------------------------------------------------------
    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """[T, E] fp32: the router GEMM runs in fp32 on fp32 weights (one decode row: the GEMV, switch
        `triton_gemv`, which widens x in registers)."""
        y = one_row_gemv(x, self.gate, None, self.opts, out_dtype=torch.float32)
        return torch.nn.functional.linear(x.float(), self.gate) if y is None else y

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_weights [T, k] fp32, topk_ids [T, k] int32), the torch reference routing."""
        return reference.route(self.router_logits(x), self.e_score_correction_bias, self.top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        alpha, limit, scale = cfg.swiglu_alpha, cfg.swiglu_limit, cfg.routed_scaling_factor
        n = self.num_local
        s13, s2 = self.w13_scale, self.w2_scale
        if self.opts.fused_moe and triton_usable(x):
            from nanoserve.kernels.moe import fused_moe, fused_route_moe, mxfp8_thresholds
            from nanoserve.kernels.moe_route import route_align_fits

            fold = self.opts.fold_shared_expert and self.shared_in_stack
            used = slice(None) if fold else slice(0, n)
            kernel_args = dict(alpha=alpha, limit=limit, expert_map=self.expert_map, routed_scaling_factor=scale,
                               fold_shared=fold, w13_scale=None if s13 is None else s13[used],
                               w2_scale=None if s2 is None else s2[used], tma=self.opts.moe_tma)
            if self.opts.fused_routing and route_align_fits(x.shape[0], self.top_k + int(fold)):
                out, topk_weights, topk_ids = fused_route_moe(
                    x, self.router_logits(x), self.e_score_correction_bias, self.w13[used], self.w2[used],
                    top_k=self.top_k, **kernel_args)
            else:
                topk_weights, topk_ids = self.route(x)
                out = fused_moe(x, self.w13[used], self.w2[used], topk_weights, topk_ids, **kernel_args,
                                **mxfp8_thresholds(self.opts))
            if not fold:
                out = out + self._shared(x)
        else:
            topk_weights, topk_ids = self.route(x)
            routed = reference.moe_experts(x, self.w13[:n], self.w2[:n], topk_ids, topk_weights, alpha, limit,
                                           self.expert_map, None if s13 is None else s13[:n],
                                           None if s2 is None else s2[:n])
            out = routed * scale + self._shared(x)
        if self.trace is not None:
            self.trace("moe_route", topk_ids=topk_ids, topk_weights=topk_weights)
        return all_reduce(out) if get_tp().size > 1 else out

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        if self.shared is not None:
            return self.shared(x)
        inter = self.w2.shape[-1]
        gate_up = linear(x, self.w13[-1], None if self.w13_scale is None else self.w13_scale[-1], self.opts)
        act = reference.swiglu_oai(gate_up[:, :inter], gate_up[:, inter:], self.cfg.swiglu_alpha,
                                   self.cfg.swiglu_limit).to(x.dtype)
        return linear(act, self.w2[-1], None if self.w2_scale is None else self.w2_scale[-1], self.opts)

    # -- checkpoint ---------------------------------------------------------------------------------------
    def _load_stacked(self, param: torch.Tensor, source: WeightSource, shard_id: str, name: str = "",
                      expert: int | None = None) -> None:
        """weight_loader of w13 / w2: a routed expert's w1 ("gate"), w3 ("up") or w2 ("down") into its slot, or
        the shared expert's gate/up/down projection ("shared_gate", ...) into the extra slot at the end."""
        cfg = self.cfg
        if shard_id.startswith("shared_"):
            slot, rows, (start, end) = self.num_local, cfg.shared_intermediate_size, (self.shared_start,
                                                                                   self.shared_end)
        else:
            if expert is None or not self.expert_start <= expert < self.expert_end:
                return  # another rank's expert: expected in the checkpoint, not read here
            slot, rows, (start, end) = expert - self.expert_start, cfg.intermediate_size, (self.inter_start,
                                                                                            self.inter_end)
        part = shard_id.removeprefix("shared_")
        if part == "down":
            check_shape(name, source.shape, (cfg.hidden_size, rows))
            dst, scale, index = param[slot], self.w2_scale, (slice(None), slice(start, end))
            scale_dst = None if scale is None else scale.data[slot]
        else:
            check_shape(name, source.shape, (rows, cfg.hidden_size))
            inter_local = self.inter_end - self.inter_start
            half = slice(0, inter_local) if part == "gate" else slice(inter_local, 2 * inter_local)
            dst, scale, index = param[slot, half], self.w13_scale, (slice(start, end), slice(None))
            scale_dst = None if scale is None else scale.data[slot, half]
        if scale_dst is None:
            copy_into(dst, source[index])
        else:  # fp8 rows/columns and their E8M0 scales, sliced alike
            q, s = read_mxfp8(source, *index)
            copy_into(dst, q)
            copy_into(scale_dst, s)
