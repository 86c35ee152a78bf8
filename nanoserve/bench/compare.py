"""`python -m nanoserve.bench --compare BASE NEW`: two benchmark runs side by side, run by run.

A performance change is shown by the same benchmark run before and after it on one machine (a baseline commit and
the new one, in one device session). Each side is a `results.json` or a bench `--out` directory; a directory is
searched for every `results.json` below it, so the per-format folders of `--quantization bf16,mxfp8` (`bf16/`,
`mxfp8/`) pair up with the same folders of the other side. Runs pair by (folder, workload, engine, mode).

For each pair the table gives output tok/s, TTFT p50 and TPOT mean, each side's value and NEW / BASE (for tok/s
higher is better, for the latencies lower is), and a verdict: `level` when every ratio is within the tolerance
(default 3 %), else `faster` or `slower` by the metric furthest from level. The header names both sides' commit,
card and date, and says so when the cards differ: ratios across cards compare the cards too.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from nanoserve.bench.report import table

DEFAULT_TOLERANCE = 0.03
"""A ratio within 1 +- this counts as level: run-to-run noise of W1/W2 on one card is about 1 %."""

METRICS = (("out tok/s", "output_tok_s", True, "{:,.1f}"), ("TTFT p50 ms", "ttft_ms.p50", False, "{:,.1f}"),
           ("TPOT ms", "tpot_ms.mean", False, "{:.3f}"))
"""(column, field in a run, higher is better, format of a value)."""


@dataclass
class Side:
    """One side of the comparison: its runs keyed by (folder, workload, engine, mode) and each file's meta."""

    path: str
    runs: dict[tuple[str, str, str, str], dict]
    metas: dict[str, dict]


def _result_files(path: str) -> list[tuple[str, str]]:
    """[(folder relative to `path`, file)] of the results.json files `path` names or holds."""
    if os.path.isfile(path):
        return [("", path)]
    if not os.path.isdir(path):
        raise ValueError(f"{path}: no such file or directory")
    found = []
    for root, _dirs, files in os.walk(path):
        if "results.json" in files:
            rel = os.path.relpath(root, path)
            found.append(("" if rel == "." else rel, os.path.join(root, "results.json")))
    if not found:
        raise ValueError(f"{path}: no results.json in it (a bench --out directory or a results.json file)")
    return sorted(found)


def load_side(path: str) -> Side:
    runs, metas = {}, {}
    for folder, file in _result_files(path):
        try:
            with open(file) as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{file}: not a readable results.json ({e})") from e
        if not isinstance(data, dict) or not isinstance(data.get("runs"), list):
            raise ValueError(f"{file}: not a bench results.json (no 'runs' list)")
        metas[folder] = data.get("meta", {})
        for run in data["runs"]:
            key = (folder, run.get("workload", "?"), run.get("engine", "nanoserve"), run.get("mode", "default"))
            runs[key] = run
    return Side(path, runs, metas)


def _field(run: dict, dotted: str) -> float | None:
    value = run
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return float(value) if isinstance(value, (int, float)) else None


def _describe(side: Side) -> str:
    meta = next(iter(side.metas.values()), {})
    return (f"{side.path}: commit {str(meta.get('commit', '?'))[:12]}, {meta.get('device', '?')}, "
            f"{meta.get('date', '?')}")


def compare(base: Side, new: Side, tolerance: float = DEFAULT_TOLERANCE) -> dict:
    """The pairs' rows, a verdict per pair and the printable report."""
    rows, out = [], []
    for key in sorted(set(base.runs) | set(new.runs)):
        folder, workload, engine, mode = key
        name = "/".join(p for p in (folder, workload) if p) + ("" if mode == "default" else f" ({mode})")
        if engine != "nanoserve":
            name += f" [{engine}]"
        b, n = base.runs.get(key), new.runs.get(key)
        if b is None or n is None:
            verdict = "only in " + ("new" if b is None else "base")
            rows.append([name] + ["-"] * (3 * len(METRICS)) + [verdict])
            out.append({"run": name, "verdict": verdict})
            continue
        entry, cells, worst = {"run": name}, [name], 0.0
        for _label, field, higher_better, form in METRICS:
            bv, nv = _field(b, field), _field(n, field)
            ratio = nv / bv if bv and nv is not None else None
            entry[field] = {"base": bv, "new": nv, "ratio": ratio}
            cells += [("-" if v is None else form.format(v)) for v in (bv, nv)]
            cells.append(f"{ratio:.3f}x" if ratio is not None else "-")
            if ratio is not None:
                gain = ratio - 1.0 if higher_better else 1.0 - ratio  # > 0: the new run is better
                if abs(gain) > abs(worst):
                    worst = gain
        entry["verdict"] = "level" if abs(worst) <= tolerance else ("faster" if worst > 0 else "slower")
        cells.append(entry["verdict"])
        rows.append(cells)
        out.append(entry)
    header = ["run"] + [h for label, *_ in METRICS for h in (f"{label}: base", "new", "x")]
    described = {"base": _describe(base), "new": _describe(new)}
    lines = [f"base: {described['base']}", f"new:  {described['new']}"]
    devices = {m.get("device") for s in (base, new) for m in s.metas.values()}
    cards_differ = len(devices) > 1
    if cards_differ:
        lines.append(f"different cards ({', '.join(sorted(str(d) for d in devices))}): the ratios compare the "
                     "cards too; rerun the baseline on the new run's machine")
    lines.append(table(header + ["verdict"], rows, f"NEW / BASE per run (level: every ratio within "
                                                   f"{tolerance:.0%})"))
    return {**described, "tolerance": tolerance, "rows": out, "cards_differ": cards_differ,
            "table": "\n".join(lines)}


def run(base_path: str, new_path: str, tolerance: float = DEFAULT_TOLERANCE, out: str | None = None) -> int:
    """The CLI: print the comparison (and write compare.json under `out`); 2 on a path that holds no results."""
    try:
        res = compare(load_side(base_path), load_side(new_path), tolerance)
    except ValueError as e:
        print(f"--compare: {e}")
        return 2
    print(res["table"])
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "compare.json"), "w") as f:
            json.dump(res, f, indent=1)
    return 0
