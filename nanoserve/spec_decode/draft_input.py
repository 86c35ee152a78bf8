"""What the engine asks a model-based drafter for, as plain lists (like ModelInput: picklable, no tensors)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DraftInput:
    """One draft step after a model step. The drafter first runs over the positions whose target hidden states
    the last step computed and whose next token is now known - per sequence `query_lens[s]` of them, ending at
    position seq_lens[s] - 1; their rows of the last step's hidden states are `rows`, their next tokens
    `next_ids` - writing its own K/V there; then it drafts `num_drafts[s]` tokens for sequence s (0: only the
    K/V). Sequences with one row come first (the attention kernels take decodes first). A block table covers
    seq_lens[s] + num_drafts[s] - 1 positions: each draft after the first is computed at the next position."""

    rows: list[int]
    next_ids: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    num_drafts: list[int]
