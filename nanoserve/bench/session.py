"""One benchmark session: the models it builds (once each), the parts it runs (each guarded, each flushed to
results.json as soon as it ends), and a global time budget. `python -m nanoserve.bench` drives this."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from nanoserve.bench import report
from nanoserve.bench.env import environment
from nanoserve.bench.floor import H200, Ceilings
from nanoserve.bench.offline import NanoBench, RunResult, unavailable_kernel_switches
from nanoserve.bench.workloads import Workload
from nanoserve.config import KERNEL, SWITCH_ALIASES, Optimizations, Platform
from nanoserve.model.m3_config import M3Config
from nanoserve.runner.model_runner import resolve_device, resolve_dtype

logger = logging.getLogger(__name__)


class PartTimeout(BaseException):
    """A part ran past what was left of the time budget (a BaseException, like KeyboardInterrupt, so the
    `except Exception` fallbacks inside a part - a failed graph capture, a failed ablation row - let it through)."""


def model_config(model: str) -> M3Config:
    from nanoserve.presets.catalog import PRESETS, get_preset

    if model in PRESETS:
        return get_preset(model).config
    from nanoserve.model.loader import read_config
    from nanoserve.presets.resolve import resolve_model_dir

    return read_config(resolve_model_dir(model))  # a shipped model (m3-mini) by name, or a directory


def device_and_switches(args) -> tuple[torch.device, Optimizations]:
    """The device bench's --device names (auto: a GPU when there is one) and the bench's switches there: on the CPU
    the reference kernels (Triton would run in its interpreter) unless --no-cpu-reference-kernels, then --switch and
    --enforce-eager."""
    on_gpu = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if on_gpu else "cpu")
    opts, _ = resolve_switches(device, args.cpu_reference_kernels is not False,
                               parse_switch_changes(args.switch, {"enforce_eager": args.enforce_eager}))
    return device, opts


def resolve_switches(device: torch.device, cpu_reference_kernels: bool, changes: dict[str, bool]
                     ) -> tuple[Optimizations, dict[str, str]]:
    """The effective switches: defaults, then CPU reference kernels / unavailable kernels off, then explicit
    changes. Returns (switches, why each forced-off switch is off)."""
    opts = Optimizations()
    notes: dict[str, str] = {}
    if device.type == "cpu" and cpu_reference_kernels:
        for name in Optimizations.names(KERNEL):
            setattr(opts, name, False)
            notes[name] = "CPU reference kernels (--cpu-reference-kernels)"
    else:
        for name, why in unavailable_kernel_switches().items():
            setattr(opts, name, False)
            notes[name] = f"kernel unavailable ({why})"
            logger.warning("switch %s forced off: %s", name, why)
    for name, value in changes.items():
        setattr(opts, name, value)
        notes.pop(name, None) if value else notes.setdefault(name, "turned off on the command line")
    return opts, notes


def parse_switch_changes(items: list[str], aliases: dict[str, bool]) -> dict[str, bool]:
    """--switch name=on|off (repeatable) plus vLLM-style alias flags."""
    out: dict[str, bool] = {}
    for alias, value in aliases.items():
        if value is not None:
            switch, on_value = SWITCH_ALIASES[alias]
            out[switch] = value == on_value
    names = set(Optimizations.names())
    for item in items:
        if "=" not in item:
            raise ValueError(f"--switch {item!r}: expected NAME=on|off")
        name, v = item.split("=", 1)
        if name not in names:
            raise ValueError(f"--switch: unknown switch {name!r}; known: {', '.join(sorted(names))}")
        if v.lower() not in ("on", "off", "1", "0", "true", "false"):
            raise ValueError(f"--switch {item!r}: value must be on or off")
        out[name] = v.lower() in ("on", "1", "true")
    return out


@dataclass
class SessionConfig:
    model: str
    device: str = "auto"
    dtype: str = "auto"
    out_dir: str | None = None
    seed: int = 0
    time_budget_s: float | None = None
    cpu_reference_kernels: bool | None = None  # None = on for a CPU device
    switch_changes: dict[str, bool] = field(default_factory=dict)
    max_num_batched_tokens: int | None = None
    hw: Ceilings = H200
    quantization: str | None = None
    """Weight format asked of the engine (vLLM's --quantization): None = the checkpoint's, "mxfp8"."""
    kv_cache_dtype: str = "auto"
    """The KV cache's element type (vLLM's --kv-cache-dtype): "auto" = the model dtype, "fp8" = e4m3."""
    copy_ceiling_known: bool | None = None
    """Whether hw's copy bandwidth is this device's, for the decode profile's % of ceiling: None = on a GPU (the
    H200 default or --peak-gbps) yes, on the CPU no; True when --peak-gbps gave it."""


class BenchSession:
    def __init__(self, cfg: SessionConfig):
        self.cfg = cfg
        self.t0 = time.perf_counter()
        self.device = resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        ref = cfg.cpu_reference_kernels if cfg.cpu_reference_kernels is not None else self.device.type == "cpu"
        self.opts, self.switch_notes = resolve_switches(self.device, ref, cfg.switch_changes)
        self.model_cfg = model_config(cfg.model)
        meta = environment(self.device)
        meta.update(model=cfg.model, quantization=cfg.quantization, kv_cache_dtype=cfg.kv_cache_dtype,
                    dtype=str(self.dtype).replace("torch.", ""), switches=self.opts.as_dict(),
                    switch_notes=self.switch_notes, ceilings=cfg.hw.name)
        self.meta = meta
        self.results = report.Results(cfg.out_dir, meta)
        self.nano: NanoBench | None = None
        self.platform: Platform | None = None  # what the switches run on, once the model is built
        self.hf = None
        self.nano_tokens: dict[str, list[list[int]]] = {}  # workload -> nanoserve's greedy tokens (vs HF)

    # -- time and guarded parts -----------------------------------------------------------------------------
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def time_left(self) -> float:
        if self.cfg.time_budget_s is None:
            return float("inf")
        return self.cfg.time_budget_s - self.elapsed()

    def part(self, name: str, fn: Callable[[], Any], min_time_s: float = 0.0, reserve_s: float = 0.0) -> Any:
        """Run one part: skipped if less than min_time_s of the budget is left, interrupted (SIGALRM, main thread
        only) when all but reserve_s of it is spent; errors are recorded, printed and swallowed; results are
        flushed either way."""
        left = self.time_left()
        if left < min_time_s:
            msg = f"skipped {name}: {left:.0f} s of the time budget left, it needs ~{min_time_s:.0f} s"
            print(f"[bench] {msg}", flush=True)
            self.results.add("notes", msg)
            return None
        print(f"[bench] {name} (t={self.elapsed():.0f} s)", flush=True)
        t0 = time.perf_counter()
        alarm = left != float("inf") and threading.current_thread() is threading.main_thread() \
            and hasattr(signal, "setitimer")
        if alarm:
            def on_alarm(signum, frame):
                raise PartTimeout(f"interrupted: the time budget ran out ({left - reserve_s:.0f} s for this part)")

            previous = signal.signal(signal.SIGALRM, on_alarm)
            signal.setitimer(signal.ITIMER_REAL, max(left - reserve_s, 1.0))
        try:
            out = fn()
            print(f"[bench] {name} done in {time.perf_counter() - t0:.1f} s", flush=True)
            return out
        except (Exception, PartTimeout) as e:  # noqa: BLE001 - keep going: one broken part must not lose the others
            tb = traceback.format_exc()
            print(f"[bench] {name} FAILED after {time.perf_counter() - t0:.1f} s: {type(e).__name__}: {e}\n{tb}",
                  flush=True)
            self.results.add("errors", {"part": name, "error": f"{type(e).__name__}: {e}", "traceback": tb})
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            return None
        finally:
            if alarm:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)
            self.results.flush()

    def say(self, text: str) -> None:
        print(text, flush=True)

    # -- nanoserve ------------------------------------------------------------------------------------------
    def build_nano(self, planned: list[Workload], max_num_seqs: int | None = None) -> NanoBench:
        """Build the nanoserve model once, with a KV pool and max_model_len that hold every planned workload."""
        if self.nano is not None:
            return self.nano
        bs = self.model_cfg.index_block_size
        need = max((w.max_total_len for w in planned), default=bs)
        max_len = min(-(-need // bs) * bs, self.model_cfg.max_position_embeddings)
        kv = max((w.kv_tokens(bs) for w in planned), default=bs)
        seqs = max_num_seqs or min(max((w.num_requests for w in planned), default=1), 512)
        self.nano = NanoBench(self.cfg.model, self.device.type, self.cfg.dtype, self.opts, max_model_len=max_len,
                              max_num_seqs=max(seqs, 1), kv_tokens=kv,
                              max_num_batched_tokens=self.cfg.max_num_batched_tokens, seed=self.cfg.seed,
                              hw=self.cfg.hw, quantization=self.cfg.quantization,
                              kv_cache_dtype=self.cfg.kv_cache_dtype)
        self.platform = self.nano.platform
        self.meta["switches_not_applicable"] = self.opts.not_applicable(self.platform)
        self.meta["nanoserve_build_s"] = self.nano.build_s
        self.meta["nanoserve_kv_blocks"] = self.nano.num_blocks
        self.meta["nanoserve_weight_memory"] = self.nano.weight_memory
        self.meta["nanoserve_max_model_len"] = max_len
        self.results.flush()
        return self.nano

    def close_nano(self) -> None:
        if self.nano is not None:
            self.nano.close()
            self.nano = None

    def run_nano(self, wl: Workload, warmup: bool = True) -> RunResult | None:
        nano = self.nano
        warm = nano.warmup(wl) if warmup else None
        res = nano.run(wl)
        res.extra["description"] = wl.description
        if warm is not None:  # the same shapes cold: what the timed run would have cost without the warm-up
            res.extra.update(warmup_ttft_ms=warm.ttft_ms["mean"], warmup_wall_s=warm.wall_s,
                             warmup_triton_builds=warm.extra.get("triton_builds"))
            self.say(f"[bench] {wl.name}: warm-up (cold) TTFT p50 {warm.ttft_ms['p50']:.1f} ms, "
                     f"{warm.extra.get('triton_builds')} kernel builds; timed TTFT p50 {res.ttft_ms['p50']:.1f} ms, "
                     f"{res.extra.get('triton_builds')} builds")
        if res.extra.get("triton_builds"):
            note = (f"{wl.name}: {res.extra['triton_builds']} Triton kernel build(s) inside the timed run "
                    f"({res.extra.get('triton_builds_kernels')}): its timings include them")
            self.say(f"[bench] WARNING {note}")
            self.results.add("notes", note)
        if res.extra.get("parameter_bytes"):  # (run() records the weight format and bytes)
            res.extra["weight_gib"] = res.extra["parameter_bytes"] / 2**30
        self.nano_tokens[wl.name] = res.token_ids
        self.results.add("runs", res.as_dict())
        self.say(report.runs_table([res.as_dict()]))
        return res

    def ablate(self, wl: Workload, only: list[str] | None = None, repeats: int = 1) -> dict:
        from nanoserve.bench.ablation import ablate

        partial = {"workload": wl.name, "rows": []}
        self.results.data["ablations"].append(partial)

        def on_row(row: dict) -> None:
            partial["rows"].append(row)
            self.results.flush()

        abl = ablate(self.nano, wl, self.switch_notes, self.cfg.model, self.meta, on_row=on_row, only=only,
                     repeats=repeats)
        self.results.data["ablations"][self.results.data["ablations"].index(partial)] = abl
        self.results.flush()
        self.say(abl["table"])
        if self.cfg.out_dir:
            report.plot_ablation(abl, os.path.join(self.cfg.out_dir, f"ablation_{wl.name}.png"))
            self.results.write_text(f"ablation_{wl.name}.txt", abl["table"])
        return abl

    def profile(self, wl: Workload, steps: int = 5) -> dict:
        from nanoserve.bench.profile import profile_decode

        prof = profile_decode(self.nano, wl, steps, copy_ceiling_known=self.cfg.copy_ceiling_known)
        self.results.add("profiles", prof)
        self.say(prof["table"])
        self.results.write_text(f"profile_{wl.name}.txt", prof["table"])
        return prof

    def profile_prefill(self, wl: Workload, chunk: int | None = None) -> dict:
        from nanoserve.bench.prefill_profile import profile_prefill

        prof = profile_prefill(self.nano, wl, chunk)
        self.results.add("prefill_profiles", prof)
        self.say(prof["table"])
        self.results.write_text(f"prefill_profile_{wl.name}_{prof['chunk']}.txt", prof["table"])
        return prof

    # -- Hugging Face ---------------------------------------------------------------------------------------
    def build_hf(self):
        if self.hf is None:
            from nanoserve.bench.hf import HFBench
            from nanoserve.presets.catalog import PRESETS, get_preset

            if self.cfg.model not in PRESETS:
                raise ValueError("the HF baseline draws the preset's random weights in memory: --model must be a "
                                 f"preset ({', '.join(sorted(PRESETS))})")
            self.close_nano()
            self.hf = HFBench(self.model_cfg, get_preset(self.cfg.model), self.device, self.dtype, self.cfg.hw)
            self.meta["hf_build_s"] = self.hf.build_s
        return self.hf

    def run_hf(self, wl: Workload, mode: str, max_tokens: int | None = None) -> RunResult | None:
        hf = self.build_hf()
        reason = hf.skip_reason(wl, mode)
        if reason:
            msg = f"HF {mode} {wl.name} not run: {reason}"
            self.say(f"[bench] {msg}")
            self.results.add("notes", msg)
            return None
        res = hf.run(wl, mode, max_tokens)
        if wl.name in self.nano_tokens and wl.greedy:
            from nanoserve.bench.ablation import first_divergence

            ours = [t[: len(h)] for t, h in zip(self.nano_tokens[wl.name], res.token_ids)]
            res.extra["first_divergence_vs_nanoserve"] = first_divergence(ours, res.token_ids)
        res.extra["description"] = wl.description
        self.results.add("runs", res.as_dict())
        self.say(report.runs_table([res.as_dict()]))
        return res

    def close_hf(self) -> None:
        if self.hf is not None:
            self.hf.close()
            self.hf = None

    # -- W3 -------------------------------------------------------------------------------------------------
    def serve(self, url: str, spec: dict, model_name: str | None = None, tokenizer=None) -> dict:
        from nanoserve.bench.serve import run_sweep, sweep_table

        sweep = run_sweep(url, model_name, spec["concurrency"], spec["requests_per_concurrency"], spec["prompt_len"],
                          spec["output_len"], tokenizer, self.cfg.seed, logprobs=spec.get("logprobs"),
                          on_level=lambda lv: print(f"[bench] W3 C={lv['concurrency']}: "
                                                    f"{lv['output_throughput']:.1f} out tok/s", flush=True))
        self.results.add("serve", sweep)
        self.say(sweep_table(sweep))
        if self.cfg.out_dir:
            report.plot_sweep(sweep, os.path.join(self.cfg.out_dir, "w3_sweep.png"))
        return sweep

    # -- the end --------------------------------------------------------------------------------------------
    def summary(self) -> str:
        d = self.results.data
        m = self.meta
        lines = [f"nanoserve bench | {m['model']} on {m['device']} | {m['date']} | commit {m['commit']} | "
                 f"torch {m['torch']}, triton {m['triton']}, transformers {m['transformers']}",
                 f"switches: {self.opts.describe(self.platform)}"]
        by_reason: dict[str, list[str]] = {}
        for k, v in self.switch_notes.items():
            by_reason.setdefault(v, []).append(k)
        for reason, names in by_reason.items():
            lines.append(f"forced off: {', '.join(names)}: {reason}")
        if d["runs"]:
            lines += ["", report.runs_table(d["runs"], "Runs (TTFT/TPOT from engine timestamps; GB/s and TFLOP/s "
                                                      "of the decode steps; % floor = TPOT floor / TPOT for one "
                                                      "request, tok/s / floor tok/s otherwise)")]
            ratio = report.hf_ratio_table(d["runs"])
            if ratio:
                lines += ["", ratio]
            if any(r["engine"] == "nanoserve" for r in d["runs"]):
                lines += ["", report.targets_table(d["runs"])]
        for a in d["ablations"]:
            if "table" in a:
                lines += ["", a["table"]]
        for p in d["profiles"] + d["prefill_profiles"]:
            lines += ["", p["table"]]
        if d["serve"]:
            from nanoserve.bench.serve import sweep_table

            lines += [""] + [sweep_table(s) for s in d["serve"]]
        for n in d["notes"]:
            lines.append(f"note: {n}")
        for e in d["errors"]:
            lines.append(f"ERROR in {e['part']}: {e['error']}")
        lines.append(f"total {self.elapsed():.0f} s" + (f"; results in {self.cfg.out_dir}/results.json"
                                                        if self.cfg.out_dir else ""))
        text = "\n".join(lines)
        self.results.write_text("summary.txt", text)
        if self.cfg.out_dir and d["runs"]:
            report.plot_runs(d["runs"], os.path.join(self.cfg.out_dir, "runs.png"))
        return text
