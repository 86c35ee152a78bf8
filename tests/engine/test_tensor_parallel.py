"""Tensor parallelism on the CPU: gloo, real separate processes (spawned workers, torchrun, the server).

The main check feeds the same ModelInputs (a prefill of two prompts, one longer than top-k x MSA block so blocks are
really dropped; decodes; a chunked prefill beside decodes) to a LocalExecutor (tp=1) and to a MultiprocExecutor,
and compares every step's logits: max |diff| <= TP_RTOL x max |tp=1 logit|, TP_RTOL = 1e-5 in fp32 (measured about
5e-7: the shards compute the same products, only the all-reduce sums them in another order).

What runs where, within the budget of two CPU cores:
- m3-tiny (8 query heads, 4 KV heads, 16 experts): TP=2 with tensor-parallel experts, TP=2 expert parallel, TP=4;
  its MXFP8 checkpoint with fp8 weights kept (mxfp8_weights): TP=2 and TP=2 expert parallel.
- KV heads are replicated only when tp > num_key_value_heads, i.e. TP=8 on m3-tiny: 8 processes, too heavy here.
  Instead: kv_head_range and every layer's shard shapes at tp=8 (in one process, no collectives), the loader's
  reads at tp=8, and the logits of a 2-KV-head variant of m3-tiny at TP=4 (each KV and index head on two ranks),
  expert parallel.
- The loader reads only each rank's slices (every rank of tp = 2 and 8, both MoE modes, in one process).
- Offline generate at TP=2, and the same script under torchrun (`python -m torch.distributed.run`, i.e. torchrun,
  --nproc-per-node 2), give TP=1's greedy tokens; `python -m nanoserve.server --tensor-parallel-size 2` serves them.
- A worker killed mid-run (or while idle) fails the engine with "tensor-parallel worker 1 died (exit code -9)"
  within FAIL_FAST_S; the server then answers 500 and /health 503. A worker stopped with SIGSTOP while idle fails
  it within the worker timeout (its heartbeats stop); a collective stuck while every heartbeat runs fails rank 0's
  step within it too.

Run: python -m pytest tests/engine/test_tensor_parallel.py -q
"""

from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist

from nanoserve import LLM, SamplingParams
from nanoserve.config import EngineConfig
from nanoserve.distributed.executor import MultiprocExecutor, free_loopback_port
from nanoserve.distributed.watchdog import WorkerFailure, WorkerWatchdog
from nanoserve.executor.base import Executor
from nanoserve.executor.local import LocalExecutor
from nanoserve.model import loader
from nanoserve.model.m3 import M3ForCausalLM
from nanoserve.parallel_state import get_tp, kv_head_range, set_tp
from nanoserve.presets.catalog import get_preset
from nanoserve.presets.make_checkpoint import write_checkpoint
from nanoserve.runner.kv_cache import allocate_kv_caches, kv_cache_bytes_per_block
from nanoserve.step import ModelInput, StepInput
from tests.helpers.tp_helpers import CPU_REFERENCE, channel_messages, channel_peer, stuck_peer

TP_RTOL = 1e-5
"""fp32: max |tp logits - tp=1 logits| <= TP_RTOL x max |tp=1 logit| (measured: about 5e-7)."""
FAIL_FAST_S = 60.0
"""A killed worker must fail the engine within this many seconds (measured: well under one)."""
DIST_TIMEOUT_S = "60"
"""Collective timeout in these tests (NANOSERVE_DIST_TIMEOUT): a bug that hangs fails the test instead."""
NUM_BLOCKS = 48
MAX_MODEL_LEN = 512
ENGINE_ARGS = dict(device="cpu", max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=NUM_BLOCKS,
                   optimizations=CPU_REFERENCE)
GEN_PROMPT_LENS = (70, 21, 5)
GEN_MAX_TOKENS = 12
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def _tp_isolation(monkeypatch):
    """Short collective timeouts, and every test leaves no process group, TP state or worker behind."""
    monkeypatch.setenv("NANOSERVE_DIST_TIMEOUT", DIST_TIMEOUT_S)
    yield
    set_tp(0, 1)
    assert not dist.is_initialized(), "a test left a process group behind"
    assert not multiprocessing.active_children(), "a test left a worker process behind"


