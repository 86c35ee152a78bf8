"""The engine's side of prefill/decode disaggregation (a `kv_transfer_config` that names a connector): the blocks
a prefill server keeps for a decode server, and a decode server's pulls. vLLM's NixlConnector, scheduler side.

    prefill server (kv_producer)   a request with do_remote_decode that ends by length keeps its prompt's blocks
                                   (`hold`): still in the prefix cache and shareable, owned by the request until
                                   the decode server has pulled them or VLLM_NIXL_ABORT_REQUEST_TIMEOUT passes;
                                   its output carries the kv_transfer_params that name them
    decode server (kv_consumer)    a request with do_remote_prefill gets blocks for its whole prompt (its local
                                   prefix hits first) and waits, LOADING_REMOTE_KV, while the blocks it lacks are
                                   read from the prefill server (`load`); then it computes only its last prompt
                                   token. A failed pull fails the request or has it computed here
                                   (kv_load_failure_policy)

The scheduler calls `progress` at the start of every schedule: it learns which held blocks to free and which loads
ended. The block transfer itself is kv_transfer/transfer.py's KVTransferAgent (NIXL), built by the executor over
the runner's pools; this module hands it block ids and request ids, never a tensor. The first pull from a prefill
engine fetches its layout over its side channel in a background thread, so a slow or dead prefill server never
stalls the steps of the others.

Why a pull starts one schedule after its blocks were allocated: on a GPU, the step launched just before may still
be writing blocks that were freed meanwhile (a sequence that ended while the step was in flight) and handed out
again to this load; a read into them must not race that write. By the next schedule that step's tokens have been
received, so its writes are done.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nanoserve.config import EngineConfig
from nanoserve.engine.sequence import FinishReason, Sequence
from nanoserve.kv_transfer import params as kv_params
from nanoserve.kv_transfer.config import KVTransferConfig, abort_timeout_s, side_channel

if TYPE_CHECKING:
    from nanoserve.executor.base import Executor

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0
"""How long a decode server waits for a prefill server's side channel to answer (then the pull fails)."""
POLL_LOADS_S = 0.002
POLL_HELD_S = 0.02
"""How often an engine with nothing to run polls its transfers: pulls in flight, blocks kept for a pull."""


def check_supported(config: EngineConfig, kv: KVTransferConfig) -> None:
    """What a connector cannot serve yet, refused when the engine starts."""
    if config.tensor_parallel_size > 1:
        raise ValueError(f"kv_transfer_config: prefill/decode disaggregation runs with tensor_parallel_size 1 only "
                         f"(got {config.tensor_parallel_size}): each rank would move its own shard of the blocks")


@dataclass
class Load:
    """A decode's pull of its prompt's KV: (remote block, local block) pairs, and where it stands."""

    seq: Sequence
    remote: kv_params.RemotePrefill
    pairs: list[tuple[int, int]]
    allocated_at: int  # the progress() call during whose schedule its blocks were allocated
    pull: Any = None  # transfer.Pull, once started
    error: str | None = None
    aborted: bool = False  # the request went away while its read was in flight: free the blocks when it ends


