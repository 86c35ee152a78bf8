"""A narrated trace of a few requests through the engine, step by step, on the CPU.

    python -m nanoserve.walkthrough                      # every mechanism in one run (about a second)
    python -m nanoserve.walkthrough --scenario prefix    # or: chunk, preempt
    python -m nanoserve.walkthrough --pause -v           # wait for Enter between steps; show everything

It builds a real engine on the m3-tiny preset (random weights, so the generated text is noise), sends a handful
of requests chosen to make each mechanism happen, and after every engine step prints what happened in plain
words. Nothing in the narration is scripted: every line is derived from the engine's real state -

- the engine's observer events (LLMEngine.add_observer): admit, chunk, preempt, finish, allocate, free, evict,
  prefix_hit and step;
- the block manager's tables and reference counts, and the scheduler's queues;
- the model's tracing hook (M3ForCausalLM.set_trace): which KV blocks an MSA layer selected, which experts an MoE
  layer routed each token to;
- engine.stats, whose counters the closing summary compares with what was narrated.

The scenarios only choose the inputs: prompt lengths, arrival steps, the token budget and the KV pool size.
The engine runs with the plain reference kernels (no Triton), which are fast at this size on any CPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, TextIO

import torch

from nanoserve.config import EngineConfig, Optimizations
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.sequence import Sequence
from nanoserve.kernels import reference
from nanoserve.presets.catalog import get_preset
from nanoserve.sampling import SamplingParams

MODEL = "m3-tiny"
DETAILS = ("low", "normal", "high")
PREVIEW_CHARS = 48  # how much of a prompt or an answer to quote
RULE_WIDTH = 110
INDENT = 15  # the column where the text after a [tag] starts


# ------------------------------------------------------------------------------------------------------------
# Scenarios: the inputs only (prompt lengths, arrivals, budget, pool size). Lengths are in KV blocks so the
# story holds for any MSA block size; m3-tiny's block is 16 tokens.
# ------------------------------------------------------------------------------------------------------------

SYSTEM_PROMPT = "You are a helpful assistant. Answer in one short sentence."
LONG_DOCUMENT = ("Summarise: a paged KV cache splits each sequence's keys and values into fixed-size blocks, so "
                 "memory is handed out on demand and freed blocks are reused by other sequences.")


@dataclass
class Part:
    """A piece of a prompt: `text`, cut (or repeated) to exactly `blocks` KV blocks plus `extra` tokens."""

    text: str
    blocks: int = 0
    extra: int = 0


@dataclass
class RequestPlan:
    name: str  # the request id, one letter so block maps stay readable
    role: str  # why the scenario sends it (printed once, before step 1)
    parts: list[Part]
    max_tokens: int
    arrives: int  # added to the engine just before this step


@dataclass
class Scenario:
    name: str
    title: str
    requests: list[RequestPlan]
    kv_blocks: int  # size of the KV pool, in blocks
    budget_blocks: int  # max_num_batched_tokens, in blocks
    max_num_seqs: int = 4


def _scenarios() -> dict[str, Scenario]:
    system = Part(SYSTEM_PROMPT, blocks=2)  # two full blocks: exactly what a second request can find cached
    return {
        "all": Scenario(
            "all", "every mechanism in one run: a prefix-cache hit, a chunked prefill, a preemption, evictions",
            [RequestPlan("A", "a question after a 2-block system prompt", [system, Part(" Why cache keys?", extra=8)],
                         max_tokens=12, arrives=1),
             RequestPlan("B", "the same system prompt, another question: its first 2 blocks are already cached",
                         [system, Part(" What does a scheduler do?", extra=10)], max_tokens=12, arrives=2),
             RequestPlan("C", "a long prompt: more than one step's token budget, so it is chunked",
                         [Part(LONG_DOCUMENT, blocks=6, extra=4)], max_tokens=6, arrives=3)],
            kv_blocks=11, budget_blocks=4),
        "prefix": Scenario(
            "prefix", "prefix caching: shared blocks, and cached blocks revived after their owner finished",
            [RequestPlan("A", "a question after a 2-block system prompt", [system, Part(" Why cache keys?", extra=8)],
                         max_tokens=4, arrives=1),
             RequestPlan("B", "the same system prompt while A still runs: shares A's two blocks",
                         [system, Part(" What does a scheduler do?", extra=10)], max_tokens=4, arrives=2),
             RequestPlan("C", "the same system prompt after A and B finished: revives their freed, cached blocks",
                         [system, Part(" Count to ten.", extra=6)], max_tokens=3, arrives=6)],
            kv_blocks=16, budget_blocks=8),
        "chunk": Scenario(
            "chunk", "chunked prefill: a long prompt split across steps, beside a running decode",
            [RequestPlan("A", "a short prompt that is decoding while the long one arrives",
                         [Part("Count to ten.", blocks=1, extra=4)], max_tokens=8, arrives=1),
             RequestPlan("L", "a prompt about three times the token budget: it is computed in chunks",
                         [Part(LONG_DOCUMENT, blocks=6, extra=4)], max_tokens=3, arrives=2)],
            kv_blocks=16, budget_blocks=2),
        "preempt": Scenario(
            "preempt", "preemption: a KV pool too small for two growing sequences",
            [RequestPlan("A", "a prompt just short of 3 full blocks, growing into a 4th",
                         [Part("Tell me a story about a small cat.", blocks=2, extra=14)], max_tokens=8, arrives=1),
             RequestPlan("B", "another one, arriving next: the two fill the 6-block pool",
                         [Part("The quick brown fox jumps over the lazy dog.", blocks=2, extra=14)], max_tokens=4,
                         arrives=2)],
            kv_blocks=6, budget_blocks=4),
    }


SCENARIOS = _scenarios()


def _fit(tokenizer: Any, part: Part, block_size: int) -> list[int]:
    n = part.blocks * block_size + part.extra
    ids = tokenizer.encode(part.text, add_special_tokens=False)
    while len(ids) < n:
        ids += tokenizer.encode(" " + part.text, add_special_tokens=False)
    return ids[:n]


def reference_optimizations() -> Optimizations:
    """Every kernel switch off (plain PyTorch reference kernels); the scheduling switches stay on, but for
    overlap_scheduling: the narration reports each step's sampled tokens when that step returns."""
    return Optimizations.reference_kernels().replace(cuda_graphs=False, overlap_scheduling=False)


