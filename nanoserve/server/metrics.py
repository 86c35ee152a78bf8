"""Prometheus metrics in vLLM's names and label sets (model_name, engine), so dashboards and alerts built for
vLLM read them unchanged. Every family has a sample from startup (0 until something happens), so rates and
ratios exist before the first request.

Four sources feed them:
  * the engine's snapshot (AsyncLLMEngine.snapshot: EngineStats counters and the queue / KV gauges after the
    latest step), read at scrape time: counters advance by the change since the previous scrape;
  * the engine's observer events, on the engine thread: "outputs" (each step's appended tokens, as they come back:
    vllm:iteration_tokens_total, and each sequence's gap since its previous token: the inter-token latency);
  * each request as the server adds it: its n and max_tokens;
  * each finished request's RequestMetrics timestamps, observed into the latency histograms as it finishes.

Each app gets its own CollectorRegistry, so several servers in one process (the tests) do not collide.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from nanoserve.engine.llm_engine import EngineStats
from nanoserve.engine.outputs import RequestOutput
from nanoserve.entrypoints.async_engine import AsyncLLMEngine, EngineSnapshot
from nanoserve.sampling import SamplingParams

# vLLM's buckets
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                         20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
FINISH_REASONS = ("stop", "length", "abort")
PROMPT_TOKEN_SOURCES = {"local_compute": "prompt_tokens_local_compute",
                        "local_cache_hit": "prompt_tokens_local_cache_hit",
                        "external_kv_transfer": "prompt_tokens_external_kv_transfer"}
"""vllm:prompt_tokens_by_source's `source` label -> the EngineStats counter behind it."""
ENGINE_INDEX = "0"  # vLLM labels every metric with its engine core's index; nanoserve has one engine


