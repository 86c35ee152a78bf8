"""What a step's tokens turn into for the caller: logprob lists, timestamps, and one RequestOutput per request.

    RequestState    a request's sequences (n of them) and what its outputs report about it
    record_token    a sampled token's logprobs and times, onto its sequence
    make_output     a request's state -> RequestOutput (vLLM's shape, engine/outputs.py), cumulative so far
"""

from __future__ import annotations

from dataclasses import dataclass

from nanoserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from nanoserve.engine.sequence import Sequence
from nanoserve.sampling import SamplingParams


@dataclass
class RequestState:
    """One request in the engine: its prompt, its parameters and its n sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    arrival_time: float

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


def record_token(seq: Sequence, logprobs: dict[int, float] | None, now: float) -> list[float]:
    """seq's newest token was appended: keep its logprobs (when asked for: the chosen token's first) and the times.
    Returns the time since its previous token ([] for its first: the inter-token latency metric's sample)."""
    if logprobs is not None:
        seq.logprobs.append(logprobs)
        seq.cumulative_logprob += next(iter(logprobs.values()))
    gap = [] if seq.first_token_time is None else [now - seq.last_token_time]
    if seq.first_token_time is None:
        seq.first_token_time = now
    seq.last_token_time = now
    return gap


def make_output(state: RequestState) -> RequestOutput:
    """Everything the request has produced so far (text, tokens, logprobs, finish reasons, metrics)."""
    completions = [
        CompletionOutput(
            index=s.index, text=s.text, token_ids=list(s.output_token_ids),
            cumulative_logprob=s.cumulative_logprob if s.params.logprobs is not None else None,
            logprobs=list(s.logprobs) if s.params.logprobs is not None else None,
            finish_reason=s.finish_reason.value if s.finish_reason else None, stop_reason=s.stop_reason)
        for s in state.seqs
    ]
    # complete once the first token is out (the prompt is prefilled by then) and never changed after: shared
    prompt_logprobs = state.seqs[0].prompt_logprobs if state.params.prompt_logprobs is not None else None
    return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, completions, state.finished,
                         request_metrics(state), prompt_logprobs, state.seqs[0].kv_transfer_answer)


def request_metrics(state: RequestState) -> RequestMetrics:
    """The request's times: the earliest first-token, the latest finish, and so on over its sequences."""
    seqs = state.seqs
    return RequestMetrics(
        arrival_time=state.arrival_time,
        first_scheduled_time=min((s.first_scheduled_time for s in seqs if s.first_scheduled_time), default=None),
        first_token_time=min((s.first_token_time for s in seqs if s.first_token_time), default=None),
        last_token_time=max((s.last_token_time for s in seqs if s.last_token_time), default=None),
        finished_time=max((s.finished_time for s in seqs if s.finished_time), default=None),
        num_cached_tokens=seqs[0].num_cached_tokens, num_preemptions=sum(s.num_preemptions for s in seqs))
