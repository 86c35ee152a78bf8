"""WorkerWatchdog: rank 0's view of whether its tensor-parallel workers are alive and answering.

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

A worker that is alive but does not answer (stopped with SIGSTOP, deadlocked, its machine frozen) must fail it
too, within the worker timeout T (`--worker-timeout`, NANOSERVE_WORKER_TIMEOUT, default 30 s; 0 turns it off).
Two detectors, in the section "Hung workers" below:

- Heartbeats. Every spawned worker runs a thread that sends "alive" up its pipe every min(1 s, T/4)
  (`WorkerPipe`). The monitor thread gives the verdict "tensor-parallel worker R did not answer within T s" when
  one has been silent for T. This covers an idle engine too, and start-up: the heartbeat thread ticks while the
  model loads, kernels compile and graphs are captured, so no warm-up needs excusing. (Silence is counted from a
  worker's first heartbeat; before that, a worker that never starts is the rendezvous timeout's.)
- The step bound. Once the engine is warmed up (`bound_steps`, after the KV cache is sized, which on a GPU runs
  the warm-up forward), rank 0 waits at most T for its peers in any one step: on gloo through the groups' own
  timeout on rank 0 (a collective whose peer does not answer raises after T; the workers keep the long
  NANOSERVE_DIST_TIMEOUT), on GPUs in `wait_for_event`, whose deadline starts after rank 0 has launched its own
  share of the step (so rank 0's own kernel compiles and graph captures do not count). This catches a deadlock
  that leaves the heartbeats running, and works under torchrun, where there are no heartbeats.

On either verdict the NCCL communicators are aborted, as for a death, so no kernel keeps waiting on the peer.

`fail(message)` is the one way a verdict is recorded. Under torchrun there are no spawned workers to watch:
torchrun tears the job down when a rank dies, and the step bound covers a hang.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
import time
from datetime import timedelta
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
WORKER_TIMEOUT_ENV = "NANOSERVE_WORKER_TIMEOUT"
DEFAULT_WORKER_TIMEOUT_S = 30.0
"""A worker silent this long, or a step whose peers do not answer this long, fails the engine. The slowest
legitimate wait is far shorter: a 128k-token prefill chunk takes about 1 s on a GPU, and the ranks run it side by
side; start-up and warm-up are covered by the heartbeats only (see the module docstring)."""
MAX_HEARTBEAT_INTERVAL_S = 1.0


class WorkerFailure(RuntimeError):
    """A tensor-parallel rank died or a collective failed; the executor cannot run any further step."""


def resolve_worker_timeout(value: float | None) -> float:
    """The worker timeout in seconds: `value` (EngineConfig.worker_timeout), else $NANOSERVE_WORKER_TIMEOUT, else
    DEFAULT_WORKER_TIMEOUT_S; 0 turns hang detection off."""
    if value is None:
        text = os.environ.get(WORKER_TIMEOUT_ENV)
        if text is None:
            return DEFAULT_WORKER_TIMEOUT_S
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"{WORKER_TIMEOUT_ENV}={text!r} is not a number of seconds") from None
        if value < 0:
            raise ValueError(f"{WORKER_TIMEOUT_ENV}={text!r} must be >= 0 (0 = no hang detection)")
    return float(value)


def heartbeat_interval(timeout: float) -> float:
    """How often a worker says it is alive: a few times per timeout, at least once a second."""
    return min(MAX_HEARTBEAT_INTERVAL_S, timeout / 4)


class WorkerPipe:
    """A spawned worker's end of its pipe to rank 0: the traceback it dies of, its heartbeats, and rank 0's end
    closing (rank 0 never writes; end-of-file means rank 0 is gone). Sends from two threads share one lock."""

    def __init__(self, conn: multiprocessing.connection.Connection):
        self.conn = conn
        self._lock = threading.Lock()

    def _send(self, message: tuple) -> bool:
        try:
            with self._lock:
                self.conn.send(message)
            return True
        except OSError:
            return False

    def report_error(self, text: str) -> None:
        """Send rank 0 the traceback of the exception this worker is dying of."""
        self._send(("error", text))

    def start_heartbeat(self, interval: float) -> None:
        """Say "alive" every `interval` seconds from a daemon thread, until the pipe closes. A stopped or frozen
        process stops saying it; a busy one does not (the model's work runs in native code, outside the GIL)."""
        def beat() -> None:
            while self._send(("alive", None)):
                time.sleep(interval)

        threading.Thread(target=beat, daemon=True, name="nanoserve-tp-heartbeat").start()

    def wait_for_parent_exit(self) -> None:
        """Return when rank 0's end closes."""
        try:
            self.conn.recv()
        except (EOFError, OSError):
            pass


class WorkerWatchdog:
    """Watches the spawned workers (rank r, its process, rank 0's end of its pipe) and holds the failure verdict.

    `timeout`: the worker timeout in seconds (0: no hang detection). Life cycle: `watch(...)` each worker as it is
    spawned, `start()` the monitor thread, `bound_steps(...)` once warmed up; at shutdown `stop()` it, stop the
    workers, then `close()` the pipes."""

    def __init__(self, timeout: float = DEFAULT_WORKER_TIMEOUT_S) -> None:
        self.timeout = timeout
        self.workers: dict[int, BaseProcess] = {}  # rank -> process
        self._pipes: dict[Any, int] = {}  # rank 0's end of each worker's pipe -> its rank
        self._errors: dict[int, str] = {}  # rank -> traceback a worker sent before dying
        self._last_beat: dict[int, float] = {}  # rank -> monotonic time of its latest heartbeat
        self._steps_bounded = False
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

    def _fail_and_abort(self, message: str) -> None:
        self.fail(message)
        self._abort_collectives()

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
        t0 = time.monotonic()
        try:
            return fn(*args)
        except WorkerFailure:
            raise
        except Exception as e:
            if self._steps_bounded and time.monotonic() - t0 >= self.timeout:  # a collective ran out of time
                raise self._step_timed_out() from e
            if self.workers:
                self._await_verdict(FAILURE_GRACE_S)
            self.fail(f"tensor-parallel step failed on rank 0: {type(e).__name__}: {e}")
            raise WorkerFailure(self._failure) from e
        except BaseException:  # KeyboardInterrupt mid-step: the workers may be inside a collective
            self.fail("tensor-parallel step interrupted on rank 0")
            raise

    def wait_for_event(self, done: torch.cuda.Event) -> None:
        """Wait for a recorded CUDA event while watching the verdict: a collective whose peer died never
        completes, and a plain synchronize would wait on it until the NCCL timeout. Once steps are bounded, give
        up after the worker timeout."""
        deadline = time.monotonic() + self.timeout if self._steps_bounded else float("inf")
        while not done.query():
            if self._failure is not None:
                raise WorkerFailure(self._failure)
            if time.monotonic() > deadline:
                raise self._step_timed_out()
            time.sleep(0)  # yield the GIL (the server's event loop shares it) without adding latency

    # -- hung workers: heartbeats and the step bound ----------------------------------------------------------
    def bound_steps(self, groups: list[dist.ProcessGroup]) -> None:
        """From now on (the engine is warmed up) rank 0 waits at most `timeout` for its peers in a step: gloo
        groups get it as their timeout on this rank (a collective raises when it runs out), and `wait_for_event`
        takes it as its deadline. NCCL groups keep theirs: the GPU wait is bounded in `wait_for_event`."""
        if not self.timeout:
            return
        for group in groups:
            if dist.get_backend(group) == "gloo":
                dist.distributed_c10d._set_pg_timeout(timedelta(seconds=self.timeout), group)
        self._steps_bounded = True

    def _silent_worker(self) -> int | None:
        """The lowest rank whose heartbeats stopped for `timeout` seconds, if any."""
        if not self.timeout:
            return None
        now = time.monotonic()
        silent = [r for r, t in self._last_beat.items() if now - t > self.timeout]
        return min(silent) if silent else None

    def _hang_message(self, rank: int) -> str:
        return f"tensor-parallel worker {rank} did not answer within {self.timeout:g} s"

    def _step_timed_out(self) -> WorkerFailure:
        """A step's peers gave no answer for `timeout`: blame the worker whose heartbeats stopped (its verdict
        is due within a heartbeat), else record that a collective is stuck with every worker still alive."""
        if self.workers:
            self._await_verdict(2 * heartbeat_interval(self.timeout) + WATCH_INTERVAL_S)
        if self._failure is None:
            who = "a tensor-parallel worker" if not self.workers else \
                f"tensor-parallel worker(s) {', '.join(map(str, sorted(self.workers)))}"
            alive = "; every worker still sends heartbeats, so a collective is stuck" if self.workers else ""
            self._fail_and_abort(f"{who} did not answer within {self.timeout:g} s{alive}")
        return WorkerFailure(self._failure)

    # -- the monitor thread -----------------------------------------------------------------------------------
    def _watch(self) -> None:
        """Wait on the workers' pipes and sentinels; the first death, or the first worker silent for the worker
        timeout, is the verdict."""
        sentinels = {proc.sentinel: rank for rank, proc in self.workers.items()}
        pipes = dict(self._pipes)
        tick = heartbeat_interval(self.timeout) if self.timeout else None
        while True:
            ready = multiprocessing.connection.wait([self._stop_r, *pipes, *sentinels], timeout=tick)
            if self._stop_r in ready:
                return
            for pipe in [r for r in ready if r in pipes]:
                self._read_pipe(pipe, pipes)
            dead = [sentinels[r] for r in ready if r in sentinels]
            if dead:
                rank = min(dead)
                for pipe in [p for p, r in pipes.items() if r == rank]:
                    self._read_pipe(pipe, pipes)  # its last words, if they are still in flight
                self._fail_and_abort(self._death_message(rank))
                return
            silent = self._silent_worker()
            if silent is not None:
                self._fail_and_abort(self._hang_message(silent))
                return

    def _read_pipe(self, pipe: Any, pipes: dict[Any, int]) -> None:
        rank = pipes[pipe]
        try:
            while pipe.poll():
                kind, payload = pipe.recv()
                if kind == "error":
                    self._errors[rank] = payload
                elif kind == "alive":
                    self._last_beat[rank] = time.monotonic()
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
