"""Warm-up before ready: build the kernels, and capture the decode graphs, of the shapes the engine will meet.

Triton compiles a kernel the first time it meets a new specialisation (its constexpr tiles: the fused MoE's token
bucket, the padded row counts of small batches, the MSA top-k chunk, the long-context prefill tiles), and a decode
graph is captured the first time its batch bucket is met. On a fresh machine each of those costs up to seconds,
inside the TTFT of whichever request meets the shape first. `warm_up` runs those shapes on dummy inputs before the
server opens its socket (as vLLM compiles and captures before its API server listens), in this order - what
every request needs first, the rarer shapes last, so a budget that runs out leaves the rare ones:

1. decode: one step of every decode batch bucket (runner/cuda_graphs.py's `batch_buckets` up to max_num_seqs),
   largest first so the smaller graphs reuse the memory pool, at a context long enough for MSA to select blocks;
   with CUDA graphs on, each step captures its bucket's graph (at that context bucket; longer context buckets are
   still captured when first met). Each step's logits go through the sampler: greedy rows and a seeded row with
   top-k / top-p / min-p and logprobs.
2b. speculative decoding (with a speculative_config of k tokens): per decode batch bucket, largest first, one
   verify step of every query length 2 .. k + 1 (with spec_cuda_graphs each captures its verify graph) and, for a
   draft model (mtp, eagle3), after the k + 1 one, a draft step from each number of final positions 1 .. k + 1
   (the MTP drafter captures its first-pass graph of that length and its one-token pass; with spec_draft_chain
   the k + 1 verify step also captures its draft chain's graph, and with spec_multi_step a launch of
   spec_steps_per_launch such steps then captures its graph, ending in the same context bucket). Without them a
   request's first verify and draft steps of each length capture graphs and build kernels inside its TPOT.
3. prefill: one prompt of every power-of-two token count up to max_num_batched_tokens (the MoE's token buckets
   are powers of two, and the small-batch kernels pad their rows to one), and the budget itself.
4. MSA: a prompt of index_topk_blocks + 2 blocks, so every sparse layer selects among more blocks than it keeps
   (in chunks of max_num_batched_tokens when it is longer than one step).
5. long prompts: one chunk of max_num_batched_tokens tokens ending at 2x, 4x, ... the budget and at the longest
   prompt (max_model_len - 1): the MSA top-k chunk grows with the blocks a chunk attends to, and from
   configs.LONG_PREFILL_CONTEXT tokens on the prefill kernels take their `_long` tiles.
6. long contexts: a graph is keyed by its context bucket too (runner/cuda_graphs.py's `seq_len_buckets`), so per
   bucket past the decode context's, one sequence (a long request is usually alone) decodes once and, with
   speculative decoding, runs the verify and draft shapes of 2b - at the bucket's end, so that the draft chain's
   positions stay in it. Without them the first long request captures those graphs inside its TPOT.

The steps go straight to the executor (every rank under tensor parallelism), over scratch KV blocks that a dummy
sequence takes from the block manager and gives back: nothing is scheduled, no request or statistic is recorded,
the prefix cache registers nothing, and the sampler's shared generator is not drawn from (the seeded row has its
own), so later outputs are the same with or without a warm-up. The budget is checked before each shape; what is
left when it runs out is named in the log line.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from nanoserve.engine.sequence import Sequence
from nanoserve.runner.cuda_graphs import batch_buckets, seq_len_buckets
from nanoserve.sampling import SamplingParams
from nanoserve.spec_decode import multi_step
from nanoserve.spec_decode.draft_input import DraftInput
from nanoserve.step import ModelInput, StepInput, StepSeq

if TYPE_CHECKING:
    from nanoserve.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

DEFAULT_GPU_BUDGET_S = 120.0
"""The server's warm-up budget on a GPU when --warmup-budget-s is not given (on the CPU: 0, no warm-up: nothing
there takes the Triton path, and the server should start at once)."""

WARMUP_SEQ_ID = -1
"""The dummy sequence's id: real sequences count up from 0, so it never meets one in the block manager."""


