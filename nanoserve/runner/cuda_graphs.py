"""GraphRunner: decode steps - and, with switch `spec_cuda_graphs`, speculative verify steps - replayed as CUDA/HIP
graphs (switch `cuda_graphs`; reference: the eager forward in `ModelRunner.execute`).

A decode step launches a few hundred small kernels; at batch size 1 their launch cost alone is a large share of a
~1.5 ms step. A captured graph replays all of them with one launch. Graphs need fixed shapes and fixed addresses,
so the runner keeps static input buffers sized for the largest batch and captures one graph per
(batch-size bucket, context-length bucket) - and per query length for verify steps:

- batch buckets (`BATCH_BUCKETS`, up to max_num_seqs): a batch of n decodes runs in the smallest bucket >= n.
  Padding rows carry token 0 at position 0 with seq_len 1, an all-zero block table row and slot -1 (no cache
  write); their outputs are computed and dropped.
- context buckets (`SEQ_LEN_BUCKETS`, up to max_model_len): the captured AttentionMetadata says
  max_seq_len = the bucket, so the decode kernels' grids (which depend only on the batch size, the head counts
  and meta.max_seq_len) are fixed; a short context does not pay for a grid sized for max_model_len.
- query length q: 1 for a decode step. A speculative verify step (switch `spec_cuda_graphs`) feeds every sequence
  the same q = 1 + drafts tokens (2 <= q <= k + 1) and wants the logits of all of them: its graph runs the batch as
  bs sequences of q tokens (query_start_loc 0, q, 2q, ...; positions seq_len - q .. seq_len - 1), and the static
  buffers hold max_bs * (k + 1) tokens. Its padding sequences have seq_len q, positions 0 .. q - 1 and slot -1.
  Such a batch takes the prefill kernels' paths (num_decode_seqs 0): their grids and tiles depend only on the
  host-side query lengths ([q] * bs) and context lengths (the bucket), which are fixed for the key; everything
  per step (positions, lengths, tables, query starts) is read on the device.

Each step copies its inputs into the static buffers (pinned host staging, one asynchronous copy per buffer; the
block tables and slots are computed by the same functions as an eager step's, runner/input_prep.py),
replays the graph, and returns a view of the static logits [n, vocab] (valid until the next replay). With
`captured_argmax` the graph also writes each row's argmax into a static token buffer (`tokens`), so a batch of
plain greedy rows needs no kernel after the replay but a copy of its tokens (runner/sampler.py). A graph is
captured the first time its key is needed, after one eager warm-up run of the same padded batch (which compiles
the Triton kernels outside the capture); `capture_all` captures every decode batch bucket ahead of time. All graphs
share one memory pool. A failed decode capture turns every graph off (decode and verify run eagerly); a failed
verify capture turns the verify graphs off only.

A model-based drafter (MTP, EAGLE-3) reads what each target step computed for every row: its `keep` function
(`DraftRunner.read`) runs inside the captured forward and writes into a static buffer (`kept`), so after a replay
the drafter reads a view of it.

Graphs apply only where every kernel on the decode and verify paths is graph-safe: the Triton attention, MSA, MoE
and QK-norm/RoPE/KV-insert kernels (their reference paths loop over sequences in Python or use data-dependent
shapes; the MSA prefill grouped by block, `msa_sparse_by_block`, sorts and tiles on the device without a host
synchronisation), on a CUDA/HIP device, with tensor_parallel_size 1. Otherwise decode runs eagerly and the reason
is logged once.
"""

from __future__ import annotations

import logging
from typing import Callable

import numpy as np
import torch

from nanoserve.batch import AttentionMetadata, TokenFeed, VerifyFeed
from nanoserve.config import KERNEL, MODEL, Optimizations
from nanoserve.kernels import triton_usable
from nanoserve.parallel_state import get_tp
from nanoserve.runner.input_prep import apply_token_feed, fill_block_tables, slot_mapping

