"""The vision tower: a CLIP-style encoder over a flat batch of patches, with partial 3-D RoPE.

    patches [N, 1176] -> patch embedding -> pre_layrnorm -> 32 x [ x += Attn(LN1(x));  x += MLP(LN2(x)) ] -> [N, 1280]

There is no post-layernorm (the released checkpoint has none: its features are the last layer's raw output).
Attention is bidirectional within each segment of the batch (an image, or at most 4 temporal patches of a video;
model/vision/grid.py) and never across segments, so any mix of images and videos runs as one batch: one
projection GEMM per weight and one attention launch per layer for all of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanoserve.config import Optimizations
from nanoserve.kernels import reference, triton_usable
from nanoserve.model.vision import grid
from nanoserve.model.vision.config import VisionConfig
from nanoserve.model.vision.layers import PatchEmbedding, VisionLayerNorm, VisionLinear


@dataclass
class Segments:
    """Where a batch's attention segments lie and how its patches are rotated (built once per forward)."""

    cu_seqlens: torch.Tensor  # [segments + 1] int32, on the device
    max_seqlen: int
    cos: torch.Tensor  # [N, 3 x band / 2] fp32
    sin: torch.Tensor


class VisionAttention(nn.Module):
    """Multi-head attention (16 heads of 80) with q|k|v fused into one projection, partial 3-D RoPE on q and k,
    bidirectional within segments. Triton (kernels/vision_attention.py) under `triton_vision_attention`."""

    def __init__(self, cfg: VisionConfig, opts: Optimizations, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        d = cfg.hidden_size
        self.num_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.scale = reference.attention_scale(self.head_dim)
        self.opts = opts
        self.qkv_proj = VisionLinear(d, [("q", d), ("k", d), ("v", d)], dtype, device)
        self.out_proj = VisionLinear(d, [("", d)], dtype, device)

    def forward(self, x: torch.Tensor, seg: Segments) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        if self.opts.triton_vision_attention and triton_usable(x):
            from nanoserve.kernels.vision_attention import vision_attention

            out = vision_attention(qkv, seg.cos, seg.sin, seg.cu_seqlens, seg.max_seqlen, self.num_heads,
                                   self.head_dim, self.scale)
        else:
            n = x.shape[0]
            q, k, v = (t.view(n, self.num_heads, self.head_dim) for t in qkv.chunk(3, dim=-1))
            q = reference.apply_partial_rope(q, seg.cos, seg.sin)
            k = reference.apply_partial_rope(k, seg.cos, seg.sin)
            out = reference.varlen_attention(q, k, v, seg.cu_seqlens, self.scale).reshape(n, -1)
        return self.out_proj(out)


class VisionMLP(nn.Module):
    """fc1 -> GELU (exact, erf) -> fc2."""

    def __init__(self, cfg: VisionConfig, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.fc1 = VisionLinear(cfg.hidden_size, [("", cfg.intermediate_size)], dtype, device)
        self.fc2 = VisionLinear(cfg.intermediate_size, [("", cfg.hidden_size)], dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class VisionEncoderLayer(nn.Module):
    """Pre-norm residual block. The residual stream travels beside the branch output, so each "add, then norm"
    is one fused kernel: the layer returns (MLP output, residual) and the next layer's LN1 adds them."""

    def __init__(self, cfg: VisionConfig, opts: Optimizations, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.layer_norm1 = VisionLayerNorm(cfg.hidden_size, cfg.layer_norm_eps, opts, device)
        self.self_attn = VisionAttention(cfg, opts, dtype, device)
        self.layer_norm2 = VisionLayerNorm(cfg.hidden_size, cfg.layer_norm_eps, opts, device)
        self.mlp = VisionMLP(cfg, dtype, device)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                seg: Segments) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, h = x, self.layer_norm1(x)
        else:
            h, residual = self.layer_norm1(x, residual)
        h, residual = self.layer_norm2(self.self_attn(h, seg), residual)
        return self.mlp(h), residual


class VisionTower(nn.Module):
    """Patches [N, patch_dim] of a batch described by grid_thw -> encoder features [N, hidden]."""

    def __init__(self, cfg: VisionConfig, opts: Optimizations, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbedding(cfg.patch_dim, cfg.hidden_size, dtype, device)
        self.pre_layrnorm = VisionLayerNorm(cfg.hidden_size, cfg.layer_norm_eps, opts, device)
        self.layers = nn.ModuleList(VisionEncoderLayer(cfg, opts, dtype, device)
                                    for _ in range(cfg.num_hidden_layers))
        self.register_buffer("inv_freq", grid.rope_inv_freq(cfg.rope_band, cfg.rope_theta, device), persistent=False)

    def segments(self, grid_thw: list[tuple[int, int, int]] | torch.Tensor, device: torch.device) -> Segments:
        segs = grid.segments(grid_thw, self.cfg.vision_segment_max_frames)
        cos, sin = grid.rope_cos_sin(grid.positions(segs, self.cfg.spatial_merge_size, device), self.inv_freq)
        return Segments(grid.cu_seqlens(segs, device), max((t * h * w for t, h, w in segs), default=0), cos, sin)

    def forward(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]] | torch.Tensor) -> torch.Tensor:
        seg = self.segments(grid_thw, pixel_values.device)
        if pixel_values.shape[0] != int(seg.cu_seqlens[-1]):
            raise ValueError(f"pixel_values has {pixel_values.shape[0]} patches, grid_thw describes "
                             f"{int(seg.cu_seqlens[-1])}")
        x = self.pre_layrnorm(self.patch_embed(pixel_values))
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, seg)
        return x if residual is None else x + residual
