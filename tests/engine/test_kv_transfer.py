"""P/D disaggregation outside the engine core (nanoserve/kv_transfer/): `--kv-transfer-config`, the request-level
`kv_transfer_params` protocol of vLLM's NixlConnector, and KV blocks moved between two processes by NIXL over TCP.

The transfer test runs a source and a destination in two fresh processes on loopback, with UCX held to its TCP
transport (UCX_TLS=tcp, as between two machines without RDMA): the source keeps pools like a server's (a bf16 K/V
pool and an fp8 index-key pool, block dimension first), the destination pulls given block ids into its own blocks,
and every byte is compared; the source learns from NIXL's notification that the blocks were read, and frees blocks
nobody pulls after their timeout; once the source is gone, a pull from it fails at once (a decode server then fails
the request or computes the prompt itself).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback

import pytest
import torch

from nanoserve.kv_transfer import params
from nanoserve.kv_transfer.config import KVTransferConfig
from nanoserve.kv_transfer.transfer import PoolRegion, coalesce, layout_mismatch
from tests.helpers.server_utils import free_port

NUM_BLOCKS = 12


def pools(seed: int | None, num_blocks: int = NUM_BLOCKS, heads: int = 2) -> list[torch.Tensor]:
    """A K/V pool [blocks, 2, block_size, heads, head_dim] in bf16 and an MSA index-key pool [blocks, block_size,
    dim] in fp8 e4m3: random content from `seed`, or zeros."""
    g = torch.Generator().manual_seed(seed or 0)
    kv = torch.randn(num_blocks, 2, 4, heads, 8, generator=g).to(torch.bfloat16)
    index = torch.randint(0, 256, (num_blocks, 4, 8), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
    if seed is None:
        kv.zero_(), index.view(torch.uint8).zero_()
    return [kv, index]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


# -- the two processes -----------------------------------------------------------------------------------------------
def transport(device: str) -> None:
    """Between CPU processes UCX is held to TCP (as between machines without RDMA); on a GPU it picks its own
    (CUDA IPC within a machine)."""
    if device == "cpu":
        os.environ["UCX_TLS"] = "tcp"


def source(port: int, out: mp.Queue, stop, device: str) -> None:
    try:
        transport(device)
        from nanoserve.kv_transfer.transfer import KVTransferAgent

        agent = KVTransferAgent("prefill-0", [p.to(device) for p in pools(seed=1)])
        agent.serve("127.0.0.1", port)
        agent.expect("req-pulled", timeout_s=60)
        agent.expect("req-cached", timeout_s=60)
        agent.expect("req-abandoned", timeout_s=1.0)
        out.put(("ready", None))
        done: list = []
        import time

        deadline = time.monotonic() + 60
        while len(done) < 3 and time.monotonic() < deadline:
            done += agent.finished()
            time.sleep(0.01)
        out.put(("finished", sorted(done)))
        out.put(("left", agent.num_expected))
        stop.wait(90)  # the side channel stays up for the destination's last connect
        agent.shutdown()
    except BaseException:
        out.put(("error", traceback.format_exc()))


def destination(port: int, out: mp.Queue, source_gone, device: str) -> None:
    try:
        transport(device)
        from nanoserve.kv_transfer.transfer import KVTransferAgent

        mine = [p.to(device) for p in pools(seed=None)]
        agent = KVTransferAgent("decode-0", mine)
        engine = agent.connect("127.0.0.1", port)
        pairs = [(3, 0), (4, 1), (7, 2), (1, 5)]  # remote 3-4 into local 0-1 is one run
        state = agent.pull(engine, pairs, "req-pulled").wait()
        nothing = agent.pull(engine, [], "req-cached").state()  # a full prefix hit: nothing to read, free there
        out.put(("pulled", (engine, state, nothing, [as_bytes(p).cpu() for p in mine])))

        # another geometry: refused, naming the pool
        wrong = KVTransferAgent("decode-1", [p.to(device) for p in pools(seed=None, heads=4)])
        try:
            wrong.connect("127.0.0.1", port)
            out.put(("mismatch", None))
        except ValueError as exc:
            out.put(("mismatch", str(exc)))
        wrong.shutdown()
        source_gone.wait(90)  # a source that died: the next pull fails at once, naming it
        try:
            agent.pull(engine, [(2, 3)], "req-late")
            out.put(("dead source", None))
        except ConnectionError as exc:
            out.put(("dead source", str(exc)))
        agent.shutdown()
    except BaseException:
        out.put(("error", traceback.format_exc()))


def take(q: mp.Queue, what: str, timeout: float = 90):
    kind, value = q.get(timeout=timeout)
    assert kind != "error", value
    assert kind == what, (kind, value)
    return value


def test_blocks_move_between_two_processes_over_tcp():
    two_processes("cpu")


@pytest.mark.gpu
def test_blocks_move_between_two_processes_on_a_gpu():
    """The same pull between device pools (NIXL's VRAM): the code path a GPU server takes."""
    two_processes("cuda")


def two_processes(device: str) -> None:
    ctx = mp.get_context("spawn")
    port = free_port()
    src_q, dst_q, stop, source_gone = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Event()
    src = ctx.Process(target=source, args=(port, src_q, stop, device), daemon=True)
    dst = ctx.Process(target=destination, args=(port, dst_q, source_gone, device), daemon=True)
    src.start()
    try:
        take(src_q, "ready")
        dst.start()
        engine, state, nothing, got = take(dst_q, "pulled")
        assert (engine, state, nothing) == ("prefill-0", "done", "done")
        want = [as_bytes(p) for p in pools(seed=1)]
        for pool_got, pool_want in zip(got, want):  # bf16 K/V and fp8 index keys, byte for byte
            for remote, local in [(3, 0), (4, 1), (7, 2), (1, 5)]:
                assert torch.equal(pool_got[local], pool_want[remote])
            for untouched in (3, 4, 6, 7, 8, 9, 10, 11):
                assert not pool_got[untouched].any()
        assert "pool 0: blocks of [2, 4, 2, 8] bfloat16" in take(dst_q, "mismatch")
        assert take(src_q, "finished") == [("req-abandoned", "timeout"), ("req-cached", "pulled"),
                                           ("req-pulled", "pulled")]
        assert take(src_q, "left") == 0
        stop.set()
        src.join(30)
        assert src.exitcode == 0
        source_gone.set()
        assert "the KV pull of req-late from engine 'prefill-0' failed" in take(dst_q, "dead source")
        dst.join(30)
        assert dst.exitcode == 0
    finally:
        stop.set()
        source_gone.set()
        for p in (src, dst):
            if p.is_alive():
                p.kill()


# -- pieces ----------------------------------------------------------------------------------------------------------
def test_regions_describe_every_pool_and_mismatches_name_the_pool():
    a = [PoolRegion.of(p) for p in pools(seed=1)]
    assert [(r.block_shape, r.dtype, r.num_blocks, r.mem_type) for r in a] == \
        [((2, 4, 2, 8), "bfloat16", NUM_BLOCKS, "DRAM"), ((4, 8), "float8_e4m3fn", NUM_BLOCKS, "DRAM")]
    assert a[0].block_bytes == 2 * 4 * 2 * 8 * 2 and a[1].block_bytes == 4 * 8
    assert layout_mismatch(a, [PoolRegion.of(p) for p in pools(seed=2, num_blocks=30)]) is None  # sizes may differ
    fp8_kv = [pools(seed=1)[0].view(torch.uint8)[..., :8].contiguous().view(torch.float8_e4m3fn), pools(seed=1)[1]]
    assert layout_mismatch(a, [PoolRegion.of(p) for p in fp8_kv]).startswith("pool 0:")
    assert layout_mismatch(a, a[:1]) == "1 pools there, 2 here"
    with pytest.raises(ValueError, match="contiguous"):
        PoolRegion.of(pools(seed=1)[0].transpose(1, 2))


def test_coalesce_merges_runs_consecutive_on_both_sides():
    assert coalesce([(3, 0), (4, 1), (7, 2), (8, 3), (1, 5), (2, 7)]) == [(3, 0, 2), (7, 2, 2), (1, 5, 1), (2, 7, 1)]
    assert coalesce([]) == []


def test_the_router_s_prefill_request_and_the_prefill_answer():
    """The params vllm-router sends a prefill server, what its answer carries, what the decode server reads."""
    router_sends = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                    "remote_block_ids": None, "remote_host": None, "remote_port": None}
    assert params.parse(router_sends) == params.RemoteDecode()
    answer = params.prefill_answer("prefill-0", "chatcmpl-1", [3, 7, 1], "10.0.0.5", 5600)
    assert answer == {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[3, 7, 1]],
                      "remote_engine_id": "prefill-0", "remote_request_id": "chatcmpl-1", "remote_host": "10.0.0.5",
                      "remote_port": 5600, "tp_size": 1}
    assert params.parse(answer) == params.RemotePrefill("prefill-0", "chatcmpl-1", "10.0.0.5", 5600, (3, 7, 1))
    assert params.parse({**answer, "remote_block_ids": [3, 7, 1]}).block_ids == (3, 7, 1)  # vLLM's older form
    assert params.parse(None) is None and params.parse({}) is None
    assert params.parse({"do_remote_prefill": False, "do_remote_decode": False}) is None


