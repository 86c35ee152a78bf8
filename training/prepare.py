"""Tokenize m3-mini's training data into arrays, and write the held-out evaluation set.

    python -m training.prepare --corpus data/corpus --tokenizer data/tokenizer/tokenizer.json --out data/prepared

Writes compressed arrays (`ids` uint16, `trains` marking the tokens whose prediction is trained, document
`starts`), small enough to carry to a GPU machine:
- `text.npz`: the corpus documents, each ended by EOS; every source loses 2 % of its documents to
  `heldout_<source>.txt` (perplexity per corpus);
- `chats.npz`: generated M3-format chats of every kind but retrieval (training/chats.py's mixture without it),
  the loss on the assistant turns only;
- `long.npz`: key-retrieval chats of 0.5-8.5k tokens, trained in their own steps (and through MSA's real
  selection in the sparse phase);
- `heldout.jsonl.gz`: evaluation prompts from other seeds (arithmetic, tool calls on tools never seen in
  training, thinking format, retrieval at 1k/4k/8k tokens), with what a grader expects.
Chats use seeds 1.. for training and 10**6 + i for held-out, so the two never share a draw.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random

import numpy as np

from nanoserve.presets.tokenizer import CHAT_TEMPLATE, EOS_ID
from training import chats
from training.corpus import read_docs, wordnet_glosses_from_text
from training.tokenizer import SOURCES

HELDOUT_SEED = 10**6
RETRIEVAL_TOKENS = (1024, 4096, 8192)
BYTES_PER_TOKEN = 3.0  # the corpus's rate with the 4k tokenizer (training/tokenizer.py), to size filler text


class Encoder:
    def __init__(self, path: str):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(path)

    def ids(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def segments(self, segs: list[tuple[str, bool]]) -> tuple[list[int], list[int]]:
        ids, trains = [], []
        for text, t in segs:
            e = self.ids(text)
            ids.extend(e)
            trains.extend([int(t)] * len(e))
        return ids, trains


def save_docs(out: str, name: str, docs: list[tuple[list[int], list[int]]]) -> int:
    """`<name>.npz`: ids (uint16), trains (uint8), starts (int64), compressed (the chat format repeats a lot)."""
    starts = np.cumsum([0] + [len(d[0]) for d in docs])[:-1]
    np.savez_compressed(os.path.join(out, f"{name}.npz"),
                        ids=np.concatenate([np.asarray(d[0], np.uint16) for d in docs]),
                        trains=np.concatenate([np.asarray(d[1], np.uint8) for d in docs]),
                        starts=starts.astype(np.int64))
    return int(sum(len(d[0]) for d in docs))


def filler_sentences(corpus: str) -> list[str]:
    """Short plain sentences (WordNet glosses) to fill retrieval prompts."""
    return [f"The word {lemma} means {gloss}." for lemma, gloss in glosses(corpus)]


def glosses(corpus: str) -> list[tuple[str, str]]:
    return wordnet_glosses_from_text(os.path.join(corpus, "wordnet.txt"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default="data/corpus")
    ap.add_argument("--tokenizer", default="data/tokenizer/tokenizer.json")
    ap.add_argument("--out", default="data/prepared")
    ap.add_argument("--chats", type=int, default=100_000, help="short chats for training (no retrieval)")
    ap.add_argument("--long", type=int, default=2_000, help="retrieval chats for training")
    ap.add_argument("--heldout", type=int, default=100, help="held-out prompts per task")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    enc = Encoder(args.tokenizer)
    know = {"glosses": glosses(args.corpus), "sentences": filler_sentences(args.corpus)}

    # the corpus, 2 % of each source held out for perplexity
    rng = random.Random(0)
    docs = []
    for name in SOURCES:
        source = read_docs(os.path.join(args.corpus, f"{name}.txt"))
        rng.shuffle(source)
        n_held = max(1, len(source) // 50)
        with open(os.path.join(args.out, f"heldout_{name}.txt"), "w", encoding="utf-8") as f:
            f.write("\n\n".join(source[:n_held]))
        for d in source[n_held:]:
            ids = enc.ids(d) + [EOS_ID]
            docs.append((ids, [1] * len(ids)))
    rng.shuffle(docs)
    print(f"text: {save_docs(args.out, 'text', docs) / 1e6:.2f} M tokens")

    # short chats of the training mixture; retrieval chats (most of the mixture's tokens) go to the long set
    short = []
    kinds = {k: w for k, w in chats.MIXTURE.items() if k != "retrieval"}
    for i in range(args.chats):
        r = random.Random(i + 1)
        c = chats.sample(r, r.choices(list(kinds), weights=list(kinds.values()))[0], **know)
        short.append(enc.segments(chats.render(c, CHAT_TEMPLATE)))
    print(f"chats: {save_docs(args.out, 'chats', short) / 1e6:.2f} M tokens")

    # retrieval chats, 0.5-8.5k tokens (the held-out set asks at 1k, 4k and 8k)
    assert args.chats < HELDOUT_SEED // 2 and args.long < HELDOUT_SEED // 2, "training seeds would meet held-out ones"
    long = []
    for i in range(args.long):
        r = random.Random(HELDOUT_SEED // 2 + i)
        n_chars = int(r.uniform(500, 8_500) * BYTES_PER_TOKEN)
        c = chats.sample(r, "retrieval", n_chars=n_chars, **know)
        long.append(enc.segments(chats.render(c, CHAT_TEMPLATE)))
    print(f"long: {save_docs(args.out, 'long', long) / 1e6:.2f} M tokens")

    # the held-out evaluation set
    rows = []
    kinds = {"arith": {}, "tool": {}, "no_tool": {}}
    seed = HELDOUT_SEED
    for kind, kw in kinds.items():
        for _ in range(args.heldout):
            seed += 1
            c = chats.sample(random.Random(seed), kind, **kw, **know)
            rows.append({"task": kind, "prompt": chats.prompt(c, CHAT_TEMPLATE), "expected": c.expected,
                         "tools": c.tools, "thinking_mode": c.thinking_mode})
    for n_tok in RETRIEVAL_TOKENS:
        for _ in range(args.heldout // 2):
            seed += 1
            c = chats.sample(random.Random(seed), "retrieval", n_chars=int(n_tok * BYTES_PER_TOKEN), **know)
            rows.append({"task": f"retrieval_{n_tok // 1024}k", "prompt": chats.prompt(c, CHAT_TEMPLATE),
                         "expected": c.expected, "tools": None, "thinking_mode": c.thinking_mode})
    with gzip.open(os.path.join(args.out, "heldout.jsonl.gz"), "wt", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(f"heldout: {len(rows)} prompts")


if __name__ == "__main__":
    main()
