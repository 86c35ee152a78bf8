"""/metrics as vLLM serves it: vLLM's names and label sets (model_name, engine), every family present with a 0
sample from startup, a page prometheus_client's parser reads, and each metric moving by exactly what a request
did (ported from vLLM's test_metrics_counts: the same expectations per request)."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.server_utils import MAX_MODEL_LEN, SERVED_MODEL, ServerProcess, ServerThread, metric

MODEL = SERVED_MODEL  # conftest's engine and app
LABELS = {"model_name": MODEL, "engine": "0"}
PROMPT_IDS = [(13 * i + 5) % 400 + 9 for i in range(20)]
FAMILIES = {  # family -> prometheus type
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge", "vllm:cache_config_info": "gauge",
    "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter", "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:iteration_tokens_total": "histogram", "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram", "vllm:request_params_n": "histogram",
    "vllm:request_params_max_tokens": "histogram", "vllm:time_to_first_token_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram", "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram", "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram", "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
}


@pytest.fixture(scope="module")
def server(app):
    with ServerThread(app) as srv:
        srv.startup_page = httpx.get(f"{srv.url}/metrics").text  # before any request
        yield srv


def parse(page: str) -> dict:
    """{family name: (type, {(sample name, frozenset(labels)): value})}."""
    out = {}
    for fam in text_string_to_metric_families(page):
        out[fam.name] = (fam.type, {(s.name, frozenset(s.labels.items())): s.value for s in fam.samples})
    return out


def scrape(server) -> dict:
    resp = httpx.get(f"{server.url}/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    return parse(resp.text)


def value(page: dict, family: str, suffix: str = "", **extra: str) -> float:
    labels = frozenset({**LABELS, **extra}.items())
    return page[family][1].get((family + suffix, labels), 0.0)


def completion(server, **body) -> dict:
    resp = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, **body}, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_every_family_has_a_zero_sample_from_startup(server):
    page = parse(server.startup_page)
    for family, kind in FAMILIES.items():
        assert family in page, family
        assert page[family][0] == kind, (family, page[family][0])
        if family == "vllm:cache_config_info":
            continue
        suffix = {"counter": "_total", "histogram": "_count", "gauge": ""}[kind]
        extra = {"finished_reason": "stop"} if family == "vllm:request_success" else {}
        assert (family + suffix, frozenset({**LABELS, **extra}.items())) in page[family][1], family
        assert value(page, family, suffix, **extra) == 0.0, family
    for _, labels in page["vllm:num_requests_running"][1]:
        assert dict(labels) == LABELS


def test_cache_config_info(server, engine):
    [(name, labels)] = scrape(server)["vllm:cache_config_info"][1]
    info = dict(labels)
    eng = engine.engine
    assert info["engine"] == "0" and info["block_size"] == str(eng.block_size) and info["cache_dtype"] == "auto"
    assert info["num_gpu_blocks"] == str(eng.block_manager.num_blocks)
    assert info["kv_cache_size_tokens"] == str(eng.block_manager.num_blocks * eng.block_size)
    assert info["enable_prefix_caching"] == "True"
    assert float(info["kv_cache_max_concurrency"]) == pytest.approx(
        eng.block_manager.num_blocks * eng.block_size / MAX_MODEL_LEN, rel=1e-3)


def test_cache_config_info_reports_the_kv_cache_dtype(tiny_dir, tmp_path):
    """A server started with `--kv-cache-dtype fp8` says so in cache_dtype, as vLLM's does (and serves)."""
    with ServerProcess(tiny_dir, tmp_path / "server.log", "--kv-cache-dtype", "fp8") as srv:
        resp = httpx.post(f"{srv.url}/v1/completions", json={"model": "tiny", "prompt": PROMPT_IDS, "max_tokens": 2},
                          timeout=120)
        assert resp.status_code == 200, resp.text
        text = httpx.get(f"{srv.url}/metrics", timeout=10).text
    assert metric(text, "vllm:cache_config_info", cache_dtype="fp8", engine="0") == 1.0
    assert metric(text, "vllm:cache_config_info", cache_dtype="auto") == 0.0  # one sample, not one per dtype


