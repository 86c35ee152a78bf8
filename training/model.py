"""M3 as a trainable, batched PyTorch module: the same forward pass nanoserve serves, written for training.

nanoserve's own model is inference-only (paged KV cache, per-sequence reference paths, Triton kernels). Training
wants the opposite trade: whole padded batches, autograd, and a few extra outputs. This module computes M3's text
forward pass (Gemma norms, per-head QK norm, partial NeoX RoPE, GQA, MSA's indexer and block top-k, the sigmoid
router with its correction bias, routed experts scaled by `routed_scaling_factor` plus the shared expert,
SwiGLU-OAI) on `[B, T]` token batches, and its parameters carry the released checkpoint names (`export.py` writes
them out unchanged), so what is trained here is what nanoserve loads.

Three things exist only for training:
- **the indexer loss.** MSA's top-k is a hard choice, so no gradient reaches the indexer through the attention.
  Each sparse layer returns the KL divergence from the dense attention distribution (averaged over the query heads
  of a KV group, detached) to the indexer's softmax over the same keys, on a random subset of query rows - the
  warm-up DeepSeek-V3.2 uses for its indexer.
- **sparse mode.** `attention="sparse"` attends through the indexer's real block selection (a boolean mask), so the
  model learns to work with what the indexer picks; `"dense"` is plain causal attention (what MSA is anyway while
  a sequence fits in top-k blocks).
- **the MTP module** (`mtp.layers.0.*`): one more MSA+MoE decoder block that reads the main model's final-normed
  hidden state at t and the embedding of token t+1 and predicts token t+2, for speculative decoding.

Each row of a batch holds one chat from position 0 (padded at its end), so every chat is trained exactly as it is
served, with plain causal attention.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanoserve.model.m3_config import M3Config


def gemma_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())).to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX partial RoPE on x [B, T, H, D] with cos/sin [B, T, r/2]: the first r dims rotate."""
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    c, s = cos[:, :, None, :].to(x.dtype), sin[:, :, None, :].to(x.dtype)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1)


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    g = gate.clamp(max=limit)
    u = up.clamp(min=-limit, max=limit)
    return g * torch.sigmoid(alpha * g) * (u + 1.0)


class Norm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))


def linear(n_out: int, n_in: int) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=False)


