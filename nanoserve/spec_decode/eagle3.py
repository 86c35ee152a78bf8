"""An EAGLE-3 draft model (speculative decoding's `eagle3` method), read from a draft directory in the layout vLLM
serves (`LlamaForCausalLMEagle3`: config.json + safetensors, as Inferact/MiniMax-M3-EAGLE3 ships).

One Llama-style decoder layer that reads the target model, not just tokens:

    g = fc([a_1 ; a_2 ; a_3])                    a_i: the target's residual stream entering its layer L_i
                                                  (`eagle_aux_hidden_state_layer_ids`; L_i = the number of
                                                  layers: the stream after the last, before the final norm),
                                                  at position t; usually three taps
    x = [input_layernorm(embed(x_{t+1})) ; hidden_norm(g)]          2 * hidden wide
    h = g + o_proj(attention(q|k|v_proj(x)))       Llama attention: GQA, full rotate-half RoPE, its own paged K/V
    h = h + mlp(post_attention_layernorm(h))       SiLU-gated MLP
    logits of x_{t+2} = lm_head(norm(h))          the draft's own head over `draft_vocab_size` tokens (draft id
                                                  d is target id d + d2t[d]), or the target's head when it has none

Norms are Llama RMSNorms (x * w, not Gemma's x * (1 + w)). The embedding is the target's unless the directory
has its own. With `norm_before_residual` the residual is the normed g. Each further draft step feeds the layer
its own pre-norm output h in place of g (vLLM's recursion). The tensors are named as vLLM loads them:
`midlayer.*` (or `layers.0.*`), `fc.weight`, `norm.weight`, and optionally `lm_head.weight`, `d2t`,
`embed_tokens.weight` (a `model.` prefix is allowed); `t2d`, the reverse map, is not needed to draft.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open

from nanoserve.batch import AttentionMetadata
from nanoserve.config import Optimizations
from nanoserve.kernels import reference, triton_usable
from nanoserve.model.loader import CheckpointError, scan_safetensors
from nanoserve.model.m3 import M3ForCausalLM
from nanoserve.model.m3_config import M3Config


@dataclass(frozen=True)
class Eagle3Config:
    """The draft directory's config.json, as far as drafting reads it (defaults: vLLM's / Llama's)."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]
    norm_before_residual: bool

    @classmethod
    def read(cls, draft_dir: str, target: M3Config) -> "Eagle3Config":
        if not os.path.isdir(draft_dir):
            raise CheckpointError(f"EAGLE-3 draft directory {draft_dir!r} does not exist")
        path = os.path.join(draft_dir, "config.json")
        if not os.path.isfile(path):
            raise CheckpointError(f"EAGLE-3 draft {draft_dir!r}: config.json is missing")
        with open(path) as f:
            raw = json.load(f)

        def need(name: str, ok: bool, what: str) -> None:
            if not ok:
                raise CheckpointError(f"EAGLE-3 draft {path}: {name}={raw.get(name)!r} is {what}")

        need("hidden_act", raw.get("hidden_act", "silu") == "silu", "not supported (silu only)")
        need("rope_scaling", not raw.get("rope_scaling"), "not supported (plain RoPE only)")
        h, heads = raw.get("hidden_size"), raw.get("num_attention_heads")
        need("hidden_size", isinstance(h, int) and h > 0, "required: a positive integer")
        need("num_attention_heads", isinstance(heads, int) and heads > 0, "required: a positive integer")
        eagle = raw.get("eagle_config") or {}
        layers = target.num_hidden_layers
        aux = eagle.get("eagle_aux_hidden_state_layer_ids", raw.get("eagle_aux_hidden_state_layer_ids"))
        aux = tuple(aux) if aux is not None else (2, layers // 2, layers - 3)  # vLLM's default taps
        need("eagle_aux_hidden_state_layer_ids", len(aux) >= 1 and all(isinstance(i, int) and 0 <= i <= layers
                                                                        for i in aux),
             f"not a list of tap points 0..{layers} of the target's {layers} layers")
        cfg = cls(hidden_size=h, num_attention_heads=heads,
                  num_key_value_heads=raw.get("num_key_value_heads") or heads,
                  head_dim=raw.get("head_dim") or h // heads, intermediate_size=raw.get("intermediate_size", 0),
                  rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), rope_theta=float(raw.get("rope_theta", 1e4)),
                  vocab_size=raw.get("vocab_size", target.vocab_size),
                  draft_vocab_size=raw.get("draft_vocab_size") or raw.get("vocab_size", target.vocab_size),
                  target_hidden_size=raw.get("target_hidden_size") or h, aux_layer_ids=aux,
                  norm_before_residual=bool(raw.get("norm_before_residual", False)))
        need("vocab_size", cfg.vocab_size == target.vocab_size, f"not the target's {target.vocab_size}")
        need("target_hidden_size", cfg.target_hidden_size == target.hidden_size,
             f"not the target's hidden size {target.hidden_size}")
        need("intermediate_size", isinstance(cfg.intermediate_size, int) and cfg.intermediate_size > 0,
             "required: a positive integer")
        return cfg


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm, in fp32, cast back."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