class KVConnector:
    """One engine's P/D bookkeeping over its KVTransferAgent (see the module docstring)."""

    def __init__(self, config: KVTransferConfig, agent: Any, block_size: int):
        self.config = config
        self.agent = agent
        self.block_size = block_size
        self.host, self.port = side_channel()
        self.abort_timeout_s = abort_timeout_s()
        self.held: dict[str, Sequence] = {}  # request id -> its finished sequence, holding its prompt's blocks
        self.loads: dict[int, Load] = {}  # seq id -> its pull
        self._connecting: dict[str, Future] = {}  # remote engine id -> its side-channel fetch, in the thread
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kv-transfer-connect")
        self._calls = 0
        if config.is_producer:
            agent.serve(self.host, self.port)
        logger.info("KV transfer: %s as %s, engine id %s%s", config.kv_connector, config.kv_role, config.engine_id,
                    f", side channel {self.host}:{self.port}" if config.is_producer else "")

    @classmethod
    def start(cls, config: KVTransferConfig, executor: Executor, block_size: int) -> "KVConnector":
        """The connector of an engine whose KV pool is allocated: its agent registers the pools."""
        return cls(config, executor.kv_transfer_agent(config.engine_id, config.backends), block_size)

    @property
    def busy(self) -> bool:
        """Blocks kept for a pull, or pulls not ended: work for the next progress() call."""
        return bool(self.held or self.loads)

    @property
    def poll_s(self) -> float:
        """How long an engine with nothing else to do may wait before the next progress() call."""
        return POLL_LOADS_S if self.loads else POLL_HELD_S

    # -- a prefill server ---------------------------------------------------------------------------------
    def hold(self, seq: Sequence, reason: FinishReason) -> bool:
        """seq ends: keep its prompt's blocks for a decode server (True), when it asked for remote decode and
        ended by length (its one token: the prompt is computed); else False, and it frees them as usual. Its
        output then carries the kv_transfer_params naming the blocks."""
        if not isinstance(seq.kv_transfer, kv_params.RemoteDecode) or reason != FinishReason.LENGTH:
            return False
        blocks = seq.block_table[: -(-seq.num_prompt_tokens // self.block_size)]
        self.agent.expect(seq.request_id, self.abort_timeout_s)
        self.held[seq.request_id] = seq
        seq.kv_transfer_answer = kv_params.prefill_answer(self.config.engine_id, seq.request_id, blocks, self.host,
                                                          self.port)
        return True

    # -- a decode server ----------------------------------------------------------------------------------
    def load(self, seq: Sequence, first: int, local_blocks: list[int]) -> None:
        """Pull seq's prompt KV into `local_blocks`, the blocks of its prompt from logical block `first` on (those
        before are local prefix-cache hits), from the same blocks of the prefill server's. Nothing to pull (a full
        local hit) still tells the prefill server, which frees its blocks. The pull starts in a later
        progress()."""
        remote = seq.kv_transfer
        assert isinstance(remote, kv_params.RemotePrefill)
        load = Load(seq, remote, [], self._calls)
        end = first + len(local_blocks)
        if remote.tp_size != self.agent.tp_size:
            load.error = f"the prefill engine runs tensor parallel size {remote.tp_size}, this one {self.agent.tp_size}"
        elif end > len(remote.block_ids):
            load.error = f"the prompt's KV fills {end} blocks, the prefill server named {len(remote.block_ids)}"
        else:
            load.pairs = kv_params.pull_plan(remote.block_ids[:end], local_blocks)
        self.loads[seq.seq_id] = load

    def abort(self, seq: Sequence) -> bool:
        """A loading sequence is aborted: may its blocks be freed now? Not while a read is writing them: then
        progress() returns it once the read has ended."""
        load = self.loads.get(seq.seq_id)
        if load is not None and load.pull is not None and load.error is None and load.pull.state() == "pending":
            load.aborted = True
            return False
        self.loads.pop(seq.seq_id, None)
        return True

    # -- every schedule -----------------------------------------------------------------------------------
    def progress(self) -> tuple[list[Sequence], list[Sequence], list[Sequence]]:
        """(released, loaded, failed): sequences whose blocks may be freed now (prefill holds pulled or timed out,
        aborted loads whose read has ended), decodes whose KV has arrived, decodes whose pull failed."""
        self._calls += 1
        released: list[Sequence] = []
        if self.held:
            for request_id, why in self.agent.finished():
                seq = self.held.pop(request_id, None)
                if seq is not None:
                    released.append(seq)
                    if why == "timeout":
                        logger.warning("KV transfer: request %s's blocks were not pulled within %.0f s; freed",
                                       request_id, self.abort_timeout_s)
        loaded, failed = [], []
        for load in list(self.loads.values()):
            state = self._advance(load)
            if state == "pending":
                continue
            del self.loads[load.seq.seq_id]
            if load.aborted:
                released.append(load.seq)
            elif state == "done":
                loaded.append(load.seq)
            else:
                logger.warning("KV transfer: the pull of %s from engine %r failed: %s", load.seq.request_id,
                               load.remote.engine_id, load.error)
                failed.append(load.seq)
        for engine_id in [e for e, f in self._connecting.items() if f.done()]:
            del self._connecting[engine_id]  # every load waiting on it has seen its result
        return released, loaded, failed

    def _advance(self, load: Load) -> str:
        """Move a pull on: "pending", "done" or "error"."""
        if load.error is not None:
            return "error"
        if load.pull is not None:
            state = load.pull.state()
            if state == "error":
                load.error = "NIXL reported an error"
                self.agent.forget(load.remote.engine_id)
            return state
        if self._calls <= load.allocated_at:  # (the module docstring says why)
            return "pending"
        remote = load.remote
        if not self.agent.is_connected(remote.engine_id):
            future = self._connecting.get(remote.engine_id)
            if future is None:
                future = self._connecting[remote.engine_id] = self._thread.submit(
                    self.agent.connect, remote.host, remote.port, CONNECT_TIMEOUT_S)
            if not future.done():
                return "pending"
            if future.exception() is not None:
                load.error = str(future.exception())
                return "error"
            if future.result() != remote.engine_id:
                load.error = (f"the side channel at {remote.host}:{remote.port} is engine {future.result()!r}, not "
                              f"{remote.engine_id!r}")
                return "error"
        try:
            load.pull = self.agent.pull(remote.engine_id, load.pairs, remote.request_id)
        except (ConnectionError, ValueError) as exc:
            load.error = str(exc)
            self.agent.forget(remote.engine_id)
            return "error"
        return self._advance(load)

    def shutdown(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
        self.agent.shutdown()
