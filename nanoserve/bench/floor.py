"""The physical floor of a workload: bytes a step must read and FLOPs it must do, over the device's ceilings
(docs/benchmarks.md, "The floor and the achieved rates").

A decode step reads every active weight once - the dense layers, each MSA layer's attention + indexer + router +
the experts its batch touches + the shared expert, and the LM head - plus each sequence's KV (all of it on the
dense layers; on MSA layers all index keys and the top-k selected blocks). With B sequences routed uniformly over
E experts, top-k each, a layer touches E * (1 - (1 - k/E)^B) distinct experts (~111 of 128 at B = 64).
Prefill is compute bound: 2 FLOPs per active weight per token, plus attention. A workload's floor is its prefill
FLOPs at peak plus, decode step by step, the larger of bytes / bandwidth and FLOPs / peak.
"""

from __future__ import annotations

from dataclasses import dataclass

from nanoserve.model.m3_config import M3Config


@dataclass(frozen=True)
class Ceilings:
    name: str
    bytes_per_s: float
    flops_per_s: float


H200 = Ceilings("H200 measured ceilings (4.26 TB/s copy, 772 TFLOP/s bf16 matmul)", 4.26e12, 772e12)
H100 = Ceilings("H100 SXM datasheet peaks (3.35 TB/s HBM3, 989 TFLOP/s bf16 dense matmul; not measured)", 3.35e12,
                989e12)


def ceilings_for(device_name: str | None) -> Ceilings | None:
    """The ceilings of a GPU by its name (torch.cuda.get_device_name), or None for a card without an entry."""
    name = (device_name or "").upper()
    if "H200" in name:
        return H200
    if "H100" in name:
        return H100
    return None

QUANTIZABLE_COMPONENTS = ("attention projections", "indexer projections", "dense MLPs", "routed experts w13",
                          "routed experts w2", "shared expert w13", "shared expert w2")
"""The components of a decode step's bytes whose weights MXFP8 quantizes (`ModelCost.decode_components`)."""
DECODE_COMPONENTS = QUANTIZABLE_COMPONENTS + ("router", "LM head", "embedding rows", "dense-layer KV",
                                              "MSA index keys", "MSA selected KV")
"""Every component of a decode step's bytes: the quantizable weights, the fp32 router, the 16-bit LM head and
embedding rows, the KV of the dense layers, and on MSA layers the index keys and the selected KV blocks."""


