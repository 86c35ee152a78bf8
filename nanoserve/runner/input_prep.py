"""A step's batch -> device tensors, vectorised (switch `fast_input_prep`; reference: `AttentionMetadata.build`
plus one `torch.tensor(...)` per input, `reference_prepare`).

The reference builds positions and slots with a Python loop over every token and copies each tensor to the device
on its own: fine for a decode step of a few sequences, ~5 ms for an 8192-token prefill chunk, and a handful of
synchronous copies per step. Here numpy computes positions and slots for the whole batch at once, everything is
packed into two host buffers (one int64, one int32) and each goes to the device in one copy. On a GPU the host
buffers are pinned and reused, so the copies are asynchronous; an event guards a buffer until its copy is done.

`fill_block_tables`, `slot_mapping` and `apply_token_feed` (async scheduling's device-side input ids) are the
steps every preparation shares: `InputPreparer` (eager steps)
and the decode graphs' staging (runner/cuda_graphs.py, which writes into its static buffers) both call them.
"""

from __future__ import annotations

import numpy as np
import torch

from nanoserve.batch import AttentionMetadata, TokenFeed
from nanoserve.step import ModelInput


def reference_prepare(inp: ModelInput, block_size: int, device: torch.device
                      ) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor]:
    """The plain path (`fast_input_prep` off): the Python loop of `AttentionMetadata.build`, one copy per tensor."""
    meta = AttentionMetadata.build(inp.query_lens, inp.seq_lens, inp.block_tables, block_size, device)
    input_ids = torch.tensor(inp.input_ids, dtype=torch.long, device=device)
    ends = meta.query_start_loc[1:].long() - 1
    logits_index = ends[torch.tensor(inp.sample_rows, dtype=torch.long, device=device)]
    if inp.prompt_rows:  # the extra rows of prompt logprobs, after the sample rows
        logits_index = torch.cat([logits_index, torch.tensor(inp.prompt_rows, dtype=torch.long, device=device)])
    return input_ids, meta, logits_index


def apply_token_feed(input_ids: torch.Tensor, feed: TokenFeed | None) -> None:
    """Write the fed tokens into a step's device input ids (in place; queued on the stream, no host sync). Every
    preparation path - eager, reference, the decode graphs' static buffer - calls this after its own copy."""
    if feed is None or not feed.dst:
        return
    if feed.is_prefix:
        input_ids[: len(feed.dst)].copy_(feed.tokens[: len(feed.src)], non_blocking=True)
        return
    on_cuda = input_ids.device.type == "cuda"
    dst = torch.tensor(feed.dst, dtype=torch.long, pin_memory=on_cuda).to(input_ids.device, non_blocking=True)
    src = torch.tensor(feed.src, dtype=torch.long, pin_memory=on_cuda).to(input_ids.device, non_blocking=True)
    input_ids.index_copy_(0, dst, feed.tokens.index_select(0, src).to(input_ids.dtype))


def fill_block_tables(out: np.ndarray, block_tables: list[list[int]]) -> None:
    """Row i of `out` (already zero) gets sequence i's block table; the entries past its end stay 0."""
    for i, t in enumerate(block_tables):
        out[i, : len(t)] = t


