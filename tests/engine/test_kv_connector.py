"""Prefill/decode disaggregation in the engine (engine/kv_connector.py), two m3-tiny engines in this process: a
prefill engine (kv_producer) and a decode engine (kv_consumer), their KV blocks moved by NIXL over TCP on loopback.

A request with do_remote_decode on the prefill engine runs with max_tokens 1, keeps its prompt's blocks and names
them in its output's kv_transfer_params; the same request with those parameters on the decode engine pulls the
blocks its prefix cache lacks, computes the last prompt token only and decodes - greedy, exactly what one engine
gives - with pools in the model dtype and in fp8 (K/V and MSA index keys move as stored). Held too: the prefill
engine's blocks stay shareable while held and all come back once pulled, or at the abort timeout when nobody pulls
them; a full local hit pulls nothing and frees the source's blocks at once; a pull that fails (pools of another
layout) fails the request, or with kv_load_failure_policy "recompute" has it computed locally; an abort while
waiting frees the blocks; what a connector cannot serve is refused by name. The block pools' invariants are
checked after each test.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

import pytest

from nanoserve.config import EngineConfig
from nanoserve.engine.kv_connector import check_supported
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.outputs import RequestOutput
from nanoserve.kv_transfer.config import KVTransferConfig
from nanoserve.sampling import SamplingParams
from tests.helpers.server_utils import engine_config, free_port

ABORT_TIMEOUT_S = 2.0
GREEDY = SamplingParams(temperature=0, max_tokens=6)
BLOCK = 16  # m3-tiny's KV block


@contextlib.contextmanager
def environ(**values: str):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def engine(name: str, role: str, **overrides) -> LLMEngine:
    config = {"kv_connector": "NixlConnector", "kv_role": role, "engine_id": name,
              "kv_load_failure_policy": overrides.pop("policy", "fail")}
    with environ(UCX_TLS="tcp", VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1", VLLM_NIXL_SIDE_CHANNEL_PORT=str(free_port()),
                 VLLM_NIXL_ABORT_REQUEST_TIMEOUT=str(ABORT_TIMEOUT_S)):
        return LLMEngine(engine_config("m3-tiny", kv_transfer_config=config, **overrides))


@pytest.fixture(scope="module")
def engines():
    """Prefill engines with pools in the model dtype and in fp8 (kv_cache_dtype); a decode engine of each, the
    first failing a request whose pull fails, the fp8 one computing it locally instead."""
    built = {"prefill": engine("prefill", "kv_producer"), "decode": engine("decode", "kv_consumer"),
             "prefill8": engine("prefill8", "kv_producer", kv_cache_dtype="fp8"),
             "decode8": engine("decode8", "kv_consumer", kv_cache_dtype="fp8", policy="recompute")}
    yield built
    for e in built.values():
        e.shutdown()


@pytest.fixture(autouse=True)
def sound_pools(engines):
    """After each test: nothing held or loading, every block back in the free list, the pools' invariants."""
    yield
    for e in engines.values():
        drain(e)
        assert not e.kv_connector.busy and not e.has_unfinished_requests()
        e.block_manager.check_integrity()
        assert e.block_manager.num_free_blocks == e.block_manager.num_blocks


def run(e: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams = GREEDY,
        kv: dict | None = None) -> RequestOutput:
    """Add a request and step until it finishes (sleeping while only KV transfers are under way)."""
    e.add_request(request_id, {"prompt_token_ids": prompt}, params, kv_transfer_params=kv)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for out in e.step():
            if out.request_id == request_id and out.finished:
                return out
        time.sleep(e.kv_transfer_wait() or 0)
    raise AssertionError(f"{request_id} did not finish")


def drain(e: LLMEngine, timeout: float = 10) -> None:
    """Step until the engine's transfers are over (held blocks pulled or timed out)."""
    deadline = time.monotonic() + timeout
    while e.kv_connector.busy or e.has_unfinished_requests():
        assert time.monotonic() < deadline, "transfers still under way"
        e.step()
        time.sleep(e.kv_transfer_wait() or 0)


