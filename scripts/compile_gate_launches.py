"""The Triton launches the engine makes, recorded from the real model without a GPU (for scripts/compile_gate.py,
which imports this module, scripts/compile_gate_launches.py).

The m3-slice model (the released widths, 4 layers: a dense-attention + dense-MLP layer, then three MSA + MoE
layers) is built on the `meta` device - shapes, dtypes and strides, no memory - and run forward over a set of
steps as the engine schedules them: decode batches, prefill chunks, a mixed step, and a chunk at the end of a
128k context (the `_long` prefill tiles). Everything in the forward runs as on a GPU except at four points,
patched for the recording only:

- `kernels.configs.backend` answers the backend being recorded ("hip" or "cuda"), so every wrapper picks that
  backend's column of the tile tables, exactly as on a card;
- `kernels.triton_usable` answers True, so every layer takes its Triton path (the switches at their defaults);
- `kernels.configs.sm_count` answers the card's multiprocessor count (split-K grids);
- `JITFunction.run` (under TRITON_INTERPRET=1, `InterpretedFunction.run`) - a kernel launch - binds the
  arguments with the target backend's own specialisation (argument types, 16-byte divisibility of pointers and
  integers, the AMD buffer-op range) and records the kernel, signature, constexprs, attributes and launch
  options instead of launching.

The collectives of the sharded layers (TP=4, TP=8, and TP=8 with EP=8) are no-ops here: only the shapes matter.
The KV pools are bf16, and once more fp8 (`--kv-cache-dtype fp8`) with bf16 weights on one GPU (the sharded
shapes change head counts, not the fp8 code): the attention, MSA and cache-insert kernels then read or write fp8;
a launch that run makes that a bf16-pool run made too (everything else) is kept once, under the bf16 runs, so
the CI subset grows by the fp8-KV launches only (six per backend). Likewise one more run with MXFP8 weights and
the `mx_activations` switch on (one GPU) adds the linears' activation quantize kernel and tl.dot_scaled GEMM.
A launch is deduplicated by (kernel, signature, constexprs, attributes, options) per backend; each keeps the
scenarios (weights, sharding, step) that made it.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field
from typing import Iterator
from unittest import mock

import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction, create_function_from_signature

import nanoserve.kernels as kernels_pkg
import nanoserve.parallel_state as parallel_state
from nanoserve.batch import AttentionMetadata
from nanoserve.config import Optimizations
from nanoserve.kernels import configs
from nanoserve.model.m3 import M3ForCausalLM
from nanoserve.parallel_state import set_tp
from nanoserve.presets.catalog import get_preset
from nanoserve.runner.kv_cache import allocate_kv_caches

RECORD_TARGET = {"hip": GPUTarget("hip", "gfx942", 64), "cuda": GPUTarget("cuda", 90, 32)}
"""The target whose backend specialises the arguments while recording (the specialisation is the backend's,
the same for both chips of a backend)."""
SM_COUNT = {"hip": 304, "cuda": 132}
"""Multiprocessors (CUs) the split-K grids are sized for while recording: MI300X, H100/H200."""

BLOCK_SIZE = 128
"""KV block size of the recorded steps (the MSA block size of M3; the recipe's --block-size)."""
WEIGHTS = ("bf16", "mxfp8")
SHARDINGS = {"tp1": (1, False), "tp4": (4, False), "tp8": (8, False), "tp8-ep8": (8, True)}
"""Name -> (tensor_parallel_size, enable_expert_parallel); each records rank 0's shard."""
FP8_KV = "bf16+fp8-kv"
"""The weight-format label of the runs with fp8 KV pools (bf16 weights: the attention side does not depend on
the weights' format), recorded at FP8_KV_SHARDINGS."""
FP8_KV_SHARDINGS = ("tp1",)
MX_ACT = "mxfp8+mx-act"
"""The weight-format label of the run with the `mx_activations` switch on (MXFP8 weights and activations: the
linears' tl.dot_scaled kernel and its quantize kernel), recorded on one GPU: the sharded shapes change N and K,
not the code."""
RUNS = [(weights, sharding, torch.bfloat16) for weights in WEIGHTS for sharding in SHARDINGS] + \
    [(FP8_KV, sharding, torch.float8_e4m3fn) for sharding in FP8_KV_SHARDINGS] + [(MX_ACT, "tp1", torch.bfloat16)]
"""(weight-format label, sharding, KV pool dtype) of every recorded run."""
EXTRA_RUNS = (FP8_KV, MX_ACT)
"""Runs recorded apart: a launch one of them makes that a plain bf16 / MXFP8 run made too is kept under the
plain run, so each adds only its own launches to the CI subset."""


def _steps() -> list[tuple[str, list[int], list[int]]]:
    """(name, query_lens, seq_lens) of the recorded steps: every token count the tile tables' buckets tell apart
    (1 ... 16,384 tokens; decode batches as the CUDA graphs pad them), a mixed step of decodes and a prefill
    chunk, and a chunk at the end of a 128k context."""
    steps = [(f"decode-{n}", [1] * n, [2048] * n) for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)]
    steps.append(("decode-1-128k", [1], [131072]))
    steps += [(f"prefill-{n}", [n], [n]) for n in (512, 1024, 2048, 4096, 8192, 16384)]
    steps.append(("mixed-63+2048", [1] * 63 + [2048], [4096] * 63 + [6144]))
    steps.append(("prefill-16384-at-128k", [16384], [131072]))
    return steps