def build_engine(scenario: Scenario) -> LLMEngine:
    """A CPU engine on m3-tiny whose KV pool and token budget are the scenario's."""
    block = get_preset(MODEL).config.index_block_size  # the KV block size is the MSA block size
    return LLMEngine(EngineConfig(
        model=MODEL, device="cpu", optimizations=reference_optimizations(),
        max_model_len=scenario.kv_blocks * block, max_num_batched_tokens=scenario.budget_blocks * block,
        num_gpu_blocks_override=scenario.kv_blocks, max_num_seqs=scenario.max_num_seqs))


def _line(tag: str, text: str) -> str:
    """'  [tag]        text', wrapped under the text."""
    label = f"[{tag}]" if tag else ""
    return textwrap.fill(text, RULE_WIDTH, initial_indent=f"  {label:<{INDENT - 2}}", subsequent_indent=" " * INDENT,
                         break_on_hyphens=False)


# ------------------------------------------------------------------------------------------------------------
# The narrator. Each event is put into words the moment it happens, while the state it describes (free blocks,
# reference counts, a sequence's progress) is still true; the words are printed once engine.step() returns.
# ------------------------------------------------------------------------------------------------------------


@dataclass
class Narrated:
    """Totals of what the narration reported, to set against engine.stats (the summary and the test do)."""

    steps: int = 0
    preemptions: int = 0
    prefix_hit_tokens: int = 0
    chunks: int = 0
    evictions: int = 0
    msa_selections: int = 0
    moe_routings: int = 0
    finished: int = 0


