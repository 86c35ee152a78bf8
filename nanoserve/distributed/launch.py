"""Tensor parallelism across machines: ranks started by torchrun instead of spawned by the engine.

    torchrun --nnodes 2 --nproc-per-node 8 --node-rank R --master-addr HOST --master-port 29500 \\
        -m nanoserve.server --model DIR --tensor-parallel-size 16

torchrun starts the same command once per GPU and tells each process where it is (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT). Rank 0 becomes the engine - the server, or an offline script's `LLM(...)` - and joins
through env:// instead of spawning workers. Every other rank becomes a worker as soon as it has an engine config:
`run_worker_if_torchrun(config)` joins the process groups, runs the worker loop (distributed/worker.py) and exits
the process when rank 0 shuts down. The server calls it before binding its port; `LLM(...)` reaches it through
MultiprocExecutor. `python -m nanoserve.distributed.launch` is a bare worker, for ranks > 0 started on their own.

When a rank dies, torchrun's agent stops the others on its host (and the rendezvous the other hosts); rank 0's
step bound (--worker-timeout, distributed/watchdog.py) covers a rank that hangs without dying.
"""

from __future__ import annotations

import argparse
import os
import signal

from nanoserve.config import DEVICES, EngineConfig
from nanoserve.distributed.worker import RankInfo, run_worker

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def torchrun_rank() -> RankInfo | None:
    """This process's place in a torchrun launch (WORLD_SIZE > 1 in the environment), else None."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return None
    missing = [k for k in TORCHRUN_ENV if k not in os.environ]
    if missing:
        raise RuntimeError(f"WORLD_SIZE={world_size} is set but {', '.join(missing)} is not: start every rank with "
                           f"torchrun (or set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT yourself)")
    return RankInfo(int(os.environ["RANK"]), world_size, int(os.environ["LOCAL_RANK"]), "env://")


def check_world_size(info: RankInfo, tensor_parallel_size: int) -> None:
    if info.world_size != tensor_parallel_size:
        raise ValueError(f"torchrun started {info.world_size} processes but tensor_parallel_size="
                         f"{tensor_parallel_size}: they must be equal (pass --tensor-parallel-size "
                         f"{info.world_size})")


def run_worker_if_torchrun(config: EngineConfig) -> None:
    """Under torchrun on a rank > 0: serve as a tensor-parallel worker, then exit the process. Otherwise return
    at once (rank 0, or no torchrun), so the caller goes on to build the engine."""
    info = torchrun_rank()
    if info is None or info.rank == 0:
        return
    check_world_size(info, config.tensor_parallel_size)
    serve_as_worker(config, info)
    raise SystemExit(0)


def serve_as_worker(config: EngineConfig, info: RankInfo) -> None:
    # torchrun forwards SIGINT / SIGTERM to every rank. Only rank 0 decides when to stop (a server drains its
    # in-flight requests first, which needs every shard), so a worker waits for rank 0's stop command, or for
    # rank 0's sockets to close; torchrun's own SIGKILL after its grace period remains the backstop.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    run_worker(config, info)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m nanoserve.distributed.launch",
        description="A bare tensor-parallel worker (rank > 0) under torchrun; it takes the model and every other "
                    "setting from rank 0.")
    parser.add_argument("--device", default="auto", choices=DEVICES,
                        help="where this rank runs (cuda:LOCAL_RANK on GPUs); must match rank 0")
    args = parser.parse_args(argv)
    info = torchrun_rank()
    if info is None or info.rank == 0:
        raise SystemExit("nanoserve.distributed.launch is for ranks > 0 under torchrun; rank 0 runs the engine "
                         "(python -m nanoserve.server, or a script that builds LLM(...))")
    serve_as_worker(EngineConfig(device=args.device, tensor_parallel_size=info.world_size), info)


if __name__ == "__main__":
    main()
