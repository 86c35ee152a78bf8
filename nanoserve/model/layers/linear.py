"""Tensor-parallel linear layers and the weight-loading protocol they share.

Every parameter carries a `weight_loader(param, source, shard_id, name)` that copies this rank's part of a
checkpoint tensor into it, and `weight_shards`, the shard ids it takes ("" = the whole tensor); the table in
model/checkpoint_names.py says which checkpoint tensor fills which shard. `source` is anything with `.shape` and slicing
(a torch tensor, or a lazy safetensors slice from the loader), so a rank reads only its rows or columns and never
materialises the full tensor.

- ColumnParallel / MergedColumnParallel: output rows split across ranks (no communication).
- RowParallel: input columns split; the partial products are summed with one all-reduce.

MXFP8 weights (`quant="mxfp8"`, the `mxfp8_weights` switch on an MXFP8 checkpoint): `weight` holds this rank's
fp8 e4m3 rows/columns and `weight_scale` their E8M0 exponents (one per 32 input columns), as the checkpoint stores
them; `forward` runs the fp8-weight GEMM (kernels/fp8_linear.py) or, without Triton, its reference (dequantise,
then F.linear), as the `triton_fp8_linear` switch of the `opts` they are given says. A row-parallel shard must
start and end on a 32-column block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanoserve.config import Optimizations
from nanoserve.kernels import reference, triton_usable
from nanoserve.model.mxfp8 import MXFP8_BLOCK, quantize_mxfp8
from nanoserve.parallel_state import all_reduce, get_tp, shard_range

QUANTIZATIONS = (None, "mxfp8")


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


def read_mxfp8(source: WeightSource, rows: slice, cols: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of a quantized weight as (fp8 [rows, cols], uint8 scales [rows, cols / 32]): read as
    stored from an MXFP8 checkpoint source, or quantised here from a 16/32-bit one (a preset drawn on the device
    with `quantization="mxfp8"`). `cols` must start on a 32-column block."""
    if hasattr(source, "read_mxfp8"):
        return source.read_mxfp8(rows, cols)
    return quantize_mxfp8(source[rows, cols])


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None,
           opts: Optimizations | None = None) -> torch.Tensor:
    """x @ W^T for a 16/32-bit weight (scale None) or an MXFP8 one (fp8 weight + E8M0 scale): the Triton
    fp8-weight GEMM under the `triton_fp8_linear` switch (opts None: on), else its reference. A single row with a
    weight of a tuned shape takes the Triton GEMV under the `triton_gemv` switch (16-bit: instead of F.linear;
    MXFP8: instead of the fp8 GEMM); on Hopper a few rows (a decode step) take the Gluon fp8 GEMM under the
    `fp8_linear_wgmma` switch. Under the `mx_activations` switch (an approximation, off by default) an
    MXFP8 weight multiplies activations quantized to MXFP8 too: kernels/mx_linear.py (no GEMV), or its
    reference."""
    if scale is None:
        y = one_row_gemv(x, weight, None, opts)
        return F.linear(x, weight) if y is None else y
    mx = opts is not None and opts.mx_activations
    if (opts is None or opts.triton_fp8_linear) and triton_usable(x):
        if mx:
            from nanoserve.kernels.mx_linear import mx_linear

            return mx_linear(x, weight, scale)
        from nanoserve.kernels.fp8_linear import FP8_WGMMA_MAX_ROWS, fp8_linear

        y = one_row_gemv(x, weight, scale, opts)
        if y is not None:
            return y
        wgmma = opts is None or opts.fp8_linear_wgmma
        return fp8_linear(x, weight, scale, wgmma_max_rows=FP8_WGMMA_MAX_ROWS if wgmma else None)
    return reference.mx_linear(x, weight, scale) if mx else reference.fp8_linear(x, weight, scale)


def one_row_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, opts: Optimizations | None,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """x @ W^T by kernels/gemv.py when the `triton_gemv` switch (opts None: on) and the GEMV's table take it (one
    row, a tuned weight shape; `scale`: MXFP8), else None: the caller runs its own path."""
    if not ((opts is None or opts.triton_gemv) and x.dim() == 2 and x.shape[0] == 1 and triton_usable(x)):
        return None
    from nanoserve.kernels import gemv

    if not gemv.gemv_applies(x, weight, scale):
        return None
    return gemv.gemv(x, weight, out_dtype=out_dtype) if scale is None else gemv.gemv_mxfp8(x, weight, scale)