@dataclass
class Row:
    """One sequence of the batch being run, as the step event saw it (before the step advanced it)."""

    seq: Sequence
    name: str
    start: int  # tokens already in the KV cache
    num_new: int  # tokens computed this step
    token_ids: list[int]  # those new tokens
    samples: bool  # does this step end with a new token sampled for it?


_SAMPLED = object()  # where, among a step's lines, the sampled tokens are reported


class Narrator:
    """Engine observer (LLMEngine.add_observer) and model trace hook (M3ForCausalLM.set_trace) in one."""

    def __init__(self, engine: LLMEngine, detail: str, out: TextIO):
        self.engine = engine
        self.bm = engine.block_manager
        self.tok = engine.tokenizer
        self.detail = DETAILS.index(detail)  # 0 low, 1 normal, 2 high
        self.out = out
        self.count = Narrated()
        self.lines: list[Any] = []  # this step's (level, text) lines, and the _SAMPLED marker
        self.rows: list[Row] = []  # this step's batch
        self.owner: dict[int, str] = {}  # block id -> the request it was last handed to
        self._last_free: tuple[Sequence | None, int] = (None, -1)  # (sequence, line index) of the latest free
        cfg = engine.model_config
        # One layer of each kind is narrated: the first MSA layer and the first MoE layer.
        self.msa_layer = next((i for i in range(cfg.num_hidden_layers) if cfg.is_sparse_attention(i)), None)
        self.moe_layer = next((i for i in range(cfg.num_hidden_layers) if cfg.is_moe(i)), None)
        self.topk = cfg.index_topk_blocks
        self.num_experts = cfg.num_local_experts

    # -- words ----------------------------------------------------------------------------------------------
    def tag(self, tag: str, text: str, level: int = 0) -> None:
        """Queue a line shown at detail >= level (0 low, 1 normal, 2 high)."""
        self.lines.append((level, _line(tag, text)))

    def print(self, text: str = "") -> None:
        print(text, file=self.out)

    def quote(self, ids: list[int]) -> str:
        text = self.tok.decode(ids)
        return repr(text if len(text) <= PREVIEW_CHARS else text[:PREVIEW_CHARS] + "...")

    def token(self, token_id: int) -> str:
        """One token as text; a piece of a multi-byte character (or a control character) by its id instead."""
        text = self.tok.decode([token_id])
        return repr(text) if text.isprintable() and "\ufffd" not in text else f"<token {token_id}>"

    @staticmethod
    def ids(blocks: list[int]) -> str:
        return " ".join(map(str, blocks))

    # -- engine events --------------------------------------------------------------------------------------
    def on_event(self, event: str, **p: Any) -> None:
        """LLMEngine observer: one handler per event, `_<event>(**payload)`. Handlers take **_ so the engine
        may add payload keys (or events) without breaking the narration."""
        if self.rows and event != "step" and _SAMPLED not in self.lines:
            self.lines.append(_SAMPLED)  # the model has run: report the sampled tokens before what follows
        handler = getattr(self, f"_{event}", None)
        if handler is not None:
            handler(**p)

    def _before_free(self, seq: Sequence, tag: str, text: str) -> None:
        """Add a line that explains why seq's blocks were just freed. The block manager reports the free first;
        the line goes before it, so the cause reads before the effect."""
        self.tag(tag, text)
        freed, at = self._last_free
        if freed is seq and at == len(self.lines) - 2:
            self.lines[at], self.lines[at + 1] = self.lines[at + 1], self.lines[at]

    def _allocate(self, seq: Sequence, blocks: list[int], **_: Any) -> None:
        first = len(seq.block_table) - len(blocks)  # the new blocks are the table's last entries
        bs = self.bm.block_size
        for b in blocks:
            self.owner[b] = seq.request_id
        self.tag("allocate", f"{seq.request_id} gets block{'s' * (len(blocks) > 1)} {self.ids(blocks)} for its "
                 f"tokens {first * bs}-{(first + len(blocks)) * bs - 1}; {self.bm.num_free_blocks} blocks free "
                 f"left", level=1)

    def _prefix_hit(self, seq: Sequence, blocks: list[int], tokens: int, **_: Any) -> None:
        self.count.prefix_hit_tokens += tokens
        revived = [b for b in blocks if self.bm.blocks[b].ref_count == 1]  # nobody else holds it: was free
        shared = [b for b in blocks if b not in revived]
        owners = sorted({self.owner[b] for b in blocks if b in self.owner})
        whose = ("its own, from before its preemption" if owners == [seq.request_id] else
                 f"computed for {', '.join(owners)}")
        how = []
        if shared:
            how.append(f"{self.ids(shared)} now shared (ref count > 1)")
        if revived:
            how.append(f"{self.ids(revived)} revived from the free list, where {'it' if len(revived) == 1 else 'they'}"
                       f" kept {'its' if len(revived) == 1 else 'their'} content")
        self.tag("prefix hit", f"{seq.request_id}: reuses {tokens} cached tokens, blocks {self.ids(blocks)}"
                 + (f" ({whose})" if owners else "") + f": {'; '.join(how)}. "
                 f"Those tokens are not computed again.")

    def _evict(self, block: int, **_: Any) -> None:
        self.count.evictions += 1
        was = self.owner.get(block)
        self.tag("evict", f"block {block}{f' (last used by {was})' if was else ''} was free but still held a "
                 f"cached prefix; the pool hands it out again, so that prefix is forgotten")

    def _admit(self, seq: Sequence, num_new_tokens: int, num_cached_tokens: int, **_: Any) -> None:
        again = seq.num_preemptions > 0
        what = f"{num_new_tokens} tokens to {'recompute' if again else 'compute'}"
        if num_cached_tokens:
            what += f", {num_cached_tokens} more found in the prefix cache"
        self.tag("admit", f"{seq.request_id}{' (again, after its preemption)' if again else ''}: first in the "
                 f"waiting queue, and the budget and the pool have room: {what}")

    def _chunk(self, seq: Sequence, num_new_tokens: int, remaining: int, **_: Any) -> None:
        self.count.chunks += 1
        start = seq.num_computed_tokens
        self.tag("chunk", f"{seq.request_id}: only tokens {start}-{start + num_new_tokens - 1} fit this step's "
                 f"token budget; the other {remaining} wait for the next step (chunked prefill)")

    def _preempt(self, seq: Sequence, needed_by: Sequence | None = None, **_: Any) -> None:
        self.count.preemptions += 1
        need = needed_by or seq
        cause = (f"{need.request_id} needs another KV block and the pool is empty, so the newest running "
                 f"sequence, {seq.request_id}, gives way" if need is not seq else
                 f"{seq.request_id} needs more KV blocks than are free, and no newer sequence can give way")
        self._before_free(seq, "preempt", f"{cause}. {seq.request_id} returns its blocks and goes back to the front "
                          f"of the waiting queue; its tokens will be computed again later (preemption by recompute).")

    def _free(self, seq: Sequence, blocks: list[int], **_: Any) -> None:
        self._last_free = (seq, len(self.lines))
        held = [b for b in blocks if self.bm.blocks[b].ref_count > 0]
        cached = [b for b in blocks if b not in held and self.bm.blocks[b].hash is not None]
        text = f"{seq.request_id} returns blocks {self.ids(blocks)}; {self.bm.num_free_blocks} free now"
        if held:
            text += f"; {self.ids(held)} still in use by another sequence"
        if cached:
            text += f"; {self.ids(cached)} keep their cached prefix until handed out again"
        self.tag("free", text, level=1)

    def _finish(self, seq: Sequence, reason: str, **_: Any) -> None:
        self.count.finished += 1
        self._before_free(seq, "finish", f"{seq.request_id}: {len(seq.output_token_ids)} tokens generated (finish "
                          f"reason '{reason}'): {self.quote(seq.output_token_ids)}")

    def _step(self, scheduled: list[Any], preempted: list[Sequence], model_input: Any, **_: Any) -> None:
        self.rows, i = [], 0
        for s in scheduled:
            ids = model_input.input_ids[i: i + s.num_new_tokens]
            i += s.num_new_tokens
            self.rows.append(Row(s.seq, s.seq.request_id, s.seq.num_computed_tokens, s.num_new_tokens, ids, s.samples))
        budget = self.engine.max_num_batched_tokens
        used = sum(r.num_new for r in self.rows)
        parts = []
        for s, r in zip(scheduled, self.rows):
            if s.is_decode:
                parts.append(f"{r.name} decodes 1")
            else:
                last = " (its last chunk)" if r.samples and r.start > s.seq.num_cached_tokens else ""
                parts.append(f"{r.name} prefills {r.num_new} (tokens {r.start}-{r.start + r.num_new - 1}){last}")
        self.tag("batch", f"{used} of the {budget}-token budget: {'; '.join(parts)}")
        self.tag("", "(decodes first, then prefills; running sequences are served before waiting ones)", level=2)
        for name, why in self._waiting_reasons(preempted, budget - used):
            self.tag("waiting", f"{name}: {why}")

    def _waiting_reasons(self, preempted: list[Sequence], left: int) -> list[tuple[str, str]]:
        """Why each waiting sequence was not admitted, from the state right after scheduling (this mirrors the
        admission loop of Scheduler.schedule)."""
        sched, bm = self.engine.scheduler, self.bm
        waiting = list(sched.waiting)
        if not waiting:
            return []
        head = waiting[0]
        if preempted:
            why = "a step that had to preempt admits no one"
        elif left <= 0:
            why = "this step's token budget is spent"
        elif len(sched.running) >= sched.config.max_num_seqs:
            why = f"max_num_seqs={sched.config.max_num_seqs} sequences are running already"
        else:
            computed = bm.computed_blocks(head)
            cached = len(computed) * bm.block_size
            n = min(head.num_tokens - cached, left)
            revive = sum(1 for b in computed if bm.blocks[b].ref_count == 0)  # cached but free: comes off the list
            need = bm.blocks_needed(cached + n) - len(computed) + revive
            why = (f"its next {n} tokens need {need} free blocks"
                   + (f" ({revive} of them cached blocks of its own, to revive)" if revive else "")
                   + f", but the pool has {bm.num_free_blocks}")
        return [(head.request_id, why)] + [(s.request_id, f"queued behind {head.request_id} (first come, first "
                                                           f"served)") for s in waiting[1:]]

    # -- model trace ----------------------------------------------------------------------------------------
    def on_trace(self, event: str, layer: int, **p: Any) -> None:
        """Model trace hook: narrate one MSA layer and one MoE layer (the first of each)."""
        if event == "msa_select" and layer == self.msa_layer:
            self._msa(layer, **p)
        elif event == "moe_route" and layer == self.moe_layer:
            self._moe(layer, **p)

    def _msa(self, layer: int, index_q: torch.Tensor, index_cache: torch.Tensor, meta: Any,
             selection: torch.Tensor, **_: Any) -> None:
        """For each sequence's newest query: the blocks each KV group selected, with their block scores
        (recomputed for that one query with the reference indexer; the own block is forced in, whatever its
        score)."""
        self.count.msa_selections += 1
        bs = meta.block_size
        end = 0
        dense = []  # sequences whose query sees no more than top-k blocks
        for s, row in enumerate(self.rows):
            end += row.num_new
            t = end - 1
            seq_len = meta.seq_lens_cpu[s]
            pos = meta.positions[t: t + 1]
            n_blocks = -(-seq_len // bs)
            head = f"layer {layer}, {row.name}'s newest query (position {int(pos)}) sees {n_blocks} blocks"
            if n_blocks <= self.topk:
                dense.append(f"{row.name} ({n_blocks} block{'s' * (n_blocks > 1)})")
                continue
            keys = reference.gather_context(index_cache, meta.block_tables[s], seq_len)
            scores = reference.msa_block_scores(index_q[t: t + 1], keys, pos, bs)[:, 0].tolist()  # [G][block]
            own = int(pos) // bs
            table = meta.block_tables[s][:n_blocks].tolist()
            self.tag("MSA", f"{head}, keeps {self.topk} per KV group (block b = entry b of {row.name}'s block "
                     f"table {table}):")
            for g, sel in enumerate(selection[t].tolist()):
                chosen = [b for b in sel if b >= 0]
                if g == 0 or self.detail >= 2:  # group 0 in full (every group at high detail)
                    picked = ", ".join(f"{b} (own block, forced)" if b == own else f"{b} (score {scores[g][b]:.2f})"
                                       for b in chosen)
                    dropped = ", ".join(f"{b} ({scores[g][b]:.2f})" for b in range(n_blocks) if b not in chosen)
                    self.tag("", f"group {g} selects {picked}; drops {dropped}")
            others = [f"group {g}: {self.ids(sorted(b for b in sel if b >= 0))}"
                      for g, sel in enumerate(selection[t].tolist()) if g > 0]
            if others and self.detail < 2:
                self.tag("", "; ".join(others), level=1)
        if dense:
            self.tag("MSA", f"layer {layer}: the newest query of {', '.join(dense)} sees no more than {self.topk} "
                     f"blocks, so the top-{self.topk} selection keeps them all: MSA equals dense attention there",
                     level=1)

    def _moe(self, layer: int, topk_ids: torch.Tensor, topk_weights: torch.Tensor, **_: Any) -> None:
        self.count.moe_routings += 1
        ids, weights = topk_ids.tolist(), topk_weights.tolist()
        load = Counter(e for row in ids for e in row)
        busiest = ", ".join(f"e{e} x{c}" for e, c in load.most_common(3))
        idle = self.num_experts - len(load)
        shown = "" if self.detail >= 2 or len(ids) == len(self.rows) else \
            " Below, the newest token of each sequence (-v: every token):"
        self.tag("MoE", f"layer {layer}: {len(ids)} token{'s' * (len(ids) > 1)}, each sent to {len(ids[0])} of "
                 f"{self.num_experts} experts (and the shared expert); busiest {busiest}; {idle} "
                 f"expert{'s' * (idle != 1)} idle.{shown if self.detail >= 1 else ''}")
        t = 0
        for row in self.rows:
            for j, token in enumerate(row.token_ids):
                if self.detail >= 2 or j == row.num_new - 1:
                    route = ", ".join(f"e{e} {w:.2f}" for e, w in sorted(zip(ids[t], weights[t]), key=lambda x: -x[1]))
                    self.tag("", f"{row.name} {self.token(token):>11} -> {route}", level=1)
                t += 1

    # -- after the step -------------------------------------------------------------------------------------
    def flush(self, number: int, arrivals: list[Sequence]) -> None:
        """Print step `number`: arrivals, the buffered lines, the sampled tokens, block tables and the pool."""
        self.count.steps += 1
        self.print(f"--- step {number} " + "-" * (RULE_WIDTH - 10 - len(str(number))))
        for seq in arrivals:
            self.print(_line("arrive", f"{seq.request_id}: a {seq.num_prompt_tokens}-token prompt "
                             f"{self.quote(seq.prompt_token_ids)}, up to {seq.params.max_tokens} new tokens"))
        if _SAMPLED not in self.lines:
            self.lines.append(_SAMPLED)
        for item in self.lines:
            if item is _SAMPLED:
                self._sampled()
            elif self.detail >= item[0]:
                self.print(item[1])
        if not self.rows:
            self.print("  (nothing could run this step)")
        self._tables()
        self.lines, self.rows = [], []

    def _sampled(self) -> None:
        toks = [f"{r.name} {self.token(r.seq.output_token_ids[-1])}" for r in self.rows if r.samples]
        if toks and self.detail >= 1:
            self.print(_line("sample", f"one new token each: {', '.join(toks)}"))

    def _tables(self) -> None:
        if self.detail < 1:
            return
        running = self.engine.scheduler.running
        shared = {b for s in running for b in s.block_table if self.bm.blocks[b].ref_count > 1}
        for i, seq in enumerate(running):
            table = " ".join(f"{b}*" if b in shared else str(b) for b in seq.block_table)
            self.print(_line("tables" if i == 0 else "", f"{seq.request_id} [{table}]  {seq.num_computed_tokens} "
                             f"of {seq.num_tokens} tokens in the KV cache"))
        if shared:
            self.print(_line("", "(* = shared: the same physical block in several block tables)"))
        cached = sum(1 for b in self.bm.free if self.bm.blocks[b].hash is not None)
        self.print(_line("pool", f"{self.bm.num_free_blocks} of {self.bm.num_blocks} blocks free"
                         + (f", {cached} of them still holding a cached prefix" if cached else "")))
        if self.detail >= 2:
            self.print(_line("", f"by block id: {self._pool_map()}   (letter = owner, * = shared, o = free but "
                                 f"cached, . = free)"))

    def _pool_map(self) -> str:
        owners: dict[int, set[str]] = {}
        for seq in self.engine.scheduler.running:
            for b in seq.block_table:
                owners.setdefault(b, set()).add(seq.request_id)
        cells = []
        for blk in self.bm.blocks:
            o = owners.get(blk.block_id)
            cells.append(("*" if len(o) > 1 else next(iter(o))) if o else "o" if blk.hash is not None else ".")
        return "".join(cells)


# ------------------------------------------------------------------------------------------------------------
# The run: add each request at its arrival step, step the engine, narrate.
# ------------------------------------------------------------------------------------------------------------


@dataclass
class Result:
    engine: LLMEngine
    narrated: Narrated


def run(scenario: str = "all", detail: str = "normal", pause: bool = False, delay: float = 0.0,
        out: TextIO | None = None, wait: Callable[[], Any] = input) -> Result:
    """Run one scenario and narrate it to `out` (stdout by default). Returns the engine, whose counters can be
    set against the narrated totals. `pause` waits for `wait()` (Enter) between steps; `delay` sleeps."""
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}; choose one of {', '.join(SCENARIOS)}")
    if detail not in DETAILS:
        raise ValueError(f"unknown detail {detail!r}; choose one of {', '.join(DETAILS)}")
    out = out or sys.stdout
    # m3-tiny's matrices are tiny: with several threads, synchronising them costs more than the math.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(SCENARIOS[scenario], detail, pause, delay, out, wait)
    finally:
        torch.set_num_threads(threads)


