"""The MiniMax M3 text model, top-down.

    tokens -> embedding -> N x [ x += Attn(Norm(x));  x += FFN(Norm(x)) ] -> final norm -> lm_head -> logits

Each layer's attention is dense or MSA (block-sparse) and its FFN is a dense SwiGLU-OAI MLP or the MoE, as the
config says (the real model: layers 0-2 dense/dense, 3-59 MSA/MoE). The forward pass takes a flat batch of tokens
from many sequences plus their AttentionMetadata, and reads and writes the paged KV cache bound to each layer.
Which checkpoint tensor fills which parameter is the table in model/checkpoint_names.py.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn as nn

from nanoserve.batch import AttentionMetadata
from nanoserve.config import Optimizations
from nanoserve.kernels import reference
from nanoserve.model.layers.attention import M3Attention
from nanoserve.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from nanoserve.model.layers.mlp import SwiGLUOAIMLP
from nanoserve.model.layers.moe import M3MoE
from nanoserve.model.layers.norm import GemmaRMSNorm
from nanoserve.model.m3_config import M3Config

ROPE_TABLE_MIN = 4096
"""Smallest RoPE table (positions) under the rope_table switch; it doubles as longer contexts arrive."""
MSA_TOPK_REUSE_EVERY = 2
"""Under the msa_topk_reuse approximation, MSA layers compute a fresh selection every this many layers."""


class M3DecoderLayer(nn.Module):
    """Pre-norm residual block: attention then FFN, each behind a Gemma RMSNorm."""

    def __init__(self, cfg: M3Config, idx: int, opts: Optimizations, dtype: torch.dtype, device: torch.device | str,
                 quant: str | None = None):
        super().__init__()
        self.idx = idx
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, opts, device)
        self.self_attn = M3Attention(cfg, idx, opts, dtype, device, quant)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, opts, device)
        if cfg.is_moe(idx):
            self.mlp: nn.Module = M3MoE(cfg, opts, dtype, device, quant)
        else:
            self.mlp = SwiGLUOAIMLP(cfg.hidden_size, cfg.dense_intermediate_size, cfg.swiglu_alpha,
                                    cfg.swiglu_limit, dtype, device, quant=quant, opts=opts)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                prev_selection: torch.Tensor | None):
        # The residual stream is carried separately so each "add, then norm" can be one fused kernel.
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h, selection = self.self_attn(h, positions, rope, meta, prev_selection)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual, selection


class M3ForCausalLM(nn.Module):
    """The whole text model. `forward` returns final hidden states; `compute_logits` applies the LM head to the
    rows the caller needs (usually each sequence's last token), in fp32.

    `quantization` is the checkpoint's weight format: None (bf16) or "mxfp8". With "mxfp8" and the
    `mxfp8_weights` switch on, every quantized projection keeps its fp8 weights and E8M0 scales on the device
    (`weight_format == "mxfp8"`); with it off they are dequantised to `dtype` at load (the reference path).
    The embedding, lm_head, norms and router are never quantized."""

    def __init__(self, cfg: M3Config, opts: Optimizations | None = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", quantization: str | None = None):
        super().__init__()
        self.cfg = cfg
        self.opts = opts if opts is not None else Optimizations()
        self.dtype = dtype
        self.quantization = quantization
        self.weight_format = quantization if quantization == "mxfp8" and self.opts.mxfp8_weights else None
        quant = self.weight_format
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, device)
        self.layers = nn.ModuleList(M3DecoderLayer(cfg, i, self.opts, dtype, device, quant)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, self.opts, device)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, dtype, device, self.opts)
        self.register_buffer("inv_freq", reference.rope_inv_freq(cfg.rotary_dim, cfg.rope_theta, device),
                             persistent=False)
        # switch rope_table: (cos, sin) of positions 0 .. len-1, [len, 2, rotary_dim / 2] fp32, grown on demand.
        # Replaced tables stay referenced: a decode graph captured earlier still reads the one it was captured with.
        self.rope_table: torch.Tensor | None = None
        self._old_rope_tables: list[torch.Tensor] = []

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden]. `inputs_embeds` [T, hidden]: the input
        embeddings to start from instead of the ids' (a step with image or video features at its placeholders:
        runner/multimodal.py)."""
        rope = self.rope(positions, meta.max_seq_len)
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        selection = None
        msa_seen = 0
        for layer in self.layers:
            reuse = None
            if layer.self_attn.sparse:
                if self.opts.msa_topk_reuse and msa_seen % MSA_TOPK_REUSE_EVERY:
                    reuse = selection
                msa_seen += 1
            x, residual, sel = layer(x, residual, positions, rope, meta, reuse)
            if sel is not None:
                selection = sel
        x, _ = self.norm(x, residual)
        return x

    def rope(self, positions: torch.Tensor, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE (cos, sin) [T, rotary_dim / 2] fp32 for positions < max_seq_len. Switch `rope_table`: one gather
        from a table that `reference.rope_cos_sin` computed for every position (the same element-wise ops, so the
        same values); off: computed from the positions, four launches per step."""
        if not self.opts.rope_table:
            return reference.rope_cos_sin(positions, self.inv_freq)
        table = self.rope_table
        if table is None or table.shape[0] < max_seq_len:
            size = max(max_seq_len, 2 * table.shape[0] if table is not None else ROPE_TABLE_MIN)
            size = max(max_seq_len, min(size, self.cfg.max_position_embeddings))
            if table is not None:
                self._old_rope_tables.append(table)
            cos, sin = reference.rope_cos_sin(torch.arange(size, device=self.inv_freq.device), self.inv_freq)
            table = self.rope_table = torch.stack([cos, sin], dim=1)
        picked = table.index_select(0, positions)
        return picked[:, 0], picked[:, 1]

    def weight_summary(self) -> str:
        """One line for the startup log: the weight format this rank serves and the bytes its parameters take."""
        held = sum(p.numel() * p.element_size() for p in self.parameters())
        if self.weight_format == "mxfp8":
            what = "mxfp8 (fp8 e4m3 + one E8M0 scale per 32 weights; embeddings, lm_head, norms, router unquantized)"
        elif self.quantization == "mxfp8":
            what = f"{str(self.dtype).removeprefix('torch.')} (the MXFP8 weights dequantized at load)"
        else:
            what = str(self.dtype).removeprefix("torch.")
        return f"{what}, {held / 2**30:.2f} GiB of parameters"

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits of the given hidden rows (into `out` when given)."""
        return self.lm_head(hidden, out)

    def set_trace(self, fn: Callable[..., None] | None) -> None:
        """Install (or, with None, remove) a tracing hook: each MSA attention layer then calls
        fn("msa_select", layer=i, ...) after choosing its KV blocks, and each MoE layer fn("moe_route", layer=i, ...)
        after routing (payloads: M3Attention.trace, M3MoE.trace). For teaching and debugging: the walkthrough
        narrates from it. Not called from captured CUDA graphs."""
        for i, layer in enumerate(self.layers):
            hook = None if fn is None else functools.partial(fn, layer=i)
            layer.self_attn.trace = hook
            if isinstance(layer.mlp, M3MoE):
                layer.mlp.trace = hook

    def bind_kv_caches(self, kv_caches: list[torch.Tensor], index_caches: list[torch.Tensor | None]) -> None:
        """Give each layer its KV pool (and MSA layers their index-key pool)."""
        for layer, kv, idx in zip(self.layers, kv_caches, index_caches):
            layer.self_attn.kv_cache = kv
            layer.self_attn.index_cache = idx
