"""The README opens with the two commands a user needs, and CI runs exactly the second one."""

from __future__ import annotations

import os
import re
import stat
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _read(*parts: str) -> str:
    with open(os.path.join(ROOT, *parts)) as f:
        return f.read()


def readme_commands() -> list[str]:
    """The lines of the README's first ```bash block."""
    match = re.search(r"^```bash\n(.*?)^```", _read("README.md"), flags=re.S | re.M)
    assert match, "README.md has no ```bash block"
    return [line for line in match.group(1).splitlines() if line.strip()]


def ci_commands() -> list[str]:
    """The lines of .ci/run that run something (no comments, shell options, cd, or the verdict)."""
    lines = []
    for line in _read(".ci", "run").splitlines():
        s = line.strip()
        if not s or s.startswith("#") or s.startswith(("set ", "cd ", "rc=", "case ", "esac")) or ")" in s[:3]:
            continue
        lines.append(s)
    return lines


def test_readme_starts_with_the_two_commands():
    text = _read("README.md")
    lines = [line for line in text.splitlines() if line.strip()]
    assert lines[0].startswith("# "), "the README starts with its title"
    assert lines[1] == "```bash", "then, before any prose, the commands"
    commands = readme_commands()
    assert len(commands) == 2, commands
    assert lines[2:4] == commands and lines[4] == "```"
    serve, test = commands
    assert "pip install" in serve and "python -m nanoserve.server" in serve
    assert "pip install" in test and '".[test]"' in test and "python -m pytest tests" in test


def test_ci_runs_exactly_the_readme_test_command():
    test_command = readme_commands()[1]
    assert ci_commands() == [test_command]
    assert test_command in _read(".ci", "run").splitlines()


def test_ci_script_is_executable_and_valid_bash():
    path = os.path.join(ROOT, ".ci", "run")
    assert os.stat(path).st_mode & stat.S_IXUSR
    assert _read(".ci", "run").startswith("#!/usr/bin/env bash\n")
    assert subprocess.run(["bash", "-n", path], capture_output=True).returncode == 0


@pytest.mark.parametrize("pytest_rc, ci_rc, verdict", [(0, 0, "CI: all tests passed"),
                                                       (5, 1, "collected no tests"),
                                                       (1, 1, "the install or the tests failed")])
def test_ci_verdict_follows_pytest_exit_code(tmp_path, pytest_rc, ci_rc, verdict):
    """.ci/run with stand-in `pip` and `python` on PATH: pytest's exit code 5 (no tests collected) fails CI."""
    for name, rc in (("pip", 0), ("python", pytest_rc)):
        stub = tmp_path / name
        stub.write_text(f"#!/bin/sh\nexit {rc}\n")
        stub.chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    proc = subprocess.run(["bash", os.path.join(ROOT, ".ci", "run")], capture_output=True, text=True, env=env,
                          timeout=60)
    assert proc.returncode == ci_rc
    assert verdict in proc.stdout + proc.stderr


def test_test_extra_provides_what_the_suite_needs():
    """`pip install -e ".[test]"` must bring pytest, pytest-timeout (pyproject's addopts use --timeout) and, when
    the README's test command spreads the tests over processes (`-n`), pytest-xdist."""
    pyproject = _read("pyproject.toml")
    test_extra = re.search(r"^test = \[(.*?)\]", pyproject, flags=re.M | re.S)
    assert test_extra, "pyproject.toml has no [project.optional-dependencies] test extra"
    names = re.findall(r'"([A-Za-z0-9_.\-]+)', test_extra.group(1))
    assert "pytest" in names
    if "--timeout" in pyproject:
        assert "pytest-timeout" in names
    if " -n " in readme_commands()[1]:
        assert "pytest-xdist" in names


MEASURED_NUMBER = re.compile(r"(?<![\w.,])\d{1,3}(?:,\d{3})+(?:\.\d+)?(?![\w])|(?<![\w.,])\d+(?:\.\d+)?(?![\w.,])")
"""A measured number in a table cell: 1.447, 6,419, 226 - not the digits of a name (W4, bf16, p99, 16k-token)."""


def _json_numbers(value) -> set[float]:
    if isinstance(value, bool):
        return set()
    if isinstance(value, (int, float)):
        return {float(value)}
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list):
        return set().union(*(_json_numbers(v) for v in value)) if value else set()
    return set()


def test_readme_measured_numbers_are_the_records_and_the_docs():
    """Every number of the README's Measured table is in the results/ JSON file its row names (the run of record)
    and is quoted as written in docs/results.md: the README, the records and the docs cannot disagree."""
    import json

    text = _read("README.md")
    section = text[text.index("## Measured"):]
    section = section[:section.index("\n## ", 1)]
    rows = [line for line in section.splitlines() if line.startswith("| W")]
    assert len(rows) >= 6, "the Measured table lost its rows"
    docs = _read("docs", "results.md")
    missing = []
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        record = re.fullmatch(r"`(\S+\.json)`", cells[-1])
        assert record, f"the row names no results/ file: {row}"
        numbers = _json_numbers(json.loads(_read("results", record.group(1))))
        for cell in cells[1:-1]:
            for token in MEASURED_NUMBER.findall(cell):
                if float(token.replace(",", "")) not in numbers:
                    missing.append(f"{token} ({cells[0]}) is not in results/{record.group(1)}")
                if not re.search(rf"(?<![\d.,]){re.escape(token)}(?![\d])", docs):
                    missing.append(f"{token} ({cells[0]}) is not quoted in docs/results.md")
    assert not missing, "\n".join(missing)


def test_readme_layout_block_matches_the_tree():
    """Every path the README's layout block names exists, and every package under nanoserve/ and every top-level
    folder of the repository is named there."""
    block = re.search(r"^## Layout\n\n```\n(.*?)^```", _read("README.md"), flags=re.S | re.M)
    assert block, "README.md has no layout block"
    named = [line.split()[0] for line in block.group(1).splitlines() if line and not line.startswith(" ")]
    missing = [p for p in named if not os.path.exists(os.path.join(ROOT, p))]
    assert not missing, f"the layout block names paths that do not exist: {missing}"
    packages = sorted(f"nanoserve/{d}/" for d in os.listdir(os.path.join(ROOT, "nanoserve"))
                      if os.path.isfile(os.path.join(ROOT, "nanoserve", d, "__init__.py")))
    folders = [f"{d}/" for d in ("training", "scripts", "studies", "tests") if os.path.isdir(os.path.join(ROOT, d))]
    unnamed = [p for p in packages + folders if p not in named]
    assert not unnamed, f"the layout block does not name: {unnamed}"
