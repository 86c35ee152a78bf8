"""What every tensor-parallel rank runs: join the process groups, build its shard of the model, obey rank 0.

Process layout for tensor_parallel_size = N:

    rank 0         the engine's process: scheduler, sampler, MultiprocExecutor (distributed/executor.py) and a
                   ModelRunner holding shard 0. It sends every command and is where the logits come back.
    ranks 1..N-1   workers, each with a ModelRunner holding its shard, running `worker_loop`: receive a command
                   from rank 0, run it, repeat. Spawned by MultiprocExecutor on one machine, or started by torchrun
                   on any number of machines (distributed/launch.py).

Two process groups join the same N processes:

- the model group (the default group): nccl on GPUs (RCCL on ROCm builds), gloo on the CPU. The layers'
  all-reduces and the LM head's all-gather run here. Its timeout is bounded (`NANOSERVE_DIST_TIMEOUT`, seconds)
  so a peer that stops answering turns into an error, never a hang; once warmed up, rank 0 waits much less
  (the worker timeout, distributed/watchdog.py).
- the control group: gloo, always on the CPU. Rank 0 broadcasts each command over it (distributed/commands.py;
  a step carries its pickled ModelInput), so sending a step never touches the GPU stream. Its timeout is
  effectively infinite because an idle worker (a server with no requests) waits here for the next step; a dead
  peer still fails it at once, because gloo sees the closed socket. Rank 0 only sends on it, and once warmed up
  a send to a peer that stopped reading gives up after the worker timeout.

Every rank takes the EngineConfig from rank 0 (the first command), so all shards are built from one config even
when torchrun started each rank with its own command line; the rank's own config only picks backend and device.
"""

from __future__ import annotations

import logging
import os
import pickle
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from nanoserve.config import EngineConfig
from nanoserve.distributed.commands import Command, Configure, InitCache, Step, Stop
from nanoserve.parallel_state import set_tp
from nanoserve.runner.model_runner import ModelRunner, resolve_device

logger = logging.getLogger(__name__)

DIST_TIMEOUT_ENV = "NANOSERVE_DIST_TIMEOUT"
DEFAULT_DIST_TIMEOUT_S = 600.0
"""Model-group collectives (and the rendezvous) fail after this long without an answer from every rank."""
IDLE_TIMEOUT = timedelta(days=365)
"""Control group: how long an idle worker waits for rank 0's next command (a server may idle for days)."""
MULTICAST_OFF_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
"""NVLink multicast off in every rank, set before the process group exists (the lent multi-GPU hosts need it)."""

def dist_timeout() -> timedelta:
    return timedelta(seconds=float(os.environ.get(DIST_TIMEOUT_ENV, DEFAULT_DIST_TIMEOUT_S)))


@dataclass(frozen=True)
class RankInfo:
    """Where a rank sits: global rank, world size, rank on its host (its GPU), and the rendezvous URL."""

    rank: int
    world_size: int
    local_rank: int
    init_method: str


def rank_device(config: EngineConfig, local_rank: int) -> torch.device:
    """cuda:<local rank> on GPUs (HIP on ROCm), else the CPU."""
    device = resolve_device(config.device)
    return torch.device("cuda", local_rank) if device.type == "cuda" else device