@dataclass(frozen=True)
class Shape:
    """One warm-up step (or, for a prompt longer than a step, the chunks of one prompt).

    kind: "decode" (`batch` sequences, one new token each, at context `context`), "verify" (`batch` sequences of
    `chunk` new tokens each, every token's logits wanted, ending at `context`), "draft" (no target step: the draft
    model's passes after the verify step before it, from the last `chunk` positions of each sequence), "prefill"
    (one prompt of `context` tokens, run in chunks of at most `chunk` tokens) or "chunk" (the last chunk of a long
    prompt alone: `chunk` tokens ending at `context`, attending to whatever the scratch blocks before it hold - the
    kernels' tiles depend on the lengths, not on the values)."""

    kind: str
    batch: int
    context: int
    chunk: int
    label: str
    bucket: bool = False
    """Run for a longer context bucket's graphs (step 6), beside those of the decode context."""

    @property
    def steps(self) -> list[tuple[int, int]]:
        """(query tokens, context after the step) of each step this shape runs."""
        if self.kind == "decode":
            return [(1, self.context)]
        if self.kind == "draft":
            return []
        if self.kind in ("chunk", "verify"):
            return [(self.chunk, self.context)]
        out, done = [], 0
        while done < self.context:
            q = min(self.chunk, self.context - done)
            done += q
            out.append((q, done))
        return out


def plan(max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, block_size: int, topk_blocks: int,
         has_msa: bool, spec_tokens: int = 0, draft_model: bool = False) -> list[Shape]:
    """The shapes to warm, in the order they run (see the module docstring). spec_tokens: k of the
    speculative_config (0: none); draft_model: its drafter is a model (mtp, eagle3), not prompt lookup."""
    longest_prompt = max(max_model_len - 1, 1)  # a prompt leaves room for one generated token
    msa_len = min((topk_blocks + 2) * block_size, longest_prompt) if has_msa else 0
    decode_context = min(max(msa_len + 1, 2), max_model_len)
    shapes = [Shape("decode", b, decode_context, 1, f"decode batch {b}")
              for b in reversed(batch_buckets(max_num_seqs))]
    # a verify step's context and its drafts' positions stay within max_model_len (and the scratch blocks)
    spec_context = max(1, min(decode_context, max_model_len - spec_tokens))
    for b in reversed(batch_buckets(max_num_seqs)) if spec_tokens else ():
        shapes += _spec_shapes(b, spec_context, spec_tokens, draft_model)
    top = min(max_num_batched_tokens, longest_prompt)
    counts, t = [], 1
    while t < top:
        counts.append(t)
        t *= 2
    counts.append(top)
    shapes += [Shape("prefill", 1, n, n, f"prefill {n} tokens") for n in counts]
    if msa_len and msa_len not in counts:
        shapes.append(Shape("prefill", 1, msa_len, max_num_batched_tokens, f"MSA prompt {msa_len} tokens"))
    context = 2 * top
    while top < longest_prompt:  # chunks of a long prompt: 2x, 4x, ... the budget, and the longest prompt
        context = min(context, longest_prompt)
        shapes.append(Shape("chunk", 1, context, top, f"{top}-token chunk at context {context}"))
        if context == longest_prompt:
            break
        context *= 2
    buckets = seq_len_buckets(max_model_len)
    first = next(b for b in buckets if b >= decode_context)
    for previous, bucket in zip(buckets, buckets[1:]):  # the context buckets past the decode context's
        if bucket <= first:
            continue
        shapes.append(Shape("decode", 1, bucket, 1, f"decode batch 1 at context {bucket}", bucket=True))
        spec_at = bucket - spec_tokens  # + k - 1 draft positions end at the bucket's last position
        if spec_tokens and spec_at > previous:
            shapes += _spec_shapes(1, spec_at, spec_tokens, draft_model, bucket=True)
    return shapes


def _spec_shapes(batch: int, context: int, k: int, draft_model: bool, bucket: bool = False) -> list[Shape]:
    """A speculative batch's verify steps of every query length 2 .. k + 1 ending at `context`, and for a draft
    model its draft steps from 1 .. k + 1 final positions (after the k + 1 one); `bucket`: for a longer context
    bucket (step 6), whose labels name the context."""
    where = f" at context {context}" if bucket else ""
    out = [Shape("verify", batch, context, q, f"verify batch {batch} x {q} tokens{where}", bucket)
           for q in range(2, k + 2) if q <= context]
    if draft_model and k + 1 <= context:
        out += [Shape("draft", batch, context, q, f"drafts batch {batch} from {q} positions{where}", bucket)
                for q in range(1, k + 2)]
    return out