def slot_mapping(tables: np.ndarray, rows: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """Where each token's K/V goes: block_table[p // block_size] * block_size + p % block_size, for the token at
    position `positions[j]` of sequence `rows[j]` (int64)."""
    return tables[rows, positions // block_size].astype(np.int64) * block_size + positions % block_size


class _Staging:
    """A growable host buffer (pinned on a GPU) whose previous copy to the device must finish before reuse."""

    def __init__(self, dtype: torch.dtype, device: torch.device):
        self.dtype, self.device = dtype, device
        self.pinned = device.type == "cuda"
        self.host = torch.empty(0, dtype=dtype)
        self.np_dtype = self.host.numpy().dtype
        self.copied = torch.cuda.Event() if self.pinned else None

    def to_device(self, parts: list[np.ndarray]) -> torch.Tensor:
        """Concatenate `parts` and return them as one device tensor."""
        n = sum(p.size for p in parts)
        if not self.pinned:  # CPU: a fresh tensor (the caller keeps views of it)
            return torch.from_numpy(np.concatenate([p.ravel() for p in parts]).astype(self.np_dtype, copy=False))
        self.copied.synchronize()
        if self.host.numel() < n:
            self.host = torch.empty(max(n, 2 * self.host.numel()), dtype=self.dtype, pin_memory=True)
        buf = self.host.numpy()
        off = 0
        for p in parts:
            buf[off: off + p.size] = p.ravel()
            off += p.size
        out = self.host[:n].to(self.device, non_blocking=True)
        self.copied.record()
        return out


class InputPreparer:
    """Builds (input_ids, AttentionMetadata, logits_index) for one step, like `reference_prepare`, with the same
    validation."""

    def __init__(self, block_size: int, device: torch.device):
        self.block_size = block_size
        self.device = device
        self.i64 = _Staging(torch.int64, device)
        self.i32 = _Staging(torch.int32, device)

    def prepare(self, input_ids: list[int], query_lens: list[int], seq_lens: list[int],
                block_tables: list[list[int]], sample_rows: list[int], prompt_rows: list[int] = ()
                ) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor]:
        page = self.block_size
        num_seqs = len(query_lens)
        if len(seq_lens) != num_seqs or len(block_tables) != num_seqs:
            raise ValueError("query_lens, seq_lens and block_tables must have one entry per sequence")
        q = np.asarray(query_lens, dtype=np.int64)
        s = np.asarray(seq_lens, dtype=np.int64)
        if num_seqs and ((q < 1).any() or (q > s).any()):
            bad = int(np.flatnonzero((q < 1) | (q > s))[0])
            raise ValueError(f"query length {query_lens[bad]} must be in [1, seq_len={seq_lens[bad]}]")
        table_lens = np.fromiter((len(t) for t in block_tables), dtype=np.int64, count=num_seqs)
        if (table_lens * page < s).any():
            bad = int(np.flatnonzero(table_lens * page < s)[0])
            raise ValueError(f"block table of {table_lens[bad]} blocks cannot hold {seq_lens[bad]} tokens")
        num_tokens = int(q.sum())
        if len(input_ids) != num_tokens:
            raise ValueError(f"{len(input_ids)} input ids for {num_tokens} scheduled tokens")

        width = max(int(table_lens.max(initial=0)), 1)
        tables = np.zeros((num_seqs, width), dtype=np.int32)
        fill_block_tables(tables, block_tables)
        starts = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(q, out=starts[1:])
        row = np.repeat(np.arange(num_seqs), q)
        positions = np.arange(num_tokens, dtype=np.int64) - starts[row] + (s - q)[row]
        slots = slot_mapping(tables, row, positions, page)
        logits_index = starts[1:][np.asarray(sample_rows, dtype=np.int64)] - 1
        if len(prompt_rows):  # the extra rows of prompt logprobs, after the sample rows
            logits_index = np.concatenate([logits_index, np.asarray(prompt_rows, dtype=np.int64)])
        not_decode = np.flatnonzero(q != 1)
        num_decode = int(not_decode[0]) if not_decode.size else num_seqs

        ids = np.asarray(input_ids, dtype=np.int64)
        i64 = self.i64.to_device([ids, positions, slots, logits_index])
        i32 = self.i32.to_device([starts.astype(np.int32), s.astype(np.int32), tables])
        t, r, n = num_tokens, len(logits_index), num_seqs
        meta = AttentionMetadata(
            positions=i64[t: 2 * t], query_start_loc=i32[: n + 1], seq_lens=i32[n + 1: 2 * n + 1],
            block_tables=i32[2 * n + 1:].view(n, width), slot_mapping=i64[2 * t: 3 * t], block_size=page,
            max_query_len=int(q.max(initial=0)), max_seq_len=int(s.max(initial=0)), num_decode_seqs=num_decode,
            query_lens_cpu=list(query_lens), seq_lens_cpu=list(seq_lens))
        return i64[:t], meta, i64[3 * t: 3 * t + r]
