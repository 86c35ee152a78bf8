"""The whole engine on m3-tiny (CPU, reference kernels): batching, preemption, chunking and prefix caching must
not change a single greedy token; prefix caching must really skip work; aborts and bad inputs are handled.

The "each prompt alone" oracle runs with every switch off and a KV pool large enough for anything, so it shares
nothing with the batched runs but the model.
"""

from __future__ import annotations

import random
import re
from collections import Counter

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.presets.tokenizer import BOS_ID
from tests.helpers.engine_utils import assert_all_blocks_free, engine_opts, random_tokens

LAYER_SWITCHES = ("paged_kv", "prefix_caching", "continuous_batching", "chunked_prefill")
MAX_MODEL_LEN = 192
SMALL_POOL_BLOCKS = 24  # 384 tokens for a batch of ~630 prompt tokens: forces preemption
SMALL_BUDGET = 64  # tokens per step: forces chunked prefill of every prompt over 64 tokens
OFF_POOL_BLOCKS = 48  # with paged KV off each sequence reserves max_model_len (12 blocks): 4 run at once


def mixed_prompts() -> list[list[int]]:
    """Different lengths; four share a 70-token prefix (four full 16-token blocks), one is long."""
    rng = random.Random(1234)
    prefix = random_tokens(rng, 70)
    shared = [prefix + random_tokens(rng, n) for n in (5, 17, 30, 1)]
    others = [random_tokens(rng, n) for n in (12, 45, 150, 90)]
    return [shared[0], others[0], shared[1], others[1], others[2], shared[2], others[3], shared[3]]


MIXED_PARAMS = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (20, 6, 12, 16, 10, 20, 4, 14)]


@pytest.fixture(scope="module")
def ref_llm() -> LLM:
    return LLM("m3-tiny", optimizations=engine_opts(**{s: False for s in LAYER_SWITCHES}), kv_cache_tokens=4096,
               max_model_len=512)


@pytest.fixture(scope="module")
def llm() -> LLM:
    """Every switch of this layer on, with a pool and a budget small enough to preempt and chunk."""
    return LLM("m3-tiny", optimizations=engine_opts(), num_gpu_blocks_override=SMALL_POOL_BLOCKS,
               max_num_batched_tokens=SMALL_BUDGET, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def expected(ref_llm) -> list[list[int]]:
    """Greedy tokens of each mixed prompt, run alone."""
    return [ref_llm.generate({"prompt_token_ids": p}, sp, use_tqdm=False)[0].outputs[0].token_ids
            for p, sp in zip(mixed_prompts(), MIXED_PARAMS)]


def generate_tokens(llm: LLM, prompts: list[list[int]], params) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_mixed_batch_with_preemption_and_chunking_matches_each_prompt_alone(llm, expected):
    engine = llm.engine
    events: Counter[str] = Counter()

    def count(name: str, **payload) -> None:
        events[name] += 1

    engine.add_observer(count)
    preemptions, hits = engine.stats.num_preemptions, engine.stats.prefix_cache_hits
    got = generate_tokens(llm, mixed_prompts(), MIXED_PARAMS)
    engine.observers.remove(count)
    assert engine.stats.num_preemptions > preemptions, "the pool was meant to be small enough to preempt"
    assert events["preempt"] == engine.stats.num_preemptions - preemptions
    assert events["chunk"] > 0, "the budget was meant to be small enough to chunk"
    assert engine.stats.prefix_cache_hits > hits, "the shared prefix was meant to hit the cache"
    assert got == expected
    assert [len(t) for t in got] == [sp.max_tokens for sp in MIXED_PARAMS]
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("off", [*LAYER_SWITCHES, "all"])
def test_mixed_batch_matches_with_switches_off(off, expected):
    switches = {s: False for s in LAYER_SWITCHES} if off == "all" else {off: False}
    chunked = switches.get("chunked_prefill", True)
    llm = LLM("m3-tiny", optimizations=engine_opts(**switches), num_gpu_blocks_override=OFF_POOL_BLOCKS,
              # without chunked prefill a whole prompt must fit one step
              max_num_batched_tokens=SMALL_BUDGET if chunked else MAX_MODEL_LEN, max_model_len=MAX_MODEL_LEN)
    assert generate_tokens(llm, mixed_prompts(), MIXED_PARAMS) == expected
    if not switches.get("prefix_caching", True):
        assert llm.engine.stats.prefix_cache_hits == 0
    assert_all_blocks_free(llm)


def test_cache_salt_keeps_prefix_caches_apart(llm, ref_llm):
    """A prompt dict's cache_salt (vLLM's): the same prompt under another salt recomputes its prefix, under the
    same salt hits it; the tokens are the same either way. An empty salt is a ValueError naming it."""
    llm.engine.block_manager.reset_prefix_cache()
    prompt = random_tokens(random.Random(11), 70)
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)

    def run(salt):
        return llm.generate({"prompt_token_ids": prompt, "cache_salt": salt}, sp, use_tqdm=False)[0]

    first = run("a")
    other, same = run("b"), run("a")
    assert (first.num_cached_tokens, other.num_cached_tokens) == (0, 0) and same.num_cached_tokens == 64
    assert first.outputs[0].token_ids == other.outputs[0].token_ids == same.outputs[0].token_ids == \
        generate_tokens(ref_llm, [prompt], sp)[0]
    with pytest.raises(ValueError, match="cache_salt"):
        run("")
    assert_all_blocks_free(llm)