@dataclass
class WarmupReport:
    """What a warm-up built, and what its budget left out."""

    budget_s: float
    built: list[Shape] = field(default_factory=list)
    skipped: list[Shape] = field(default_factory=list)
    graphs: int = 0
    seconds: float = 0.0

    def summary(self) -> str:
        """The one log line: counts of what was built, the graphs, the time, and what the budget left out."""
        if not self.built and not self.skipped:
            return "warm-up: nothing to build"
        if self.budget_s <= 0:
            return ("warm-up skipped (budget 0 s): kernels are built and decode graphs captured when first met "
                    f"({len(self.skipped)} shapes)")
        decode = [s.batch for s in self.built if s.kind == "decode" and not s.bucket]
        spec = [s for s in self.built if s.kind in ("verify", "draft")]
        prefill = [s.context for s in self.built if s.kind in ("prefill", "chunk")]
        buckets = [s.context for s in self.built if s.kind == "decode" and s.bucket]
        parts = [f"{len(decode)} decode batch sizes" + (f" ({min(decode)}-{max(decode)})" if decode else ""),
                 f"{len(prefill)} prefill shapes" + (f" ({min(prefill)}-{max(prefill)} tokens)" if prefill else ""),
                 f"{self.graphs} CUDA graphs captured"]
        if spec or any(s.kind in ("verify", "draft") for s in self.skipped):
            parts.insert(1, f"{len(spec)} speculative verify and draft shapes")
        if buckets:
            parts.insert(-1, f"one sequence at {len(buckets)} longer context bucket{'s' * (len(buckets) > 1)} "
                             f"({', '.join(str(b) for b in buckets)} tokens)")
        line = f"warm-up: built {', '.join(parts)} in {self.seconds:.1f} s"
        if self.skipped:
            line += (f"; not built, the budget of {self.budget_s:g} s was spent: "
                     f"{', '.join(s.label for s in self.skipped)}")
        return line


def warm_up(engine: "LLMEngine", budget_s: float, clock: Callable[[], float] = time.monotonic) -> WarmupReport:
    """Run the engine's warm-up shapes until done or `budget_s` seconds have passed (0: none); log one line.
    Raises if the KV blocks did not all come back (a bug, not a condition to serve with)."""
    cfg = engine.model_config
    spec = engine.spec_config
    k = spec.num_speculative_tokens if spec is not None else 0
    shapes = plan(engine.config.max_num_seqs, engine.max_num_batched_tokens, engine.max_model_len,
                  engine.block_size, cfg.index_topk_blocks, cfg.num_sparse_attn_layers > 0,
                  k, spec is not None and spec.method != "ngram")
    report = WarmupReport(budget_s)
    start = clock()
    if budget_s <= 0:
        report.skipped = shapes
        logger.info(report.summary())
        return report
    bm = engine.block_manager
    free_before = bm.num_free_blocks
    scratch = Sequence(WARMUP_SEQ_ID, "warmup", 0, [], SamplingParams())
    # (a draft shape writes its drafts' K/V up to k - 1 positions past its context)
    longest = max([ctx for s in shapes for _, ctx in s.steps] +
                  [s.context + k - 1 for s in shapes if s.kind in ("draft", "verify")] +
                  [s.context + multi_step.reach(0, k + 1, _spec_steps(engine)) for s in shapes if s.kind == "verify"])
    if not bm.allocate(scratch, longest):
        raise RuntimeError(f"warm-up: the KV pool has no {bm.blocks_needed(longest)} free blocks for its "
                           f"scratch sequence")
    graphs_before = _num_graphs(engine)
    try:
        for i, shape in enumerate(shapes):
            if clock() - start >= budget_s:
                report.skipped = shapes[i:]
                break
            _run(engine, shape, scratch.block_table)
            report.built.append(shape)
    finally:
        bm.free_seq(scratch)
    if bm.num_free_blocks != free_before:
        raise RuntimeError(f"warm-up leaked KV blocks: {free_before} free before, {bm.num_free_blocks} after")
    report.graphs = _num_graphs(engine) - graphs_before
    report.seconds = clock() - start
    logger.info(report.summary())
    return report


