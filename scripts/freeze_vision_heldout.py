"""Freeze the picture questions `python -m nanoserve.bench --quality` grades a model with a vision tower on.

    python scripts/freeze_vision_heldout.py [--per-task 20]

Draws training/vision_tasks.py's held-out examples (seeds from HELDOUT_SEED_BASE on, which the training stream
never draws) and writes nanoserve/bench/heldout/pictures.jsonl.gz: one line per example with `task`, `question`,
`answer` and the picture as a PNG data URL, so the bench needs neither the training code nor its fonts. Run again
only to grow the set; the frozen file is what every model is graded on.
"""

from __future__ import annotations

import argparse
import base64
import gzip
import io
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from training import vision_tasks  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-task", type=int, default=20)
    ap.add_argument("--out", default="nanoserve/bench/heldout/pictures.jsonl.gz")
    args = ap.parse_args()
    with gzip.open(args.out, "wt", encoding="utf-8") as f:
        for ex in vision_tasks.heldout(args.per_task):
            buf = io.BytesIO()
            ex.image.save(buf, format="PNG", optimize=True)
            url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
            f.write(json.dumps({"task": ex.task, "question": ex.question, "answer": ex.answer, "image": url}) + "\n")
    print(f"{args.out}: {os.path.getsize(args.out)} bytes")


if __name__ == "__main__":
    main()
