"""A step on its way: what `LLMEngine.launch` handed the executor (`LaunchedStep`), and what `update` hands
`outputs` once its tokens are appended (`Appended`). Both step loops pass these - the plain one in
engine/llm_engine.py and the overlapped one in engine/overlap.py."""

from __future__ import annotations

from dataclasses import dataclass

from nanoserve.engine.scheduler import ScheduledSeq, SchedulerOutput
from nanoserve.engine.sequence import Sequence
from nanoserve.executor.base import StepFuture
from nanoserve.step import StepInput


@dataclass
class LaunchedStep:
    """A step whose forward and sampling are queued: its schedule, its input, and the future of its tokens."""

    sched: SchedulerOutput
    step: StepInput
    future: StepFuture
    sampled: list[ScheduledSeq]  # the sequences that get tokens from it, in batch order

    @property
    def seqs(self) -> list[Sequence]:
        return [s.seq for s in self.sampled]


@dataclass
class Appended:
    """One token `update` appended to its sequence (`has_token` False: the sequence ended without one), its
    logprobs (the chosen token first; None when not asked), whether its stop strings were checked already (a run of
    accepted drafts), and whether it is the sequence's first."""

    seq: Sequence
    logprobs: dict[int, float] | None = None
    has_token: bool = True
    text_done: bool = False
    first: bool = False  # the sequence's first output token (its prompt's prefill ended in this step)
