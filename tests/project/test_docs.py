"""The docs cannot go stale silently.

- docs/architecture.md's switch table is generated from the switch declarations in nanoserve.config.Optimizations
  (default, exact or approximation, layer, module, reference path) and from the code that reads each switch. The
  test regenerates it and compares; after adding or changing a switch, refresh the table with

      python tests/project/test_docs.py --write

- docs/walkthrough.md quotes the output of `python -m nanoserve.walkthrough`. The test reruns the walkthrough and
  checks that every quoted scheduler and block-manager line (the integer facts: admissions, chunks, prefix hits,
  preemptions, allocations, frees, evictions, batches, block tables) still appears in the real output.

- docs/results.md, the page of current numbers, is generated from the runs of record in results/; after adding a
  record, refresh it with

      python -m nanoserve.bench --report results/ > docs/results.md

  The explanation pages name no dated run but link its entry there, and every record is cited by some doc.
"""

from __future__ import annotations

import ast
import io
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
WALKTHROUGH = ROOT / "docs" / "walkthrough.md"
BEGIN = "<!-- switch-table:begin (generated: python tests/project/test_docs.py --write) -->"
END = "<!-- switch-table:end -->"


# where a switch changes what runs (not bench/, server/)
DATA_PATH = ("server", "engine", "executor", "runner", "spec_decode", "model", "kernels", "distributed")


def readers(switch: str) -> list[str]:
    """The data-path modules whose code reads the switch (`opts.<switch>` or `optimizations.<switch>`)."""
    pattern = re.compile(rf"\b(?:opts|optimizations)\.{switch}\b")
    found = []
    for package in DATA_PATH:
        for path in sorted((ROOT / "nanoserve" / package).rglob("*.py")):
            if pattern.search(path.read_text()):
                found.append(path.relative_to(ROOT / "nanoserve").as_posix())
    return sorted(found)


def switch_table(opts_cls=None) -> str:
    """The table, from the switch declarations of `opts_cls` (default: nanoserve.config.Optimizations)."""
    from nanoserve.config import Optimizations

    rows = ["| switch | default | exact | layer | module | what it does | off: the reference path | read in |",
            "|---|---|---|---|---|---|---|---|"]
    for sw in (opts_cls or Optimizations).switches():
        where = ", ".join(f"`{r}`" for r in readers(sw.name)) or "not read yet"
        rows.append(f"| `{sw.name}` | {'on' if sw.default else 'off'} | "
                    f"{'yes' if sw.exact else 'no: approximation'} | {sw.layer} | "
                    f"[`{sw.module}`](../nanoserve/{sw.module}) | {sw.does.replace('|', '/')} | "
                    f"{sw.reference.replace('|', '/')} | {where} |")
    return "\n".join(rows)


def documented_table(text: str) -> str:
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[start:end].strip()


def write_switch_table() -> None:
    text = ARCHITECTURE.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    ARCHITECTURE.write_text(text[:start] + "\n" + switch_table() + "\n" + text[end:])


# -- tests ------------------------------------------------------------------------------------------------------
def test_every_switch_declares_an_existing_module():
    from nanoserve.config import Optimizations

    for sw in Optimizations.switches():
        assert (ROOT / "nanoserve" / sw.module).is_file(), f"{sw.name}: its declaration names {sw.module}, which " \
                                                           f"does not exist"
        assert sw.does and sw.reference, f"{sw.name}: say what it does and what runs when it is off"


def test_architecture_switch_table_is_current():
    from nanoserve.config import Optimizations

    table = documented_table(ARCHITECTURE.read_text())
    for name in Optimizations.names():
        assert f"| `{name}` |" in table, f"docs/architecture.md's switch table lacks {name}"
    assert table == switch_table(), ("docs/architecture.md's switch table is out of date: run "
                                     "`python tests/project/test_docs.py --write`")


OUTSIDE_REFERENCES = re.compile(
    r"\.\./shared|/work/|(?-i:DESIGN\.md|BENCHMARKS\.md)|m3_spec|the issue asks|steering|\bengineers?\b",
    re.IGNORECASE)
"""What a reader of this repository cannot follow: files outside it, and talk of how it was made."""