def test_priority_policy_serves_lower_priority_values_first():
    """scheduling_policy="priority" with one sequence at a time: requests finish in priority order whatever the
    order they came in, and their tokens are the ones they get alone. Under first come, first served any priority
    but 0 is a ValueError naming it."""
    llm = LLM("m3-tiny", optimizations=engine_opts(), max_model_len=MAX_MODEL_LEN, max_num_seqs=1,
              scheduling_policy="priority")
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    prompts = [[BOS_ID, 10 + i, 20 + i] for i in range(4)]
    alone = [llm.generate({"prompt_token_ids": p}, sp, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    engine, finished = llm.engine, []
    for i, (prompt, priority) in enumerate(zip(prompts, [3, -1, 3, 0])):
        engine.add_request(f"p{i}", {"prompt_token_ids": prompt}, sp, priority=priority)
    while engine.has_unfinished_requests():
        finished += [(o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished]
    assert [rid for rid, _ in finished] == ["p1", "p3", "p0", "p2"]
    assert dict(finished) == {f"p{i}": alone[i] for i in range(4)}
    with pytest.raises(ValueError, match="priority"):
        LLM("m3-tiny", optimizations=engine_opts(), max_model_len=MAX_MODEL_LEN).generate(
            prompts[:1], sp, use_tqdm=False, priority=[1])


def test_prefix_caching_skips_the_shared_prefix(llm, ref_llm):
    engine, stats = llm.engine, llm.engine.stats
    engine.block_manager.reset_prefix_cache()
    rng = random.Random(7)
    prefix = random_tokens(rng, 64)
    first, second = prefix + random_tokens(rng, 10), prefix + random_tokens(rng, 12)
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    before = stats.num_computed_prefill_tokens
    llm.generate({"prompt_token_ids": first}, sp, use_tqdm=False)
    assert stats.num_computed_prefill_tokens - before == len(first)

    before, hits = stats.num_computed_prefill_tokens, stats.prefix_cache_hits
    out = llm.generate({"prompt_token_ids": second}, sp, use_tqdm=False)[0]
    assert stats.prefix_cache_hits - hits == 64 and out.num_cached_tokens == 64
    assert stats.num_computed_prefill_tokens - before == len(second) - 64
    assert out.outputs[0].token_ids == generate_tokens(ref_llm, [second], sp)[0]

    # the same prompt again: every full block is cached, but the last token is computed for its logits - so a
    # prompt of whole blocks recomputes its last block
    for repeated, cached in [(prefix + [prefix[0]], 64), (prefix, 48)]:  # 4 full blocks + 1 token; 4 full blocks
        llm.generate({"prompt_token_ids": repeated}, sp, use_tqdm=False)
        before = stats.num_computed_prefill_tokens
        again = llm.generate({"prompt_token_ids": repeated}, sp, use_tqdm=False)[0]
        assert again.num_cached_tokens == cached
        assert stats.num_computed_prefill_tokens - before == len(repeated) - cached
        assert again.outputs[0].token_ids == generate_tokens(ref_llm, [repeated], sp)[0]
    assert_all_blocks_free(llm)


def test_abort_mid_run_frees_blocks(llm, ref_llm):
    engine = llm.engine
    aborted_before = engine.stats.num_aborted
    rng = random.Random(3)
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    short, long, kept = random_tokens(rng, 10), random_tokens(rng, 150), random_tokens(rng, 20)
    engine.add_request("decoding", short, sp)
    engine.add_request("prefilling", long, sp)
    engine.add_request("kept", kept, sp)
    engine.add_request("waiting", random_tokens(rng, 30), sp)
    engine.abort_request("waiting")  # never scheduled
    engine.step()
    engine.step()
    seqs = {rid: state.seqs[0] for rid, state in engine.requests.items()}
    assert seqs["decoding"].output_token_ids and not seqs["decoding"].is_finished
    assert 0 < seqs["prefilling"].num_computed_tokens < len(long)
    engine.abort_request(["prefilling", "decoding"])
    engine.block_manager.check_integrity()
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert list(finished) == ["kept"]
    assert finished["kept"].outputs[0].token_ids == generate_tokens(ref_llm, [kept], sp)[0]
    assert all(s.finish_reason.value == "abort" for s in (seqs["prefilling"], seqs["decoding"]))
    engine.abort_request(["no-such-request", "decoding"])  # unknown or finished ids are ignored
    assert engine.stats.num_aborted == aborted_before + 3
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("prompt, words", [
    ("", ["prompt", "empty"]),
    ({"prompt_token_ids": []}, ["prompt", "empty"]),
    ([10] * 300, ["300", str(MAX_MODEL_LEN), "max_model_len"]),
    ([10] * MAX_MODEL_LEN, [str(MAX_MODEL_LEN), "max_model_len"]),
    ([10, 512], ["prompt_token_ids", "512"]),
    ([10, -1], ["prompt_token_ids"]),
    ({"text": "hi"}, ["prompt"]),
    (3.5, ["prompt"]),
])
def test_bad_prompt_raises_naming_the_field(llm, prompt, words):
    with pytest.raises(ValueError) as err:
        llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
    for w in words:
        assert w in str(err.value)
    assert_all_blocks_free(llm)


def test_bad_sampling_params_are_rejected_by_the_engine(llm):
    sp = SamplingParams(max_tokens=2)
    sp.top_p = 0.0  # changed after construction: the engine validates again
    with pytest.raises(ValueError, match="top_p"):
        llm.generate([10, 11], sp, use_tqdm=False)
    with pytest.raises(ValueError, match="logprobs"):
        llm.engine.add_request("x", [10, 11], SamplingParams(logprobs=21))
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate([[10, 11], [12, 13]], [SamplingParams()] * 3, use_tqdm=False)
    assert_all_blocks_free(llm)


def test_a_failing_batch_leaves_no_request_behind(llm):
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[10, 11, 12], ""], SamplingParams(max_tokens=2), use_tqdm=False)
    assert_all_blocks_free(llm)


def test_generation_stops_at_max_model_len(llm):
    out = llm.generate([10] * (MAX_MODEL_LEN - 3), SamplingParams(max_tokens=None, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"
    assert_all_blocks_free(llm)


def test_duplicate_request_id(llm):
    engine = llm.engine
    engine.add_request("dup", [10, 11], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("dup", [12, 13], SamplingParams(max_tokens=2))
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert [o.prompt_token_ids for o in outs] == [[10, 11]]
    assert_all_blocks_free(llm)


def test_n_completions(llm):
    prompt = {"prompt_token_ids": random_tokens(random.Random(5), 20)}
    out = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3, "seeded completions of one request must differ"
    greedy = llm.generate(prompt, SamplingParams(n=2, temperature=0.0, max_tokens=8, ignore_eos=True),
                          use_tqdm=False)[0]
    assert len(greedy.outputs) == 2 and greedy.outputs[0].token_ids == greedy.outputs[1].token_ids
    assert_all_blocks_free(llm)


def test_text_prompt_and_output_text(llm):
    tok = llm.get_tokenizer()
    out = llm.generate("The engine schedules", SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.prompt == "The engine schedules"
    assert out.prompt_token_ids == tok.encode("The engine schedules", add_special_tokens=False)
    # a random model's bytes need not end on a character boundary: a character left unfinished when the length
    # limit ends the output comes out at the end as U+FFFD (vLLM's flush), so the text is what its tokens decode to
    full = tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)
    assert out.outputs[0].text == full and out.outputs[0].text


def test_chat_renders_the_template(llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    assert out.prompt_token_ids[0] == BOS_ID
    prompt = tok.decode(out.prompt_token_ids, skip_special_tokens=False)
    assert prompt.startswith("]~!b[]~b]system\n")  # M3's format: a system turn, then the client's system message
    assert prompt.endswith("]~b]developer\nBe brief.[e~[\n]~b]user\nHello[e~[\n]~b]ai\n")
    two = llm.chat([messages, messages[1:]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(two) == 2 and two[0].prompt_token_ids == out.prompt_token_ids
    assert tok.decode(two[1].prompt_token_ids, skip_special_tokens=False).endswith(  # no system message: the default
        "]~b]developer\nYou are a helpful assistant.[e~[\n]~b]user\nHello[e~[\n]~b]ai\n")
    with pytest.raises(ValueError, match="messages"):
        llm.chat([], use_tqdm=False)


@pytest.fixture(scope="module")
def chat_llm() -> LLM:
    return LLM("m3-tiny", optimizations=engine_opts(), max_model_len=1024)  # a prompt with tools is ~600 tokens


def test_chat_takes_tools_template_kwargs_and_continuation(chat_llm):
    """LLM.chat as vLLM's: tools go into the prompt as the template writes them (the server's rendering), the
    template variables and continue_final_message apply, a template string replaces the model's, and it generates."""
    from nanoserve.chat_template import render_chat, template_messages

    tok = chat_llm.get_tokenizer()
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    out = chat_llm.chat(messages, params, use_tqdm=False, tools=tools,
                   chat_template_kwargs={"thinking_mode": "enabled"})[0]
    prompt = tok.decode(out.prompt_token_ids, skip_special_tokens=False)
    assert out.prompt_token_ids == tok.encode(render_chat(tok, template_messages(messages), tools=tools,
                                                          chat_template_kwargs={"thinking_mode": "enabled"}),
                                              add_special_tokens=False)
    assert "# Tools" in prompt and '"name": "get_weather"' in prompt and prompt.endswith("]~b]ai\n<mm:think>")
    assert len(out.outputs[0].token_ids) == 5
    plain = chat_llm.chat(messages, params, use_tqdm=False)[0]
    assert "get_weather" not in tok.decode(plain.prompt_token_ids, skip_special_tokens=False)
    cont = chat_llm.chat(messages + [{"role": "assistant", "content": "It is"}], params, use_tqdm=False,
                    add_generation_prompt=False, continue_final_message=True)[0]
    assert tok.decode(cont.prompt_token_ids, skip_special_tokens=False).endswith("It is")
    own = chat_llm.chat(messages, params, use_tqdm=False,
                   chat_template="{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")[0]
    assert tok.decode(own.prompt_token_ids, skip_special_tokens=False) == "<user>Weather in Oslo?"
    with pytest.raises(ValueError, match=r"tools\[0\].function.name"):
        chat_llm.chat(messages, params, use_tqdm=False, tools=[{"type": "function", "function": {}}])
    with pytest.raises(ValueError, match="continue_final_message"):
        chat_llm.chat(messages, params, use_tqdm=False, continue_final_message=True)


def test_progress_bar_shows_prefill_and_decode_rates(llm, capsys):
    rng = random.Random(9)
    llm.generate([{"prompt_token_ids": random_tokens(rng, 40)} for _ in range(3)],
                 SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    err = capsys.readouterr().err
    final = err.replace("\r", "\n").strip().splitlines()[-1]
    assert "Processed prompts" in final and "3/3" in final
    rates = re.search(r"prefill ([\d,]+) tok/s, decode ([\d,]+) tok/s", final)
    assert rates and all(int(r.replace(",", "")) > 0 for r in rates.groups()), final


def test_failed_engine_construction_releases_its_executor(tiny_dir, monkeypatch):
    """A bad limit found after the model is built (here a KV pool smaller than max_model_len) raises a ValueError
    naming the problem and shuts the executor down (TP workers and device memory are not left behind)."""
    from nanoserve import EngineConfig, LLMEngine
    from nanoserve.executor import local as executor_mod

    shut = []
    real = executor_mod.LocalExecutor.shutdown
    monkeypatch.setattr(executor_mod.LocalExecutor, "shutdown", lambda self: (shut.append(True), real(self)))
    with pytest.raises(ValueError, match="fewer than max_model_len"):
        LLMEngine(EngineConfig.from_kwargs(model=tiny_dir, max_model_len=512, num_gpu_blocks_override=4,
                                           optimizations=engine_opts()))
    assert shut == [True]


def test_block_size_is_the_models_msa_block_size():
    """The KV block size is derived once (runner/kv_cache.py) and handed down: the block manager and the engine's
    limits use the executor's; a block_size asking for another is refused, naming both."""
    with LLM("m3-tiny", optimizations=engine_opts(), max_model_len=64, block_size=16) as llm:
        assert llm.engine.block_size == llm.engine.block_manager.block_size == llm.engine.executor.block_size == 16
    with pytest.raises(ValueError, match=r"block_size=32 is invalid: it must equal the model's MSA block size \(16\)"):
        LLM("m3-tiny", optimizations=engine_opts(), max_model_len=64, block_size=32)
