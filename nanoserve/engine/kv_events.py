"""KV-cache events in vLLM's format: which prefix blocks this engine holds, published over ZMQ for KV-aware routers.

A KV-aware router (llm-d's precise prefix-cache scorer, NVIDIA Dynamo's KV router, vllm-router's kv_aware policy)
keeps an index of the prefix blocks every replica holds and sends a request to the replica that holds the longest
prefix of it. It learns what a replica holds from these events, as vLLM publishes them with
`--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}'`:

    BlockStored       full blocks entered the prefix cache: block_hashes, parent_block_hash (the block before the
                      first, None at the start of a prompt), token_ids (all of theirs, in order), block_size,
                      lora_id, medium ("GPU": the device pool), lora_name, extra_keys (per block: the content
                      hashes of the images / videos with placeholders in it, then the cache_salt on a prompt's first
                      block; None when there is neither), group_idx 0, kv_cache_spec_kind "full_attention"
    BlockRemoved      cached blocks were evicted: block_hashes, medium, group_idx
    AllBlocksCleared  the whole prefix cache was dropped

On the wire (vLLM's since it moved its events to map encoding): each ZMQ message has three frames, the topic, an
8-byte big-endian sequence number and a msgpack payload `[ts, [event, ...], data_parallel_rank]`, each event a map
tagged by its class name under "type". One batch per engine step (and one for what an idle engine registered last).
With a `replay_endpoint`, a ROUTER socket answers a request for sequence number N (8 bytes, big-endian) with every
batch from N that is still in the last `buffer_steps`, as (seq, payload) frames, then (-1, b"").

Block hashes: a router that indexes by its own tokenization must compute the same keys from token ids, so they are
vLLM's `sha256_cbor` hashes (`--prefix-caching-hash-algo sha256_cbor`), the scheme llm-d reproduces:

    NONE_HASH = sha256(cbor(str(PYTHONHASHSEED)))              (random bytes when PYTHONHASHSEED is unset, as vLLM)
    digest_i  = sha256(cbor([digest_{i-1} or NONE_HASH, [token ids of block i], extra_keys_i]))
    key_i     = int.from_bytes(digest_i, "big") & (2**64 - 1)     (the low 64 bits: vLLM's default integer hashes)

with canonical CBOR. They are computed here from each block's tokens; the engine's own prefix-cache hash
(block_manager.chain_hash) is not published. Consumers that treat the keys as opaque (Dynamo, vllm-router) only
need them to be stable between BlockStored and BlockRemoved and chained through parent_block_hash, which they are.
The block size is the engine's (m3-mini and M3: 64, the MSA block), not vLLM's default 16: a router must be told.

The recorder is an engine observer (LLMEngine.add_observer): it reads the block manager's `cache` and `evict`
events on the engine's thread, and the publisher's own thread encodes and sends, so a slow subscriber never holds
up a step.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from nanoserve.config import from_json_object

logger = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"  # vLLM's name for the device KV pool (routers credit other media, "CPU" and disk, less)
KV_CACHE_SPEC_KIND = "full_attention"  # M3's K/V and MSA index keys live in the same blocks of one pool
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's last frame


@dataclass
class KVEventsConfig:
    """`--kv-events-config` (vLLM's KVEventsConfig; the same keys and defaults)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    """"zmq" or "null"; unset: "zmq" when events are enabled, else "null"."""
    endpoint: str = "tcp://*:5557"
    """Where the PUB socket binds (an address with "*" or "::", ipc:// or inproc://) or connects (any other)."""
    replay_endpoint: str | None = None
    """A ROUTER socket (bound) that replays buffered batches from a sequence number; None: no replay."""
    buffer_steps: int = 10_000
    """Batches kept for replay."""
    hwm: int = 100_000
    """The PUB socket's high-water mark: messages queued per subscriber before ZMQ drops."""
    max_queue_size: int = 100_000
    """Batches waiting for the publisher thread before the engine thread blocks."""
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"kv_events_config: publisher must be 'zmq' or 'null', got {self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"kv_events_config: {name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def from_dict(cls, value: dict[str, Any] | None) -> "KVEventsConfig":
        return from_json_object(cls, value, "kv_events_config")

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


# -- block hashes ----------------------------------------------------------------------------------------------------
def none_hash(seed: str | None = None) -> bytes:
    """The chain's root (vLLM's NONE_HASH): sha256 of the CBOR seed string; random when there is no seed."""
    import cbor2

    if seed is None:
        seed = os.environ.get("PYTHONHASHSEED")
    if seed is None:
        return os.urandom(32)
    return hashlib.sha256(cbor2.dumps(seed, canonical=True)).digest()


def block_digest(parent: bytes, token_ids: list[int] | tuple[int, ...], extra_keys: tuple | None) -> bytes:
    """vLLM's sha256_cbor block hash: sha256(cbor([parent digest, token ids, extra keys]))."""
    import cbor2

    return hashlib.sha256(cbor2.dumps((parent, tuple(token_ids), extra_keys), canonical=True)).digest()


def extra_keys(mm: tuple[str, ...], salt: str | None) -> tuple | None:
    """A block's extra keys as vLLM orders them: its images' content hashes, then the cache_salt (a prompt's first
    block only); None when it has neither."""
    keys = (*mm, salt) if salt else tuple(mm)
    return keys or None


def external_key(digest: bytes) -> int:
    """The 64-bit integer a block is published as (vLLM's default: the digest's low 64 bits, big-endian)."""
    return int.from_bytes(digest, "big") & ((1 << 64) - 1)


def prompt_keys(token_ids: list[int], block_size: int, cache_salt: str | None = None,
                root: bytes | None = None) -> list[int]:
    """The keys of a token sequence's full blocks, as a router computes them to look a prompt up."""
    parent, keys = root if root is not None else none_hash(), []
    for i in range(len(token_ids) // block_size):
        parent = block_digest(parent, token_ids[i * block_size:(i + 1) * block_size],
                              (cache_salt,) if cache_salt and i == 0 else None)
        keys.append(external_key(parent))
    return keys


# -- events ----------------------------------------------------------------------------------------------------------
def block_stored(keys: list[int], parent: int | None, token_ids: list[int], block_size: int,
                 extra_keys: list[tuple | None]) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": keys, "parent_block_hash": parent, "token_ids": token_ids,
            "block_size": block_size, "lora_id": None, "medium": MEDIUM_GPU, "lora_name": None,
            "extra_keys": [list(e) if e is not None else None for e in extra_keys], "group_idx": 0,
            "kv_cache_spec_kind": KV_CACHE_SPEC_KIND}


def block_removed(keys: list[int]) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": keys, "medium": MEDIUM_GPU, "group_idx": 0}


def all_blocks_cleared() -> dict[str, Any]:
    return {"type": "AllBlocksCleared"}


def encode_batch(events: list[dict[str, Any]], ts: float | None = None, data_parallel_rank: int = 0) -> bytes:
    """One KVEventBatch as msgpack: [ts, events, data_parallel_rank] (positional), each event a tagged map."""
    import msgpack

    return msgpack.packb([time.time() if ts is None else ts, events, data_parallel_rank], use_bin_type=True)


# -- the publisher ---------------------------------------------------------------------------------------------------
class ZmqEventPublisher:
    """PUB socket + optional ROUTER replay socket, driven by one thread; `publish(events)` only queues."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0):
        import zmq

        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self._queue: queue.Queue[list[dict] | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._seq = 0
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        endpoint = config.endpoint
        if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
            self._pub.bind(endpoint)  # the stable side binds (vLLM's rule)
        else:
            self._pub.connect(endpoint)
        self._replay = None
        if config.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(config.replay_endpoint)
        self._poller = zmq.Poller()
        if self._replay is not None:
            self._poller.register(self._replay, zmq.POLLIN)
        self.idle_flush = lambda: None  # set by the recorder: events an idle engine left pending
        self._running = True
        self._thread = threading.Thread(target=self._run, daemon=True, name="kv-events-publisher")
        self._thread.start()
        logger.info("KV events: publishing on %s%s (topic %r)", endpoint,
                    f", replay on {config.replay_endpoint}" if self._replay is not None else "", config.topic)

    @property
    def next_seq(self) -> int:
        return self._seq

    def publish(self, events: list[dict[str, Any]]) -> None:
        if self._running and events:
            self._queue.put(events)

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._poller.poll(0):
                self._serve_replay()
            try:
                events = self._queue.get(timeout=0.01)
            except queue.Empty:
                self.idle_flush()
                if not self._running and self._queue.empty():
                    return
                continue
            if events is None:
                return
            payload = encode_batch(events, data_parallel_rank=self.data_parallel_rank)
            self._pub.send_multipart((self._topic, self._seq.to_bytes(8, "big"), payload))
            self._buffer.append((self._seq, payload))
            self._seq += 1

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("KV events: a replay request of %d frames (expected identity, b'', seq)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

    def shutdown(self, timeout: float = 2.0) -> None:
        """Send what is queued, then close the sockets."""
        if not self._running:
            return
        self.idle_flush()
        self._running = False
        self._queue.put(None)
        self._thread.join(timeout)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)


class KVEventRecorder:
    """Turns the block manager's events into vLLM's KV events and hands them to the publisher one step at a time.

    Called on the engine's thread. `cache` (blocks entered the prefix cache) becomes BlockStored, `evict` becomes
    BlockRemoved, `reset` (the whole cache dropped) AllBlocksCleared; `step` closes the batch of the step before."""

    def __init__(self, publisher: ZmqEventPublisher, block_size: int, root: bytes | None = None):
        self.publisher = publisher
        self.block_size = block_size
        self.root = none_hash() if root is None else root
        self._digests: dict[bytes, bytes] = {}  # the engine's hash of a cached block -> its published digest
        self._pending: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        publisher.idle_flush = self.flush

    def __call__(self, event: str, **payload: Any) -> None:
        if event == "cache":
            self._stored(payload["seq"], payload["cached"])
        elif event == "evict":
            digest = self._digests.pop(payload["hash"], None)
            if digest is not None:
                self._add(block_removed([external_key(digest)]))
        elif event == "reset" and payload.get("all"):
            self._digests.clear()
            self._add(all_blocks_cleared())
        elif event == "step":
            self.flush()

    def _stored(self, seq: Any, cached: list[tuple[bytes, bytes | None, tuple[int, ...], tuple[str, ...]]]) -> None:
        """`cached`: (engine hash, engine parent hash, token ids, image hashes) of each block that entered the cache,
        in the order of seq's blocks. Runs of blocks that chain become one BlockStored each."""
        from nanoserve.engine.block_manager import salt_root

        start = salt_root(seq.cache_salt)  # the engine's parent of a prompt's first block
        run: dict[str, Any] | None = None
        last = None
        for h, parent, tokens, mm in cached:
            first = parent == start
            if first:
                parent_digest = self.root
            else:
                parent_digest = self._digests.get(parent)  # type: ignore[arg-type]
                if parent_digest is None:  # the parent was evicted meanwhile: recompute the chain from the start
                    parent_digest = self._chain_digest(seq, parent)
            extra = extra_keys(mm, seq.cache_salt if first else None)
            digest = block_digest(parent_digest, tokens, extra)
            self._digests[h] = digest
            if run is None or parent != last:
                run = block_stored([], None if first else external_key(parent_digest), [], self.block_size, [])
                self._add(run)
            run["block_hashes"].append(external_key(digest))
            run["token_ids"].extend(tokens)
            run["extra_keys"].append(list(extra) if extra else None)
            last = h

    def _chain_digest(self, seq: Any, parent: bytes) -> bytes:
        """The published digest of the block of seq whose engine hash is `parent`, from seq's tokens."""
        from nanoserve.engine.block_manager import block_extra_keys, chain_hash, salt_root

        tokens, bs = seq.token_ids, self.block_size
        engine_h, digest = salt_root(seq.cache_salt), self.root
        for i in range(len(tokens) // bs):
            chunk = tokens[i * bs:(i + 1) * bs]
            mm = block_extra_keys(seq, i, bs)
            engine_h = chain_hash(engine_h, chunk, mm)
            digest = block_digest(digest, chunk, extra_keys(mm, seq.cache_salt if i == 0 else None))
            if engine_h == parent:
                return digest
        raise RuntimeError("KV events: a cached block's parent is not a block of its sequence")

    def _add(self, event: dict[str, Any]) -> None:
        with self._lock:
            self._pending.append(event)

    def flush(self) -> None:
        with self._lock:
            events, self._pending = self._pending, []
        self.publisher.publish(events)


def attach(engine: Any, config: KVEventsConfig | dict | None) -> ZmqEventPublisher | None:
    """Publish `engine`'s KV events as `config` says (an LLMEngine; its observers get the recorder). Returns the
    publisher (call shutdown() when the engine stops), or None when events are off."""
    if not isinstance(config, KVEventsConfig):
        config = KVEventsConfig.from_dict(config)
    if not config.publishes:
        return None
    if not engine.config.optimizations.prefix_caching:
        logger.warning("KV events: the prefix_caching switch is off, so no block is ever cached and none published")
    if os.environ.get("PYTHONHASHSEED") is None:
        logger.warning("KV events: PYTHONHASHSEED is unset, so the block hashes start from random bytes and a router "
                       "cannot compute them from token ids (set it, as for vLLM's sha256_cbor hashes)")
    publisher = ZmqEventPublisher(config)
    engine.add_observer(KVEventRecorder(publisher, engine.block_size))
    return publisher
