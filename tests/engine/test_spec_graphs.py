"""Speculative decoding under CUDA graphs (switch `spec_cuda_graphs`, runner/cuda_graphs.py), on the CPU with the
runner's capture seam: `graph_capture = lambda fn: fn` re-runs the captured function over the same static buffers at
every replay, which checks the padding (a batch of 3 in bucket 4) and the buffer plumbing - query starts 0, q, 2q,
positions, slots, the logits of every row, what the drafter reads - against the eager path.

Greedy output (m3-tiny, fp32) with speculation, graphs and the switch on must equal the output without speculation
and with the switch off, token for token, for the ngram, MTP and EAGLE-3 drafters, at batch 1 and 3, and a
model-based drafter's drafts must equal the eager path's (it read the right rows of the graphs' static buffer);
verify, decode and MTP draft-pass steps replay graphs; a failed verify or draft-pass capture leaves the other
graphs working; every block comes back.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from nanoserve import LLM, SamplingParams
from tests.engine.test_spec_decode import eagle_config, tokens_of, write_eagle3_dir
from tests.helpers.engine_utils import (
    assert_all_blocks_free,
    engine_opts,
    finish_all,
    record_drafts,
    step_until_in_flight,
)

MAX_MODEL_LEN = 256
K = 3
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
MTP = {"method": "mtp", "num_speculative_tokens": K}


def prompts() -> list[list[int]]:
    """Three prompts that repeat themselves (prompt lookup finds drafts in all three at once, so whole batches
    verify the same number of tokens)."""
    rng = random.Random(11)
    motifs = [[rng.randrange(9, 512) for _ in range(n)] for n in (7, 9, 5)]
    return [motifs[0] * 5, motifs[1] * 4 + motifs[0][:3], motifs[2] * 6]


def generate(model: str, batches: list[list[list[int]]], spec: dict | None, graphs: bool,
             capture=None, **switches: bool) -> tuple[list[list[int]], Counter, dict]:
    """Greedy outputs of each batch in turn (one generate call each); with `graphs`, under the emulated capture
    (or `capture`) with spec_cuda_graphs on. Returns the outputs, how often each graph key replayed (query length
    1: decode; more: verify) and the engine's stats and GraphRunner (before it shut down)."""
    switches.setdefault("spec_multi_step", False)  # (one step per launch here: tests/engine/test_spec_multi_step.py)
    opts = engine_opts().replace(cuda_graphs=graphs, spec_cuda_graphs=graphs, **switches)
    llm = LLM(model, optimizations=opts, max_model_len=MAX_MODEL_LEN, max_num_seqs=4, speculative_config=spec)
    runner = llm.engine.executor.runner
    replays: Counter = Counter()

    def counting(fn):
        replay = capture(fn) if capture is not None else fn

        def run():
            replays[fn.key] += 1
            replay()
        return run

    if graphs:
        runner.graph_capture = counting
    drafts = record_drafts(llm)  # every draft a model-based drafter proposed, in order
    scheduled: list[list[list[int]]] = []  # the drafts each step's sequences got, however they were made
    if llm.engine.spec_config is not None:
        schedule = llm.engine.scheduler.schedule

        def recording(*args):
            scheduled.append([list(seq.spec_token_ids) for seq in llm.engine.scheduler.running])
            return schedule(*args)
        llm.engine.scheduler.schedule = recording
    outs = []
    for batch in batches:
        outs += tokens_of(llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY, use_tqdm=False))
    assert_all_blocks_free(llm)
    state = {"stats": llm.engine.stats, "graphs": runner.graphs, "drafts": drafts, "scheduled": scheduled}
    llm.engine.shutdown()
    return outs, replays, state


@pytest.fixture(scope="module")
def eagle_draft(tmp_path_factory) -> str:
    """A random EAGLE-3 draft for m3-tiny (taps on layers 0, 2 and after the last)."""
    path = tmp_path_factory.mktemp("eagle3-graphs") / "draft"
    write_eagle3_dir(path)
    return str(path)


BATCHES = {"batch 1": lambda p: [[p[0]], [p[2]]], "batch 3": lambda p: [p]}