class ControlChannel:
    """Rank 0 -> every rank: one pickled command (distributed/commands.py) per `send`, over the gloo control group.

    A command travels in a fixed-size frame (8-byte length, then the pickle) so the common case - a decode step's
    few hundred ids - is a single broadcast; a longer pickle (a big prefill) sends its remainder in a second one.
    """

    FRAME_BYTES = 16384
    HEADER_BYTES = 8

    def __init__(self, group: dist.ProcessGroup, rank: int):
        self.group = group
        self.rank = rank
        self._frame = torch.zeros(self.FRAME_BYTES, dtype=torch.uint8)

    def send(self, command: Command) -> None:
        assert self.rank == 0, "only rank 0 sends commands"
        data = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
        first = min(len(data), self.FRAME_BYTES - self.HEADER_BYTES)
        frame = self._frame.numpy()
        frame[: self.HEADER_BYTES] = np.frombuffer(len(data).to_bytes(self.HEADER_BYTES, "little"), np.uint8)
        frame[self.HEADER_BYTES: self.HEADER_BYTES + first] = np.frombuffer(data, np.uint8, first)
        dist.broadcast(self._frame, src=0, group=self.group)
        if len(data) > first:
            rest = torch.from_numpy(np.frombuffer(data, np.uint8, offset=first).copy())
            dist.broadcast(rest, src=0, group=self.group)

    def recv(self) -> Command:
        dist.broadcast(self._frame, src=0, group=self.group)
        frame = self._frame.numpy()
        length = int.from_bytes(frame[: self.HEADER_BYTES].tobytes(), "little")
        first = min(length, self.FRAME_BYTES - self.HEADER_BYTES)
        data = frame[self.HEADER_BYTES: self.HEADER_BYTES + first].tobytes()
        if length > first:
            rest = torch.empty(length - first, dtype=torch.uint8)
            dist.broadcast(rest, src=0, group=self.group)
            data += rest.numpy().tobytes()
        return pickle.loads(data)

    def agree_min(self, value: int) -> int:
        """The smallest `value` over all ranks (on the CPU group, so it works the same under nccl and gloo)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def barrier(self) -> None:
        dist.barrier(group=self.group)


def join_process_groups(config: EngineConfig, info: RankInfo) -> ControlChannel:
    """torch.distributed for this rank: the model group (nccl / gloo) and the gloo control group."""
    for key, value in MULTICAST_OFF_ENV.items():
        os.environ.setdefault(key, value)
    device = rank_device(config, info.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before NCCL exists, so its communicators bind this rank's GPU
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=info.init_method, world_size=info.world_size, rank=info.rank,
                            timeout=dist_timeout(), device_id=device if device.type == "cuda" else None)
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return ControlChannel(control, info.rank)


def build_runner(config: EngineConfig, info: RankInfo) -> ModelRunner:
    """This rank's shard: the TP state must be set before the model is built (layers read it at construction)."""
    set_tp(info.rank, info.world_size, dist.group.WORLD, expert_parallel=config.enable_expert_parallel)
    return ModelRunner(config, rank_device(config, info.local_rank))


def initialize_cache(runner: ModelRunner, channel: ControlChannel, max_model_len: int, max_num_batched_tokens: int,
                     max_num_seqs: int) -> int:
    """Every rank sizes its own KV pool, then all take the smallest, so block id b names the same tokens (and
    every block table is valid) on every rank. On a GPU the sizing runs a warm-up step, in lockstep on all ranks."""
    own = runner.determine_num_blocks(max_model_len, max_num_batched_tokens, max_num_seqs)
    num_blocks = channel.agree_min(own)
    runner.allocate_kv_cache(num_blocks)
    return num_blocks


def apply_switches(runner: ModelRunner, switches: dict[str, bool]) -> None:
    """Take rank 0's optimization switches. The model reads them at every forward from the Optimizations object it
    shares with the runner's config, so flipping them in place (as the benchmark's ablation does on rank 0) takes
    effect at the next step."""
    opts = runner.config.optimizations
    for name, value in switches.items():
        setattr(opts, name, value)


def worker_loop(runner: ModelRunner, channel: ControlChannel) -> None:
    """Ranks > 0: run rank 0's commands until it says stop. Logits stay here; only rank 0 samples."""
    while True:
        command = channel.recv()
        if isinstance(command, Step):
            if command.switches is not None:
                apply_switches(runner, command.switches)
            runner.execute(command.inp)
        elif isinstance(command, InitCache):
            initialize_cache(runner, channel, command.max_model_len, command.max_num_batched_tokens,
                             command.max_num_seqs)
        elif isinstance(command, Stop):
            return
        else:
            raise RuntimeError(f"unknown tensor-parallel command {command!r}")


def run_worker(config: EngineConfig, info: RankInfo) -> None:
    """A whole worker rank: join, take rank 0's config, build the shard, serve commands, leave."""
    if rank_device(config, info.local_rank).type == "cpu":
        torch.set_num_threads(1)  # N ranks share the host's cores; one thread each avoids oversubscription
    channel = join_process_groups(config, info)
    command = channel.recv()
    if not isinstance(command, Configure):
        raise RuntimeError(f"expected the engine config from rank 0, got {type(command).__name__}")
    engine_config = command.config
    if engine_config.tensor_parallel_size != info.world_size:
        raise RuntimeError(f"rank 0 runs tensor_parallel_size={engine_config.tensor_parallel_size} but "
                           f"{info.world_size} ranks joined")
    runner = build_runner(engine_config, info)
    channel.barrier()  # tells rank 0 this shard is loaded
    worker_loop(runner, channel)
    runner.shutdown()
    # Only a clean stop leaves the groups politely; after an error the process just exits (tearing down a group
    # whose peer is gone can block on the GPU).
    leave_process_groups()


def leave_process_groups() -> None:
    set_tp(0, 1)
    if dist.is_initialized():
        dist.destroy_process_group()
