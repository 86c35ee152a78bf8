"""A/B ablation: one workload with every switch on, then each switch off alone (approximations: each turned ON
alone, since they are off by default), on one model build.

Model-side switches are flipped on the shared Optimizations object (the layers read it at forward time) and the
kernels they select are warmed up before the timed run; engine-side switches take effect in the fresh engine each
row gets. A switch read when the model is built (`build_time`: mxfp8_weights, which decides whether the weights are
fp8 or dequantized) gets a model built again for its row, and the base model back after it (two builds); each row
records the weights it ran on (format, bytes), so such a row shows that it ran what it claims. "Same tokens"
compares every request's greedy output with the all-on row: kernels and their references agree to rounding, so in
bf16 a long greedy continuation may legitimately drift - the first diverging position is shown.

A switch that cannot act here (`Optimizations.not_applicable`: a CUDA-only switch on the CPU, a Triton kernel where
the reference path runs anyway, an MXFP8 kernel on 16-bit weights, a speculative switch without a
speculative_config, overlap_grammar on a workload without structured outputs) gets an `n/a` row with the reason and
is not timed: timing it would only measure noise. Each timed row runs `repeats` times (a fresh engine each); the
table gives the medians and the spread of output tok/s, (max - min) / median, and a row whose effect on the median
is within the larger of its own spread and the all-on row's is flagged: that difference is not measured.
"""

from __future__ import annotations

import logging
import statistics
import time

from nanoserve.bench.offline import NanoBench, RunResult
from nanoserve.bench.report import fmt_ms, table
from nanoserve.bench.workloads import Workload
from nanoserve.config import ENGINE, Platform

logger = logging.getLogger(__name__)


def first_divergence(a: list[list[int]], b: list[list[int]]) -> int | None:
    """Smallest position where some request's tokens differ (None = identical everywhere)."""
    worst = None
    for x, y in zip(a, b):
        n = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), None)
        if n is None and len(x) != len(y):
            n = min(len(x), len(y))
        if n is not None:
            worst = n if worst is None else min(worst, n)
    return worst


def spread(values: list[float]) -> float | None:
    """(max - min) / median of repeated measurements (None: fewer than two, or a zero median)."""
    if len(values) < 2:
        return None
    mid = statistics.median(values)
    return (max(values) - min(values)) / mid if mid else None


def not_applicable_here(opts, platform: Platform, wl: Workload) -> dict[str, str]:
    """The switches that cannot act in this ablation (switch -> why): the platform's; a switch the server's request
    preparation reads (declared in a server/ module), since the ablation drives the engine directly; and
    overlap_grammar on a workload none of whose requests has a structured output (it moves only the grammars' host
    work)."""
    out = opts.not_applicable(platform)
    for sw in type(opts).switches():
        if sw.module.startswith("server/"):
            out.setdefault(sw.name, f"acts in the server ({sw.module}); the ablation drives the engine directly")
    if "overlap_grammar" in type(opts).names() and not any(r.json_schema for r in wl.requests):
        out.setdefault("overlap_grammar", f"no request of {wl.name} has a structured output")
    return {name: out[name] for name in type(opts).names() if name in out}


def _median_of(results: list[RunResult], get) -> float | None:
    values = [v for v in (get(r) for r in results) if v is not None and v == v]
    return statistics.median(values) if values else None