def _run(scenario: Scenario, detail: str, pause: bool, delay: float, out: TextIO, wait: Callable[[], Any]
         ) -> Result:
    engine = build_engine(scenario)
    narrator = Narrator(engine, detail, out)
    engine.add_observer(narrator.on_event)
    engine.executor.runner.model.set_trace(narrator.on_trace)
    try:
        _intro(engine, scenario, out)
        pending = sorted(scenario.requests, key=lambda r: r.arrives)
        step = 0
        while pending or engine.has_unfinished_requests():
            step += 1
            if pending and pending[0].arrives > step and not engine.has_unfinished_requests():
                step = pending[0].arrives  # nothing to run until the next arrival: skip the idle steps
            arrivals = []
            for plan in [r for r in pending if r.arrives <= step]:
                pending.remove(plan)
                ids = [t for part in plan.parts for t in _fit(engine.tokenizer, part, engine.block_size)]
                engine.add_request(plan.name, {"prompt_token_ids": ids},
                                   SamplingParams(temperature=0.0, max_tokens=plan.max_tokens, ignore_eos=True))
                arrivals.append(engine.requests[plan.name].seqs[0])
            engine.step()
            narrator.flush(step, arrivals)
            engine.block_manager.check_integrity()
            if pause:
                try:
                    wait()
                except EOFError:
                    pause = False
            elif delay:
                time.sleep(delay)
        _summary(engine, narrator.count, out)
    finally:
        engine.executor.runner.model.set_trace(None)
    return Result(engine, narrator.count)