def test_each_metric_moves_by_what_a_request_did(server):
    n_prompt, max_tokens = len(PROMPT_IDS), 6
    before = scrape(server)
    for _ in range(2):
        out = completion(server, prompt=PROMPT_IDS, max_tokens=max_tokens, ignore_eos=True, temperature=0)
    assert out["usage"]["completion_tokens"] == max_tokens
    cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]  # the second run hits the first's blocks
    after = scrape(server)

    def delta(family: str, suffix: str, **extra) -> float:
        return value(after, family, suffix, **extra) - value(before, family, suffix, **extra)

    expected = {
        ("vllm:prompt_tokens", "_total"): 2 * n_prompt,
        ("vllm:generation_tokens", "_total"): 2 * max_tokens,
        ("vllm:request_prompt_tokens", "_sum"): 2 * n_prompt, ("vllm:request_prompt_tokens", "_count"): 2,
        ("vllm:request_generation_tokens", "_sum"): 2 * max_tokens,
        ("vllm:request_params_n", "_sum"): 2, ("vllm:request_params_n", "_count"): 2,
        ("vllm:request_params_max_tokens", "_sum"): 2 * max_tokens,
        ("vllm:request_params_max_tokens", "_count"): 2,
        # vLLM's count: the step that samples a request's first token counts its whole prompt (the cached part
        # too, the second time), then one step per further token
        ("vllm:iteration_tokens_total", "_sum"): 2 * (n_prompt + max_tokens),
        ("vllm:iteration_tokens_total", "_count"): 2 * max_tokens,
        ("vllm:inter_token_latency_seconds", "_count"): 2 * (max_tokens - 1),
        ("vllm:time_per_output_token_seconds", "_count"): 2,
        ("vllm:time_to_first_token_seconds", "_count"): 2,
        ("vllm:e2e_request_latency_seconds", "_count"): 2,
        ("vllm:request_queue_time_seconds", "_count"): 2,
        ("vllm:request_inference_time_seconds", "_count"): 2,
        ("vllm:request_prefill_time_seconds", "_count"): 2,
        ("vllm:request_decode_time_seconds", "_count"): 2,
        ("vllm:prefix_cache_queries", "_total"): 2 * n_prompt,
        ("vllm:prefix_cache_hits", "_total"): cached,
    }
    for (family, suffix), want in expected.items():
        assert delta(family, suffix) == want, (family + suffix, delta(family, suffix), want)
    assert cached > 0
    assert delta("vllm:request_success", "_total", finished_reason="length") == 2
    # the latency histograms hold sensible values: decode time covers the inter-token gaps
    decode = delta("vllm:request_decode_time_seconds", "_sum")
    itl = delta("vllm:inter_token_latency_seconds", "_sum")
    assert decode == pytest.approx(itl, rel=1e-6, abs=1e-6) and decode > 0
    inference = delta("vllm:request_inference_time_seconds", "_sum")
    prefill = delta("vllm:request_prefill_time_seconds", "_sum")
    assert inference == pytest.approx(prefill + decode, rel=1e-6, abs=1e-6)


def test_n_and_stop_are_counted(server):
    before = scrape(server)
    completion(server, prompt=PROMPT_IDS[:5], max_tokens=3, n=3, temperature=1.0, seed=1, ignore_eos=True)
    after = scrape(server)
    assert value(after, "vllm:request_params_n", "_sum") - value(before, "vllm:request_params_n", "_sum") == 3
    assert value(after, "vllm:generation_tokens", "_total") - value(before, "vllm:generation_tokens", "_total") == 9
    # the n = 3 histogram bucket: le="5" counts it, le="2" does not
    def bucket(page, le):
        return value(page, "vllm:request_params_n", "_bucket", le=le)
    assert bucket(after, "5.0") - bucket(before, "5.0") == 1 and bucket(after, "2.0") - bucket(before, "2.0") == 0