class Attention(nn.Module):
    """GQA with per-head QK norm and partial RoPE; on sparse layers, MSA's indexer and block selection."""

    def __init__(self, cfg: M3Config, sparse: bool):
        super().__init__()
        self.cfg, self.sparse = cfg, sparse
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj, self.k_proj = linear(cfg.q_size, h), linear(cfg.kv_size, h)
        self.v_proj, self.o_proj = linear(cfg.kv_size, h), linear(h, cfg.q_size)
        self.q_norm, self.k_norm = Norm(d), Norm(d)
        if sparse:
            di = cfg.index_head_dim
            self.index_q_proj, self.index_k_proj = linear(cfg.index_n_heads * di, h), linear(di, h)
            self.index_q_norm, self.index_k_norm = Norm(di), Norm(di)

    def forward(self, x, cos, sin, mode: str, kl_rows: torch.Tensor | None):
        cfg = self.cfg
        b, t, _ = x.shape
        eps, d = cfg.rms_norm_eps, cfg.head_dim
        q = rope(gemma_norm(self.q_proj(x).view(b, t, -1, d), self.q_norm.weight, eps), cos, sin)
        k = rope(gemma_norm(self.k_proj(x).view(b, t, -1, d), self.k_norm.weight, eps), cos, sin)
        v = self.v_proj(x).view(b, t, -1, d)
        group = q.shape[2] // k.shape[2]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, T, D]
        aux = {}
        mask = None  # plain causal attention (each row is one document, padded at its end)
        if self.sparse:
            di = cfg.index_head_dim
            ik = rope(gemma_norm(self.index_k_proj(x).view(b, t, 1, di), self.index_k_norm.weight, eps), cos, sin)
            if mode == "sparse" or kl_rows is not None:
                xr = x if mode == "sparse" else x[:, kl_rows]
                cr, sr = (cos, sin) if mode == "sparse" else (cos[:, kl_rows], sin[:, kl_rows])
                iq = rope(gemma_norm(self.index_q_proj(xr).view(b, xr.shape[1], -1, di), self.index_q_norm.weight,
                                     eps), cr, sr)
                rows = torch.arange(t, device=x.device) if mode == "sparse" else kl_rows
                causal = torch.arange(t, device=x.device)[None, :] <= rows[:, None]  # [R, T]
                scores = torch.einsum("brgd,bsd->bgrs", iq.float(), ik[:, :, 0].float())
                scores = scores.masked_fill(~causal, float("-inf"))  # [B, G, R, T]
                if mode == "sparse":
                    mask = self.block_mask(scores.detach(), causal).repeat_interleave(group, dim=1)
                    scores = scores[:, :, kl_rows] if kl_rows is not None else None
                if kl_rows is not None:
                    aux["index_kl"] = self.index_kl(q, k, scores, causal[kl_rows] if mode == "sparse" else causal,
                                                    kl_rows, group)
        # K/V repeated per query head rather than enable_gqa, which keeps SDPA off its flash kernel on CUDA
        kq, vq = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, kq, vq, attn_mask=mask, is_causal=mask is None,
                                             scale=1.0 / math.sqrt(d))
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1)), aux

    def block_mask(self, scores: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
        """MSA's selection as a key mask: block scores are the max token score in each block of `block_size`
        positions, the query's own block is forced, the top-k blocks are kept, then token causality. Rows hold one
        document each (positions = row offsets), as in serving."""
        cfg = self.cfg
        bsz, g, t, _ = scores.shape
        bs = cfg.index_block_size
        nb = -(-t // bs)
        padded = F.pad(scores, (0, nb * bs - t), value=float("-inf"))
        block = padded.view(bsz, g, t, nb, bs).amax(-1)  # [B, G, T, nb]
        own = torch.arange(t, device=scores.device) // bs
        blocks = torch.arange(nb, device=scores.device)
        forced = (blocks[None, :] <= own[:, None]) & (blocks[None, :] > own[:, None] - cfg.index_local_blocks)
        block = block.masked_fill(forced, float("inf"))
        k = min(cfg.index_topk_blocks, nb)
        top = block.topk(k, dim=-1)
        chosen = torch.zeros_like(block, dtype=torch.bool).scatter_(-1, top.indices, top.values > float("-inf"))
        keys = chosen.repeat_interleave(bs, dim=-1)[..., :t]
        return keys & causal

    def index_kl(self, q, k, scores, ok, rows, group):
        """KL(dense attention || indexer softmax) on the query rows `rows` [R] (scores [B, G, R, T], ok [R, T] the
        causal keys), averaged over rows, batch and groups. The target is the dense attention distribution of the
        group's query heads (mean over heads), detached."""
        d = self.cfg.head_dim
        qr = q[:, :, rows].detach().float()  # [B, Hq, R, D]
        kk = k.detach().float().repeat_interleave(group, 1)
        att = torch.matmul(qr, kk.transpose(-1, -2)) / math.sqrt(d)
        att = att.masked_fill(~ok, float("-inf")).softmax(-1)
        target = att.view(att.shape[0], -1, group, *att.shape[2:]).mean(2)  # [B, G, R, T]
        logq = (scores / math.sqrt(self.cfg.index_head_dim)).log_softmax(-1).masked_fill(~ok, 0.0)
        kl = (target * (target.clamp_min(1e-12).log() - logq)).sum(-1)
        return kl.mean()


class DenseMLP(nn.Module):
    def __init__(self, cfg: M3Config, width: int):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.gate_proj, self.up_proj, self.down_proj = linear(width, h), linear(width, h), linear(h, width)

    def forward(self, x):
        return self.down_proj(swiglu_oai(self.gate_proj(x), self.up_proj(x), self.cfg.swiglu_alpha,
                                         self.cfg.swiglu_limit))


class MoE(nn.Module):
    """The sigmoid router (fp32), its correction bias (selection only; balanced without an auxiliary loss by
    `update_bias`), top-k experts renormalised and scaled by routed_scaling_factor, plus the shared expert."""

    def __init__(self, cfg: M3Config):
        super().__init__()
        self.cfg = cfg
        h, e, i = cfg.hidden_size, cfg.num_local_experts, cfg.intermediate_size
        self.gate = linear(e, h)
        self.register_buffer("e_score_correction_bias", torch.zeros(e))
        self.w1 = nn.Parameter(torch.empty(e, i, h))  # gate
        self.w3 = nn.Parameter(torch.empty(e, i, h))  # up
        self.w2 = nn.Parameter(torch.empty(e, h, i))  # down
        self.shared_experts = DenseMLP(cfg, cfg.shared_intermediate_size)
        self.register_buffer("load", torch.zeros(e), persistent=False)

    def forward(self, x, token_mask):
        cfg = self.cfg
        shape = x.shape
        xf = x.reshape(-1, shape[-1])
        logits = F.linear(xf.float(), self.gate.weight.float())
        s = torch.sigmoid(logits)
        ids = torch.topk(s.detach() + self.e_score_correction_bias, cfg.num_experts_per_tok, dim=-1).indices
        w = s.gather(1, ids)
        w = w / w.sum(-1, keepdim=True)
        # every expert on every token, weighted by its routing weight (0 where not chosen): the same sum as
        # gathering each expert's tokens, with no data-dependent shapes, so the GPU never waits on the host
        # (at these widths the extra arithmetic is cheaper than the synchronisations it saves)
        dense_w = torch.zeros(s.shape, dtype=w.dtype, device=s.device).scatter(1, ids, w)  # [N, E]
        a = swiglu_oai(torch.einsum("nh,eih->eni", xf, self.w1), torch.einsum("nh,eih->eni", xf, self.w3),
                       cfg.swiglu_alpha, cfg.swiglu_limit)
        a = a * dense_w.t().unsqueeze(-1).to(a.dtype)
        out = torch.bmm(a, self.w2.transpose(1, 2).to(a.dtype)).float().sum(0)  # [E, N, h] -> [N, h]
        live = token_mask.reshape(-1)
        with torch.no_grad():
            self.load += torch.zeros_like(self.load).index_add_(
                0, ids.reshape(-1), live[:, None].expand_as(ids).reshape(-1).float())
        y = cfg.routed_scaling_factor * out.to(x.dtype) + self.shared_experts(xf)
        return y.view(shape)

    @torch.no_grad()
    def update_bias(self, rate: float) -> None:
        """Aux-loss-free balance (DeepSeek-V3): nudge each expert's bias against its load since the last call."""
        if self.load.sum() > 0:
            self.e_score_correction_bias += rate * torch.sign(self.load.mean() - self.load)
        self.load.zero_()


class Block(nn.Module):
    def __init__(self, cfg: M3Config, layer: int | None, sparse_attn: bool | None = None, moe: bool | None = None):
        super().__init__()
        sparse_attn = cfg.is_sparse_attention(layer) if sparse_attn is None else sparse_attn
        moe = cfg.is_moe(layer) if moe is None else moe
        self.input_layernorm, self.post_attention_layernorm = Norm(cfg.hidden_size), Norm(cfg.hidden_size)
        self.self_attn = Attention(cfg, sparse_attn)
        if moe:
            self.block_sparse_moe = MoE(cfg)
        else:
            self.mlp = DenseMLP(cfg, cfg.dense_intermediate_size)
        self.eps = cfg.rms_norm_eps

    def forward(self, x, cos, sin, token_mask, mode, kl_rows):
        a, aux = self.self_attn(gemma_norm(x, self.input_layernorm.weight, self.eps), cos, sin, mode, kl_rows)
        x = x + a
        h = gemma_norm(x, self.post_attention_layernorm.weight, self.eps)
        ffn = self.block_sparse_moe(h, token_mask) if hasattr(self, "block_sparse_moe") else self.mlp(h)
        return x + ffn, aux


class MTP(nn.Module):
    """One DeepSeek-V3-style MTP module: z = eh_proj([enorm(embed(x_{t+1})); hnorm(h_t)]) -> an MSA+MoE block ->
    final_layernorm -> the shared LM head, predicting x_{t+2}."""

    def __init__(self, cfg: M3Config):
        super().__init__()
        h = cfg.hidden_size
        self.enorm, self.hnorm, self.final_layernorm = Norm(h), Norm(h), Norm(h)
        self.eh_proj = linear(h, 2 * h)
        self.transformer_layer = Block(cfg, None, sparse_attn=True, moe=True)


class M3Train(nn.Module):
    def __init__(self, cfg: M3Config, mtp: bool = True):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = Norm(cfg.hidden_size)
        self.lm_head = linear(cfg.vocab_size, cfg.hidden_size)
        self.mtp = MTP(cfg) if mtp else None
        self.eager_modes: set[str] = set()
        """Attention modes whose steps call the blocks' plain `forward`, bypassing a torch.compile'd block (train.py
        puts "sparse" here: compiling that rare kind of step costs more time than it saves)."""
        self.dynamic_steps = False
        """Mark the batch and sequence dimensions of the blocks' inputs dynamic on every call (`compile_blocks`)."""
        half = cfg.rotary_dim // 2
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.rotary_dim, 2, dtype=torch.float32) / cfg.rotary_dim))
        self.register_buffer("inv_freq", inv[:half], persistent=False)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        for name, p in self.named_parameters():
            if name.endswith("norm.weight") or ".enorm." in name or ".hnorm." in name or "layernorm" in name:
                nn.init.zeros_(p)
            else:
                nn.init.normal_(p, 0.0, std)
        # residual-branch outputs scaled down with depth (GPT-2's rule), so the stream starts near the embedding
        scale = 1.0 / math.sqrt(2 * (self.cfg.num_hidden_layers + 1))
        for name, p in self.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", ".w2")):
                p.data.mul_(scale)

    def moe_layers(self):
        return [m for m in self.modules() if isinstance(m, MoE)]

    def blocks(self) -> list[Block]:
        """The decoder blocks, then the MTP module's block."""
        return [*self.layers, *([self.mtp.transformer_layer] if self.mtp is not None else [])]

    def compile_blocks(self, backend: str = "inductor") -> None:
        """torch.compile every block in place (parameter names, and so the exported checkpoint, stay the same),
        with the batch and sequence dimensions of its inputs dynamic from the first call. The identical MSA+MoE
        layers share their graphs, so a run compiles one graph for each of the three kinds of block (the dense first
        layer, the MSA+MoE layers, the MTP block, which reads a bf16 stream and trains no indexer), whatever the
        shapes of its steps, except that steps of one row compile one more each (torch.compile always specialises
        a size of 1). Left to torch.compile's automatic dynamic shapes, each kind compiled for the first step's
        shape and again, dynamic, at the first step of another shape (a long step), after which only the dynamic
        graphs ran."""
        for block in self.blocks():
            block.compile(backend=backend)
        self.dynamic_steps = True

    def _block(self, block: Block, eager: bool, x, cos, sin, token_mask, mode, rows):
        if eager:
            return block.forward(x, cos, sin, token_mask, mode, rows)
        if self.dynamic_steps:
            for tensor in (x, cos, sin, token_mask):  # all [B, T, ...]
                torch._dynamo.maybe_mark_dynamic(tensor, 0)
                torch._dynamo.maybe_mark_dynamic(tensor, 1)
        return block(x, cos, sin, token_mask, mode, rows)

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor, mode: str = "dense", kl_rows: int = 0,
                mtp: bool = True, heads: tuple[torch.Tensor, torch.Tensor] | None = None,
                embeds: torch.Tensor | None = None):
        """ids [B, T]: one document per row from position 0, `lengths` [B] real tokens (the rest is padding, which
        only attends to what precedes it and is never trained). Returns (logits [B, T, V], mtp_logits [B, T-1, V]
        or None, aux) where mtp_logits[:, t] predicts ids[:, t + 2] and aux holds the mean indexer KL.
        `heads` (two boolean masks [B, T] and [B, T-1]) computes the LM head only where they are true: the logits
        come back flattened over those positions (training takes the loss on assistant turns only). `embeds`
        [B, T, hidden]: the input embeddings to start from (image features at the placeholders: train_vision.py)."""
        cfg = self.cfg
        b, t = ids.shape
        token_mask = torch.arange(t, device=ids.device)[None, :] < lengths[:, None]
        freqs = torch.arange(t, device=ids.device, dtype=torch.float32)[None, :, None] * self.inv_freq
        cos, sin = freqs.cos().expand(b, -1, -1), freqs.sin().expand(b, -1, -1)
        rows = torch.randperm(t, device=ids.device)[:kl_rows].sort().values if kl_rows else None
        x = self.embed_tokens(ids) if embeds is None else embeds
        kls = []
        eager = mode in self.eager_modes
        for layer in self.layers:
            x, aux = self._block(layer, eager, x, cos, sin, token_mask, mode, rows)
            if "index_kl" in aux:
                kls.append(aux["index_kl"])
        h = gemma_norm(x, self.norm.weight, cfg.rms_norm_eps)
        logits = self.lm_head(h if heads is None else h[heads[0]])
        mtp_logits = None
        if mtp and self.mtp is not None and t > 1:
            m = self.mtp
            e = gemma_norm(self.embed_tokens(ids[:, 1:]), m.enorm.weight, cfg.rms_norm_eps)
            hp = gemma_norm(h[:, :-1], m.hnorm.weight, cfg.rms_norm_eps)
            z = m.eh_proj(torch.cat([e, hp], dim=-1))
            # row t reads h_t and x_{t+1} at position t (vLLM's MTP convention: the target's positions)
            z, _ = self._block(m.transformer_layer, eager, z, cos[:, :-1], sin[:, :-1], token_mask[:, :-1], mode,
                               None)
            z = gemma_norm(z, m.final_layernorm.weight, cfg.rms_norm_eps)
            mtp_logits = self.lm_head(z if heads is None else z[heads[1]])
        out_aux = {"index_kl": torch.stack(kls).mean() if kls else torch.zeros((), device=ids.device)}
        return logits, mtp_logits, out_aux

    # -- the released checkpoint names ------------------------------------------------------------------------
    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor under its released M3 name (`language_model.model.layers.N...`), experts split per index,
        the router and its bias in fp32; MTP under `language_model.model.mtp.layers.0.*`."""
        out: dict[str, torch.Tensor] = {}
        p = "language_model."
        out[f"{p}model.embed_tokens.weight"] = self.embed_tokens.weight
        out[f"{p}model.norm.weight"] = self.norm.weight
        out[f"{p}lm_head.weight"] = self.lm_head.weight
        for i, layer in enumerate(self.layers):
            out.update(_block_tensors(layer, f"{p}model.layers.{i}"))
        if self.mtp is not None:
            mp = f"{p}model.mtp.layers.0"
            for n in ("enorm", "hnorm", "final_layernorm"):
                out[f"{mp}.{n}.weight"] = getattr(self.mtp, n).weight
            out[f"{mp}.eh_proj.weight"] = self.mtp.eh_proj.weight
            out.update(_block_tensors(self.mtp.transformer_layer, f"{mp}.transformer_layer"))
        return {k: v.detach() for k, v in out.items()}


def _block_tensors(layer: Block, prefix: str) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in layer.named_parameters():
        if ".w1" in name or ".w2" in name or ".w3" in name:
            continue
        out[f"{prefix}.{name}"] = t
    if hasattr(layer, "block_sparse_moe"):
        moe = layer.block_sparse_moe
        out[f"{prefix}.block_sparse_moe.e_score_correction_bias"] = moe.e_score_correction_bias
        for e in range(moe.w1.shape[0]):
            for w in ("w1", "w2", "w3"):
                out[f"{prefix}.block_sparse_moe.experts.{e}.{w}.weight"] = getattr(moe, w)[e]
    return out
