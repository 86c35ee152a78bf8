"""Offline workloads on nanoserve: one model build, a fresh engine per run, timings from the engine's timestamps.

`NanoBench` builds the model and its KV pool once (an executor) and hands out a new `LLMEngine` around it per run,
so each run starts with an empty prefix cache and fresh counters, and the ablation can flip switches between runs
without rebuilding 50 GB of weights. Model-side switches are read from the shared `Optimizations` object at
forward time; engine-side ones take effect in the next engine built; a `build_time` switch (mxfp8_weights) only in
a model built again (`rebuild`). Every run records the weights it ran on (format and bytes).
"""

from __future__ import annotations

import dataclasses
import gc
import importlib
import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from nanoserve.bench.compile_watch import CompileWatch
from nanoserve.bench.floor import H200, Ceilings, ModelCost, workload_floor
from nanoserve.bench.workloads import Workload
from nanoserve.config import KERNEL, EngineConfig, Optimizations, Platform
from nanoserve.engine.builder import DEFAULT_MAX_NUM_BATCHED_TOKENS, make_executor
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.outputs import RequestOutput
from nanoserve.runner.kv_cache import kv_cache_bytes_per_block, kv_cache_torch_dtype
from nanoserve.runner.model_runner import platform_of, resolve_device
from nanoserve.sampling import SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)

KV_HEADROOM = 1.15
"""KV pool = this x the largest workload's resident tokens (+ one max_model_len sequence)."""
MAX_KV_FRACTION_OF_FREE = 0.75
"""Never ask for more than this share of the free device memory for the KV pool (activations need the rest)."""


def unavailable_kernel_switches(opts_cls: type[Optimizations] = Optimizations) -> dict[str, str]:
    """KERNEL switches whose module (or the functions the model imports from it) cannot be imported here
    (switch -> reason), from each switch's declared module and entry points."""
    out = {}
    for s in opts_cls.switches():
        if s.layer != KERNEL:
            continue
        module = s.import_path
        try:
            mod = importlib.import_module(module)
            missing = [n for n in s.entry_points if not hasattr(mod, n)]
            if missing:
                out[s.name] = f"{module} has no {', '.join(missing)}"
        except Exception as e:  # noqa: BLE001 - a kernel being written may not import yet
            out[s.name] = f"{module} does not import: {type(e).__name__}: {e}"
    return out


def stats(values: list[float]) -> dict[str, float]:
    """mean / p50 / p99 / min / max (numpy's linear percentiles, as vllm bench serve)."""
    if not values:
        return {"mean": float("nan"), "p50": float("nan"), "p99": float("nan"), "min": float("nan"),
                "max": float("nan"), "n": 0}
    a = np.asarray(values, dtype=np.float64)
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)),
            "min": float(a.min()), "max": float(a.max()), "n": int(a.size)}


@dataclass
class RunResult:
    """One workload on one engine configuration."""

    workload: str
    engine: str  # "nanoserve" or "hf"
    mode: str  # nanoserve: "default" / the ablation row; hf: "eager" / "static"
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    wall_s: float
    output_tok_s: float
    total_tok_s: float
    ttft_ms: dict
    tpot_ms: dict
    e2e_ms: dict
    decode_tok_s: float  # batch / mean TPOT: the decode rate once every request is decoding
    perf: dict = field(default_factory=dict)  # achieved GB/s, TFLOP/s, floors and fractions
    extra: dict = field(default_factory=dict)  # prefix-cache hits, preemptions, notes
    switches: dict = field(default_factory=dict)
    token_ids: list[list[int]] = field(default_factory=list, repr=False)

    def as_dict(self, with_tokens: bool = False) -> dict:
        d = dataclasses.asdict(self)
        if not with_tokens:
            d.pop("token_ids")
        return d