def _intro(engine: LLMEngine, scenario: Scenario, out: TextIO) -> None:
    cfg, bs = engine.model_config, engine.block_size

    def say(text: str = "") -> None:
        out.write(textwrap.fill(text, RULE_WIDTH, subsequent_indent="    ", break_on_hyphens=False) + "\n")

    layers = range(cfg.num_hidden_layers)
    say(f"nanoserve walkthrough - scenario '{scenario.name}': {scenario.title}")
    say(f"model {MODEL} (random weights: the text it writes is noise), {cfg.num_hidden_layers} layers: "
        f"{'/'.join('MSA' if cfg.is_sparse_attention(i) else 'dense' for i in layers)} attention, "
        f"{'/'.join('MoE' if cfg.is_moe(i) else 'MLP' for i in layers)} FFN")
    say(f"KV pool {engine.block_manager.num_blocks} blocks of {bs} tokens (a block = an MSA block); token budget "
        f"{engine.max_num_batched_tokens} per step; at most {engine.scheduler.config.max_num_seqs} sequences; "
        f"MSA keeps the top {cfg.index_topk_blocks} blocks per query; MoE routes each token to "
        f"{cfg.num_experts_per_tok} of {cfg.num_local_experts} experts")
    say("requests (greedy, ignore EOS, so every run is the same):")
    for r in scenario.requests:
        n = sum(p.blocks * bs + p.extra for p in r.parts)
        say(f"  {r.name}  arrives before step {r.arrives}, {n} prompt tokens: {r.role}")
    say()