def weight_parameters(rows: int, cols: int, dtype: torch.dtype, device: torch.device | str, quant: str | None,
                      lead: tuple[int, ...] = ()) -> tuple[nn.Parameter, nn.Parameter | None]:
    """(weight, scale) parameters of a [*lead, rows, cols] weight: `dtype` and no scale, or MXFP8 (fp8 e4m3 +
    uint8 E8M0 per 32 columns)."""
    if quant not in QUANTIZATIONS:
        raise ValueError(f"quantization={quant!r} is invalid: one of {', '.join(map(str, QUANTIZATIONS))}")
    if quant is None:
        return nn.Parameter(torch.empty(*lead, rows, cols, dtype=dtype, device=device), requires_grad=False), None
    if cols % MXFP8_BLOCK:
        raise ValueError(f"MXFP8 weights need an input width that is a multiple of {MXFP8_BLOCK} on each rank, "
                         f"got {cols}: use fewer tensor-parallel ranks or turn mxfp8_weights off")
    w = nn.Parameter(torch.empty(*lead, rows, cols, dtype=torch.float8_e4m3fn, device=device), requires_grad=False)
    s = nn.Parameter(torch.empty(*lead, rows, cols // MXFP8_BLOCK, dtype=torch.uint8, device=device),
                     requires_grad=False)
    return w, s


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

    def __init__(self, input_size: int, parts: list[OutputPart], dtype: torch.dtype, device: torch.device | str,
                 quant: str | None = None, opts: Optimizations | None = None):
        super().__init__()
        self.opts = opts
        self.input_size = input_size
        self.parts = {p.shard_id: p for p in parts}
        self.offsets: dict[str, int] = {}
        offset = 0
        for p in parts:
            self.offsets[p.shard_id] = offset
            offset += p.local_rows
        self.output_size = offset
        self.weight, self.weight_scale = weight_parameters(offset, input_size, dtype, device, quant)
        self.weight.weight_loader = self.weight_loader
        self.weight.weight_shards = tuple(self.parts)

    def split_sizes(self) -> list[int]:
        return [p.local_rows for p in self.parts.values()]

    def weight_loader(self, param: torch.Tensor, source: WeightSource, shard_id: str, name: str = "") -> None:
        part = self.parts[shard_id]
        check_shape(name or shard_id, source.shape, (part.global_rows, self.input_size))
        off = self.offsets[shard_id]
        if self.weight_scale is None:
            copy_into(param[off: off + part.local_rows], source[part.start: part.end])
        else:
            q, s = read_mxfp8(source, slice(part.start, part.end), slice(None))
            copy_into(param[off: off + part.local_rows], q)
            copy_into(self.weight_scale.data[off: off + part.local_rows], s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.weight_scale, self.opts)


class ColumnParallelLinear(MergedColumnParallelLinear):
    """A single projection whose output rows are split across ranks."""

    def __init__(self, input_size: int, output_size: int, dtype: torch.dtype, device: torch.device | str,
                 quant: str | None = None, opts: Optimizations | None = None):
        super().__init__(input_size, [OutputPart.split("", output_size)], dtype, device, quant, opts)

    def weight_loader(self, param: torch.Tensor, source: WeightSource, shard_id: str = "", name: str = "") -> None:
        super().weight_loader(param, source, "", name)


class RowParallelLinear(nn.Module):
    """Input columns split across ranks; `forward` all-reduces the partial sums (unless reduce=False, for a
    caller that sums several partial results before one all-reduce)."""

    def __init__(self, input_size: int, output_size: int, dtype: torch.dtype, device: torch.device | str,
                 input_range: tuple[int, int] | None = None, reduce: bool = True, quant: str | None = None,
                 opts: Optimizations | None = None):
        super().__init__()
        self.opts = opts
        self.input_size = input_size
        self.output_size = output_size
        self.start, self.end = input_range if input_range is not None else shard_range(input_size)
        self.reduce = reduce
        if quant is not None and self.start % MXFP8_BLOCK:
            raise ValueError(f"MXFP8 weights need each rank's input columns to start on a {MXFP8_BLOCK}-column "
                             f"block, got {self.start}: use fewer tensor-parallel ranks or turn mxfp8_weights off")
        self.weight, self.weight_scale = weight_parameters(output_size, self.end - self.start, dtype, device, quant)
        self.weight.weight_loader = self.weight_loader
        self.weight.weight_shards = ("",)

    def weight_loader(self, param: torch.Tensor, source: WeightSource, shard_id: str = "", name: str = "") -> None:
        check_shape(name, source.shape, (self.output_size, self.input_size))
        if self.weight_scale is None:
            copy_into(param, source[:, self.start: self.end])
        else:
            q, s = read_mxfp8(source, slice(None), slice(self.start, self.end))
            copy_into(param, q)
            copy_into(self.weight_scale.data, s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.weight_scale, self.opts)
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
