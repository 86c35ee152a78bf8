"""Tensor-parallel linear layers and the weight-loading protocol they share.

Every parameter carries a `weight_loader(param, source, shard_id, name)` that copies this rank's part of a
checkpoint tensor into it, and `weight_shards`, the shard ids it takes ("" = the whole tensor); the table in
model/checkpoint_names.py says which checkpoint tensor fills which shard. `source` is anything with `.shape` and slicing (a torch tensor, or a lazy safetensors slice from
the loader), so a rank reads only its rows or columns and never materialises the full tensor.

- ColumnParallel / MergedColumnParallel: output rows split across ranks (no communication).
- RowParallel: input columns split; the partial products are summed with one all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanoserve.parallel_state import all_reduce, get_tp, shard_range


class WeightSource(Protocol):
    """A checkpoint tensor that can be read in parts."""

    shape: tuple[int, ...]

    def __getitem__(self, index: Any) -> torch.Tensor: ...


def check_shape(name: str, got: tuple[int, ...], expected: tuple[int, ...]) -> None:
    if tuple(got) != tuple(expected):
        raise ValueError(f"shape mismatch for {name}: checkpoint has {list(got)}, model expects {list(expected)}")


def copy_into(param: torch.Tensor, value: torch.Tensor) -> None:
    if param.shape != value.shape:
        raise ValueError(f"internal shard shape mismatch: {list(value.shape)} into {list(param.shape)}")
    with torch.no_grad():
        param.copy_(value.to(dtype=param.dtype, device=param.device))


@dataclass(frozen=True)
class OutputPart:
    """One checkpoint tensor fused into a merged projection: its global row count and the rows this rank keeps."""

    shard_id: str
    global_rows: int
    start: int
    end: int

    @property
    def local_rows(self) -> int:
        return self.end - self.start

    @classmethod
    def split(cls, shard_id: str, rows: int) -> "OutputPart":
        start, end = shard_range(rows)
        return cls(shard_id, rows, start, end)

    @classmethod
    def replicated(cls, shard_id: str, rows: int) -> "OutputPart":
        return cls(shard_id, rows, 0, rows)


class MergedColumnParallelLinear(nn.Module):
    """Several projections of the same input fused into one GEMM (e.g. q|k|v|index_q|index_k, or gate|up).
    Output rows are this rank's parts, concatenated in the order given."""

    def __init__(self, input_size: int, parts: list[OutputPart], dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.input_size = input_size
        self.parts = {p.shard_id: p for p in parts}
        self.offsets: dict[str, int] = {}
        offset = 0
        for p in parts:
            self.offsets[p.shard_id] = offset
            offset += p.local_rows
        self.output_size = offset
        self.weight = nn.Parameter(torch.empty(offset, input_size, dtype=dtype, device=device), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.weight.weight_shards = tuple(self.parts)

    def split_sizes(self) -> list[int]:
        return [p.local_rows for p in self.parts.values()]

    def weight_loader(self, param: torch.Tensor, source: WeightSource, shard_id: str, name: str = "") -> None:
        part = self.parts[shard_id]
        check_shape(name or shard_id, source.shape, (part.global_rows, self.input_size))
        off = self.offsets[shard_id]
        copy_into(param[off: off + part.local_rows], source[part.start: part.end])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class ColumnParallelLinear(MergedColumnParallelLinear):
    """A single projection whose output rows are split across ranks."""

    def __init__(self, input_size: int, output_size: int, dtype: torch.dtype, device: torch.device | str):
        super().__init__(input_size, [OutputPart.split("", output_size)], dtype, device)

    def weight_loader(self, param: torch.Tensor, source: WeightSource, shard_id: str = "", name: str = "") -> None:
        super().weight_loader(param, source, "", name)


class RowParallelLinear(nn.Module):
    """Input columns split across ranks; `forward` all-reduces the partial sums (unless reduce=False, for a
    caller that sums several partial results before one all-reduce)."""

    def __init__(self, input_size: int, output_size: int, dtype: torch.dtype, device: torch.device | str,
                 input_range: tuple[int, int] | None = None, reduce: bool = True):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.start, self.end = input_range if input_range is not None else shard_range(input_size)
        self.reduce = reduce
        self.weight = nn.Parameter(torch.empty(output_size, self.end - self.start, dtype=dtype, device=device),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.weight.weight_shards = ("",)

    def weight_loader(self, param: torch.Tensor, source: WeightSource, shard_id: str = "", name: str = "") -> None:
        check_shape(name, source.shape, (self.output_size, self.input_size))
        copy_into(param, source[:, self.start: self.end])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        return all_reduce(y) if self.reduce and get_tp().size > 1 else y


class ReplicatedParameter:
    """Loader for a tensor every rank holds whole (norm weights, the MoE router)."""

    @staticmethod
    def weight_loader(param: torch.Tensor, source: WeightSource, shard_id: str = "", name: str = "") -> None:
        check_shape(name, source.shape, tuple(param.shape))
        copy_into(param, source[:] if len(source.shape) else source[()])


def replicated_parameter(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    p = nn.Parameter(torch.zeros(shape, dtype=dtype, device=device), requires_grad=False)
    p.weight_loader = ReplicatedParameter.weight_loader
    p.weight_shards = ("",)
    return p
