"""What one GPU holds for an M3 model: weight bytes, KV-cache bytes per token, and the context x concurrency the
rest leaves.

`kv_bytes_per_token` is what the engine sizes its KV pool with (runner/kv_cache.py `kv_cache_bytes_per_block`);
`weight_bytes_per_gpu` follows the sharding rules of the layers (model/layers/): query heads, the dense MLP and
the shared expert split over tensor-parallel ranks; KV and index heads split while tp <= num_key_value_heads and
replicated beyond; the single index-key head, the router, the norms replicated; the embedding and lm_head split
by vocabulary rows; routed experts split by intermediate dim (TP) or by whole experts (EP), the same bytes either
way. MXFP8 (`quantization="mxfp8"`): every quantized matrix costs 1 byte per weight plus one E8M0 byte per 32;
the embedding, lm_head, norms and router stay as in bf16. docs/memory.md tabulates the real model with these.

    python -m nanoserve.model.memory_plan      # the docs/memory.md tables for the released M3 config
"""

from __future__ import annotations

from dataclasses import dataclass

from nanoserve.parallel_state import kv_head_range
from nanoserve.model.m3_config import M3Config

MXFP8_BLOCK = 32
QUANTIZATIONS = (None, "mxfp8")


def kv_bytes_per_token(cfg: M3Config, item_bytes: int, tp_size: int = 1, rank: int = 0) -> int:
    """KV-cache bytes one token costs on `rank` of `tp_size`, all layers: K + V of this rank's KV heads on every
    layer, plus the index key (one replicated head) on every MSA layer."""
    k0, k1 = kv_head_range(cfg.num_key_value_heads, rank, tp_size)
    per_token = cfg.num_hidden_layers * 2 * (k1 - k0) * cfg.head_dim + cfg.num_sparse_attn_layers * cfg.index_head_dim
    return per_token * item_bytes


@dataclass(frozen=True)
class WeightBytes:
    """One rank's weight bytes, by part."""

    quantized: int
    """The matrices an MXFP8 checkpoint quantizes (attention and indexer projections, MLPs, experts)."""
    scales: int
    """Their E8M0 scales (0 in bf16)."""
    embeddings: int
    """embed_tokens + lm_head (bf16 in both formats)."""
    other: int
    """Norms, router weight and bias (fp32), replicated."""

    @property
    def total(self) -> int:
        return self.quantized + self.scales + self.embeddings + self.other


def weight_bytes_per_gpu(cfg: M3Config, tp_size: int = 1, quantization: str | None = None,
                         rank: int = 0) -> WeightBytes:
    """The weight bytes `rank` of `tp_size` holds (expert parallel or not: the same count)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization={quantization!r} is invalid: one of {QUANTIZATIONS}")
    h, d, di, tp = cfg.hidden_size, cfg.head_dim, cfg.index_head_dim, tp_size
    k0, k1 = kv_head_range(cfg.num_key_value_heads, rank, tp)
    kv_local = k1 - k0
    matrices = 0  # weights of quantizable matrices on this rank
    norms = cfg.hidden_size  # final norm
    router = 0
    for layer in range(cfg.num_hidden_layers):
        norms += 2 * h + 2 * d
        matrices += (cfg.q_size // tp) * h * 2  # q_proj and o_proj
        matrices += 2 * kv_local * d * h  # k_proj, v_proj
        if cfg.is_sparse_attention(layer):
            matrices += kv_local * di * h + di * h  # index_q (sharded like KV), index_k (replicated)
            norms += 2 * di
        if cfg.is_moe(layer):
            matrices += cfg.num_local_experts * 3 * cfg.intermediate_size * h // tp
            matrices += 3 * cfg.shared_intermediate_size * h // tp
            router += cfg.num_local_experts * h + cfg.num_local_experts
        else:
            matrices += 3 * cfg.dense_intermediate_size * h // tp
    embeddings = 2 * (cfg.vocab_size // tp) * h * 2
    other = norms * 2 + router * 4
    if quantization == "mxfp8":
        return WeightBytes(matrices, matrices // MXFP8_BLOCK, embeddings, other)
    return WeightBytes(matrices * 2, 0, embeddings, other)


@dataclass(frozen=True)
class MemoryPlan:
    """One configuration's budget on one GPU."""

    gpu_bytes: int
    tp_size: int
    quantization: str | None
    weights: WeightBytes
    kv_per_token: int
    usable_bytes: int
    """gpu_bytes x utilization - weights - activation reserve: what the KV pool gets."""

    @property
    def kv_tokens(self) -> int:
        """Tokens of context the KV pool holds (all sequences together)."""
        return max(self.usable_bytes, 0) // self.kv_per_token

    def concurrency(self, context: int) -> int:
        """Sequences of `context` tokens that fit at once."""
        return self.kv_tokens // context


def memory_plan(cfg: M3Config, gpu_bytes: int, tp_size: int, quantization: str | None = None,
                kv_item_bytes: int = 2, gpu_memory_utilization: float = 0.9,
                activation_reserve_bytes: int = 4 * 2**30) -> MemoryPlan:
    """The budget of rank 0 (the ranks differ only in which heads they hold): weights, KV bytes per token, and
    the pool left under `gpu_memory_utilization` after the weights and a reserve for activations of a prefill
    step (the engine measures that peak at start; 4 GiB is what m3-slice's 8192-token step peaked at)."""
    weights = weight_bytes_per_gpu(cfg, tp_size, quantization)
    kv = kv_bytes_per_token(cfg, kv_item_bytes, tp_size)
    usable = int(gpu_bytes * gpu_memory_utilization) - weights.total - activation_reserve_bytes
    return MemoryPlan(gpu_bytes, tp_size, quantization, weights, kv, usable)


GPUS = {"H200 (141 GB)": 141 * 10**9, "MI355X (288 GB)": 288 * 10**9}
CONTEXTS = (131_072, 1_048_576)


def markdown_tables(cfg: M3Config) -> str:
    """The docs/memory.md table: per GPU x layout x format."""
    lines = ["| GPU | layout | weights | weights / GPU | KV B/token/GPU | KV pool / GPU | tokens in KV | "
             "128k-token seqs | 1M-token seqs |", "|---|---|---|---|---|---|---|---|---|"]
    for gpu, nbytes in GPUS.items():
        for layout in ("TP=8", "TP=8+EP"):
            for quant in (None, "mxfp8"):
                p = memory_plan(cfg, nbytes, 8, quant)
                pool = f"{p.usable_bytes / 1e9:.1f} GB" if p.usable_bytes > 0 else "none"
                lines.append(f"| {gpu} | {layout} | {quant or 'bf16'} | {p.weights.total / 1e9:.1f} GB | "
                             f"{p.kv_per_token:,} | {pool} | {p.kv_tokens:,} | {p.concurrency(CONTEXTS[0])} | "
                             f"{p.concurrency(CONTEXTS[1])} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_tables(M3Config()))
