"""The engines' life cycle: shutdown(), the context managers, the finalizer, and tensor-parallel engines one after
another in one process (TP=2 on gloo, CPU) - for the offline LLM and for AsyncLLMEngine."""

from __future__ import annotations

import asyncio
import gc
import os
import time

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.config import EngineConfig
from nanoserve.entrypoints.async_engine import AsyncLLMEngine, EngineShutdownError
from nanoserve.parallel_state import get_tp
from tests.helpers.server_utils import FAST_CPU

ARGS = dict(device="cpu", max_model_len=256, num_gpu_blocks_override=64, optimizations=FAST_CPU)
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ", 1)[1][0] != "Z"  # a zombie has exited


def test_two_tp_llms_one_after_another_and_shutdown_forms(tiny_dir):
    with LLM(tiny_dir, tensor_parallel_size=2, **ARGS) as llm:
        first = llm.generate(["Hello there"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        pids = llm.engine.executor.worker_pids
    assert len(first) == 4 and not any(alive(p) for p in pids) and get_tp().size == 1
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(["Hello there"], GREEDY, use_tqdm=False)

    llm = LLM(tiny_dir, tensor_parallel_size=2, **ARGS)  # a second TP engine in the same process
    assert llm.generate(["Hello there"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == first
    pids = llm.engine.executor.worker_pids
    del llm  # the last reference: the finalizer stops the workers
    gc.collect()
    assert not any(alive(p) for p in pids) and get_tp().size == 1

    llm = LLM(tiny_dir, **ARGS)  # and a single-process one after that
    assert llm.generate(["Hello there"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == first
    llm.shutdown()
    llm.shutdown()  # idempotent


def async_engine(model_dir: str, tp: int) -> AsyncLLMEngine:
    return AsyncLLMEngine.from_config(EngineConfig.from_kwargs(model=model_dir, tensor_parallel_size=tp, **ARGS))


async def greedy_tokens(engine: AsyncLLMEngine, request_id: str = "r") -> list[int]:
    outs = [o async for o in engine.generate(request_id, "Hello there", GREEDY)]
    return outs[-1].outputs[0].token_ids


def test_async_engines_one_after_another_and_shutdown_forms(tiny_dir):
    """`async with` (TP=2), `await shutdown()` (TP=1), a plain `with` around asyncio.run (TP=1) and the finalizer
    (TP=2): each releases the engine (its workers exit, the process groups are left), so the next one works."""
    async def first_two() -> tuple[list[int], list[int]]:
        async with async_engine(tiny_dir, 2) as engine:  # started on entering
            first = await greedy_tokens(engine)
            pids = engine.engine.executor.worker_pids
        assert not any(alive(p) for p in pids) and get_tp().size == 1
        with pytest.raises(EngineShutdownError, match="shut down"):
            await engine.add_request("late", "Hello there", GREEDY)
        with pytest.raises(RuntimeError, match="shut down"):
            await engine.start()

        engine = async_engine(tiny_dir, 1)  # a single-process one after it
        await engine.start()
        second = await greedy_tokens(engine)
        await engine.shutdown()
        await engine.shutdown()  # idempotent
        return first, second

    first, second = asyncio.run(first_two())
    assert len(first) == 4 and second == first

    with async_engine(tiny_dir, 1) as engine:  # the event loop ends inside; leaving the block releases it
        async def use(engine: AsyncLLMEngine) -> list[int]:
            await engine.start()
            return await greedy_tokens(engine)  # no shutdown: asyncio.run cancels the engine loop

        assert asyncio.run(use(engine)) == first
    with pytest.raises(RuntimeError, match="shut down"):
        asyncio.run(engine.start())

    engine = async_engine(tiny_dir, 2)
    pids = engine.engine.executor.worker_pids

    async def use_and_drop(engine: AsyncLLMEngine) -> list[int]:
        await engine.start()
        return await greedy_tokens(engine)

    assert asyncio.run(use_and_drop(engine)) == first
    del engine  # the last reference: the finalizer stops the workers
    # the engine thread may still finish a step that asyncio.run's exit abandoned (its job holds the engine)
    deadline = time.monotonic() + 30
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    assert not any(alive(p) for p in pids) and get_tp().size == 1


def test_cpu_threads_default_override_and_errors(monkeypatch):
    from nanoserve.cpu_threads import physical_cores, resolve_cpu_threads

    monkeypatch.delenv("NANOSERVE_CPU_THREADS", raising=False)
    assert resolve_cpu_threads() == physical_cores() >= 1
    assert physical_cores() <= len(os.sched_getaffinity(0))
    assert resolve_cpu_threads(3) == 3
    monkeypatch.setenv("NANOSERVE_CPU_THREADS", "2")
    assert resolve_cpu_threads() == 2 and resolve_cpu_threads(5) == 5  # the argument wins over the variable
    monkeypatch.setenv("NANOSERVE_CPU_THREADS", "many")
    with pytest.raises(ValueError, match="NANOSERVE_CPU_THREADS"):
        resolve_cpu_threads()
    with pytest.raises(ValueError, match="cpu_threads"):
        resolve_cpu_threads(0)