# -- helpers ----------------------------------------------------------------------------------------------------
def engine_config(model_dir: str, tp: int = 1, ep: bool = False) -> EngineConfig:
    return EngineConfig.from_kwargs(model=model_dir, tensor_parallel_size=tp, enable_expert_parallel=ep,
                                    **ENGINE_ARGS)


@contextmanager
def running(executor: Executor):
    try:
        executor.initialize_cache(MAX_MODEL_LEN, 8192, 16)
        yield executor
    finally:
        executor.shutdown()


def parity_steps() -> list[ModelInput]:
    """Prefill A (70 tokens > 3 x 16, so MSA drops blocks) and B; decode both beside a first chunk of C; decode
    both beside C's last chunk; decode all three. Block tables are scattered over the pool."""
    g = torch.Generator().manual_seed(1)
    a, b, c = (torch.randint(0, 512, (n,), generator=g).tolist() for n in (70, 21, 60))
    blocks = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    ta, tb, tc = blocks[:6], blocks[6:9], blocks[9:14]
    return [
        ModelInput(a + b, [70, 21], [70, 21], [ta, tb], [0, 1]),
        ModelInput([5, 6] + c[:40], [1, 1, 40], [71, 22, 40], [ta, tb, tc], [0, 1]),
        ModelInput([7, 8] + c[40:], [1, 1, 20], [72, 23, 60], [ta, tb, tc], [0, 1, 2]),
        ModelInput([9, 10, 11], [1, 1, 1], [73, 24, 61], [ta, tb, tc], [0, 1, 2]),
    ]


def step_logits(executor: Executor, inp: ModelInput) -> torch.Tensor:
    """One forward through the executor (every rank runs it) and rank 0's logits of the rows it asks for."""
    executor.execute_model(StepInput(inp, []))
    logits = executor.runner.logits.float().clone()
    executor.sample_tokens().result()  # (the step's second half: no row to sample)
    return logits


def run_steps(executor: Executor, reuse_from: int | None = None) -> list[torch.Tensor]:
    """Every parity step's logits; with reuse_from, the msa_topk_reuse approximation is switched on in place (as
    the benchmark's ablation does) before that step."""
    out = []
    with running(executor) as ex:
        for i, step in enumerate(parity_steps()):
            if i == reuse_from:
                ex.runner.config.optimizations.msa_topk_reuse = True
            out.append(step_logits(ex, step))
    return out


def assert_logits_close(label: str, got: list[torch.Tensor], ref: list[torch.Tensor]) -> None:
    assert len(got) == len(ref)
    for i, (g, r) in enumerate(zip(got, ref)):
        assert g.shape == r.shape, f"{label} step {i}: shape {list(g.shape)} vs {list(r.shape)}"
        max_d, scale = (g - r).abs().max().item(), r.abs().max().item()
        print(f"\n[tp] {label} step {i}: max |diff| = {max_d:.3e}, relative {max_d / scale:.3e}")
        assert max_d <= TP_RTOL * scale, f"{label} step {i}: max |diff| {max_d:.3e} > {TP_RTOL} x {scale:.3f}"


def generate_tokens(llm: LLM, prompts: list[list[int]], max_tokens: int = GEN_MAX_TOKENS) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def gen_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in GEN_PROMPT_LENS]


def wait_until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.02)


