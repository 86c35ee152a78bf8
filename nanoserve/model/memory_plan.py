"""What one GPU holds for an M3 model: weight bytes, KV-cache bytes per token, and the context x concurrency the
rest leaves.

`kv_bytes_per_token` is what the engine sizes its KV pool with (runner/kv_cache.py `kv_cache_bytes_per_block`),
and `kv_pool_bytes` is the budget rule it divides (runner/model_runner.py `determine_num_blocks`, through
`engine_kv_pool_bytes`): the device's total memory x gpu_memory_utilization, less what the engine uses at the peak
of a worst-case step (its weights plus that step's activations, measured at start) and what other processes
hold, capped by what is free (so an engine beside another in one process does not count the other's memory).
`memory_plan` applies the same two functions to a configuration on paper, with the weights counted by
`weight_bytes_per_gpu` and a fixed reserve for the activations.

`weight_bytes_per_gpu` follows the sharding rules of the layers (model/layers/): query heads, the dense MLP and the
shared expert split over tensor-parallel ranks; KV and index-query heads split while tp <= num_key_value_heads and
replicated beyond; the single index-key head, the router, the norms replicated; the embedding and lm_head split by
vocabulary rows; routed experts split by intermediate dim (TP) or by whole experts (EP). MXFP8
(`quantization="mxfp8"`): every quantized matrix costs 1 byte per weight plus one E8M0 byte per 32; the embedding
and lm_head stay 16-bit; the norms and the router are fp32 in either format. docs/mxfp8.md tabulates the released
model with these:

    python -m nanoserve.bench --memory-plan          # the docs/mxfp8.md memory table, for the released M3 config
"""

from __future__ import annotations

from dataclasses import dataclass

from nanoserve.model.m3_config import M3Config
from nanoserve.parallel_state import kv_head_range

MXFP8_BLOCK = 32
QUANTIZATIONS = (None, "mxfp8")


@dataclass(frozen=True)
class KVBytes:
    """KV-cache bytes one token costs on one rank, all layers, by part."""

    dense: int
    """K + V of this rank's KV heads on the dense-attention layers."""
    msa: int
    """K + V of this rank's KV heads on the MSA layers."""
    index_keys: int
    """The MSA index key (one head, replicated on every rank) on every MSA layer."""

    @property
    def total(self) -> int:
        return self.dense + self.msa + self.index_keys


def kv_bytes_by_part(cfg: M3Config, item_bytes: int, tp_size: int = 1, rank: int = 0) -> KVBytes:
    k0, k1 = kv_head_range(cfg.num_key_value_heads, rank, tp_size)
    kv_per_layer = 2 * (k1 - k0) * cfg.head_dim * item_bytes
    sparse = cfg.num_sparse_attn_layers
    return KVBytes(dense=(cfg.num_hidden_layers - sparse) * kv_per_layer, msa=sparse * kv_per_layer,
                   index_keys=sparse * cfg.index_head_dim * item_bytes)


def kv_bytes_per_token(cfg: M3Config, item_bytes: int, tp_size: int = 1, rank: int = 0) -> int:
    """KV-cache bytes one token costs on `rank` of `tp_size`, all layers: K + V of this rank's KV heads on every
    layer, plus the index key (one replicated head) on every MSA layer."""
    return kv_bytes_by_part(cfg, item_bytes, tp_size, rank).total


def kv_pool_bytes(total_bytes: int, gpu_memory_utilization: float, used_bytes: int) -> int:
    """The bytes the KV pool gets: total x gpu_memory_utilization, less what is in use at the peak of a step
    (weights, activations, other processes). The engine's rule (runner/model_runner.py) and the plan's."""
    return int(total_bytes * gpu_memory_utilization - used_bytes)


@dataclass(frozen=True)
class DeviceMemory:
    """What an engine reads of its GPU when it sizes its KV pool (bytes; runner/model_runner.py): before it loaded
    its weights, and around one worst-case warm-up step."""

    total: int
    """The device's memory (torch.cuda.mem_get_info)."""
    free: int
    """Free on the device after the warm-up step's memory went back to it."""
    baseline: int
    """Allocated by this process before the engine loaded its weights: other engines of the process, and the
    tensors of one shut down but not yet collected."""
    held: int
    """Allocated by this process after the warm-up: the baseline plus this engine's weights."""
    peak: int
    """The most allocated by this process during the warm-up step: held plus the step's activations."""
    reserved: int
    """Held by this process's caching allocator after the warm-up (allocated or cached)."""