@pytest.mark.parametrize("change, field", [
    ({"remote_block_ids": [[1], [2]]}, "remote_block_ids"), ({"remote_block_ids": [1, -2]}, "remote_block_ids"),
    ({"remote_block_ids": None}, "remote_block_ids"), ({"remote_port": "5600"}, "remote_port"),
    ({"remote_host": ""}, "remote_host"), ({"remote_engine_id": None}, "remote_engine_id"),
    ({"remote_request_id": 7}, "remote_request_id"), ({"tp_size": 0}, "tp_size"),
    ({"do_remote_prefill": "yes"}, "do_remote_prefill"),
])
def test_bad_params_name_the_field(change, field):
    good = params.prefill_answer("p", "r", [1, 2], "h", 5600)
    with pytest.raises(ValueError, match=f"kv_transfer_params.{field} "):
        params.parse({**good, **change})
    with pytest.raises(ValueError, match="cannot both be true"):
        params.parse({**good, "do_remote_decode": True})


def test_pull_plan_reads_only_what_the_decode_cache_lacks():
    assert params.pull_plan((3, 7, 1, 9), [20, 21, 22, 23]) == [(3, 20), (7, 21), (1, 22), (9, 23)]
    assert params.pull_plan((3, 7, 1, 9), [22, 23]) == [(1, 22), (9, 23)]  # its first two blocks were cached here
    assert params.pull_plan((3, 7), []) == []
    with pytest.raises(ValueError):
        params.pull_plan((3,), [1, 2])


