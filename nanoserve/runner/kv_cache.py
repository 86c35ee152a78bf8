"""The paged KV cache pools: per layer a K/V pool, and per MSA layer a key-only index pool.

    kv[layer]           [num_blocks, 2, block_size, kv_heads_on_this_rank, head_dim]
    index_keys[layer]   [num_blocks, block_size, index_head_dim]          (MSA layers; None on dense layers)

All layers share one block table per sequence: logical block b of a sequence is the same physical block id in
every pool. For M3 the KV block size equals the MSA block size, so "MSA block b" is "block-table entry b".

The pools' element type is the model dtype, or with `kv_cache_dtype="fp8"` (or "fp8_e4m3") fp8 e4m3 for all of
them, K/V and index keys alike: one byte per element, so the same memory holds twice the tokens of a bf16 pool.
How values go in and out of an fp8 pool: kernels/reference.py `to_cache` / `from_cache`.
"""

from __future__ import annotations

import torch

from nanoserve.config import KV_CACHE_DTYPES
from nanoserve.kernels.reference import FP8_KV_DTYPE
from nanoserve.model.m3_config import M3Config
from nanoserve.model.memory_plan import kv_bytes_per_token
from nanoserve.parallel_state import get_tp, kv_head_range


def kv_block_size(cfg: M3Config, requested: int | None = None) -> int:
    """Tokens per KV block: the model's MSA block size (MSA selects KV blocks by block-table entry), the one place
    it is derived - the runner sizes its pools by it, the executor reports it, the engine's block manager and
    limits take it from there. `requested`: EngineConfig.block_size, which may only name the same size."""
    if requested is not None and requested != cfg.index_block_size:
        raise ValueError(f"block_size={requested} is invalid: it must equal the model's MSA block size "
                         f"({cfg.index_block_size}), since MSA selects KV blocks by block-table entry")
    return cfg.index_block_size


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pools' element type for `kv_cache_dtype` (EngineConfig): "auto" = the model dtype, "fp8" / "fp8_e4m3" =
    float8_e4m3fn (OCP e4m3 on every GPU, MI300X included: docs/rocm.md)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in KV_CACHE_DTYPES:
        return FP8_KV_DTYPE
    raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is invalid: one of {', '.join(KV_CACHE_DTYPES)}")


def kv_cache_bytes_per_block(cfg: M3Config, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one KV block costs on this rank, summed over layers (K + V + index keys; model/memory_plan.py)."""
    tp = get_tp()
    item = torch.empty((), dtype=dtype).element_size()
    return kv_bytes_per_token(cfg, item, tp.size, tp.rank) * block_size


def allocate_kv_caches(cfg: M3Config, num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device | str) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """Allocate every layer's pools. They start zeroed; attention never reads a slot before it is written."""
    k0, k1 = kv_head_range(cfg.num_key_value_heads)
    kv, index = [], []
    for layer in range(cfg.num_hidden_layers):
        kv.append(torch.zeros(num_blocks, 2, block_size, k1 - k0, cfg.head_dim, dtype=dtype, device=device))
        index.append(torch.zeros(num_blocks, block_size, cfg.index_head_dim, dtype=dtype, device=device)
                     if cfg.is_sparse_attention(layer) else None)
    return kv, index
