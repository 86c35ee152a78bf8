"""KV-cache events (engine/kv_events.py): vLLM's BlockStored / BlockRemoved / AllBlocksCleared over ZMQ.

What a KV-aware router relies on, checked with real ZMQ sockets: the block hashes are the ones it computes from
token ids (vLLM's sha256_cbor chain, checked against CBOR bytes built here by hand), the batches decode with vLLM's
own event types (msgspec structs declared as vLLM declares them), every stored block's tokens are the prompt's,
an evicted block's BlockRemoved names the hash its BlockStored published, and a subscriber that joins late gets
the batches it missed from the replay socket. The last tests do this against a server process started with
`--kv-events-config`.
"""

from __future__ import annotations

import hashlib
import json
import time

import httpx
import msgspec
import pytest
import zmq

from nanoserve import LLM, SamplingParams
from nanoserve.engine import kv_events
from nanoserve.engine.kv_events import KVEventsConfig, encode_batch, none_hash, prompt_keys
from tests.helpers.engine_utils import engine_opts, random_tokens
from tests.helpers.server_utils import ServerProcess, free_port


# -- vLLM's event types, declared as vLLM declares them (vllm/distributed/kv_events.py) ------------------------------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(KVEventBatch)


# -- block hashes ----------------------------------------------------------------------------------------------------
def cbor_head(major: int, n: int) -> bytes:
    """A canonical CBOR item head (the shortest encoding of n), written out by hand."""
    if n < 24:
        return bytes([major << 5 | n])
    for info, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if n < 1 << (8 * size):
            return bytes([major << 5 | info]) + n.to_bytes(size, "big")
    raise ValueError(n)


