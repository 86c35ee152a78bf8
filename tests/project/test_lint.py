"""The code passes ruff under the configuration in pyproject.toml ([tool.ruff]): pyflakes' errors (undefined names,
unused imports), pycodestyle's errors and warnings (lines over 120 characters, whitespace) and sorted imports, over
every Python file of the repository that git does not ignore."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ruff") is None,
                                reason="ruff is not installed (it comes with pip install -e '.[test]')")


def ruff(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    # --no-cache: a test run leaves no .ruff_cache behind in the checkout
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *args], cwd=ROOT, input=stdin,
                          capture_output=True, text=True, timeout=300)


def test_repository_passes_ruff():
    proc = ruff(".")
    assert proc.returncode == 0, f"`ruff check .` failed:\n{proc.stdout}{proc.stderr}"


def test_the_repository_configuration_is_the_one_applied():
    """A file checked under the repository's name gets pyproject.toml's rules: 120 columns, not ruff's default 88,
    and import sorting (not in ruff's default rule set)."""
    fits = "x = " + repr("a" * 114) + "\n"
    assert len(fits.rstrip("\n")) == 120
    proc = ruff("--stdin-filename", "nanoserve/example.py", "-", stdin=fits)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    bad = "import sys\nimport os\n\nx = " + repr("a" * 115) + "\nprint(os, sys, x)\n"
    proc = ruff("--stdin-filename", "nanoserve/example.py", "--output-format", "concise", "-", stdin=bad)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "I001" in proc.stdout and "E501" in proc.stdout, proc.stdout
