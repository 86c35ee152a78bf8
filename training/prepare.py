"""Tokenize m3-mini's training data into arrays, and write the held-out evaluation set.

    python -m training.prepare --corpus data/corpus --out data/prepared [--workers 2]

Writes compressed arrays (`ids` uint16, `trains` marking the tokens whose prediction is trained, document
`starts`), small enough to carry to a GPU machine:
- `text.npz`: the corpus documents, each ended by EOS; every source loses 2 % of its documents to
  `heldout_<source>.txt` (perplexity per corpus);
- `chats.npz`: generated M3-format chats of every kind but retrieval (training/chats.py's mixture without it),
  the loss on the assistant turns only;
- `long.npz`: retrieval chats of 0.5-15.5k tokens (a value hidden among up to 64 in filler text), trained in their
  own steps (and through MSA's real selection in the sparse phase);
- `heldout.jsonl.gz`: evaluation prompts from other seeds (arithmetic, tool calls on tools never seen in
  training, thinking format, retrieval at 1k/4k/8k tokens), with what a grader expects.
Chats use seeds 1.. for training and 10**6 + i for held-out, so the two never share a draw. The texts the chats
quote (WordNet glosses, filler sentences from the Python docs and fortunes, the standard library's docstrings) come
from the training part of the corpus only: nothing of the held-out 2 % reaches a chat. The held-out requests
`python -m nanoserve.bench --quality` grades are not written here: nanoserve/bench/heldout/ has its own generator.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import re

import numpy as np

from nanoserve.presets.tokenizer import CHAT_TEMPLATE, EOS_ID
from training import chats
from training.config import MINI
from training.corpus import read_docs
from training.passages import stdlib_entries
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
    """`<name>.npz`: ids (uint16), trains (uint8), starts (int64), in a zip compressed with LZMA (np.load reads it
    as any .npz; token ids take 0.5-0.7x the bytes of np.savez_compressed's deflate, which is what lets the arrays
    travel to a GPU machine with the repository)."""
    import zipfile

    starts = np.cumsum([0] + [len(d[0]) for d in docs])[:-1]
    arrays = {"ids": np.concatenate([np.asarray(d[0], np.uint16) for d in docs]),
              "trains": np.concatenate([np.asarray(d[1], np.uint8) for d in docs]),
              "starts": starts.astype(np.int64)}
    with zipfile.ZipFile(os.path.join(out, f"{name}.npz"), "w", compression=zipfile.ZIP_LZMA) as zf:
        for key, a in arrays.items():
            with zf.open(f"{key}.npy", "w", force_zip64=True) as f:
                np.lib.format.write_array(f, a)
    return int(sum(len(d[0]) for d in docs))


def filler_sentences(glosses_: list[tuple[str, str]], docs: dict[str, list[str]], rng: random.Random,
                     n: int = 60_000) -> list[str]:
    """Plain sentences to fill retrieval prompts: WordNet glosses as "The word X means Y.", sentences of the Python
    docs' prose (no markup) and short fortunes, shuffled together."""
    out = [f"The word {lemma} means {gloss}." for lemma, gloss in glosses_]
    for doc in docs.get("python_docs", []):
        for sent in re.split(r"(?<=[.!?])\s+", " ".join(doc.split())):
            if 40 <= len(sent) <= 200 and not re.search(r"[`*:|=<>\\_\[\]{}]|\.\.", sent) and sent[0].isupper():
                out.append(sent)
    for doc in docs.get("fortunes", []):
        line = " ".join(doc.split())
        if 30 <= len(line) <= 160 and "--" not in line:
            out.append(line)
    rng.shuffle(out)
    return out[:n]


def _render(job: tuple[str, int, int, dict]) -> list[tuple[list[int], list[int]]]:
    """Chats of seeds [start, stop) of one kind set ("short": the mixture without retrieval, "long": retrieval of a
    length drawn per seed), tokenized. Runs in a worker process."""
    what, start, stop, cfg = job
    enc, know = _WORKER["enc"], _WORKER["know"]
    out = []
    kinds = {k: w for k, w in chats.MIXTURE.items() if k != "retrieval"}
    for seed in range(start, stop):
        r = random.Random(seed)
        if what == "short":
            c = chats.sample(r, r.choices(list(kinds), weights=list(kinds.values()))[0], **know)
        else:
            tokens = r.uniform(500, cfg["long_max"])
            c = chats.sample(r, "retrieval", n_chars=int(tokens * BYTES_PER_TOKEN), needle=None, **know)
        ids, trains = enc.segments(chats.render(c, CHAT_TEMPLATE))
        if what == "long" and len(ids) > cfg["long_limit"]:  # a filler denser than BYTES_PER_TOKEN: cut to fit
            c = chats.sample(random.Random(seed + 7919), "retrieval",
                             n_chars=int(tokens * BYTES_PER_TOKEN * cfg["long_limit"] / len(ids) * 0.95),
                             needle=None, **know)
            ids, trains = enc.segments(chats.render(c, CHAT_TEMPLATE))
        out.append((ids, trains))
    return out


