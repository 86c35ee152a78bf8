"""studies/ holds one-question studies apart from the tools: each says its question and how to run it, names
where its answer is, and nothing in nanoserve/ imports one."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STUDIES = sorted((ROOT / "studies").glob("*.py"))


def test_each_study_says_its_question_how_to_run_it_and_where_its_answer_is():
    assert STUDIES, "studies/ holds no study"
    index = (ROOT / "studies" / "README.md").read_text()
    for path in STUDIES:
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        assert doc.startswith("Study: ") and "?" in doc.split("\n\n")[0], f"{path.name}: start with its question"
        assert f"python -m studies.{path.stem}" in doc, f"{path.name}: say how to run it"
        answer = re.search(r"Its answer is (docs/\w+\.md)", doc)
        assert answer and (ROOT / answer.group(1)).is_file(), f"{path.name}: name the doc that holds its answer"
        assert f"`{path.name}`" in index, f"studies/README.md does not list {path.name}"


def test_nothing_in_the_package_imports_a_study():
    for path in sorted((ROOT / "nanoserve").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n == "studies" or n.startswith("studies.") for n in names), path
