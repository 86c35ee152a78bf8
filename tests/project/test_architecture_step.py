"""docs/architecture.md shows the engine's step as the code has it, not an abridged copy: the block between its
engine-step markers is rendered from the source of LLMEngine's plain step (and OverlappedStep's), and the plain
path from schedule() to the outputs stays short enough to read at once.

    python tests/project/test_architecture_step.py --write     refresh the block after changing the step
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
BEGIN = "<!-- engine-step:begin (generated: python tests/project/test_architecture_step.py --write) -->"
END = "<!-- engine-step:end -->"
STEP = [("nanoserve/engine/llm_engine.py", "LLMEngine", ["step", "launch", "update", "append_tokens", "outputs"]),
        ("nanoserve/engine/overlap.py", "OverlappedStep", ["step"])]
MAX_PLAIN_STEP_LINES = 60
"""LLMEngine.step and the methods it calls for one plain step, without docstrings, comments or blank lines."""


def methods(path: str, cls: str, names: list[str]) -> list[tuple[str, list[str], int]]:
    """(name, its source lines, its docstring's line count) of each method, in the order asked."""
    lines = (ROOT / path).read_text().splitlines()
    tree = ast.parse("\n".join(lines))
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    found = {f.name: f for f in node.body if isinstance(f, ast.FunctionDef)}
    out = []
    for name in names:
        fn = found[name]
        doc = fn.body[0]
        doc_lines = doc.end_lineno - doc.lineno + 1 if ast.get_docstring(fn) is not None else 0
        out.append((name, lines[fn.lineno - 1: fn.end_lineno], doc_lines))
    return out


def render() -> str:
    parts = []
    for path, cls, names in STEP:
        parts.append(f"class {cls}:  # {path}")
        for _, source, _ in methods(path, cls, names):
            parts += source + [""]
    return BEGIN + "\n```python\n" + "\n".join(parts).rstrip() + "\n```\n" + END


def test_the_doc_shows_the_codes_own_step():
    text = DOC.read_text()
    assert BEGIN in text and END in text, f"docs/architecture.md lost its engine-step markers ({BEGIN})"
    shown = text[text.index(BEGIN): text.index(END) + len(END)]
    assert shown == render(), "docs/architecture.md's step differs from the code: run " \
                              "`python tests/project/test_architecture_step.py --write`"


def test_the_plain_step_reads_at_once():
    path, cls, names = STEP[0]
    counted = {}
    for name, source, doc_lines in methods(path, cls, names):
        code = [line for line in source if line.strip() and not line.strip().startswith("#")]
        counted[name] = len(code) - doc_lines
    assert sum(counted.values()) <= MAX_PLAIN_STEP_LINES, counted


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/project/test_architecture_step.py --write")
    text = DOC.read_text()
    DOC.write_text(text[: text.index(BEGIN)] + render() + text[text.index(END) + len(END):])
    print(f"wrote the engine step into {DOC.relative_to(ROOT)}")
