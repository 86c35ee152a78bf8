"""The measured tile tables, as data: one JSON file per kernel family in this folder, read once by `load`.

    attention.json  the "cuda" tiles of kernels/configs.py TABLES        {"tiles": {kernel: tile}}
    moe.json        the "cuda" tiles of the fused MoE (configs.MOE_TILES)  {"moe": {"H,I,E": {bucket: entry}}}
    fp8.json        the "cuda" tables of kernels/fp8_configs.py            {"linear": {"N,K": {bucket: entry}}, "moe"}
    gemv.json       the "cuda" tables of the one-row GEMV (configs.py)     {"16bit": {"N,K": tile}, "mxfp8"}

Each file holds its tables in the form its tuner writes them, so a tuner's output can replace it as it is:
`scripts/tune_moe.py --write-configs` writes moe.json itself, `scripts/tune_gemv.py --write FILE` adds to gemv.json
or to a file of its form, and `scripts/tune_fp8.py`'s fp8_tuned.json has fp8.json's form (with a "meta" of the run);
the last two are also the forms $NANOSERVE_GEMV_TUNED_CONFIG and $NANOSERVE_FP8_TUNED_CONFIG read. attention.json
has no tuner today (`python -m nanoserve.bench --micro attention` times its entries). Beside the tables, a
"provenance" list: one record per run behind the entries, with PROVENANCE_FIELDS (null where the run did not record
one) and whatever else that run recorded (times, the alternatives it beat, notes). A record's "entries" names the
entries it chose, in the tables' own nesting ({"moe": {"6144,3072,128": [4096, 16384]}}, {"16bit": ["9216,6144"]});
every entry has exactly one record (`add_record` keeps it so when a tuner replaces entries).

Only the "cuda" columns are here: they are measurements. The "hip" and "interpret" columns are rules (stated in
configs.py's docstring, checked by the compile gate) and stay in the Python tables beside the rules.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

FOLDER = Path(__file__).resolve().parent
PROVENANCE_FIELDS = ("entries", "card", "torch", "triton", "command", "commit", "date")
"""What every provenance record has: the entries it chose, the card, the torch and Triton versions, the command
line, the commit of the kernels timed and the date of the run."""


def path(name: str) -> Path:
    """The shipped file of a table family ("attention", "moe", "fp8", "gemv")."""
    return FOLDER / f"{name}.json"


@functools.cache
def load(name: str) -> dict:
    """The parsed JSON of the shipped file `name` (read once per process; callers copy what they change)."""
    with open(path(name)) as f:
        return json.load(f)


def entry_paths(entries: dict | list, prefix: tuple = ()) -> set[tuple[str, ...]]:
    """The entries a record (or a table) names, as key paths: {"moe": {"6144,3072,128": [1, 16]}} ->
    {("moe", "6144,3072,128", "1"), ("moe", "6144,3072,128", "16")}."""
    if isinstance(entries, dict):
        return {p for key, sub in entries.items() for p in entry_paths(sub, (*prefix, str(key)))}
    return {(*prefix, str(key)) for key in entries}


def _without(entries: dict | list, drop: set[tuple[str, ...]], prefix: tuple = ()) -> dict | list:
    if isinstance(entries, list):
        return [key for key in entries if (*prefix, str(key)) not in drop]
    kept = {key: _without(sub, drop, (*prefix, str(key))) for key, sub in entries.items()}
    return {key: sub for key, sub in kept.items() if sub}


def add_record(data: dict, record: dict) -> dict:
    """`data` (a table file's contents) with `record` appended to its provenance. The entries it names leave the
    older records (an entry has one origin); a record left without entries is dropped (git keeps its history)."""
    new = entry_paths(record["entries"])
    kept = []
    for old in data.get("provenance", []):
        entries = _without(old["entries"], new)
        if entries:
            kept.append({**old, "entries": entries})
    return {**data, "provenance": [*kept, record]}


def write(file: str | os.PathLike, data: dict) -> None:
    """Write a table file as the shipped ones are laid out (one entry per line)."""
    with open(file, "w") as f:
        f.write(dumps(data) + "\n")


LINE = 110
"""Values whose JSON fits this many columns (with the indent) are written on one line."""


def dumps(data: dict, indent: int = 0) -> str:
    """JSON with each table entry, tile or other short value on one line, longer objects one key per line."""
    pad = " " * (indent + 1)
    if indent and len(json.dumps(data)) + indent <= LINE:
        return json.dumps(data)
    if isinstance(data, list) and any(isinstance(v, dict) for v in data):
        return "[\n" + ",\n".join(pad + dumps(v, indent + 1) for v in data) + "\n" + " " * indent + "]"
    if not isinstance(data, dict) or not data:
        return json.dumps(data)
    items = [f"{pad}{json.dumps(str(k))}: {dumps(v, indent + 1)}" for k, v in data.items()]
    return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