def _row(label: str, switch: str | None, runs: list[RunResult] | None, base: list[RunResult] | None,
         note: str = "", approximation: bool = False) -> dict:
    row = {"label": label, "switch": switch, "note": note, "approximation": approximation}
    if not runs:
        return row
    res = runs[0]
    # TTFT p50 and mean: with every request arriving at once (W2: 64 prompts in 4-5 prefill steps) the median
    # request finishes its prompt at a step boundary, so p50 can jump by a whole step between runs; the mean moves
    # with every request's wait. Each is the median over the row's repeats.
    tok_s = [r.output_tok_s for r in runs]
    row.update(output_tok_s=statistics.median(tok_s), ttft_ms=_median_of(runs, lambda r: r.ttft_ms["p50"]),
               ttft_mean_ms=_median_of(runs, lambda r: r.ttft_ms["mean"]),
               tpot_ms=_median_of(runs, lambda r: r.tpot_ms["mean"] if r.tpot_ms["n"] else None),
               repeats=len(runs), output_tok_s_runs=tok_s, spread=spread(tok_s),
               wall_s=sum(r.wall_s for r in runs), switches=res.switches, extra=res.extra,
               weight_format=res.extra.get("weight_format"), weight_bytes=res.extra.get("parameter_bytes"))
    if base:
        b = _row("", None, base, None)
        row["ratio"] = row["output_tok_s"] / b["output_tok_s"] if b["output_tok_s"] else None
        row["tpot_ratio"] = row["tpot_ms"] / b["tpot_ms"] if row["tpot_ms"] and b["tpot_ms"] else None
        noise = max((s for s in (row["spread"], b["spread"]) if s is not None), default=None)
        row["within_spread"] = None if noise is None or row["ratio"] is None or label == "all on" else \
            abs(row["ratio"] - 1.0) <= noise
        div = first_divergence(base[0].token_ids, res.token_ids)
        row["identical"] = div is None
        row["first_divergence"] = div
        row["tokens_per_request"] = max((len(t) for t in res.token_ids), default=0)
    return row


