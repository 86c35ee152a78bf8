"""WorkerWatchdog: rank 0's view of whether its spawned tensor-parallel workers are alive.

A dead worker must fail the engine promptly with a clear error, never hang it:

- A monitor thread waits on every spawned worker's process sentinel and on its pipe (which carries the traceback
  when a worker fails with an exception, see `report_error`). When a worker dies it records the verdict
  "tensor-parallel worker R died (exit code X)" and, on GPUs, aborts the NCCL communicators so nothing keeps
  waiting on the dead peer.
- `raise_if_failed` (before each step, in `check_health`, while waiting for the rendezvous) raises the verdict;
  it also notices a worker that has exited before the monitor has spoken, and waits a moment for its verdict.
- `guarded(fn)` runs one collective step: any error inside it leaves the ranks out of step, so the watchdog then
  holds a verdict for good and every later call raises the same `WorkerFailure`.
- `wait_for_event` waits for a step's kernels on a GPU by polling a CUDA event while watching the verdict, rather
  than in a synchronize that a dead peer could hang.

`fail(message)` is the one way a verdict is recorded, so another detector (say, a heartbeat for a worker that
hangs without dying) only has to call it. Under torchrun there are no spawned workers to watch: torchrun tears
the job down when a rank dies, and the model group's bounded timeout (NANOSERVE_DIST_TIMEOUT) covers a hang.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import threading
import time
from multiprocessing.process import BaseProcess
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

T = TypeVar("T")

FAILURE_GRACE_S = 5.0
"""After a collective fails, how long to wait for a worker's death to show before blaming rank 0's own error."""
WATCH_INTERVAL_S = 0.05
"""How often rank 0 re-checks the workers while it waits for the rendezvous or a failure verdict."""


class WorkerFailure(RuntimeError):
    """A tensor-parallel rank died or a collective failed; the executor cannot run any further step."""


def report_error(conn: multiprocessing.connection.Connection, text: str) -> None:
    """Worker side of the pipe: send rank 0 the traceback of the exception this worker is dying of."""
    try:
        conn.send(("error", text))
    except OSError:
        pass


class WorkerWatchdog:
    """Watches the spawned workers (rank r, its process, rank 0's end of its pipe) and holds the failure verdict.

    Life cycle: `watch(...)` each worker as it is spawned, `start()` the monitor thread; at shutdown `stop()` it,
    stop the workers, then `close()` the pipes."""

    def __init__(self) -> None:
        self.workers: dict[int, BaseProcess] = {}  # rank -> process
        self._pipes: dict[Any, int] = {}  # rank 0's end of each worker's pipe -> its rank
        self._errors: dict[int, str] = {}  # rank -> traceback a worker sent before dying
        self._failure: str | None = None
        self._monitor: threading.Thread | None = None
        self._stop_r, self._stop_w = multiprocessing.Pipe(duplex=False)
        self._stopped = False

    # -- set-up and tear-down -------------------------------------------------------------------------------
    def watch(self, rank: int, proc: BaseProcess, pipe: multiprocessing.connection.Connection) -> None:
        self.workers[rank] = proc
        self._pipes[pipe] = rank

    def start(self) -> None:
        self._monitor = threading.Thread(target=self._watch, daemon=True, name="nanoserve-tp-monitor")
        self._monitor.start()

    def stop(self) -> None:
        """End the monitor thread. The pipes stay open: a worker exits as soon as its pipe closes, so `close` comes
        only after the executor has stopped the workers."""
        if self._stopped:
            return
        self._stopped = True
        self._stop_w.close()
        if self._monitor is not None:
            self._monitor.join()

    def close(self) -> None:
        for pipe in self._pipes:
            pipe.close()

    # -- the verdict ----------------------------------------------------------------------------------------
    @property
    def failure(self) -> str | None:
        """Why the tensor-parallel group cannot continue, or None while it is healthy."""
        return self._failure

    def fail(self, message: str) -> None:
        """Record the verdict (the first one stands)."""
        if self._failure is None:
            self._failure = message
            logger.error("%s; the engine cannot continue", message)

    def raise_if_failed(self) -> None:
        """Raise the verdict, or, if a worker has exited and the monitor has not yet spoken, wait for it."""
        if self._failure is None and any(p.exitcode is not None for p in self.workers.values()):
            self._await_verdict(FAILURE_GRACE_S)
        if self._failure is not None:
            raise WorkerFailure(self._failure)

    def guarded(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a collective step on rank 0. On any error the ranks are out of step, so the group fails for good;
        if a worker died, that is the error reported (its socket may close a moment before it is reaped)."""
        self.raise_if_failed()
        try:
            return fn(*args)
        except WorkerFailure:
            raise
        except Exception as e:
            if self.workers:
                self._await_verdict(FAILURE_GRACE_S)
            self.fail(f"tensor-parallel step failed on rank 0: {type(e).__name__}: {e}")
            raise WorkerFailure(self._failure) from e
        except BaseException:  # KeyboardInterrupt mid-step: the workers may be inside a collective
            self.fail("tensor-parallel step interrupted on rank 0")
            raise

    def wait_for_event(self, done: torch.cuda.Event) -> None:
        """Wait for a recorded CUDA event while watching the verdict: a collective whose peer died never
        completes, and a plain synchronize would wait on it until the NCCL timeout."""
        while not done.query():
            if self._failure is not None:
                raise WorkerFailure(self._failure)
            time.sleep(0)  # yield the GIL (the server's event loop shares it) without adding latency

    # -- the monitor thread -----------------------------------------------------------------------------------
    def _watch(self) -> None:
        """Wait on the workers' pipes and sentinels; the first death is the verdict."""
        sentinels = {proc.sentinel: rank for rank, proc in self.workers.items()}
        pipes = dict(self._pipes)
        while True:
            ready = multiprocessing.connection.wait([self._stop_r, *pipes, *sentinels])
            if self._stop_r in ready:
                return
            for pipe in [r for r in ready if r in pipes]:
                self._read_pipe(pipe, pipes)
            dead = [sentinels[r] for r in ready if r in sentinels]
            if dead:
                rank = min(dead)
                for pipe in [p for p, r in pipes.items() if r == rank]:
                    self._read_pipe(pipe, pipes)  # its last words, if they are still in flight
                self.fail(self._death_message(rank))
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
        proc = self.workers[rank]
        proc.join(WATCH_INTERVAL_S)
        msg = f"tensor-parallel worker {rank} died (exit code {proc.exitcode})"
        if rank in self._errors:
            lines = self._errors[rank].strip().splitlines()
            msg += f": {lines[-1]}" if lines else ""
            logger.error("tensor-parallel worker %d failed:\n%s", rank, self._errors[rank])
        return msg

    def _abort_collectives(self) -> None:
        """On GPUs, abort the NCCL communicators so no kernel keeps waiting on the dead peer (gloo needs nothing:
        its sockets to the peer are closed)."""
        if not dist.is_initialized() or dist.get_backend() != "nccl":
            return
        try:
            dist.distributed_c10d._abort_process_group()
        except Exception:
            logger.exception("tensor parallel: aborting the NCCL communicators failed")

    def _await_verdict(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while self._failure is None and self._monitor is not None and self._monitor.is_alive() \
                and time.monotonic() < deadline:
            time.sleep(WATCH_INTERVAL_S)