logger = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512)
"""Captured decode batch sizes (then capped at max_num_seqs). Padding rows cost little: decode is bound by the
weight reads, and padding rows all route to the same experts and attend one key."""
SEQ_LEN_BUCKET_FIRST, SEQ_LEN_BUCKET_GROWTH = 4096, 4
"""Context-length buckets: 4k, 16k, 64k, ... then max_model_len."""

Replay = Callable[[], None]
CaptureFn = Callable[[Callable[[], None]], Replay]
Keep = Callable[[torch.Tensor], torch.Tensor]
"""What a drafter reads of a forward: the model's final hidden states [T, H] -> [T, width] (spec_decode/drafter.py)."""
VerifyKey = tuple[int, int, int]
"""A verify graph's key: (batch bucket, context bucket, query length per sequence); a decode graph's is the first
two."""


def batch_buckets(max_num_seqs: int) -> list[int]:
    cap = max(1, min(max_num_seqs, BATCH_BUCKETS[-1]))
    return [b for b in BATCH_BUCKETS if b < cap] + [cap]


def seq_len_buckets(max_model_len: int) -> list[int]:
    out, b = [], SEQ_LEN_BUCKET_FIRST
    while b < max_model_len:
        out.append(b)
        b *= SEQ_LEN_BUCKET_GROWTH
    return out + [max_model_len]


def switch_state(opts: Optimizations) -> tuple[bool, ...]:
    """The switches the model reads at forward time (the MODEL and KERNEL layers of their declarations): a graph
    bakes in the kernels chosen when it was captured, so graphs are dropped whenever one of these changes (the
    ablation flips them on a live model)."""
    return tuple(bool(getattr(opts, n)) for n in type(opts).names(MODEL, KERNEL))


def unsupported_reason(model: torch.nn.Module, opts: Optimizations, device: torch.device) -> str | None:
    """Why decode graphs cannot be used with this model, switches and device (None = they can)."""
    if device.type != "cuda":
        return f"the device is {device.type}, not CUDA/HIP"
    if get_tp().size > 1:
        return "tensor_parallel_size > 1 (graph capture around the all-reduces is not validated yet)"
    if not triton_usable(device):
        return "Triton is not usable on this device"
    cfg = model.cfg
    needed = ["fused_qk_norm_rope"]
    if any(not cfg.is_sparse_attention(i) for i in range(cfg.num_hidden_layers)):
        needed.append("triton_attention")
    if cfg.num_sparse_attn_layers:
        needed.append("triton_msa")
    if any(cfg.is_moe(i) for i in range(cfg.num_hidden_layers)):
        needed.append("fused_moe")
    off = [n for n in needed if not getattr(opts, n)]
    if off:
        return (f"switch(es) {', '.join(off)} are off: their reference paths loop over sequences in Python or "
                f"use data-dependent shapes, which a graph cannot capture")
    return None


def cuda_graph_capture(pool) -> CaptureFn:
    """Capture `fn` into a torch.cuda.CUDAGraph that allocates from `pool`; returns its replay."""

    def capture(fn: Callable[[], None]) -> Replay:
        graph = torch.cuda.CUDAGraph()
        # thread_local: only this thread's unsafe calls break the capture (the server steps the engine in a
        # background thread while its event loop thread keeps running)
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            fn()

        def replay() -> None:
            graph.replay()
        # the graph reads tensors by address: whatever `fn` made before the capture and holds in its closure (the
        # draft graphs' index of each sequence's last row) must live as long as the graph, or the allocator hands
        # its memory to other tensors and the replays read whatever those hold
        replay.captured = fn
        return replay

    return capture