@pytest.fixture(scope="module")
def expected(tiny_dir, mtp_dir) -> dict:
    """Greedy outputs without speculation (the MTP checkpoint's main model is m3-tiny's)."""
    out, _, _ = generate(tiny_dir, [prompts()], None, graphs=False)
    return {"batch 1": [out[0], out[2]], "batch 3": out}


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("method", ["ngram", "mtp", "eagle3"])
def test_verify_steps_replay_graphs_with_the_same_greedy_output(tiny_dir, mtp_dir, eagle_draft, expected, method,
                                                                batch):
    model, spec = {"ngram": (tiny_dir, NGRAM), "mtp": (mtp_dir, MTP),
                   "eagle3": (tiny_dir, eagle_config(eagle_draft, K))}[method]
    batches = BATCHES[batch](prompts())
    eager, _, eager_state = generate(model, batches, spec, graphs=False)
    # (spec_async off: the drafts each step verifies are then the host's, which this compares; spec_pad_drafts
    # off: a padding token the target accepts moves a sequence on by one more token than the eager run's step)
    graphed, replays, state = generate(model, batches, spec, graphs=True, spec_async=False, spec_pad_drafts=False)
    assert eager == expected[batch]
    assert graphed == expected[batch]
    # the drafter read the same hidden states from the graphs' static buffer as from the eager forward: the same
    # drafts (greedy verification alone would hide a wrong drafter input: it only costs acceptance)
    assert state["scheduled"] == eager_state["scheduled"]  # (with the draft chain too, on by default)
    if method != "ngram":
        assert sum(len(d) for step in state["scheduled"] for d in step) > 20
    steps = {k: n for k, n in replays.items() if k[0] not in ("draft", "chain")}
    verify = {k: n for k, n in steps.items() if k[2] > 1}
    decode = {k: n for k, n in steps.items() if k[2] == 1}
    assert verify and decode, f"verify and decode steps were both meant to replay graphs: {replays}"
    draft_passes = {k: n for k, n in replays.items() if k[0] == "draft"}
    assert bool(draft_passes) == (method != "ngram"), replays  # a draft model's passes replay graphs too
    assert all(1 < k[2] <= K + 1 for k in verify)
    want_bs = 1 if batch == "batch 1" else 4  # 3 sequences run padded to bucket 4
    assert any(k[0] == want_bs for k in verify), replays
    if method == "ngram":  # (m3-tiny's random MTP module drafts what its greedy output rarely is)
        assert state["stats"].spec_decode_num_accepted_tokens > 0


def acceptance(stats) -> tuple:
    return (stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens,
            list(stats.spec_decode_accepted_per_pos))


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("method", ["mtp", "eagle3"])
def test_the_draft_chain_drafts_what_the_next_step_would(tiny_dir, mtp_dir, eagle_draft, expected, method, batch):
    """spec_draft_chain against its reference (the drafts proposed at each step's start), m3-tiny's random MTP
    module or EAGLE-3 draft, emulated capture: the same greedy output, the same drafts - so the same acceptance
    counts, per position - with chain graphs replayed after the verify graphs and fewer draft proposals at step
    starts."""
    model, spec = (mtp_dir, MTP) if method == "mtp" else (tiny_dir, eagle_config(eagle_draft, K))
    batches = BATCHES[batch](prompts())
    ref, _, ref_state = generate(model, batches, spec, graphs=True, spec_draft_chain=False)
    out, replays, state = generate(model, batches, spec, graphs=True, spec_draft_chain=True, spec_async=False)
    assert out == ref == expected[batch]
    assert state["scheduled"] == ref_state["scheduled"]  # every step's drafts, token for token
    assert sum(len(d) for step in state["scheduled"] for d in step) > 20
    assert acceptance(state["stats"]) == acceptance(ref_state["stats"])
    chains = {k: n for k, n in replays.items() if k[0] == "chain"}
    assert chains and all(k[3] == K + 1 for k in chains), replays
    proposals = sum(len(step) for step in state["drafts"])
    assert proposals < sum(len(step) for step in ref_state["drafts"])


