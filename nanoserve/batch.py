"""The types that describe one step's batch, shared by every layer that touches it.

    TokenFeed           input ids taken from the previous step's sampled tokens on the device (async scheduling)
    VerifyFeed          a verify step's queries and positions taken from the previous step's draft chain (async
                        speculative decoding)
    AttentionMetadata   what the attention layers and kernels need about the flat batch, as device tensors

This module imports nothing of nanoserve, so the engine, the runner, the model and the kernels may all use it.

A step's batch is one flat run of T tokens: sequence 0's new tokens, then sequence 1's, and so on. Decodes
(one new token each) come first, then prefills (a whole prompt, or a chunk of one). Each sequence's KV lives in
fixed-size blocks of a shared pool; its block table lists them in order, so token position p of the sequence sits
in block `block_table[p // block_size]` at offset `p % block_size`, i.e. at "slot"
`block_table[p // block_size] * block_size + p % block_size`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenFeed:
    """Input ids that are still on the device (async scheduling): `input_ids[dst[j]]` of this step is the token
    that the previous step sampled in row `src[j]` of `tokens`. The host list holds a placeholder there; the
    runner copies the token in on the device, so the step is launched before the previous one's tokens reach the
    host. Only a runner in the engine's process (tensor_parallel_size 1) can take one."""

    dst: list[int]
    src: list[int]
    tokens: torch.Tensor  # [S] int64, the previous step's sampled tokens, on the device

    @property
    def is_prefix(self) -> bool:
        """dst and src are both 0, 1, ..., k-1 (a decode batch in the previous step's order): one plain copy."""
        return self.dst == self.src == list(range(len(self.dst)))


@dataclass
class VerifyFeed:
    """A verify step launched before the previous one's tokens reach the host (switch spec_async): sequence i's
    query - its k + 1 input ids - is row `rows[i]` of `ids`, and its first position row `rows[i]` of `pos`, both
    left on the device by the previous step's draft chain (spec_decode/draft_chain.py). The host's lists hold
    placeholders; the runner writes these over them on the device, and the positions' slots and context lengths
    with them."""

    rows: list[int]
    ids: torch.Tensor  # [R, k + 1] int64: the bonus token, then the drafts
    pos: torch.Tensor  # [R] int64: the bonus token's position


@dataclass
class AttentionMetadata:
    """Per-step attention inputs (device tensors + the few host-side numbers the reference path needs)."""

    positions: torch.Tensor
    """[T] int64: absolute position of each token in its sequence."""
    query_start_loc: torch.Tensor
    """[S+1] int32: sequence s owns tokens query_start_loc[s] : query_start_loc[s+1] of the flat batch."""
    seq_lens: torch.Tensor
    """[S] int32: context length of each sequence after this step (cached tokens + this step's tokens)."""
    block_tables: torch.Tensor
    """[S, max_blocks] int32: physical KV block of each logical block; entries past a sequence's end are 0."""
    slot_mapping: torch.Tensor
    """[T] int64: where each token's K/V (and index key) is written; -1 = padding, write nothing."""
    block_size: int
    max_query_len: int
    max_seq_len: int
    num_decode_seqs: int
    """The first num_decode_seqs sequences have exactly one query token (decodes)."""
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def is_decode_only(self) -> bool:
        return self.num_decode_seqs == self.num_seqs

    @classmethod
    def build(cls, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]], block_size: int,
              device: torch.device | str = "cpu") -> "AttentionMetadata":
        """Build the metadata on the host for sequences whose new tokens are the last `query_lens[s]` of
        `seq_lens[s]` (used by the model runner and by tests)."""
        if len(query_lens) != len(seq_lens) or len(seq_lens) != len(block_tables):
            raise ValueError("query_lens, seq_lens and block_tables must have one entry per sequence")
        positions: list[int] = []
        slots: list[int] = []
        for q, n, table in zip(query_lens, seq_lens, block_tables):
            if not 1 <= q <= n:
                raise ValueError(f"query length {q} must be in [1, seq_len={n}]")
            if len(table) * block_size < n:
                raise ValueError(f"block table of {len(table)} blocks cannot hold {n} tokens")
            for p in range(n - q, n):
                positions.append(p)
                slots.append(table[p // block_size] * block_size + p % block_size)
        width = max((len(t) for t in block_tables), default=1) or 1
        tables = torch.zeros(len(block_tables), width, dtype=torch.int32)
        for i, t in enumerate(block_tables):
            tables[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        num_decode = 0
        while num_decode < len(query_lens) and query_lens[num_decode] == 1:
            num_decode += 1
        return cls(
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=tables.to(device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_size=block_size,
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            num_decode_seqs=num_decode,
            query_lens_cpu=list(query_lens),
            seq_lens_cpu=list(seq_lens),
        )
