"""Results on disk (results.json, written after every part) and on screen (aligned tables), plus PNG plots."""

from __future__ import annotations

import json
import logging
import math
import os
import re
from typing import Any, Sequence

logger = logging.getLogger(__name__)

TARGETS = {
    "W1 TPOT (ms)": ("<=", 1.5),
    "W2 output tok/s": (">=", 4000.0),
    "W4 TPOT 128k / 1k": ("<=", 1.3),
    "W4 TTFT at 128k (s)": ("<=", 1.5),
    "W2J / W2 output tok/s": (">=", 0.85),
}
"""The targets of docs/benchmarks.md ("Targets") that one bench run checks: W1's and W2's, W4's, and the
structured-output one (JSON-constrained W2 keeps >= 85 % of W2's rate)."""


def fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.{digits}f}"
    return str(value)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None) -> str:
    """A plain-text table: numbers right-aligned, text left-aligned, one rule under the header."""
    cells = [[fmt(c) if not isinstance(c, str) else c for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    numeric = [bool(cells) and all(_NUMERIC.match(r[i]) for r in cells) for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

    out = [title] if title else []
    out += [line(headers), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells]
    return "\n".join(out)


_NUMERIC = re.compile(r"^(-|[-+]?[\d,]*\.?\d+[x%]?)$")


class Results:
    """Everything one bench invocation measured; `flush` rewrites results.json atomically."""

    def __init__(self, out_dir: str | None, meta: dict):
        self.out_dir = out_dir
        self.data: dict[str, Any] = {"meta": meta, "runs": [], "ablations": [], "profiles": [], "prefill_profiles": [],
                                     "serve": [],
                                     "errors": [], "notes": []}
        if out_dir:
            os.makedirs(out_dir, exist_ok=True)

    def add(self, kind: str, item: Any) -> None:
        self.data[kind].append(item)
        self.flush()

    def flush(self) -> None:
        if not self.out_dir:
            return
        path = os.path.join(self.out_dir, "results.json")
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1, default=_json_default)
        os.replace(tmp, path)

    def write_text(self, name: str, text: str) -> None:
        if self.out_dir:
            with open(os.path.join(self.out_dir, name), "w") as f:
                f.write(text + "\n")


def _json_default(o: Any) -> Any:
    if hasattr(o, "as_dict"):
        return o.as_dict()
    if isinstance(o, float) and math.isnan(o):
        return None
    return str(o)


# -- run tables ---------------------------------------------------------------------------------------------------

RUN_HEADERS = ("workload", "engine", "mode", "reqs", "out tok/s", "TTFT p50 ms", "TPOT mean ms", "TPOT p99 ms",
               "GB/s", "TFLOP/s", "% floor")


def run_row(r: dict) -> list[Any]:
    perf = r.get("perf", {})
    frac = perf.get("tpot_fraction_of_floor") if r["num_requests"] == 1 else \
        perf.get("output_tok_s_fraction_of_floor")
    return [r["workload"], r["engine"], r["mode"], r["num_requests"], r["output_tok_s"], r["ttft_ms"]["p50"],
            fmt_ms(r["tpot_ms"]["mean"]), fmt_ms(r["tpot_ms"]["p99"]), perf.get("decode_gb_s"),
            perf.get("decode_tflop_s"), None if frac is None else 100 * frac]


def fmt_ms(ms: float | None) -> str:
    """A TPOT to the microsecond: decode targets sit at 1.1-1.5 ms, where one decimal hides the difference."""
    return "-" if ms is None or math.isnan(ms) else f"{ms:.3f}"


def runs_table(runs: list[dict], title: str | None = None) -> str:
    return table(RUN_HEADERS, [run_row(r) for r in runs], title)


def targets_table(runs: list[dict]) -> str:
    """The targets against what this run measured (nanoserve, default switches)."""
    best = {r["workload"]: r for r in runs if r["engine"] == "nanoserve" and r["mode"] == "default"}
    got: dict[str, float | None] = {"W1 TPOT (ms)": best.get("W1", {}).get("tpot_ms", {}).get("mean"),
                                    "W2 output tok/s": best.get("W2", {}).get("output_tok_s")}
    long, short = best.get("W4-128k"), best.get("W1")
    got["W4 TPOT 128k / 1k"] = (long["tpot_ms"]["mean"] / short["tpot_ms"]["mean"]) if long and short else None
    got["W4 TTFT at 128k (s)"] = long["ttft_ms"]["mean"] / 1e3 if long else None
    w2, w2j = best.get("W2"), best.get("W2J")
    got["W2J / W2 output tok/s"] = w2j["output_tok_s"] / w2["output_tok_s"] if w2 and w2j and w2["output_tok_s"] \
        else None
    rows = []
    for name, (op, goal) in TARGETS.items():
        v = got.get(name)
        ok = None if v is None or v != v else (v <= goal if op == "<=" else v >= goal)
        shown = fmt_ms(v) if name == "W1 TPOT (ms)" else v
        rows.append([name, f"{op} {goal:g}", shown, "-" if ok is None else ("PASS" if ok else "miss")])
    return table(("target", "goal", "measured", "verdict"), rows)


def hf_ratio_table(runs: list[dict]) -> str | None:
    """nanoserve vs each HF configuration, per workload measured by both."""
    nano = {r["workload"]: r for r in runs if r["engine"] == "nanoserve" and r["mode"] == "default"}
    rows = []
    for r in runs:
        if r["engine"] != "hf" or r["workload"] not in nano:
            continue
        n = nano[r["workload"]]
        tp_ratio = r["tpot_ms"]["mean"] / n["tpot_ms"]["mean"] if n["tpot_ms"]["n"] and r["tpot_ms"]["n"] else None
        rows.append([r["workload"], r["mode"], fmt_ms(r["tpot_ms"]["mean"]), fmt_ms(n["tpot_ms"]["mean"]), tp_ratio,
                     r["decode_tok_s"], n["decode_tok_s"],
                     n["decode_tok_s"] / r["decode_tok_s"] if r["decode_tok_s"] else None])
    if not rows:
        return None
    return table(("workload", "HF mode", "HF TPOT ms", "nano TPOT ms", "TPOT HF/nano", "HF decode tok/s",
                  "nano decode tok/s", "speedup"), rows)


# -- plots --------------------------------------------------------------------------------------------------------


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001 - plots are optional
        logger.warning("matplotlib unavailable, no plots: %s", e)
        return None
    return plt


def plot_ablation(abl: dict, path: str) -> str | None:
    """Bars: tok/s of each row relative to all-on."""
    plt = _pyplot()
    if plt is None:
        return None
    rows = [r for r in abl["rows"] if r.get("ratio") is not None]
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(rows) + 1.5))
    names = [r["label"] for r in rows]
    vals = [r["ratio"] for r in rows]
    colors = ["#4c72b0" if r["label"] == "all on" else ("#dd8452" if r.get("approximation") else "#55a868")
              for r in rows]
    ax.barh(names, vals, color=colors)
    ax.axvline(1.0, color="k", lw=0.8)
    ax.invert_yaxis()
    ax.set_xlabel("output tok/s relative to all switches on")
    ax.set_title(f"Ablation, {abl['workload']} on {abl['model']} ({abl['device']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_sweep(sweep: dict, path: str) -> str | None:
    """The W3 concurrency sweep: output tok/s, and TTFT / TPOT p50 and p99, against concurrency."""
    plt = _pyplot()
    if plt is None:
        return None
    levels = [lv for lv in sweep["levels"] if not lv.get("error")]
    c = [lv["concurrency"] for lv in levels]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    axes[0].plot(c, [lv["output_throughput"] for lv in levels], "o-")
    axes[0].set_ylabel("output tok/s")
    for ax, metric in ((axes[1], "ttft_ms"), (axes[2], "tpot_ms")):
        ax.plot(c, [lv[metric]["p50"] for lv in levels], "o-", label="p50")
        ax.plot(c, [lv[metric]["p99"] for lv in levels], "s--", label="p99")
        ax.set_ylabel(metric.replace("_ms", " (ms)").upper())
        ax.legend()
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
    fig.suptitle(f"W3 closed loop against {sweep['url']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_runs(runs: list[dict], path: str) -> str | None:
    """Decode tok/s per workload, nanoserve beside each HF configuration."""
    plt = _pyplot()
    if plt is None or not runs:
        return None
    names = sorted({r["workload"] for r in runs})
    series = sorted({(r["engine"], r["mode"]) for r in runs})
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(names) * len(series)), 3.8))
    width = 0.8 / len(series)
    for k, (eng, mode) in enumerate(series):
        vals = []
        for n in names:
            r = next((x for x in runs if x["workload"] == n and x["engine"] == eng and x["mode"] == mode), None)
            vals.append(r["output_tok_s"] if r else 0.0)
        ax.bar([i + k * width for i in range(len(names))], vals, width, label=f"{eng} {mode}")
    ax.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(names))], names)
    ax.set_ylabel("output tok/s")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def formats_table(runs_by_format: dict[str, list[dict]], weight_gib: dict[str, float | None]) -> str | None:
    """The same workloads in several weight formats (bf16, mxfp8), side by side: TPOT, output tok/s, TTFT and
    the floor each format's bytes give, plus the GPU memory its weights take."""
    formats = [f for f, runs in runs_by_format.items() if runs]
    if len(formats) < 2:
        return None
    by = {f: {r["workload"]: r for r in runs_by_format[f] if r["mode"] == "default"} for f in formats}
    base = formats[0]
    rows = []
    for wl in by[base]:
        for f in formats:
            r = by[f].get(wl)
            if r is None:
                continue
            b = by[base][wl]
            rows.append([wl, f, fmt_ms(r["tpot_ms"]["mean"]), fmt_ms(r["perf"].get("floor_tpot_ms")), r["output_tok_s"],
                         r["perf"].get("floor", {}).get("output_tok_s"), r["ttft_ms"]["mean"],
                         b["output_tok_s"] and r["output_tok_s"] / b["output_tok_s"]])
    rows += [["weights (GiB)", f, weight_gib.get(f), None, None, None, None, None] for f in formats]
    return table(("workload", "weights", "TPOT ms", "floor TPOT ms", "output tok/s", "floor tok/s", "TTFT ms",
                  f"tok/s vs {base}"), rows, "Weight formats side by side (floors from the bytes each format reads)")
