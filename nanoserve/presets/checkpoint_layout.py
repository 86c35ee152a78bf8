"""The tensors of an M3 text checkpoint by their released names, and random weights for them.

`checkpoint_specs(cfg)` lists every text tensor with its shape and role; the checkpoint maker writes them and
the benchmark draws them straight into device memory, both through `random_tensors`. `random_vision_tensors`
draws a vision tower, projector and merger under their released names (a preset that sees: m3-tiny-vl).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from nanoserve.model.checkpoint_names import VISION_WEIGHT_NAMES, name_map
from nanoserve.model.m3_config import M3Config
from nanoserve.model.vision.config import VisionConfig
from nanoserve.model.vision.model import M3VisionModel

PROJ, NORM, ROUTER, BIAS = "proj", "norm", "router", "bias"


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    role: str  # PROJ (bf16 matrix), NORM (bf16 zero-centred offset), ROUTER (fp32 matrix), BIAS (fp32 vector)

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32 if self.role in (ROUTER, BIAS) else torch.bfloat16


def checkpoint_specs(cfg: M3Config) -> dict[str, TensorSpec]:
    h, d, di = cfg.hidden_size, cfg.head_dim, cfg.index_head_dim
    p = "language_model."
    specs = {
        f"{p}model.embed_tokens.weight": TensorSpec((cfg.vocab_size, h), PROJ),
        f"{p}model.norm.weight": TensorSpec((h,), NORM),
        f"{p}lm_head.weight": TensorSpec((cfg.vocab_size, h), PROJ),
    }
    for i in range(cfg.num_hidden_layers):
        lp = f"{p}model.layers.{i}"
        specs.update({
            f"{lp}.input_layernorm.weight": TensorSpec((h,), NORM),
            f"{lp}.post_attention_layernorm.weight": TensorSpec((h,), NORM),
            f"{lp}.self_attn.q_proj.weight": TensorSpec((cfg.q_size, h), PROJ),
            f"{lp}.self_attn.k_proj.weight": TensorSpec((cfg.kv_size, h), PROJ),
            f"{lp}.self_attn.v_proj.weight": TensorSpec((cfg.kv_size, h), PROJ),
            f"{lp}.self_attn.o_proj.weight": TensorSpec((h, cfg.q_size), PROJ),
            f"{lp}.self_attn.q_norm.weight": TensorSpec((d,), NORM),
            f"{lp}.self_attn.k_norm.weight": TensorSpec((d,), NORM),
        })
        if cfg.is_sparse_attention(i):
            specs.update({
                f"{lp}.self_attn.index_q_proj.weight": TensorSpec((cfg.index_n_heads * di, h), PROJ),
                f"{lp}.self_attn.index_k_proj.weight": TensorSpec((di, h), PROJ),
                f"{lp}.self_attn.index_q_norm.weight": TensorSpec((di,), NORM),
                f"{lp}.self_attn.index_k_norm.weight": TensorSpec((di,), NORM),
            })
        if cfg.is_moe(i):
            mp = f"{lp}.block_sparse_moe"
            specs[f"{mp}.gate.weight"] = TensorSpec((cfg.num_local_experts, h), ROUTER)
            specs[f"{mp}.e_score_correction_bias"] = TensorSpec((cfg.num_local_experts,), BIAS)
            for e in range(cfg.num_local_experts):
                specs[f"{mp}.experts.{e}.w1.weight"] = TensorSpec((cfg.intermediate_size, h), PROJ)
                specs[f"{mp}.experts.{e}.w3.weight"] = TensorSpec((cfg.intermediate_size, h), PROJ)
                specs[f"{mp}.experts.{e}.w2.weight"] = TensorSpec((h, cfg.intermediate_size), PROJ)
            s = cfg.shared_intermediate_size
            specs[f"{mp}.shared_experts.gate_proj.weight"] = TensorSpec((s, h), PROJ)
            specs[f"{mp}.shared_experts.up_proj.weight"] = TensorSpec((s, h), PROJ)
            specs[f"{mp}.shared_experts.down_proj.weight"] = TensorSpec((h, s), PROJ)
        else:
            n = cfg.dense_intermediate_size
            specs[f"{lp}.mlp.gate_proj.weight"] = TensorSpec((n, h), PROJ)
            specs[f"{lp}.mlp.up_proj.weight"] = TensorSpec((n, h), PROJ)
            specs[f"{lp}.mlp.down_proj.weight"] = TensorSpec((h, n), PROJ)
    return specs


def random_tensors(cfg: M3Config, init_std: float, random_norms: bool, seed: int = 0,
                   device: torch.device | str = "cpu", dtype: torch.dtype | None = None
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """Draw every checkpoint tensor in a fixed order from one seeded generator on `device`: projections
    N(0, init_std); norms zero (as in the real checkpoint) or, with random_norms, N(0, 0.1) so the (1 + w) scale
    is exercised; the router bias zero or N(0, 0.02). The same seed gives the same weights on the same device
    type. `dtype` overrides the checkpoint dtype of projections (e.g. fp32 for CPU tests)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, spec in checkpoint_specs(cfg).items():
        out_dtype = spec.dtype if dtype is None or spec.role in (ROUTER, BIAS) else dtype
        if spec.role in (PROJ, ROUTER):
            t = torch.empty(spec.shape, dtype=torch.float32, device=device).normal_(0.0, init_std, generator=gen)
        elif random_norms:
            std = 0.1 if spec.role == NORM else 0.02
            t = torch.empty(spec.shape, dtype=torch.float32, device=device).normal_(0.0, std, generator=gen)
        else:
            t = torch.zeros(spec.shape, dtype=torch.float32, device=device)
        yield name, t.to(out_dtype)


def random_vision_tensors(cfg: VisionConfig, init_std: float, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every vision tensor of a checkpoint by its released name and stored shape (the Conv3d patch embedding 5-D
    and fp32, the rest bf16, as the released checkpoint stores them), drawn from one seeded generator: matrices and
    biases N(0, init_std), LayerNorm weights 1 + N(0, init_std)."""
    model = M3VisionModel(cfg, device="meta")
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, target in sorted(name_map(model, VISION_WEIGHT_NAMES, prefix="").items()):
        param = model.get_parameter(target.param)
        if "patch_embedding" in name:
            shape = (cfg.hidden_size, cfg.num_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        elif target.shard:  # one of q | k | v, fused into one parameter
            shape = (param.shape[0] // 3, *param.shape[1:])
        else:
            shape = tuple(param.shape)
        t = torch.empty(shape, dtype=torch.float32).normal_(0.0, init_std, generator=gen)
        if ("layer_norm" in name or "layrnorm" in name) and name.endswith("weight"):
            t += 1.0
        out[name] = t if "patch_embedding" in name else t.to(torch.bfloat16)
    return out