def prompt(length: int, start: int = 5) -> list[int]:
    return [start + (i * 7) % 300 for i in range(length)]


def pd(prefill: LLMEngine, decode: LLMEngine, request_id: str, ids: list[int],
       params: SamplingParams = GREEDY) -> tuple[RequestOutput, RequestOutput]:
    first = run(prefill, f"{request_id}-p", ids, params, kv={"do_remote_decode": True})
    return first, run(decode, f"{request_id}-d", ids, params, kv=first.kv_transfer_params)


@pytest.mark.parametrize("pools", ["auto", "fp8"])
def test_pd_gives_one_engines_answers(engines, pools):
    """Prompts of 1, 2 + a partial, exactly 3 and 5 + a partial blocks; the last one twice, so that the decode
    engine holds its first blocks in its prefix cache and pulls only the rest. (m3-tiny's random weights leave
    near-ties between logits: these prompts are ones whose greedy answer one engine gives the same with or
    without a prefix-cache hit, as the transfer's must be.)"""
    prefill, decode = (engines["prefill"], engines["decode"]) if pools == "auto" else \
        (engines["prefill8"], engines["decode8"])
    before = decode.stats.prompt_tokens_external_kv_transfer
    for i, ids in enumerate([prompt(9), prompt(40, 11), prompt(3 * BLOCK, 13), prompt(90, 19), prompt(90, 19)]):
        alone = run(prefill, f"alone-{pools}-{i}", ids)
        first, out = pd(prefill, decode, f"{pools}-{i}", ids)
        assert first.outputs[0].finish_reason == "length" and len(first.outputs[0].token_ids) == 1
        params = first.kv_transfer_params
        assert params["remote_engine_id"] == prefill.kv_transfer.engine_id and params["do_remote_prefill"]
        assert len(params["remote_block_ids"][0]) == -(-len(ids) // BLOCK)  # every block of the prompt
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids, (pools, i)
        assert out.num_cached_tokens == len(ids) - 1 and out.kv_transfer_params is None
    # each prompt's KV but its last token's came from the transfer, and for the repeated one the first 5 blocks
    # from the decode engine's own prefix cache
    assert decode.stats.prompt_tokens_external_kv_transfer - before == 8 + 39 + 47 + 89 + (89 - 80)


def test_the_decode_engine_computes_one_prompt_token_per_request(engines):
    prefill, decode = engines["prefill"], engines["decode"]
    s = decode.stats
    before = (s.prompt_tokens_local_compute, s.prompt_tokens_local_cache_hit, s.prompt_tokens_external_kv_transfer,
              s.num_computed_prefill_tokens)
    pd(prefill, decode, "count-a", prompt(70, 23))
    pd(prefill, decode, "count-b", prompt(70, 23)[:64] + prompt(10, 200))  # the first 4 blocks are cached here
    moved = [a - b for a, b in zip((s.prompt_tokens_local_compute, s.prompt_tokens_local_cache_hit,
                                    s.prompt_tokens_external_kv_transfer, s.num_computed_prefill_tokens), before)]
    assert moved == [2, 64, 69 + 73 - 64, 2], moved  # (local compute, cache hit, pulled, prefill tokens run)


def test_held_blocks_stay_shareable_and_come_back_once_pulled(engines):
    prefill, decode = engines["prefill"], engines["decode"]
    ids = prompt(50, 29)
    first = run(prefill, "held", ids, kv={"do_remote_decode": True})
    bm = prefill.block_manager
    held = first.kv_transfer_params["remote_block_ids"][0]
    assert bm.num_free_blocks == bm.num_blocks - len(held)
    again = run(prefill, "sharer", ids)  # the same prompt meanwhile: its full blocks are hits
    assert again.num_cached_tokens == 3 * BLOCK
    bm.check_integrity()
    run(decode, "held-d", ids, kv=first.kv_transfer_params)
    drain(prefill, timeout=ABORT_TIMEOUT_S / 2)  # pulled: freed well before the timeout
    assert bm.num_free_blocks == bm.num_blocks


def test_unpulled_blocks_are_freed_at_the_timeout(engines):
    prefill = engines["prefill"]
    run(prefill, "abandoned", prompt(40, 31), kv={"do_remote_decode": True})
    t0 = time.monotonic()
    assert prefill.kv_connector.busy and prefill.kv_transfer_wait() is not None  # (the loop polls meanwhile)
    drain(prefill)
    assert time.monotonic() - t0 > ABORT_TIMEOUT_S / 2


def test_a_full_local_hit_pulls_nothing_and_frees_the_source_at_once(engines):
    prefill, decode = engines["prefill"], engines["decode"]
    ids = prompt(2 * BLOCK + 1, 37)  # two full blocks and the last token, which is computed anyway
    pd(prefill, decode, "hit-1", ids)
    drain(prefill)
    before = decode.stats.prompt_tokens_external_kv_transfer
    first, out = pd(prefill, decode, "hit-2", ids)
    assert out.num_cached_tokens == 2 * BLOCK and decode.stats.prompt_tokens_external_kv_transfer == before
    drain(prefill, timeout=ABORT_TIMEOUT_S / 2)  # told at once: no timeout


def test_a_failed_pull_fails_the_request_or_computes_it_locally(engines, caplog):
    """Pools of another layout (fp8 there, the model dtype here) are refused at connect, naming the pool; under
    kv_load_failure_policy "fail" the request ends with an error, under "recompute" it is computed here."""
    ids = prompt(30, 41)
    first = run(engines["prefill8"], "mismatch-p", ids, kv={"do_remote_decode": True})
    with caplog.at_level(logging.WARNING, logger="nanoserve.engine.kv_connector"):
        failed = run(engines["decode"], "mismatch-d", ids, kv=first.kv_transfer_params)
    assert failed.outputs[0].finish_reason == "error" and not failed.outputs[0].token_ids
    assert "cannot send its KV blocks here: pool 0: blocks of [2, 16, 4, 32] float8_e4m3fn" in caplog.text
    first = run(engines["prefill"], "mismatch-p2", ids, kv={"do_remote_decode": True})
    local = run(engines["decode8"], "mismatch-d2", ids, kv=first.kv_transfer_params)
    assert local.outputs[0].token_ids == run(engines["prefill8"], "mismatch-alone", ids).outputs[0].token_ids
    assert local.num_cached_tokens == 0


def test_an_abort_while_waiting_for_the_kv_frees_the_blocks(engines):
    prefill, decode = engines["prefill"], engines["decode"]
    ids = prompt(60, 43)
    for when in ("before the pull", "once it started"):
        first = run(prefill, f"abort-p-{when}", ids, kv={"do_remote_decode": True})
        decode.add_request(f"abort-d-{when}", {"prompt_token_ids": ids}, GREEDY,
                           kv_transfer_params=first.kv_transfer_params)
        decode.step()  # admitted: its blocks are allocated, the pull starts at the next schedule
        assert decode.scheduler.loading and decode.block_manager.num_free_blocks < decode.block_manager.num_blocks
        if when == "once it started":
            decode.step()
        decode.abort_request(f"abort-d-{when}")
        assert not decode.scheduler.loading


def test_what_a_connector_cannot_serve_is_refused_by_name(engines):
    prefill, decode = engines["prefill"], engines["decode"]
    remote = {"do_remote_prefill": True, "remote_engine_id": "prefill", "remote_request_id": "r",
              "remote_block_ids": [[1]], "remote_host": "127.0.0.1", "remote_port": 5600}
    cases = [(decode, {"do_remote_decode": True}, GREEDY, "do_remote_decode needs kv_role kv_producer"),
             (prefill, remote, GREEDY, "do_remote_prefill needs kv_role kv_consumer"),
             (prefill, {"do_remote_decode": True}, SamplingParams(n=2, temperature=0), "only with n 1"),
             (decode, remote, SamplingParams(prompt_logprobs=1), "cannot give prompt_logprobs"),
             (decode, {**remote, "remote_port": "5600"}, GREEDY, "kv_transfer_params.remote_port")]
    for e, kv, params, message in cases:
        with pytest.raises(ValueError, match=message):
            e.add_request("refused", {"prompt_token_ids": prompt(5)}, params, kv_transfer_params=kv)
    connector = KVTransferConfig.from_dict({"kv_connector": "NixlConnector", "kv_role": "kv_both"})
    with pytest.raises(ValueError, match="tensor_parallel_size 1 only"):
        check_supported(EngineConfig.from_kwargs(model="m3-tiny", tensor_parallel_size=2), connector)
    check_supported(EngineConfig.from_kwargs(  # a draft model's pools move with the target's (the test below)
        model="m3-tiny", speculative_config={"method": "mtp", "num_speculative_tokens": 1}), connector)


def test_pd_with_mtp_drafts_as_one_engine_does():
    """m3-mini with MTP k=3 on both sides: the decode engine's answers, its verify steps and its accepted drafts are
    one engine's exactly - the MTP layer's KV of the prompt came with the target's (without it, on these chats, the
    decode engine needed 24 and 16 verify steps instead of 19 and 13, and accepted 35 and 19 drafts, not 40 and
    21). The prefill engine runs the same speculative config: the pools' layouts must match."""
    from nanoserve.chat_template import render_chat

    spec = {"method": "mtp", "num_speculative_tokens": 3}

    def build(name: str, role: str) -> LLMEngine:
        config = {"kv_connector": "NixlConnector", "kv_role": role, "engine_id": name}
        with environ(UCX_TLS="tcp", VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
                     VLLM_NIXL_SIDE_CHANNEL_PORT=str(free_port()), VLLM_NIXL_ABORT_REQUEST_TIMEOUT="10"):
            return LLMEngine(engine_config("m3-mini", kv_transfer_config=config, speculative_config=spec))

    built = [build("mtp-single", "kv_both"), build("mtp-prefill", "kv_producer"), build("mtp-decode", "kv_consumer")]
    single, prefill, decode = built
    tok = single.tokenizer
    params = SamplingParams(temperature=0, max_tokens=60)
    try:
        for i, question in enumerate(["What is 348 + 275?", "Hello! Who are you?"]):
            ids = tok.encode(render_chat(tok, [{"role": "user", "content": question}]), add_special_tokens=False)
            before = [(e.stats.spec_decode_num_drafts, e.stats.spec_decode_num_accepted_tokens) for e in built]
            alone = run(single, f"mtp-alone-{i}", ids, params)
            first, out = pd(prefill, decode, f"mtp-{i}", ids, params)
            after = [(e.stats.spec_decode_num_drafts, e.stats.spec_decode_num_accepted_tokens) for e in built]
            steps = [(a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before)]
            assert out.outputs[0].token_ids == alone.outputs[0].token_ids and out.num_cached_tokens == len(ids) - 1
            assert steps[2] == steps[0] and steps[0][1] > 0, steps  # the same drafts, the same acceptance
        for e in built:
            drain(e)
            e.block_manager.check_integrity()
            assert e.block_manager.num_free_blocks == e.block_manager.num_blocks
    finally:
        for e in built:
            e.shutdown()


def test_an_engine_without_a_connector_refuses_the_params():
    e = LLMEngine(engine_config("m3-tiny"))
    try:
        with pytest.raises(ValueError, match="kv_transfer_params: this server transfers no KV"):
            e.add_request("r", {"prompt_token_ids": prompt(5)}, GREEDY, kv_transfer_params={"do_remote_decode": True})
        e.add_request("plain", {"prompt_token_ids": prompt(5)}, GREEDY,  # both false: a plain request
                      kv_transfer_params={"do_remote_decode": False, "do_remote_prefill": False})
    finally:
        e.shutdown()
