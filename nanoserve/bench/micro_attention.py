"""Attention kernel micro-benchmarks at the model's widths (GPU only): `python -m nanoserve.bench --micro attention`.

- Decode: dense paged attention and MSA (block selection + block-sparse attention) over one new token per
  sequence at contexts 1k / 8k / 32k / 128k, batch 1 and 64. Each is captured alone in a CUDA graph (as a decode
  step runs it) and replayed with L2 flushed before every replay; the table gives the median replay time, the
  bytes the kernel must read (the KV of the whole context for dense; the index keys of the whole context plus the
  K/V of the selected blocks for MSA) and the GB/s that makes.
- Prefill: one sequence of 8k and 32k tokens, dense causal attention, the MSA selection, and the block-sparse
  attention with random index queries (the worst case for its query tiles: neighbours select different blocks)
  and with slowly drifting ones (closer to a trained indexer), each as TFLOP/s of its causal matmuls
  (`triton.testing.do_bench` medians: it clears L2 before each call).
- Long prefill: one chunk of 8,192 queries at the end of a 131,072-token context (the last chunk of W4's 128k
  prompt), dense causal attention over a bf16 pool and over an fp8 e4m3 pool (`--kv-cache-dtype fp8`), each with
  its table tiles (`paged_prefill_long`, `paged_prefill_fp8_long`).

The KV blocks of a batch are shuffled in the pool (a real block table, not a contiguous one) and filled with
random bf16 values. The largest case (batch 64 at 128k context) holds 16 GiB of KV.
"""

from __future__ import annotations

import torch

from nanoserve.batch import AttentionMetadata
from nanoserve.bench.report import table
from nanoserve.model.m3_config import M3Config

DECODE_CONTEXTS = (1024, 8192, 32768, 131072)
DECODE_BATCHES = (1, 64)
PREFILL_LENS = (8192, 32768)
LONG_PREFILL = (8192, 131072)
"""(queries, context) of the long-prefill rows."""
L2_FLUSH_BYTES = 256 * 2**20
"""Larger than any GPU's L2: zeroing it before a replay evicts what the last replay left there."""
REPLAYS = 30


def cold_graph_ms(fn) -> float:
    """Median milliseconds of one CUDA-graph replay of `fn`, L2 flushed before each replay."""
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(REPLAYS):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def eager_ms(fn) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