class ModelCost:
    """Bytes and FLOPs of M3 steps, from the config (weights in `weight_bytes` per element, router in fp32).

    With quantization="mxfp8" the quantized matrices (attention, indexer, MLPs, experts) cost what the engine
    reads for them: 1 byte per fp8 weight plus one E8M0 scale byte per 32; the embedding rows and the LM head stay
    at `weight_bytes` (bf16), the router in fp32."""

    def __init__(self, cfg: M3Config, weight_bytes: int = 2, kv_bytes: int = 2, quantization: str | None = None):
        self.cfg = cfg
        self.wb, self.kvb = weight_bytes, kv_bytes
        self.quantization = quantization
        self.qb = 1.0 + 1.0 / 32 if quantization == "mxfp8" else float(weight_bytes)
        """Bytes per weight of a quantizable matrix."""
        h = cfg.hidden_size
        self.attn = 2 * cfg.q_size * h + 2 * cfg.kv_size * h
        self.indexer = (cfg.index_n_heads + 1) * cfg.index_head_dim * h
        self.dense_mlp = 3 * cfg.dense_intermediate_size * h
        self.expert = 3 * cfg.intermediate_size * h
        self.shared = 3 * cfg.shared_intermediate_size * h
        self.router = cfg.num_local_experts * h
        self.lm_head = cfg.vocab_size * h
        n = cfg.num_hidden_layers
        self.dense_attn_layers = [i for i in range(n) if not cfg.is_sparse_attention(i)]
        self.sparse_attn_layers = [i for i in range(n) if cfg.is_sparse_attention(i)]
        self.moe_layers = [i for i in range(n) if cfg.is_moe(i)]
        self.dense_mlp_layers = [i for i in range(n) if not cfg.is_moe(i)]

    # -- weights ------------------------------------------------------------------------------------------
    def experts_touched(self, batch: int) -> float:
        e, k = self.cfg.num_local_experts, self.cfg.num_experts_per_tok
        return e * (1.0 - (1.0 - k / e) ** max(batch, 0))

    def active_params_per_token(self, with_lm_head: bool = True) -> float:
        """Weights one token multiplies (FLOPs = 2x this)."""
        c = self.cfg
        p = self.attn * c.num_hidden_layers + self.indexer * len(self.sparse_attn_layers)
        p += self.dense_mlp * len(self.dense_mlp_layers)
        p += (c.num_experts_per_tok * self.expert + self.shared + self.router) * len(self.moe_layers)
        return p + (self.lm_head if with_lm_head else 0)

    def total_params(self) -> float:
        c = self.cfg
        p = self.attn * c.num_hidden_layers + self.indexer * len(self.sparse_attn_layers)
        p += self.dense_mlp * len(self.dense_mlp_layers)
        p += (c.num_local_experts * self.expert + self.shared + self.router) * len(self.moe_layers)
        return p + 2 * self.lm_head  # embedding + LM head

    def decode_weight_bytes(self, batch: int) -> float:
        """Weight bytes one decode step of `batch` sequences reads (embedding rows included)."""
        c = self.cfg
        b = (self.attn * c.num_hidden_layers + self.indexer * len(self.sparse_attn_layers)
             + self.dense_mlp * len(self.dense_mlp_layers)
             + (self.experts_touched(batch) * self.expert + self.shared) * len(self.moe_layers)) * self.qb
        b += (self.lm_head + batch * c.hidden_size) * self.wb
        return b + self.router * len(self.moe_layers) * 4

    def all_weight_bytes(self) -> float:
        router = self.router * len(self.moe_layers)
        unquantized = 2 * self.lm_head  # embedding + LM head
        return (self.total_params() - router - unquantized) * self.qb + unquantized * self.wb + router * 4

    # -- attention ----------------------------------------------------------------------------------------
    def _selected_keys(self, context: int) -> int:
        c = self.cfg
        return min(context, c.index_topk_blocks * c.index_block_size)

    def decode_kv_bytes(self, context: int) -> float:
        """KV (and index-key) bytes one sequence's decode token reads at `context` tokens."""
        c = self.cfg
        per_token_kv = 2 * c.num_key_value_heads * c.head_dim * self.kvb
        b = len(self.dense_attn_layers) * context * per_token_kv
        b += len(self.sparse_attn_layers) * (context * c.index_head_dim * self.kvb
                                             + self._selected_keys(context) * per_token_kv)
        return b

    def attention_flops(self, context: int) -> float:
        """Attention FLOPs of one query token at `context` keys (QK + PV; indexer scores on MSA layers)."""
        c = self.cfg
        per_key = 4 * c.num_attention_heads * c.head_dim
        f = len(self.dense_attn_layers) * per_key * context
        f += len(self.sparse_attn_layers) * (2 * c.index_n_heads * c.index_head_dim * context
                                             + per_key * self._selected_keys(context))
        return f

    def decode_components(self, batch: int, context: float) -> dict[str, float]:
        """decode_step's bytes split by model component (DECODE_COMPONENTS, in that order): what one decode step
        of `batch` sequences at mean context `context` reads for each. The experts are split into w13 (gate|up,
        2/3 of an expert) and w2 (down, 1/3), as the fused MoE reads them in two kernels. The values sum to
        decode_step(batch, context)[0]."""
        c = self.cfg
        ctx = int(context)
        h, n_moe, n_sparse = c.hidden_size, len(self.moe_layers), len(self.sparse_attn_layers)
        touched = self.experts_touched(batch) * n_moe
        per_token_kv = 2 * c.num_key_value_heads * c.head_dim * self.kvb
        out = {
            "attention projections": self.attn * c.num_hidden_layers * self.qb,
            "indexer projections": self.indexer * n_sparse * self.qb,
            "dense MLPs": self.dense_mlp * len(self.dense_mlp_layers) * self.qb,
            "routed experts w13": touched * 2 * c.intermediate_size * h * self.qb,
            "routed experts w2": touched * c.intermediate_size * h * self.qb,
            "shared expert w13": n_moe * 2 * c.shared_intermediate_size * h * self.qb,
            "shared expert w2": n_moe * c.shared_intermediate_size * h * self.qb,
            "router": self.router * n_moe * 4,
            "LM head": self.lm_head * self.wb,
            "embedding rows": batch * h * self.wb,
            "dense-layer KV": batch * len(self.dense_attn_layers) * ctx * per_token_kv,
            "MSA index keys": batch * n_sparse * ctx * c.index_head_dim * self.kvb,
            "MSA selected KV": batch * n_sparse * self._selected_keys(ctx) * per_token_kv,
        }
        assert tuple(out) == DECODE_COMPONENTS
        return out

    # -- steps ----------------------------------------------------------------------------------------------
    def decode_step(self, batch: int, context: float) -> tuple[float, float]:
        """(bytes, FLOPs) of one decode step of `batch` sequences at mean context `context`."""
        ctx = int(context)
        bytes_ = self.decode_weight_bytes(batch) + batch * self.decode_kv_bytes(ctx)
        flops = batch * (2 * self.active_params_per_token() + self.attention_flops(ctx))
        return bytes_, flops

    def prefill_flops(self, prompt_len: int, cached: int = 0) -> float:
        """FLOPs to prefill tokens cached..prompt_len-1 of one prompt (one LM-head row)."""
        n = prompt_len - cached
        linear = 2 * n * self.active_params_per_token(with_lm_head=False) + 2 * self.lm_head
        # sum over query positions p of attention at context p + 1, in closed form for the dense part
        c = self.cfg
        per_key = 4 * c.num_attention_heads * c.head_dim
        ctx_sum = (prompt_len * (prompt_len + 1) - cached * (cached + 1)) / 2
        sel = c.index_topk_blocks * c.index_block_size
        sel_sum = sum(min(p + 1, sel) for p in range(cached, min(prompt_len, sel)))
        sel_sum += max(0, prompt_len - max(sel, cached)) * sel
        f = len(self.dense_attn_layers) * per_key * ctx_sum
        f += len(self.sparse_attn_layers) * (2 * c.index_n_heads * c.index_head_dim * ctx_sum + per_key * sel_sum)
        return linear + f