def reference_keys(tokens: list[int], block_size: int, seed: str, salt: str | None = None) -> list[int]:
    """llm-d's sha256_cbor keys: sha256(cbor([parent, tokens, extra])) chained from sha256(cbor(seed)), the low
    64 bits of each digest, big-endian."""
    parent = hashlib.sha256(cbor_head(3, len(seed)) + seed.encode()).digest()
    keys = []
    for i in range(len(tokens) // block_size):
        chunk = tokens[i * block_size:(i + 1) * block_size]
        extra = (cbor_head(4, 1) + cbor_head(3, len(salt)) + salt.encode()) if salt and i == 0 else b"\xf6"
        body = cbor_head(4, 3) + cbor_head(2, 32) + parent + cbor_head(4, len(chunk)) + \
            b"".join(cbor_head(0, t) for t in chunk) + extra
        parent = hashlib.sha256(body).digest()
        keys.append(int.from_bytes(parent[24:], "big"))
    return keys


def test_block_hashes_are_vllm_sha256_cbor_hashes(monkeypatch):
    tokens = [1, 23, 24, 255, 256, 4095, 70000, 9] * 8
    assert prompt_keys(tokens, 16, root=none_hash("0")) == reference_keys(tokens, 16, "0")
    assert prompt_keys(tokens[:63], 16, root=none_hash("0")) == reference_keys(tokens, 16, "0")[:3]  # full blocks
    salted = prompt_keys(tokens, 16, cache_salt="tenant-a", root=none_hash("0"))
    assert salted == reference_keys(tokens, 16, "0", salt="tenant-a")
    assert salted[0] != prompt_keys(tokens, 16, root=none_hash("0"))[0]
    assert none_hash("1") != none_hash("0")
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert none_hash() == none_hash("0")  # the seed is PYTHONHASHSEED, as vLLM's
    monkeypatch.delenv("PYTHONHASHSEED")
    assert none_hash() != none_hash()  # unseeded: random bytes, as vLLM's


def test_a_batch_decodes_with_vllm_types():
    stored = kv_events.block_stored([1, 2], None, list(range(8)), 4, [("salt",), None])
    batch = DECODER.decode(encode_batch([stored, kv_events.block_removed([2]), kv_events.all_blocks_cleared()],
                                        ts=12.5))
    assert batch.ts == 12.5 and batch.data_parallel_rank == 0
    s, r, c = batch.events
    assert isinstance(s, BlockStored) and isinstance(r, BlockRemoved) and isinstance(c, AllBlocksCleared)
    assert (s.block_hashes, s.parent_block_hash, s.token_ids, s.block_size) == ([1, 2], None, list(range(8)), 4)
    assert (s.medium, s.lora_id, s.lora_name, s.group_idx, s.kv_cache_spec_kind) == \
        ("GPU", None, None, 0, "full_attention")
    assert s.extra_keys == [("salt",), None]
    assert (r.block_hashes, r.medium, r.group_idx) == ([2], "GPU", 0)


def test_config_takes_vllms_keys_and_names_unknown_ones():
    cfg = KVEventsConfig.from_dict({"enable_kv_cache_events": True, "endpoint": "tcp://*:6000", "topic": "kv"})
    assert cfg.publisher == "zmq" and cfg.publishes and cfg.buffer_steps == 10_000 and cfg.replay_endpoint is None
    assert not KVEventsConfig.from_dict({"enable_kv_cache_events": False}).publishes
    assert not KVEventsConfig.from_dict({"enable_kv_cache_events": True, "publisher": "null"}).publishes
    with pytest.raises(ValueError, match="unknown keys \\['endpint'\\]"):
        KVEventsConfig.from_dict({"enable_kv_cache_events": True, "endpint": "tcp://*:6000"})
    with pytest.raises(ValueError, match="publisher must be"):
        KVEventsConfig.from_dict({"publisher": "kafka"})


# -- a subscriber ----------------------------------------------------------------------------------------------------
class Subscriber:
    """A SUB socket on the publisher's endpoint, and a DEALER for the replay socket (as a router connects)."""

    def __init__(self, port: int, replay_port: int | None = None, topic: str = ""):
        self.ctx = zmq.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.sub.connect(f"tcp://127.0.0.1:{port}")
        self.replay_port = replay_port
        self.batches: list[tuple[int, KVEventBatch, bytes]] = []  # (seq, batch, payload)

    def receive(self, until, timeout: float = 30.0) -> list:
        """Collect batches until `until(events so far)` holds; every event received, in order."""
        deadline = time.monotonic() + timeout
        while not until(self.events()):
            assert time.monotonic() < deadline, f"timed out; got {self.events()}"
            if self.sub.poll(100):
                topic, seq, payload = self.sub.recv_multipart()
                self.batches.append((int.from_bytes(seq, "big"), DECODER.decode(payload), payload))
        return self.events()

    def events(self) -> list:
        return [e for _, b, _ in self.batches for e in b.events]

    def replay(self, start: int) -> list[tuple[int, bytes]]:
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{self.replay_port}")
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        out = []
        try:
            while True:
                assert dealer.poll(10_000), "the replay socket did not answer"
                _, seq, payload = dealer.recv_multipart()
                if seq == kv_events.END_SEQ:
                    assert payload == b""
                    return out
                out.append((int.from_bytes(seq, "big"), payload))
        finally:
            dealer.close(linger=0)

    def close(self) -> None:
        self.sub.close(linger=0)


def stored(events) -> list[BlockStored]:
    return [e for e in events if isinstance(e, BlockStored)]


def check_chained(events: list[BlockStored]) -> None:
    """Within an event the hashes chain block by block; across events, a parent names a block published before."""
    seen: set[int] = set()
    for e in events:
        assert len(e.token_ids) == len(e.block_hashes) * e.block_size
        assert e.parent_block_hash is None or e.parent_block_hash in seen, (e.parent_block_hash, seen)
        seen.update(e.block_hashes)


# -- the engine, in this process -------------------------------------------------------------------------------------
def test_engine_publishes_stored_removed_and_cleared():
    """m3-tiny with a pool of 12 blocks: a prompt's full blocks are published with the keys a router computes from
    its tokens; prompts that overflow the pool evict them (BlockRemoved names the same keys); resetting the prefix
    cache with nothing running is AllBlocksCleared."""
    llm = LLM("m3-tiny", optimizations=engine_opts(), num_gpu_blocks_override=12, max_model_len=160)
    engine = llm.engine
    port = free_port()
    root = none_hash("7")
    publisher = kv_events.ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True,
                                                           endpoint=f"tcp://*:{port}"))
    engine.add_observer(kv_events.KVEventRecorder(publisher, engine.block_size, root=root))
    sub = Subscriber(port)
    try:
        time.sleep(0.3)  # PUB/SUB: a subscriber misses what is sent before its subscription arrives
        import random

        rng = random.Random(0)
        bs = engine.block_size
        first = random_tokens(rng, 5 * bs + 3)
        llm.generate([{"prompt_token_ids": first}], SamplingParams(max_tokens=2, temperature=0))
        events = sub.receive(lambda ev: sum(len(e.block_hashes) for e in stored(ev)) >= 5)
        want = prompt_keys(first, bs, root=root)
        got = [h for e in stored(events) for h in e.block_hashes]
        assert got[:5] == want and events[0].parent_block_hash is None and events[0].block_size == bs
        assert [t for e in stored(events) for t in e.token_ids][:5 * bs] == first[:5 * bs]
        check_chained(stored(events))

        # 3 more prompts of 5+ blocks in a pool of 12: the first prompt's blocks are evicted
        for _ in range(3):
            llm.generate([{"prompt_token_ids": random_tokens(rng, 5 * bs + 1)}],
                         SamplingParams(max_tokens=1, temperature=0))
        events = sub.receive(lambda ev: set(want) <= {h for e in ev if isinstance(e, BlockRemoved)
                                                       for h in e.block_hashes})
        check_chained(stored(events))
        published = {h for e in stored(events) for h in e.block_hashes}
        removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
        assert set(removed) <= published and len(removed) == len(set(removed))

        engine.block_manager.reset_prefix_cache()  # nothing running: the whole cache goes
        events = sub.receive(lambda ev: isinstance(ev[-1], AllBlocksCleared))
        assert not engine.block_manager.cached
        seqs = [s for s, _, _ in sub.batches]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # one sequence number per batch, in order
    finally:
        sub.close()
        publisher.shutdown()


