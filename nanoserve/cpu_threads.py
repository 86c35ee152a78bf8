"""How many threads torch's CPU operators use (intra-op parallelism), set once by each front end - LLM, the server
and the benchmark - when the model runs on the CPU.

torch's own default is every logical CPU. On a host with SMT two threads of one core share its vector units, so a
compute-bound matmul runs no faster on both and pays the synchronisation; every physical core the process may run
on is the better default. `--cpu-threads N` (the server, the benchmark), `LLM(cpu_threads=N)` or
NANOSERVE_CPU_THREADS=N choose otherwise.
"""

from __future__ import annotations

import glob
import logging
import os

import torch

logger = logging.getLogger(__name__)

ENV = "NANOSERVE_CPU_THREADS"


def physical_cores() -> int:
    """The physical cores among the CPUs this process may run on (hyper-threads of one core count once)."""
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    cores = set()
    for cpu in allowed:
        paths = glob.glob(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        try:
            with open(paths[0]) as f:
                cores.add(f.read().strip())
        except (IndexError, OSError):
            cores.add(str(cpu))  # no topology information: count the CPU itself
    return max(1, len(cores))


def resolve_cpu_threads(requested: int | None = None) -> int:
    """`requested`, else $NANOSERVE_CPU_THREADS, else the physical cores. Raises ValueError for a bad value."""
    source = "cpu_threads"
    if requested is None and os.environ.get(ENV):
        requested, source = os.environ[ENV], ENV
    if requested is None:
        return physical_cores()
    try:
        n = int(requested)
    except ValueError:
        raise ValueError(f"{source} must be a positive integer, got {requested!r}") from None
    if n < 1:
        raise ValueError(f"{source} must be a positive integer, got {requested!r}")
    return n


def configure_cpu_threads(requested: int | None = None) -> int:
    """Set torch's intra-op threads (see the module docstring); returns the number set."""
    n = resolve_cpu_threads(requested)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    logger.debug("torch intra-op threads: %d", n)
    return n
