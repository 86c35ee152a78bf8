"""M3 attention: one class for both layer kinds.

Dense layers (M3 layers 0-2) run causal GQA over the whole paged context. MSA layers (3-59) add the indexer:
index q/k projections with their own per-head norms and the same RoPE, token scores against the key-only index
cache, a max-pool per KV block, the query's own block forced in, and the top-k blocks per KV group; attention
then runs exactly over the selected blocks.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from nanoserve.batch import AttentionMetadata
from nanoserve.config import Optimizations
from nanoserve.kernels import reference, triton_usable
from nanoserve.model.layers.linear import (
    MergedColumnParallelLinear,
    OutputPart,
    RowParallelLinear,
    replicated_parameter,
)
from nanoserve.model.m3_config import M3Config
from nanoserve.parallel_state import get_tp, kv_head_range, shard_range


class M3Attention(nn.Module):
    """q|k|v (|index_q|index_k on MSA layers) as one column-parallel GEMM, per-head QK-norm + partial RoPE,
    K/V (and index-key) cache insert, dense or block-sparse paged attention, row-parallel o_proj.

    Under tensor parallelism a rank holds num_attention_heads / tp query heads and the KV heads (and index heads,
    one per KV head) they read: split while tp <= num_key_value_heads, replicated beyond. The single index-key
    head is replicated on every rank."""

    trace: Callable[..., None] | None = None
    """Optional tracing hook, for teaching and debugging (set it with M3ForCausalLM.set_trace). An MSA layer calls
    trace("msa_select", index_q=, index_cache=, meta=, selection=) right after choosing its blocks. Eager mode
    only; left None it costs one attribute check."""

    def __init__(self, cfg: M3Config, layer_idx: int, opts: Optimizations, dtype: torch.dtype,
                 device: torch.device | str, quant: str | None = None):
        super().__init__()
        self.cfg = cfg
        self.layer_idx = layer_idx
        self.opts = opts
        self.sparse = cfg.is_sparse_attention(layer_idx)
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        tp = get_tp()
        if cfg.num_attention_heads % tp.size:
            raise ValueError(f"num_attention_heads={cfg.num_attention_heads} is not divisible by "
                             f"tensor_parallel_size={tp.size}")
        q0, q1 = shard_range(cfg.num_attention_heads)
        k0, k1 = kv_head_range(cfg.num_key_value_heads)
        self.num_heads, self.num_kv_heads = q1 - q0, k1 - k0
        d = cfg.head_dim
        parts = [OutputPart("q", cfg.q_size, q0 * d, q1 * d), OutputPart("k", cfg.kv_size, k0 * d, k1 * d),
                 OutputPart("v", cfg.kv_size, k0 * d, k1 * d)]
        if self.sparse:
            di = cfg.index_head_dim
            self.index_head_dim = di
            self.num_index_heads = self.num_kv_heads  # one index head per KV group, sharded like the KV heads
            parts += [OutputPart("index_q", cfg.index_n_heads * di, k0 * di, k1 * di),
                      OutputPart.replicated("index_k", di)]
        self.qkv_proj = MergedColumnParallelLinear(cfg.hidden_size, parts, dtype, device, quant, opts)
        self.split_sizes = self.qkv_proj.split_sizes()
        self.o_proj = RowParallelLinear(cfg.q_size, cfg.hidden_size, dtype, device, (q0 * d, q1 * d), quant=quant,
                                        opts=opts)
        self.q_norm = replicated_parameter((d,), torch.float32, device)
        self.k_norm = replicated_parameter((d,), torch.float32, device)
        if self.sparse:
            self.index_q_norm = replicated_parameter((cfg.index_head_dim,), torch.float32, device)
            self.index_k_norm = replicated_parameter((cfg.index_head_dim,), torch.float32, device)
        self.kv_cache: torch.Tensor | None = None  # [num_blocks, 2, block_size, kv_heads, head_dim]
        self.index_cache: torch.Tensor | None = None  # [num_blocks, block_size, index_head_dim]
        # an fp8 pool's per-tensor scales (stored = x / scale): the checkpoint's k_scale / v_scale, else 1.0
        self.k_scale = 1.0
        self.v_scale = 1.0

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, prev_selection: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [T, hidden] -> (out [T, hidden], this layer's MSA block selection or None).
        `prev_selection` is the previous MSA layer's selection, reused only under the msa_topk_reuse
        approximation."""
        if self.kv_cache is None:
            raise RuntimeError("KV cache not bound: call model.bind_kv_caches() first")
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        q, index_q = self._norm_rope_insert(qkv, positions, rope, meta)
        selection = None
        if self.sparse:
            selection = prev_selection if prev_selection is not None else self._select(index_q, meta)
            if self.trace is not None:
                self.trace("msa_select", index_q=index_q, index_cache=self.index_cache, meta=meta, selection=selection)
            out = self._sparse_attention(q, meta, selection)
        else:
            out = self._dense_attention(q, meta)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim)), selection

    # -- stages -------------------------------------------------------------------------------------------
    def _kv_scales(self) -> tuple[float, float]:
        """(k_scale, v_scale) the pool is written and read with: the layer's for an fp8 pool; a 16/32-bit pool
        holds the values themselves (as vLLM, which uses the scales with an fp8 cache only)."""
        if self.kv_cache.dtype == reference.FP8_KV_DTYPE:
            return self.k_scale, self.v_scale
        return 1.0, 1.0

    def _norm_rope_insert(self, qkv: torch.Tensor, positions: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                          meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-head QK-norm, partial RoPE, and the K/V + index-key cache writes. Returns (q, index_q)."""
        eps = self.cfg.rms_norm_eps
        if self.opts.fused_qk_norm_rope and triton_usable(qkv):
            from nanoserve.kernels.norm_rope import qk_norm_rope_insert

            return qk_norm_rope_insert(
                qkv, self.split_sizes, self.head_dim, self.q_norm, self.k_norm,
                self.index_q_norm if self.sparse else None, self.index_k_norm if self.sparse else None,
                positions, rope, eps, meta.slot_mapping, self.kv_cache, self.index_cache, *self._kv_scales())
        t, d = qkv.shape[0], self.head_dim
        pieces = torch.split(qkv, self.split_sizes, dim=-1)
        cos, sin = rope
        q, k = reference.qk_norm_rope(pieces[0].reshape(t, -1, d), pieces[1].reshape(t, -1, d),
                                      self.q_norm, self.k_norm, cos, sin, eps)
        reference.write_kv(self.kv_cache, k, pieces[2].reshape(t, -1, d), meta.slot_mapping, *self._kv_scales())
        if not self.sparse:
            return q, None
        di = self.index_head_dim
        index_q, index_k = reference.qk_norm_rope(pieces[3].reshape(t, -1, di), pieces[4].reshape(t, 1, di),
                                                  self.index_q_norm, self.index_k_norm, cos, sin, eps)
        reference.write_index_keys(self.index_cache, index_k[:, 0], meta.slot_mapping)
        return q, index_q

    def _dense_attention(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        k_scale, v_scale = self._kv_scales()
        if self.opts.triton_attention and triton_usable(q):
            from nanoserve.kernels.attention import paged_attention

            return paged_attention(q, self.kv_cache, meta, self.scale, k_scale=k_scale, v_scale=v_scale)
        return reference.paged_attention(q, self.kv_cache, meta, self.scale, k_scale=k_scale, v_scale=v_scale)

    def _select(self, index_q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        topk, local = self.cfg.index_topk_blocks, self.cfg.index_local_blocks
        if self.opts.triton_msa and triton_usable(index_q):
            from nanoserve.kernels.msa import msa_select

            return msa_select(index_q, self.index_cache, meta, topk, local)
        return reference.msa_select(index_q, self.index_cache, meta, topk, local)

    def _sparse_attention(self, q: torch.Tensor, meta: AttentionMetadata, selection: torch.Tensor) -> torch.Tensor:
        k_scale, v_scale = self._kv_scales()
        if self.opts.triton_msa and triton_usable(q):
            from nanoserve.kernels.msa import sparse_attention

            return sparse_attention(q, self.kv_cache, meta, selection, self.scale,
                                    by_block=self.opts.msa_sparse_by_block, k_scale=k_scale, v_scale=v_scale)
        return reference.sparse_attention(q, self.kv_cache, meta, selection, self.scale, k_scale=k_scale,
                                          v_scale=v_scale)
