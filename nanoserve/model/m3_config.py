"""The MiniMax M3 text configuration, read from either config.json dialect.

A released checkpoint nests the language model under `text_config` and describes the
per-layer structure with `moe_layer_freq` and `sparse_attention_config`. Hugging Face transformers writes a second
dialect of the same facts (`layer_types`, `mlp_layer_types`, `index_*`, `rope_parameters`). `M3Config.from_dict`
accepts both, and a bare text config too, and `to_hf_dict` writes the released dialect back.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

DENSE, SPARSE = "dense", "sparse"
# transformers' per-layer names -> ours
HF_ATTN_KINDS = {"full_attention": DENSE, "minimax_m3_sparse": SPARSE}
HF_MLP_KINDS = {"dense": DENSE, "sparse": SPARSE}


def _layer_kind(field_name: str, value: Any, kinds: dict[str, str]) -> str:
    if value not in kinds:
        raise ValueError(f"config.json: {field_name} entry {value!r} is not one of {sorted(kinds)}")
    return kinds[value]


@dataclass
class M3Config:
    """Every number the M3 text forward pass needs, with the real model's defaults."""

    vocab_size: int = 200064
    hidden_size: int = 6144
    num_hidden_layers: int = 60
    num_attention_heads: int = 64
    num_key_value_heads: int = 4
    head_dim: int = 128
    rotary_dim: int = 64
    rope_theta: float = 5_000_000.0
    max_position_embeddings: int = 1_048_576
    rms_norm_eps: float = 1e-6
    # FFN
    intermediate_size: int = 3072  # one routed expert
    dense_intermediate_size: int = 12288
    shared_intermediate_size: int = 3072
    num_local_experts: int = 128
    num_experts_per_tok: int = 4
    n_shared_experts: int = 1
    routed_scaling_factor: float = 2.0
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # MSA (MiniMax Sparse Attention)
    index_n_heads: int = 4
    index_head_dim: int = 128
    index_block_size: int = 128
    index_topk_blocks: int = 16
    index_local_blocks: int = 1
    index_init_blocks: int = 0
    # per-layer structure: "dense"/"sparse" for attention and for the MLP
    attn_layer_types: list[str] = field(default_factory=lambda: [DENSE] * 3 + [SPARSE] * 57)
    mlp_layer_types: list[str] = field(default_factory=lambda: [DENSE] * 3 + [SPARSE] * 57)
    bos_token_id: int = 200034
    eos_token_id: int = 200020
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        self.validate()

    # -- derived sizes -------------------------------------------------------------------------------
    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def num_sparse_attn_layers(self) -> int:
        return sum(t == SPARSE for t in self.attn_layer_types)

    def is_sparse_attention(self, layer: int) -> bool:
        return self.attn_layer_types[layer] == SPARSE

    def is_moe(self, layer: int) -> bool:
        return self.mlp_layer_types[layer] == SPARSE

    def validate(self) -> None:
        def need(cond: bool, name: str, msg: str) -> None:
            if not cond:
                raise ValueError(f"model config field '{name}': {msg}")

        need(len(self.attn_layer_types) == self.num_hidden_layers, "attn_layer_types",
             f"has {len(self.attn_layer_types)} entries, num_hidden_layers is {self.num_hidden_layers}")
        need(len(self.mlp_layer_types) == self.num_hidden_layers, "mlp_layer_types",
             f"has {len(self.mlp_layer_types)} entries, num_hidden_layers is {self.num_hidden_layers}")
        for name in ("attn_layer_types", "mlp_layer_types"):
            bad = [t for t in getattr(self, name) if t not in (DENSE, SPARSE)]
            need(not bad, name, f"entries must be 'dense' or 'sparse', got {bad[:3]}")
        need(self.num_attention_heads % self.num_key_value_heads == 0, "num_attention_heads",
             f"{self.num_attention_heads} is not a multiple of num_key_value_heads={self.num_key_value_heads}")
        need(0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0, "rotary_dim",
             f"must be even and in (0, head_dim={self.head_dim}], got {self.rotary_dim}")
        need(self.rotary_dim <= self.index_head_dim, "rotary_dim",
             f"{self.rotary_dim} exceeds index_head_dim={self.index_head_dim}")
        if self.num_sparse_attn_layers:
            need(self.index_n_heads == self.num_key_value_heads, "index_n_heads",
                 f"MSA selects per KV group, so it must equal num_key_value_heads={self.num_key_value_heads}")
            need(self.index_topk_blocks >= max(1, self.index_local_blocks), "index_topk_blocks",
                 f"{self.index_topk_blocks} must be >= max(1, index_local_blocks={self.index_local_blocks})")
        need(self.index_init_blocks == 0, "index_init_blocks",
             f"forced leading ('sink') blocks are not supported (M3 uses 0), got {self.index_init_blocks}")
        need(1 <= self.num_experts_per_tok <= self.num_local_experts, "num_experts_per_tok",
             f"must be in [1, num_local_experts={self.num_local_experts}], got {self.num_experts_per_tok}")

    # -- reading / writing config.json ----------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "M3Config":
        """Parse a config.json dict: a `minimax_m3_vl` file (text under `text_config`) or a bare text config,
        in the released dialect or the one transformers writes."""
        if not isinstance(raw, dict):
            raise ValueError(f"config.json: expected a JSON object, got {type(raw).__name__}")
        model_type = raw.get("model_type")
        known = {"minimax_m3_vl", "minimax_m3_vl_text", "minimax_m3", "minimax_m3_text", None}
        if model_type not in known:
            raise ValueError(f"config.json: unknown model_type {model_type!r}; nanoserve serves MiniMax M3 "
                             f"(model_type 'minimax_m3_vl' or 'minimax_m3_vl_text')")
        text = raw.get("text_config", raw)
        if not isinstance(text, dict):
            raise ValueError("config.json: 'text_config' must be an object")
        n_layers = int(text.get("num_hidden_layers", cls.num_hidden_layers))
        kw: dict[str, Any] = {}
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
                     "intermediate_size", "dense_intermediate_size", "shared_intermediate_size",
                     "num_local_experts", "num_experts_per_tok", "n_shared_experts", "routed_scaling_factor",
                     "swiglu_alpha", "swiglu_limit", "index_n_heads", "index_head_dim", "index_block_size",
                     "index_topk_blocks", "index_local_blocks", "bos_token_id", "eos_token_id",
                     "tie_word_embeddings"):
            if text.get(name) is not None:
                kw[name] = text[name]
        if isinstance(kw.get("eos_token_id"), list):
            kw["eos_token_id"] = kw["eos_token_id"][0]

        # RoPE: released dialect has rope_theta/rotary_dim/partial_rotary_factor at the top of text_config;
        # the transformers dialect nests theta and the partial factor in rope_parameters.
        rope = text.get("rope_parameters") or {}
        theta = text.get("rope_theta", rope.get("rope_theta"))
        if theta is not None:
            kw["rope_theta"] = float(theta)
        head_dim = int(kw.get("head_dim", cls.head_dim))
        # The partial factor wins over rotary_dim: the released file has both (consistent), but transformers
        # ignores rotary_dim and writes its class default (64) whatever head_dim is, so only the factor is
        # trustworthy in its dialect. rotary_dim alone is honoured; neither means M3's half of head_dim.
        factor = text.get("partial_rotary_factor", rope.get("partial_rotary_factor"))
        if factor is not None:
            kw["rotary_dim"] = int(head_dim * float(factor))
        elif text.get("rotary_dim") is not None:
            kw["rotary_dim"] = int(text["rotary_dim"])
        else:
            kw["rotary_dim"] = head_dim // 2
        if rope.get("rope_type", "default") not in ("default", None) or text.get("rope_scaling"):
            raise ValueError("config.json: rope scaling is not supported (M3 uses plain RoPE up to 1M tokens)")

        # MSA: released dialect nests it in sparse_attention_config with sparse_* names.
        sparse = text.get("sparse_attention_config") or {}
        for flat, legacy in (("index_n_heads", "sparse_num_index_heads"), ("index_head_dim", "sparse_index_dim"),
                             ("index_block_size", "sparse_block_size"), ("index_topk_blocks", "sparse_topk_blocks"),
                             ("index_local_blocks", "sparse_local_block"), ("index_init_blocks", "sparse_init_block")):
            if legacy in sparse:
                kw[flat] = int(sparse[legacy])
        if sparse and sparse.get("sparse_score_type", "max") != "max":
            raise ValueError(f"config.json: sparse_score_type {sparse['sparse_score_type']!r} is not supported "
                             f"(only 'max')")
        freq = sparse.get("sparse_attention_freq") or []
        no_value = sparse.get("sparse_disable_index_value")
        if no_value is None:  # absent: selection-only indexers everywhere, as in M3
            no_value = [1] * len(freq)
        if len(no_value) != len(freq) or not all(v or not f for v, f in zip(no_value, freq)):
            raise ValueError("config.json: an index value/output branch (sparse_disable_index_value = 0 on a "
                             "sparse layer) is not supported; M3 disables it on every sparse layer")

        if text.get("layer_types") is not None:
            kw["attn_layer_types"] = [_layer_kind("layer_types", t, HF_ATTN_KINDS) for t in text["layer_types"]]
        elif sparse.get("sparse_attention_freq") is not None and sparse.get("use_sparse_attention", True):
            kw["attn_layer_types"] = [SPARSE if f else DENSE for f in sparse["sparse_attention_freq"]]
        else:
            kw["attn_layer_types"] = [DENSE] * n_layers
        if text.get("mlp_layer_types") is not None:
            kw["mlp_layer_types"] = [_layer_kind("mlp_layer_types", t, HF_MLP_KINDS)
                                     for t in text["mlp_layer_types"]]
        elif text.get("moe_layer_freq") is not None:
            freq = text["moe_layer_freq"]
            kw["mlp_layer_types"] = [SPARSE if f else DENSE for f in (freq if isinstance(freq, list)
                                                                      else [freq] * n_layers)]
        else:
            kw["mlp_layer_types"] = [SPARSE] * n_layers
        return cls(**kw)

    @classmethod
    def from_file(cls, path: str) -> "M3Config":
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def to_hf_dict(self, vision_config: dict[str, Any] | None = None) -> dict[str, Any]:
        """The released checkpoint's config.json layout: `minimax_m3_vl` + `text_config`."""
        text = {
            "architectures": ["MiniMaxM3SparseForCausalLM"],
            "model_type": "minimax_m3_vl_text",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings, "rms_norm_eps": self.rms_norm_eps,
            "use_gemma_norm": True, "attention_output_gate": False, "rope_theta": self.rope_theta,
            "rotary_dim": self.rotary_dim, "partial_rotary_factor": self.rotary_dim / self.head_dim,
            "hidden_act": "swigluoai", "use_qk_norm": True, "qk_norm_type": "per_head",
            "tie_word_embeddings": self.tie_word_embeddings,
            "intermediate_size": self.intermediate_size, "dense_intermediate_size": self.dense_intermediate_size,
            "shared_intermediate_size": self.shared_intermediate_size,
            "num_local_experts": self.num_local_experts, "num_experts_per_tok": self.num_experts_per_tok,
            "n_shared_experts": self.n_shared_experts, "scoring_func": "sigmoid", "use_routing_bias": True,
            "moe_layer_freq": [int(t == SPARSE) for t in self.mlp_layer_types],
            "swiglu_alpha": self.swiglu_alpha, "swiglu_limit": self.swiglu_limit,
            "routed_scaling_factor": self.routed_scaling_factor,
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
            "sparse_attention_config": {
                "use_sparse_attention": self.num_sparse_attn_layers > 0,
                "sparse_index_dim": self.index_head_dim,
                "sparse_num_index_heads": self.index_n_heads,
                "sparse_topk_blocks": self.index_topk_blocks,
                "sparse_block_size": self.index_block_size,
                "sparse_disable_index_value": [int(t == SPARSE) for t in self.attn_layer_types],
                "sparse_score_type": "max",
                "sparse_init_block": self.index_init_blocks,
                "sparse_local_block": self.index_local_blocks,
                "sparse_attention_freq": [int(t == SPARSE) for t in self.attn_layer_types],
            },
        }
        out: dict[str, Any] = {
            "architectures": ["MiniMaxM3SparseForConditionalGeneration"],
            "model_type": "minimax_m3_vl",
            "text_config": text,
            "torch_dtype": "bfloat16",
            "image_token_index": 200025,
            "video_token_index": 200026,
        }
        if vision_config is not None:
            out["vision_config"] = vision_config
        return out

    def replace(self, **changes: Any) -> "M3Config":
        d = asdict(self)
        d.update(changes)
        return M3Config(**d)
