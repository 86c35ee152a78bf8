"""Images through the engine on m3-tiny-vl (m3-tiny with a tiny random vision tower), on the CPU: the encoder runs
with the prefill and its features land on the placeholders (logprobs against transformers' whole model, with the
image's placeholder run split across chunks), the encoder cache (an image sent again is not encoded again; switch
encoder_cache against its reference), the prefix cache keyed by the image's content, the encoder budget cutting a
chunk before an image, and preemption and aborts leaving the encoder cache's books clean."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.encoder_cache import EncoderCacheManager
from nanoserve.engine.scheduler import Scheduler, SchedulerConfig
from nanoserve.engine.sequence import Sequence
from nanoserve.step import MultiModalFeature
from tests.helpers.engine_utils import assert_all_blocks_free, engine_opts
from tests.helpers.images import image_tokens, png

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def image_prompt(text: str, *seeds: int, size: tuple[int, int] = (64, 80)) -> dict:
    """A raw prompt: one image marker per seed, then the text."""
    images = [png(s, *size) for s in seeds]
    return {"prompt": "]<]image[>[" * len(seeds) + text, "multi_modal_data": {"image": images}}


def check_clean(llm: LLM) -> None:
    """No block held, no encoder-cache entry in use, and the runner holds what the books say (plus what it will
    drop with the next step)."""
    assert_all_blocks_free(llm)
    books = llm.engine.encoder_cache
    books.check_integrity()
    assert not books.users
    held = set(llm.engine.executor.runner.encoder.cache)
    assert set(books.rows) <= held <= set(books.rows) | set(books.freed)


@pytest.fixture(scope="module")
def llm(tiny_vl_dir):
    with LLM(tiny_vl_dir, optimizations=engine_opts(), max_model_len=512, max_num_batched_tokens=16) as llm:
        yield llm


def test_logprobs_match_transformers_with_the_image_split_across_chunks(llm, tiny_vl_dir):
    """The prompt's every logprob (its image's 20 placeholders computed in two 16-token chunks) against
    transformers' MiniMaxM3SparseForConditionalGeneration on the same checkpoint, pixels and ids."""
    from transformers.models.minimax_m3_vl import MiniMaxM3SparseForConditionalGeneration
    from transformers.utils import logging as hf_logging

    from nanoserve.multimodal.processor import MultiModalProcessor

    prompt = image_prompt("What is in this picture?", 1, size=(120, 140))
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, logprobs=3)
    [out] = llm.generate([prompt], params, use_tqdm=False)
    ids = out.prompt_token_ids
    assert ids.count(llm.engine.vision_config.image_token_id) == image_tokens(120, 140) == 20

    mm = MultiModalProcessor.from_model_dir(tiny_vl_dir)(prompt["prompt"], prompt["multi_modal_data"]["image"],
                                                         tokenizer=llm.get_tokenizer(), add_special_tokens=False)
    assert mm.input_ids == ids
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        hf = MiniMaxM3SparseForConditionalGeneration.from_pretrained(tiny_vl_dir, dtype=torch.float32).eval()
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()
    hf.config.vision_config._attn_implementation = "eager"
    hf.config.text_config._attn_implementation = "eager"
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([ids]), pixel_values=mm.pixel_values,
                    image_grid_thw=mm.image_grid_thw).logits[0]
    want = torch.log_softmax(logits.float(), dim=-1)
    got = [next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]]
    torch.testing.assert_close(torch.tensor(got), want[torch.arange(len(ids) - 1), torch.tensor(ids[1:])],
                               atol=1e-4, rtol=0)
    first = out.outputs[0]
    assert first.token_ids[0] == int(want[-1].argmax())
    assert first.logprobs[0][first.token_ids[0]] == pytest.approx(float(want[-1].max()), abs=1e-4)


def run(llm: LLM, prompts: list[dict]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_an_image_sent_again_is_not_encoded_again_and_the_switch_agrees(llm, tiny_vl_dir):
    # the second prompt's text comes first, so its image is in blocks of another prefix: no prefix-cache hit
    prompts = [image_prompt("Describe it.", 2), {"prompt": "Again: ]<]image[>[ and ]<]image[>[?",
                                                 "multi_modal_data": {"image": [png(2), png(3)]}}]
    stats = llm.engine.stats
    before = (stats.encoder_items, stats.encoder_cache_hits)
    shared = run(llm, prompts)
    assert (stats.encoder_items - before[0], stats.encoder_cache_hits - before[1]) == (2, 1)
    check_clean(llm)
    opts = engine_opts(encoder_cache=False)
    with LLM(tiny_vl_dir, optimizations=opts, max_model_len=512, max_num_batched_tokens=512) as whole:
        assert run(whole, prompts) == shared  # one step per prompt, and no sharing: the same tokens
        assert (whole.engine.stats.encoder_items, whole.engine.stats.encoder_cache_hits) == (3, 0)
        check_clean(whole)


def test_the_prefix_cache_is_keyed_by_the_image(llm):
    llm.engine.block_manager.reset_prefix_cache()
    first, same, other = llm.generate([image_prompt("Name the colours.", 4), image_prompt("Name the colours.", 4),
                                       image_prompt("Name the colours.", 5)], GREEDY, use_tqdm=False)
    assert first.num_cached_tokens == 0 and same.num_cached_tokens >= 16  # the image is in the first block
    assert other.num_cached_tokens == 0  # the same tokens, another picture: no hit
    assert same.outputs[0].token_ids == first.outputs[0].token_ids
    check_clean(llm)


def test_preemption_and_aborts_free_the_encoder_cache(tiny_vl_dir):
    prompts = [image_prompt(f"Question {i}: what is here?", 10 + i) for i in range(4)]
    with LLM(tiny_vl_dir, optimizations=engine_opts(), max_model_len=128, max_num_batched_tokens=32,
             num_gpu_blocks_override=8) as small:
        outs = small.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                              use_tqdm=False)
        assert small.engine.stats.num_preemptions > 0 and all(len(o.outputs[0].token_ids) == 24 for o in outs)
        check_clean(small)
        engine = small.engine
        engine.add_request("gone", small._with_media(image_prompt("Never mind.", 20, size=(200, 200))), GREEDY)
        engine.step()  # its first chunk ends inside its 49 placeholders: the image's features are in use
        assert engine.encoder_cache.users
        engine.abort_request("gone")
        while engine.has_unfinished_requests() or engine.step():
            pass
        check_clean(small)


