"""KV blocks between two engines' pools, moved by NIXL (the transfer library under vLLM's NixlConnector).

Both sides hold KV pools whose first dimension is the block id (runner/kv_cache.py: per layer a K/V pool and, on
MSA layers, an index-key pool; any element type - bf16, fp8 e4m3 - is moved as the bytes it is stored as). A
source (the prefill server) registers its pools with its NIXL agent and serves their layout on a side channel; a
destination (the decode server) fetches it once per source, checks that every pool matches its own block for block
(the same count of pools, each with the same per-block shape and type), and reads the blocks it is given straight
into its own blocks. The read carries the request id as a NIXL notification, which tells the source that the
blocks were pulled; a source also gives up on blocks nobody pulled after a timeout.

    source = KVTransferAgent("prefill-0", pools)                 destination = KVTransferAgent("decode-0", pools)
    source.serve("0.0.0.0", 5600)
    source.expect("req-1", deadline)                            engine = destination.connect("prefill-host", 5600)
                                                                pull = destination.pull(engine, [(3, 0), (7, 1)],
                                                                                        "req-1")
                                                                while pull.state() == "pending": ...
    source.finished() -> [("req-1", "pulled")]

NIXL picks the transport through its backend (UCX by default: shared memory or TCP between CPU processes, RDMA or
NVLink between GPUs, set by UCX_TLS as usual); the code path is the same for host and device memory.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

logger = logging.getLogger(__name__)

GET_META = b"get_meta"
POLL_BUSY_S = 0.0005
POLL_IDLE_S = 0.01
"""Without NIXL's progress thread (host pools): how often the agent's own poller moves transfers on - briskly
while blocks wait for a pull or a pull is in flight, else now and then."""


@dataclass(frozen=True)
class PoolRegion:
    """One pool as a transfer sees it: where block 0 starts, how many bytes a block takes, what a block holds."""

    addr: int
    block_bytes: int
    num_blocks: int
    device_id: int
    mem_type: str  # NIXL's memory type: DRAM (host) or VRAM (device)
    block_shape: tuple[int, ...]
    dtype: str

    @classmethod
    def of(cls, pool: torch.Tensor) -> "PoolRegion":
        if not pool.is_contiguous():
            raise ValueError("a KV pool must be contiguous to be transferred block by block")
        block_bytes = pool[0].numel() * pool.element_size()
        on_device = pool.device.type != "cpu"
        return cls(pool.data_ptr(), block_bytes, pool.shape[0], (pool.device.index or 0) if on_device else 0,
                   "VRAM" if on_device else "DRAM", tuple(pool.shape[1:]), str(pool.dtype).removeprefix("torch."))

    def as_list(self) -> list:
        return [self.addr, self.block_bytes, self.num_blocks, self.device_id, self.mem_type, list(self.block_shape),
                self.dtype]

    @classmethod
    def from_list(cls, v: list) -> "PoolRegion":
        return cls(v[0], v[1], v[2], v[3], v[4], tuple(v[5]), v[6])


def layout_mismatch(mine: list[PoolRegion], theirs: list[PoolRegion]) -> str | None:
    """Why two engines' pools cannot exchange blocks, or None. Every pool is compared, not the first only: a
    transfer that assumed one layer's layout for every layer would move the wrong bytes."""
    if len(mine) != len(theirs):
        return f"{len(theirs)} pools there, {len(mine)} here"
    for i, (a, b) in enumerate(zip(mine, theirs)):
        if (a.block_shape, a.dtype, a.block_bytes) != (b.block_shape, b.dtype, b.block_bytes):
            return (f"pool {i}: blocks of {list(b.block_shape)} {b.dtype} ({b.block_bytes} bytes) there, "
                    f"{list(a.block_shape)} {a.dtype} ({a.block_bytes} bytes) here")
    return None