_WORKER: dict = {}


def _init_worker(tokenizer: str, know: dict) -> None:
    _WORKER["enc"], _WORKER["know"] = Encoder(tokenizer), know


def render_many(what: str, seeds: range, workers: int, tokenizer: str, know: dict, cfg: dict):
    """Every seed's chat tokenized, in seed order, over `workers` processes (1: in this one)."""
    step = 500
    jobs = [(what, a, min(a + step, seeds.stop), cfg) for a in range(seeds.start, seeds.stop, step)]
    if workers <= 1:
        _init_worker(tokenizer, know)
        return [d for job in jobs for d in _render(job)]
    import multiprocessing as mp

    with mp.get_context("fork").Pool(workers, _init_worker, (tokenizer, know)) as pool:
        return [d for part in pool.imap(_render, jobs) for d in part]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default="data/corpus")
    ap.add_argument("--tokenizer", default="nanoserve/presets/m3_mini/tokenizer.json",
                    help="the tokenizer the weights use (default: the one m3-mini ships)")
    ap.add_argument("--out", default="data/prepared")
    ap.add_argument("--chats", type=int, default=200_000, help="short chats for training (no retrieval)")
    ap.add_argument("--long", type=int, default=4_000, help="retrieval chats for training")
    ap.add_argument("--long-max", type=int, default=16_300, help="longest retrieval chat, in tokens (the context "
                    "is 16,384)")
    ap.add_argument("--heldout", type=int, default=100, help="held-out prompts per task")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes rendering chats")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    enc = Encoder(args.tokenizer)

    # the corpus, 2 % of each source held out for perplexity
    rng = random.Random(0)
    docs = []
    train_docs: dict[str, list[str]] = {}
    for name in SOURCES:
        source = read_docs(os.path.join(args.corpus, f"{name}.txt"))
        rng.shuffle(source)
        n_held = max(1, len(source) // 50)
        with open(os.path.join(args.out, f"heldout_{name}.txt"), "w", encoding="utf-8") as f:
            f.write("\n\n".join(source[:n_held]))
        train_docs[name] = source[n_held:]
        for d in source[n_held:]:
            ids = enc.ids(d) + [EOS_ID]
            docs.append((ids, [1] * len(ids)))
    rng.shuffle(docs)
    print(f"text: {save_docs(args.out, 'text', docs) / 1e6:.2f} M tokens", flush=True)

    # what the chats quote: the training part of the corpus only
    train_glosses = [(lemma, gloss.rstrip(".")) for lemma, _, gloss in
                     (d.partition(": ") for d in train_docs["wordnet"])]
    know = {"glosses": train_glosses, "sentences": filler_sentences(train_glosses, train_docs, random.Random(1)),
            "docs": stdlib_entries()}
    print(f"quoted: {len(know['glosses'])} glosses, {len(know['sentences'])} filler sentences, "
          f"{len(know['docs'])} library entries", flush=True)

    # short chats of the training mixture; retrieval chats (most of the mixture's tokens) go to the long set
    assert args.chats < HELDOUT_SEED // 2 and args.long < HELDOUT_SEED // 2, "training seeds would meet held-out ones"
    cfg = {"long_max": args.long_max, "long_limit": MINI.max_position_embeddings - 64}
    short = render_many("short", range(1, args.chats + 1), args.workers, args.tokenizer, know, cfg)
    print(f"chats: {save_docs(args.out, 'chats', short) / 1e6:.2f} M tokens", flush=True)
    long = render_many("long", range(HELDOUT_SEED // 2, HELDOUT_SEED // 2 + args.long), args.workers,
                       args.tokenizer, know, cfg)
    print(f"long: {save_docs(args.out, 'long', long) / 1e6:.2f} M tokens, longest {max(len(d[0]) for d in long)}",
          flush=True)

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
            c = chats.sample(random.Random(seed), "retrieval", n_chars=int(n_tok * BYTES_PER_TOKEN), needle=0,
                             **know)
            rows.append({"task": f"retrieval_{n_tok // 1024}k", "prompt": chats.prompt(c, CHAT_TEMPLATE),
                         "expected": c.expected, "tools": None, "thinking_mode": c.thinking_mode})
    with gzip.open(os.path.join(args.out, "heldout.jsonl.gz"), "wt", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(f"heldout: {len(rows)} prompts")


if __name__ == "__main__":
    main()