def one_two_five_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's buckets for token counts)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class ServerMetrics:
    """The Prometheus collectors of one app, and how the engine feeds them."""

    def __init__(self, model_name: str, engine: AsyncLLMEngine):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.max_model_len = engine.max_model_len
        self.values = (model_name, ENGINE_INDEX)
        labels = ["model_name", "engine"]
        r = self.registry
        token_buckets = one_two_five_buckets(engine.max_model_len)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r)

        def histogram(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        self.running = gauge("vllm:num_requests_running", "Requests with sequences on the engine (holding KV).")
        self.waiting = gauge("vllm:num_requests_waiting", "Sequences waiting for admission (new or preempted).")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of requests added.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.prompt_by_source = Counter("vllm:prompt_tokens_by_source", "Prompt tokens by where their KV came from: "
                                        "computed here, found in the prefix cache, pulled from a prefill server "
                                        "(P/D), counted as each prompt is done.", labels + ["source"], registry=r)
        self.preemptions = counter("vllm:num_preemptions", "Sequences preempted (KV freed, recomputed later).")
        self.success = Counter("vllm:request_success", "Requests finished, by finish reason (of the first "
                               "completion).", labels + ["finished_reason"], registry=r)
        self.iteration_tokens = histogram("vllm:iteration_tokens_total", "Tokens per engine step, as vLLM "
                                          "counts them: the whole prompt of each request whose first token the "
                                          "step samples (prefix-cache hits included) plus the tokens it "
                                          "samples.", ITERATION_TOKEN_BUCKETS)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Prompt length per request.",
                                               token_buckets)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Tokens generated per request (all n completions).",
                                                   token_buckets)
        self.params_n = histogram("vllm:request_params_n", "The n request parameter.", N_BUCKETS)
        self.params_max_tokens = histogram("vllm:request_params_max_tokens", "The max_tokens request parameter "
                                           "(unset: what max_model_len leaves after the prompt).", token_buckets)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS)
        self.tpot = histogram("vllm:time_per_output_token_seconds", "Mean time between a request's output tokens.",
                              TOKEN_LATENCY_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between a sequence's consecutive tokens.",
                             TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to finish.", REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds", "Arrival to first scheduled (waiting).",
                                    REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram("vllm:request_inference_time_seconds", "First scheduled to last token "
                                        "(running: prefill and decode).", REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds", "First scheduled to first token.",
                                      REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds", "First token to last token.",
                                     REQUEST_LATENCY_BUCKETS)
        # a 0 sample for every family from the start
        for metric in (self.running, self.waiting, self.kv_usage, self.prompt_tokens, self.generation_tokens,
                       self.prefix_queries, self.prefix_hits, self.preemptions, self.iteration_tokens,
                       self.request_prompt_tokens, self.request_generation_tokens, self.params_n,
                       self.params_max_tokens, self.ttft, self.tpot, self.itl, self.e2e, self.queue_time,
                       self.inference_time, self.prefill_time, self.decode_time):
            metric.labels(*self.values)
        for reason in FINISH_REASONS:
            self.success.labels(*self.values, reason)
        for source in PROMPT_TOKEN_SOURCES:
            self.prompt_by_source.labels(*self.values, source)
        self._cache_config_info(engine)
        self.spec = SpecDecodeMetrics(r, labels, self.values) if engine.engine.spec_config is not None else None
        self.encoder = EncoderMetrics(r, labels, self.values) if engine.engine.vision_config is not None else None
        self._last = EngineStats()
        engine.finish_listeners.append(self.observe_finished)
        engine.engine.add_observer(self.on_engine_event)

    def _cache_config_info(self, engine: AsyncLLMEngine) -> None:
        """vLLM's vllm:cache_config_info: a gauge at 1 whose labels describe the KV cache (cache_dtype is
        `--kv-cache-dtype` as configured, "auto" meaning the model dtype, as vLLM reports it)."""
        eng, cfg = engine.engine, engine.config
        num_blocks = eng.block_manager.num_blocks
        tokens = num_blocks * eng.block_size
        info = {"block_size": str(eng.block_size), "cache_dtype": cfg.kv_cache_dtype,
                "enable_prefix_caching": str(cfg.optimizations.prefix_caching),
                "gpu_memory_utilization": str(cfg.gpu_memory_utilization), "num_gpu_blocks": str(num_blocks),
                "num_cpu_blocks": "0", "kv_cache_size_tokens": str(tokens),
                "kv_cache_max_concurrency": f"{tokens / eng.max_model_len:.2f}", "engine": ENGINE_INDEX}
        Gauge("vllm:cache_config_info", "Information of the engine's KV cache configuration.", list(info),
              registry=self.registry).labels(**info).set(1)

    # -- the engine thread: observer events -----------------------------------------------------------------
    def on_engine_event(self, event: str, **payload: Any) -> None:
        if event == "outputs":
            # vLLM's count (IterationStats.update_from_output): the tokens a step's outputs bring, and the whole
            # prompt of a request with its first token
            tokens = sum(1 + (a.seq.num_prompt_tokens if a.first else 0) for a in payload["appended"] if a.has_token)
            if tokens:
                self.iteration_tokens.labels(*self.values).observe(tokens)
            itl = self.itl.labels(*self.values)
            for gap in payload["inter_token_latencies"]:
                itl.observe(gap)

    # -- the server: each request as it is added --------------------------------------------------------------
    def observe_request(self, params: SamplingParams, prompt_len: int) -> None:
        self.params_n.labels(*self.values).observe(params.n)
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - prompt_len
        self.params_max_tokens.labels(*self.values).observe(max_tokens)

    # -- scrape time: snapshot -> gauges and counter deltas ---------------------------------------------------
    def update_from_snapshot(self, snap: EngineSnapshot) -> None:
        v = self.values
        self.running.labels(*v).set(snap.num_running)
        self.waiting.labels(*v).set(snap.num_waiting)
        self.kv_usage.labels(*v).set(snap.kv_cache_usage)
        now, last = snap.stats, self._last
        for metric, field in ((self.prompt_tokens, "num_prompt_tokens"),
                              (self.generation_tokens, "num_generation_tokens"),
                              (self.prefix_queries, "prefix_cache_queries"), (self.prefix_hits, "prefix_cache_hits"),
                              (self.preemptions, "num_preemptions")):
            delta = getattr(now, field) - getattr(last, field)
            if delta > 0:
                metric.labels(*v).inc(delta)
        for source, field in PROMPT_TOKEN_SOURCES.items():
            delta = getattr(now, field) - getattr(last, field)
            if delta > 0:
                self.prompt_by_source.labels(*v, source).inc(delta)
        if now.num_aborted > last.num_aborted:  # aborted requests never produce a finished output
            self.success.labels(*v, "abort").inc(now.num_aborted - last.num_aborted)
        if self.spec is not None:
            self.spec.update(now, last)
        if self.encoder is not None:
            self.encoder.update(now, last)
        self._last = now

    def render(self, snap: EngineSnapshot) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type."""
        self.update_from_snapshot(snap)
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    # -- per finished request: latency histograms -----------------------------------------------------------
    def observe_finished(self, out: RequestOutput) -> None:
        m, v = out.metrics, self.values
        self.success.labels(*v, out.outputs[0].finish_reason or "abort").inc()
        self.request_prompt_tokens.labels(*v).observe(len(out.prompt_token_ids))
        self.request_generation_tokens.labels(*v).observe(sum(len(c.token_ids) for c in out.outputs))
        if m is None:
            return
        if m.first_scheduled_time is not None:
            self.queue_time.labels(*v).observe(m.first_scheduled_time - m.arrival_time)
        if m.first_token_time is not None:
            self.ttft.labels(*v).observe(m.first_token_time - m.arrival_time)
            if m.first_scheduled_time is not None:
                self.prefill_time.labels(*v).observe(m.first_token_time - m.first_scheduled_time)
        if m.last_token_time is not None and m.first_token_time is not None:
            self.decode_time.labels(*v).observe(m.last_token_time - m.first_token_time)
            if m.first_scheduled_time is not None:
                self.inference_time.labels(*v).observe(m.last_token_time - m.first_scheduled_time)
        if m.finished_time is not None:
            self.e2e.labels(*v).observe(m.finished_time - m.arrival_time)
        longest = max((len(c.token_ids) for c in out.outputs), default=0)
        if longest > 1 and m.first_token_time is not None and m.last_token_time is not None:
            self.tpot.labels(*v).observe((m.last_token_time - m.first_token_time) / (longest - 1))


class SpecDecodeMetrics:
    """vLLM's speculative-decoding counters (registered only when the engine speculates): verify steps of a
    sequence, draft tokens verified, draft tokens accepted, and accepted per draft position (label `position`)."""

    def __init__(self, registry: CollectorRegistry, labels: list[str], values: tuple[str, ...]):
        self.values = values
        self.drafts = Counter("vllm:spec_decode_num_drafts", "Verify steps of a sequence (one draft each).",
                              labels, registry=registry)
        self.draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.", labels,
                                    registry=registry)
        self.accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", labels,
                                registry=registry)
        self.per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by their "
                               "position in the draft (0 = the first).", labels + ["position"], registry=registry)
        for metric in (self.drafts, self.draft_tokens, self.accepted):
            metric.labels(*values)

    def update(self, now: EngineStats, last: EngineStats) -> None:
        v = self.values
        for metric, field in ((self.drafts, "spec_decode_num_drafts"),
                              (self.draft_tokens, "spec_decode_num_draft_tokens"),
                              (self.accepted, "spec_decode_num_accepted_tokens")):
            delta = getattr(now, field) - getattr(last, field)
            if delta > 0:
                metric.labels(*v).inc(delta)
        before = last.spec_decode_accepted_per_pos
        for pos, count in enumerate(now.spec_decode_accepted_per_pos):
            delta = count - (before[pos] if pos < len(before) else 0)
            self.per_pos.labels(*v, str(pos)).inc(max(delta, 0))


class EncoderMetrics:
    """The vision model's work (registered only for a model that sees): images and videos encoded, their feature
    rows (placeholder tokens), the time the encoder took, and items found in the encoder cache instead of encoded.
    nanoserve's own names (vLLM has no such metrics)."""

    def __init__(self, registry: CollectorRegistry, labels: list[str], values: tuple[str, ...]):
        self.values = values
        self.counters = {
            "encoder_items": Counter("nanoserve:encoder_items", "Images and videos the vision model encoded.",
                                     labels, registry=registry),
            "encoder_tokens": Counter("nanoserve:encoder_tokens", "Feature rows (placeholder tokens) encoded.",
                                      labels, registry=registry),
            "encoder_seconds": Counter("nanoserve:encoder_seconds", "Time the vision model took, in seconds.",
                                       labels, registry=registry),
            "encoder_cache_hits": Counter("nanoserve:encoder_cache_hits", "Images and videos whose features a "
                                          "request found in the encoder cache (not encoded again).", labels,
                                          registry=registry)}
        for metric in self.counters.values():
            metric.labels(*values)

    def update(self, now: EngineStats, last: EngineStats) -> None:
        for field, metric in self.counters.items():
            delta = getattr(now, field) - getattr(last, field)
            if delta > 0:
                metric.labels(*self.values).inc(delta)
