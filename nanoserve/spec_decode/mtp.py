"""M3's multi-token-prediction (MTP) module, the draft model of speculative decoding's `mtp` method.

DeepSeek-V3's layout, as M3's checkpoints name it (`language_model.model.mtp.layers.0.*`):

    e = enorm(embed(x_{t+1}))        the shared embedding of the token after position t
    h = hnorm(h_t)                   the main model's final-normed hidden state at t
    z = eh_proj([e ; h])             eh_proj: [hidden, 2 * hidden]
    z -> one decoder block (MSA attention + MoE, its own K/V and index keys) at position t
      -> final_layernorm -> the shared lm_head: the logits of x_{t+2}

The block is built from the model's own layer classes (an M3DecoderLayer whose config says "MSA, MoE") and its
tensors fill it through the same name table as a main-model layer (model/checkpoint_names.py), so what loads a
decoder layer loads this one, TP slicing and MXFP8 included. The main loader skips `mtp.` keys; `load_mtp` reads
them from the same checkpoint directory.

Drafting k tokens applies the one module k times (as vLLM does when k exceeds the modules a checkpoint has):
step j reads the module's own final-normed output of step j - 1 in place of the main model's hidden state.
"""

from __future__ import annotations

import dataclasses
from contextlib import ExitStack

import torch
import torch.nn as nn
from safetensors import safe_open

from nanoserve.batch import AttentionMetadata
from nanoserve.config import Optimizations
from nanoserve.model.checkpoint_names import CHECKPOINT_PREFIX, loader_for, name_map
from nanoserve.model.layers.linear import ColumnParallelLinear
from nanoserve.model.layers.norm import GemmaRMSNorm
from nanoserve.model.loader import FP8_DTYPES, SCALE_SUFFIX, CheckpointError, MXFP8Slice, SafeSlice, checkpoint_files
from nanoserve.model.m3 import M3DecoderLayer, M3ForCausalLM
from nanoserve.model.m3_config import SPARSE, M3Config

MTP_PREFIX = "language_model.model.mtp.layers.0."
"""Where the first MTP module's tensors sit in a checkpoint (a standalone MTP checkpoint drops `language_model.`)."""
MTP_PREFIXES = (MTP_PREFIX, MTP_PREFIX.removeprefix("language_model."))


def mtp_config(cfg: M3Config) -> M3Config:
    """The model's config with one more layer, MSA attention and MoE: the MTP block is that layer."""
    return dataclasses.replace(cfg, num_hidden_layers=cfg.num_hidden_layers + 1,
                               attn_layer_types=[*cfg.attn_layer_types, SPARSE],
                               mlp_layer_types=[*cfg.mlp_layer_types, SPARSE])


