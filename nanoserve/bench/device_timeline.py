"""What the device does during each engine step, from CUDA/HIP events (`--speculative host` on a GPU).

Host timers say how long the host spends in each phase; they cannot say whether the device was waiting for it. An
event recorded on the stream takes its timestamp when the device reaches it, so three per step tell the device's
side:

    start   before the step's inputs are staged (the runner's `execute`: its copies are the step's first device work)
    forward after the forward is queued (a decode or verify graph replayed, or the eager launches)
    end     after the step's sampling, verification and draft chain are queued (`sample_tokens` returned)

and two more around the draft chain (`chain_start`, `chain`) when a verify step runs one, and around a draft
model's passes made once the step's tokens are on the host (`draft_start`, `draft`: the runner's `propose_drafts`,
where no chain made the drafts). From them, per step: `forward` = start -> forward, `chain` = chain_start -> chain,
`draft` = draft_start -> draft, `device` = start -> end (the device's span of the step: its work, and any wait for
the host inside the step), and the **bubble** before the next step = end -> next start, less the draft passes run
in that gap: the device idle because the host had not launched the next step yet (0 where the host is a step
ahead). Steps of different requests are not compared (`boundary()` between them): the gap there is the client's,
not the engine's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol


class Event(Protocol):
    def record(self) -> None: ...

    def elapsed_time(self, end: "Event") -> float: ...


def cuda_event() -> Event:
    import torch

    return torch.cuda.Event(enable_timing=True)


@dataclass
class DeviceTimeline:
    """The events of every step (see the module docstring); `summary()` once the device has finished them."""

    new_event: Callable[[], Event] = cuda_event
    steps: list[dict[str, Event]] = field(default_factory=list)
    segments: list[int] = field(default_factory=list)
    """The index of each request's first step: bubbles are measured within a request only."""

    def mark(self, name: str) -> None:
        """Record event `name` of the current step ("start" begins a new step)."""
        if name == "start":
            self.steps.append({})
        elif not self.steps:
            return  # an event outside a step (none is timed before the first start)
        event = self.new_event()
        event.record()
        self.steps[-1][name] = event

    def boundary(self) -> None:
        """The next step begins a new request."""
        self.segments.append(len(self.steps))

    def wrap(self, fn: Callable, before: str | None = None, after: str | None = None) -> Callable:
        """`fn` with event `before` recorded before it runs and `after` once it has returned."""
        def marked(*args, **kwargs):
            if before:
                self.mark(before)
            out = fn(*args, **kwargs)
            if after:
                self.mark(after)
            return out
        return marked

    def summary(self) -> dict[str, Any]:
        """Mean milliseconds per step: forward, draft chain (over the steps that ran one), device span, and bubble
        (per gap between consecutive steps of a request); the bubbles' share of the device's time
        (`idle_share`: bubbles / (spans + bubbles)). Call after the device has finished (synchronize)."""
        complete = [s for s in self.steps if "start" in s and "end" in s]
        forward = [s["start"].elapsed_time(s["forward"]) for s in complete if "forward" in s]
        chain = [s["chain_start"].elapsed_time(s["chain"]) for s in complete if "chain" in s and "chain_start" in s]
        draft = [_draft_ms(s) for s in complete if "draft" in s]
        spans = [s["start"].elapsed_time(s["end"]) for s in complete]
        starts = set(self.segments)
        bubbles = [max(0.0, a["end"].elapsed_time(b["start"]) - _draft_ms(a))
                   for i, (a, b) in enumerate(zip(self.steps, self.steps[1:]), start=1)
                   if i not in starts and "end" in a and "start" in b]

        def mean(xs: list[float]) -> float | None:
            return sum(xs) / len(xs) if xs else None

        busy, idle = sum(spans), sum(bubbles)
        return {"steps": len(complete), "forward_ms": mean(forward), "chain_ms": mean(chain),
                "chain_steps": len(chain), "draft_ms": mean(draft), "draft_steps": len(draft),
                "device_ms": mean(spans), "bubble_ms": mean(bubbles),
                "idle_share": idle / (busy + idle) if busy + idle > 0 else None}


def _draft_ms(step: dict[str, Event]) -> float:
    """The step's draft passes made on the host's call (0 where it had none)."""
    return step["draft_start"].elapsed_time(step["draft"]) if "draft" in step and "draft_start" in step else 0.0


def install(engine, timeline: DeviceTimeline) -> None:
    """Record the timeline's events around the engine's runner (rank 0's, in this process) and its sampling. Each
    event costs the host a few microseconds, counted in the host phase that records it."""
    runner = engine.executor.runner
    runner.execute = timeline.wrap(runner.execute, before="start", after="forward")
    draft_chain = runner.draft_chain

    def chain():  # timed only where a chain graph ran (it returns None where none fits)
        timeline.mark("chain_start")
        drafts = draft_chain()
        if drafts is not None:
            timeline.mark("chain")
        return drafts

    runner.draft_chain = chain
    if runner.drafter is not None:  # a draft model's passes once the tokens are on the host (no chain made them)
        runner.propose_drafts = timeline.wrap(runner.propose_drafts, before="draft_start", after="draft")
    engine.executor.sample_tokens = timeline.wrap(engine.executor.sample_tokens, after="end")
