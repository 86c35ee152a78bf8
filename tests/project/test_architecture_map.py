"""docs/architecture.md maps the whole package: every module under nanoserve/ is named there, so a reader who opens
any file can find what it owns and where it sits.

A module counts as named when the page gives its path relative to nanoserve/ (`engine/outputs.py`, with or
without the `nanoserve/` prefix), or lists it in a tree block - a fenced block whose lines open a folder (`bench/`)
and name the files under it, indented one step deeper, the folder's line or a file's line also naming files of
that folder in its description (`schema/   the bodies: chat.py, completions.py`). The generated switch table does
not count (a module read by a switch still needs its own line), and package `__init__.py` files are exempt: the
package is what is mapped.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "nanoserve"
ARCHITECTURE = ROOT / "docs" / "architecture.md"

TREE_ENTRY = re.compile(r"^( *)([\w.]+/|[\w.]+\.py)(?=\s|$)")


def tree_paths(text: str) -> set[str]:
    """The module paths the page's tree blocks list (relative to nanoserve/)."""
    found = set()
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M):
        stack: list[tuple[int, str]] = []  # (indent, folder) of the open folders
        for line in block.splitlines():
            entry = TREE_ENTRY.match(line)
            if not entry:
                continue
            indent, name = len(entry.group(1)), entry.group(2)
            while stack and stack[-1][0] >= indent:
                stack.pop()
            if name.endswith("/"):
                stack.append((indent, name))
            folder = "".join(f for _, f in stack)
            if name.endswith(".py"):
                found.add(folder + name)
            for named in re.findall(r"(?<![\w/])([\w]+\.py)\b", line[entry.end():]):
                found.add(folder + named)
    return found


def test_tree_paths_reads_nested_folders():
    block = "```\nserver/\n  app.py    the app\n  openai/   its API\n    schema/   bodies: chat.py, common.py\n" \
            "    routes.py\n  state.py\n```\n"
    assert tree_paths(block) == {"server/app.py", "server/openai/schema/chat.py", "server/openai/schema/common.py",
                                 "server/openai/routes.py", "server/state.py"}


def test_architecture_names_every_module():
    text = ARCHITECTURE.read_text()
    begin, end = "<!-- switch-table:begin", "<!-- switch-table:end -->"
    text = text[:text.index(begin)] + text[text.index(end):]
    listed = tree_paths(text)
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if path.name == "__init__.py" or rel in listed:
            continue
        if not re.search(rf"(?<![\w/]){re.escape(rel)}(?![\w])|nanoserve/{re.escape(rel)}(?![\w])", text):
            missing.append(rel)
    assert not missing, "docs/architecture.md does not name these modules (add them to the page's module map):\n" \
                        + "\n".join(missing)
