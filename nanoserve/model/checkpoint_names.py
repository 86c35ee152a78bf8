"""Checkpoint tensor names -> model parameters, as one table (`WEIGHT_NAMES`).

Each row names a checkpoint tensor (after the `language_model.` prefix; `{layer}` and `{expert}` stand for the
decoder layer and the routed expert), the parameter of `M3ForCausalLM` it fills (with the same placeholders) and
the shard of that parameter it is: the part of a merged projection (`q` of q|k|v|index_q|index_k, `gate` of
gate|up, ...), or "" for the whole parameter. Each parameter declares the shards it takes (`weight_shards`) and
copies this rank's slice of a shard in its `weight_loader`, so tensor and expert parallelism stay in the layers.

The loader expands the rows over the model's layers and experts and keeps those whose parameter exists and takes
that shard: a dense layer has `mlp.gate_up_proj`, an MoE layer `mlp.w13`; an MSA layer's q|k|v has `index_q`; the
shared expert is either a slot of the expert stack or its own MLP. What remains are the targets the checkpoint
must fill, each from exactly one tensor.

Adding a name is one row. An alias - a second name for the same target, such as another checkpoint's spelling -
is a row with the same parameter and shard; a checkpoint may then use either name (not both: the loader refuses a
checkpoint that fills one target twice). The dense layers' MLP has such aliases: the released checkpoint (and
newer transformers, 5.25 for one) spells it `mlp.{gate,up,down}_proj`, transformers 5.17 saves it as
`block_sparse_moe.{gate,up,down}_proj`. An MXFP8 weight's E8M0 scale is named after its weight (`<weight name>
_scale_inv`) and read with it, so every alias covers its scale too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch.nn as nn

from nanoserve.model.layers.linear import WeightSource

CHECKPOINT_PREFIX = "language_model."


@dataclass(frozen=True)
class NameRule:
    """checkpoint name pattern -> parameter path pattern, and the shard of the parameter it fills."""

    name: str
    param: str
    shard: str = ""


L = "model.layers.{layer}"
ATTN, MOE = f"{L}.self_attn", f"{L}.block_sparse_moe"
WEIGHT_NAMES: tuple[NameRule, ...] = (
    NameRule("model.embed_tokens.weight", "embed_tokens.weight"),
    NameRule("model.norm.weight", "norm.weight"),
    NameRule("lm_head.weight", "lm_head.weight"),
    NameRule(f"{L}.input_layernorm.weight", "layers.{layer}.input_layernorm.weight"),
    NameRule(f"{L}.post_attention_layernorm.weight", "layers.{layer}.post_attention_layernorm.weight"),
    # attention: q|k|v, and on MSA layers index_q|index_k, are one merged column-parallel projection
    NameRule(f"{ATTN}.q_proj.weight", "layers.{layer}.self_attn.qkv_proj.weight", "q"),
    NameRule(f"{ATTN}.k_proj.weight", "layers.{layer}.self_attn.qkv_proj.weight", "k"),
    NameRule(f"{ATTN}.v_proj.weight", "layers.{layer}.self_attn.qkv_proj.weight", "v"),
    NameRule(f"{ATTN}.index_q_proj.weight", "layers.{layer}.self_attn.qkv_proj.weight", "index_q"),
    NameRule(f"{ATTN}.index_k_proj.weight", "layers.{layer}.self_attn.qkv_proj.weight", "index_k"),
    NameRule(f"{ATTN}.o_proj.weight", "layers.{layer}.self_attn.o_proj.weight"),
    NameRule(f"{ATTN}.q_norm.weight", "layers.{layer}.self_attn.q_norm"),
    NameRule(f"{ATTN}.k_norm.weight", "layers.{layer}.self_attn.k_norm"),
    NameRule(f"{ATTN}.index_q_norm.weight", "layers.{layer}.self_attn.index_q_norm"),
    NameRule(f"{ATTN}.index_k_norm.weight", "layers.{layer}.self_attn.index_k_norm"),
    # dense layers: gate|up merged, down row-parallel
    NameRule(f"{L}.mlp.gate_proj.weight", "layers.{layer}.mlp.gate_up_proj.weight", "gate"),
    NameRule(f"{L}.mlp.up_proj.weight", "layers.{layer}.mlp.gate_up_proj.weight", "up"),
    NameRule(f"{L}.mlp.down_proj.weight", "layers.{layer}.mlp.down_proj.weight"),
    # ... the same three as transformers 5.17 saves them, under block_sparse_moe (aliases: one spelling per file)
    NameRule(f"{MOE}.gate_proj.weight", "layers.{layer}.mlp.gate_up_proj.weight", "gate"),
    NameRule(f"{MOE}.up_proj.weight", "layers.{layer}.mlp.gate_up_proj.weight", "up"),
    NameRule(f"{MOE}.down_proj.weight", "layers.{layer}.mlp.down_proj.weight"),
    # MoE layers: the fp32 router and its selection bias, then the routed experts stacked into w13 (w1|w3) and w2
    NameRule(f"{MOE}.gate.weight", "layers.{layer}.mlp.gate"),
    NameRule(f"{MOE}.e_score_correction_bias", "layers.{layer}.mlp.e_score_correction_bias"),
    NameRule(f"{MOE}.experts.{{expert}}.w1.weight", "layers.{layer}.mlp.w13", "gate"),
    NameRule(f"{MOE}.experts.{{expert}}.w3.weight", "layers.{layer}.mlp.w13", "up"),
    NameRule(f"{MOE}.experts.{{expert}}.w2.weight", "layers.{layer}.mlp.w2", "down"),
    # the shared expert: an extra slot of the expert stack when its shard has a routed expert's shape ...
    NameRule(f"{MOE}.shared_experts.gate_proj.weight", "layers.{layer}.mlp.w13", "shared_gate"),
    NameRule(f"{MOE}.shared_experts.up_proj.weight", "layers.{layer}.mlp.w13", "shared_up"),
    NameRule(f"{MOE}.shared_experts.down_proj.weight", "layers.{layer}.mlp.w2", "shared_down"),
    # ... else an MLP of its own
    NameRule(f"{MOE}.shared_experts.gate_proj.weight", "layers.{layer}.mlp.shared.gate_up_proj.weight", "gate"),
    NameRule(f"{MOE}.shared_experts.up_proj.weight", "layers.{layer}.mlp.shared.gate_up_proj.weight", "up"),
    NameRule(f"{MOE}.shared_experts.down_proj.weight", "layers.{layer}.mlp.shared.down_proj.weight"),
)


VT, VL = "vision_tower.vision_model", "vision_tower.vision_model.encoder.layers.{layer}"
VISION_WEIGHT_NAMES: tuple[NameRule, ...] = (
    # The vision tower, projector and patch merger (model/vision/model.py M3VisionModel), under no prefix: they sit
    # beside `language_model.` in the checkpoint. `{layer}` is a vision layer. Every tensor is loaded whole (the
    # tower is replicated under tensor parallelism) and unquantized (an MXFP8 checkpoint keeps them bf16 / fp32).
    NameRule(f"{VT}.embeddings.patch_embedding.weight", "tower.patch_embed.weight"),  # Conv3d, stored fp32
    NameRule(f"{VT}.pre_layrnorm.weight", "tower.pre_layrnorm.weight"),
    NameRule(f"{VT}.pre_layrnorm.bias", "tower.pre_layrnorm.bias"),
    *(NameRule(f"{VL}.{norm}.{p}", f"tower.layers.{{layer}}.{norm}.{p}")
      for norm in ("layer_norm1", "layer_norm2") for p in ("weight", "bias")),
    # q|k|v are one fused projection, weights and biases alike
    *(NameRule(f"{VL}.self_attn.{x}_proj.{p}", f"tower.layers.{{layer}}.self_attn.qkv_proj.{p}", x)
      for x in "qkv" for p in ("weight", "bias")),
    *(NameRule(f"{VL}.{m}.{p}", f"tower.layers.{{layer}}.{m}.{p}")
      for m in ("self_attn.out_proj", "mlp.fc1", "mlp.fc2") for p in ("weight", "bias")),
    *(NameRule(f"{ckpt}.{lin}.{p}", f"{ours}.{lin}.{p}")
      for ckpt, ours in (("multi_modal_projector", "projector"), ("patch_merge_mlp", "merger"))
      for lin in ("linear_1", "linear_2") for p in ("weight", "bias")),
)
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "patch_merge_mlp.")
"""Where the vision tensors live in a checkpoint (a text-only load skips them)."""

KV_SCALE_NAME = re.compile(re.escape(CHECKPOINT_PREFIX) + r"model\.layers\.(\d+)\.self_attn\.([kv])_scale")
"""An fp8 KV cache's per-tensor scales, vLLM's names (`...self_attn.k_scale`, `...self_attn.v_scale`: one scalar
each, stored = x / scale). Optional, so outside the table: the loader puts them on the layer's attention
(`M3Attention.k_scale` / `v_scale`), which uses them with an fp8 pool only."""


@dataclass(frozen=True)
class Target:
    """One thing a checkpoint tensor fills: a parameter's shard (of one expert, for the expert stacks)."""

    param: str
    shard: str
    expert: int | None


