"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary rows."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanoserve.config import Optimizations
from nanoserve.model.layers.linear import WeightSource, check_shape, copy_into, one_row_gemv
from nanoserve.parallel_state import all_gather_last_dim, all_reduce, get_tp


class _VocabShard(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        tp = get_tp()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        # Pad the vocabulary so it splits evenly; padded rows stay zero and are sliced off the logits.
        self.padded_vocab = -(-vocab_size // tp.size) * tp.size
        per = self.padded_vocab // tp.size
        self.start = tp.rank * per
        self.end = min(self.start + per, vocab_size)
        self.weight = nn.Parameter(torch.zeros(per, hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.weight.weight_shards = ("",)

    def weight_loader(self, param: torch.Tensor, source: WeightSource, shard_id: str = "", name: str = "") -> None:
        check_shape(name, source.shape, (self.vocab_size, self.hidden_size))
        if self.end > self.start:
            copy_into(param[: self.end - self.start], source[self.start: self.end])


class VocabParallelEmbedding(_VocabShard):
    """Token embedding. Ids outside this rank's slice contribute zeros; an all-reduce assembles the rows."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if get_tp().size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside[:, None], 0)
        return all_reduce(out)


class ParallelLMHead(_VocabShard):
    """Untied output projection. Each rank computes its vocabulary slice; the slices are gathered (fp32 logits).
    One row (a one-request decode step) may take the `triton_gemv` GEMV, when its table holds the slice's shape."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device | str,
                 opts: Optimizations | None = None):
        super().__init__(vocab_size, hidden_size, dtype, device)
        self.opts = opts

    def forward(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits [rows, vocab_size]; into `out` when given (a CUDA graph's static buffer: the conversion to
        fp32 then writes there directly, with no second copy)."""
        logits = one_row_gemv(hidden, self.weight, None, self.opts)
        if logits is None:
            logits = F.linear(hidden, self.weight)
        # Gathered in the model dtype (half the bytes of fp32); widening to fp32 afterwards is exact.
        logits = all_gather_last_dim(logits)[:, : self.vocab_size]
        return logits.float() if out is None else out.copy_(logits)