class Batch:
    """A batch of sequences over a shuffled paged KV pool at the model's attention widths: queries, K/V, index
    queries and index keys (random bf16), and its AttentionMetadata."""

    def __init__(self, cfg: M3Config, query_lens: list[int], seq_lens: list[int], device: torch.device,
                 seed: int = 0, dtype: torch.dtype = torch.bfloat16):
        self.cfg, self.block = cfg, cfg.index_block_size
        gen = torch.Generator().manual_seed(seed)
        per_seq = [-(-n // self.block) for n in seq_lens]
        total = sum(per_seq) + 1
        perm = torch.randperm(total, generator=gen).tolist()
        tables, i = [], 0
        for n in per_seq:
            tables.append(perm[i:i + n])
            i += n
        self.meta = AttentionMetadata.build(query_lens, seq_lens, tables, self.block, device)
        t = self.meta.num_tokens
        dgen = torch.Generator(device=device).manual_seed(seed)

        def draw(*shape):
            return torch.empty(*shape, dtype=dtype, device=device).normal_(0, 1, generator=dgen)

        hkv, d, g, di = cfg.num_key_value_heads, cfg.head_dim, cfg.index_n_heads, cfg.index_head_dim
        self.kv = draw(total, 2, self.block, hkv, d)
        self.q = draw(t, cfg.num_attention_heads, d)
        self.index_cache = draw(total, self.block, di)
        self.index_q = draw(t, g, di)
        self.scale = d ** -0.5

    def dense(self):
        from nanoserve.kernels.attention import paged_attention

        return paged_attention(self.q, self.kv, self.meta, self.scale)

    def select(self, index_q: torch.Tensor | None = None):
        from nanoserve.kernels.msa import msa_select

        c = self.cfg
        return msa_select(self.index_q if index_q is None else index_q, self.index_cache, self.meta,
                          c.index_topk_blocks, c.index_local_blocks)

    def sparse(self, selected: torch.Tensor):
        from nanoserve.kernels.msa import sparse_attention

        return sparse_attention(self.q, self.kv, self.meta, selected, self.scale)

    def smooth_index_queries(self, seed: int = 3) -> torch.Tensor:
        """Index queries that drift slowly along the sequence (a random walk), so neighbouring tokens select
        mostly the same blocks, as a trained indexer's do."""
        gen = torch.Generator(device=self.q.device).manual_seed(seed)
        shape = self.index_q.shape
        walk = torch.cumsum(torch.empty(shape, device=self.q.device).normal_(0, 0.02, generator=gen), 0)
        return (walk + torch.empty(1, *shape[1:], device=self.q.device).normal_(0, 1, generator=gen)).to(
            self.index_q.dtype)


def dense_decode_bytes(cfg: M3Config, seq_lens: list[int], item: int = 2) -> int:
    """K and V of every context token, plus each sequence's query and output."""
    return (sum(seq_lens) * cfg.num_key_value_heads * cfg.head_dim * 2 * item
            + len(seq_lens) * cfg.num_attention_heads * cfg.head_dim * 2 * item)


def msa_decode_bytes(cfg: M3Config, seq_lens: list[int], item: int = 2) -> int:
    """The index keys of the whole context, the K/V of the selected blocks, the queries and the output."""
    b = cfg.index_block_size
    index = sum(seq_lens) * cfg.index_head_dim * item
    kv = sum(min(cfg.index_topk_blocks, -(-n // b)) * b * cfg.num_key_value_heads * cfg.head_dim * 2 * item
             for n in seq_lens)
    per_seq = cfg.num_attention_heads * cfg.head_dim * 2 * item + cfg.index_n_heads * cfg.index_head_dim * item
    return index + kv + len(seq_lens) * per_seq


def causal_flops(cfg: M3Config, n: int, heads: int, keys_per_query: int | None = None) -> float:
    """QK^T + PV matmul FLOPs of a causal prefill of n tokens (keys_per_query caps the keys a query sees)."""
    cap = min(keys_per_query or n, n)
    keys = cap * (cap + 1) // 2 + (n - cap) * cap  # sum over i < n of min(i + 1, cap)
    return 4.0 * heads * cfg.head_dim * keys


def decode_row(cfg: M3Config, ctx: int, batch: int, device: torch.device) -> dict:
    """One decode case: `batch` sequences of `ctx` tokens, one new token each."""
    b = Batch(cfg, [1] * batch, [ctx] * batch, device)
    sel = b.select()
    row = {"context": ctx, "batch": batch, "dense_ms": cold_graph_ms(b.dense),
           "msa_ms": cold_graph_ms(lambda: b.sparse(b.select())),
           "msa_select_ms": cold_graph_ms(b.select), "msa_sparse_ms": cold_graph_ms(lambda: b.sparse(sel))}
    row["dense_gb_s"] = dense_decode_bytes(cfg, [ctx] * batch) / row["dense_ms"] / 1e6
    row["msa_gb_s"] = msa_decode_bytes(cfg, [ctx] * batch) / row["msa_ms"] / 1e6
    return row


def prefill_row(cfg: M3Config, n: int, device: torch.device) -> dict:
    """One prefill case: a whole prompt of n tokens."""
    b = Batch(cfg, [n], [n], device)
    row = {"tokens": n, "dense_ms": eager_ms(b.dense), "msa_select_ms": eager_ms(b.select)}
    row["dense_tflop_s"] = causal_flops(cfg, n, cfg.num_attention_heads) / row["dense_ms"] / 1e9
    row["msa_select_tflop_s"] = causal_flops(cfg, n, cfg.index_n_heads) / 2 / row["msa_select_ms"] / 1e9
    sparse_keys = cfg.index_topk_blocks * cfg.index_block_size
    for kind, index_q in (("random", b.index_q), ("smooth", b.smooth_index_queries())):
        sel = b.select(index_q)
        ms = eager_ms(lambda sel=sel: b.sparse(sel))
        row[f"sparse_{kind}_ms"] = ms
        row[f"sparse_{kind}_tflop_s"] = causal_flops(cfg, n, cfg.num_attention_heads, sparse_keys) / ms / 1e9
    return row


def long_prefill_rows(cfg: M3Config, device: torch.device, chunk: int = LONG_PREFILL[0],
                      context: int = LONG_PREFILL[1]) -> list[dict]:
    """Dense attention of one chunk at the end of a long context, over a bf16 and an fp8 KV pool (same values,
    rounded to e4m3 for the fp8 pool)."""
    from nanoserve.kernels.attention import paged_attention

    b = Batch(cfg, [chunk], [context], device)
    heads = cfg.num_attention_heads
    flops = causal_flops(cfg, context, heads) - causal_flops(cfg, context - chunk, heads)  # the chunk's queries
    rows = []
    for pool, kv in (("bf16", b.kv), ("fp8", b.kv.to(torch.float8_e4m3fn))):
        ms = eager_ms(lambda kv=kv: paged_attention(b.q, kv, b.meta, b.scale))
        rows.append({"queries": chunk, "context": context, "kv_pool": pool, "dense_ms": ms,
                     "dense_tflop_s": flops / ms / 1e9})
    return rows


def attention_micro(cfg: M3Config, tokens: list[int] | None, device: torch.device,
                    contexts: tuple[int, ...] = DECODE_CONTEXTS, batches: tuple[int, ...] = DECODE_BATCHES,
                    prefill_lens: tuple[int, ...] = PREFILL_LENS) -> dict:
    """Decode and prefill attention tables (`tokens`: unused; the signature of the other micro-benchmarks)."""
    decode, prefill = [], []
    for ctx in contexts:
        for batch in batches:
            decode.append(decode_row(cfg, ctx, batch, device))
            torch.cuda.empty_cache()  # each case's KV (up to 16 GiB) goes back before the next
    for n in prefill_lens:
        prefill.append(prefill_row(cfg, n, device))
        torch.cuda.empty_cache()
    long = long_prefill_rows(cfg, device)
    text = table(("context", "batch", "dense us", "dense GB/s", "MSA us", "select us", "sparse us", "MSA GB/s"),
                 [[r["context"], r["batch"], r["dense_ms"] * 1e3, r["dense_gb_s"], r["msa_ms"] * 1e3,
                   r["msa_select_ms"] * 1e3, r["msa_sparse_ms"] * 1e3, r["msa_gb_s"]] for r in decode],
                 "Decode attention, one token per sequence (CUDA-graph replay, cold L2; median)")
    text += "\n\n" + table(("tokens", "dense ms", "dense TFLOP/s", "select ms", "sparse random ms",
                            "TFLOP/s", "sparse smooth ms", "TFLOP/s"),
                           [[r["tokens"], r["dense_ms"], r["dense_tflop_s"], r["msa_select_ms"],
                             r["sparse_random_ms"], r["sparse_random_tflop_s"], r["sparse_smooth_ms"],
                             r["sparse_smooth_tflop_s"]] for r in prefill],
                           "Prefill attention of one sequence (do_bench median; TFLOP/s of the causal matmuls)")
    text += "\n\n" + table(("queries", "context", "KV pool", "dense ms", "dense TFLOP/s"),
                           [[r["queries"], r["context"], r["kv_pool"], r["dense_ms"], r["dense_tflop_s"]]
                            for r in long],
                           "Long prefill: one chunk at the end of a long context, dense attention (do_bench median)")
    return {"rows": {"decode": decode, "prefill": prefill, "long_prefill": long}, "table": text}
