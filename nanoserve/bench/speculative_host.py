"""Where a speculative step's wall time goes on the host, beside a plain decode step.

    python -m nanoserve.bench --speculative host                  # m3-mini, every configuration, all prompts
    python -m nanoserve.bench --speculative host --spec-limit 5   # at most 5 prompts per task

A model's arithmetic at batch 1 is small; what a step costs beyond it is host work (drafting, scheduling, input
staging, launching, sampling, acceptance, detokenisation) and the waits where the host syncs with the device. For each
configuration - no speculation, ngram k=3 (prompt lookup 1-3 tokens), mtp k=3 (when the checkpoint has an MTP module)
and, on a GPU, mtp k=3 with switch spec_async off, with spec_draft_chain off and with spec_feed_in_graph off - the
engine is built once (on a GPU warmed up as the server is: engine/warmup.py), answers one short prompt untimed, and
then answers the held-out chat prompts (tasks arith, tool, no_tool) greedily, one at a time (batch 1, where
speculation pays). Meanwhile time.perf_counter wrappers, installed on the engine's objects (the engine's code is
not changed), time each phase of every engine step:

    launch          engine.launch: schedule the step and hand it to the executor, made of
      schedule        engine.scheduler.schedule
      execute_model   engine.executor.execute_model: stage the inputs and launch (or replay) the target's forward
      masks           engine._grammar_masks: the structured-output masks, on the host while the forward runs
      sample_tokens   engine.executor.sample_tokens: queue the draw, the verification of drafts, the draft chain
    update          engine.update: the step's tokens appended, stop checks; inside it
      result          the step future's result(): wait for the tokens (the host-device sync), then
        propose         the runner's Proposer.propose: the next step's drafts (ngram: the lookup on the host)
          propose_drafts  a draft model's passes (mtp; its graph replays)
    outputs         engine.outputs: detokenise, stop strings, logprobs, the outputs
    other           the rest of engine.step: step - launch, update and outputs
    step            the whole engine.step
    outside step    generate()'s time outside engine.step (add_request, the generate loop), per step

On a GPU, CUDA events recorded around each step's forward, draft chain and sampling add the device's side: its
time per step, and the bubbles where it waited for the host (bench/device_timeline.py).

How to read it: each phase row is its mean milliseconds per step, where a step is one forward of the target model
(a prefill, a decode or a verify step: tokens per step is output tokens / steps). With overlap_scheduling (on by
default) one step() call receives the previous step's tokens and launches the next, and a request's last step()
call only finishes its last step; that call's time is counted too, so per step the phases add up to step's wall
time. On a GPU the forward runs asynchronously: execute_model, sample and verify are launch times, and the
device's compute shows up where the host waits for it, in receive (and in propose_drafts, which reads its
drafts back). ms / token = the step's wall time per output token, TPOT as the host sees it; a speculative
configuration gains when its tokens per step outgrow its step's cost relative to no speculation. Greedy outputs
must be equal across configurations: a difference is printed and the command fails.
"""

from __future__ import annotations

import functools
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from nanoserve.bench.device_timeline import DeviceTimeline
from nanoserve.bench.device_timeline import install as install_timeline
from nanoserve.bench.quality import heldout_rows
from nanoserve.bench.speculative_llm import (
    MULTI,
    NO_ASYNC,
    NO_CHAIN,
    NO_FEED,
    build_llm,
    first_difference,
    max_tokens_for,
    no_chain_skip,
    switches_for,
)

TASKS = ("arith", "tool", "no_tool")
"""The held-out chat tasks answered (retrieval's long prompts measure prefill, not a decode step)."""

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
MTP_K3 = {"method": "mtp", "num_speculative_tokens": 3}

PHASES = ("launch", "schedule", "execute_model", "masks", "sample_tokens", "update", "result", "propose",
          "propose_drafts", "outputs")
"""The timed phases of a step, in the order the plain step runs them (the overlapped step updates first)."""

PHASE_SOURCES = {"launch": "engine.launch", "schedule": "engine.scheduler.schedule",
                 "execute_model": "engine.executor.execute_model", "masks": "engine._grammar_masks",
                 "sample_tokens": "engine.executor.sample_tokens", "update": "engine.update",
                 "result": "the step's future, result()", "propose": "the runner's Proposer.propose",
                 "propose_drafts": "the runner's propose_drafts", "outputs": "engine.outputs"}

DEVICE_ROWS = (("device: forward (inputs staged, forward queued)", "forward_ms", ".3f"),
               ("device: draft chain (the steps that ran one)", "chain_ms", ".3f"),
               ("device: draft passes after the tokens (the steps that ran them)", "draft_ms", ".3f"),
               ("device: span of a step (first work to sampling queued)", "device_ms", ".3f"),
               ("device: bubble (idle between a step and the next)", "bubble_ms", ".3f"),
               ("device: idle share (bubbles / (spans + bubbles))", "idle_share", ".2f"))
"""The device's side of a step, from CUDA events (on a GPU): mean ms per step, the chain's and the draft passes' over
the steps that ran them (bench/device_timeline.py)."""


