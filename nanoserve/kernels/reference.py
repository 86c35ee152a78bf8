"""The plain-PyTorch oracle: every computation a Triton kernel in this package replaces, written for clarity.

Each function here is the reference path of a switch in `nanoserve.config.Optimizations` and the thing the
kernel tests compare against. Shapes use T = tokens in the flat batch, Hq / Hkv = query / KV heads on this rank,
D = head_dim, G = MSA index heads (= Hkv), E = experts on this rank.

KV cache layout (per layer):
    kv          [num_blocks, 2, block_size, Hkv, D]    (K at [:, 0], V at [:, 1]; K stored after norm + RoPE)
    index_keys  [num_blocks, block_size, D_index]      (MSA layers only; after index-k norm + RoPE)

The pools are in the model dtype, or in fp8 e4m3 (`kv_cache_dtype="fp8"`): an fp8 pool stores x / scale saturated
to +-448 (`to_cache`) and is read back as fp8 x scale in fp32 (`from_cache`), with one scale per layer for K and one
for V (k_scale, v_scale; 1.0 unless the checkpoint has them) and 1.0 for the index keys.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from nanoserve.batch import AttentionMetadata

# --------------------------------------------------------------------------------------------------------------
# Norms, RoPE, activation
# --------------------------------------------------------------------------------------------------------------


def gemma_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma RMSNorm over the last dim: fp32 inside, scale by (1 + w), cast back to x's dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.float())).to(x.dtype)


def add_gemma_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual <- x + residual (in the activation dtype), then return (norm(residual), residual)."""
    residual = x + residual
    return gemma_rmsnorm(residual, weight, eps), residual