class M3MTP(nn.Module):
    """One MTP module (see the module docstring). `forward` returns its final-normed hidden states; the logits
    come from the main model's `compute_logits` (the shared lm_head)."""

    def __init__(self, cfg: M3Config, opts: Optimizations, dtype: torch.dtype, device: torch.device | str,
                 quant: str | None = None):
        super().__init__()
        self.cfg = mtp_config(cfg)
        self.layer_idx = cfg.num_hidden_layers
        h = cfg.hidden_size
        self.enorm = GemmaRMSNorm(h, cfg.rms_norm_eps, opts, device)
        self.hnorm = GemmaRMSNorm(h, cfg.rms_norm_eps, opts, device)
        self.eh_proj = ColumnParallelLinear(2 * h, h, dtype, device, quant=quant, opts=opts)
        # under `layers.<idx>` so that the main model's name table maps the block's checkpoint names
        self.layers = nn.ModuleDict({str(self.layer_idx): M3DecoderLayer(self.cfg, self.layer_idx, opts, dtype,
                                                                         device, quant)})
        self.final_layernorm = GemmaRMSNorm(h, cfg.rms_norm_eps, opts, device)

    @property
    def block(self) -> M3DecoderLayer:
        return self.layers[str(self.layer_idx)]

    def bind_kv_cache(self, kv: torch.Tensor | None, index_keys: torch.Tensor | None) -> None:
        self.block.self_attn.kv_cache = kv
        self.block.self_attn.index_cache = index_keys

    @torch.inference_mode()
    def forward(self, model: M3ForCausalLM, next_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """next_ids [T] (x_{t+1}), hidden [T, H] (the final-normed h_t), positions [T] (t) -> [T, H] final-normed
        outputs, whose logits predict x_{t+2}."""
        e = self.enorm(model.embed_tokens(next_ids))
        z = self.eh_proj(torch.cat([e, self.hnorm(hidden)], dim=-1))
        rope = model.rope(positions, meta.max_seq_len)
        out, residual, _ = self.block(z, None, positions, rope, meta, None)
        x, _ = self.final_layernorm(out, residual)
        return x

    def checkpoint_names(self) -> dict[str, tuple[str, object]]:
        """checkpoint name (under MTP_PREFIX) -> (parameter path, name-table target) for every tensor it needs."""
        block = f"{CHECKPOINT_PREFIX}model.layers.{self.layer_idx}."
        out = {}
        for name, target in name_map(self).items():
            if name.startswith(block):
                out[MTP_PREFIX + "transformer_layer." + name.removeprefix(block)] = (name, target)
        return out


def has_mtp(model_dir: str) -> bool:
    """Does the checkpoint hold an MTP module (any `mtp.layers.0.` tensor)?"""
    return any(k.startswith(MTP_PREFIXES) for k in checkpoint_files(model_dir))


def load_mtp(mtp: M3MTP, model_dir: str) -> int:
    """Fill `mtp` from the checkpoint's `mtp.layers.0.*` tensors: every one it needs, each once, none left over
    (a CheckpointError naming them otherwise). Returns how many tensors were read."""
    files = checkpoint_files(model_dir)
    present = {}
    for key in files:
        for prefix in MTP_PREFIXES:
            if key.startswith(prefix) and not key.endswith(SCALE_SUFFIX):
                present[MTP_PREFIX + key.removeprefix(prefix)] = key
    own = {MTP_PREFIX + n + ".weight": (f"{n}.weight", None) for n in ("enorm", "hnorm", "final_layernorm",
                                                                        "eh_proj")}
    block = mtp.checkpoint_names()
    # aliases of one target (two spellings of the dense MLP) cannot occur in an MoE block; each name is one target
    wanted = set(own) | set(block)
    missing = sorted(wanted - set(present))
    unexpected = sorted(set(present) - wanted)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing MTP tensor(s): {', '.join(missing[:8])}"
                         + (" ..." if len(missing) > 8 else ""))
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected MTP tensor(s): {', '.join(unexpected[:8])}"
                         + (" ..." if len(unexpected) > 8 else ""))
        raise CheckpointError(f"{model_dir}: " + "; ".join(parts))
    params = dict(mtp.named_parameters())
    with ExitStack() as stack:
        handles: dict[str, object] = {}

        def source(key: str) -> SafeSlice:
            path = files[key]
            if path not in handles:
                handles[path] = stack.enter_context(safe_open(path, framework="pt", device="cpu"))
            return SafeSlice(handles[path], key)

        for name in sorted(wanted):
            key = present[name]
            src: object = source(key)
            if src._slice.get_dtype() in FP8_DTYPES:
                if key + SCALE_SUFFIX not in files:
                    raise CheckpointError(f"{key} is fp8 but its {key + SCALE_SUFFIX} is missing")
                src = MXFP8Slice(src, source(key + SCALE_SUFFIX), key)
            try:
                if name in own:
                    param = params[own[name][0]]
                    param.weight_loader(param.data, src, "", key)
                else:
                    _, target = block[name]
                    loader_for(mtp, key, target)(src)
            except ValueError as e:
                raise CheckpointError(str(e)) from e
    return len(wanted)
