"""Study: how much of the host's structured-output work per decode step can run beside the forward? W2J's case:
64 sequences held to W2J_SCHEMA over m3-slice's vocabulary (the preset's 512-token tokenizer, 200,064 logit rows),
with switch overlap_grammar off and on. Its answer is docs/optimizations.md's overlap_grammar section.

    python -m studies.structured_host [--rows 64] [--steps 200] [--repeats 3]     # from the repository root

Each step draws, for every row, a random token its grammar allows (outside the timers) and then times the host work
the engine does for it, split by where it falls in the engine loop:

    critical    between the wait for step N's tokens and the launch of step N+1, when the device is idle:
                off: every row's accept_token (LLMEngine._receive); on: nothing (only an EOS is accepted there)
    overlapped  after step N+1's forward is launched, while the device computes it:
                off: the mask fill, then the copy of the mask into fresh pinned memory (GrammarBitmask.apply)
                on: one batched accept of the 64 tokens, then the mask fill into a pinned buffer (no copy)

Without CUDA, pinned memory is not available: the staging copy is timed as a clone of the mask (a pageable-to-
pinned copy is a memcpy too) and the on path fills a pageable buffer. Prints the medians in ms.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from nanoserve.bench.workloads import W2J_SCHEMA
from nanoserve.engine.structured_output import SequenceGrammar, StructuredOutputManager
from nanoserve.model.m3_config import M3Config
from nanoserve.presets.resolve import preset_tokenizer_dir
from nanoserve.presets.tokenizer import EOS_ID
from nanoserve.sampling import StructuredOutputsParams


@dataclass
class Seq:
    """What the manager reads of a sequence (ConstrainedSeq)."""

    seq_id: int
    request_id: str
    grammar: SequenceGrammar
    output_token_ids: list[int] = field(default_factory=list)


def allowed_tokens(mask_row: torch.Tensor, vocab: int) -> np.ndarray:
    bits = np.unpackbits(mask_row.numpy().view(np.uint8), bitorder="little")[:vocab]
    return np.flatnonzero(bits)


def run(manager: StructuredOutputManager, compiled, rows: int, steps: int, overlap: bool, seed: int
        ) -> tuple[list[float], list[float]]:
    rng = random.Random(seed)
    seqs = [Seq(i, f"r{i}", manager.new_grammar(compiled)) for i in range(rows)]
    pinned = overlap and torch.cuda.is_available()
    critical, overlapped = [], []
    mask = manager.bitmask(seqs, pinned=pinned)
    for _ in range(steps):
        # the step's tokens: one allowed token per row (never EOS: W2J's format cannot end in 256 tokens)
        for i, s in enumerate(seqs):
            ok = [t for t in allowed_tokens(mask.bitmask[i], manager.vocab_size) if t != EOS_ID]
            s.output_token_ids.append(int(rng.choice(ok)))
        t0 = time.perf_counter()
        if not overlap:
            for s in seqs:
                assert manager.accept(s)
        t1 = time.perf_counter()
        if overlap:
            manager.catch_up(seqs)
        mask = manager.bitmask(seqs, pinned=pinned)
        if not overlap:
            mask.bitmask.pin_memory() if torch.cuda.is_available() else mask.bitmask.clone()
        t2 = time.perf_counter()
        critical.append((t1 - t0) * 1e3)
        overlapped.append((t2 - t1) * 1e3)
    return critical, overlapped


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m studies.structured_host", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3, help="alternate off/on this many times; medians over all")
    args = ap.parse_args()
    vocab = M3Config().vocab_size
    manager = StructuredOutputManager(preset_tokenizer_dir("m3-slice"), vocab, [EOS_ID], max_batch=args.rows)
    compiled = manager.compile(StructuredOutputsParams(json=W2J_SCHEMA))
    results = {False: ([], []), True: ([], [])}
    for r in range(args.repeats):
        for overlap in (False, True):
            c, o = run(manager, compiled, args.rows, args.steps, overlap, seed=r)
            results[overlap][0].extend(c)
            results[overlap][1].extend(o)
    print(f"{args.rows} rows x {args.steps} steps x {args.repeats}, vocab {vocab}, W2J_SCHEMA, "
          f"cuda={torch.cuda.is_available()}, torch threads {torch.get_num_threads()}")
    print("| overlap_grammar | critical ms (device idle) | overlapped ms (beside the forward) | total ms |")
    print("|---|---|---|---|")
    for overlap in (False, True):
        c, o = (statistics.median(x) for x in results[overlap])
        print(f"| {'on' if overlap else 'off'} | {c:.2f} | {o:.2f} | {c + o:.2f} |")


if __name__ == "__main__":
    main()