def test_docs_name_only_what_is_in_this_repository():
    """docs/*.md and README.md link and name only files of this repository, and speak to its users; the code,
    scripts and tests name no outside file either."""
    assert OUTSIDE_REFERENCES.search("the protocol of [it](../../shared/BENCHMARKS.md)")
    assert not OUTSIDE_REFERENCES.search("see docs/benchmarks.md")
    found = []
    code = [p for d in ("nanoserve", "scripts", "tests") for p in sorted((ROOT / d).rglob("*.py"))
            if p != Path(__file__).resolve()]
    for path in code + [p for d in ("scripts",) for p in sorted((ROOT / d).glob("*.sh"))]:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for m in OUTSIDE_REFERENCES.finditer(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {m.group(0)!r} in {line.strip()[:100]!r}")
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for m in OUTSIDE_REFERENCES.finditer(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {m.group(0)!r} in {line.strip()[:100]!r}")
            for target in re.findall(r"\]\(([^)#\s]+)", line):  # relative markdown links must resolve
                if "://" not in target and not (path.parent / target).resolve().is_relative_to(ROOT):
                    found.append(f"{path.relative_to(ROOT)}:{n}: link {target} leaves the repository")
                elif "://" not in target and not (path.parent / target).exists():
                    found.append(f"{path.relative_to(ROOT)}:{n}: link {target} does not exist")
    assert not found, "\n".join(found)


SCRIPT_CITATION = re.compile(r"scripts/([\w.-]+\.(?:py|sh))")
"""A script named by its path. Beside `in git at <commit>` (on its line or the next) it cites a removed script as
the provenance of a number."""


def test_scripts_are_documented_tools():
    """scripts/ holds tools: each says what it is for and how to run it (a module docstring naming its command,
    or a shell header comment that does)."""
    for path in sorted((ROOT / "scripts").iterdir()):
        text = path.read_text()
        run = f"scripts/{path.name}"
        if path.suffix == ".py":
            doc = ast.get_docstring(ast.parse(text)) or ""
            assert doc and run in doc, f"{run}: its docstring must say what it is for and how to run it ({run})"
        elif path.suffix == ".sh":
            header = "".join(line for line in text.splitlines(True)[1:] if line.startswith("#")).split("\nset ")[0]
            assert run in header, f"{run}: its header comment must say how to run it ({run})"
        else:
            raise AssertionError(f"{run}: scripts/ holds Python and shell tools only")


def test_every_cited_script_exists():
    """The docs, the README, the code and the tests name only scripts that exist (or say at which commit one that
    was removed can be read)."""
    texts = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    texts += [p for d in ("nanoserve", "scripts", "tests") for p in sorted((ROOT / d).rglob("*.py"))]
    texts += sorted((ROOT / "scripts").glob("*.sh"))
    texts.remove(ROOT / "docs" / "results.md")  # it quotes each record's command as run, at the record's commit
    missing = []
    for path in texts:
        lines = path.read_text().splitlines()
        for n, line in enumerate(lines):
            for name in SCRIPT_CITATION.findall(line):
                near = " ".join(lines[max(0, n - 1):n + 2])  # a citation may wrap onto the next line
                if not (ROOT / "scripts" / name).exists() and "in git at" not in near:
                    missing.append(f"{path.relative_to(ROOT)}:{n + 1}: scripts/{name}")
    assert not missing, "cited scripts that do not exist:\n" + "\n".join(missing)


EXPLANATIONS = ("docs/benchmarks.md", "docs/optimizations.md", "docs/mxfp8.md")
"""The pages that say how nanoserve works and how it is measured; the numbers are on docs/results.md."""


def test_explanations_keep_no_dated_runs_and_numbers_live_on_the_results_page():
    """docs/benchmarks.md has the targets, the method and how to reproduce, in that order; it, docs/optimizations.md
    and docs/mxfp8.md name no dated run (a run is cited by a link to its entry on docs/results.md), and no page
    keeps dated sections or speaks of sessions: history is in git."""
    bench = (ROOT / "docs" / "benchmarks.md").read_text()
    assert bench.index("## Targets") < bench.index("## Method") < bench.index("## How to reproduce")
    for name in EXPLANATIONS:
        for n, line in enumerate((ROOT / name).read_text().splitlines(), 1):
            outside_links = re.sub(r"\]\([^)]*\)", "]", line)
            assert not re.search(r"\d{4}-\d{2}-\d{2}", outside_links), \
                f"{name}:{n}: a dated run belongs on docs/results.md (link its entry): {line}"
    for name in (*EXPLANATIONS, "docs/results.md", "README.md"):
        for n, line in enumerate((ROOT / name).read_text().splitlines(), 1):
            assert not re.match(r"#+ .*\d{4}-\d{2}-\d{2}", line), f"{name}:{n}: a dated section: {line}"
            assert not re.search(r"\bsessions?\b", line, re.I), f"{name}:{n}: speaks of a session: {line}"


def test_the_bench_checks_the_targets_the_docs_state():
    """The targets table the bench prints (bench/report.py TARGETS) holds the goals of docs/benchmarks.md's."""
    from nanoserve.bench.report import TARGETS

    docs = {"W1 TPOT (ms)": "W1 bf16 TPOT", "W2 output tok/s": "W2 output tok/s",
            "W4 TPOT 128k / 1k": "W4 TPOT at 128k / TPOT at 1k", "W4 TTFT at 128k (s)": "W4 TTFT at 128k",
            "W2J / W2 output tok/s": "W2J / W2"}
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    table = text[text.index("## Targets"):text.index("## Method")]
    goals = {cells[0]: cells[1] for cells in ([c.strip() for c in line.strip("|").split("|")]
                                              for line in table.splitlines() if line.startswith("| "))}
    assert set(TARGETS) == set(docs)
    for name, (op, goal) in TARGETS.items():
        stated = re.fullmatch(r"(<=|>=) ([\d,.]+)(?: \w+)?", goals[docs[name]])
        assert stated and stated.group(1) == op and float(stated.group(2).replace(",", "")) == goal, (name, goals)


def test_results_page_is_what_the_records_render():
    """docs/results.md is generated: `python -m nanoserve.bench --report results/ > docs/results.md`."""
    from nanoserve.bench.results_page import render

    assert (ROOT / "docs" / "results.md").read_text() == render(str(ROOT / "results")), \
        "docs/results.md is not what the records render: run `python -m nanoserve.bench --report results/ > " \
        "docs/results.md`"


RECORD_CITATION = re.compile(r"(?<![\w-])(\d{4}-\d{2}-\d{2}_[\w.-]+?)\.json|results\.md#(\d{4}-\d{2}-\d{2}_[\w.-]+)")
"""A record named by its file, or its entry on docs/results.md linked by its anchor."""


def test_every_record_is_cited_and_every_citation_is_a_record():
    """Each record in results/ is cited by the README or a doc other than the generated page (a record nobody cites
    is removed: git keeps it), and every record or results.md entry the README, the docs and the code cite
    exists."""
    records = {p.stem for p in (ROOT / "results").glob("*.json")}
    texts = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    texts += [p for d in ("nanoserve", "scripts", "studies") for p in sorted((ROOT / d).rglob("*.py"))]
    cited, missing = set(), []
    for path in texts:
        if path.name == "results.md":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for m in RECORD_CITATION.finditer(line):
                name = m.group(1) or m.group(2)
                cited.add(name)
                if name not in records:
                    missing.append(f"{path.relative_to(ROOT)}:{n}: {name}")
    assert not missing, "cited records that are not in results/:\n" + "\n".join(missing)
    assert not records - cited, f"records no doc cites (remove them, git keeps them): {sorted(records - cited)}"


def test_readme_measured_numbers_are_on_the_results_page():
    """Every number of the README's Measured table is on docs/results.md, where its run's entry shows it."""
    from tests.project.test_readme import MEASURED_NUMBER

    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Measured"):]
    section = section[:section.index("\n## ", 1)]
    page = (ROOT / "docs" / "results.md").read_text()
    missing = []
    for row in (line for line in section.splitlines() if line.startswith("| W")):
        cells = [c.strip() for c in row.strip("|").split("|")]
        for cell in cells[1:-1]:
            for token in MEASURED_NUMBER.findall(cell):
                if not re.search(rf"(?<![\d.,]){re.escape(token)}(?![\d])", page):
                    missing.append(f"{token} ({cells[0]})")
    assert not missing, "README numbers not on docs/results.md: " + ", ".join(missing)


def test_every_result_of_record_names_its_run():
    """results/*.json: each file is one run's record, named <date>_<commit(s)>_<what>.json, whose meta gives the
    date, the commit(s), the card and the command."""
    import json

    files = sorted((ROOT / "results").glob("*.json"))
    assert files, "results/ holds no record"
    for path in files:
        meta = json.loads(path.read_text())["meta"]
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}_[\w.-]+\.json", path.name), path.name
        assert str(meta["date"]).startswith(path.name[:10]), path.name
        commits = [meta["commit"]] if "commit" in meta else meta.get("commits", [])
        assert meta.get("device") and meta.get("command") and commits, path.name
        assert all(str(c)[:7] in path.name for c in commits), f"{path.name}: its name lacks a commit of {commits}"


def test_walkthrough_doc_quotes_real_output():
    from nanoserve import walkthrough

    doc = WALKTHROUGH.read_text()
    blocks = re.findall(r"<!-- output: python -m nanoserve.walkthrough(.*?) -->\s*```text\n(.*?)```", doc, re.S)
    assert blocks, "docs/walkthrough.md quotes no walkthrough output"
    outputs: dict[str, str] = {}
    checked = 0
    for args, quoted in blocks:
        args = args.split()
        key = " ".join(args)
        if key not in outputs:
            out = io.StringIO()
            scenario = args[args.index("--scenario") + 1] if "--scenario" in args else "all"
            detail = "high" if "-v" in args else "low" if "-q" in args else "normal"
            walkthrough.run(scenario, detail, out=out)
            outputs[key] = out.getvalue()
        real = outputs[key]
        for line in quoted.splitlines():
            tag = re.match(r"^  \[(arrive|admit|prefix hit|chunk|preempt|allocate|free|evict|batch|waiting|tables"
                           r"|pool)\]", line)
            if tag or line.startswith("--- step"):
                assert line in real.splitlines(), f"docs/walkthrough.md quotes a line the walkthrough no longer " \
                                                  f"prints (python -m nanoserve.walkthrough {key}):\n{line}"
                checked += 1
    assert checked >= 10


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # run as a script from a checkout
    if sys.argv[1:] == ["--write"]:
        write_switch_table()
        print(f"wrote the switch table into {ARCHITECTURE.relative_to(ROOT)}")
    else:
        print(switch_table())
