"""The held-out set `python -m nanoserve.bench --quality` grades: requests no training code has seen, frozen as data.

    requests.jsonl.gz    one request a line: `task`, OpenAI `messages`, `tools`, `thinking_mode`, `expected`, and
                         `request` (the words the generator wrote, without the passage or document they carry)
    documents.jsonl.gz   the long documents of the retrieval tasks, by `id`; a request's message holds DOCUMENT
                         where its document goes (several questions share one document, so a CPU prefills it once)
    text.jsonl.gz        the held-out text of m3-mini's four training corpora (perplexity), as shipped with the
                         weights this set was first measured on, so a later model is graded on the same text
    shipped.json         what the shipped weights measured on this set: the "before" column and the perplexity
                         a new model must not exceed
    pictures.jsonl.gz    picture questions for a model with a vision tower: `task`, `question`, `answer`, `image`
                         (a PNG data URL). Unlike the requests, these come from the training generator's picture
                         tasks, held out by seed (seeds its training stream never draws); written by
                         scripts/freeze_vision_heldout.py

`build.py` wrote the first two files. It is a generator of its own: its tool families, templates, names, filler and
glossary are not the training generator's (training/), and tests/training/test_heldout_leak.py checks that none of
the training generator's tool names or request templates appear here. Nothing under training/ reads this folder.
"""

from __future__ import annotations

import gzip
import json
import os
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REQUESTS = os.path.join(HERE, "requests.jsonl.gz")
DOCUMENTS = os.path.join(HERE, "documents.jsonl.gz")
TEXT = os.path.join(HERE, "text.jsonl.gz")
SHIPPED = os.path.join(HERE, "shipped.json")
PICTURES = os.path.join(HERE, "pictures.jsonl.gz")
DOCUMENT = "\x00DOCUMENT\x00"
"""The placeholder a retrieval request's user message holds where its document goes."""


def read_jsonl(path: str) -> list[dict[str, Any]]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_requests(path: str = REQUESTS, documents: str = DOCUMENTS) -> list[dict[str, Any]]:
    """Every held-out request in file order, each retrieval request's document put in its place."""
    docs = {d["id"]: d["text"] for d in read_jsonl(documents)} if os.path.isfile(documents) else {}
    rows = read_jsonl(path)
    for r in rows:
        if r.get("document"):
            r["messages"] = [{**m, "content": m["content"].replace(DOCUMENT, docs[r["document"]])}
                             if isinstance(m.get("content"), str) else m for m in r["messages"]]
    return rows


def shipped_measurements(path: str = SHIPPED) -> dict[str, Any]:
    """What the shipped weights measured on this set ({} when not recorded)."""
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)