STEPS = _steps()


@dataclass
class Launch:
    """One distinct kernel launch, as the backend would compile it. Plain data: it crosses to compile workers."""

    kernel: str
    """module:qualname of the @triton.jit function."""
    signature: dict[str, str]
    constexprs: dict[tuple, object]
    attrs: dict[tuple, list]
    options: dict[str, object]
    """Launch options the wrapper passed (num_warps, num_stages, ...)."""
    backend: str
    scenarios: set[tuple[str, str, str]] = field(default_factory=set)
    """(weights, sharding, step) that made this launch."""

    @property
    def key(self) -> tuple:
        return (self.backend, self.kernel, tuple(self.signature.items()),
                tuple(sorted((k, repr(v)) for k, v in self.constexprs.items())),
                tuple(sorted((k, repr(v)) for k, v in self.attrs.items())), tuple(sorted(self.options.items())))

    @property
    def short_name(self) -> str:
        return self.kernel.rsplit(":", 1)[-1]

    def named_constexprs(self) -> dict[str, object]:
        """The constexprs by parameter name (for reports and for choosing a representative subset)."""
        names = list(self.signature)
        return {names[k[0]] if len(k) == 1 else str(k): v for k, v in self.constexprs.items()}


_JIT_ARGS = ("version", "do_not_specialize", "do_not_specialize_on_alignment", "debug", "noinline", "repr",
             "launch_metadata")


def as_jit(kernel) -> JITFunction:
    """The kernel as a JITFunction: itself, or - when TRITON_INTERPRET=1 made it an InterpretedFunction (the CPU
    test run) - one built from the same function with the same decorator arguments, for its signature and
    specialisation rules. (Compiling needs the real module: scripts/compile_gate.py compiles in worker processes
    started without TRITON_INTERPRET.)"""
    if isinstance(kernel, JITFunction):
        return kernel
    cached = _JIT_TWINS.get(id(kernel))
    if cached is None:
        cached = _JIT_TWINS[id(kernel)] = JITFunction(kernel.fn, **{k: v for k, v in kernel.kwargs.items()
                                                                if k in _JIT_ARGS})
    return cached


_JIT_TWINS: dict[int, JITFunction] = {}  # by the interpreted kernel's id (module-level: they live on)


def _recorder(backend: str, launches: dict[tuple, Launch], scenario: list):
    target_backend = make_backend(RECORD_TARGET[backend])
    binders: dict[int, object] = {}  # by id: a JITFunction's hash walks its source's dependencies
    seen: dict[tuple, Launch] = {}

    def run(self, *args, grid, warmup, **kwargs):
        jit = as_jit(self)
        binder = binders.get(id(jit))
        if binder is None:
            binder = binders[id(jit)] = create_function_from_signature(jit.signature, jit.params, target_backend)
        bound, specialization, options = binder(*args, **kwargs)
        seen_key = (id(jit), repr(specialization), repr(sorted(kwargs.items())))  # as Triton's own kernel cache
        launch = seen.get(seen_key)
        if launch is None:
            _, signature, constexprs, attrs = jit._pack_args(target_backend, kwargs, bound, specialization, options)
            launch = Launch(f"{jit.fn.__module__}:{jit.fn.__qualname__}", signature, constexprs, attrs,
                            {k: v for k, v in kwargs.items() if k not in signature}, backend)
            launch = seen[seen_key] = launches.setdefault(launch.key, launch)
        launch.scenarios.add(tuple(scenario))
        return None

    return run