# -- a server process ------------------------------------------------------------------------------------------------
SYSTEM = "You are a careful assistant. " * 40


@pytest.fixture(scope="module")
def events_server(tmp_path_factory):
    port, replay = free_port(), free_port()
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}",
              "replay_endpoint": f"tcp://*:{replay}", "topic": "kv@replica0"}
    log = tmp_path_factory.mktemp("kv-events") / "server.log"
    with ServerProcess("m3-mini", log, "--max-model-len", "2048", "--kv-events-config", json.dumps(config),
                       name="m3-mini", env={"PYTHONHASHSEED": "0"}) as server:
        server.event_port, server.replay_port = port, replay
        yield server


def chat_tokens(server, messages) -> list[int]:
    """The prompt the server builds for a chat, from its own /tokenize (the route vllm-router asks, too)."""
    body = {"model": "m3-mini", "messages": messages, "add_generation_prompt": True}
    return httpx.post(f"{server.url}/tokenize", json=body, timeout=30).json()["tokens"]


def test_server_publishes_the_blocks_of_a_chat(events_server):
    """A real subscriber on the server's endpoint: the chat's full prompt blocks arrive as BlockStored, with the
    prompt's tokens and the keys computed from them (PYTHONHASHSEED=0); a late subscriber gets the same batches
    from the replay socket, sequence numbers and all."""
    sub = Subscriber(events_server.event_port, events_server.replay_port, topic="kv@replica0")
    try:
        time.sleep(0.3)
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Say one thing."}]
        tokens = chat_tokens(events_server, messages)
        resp = httpx.post(f"{events_server.url}/v1/chat/completions", timeout=60,
                          json={"model": "m3-mini", "messages": messages, "max_tokens": 3, "temperature": 0})
        assert resp.status_code == 200, resp.text
        bs = 64
        want = prompt_keys(tokens, bs, root=none_hash("0"))
        assert len(want) >= 4
        events = sub.receive(lambda ev: len([h for e in stored(ev) for h in e.block_hashes]) >= len(want))
        got = stored(events)
        assert [h for e in got for h in e.block_hashes][:len(want)] == want
        assert [t for e in got for t in e.token_ids][:len(want) * bs] == tokens[:len(want) * bs]
        assert got[0].parent_block_hash is None and got[0].block_size == bs and got[0].medium == "GPU"
        check_chained(got)

        replayed = sub.replay(0)
        assert [s for s, _ in replayed][:1] == [0]
        assert [s for s, _ in replayed] == list(range(len(replayed)))
        live = {s: p for s, _, p in sub.batches}
        assert all(live[s] == p for s, p in replayed if s in live)  # the same payloads, byte for byte
        late = [e for _, p in replayed for e in DECODER.decode(p).events]
        assert [h for e in stored(late) for h in e.block_hashes][:len(want)] == want
        last = replayed[-1][0]
        assert sub.replay(last) == replayed[-1:]  # from a later sequence number: only what follows it
    finally:
        sub.close()


def test_server_rejects_a_bad_kv_events_config(capsys):
    """A misspelt key stops the start with a message naming it, as vLLM's config check does (the server's
    argument parser, before anything loads)."""
    from nanoserve.server.__main__ import build_parser

    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args(["--kv-events-config", '{"enable_kv_cache_events": true, "endpont": "tcp://*:1"}'])
    assert stop.value.code == 2 and "unknown keys ['endpont']" in capsys.readouterr().err
    args = build_parser().parse_args(["--kv-events-config", '{"enable_kv_cache_events": true}'])
    assert args.kv_events_config == {"enable_kv_cache_events": True}
