"""The executor interface: where the model runs, as the engine sees it.

The engine talks to an executor through `initialize_cache` and one pair of calls per step, as vLLM's executors:
`execute_model(StepInput)` queues the forward, and `sample_tokens(GrammarMasks)` - given the structured-output masks
the engine filled on the host meanwhile - queues the sampling and returns a future whose `result()` is the step's
`StepOutput`: token ids, never logits (nanoserve/step.py). Tensor parallelism is a different executor
(distributed/executor.py), not a different engine. Both executors build on this module; it imports neither.
"""

from __future__ import annotations

from typing import Protocol

import torch

from nanoserve.config import Platform
from nanoserve.kv_transfer.transfer import KVTransferAgent
from nanoserve.model.m3_config import M3Config
from nanoserve.model.vision.config import VisionConfig
from nanoserve.spec_decode.draft_input import DraftInput
from nanoserve.step import GrammarMasks, StepInput, StepOutput


class StepFuture(Protocol):
    """A step on its way: `result()` waits for its tokens (on a GPU the step runs meanwhile)."""

    def result(self) -> StepOutput: ...


class Executor:
    """Interface: a model (config), a KV pool of `num_blocks`, and one step at a time."""

    model_config: M3Config
    model_dir: str
    device: torch.device
    num_blocks: int
    block_size: int
    platform: Platform
    """Which switches can act where the model runs (Optimizations.not_applicable)."""
    vision_config: VisionConfig | None = None
    """The vision model's config; None when the checkpoint has none (the model takes no images or videos)."""
    encoder_cache_size: int = 0
    """With a vision model: the feature rows its encoder cache holds and it may encode per step (set by
    initialize_cache, from max_num_batched_tokens)."""

    def initialize_cache(self, max_model_len: int, max_num_batched_tokens: int, max_num_seqs: int) -> int:
        """Size the KV pool for these limits, allocate it, and return its number of blocks."""
        raise NotImplementedError

    supports_token_feed: bool = False
    """Can a step take input tokens the previous step sampled, still on the device (StepInput.fed)? Only where the
    sampled tokens and the model share a process and device; async scheduling needs it."""

    def execute_model(self, step: StepInput) -> None:
        """Queue one step's forward. `sample_tokens` must follow before the next execute_model."""
        raise NotImplementedError

    def sample_tokens(self, masks: GrammarMasks | None = None) -> StepFuture:
        """Queue the tokens of the step execute_model queued: sampling, prompt logprobs, the verification of drafts
        and the next drafts (rank 0). Returns without waiting for the device."""
        raise NotImplementedError

    def propose_drafts(self, inp: DraftInput) -> list[list[int]]:
        """A model-based drafter's passes alone (the warm-up builds their shapes with it): its draft tokens per
        sequence, read from the last step's hidden states (spec_decode/draft_input.py)."""
        raise NotImplementedError(f"{type(self).__name__} runs no model-based drafter")

    def kv_transfer_agent(self, engine_id: str, backends: list[str]) -> KVTransferAgent:
        """A NIXL agent over every KV pool of the model (K/V and MSA index keys), for prefill/decode
        disaggregation (kv_transfer/transfer.py). Call after initialize_cache: it registers the pools' memory."""
        raise NotImplementedError(f"{type(self).__name__} cannot transfer KV blocks (tensor_parallel_size 1 only)")

    def check_health(self) -> None:
        """Raise if a worker is gone."""

    def shutdown(self) -> None:
        raise NotImplementedError