def test_the_draft_chain_on_a_trained_model_accepts_and_matches():
    """m3-mini (trained: its MTP drafts are mostly accepted, so the chain meets whole, partial and rejected drafts)
    in fp32: spec_draft_chain on and off give the same greedy tokens and the same acceptance, every block comes
    back."""
    prompt_sets = [[[1, 2, 3] + list(range(40, 80))], [list(range(100, 140)), list(range(300, 330)) * 2]]

    def run(chain: bool):
        opts = engine_opts().replace(cuda_graphs=True, spec_cuda_graphs=True, spec_draft_chain=chain)
        with LLM("m3-mini", optimizations=opts, dtype="float32", max_model_len=512, max_num_seqs=4,
                 speculative_config=MTP) as llm:
            runner = llm.engine.executor.runner
            runner.graph_capture = lambda fn: fn
            outs = []
            for batch in prompt_sets:
                outs += tokens_of(llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY, use_tqdm=False))
            assert_all_blocks_free(llm)
            return outs, acceptance(llm.engine.stats), runner.chain

    out, accepted, chain = run(True)
    ref, ref_accepted, no_chain = run(False)
    assert out == ref and accepted == ref_accepted
    per_pos = accepted[3]
    assert per_pos[0] > 0 and per_pos[-1] < accepted[0], "whole and partial drafts were both meant to occur"
    assert chain is not None and chain.graphs and no_chain is None


def test_abort_while_a_draft_chain_is_in_flight(mtp_dir, expected):
    """An abort of a sequence whose verify step and draft chain are still in flight: the blocks the chain's passes
    write to come back with the rest, and the other sequences finish with their greedy output."""
    opts = engine_opts().replace(cuda_graphs=True, spec_cuda_graphs=True, spec_draft_chain=True)
    with LLM(mtp_dir, optimizations=opts, max_model_len=MAX_MODEL_LEN, max_num_seqs=4,
             speculative_config=MTP) as llm:
        llm.engine.executor.runner.graph_capture = lambda fn: fn
        engine = llm.engine
        for i, p in enumerate(prompts()):
            engine.add_request(f"r{i}", p, GREEDY)
        inflight = step_until_in_flight(engine, lambda step: step.future.chain is not None, 40)
        assert inflight is not None, "a draft chain was meant to be in flight"
        engine.abort_request(["r1"])
        engine.block_manager.check_integrity()
        finished = finish_all(engine)
        assert finished == {"r0": expected["batch 3"][0], "r2": expected["batch 3"][2]}
        assert_all_blocks_free(llm)


def test_a_drafter_reads_a_view_of_the_graphs_static_buffer(mtp_dir):
    """With spec_cuda_graphs an MTP drafter keeps graphs on: after a replayed step its input is the graph's
    static `kept` rows (every token of the step), not a copy taken outside the graph."""
    opts = engine_opts().replace(cuda_graphs=True, spec_cuda_graphs=True)
    with LLM(mtp_dir, optimizations=opts, max_model_len=MAX_MODEL_LEN, max_num_seqs=4,
             speculative_config=MTP) as llm:
        runner = llm.engine.executor.runner
        runner.graph_capture = lambda fn: fn
        views = []
        execute = runner.execute

        def spy(inp, *args, **kwargs):
            out = execute(inp, *args, **kwargs)
            graphs = runner.graphs
            if graphs is not None and runner.drafter.last is not None and \
                    runner.drafter.last.data_ptr() == graphs.kept.data_ptr():
                views.append(len(inp.input_ids) == runner.drafter.last.shape[0])
            return out

        runner.execute = spy
        llm.generate([{"prompt_token_ids": p} for p in prompts()], GREEDY, use_tqdm=False)
        assert views and all(views)
        assert runner.graphs.graphs and runner.graphs.verify_graphs
        assert_all_blocks_free(llm)


def test_switch_off_runs_verify_steps_eagerly(mtp_dir):
    """spec_cuda_graphs off (its reference): verify steps run eagerly, and an MTP drafter turns graphs off
    altogether."""
    for model, spec in ((mtp_dir, MTP), (mtp_dir, NGRAM)):
        opts = engine_opts().replace(cuda_graphs=True, spec_cuda_graphs=False)
        with LLM(model, optimizations=opts, max_model_len=MAX_MODEL_LEN, max_num_seqs=4,
                 speculative_config=spec) as llm:
            runner = llm.engine.executor.runner
            runner.graph_capture = lambda fn: fn
            llm.generate([{"prompt_token_ids": p} for p in prompts()], GREEDY, use_tqdm=False)
            if spec is MTP:
                assert runner.graphs is None
            else:
                assert runner.graphs.graphs and not runner.graphs.verify_graphs
                assert runner.graphs.max_query_len == 1


