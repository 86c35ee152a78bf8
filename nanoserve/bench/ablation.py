"""A/B ablation: one workload with every switch on, then each switch off alone (approximations: each turned ON
alone, since they are off by default), on one model build.

Model-side switches are flipped on the shared Optimizations object (the layers read it at forward time) and the
kernels they select are warmed up before the timed run; engine-side switches take effect in the fresh engine each
row gets. A switch read when the model is built (`build_time`: mxfp8_weights, which decides whether the weights are
fp8 or dequantized) gets a model built again for its row, and the base model back after it (two builds); each row
records the weights it ran on (format, bytes), so such a row shows that it ran what it claims. "Same tokens"
compares every request's greedy output with the all-on row: kernels and their references agree to rounding, so in
bf16 a long greedy continuation may legitimately drift - the first diverging position is shown.
"""

from __future__ import annotations

import logging
import time

from nanoserve.bench.offline import NanoBench, RunResult
from nanoserve.bench.quality import WITH_MXFP8
from nanoserve.bench.report import fmt_ms, table
from nanoserve.bench.workloads import Workload
from nanoserve.config import ENGINE

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


def _row(label: str, switch: str | None, res: RunResult | None, base: RunResult | None, note: str = "",
         approximation: bool = False) -> dict:
    row = {"label": label, "switch": switch, "note": note, "approximation": approximation}
    if res is None:
        return row
    # TTFT p50 and mean: with every request arriving at once (W2: 64 prompts in 4-5 prefill steps) the median
    # request finishes its prompt at a step boundary, so p50 can jump by a whole step between runs; the mean moves
    # with every request's wait
    row.update(output_tok_s=res.output_tok_s, ttft_ms=res.ttft_ms["p50"], ttft_mean_ms=res.ttft_ms["mean"],
               tpot_ms=res.tpot_ms["mean"],
               wall_s=res.wall_s, switches=res.switches, extra=res.extra,
               weight_format=res.extra.get("weight_format"), weight_bytes=res.extra.get("parameter_bytes"))
    if base is not None:
        row["ratio"] = res.output_tok_s / base.output_tok_s if base.output_tok_s else None
        row["tpot_ratio"] = res.tpot_ms["mean"] / base.tpot_ms["mean"] if base.tpot_ms["n"] and res.tpot_ms["n"] \
            else None
        div = first_divergence(base.token_ids, res.token_ids)
        row["identical"] = div is None
        row["first_divergence"] = div
        row["tokens_per_request"] = max((len(t) for t in res.token_ids), default=0)
    return row


def ablate(bench: NanoBench, wl: Workload, base_notes: dict[str, str] | None = None, model_name: str = "",
           meta: dict | None = None, warmup_tokens: int | None = None, on_row=None,
           only: list[str] | None = None) -> dict:
    """Run the ablation rows; returns {"workload", "rows": [...], "table": text, ...}. `base_notes`: switches
    that are off in the base run and why (CPU reference kernels, a kernel module missing). `on_row(row)` is
    called after every row (the caller flushes results). `only`: flip just these switches (default: all)."""
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
    device = bench.device.type
    rows: list[dict] = []
    t0 = time.perf_counter()

    def record(row: dict) -> None:
        rows.append(row)
        if on_row is not None:
            on_row(row)

    bench.warmup(wl, max_tokens=warmup_tokens)
    base = bench.run(wl, mode="all on")
    record(_row("all on", None, base, base))
    for name in switches.names():
        if only and name not in only:
            continue
        approx = name in approximations
        value = saved[name]
        if approx and value:
            record(_row(f"{name} on", name, None, None, "on in the base run already", approximation=True))
            continue
        if not approx and not value:
            why = base_notes.get(name) or ("off by default" if not defaults[name] else "turned off on the command line")
            record(_row(f"{name} off", name, None, None, f"off in the base run: {why}"))
            continue
        note = ""
        if (name == "mxfp8_weights" or name in WITH_MXFP8) and bench.weights["weight_format"] != "mxfp8":
            # a switch that acts on MXFP8 weights only: with other weights the row would change nothing
            record(_row(f"{name} {'ON' if approx else 'off'}", name, None, None, "not applicable: the weights are "
                        "not MXFP8 (an MXFP8 checkpoint or --quantization mxfp8)", approximation=approx))
            continue
        if name == "cuda_graphs" and device != "cuda":
            note = f"not applicable on {device} (decode is eager either way)"
        elif approx:
            note = "APPROXIMATION (changes outputs), off by default; this row turns it ON"
        label = f"{name} {'ON' if approx else 'off'}"
        if name in build_time:
            note = (note + "; " if note else "") + "model rebuilt for this row"
        setattr(opts, name, not value)
        try:
            if name in build_time:
                bench.rebuild()  # the row's model: built with the switch flipped
            if name not in engine_side:
                bench.warmup(wl, max_tokens=warmup_tokens)  # compile the kernels this setting selects
            res = bench.run(wl, mode=label)
            record(_row(label, name, res, base, note, approx))
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
           "device": meta.get("device", device), "date": meta.get("date"), "commit": meta.get("commit"), "rows": rows,
           "elapsed_s": time.perf_counter() - t0}
    out["table"] = ablation_table(out)
    return out


def ablation_table(abl: dict) -> str:
    title = (f"Ablation: {abl['workload']} - {abl['description']}\n"
             f"model {abl['model']} | device {abl['device']} | {abl.get('date') or ''} | "
             f"commit {abl.get('commit') or '?'}")
    rows = []
    for r in abl["rows"]:
        setting = r["label"].split(" ", 1)[1] if r["switch"] else r["label"]
        if "output_tok_s" not in r:
            rows.append([r["switch"] or "-", setting, "-", None, None, None, None, None, "-", r["note"]])
            continue
        same = "-" if r["label"] == "all on" else (
            "yes" if r.get("identical") else f"no (from token {r.get('first_divergence')})")
        ratio = r.get("ratio")
        weights = r.get("weight_format") or "-"
        if r.get("weight_bytes"):
            b = r["weight_bytes"]
            weights += f" {b / 2**30:.2f} GiB" if b >= 2**30 else f" {b / 2**20:.1f} MiB"
        rows.append([r["switch"] or "(all)", setting, weights, r["output_tok_s"], r["ttft_ms"], r.get("ttft_mean_ms"),
                     fmt_ms(r["tpot_ms"]),
                     "-" if ratio is None else f"{ratio:.2f}x", same, r["note"]])
    return table(("switch", "setting", "weights", "out tok/s", "TTFT p50 ms", "TTFT mean ms", "TPOT ms", "x all-on",
                  "same tokens", "note"), rows, title)