def rope_inv_freq(rotary_dim: int, theta: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """Inverse frequencies of the rotated dims, computed exactly as Hugging Face does (fp32)."""
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim))


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, rotary_dim/2] cos and sin in fp32."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    return freqs.cos(), freqs.sin()


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX (rotate-half) RoPE on the first 2*cos.shape[-1] dims of x [T, H, D]; the rest pass through.
    The rotation is computed in fp32 and cast back."""
    half = cos.shape[-1]
    xf = x.float()
    x1, x2, rest = xf[..., :half], xf[..., half: 2 * half], xf[..., 2 * half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1).to(x.dtype)


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """Clamped SwiGLU-OAI: min(gate, limit) * sigmoid(alpha * gate') * (clamp(up, -limit, limit) + 1), in fp32."""
    g = gate.float().clamp(max=limit)
    u = up.float().clamp(min=-limit, max=limit)
    return g * torch.sigmoid(alpha * g) * (u + 1.0)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_w: torch.Tensor, k_w: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head Gemma norm of q [T, Hq, D] and k [T, Hk, D], rounded to the activation dtype, then partial RoPE."""
    q = gemma_rmsnorm(q, q_w, eps)
    k = gemma_rmsnorm(k, k_w, eps)
    return apply_partial_rope(q, cos, sin), apply_partial_rope(k, cos, sin)


# --------------------------------------------------------------------------------------------------------------
# Paged KV cache writes and reads
# --------------------------------------------------------------------------------------------------------------


FP8_KV_DTYPE = torch.float8_e4m3fn
"""The fp8 KV cache's element type: OCP e4m3 (vLLM's "fp8" / "fp8_e4m3"), on every GPU (docs/rocm.md)."""
FP8_KV_MAX = torch.finfo(FP8_KV_DTYPE).max
"""448: the largest finite e4m3 value; writes saturate to it (e4m3fn has no infinity, an overflow would be NaN)."""


def to_cache(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """x as a pool of `dtype` stores it: a 16/32-bit pool takes x cast; an fp8 pool takes x / scale (computed in
    fp32 as x times the fp32 reciprocal, as the fused insert kernel does), saturated to +-FP8_KV_MAX and rounded to
    nearest even."""
    if dtype != FP8_KV_DTYPE:
        return x.to(dtype)
    return (x.float() * (1.0 / scale)).clamp_(-FP8_KV_MAX, FP8_KV_MAX).to(dtype)


def from_cache(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Cached values in fp32: as stored, times the scale for an fp8 pool."""
    return x.float() * scale if x.dtype == FP8_KV_DTYPE else x.float()


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Store k, v [T, Hkv, D] at their slots; slot -1 (padding) writes nothing. An fp8 pool stores k / k_scale
    and v / v_scale (`to_cache`)."""
    block_size = kv_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[blocks, 0, offsets] = to_cache(k[keep], kv_cache.dtype, k_scale)
    kv_cache[blocks, 1, offsets] = to_cache(v[keep], kv_cache.dtype, v_scale)


def write_kv_padded(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """`write_kv` for a batch whose padding rows (slot -1) come after its real ones, without a host
    synchronisation (a boolean mask's shape waits for the device, which a CUDA graph cannot capture): each padding
    row writes the first row's values into the first row's slot again, so every duplicate write is the same one."""
    block_size = kv_cache.shape[2]
    pad = (slot_mapping < 0)[:, None, None]
    slots = torch.where(slot_mapping >= 0, slot_mapping, slot_mapping[:1])
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[blocks, 0, offsets] = to_cache(torch.where(pad, k[:1], k), kv_cache.dtype)
    kv_cache[blocks, 1, offsets] = to_cache(torch.where(pad, v[:1], v), kv_cache.dtype)


def write_index_keys(index_cache: torch.Tensor, index_k: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store index keys [T, D_index] at their slots; slot -1 writes nothing. An fp8 pool stores them at scale 1
    (they only rank blocks; a scale would not change the ranking)."""
    block_size = index_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    index_cache[slots // block_size, slots % block_size] = to_cache(index_k[keep], index_cache.dtype)


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first seq_len tokens of one sequence from a paged cache: cache [N, bs, ...] -> [seq_len, ...].
    For the K/V pool pass kv_cache[:, 0] or kv_cache[:, 1]."""
    block_size = cache.shape[1]
    n_blocks = -(-seq_len // block_size)
    blocks = cache[block_table[:n_blocks].long()]
    return blocks.reshape(n_blocks * block_size, *cache.shape[2:])[:seq_len]


def _sequences(meta: AttentionMetadata):
    """Yield (index, token slice, query positions, seq_len) for each sequence of the batch."""
    start = 0
    for s, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        yield s, slice(start, start + q_len), seq_len
        start += q_len


SCORE_BYTES = 1 << 30
"""The most bytes of fp32 scores the attention and MSA references hold at once for one sequence: its queries go
through in chunks of SCORE_BYTES // (heads x context x 4) (at M3's 64 query heads and a 131,072-token context, 32
queries at a time), so a reference path stays a few GiB however long the prompt - any one kernel switch can be
turned off at long context. A query's result does not depend on the others in its chunk."""


def _query_chunks(num_queries: int, bytes_per_query: int, query_chunk: int | None) -> list[tuple[int, int]]:
    """[start, end) ranges covering num_queries: query_chunk queries each, or as many as SCORE_BYTES holds."""
    size = query_chunk or max(1, SCORE_BYTES // max(1, bytes_per_query))
    return [(a, min(a + size, num_queries)) for a in range(0, num_queries, size)]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float) -> torch.Tensor:
    """Exact softmax attention. q [Tq, Hq, D], k/v [Hkv, Tk, D] fp32, allowed [Hkv or 1, 1, Tq, Tk] bool ->
    [Tq, Hq, D]. GQA: query head h reads KV head h // (Hq // Hkv); the heads of a group share their KV head's
    matrices (no copy per query head). Scores and softmax in fp32."""
    tq, hq, d = q.shape
    hkv, tk = k.shape[0], k.shape[1]
    group = hq // hkv
    qg = q.float().transpose(0, 1).reshape(hkv, group * tq, d)  # head h = kv * group + g
    scores = torch.matmul(qg, k.transpose(-1, -2)).mul_(scale).view(hkv, group, tq, tk)
    scores.masked_fill_(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    del scores
    out = torch.matmul(probs.view(hkv, group * tq, tk), v)  # [Hkv, group x Tq, D]
    return out.view(hq, tq, d).transpose(0, 1).to(q.dtype)


def _context_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, k_scale: float = 1.0,
                v_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's cached K and V as fp32 [Hkv, seq_len, D] (an fp8 pool's times k_scale / v_scale)."""
    k = from_cache(gather_context(kv_cache[:, 0], block_table, seq_len).transpose(0, 1), k_scale)
    v = from_cache(gather_context(kv_cache[:, 1], block_table, seq_len).transpose(0, 1), v_scale)
    return k, v


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    query_chunk: int | None = None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Causal GQA attention of q [T, Hq, D] over each sequence's cached context (this step's K/V already written).
    A query at position p sees keys 0..p. Returns [T, Hq, D]. Queries go through in chunks (SCORE_BYTES; or
    query_chunk at a time). An fp8 pool is read as fp8 x k_scale / v_scale."""
    out = torch.empty_like(q)
    for s, tokens, seq_len in _sequences(meta):
        k, v = _context_kv(kv_cache, meta.block_tables[s], seq_len, k_scale, v_scale)
        pos = meta.positions[tokens]
        keys = torch.arange(seq_len, device=q.device)
        for a, b in _query_chunks(pos.shape[0], q.shape[1] * seq_len * 4, query_chunk):
            allowed = keys[None, :] <= pos[a:b, None]  # [Tc, L]
            out[tokens.start + a:tokens.start + b] = _attend(q[tokens][a:b], k, v, allowed[None, None], scale)
    return out


# --------------------------------------------------------------------------------------------------------------
# MSA: indexer block selection and block-sparse attention
# --------------------------------------------------------------------------------------------------------------


def msa_block_scores(index_q: torch.Tensor, index_keys: torch.Tensor, positions: torch.Tensor,
                     block_size: int) -> torch.Tensor:
    """Block scores of one sequence. index_q [Tq, G, Di] (normed + roped), index_keys [L, Di] (its cached keys),
    positions [Tq]. Token score s_g(t, j) = <q_g(t), k(j)> in fp32 (no 1/sqrt(d): ranking is unchanged), -inf for
    j > p_t; a block's score is the max over its causally visible keys. Returns [G, Tq, n_blocks] with -inf for
    blocks after the query's own block."""
    seq_len = index_keys.shape[0]
    n_blocks = -(-seq_len // block_size)
    scores = torch.einsum("tgd,ld->gtl", index_q.float(), from_cache(index_keys))
    future = torch.arange(seq_len, device=scores.device)[None, :] > positions[:, None]
    scores = scores.masked_fill(future[None], float("-inf"))
    scores = F.pad(scores, (0, n_blocks * block_size - seq_len), value=float("-inf"))
    return scores.view(*scores.shape[:2], n_blocks, block_size).amax(-1)


def msa_topk_blocks(block_scores: torch.Tensor, positions: torch.Tensor, block_size: int, topk: int,
                    local_blocks: int) -> torch.Tensor:
    """Select blocks from [G, Tq, n_blocks] scores: the query's own block and the (local_blocks - 1) before it are
    forced; then the highest scores. Ties break toward the lower block index (a stable descending sort), so any
    implementation that orders by (score desc, block asc) selects the same set. Returns [Tq, G, topk] int32 logical
    block indices in that order, padded with -1 where fewer than topk blocks are valid."""
    g, tq, n_blocks = block_scores.shape
    scores = block_scores.clone()
    own = (positions // block_size).long()  # [Tq]
    blocks = torch.arange(n_blocks, device=scores.device)
    forced = (blocks[None, :] <= own[:, None]) & (blocks[None, :] > own[:, None] - local_blocks)  # [Tq, nb]
    scores = scores.masked_fill(forced[None], float("inf"))
    order = torch.sort(scores, dim=-1, descending=True, stable=True)
    k = min(topk, n_blocks)
    picked = order.indices[..., :k].to(torch.int32)
    picked = picked.masked_fill(order.values[..., :k] == float("-inf"), -1)
    if k < topk:
        picked = F.pad(picked, (0, topk - k), value=-1)
    return picked.permute(1, 0, 2).contiguous()


def msa_select(index_q: torch.Tensor, index_cache: torch.Tensor, meta: AttentionMetadata, topk: int,
               local_blocks: int, query_chunk: int | None = None) -> torch.Tensor:
    """MSA indexer for a whole batch: index_q [T, G, Di] -> selected logical blocks [T, G, topk] int32 (-1 pad).
    Queries are scored in chunks (SCORE_BYTES; or query_chunk at a time)."""
    block_size = index_cache.shape[1]
    out = torch.full((index_q.shape[0], index_q.shape[1], topk), -1, dtype=torch.int32, device=index_q.device)
    for s, tokens, seq_len in _sequences(meta):
        keys = gather_context(index_cache, meta.block_tables[s], seq_len)
        pos = meta.positions[tokens]
        iq = index_q[tokens]
        for a, b in _query_chunks(pos.shape[0], iq.shape[1] * seq_len * 4, query_chunk):
            scores = msa_block_scores(iq[a:b], keys, pos[a:b], block_size)
            out[tokens.start + a:tokens.start + b] = msa_topk_blocks(scores, pos[a:b], block_size, topk,
                                                                     local_blocks)
    return out


def sparse_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, selected: torch.Tensor,
                     scale: float, query_chunk: int | None = None, k_scale: float = 1.0,
                     v_scale: float = 1.0) -> torch.Tensor:
    """Exact attention of q [T, Hq, D] over the union of the blocks its KV group selected (selected [T, Hkv, k],
    logical block indices, -1 = none), with token-level causality re-applied (keys <= the query's position).
    One softmax over that union. Returns [T, Hq, D]. Queries go through in chunks (SCORE_BYTES; or query_chunk at
    a time). An fp8 pool is read as fp8 x k_scale / v_scale."""
    out = torch.empty_like(q)
    block_size = kv_cache.shape[2]
    n_kv = kv_cache.shape[3]
    for s, tokens, seq_len in _sequences(meta):
        k, v = _context_kv(kv_cache, meta.block_tables[s], seq_len, k_scale, v_scale)
        pos = meta.positions[tokens]
        n_blocks = -(-seq_len // block_size)
        keys = torch.arange(seq_len, device=q.device)
        key_block = keys // block_size
        for a, b in _query_chunks(pos.shape[0], q.shape[1] * seq_len * 4, query_chunk):
            sel = selected[tokens][a:b].long()  # [Tc, Hkv, k]
            keep = torch.zeros(sel.shape[0], n_kv, n_blocks + 1, dtype=torch.bool, device=q.device)
            keep.scatter_(-1, sel.masked_fill(sel < 0, n_blocks), True)
            causal = keys[None, :] <= pos[a:b, None]  # [Tc, L]
            allowed = keep[..., :n_blocks][..., key_block] & causal[:, None, :]  # [Tc, Hkv, L]
            out[tokens.start + a:tokens.start + b] = _attend(q[tokens][a:b], k, v,
                                                             allowed.transpose(0, 1)[:, None], scale)
    return out


# --------------------------------------------------------------------------------------------------------------
# MXFP8 weights; MoE: routing and the per-expert loop
# --------------------------------------------------------------------------------------------------------------


MXFP8_BLOCK = 32
E8M0_BIAS = 127


def dequantize_mxfp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The MXFP8 rule (the checkpoint's, and what the fp8 kernels compute in registers): W[..., o, i] =
    fp8[..., o, i] * 2^(S[..., o, i // 32] - 127), with S the uint8 E8M0 exponents of each 1x32 block."""
    factor = torch.exp2(scale.float() - E8M0_BIAS).repeat_interleave(MXFP8_BLOCK, dim=-1)[..., : q.shape[-1]]
    return (q.float() * factor).to(dtype)


def weight(w: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """A layer weight in the activation dtype: as stored, or, for MXFP8 (fp8 e4m3 + E8M0 scales per 1x32 block),
    dequantised: W[o, i] = fp8[o, i] * 2^(scale[o, i // 32] - 127)."""
    return w if scale is None else dequantize_mxfp8(w, scale, dtype)


def fp8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x @ W^T for an MXFP8 weight (kernels/fp8_linear.py): dequantise to x's dtype, then the plain linear."""
    return F.linear(x, dequantize_mxfp8(w, scale, x.dtype))


MX_E4M3_EMAX = 8
"""floor(log2(448)): the exponent of e4m3's largest power of two, which the OCP MX scale rule subtracts."""
MX_MIN_EXPONENT = -126
"""Activation scales are clamped here (E8M0 byte 1, never 0): every reader then agrees on the scale's value
(E8M0's byte 0 is 2^-127 to the block-scaled instructions, and 0 to kernels that place the byte in an fp32
exponent field). Only blocks whose largest magnitude is under 2^-118 are affected: they quantize to zero."""


def quantize_mx_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (K a multiple of 32) -> (fp8 e4m3 [..., K], uint8 E8M0 [..., K / 32]) by the OCP MX rule, per
    token and per 32 consecutive values along K: the scale is 2^(floor(log2(amax)) - 8) (amax: the block's
    largest magnitude), each value is divided by it, saturated to +-448 and rounded to the nearest e4m3 value
    (ties to even). floor(log2) is read from fp32's exponent field, so it is exact. Dequantize with
    `dequantize_mxfp8` (the weights' rule)."""
    k = x.shape[-1]
    if k % MXFP8_BLOCK:
        raise ValueError(f"MX activations need a width that is a multiple of {MXFP8_BLOCK}, got {k}")
    blocks = x.float().reshape(*x.shape[:-1], k // MXFP8_BLOCK, MXFP8_BLOCK)
    amax = blocks.abs().amax(-1)
    exp = ((amax.view(torch.int32) >> 23) & 0xFF) - E8M0_BIAS - MX_E4M3_EMAX
    exp = exp.clamp(MX_MIN_EXPONENT, 127)
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    q = (blocks * torch.exp2(-exp.float())[..., None]).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn)
    return q.reshape(x.shape), (exp + E8M0_BIAS).to(torch.uint8)


def mx_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x @ W^T with the activations quantized to MXFP8 as well (kernels/mx_linear.py, the `mx_activations`
    switch): quantize x (`quantize_mx_activations`), dequantize both operands to fp32, multiply in fp32, cast to
    x's dtype."""
    q, s = quantize_mx_activations(x)
    return F.linear(dequantize_mxfp8(q, s, torch.float32), dequantize_mxfp8(w, scale, torch.float32)).to(x.dtype)


def route(router_logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """M3 routing, all fp32: s = sigmoid(logits); choose top_k of (s + bias); weights = s of the chosen experts,
    renormalised to sum to 1. Returns (topk_weights [T, k] fp32, topk_ids [T, k] int32)."""
    scores = torch.sigmoid(router_logits.float())
    _, ids = torch.topk(scores + correction_bias.float(), top_k, dim=-1)
    weights = scores.gather(1, ids)
    return weights / weights.sum(-1, keepdim=True), ids.to(torch.int32)


def moe_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor, alpha: float, limit: float,
                expert_map: torch.Tensor | None = None, w13_scale: torch.Tensor | None = None,
                w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """sum_k topk_weights[t, k] * Expert_{topk_ids[t, k]}(x[t]) for x [T, H], a plain loop over experts.

    w13 [E, 2I, H] holds each expert's gate rows then up rows; w2 [E, H, I]. topk_ids are global expert ids;
    expert_map [E_global] maps them to local indices (-1 = owned by another rank: skipped), None = identity.
    MXFP8 experts: w13/w2 in fp8 with w13_scale [E, 2I, H/32] / w2_scale [E, H, I/32]; each expert is
    dequantised to x's dtype when it is used. Accumulates in fp32, returns x's dtype (routed_scaling_factor is
    applied by the caller)."""
    inter = w2.shape[-1]
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    local_ids = topk_ids.long() if expert_map is None else expert_map[topk_ids.long()].long()
    for e in range(w13.shape[0]):
        token, slot = torch.where(local_ids == e)
        if token.numel() == 0:
            continue
        up_w = weight(w13[e], None if w13_scale is None else w13_scale[e], x.dtype)
        down_w = weight(w2[e], None if w2_scale is None else w2_scale[e], x.dtype)
        gate_up = F.linear(x[token], up_w)
        act = swiglu_oai(gate_up[:, :inter], gate_up[:, inter:], alpha, limit).to(x.dtype)
        y = F.linear(act, down_w).float() * topk_weights[token, slot, None].float()
        out.index_add_(0, token, y)
    return out.to(x.dtype)


def attention_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


# --------------------------------------------------------------------------------------------------------------
# The vision tower: LayerNorm and bidirectional attention within segments (kernels/layer_norm.py,
# kernels/vision_attention.py)
# --------------------------------------------------------------------------------------------------------------


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim: fp32 inside (biased variance), then * w + b, cast back to x's dtype."""
    return F.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), eps).to(x.dtype)


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual <- x + residual (in the activation dtype), then return (layer_norm(residual), residual)."""
    residual = x + residual
    return layer_norm(residual, weight, bias, eps), residual


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Bidirectional attention within segments: q, k, v [N, H, D], segment s = rows cu_seqlens[s] ..
    cu_seqlens[s + 1] (every query sees every key of its segment and none outside it). Returns [N, H, D].
    Scores and softmax in fp32. Segments of one length go through together, as many at a time as SCORE_BYTES of
    scores hold (a batch of pictures comes in a few sizes: a few products per layer instead of one per picture,
    which is what bounds a training step of many small images); a segment too long for that goes through alone,
    its queries in chunks."""
    out = torch.empty_like(q)
    heads = q.shape[1]
    everything = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=q.device)
    bounds = cu_seqlens.tolist()
    by_length: dict[int, list[int]] = {}
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b > a:
            by_length.setdefault(b - a, []).append(a)
    for length, starts in by_length.items():
        together = SCORE_BYTES // (heads * length * length * 4)
        if together < 2:  # alone, in query chunks
            for a in starts:
                ks, vs = k[a:a + length].float().transpose(0, 1), v[a:a + length].float().transpose(0, 1)
                for c0, c1 in _query_chunks(length, heads * length * 4, None):
                    out[a + c0:a + c1] = _attend(q[a + c0:a + c1], ks, vs, everything, scale)
            continue
        for g in range(0, len(starts), together):
            first = torch.tensor(starts[g:g + together], device=q.device)
            rows = (first[:, None] + torch.arange(length, device=q.device)).reshape(-1)  # [G x L]
            qs, ks, vs = (t[rows].float().view(-1, length, heads, t.shape[-1]).transpose(1, 2) for t in (q, k, v))
            probs = torch.softmax(torch.matmul(qs, ks.transpose(-1, -2)) * scale, dim=-1)  # [G, H, L, L]
            out[rows] = torch.matmul(probs, vs).transpose(1, 2).reshape(-1, heads, v.shape[-1]).to(q.dtype)
    return out
