"""Prometheus metrics, named after vLLM's (dashboards built for vLLM read them unchanged).

Two sources feed them:
  * the engine's snapshot (AsyncLLMEngine.snapshot: EngineStats counters and the queue / KV gauges after the
    latest step), read at scrape time: counters advance by the change since the previous scrape;
  * each finished request's RequestMetrics timestamps, observed into the latency histograms as it finishes.

Each app gets its own CollectorRegistry, so several servers in one process (the tests) do not collide.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from nanoserve.engine.llm_engine import EngineStats
from nanoserve.engine.outputs import RequestOutput
from nanoserve.entrypoints.async_engine import EngineSnapshot

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
FINISH_REASONS = ("stop", "length", "abort")


class ServerMetrics:
    """The Prometheus collectors of one app, and how the engine snapshot and finished requests feed them."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, labels + list(extra), registry=r)

        def histogram(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        self.running = gauge("vllm:num_requests_running", "Requests with sequences on the engine (holding KV).")
        self.waiting = gauge("vllm:num_requests_waiting", "Sequences waiting for admission (new or preempted).")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of requests added.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("vllm:num_preemptions", "Sequences preempted (KV freed, recomputed later).")
        self.success = counter("vllm:request_success", "Requests finished, by finish reason (of the first "
                               "completion).", ("finished_reason",))
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Arrival to first token.", LATENCY_BUCKETS)
        self.tpot = histogram("vllm:time_per_output_token_seconds", "Mean time between a request's output tokens.",
                              LATENCY_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to finish.", LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds", "Arrival to first scheduled.",
                                    LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Prompt length per request.",
                                               TOKEN_BUCKETS)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Tokens generated per request (all n completions).",
                                                   TOKEN_BUCKETS)
        for reason in FINISH_REASONS:  # export zeros from the start, so rates exist before the first request
            self.success.labels(model_name, reason)
        self._last = EngineStats()

    # -- scrape time: snapshot -> gauges and counter deltas ---------------------------------------------------
    def update_from_snapshot(self, snap: EngineSnapshot) -> None:
        name = self.model_name
        self.running.labels(name).set(snap.num_running)
        self.waiting.labels(name).set(snap.num_waiting)
        self.kv_usage.labels(name).set(snap.kv_cache_usage)
        now, last = snap.stats, self._last
        for metric, field in ((self.prompt_tokens, "num_prompt_tokens"),
                              (self.generation_tokens, "num_generation_tokens"),
                              (self.prefix_queries, "prefix_cache_queries"), (self.prefix_hits, "prefix_cache_hits"),
                              (self.preemptions, "num_preemptions")):
            delta = getattr(now, field) - getattr(last, field)
            if delta > 0:
                metric.labels(name).inc(delta)
        if now.num_aborted > last.num_aborted:  # aborted requests never produce a finished output
            self.success.labels(name, "abort").inc(now.num_aborted - last.num_aborted)
        self._last = now

    def render(self, snap: EngineSnapshot) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type."""
        self.update_from_snapshot(snap)
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    # -- per finished request: latency histograms -----------------------------------------------------------
    def observe_finished(self, out: RequestOutput) -> None:
        m, name = out.metrics, self.model_name
        self.success.labels(name, out.outputs[0].finish_reason or "abort").inc()
        self.request_prompt_tokens.labels(name).observe(len(out.prompt_token_ids))
        self.request_generation_tokens.labels(name).observe(sum(len(c.token_ids) for c in out.outputs))
        if m is None:
            return
        if m.first_scheduled_time is not None:
            self.queue_time.labels(name).observe(m.first_scheduled_time - m.arrival_time)
        if m.first_token_time is not None:
            self.ttft.labels(name).observe(m.first_token_time - m.arrival_time)
        if m.finished_time is not None:
            self.e2e.labels(name).observe(m.finished_time - m.arrival_time)
        longest = max((len(c.token_ids) for c in out.outputs), default=0)
        if longest > 1 and m.first_token_time is not None and m.last_token_time is not None:
            self.tpot.labels(name).observe((m.last_token_time - m.first_token_time) / (longest - 1))
