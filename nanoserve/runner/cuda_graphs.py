"""GraphRunner: decode steps replayed as CUDA/HIP graphs (switch `cuda_graphs`; reference: the eager forward in
`ModelRunner.execute`).

A decode step launches a few hundred small kernels; at batch size 1 their launch cost alone is a large share of a
~1.5 ms step. A captured graph replays all of them with one launch. Graphs need fixed shapes and fixed addresses,
so the runner keeps static input buffers sized for the largest batch and captures one graph per
(batch-size bucket, context-length bucket):

- batch buckets (`BATCH_BUCKETS`, up to max_num_seqs): a batch of n decodes runs in the smallest bucket >= n.
  Padding rows carry token 0 at position 0 with seq_len 1, an all-zero block table row and slot -1 (no cache
  write); their outputs are computed and dropped.
- context buckets (`SEQ_LEN_BUCKETS`, up to max_model_len): the captured AttentionMetadata says
  max_seq_len = the bucket, so the decode kernels' grids (which depend only on the batch size, the head counts
  and meta.max_seq_len) are fixed; a short context does not pay for a grid sized for max_model_len.

Each step copies its inputs into the static buffers (pinned host staging, one asynchronous copy per buffer; the
block tables and slots are computed by the same functions as an eager step's, runner/input_prep.py),
replays the graph, and returns a view of the static logits [n, vocab] (valid until the next replay). With
`captured_argmax` the graph also writes each row's argmax into a static token buffer (`tokens`), so a batch of
plain greedy rows needs no kernel after the replay but a copy of its tokens (engine/sampler.py). A graph is
captured the first time its key is needed, after one eager warm-up run of the same padded batch (which compiles
the Triton kernels outside the capture); `capture_all` captures every batch bucket ahead of time. All graphs share
one memory pool.

Graphs apply only where every kernel on the decode path is graph-safe: the Triton attention, MSA, MoE and
QK-norm/RoPE/KV-insert kernels (their reference paths loop over sequences in Python or use data-dependent shapes),
on a CUDA/HIP device, with tensor_parallel_size 1. Otherwise decode runs eagerly and the reason is logged once.
"""

from __future__ import annotations

import logging
from typing import Callable

import numpy as np
import torch

from nanoserve.batch import AttentionMetadata, TokenFeed
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
        return graph.replay

    return capture