def test_a_failed_verify_capture_leaves_the_decode_graphs(tiny_dir, expected):
    """A verify graph whose capture fails: verify steps run eagerly from then on (logged), decode steps keep
    replaying their graphs, and the output is unchanged."""
    def capture(fn):
        if fn.key[2] > 1:
            raise RuntimeError("emulated capture failure")
        return fn

    out, replays, state = generate(tiny_dir, [prompts()], NGRAM, graphs=True, capture=capture)
    assert out == expected["batch 3"]
    graphs = state["graphs"]
    assert graphs.verify_disabled and "emulated capture failure" in graphs.verify_disabled
    assert graphs.disabled is None and graphs.graphs and not graphs.verify_graphs
    assert replays and all(k[2] == 1 for k in replays)  # (ngram: no draft passes)


def test_cost_bench_times_the_verify_step_as_the_engine_runs_it(tiny_dir):
    """`python -m nanoserve.bench --speculative cost`: with spec_cuda_graphs the verify step it times replays a
    graph of k + 1 tokens per sequence (here the emulated capture), and it reports the eager verify beside it; the
    MTP's one-token draft passes replay graphs as in the engine."""
    from nanoserve.bench.speculative_cost import _measure

    opts = engine_opts().replace(cuda_graphs=True, spec_cuda_graphs=True)
    context, per_seq = 20, 2
    with LLM(tiny_dir, optimizations=opts, max_model_len=64, max_num_seqs=3, num_gpu_blocks_override=3 * per_seq,
             speculative_config=NGRAM) as llm:
        runner = llm.engine.executor.runner
        captured = []
        runner.graph_capture = lambda fn: captured.append(fn.key) or fn
        report = _measure(runner, context, (1, 3), (1, K), 1, per_seq, 0, "m3-tiny")
        assert any(key[0] == "draft" for key in captured)  # the MTP's one-token passes too
        assert runner.draft_graphs is None  # dropped with the bench's random drafter
    for row in report["rows"]:
        assert row["decode_graphs"] and row["verify_k1_graphs"] and row[f"verify_k{K}_graphs"], row
        assert row[f"verify_k{K}_ms"] > 0 and row[f"verify_k{K}_eager_ms"] > 0
    assert "(no graphs)" not in report["table"]


