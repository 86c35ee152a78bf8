"""M3's mixture of experts: an fp32 sigmoid router with a selection-only correction bias, top-k routed SwiGLU-OAI
experts scaled by routed_scaling_factor, plus one always-on shared expert (m3_spec.md 2.6)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from nanoserve.config import Optimizations
from nanoserve.kernels import reference, triton_usable
from nanoserve.model.layers.linear import (WeightSource, check_shape, copy_into, linear, read_mxfp8,
                                           replicated_parameter, weight_parameters)
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
    trace("moe_route", topk_ids=, topk_weights=) right after routing. Eager mode only; None costs one check."""

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
    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_weights [T, k] fp32, topk_ids [T, k] int32); the router GEMM runs in fp32 on fp32 weights."""
        logits = torch.nn.functional.linear(x.float(), self.gate)
        return reference.route(logits, self.e_score_correction_bias, self.top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        topk_weights, topk_ids = self.route(x)
        if self.trace is not None:
            self.trace("moe_route", topk_ids=topk_ids, topk_weights=topk_weights)
        alpha, limit, scale = cfg.swiglu_alpha, cfg.swiglu_limit, cfg.routed_scaling_factor
        n = self.num_local
        s13, s2 = self.w13_scale, self.w2_scale
        if self.opts.fused_moe and triton_usable(x):
            from nanoserve.kernels.moe import fused_moe

            fold = self.opts.fold_shared_expert and self.shared_in_stack
            used = slice(None) if fold else slice(0, n)
            out = fused_moe(x, self.w13[used], self.w2[used], topk_weights, topk_ids, alpha=alpha, limit=limit,
                            expert_map=self.expert_map, routed_scaling_factor=scale, fold_shared=fold,
                            w13_scale=None if s13 is None else s13[used], w2_scale=None if s2 is None else s2[used])
            if not fold:
                out = out + self._shared(x)
        else:
            routed = reference.moe_experts(x, self.w13[:n], self.w2[:n], topk_ids, topk_weights, alpha, limit,
                                           self.expert_map, None if s13 is None else s13[:n],
                                           None if s2 is None else s2[:n])
            out = routed * scale + self._shared(x)
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
    def load_map(self, prefix: str) -> dict[str, Callable[[WeightSource], None]]:
        """Checkpoint key -> loader, for the real names under `...block_sparse_moe.`."""
        cfg = self.cfg
        hidden, inter, shared = cfg.hidden_size, cfg.intermediate_size, cfg.shared_intermediate_size
        inter_local = self.inter_end - self.inter_start
        out: dict[str, Callable[[WeightSource], None]] = {
            f"{prefix}.gate.weight":
                lambda s, n=f"{prefix}.gate.weight": self.gate.weight_loader(self.gate.data, s, "", n),
            f"{prefix}.e_score_correction_bias":
                lambda s, n=f"{prefix}.e_score_correction_bias": self.e_score_correction_bias.weight_loader(
                    self.e_score_correction_bias.data, s, "", n),
        }

        def up_rows(slot: int, which: str, rng: tuple[int, int], rows: int):
            def load(src: WeightSource, name: str) -> None:
                check_shape(name, src.shape, (rows, hidden))
                half = slice(0, inter_local) if which == "gate" else slice(inter_local, 2 * inter_local)
                if self.w13_scale is None:
                    copy_into(self.w13.data[slot, half], src[rng[0]: rng[1]])
                else:
                    q, s = read_mxfp8(src, slice(*rng), slice(None))
                    copy_into(self.w13.data[slot, half], q)
                    copy_into(self.w13_scale.data[slot, half], s)
            return load

        def down_cols(slot: int, rng: tuple[int, int], cols: int):
            def load(src: WeightSource, name: str) -> None:
                check_shape(name, src.shape, (hidden, cols))
                if self.w2_scale is None:
                    copy_into(self.w2.data[slot], src[:, rng[0]: rng[1]])
                else:
                    q, s = read_mxfp8(src, slice(None), slice(*rng))
                    copy_into(self.w2.data[slot], q)
                    copy_into(self.w2_scale.data[slot], s)
            return load

        irange = (self.inter_start, self.inter_end)
        for e in range(cfg.num_local_experts):
            p = f"{prefix}.experts.{e}"
            if self.expert_start <= e < self.expert_end:
                slot = e - self.expert_start
                loaders = {"w1": up_rows(slot, "gate", irange, inter), "w3": up_rows(slot, "up", irange, inter),
                           "w2": down_cols(slot, irange, inter)}
            else:  # another rank's expert: expected in the checkpoint, not read here
                loaders = {w: (lambda src, name: None) for w in ("w1", "w3", "w2")}
            for w, fn in loaders.items():
                out[f"{p}.{w}.weight"] = lambda s, fn=fn, n=f"{p}.{w}.weight": fn(s, n)
        sp = f"{prefix}.shared_experts"
        if self.shared is not None:
            for name, (mod, shard) in {"gate_proj": (self.shared.gate_up_proj, "gate"),
                                       "up_proj": (self.shared.gate_up_proj, "up"),
                                       "down_proj": (self.shared.down_proj, "")}.items():
                out[f"{sp}.{name}.weight"] = (lambda s, m=mod, sh=shard, n=f"{sp}.{name}.weight":
                                              m.weight_loader(m.weight.data, s, sh, n))
        else:
            srange = (self.shared_start, self.shared_end)
            slot = self.num_local
            for name, fn in {"gate_proj": up_rows(slot, "gate", srange, shared),
                             "up_proj": up_rows(slot, "up", srange, shared),
                             "down_proj": down_cols(slot, srange, shared)}.items():
                out[f"{sp}.{name}.weight"] = lambda s, fn=fn, n=f"{sp}.{name}.weight": fn(s, n)
        return out