def test_kv_transfer_config_in_vllms_shape():
    cfg = KVTransferConfig.from_dict({"kv_connector": "NixlConnector", "kv_role": "kv_both"})
    assert cfg.is_producer and cfg.is_consumer and cfg.backends == ["UCX"] and len(cfg.engine_id) == 36
    cfg = KVTransferConfig.from_dict({"kv_connector": "NixlConnector", "kv_role": "kv_consumer", "engine_id": "d0",
                                      "kv_connector_extra_config": {"backends": ["UCX"]}, "kv_buffer_device": "cpu"})
    assert cfg.is_consumer and not cfg.is_producer and cfg.engine_id == "d0"
    assert not KVTransferConfig.from_dict({}).is_producer
    for bad, message in [({"kv_connector": "NixlConnector"}, "kv_role is needed"),
                         ({"kv_connector": "NixlConnector", "kv_role": "prefill"}, "kv_role must be one of"),
                         ({"kv_connector": "P2pNcclConnector", "kv_role": "kv_both"}, "is not served"),
                         ({"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_rol": 1}, "unknown keys"),
                         ({"kv_connector": "NixlConnector", "kv_role": "kv_both",
                           "kv_connector_extra_config": {"backends": "UCX"}}, "backends must be")]:
        with pytest.raises(ValueError, match=message):
            KVTransferConfig.from_dict(bad)


def test_the_server_refuses_what_the_connector_cannot_serve():
    """--kv-transfer-config is checked in vLLM's shape, and a connector with tensor parallelism (each rank would
    move its shard) stops the start (exit 2) with a message saying why, instead of serving requests whose
    kv_transfer_params it could not honour."""
    import subprocess
    import sys

    run = [sys.executable, "-m", "nanoserve.server", "--model", "m3-tiny", "--device", "cpu", "--kv-transfer-config"]
    out = subprocess.run(run + ['{"kv_connector": "NixlConnector", "kv_role": "kv_both"}', "--tensor-parallel-size",
                                "2"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "runs with tensor_parallel_size 1 only" in out.stderr, out.stderr
    out = subprocess.run(run + ['{"kv_connector": "NixlConnector"}'], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "kv_role is needed" in out.stderr, out.stderr
