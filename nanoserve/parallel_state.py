"""The tensor-parallel group of this process and the collectives the model uses.

With tp_size == 1 (the default) every collective is a no-op, so a one-GPU run pays nothing for being
tensor-parallel-ready. Every rank calls `set_tp` once, after joining the process group and before building the
model: the layers read their shard from it at construction (distributed/worker.py `build_runner`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class TensorParallelGroup:
    """This rank's place in the tensor-parallel group."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None
    expert_parallel: bool = False
    """MoE sharding mode: True = whole experts split across ranks, False = each expert's intermediate dim split."""


_TP = TensorParallelGroup()


def get_tp() -> TensorParallelGroup:
    return _TP


def set_tp(rank: int, size: int, group: dist.ProcessGroup | None = None, expert_parallel: bool = False) -> None:
    """Set this process's tensor-parallel coordinates (torch.distributed must already be initialised if size > 1)."""
    global _TP
    if not 0 <= rank < size:
        raise ValueError(f"tp rank {rank} is outside [0, {size})")
    _TP = TensorParallelGroup(rank, size, group, expert_parallel)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum x over the group, in place (no-op at tp_size 1)."""
    if _TP.size > 1:
        dist.all_reduce(x, group=_TP.group)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's x along the last dim (identity at tp_size 1)."""
    if _TP.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP.size)]
    dist.all_gather(parts, x.contiguous(), group=_TP.group)
    return torch.cat(parts, dim=-1)


def shard_range(total: int, rank: int | None = None, size: int | None = None) -> tuple[int, int]:
    """[start, end) of this rank's equal share of `total` items (must divide evenly)."""
    rank = _TP.rank if rank is None else rank
    size = _TP.size if size is None else size
    if total % size:
        raise ValueError(f"cannot split {total} evenly over tensor_parallel_size={size}")
    per = total // size
    return rank * per, (rank + 1) * per


def kv_head_range(num_kv_heads: int, rank: int | None = None, size: int | None = None) -> tuple[int, int]:
    """KV (and MSA index) heads of this rank: split while tp <= num_kv_heads, else one replicated head per rank
    (rank r serves head r // (tp / num_kv_heads), which is the head its query heads belong to)."""
    rank = _TP.rank if rank is None else rank
    size = _TP.size if size is None else size
    if size <= num_kv_heads:
        return shard_range(num_kv_heads, rank, size)
    if size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size={size} must be a multiple of num_key_value_heads={num_kv_heads} "
                         f"when it exceeds it")
    head = rank // (size // num_kv_heads)
    return head, head + 1