def configurations(model_dir: str, device: str = "cpu") -> list[tuple[str, dict | None, str | None]]:
    """(name, speculative_config, why it is skipped or None) for every configuration measured."""
    from nanoserve.spec_decode.mtp import has_mtp

    no_mtp = None if has_mtp(model_dir) else f"{model_dir} has no MTP module (language_model.model.mtp.*)"
    return [("no speculation", None, None), ("ngram k=3", NGRAM, None), ("mtp k=3", MTP_K3, no_mtp),
            (NO_ASYNC, MTP_K3, no_chain_skip(no_mtp, device)), (NO_CHAIN, MTP_K3, no_chain_skip(no_mtp, device)),
            (NO_FEED, MTP_K3, no_chain_skip(no_mtp, device)), (MULTI, MTP_K3, no_chain_skip(no_mtp, device))]


@dataclass
class PhaseTimer:
    """Inclusive wall time and calls per phase. A phase called while another timed one runs is nested in it: its
    time is the caller's too, so only the phases `step` calls directly are subtracted from it for "other"."""

    total_s: Counter = field(default_factory=Counter)
    calls: Counter = field(default_factory=Counter)
    within: dict[str, str | None] = field(default_factory=dict)  # phase -> the timed phase that called it
    direct_in_step_s: float = 0.0
    _stack: list[str] = field(default_factory=list)

    def wrap(self, name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            parent = self._stack[-1] if self._stack else None
            self._stack.append(name)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                self._stack.pop()
                self.total_s[name] += dt
                self.calls[name] += 1
                self.within.setdefault(name, parent)
                if parent == "step":
                    self.direct_in_step_s += dt
        return timed


def install_timers(engine, timer: PhaseTimer) -> list[str]:
    """Wrap the engine's phases on its instances (see the module docstring); returns the phases wrapped. The
    overlapped step holds the engine's `launch`, `update` and `outputs` as bound methods taken when it was built:
    it gets the wrapped ones."""
    wrapped = []

    def put(obj, attr: str, name: str) -> None:
        setattr(obj, attr, timer.wrap(name, getattr(obj, attr)))
        wrapped.append(name)

    runner = engine.executor.runner
    proposer = runner.sampling.proposer
    if proposer is not None:
        put(proposer, "propose", "propose")
        if proposer.by_model is not None:  # a draft model: the runner runs its passes
            put(runner, "propose_drafts", "propose_drafts")
    sample_tokens = engine.executor.sample_tokens

    def sample_and_time_its_result(masks=None):
        future = sample_tokens(masks)
        future.result = timer.wrap("result", future.result)
        return future

    engine.executor.sample_tokens = timer.wrap("sample_tokens", sample_and_time_its_result)
    wrapped += ["sample_tokens", "result"]
    put(engine.scheduler, "schedule", "schedule")
    put(engine.executor, "execute_model", "execute_model")
    put(engine, "_grammar_masks", "masks")
    put(engine, "launch", "launch")
    put(engine, "update", "update")
    put(engine, "outputs", "outputs")
    if engine.overlapped is not None:
        overlapped = engine.overlapped
        overlapped.launch, overlapped.receive, overlapped.process = engine.launch, engine.update, engine.outputs
    put(engine, "step", "step")
    return wrapped


def measure_host(model: str, device: str = "cpu", dtype: str = "auto", limit: int | None = None,
                 optimizations=None) -> dict[str, Any]:
    """The report (see the module docstring): a dict, with a printable `table`. `limit`: at most this many
    prompts per task (None: all); `optimizations`: the engines' switches (None: the defaults)."""
    from nanoserve.presets.resolve import resolve_model_dir

    model_dir = resolve_model_dir(model)
    rows = [r for r in heldout_rows(model_dir, limit, 0, flag="--speculative host") if r["task"] in TASKS]
    if not rows:
        raise ValueError(f"--speculative host: {model_dir}'s held-out set has no prompts of the tasks "
                         f"{', '.join(TASKS)}")
    report: dict[str, Any] = {"model": model, "device": device, "dtype": dtype, "limit": limit,
                              "prompts": dict(Counter(r["task"] for r in rows)), "configs": {}, "skipped": {},
                              "differences": []}
    outputs: dict[str, list[list[int]]] = {}
    for name, config, skip in configurations(model_dir, device):
        if skip:
            report["skipped"][name] = skip
            continue
        result, outputs[name] = _measure_one(model, device, dtype, config, rows, switches_for(name, optimizations))
        report["configs"][name] = {"speculative_config": config, **result}
        _progress(name, result)
    base = outputs["no speculation"]
    for name, outs in outputs.items():
        for i, (a, b) in enumerate(zip(base, outs)):
            if (d := first_difference(a, b)) is not None:
                report["differences"].append({"config": name, "prompt": i, "first_token": d})
    report["identical"] = not report["differences"]
    report["table"] = host_table(report)
    return report


def _measure_one(model: str, device: str, dtype: str, config: dict | None, rows: list[dict], optimizations
                 ) -> tuple[dict[str, Any], list[list[int]]]:
    """One engine: warm up, install the timers, answer every row alone; its per-step report and its outputs."""
    from nanoserve.sampling import SamplingParams

    llm = build_llm(model, device, dtype, config, optimizations)
    try:
        engine = llm.engine
        # one short request first, so the timed ones do not pay for first-use work (allocations, kernel builds)
        llm.generate([rows[0]["prompt"]], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
        timer = PhaseTimer()
        install_timers(engine, timer)
        timeline = None
        if engine.executor.device.type == "cuda":  # events on the stream: what the device did meanwhile
            timeline = DeviceTimeline()
            install_timeline(engine, timeline)
        stats = engine.stats
        drafts0, accepted0 = stats.spec_decode_num_drafts, stats.spec_decode_num_accepted_tokens
        outs, wall = [], 0.0
        for r in rows:
            if timeline is not None:
                timeline.boundary()
            t0 = time.perf_counter()
            out = llm.generate([r["prompt"]], SamplingParams(temperature=0.0, max_tokens=max_tokens_for(r["task"])),
                               use_tqdm=False)[0]
            wall += time.perf_counter() - t0
            outs.append(list(out.outputs[0].token_ids))
        num_drafts = stats.spec_decode_num_drafts - drafts0
        num_accepted = stats.spec_decode_num_accepted_tokens - accepted0
        if timeline is not None:
            import torch

            torch.cuda.synchronize()
    finally:
        llm.shutdown()
    steps = timer.calls["execute_model"]  # target forwards
    tokens = sum(len(o) for o in outs)
    step_s = timer.total_s["step"]

    def per_step_ms(seconds: float) -> float:
        return seconds * 1e3 / steps if steps else 0.0

    result = {"engine_steps": timer.calls["step"], "steps": steps, "output_tokens": tokens,
              "tokens_per_step": tokens / steps if steps else 0.0, "wall_s": wall,
              "phases": {p: {"calls": timer.calls[p], "ms_per_step": per_step_ms(timer.total_s[p]),
                             "total_ms": timer.total_s[p] * 1e3, "within": timer.within.get(p)}
                         for p in PHASES if p in timer.calls},
              "other_ms_per_step": per_step_ms(step_s - timer.direct_in_step_s),
              "step_ms_per_step": per_step_ms(step_s),
              "outside_step_ms_per_step": per_step_ms(wall - step_s),
              "ms_per_token": step_s * 1e3 / tokens if tokens else None,
              "num_drafts": num_drafts, "num_accepted_tokens": num_accepted,
              "mean_accepted_length": 1.0 + num_accepted / num_drafts if num_drafts else None,
              "device": timeline.summary() if timeline is not None else None}
    return result, outs


def _progress(name: str, result: dict[str, Any]) -> None:
    import sys

    print(f"{name}: {result['output_tokens']} tokens in {result['steps']} steps, {result['wall_s']:.1f} s",
          file=sys.stderr, flush=True)


def _f(v: float | None, fmt: str = ".3f") -> str:
    return "-" if v is None else format(v, fmt)


def host_table(report: dict[str, Any]) -> str:
    configs = report["configs"]
    names = list(configs)
    prompts = ", ".join(f"{t} {n}" for t, n in report["prompts"].items())
    lines = [f"## Host time per speculative step on {report['model']} ({report['device']}, greedy, batch 1; "
             f"held-out prompts: {prompts})", "",
             "ms per step (a step: one target forward); a phase's calls are in the JSON report", "",
             "| phase | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for p in PHASES:
        if not any(p in c["phases"] for c in configs.values()):
            continue
        within = next((c["phases"][p]["within"] for c in configs.values() if p in c["phases"]), None)
        label = f"{p} ({PHASE_SOURCES[p]}" + (f", within {within})" if within not in (None, "step") else ")")
        cells = [_f(c["phases"][p]["ms_per_step"]) if p in c["phases"] else "-" for c in configs.values()]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    for label, key, fmt in (("other (step - launch, update and outputs)", "other_ms_per_step", ".3f"),
                            ("**step** (engine.step)", "step_ms_per_step", ".3f"),
                            ("outside step (generate loop, add_request)", "outside_step_ms_per_step", ".3f"),
                            ("steps", "steps", "d"), ("output tokens", "output_tokens", "d"),
                            ("tokens / step", "tokens_per_step", ".2f"),
                            ("mean accepted length", "mean_accepted_length", ".2f"),
                            ("**ms / token** (step time per output token)", "ms_per_token", ".3f")):
        lines.append(f"| {label} | " + " | ".join(_f(c[key], fmt) for c in configs.values()) + " |")
    if any(c.get("device") for c in configs.values()):  # on a GPU: the device's side (bench/device_timeline.py)
        for label, key, fmt in DEVICE_ROWS:
            cells = [_f((c.get("device") or {}).get(key), fmt) for c in configs.values()]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    for name, why in report["skipped"].items():
        lines.append(f"\n{name}: skipped, {why}")
    if not report["identical"]:
        lines.append("\nGREEDY OUTPUT DIFFERS ACROSS CONFIGURATIONS: " + "; ".join(
            f"{d['config']} prompt {d['prompt']} from token {d['first_token']}" for d in report["differences"]))
    return "\n".join(lines)
