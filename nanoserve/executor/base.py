"""The executor interface: where the model runs, as the engine sees it.

The engine talks to an executor only through `initialize_cache` and `execute_model(ModelInput) -> logits`, so
tensor parallelism is a different executor (distributed/executor.py), not a different engine. Both executors
build on this module; it imports neither.
"""

from __future__ import annotations

import torch

from nanoserve.batch import ModelInput, TokenFeed
from nanoserve.model.m3_config import M3Config
from nanoserve.spec_decode.draft_input import DraftInput


class Executor:
    """Interface: a model (config), a KV pool of `num_blocks`, and one forward step at a time."""

    model_config: M3Config
    model_dir: str
    device: torch.device
    num_blocks: int
    block_size: int

    def initialize_cache(self, max_model_len: int, max_num_batched_tokens: int, max_num_seqs: int) -> int:
        """Size the KV pool for these limits, allocate it, and return its number of blocks."""
        raise NotImplementedError

    supports_token_feed: bool = False
    """Can execute_model take a TokenFeed (input ids from the previous step's tokens on the device)? Only where
    the sampled tokens and the model share a process and device; async scheduling needs it."""

    def execute_model(self, inp: ModelInput, feed: TokenFeed | None = None) -> torch.Tensor:
        """Run one step; fp32 logits [len(inp.sample_rows), vocab] on this process's device. `feed` only where
        supports_token_feed."""
        raise NotImplementedError

    def last_argmax(self) -> torch.Tensor | None:
        """The argmax of the last step's logits if the step computed it on the device (a decode graph under the
        captured_argmax switch), valid until the next step; None otherwise."""
        return None

    def propose_drafts(self, inp: DraftInput) -> list[list[int]]:
        """Speculative decoding with a model-based drafter (the MTP module): its draft tokens per sequence, read
        from the last step's hidden states (spec_decode/draft_input.py). Only where the runner loaded one."""
        raise NotImplementedError(f"{type(self).__name__} runs no model-based drafter")

    def draft_chain(self) -> torch.Tensor | None:
        """Right after a verify step: the next step's MTP drafts made on the device (runner/draft_chain.py), or
        None where this executor or the step has none."""
        return None

    def check_health(self) -> None:
        """Raise if a worker is gone."""

    def shutdown(self) -> None:
        raise NotImplementedError