def _run(engine: "LLMEngine", shape: Shape, table: list[int]) -> None:
    """One shape's steps through the executor, each waited for (the clock reads the time it took)."""
    vocab, bs = engine.model_config.vocab_size, engine.block_size
    if shape.kind == "draft":
        _draft(engine, shape, table)
        return
    k = engine.spec_config.num_speculative_tokens if engine.spec_config is not None else 0
    for query, context in shape.steps:
        blocks = table[: -(-context // bs)]
        n = shape.batch
        if shape.kind == "verify":  # as engine/step_input.py lays out a verify step, every row plain greedy
            chain = query == k + 1  # (with a draft model and spec_draft_chain: the chain's graph too)
            if chain:  # the blocks its draft chain writes to, as the scheduler's lookahead allocates them
                blocks = table[: -(-(context + k - 1) // bs)]
            ids = [(context + i) % vocab for i in range(n * query)]
            seqs = [_row(WARMUP_SEQ_ID - i, GREEDY, context - query, query, ids[i * query + 1: (i + 1) * query],
                         k if chain else 0) for i in range(n)]
            inp = ModelInput(ids, [query] * n, [context] * n, [blocks] * n, [], list(range(n * query)))
        elif shape.kind == "decode":
            inp = ModelInput([(context + i) % vocab for i in range(n)], [1] * n, [context] * n, [blocks] * n,
                             list(range(n)))
            seqs = _sampled_rows(n, context)
        else:  # a prompt's chunk: positions context - query ... context - 1
            ids = [(context - query + i) % vocab for i in range(query)]
            inp = ModelInput(ids, [query], [context], [blocks], [0])
            seqs = _sampled_rows(1, context, query)
        # (each dummy row's generator is dropped first: the seeded row always draws from a fresh one)
        engine.executor.execute_model(StepInput(inp, seqs, finished=[s.seq_id for s in seqs], propose=False))
        engine.executor.sample_tokens().result()  # waits for the step
        if shape.kind == "verify" and query == k + 1 and _spec_steps(engine) > 1:
            _multi(engine, shape, table, query, context)


def _spec_steps(engine: "LLMEngine") -> int:
    """The speculative steps one launch runs (1: no multi-step launches; spec_decode/multi_step.py)."""
    spec, cfg = engine.spec_config, engine.config
    if spec is None or spec.method == "ngram" or not cfg.optimizations.spec_multi_step:
        return 1
    return cfg.spec_steps_per_launch


def _multi(engine: "LLMEngine", shape: Shape, table: list[int], query: int, context: int) -> None:
    """A launch of several verify steps after the verify step at `context` (the draft chain's): started early
    enough that its farthest position stays in that step's context bucket, whose graph it captures."""
    steps, k, vocab = _spec_steps(engine), query - 1, engine.model_config.vocab_size
    extra = multi_step.reach(0, query, steps)
    bucket = next(b for b in seq_len_buckets(engine.max_model_len) if b >= context)
    context = min(context, bucket - extra)
    if context < query:
        return
    blocks = table[: -(-(context + extra) // engine.block_size)]
    n = shape.batch
    ids = [(context + i) % vocab for i in range(n * query)]
    seqs = [_row(WARMUP_SEQ_ID - i, GREEDY, context - query, query, ids[i * query + 1: (i + 1) * query], k)
            for i in range(n)]
    inp = ModelInput(ids, [query] * n, [context] * n, [blocks] * n, [], list(range(n * query)))
    engine.executor.execute_model(StepInput(inp, seqs, finished=[s.seq_id for s in seqs], propose=False,
                                            spec_steps=steps))
    engine.executor.sample_tokens().result()


def _draft(engine: "LLMEngine", shape: Shape, table: list[int]) -> None:
    """A draft model's passes from the last `shape.chunk` positions of each sequence of the verify step of k + 1
    tokens that ran just before (the drafter reads its rows), k drafts each."""
    n, q, k = shape.batch, shape.chunk, engine.spec_config.num_speculative_tokens
    verified = k + 1
    blocks = table[: -(-(shape.context + k - 1) // engine.block_size)]
    rows = [i * verified + verified - q + j for i in range(n) for j in range(q)]
    vocab = engine.model_config.vocab_size
    engine.executor.propose_drafts(DraftInput(rows, [r % vocab for r in rows], [q] * n, [shape.context] * n,
                                              [blocks] * n, [k] * n))


GREEDY = SamplingParams(temperature=0.0)
DRAWN = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, min_p=0.01, seed=0, logprobs=2)


def _row(seq_id: int, params: SamplingParams, start: int, query: int, draft: list[int], max_drafts: int = 0
         ) -> StepSeq:
    """A dummy sequence as the runner sees it (nothing reads its tokens: it has no penalties, and the warm-up's
    steps propose no drafts)."""
    return StepSeq(seq_id, 0, params, [0], [], 0, start, query, samples=True, draft=draft, max_drafts=max_drafts)


def _sampled_rows(n: int, context: int, query: int = 1) -> list[StepSeq]:
    """The sampler's dummy rows: one seeded draw with every filter and logprobs (its own generator, so the engine's
    shared one is not advanced), the rest greedy."""
    return [_row(WARMUP_SEQ_ID - i, DRAWN if i == 0 else GREEDY, context - query, query, []) for i in range(n)]


def _num_graphs(engine: "LLMEngine") -> int:
    """Graphs captured so far: only a runner in this process (tensor_parallel_size 1) has them."""
    runner = getattr(engine.executor, "runner", None)
    return runner.num_graphs if runner is not None else 0
