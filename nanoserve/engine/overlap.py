"""The overlapped step: the engine iteration with switch `overlap_scheduling` on (and `async_scheduling` on top of
it). The reference is the plain step, `LLMEngine.step`: schedule -> run the model -> sample -> (a) -> (b), each
step waiting for its own tokens, with the device idle while the host works.

Why: the host's turn between two forwards - receive the tokens, detokenise, check stops, build the outputs,
schedule, stage the inputs - takes a real share of a decode step on a GPU, during which the device idles. This
loop runs that host work while the device computes the next step. It reuses the plain step's three parts:
`launch` (schedule, hand the step to the executor: the forward and the sampling are queued, no host sync), and
the host work on a step's tokens, split in two: (a) `update`, what the next schedule depends on - wait for the
tokens, append them, end the sequences that EOS, a stop token id or a length limit ends; (b) `outputs`, the rest -
incremental detokenisation, stop strings, logprobs, the RequestOutputs.

Overlap scheduling. Call N+1 runs (a) for step N's tokens, schedules and launches step N+1 (forward and
device-side sampling, no host sync), and does (b) for step N's tokens while the device computes step N+1 - so
`step()` returns the previous step's outputs, and a last call with nothing left to schedule returns the final
ones. A sequence that a stop string ends in (b) is already in step N+1: it is finished there (its blocks freed:
later steps are queued behind N+1 on the device) and its N+1 token is dropped when it arrives, as an aborted
sequence's is.

Async scheduling (launch ahead; reference: overlap alone). Overlap still waits for step N's tokens before it schedules
step N+1, so the device idles through the host's receive, schedule and input staging. Launching ahead, step N+1 is
scheduled and launched first: each token sampled in step N counts as pending in its sequence (`Sequence.num_pending`:
its KV position is held, its value is not known), a decode's input id at that position comes from step N's sampled
tokens on the device (`StepInput.fed`: the runner copies them in), and only then (a) receives step N's tokens, while
the device runs N+1. A sequence that step N's token ends (EOS, a stop id) is already in N+1 and is handled as one a
stop string ends; one whose last allowed token is pending is not scheduled again. A step waits for the tokens first,
as overlap alone does, when a running sequence's sampling reads its own output on the host (structured outputs,
bad_words, penalties: `reads_own_output`), when the step in flight computes prompt logprobs, or when the engine turned
launching ahead off (the executor cannot feed tokens - tensor parallelism - or speculative decoding, whose next drafts
come with the previous step's tokens).
"""

from __future__ import annotations

from typing import Callable

from nanoserve.engine.launched_step import Appended, LaunchedStep
from nanoserve.engine.outputs import RequestOutput
from nanoserve.engine.sequence import Sequence


class OverlappedStep:
    """The engine iteration that keeps one step in flight. `launch(previous)`, `receive(step)` and
    `process(appended)` are the engine's `launch`, `update` and `outputs`; `launch_ahead` turns on async scheduling,
    and `speculative_ahead(previous)` says whether a speculative step may be launched before `previous`'s tokens
    arrive (None: the engine does not speculate). Chosen once, when the engine is built: a step in flight must be
    finished by the loop that launched it."""

    def __init__(self, launch: Callable[[LaunchedStep | None], LaunchedStep | None],
                 receive: Callable[[LaunchedStep], list[Appended]],
                 process: Callable[[list[Appended]], list[RequestOutput]], launch_ahead: bool,
                 speculative_ahead: Callable[[LaunchedStep], bool] | None = None):
        self.launch, self.receive, self.process = launch, receive, process
        self.launch_ahead = launch_ahead
        self.speculative_ahead = speculative_ahead
        self.in_flight: LaunchedStep | None = None  # step N, queued on the device, its tokens not yet received

    def step(self) -> list[RequestOutput]:
        """Launch step N+1, then finish step N on the host while the device computes: returns step N's outputs."""
        previous, self.in_flight = self.in_flight, None
        ahead = previous is not None and self._can_launch_ahead(previous)
        received = self.receive(previous) if previous is not None and not ahead else []  # (a) first: plain overlap
        self.in_flight = self.launch(previous if ahead else None)
        if ahead:  # (a) for step N's tokens, while the device computes step N+1
            received = self.receive(previous)
        return self.process(received)  # (b) for step N, while the device computes step N+1

    def _can_launch_ahead(self, previous: LaunchedStep) -> bool:
        """May the next step be launched before `previous`'s tokens are received (async scheduling)?"""
        if not self.launch_ahead or previous.step.prompt_logprobs:
            return False  # prompt logprobs: the next schedule reads how many a sequence has
        if any(reads_own_output(seq) for seq in previous.seqs if not seq.is_finished):
            return False
        return self.speculative_ahead is None or self.speculative_ahead(previous)


def reads_own_output(seq: Sequence) -> bool:
    """Does sampling seq's next token read its output tokens on the host? (a structured-output grammar, bad_words,
    repetition / presence / frequency penalties). Such a sequence's tokens must be received before its next step
    is built, so async scheduling waits for them."""
    p = seq.params
    return (seq.grammar is not None or bool(p.bad_words_token_ids) or p.repetition_penalty != 1.0
            or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0)
