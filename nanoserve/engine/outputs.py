"""What the engine returns per request (vLLM's RequestOutput / CompletionOutput shape)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    """One token's entry in prompt_logprobs (vLLM's shape): its logprob, its rank in the vocabulary (1 = the most
    likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None  # per token: {chosen id: logprob, then top-N alternatives}
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    reasoning: str | None = None  # LLM(reasoning_parser=...).chat: the thinking (None: the model did not think)
    content: str | None = None  # ... and the answer after it


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float | None
    num_cached_tokens: int = 0
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = field(default=None)
    """With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (nothing predicts it)."""
    kv_transfer_params: dict[str, Any] | None = None
    """Prefill/decode disaggregation, on a prefill server: where the finished prompt's KV blocks wait for a decode
    server (vLLM's kv_transfer_params, engine/kv_connector.py); None otherwise."""

    @property
    def num_cached_tokens(self) -> int:
        return self.metrics.num_cached_tokens if self.metrics else 0