def performance(cost: ModelCost, wl: Workload, wall_s: float, tpot_s: float, ttft_s: float,
                hw: Ceilings = H200) -> dict:
    """Achieved bandwidth / FLOP rate of the decode steps and the fraction of the floor, next to tokens/s."""
    prompts = [len(r.prompt_ids) for r in wl.requests]
    outs = [r.max_tokens for r in wl.requests]
    fl = workload_floor(cost, prompts, outs, hw, wl.shared_prefix_len)
    batch = len(wl.requests)
    ctx = sum(prompts) / batch + (max(outs) / 2)
    step_bytes, step_flops = cost.decode_step(batch, ctx)
    out = {
        "ceilings": hw.name,
        "decode_step_bytes": step_bytes, "decode_step_flops": step_flops,
        "floor": fl.as_dict(),
        "output_tok_s_fraction_of_floor":
            (sum(outs) / wall_s) / fl.output_tok_s if wall_s and fl.output_tok_s else None,
    }
    if tpot_s and tpot_s == tpot_s:
        floor_step = max(step_bytes / hw.bytes_per_s, step_flops / hw.flops_per_s)
        out.update({
            "decode_gb_s": step_bytes / tpot_s / 1e9,
            "decode_tflop_s": step_flops / tpot_s / 1e12,
            "decode_bandwidth_fraction": step_bytes / tpot_s / hw.bytes_per_s,
            "floor_tpot_ms": floor_step * 1e3,
            "tpot_fraction_of_floor": floor_step / tpot_s,
        })
    if ttft_s and ttft_s == ttft_s and batch == 1:
        floor_ttft = workload_floor(cost, prompts, [1], hw).prefill_s
        out.update({"floor_ttft_ms": floor_ttft * 1e3, "ttft_fraction_of_floor": floor_ttft / ttft_s,
                    "prefill_tflop_s": cost.prefill_flops(prompts[0]) / ttft_s / 1e12})
    return out