class Eagle3Drafter(nn.Module):
    """The draft layer and its weights (see the module docstring). `step` is one pass of the layer over a flat
    batch; the runner keeps the target's taps and the K/V pool."""

    def __init__(self, cfg: Eagle3Config, opts: Optimizations, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.cfg, self.opts = cfg, opts
        h, hd = cfg.hidden_size, cfg.head_dim
        q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd

        def param(*shape: int, dt: torch.dtype = dtype) -> nn.Parameter:
            return nn.Parameter(torch.zeros(shape, dtype=dt, device=device), requires_grad=False)

        self.shapes = {  # checkpoint name (normalised) -> parameter
            "fc.weight": param(h, len(cfg.aux_layer_ids) * cfg.target_hidden_size),
            "norm.weight": param(h, dt=torch.float32),
            "layers.0.input_layernorm.weight": param(h, dt=torch.float32),
            "layers.0.hidden_norm.weight": param(h, dt=torch.float32),
            "layers.0.post_attention_layernorm.weight": param(h, dt=torch.float32),
            "layers.0.self_attn.q_proj.weight": param(q, 2 * h), "layers.0.self_attn.k_proj.weight": param(kv, 2 * h),
            "layers.0.self_attn.v_proj.weight": param(kv, 2 * h), "layers.0.self_attn.o_proj.weight": param(h, q),
            "layers.0.mlp.gate_proj.weight": param(cfg.intermediate_size, h),
            "layers.0.mlp.up_proj.weight": param(cfg.intermediate_size, h),
            "layers.0.mlp.down_proj.weight": param(h, cfg.intermediate_size)}
        self.params = nn.ParameterDict({k.replace(".", "__"): p for k, p in self.shapes.items()})
        self.lm_head: torch.Tensor | None = None  # [draft_vocab, H], else the target's head
        self.d2t: torch.Tensor | None = None  # [draft_vocab] int64 offsets to target ids
        self.embed: torch.Tensor | None = None  # its own embedding, else the target's
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device=device) / hd))
        self.register_buffer("inv_freq", inv, persistent=False)
        self.scale = 1.0 / math.sqrt(hd)
        self.kv_cache: torch.Tensor | None = None

    def w(self, name: str) -> torch.Tensor:
        return self.shapes[name]

    def bind_kv_cache(self, kv: torch.Tensor | None) -> None:
        self.kv_cache = kv

    # -- drafting --------------------------------------------------------------------------------------------
    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's taps side by side [T, taps * target_hidden] -> the layer's hidden input [T, H]."""
        return F.linear(aux.to(self.w("fc.weight").dtype), self.w("fc.weight"))

    @torch.inference_mode()
    def step(self, model: M3ForCausalLM, next_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
             meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """next_ids [T] (x_{t+1}), hidden [T, H] (g, or the last step's output), positions [T] -> (the final-normed
        output, whose logits predict x_{t+2}; the pre-norm output, the next step's hidden input). Writes this
        step's K/V into the pool at meta's slots."""
        c, eps = self.cfg, self.cfg.rms_norm_eps
        embeds = F.embedding(next_ids, self.embed) if self.embed is not None else model.embed_tokens(next_ids)
        residual = hidden
        normed = rms_norm(hidden, self.w("layers.0.hidden_norm.weight"), eps)
        if c.norm_before_residual:
            residual = normed
        x = torch.cat([rms_norm(embeds.to(hidden.dtype), self.w("layers.0.input_layernorm.weight"), eps), normed], -1)
        t, hd = x.shape[0], c.head_dim
        q = F.linear(x, self.w("layers.0.self_attn.q_proj.weight")).view(t, -1, hd)
        k = F.linear(x, self.w("layers.0.self_attn.k_proj.weight")).view(t, -1, hd)
        v = F.linear(x, self.w("layers.0.self_attn.v_proj.weight")).view(t, -1, hd)
        cos, sin = reference.rope_cos_sin(positions, self.inv_freq)
        q, k = reference.apply_partial_rope(q, cos, sin), reference.apply_partial_rope(k, cos, sin)
        # (no host synchronisation, so the draft passes replay as CUDA graphs: spec_decode/drafter.py's DraftGraphs)
        reference.write_kv_padded(self.kv_cache, k, v, meta.slot_mapping)
        if self.opts.triton_attention and triton_usable(q):
            from nanoserve.kernels.attention import paged_attention

            attn = paged_attention(q, self.kv_cache, meta, self.scale)
        else:
            attn = reference.paged_attention(q, self.kv_cache, meta, self.scale)
        residual = residual + F.linear(attn.reshape(t, -1), self.w("layers.0.self_attn.o_proj.weight"))
        h = rms_norm(residual, self.w("layers.0.post_attention_layernorm.weight"), eps)
        h = F.linear(F.silu(F.linear(h, self.w("layers.0.mlp.gate_proj.weight")))
                     * F.linear(h, self.w("layers.0.mlp.up_proj.weight")), self.w("layers.0.mlp.down_proj.weight"))
        prenorm = residual + h
        return rms_norm(prenorm, self.w("norm.weight"), eps), prenorm

    def draft_tokens(self, model: M3ForCausalLM, normed: torch.Tensor) -> torch.Tensor:
        """Greedy draft tokens (target ids) from final-normed outputs."""
        if self.lm_head is None:
            return model.compute_logits(normed).argmax(dim=-1)
        draft = F.linear(normed.to(self.lm_head.dtype), self.lm_head).argmax(dim=-1)
        return draft if self.d2t is None else draft + self.d2t[draft]


def draft_files(draft_dir: str) -> dict[str, str]:
    """Tensor name -> safetensors file of a draft directory (every *.safetensors file in it)."""
    if not os.path.isdir(draft_dir):
        raise CheckpointError(f"EAGLE-3 draft directory {draft_dir!r} does not exist")
    return scan_safetensors(draft_dir, f"EAGLE-3 draft {draft_dir}")


def normalised(name: str) -> str:
    """vLLM's spellings of one name: an optional `model.` prefix, `midlayer.` for `layers.0.`."""
    name = name.removeprefix("model.")
    return "layers.0." + name.removeprefix("midlayer.") if name.startswith("midlayer.") else name


OPTIONAL = ("lm_head.weight", "d2t", "embed_tokens.weight", "t2d")


def load_eagle3(draft_dir: str, target: M3ForCausalLM, opts: Optimizations, dtype: torch.dtype,
                device: torch.device | str) -> Eagle3Drafter:
    """Build the draft for `target` from its directory and load every tensor, checking names and shapes (a
    CheckpointError naming what is missing, unexpected or misshapen)."""
    cfg = Eagle3Config.read(draft_dir, target.cfg)
    drafter = Eagle3Drafter(cfg, opts, dtype, device)
    files = draft_files(draft_dir)
    names = {normalised(k): k for k in files}
    missing = sorted(set(drafter.shapes) - set(names))
    unexpected = sorted(set(names) - set(drafter.shapes) - set(OPTIONAL))
    if missing or unexpected:
        parts = ([f"missing tensor(s): {', '.join(missing)}"] if missing else []) + \
                ([f"unexpected tensor(s): {', '.join(unexpected)}"] if unexpected else [])
        raise CheckpointError(f"EAGLE-3 draft {draft_dir}: " + "; ".join(parts))
    h = cfg.hidden_size

    def read(name: str) -> torch.Tensor:
        with safe_open(files[names[name]], framework="pt", device="cpu") as f:
            return f.get_tensor(names[name])

    def check(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        if tuple(t.shape) != shape:
            raise CheckpointError(f"EAGLE-3 draft {draft_dir}: {names[name]} has shape {tuple(t.shape)}, "
                                  f"expected {shape}")
        return t

    for name, p in drafter.shapes.items():
        p.data.copy_(check(name, read(name), tuple(p.shape)))
    if "lm_head.weight" in names:
        drafter.lm_head = check("lm_head.weight", read("lm_head.weight"), (cfg.draft_vocab_size, h)).to(
            device=device, dtype=dtype)
    elif cfg.draft_vocab_size != cfg.vocab_size or h != target.cfg.hidden_size:
        raise CheckpointError(f"EAGLE-3 draft {draft_dir}: no lm_head.weight, and the target's head does not fit "
                              f"(draft vocab {cfg.draft_vocab_size}, hidden {h})")
    if "d2t" in names:
        drafter.d2t = check("d2t", read("d2t"), (cfg.draft_vocab_size,)).to(device=device, dtype=torch.int64)
    elif drafter.lm_head is not None and cfg.draft_vocab_size != cfg.vocab_size:
        raise CheckpointError(f"EAGLE-3 draft {draft_dir}: a draft vocabulary of {cfg.draft_vocab_size} tokens "
                              f"needs d2t (draft id -> target id)")
    if "embed_tokens.weight" in names:
        drafter.embed = check("embed_tokens.weight", read("embed_tokens.weight"), (cfg.vocab_size, h)).to(
            device=device, dtype=dtype)
    elif h != target.cfg.hidden_size:
        raise CheckpointError(f"EAGLE-3 draft {draft_dir}: no embed_tokens.weight, and the target's embedding is "
                              f"{target.cfg.hidden_size} wide, not {h}")
    return drafter.eval()
