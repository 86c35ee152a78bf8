"""How an engine on a GPU sizes its KV pool (model/memory_plan.py `engine_kv_pool_bytes`, which
runner/model_runner.py calls with what torch reports), checked on the accounting itself: alone on the device an
engine gets total x gpu_memory_utilization less its own peak and other processes' memory (the rule it always
had); a second engine in the same process counts neither the first one's memory nor tensors left by one shut down,
gets its share when the device has it, and otherwise what is left after its steps' activations, never more than is
free. tests/engine/test_gpu_engine.py builds the engines on a GPU."""

from __future__ import annotations

import pytest

from nanoserve.model.memory_plan import DeviceMemory, engine_kv_pool_bytes, kv_pool_bytes

GiB = 2**30
TOTAL = 140 * GiB


def device(*, other_processes=0, baseline=0, weights=10 * GiB, activations=2 * GiB, cached=0) -> DeviceMemory:
    """The reading after the warm-up step: this process holds baseline + weights (+ cached by its allocator),
    its warm-up peaked at activations above that, other processes hold other_processes."""
    held = baseline + weights
    reserved = held + cached
    return DeviceMemory(total=TOTAL, free=TOTAL - other_processes - reserved, baseline=baseline, held=held,
                        peak=held + activations, reserved=reserved)


@pytest.mark.parametrize("other_processes", [0, 7 * GiB])
@pytest.mark.parametrize("cached", [0, 3 * GiB])
def test_alone_the_pool_is_the_share(other_processes, cached):
    mem = device(other_processes=other_processes, cached=cached)
    want = kv_pool_bytes(TOTAL, 0.9, 12 * GiB + other_processes)
    assert engine_kv_pool_bytes(mem, 0.9) == want == int(0.9 * TOTAL) - 12 * GiB - other_processes


def test_a_second_engine_does_not_count_the_first_ones_memory():
    """The first engine holds 40 GiB (its weights and pool) when the second is built at utilization 0.3: the
    second gets the same share the first would have alone, since the device has room for it."""
    alone = engine_kv_pool_bytes(device(), 0.3)
    beside = engine_kv_pool_bytes(device(baseline=40 * GiB), 0.3)
    assert beside == alone == int(0.3 * TOTAL) - 12 * GiB
    # tensors of a shut-down engine that the collector has not freed yet count the same way: not against the share
    assert engine_kv_pool_bytes(device(baseline=25 * GiB, cached=5 * GiB), 0.3) == alone


def test_where_the_share_does_not_fit_the_pool_is_what_is_left():
    """The first engine took 0.9 of the device; the second, also at 0.9, gets the free memory less its own
    steps' activations - not a negative budget, and never more than the device has."""
    first = int(0.9 * TOTAL)
    mem = device(baseline=first, cached=1 * GiB)
    pool = engine_kv_pool_bytes(mem, 0.9)
    assert pool == mem.free + 1 * GiB - 2 * GiB
    assert 0 < pool < kv_pool_bytes(TOTAL, 0.9, 12 * GiB)
    assert mem.peak + pool <= mem.total - (mem.total - mem.free - mem.reserved)  # the pool and a step fit