class GraphRunner:
    """The capture buckets, the static decode buffers and the graphs captured over them, for one model and one KV
    pool.

    `capture` turns a function into a replayable callable; the default records a CUDA graph. Tests on the CPU pass
    `lambda fn: fn`, which re-runs the function at every replay over the same static buffers - it checks the
    padding and buffer plumbing against the eager path without a GPU."""

    runs_eagerly = "decode and verify steps"
    """What runs eagerly once a capture has failed (for the log)."""
    verify_runs_eagerly = "verify steps"
    """What runs eagerly once a capture of a graph of several tokens per sequence has failed (for the log)."""

    def __init__(self, model: torch.nn.Module, max_num_seqs: int, max_model_len: int, block_size: int,
                 device: torch.device, capture: CaptureFn | None = None, captured_argmax: bool = False,
                 max_query_len: int = 1, keep: Keep | None = None, keep_width: int = 0,
                 keep_dtype: torch.dtype | None = None, with_logits: bool = True, feed_in_graph: bool = False):
        """max_query_len: the longest verify query a graph takes (k + 1; 1 = decode graphs only). keep: what a
        drafter reads of each forward, written into the static `kept` [tokens, keep_width] of keep_dtype.
        with_logits: allocate the static logits (a subclass whose graphs output something else does not).
        feed_in_graph (switch spec_feed_in_graph): verify graphs take a fed query from `next_ids` / `next_pos`
        themselves (`_take_feed`) instead of the host launching the copies before the replay."""
        self.model = model
        self.captured_argmax = captured_argmax
        self.device = device
        self.block_size = block_size
        self.buckets = batch_buckets(max_num_seqs)
        self.max_bs = self.buckets[-1]
        self.len_buckets = seq_len_buckets(max_model_len)
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // block_size)
        self.max_query_len = max(1, max_query_len)
        self.max_tokens = self.max_bs * self.max_query_len
        self.keep = keep
        on_cuda = device.type == "cuda"
        self._capture = capture or cuda_graph_capture(torch.cuda.graph_pool_handle())
        n, w, t = self.max_bs, self.max_blocks, self.max_tokens
        # device-side static inputs: int64 rows = input ids, positions, slots (one per token); int32 = query starts
        # + seq lens (one per sequence)
        self.i64 = torch.zeros(3, t, dtype=torch.int64, device=device)
        self.i32 = torch.zeros(2 * n + 1, dtype=torch.int32, device=device)
        self.tables = torch.zeros(n, w, dtype=torch.int32, device=device)
        self.logits = torch.zeros(t, model.cfg.vocab_size, dtype=torch.float32, device=device) \
            if with_logits else None
        self.tokens = torch.zeros(n, dtype=torch.int64, device=device)  # captured_argmax: argmax of each row
        self.kept = torch.zeros(t, keep_width, dtype=keep_dtype or torch.float32, device=device) \
            if keep is not None else None
        # host staging (pinned on a GPU, so the copies are asynchronous), written through numpy views
        self.h_i64 = torch.zeros(3, t, dtype=torch.int64, pin_memory=on_cuda)
        self.h_i32 = torch.zeros(2 * n + 1, dtype=torch.int32, pin_memory=on_cuda)
        self.h_tables = torch.zeros(n, w, dtype=torch.int32, pin_memory=on_cuda)
        self.n_i64, self.n_i32, self.n_tables = self.h_i64.numpy(), self.h_i32.numpy(), self.h_tables.numpy()
        # a verify step launched before the previous one's tokens reach the host (async speculative decoding) takes
        # its queries from here: the draft chain writes each sequence's next input ids (the bonus token, then the
        # drafts) and the position of the first; `feed` says which row each sequence takes, then how many are fed
        q = self.max_query_len
        self.next_ids = torch.zeros(n, q, dtype=torch.int64, device=device) if q > 1 else None
        self.next_pos = torch.zeros(n, dtype=torch.int64, device=device) if q > 1 else None
        self.feed_in_graph = feed_in_graph and q > 1
        if self.feed_in_graph:
            self.feed = torch.zeros(n + 1, dtype=torch.int64, device=device)
            self.h_feed = torch.zeros(n + 1, dtype=torch.int64, pin_memory=on_cuda)
            self.n_feed = self.h_feed.numpy()
        self._copied = torch.cuda.Event() if on_cuda else None
        self.graphs: dict[tuple[int, int], Replay] = {}
        self.verify_graphs: dict[VerifyKey, Replay] = {}
        self.disabled: str | None = None
        self.verify_disabled: str | None = None
        """Why verify graphs are off (a capture failed) while decode graphs go on; None = they are on."""

    # -- which graph ----------------------------------------------------------------------------------------
    def fits(self, num_seqs: int, max_seq_len: int, max_table_len: int, query_len: int = 1) -> bool:
        """May a batch of num_seqs sequences of query_len tokens each replay a graph?"""
        if query_len > 1 and (self.verify_disabled is not None or query_len > self.max_query_len):
            return False
        return (self.disabled is None and num_seqs <= self.max_bs and max_seq_len <= self.max_model_len
                and max_table_len <= self.max_blocks)

    def key(self, num_seqs: int, max_seq_len: int) -> tuple[int, int]:
        bs = next(b for b in self.buckets if b >= num_seqs)
        length = next(b for b in self.len_buckets if b >= max_seq_len)
        return bs, length

    # -- one step ---------------------------------------------------------------------------------------------
    def run(self, input_ids: list[int], seq_lens: list[int], block_tables: list[list[int]],
            feed: TokenFeed | None = None, query_len: int = 1, verify_feed: VerifyFeed | None = None
            ) -> torch.Tensor | None:
        """One step of query_len new tokens per sequence with every token's logits wanted - a decode step
        (query_len 1, each sequence sampled) or a verify step: logits [n x query_len, vocab] (a view of the static
        output, valid until the next replay), or None if the graph could not be captured. `feed`: input ids copied
        on the device from the previous step's tokens, after the staging (async scheduling); `verify_feed`: the
        verify step's queries and positions from the previous step's draft chain (async speculative decoding)."""
        n = len(seq_lens)
        bs, length = self.key(n, max(seq_lens))
        in_graph = self.feed_in_graph and query_len > 1  # (then every verify step says how many rows are fed)
        feed_rows = (verify_feed.rows if verify_feed is not None else []) if in_graph else None
        self.stage(input_ids, seq_lens, block_tables, bs, query_len, feed_rows)
        apply_token_feed(self.i64[0], feed)
        if verify_feed is not None and not in_graph:
            self.apply_verify_feed(verify_feed, n, query_len)
        if not self.replay(bs, length, query_len):
            return None
        return self.logits[: n * query_len]

    def apply_verify_feed(self, feed: VerifyFeed, n: int, q: int) -> None:
        """Write the fed queries over the staged placeholders, on the device: the input ids, the positions from
        each sequence's first, its context length after the step, and the slots those positions have in its block
        table (staged already, covering the farthest it can reach)."""
        src = torch.tensor(feed.rows, dtype=torch.int64)
        if self.device.type == "cuda":
            src = src.pin_memory().to(self.device, non_blocking=True)
        first = feed.pos[src]
        pos = first[:, None] + torch.arange(q, device=self.device)[None, :]
        self.i64[0, : n * q].copy_(feed.ids[src, :q].reshape(-1))
        self.i64[1, : n * q].copy_(pos.reshape(-1))
        self.i32[self.max_bs + 1: self.max_bs + 1 + n].copy_(first + q)
        page = self.tables[:n].gather(1, pos // self.block_size).to(torch.int64)
        self.i64[2, : n * q].copy_((page * self.block_size + pos % self.block_size).reshape(-1))

    def _take_feed(self, bs: int, q: int, rows: torch.Tensor | None = None, fed: torch.Tensor | None = None
                   ) -> None:
        """apply_verify_feed inside the graph (feed_in_graph): the first `feed[max_bs]` sequences take their input
        ids, positions, context lengths and slots from rows `feed[:bs]` of next_ids / next_pos; the others keep
        what the host staged. The same arithmetic, with no launches of the host's between stage and replay.
        `rows` and `fed` (device tensors [bs]): which row each sequence takes and whether it takes one, in place of
        the staged `feed` (a later step of a multi-step graph: spec_decode/multi_step.py)."""
        t = bs * q
        if rows is None:
            rows, count = self.feed[:bs], self.feed[self.max_bs]
            fed = torch.arange(bs, device=self.device) < count  # [bs]
        first = self.next_pos[rows]
        pos = first[:, None] + torch.arange(q, device=self.device)[None, :]
        page = self.tables[:bs].gather(1, (pos // self.block_size).clamp(0, self.max_blocks - 1)).to(torch.int64)
        taken = torch.stack([self.next_ids[rows, :q], pos, page * self.block_size + pos % self.block_size])
        staged = self.i64[:, :t]
        staged.copy_(torch.where(fed[None, :, None], taken, staged.view(3, bs, q)).view(3, t))
        lens = self.i32[self.max_bs + 1: self.max_bs + 1 + bs]
        lens.copy_(torch.where(fed, (first + q).to(torch.int32), lens))

    def replay(self, bs: int, length: int, query_len: int = 1) -> bool:
        """Replay the graph of this key over the staged buffers, capturing it first if needed; False if its
        capture failed (the caller runs the step eagerly)."""
        replay = self.graphs.get((bs, length)) if query_len == 1 else self.verify_graphs.get((bs, length, query_len))
        if replay is None:
            replay = self._capture_key(bs, length, query_len)
            if replay is None:
                return False
        replay()
        return True

    def stage(self, input_ids: list[int], seq_lens: list[int], block_tables: list[list[int]], bs: int,
              query_len: int = 1, feed_rows: list[int] | None = None) -> None:
        """Write the padded batch (bs sequences of query_len tokens) into the host staging buffers and copy them
        to the device buffers; `feed_rows`: the rows of `next_ids` / `next_pos` the sequences take in the graph
        (feed_in_graph; [] = none fed)."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copies have read the staging buffers
        n, q, page = len(seq_lens), query_len, self.block_size
        t, t_pad = n * q, bs * q
        lens = np.asarray(seq_lens, dtype=np.int64)
        rows = np.repeat(np.arange(n), q)
        pos = lens[rows] - q + np.tile(np.arange(q), n)  # a sequence's q tokens sit at seq_len - q .. seq_len - 1
        h = self.n_i64
        h[:, :t_pad] = 0
        h[0, :t] = input_ids
        h[1, :t] = pos
        h[1, t:t_pad] = np.tile(np.arange(q), bs - n)  # padding sequences: positions 0 .. q - 1 of seq_len q
        h[2, :t_pad] = -1  # padding writes nothing into the cache
        tables = self.n_tables
        tables[:bs] = 0
        fill_block_tables(tables, block_tables)
        h[2, :t] = slot_mapping(tables, rows, pos, page)
        self.n_i32[: bs + 1] = np.arange(bs + 1) * q  # query_start_loc: 0, q, 2q, ...
        seq = self.n_i32[self.max_bs + 1:]
        seq[:bs] = q
        seq[:n] = lens
        non_blocking = self._copied is not None
        self.i64.copy_(self.h_i64, non_blocking=non_blocking)
        self.i32.copy_(self.h_i32, non_blocking=non_blocking)
        self.tables[:bs].copy_(self.h_tables[:bs], non_blocking=non_blocking)
        if feed_rows is not None:
            self.n_feed[: len(feed_rows)] = feed_rows
            self.n_feed[len(feed_rows): self.max_bs] = 0
            self.n_feed[self.max_bs] = len(feed_rows)
            self.feed.copy_(self.h_feed, non_blocking=non_blocking)
        if self._copied is not None:
            self._copied.record()

    # -- capture ----------------------------------------------------------------------------------------------
    def static_inputs(self, bs: int, max_seq_len: int, query_len: int = 1
                      ) -> tuple[torch.Tensor, AttentionMetadata]:
        """The input ids and AttentionMetadata of the first bs static sequences (bs x query_len tokens), as a graph
        of context bucket max_seq_len reads them. The host-side lengths are fixed for the key: query_len per
        sequence, and the bucket as each context length (only grid and tile choices and the reference paths read
        them; a key past a query's position is masked everywhere)."""
        n, t = self.max_bs, bs * query_len
        meta = AttentionMetadata(
            positions=self.i64[1, :t], query_start_loc=self.i32[: bs + 1], seq_lens=self.i32[n + 1: n + 1 + bs],
            block_tables=self.tables[:bs], slot_mapping=self.i64[2, :t], block_size=self.block_size,
            max_query_len=query_len, max_seq_len=max_seq_len, num_decode_seqs=bs if query_len == 1 else 0,
            query_lens_cpu=[query_len] * bs, seq_lens_cpu=[max_seq_len] * bs)
        return self.i64[0, :t], meta

    def _forward(self, bs: int, max_seq_len: int, query_len: int, take_feed: bool = True) -> Callable[[], None]:
        """The step a graph records: the model over the first bs static sequences, logits into the static output
        (and what the drafter reads into `kept`); a verify step first takes the staged feed (feed_in_graph) unless
        `take_feed` is False (the caller feeds it)."""
        input_ids, meta = self.static_inputs(bs, max_seq_len, query_len)
        t = bs * query_len
        model, logits, tokens = self.model, self.logits[:t], self.tokens[:bs]
        argmax = self.captured_argmax and query_len == 1  # a verify step's rows go to the acceptance rule
        keep, kept = self.keep, self.kept[:t] if self.kept is not None else None
        take_feed = take_feed and self.feed_in_graph and query_len > 1

        def forward() -> None:
            if take_feed:
                self._take_feed(bs, query_len)
            hidden = model(input_ids, meta.positions, meta)
            if keep is not None:
                kept.copy_(keep(hidden))
            model.compute_logits(hidden, out=logits)
            if argmax:
                torch.argmax(logits, dim=-1, out=tokens)

        forward.key = (bs, max_seq_len, query_len)  # for the capture seam (logs, tests)
        return forward

    def _capture_key(self, bs: int, length: int, query_len: int = 1) -> Replay | None:
        """Warm up and capture one graph over the staged inputs (this step's: K/V writes are idempotent)."""
        key = (bs, length, query_len)
        fn = self._forward(*key)
        try:
            fn()  # eager warm-up: compiles the kernels and settles allocator state outside the capture
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            replay = self._capture(fn)
        except Exception as e:  # noqa: BLE001 - a failed capture must not take the engine down
            why = f"capture of batch {key[0]} / context {key[1]} / query length {key[2]} failed: " \
                  f"{type(e).__name__}: {e}"
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # raises if the failure left the device unusable
            if key[2] > 1:  # the decode graphs were captured on their own and keep working
                self.verify_disabled = why
                logger.warning("CUDA graphs of several tokens per sequence disabled, %s run eagerly: %s",
                               self.verify_runs_eagerly, why, exc_info=True)
                self.verify_graphs.clear()
                return None
            self.disabled = why
            logger.warning("CUDA graphs disabled, %s run eagerly: %s", self.runs_eagerly, why, exc_info=True)
            self.graphs.clear()
            self.verify_graphs.clear()
            return None
        if query_len == 1:
            self.graphs[(bs, length)] = replay
        else:
            self.verify_graphs[key] = replay
        logger.debug("captured graph: batch %d, context bucket %d, query length %d", *key)
        return replay

    def capture_all(self, max_seq_len: int | None = None, max_batch: int | None = None) -> int:
        """Capture every batch bucket up to the one holding max_batch, for the context bucket of max_seq_len
        (default: the largest), largest batch first, on dummy inputs (all padding). Returns how many were captured."""
        top, length = self.key(min(max_batch or self.max_bs, self.max_bs), max_seq_len or self.max_model_len)
        count = 0
        for bs in sorted((b for b in self.buckets if b <= top), reverse=True):
            if (bs, length) in self.graphs:
                continue
            self.stage([0] * bs, [1] * bs, [[0]] * bs, bs)
            self.i64[2, :bs].fill_(-1)  # dummy rows write nothing into the cache
            if self._capture_key(bs, length) is None:
                break
            count += 1
        return count