def _placeholders(pattern: str) -> set[str]:
    return set(re.findall(r"\{(\w+)\}", pattern))


def name_map(model: nn.Module, rules: tuple[NameRule, ...] | None = None,
             prefix: str = CHECKPOINT_PREFIX) -> dict[str, Target]:
    """Every checkpoint name the table (default: WEIGHT_NAMES) gives for `model`, with the prefix -> its target.
    The vision model: `name_map(vision, VISION_WEIGHT_NAMES, prefix="")`."""
    rules = WEIGHT_NAMES if rules is None else rules
    cfg = model.cfg  # type: ignore[attr-defined]
    params = dict(model.named_parameters())
    out: dict[str, Target] = {}
    for rule in rules:
        used = _placeholders(rule.name) | _placeholders(rule.param)
        layers = range(cfg.num_hidden_layers) if "layer" in used else [None]
        experts = range(cfg.num_local_experts) if "expert" in used else [None]
        for layer in layers:
            for expert in experts:
                param = rule.param.format(layer=layer, expert=expert)
                p = params.get(param)
                if p is None or rule.shard not in getattr(p, "weight_shards", ("",)):
                    continue  # this layer has no such parameter or shard
                name = prefix + rule.name.format(layer=layer, expert=expert)
                target = Target(param, rule.shard, expert)
                if out.setdefault(name, target) != target:
                    raise ValueError(f"WEIGHT_NAMES maps {name} to both {out[name]} and {target}")
    return out


def canonical_names(names: dict[str, Target]) -> dict[Target, list[str]]:
    """target -> the names that fill it, the table's first row first (aliases after it)."""
    out: dict[Target, list[str]] = {}
    for name, target in names.items():
        out.setdefault(target, []).append(name)
    return out


def loader_for(model: nn.Module, name: str, target: Target) -> Callable[[WeightSource], None]:
    """A function that copies a source tensor (this rank's part of it) into the target."""
    param = model.get_parameter(target.param)
    kwargs = {} if target.expert is None else {"expert": target.expert}
    return lambda src: param.weight_loader(param.data, src, target.shard, name, **kwargs)


def weight_loaders(model: nn.Module) -> dict[str, Callable[[WeightSource], None]]:
    """checkpoint name -> loader, for every name of the table that applies to `model`."""
    return {name: loader_for(model, name, t) for name, t in name_map(model).items()}