class GraphRunner:
    """The capture buckets, the static decode buffers and the graphs captured over them, for one model and one KV
    pool.

    `capture` turns a function into a replayable callable; the default records a CUDA graph. Tests on the CPU pass
    `lambda fn: fn`, which re-runs the function at every replay over the same static buffers - it checks the
    padding and buffer plumbing against the eager path without a GPU."""

    def __init__(self, model: torch.nn.Module, max_num_seqs: int, max_model_len: int, block_size: int,
                 device: torch.device, capture: CaptureFn | None = None, captured_argmax: bool = False):
        self.model = model
        self.captured_argmax = captured_argmax
        self.device = device
        self.block_size = block_size
        self.buckets = batch_buckets(max_num_seqs)
        self.max_bs = self.buckets[-1]
        self.len_buckets = seq_len_buckets(max_model_len)
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // block_size)
        on_cuda = device.type == "cuda"
        self._capture = capture or cuda_graph_capture(torch.cuda.graph_pool_handle())
        n, w = self.max_bs, self.max_blocks
        # device-side static inputs: int64 rows = input ids, positions, slots; int32 = query starts + seq lens
        self.i64 = torch.zeros(3, n, dtype=torch.int64, device=device)
        self.i32 = torch.zeros(2 * n + 1, dtype=torch.int32, device=device)
        self.tables = torch.zeros(n, w, dtype=torch.int32, device=device)
        self.logits = torch.zeros(n, model.cfg.vocab_size, dtype=torch.float32, device=device)
        self.tokens = torch.zeros(n, dtype=torch.int64, device=device)  # captured_argmax: argmax of each row
        # host staging (pinned on a GPU, so the copies are asynchronous), written through numpy views
        self.h_i64 = torch.zeros(3, n, dtype=torch.int64, pin_memory=on_cuda)
        self.h_i32 = torch.zeros(2 * n + 1, dtype=torch.int32, pin_memory=on_cuda)
        self.h_tables = torch.zeros(n, w, dtype=torch.int32, pin_memory=on_cuda)
        self.n_i64, self.n_i32, self.n_tables = self.h_i64.numpy(), self.h_i32.numpy(), self.h_tables.numpy()
        self.n_i32[: n + 1] = np.arange(n + 1)  # a decode batch's query_start_loc is always 0, 1, ..., bs
        self._copied = torch.cuda.Event() if on_cuda else None
        self.graphs: dict[tuple[int, int], Replay] = {}
        self.disabled: str | None = None

    # -- which graph ----------------------------------------------------------------------------------------
    def fits(self, num_seqs: int, max_seq_len: int, max_table_len: int) -> bool:
        return (self.disabled is None and num_seqs <= self.max_bs and max_seq_len <= self.max_model_len
                and max_table_len <= self.max_blocks)

    def key(self, num_seqs: int, max_seq_len: int) -> tuple[int, int]:
        bs = next(b for b in self.buckets if b >= num_seqs)
        length = next(b for b in self.len_buckets if b >= max_seq_len)
        return bs, length

    # -- one step ---------------------------------------------------------------------------------------------
    def run(self, input_ids: list[int], seq_lens: list[int], block_tables: list[list[int]],
            feed: TokenFeed | None = None) -> torch.Tensor | None:
        """One decode step (one new token per sequence, every sequence sampled): logits [n, vocab] (a view of the
        static output, valid until the next replay), or None if the graph could not be captured. `feed`: input
        ids copied on the device from the previous step's tokens, after the staging (async scheduling)."""
        n = len(seq_lens)
        key = self.key(n, max(seq_lens))
        self.stage(input_ids, seq_lens, block_tables, key[0])
        apply_token_feed(self.i64[0], feed)
        replay = self.graphs.get(key)
        if replay is None:
            replay = self._capture_key(key)
            if replay is None:
                return None
        replay()
        return self.logits[:n]

    def stage(self, input_ids: list[int], seq_lens: list[int], block_tables: list[list[int]], bs: int) -> None:
        """Write the padded batch into the host staging buffers and copy them to the device buffers."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copies have read the staging buffers
        n, page = len(seq_lens), self.block_size
        lens = np.asarray(seq_lens, dtype=np.int64)
        pos = lens - 1
        h = self.n_i64
        h[:, :bs] = 0
        h[0, :n] = input_ids
        h[1, :n] = pos
        h[2, :bs] = -1
        tables = self.n_tables
        tables[:bs] = 0
        fill_block_tables(tables, block_tables)
        h[2, :n] = slot_mapping(tables, np.arange(n), pos, page)  # a decode's one token sits at seq_len - 1
        seq = self.n_i32[self.max_bs + 1:]
        seq[:bs] = 1
        seq[:n] = lens
        non_blocking = self._copied is not None
        self.i64.copy_(self.h_i64, non_blocking=non_blocking)
        self.i32.copy_(self.h_i32, non_blocking=non_blocking)
        self.tables[:bs].copy_(self.h_tables[:bs], non_blocking=non_blocking)
        if self._copied is not None:
            self._copied.record()

    # -- capture ----------------------------------------------------------------------------------------------
    def static_inputs(self, bs: int, max_seq_len: int) -> tuple[torch.Tensor, AttentionMetadata]:
        """The input ids and AttentionMetadata of the first bs static rows, as a graph of context bucket
        max_seq_len reads them."""
        n = self.max_bs
        meta = AttentionMetadata(
            positions=self.i64[1, :bs], query_start_loc=self.i32[: bs + 1], seq_lens=self.i32[n + 1: n + 1 + bs],
            block_tables=self.tables[:bs], slot_mapping=self.i64[2, :bs], block_size=self.block_size,
            max_query_len=1, max_seq_len=max_seq_len, num_decode_seqs=bs, query_lens_cpu=[1] * bs,
            # host lengths = the bucket: only the reference paths read them (CPU tests), and a key past a query's
            # position is masked there anyway
            seq_lens_cpu=[max_seq_len] * bs)
        return self.i64[0, :bs], meta

    def _forward(self, bs: int, max_seq_len: int) -> Callable[[], None]:
        """The step a graph records: the model over the first bs static rows, logits into the static output."""
        input_ids, meta = self.static_inputs(bs, max_seq_len)
        model, logits, tokens, argmax = self.model, self.logits[:bs], self.tokens[:bs], self.captured_argmax

        def forward() -> None:
            hidden = model(input_ids, meta.positions, meta)
            model.compute_logits(hidden, out=logits)
            if argmax:
                torch.argmax(logits, dim=-1, out=tokens)

        return forward

    def _capture_key(self, key: tuple[int, int]) -> Replay | None:
        """Warm up and capture one graph over the staged inputs (this step's: K/V writes are idempotent)."""
        fn = self._forward(*key)
        try:
            fn()  # eager warm-up: compiles the kernels and settles allocator state outside the capture
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            replay = self._capture(fn)
        except Exception as e:  # noqa: BLE001 - a failed capture must not take the engine down
            self.disabled = f"capture of batch {key[0]} / context {key[1]} failed: {type(e).__name__}: {e}"
            logger.warning("CUDA graphs disabled, decode runs eagerly: %s", self.disabled, exc_info=True)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # raises if the failure left the device unusable
            self.graphs.clear()
            return None
        self.graphs[key] = replay
        logger.debug("captured decode graph: batch %d, context bucket %d", *key)
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
            if self._capture_key((bs, length)) is None:
                break
            count += 1
        return count