def feature(offset: int, tokens: int, name: str) -> MultiModalFeature:
    return MultiModalFeature("image", name, [(offset, tokens)], np.zeros((4 * tokens, 1), np.float32),
                             [(1, 2, 2 * tokens)])


def test_the_encoder_budget_cuts_a_chunk_before_an_image():
    """Two prompts with an 8-token image each and an encoder that encodes (and holds) 10 rows: the first is
    scheduled whole with its image, the second up to its image; once the first is done with its features the second
    takes their room, which the runner is told to free."""
    from nanoserve.config import Optimizations

    bm = BlockManager(64, 4, enable_prefix_caching=True)
    books = EncoderCacheManager(size=10, budget=10)
    sched = Scheduler(SchedulerConfig(8, 64, 256, Optimizations()), bm, encoder=books)
    a = Sequence(0, "a", 0, [1, 2] + [9] * 8 + [3, 4], SamplingParams(), mm_features=[feature(2, 8, "A")])
    b = Sequence(1, "b", 0, [5, 6, 7] + [9] * 8 + [8], SamplingParams(), mm_features=[feature(3, 8, "B")])
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [(s.seq.seq_id, s.num_new_tokens) for s in out.scheduled] == [(0, 12), (1, 3)]
    assert [e.key for e in out.encoder_inputs] == ["A"] and out.scheduled[0].features[0][0] == "A"
    sched.update_after_step(out)  # a's placeholders are all computed: its entry is unused, still held
    assert books.rows == {"A": 8} and not books.users
    out = sched.schedule()
    assert [e.key for e in out.encoder_inputs] == ["B"] and out.encoder_frees == ["A"]
    assert [(s.seq.seq_id, s.num_new_tokens) for s in out.scheduled] == [(0, 1), (1, 9)]
    books.check_integrity()


def test_a_text_model_refuses_images(tiny_dir):
    with LLM(tiny_dir, optimizations=engine_opts(), max_model_len=128) as text:
        with pytest.raises(ValueError, match="takes no images"):
            text.generate([image_prompt("Hi", 1)], GREEDY, use_tqdm=False)


def test_tensor_parallel_encodes_the_same(llm, tiny_vl_dir):
    """TP=2 (gloo, a spawned worker): every rank gets the step's pixels with its ModelInput, each encodes a share of
    the pictures (model/vision/data_parallel.py) and gathers the rest; the greedy tokens are TP=1's."""
    from nanoserve.parallel_state import get_tp

    prompts = [image_prompt("Compare the two pictures.", 30, 31), image_prompt("And this one?", 32)]
    want = run(llm, prompts)
    tp = LLM(tiny_vl_dir, optimizations=engine_opts(), max_model_len=512, max_num_batched_tokens=16,
             tensor_parallel_size=2, device="cpu")
    try:
        assert run(tp, prompts) == want and tp.engine.stats.encoder_items == 3
    finally:
        tp.shutdown()
    assert get_tp().size == 1


@pytest.mark.gpu
def test_images_on_a_gpu(tiny_vl_dir):
    """bf16 on a GPU, every switch at its default (the tower's Triton attention and fused LayerNorm, CUDA graphs for
    the decodes, the KV pool sized after a worst-case encoder step) beside the reference kernels on the same GPU:
    the features the engine kept for each picture agree to bf16's precision, and both serve every request."""
    from nanoserve.config import Optimizations

    prompts = [image_prompt("Describe it.", 40, size=(300, 420)), image_prompt("And these?", 41, 42)]
    kept = []
    # (the reference keeps its features too - switch encoder_cache on - so there is something to compare)
    for opts in (Optimizations(), Optimizations.reference().replace(encoder_cache=True)):
        with LLM(tiny_vl_dir, optimizations=opts, max_model_len=2048, device="cuda") as gpu:
            outs = gpu.generate(prompts, GREEDY, use_tqdm=False)
            assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in outs)
            assert gpu.engine.stats.encoder_items == 3
            kept.append({k: v.float().cpu() for k, v in gpu.engine.executor.runner.encoder.cache.items()})
    assert kept[0].keys() == kept[1].keys()
    for key, ours in kept[0].items():
        ref = kept[1][key]
        assert (ours - ref).abs().mean() <= 2e-2 * ref.abs().mean(), key