def _summary(engine: LLMEngine, n: Narrated, out: TextIO) -> None:
    st = engine.stats
    rule = "=" * RULE_WIDTH
    print(f"{rule}\nsummary (engine.stats, and what the narration reported)", file=out)
    rows = [("engine steps", st.num_steps, n.steps),
            ("prefix-cache hit tokens", st.prefix_cache_hits, n.prefix_hit_tokens),
            ("preemptions", st.num_preemptions, n.preemptions),
            ("finished sequences", sum(st.finished.values()), n.finished)]
    for name, stat, told in rows:
        print(f"  {name:<26}engine {stat:<6}narrated {told}", file=out)
    print(f"  {'chunked prefill steps':<26}narrated {n.chunks}", file=out)
    print(f"  {'prefix evictions':<26}narrated {n.evictions}", file=out)
    print(f"  {'MSA / MoE layers traced':<26}narrated {n.msa_selections} / {n.moe_routings}", file=out)
    print(f"  prompt tokens {st.num_prompt_tokens}, computed {st.num_computed_prefill_tokens} (hits skip some, "
          f"preemptions recompute some), generated {st.num_generation_tokens}", file=out)
    print("  block manager integrity checked after every step: ok", file=out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nanoserve.walkthrough",
                                 description="Narrate a few requests through the nanoserve engine, step by step.")
    ap.add_argument("--scenario", choices=list(SCENARIOS), default="all",
                    help="which mechanism to show (default: all of them in one run)")
    ap.add_argument("--pause", action="store_true", help="wait for Enter between steps")
    ap.add_argument("--delay", type=float, default=0.0, metavar="SECONDS", help="sleep between steps")
    ap.add_argument("--detail", choices=DETAILS, default=None, help="how much to show (default: normal)")
    ap.add_argument("-v", "--verbose", action="store_true", help="same as --detail high")
    ap.add_argument("-q", "--quiet", action="store_true", help="same as --detail low")
    args = ap.parse_args(argv)
    if sum(map(bool, (args.detail, args.verbose, args.quiet))) > 1:
        ap.error("choose one of --detail, -v, -q")
    detail = args.detail or ("high" if args.verbose else "low" if args.quiet else "normal")
    if args.delay < 0:
        ap.error("--delay must be >= 0")
    wait = lambda: input("  (Enter for the next step) ")  # noqa: E731
    try:
        run(args.scenario, detail, args.pause, args.delay, wait=wait)
    except BrokenPipeError:  # piped into `head` and the reader has seen enough: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's recipe, so exit stays quiet
    return 0


if __name__ == "__main__":
    sys.exit(main())