def test_verify_staging_matches_the_eager_preparation():
    """A verify graph's static buffers, staged for random batches of q tokens per sequence, hold what the eager
    preparation builds for the real sequences (query starts 0, q, 2q, ...; positions seq_len - q .. seq_len - 1;
    slots), and inert padding sequences (seq_len q, positions 0 .. q - 1, zero tables, slot -1) for the rest of
    the bucket. Integers: exact."""
    from types import SimpleNamespace

    import numpy as np
    import torch

    from nanoserve.batch import AttentionMetadata
    from nanoserve.runner.cuda_graphs import GraphRunner

    page, max_len = 16, 96
    model = SimpleNamespace(cfg=SimpleNamespace(vocab_size=8))
    graphs = GraphRunner(model, 8, max_len, page, torch.device("cpu"), capture=lambda fn: fn, max_query_len=K + 1)
    assert graphs.max_tokens == 8 * (K + 1) and graphs.logits.shape == (8 * (K + 1), 8)
    rng = np.random.default_rng(3)
    for _ in range(30):
        n, q = int(rng.integers(1, 9)), int(rng.integers(2, K + 2))
        seq = rng.integers(q, max_len + 1, n).tolist()
        free = rng.permutation(300).tolist()
        tables = [[free.pop() for _ in range(-(-s // page))] for s in seq]
        ids = rng.integers(0, 500, n * q).tolist()
        assert graphs.fits(n, max(seq), max(len(t) for t in tables), q)
        bs, length = graphs.key(n, max(seq))
        graphs.stage(ids, seq, tables, bs, q)
        got_ids, meta = graphs.static_inputs(bs, length, q)
        ref = AttentionMetadata.build([q] * n, seq, tables, page)
        t = n * q
        assert got_ids[:t].tolist() == ids and not got_ids[t:].any()
        assert torch.equal(meta.query_start_loc, torch.arange(bs + 1, dtype=torch.int32) * q)
        assert torch.equal(meta.positions[:t], ref.positions)
        assert meta.positions[t:].tolist() == list(range(q)) * (bs - n)
        assert torch.equal(meta.slot_mapping[:t], ref.slot_mapping) and (meta.slot_mapping[t:] == -1).all()
        assert torch.equal(meta.seq_lens[:n], ref.seq_lens) and (meta.seq_lens[n:] == q).all()
        width = ref.block_tables.shape[1]
        assert torch.equal(meta.block_tables[:n, :width], ref.block_tables) and not meta.block_tables[n:].any()
        assert meta.num_decode_seqs == 0 and meta.max_query_len == q and meta.query_lens_cpu == [q] * bs
    assert not graphs.fits(1, 10, 1, K + 2)  # longer than k + 1


def test_a_failed_draft_pass_capture_leaves_the_step_graphs(mtp_dir, expected):
    """The MTP's one-token passes: a failed capture sends them back to the eager path (the same drafts), while
    verify and decode steps keep replaying their graphs."""
    def capture(fn):
        if fn.key[0] == "draft":
            raise RuntimeError("emulated capture failure")
        return fn

    eager, _, eager_state = generate(mtp_dir, [prompts()], MTP, graphs=False)
    # (without the draft chain, which makes most drafts in a graph of its own)
    out, replays, state = generate(mtp_dir, [prompts()], MTP, graphs=True, capture=capture, spec_draft_chain=False)
    assert out == eager == expected["batch 3"] and state["drafts"] == eager_state["drafts"]
    assert not any(k[0] == "draft" for k in replays)
    assert any(k[2] > 1 for k in replays) and any(k[2] == 1 for k in replays)


@pytest.mark.parametrize("batch, q", [(1, 2), (3, K + 1)])
def test_mtp_first_draft_pass_over_several_positions_replays_a_graph(mtp_dir, batch, q):
    """The MTP's first pass reads the q positions a verify step made final (q = 1 + accepted): with every sequence
    drafting and the same q, it replays a graph keyed by (batch bucket, context bucket, q) that takes each
    sequence's last row; its drafts (and the passes after it) equal the eager path's."""
    import torch

    from nanoserve.spec_decode.draft_input import DraftInput
    from nanoserve.step import ModelInput

    opts = engine_opts().replace(cuda_graphs=True, spec_cuda_graphs=True)
    with LLM(mtp_dir, optimizations=opts, max_model_len=64, max_num_seqs=4, num_gpu_blocks_override=12,
             speculative_config=MTP) as llm:
        runner = llm.engine.executor.runner
        captured = []
        runner.graph_capture = lambda fn: captured.append(fn.key) or fn
        block, context = runner.block_size, 20
        per_seq = -(-(context + q + K) // block)
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
        for i, table in enumerate(tables):  # the target's K/V of each context (eager prefill)
            runner.execute(ModelInput([(7 * i + j) % 400 + 9 for j in range(context)], [context], [context], [table],
                                      [0]))
        g = torch.Generator().manual_seed(batch)
        hidden = torch.randn(batch * q, runner.cfg.hidden_size, generator=g)  # the verify step's rows
        inp = DraftInput(list(range(batch * q)), [(11 * r) % 400 + 9 for r in range(batch * q)], [q] * batch,
                         [context] * batch, tables, [K] * batch)
        runner.drafter.last = hidden
        eager = runner.drafter.propose(inp, runner.prepare)
        runner.drafter.last = hidden
        graphed = runner.drafter.propose(inp, runner.prepare, runner.draft_pass_graphs())
        assert graphed == eager and all(len(d) == K for d in eager)
        bs = 1 if batch == 1 else 4
        assert ("draft", bs, 64, q) in captured, captured  # the first pass
        assert ("draft", bs, 64, 1) in captured, captured  # the passes after it