@dataclass
class Floor:
    prefill_s: float
    decode_s: float
    decode_steps: int
    output_tokens: int
    first_step_tpot_s: float  # floor of one decode step at the workload's first decode batch

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.total_s if self.total_s else 0.0

    def as_dict(self) -> dict:
        return {"prefill_s": self.prefill_s, "decode_s": self.decode_s, "total_s": self.total_s,
                "output_tok_s": self.output_tok_s, "tpot_ms": self.first_step_tpot_s * 1e3,
                "decode_steps": self.decode_steps}


def workload_floor(cost: ModelCost, prompt_lens: list[int], output_lens: list[int], hw: Ceilings = H200,
                   shared_prefix: int = 0, chunk_tokens: int = 8192) -> Floor:
    """Floor time of requests arriving at once: every prompt prefilled (a shared prefix once, in chunks of
    chunk_tokens that each read all weights at least once), then decode steps in lockstep, the batch shrinking
    as requests finish; each stretch of steps is costed at its mid-point context."""
    flops = sum(cost.prefill_flops(p, shared_prefix if i else 0) for i, p in enumerate(prompt_lens))
    prefill_tokens = sum(prompt_lens) - shared_prefix * max(len(prompt_lens) - 1, 0)
    chunks = -(-prefill_tokens // chunk_tokens)
    prefill_s = max(flops / hw.flops_per_s, chunks * cost.all_weight_bytes() / hw.bytes_per_s)
    # request i needs output_lens[i] - 1 decode steps (its first token comes out of the prefill)
    order = sorted(range(len(output_lens)), key=lambda i: output_lens[i])
    decode_s, steps, first = 0.0, 0, None
    for pos, i in enumerate(order):
        span = output_lens[i] - 1 - steps
        if span <= 0:
            continue
        active = order[pos:]
        ctx = sum(prompt_lens[j] for j in active) / len(active) + steps + span / 2
        bytes_, fl = cost.decode_step(len(active), ctx)
        t = max(bytes_ / hw.bytes_per_s, fl / hw.flops_per_s)
        first = t if first is None else first
        decode_s += t * span
        steps += span
    return Floor(prefill_s, decode_s, steps, sum(output_lens), first or 0.0)
