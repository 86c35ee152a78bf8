"""Helpers for tests/engine/test_tensor_parallel.py that must live in an importable module: code a spawned process runs
(the control-channel peer) and the settings shared with the torchrun script."""

from __future__ import annotations

import datetime
import pickle

import torch.distributed as dist

from nanoserve.config import Optimizations

CPU_REFERENCE = Optimizations.reference_kernels().replace(cuda_graphs=False)
"""Triton kernels off: on the CPU they run in the (slow) interpreter; these tests are about the sharding."""


def channel_messages(frame_bytes: int) -> list[tuple]:
    """Commands whose pickles are smaller than, exactly at, just over and far over one frame."""
    out = [("step", [1, 2, 3])]
    for target in (frame_bytes - 8, frame_bytes - 7, frame_bytes + 1, 7 * frame_bytes + 13):
        blob = b""
        while True:  # grow the payload until the pickle has exactly `target` bytes
            msg = ("blob", blob)
            size = len(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
            if size == target:
                break
            blob = bytes(range(256)) * ((target - size + len(blob)) // 256 + 1)
            blob = blob[: target - size + len(blob)]
        out.append(msg)
    return out


def channel_peer(init_method: str) -> None:
    """Rank 1 of a two-process gloo group: receive every command, then report (through agree_min) whether each
    one arrived intact and what its own value is."""
    from nanoserve.distributed.worker import ControlChannel

    dist.init_process_group("gloo", init_method=init_method, rank=1, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    channel = ControlChannel(dist.new_group(backend="gloo"), rank=1)
    intact = all(channel.recv() == msg for msg in channel_messages(ControlChannel.FRAME_BYTES))
    channel.agree_min(int(intact))
    channel.agree_min(5)
    dist.destroy_process_group()


def stuck_peer(init_method: str, conn, heartbeat_s: float) -> None:
    """Rank 1 of a two-process gloo group that joins, then never takes part in another collective while its
    heartbeat thread keeps saying it is alive: a deadlocked worker, as rank 0 sees it. Exits when rank 0 closes
    the pipe."""
    from nanoserve.distributed.watchdog import WorkerPipe

    pipe = WorkerPipe(conn)
    pipe.start_heartbeat(heartbeat_s)
    dist.init_process_group("gloo", init_method=init_method, rank=1, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    dist.barrier()
    pipe.wait_for_parent_exit()
