"""`python -m nanoserve.bench --report results/ > docs/results.md`: the page of current numbers, rendered from the
runs of record in `results/`.

A run of record is one JSON file, `results/<date>_<commit(s)>_<what>.json`, whose `meta` gives the run's date,
commit(s), card and command, and whose other keys hold what the run measured: a bench `--out` directory's
results.json, or the parts of one or several such runs that the docs quote. The page has one section per card
(the H200, the H100, the CPU), the newest run first, and one entry per run: a heading with its date, card, commit
and command, then its numbers - a table per part, as the tools print them where the record kept their printed
table, else as the record holds them:

- a part with the bench's own `table` text (an ablation, a profile, a micro-benchmark) is shown as that text;
- a bench results.json (`runs`, `ablations`, `profiles`, ...) as the bench prints it;
- `{"columns": [...], "rows": [[...]]}` and a list of objects as a table, an object of numbers as a two-column
  table, and anything nested as a part of its own, under its key.

Lists longer than MAX_ROWS rows show their first MAX_ROWS (the record has the rest), and the per-switch or
per-sequence detail a bench result carries beside its numbers (`switches`, `token_ids`, tracebacks) is left out.
The docs explain each optimization and the method and link here for the numbers; a test checks that this page is
what the command renders from the records.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

CARDS = (("NVIDIA H200", re.compile(r"H200")), ("NVIDIA H100 80GB HBM3", re.compile(r"H100")),
         ("CPU", re.compile(r"\bCPU\b|\bcpu\b")))
"""The cards the page has a section for, in its order, each with how a record's meta["device"] names it."""
MAX_ROWS = 40
"""Rows of one table shown on the page; the record holds the rest."""
MAX_COLUMNS = 12
"""Objects whose cells come to more columns than this are shown one part each, not as one table."""
LEFT_OUT = {"switches", "switch_notes", "token_ids", "traceback", "description", "output_tok_s_runs", "hip",
            "host", "python", "device_type"}
"""Keys whose values are per-row detail, not numbers a reader looks up."""
BENCH_PARTS = ("runs", "ablations", "profiles", "prefill_profiles", "serve")
"""The keys of a bench results.json (bench/report.py Results)."""
FILE_NAME = re.compile(r"(\d{4}-\d{2}-\d{2})_(.+)\.json")


@dataclass
class Record:
    """One run of record: its file name (without .json), its meta and what it measured."""

    name: str
    meta: dict
    parts: dict

    @property
    def card(self) -> str:
        return card_of(str(self.meta.get("device", "")))

    @property
    def what(self) -> str:
        """What the run measured: its file name after the date and commit(s)."""
        words = FILE_NAME.fullmatch(self.name + ".json").group(2).split("_")
        while len(words) > 1 and re.fullmatch(r"[0-9a-f]{7,40}(-[0-9a-f]{7,40})*", words[0]):
            words.pop(0)
        return "_".join(words)

    @property
    def anchor(self) -> str:
        """The id of its entry on the page (docs link to results.md#<anchor>)."""
        return self.name


def card_of(device: str) -> str:
    """The card a record's device line names first (a record run on several machines names its main one first)."""
    found = [(m.start(), card) for card, pattern in CARDS if (m := pattern.search(device))]
    return min(found)[1] if found else "other"


def load(results_dir: str) -> list[Record]:
    """Every record in `results_dir`, by file name; a file that is no record (no meta, a bad name) is an error."""
    records = []
    for file in sorted(os.listdir(results_dir)):
        if not file.endswith(".json"):
            continue
        if not FILE_NAME.fullmatch(file):
            raise ValueError(f"{file}: a record is named <date>_<commit(s)>_<what>.json")
        with open(os.path.join(results_dir, file)) as f:
            data = json.load(f)
        if not isinstance(data, dict) or not isinstance(data.get("meta"), dict):
            raise ValueError(f"{file}: a record is a JSON object with a meta object")
        records.append(Record(file.removesuffix(".json"), data["meta"], {k: v for k, v in data.items()
                                                                          if k != "meta"}))
    return records


# -- cells and tables ---------------------------------------------------------------------------------------------


