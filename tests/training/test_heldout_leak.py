"""The held-out set `python -m nanoserve.bench --quality` grades (nanoserve/bench/heldout/) shares nothing with the
training generator (training/): no tool name the training chats can offer, no request the training templates can
write (no 6-word run in common, no request equal up to its numbers), no name or town from the training word lists,
no library function whose docstring the training passages can quote, and no training module reads the folder."""

from __future__ import annotations

import pathlib
import random
import re

import pytest

from nanoserve.bench.heldout import build, load_requests
from training import chats, passages, requests

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def heldout():
    return load_requests()


@pytest.fixture(scope="module")
def training_texts():
    """What the training generator writes as user messages: 1,000 chats of every kind (retrieval short)."""
    texts = []
    for kind in sorted(chats.KINDS):
        rng = random.Random(1234)
        for _ in range(1000 if kind != "retrieval" else 40):
            kw = {"n_chars": 1500} if kind == "retrieval" else {}
            chat = chats.sample(rng, kind, **kw)
            texts += [m["content"] for m in chat.messages if m["role"] == "user"]
    return texts


def words(text: str) -> list[str]:
    """The text's words lower-cased, with the values a template fills in masked as "V": numbers and names (a capital
    letter not starting a sentence: people, places, tickers, months), a run of them ("13 March 2027") as one."""
    out, start = [], True
    for m in re.finditer(r"[A-Za-z']+|\d+|[.?!:\n]", text):
        w = m.group()
        if w in ".?!:\n":
            start = True
            continue
        w = "V" if w.isdigit() or w[0].isupper() and not start or w in ("am", "pm") and out[-1:] == ["V"] \
            else w.lower()
        if not (w == "V" and out and out[-1] == "V"):  # a run of them ("13 March 2027", "7 pm") is one value
            out.append(w)
        start = False
    return out


def masked(text: str) -> str:
    return " ".join(words(text))


def procedural_name(name: str) -> bool:
    """Whether training/chats.py's make_tool can write this name: verb_[adjective_]noun[_noun...]."""
    v, n, a = (f"(?:{'|'.join(map(re.escape, xs))})" for xs in (chats.VERBS, chats.NOUNS, chats.ADJECTIVES))
    return re.fullmatch(f"{v}_(?:{a}_)?{n}(?:_{n})*", name) is not None


def test_no_training_tool_name_is_offered(heldout):
    names = {t["function"]["name"] for r in heldout for t in r.get("tools") or []}
    assert len(names) >= 25
    assert not names & requests.family_names()
    assert not names & set(chats.WEATHER_NAMES)
    assert not [n for n in names if procedural_name(n)]
    assert procedural_name("book_hotel") and procedural_name("get_red_forecast")  # the check can fire


def test_no_training_template_writes_a_heldout_request(heldout, training_texts):
    def shingles(text: str, n: int = 6) -> set[tuple[str, ...]]:
        w = words(text)
        return {tuple(w[i:i + n]) for i in range(len(w) - n + 1)}

    trained = set().union(*(shingles(t) for t in training_texts))
    trained_masked = {masked(t) for t in training_texts}
    for r in heldout:
        request = r["request"]
        common = shingles(request) & trained
        assert not common, (request, sorted(common)[:3])
        assert masked(request) not in trained_masked, request
    # the check can fire: a training request is found in the training texts
    assert shingles(training_texts[0]) <= trained or len(words(training_texts[0])) < 6


def test_names_and_places_are_the_heldout_generators_own():
    assert not set(build.TOWNS) & set(chats.CITIES)
    assert not set(build.PEOPLE) & set(chats.FIRST_NAMES)
    assert not {w.lower() for w, _ in build.GLOSSARY} & {w.lower() for w, _ in chats.GLOSSES}


def test_passage_functions_are_in_modules_the_training_passages_leave_out():
    import importlib

    for q in build.DOC_FUNCTIONS:
        parts = q.split(".")
        for i in range(len(parts) - 1, 0, -1):  # the longest prefix that is a module
            try:
                obj = importlib.import_module(".".join(parts[:i]))
                break
            except ImportError:
                continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        assert passages.reserved_module(obj.__module__), q
    assert not passages.reserved_module("collections")  # the rule keeps most of the library for training


def test_no_training_module_reads_the_heldout_folder():
    import ast

    for path in (ROOT / "training").glob("*.py"):
        tree = ast.parse(path.read_text())
        docstrings = {id(n.body[0].value) for n in ast.walk(tree) if isinstance(
            n, (ast.Module, ast.FunctionDef, ast.ClassDef)) and n.body and isinstance(n.body[0], ast.Expr)}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                assert not any("bench" in n for n in names), (path, names)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                assert "heldout/" not in node.value and "bench.heldout" not in node.value, (path, node.value)