@contextlib.contextmanager
def recording(backend: str, launches: dict[tuple, Launch], scenario: list, run=None) -> Iterator[None]:
    """Within: nanoserve's kernels record their launches into `launches` as `backend` would make them, each
    tagged with the current `scenario`. `run`: a recorder of _recorder's kind to reuse across calls (it remembers
    the launches it has bound)."""
    originals = {"backend": configs.backend, "triton_usable": kernels_pkg.triton_usable,
                 "sm_count": configs.sm_count}
    replacements = {"backend": lambda device: backend, "triton_usable": lambda device: True,
                    "sm_count": lambda device: SM_COUNT[backend]}
    with contextlib.ExitStack() as stack:
        for name, module in list(sys.modules.items()):
            if not name.startswith("nanoserve"):
                continue
            for attr, original in originals.items():
                if getattr(module, attr, None) is original:  # every module that imported the function by name
                    stack.enter_context(mock.patch.object(module, attr, replacements[attr]))
        run = run or _recorder(backend, launches, scenario)
        stack.enter_context(mock.patch.object(JITFunction, "run", run))
        stack.enter_context(mock.patch.object(InterpretedFunction, "run", run))
        stack.enter_context(mock.patch.object(parallel_state.dist, "all_reduce", lambda *a, **k: None))
        stack.enter_context(mock.patch.object(parallel_state.dist, "all_gather", lambda *a, **k: None))
        yield


def _import_kernels() -> None:
    """Import every kernel module before patching, so each name-imported function is found and replaced."""
    import nanoserve.kernels.attention  # noqa: F401
    import nanoserve.kernels.fp8_linear  # noqa: F401
    import nanoserve.kernels.gemv  # noqa: F401
    import nanoserve.kernels.moe  # noqa: F401
    import nanoserve.kernels.msa  # noqa: F401
    import nanoserve.kernels.mx_linear  # noqa: F401
    import nanoserve.kernels.norm_rope  # noqa: F401
    import nanoserve.kernels.swiglu  # noqa: F401


def record_launches(backends: list[str]) -> dict[str, list[Launch]]:
    """Every distinct launch of the m3-slice model's forward and LM head over STEPS, for each run of RUNS (weight
    format, sharding, KV pool dtype), with each backend's tiles: {backend: launches}."""
    _import_kernels()
    cfg = get_preset("m3-slice").config
    launches: dict[str, dict[tuple, Launch]] = {backend: {} for backend in backends}
    extra = {label: {backend: {} for backend in backends} for label in EXTRA_RUNS}  # their launches, apart
    scenario: list = []
    recorders = {backend: _recorder(backend, launches[backend], scenario) for backend in backends}
    extra_recorders = {label: {backend: _recorder(backend, extra[label][backend], scenario) for backend in backends}
                       for label in EXTRA_RUNS}
    saved_tp = parallel_state.get_tp()
    try:
        for weights, sharding, kv_dtype in RUNS:
            tp, ep = SHARDINGS[sharding]
            set_tp(0, tp, None, ep)
            model = M3ForCausalLM(cfg, Optimizations(mx_activations=weights == MX_ACT), torch.bfloat16, "meta",
                                  "mxfp8" if weights in ("mxfp8", MX_ACT) else None)
            longest = max(max(seq_lens) for _, _, seq_lens in STEPS)
            kv, index = allocate_kv_caches(cfg, -(-longest // BLOCK_SIZE), BLOCK_SIZE, kv_dtype, "meta")
            model.bind_kv_caches(kv, index)
            for step, query_lens, seq_lens in STEPS:
                scenario[:] = [weights, sharding, step]
                tables = [list(range(-(-n // BLOCK_SIZE))) for n in seq_lens]
                meta = AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK_SIZE, device="meta")
                ids = torch.zeros(sum(query_lens), dtype=torch.long, device="meta")
                last = (torch.tensor(query_lens).cumsum(0) - 1).to("meta")
                for backend in backends:
                    record = extra_recorders[weights][backend] if weights in extra else recorders[backend]
                    with recording(backend, launches[backend], scenario, record):
                        model.compute_logits(model(ids, meta.positions, meta)[last])
        for backend in backends:
            for label in EXTRA_RUNS:
                for key, launch in extra[label][backend].items():
                    launches[backend].setdefault(key, launch)  # a launch a plain run made too stays under it
    finally:
        set_tp(saved_tp.rank, saved_tp.size, saved_tp.group, saved_tp.expert_parallel)
    return {backend: list(found.values()) for backend, found in launches.items()}