def ablate(bench: NanoBench, wl: Workload, base_notes: dict[str, str] | None = None, model_name: str = "",
           meta: dict | None = None, warmup_tokens: int | None = None, on_row=None,
           only: list[str] | None = None, repeats: int = 1, platform: Platform | None = None) -> dict:
    """Run the ablation rows; returns {"workload", "rows": [...], "table": text, ...}. `base_notes`: switches
    that are off in the base run and why (CPU reference kernels, a kernel module missing). `on_row(row)` is
    called after every row (the caller flushes results). `only`: flip just these switches (default: all).
    `repeats`: timed runs per row. `platform`: where the switches run (default: the bench's own)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    base_notes = base_notes or {}
    opts = bench.opts
    saved = opts.as_dict()
    switches = type(opts)  # the declarations: every switch gets a row
    unknown = sorted(set(only or ()) - set(switches.names()))
    if unknown:
        raise ValueError(f"unknown optimization switch(es) {', '.join(unknown)}; known: "
                         f"{', '.join(switches.names())}")
    approximations = set(switches.approximations())
    defaults = {sw.name: sw.default for sw in switches.switches()}
    engine_side = set(switches.names(ENGINE))
    build_time = set(switches.build_time())
    platform = platform or bench.platform
    na = not_applicable_here(opts, platform, wl)
    rows: list[dict] = []
    t0 = time.perf_counter()

    def record(row: dict) -> None:
        rows.append(row)
        if on_row is not None:
            on_row(row)

    def timed(label: str) -> list[RunResult]:
        return [bench.run(wl, mode=label) for _ in range(repeats)]

    bench.warmup(wl, max_tokens=warmup_tokens)
    base = timed("all on")
    record(_row("all on", None, base, base))
    for name in switches.names():
        if only and name not in only:
            continue
        approx = name in approximations
        value = saved[name]
        label = f"{name} {'ON' if approx else 'off'}"
        if name in na:
            record({**_row(label, name, None, None, f"n/a: {na[name]}", approx), "applicable": False})
            continue
        if approx and value:
            record(_row(f"{name} on", name, None, None, "on in the base run already", approximation=True))
            continue
        if not approx and not value:
            why = base_notes.get(name) or ("off by default" if not defaults[name] else "turned off on the command line")
            record(_row(label, name, None, None, f"off in the base run: {why}"))
            continue
        note = "APPROXIMATION (changes outputs), off by default; this row turns it ON" if approx else ""
        if name in build_time:
            note = (note + "; " if note else "") + "model rebuilt for this row"
        setattr(opts, name, not value)
        try:
            if name in build_time:
                bench.rebuild()  # the row's model: built with the switch flipped
            if name not in engine_side:
                bench.warmup(wl, max_tokens=warmup_tokens)  # compile the kernels this setting selects
            record(_row(label, name, timed(label), base, note, approx))
        except Exception as e:  # noqa: BLE001 - one broken path must not end the ablation
            logger.exception("ablation row %s failed", label)
            record(_row(label, name, None, None, f"FAILED: {type(e).__name__}: {e}", approx))
        finally:
            setattr(opts, name, value)
            if name in build_time:
                bench.rebuild()  # the base model again, for the rows after this one
                bench.warmup(wl, max_tokens=warmup_tokens)
            elif name not in engine_side:
                bench.capture_graphs(wl)  # graphs are dropped when a model-side switch changes
    meta = meta or {}
    out = {"workload": wl.name, "description": wl.description, "model": model_name,
           "device": meta.get("device", bench.device.type), "date": meta.get("date"), "commit": meta.get("commit"),
           "repeats": repeats, "not_applicable": na, "rows": rows, "elapsed_s": time.perf_counter() - t0}
    out["warnings"] = spread_warnings(out)
    out["table"] = ablation_table(out)
    return out


def spread_warnings(abl: dict) -> list[str]:
    """One line per timed row whose effect on output tok/s is within the spread of repeated runs."""
    out = []
    for r in abl["rows"]:
        if r.get("within_spread"):
            noise = max(s for s in (r.get("spread"), abl["rows"][0].get("spread")) if s is not None)
            out.append(f"{r['label']}: {r['ratio']:.2f}x all-on is within the spread of repeated runs "
                       f"({noise:.0%}): not a measured effect")
    return out


def ablation_table(abl: dict) -> str:
    repeats = abl.get("repeats", 1)
    title = (f"Ablation: {abl['workload']} - {abl['description']}\n"
             f"model {abl['model']} | device {abl['device']} | {abl.get('date') or ''} | "
             f"commit {abl.get('commit') or '?'} | "
             + (f"{repeats} runs per row: medians, spread = (max - min) / median of out tok/s" if repeats > 1
                else "1 run per row (--ablate-repeats N for the spread)"))
    rows = []
    for r in abl["rows"]:
        setting = r["label"].split(" ", 1)[1] if r["switch"] else r["label"]
        if r.get("applicable") is False:
            setting = "n/a"
        if "output_tok_s" not in r:
            rows.append([r["switch"] or "-", setting, "-", None, "-", None, None, None, "-", "-", r["note"]])
            continue
        same = "-" if r["label"] == "all on" else (
            "yes" if r.get("identical") else f"no (from token {r.get('first_divergence')})")
        ratio = r.get("ratio")
        weights = r.get("weight_format") or "-"
        if r.get("weight_bytes"):
            b = r["weight_bytes"]
            weights += f" {b / 2**30:.2f} GiB" if b >= 2**30 else f" {b / 2**20:.1f} MiB"
        note = r["note"]
        if r.get("within_spread"):
            note = "within the spread: no measured effect" + (f"; {note}" if note else "")
        rows.append([r["switch"] or "(all)", setting, weights, r["output_tok_s"],
                     "-" if r.get("spread") is None else f"{100 * r['spread']:.0f}%", r["ttft_ms"],
                     r.get("ttft_mean_ms"), fmt_ms(r["tpot_ms"]), "-" if ratio is None else f"{ratio:.2f}x", same,
                     note])
    text = table(("switch", "setting", "weights", "out tok/s", "spread", "TTFT p50 ms", "TTFT mean ms", "TPOT ms",
                  "x all-on", "same tokens", "note"), rows, title)
    warnings = abl.get("warnings") or []
    if warnings:
        text += f"\nWARNING: {len(warnings)} row(s) differ from all-on by less than the spread of repeated runs:\n"
        text += "\n".join(f"  {w}" for w in warnings)
    return text
