"""The vision tower's building blocks: linear layers with biases, LayerNorm, the patch embedding.

Every parameter follows the weight-loading protocol of model/layers/linear.py (`weight_loader`, `weight_shards`),
so the checkpoint name table (model/checkpoint_names.py, VISION_WEIGHT_NAMES) and the loader fill the tower as
they fill the text model. The tower is replicated: each tensor-parallel rank holds all of it (0.87 B parameters,
1.7 GB in bf16) and loads every tensor whole - the choice vLLM calls `--mm-encoder-tp-mode data` (docs/vision.md).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanoserve.config import Optimizations
from nanoserve.kernels import reference, triton_usable
from nanoserve.model.layers.linear import WeightSource, check_shape, copy_into, replicated_parameter


def _parameter(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.zeros(shape, dtype=dtype, device=device), requires_grad=False)


class VisionLinear(nn.Module):
    """y = x W^T + b. `parts` lists the checkpoint tensors stacked into its rows, each (shard id, rows): the fused
    q | k | v projection is [("q", D), ("k", D), ("v", D)]; a plain linear is [("", out)]."""

    def __init__(self, in_features: int, parts: list[tuple[str, int]], dtype: torch.dtype,
                 device: torch.device | str, bias: bool = True):
        super().__init__()
        self.offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for shard, rows in parts:
            self.offsets[shard] = (start, start + rows)
            start += rows
        self.weight = _parameter((start, in_features), dtype, device)
        self.bias = _parameter((start,), dtype, device) if bias else None
        for p in (self.weight, self.bias):
            if p is not None:
                p.weight_loader = self.weight_loader
                p.weight_shards = tuple(self.offsets)

    def weight_loader(self, param: torch.Tensor, source: WeightSource, shard_id: str = "", name: str = "") -> None:
        r0, r1 = self.offsets[shard_id]
        check_shape(name, source.shape, (r1 - r0, *param.shape[1:]))
        copy_into(param[r0:r1], source[:])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class VisionLayerNorm(nn.Module):
    """LayerNorm with weight and bias (kept in fp32, computed in fp32). Called as norm(x) it normalises x; called
    as norm(x, residual) it first adds x into the residual stream and returns (norm(x + residual), x + residual).
    Both are one Triton launch under the `fused_layer_norm` switch."""

    def __init__(self, dim: int, eps: float, opts: Optimizations, device: torch.device | str):
        super().__init__()
        self.eps = eps
        self.opts = opts
        self.weight = replicated_parameter((dim,), torch.float32, device)
        self.bias = replicated_parameter((dim,), torch.float32, device)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        fused = self.opts.fused_layer_norm and triton_usable(x)
        if fused:
            from nanoserve.kernels import layer_norm as kernels
        if residual is None:
            if fused:
                return kernels.layer_norm(x, self.weight, self.bias, self.eps)
            return reference.layer_norm(x, self.weight, self.bias, self.eps)
        if fused:
            return kernels.add_layer_norm(x, residual, self.weight, self.bias, self.eps)
        return reference.add_layer_norm(x, residual, self.weight, self.bias, self.eps)


class PatchEmbedding(nn.Module):
    """The Conv3d patch embedding as one matmul: a Conv3d whose kernel equals its stride and its input (3 x 2 x
    14 x 14) sees each flattened patch once, so it is patches [N, 1176] @ W^T with W the conv weight
    [1280, 3, 2, 14, 14] flattened to [1280, 1176] (the processor flattens a patch in the same channel, time,
    row, column order). No bias."""

    def __init__(self, patch_dim: int, hidden: int, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.weight = _parameter((hidden, patch_dim), dtype, device)
        self.weight.weight_loader = self.weight_loader
        self.weight.weight_shards = ("",)

    @staticmethod
    def weight_loader(param: torch.Tensor, source: WeightSource, shard_id: str = "", name: str = "") -> None:
        if len(source.shape) != 5 or source.shape[0] != param.shape[0] or \
                source.shape[1] * source.shape[2] * source.shape[3] * source.shape[4] != param.shape[1]:
            raise ValueError(f"shape mismatch for {name}: checkpoint has {list(source.shape)}, model expects a "
                             f"Conv3d weight [{param.shape[0]}, C, T, P, P] with C x T x P x P = {param.shape[1]}")
        copy_into(param, source[:].reshape(param.shape))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return F.linear(pixel_values.to(self.weight.dtype), self.weight)
