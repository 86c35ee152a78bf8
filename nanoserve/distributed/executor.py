"""MultiprocExecutor: tensor parallelism as the engine sees it, from rank 0.

The engine's process is rank 0: it holds a ModelRunner with shard 0 and is where the logits come back for
sampling (the LM head already all-gathers the vocabulary). Ranks 1..N-1 are worker processes - spawned here with
torch.multiprocessing (a fresh interpreter each, which inherits this process's environment: TRITON_INTERPRET,
NANOSERVE_CACHE, ...), or started by torchrun on other hosts (distributed/launch.py). Each step rank 0 broadcasts
the ModelInput over the control group and every rank runs `runner.execute` on its shard (distributed/worker.py).

Rendezvous: EngineConfig.distributed_init_method (tcp://host:port or env://), by default a free loopback port;
under torchrun always env://.

Failure handling - a dead worker must fail the engine promptly with a clear error, never hang it:

- A monitor thread waits on every spawned worker's process sentinel and on its pipe (which carries the traceback
  when a worker fails with an exception). When a worker dies it records "tensor-parallel worker R died (exit code
  X)" and, on GPUs, aborts the NCCL communicators so nothing keeps waiting on the dead peer.
- Before each step (and in `check_health`) rank 0 checks that verdict and each worker's exit code (a waitpid).
- During a step, gloo fails at once on the dead peer's closed socket; on a GPU rank 0 waits for the step by polling
  a CUDA event while watching the verdict, rather than in a synchronize that a dead peer could hang.
- Any error inside a step leaves the ranks out of step, so the executor is then failed for good: every later
  call raises the same error.
- Start-up: the rendezvous runs in a helper thread while the main thread watches the workers, so a worker that
  dies before joining fails the engine at once rather than after the rendezvous timeout.
- Under torchrun rank 0 cannot see remote processes: torchrun tears the job down when a rank dies, and the model
  group's bounded timeout (NANOSERVE_DIST_TIMEOUT) covers a rank that hangs.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing.connection
import os
import signal
import socket
import threading
import time
import traceback
from multiprocessing.process import BaseProcess
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp

from nanoserve.config import EngineConfig
from nanoserve.distributed.launch import check_world_size, run_worker_if_torchrun, torchrun_rank
from nanoserve.distributed.parallel_state import get_tp, set_tp
from nanoserve.distributed.worker import (CONFIG, INIT_CACHE, MULTICAST_OFF_ENV, STEP, STOP, ControlChannel, RankInfo,
                                          build_runner, initialize_cache, join_process_groups, leave_process_groups,
                                          rank_device, run_worker)
from nanoserve.engine.executor import Executor
from nanoserve.engine.model_runner import ModelInput, ModelRunner

logger = logging.getLogger(__name__)

T = TypeVar("T")

FAILURE_GRACE_S = 5.0
"""After a collective fails, how long to wait for a worker's death to show before blaming rank 0's own error."""
WATCH_INTERVAL_S = 0.05
"""How often rank 0 re-checks the workers while it waits for the rendezvous or a failure verdict."""
SHUTDOWN_JOIN_S = 30.0
"""How long a worker gets to leave after the stop command before it is killed."""


class WorkerFailure(RuntimeError):
    """A tensor-parallel rank died or a collective failed; the executor cannot run any further step."""


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned_worker_main(config: EngineConfig, info: RankInfo, conn: multiprocessing.connection.Connection) -> None:
    """Entry point of a spawned worker process. `conn` is its pipe to rank 0: an exception's traceback goes up it,
    and its end-of-file means rank 0 is gone, so the worker exits rather than outlive the engine."""

    def exit_when_parent_gone() -> None:
        try:
            conn.recv()  # rank 0 never writes: this returns (or raises) only when its end closes
        except (EOFError, OSError):
            pass
        os._exit(1)

    threading.Thread(target=exit_when_parent_gone, daemon=True, name="nanoserve-tp-parent-watch").start()
    # Ctrl-C in a terminal reaches the whole process group; only rank 0 decides when to stop (it may be draining
    # in-flight requests), so a worker ignores SIGINT and leaves on rank 0's stop command or when rank 0 is gone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        run_worker(config, info)
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
        raise


class MultiprocExecutor(Executor):
    """tensor_parallel_size > 1: shard 0 here, the other shards in worker processes (see the module docstring)."""

    def __init__(self, config: EngineConfig):
        if dist.is_initialized() or get_tp().size > 1:
            raise RuntimeError("torch.distributed is already initialised in this process (another tensor-parallel "
                               "engine still running?): shut it down first")
        self.config = config
        self.workers: list[BaseProcess] = []  # index i holds rank i + 1 (empty under torchrun)
        self._pipes: dict[Any, int] = {}  # rank 0's end of each worker's pipe -> its rank
        self._errors: dict[int, str] = {}  # rank -> traceback a worker sent before dying
        self._failure: str | None = None
        self._closed = False
        self._monitor: threading.Thread | None = None
        self._stop_monitor_r, self._stop_monitor_w = multiprocessing.Pipe(duplex=False)
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
            self._guarded(self.channel.send, (CONFIG, config))
            self.runner = build_runner(config, info)
            self._guarded(self.channel.barrier)  # every shard is loaded
        except BaseException:
            self.shutdown()
            raise
        self._ready = True
        self.model_config = self.runner.cfg
        self.model_dir = self.runner.model_dir
        self.block_size = self.runner.block_size
        logger.info("tensor parallel: %d ranks (%s), MoE %s, rendezvous %s", config.tensor_parallel_size,
                    dist.get_backend(), "expert-parallel" if config.enable_expert_parallel else "tensor-parallel",
                    info.init_method)

    # -- the Executor interface ---------------------------------------------------------------------------
    def initialize_cache(self, max_model_len: int, max_num_batched_tokens: int, max_num_seqs: int) -> int:
        def init() -> int:
            self.channel.send((INIT_CACHE, max_model_len, max_num_batched_tokens, max_num_seqs))
            return initialize_cache(self.runner, self.channel, max_model_len, max_num_batched_tokens, max_num_seqs)

        self.num_blocks = self._guarded(init)
        return self.num_blocks

    def execute_model(self, inp: ModelInput) -> torch.Tensor:
        def step() -> torch.Tensor:
            switches = self.runner.config.optimizations.as_dict()
            changed = switches if switches != self._sent_switches else None
            self.channel.send((STEP, inp, changed))
            self._sent_switches = switches
            logits = self.runner.execute(inp)
            if self.device.type == "cuda":
                self._wait_for_device()
            return logits

        return self._guarded(step)

    def check_health(self) -> None:
        self._raise_if_failed()

    def shutdown(self) -> None:
        """Stop the workers (politely if they are healthy), leave the process groups, free the shard."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        self._stop_monitor_w.close()
        if self._monitor is not None:
            self._monitor.join()
        # The stop command only makes sense to workers waiting in their loop; after a failure, or a start-up
        # that did not finish, they may be inside a collective, so they are killed instead.
        stopped = False
        if self._ready and self._failure is None:
            try:
                self.channel.send((STOP,))
                stopped = True
            except Exception as e:  # a worker went away during shutdown: it is being stopped anyway
                logger.warning("tensor parallel: could not send the stop command (%s)", e)
        for proc in self.workers:
            proc.join(SHUTDOWN_JOIN_S if stopped else 0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for pipe in self._pipes:
            pipe.close()
        if self.runner is not None:
            self.runner.shutdown()
            self.runner = None
        if self._failure is None or not dist.is_initialized() or dist.get_backend() == "gloo":
            leave_process_groups()
        else:  # a failed NCCL group may still hold a kernel waiting on the dead peer: do not wait for it
            set_tp(0, 1)

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.workers]

    # -- start-up -----------------------------------------------------------------------------------------
    def _spawn_workers(self, config: EngineConfig, info: RankInfo) -> None:
        ctx = torch_mp.get_context("spawn")
        for rank in range(1, info.world_size):
            parent_end, child_end = ctx.Pipe()
            worker_info = RankInfo(rank, info.world_size, rank, info.init_method)
            proc = ctx.Process(target=_spawned_worker_main, args=(config, worker_info, child_end), daemon=True,
                               name=f"nanoserve-tp-worker-{rank}")
            proc.start()
            child_end.close()
            self.workers.append(proc)
            self._pipes[parent_end] = rank
        self._monitor = threading.Thread(target=self._watch_workers, daemon=True, name="nanoserve-tp-monitor")
        self._monitor.start()

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
            self._raise_if_failed()
        if "error" in result:
            raise result["error"]
        return result["channel"]

    # -- failure detection --------------------------------------------------------------------------------
    def _watch_workers(self) -> None:
        """Monitor thread: wait on the workers' pipes and sentinels; the first death is the verdict."""
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self.workers, start=1)}
        pipes = dict(self._pipes)
        while True:
            ready = multiprocessing.connection.wait([self._stop_monitor_r, *pipes, *sentinels])
            if self._stop_monitor_r in ready:
                return
            for pipe in [r for r in ready if r in pipes]:
                self._read_pipe(pipe, pipes)
            dead = [sentinels[r] for r in ready if r in sentinels]
            if dead:
                rank = min(dead)
                for pipe in [p for p, r in pipes.items() if r == rank]:
                    self._read_pipe(pipe, pipes)  # its last words, if they are still in flight
                self._fail(self._death_message(rank))
                self._abort_collectives()
                return

    def _read_pipe(self, pipe: Any, pipes: dict[Any, int]) -> None:
        try:
            while pipe.poll():
                kind, payload = pipe.recv()
                if kind == "error":
                    self._errors[pipes[pipe]] = payload
        except (EOFError, OSError):
            del pipes[pipe]

    def _death_message(self, rank: int) -> str:
        proc = self.workers[rank - 1]
        proc.join(WATCH_INTERVAL_S)
        msg = f"tensor-parallel worker {rank} died (exit code {proc.exitcode})"
        if rank in self._errors:
            lines = self._errors[rank].strip().splitlines()
            msg += f": {lines[-1]}" if lines else ""
            logger.error("tensor-parallel worker %d failed:\n%s", rank, self._errors[rank])
        return msg

    def _fail(self, message: str) -> None:
        if self._failure is None:
            self._failure = message
            logger.error("%s; the engine cannot continue", message)

    def _abort_collectives(self) -> None:
        """On GPUs, abort the NCCL communicators so no kernel keeps waiting on the dead peer (gloo needs nothing:
        its sockets to the peer are closed)."""
        if not dist.is_initialized() or dist.get_backend() != "nccl":
            return
        try:
            dist.distributed_c10d._abort_process_group()
        except Exception:
            logger.exception("tensor parallel: aborting the NCCL communicators failed")

    def _raise_if_failed(self) -> None:
        """Raise the verdict, or, if a worker has exited and the monitor has not yet spoken, wait for it."""
        if self._failure is None and any(p.exitcode is not None for p in self.workers):
            self._await_verdict(FAILURE_GRACE_S)
        if self._failure is not None:
            raise WorkerFailure(self._failure)

    def _await_verdict(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while self._failure is None and self._monitor is not None and self._monitor.is_alive() \
                and time.monotonic() < deadline:
            time.sleep(WATCH_INTERVAL_S)

    def _guarded(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a collective step on rank 0. On any error the ranks are out of step, so the executor fails for
        good; if a worker died, that is the error reported (its socket may close a moment before it is reaped)."""
        self._raise_if_failed()
        try:
            return fn(*args)
        except WorkerFailure:
            raise
        except Exception as e:
            if self.workers:
                self._await_verdict(FAILURE_GRACE_S)
            self._fail(f"tensor-parallel step failed on rank 0: {type(e).__name__}: {e}")
            raise WorkerFailure(self._failure) from e
        except BaseException:  # KeyboardInterrupt mid-step: the workers may be inside a collective
            self._fail("tensor-parallel step interrupted on rank 0")
            raise

    def _wait_for_device(self) -> None:
        """Wait for this step's kernels while watching the workers: a collective whose peer died never
        completes, and a plain synchronize would wait on it until the NCCL timeout."""
        done = torch.cuda.Event()
        done.record()
        while not done.query():
            if self._failure is not None:
                raise WorkerFailure(self._failure)
            time.sleep(0)  # yield the GIL (the server's event loop shares it) without adding latency
