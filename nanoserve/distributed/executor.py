"""MultiprocExecutor: tensor parallelism as the engine sees it, from rank 0.

The engine's process is rank 0: it holds a ModelRunner with shard 0 and is where the logits come back to be turned
into tokens (the LM head already all-gathers the vocabulary): sampling, prompt logprobs and speculative verification
run on rank 0 only, and only the forward's ModelInput travels to the other ranks. Ranks 1..N-1 are worker processes -
spawned here with torch.multiprocessing (a fresh interpreter each, which inherits this process's environment:
TRITON_INTERPRET, NANOSERVE_CACHE, ...), or started by torchrun on other hosts (distributed/launch.py). Each step rank
0 broadcasts the ModelInput over the control group and every rank runs `runner.execute` on its shard
(distributed/worker.py).

Rendezvous: EngineConfig.distributed_init_method (tcp://host:port or env://), by default a free loopback port;
under torchrun always env://.

Failure handling lives in distributed/watchdog.py: a dead worker fails the engine promptly with a clear error
(`WorkerFailure`), never hangs it; after any error inside a step the executor is failed for good. Start-up: the
rendezvous runs in a helper thread while the main thread watches the workers, so a worker that dies before joining
fails the engine at once rather than after the rendezvous timeout.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing.connection
import os
import signal
import socket
import threading
import traceback
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp

from nanoserve.config import EngineConfig
from nanoserve.distributed.commands import Configure, InitCache, Step, Stop
from nanoserve.distributed.launch import check_world_size, run_worker_if_torchrun, torchrun_rank
from nanoserve.distributed.watchdog import (
    WATCH_INTERVAL_S,
    WorkerPipe,
    WorkerWatchdog,
    heartbeat_interval,
    resolve_worker_timeout,
)
from nanoserve.distributed.worker import (
    MULTICAST_OFF_ENV,
    ControlChannel,
    RankInfo,
    build_runner,
    initialize_cache,
    join_process_groups,
    leave_process_groups,
    rank_device,
    run_worker,
)
from nanoserve.executor.base import Executor, StepFuture
from nanoserve.parallel_state import get_tp, set_tp
from nanoserve.runner.model_runner import ModelRunner
from nanoserve.step import GrammarMasks, StepInput

logger = logging.getLogger(__name__)

SHUTDOWN_JOIN_S = 30.0
"""How long a worker gets to leave after the stop command before it is killed."""


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned_worker_main(config: EngineConfig, info: RankInfo, conn: multiprocessing.connection.Connection,
                         heartbeat_s: float | None) -> None:
    """Entry point of a spawned worker process. `conn` is its pipe to rank 0: heartbeats (every `heartbeat_s`
    seconds; None: none) and an exception's traceback go up it, and its end-of-file means rank 0 is gone, so the
    worker exits rather than outlive the engine."""
    pipe = WorkerPipe(conn)

    def exit_when_parent_gone() -> None:
        pipe.wait_for_parent_exit()
        os._exit(1)

    threading.Thread(target=exit_when_parent_gone, daemon=True, name="nanoserve-tp-parent-watch").start()
    if heartbeat_s:
        pipe.start_heartbeat(heartbeat_s)
    # Ctrl-C in a terminal reaches the whole process group; only rank 0 decides when to stop (it may be draining
    # in-flight requests), so a worker ignores SIGINT and leaves on rank 0's stop command or when rank 0 is gone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        run_worker(config, info)
    except BaseException:
        pipe.report_error(traceback.format_exc())
        raise


class MultiprocExecutor(Executor):
    """tensor_parallel_size > 1: shard 0 here, the other shards in worker processes (see the module docstring)."""

    def __init__(self, config: EngineConfig):
        if dist.is_initialized() or get_tp().size > 1:
            raise RuntimeError("torch.distributed is already initialised in this process (another tensor-parallel "
                               "engine still running?): shut it down first")
        self.config = config
        # the spawned workers (none under torchrun), hang detection and the failure verdict
        self.watchdog = WorkerWatchdog(resolve_worker_timeout(config.worker_timeout))
        self._closed = False
        self.channel: ControlChannel | None = None
        self.runner: ModelRunner | None = None
        self.num_blocks = 0
        self._ready = False  # every rank has built its shard and is in the worker loop
        self._sent_switches = config.optimizations.as_dict()  # what the workers' models run with

        info = torchrun_rank()
        spawn = info is None
        if info is not None:
            check_world_size(info, config.tensor_parallel_size)
            run_worker_if_torchrun(config)  # ranks > 0 serve as workers and exit inside this call
        else:
            init = config.distributed_init_method or f"tcp://127.0.0.1:{free_loopback_port()}"
            info = RankInfo(0, config.tensor_parallel_size, 0, init)
        atexit.register(self.shutdown)  # an offline script may never call shutdown: still stop the workers
        try:
            self.device = rank_device(config, info.local_rank)
            if self.device.type == "cuda":
                if spawn and torch.cuda.device_count() < info.world_size:
                    raise ValueError(f"tensor_parallel_size={info.world_size} needs as many GPUs, but "
                                     f"{torch.cuda.device_count()} are visible")
                torch.cuda.set_device(self.device)
            for key, value in MULTICAST_OFF_ENV.items():  # before spawning, so the workers inherit them too
                os.environ.setdefault(key, value)
            if spawn:
                self._spawn_workers(config, info)
            self.channel = self._rendezvous(config, info)
            self.watchdog.guarded(self.channel.send, Configure(config))
            self.runner = build_runner(config, info)
            self.watchdog.guarded(self.channel.barrier)  # every shard is loaded
        except BaseException:
            self.shutdown()
            raise
        self._ready = True
        self.model_config = self.runner.cfg
        self.model_dir = self.runner.model_dir
        self.block_size = self.runner.block_size
        self.platform = self.runner.platform
        self.vision_config = self.runner.vision_config
        logger.info("tensor parallel: %d ranks (%s), MoE %s, rendezvous %s", config.tensor_parallel_size,
                    dist.get_backend(), "expert-parallel" if config.enable_expert_parallel else "tensor-parallel",
                    info.init_method)

    # -- the Executor interface ---------------------------------------------------------------------------
    def initialize_cache(self, max_model_len: int, max_num_batched_tokens: int, max_num_seqs: int) -> int:
        def init() -> int:
            self.channel.send(InitCache(max_model_len, max_num_batched_tokens, max_num_seqs))
            return initialize_cache(self.runner, self.channel, max_model_len, max_num_batched_tokens, max_num_seqs)

        self.num_blocks = self.watchdog.guarded(init)
        self.encoder_cache_size = self.runner.encoder_cache_size
        self.watchdog.bound_steps([dist.group.WORLD, self.channel.group])  # warmed up: steps are bounded now
        return self.num_blocks

    def execute_model(self, step: StepInput) -> None:
        if step.fed:  # the workers get plain lists: a token still on rank 0's device cannot reach them
            raise ValueError("a tensor-parallel executor takes no tokens on the device (supports_token_feed is False)")

        def forward() -> None:
            switches = self.runner.config.optimizations.as_dict()
            changed = switches if switches != self._sent_switches else None
            self.channel.send(Step(step.model, changed))
            self._sent_switches = switches
            self.runner.execute_model(step)
            if self.device.type == "cuda":
                done = torch.cuda.Event()
                done.record()
                self.watchdog.wait_for_event(done)

        self.watchdog.guarded(forward)

    def sample_tokens(self, masks: GrammarMasks | None = None) -> StepFuture:
        return self.watchdog.guarded(lambda: self.runner.sample_tokens(masks))

    def check_health(self) -> None:
        self.watchdog.raise_if_failed()

    def shutdown(self) -> None:
        """Stop the workers (politely if they are healthy), leave the process groups, free the shard."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        self.watchdog.stop()
        # The stop command only makes sense to workers waiting in their loop; after a failure, or a start-up
        # that did not finish, they may be inside a collective, so they are killed instead.
        stopped = False
        if self._ready and self.watchdog.failure is None:
            try:
                self.channel.send(Stop())
                stopped = True
            except Exception as e:  # a worker went away during shutdown: it is being stopped anyway
                logger.warning("tensor parallel: could not send the stop command (%s)", e)
        for proc in self.workers:
            proc.join(SHUTDOWN_JOIN_S if stopped else 0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self.watchdog.close()
        if self.runner is not None:
            self.runner.shutdown()
            self.runner = None
        if self.watchdog.failure is None or not dist.is_initialized() or dist.get_backend() == "gloo":
            leave_process_groups()
        else:  # a failed NCCL group may still hold a kernel waiting on the dead peer: do not wait for it
            set_tp(0, 1)

    @property
    def workers(self) -> list[BaseProcess]:
        """The spawned worker processes, rank 1 first (empty under torchrun)."""
        return list(self.watchdog.workers.values())

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.workers]

    # -- start-up -----------------------------------------------------------------------------------------
    def _spawn_workers(self, config: EngineConfig, info: RankInfo) -> None:
        ctx = torch_mp.get_context("spawn")
        timeout = self.watchdog.timeout
        for rank in range(1, info.world_size):
            parent_end, child_end = ctx.Pipe()
            worker_info = RankInfo(rank, info.world_size, rank, info.init_method)
            proc = ctx.Process(target=_spawned_worker_main, daemon=True, name=f"nanoserve-tp-worker-{rank}",
                               args=(config, worker_info, child_end, heartbeat_interval(timeout) if timeout else None))
            proc.start()
            child_end.close()
            self.watchdog.watch(rank, proc, parent_end)
        self.watchdog.start()

    def _rendezvous(self, config: EngineConfig, info: RankInfo) -> ControlChannel:
        """Join the process groups; with spawned workers, in a helper thread while this one watches them (a
        worker that dies before joining would otherwise leave rank 0 waiting out the rendezvous timeout)."""
        if not self.workers:
            return join_process_groups(config, info)
        result: dict[str, Any] = {}

        def join() -> None:
            try:
                result["channel"] = join_process_groups(config, info)
            except BaseException as e:
                result["error"] = e

        thread = threading.Thread(target=join, daemon=True, name="nanoserve-tp-rendezvous")
        thread.start()
        while thread.is_alive():
            thread.join(WATCH_INTERVAL_S)
            self.watchdog.raise_if_failed()
        if "error" in result:
            raise result["error"]
        return result["channel"]
