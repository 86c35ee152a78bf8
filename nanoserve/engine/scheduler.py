"""Continuous batching under one token budget per step.

Each step the scheduler fills a budget of `max_num_batched_tokens` tokens:

1. Running sequences first, oldest first: one token for each decode, or the next chunk of a prompt still being
   prefilled. If the KV pool runs out, the newest running sequence is preempted (its blocks freed, to be
   recomputed later) and goes back to the front of the waiting queue.
2. Then waiting sequences, first come first served, while the budget, `max_num_seqs` and the pool allow. A prompt
   longer than what is left of the budget is split (chunked prefill) and continues next step.

With the "priority" policy (vLLM's `--scheduling-policy priority`) "oldest" and "newest" above read as "best" and
"worst" by (priority, arrival): the running sequences are served best first, the worst is preempted first, and
the waiting queue is kept in that order - a lower priority value is served sooner, whatever its arrival.

The batch is ordered decodes first, then prefills (the attention kernels rely on it). The switches of this layer:
continuous_batching off = a new batch is admitted only when the previous one has finished; chunked_prefill off =
a prompt is scheduled whole or not at all; paged_kv off = a sequence reserves max_model_len tokens of KV when
admitted; prefix_caching off = no cache lookups.

Prefill/decode disaggregation (a KV connector, engine/kv_connector.py): a decode whose prompt's KV comes from a
prefill server is admitted into `loading` instead - blocks for its whole prompt, no tokens scheduled, never
preempted - and joins the running sequences once its blocks have arrived, with only its last prompt token left to
compute; a prefill server's sequence that ends for a pull keeps its blocks (`finish`).

A prompt that asks for prompt logprobs is chunked at PROMPT_LOGPROB_CHUNK tokens even when the budget is larger:
each of its positions becomes a row of fp32 logits over the whole vocabulary (8192 rows x 200k tokens would be
6.5 GB), so the chunk bounds that memory.

Images and videos (a prompt's `mm_features`): a chunk that reaches an item's placeholder tokens needs the item's
features, so the item is encoded in the same step unless the encoder cache holds them already
(engine/encoder_cache.py). The vision model has a budget of its own per step; an item that does not fit what is
left of it (or of the cache) cuts the chunk just before the item's first placeholder, and it is encoded in a later
step. A chunk may end inside an item's placeholders: the rest of its features wait in the cache for the next chunk.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from nanoserve.config import Optimizations
from nanoserve.engine.block_manager import BlockManager, EventHook
from nanoserve.engine.encoder_cache import EncoderCacheManager
from nanoserve.engine.kv_connector import KVConnector
from nanoserve.engine.sequence import FinishReason, Sequence, SequenceStatus
from nanoserve.kv_transfer.params import RemotePrefill
from nanoserve.spec_decode.proposer import speculable
from nanoserve.step import EncoderInput, MultiModalFeature

PROMPT_LOGPROB_CHUNK = 2048
"""Most prompt tokens per step of a sequence that needs prompt logprobs (chunked prefill on): 2048 fp32 rows of a
200k vocabulary are 1.6 GB."""


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    opts: Optimizations
    policy: str = "fcfs"
    num_speculative_tokens: int = 0
    """Speculative decoding: k, the most drafts a sequence verifies per step (0: no speculative decoding)."""
    draft_writes_kv: bool = False
    """The drafter is a model with a KV cache of its own (mtp, eagle3): its later drafts are computed one position
    further each, so a sampling sequence needs blocks up to k - 1 positions past its step (lookahead)."""


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens computed for it this step (its query length), draft tokens included
    num_draft: int = 0
    """Speculative decoding: the last num_draft of those tokens are seq.spec_token_ids[:num_draft], verified by
    this step (a decode of 1 + num_draft positions)."""
    max_drafts: int = 0
    """Speculative decoding: how many drafts the step may propose for this sequence's next one (StepSeq)."""
    on_device: bool = False
    """Speculative decoding, async: its query - newest token and drafts - and its position are those the previous
    step, still in flight, left on the device (StepSeq.on_device)."""
    num_padded: int = 0
    """Speculative decoding (switch spec_pad_drafts): the last num_padded of its drafts are padding - its newest
    token repeated - so that every sequence of the batch verifies as many (`Scheduler._pad_drafts`)."""
    features: list[tuple[str, MultiModalFeature]] = field(default_factory=list)
    """Its images and videos with placeholders in this step's tokens, each with its encoder-cache key."""

    @property
    def draft(self) -> list[int]:
        return self.seq.spec_token_ids[: self.num_draft]

    @property
    def proposed(self) -> int:
        """Drafts a drafter proposed (num_draft less the padding)."""
        return self.num_draft - self.num_padded

    @property
    def is_decode(self) -> bool:
        """Computes just the newest sampled token (and drafts to verify after it). A prompt's last token is
        prefill even when it is the only one left to compute (a full prefix-cache hit), so the prefill counters
        see it."""
        seq = self.seq
        return self.num_new_tokens - self.num_draft == 1 and \
            seq.num_prompt_tokens <= seq.num_computed_tokens == seq.num_tokens - 1

    @property
    def samples(self) -> bool:
        """Does this step finish computing the sequence's tokens, so a next token is sampled?"""
        return self.seq.num_computed_tokens + self.num_new_tokens - self.num_draft == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)  # taken from the waiting queue this step
    encoder_inputs: list[EncoderInput] = field(default_factory=list)  # images / videos the step encodes
    encoder_frees: list[str] = field(default_factory=list)  # encoder-cache keys the runner drops first

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Decides, each step, which sequences run and how many of their tokens (see module docstring)."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, on_event: EventHook | None = None,
                 kv_connector: KVConnector | None = None, encoder: EncoderCacheManager | None = None):
        self.config = config
        self.bm = block_manager
        self.encoder = encoder  # the encoder cache's books (None: the model takes no images or videos)
        self._encoder_left = 0  # what this step's encoder budget has left
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.loading: list[Sequence] = []
        """P/D decodes holding blocks for their prompt while its KV is pulled (LOADING_REMOTE_KV)."""
        self.failed_loads: list[Sequence] = []
        """P/D decodes whose pull failed under kv_load_failure_policy "fail": finished here, the engine reports
        them (LLMEngine.outputs)."""
        self.kv = kv_connector
        self.on_event = on_event or (lambda *a, **k: None)
        self.num_preemptions = 0

    @property
    def opts(self) -> Optimizations:
        return self.config.opts

    @property
    def by_priority(self) -> bool:
        return self.config.policy == "priority"

    @staticmethod
    def rank(seq: Sequence) -> tuple[int, float, int]:
        """The priority policy's order: lower priority value first, then earlier arrival."""
        return seq.priority, seq.arrival_time, seq.seq_id

    def add(self, seq: Sequence) -> None:
        self._enqueue(seq, front=False)

    def _enqueue(self, seq: Sequence, front: bool) -> None:
        """Into the waiting queue: at the back (new) or the front (preempted) first come first served; in rank
        order under the priority policy (a short scan from the back: arrivals mostly rank last)."""
        if not self.by_priority:
            if front:
                self.waiting.appendleft(seq)
            else:
                self.waiting.append(seq)
            return
        key, i = self.rank(seq), len(self.waiting)
        while i and self.rank(self.waiting[i - 1]) > key:
            i -= 1
        self.waiting.insert(i, seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    # -- one step -----------------------------------------------------------------------------------------
    def schedule(self, drafts_on_device: frozenset[int] | set[int] = frozenset()) -> SchedulerOutput:
        """This step's batch. `drafts_on_device`: sequences whose previous step (speculative, still in flight)
        accepts an unknown number of its drafts, of which this step takes its query on the device: their blocks
        cover the most that step can accept (`_lookahead`)."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        chunked = self.opts.chunked_prefill
        if self.kv is not None:  # P/D: free what was pulled, run the decodes whose KV arrived
            self._kv_progress()
        self._encoder_left = self.encoder.budget if self.encoder is not None else 0

        # 1. running sequences, oldest (best) first; preempt the newest (worst) when the pool is full
        queue = sorted(self.running, key=self.rank) if self.by_priority else list(self.running)
        while queue and budget > 0:
            seq = queue.pop(0)
            if seq.num_pending and seq.reached_length_limit(self.config.max_model_len):
                continue  # its last token is still on the device (async scheduling): nothing left to compute
            remaining = seq.num_tokens - seq.num_computed_tokens
            n = self._chunk(seq, remaining, budget, chunked)
            if n > budget:
                continue  # unchunked prefill that does not fit this step's leftover budget
            n, encode = self._plan_encoder(seq, seq.num_computed_tokens, n)
            if n < 1 or (not chunked and n < remaining):
                continue  # its next placeholders need an encoder this step cannot give
            # speculative decoding: a decode verifies its drafts too, as far as the budget and the pool allow
            draft = min(len(seq.spec_token_ids), budget - n) if remaining == 1 else 0
            if draft and not self.bm.allocate(seq, seq.num_computed_tokens + n + draft):
                draft = 0
            while not self.bm.allocate(seq, seq.num_computed_tokens + n + draft):
                victim = queue.pop() if queue else seq
                self._preempt(victim, out, needed_by=seq)
                if victim is seq:
                    break
            else:
                out.scheduled.append(self._with_features(ScheduledSeq(seq, n + draft, draft), encode, out))
                budget -= n + draft

        # 2. waiting sequences, first come first served
        admit = self.opts.continuous_batching or not self.running
        while admit and self.waiting and budget > 0 and \
                len(self.running) + len(self.loading) < self.config.max_num_seqs and not out.preempted:
            seq = self.waiting[0]
            if isinstance(seq.kv_transfer, RemotePrefill):  # P/D decode: its prompt's KV is pulled, not computed
                if not self._admit_loading(seq, out):
                    break
                continue
            computed = self.bm.computed_blocks(seq)
            num_cached = len(computed) * self.bm.block_size
            remaining = seq.num_tokens - num_cached
            n = self._chunk(seq, remaining, budget, chunked)
            if n > budget:
                break
            n, encode = self._plan_encoder(seq, num_cached, n)
            if n < 1 or (not chunked and n < remaining):
                break  # its first placeholders need an encoder this step cannot give
            reserve = num_cached + n if self.opts.paged_kv else max(self.config.max_model_len, seq.num_tokens)
            if not self.bm.allocate(seq, reserve, computed):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            seq.num_computed_tokens = num_cached
            seq.num_cached_tokens = num_cached
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            self.running.append(seq)
            out.admitted.append(seq)
            out.scheduled.append(self._with_features(ScheduledSeq(seq, n), encode, out))
            budget -= n
            self.on_event("admit", seq=seq, num_new_tokens=n, num_cached_tokens=num_cached)

        for s in out.scheduled:
            if s.num_new_tokens < s.seq.num_tokens - s.seq.num_computed_tokens:
                self.on_event("chunk", seq=s.seq, num_new_tokens=s.num_new_tokens,
                              remaining=s.seq.num_tokens - s.seq.num_computed_tokens - s.num_new_tokens)
        # decodes (one new token) first: the attention kernels take the batch in that order (a decode that
        # verifies drafts has several and runs with the prefills)
        out.scheduled.sort(key=lambda s: s.num_new_tokens != 1)
        if self.config.num_speculative_tokens:
            self._pad_drafts(out, budget)
            for s in out.scheduled:
                if s.samples:
                    s.on_device = s.seq.seq_id in drafts_on_device
                    s.max_drafts = self._lookahead(s)
        if self.encoder is not None:
            out.encoder_frees = self.encoder.take_freed()
        return out

    # -- prefill/decode disaggregation -----------------------------------------------------------------------
    def _admit_loading(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """A P/D decode from the waiting queue: its local prefix hits, then blocks for the rest of its prompt,
        whose KV the connector pulls from the prefill server; it computes nothing until that has arrived."""
        computed = self.bm.computed_blocks(seq)
        reserve = seq.num_tokens if self.opts.paged_kv else max(self.config.max_model_len, seq.num_tokens)
        if not self.bm.allocate(seq, reserve, computed):
            return False
        self.waiting.popleft()
        seq.status = SequenceStatus.LOADING_REMOTE_KV
        seq.num_computed_tokens = seq.num_cached_tokens = len(computed) * self.bm.block_size
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = time.monotonic()
        self.loading.append(seq)
        out.admitted.append(seq)
        # the blocks to fill hold its prompt but the last token (computed here): none when the cache has those
        first = len(computed)
        self.kv.load(seq, first, seq.block_table[first: self.bm.blocks_needed(seq.num_prompt_tokens - 1)])
        self.on_event("kv_load", seq=seq, num_cached_tokens=seq.num_cached_tokens)
        return True

    def _kv_progress(self) -> None:
        """The connector's news since the last schedule: blocks to free, decodes whose KV arrived (they run now,
        their full blocks enter the prefix cache), pulls that failed (kv_load_failure_policy: the request fails,
        or it computes its prompt here as any other)."""
        released, loaded, failed = self.kv.progress()
        for seq in released:
            self.bm.free_seq(seq)
        for seq in loaded:
            self.loading.remove(seq)
            seq.status = SequenceStatus.RUNNING
            seq.num_computed_tokens = seq.num_prompt_tokens - 1  # (the last one is computed here, for its logits)
            seq.num_external_tokens = max(0, seq.num_computed_tokens - seq.num_cached_tokens)
            seq.num_cached_tokens = seq.num_computed_tokens
            self.running.append(seq)
            self.bm.cache_full_blocks(seq)
            self.on_event("kv_loaded", seq=seq, num_external_tokens=seq.num_external_tokens)
        for seq in failed:
            if self.kv.config.kv_load_failure_policy == "recompute":
                self.loading.remove(seq)
                self.bm.free_seq(seq)
                seq.kv_transfer, seq.status, seq.num_computed_tokens = None, SequenceStatus.WAITING, 0
                self._enqueue(seq, front=True)
            else:
                self.finish(seq, FinishReason.ERROR)
                self.failed_loads.append(seq)

    def take_failed_loads(self) -> list[Sequence]:
        failed, self.failed_loads = self.failed_loads, []
        return failed

    # -- images and videos ----------------------------------------------------------------------------------
    def _plan_encoder(self, seq: Sequence, start: int, n: int) -> tuple[int, list[MultiModalFeature]]:
        """The tokens [start, start + n) of seq may run this step if the items whose placeholders they reach have
        features: held in the encoder cache (now counted as used by seq), or encoded in this step. Returns how many
        may run - cut before the first item that what is left of the encoder budget or the cache cannot take - and
        the items to encode (entered in the cache by `_with_features` once the step takes seq)."""
        enc = self.encoder
        if enc is None or start >= seq.mm_end:
            return n, []
        plan: list[MultiModalFeature] = []
        keys: set[str] = set()
        rows = 0
        for f in seq.mm_features:
            if f.offset >= start + n:
                break
            if f.end <= start or enc.use_cached(seq, f) or enc.key(seq, f) in keys:
                continue  # passed, or held (the same item twice in a prompt is encoded once)
            if not enc.can_encode(f, self._encoder_left - rows, rows):
                return f.offset - start, plan
            plan.append(f)
            keys.add(enc.key(seq, f))
            rows += f.num_tokens
        return n, plan

    def _with_features(self, s: ScheduledSeq, encode: list[MultiModalFeature], out: SchedulerOutput
                       ) -> ScheduledSeq:
        """s is in the step: its items to encode enter the encoder cache and the step's encoder inputs, and s notes
        every item with placeholders in its tokens, with its key."""
        enc, seq = self.encoder, s.seq
        if enc is None or not seq.mm_features:
            return s
        for f in encode:
            if enc.key(seq, f) not in enc.rows:
                out.encoder_inputs.append(EncoderInput(enc.allocate(seq, f), f))
                self._encoder_left -= f.num_tokens
        start = seq.num_computed_tokens
        end = start + s.num_new_tokens - s.num_draft
        s.features = [(enc.key(seq, f), f) for f in seq.mm_features if f.offset < end and f.end > start]
        return s

    def _pad_drafts(self, out: SchedulerOutput, budget: int) -> None:
        """Batches that mix (switch spec_pad_drafts, with CUDA graphs for verify steps): where every scheduled
        sequence decodes and some verify drafts, the ones with fewer drafts than the most are padded up to it with
        their newest token repeated, so that the step is one query length for all - a verify step that replays a
        graph, not an eager batch of mixed lengths. Exact: a greedy draft is accepted only where it is the argmax
        anyway, and rejection sampling keeps the target distribution whatever the draft (a padding token accepted
        is a token gained). Sequences that cannot verify (their sampling reads their own output, a structured
        output, min_tokens still pending) or whose padded positions would pass max_model_len keep the batch as it
        is."""
        opts = self.opts
        if not (opts.spec_pad_drafts and opts.cuda_graphs and opts.spec_cuda_graphs) or not out.scheduled:
            return
        q = max(s.num_draft for s in out.scheduled)
        short = [s for s in out.scheduled if s.num_draft < q]
        if not q or not short or any(not s.is_decode or s.on_device for s in out.scheduled):
            return
        limit = self.config.max_model_len
        if sum(q - s.num_draft for s in short) > budget or not all(
                s.seq.grammar is None and speculable(s.seq.params) and
                s.seq.num_output_tokens >= s.seq.params.min_tokens and s.seq.num_computed_tokens + q + 1 <= limit
                for s in short):
            return
        if not all(self.bm.allocate(s.seq, s.seq.num_computed_tokens + 1 + q) for s in short):
            return  # (the blocks taken go back when the step's tokens arrive)
        for s in short:
            seq = s.seq
            newest = seq.output_token_ids[-1] if seq.output_token_ids else seq.prompt_token_ids[-1]
            s.num_padded = q - s.num_draft
            seq.spec_token_ids = s.draft + [newest] * s.num_padded
            s.num_new_tokens, s.num_draft = 1 + q, q

    def _lookahead(self, s: ScheduledSeq) -> int:
        """How many drafts the step may make for s's next step: k; with a draft model only as many as the blocks
        for their positions allow - the i-th draft is computed at up to i - 1 positions past the step's last,
        within max_model_len - taken here, after everything else was scheduled, and given back when the tokens
        arrive (`accept_drafts`); 1 (no extra position) when the pool has no block for them."""
        k = self.config.num_speculative_tokens
        if not self.config.draft_writes_kv:
            return k
        # (a query taken on the device may start up to k positions later than the host knows)
        end = s.seq.num_computed_tokens + s.num_new_tokens + (k if s.on_device else 0)
        k = max(1, min(k, self.config.max_model_len - end + 1))
        return k if k == 1 or self.bm.allocate(s.seq, end + k - 1) else 1

    @staticmethod
    def _chunk(seq: Sequence, remaining: int, budget: int, chunked: bool) -> int:
        """How many of `seq`'s remaining tokens to run this step: all of them unchunked, else what the budget
        leaves, and at most PROMPT_LOGPROB_CHUNK while the sequence still needs prompt logprobs."""
        if not chunked:
            return remaining
        if seq.needs_prompt_logprobs:
            budget = min(budget, PROMPT_LOGPROB_CHUNK)
        return min(remaining, budget)

    def _preempt(self, seq: Sequence, out: SchedulerOutput, needed_by: Sequence | None = None) -> None:
        """Preemption by recompute: free the blocks, requeue at the front; its tokens are recomputed later
        (full blocks it registered in the prefix cache may still be hit then). `needed_by` is the sequence whose
        growth ran the pool dry (seq itself when it preempts itself); the event reports it."""
        self.bm.free_seq(seq)
        if self.encoder is not None:
            self.encoder.release_all(seq)
        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.spec_token_ids = []
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(seq, front=True)
        out.preempted.append(seq)
        self.on_event("preempt", seq=seq, needed_by=needed_by or seq)

    # -- after the step -----------------------------------------------------------------------------------
    def update_after_step(self, out: SchedulerOutput) -> list[ScheduledSeq]:
        """The step is launched: advance computed-token counts and register newly full blocks in the prefix cache.
        Draft tokens are not counted: the ones accepted are added when the step's tokens arrive (accept_drafts).
        Returns the sequences that get a token from it, each now holding one pending (`Sequence.num_pending`: its
        value is on the device until the engine receives it)."""
        sampled = [s for s in out.scheduled if s.samples]
        for s in sampled:
            s.seq.num_pending += 1
        for s in out.scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens - s.num_draft
            self.bm.cache_full_blocks(s.seq)
            for _, f in s.features:  # items whose placeholders are all computed now: their features may go
                if f.end <= s.seq.num_computed_tokens:
                    self.encoder.release(s.seq, f)
        return sampled

    def reserve(self, reach: list[tuple[Sequence, int]]) -> bool:
        """Grow each sequence's blocks to cover its number of tokens (several speculative steps per launch: the
        farthest they can write), all or none: False, with nothing taken, when the pool cannot hold them all. What
        the steps leave unused goes back in `accept_drafts`."""
        if not self.opts.paged_kv:
            return all(n <= len(seq.block_table) * self.bm.block_size for seq, n in reach)
        before = {seq.seq_id: len(seq.block_table) for seq, _ in reach}
        for seq, n in reach:
            if not self.bm.allocate(seq, n):
                for s, _ in reach:
                    self.bm.trim(s, before[s.seq_id] * self.bm.block_size)
                return False
        return True

    def accept_drafts(self, seq: Sequence, num_accepted: int) -> None:
        """A speculative step's result: its first num_accepted drafts were right, so their K/V (written by the step)
        is kept; the blocks that only the rejected ones (or the drafter's lookahead) needed go back to the pool.
        Call after their tokens are appended."""
        seq.num_computed_tokens += num_accepted
        # (off, the sequence keeps the max_model_len of blocks it reserved; with a later step in flight, that step
        # writes past what is computed: its blocks go back when its own tokens arrive)
        if self.opts.paged_kv and not seq.num_pending:
            self.bm.trim(seq, seq.num_computed_tokens)
        self.bm.cache_full_blocks(seq)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End a sequence (stop, length or abort) wherever it is, returning its blocks."""
        if seq.status == SequenceStatus.FINISHED:
            return
        free = True
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.loading:  # (its blocks wait for a read in flight to end)
            self.loading.remove(seq)
            free = self.kv.abort(seq)
        if free and not (self.kv is not None and self.kv.hold(seq, reason)):  # (P/D: kept for a decode server)
            self.bm.free_seq(seq)
        if self.encoder is not None:
            self.encoder.release_all(seq)
        seq.num_pending = 0  # a token of it still in flight is dropped when it arrives
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finished_time = time.monotonic()
        self.on_event("finish", seq=seq, reason=reason.value)