def cell(value: Any) -> str:
    """A table cell: numbers as measured (floats of 100 or more to one decimal, smaller ones to four significant
    digits, thousands separated), text with its pipes escaped."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        if value == int(value) and abs(value) < 1e15:
            return f"{int(value):,}" if abs(value) >= 1000 else f"{value:g}"
        if abs(value) >= 100:
            return f"{value:,.1f}"
        return f"{value:.4g}"
    if isinstance(value, list) and all(not isinstance(v, (dict, list)) for v in value):
        return ", ".join(cell(v) for v in value)
    text = str(value) if not isinstance(value, (dict, list)) else json.dumps(value)
    return text.replace("|", "\\|").replace("\n", " ")


def markdown_table(headers: list[str], rows: list[list[Any]]) -> list[str]:
    shown = rows[:MAX_ROWS]
    out = ["| " + " | ".join(cell(h) for h in headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(cell(c) for c in row) + " |" for row in shown]
    if len(rows) > len(shown):
        out.append(f"\n({len(rows) - len(shown)} rows more in the record)")
    return out


def scalar(value: Any) -> bool:
    return not isinstance(value, (dict, list)) or (isinstance(value, list) and len(value) <= 8 and
                                                    all(not isinstance(v, (dict, list)) for v in value))


def flat(row: dict, prefix: str = "") -> dict:
    """A row's cells: its scalars, and those of nested objects at any depth as `key.sub`; lists of objects are
    left out (they are parts of their own)."""
    out = {}
    for k, v in row.items():
        if k in LEFT_OUT:
            continue
        if scalar(v):
            out[prefix + k] = v
        elif isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
    return out


def object_rows(items: list[dict], first: list[Any] | None = None) -> tuple[list[str], list[list[Any]]]:
    """Headers and rows of a table of objects (`first`: a leading column of the objects' keys)."""
    rows = [flat(r) for r in items]
    headers: list[str] = []
    for r in rows:
        headers += [k for k in r if k not in headers]
    cells = [[r.get(h) for h in headers] for r in rows]
    if first is not None:
        return [""] + headers, [[k] + c for k, c in zip(first, cells)]
    return headers, cells


def tabular(items: list[dict]) -> bool:
    """Whether objects make one table: every one has cells, and together at most MAX_COLUMNS columns."""
    keys: set[str] = set()
    for item in items:
        cells = flat(item)
        if not cells:
            return False
        keys |= set(cells)
    return len(keys) <= MAX_COLUMNS


# -- parts --------------------------------------------------------------------------------------------------------


def code(text: str) -> list[str]:
    return ["```text", *text.rstrip("\n").splitlines(), "```"]


def is_bench_results(value: Any) -> bool:
    return isinstance(value, dict) and "runs" in value and isinstance(value.get("meta"), dict) and \
        any(k in value for k in BENCH_PARTS[1:])


def bench_results(value: dict) -> list[str]:
    """A bench results.json as the bench printed it: the runs, then each ablation, profile and W3 sweep."""
    from nanoserve.bench.ablation import ablation_table
    from nanoserve.bench.report import runs_table
    from nanoserve.bench.serve import sweep_table

    meta = value["meta"]
    commit = str(meta.get("commit", "?"))
    commit = commit[:12] + ("-dirty" if commit.endswith("-dirty") else "")  # uncommitted changes in its tree
    out = [f"{meta.get('model', '?')} on {meta.get('device', '?')}, {meta.get('date', '?')}, commit {commit}"
           + (f", {meta['quantization']}" if meta.get("quantization") else "") + ":", ""]
    texts = []
    if value["runs"]:
        texts.append(runs_table(value["runs"]))
    texts += [a.get("table") or ablation_table(a) for a in value.get("ablations", []) if a.get("rows")]
    texts += [p["table"] for p in value.get("profiles", []) + value.get("prefill_profiles", []) if p.get("table")]
    texts += [sweep_table(s) for s in value.get("serve", []) if s.get("levels")]
    texts += [m["table"] for m in (value.get("micro") or {}).values() if isinstance(m, dict) and m.get("table")]
    texts += [v["table"] for k, v in value.items() if k not in (*BENCH_PARTS, "micro") and isinstance(v, dict)
              and isinstance(v.get("table"), str)]  # another part's printed table (--mxfp8-accuracy's)
    for text in texts:
        out += code(text) + [""]
    if value.get("errors"):
        out += [f"errors: {'; '.join(e.get('part', '?') + ': ' + e.get('error', '?') for e in value['errors'])}",
                ""]
    return out


def part(key: str, value: Any, depth: int) -> list[str]:
    """One part of a record: a bold label, then its table(s) or text, nested parts below it."""
    label = [f"**{key}**", ""] if key else []
    if isinstance(value, dict) and isinstance(value.get("table"), str):
        return label + code(value["table"]) + [""]
    if isinstance(value, str) and "\n" in value:
        return label + code(value) + [""]
    if is_bench_results(value):
        return label + bench_results(value)
    if isinstance(value, dict) and isinstance(value.get("columns"), list) and isinstance(value.get("rows"), list):
        rest = {k: v for k, v in value.items() if k not in ("columns", "rows")}
        rows = [r if isinstance(r, list) else [r.get(c) for c in value["columns"]] for r in value["rows"]]
        return label + scalars(rest) + markdown_table(value["columns"], rows) + [""] + nested(rest, depth, key)
    if isinstance(value, list):
        if value and all(isinstance(v, dict) for v in value):
            if all(isinstance(v.get("table"), str) or is_bench_results(v) for v in value):
                return label + [line for v in value for line in part("", v, depth + 1)]
            headers, rows = object_rows(value)
            out = label + markdown_table(headers, rows) + [""] if headers else label
            for i, v in enumerate(value[:MAX_ROWS]):  # the lists of objects a row holds beyond its cells
                out += nested({k: x for k, x in v.items() if isinstance(x, list)}, depth, f"{key}[{i}]")
            return out
        return label + [cell(value), ""]
    if isinstance(value, dict):
        inner = {k: v for k, v in value.items() if isinstance(v, dict) and k not in LEFT_OUT}
        if len(inner) >= 2 and tabular(list(inner.values())):  # objects of the same kind: one row each
            headers, rows = object_rows(list(inner.values()), list(inner))
            out = label + scalars(value) + markdown_table(headers, rows) + [""]
            return out + nested({k: v for k, v in value.items() if isinstance(v, list)}, depth, key)
        return label + scalars(value) + nested(value, depth, key)
    return label + [cell(value), ""]


def scalars(value: dict) -> list[str]:
    """An object's numbers and short texts as one two-column table."""
    rows = [[k, v] for k, v in value.items() if scalar(v) and k not in LEFT_OUT]
    return markdown_table(["", ""], rows) + [""] if rows else []


def nested(value: dict, depth: int, prefix: str = "") -> list[str]:
    out = []
    for k, v in value.items():
        if scalar(v) or k in LEFT_OUT:
            continue
        name = f"{prefix} / {k}" if prefix else k
        if depth >= 6:
            out += [f"**{name}**: in the record", ""]
            continue
        out += part(name, v, depth + 1)
    return out


def commits(meta: dict) -> str:
    value = meta.get("commit") or meta.get("commits") or "?"
    if isinstance(value, dict):
        value = list(value)
    return ", ".join(f"`{c}`" for c in value) if isinstance(value, list) else f"`{value}`"


def command(meta: dict) -> list[str]:
    value = meta.get("command", "")
    if isinstance(value, dict):
        value = [f"{k}: {c}" for k, cs in value.items() for c in (cs if isinstance(cs, list) else [cs])]
    lines = value if isinstance(value, list) else [value]
    return ["```bash", *(str(line) for line in lines), "```"]


def entry(record: Record) -> list[str]:
    meta = record.meta
    out = [f'<a id="{record.anchor}"></a>', "", f"### {record.what}", "",
           f"{meta.get('date', '?')} | {meta.get('device', '?')} | commit {commits(meta)} | record "
           f"[`results/{record.name}.json`](../results/{record.name}.json)", ""]
    out += command(meta) + [""]
    rest = {k: v for k, v in meta.items() if k not in ("date", "device", "commit", "commits", "command")}
    if rest:
        out += scalars(rest) + nested(rest, 1)
    for key, value in record.parts.items():
        out += part(key, value, 1)
    return out


HEADER = """# Results

Generated by `python -m nanoserve.bench --report results/ > docs/results.md` from the runs of record in
[`results/`](../results) - do not edit by hand; `tests/project/test_docs.py` checks that this page is what the command
renders. Each run's entry gives its date, card, commit and command, then its numbers as the tools printed them (or
as its record holds them). The other docs explain what each optimization does and how the numbers are measured
([optimizations.md](optimizations.md), [benchmarks.md](benchmarks.md), [mxfp8.md](mxfp8.md)) and link here.
Times on different cards are not comparable; ratios are measured within one run, on one card.
"""


def render(results_dir: str) -> str:
    records = load(results_dir)
    out = [HEADER]
    cards = [c for c, _ in CARDS] + ["other"]
    by_card = {c: sorted((r for r in records if r.card == c), key=lambda r: r.name, reverse=True) for c in cards}
    out += ["| card | runs |", "|---|---|"]
    out += [f"| [{c}](#{slug(c)}) | {len(rs)} |" for c, rs in by_card.items() if rs]
    out.append("")
    for card, rs in by_card.items():
        if not rs:
            continue
        out += [f"## {card}", ""]
        for r in rs:
            out += entry(r)
    while out and out[-1] == "":
        out.pop()
    return "\n".join(out) + "\n"


def slug(title: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def run(results_dir: str) -> int:
    """The CLI: print the page (2 when the directory holds a file that is no record)."""
    try:
        print(render(results_dir), end="")
    except (OSError, ValueError) as e:
        print(f"--report: {e}")
        return 2
    return 0