def test_iteration_tokens_count_the_tokens_that_come_back(server):
    """vLLM counts an iteration's tokens as its outputs bring them (IterationStats.update_from_output: each
    request's new tokens, and its whole prompt with its first token). A request that stops early (here at a stop
    token its greedy answer reaches) must not add the step launched for it before the stop was seen - the 356
    against vLLM's 360 of its test_metrics_counts: the count follows the engine's "outputs" event, not the launch."""
    greedy = completion(server, prompt=PROMPT_IDS, max_tokens=8, temperature=0, ignore_eos=True,
                        return_token_ids=True)["choices"][0]["token_ids"]
    k = next(i for i in range(1, len(greedy)) if greedy[i] not in greedy[:i])  # its first occurrence
    before = scrape(server)
    out = completion(server, prompt=PROMPT_IDS, max_tokens=8, temperature=0, stop_token_ids=[greedy[k]])
    assert out["choices"][0]["finish_reason"] == "stop" and out["usage"]["completion_tokens"] == k + 1
    after = scrape(server)

    def delta(suffix: str) -> float:
        return value(after, "vllm:iteration_tokens_total", suffix) - value(before, "vllm:iteration_tokens_total",
                                                                           suffix)

    assert (delta("_sum"), delta("_count")) == (len(PROMPT_IDS) + k + 1, k + 1)


def test_llm_get_metrics_as_vllm(tiny_dir):
    """LLM.get_metrics(): vLLM's offline metrics (Counter, Gauge, Vector named vllm:...), the speculative
    counters included, moving by what the generate call did."""
    from nanoserve import LLM, SamplingParams
    from nanoserve.entrypoints.llm import Counter, Gauge, Vector
    from tests.helpers.server_utils import FAST_CPU

    prompts = [{"prompt_token_ids": PROMPT_IDS * 2}, {"prompt_token_ids": PROMPT_IDS[:9]}]
    with LLM(model=tiny_dir, device="cpu", optimizations=FAST_CPU, max_model_len=MAX_MODEL_LEN,
             speculative_config={"method": "ngram", "num_speculative_tokens": 3}) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        metrics = {(m.name, m.labels.get("finished_reason")): m for m in llm.get_metrics()}
    labels = {"model_name": tiny_dir, "engine": "0"}
    assert all({k: v for k, v in m.labels.items() if k != "finished_reason"} == labels for m in metrics.values())
    names = {name for name, _ in metrics}
    server_families = set(FAMILIES) | {"vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                                       "vllm:spec_decode_num_accepted_tokens",
                                       "vllm:spec_decode_num_accepted_tokens_per_pos"}
    assert names <= server_families  # the server's /metrics names
    gauges = {name: m.value for (name, _), m in metrics.items() if isinstance(m, Gauge)}
    assert gauges == {"vllm:num_requests_running": 0, "vllm:num_requests_waiting": 0, "vllm:kv_cache_usage_perc": 0}
    counts = {name: m.value for (name, reason), m in metrics.items() if isinstance(m, Counter) and reason is None}
    assert counts["vllm:prompt_tokens"] == 2 * len(PROMPT_IDS) + 9
    assert counts["vllm:generation_tokens"] == sum(len(o.outputs[0].token_ids) for o in outs) == 24
    assert metrics["vllm:request_success", "length"].value == 2 and metrics["vllm:request_success", "stop"].value == 0
    drafts, accepted = counts["vllm:spec_decode_num_drafts"], counts["vllm:spec_decode_num_accepted_tokens"]
    per_pos = metrics["vllm:spec_decode_num_accepted_tokens_per_pos", None]
    assert isinstance(per_pos, Vector) and sum(per_pos.values) == accepted and len(per_pos.values) == 3
    assert drafts > 0 and 0 < accepted <= counts["vllm:spec_decode_num_draft_tokens"] <= 3 * drafts