def engine_kv_pool_bytes(mem: DeviceMemory, gpu_memory_utilization: float) -> int:
    """The bytes an engine's KV pool gets: its share, total x gpu_memory_utilization less what the engine itself
    uses at the peak of a step (its weights and activations, counted from its baseline) and what other processes
    hold (kv_pool_bytes); at most what is free, less the room its steps' activations need again. Alone on the
    device that is the share (the share is the smaller). A second engine in the same process does not count the
    first one's memory in its share: it gets its share if the device has it, or what is left (vLLM's
    gpu_memory_utilization is per instance likewise)."""
    own_peak = mem.peak - mem.baseline
    other_processes = mem.total - mem.free - mem.reserved
    share = kv_pool_bytes(mem.total, gpu_memory_utilization, own_peak + other_processes)
    fits = mem.free + (mem.reserved - mem.held) - (mem.peak - mem.held)  # free, the allocator's cache, less a step
    return min(share, fits)


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
                         rank: int = 0, expert_parallel: bool = False) -> WeightBytes:
    """The weight bytes `rank` of `tp_size` holds. Routed experts: each expert's intermediate dim split over the
    ranks (TP), or whole experts, num_local_experts / tp_size of them per rank (EP) - the same bytes when both
    divide evenly, as they do for M3 at TP=8."""
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
            if expert_parallel:
                matrices += (cfg.num_local_experts // tp) * 3 * cfg.intermediate_size * h
            else:
                matrices += cfg.num_local_experts * 3 * (cfg.intermediate_size // tp) * h
            matrices += 3 * cfg.shared_intermediate_size * h // tp
            router += cfg.num_local_experts * h + cfg.num_local_experts
        else:
            matrices += 3 * cfg.dense_intermediate_size * h // tp
    embeddings = 2 * (cfg.vocab_size // tp) * h * 2
    other = norms * 4 + router * 4  # the norms' weights are fp32, as is the router
    if quantization == "mxfp8":
        return WeightBytes(matrices, matrices // MXFP8_BLOCK, embeddings, other)
    return WeightBytes(matrices * 2, 0, embeddings, other)


@dataclass(frozen=True)
class MemoryPlan:
    """One configuration's budget on one GPU (rank 0; the ranks differ only in which heads they hold)."""

    gpu_bytes: int
    tp_size: int
    expert_parallel: bool
    quantization: str | None
    weights: WeightBytes
    kv: KVBytes
    pool_bytes: int
    """kv_pool_bytes(gpu_bytes, utilization, weights + activation reserve): what the KV pool gets."""

    @property
    def kv_per_token(self) -> int:
        return self.kv.total

    @property
    def kv_tokens(self) -> int:
        """Tokens of context the KV pool holds (all sequences together)."""
        return max(self.pool_bytes, 0) // self.kv_per_token

    def concurrency(self, context: int) -> int:
        """Sequences of `context` tokens that fit at once."""
        return self.kv_tokens // context


ACTIVATION_RESERVE_BYTES = 4 * 2**30
"""The plan's stand-in for the activations of the worst-case step, which the engine measures at start instead
(4 GiB: what m3-slice's 8192-token prefill step peaked at)."""


def memory_plan(cfg: M3Config, gpu_bytes: int, tp_size: int, quantization: str | None = None,
                expert_parallel: bool = False, kv_item_bytes: int = 2, gpu_memory_utilization: float = 0.9,
                activation_reserve_bytes: int = ACTIVATION_RESERVE_BYTES) -> MemoryPlan:
    """The budget of rank 0: weights, KV bytes per token, and the pool left under `gpu_memory_utilization` after
    the weights and the activation reserve (the engine's rule, `kv_pool_bytes`)."""
    weights = weight_bytes_per_gpu(cfg, tp_size, quantization, expert_parallel=expert_parallel)
    kv = kv_bytes_by_part(cfg, kv_item_bytes, tp_size)
    pool = kv_pool_bytes(gpu_bytes, gpu_memory_utilization, weights.total + activation_reserve_bytes)
    return MemoryPlan(gpu_bytes, tp_size, expert_parallel, quantization, weights, kv, pool)


GPUS = {"H200": 143_771 * 2**20, "MI355X": 288 * 2**30}
"""Total device memory, as the engine reads it (torch.cuda.mem_get_info): an H200 (sold as 141 GB) reports
143,771 MiB; an MI355X is sold as 288 GB, taken here as 288 GiB."""
LAYOUTS = {"TP=8": (8, False), "TP=8+EP": (8, True)}
CONTEXTS = (32_768, 131_072, 1_048_576)


def plans(cfg: M3Config) -> list[tuple[str, str, MemoryPlan]]:
    """(GPU, layout, plan) for every GPU x layout x format of the table."""
    return [(gpu, layout, memory_plan(cfg, nbytes, tp, quant, expert_parallel=ep))
            for gpu, nbytes in GPUS.items() for layout, (tp, ep) in LAYOUTS.items() for quant in (None, "mxfp8")]


def markdown_table(cfg: M3Config) -> str:
    """The docs/mxfp8.md memory table: per GPU x layout x format, from `memory_plan`."""
    ctx = [f"{c // 1024}k" if c < 2**20 else f"{c // 2**20}M" for c in CONTEXTS]
    lines = ["| GPU | layout | weights | weights / GPU | KV B/token/GPU: dense + MSA + index keys = total | "
             "KV pool / GPU | tokens in KV | " + " | ".join(f"{c}-token seqs" for c in ctx) + " |",
             "|---|---|---|---|---|---|---|" + "---|" * len(CONTEXTS)]
    for gpu, layout, p in plans(cfg):
        pool = f"{p.pool_bytes / 2**30:.1f} GiB" if p.pool_bytes > 0 else "none"
        kv = p.kv
        lines.append(f"| {gpu} | {layout} | {p.quantization or 'bf16'} | {p.weights.total / 2**30:.1f} GiB | "
                     f"{kv.dense:,} + {kv.msa:,} + {kv.index_keys:,} = {kv.total:,} | {pool} | {p.kv_tokens:,} | "
                     + " | ".join(str(p.concurrency(c)) for c in CONTEXTS) + " |")
    return "\n".join(lines)

