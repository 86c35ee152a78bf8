"""Engine configuration and the optimization switches, in one place.

`Optimizations` lists every optimization nanoserve has. Each field is a switch with a plain reference path behind
it (the module named in its docstring), so `python -m nanoserve.bench --ablate` can turn them off one at a time.
`EngineConfig` holds everything else an engine is built from; the vLLM-named keyword arguments of `LLM(...)` land
here, and the ones that name a switch (`enable_prefix_caching`, `enforce_eager`, ...) are aliases of that switch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any


@dataclass
class Optimizations:
    """Every optimization switch. Defaults: on where it applies. Approximations that change outputs: off."""

    paged_kv: bool = True
    """engine/block_manager.py: allocate KV blocks on demand (off: reserve max_model_len per sequence at admission)."""
    prefix_caching: bool = True
    """engine/block_manager.py: reuse the KV of full blocks already computed for an identical prefix."""
    continuous_batching: bool = True
    """engine/scheduler.py: admit new requests every step (off: a new batch starts only when the last is done)."""
    chunked_prefill: bool = True
    """engine/scheduler.py: split long prompts across steps to fit the token budget beside running decodes."""
    cuda_graphs: bool = True
    """runner/cuda_graphs.py: capture decode steps as CUDA/HIP graphs per batch-size bucket (GPU only)."""
    triton_attention: bool = True
    """kernels/attention.py: Triton paged attention for the dense layers (prefill + split-K decode)."""
    triton_msa: bool = True
    """kernels/msa.py: Triton MSA indexer scores, block top-k and block-sparse attention."""
    fused_moe: bool = True
    """kernels/moe.py: Triton fused MoE (device-side alignment, grouped GEMMs with the SwiGLU-OAI epilogue)."""
    fold_shared_expert: bool = True
    """kernels/moe.py: run the shared expert as an extra always-selected slot of the fused MoE launch."""
    fused_qk_norm_rope: bool = True
    """kernels/norm_rope.py: per-head QK-norm + partial RoPE + K/V and index-key cache insert in one launch."""
    fused_add_rmsnorm: bool = True
    """kernels/norm_rope.py: Gemma RMSNorm fused with the residual add."""
    fast_input_prep: bool = True
    """runner/model_runner.py: build a step's input tensors with numpy into pinned buffers, one host-to-device copy
    per dtype (off: AttentionMetadata.build, a Python loop per token, and one copy per tensor)."""
    overlap_scheduling: bool = True
    """engine/llm_engine.py: schedule and launch step N+1 before detokenising step N's tokens, so the host work on
    outputs runs while the device computes (off: each step waits for its tokens and finishes them first)."""
    mxfp8_weights: bool = True
    """kernels/fp8_linear.py, kernels/moe.py: keep an MXFP8 checkpoint's fp8 weights + E8M0 scales on the device and
    dequantise in registers (off: dequantise to bf16 at load). No effect on bf16 checkpoints."""
    triton_fp8_linear: bool = True
    """kernels/fp8_linear.py: the Triton GEMM for MXFP8 weights (dequantised in registers) in every quantized linear
    (off: kernels/reference.py fp8_linear, dequantise then F.linear)."""
    msa_topk_reuse: bool = False
    """APPROXIMATION (changes outputs): reuse one MSA layer's block selection in the next layer(s)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, bool):
                raise ValueError(f"optimization switch {f.name}={value!r} is invalid: must be True or False")

    @classmethod
    def reference(cls) -> "Optimizations":
        """Every switch off: the plain reference path everywhere."""
        return cls(**{f.name: False for f in fields(cls)})

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def approximations(cls) -> list[str]:
        return [f.name for f in fields(cls) if f.default is False and f.name != "paged_kv"]

    def replace(self, **changes: bool) -> "Optimizations":
        for k in changes:
            if k not in self.names():
                raise ValueError(f"unknown optimization switch {k!r}; known: {', '.join(self.names())}")
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict[str, bool]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def describe(self) -> str:
        on = [n for n, v in self.as_dict().items() if v]
        off = [n for n, v in self.as_dict().items() if not v]
        return f"on: {', '.join(on) or '-'}; off: {', '.join(off) or '-'}"


# vLLM-named engine arguments that are aliases of a switch: name -> (switch, value meaning "on")
SWITCH_ALIASES: dict[str, tuple[str, bool]] = {
    "enable_prefix_caching": ("prefix_caching", True),
    "enable_chunked_prefill": ("chunked_prefill", True),
    "enforce_eager": ("cuda_graphs", False),
}

DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = (None, "mxfp8")
DEVICES = ("auto", "cpu", "cuda")
DEFAULT_CPU_KV_TOKENS = 32768
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


@dataclass
class EngineConfig:
    """What an engine is built from. Field names follow vLLM's engine arguments."""

    model: str = "m3-tiny"
    """A checkpoint directory or a preset name (m3-tiny, m3-slice) with random weights."""
    tokenizer: str | None = None
    dtype: str = "auto"
    quantization: str | None = None
    """Weight format: None = the checkpoint's (bf16, or MXFP8 when config.json says so); "mxfp8" also quantises a
    bf16 checkpoint or preset at load (vLLM's `--quantization`)."""
    device: str = "auto"
    max_model_len: int | None = None
    block_size: int | None = None
    """KV block size in tokens; must equal the model's MSA block size (None = that size)."""
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    """Fix the KV pool size (blocks), on CPU or GPU."""
    kv_cache_tokens: int | None = None
    """CPU KV budget in tokens (GPU: sized from gpu_memory_utilization)."""
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    seed: int = 0
    max_waiting_requests: int = 1024
    max_logprobs: int = 20
    logprobs_mode: str = "raw_logprobs"
    """What logprobs report (vLLM's values): raw_* of the model's logits before any sampling step; processed_* of
    the logits the draw used (after allowed_token_ids, bad_words, min_tokens, logit_bias, penalties, temperature
    and top-k/top-p/min-p); *_logprobs as log-softmax, *_logits as the logits themselves."""
    served_model_name: str | None = None
    distributed_init_method: str | None = None
    """torch.distributed rendezvous (tcp://host:port or env://); None picks a free loopback port."""
    optimizations: Optimizations = field(default_factory=Optimizations)

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        """Build from vLLM-style keyword arguments; switch aliases (enable_prefix_caching=...) set switches."""
        opts = kwargs.pop("optimizations", None) or Optimizations()
        if not isinstance(opts, Optimizations):
            raise ValueError(f"optimizations must be an Optimizations instance, got {type(opts).__name__}")
        switch_changes = {}
        for alias, (switch, on_value) in SWITCH_ALIASES.items():
            if alias in kwargs:
                value = kwargs.pop(alias)
                if value is None:
                    continue
                if not isinstance(value, bool):
                    raise ValueError(f"{alias} must be a bool, got {value!r}")
                switch_changes[switch] = value == on_value
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(optimizations=opts.replace(**switch_changes), **kwargs)

    def validate(self) -> None:
        def need(cond: bool, name: str, allowed: str) -> None:
            if not cond:
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: {allowed}")

        def is_int(v: Any) -> bool:  # bool is an int subclass, but True is no size
            return isinstance(v, int) and not isinstance(v, bool)

        def int_in(name: str, lo: int, hi: int | None = None, optional: bool = False) -> None:
            v = getattr(self, name)
            if optional and v is None:
                return
            allowed = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]"
            need(is_int(v) and v >= lo and (hi is None or v <= hi), name, allowed + (" or None" if optional else ""))

        need(isinstance(self.model, str) and bool(self.model), "model", "a checkpoint directory or preset name")
        need(self.tokenizer is None or (isinstance(self.tokenizer, str) and bool(self.tokenizer)), "tokenizer",
             "a tokenizer directory or None")
        need(self.dtype in DTYPES, "dtype", f"one of {', '.join(DTYPES)}")
        need(self.quantization in QUANTIZATIONS, "quantization", "None or 'mxfp8'")
        need(self.device in DEVICES, "device", f"one of {', '.join(DEVICES)}")
        int_in("max_model_len", 1, optional=True)
        int_in("block_size", 1, optional=True)
        int_in("max_num_seqs", 1)
        int_in("max_num_batched_tokens", 1, optional=True)
        need(isinstance(self.gpu_memory_utilization, (int, float)) and not isinstance(self.gpu_memory_utilization, bool)
             and 0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization", "a fraction in (0, 1]")
        int_in("num_gpu_blocks_override", 1, optional=True)
        int_in("kv_cache_tokens", 1, optional=True)
        int_in("tensor_parallel_size", 1, 64)
        need(isinstance(self.enable_expert_parallel, bool), "enable_expert_parallel", "True or False")
        need(is_int(self.seed), "seed", "an integer")
        int_in("max_waiting_requests", 1)
        int_in("max_logprobs", 0, 1000)
        need(self.logprobs_mode in LOGPROBS_MODES, "logprobs_mode", f"one of {', '.join(LOGPROBS_MODES)}")
        need(isinstance(self.optimizations, Optimizations), "optimizations", "an Optimizations instance")