class NanoBench:
    """One model + KV pool, fresh engines on demand."""

    def __init__(self, model: str, device: str = "auto", dtype: str = "auto", opts: Optimizations | None = None,
                 max_model_len: int = 4096, max_num_seqs: int = 256, kv_tokens: int | None = None,
                 max_num_batched_tokens: int | None = None, seed: int = 0, hw: Ceilings = H200,
                 quantization: str | None = None, kv_cache_dtype: str = "auto"):
        self.device = resolve_device(device)
        self.opts = opts or Optimizations()
        self.hw = hw
        self.config = EngineConfig(model=model, device=self.device.type, dtype=dtype, max_model_len=max_model_len,
                                   max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                   seed=seed, optimizations=self.opts, quantization=quantization,
                                   kv_cache_dtype=kv_cache_dtype)
        self._kv_tokens = kv_tokens
        self._build()

    def _build(self) -> None:
        """The executor (model + KV pool) for self.config, with the switches self.opts holds now."""
        max_model_len, max_num_seqs = self.config.max_model_len, self.config.max_num_seqs
        self.config.num_gpu_blocks_override = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            before = torch.cuda.memory_allocated(self.device)
        t0 = time.perf_counter()
        self.executor = make_executor(self.config)
        self.build_s = time.perf_counter() - t0
        self.model_config = self.executor.model_config
        self.block_size = self.executor.block_size
        self.runner = getattr(self.executor, "runner", None)
        self.weight_memory = self._weight_memory(before if self.device.type == "cuda" else 0)
        dtype_t = self.runner.dtype if self.runner is not None else torch.bfloat16
        kv_dtype = self.runner.kv_dtype if self.runner is not None else \
            kv_cache_torch_dtype(self.config.kv_cache_dtype, dtype_t)
        self.cost = ModelCost(self.model_config, weight_bytes=torch.empty((), dtype=dtype_t).element_size(),
                              kv_bytes=torch.empty((), dtype=kv_dtype).element_size(),
                              quantization=self.weight_memory.get("weight_format"))
        if self._kv_tokens is not None:
            self.config.num_gpu_blocks_override = self._kv_blocks(self._kv_tokens, max_model_len, kv_dtype)
        budget = self.config.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
        t0 = time.perf_counter()
        self.num_blocks = self.executor.initialize_cache(max_model_len, budget, max_num_seqs)
        self.cache_s = time.perf_counter() - t0
        logger.info("nanoserve bench: model built in %.1f s, KV pool of %d blocks in %.1f s", self.build_s,
                    self.num_blocks, self.cache_s)

    def rebuild(self) -> None:
        """Drop the model and build it again with the switches self.opts holds now (a `build_time` switch that
        changed: the new model has other parameters). The old one goes first, so the two never share the device."""
        if self.executor is not None:  # (None: an earlier build failed part way)
            self.executor.shutdown()
        self.executor = self.runner = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self._build()

    @property
    def weights(self) -> dict:
        """What a run's weights were: the format served (mxfp8, or the dtype) and the parameters' bytes."""
        w = self.weight_memory
        fmt = w.get("weight_format") or (str(self.runner.dtype).removeprefix("torch.") if self.runner else None)
        return {"weight_format": fmt, "parameter_bytes": w.get("parameter_bytes"),
                "parameter_bytes_by_dtype": w.get("parameter_bytes_by_dtype")}

    @property
    def platform(self) -> Platform:
        """What the switches run on here: the device, its kernels, whether the weights are MXFP8."""
        dtype = self.runner.dtype if self.runner is not None else torch.bfloat16
        mxfp8 = self.config.quantization == "mxfp8" or self.weight_memory.get("weight_format") == "mxfp8"
        return platform_of(self.device, dtype, mxfp8, (self.config.speculative_config or {}).get("method"),
                           self.config.tensor_parallel_size)

    def _weight_memory(self, allocated_before: int) -> dict:
        """What the model's weights take on this process's device: parameter bytes by dtype, and (GPU) the
        allocator's growth over the build, before any KV pool exists."""
        out: dict = {"weight_format": None}
        model = getattr(self.runner, "model", None)
        if model is None:
            return out
        by_dtype: dict[str, int] = {}
        for p in model.parameters():
            key = str(p.dtype).replace("torch.", "")
            by_dtype[key] = by_dtype.get(key, 0) + p.numel() * p.element_size()
        out.update(weight_format=model.weight_format, parameter_bytes=sum(by_dtype.values()),
                   parameter_bytes_by_dtype=by_dtype)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            out["allocated_bytes"] = torch.cuda.memory_allocated(self.device) - allocated_before
        return out

    def _kv_blocks(self, kv_tokens: int, max_model_len: int, dtype: torch.dtype) -> int:
        blocks = int((kv_tokens * KV_HEADROOM + max_model_len) // self.block_size) + 2
        if self.device.type == "cuda":
            per_block = kv_cache_bytes_per_block(self.model_config, self.block_size, dtype)
            free = torch.cuda.mem_get_info(self.device)[0]
            cap = int(free * MAX_KV_FRACTION_OF_FREE // per_block)
            if blocks > cap:
                logger.warning("KV pool capped at %d blocks (%.1f GiB) by free memory", cap, cap * per_block / 2**30)
                blocks = cap
        return blocks

    def engine(self, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int | None = None) -> LLMEngine:
        """A fresh engine (empty prefix cache, zeroed stats) around the shared model; engine-side switches are
        read from the shared Optimizations now. `max_num_batched_tokens` overrides the build's step budget (the
        prefill chunk size) for this engine only."""
        cfg = dataclasses.replace(self.config, max_model_len=max_model_len, num_gpu_blocks_override=None,
                                  max_num_seqs=min(max_num_seqs, self.config.max_num_seqs))
        if max_num_batched_tokens is not None:
            cfg.max_num_batched_tokens = max_num_batched_tokens
        cfg.optimizations = self.opts
        return LLMEngine(cfg, executor=self.executor)

    def engine_for(self, wl: Workload, max_num_batched_tokens: int | None = None) -> LLMEngine:
        bs = self.block_size
        need = -(-wl.max_total_len // bs) * bs
        return self.engine(min(max(need, bs), self.config.max_model_len), max(wl.num_requests, 1),
                           max_num_batched_tokens)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def capture_graphs(self, wl: Workload) -> int:
        """Capture the decode graphs this workload will use (batch sizes up to its request count, its context),
        outside the timed region. 0 if graphs do not apply."""
        if self.runner is None or not hasattr(self.runner, "capture_decode_graphs"):
            return 0
        return self.runner.capture_decode_graphs(wl.max_total_len, wl.num_requests)

    def warmup(self, wl: Workload, max_tokens: int | None = None, max_requests: int | None = None,
               max_prompt: int | None = None) -> RunResult:
        """Build the kernels this workload's shapes need and capture its decode graphs, outside the timed run: the
        same requests with fresh random prompts (no prefix-cache hits for the timed run), by default at their full
        prompt and output lengths. The prefill tiles change with the context a chunk attends to
        (configs.LONG_PREFILL_CONTEXT) and the MoE's with the tokens per step; a warm-up cut to a few chunks, or
        to a few output tokens (whose sequences then finish while others still prefill, so the steps mix other
        token counts), leaves first-time kernel builds inside the timed run. `max_tokens`, `max_requests`,
        `max_prompt` cut it anyway. Returns the warm-up's own run (its TTFT is the cold one)."""
        small = wl.scaled(max_tokens=max_tokens, max_requests=max_requests, max_prompt=max_prompt, seed=1000)
        res = self.run(small, tag="warmup", keep_tokens=False)
        self.capture_graphs(wl)
        return res

    def run(self, wl: Workload, mode: str = "default", tag: str = "run", keep_tokens: bool = True,
            max_num_batched_tokens: int | None = None) -> RunResult:
        engine = self.engine_for(wl, max_num_batched_tokens)
        self.sync()
        with CompileWatch() as builds:
            outputs, wall = drive(engine, wl, tag)
        res = result_from_outputs(wl, outputs, wall, "nanoserve", mode, self.opts, self.cost, self.hw,
                                  engine.stats, keep_tokens)
        res.extra.update(self.weights)
        res.extra["triton_builds"] = builds.count  # kernels built inside this run (a timed run should have 0)
        if builds.count:
            res.extra["triton_builds_kernels"] = builds.summary()
        return res

    def close(self) -> None:
        self.executor.shutdown()
        self.executor = None
        self.runner = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def sampling_params(req) -> SamplingParams:
    if req.json_schema is not None:  # W2J: the format decides where EOS may come (it cannot before max_tokens)
        return SamplingParams(temperature=req.temperature, max_tokens=req.max_tokens,
                              structured_outputs=StructuredOutputsParams(json=req.json_schema))
    return SamplingParams(temperature=req.temperature, max_tokens=req.max_tokens, ignore_eos=True)


MAX_IDLE_STEPS = 1000
"""Steps in a row with nothing scheduled before the driver gives up (a request that can never fit)."""


def drive(engine: LLMEngine, wl: Workload, tag: str = "run") -> tuple[list[RequestOutput], float]:
    """Add every request at once, step until all finish; returns outputs in request order and the wall time."""
    t0 = time.perf_counter()
    ids = []
    for i, req in enumerate(wl.requests):
        rid = f"{tag}-{wl.name}-{i}"
        engine.add_request(rid, {"prompt_token_ids": req.prompt_ids}, sampling_params(req))
        ids.append(rid)
    results: dict[str, RequestOutput] = {}
    idle = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        idle = 0 if outs or engine.stats.num_steps else idle + 1
        for out in outs:
            if out.finished:
                results[out.request_id] = out
        if not outs and engine.num_running == 0 and engine.num_waiting and idle > MAX_IDLE_STEPS:
            engine.abort_request(ids)
            raise RuntimeError(f"{wl.name}: {engine.num_waiting} request(s) can never be scheduled")
    if engine.executor.device.type == "cuda":
        torch.cuda.synchronize(engine.executor.device)
    wall = time.perf_counter() - t0
    return [results[i] for i in ids], wall


def latencies_ms(outputs: list[RequestOutput]) -> tuple[list[float], list[float], list[float]]:
    """Each finished request's TTFT, TPOT ((last token - first token) / (tokens - 1), requests of 2 tokens or more)
    and end-to-end latency, in milliseconds, from its metrics."""
    ttft, tpot, e2e = [], [], []
    for o in outputs:
        m = o.metrics
        n = len(o.outputs[0].token_ids)
        if m is None or m.first_token_time is None:
            continue
        ttft.append((m.first_token_time - m.arrival_time) * 1e3)
        if n > 1 and m.last_token_time is not None:
            tpot.append((m.last_token_time - m.first_token_time) / (n - 1) * 1e3)
        end = m.finished_time or m.last_token_time
        e2e.append((end - m.arrival_time) * 1e3)
    return ttft, tpot, e2e


def result_from_outputs(wl: Workload, outputs: list[RequestOutput], wall: float, engine_name: str, mode: str,
                        opts: Optimizations | None, cost: ModelCost, hw: Ceilings, engine_stats=None,
                        keep_tokens: bool = True) -> RunResult:
    ttft, tpot, e2e = latencies_ms(outputs)
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    prompt_tokens = sum(len(r.prompt_ids) for r in wl.requests)
    t, f = stats(tpot), stats(ttft)
    extra = {}
    if engine_stats is not None:
        s = engine_stats
        hits = s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
        extra = {"prefix_cache_hit_rate": hits,
                 "computed_prefill_tokens": s.num_computed_prefill_tokens, "preemptions": s.num_preemptions,
                 "steps": s.num_steps}
    res = RunResult(
        workload=wl.name, engine=engine_name, mode=mode, num_requests=len(outputs), prompt_tokens=prompt_tokens,
        output_tokens=out_tokens, wall_s=wall, output_tok_s=out_tokens / wall if wall else 0.0,
        total_tok_s=(out_tokens + prompt_tokens) / wall if wall else 0.0, ttft_ms=f, tpot_ms=t, e2e_ms=stats(e2e),
        decode_tok_s=len(outputs) / (t["mean"] / 1e3) if t["n"] else 0.0,
        perf=performance(cost, wl, wall, t["mean"] / 1e3 if t["n"] else 0.0, f["mean"] / 1e3 if f["n"] else 0.0, hw),
        extra=extra, switches=opts.as_dict() if opts is not None else {},
        token_ids=[list(o.outputs[0].token_ids) for o in outputs] if keep_tokens else [])
    return res
