"""The state of one sequence (one completion of one request) as it moves through the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nanoserve.kv_transfer.params import RemoteDecode, RemotePrefill
from nanoserve.sampling import SamplingParams
from nanoserve.step import MultiModalFeature

if TYPE_CHECKING:
    from nanoserve.engine.structured_output import SequenceGrammar


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued for (re)admission: new, or preempted
    RUNNING = "running"  # holds KV blocks; prefilling or decoding
    LOADING_REMOTE_KV = "loading_remote_kv"  # P/D decode: holds blocks for its prompt while their KV is pulled
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the model's max length
    ABORT = "abort"  # cancelled by the client or the engine
    ERROR = "error"  # the engine could not continue it (a structured-output grammar rejected a sampled token)


@dataclass
class Sequence:
    """One sequence: its tokens, its KV blocks, how much of it the KV cache already holds, and timestamps.

    `num_computed_tokens` counts tokens whose K/V are in the cache. The scheduler schedules the gap
    `num_tokens - num_computed_tokens` (a whole prompt, a chunk of it, or the one newest token when decoding);
    preemption frees the blocks and resets it to 0, so the sequence is recomputed from its tokens later."""

    seq_id: int
    request_id: str
    index: int  # which of the request's n completions
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens not computed at the last admission: found in the prefix cache, or (a P/D decode) pulled from
    a prefill server as well (num_external_tokens of them), as vLLM counts its cached tokens."""
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    # sampling results
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list | None = None  # with params.prompt_logprobs: [None, then {id: Logprob} per token]
    # incremental detokenisation (engine/detokenizer.py)
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    # timestamps (time.monotonic) for metrics
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    # structured outputs: this sequence's grammar matcher (None: unconstrained)
    grammar: SequenceGrammar | None = None
    priority: int = 0
    """With the priority scheduling policy: lower runs first (vLLM's meaning); ties go by arrival."""
    cache_salt: str | None = None
    """The request's prefix-cache salt: only sequences with the same salt (or none) share cached blocks."""
    spec_token_ids: list[int] = field(default_factory=list)
    """Speculative decoding: draft tokens proposed to follow this sequence's tokens, verified in its next step
    (engine/speculative.py). Not part of num_tokens: they are guesses until the target model accepts them."""
    kv_transfer: RemoteDecode | RemotePrefill | None = None
    """Prefill/decode disaggregation (the request's kv_transfer_params, kv_transfer/params.py): RemoteDecode on a
    prefill server (keep the prompt's blocks for a decode server to pull), RemotePrefill on a decode server (pull
    the prompt's KV instead of computing it), None otherwise."""
    kv_transfer_answer: dict[str, Any] | None = None
    """On a prefill server, once the prompt's blocks are kept for a pull: the kv_transfer_params that name them
    (the response carries them to the decode server)."""
    num_external_tokens: int = 0
    """Prompt tokens whose KV was pulled from another engine (a P/D decode) rather than computed or found in the
    prefix cache here."""
    mm_features: list[MultiModalFeature] = field(default_factory=list)
    """The prompt's images and videos, in prompt order: their placeholder tokens take the vision model's features
    (engine/encoder_cache.py schedules the encoding; their content hashes key the prefix cache's blocks too)."""
    num_pending: int = 0
    """Tokens sampled on the device whose value the host has not received yet (the step that samples one is in
    flight). They count in num_tokens - the scheduler and the KV cache hold their positions, and async scheduling
    feeds them to the next step from the device - but not in output_token_ids, which holds known tokens only."""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt + generated tokens, the pending ones included (what the KV cache will hold)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    @property
    def num_known_tokens(self) -> int:
        """Prompt + generated tokens the host has (num_tokens less the pending ones)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens, the pending ones included (what max_tokens and min_tokens count)."""
        return len(self.output_token_ids) + self.num_pending

    def reached_length_limit(self, max_model_len: int, count_pending: bool = True) -> bool:
        """Has it sampled its last allowed token (max_tokens, or max_model_len)? `count_pending`: counting the
        tokens still on the device (the scheduler's question), or only the known ones (the stop check's)."""
        outputs = len(self.output_token_ids) + (self.num_pending if count_pending else 0)
        max_tokens = self.params.max_tokens
        return (self.num_prompt_tokens + outputs >= max_model_len
                or (max_tokens is not None and outputs >= max_tokens))

    @property
    def token_ids(self) -> list[int]:
        """The known tokens: prompt + output_token_ids (pending ones are not known yet)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def needs_prompt_logprobs(self) -> bool:
        """The request asked for prompt logprobs and this sequence (the request's first: they are per prompt)
        has not got them all yet. Such a sequence reads nothing from the prefix cache: a cached prefix was never
        run through the LM head."""
        return self.params.prompt_logprobs is not None and self.index == 0 and \
            (self.prompt_logprobs is None or len(self.prompt_logprobs) < len(self.prompt_token_ids))

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def mm_end(self) -> int:
        """One past the prompt position of its last placeholder token (0: no images or videos)."""
        return self.mm_features[-1].end if self.mm_features else 0

    def token_at(self, i: int) -> int:
        p = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < p else self.output_token_ids[i - p]