def coalesce(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(remote block, local block) pairs -> (remote first, local first, count) runs where both sides are
    consecutive: one transfer descriptor per run instead of per block."""
    runs: list[tuple[int, int, int]] = []
    for r, loc in pairs:
        if runs and runs[-1][0] + runs[-1][2] == r and runs[-1][1] + runs[-1][2] == loc:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((r, loc, 1))
    return runs


@dataclass
class RemoteEngine:
    engine_id: str
    agent_name: str
    regions: list[PoolRegion]
    tp_size: int


class Pull:
    """A read in flight: state() is "pending", "done" or "error" (NIXL's PROC / DONE / ERR)."""

    def __init__(self, agent: Any, handle: Any | None, on_end: Callable[[], None] | None = None):
        self._agent, self._handle, self._state = agent, handle, "done" if handle is None else "pending"
        self._on_end = on_end

    def state(self) -> str:
        if self._state == "pending":
            status = self._agent.check_xfer_state(self._handle)
            if status == "DONE":
                self._state = "done"
            elif status == "ERR":
                self._state = "error"
            if self._state != "pending":
                self._agent.release_xfer_handle(self._handle)
                if self._on_end is not None:
                    self._on_end()
        return self._state

    def wait(self, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while self.state() == "pending":
            if time.monotonic() > deadline:
                raise TimeoutError("the KV pull did not finish")
            time.sleep(0.0005)
        return self._state


class KVTransferAgent:
    """One engine's NIXL agent over its KV pools (a prefill server's, a decode server's, or both)."""

    def __init__(self, engine_id: str, pools: list[torch.Tensor], backends: list[str] | None = None,
                 tp_size: int = 1, progress_thread: bool | None = None):
        """`progress_thread`: NIXL's own thread that moves transfers on (its default, and vLLM's). It keeps a core
        busy polling, so where the pools are in host memory (a CPU machine) it is off by default, and a thread of
        this agent's polls NIXL instead, every POLL_BUSY_S while a transfer may be under way. The agent's calls
        come from several threads (the engine's, the poller, a connect), so NIXL serialises them (sync mode
        strict)."""
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

        self.engine_id = engine_id
        self.tp_size = tp_size
        self.regions = [PoolRegion.of(p) for p in pools]
        if progress_thread is None:
            progress_thread = any(r.mem_type == "VRAM" for r in self.regions)
        self.agent = nixl_agent(engine_id, nixl_agent_config(
            enable_prog_thread=progress_thread, backends=backends or ["UCX"],
            sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT))
        self._registered = self.agent.register_memory(list(pools))
        self._pools = pools  # keep them alive as long as NIXL holds their addresses
        self._remotes: dict[str, RemoteEngine] = {}
        self._expected: dict[str, float] = {}  # request id -> deadline (monotonic) of blocks kept for a pull
        self._done: list[tuple[str, str]] = []
        self._pulls = 0  # reads in flight
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._listener: threading.Thread | None = None
        self._poller: threading.Thread | None = None
        if not progress_thread:
            self._poller = threading.Thread(target=self._poll, daemon=True, name="kv-transfer-poll")
            self._poller.start()

    def _poll(self) -> None:
        """Without NIXL's progress thread: move transfers on, and take the notifications that came."""
        while not self._stop.wait(POLL_BUSY_S if self._expected or self._pulls else POLL_IDLE_S):
            self._take_notifications()

    def _take_notifications(self) -> None:
        for _agent, messages in self.agent.get_new_notifs().items():
            for msg in messages:
                request_id = msg.decode()
                with self._lock:
                    if self._expected.pop(request_id, None) is not None:
                        self._done.append((request_id, "pulled"))

    # -- the source side ------------------------------------------------------------------------------------------
    def metadata(self) -> bytes:
        import msgpack

        return msgpack.packb({"engine_id": self.engine_id, "agent_metadata": self.agent.get_agent_metadata(),
                              "tp_size": self.tp_size, "regions": [r.as_list() for r in self.regions]},
                             use_bin_type=True)

    def serve(self, host: str, port: int) -> None:
        """Answer layout requests on a ZMQ ROUTER socket at host:port (a thread; vLLM's side channel)."""
        import zmq

        payload = self.metadata()
        sock = zmq.Context.instance().socket(zmq.ROUTER)
        sock.bind(f"tcp://{host}:{port}")
        ready = threading.Event()

        def listen() -> None:
            ready.set()
            try:
                while not self._stop.is_set():
                    if sock.poll(100):
                        identity, _, msg = sock.recv_multipart()
                        if msg == GET_META:
                            sock.send_multipart((identity, b"", payload))
                        else:
                            logger.warning("KV transfer side channel: unexpected message %r", msg[:32])
            finally:
                sock.close(linger=0)

        self._listener = threading.Thread(target=listen, daemon=True, name="kv-transfer-side-channel")
        self._listener.start()
        ready.wait()

    def expect(self, request_id: str, timeout_s: float) -> None:
        """Blocks of `request_id` are kept for a pull; finished() reports them pulled, or timed out."""
        with self._lock:
            self._expected[request_id] = time.monotonic() + timeout_s

    def finished(self) -> list[tuple[str, str]]:
        """The requests whose kept blocks can be freed since the last call: (request id, "pulled" | "timeout")."""
        if self._poller is None:
            self._take_notifications()
        now = time.monotonic()
        with self._lock:
            for request_id, deadline in list(self._expected.items()):
                if deadline <= now:
                    del self._expected[request_id]
                    self._done.append((request_id, "timeout"))
            done, self._done = self._done, []
        return done

    @property
    def num_expected(self) -> int:
        return len(self._expected)

    # -- the destination side -------------------------------------------------------------------------------------
    def is_connected(self, engine_id: str) -> bool:
        """Has connect() fetched `engine_id`'s layout (so pull() can read from it)?"""
        return engine_id in self._remotes

    def forget(self, engine_id: str) -> None:
        """Drop a source (after a failed pull: it may have restarted under the same engine id, with new
        addresses); the next connect() fetches its layout again."""
        remote = self._remotes.pop(engine_id, None)
        if remote is not None:
            try:
                self.agent.remove_remote_agent(remote.agent_name)
            except Exception:  # a source NIXL already dropped
                logger.debug("KV transfer: removing engine %r", engine_id, exc_info=True)

    def connect(self, host: str, port: int, timeout_s: float = 10.0) -> str:
        """Fetch a source's layout and NIXL agent once (later calls reuse it); its engine id."""
        import msgpack
        import zmq

        sock = zmq.Context.instance().socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{host}:{port}")
        try:
            sock.send(GET_META)
            if not sock.poll(int(timeout_s * 1000)):
                raise ConnectionError(f"no KV transfer side channel answered at {host}:{port}")
            meta = msgpack.unpackb(sock.recv(), raw=False)
        finally:
            sock.close()
        engine_id = meta["engine_id"]
        if engine_id in self._remotes:
            return engine_id
        regions = [PoolRegion.from_list(r) for r in meta["regions"]]
        why = layout_mismatch(self.regions, regions)
        if why is None and meta["tp_size"] != self.tp_size:
            why = f"tensor parallel size {meta['tp_size']} there, {self.tp_size} here"
        if why is not None:
            raise ValueError(f"engine {engine_id!r} at {host}:{port} cannot send its KV blocks here: {why}")
        name = self.agent.add_remote_agent(meta["agent_metadata"])
        name = name.decode() if isinstance(name, bytes) else name
        self._remotes[engine_id] = RemoteEngine(engine_id, name, regions, meta["tp_size"])
        return engine_id

    def pull(self, engine_id: str, pairs: list[tuple[int, int]], request_id: str) -> Pull:
        """Read remote blocks into local ones ((remote, local) pairs), in every pool; the source is notified with
        `request_id` once the read is done (with no pairs, at once: it frees the blocks unread)."""
        remote = self._remotes[engine_id]
        if not pairs:
            self.agent.send_notif(remote.agent_name, request_id.encode())
            return Pull(self.agent, None)
        local_descs, remote_descs = [], []
        for mine, theirs in zip(self.regions, remote.regions):
            for r, loc, n in coalesce(pairs):
                if r < 0 or loc < 0 or r + n > theirs.num_blocks or loc + n > mine.num_blocks:
                    raise ValueError(f"blocks {r}+{n} / {loc}+{n} lie outside the pools "
                                     f"({theirs.num_blocks} / {mine.num_blocks} blocks)")
                local_descs.append((mine.addr + loc * mine.block_bytes, n * mine.block_bytes, mine.device_id))
                remote_descs.append((theirs.addr + r * theirs.block_bytes, n * theirs.block_bytes,
                                     theirs.device_id))
        local = self.agent.get_xfer_descs(local_descs, self.regions[0].mem_type)
        far = self.agent.get_xfer_descs(remote_descs, remote.regions[0].mem_type)
        handle = None
        try:
            handle = self.agent.initialize_xfer("READ", local, far, remote.agent_name, request_id.encode())
            if self.agent.transfer(handle) == "ERR":
                raise RuntimeError("NIXL reported an error")
        except Exception as exc:  # NIXL raises e.g. nixlRemoteDisconnectError when the source is gone
            if handle is not None:
                self.agent.release_xfer_handle(handle)
            raise ConnectionError(f"the KV pull of {request_id} from engine {engine_id!r} failed to start: "
                                  f"{exc}") from exc
        with self._lock:
            self._pulls += 1
        return Pull(self.agent, handle, self._pull_ended)

    def _pull_ended(self) -> None:
        with self._lock:
            self._pulls -= 1

    def shutdown(self) -> None:
        self._stop.set()
        for thread in (self._listener, self._poller):
            if thread is not None:
                thread.join(timeout=2)
        for remote in self._remotes.values():
            self.agent.remove_remote_agent(remote.agent_name)
        self._remotes.clear()
        self.agent.deregister_memory(self._registered)