def child_pids(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def mapped_file(address: int) -> str:
    """The file whose memory map holds `address` in this process ('' if none)."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return fields[5] if len(fields) > 5 else ""
    return ""


def cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# -- fixtures ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_reference(tiny_dir) -> list[torch.Tensor]:
    return run_steps(LocalExecutor(engine_config(tiny_dir)))


@pytest.fixture(scope="module")
def two_kv_dir(tmp_path_factory) -> str:
    """m3-tiny with 2 KV heads (and 2 index heads, one per KV group): at TP=4 every KV head is replicated x2."""
    preset = get_preset("m3-tiny")
    path = str(tmp_path_factory.mktemp("m3-tiny-2kv"))
    write_checkpoint(path, preset.config.replace(num_key_value_heads=2, index_n_heads=2), preset)
    return path


@pytest.fixture(scope="module")
def generate_reference(tiny_dir) -> dict:
    """TP=1 greedy tokens of gen_prompts(), and one text completion for the server test."""
    llm = LLM(tiny_dir, **ENGINE_ARGS)
    try:
        tokens = generate_tokens(llm, gen_prompts())
        out = llm.generate({"prompt_token_ids": gen_prompts()[0]},
                           SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
        return {"tokens": tokens, "server_text": out.outputs[0].text}
    finally:
        llm.engine.shutdown()


# -- sharding, in one process -----------------------------------------------------------------------------------
def test_kv_head_range_splits_then_replicates():
    assert [kv_head_range(4, r, 2) for r in range(2)] == [(0, 2), (2, 4)]
    assert [kv_head_range(4, r, 4) for r in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    # tp=8 > 4 KV heads: each head on two ranks, the head its query heads (rank r holds query head r) read
    assert [kv_head_range(4, r, 8) for r in range(8)] == [(h, h + 1) for h in (0, 0, 1, 1, 2, 2, 3, 3)]
    assert [kv_head_range(4, r, 16)[0] for r in range(16)] == [r // 4 for r in range(16)]
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        kv_head_range(4, 0, 6)


@pytest.mark.parametrize("ep", [False, True], ids=["tp-experts", "expert-parallel"])
def test_shard_shapes_at_tp8(ep):
    """m3-tiny at tp=8 on every rank: 1 query head, 1 (replicated) KV head and index head, the whole index-key
    head, 1/8 of the vocabulary and MLP, and 1/8 of each expert (TP) or 2 whole experts (EP); the KV pool holds
    one head."""
    cfg = get_preset("m3-tiny").config
    d, di = cfg.head_dim, cfg.index_head_dim
    for rank in range(8):
        set_tp(rank, 8, None, expert_parallel=ep)
        model = M3ForCausalLM(cfg, CPU_REFERENCE)
        dense_attn, sparse_attn = model.layers[0].self_attn, model.layers[1].self_attn
        assert (dense_attn.num_heads, dense_attn.num_kv_heads) == (1, 1)
        assert dense_attn.qkv_proj.weight.shape == (3 * d, cfg.hidden_size)
        assert sparse_attn.qkv_proj.weight.shape == (3 * d + 2 * di, cfg.hidden_size)  # + index_q, index_k
        assert sparse_attn.qkv_proj.parts["k"].start == (rank // 2) * d  # the head its query head reads
        assert sparse_attn.qkv_proj.parts["index_q"].start == (rank // 2) * di
        assert sparse_attn.o_proj.weight.shape == (cfg.hidden_size, d)
        assert model.embed_tokens.weight.shape == (cfg.vocab_size // 8, cfg.hidden_size)
        assert model.layers[0].mlp.gate_up_proj.weight.shape == (2 * cfg.dense_intermediate_size // 8,
                                                                 cfg.hidden_size)
        moe = model.layers[1].mlp
        if ep:
            assert (moe.expert_start, moe.expert_end) == (2 * rank, 2 * rank + 2)
            assert moe.w13.shape[0] == 2 and moe.w13.shape[1] == 2 * cfg.intermediate_size
            assert moe.expert_map.tolist().count(-1) == cfg.num_local_experts - 2
        else:
            assert moe.w13.shape == (cfg.num_local_experts + 1, 2 * cfg.intermediate_size // 8, cfg.hidden_size)
        kv, index = allocate_kv_caches(cfg, 2, cfg.index_block_size, torch.float32, "cpu")
        assert kv[0].shape == (2, 2, cfg.index_block_size, 1, d) and index[0] is None
        assert index[1].shape == (2, cfg.index_block_size, di)  # index keys replicated whole
        per_token = cfg.num_hidden_layers * 2 * d + cfg.num_sparse_attn_layers * di
        assert kv_cache_bytes_per_block(cfg, cfg.index_block_size, torch.float32) == \
            per_token * cfg.index_block_size * 4


def test_engines_refuse_to_mix_with_a_live_tp_state(tiny_dir):
    """The TP state is per process and the layers read it: no second engine while a tensor-parallel one runs."""
    set_tp(0, 2)
    with pytest.raises(RuntimeError, match="tensor-parallel engine is running"):
        LocalExecutor(engine_config(tiny_dir))
    with pytest.raises(RuntimeError, match="already initialised"):
        MultiprocExecutor(engine_config(tiny_dir, 2))


@pytest.mark.parametrize("tp,ep", [(2, False), (2, True), (8, False), (8, True)],
                         ids=["tp2", "tp2-ep", "tp8", "tp8-ep"])
def test_loader_reads_only_this_ranks_slices(tiny_dir, monkeypatch, tp, ep):
    """Wrap the loader's lazy safetensors source and record every read: each rank reads exactly the elements it
    keeps - its slice of split tensors, nothing of another rank's experts, whole replicated tensors. A read is a
    view into the checkpoint file's memory map (safetensors' get_slice), so the only bytes copied into the rank's
    memory are its slice's, when the parameter is filled."""
    cfg = get_preset("m3-tiny").config
    reads: dict[str, int] = {}
    real_getitem = loader.SafeSlice.__getitem__

    def recording_getitem(self, index):
        t = real_getitem(self, index)
        assert mapped_file(t.data_ptr()).endswith(".safetensors"), "a read copied the tensor out of the file"
        reads[self.key] = reads.get(self.key, 0) + t.numel()
        return t

    real_init = loader.SafeSlice.__init__

    def init_with_key(self, handle, key):
        real_init(self, handle, key)
        self.key = key

    monkeypatch.setattr(loader.SafeSlice, "__getitem__", recording_getitem)
    monkeypatch.setattr(loader.SafeSlice, "__init__", init_with_key)
    from safetensors import safe_open

    with safe_open(os.path.join(tiny_dir, "model.safetensors"), framework="pt") as f:
        full = {k: f.get_slice(k).get_shape() for k in f.keys()}
    numel = {k: int(torch.tensor(s).prod().item()) if s else 1 for k, s in full.items()}
    kv_split = min(tp, cfg.num_key_value_heads)
    experts_per_rank = cfg.num_local_experts // tp

    for rank in range(tp):
        reads.clear()
        set_tp(rank, tp, None, expert_parallel=ep)
        loader.load_weights(M3ForCausalLM(cfg, CPU_REFERENCE), tiny_dir)
        for key, n in numel.items():
            name = key.split(".")
            if key.endswith(("norm.weight", "gate.weight", "e_score_correction_bias", "index_k_proj.weight")):
                want = n
            elif key.endswith(("k_proj.weight", "v_proj.weight", "index_q_proj.weight")):
                want = n // kv_split
            elif ".experts." in key:
                expert = int(name[name.index("experts") + 1])
                want = (n if expert // experts_per_rank == rank else 0) if ep else n // tp
            else:  # q/o projections, dense MLP, shared expert, embedding, LM head
                want = n // tp
            assert reads.get(key, 0) == want, f"rank {rank}/{tp}: read {reads.get(key, 0)} of {key}, want {want}"


# -- logits parity, multi-process -------------------------------------------------------------------------------
@pytest.mark.parametrize("tp,ep", [(2, False), (2, True), (4, False)], ids=["tp2", "tp2-ep", "tp4"])
def test_tp_logits_equal_tp1(tiny_dir, tiny_reference, tp, ep):
    got = run_steps(MultiprocExecutor(engine_config(tiny_dir, tp, ep)))
    assert_logits_close(f"m3-tiny tp={tp}{' ep' if ep else ''}", got, tiny_reference)


@pytest.fixture(scope="module")
def mxfp8_dir(tmp_path_factory) -> str:
    preset = get_preset("m3-tiny")
    path = str(tmp_path_factory.mktemp("m3-tiny-mxfp8"))
    write_checkpoint(path, preset.config, preset, mxfp8=True)
    return path


def test_mxfp8_native_tp2_logits_equal_tp1(mxfp8_dir):
    """MXFP8 weights kept as fp8 + scales: tensor-parallel ranks hold row / 32-column-block slices of both, expert
    parallel ranks whole experts; TP=2 and TP=2 EP equal TP=1 of the same checkpoint."""
    ref = run_steps(LocalExecutor(engine_config(mxfp8_dir)))
    for ep in (False, True):
        got = run_steps(MultiprocExecutor(engine_config(mxfp8_dir, 2, ep)))
        assert_logits_close(f"MXFP8 m3-tiny tp=2{' ep' if ep else ''}", got, ref)


def test_replicated_kv_heads_tp4_logits_equal_tp1(two_kv_dir):
    ref = run_steps(LocalExecutor(engine_config(two_kv_dir)))
    got = run_steps(MultiprocExecutor(engine_config(two_kv_dir, 4, ep=True)))
    assert_logits_close("2-KV-head m3-tiny tp=4 ep", got, ref)


def test_control_channel_frames_and_min():
    """Commands smaller than, at, just over and far over one broadcast frame arrive intact; agree_min agrees."""
    from nanoserve.distributed.worker import ControlChannel

    init = f"tcp://127.0.0.1:{free_loopback_port()}"
    peer = multiprocessing.get_context("spawn").Process(target=channel_peer, args=(init,), daemon=True)
    peer.start()
    try:
        dist.init_process_group("gloo", init_method=init, rank=0, world_size=2)
        channel = ControlChannel(dist.new_group(backend="gloo"), rank=0)
        for msg in channel_messages(ControlChannel.FRAME_BYTES):
            channel.send(msg)
        assert channel.agree_min(1) == 1, "the peer received a command that differs from what was sent"
        assert channel.agree_min(7) == 5
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        peer.join(30)
        if peer.is_alive():
            peer.kill()
            peer.join()
    assert peer.exitcode == 0


def test_switch_flipped_on_rank0_reaches_the_workers(tiny_dir, tiny_reference):
    """The benchmark's ablation flips switches in place on rank 0's runner; the workers must follow at the next
    step. msa_topk_reuse changes the MSA selection (so the logits): if a worker missed the flip, its KV groups
    would select differently from rank 0's and the result would match neither run."""
    ref = run_steps(LocalExecutor(engine_config(tiny_dir)), reuse_from=1)
    assert any((r - t).abs().max() > 1e-3 for r, t in zip(ref[1:], tiny_reference[1:])), \
        "msa_topk_reuse does not change these steps: the test would prove nothing"
    got = run_steps(MultiprocExecutor(engine_config(tiny_dir, 2)), reuse_from=1)
    assert_logits_close("m3-tiny tp=2, msa_topk_reuse from step 1", got, ref)


# -- the engine, offline and under torchrun ---------------------------------------------------------------------
def test_offline_generate_tp2_equals_tp1(tiny_dir, generate_reference):
    llm = LLM(tiny_dir, tensor_parallel_size=2, **ENGINE_ARGS)
    try:
        assert isinstance(llm.engine.executor, MultiprocExecutor)
        assert generate_tokens(llm, gen_prompts()) == generate_reference["tokens"]
    finally:
        llm.engine.shutdown()
    assert get_tp().size == 1


def test_torchrun_two_ranks_generate_equals_tp1(tiny_dir, generate_reference, tmp_path):
    """`torchrun --nproc-per-node 2 tests/helpers/tp_torchrun_generate.py ...` on the CPU: both ranks run the same
    script; rank 1 turns into a worker inside LLM(...) and exits when rank 0 is done."""
    request = tmp_path / "request.json"
    out = tmp_path / "tokens.json"
    engine_args = {k: v for k, v in ENGINE_ARGS.items() if k != "optimizations"}
    switches_off = [n for n, on in CPU_REFERENCE.as_dict().items() if not on]
    request.write_text(json.dumps({"model": tiny_dir, "prompts": gen_prompts(), "max_tokens": GEN_MAX_TOKENS,
                                   "engine_args": engine_args, "switches_off": switches_off}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_loopback_port()),
           os.path.join(REPO, "tests", "helpers", "tp_torchrun_generate.py"), str(request), str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert json.loads(out.read_text()) == generate_reference["tokens"]


# -- failures ---------------------------------------------------------------------------------------------------
def test_killed_worker_mid_run_fails_fast(tiny_dir):
    llm = LLM(tiny_dir, tensor_parallel_size=2, **ENGINE_ARGS)
    executor = llm.engine.executor
    try:
        steps: list[float] = []
        llm.engine.add_observer(lambda event, **_: steps.append(time.monotonic()) if event == "step" else None)
        outcome: dict[str, BaseException] = {}

        def generate() -> None:
            try:
                generate_tokens(llm, gen_prompts(), max_tokens=MAX_MODEL_LEN - 80)
            except BaseException as e:
                outcome["error"] = e

        thread = threading.Thread(target=generate, daemon=True)
        thread.start()
        wait_until(lambda: len(steps) >= 3, 120, "a few steps")
        os.kill(executor.worker_pids[0], signal.SIGKILL)
        t0 = time.monotonic()
        thread.join(FAIL_FAST_S)
        elapsed = time.monotonic() - t0
        assert not thread.is_alive(), f"the engine hung for {FAIL_FAST_S} s after its worker was killed"
        print(f"\n[tp] killed worker -> engine error after {elapsed:.2f} s")
        error = outcome.get("error")
        assert isinstance(error, RuntimeError), f"generate ended with {error!r}, not the worker's death"
        assert "tensor-parallel worker 1 died (exit code -9)" in str(error)
        with pytest.raises(WorkerFailure, match="worker 1 died"):
            executor.check_health()
        with pytest.raises(WorkerFailure, match="worker 1 died"):  # failed for good: no new step, no hang
            generate_tokens(llm, gen_prompts()[:1], max_tokens=2)
    finally:
        t0 = time.monotonic()
        llm.engine.shutdown()
        assert time.monotonic() - t0 < FAIL_FAST_S


def test_worker_death_while_idle_is_reported(tiny_dir):
    executor = MultiprocExecutor(engine_config(tiny_dir, 2))
    try:
        executor.check_health()
        os.kill(executor.worker_pids[0], signal.SIGKILL)

        def reported() -> bool:
            try:
                executor.check_health()
            except WorkerFailure:
                return True
            return False

        wait_until(reported, 10, "check_health to report the dead worker")
        with pytest.raises(WorkerFailure, match=r"tensor-parallel worker 1 died \(exit code -9\)"):
            step_logits(executor, parity_steps()[0])
    finally:
        executor.shutdown()


HANG_TIMEOUT_S = 2.0
"""worker_timeout of the hang tests: short, so they are quick."""


def test_stopped_worker_while_idle_fails_within_the_worker_timeout(tiny_dir):
    config = EngineConfig.from_kwargs(model=tiny_dir, tensor_parallel_size=2, worker_timeout=HANG_TIMEOUT_S,
                                      **ENGINE_ARGS)
    executor = MultiprocExecutor(config)
    [pid] = executor.worker_pids
    try:
        executor.initialize_cache(MAX_MODEL_LEN, 8192, 16)
        step_logits(executor, parity_steps()[0])
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()

        def reported() -> bool:
            try:
                executor.check_health()
            except WorkerFailure:
                return True
            return False

        wait_until(reported, HANG_TIMEOUT_S + 10, "check_health to report the stopped worker")
        elapsed = time.monotonic() - t0
        # silence counts from the last heartbeat, which came up to one interval (T/4) before the stop
        assert HANG_TIMEOUT_S * 0.75 <= elapsed < HANG_TIMEOUT_S + 2, elapsed
        with pytest.raises(WorkerFailure, match=r"^tensor-parallel worker 1 did not answer within 2 s$"):
            step_logits(executor, parity_steps()[0])  # failed for good, at once
    finally:
        executor.shutdown()  # kills the stopped worker
        assert not pid_alive(pid)


def test_stuck_collective_with_live_heartbeats_is_bounded():
    """A worker that still sends heartbeats but never joins rank 0's collective (a deadlock): once steps are
    bounded, rank 0's gloo collective gives up after the worker timeout instead of waiting for it."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    init = f"tcp://127.0.0.1:{free_loopback_port()}"
    peer = ctx.Process(target=stuck_peer, args=(init, child, 0.25), daemon=True)
    peer.start()
    child.close()
    watchdog = WorkerWatchdog(timeout=HANG_TIMEOUT_S)
    watchdog.watch(1, peer, parent)
    watchdog.start()
    try:
        dist.init_process_group("gloo", init_method=init, rank=0, world_size=2,
                                timeout=datetime.timedelta(seconds=60))
        dist.barrier()
        watchdog.bound_steps([dist.group.WORLD])
        t0 = time.monotonic()
        with pytest.raises(WorkerFailure, match=r"worker\(s\) 1 did not answer within 2 s; every worker still "
                                                r"sends heartbeats"):
            watchdog.guarded(dist.all_reduce, torch.ones(4))
        assert HANG_TIMEOUT_S <= time.monotonic() - t0 < HANG_TIMEOUT_S + 2
        with pytest.raises(WorkerFailure, match="did not answer"):  # the verdict stands
            watchdog.raise_if_failed()
    finally:
        watchdog.stop()
        peer.kill()
        peer.join()
        watchdog.close()
        if dist.is_initialized():
            dist.destroy_process_group()


# -- the server -------------------------------------------------------------------------------------------------
def test_server_tp2_serves_then_fails_cleanly(tiny_dir, generate_reference, tmp_path):
    """python -m nanoserve.server --tensor-parallel-size 2: serves TP=1's completion; after its worker is killed
    /health turns 503 while idle and requests get 500; it exits (status 1: its engine died, so a supervisor restarts
    it) by itself or on SIGTERM, and no worker outlives it."""
    httpx = pytest.importorskip("httpx")
    port = free_loopback_port()
    switch_flags = [f"--no-{n.replace('_', '-')}" for n, on in CPU_REFERENCE.as_dict().items() if not on]
    cmd = [sys.executable, "-m", "nanoserve.server", "--model", tiny_dir, "--port", str(port), "--device", "cpu",
           "--tensor-parallel-size", "2", "--max-model-len", str(MAX_MODEL_LEN), "--num-gpu-blocks-override",
           str(NUM_BLOCKS), "--served-model-name", "tiny", *switch_flags]
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    workers: list[int] = []
    try:
        def healthy() -> bool:
            assert server.poll() is None, log_path.read_text()
            try:
                return httpx.get(f"{url}/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(healthy, 180, "the server to start")
        workers = [pid for pid in child_pids(server.pid) if b"spawn_main" in cmdline(pid)]
        assert len(workers) == 1, f"expected one worker process, found {workers}"
        body = {"model": "tiny", "prompt": gen_prompts()[0], "max_tokens": 8, "temperature": 0.0,
                "ignore_eos": True}
        resp = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] == generate_reference["server_text"]

        os.kill(workers[0], signal.SIGKILL)
        # an idle server notices the dead worker on /health, before any request trips over it
        wait_until(lambda: httpx.get(f"{url}/health", timeout=10).status_code == 503, FAIL_FAST_S,
                   "/health to report the dead worker")
        assert "tensor-parallel worker 1 died" in httpx.get(f"{url}/health", timeout=10).text
        resp = httpx.post(f"{url}/v1/completions", json=body, timeout=FAIL_FAST_S)
        assert resp.status_code == 500, resp.text
        assert "tensor-parallel worker 1 died" in resp.json()["error"]["message"]

        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        for pid in workers:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert server.returncode == 1, log_path.read_text()[-4000:]
