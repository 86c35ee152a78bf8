"""Engine configuration and the optimization switches, in one place.

`Optimizations` lists every optimization nanoserve has. Each field is one `switch(...)` declaration: its default,
whether it is exact or an approximation, the layer of the stack it touches, the module that implements it and the
reference path that runs when it is off. Everything else is derived from these declarations: the server's
`--<switch>` / `--no-<switch>` flags, the rows of `python -m nanoserve.bench --ablate`, which switches drop the
captured CUDA graphs when flipped, the bench's kernel availability probe and the switch table in
docs/architecture.md. Adding a switch means adding its declaration here and the code that reads it.

`EngineConfig` holds everything else an engine is built from; the vLLM-named keyword arguments of `LLM(...)` land
here, and the ones that name a switch (`enable_prefix_caching`, `enforce_eager`, ...) are aliases of that switch.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field, fields
from typing import Any

ENGINE, MODEL, KERNEL = "engine", "model", "kernel"
"""The layer a switch touches. ENGINE: read by the scheduler, block manager, engine loop or model runner, so it
takes effect in the next engine built. MODEL: read by the model's layers at forward time, or - a `build_time`
switch - when the model is built (it decides the parameters), so it takes effect in the next model built. KERNEL:
selects a Triton kernel (or its kernels/reference.py twin) inside a model layer, also at forward time. MODEL and KERNEL
switches are baked into captured CUDA graphs, so flipping one drops them; on the CPU the tests turn
the KERNEL ones off."""
LAYERS = (ENGINE, MODEL, KERNEL)


@dataclass(frozen=True)
class Switch:
    """One optimization switch, as declared in `Optimizations` with `switch(...)`."""

    name: str
    default: bool
    layer: str  # ENGINE, MODEL or KERNEL
    module: str  # the file that implements it, relative to nanoserve/ ("kernels/moe.py")
    does: str  # what it does when on
    reference: str  # what runs instead when it is off
    exact: bool  # False: an approximation that changes outputs (off by default)
    entry_points: tuple[str, ...]  # KERNEL: the functions the model imports from `module` (the bench probes them)
    build_time: bool = False  # read when the model is built (parameter dtypes, layouts): flipping it needs a rebuild

    @property
    def import_path(self) -> str:
        """`module` as a Python module name (nanoserve.kernels.moe)."""
        return "nanoserve." + self.module.removesuffix(".py").replace("/", ".")

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def doc(self) -> str:
        """One line for --help and the docs: module, what it does, the off path."""
        prefix = "" if self.exact else "APPROXIMATION (changes outputs): "
        return f"{self.module}: {prefix}{self.does} (off: {self.reference})"


def switch(default: bool, layer: str, module: str, does: str, reference: str, *, exact: bool = True,
           entry_points: tuple[str, ...] = (), build_time: bool = False) -> Any:
    """Declare one optimization switch as a field of `Optimizations` (see `Switch` for the arguments)."""
    if layer not in LAYERS:
        raise ValueError(f"switch layer must be one of {', '.join(LAYERS)}, got {layer!r}")
    if not exact and default:
        raise ValueError("an approximation must be off by default")
    if layer == KERNEL and not entry_points:
        raise ValueError("a kernel switch must name the functions it selects (entry_points)")
    if build_time and layer != MODEL:
        raise ValueError("only a MODEL switch can be read when the model is built (build_time)")
    spec = dict(default=default, layer=layer, module=module, does=does, reference=reference, exact=exact,
                entry_points=tuple(entry_points), build_time=build_time)
    return field(default=default, metadata={"switch": spec})


@dataclass
class Optimizations:
    """Every optimization switch, one declaration each. Defaults: on where it applies. Approximations that change
    outputs: off, and so is an exact one measured slower than its reference (spec_multi_step). Read them as
    attributes (`opts.fused_moe`); the declarations as `Optimizations.switches()`."""

    paged_kv: bool = switch(
        True, ENGINE, "engine/block_manager.py", "allocate KV blocks on demand as a sequence grows",
        "reserve max_model_len tokens of blocks per sequence at admission")
    prefix_caching: bool = switch(
        True, ENGINE, "engine/block_manager.py", "reuse the KV of full blocks already computed for an identical prefix",
        "no prefix lookups: every prompt computes all of its KV")
    continuous_batching: bool = switch(
        True, ENGINE, "engine/scheduler.py", "admit new requests every step",
        "a new batch starts only when the last is done")
    chunked_prefill: bool = switch(
        True, ENGINE, "engine/scheduler.py",
        "split long prompts across steps to fit the token budget beside running decodes",
        "a prompt is scheduled whole or not at all")
    cuda_graphs: bool = switch(
        True, ENGINE, "runner/cuda_graphs.py", "capture decode steps as CUDA/HIP graphs per batch-size bucket "
        "(GPU only)", "eager decode, one launch at a time")
    triton_attention: bool = switch(
        True, KERNEL, "kernels/attention.py", "Triton paged attention for the dense layers (prefill + split-K decode)",
        "kernels/reference.py paged_attention", entry_points=("paged_attention",))
    triton_msa: bool = switch(
        True, KERNEL, "kernels/msa.py", "Triton MSA indexer scores, block top-k and block-sparse attention",
        "kernels/reference.py msa_select and sparse_attention", entry_points=("msa_select", "sparse_attention"))
    msa_sparse_by_block: bool = switch(
        True, KERNEL, "kernels/msa.py", "MSA prefill attention grouped by KV block: the (token, block) pairs sorted "
        "by block, each selected block read once per tile of up to 8 tokens that chose it, partial results merged "
        "per token", "the per-token-tile Triton kernel, which reads every selected block once per token",
        entry_points=("sparse_attention",))
    fused_moe: bool = switch(
        True, KERNEL, "kernels/moe.py",
        "Triton fused MoE (device-side alignment, grouped GEMMs with the SwiGLU-OAI epilogue)",
        "kernels/reference.py moe_experts, a loop over the selected experts", entry_points=("fused_moe",))
    fold_shared_expert: bool = switch(
        True, KERNEL, "kernels/moe.py", "run the shared expert as an extra always-selected slot of the fused MoE "
        "launch", "the shared expert as a separate PyTorch MLP", entry_points=("fused_moe",))
    moe_tma: bool = switch(
        True, KERNEL, "kernels/moe.py", "the fused MoE's GEMMs load weight tiles (and GEMM 2 its activation tiles) "
        "through TMA tensor descriptors where the tile table's entry says \"tma\" (16-bit experts, prefill-sized "
        "buckets)", "pointer loads with the same tiles", entry_points=("fused_moe",))
    moe_dequant_prefill: bool = switch(
        True, KERNEL, "kernels/moe.py", "MXFP8 experts in a fused MoE call of at least moe.MOE_DEQUANT_MIN_TOKENS "
        "tokens (a long prompt's prefill chunk) are dequantised to the model dtype, a group of expert slots of at "
        "most moe.MOE_DEQUANT_GROUP_BYTES (2 GiB) at a time, and run the 16-bit kernels: faster there, for a "
        "transient of up to 2 GiB that the KV cache is sized with", "the MXFP8 kernels, which dequantise each "
        "tile in registers", entry_points=("fused_moe",))
    moe_wgmma: bool = switch(
        True, KERNEL, "kernels/moe_wgmma.py", "on Hopper (sm_90), MXFP8 experts in a fused MoE call of at least "
        "moe.MOE_WGMMA_MIN_TOKENS tokens run Gluon kernels that dequantise the weights straight into the warpgroup "
        "MMA's register operand in two warpgroups taking turns, fed by a TMA / cp.async loader warpgroup; takes "
        "precedence over moe_dequant_prefill", "the Triton MXFP8 kernels of kernels/moe.py (and, for a call of at "
        "least moe.MOE_DEQUANT_MIN_TOKENS tokens, moe_dequant_prefill)", entry_points=("supported", "gemms"))
    triton_gemv: bool = switch(
        True, KERNEL, "kernels/gemv.py", "one-row (decode) products with a weight of a tuned shape run a Triton "
        "GEMV that streams the weight once (kernels/configs.py GEMV_TILES for 16-bit weights, GEMV_MXFP8_TILES for "
        "MXFP8 ones)", "F.linear (the library GEMM), or kernels/fp8_linear.py for MXFP8 weights",
        entry_points=("gemv", "gemv_mxfp8"))
    fused_routing: bool = switch(
        True, KERNEL, "kernels/moe_route.py", "with fused_moe, decode batches of up to 12 tokens (M3) are routed "
        "(sigmoid, biased top-k, renormalised weights) and aligned in one single-program launch",
        "kernels/reference.py route (torch: sigmoid, topk, gather, sum) and moe_align's two launches",
        entry_points=("route_and_align",))
    fused_qk_norm_rope: bool = switch(
        True, KERNEL, "kernels/norm_rope.py",
        "per-head QK-norm + partial RoPE + K/V and index-key cache insert in one launch",
        "kernels/reference.py qk_norm_rope, write_kv and write_index_keys", entry_points=("qk_norm_rope_insert",))
    fused_add_rmsnorm: bool = switch(
        True, KERNEL, "kernels/norm_rope.py", "Gemma RMSNorm fused with the residual add",
        "kernels/reference.py add_gemma_rmsnorm", entry_points=("fused_add_rmsnorm",))
    fused_swiglu: bool = switch(
        True, KERNEL, "kernels/swiglu.py", "the dense MLP's clamped SwiGLU-OAI (gate|up -> activation) in one launch",
        "kernels/reference.py swiglu_oai, about ten element-wise kernels in fp32, then the cast",
        entry_points=("swiglu_oai",))
    fused_rmsnorm: bool = switch(
        True, KERNEL, "kernels/norm_rope.py", "a Gemma RMSNorm without a residual add (the first layer's input norm) "
        "in one launch", "kernels/reference.py gemma_rmsnorm, about eight element-wise kernels",
        entry_points=("fused_rmsnorm",))
    triton_vision_attention: bool = switch(
        True, KERNEL, "kernels/vision_attention.py", "the vision tower's partial 3-D RoPE and its bidirectional "
        "attention within each image / video segment: one rotation launch and one varlen flash-attention launch "
        "for a whole batch of images", "kernels/reference.py apply_partial_rope on q and k, then varlen_attention "
        "(a loop over segments, fp32 scores)", entry_points=("vision_attention",))
    fused_layer_norm: bool = switch(
        True, KERNEL, "kernels/layer_norm.py", "the vision tower's LayerNorms, each fused with the residual add "
        "before it, in one launch", "kernels/reference.py layer_norm and add_layer_norm (the add, then "
        "F.layer_norm)", entry_points=("layer_norm", "add_layer_norm"))
    mxfp8_weights: bool = switch(
        True, MODEL, "model/layers/linear.py", "keep an MXFP8 checkpoint's fp8 weights + E8M0 scales as the "
        "parameters of every quantized linear and of the expert stacks, dequantised inside the GEMM (MODEL, not "
        "KERNEL: it decides the parameters' dtype when the model is built, and the plain-PyTorch path reads fp8 "
        "too); no effect on bf16 checkpoints", "dequantise to the model dtype at load", build_time=True)
    triton_fp8_linear: bool = switch(
        True, KERNEL, "kernels/fp8_linear.py", "the Triton GEMM for MXFP8 weights (dequantised in registers) in every "
        "quantized linear", "kernels/reference.py fp8_linear, dequantise then F.linear", entry_points=("fp8_linear",))
    fp8_linear_wgmma: bool = switch(
        True, KERNEL, "kernels/fp8_linear_wgmma.py", "on Hopper (sm_90), an MXFP8 linear of at most "
        "fp8_linear.FP8_WGMMA_MAX_ROWS rows that would dequantise in registers (a decode step, or a captured "
        "batch) runs a Gluon kernel that streams the weights by TMA and dequantises them straight into the "
        "warpgroup MMA's register operand, K split across programs to fill one wave",
        "the Triton fp8 GEMM of kernels/fp8_linear.py (tiles from its table)",
        entry_points=("supported", "partial_sums"))
    rope_table: bool = switch(
        True, MODEL, "model/m3.py", "RoPE cos/sin gathered from a table computed once per context length (one "
        "launch per step)", "kernels/reference.py rope_cos_sin from the positions, four launches")
    captured_argmax: bool = switch(
        True, MODEL, "runner/cuda_graphs.py", "the decode graph also takes each row's argmax, and a batch of plain "
        "greedy rows (temperature 0, no logprobs, no logit processing) takes its tokens from it (MODEL: it changes "
        "what a graph records)", "the sampler copies the logits and launches its own argmax after the replay")
    fast_input_prep: bool = switch(
        True, ENGINE, "runner/input_prep.py",
        "build a step's input tensors with numpy into pinned buffers, one host-to-device copy per dtype",
        "reference_prepare: AttentionMetadata.build, a Python loop per token, and one copy per tensor")
    encoder_cache: bool = switch(
        True, ENGINE, "engine/encoder_cache.py", "the vision features of an image or video are kept by its content "
        "hash after the prefill that used them, until the cache needs their room, and shared by every sequence "
        "that sends the same item: an image sent again is not encoded again",
        "each sequence's images and videos are encoded for it alone and dropped once its prefill has passed them")
    overlap_scheduling: bool = switch(
        True, ENGINE, "engine/llm_engine.py", "schedule and launch step N+1 before detokenising step N's tokens, "
        "so the host work on outputs runs while the device computes",
        "each step waits for its tokens and finishes them first")
    async_scheduling: bool = switch(
        True, ENGINE, "engine/llm_engine.py", "with overlap_scheduling, step N+1 is launched before step N's tokens "
        "reach the host: a decode's input token is copied from step N's sampled tokens on the device, so the "
        "device does not wait through the host's turn (receive, schedule, stage) between steps (tensor_parallel_size "
        "1; a step waits for the tokens first when a running request's sampling reads its own output on the host: "
        "structured outputs, bad_words, penalties, or prompt logprobs)",
        "each step is launched once the previous step's tokens are on the host")
    overlap_grammar: bool = switch(
        True, ENGINE, "engine/structured_output.py", "structured outputs' host work runs while the forward runs: "
        "the grammars accept the previous step's tokens in one batched call after the forward is launched (EOS, "
        "which may end a format, at once), and the step's masks are filled while the forward runs", "each token is "
        "accepted by its grammar as it is received, before the next step is scheduled")
    constrained_tool_calls: bool = switch(
        True, ENGINE, "server/prepare.py", "with tool_choice auto, a tool call the model opens (the tool-call "
        "parser's start marker) is held by structured decoding to the offered tools' names and parameter schemas: "
        "an xgrammar structural tag triggered by the marker (the text around calls stays free; with a "
        "response_format the answer is that format or a call), after the thinking the reasoning parser allows",
        "the output is not constrained; the tool-call parser drops a call to a function the request did not offer "
        "and an argument under a key its parameters do not declare, with a logged warning")
    speculative_decoding: bool = switch(
        True, ENGINE, "spec_decode/proposer.py", "with a speculative_config (--speculative-config): each decoding "
        "sequence drafts up to k tokens (ngram prompt lookup, the checkpoint's MTP module or an EAGLE-3 draft) and "
        "one target pass verifies them, keeping the longest accepted prefix plus one token (greedy: token for token "
        "the same output; sampling: rejection sampling, the same distribution); without a speculative_config "
        "nothing changes",
        "one token per sequence per step; a speculative_config given is not used (logged at start)")
    spec_cuda_graphs: bool = switch(
        True, ENGINE, "runner/cuda_graphs.py", "with cuda_graphs and a speculative_config: a verify step whose "
        "sequences all feed the same number of tokens (2 to k + 1) replays a graph keyed by (batch bucket, context "
        "bucket, query length), a model-based drafter (mtp, eagle3) no longer turns graphs off (the graph writes "
        "what it reads into a static buffer), and the draft model's passes (mtp, eagle3) replay graphs of their own",
        "verify steps run eagerly; with an mtp or eagle3 drafter every step and draft pass runs eagerly")
    spec_greedy_accept: bool = switch(
        True, ENGINE, "spec_decode/verify.py", "a verify step whose sequences are all plain greedy (temperature 0, no "
        "logprobs, no logit processing, no structured output) queues one argmax over its rows and copies it to the "
        "host, where each draft is compared with it (the longest matching prefix, then the argmax)",
        "every verify step runs the rejection sampler on the device over the target distributions (one-hot at the "
        "argmax for a greedy row)")
    spec_draft_chain: bool = switch(
        True, ENGINE, "spec_decode/draft_chain.py", "with a draft model (mtp, eagle3), spec_cuda_graphs and "
        "spec_greedy_accept: after a verify graph whose sequences are all plain greedy with k drafts, one more graph "
        "accepts on the device and runs the draft passes of the next step's drafts (the first over the verified "
        "positions, each reading its argmax as the token after it), so they arrive with this step's tokens: one "
        "host-device synchronisation per step instead of two",
        "each step's drafts are proposed once its tokens reach the host, from the tokens accepted there "
        "(spec_decode/proposer.py, spec_decode/drafter.py)")
    spec_pad_drafts: bool = switch(
        True, ENGINE, "engine/scheduler.py", "with cuda_graphs and spec_cuda_graphs: a batch of decoding sequences "
        "that verify different numbers of drafts (some none) pads the shorter drafts to the longest with each "
        "sequence's newest token repeated, so the step is one query length for all and replays a verify graph "
        "(exact: a padding token is accepted only where it is what the target picks)", "the batch runs eagerly, "
        "each sequence with its own drafts")
    spec_async: bool = switch(
        True, ENGINE, "engine/llm_engine.py", "with async_scheduling and the draft chain (spec_draft_chain): a "
        "speculative step is launched before the previous step's tokens reach the host - its queries (each "
        "sequence's bonus token and next drafts) and positions are those the previous step's draft chain left on "
        "the device, its blocks cover the most the previous step can accept - so the host's work on a step's tokens "
        "runs while the device computes the next", "each speculative step is launched once the previous step's "
        "tokens are on the host")
    spec_feed_in_graph: bool = switch(
        True, ENGINE, "runner/cuda_graphs.py", "with spec_async: a verify graph takes a query launched ahead itself - "
        "its input ids and first positions from the rows of the draft chain's buffers that one small staged copy "
        "names, its context lengths and slots from them - so the host launches nothing between staging and replay",
        "the host launches the copies of GraphRunner.apply_verify_feed (about fifteen small kernels) before each "
        "replay")
    spec_multi_step: bool = switch(
        False, ENGINE, "spec_decode/multi_step.py", "(off by default: measured slower on an H100, where one step per "
        "launch with spec_async already overlaps the host with the device; docs/speculative_decoding.md) "
        "with spec_feed_in_graph: where every running sequence verifies k "
        "drafts, is plain greedy and has room for them, nothing waits and the pool holds the blocks, one graph runs "
        "spec_steps_per_launch speculative steps (verify, accept, the next drafts) back to back on the device, each "
        "taking its queries from the one before; the host stages once, waits once and appends every step's tokens "
        "through the stop checks (tokens past a stop are dropped)", "one speculative step per launch")
    msa_topk_reuse: bool = switch(
        False, MODEL, "model/m3.py", "reuse one MSA layer's block selection in the next layer(s)",
        "every MSA layer selects its own blocks", exact=False)
    mx_activations: bool = switch(
        False, MODEL, "kernels/mx_linear.py", "with MXFP8 weights, quantize the activations entering every quantized "
        "linear to MXFP8 per token (e4m3 values, one E8M0 scale per 32 along K) and multiply fp8 x fp8 with "
        "tl.dot_scaled: the block-scaled MFMA on gfx950 and tcgen05.mma on sm_100 (decomposed on sm_90 and gfx942); "
        "without Triton, kernels/reference.py mx_linear; no effect on 16-bit weights or the MoE's experts",
        "the activations stay in the model dtype (kernels/fp8_linear.py or reference.fp8_linear)", exact=False)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, bool):
                raise ValueError(f"optimization switch {f.name}={value!r} is invalid: must be True or False")

    @classmethod
    def switches(cls) -> list[Switch]:
        """The declarations, in order."""
        return list(_declarations(cls))

    @classmethod
    def names(cls, *layers: str) -> list[str]:
        """Every switch name, or those of the given layers (ENGINE, MODEL, KERNEL)."""
        return list(_names(cls, layers))

    @classmethod
    def build_time(cls) -> list[str]:
        """Switches read when the model is built: flipping one takes a new model (the ablation rebuilds it)."""
        return [s.name for s in cls.switches() if s.build_time]

    @classmethod
    def approximations(cls) -> list[str]:
        """Switches that change outputs (off by default)."""
        return [s.name for s in cls.switches() if not s.exact]

    @classmethod
    def reference(cls) -> "Optimizations":
        """Every switch off: the plain reference path everywhere."""
        return cls(**{name: False for name in cls.names()})

    @classmethod
    def reference_kernels(cls) -> "Optimizations":
        """The defaults with every KERNEL switch off: the plain-PyTorch kernels (what CPU runs and tests use, since
        Triton runs only in its slow interpreter there)."""
        return cls(**{name: False for name in cls.names(KERNEL)})

    def replace(self, **changes: bool) -> "Optimizations":
        for k in changes:
            if k not in self.names():
                raise ValueError(f"unknown optimization switch {k!r}; known: {', '.join(self.names())}")
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict[str, bool]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def not_applicable(self, platform: "Platform") -> dict[str, str]:
        """The switches that cannot act on `platform`, each with why: the device lacks what it needs (CUDA, Triton,
        Hopper's Gluon), the weights are not MXFP8, there is no speculative_config, or a switch it works through
        is off or cannot act either (then its reason is given). Whether a switch applies does not depend on its own
        value: an approximation that is off can still apply. A switch not in SWITCH_NEEDS applies everywhere."""
        out: dict[str, str] = {}

        def why(name: str) -> str | None:
            if name not in out:
                out[name] = ""  # a guard against a cycle in SWITCH_NEEDS; filled in below
                out[name] = next(filter(None, (_unmet(need, self, platform, why)
                                               for need in SWITCH_NEEDS.get(name, ()))), "")
            return out[name] or None

        return {name: why(name) for name in self.names() if why(name)}

    def describe(self, platform: "Platform | None" = None) -> str:
        """One line: the switches on, those off and, given the platform, those that cannot act here and why
        (`n/a`, grouped by reason) - these are listed under n/a only, whatever their value."""
        na = self.not_applicable(platform) if platform is not None else {}
        on = [n for n, v in self.as_dict().items() if v and n not in na]
        off = [n for n, v in self.as_dict().items() if not v and n not in na]
        text = f"on: {', '.join(on) or '-'}; off: {', '.join(off) or '-'}"
        by_reason: dict[str, list[str]] = {}
        for name, reason in na.items():
            by_reason.setdefault(reason, []).append(name)
        if by_reason:
            text += "; n/a: " + "; ".join(f"{', '.join(names)} ({reason})" for reason, names in by_reason.items())
        return text


# The declarations never change, and the model runner reads the MODEL and KERNEL names every step (to see whether
# its graphs still match the switches): built once per class, not once per call (about 60 us a call otherwise).
@functools.cache
def _declarations(cls: type) -> tuple[Switch, ...]:
    return tuple(Switch(name=f.name, **f.metadata["switch"]) for f in fields(cls))


@functools.cache
def _names(cls: type, layers: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(s.name for s in _declarations(cls) if not layers or s.layer in layers)


@dataclass(frozen=True)
class Platform:
    """Where the switches run, as far as whether one can act at all is concerned: the device and what runs on it,
    the model's weights and the engine's setup. `Optimizations.not_applicable(platform)` reads it. The device
    questions are the kernel layer's to answer (`kernels.triton_usable`, `kernels.moe_wgmma.hopper_gluon`);
    `nanoserve.runner.model_runner.platform_of` builds one for a live model that way."""

    device: str = "cpu"
    """"cuda" (a CUDA or HIP device) or "cpu"."""
    triton: bool = False
    """Triton kernels run on this device in this process: a GPU, or the CPU under TRITON_INTERPRET=1."""
    hopper_gluon: bool = False
    """The Gluon kernels for Hopper run here: an sm_90 CUDA device, Triton's Gluon, bf16 activations."""
    mxfp8: bool = False
    """The weights are MXFP8 as the checkpoint and `quantization` give them (before the mxfp8_weights switch)."""
    speculative: str | None = None
    """The speculative_config's method (ngram, mtp, eagle3); None without one."""
    tensor_parallel_size: int = 1


REQUIREMENTS: dict[str, tuple[Any, str]] = {
    "cuda": (lambda p: p.device == "cuda", "no CUDA/HIP device"),
    "triton": (lambda p: p.triton, "Triton kernels do not run on this device: the reference path runs"),
    "hopper": (lambda p: p.hopper_gluon, "not a Hopper (sm_90) GPU with Triton's Gluon and bf16 activations"),
    "mxfp8": (lambda p: p.mxfp8, "the weights are not MXFP8"),
    "speculative": (lambda p: p.speculative is not None, "no speculative_config"),
    "draft model": (lambda p: p.speculative in ("mtp", "eagle3"), "the drafter is no model (mtp, eagle3)"),
    "no speculation": (lambda p: p.speculative is None, "speculative decoding drafts from the host's tokens"),
    "one rank": (lambda p: p.tensor_parallel_size == 1, "tensor_parallel_size > 1"),
}
"""What a switch can need of its platform: a test and what is missing when it fails."""

SWITCH_NEEDS: dict[str, tuple[str, ...]] = {
    "cuda_graphs": ("cuda", "triton", "one rank"),
    "triton_attention": ("triton",),
    "triton_msa": ("triton",),
    "msa_sparse_by_block": ("triton", "triton_msa"),
    "fused_moe": ("triton",),
    "fold_shared_expert": ("triton", "fused_moe"),
    "moe_tma": ("triton", "fused_moe"),
    "moe_dequant_prefill": ("triton", "fused_moe", "mxfp8", "not moe_wgmma"),
    "moe_wgmma": ("hopper", "fused_moe", "mxfp8"),
    "triton_gemv": ("triton",),
    "fused_routing": ("triton", "fused_moe"),
    "fused_qk_norm_rope": ("triton",),
    "fused_add_rmsnorm": ("triton",),
    "fused_swiglu": ("triton",),
    "fused_rmsnorm": ("triton",),
    "triton_vision_attention": ("triton",),
    "fused_layer_norm": ("triton",),
    "mxfp8_weights": ("mxfp8",),
    "triton_fp8_linear": ("triton", "mxfp8"),
    "fp8_linear_wgmma": ("hopper", "mxfp8", "triton_fp8_linear"),
    "captured_argmax": ("cuda_graphs",),
    "async_scheduling": ("overlap_scheduling", "one rank", "no speculation"),
    "speculative_decoding": ("speculative",),
    "spec_cuda_graphs": ("speculative_decoding", "cuda_graphs"),
    "spec_greedy_accept": ("speculative_decoding",),
    "spec_draft_chain": ("spec_cuda_graphs", "spec_greedy_accept", "draft model"),
    "spec_pad_drafts": ("spec_cuda_graphs",),
    "spec_async": ("spec_draft_chain",),
    "spec_feed_in_graph": ("spec_async",),
    "spec_multi_step": ("spec_feed_in_graph",),
    "mx_activations": ("mxfp8",),
}
"""What each switch needs to act at all, checked in order: a REQUIREMENTS key, another switch that must be on (and
able to act), or "not <switch>" for a switch that takes its calls first where it acts (moe_wgmma takes the calls
moe_dequant_prefill would on Hopper). The kernel switches need Triton (on the CPU the reference path runs whatever
they say); cuda_graphs needs what runner/cuda_graphs.py's unsupported_reason asks beyond the kernel switches."""


def _unmet(need: str, opts: Optimizations, platform: Platform, why) -> str | None:
    """Why `need` is not met on `platform` with `opts` (None: it is); `why(switch)` is another switch's reason."""
    if need in REQUIREMENTS:
        test, missing = REQUIREMENTS[need]
        return None if test(platform) else missing
    if need.startswith("not "):
        other = need[4:]
        return f"{other} takes these calls here" if getattr(opts, other) and why(other) is None else None
    if why(need) is not None:
        return why(need)  # what keeps the switch it works through from acting keeps this one too
    return None if getattr(opts, need) else f"{need} is off"


# vLLM-named engine arguments that are aliases of a switch: name -> (switch, value meaning "on")
SWITCH_ALIASES: dict[str, tuple[str, bool]] = {
    "enable_prefix_caching": ("prefix_caching", True),
    "enable_chunked_prefill": ("chunked_prefill", True),
    "enforce_eager": ("cuda_graphs", False),
}

def from_json_object(cls, value: dict[str, Any] | None, what: str):
    """A config dataclass from the JSON object a flag took (`--kv-events-config`, `--kv-transfer-config`): None gives
    the defaults; anything but an object, or a key the dataclass does not have, is a ValueError that names `what`."""
    if value is None:
        return cls()
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a JSON object, got {type(value).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{what}: unknown keys {unknown} (known: {sorted(known)})")
    return cls(**value)


DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = (None, "mxfp8", "bf16")
"""`quantization=` values (vLLM's `--quantization`): None = the checkpoint's format (config.json's
`quantization_config`), "mxfp8" = MXFP8 weights (a bf16 checkpoint is quantized at load), "bf16" = 16-bit weights in
the model dtype (an MXFP8 checkpoint is dequantized at load). docs/mxfp8.md."""
DEVICES = ("auto", "cpu", "cuda")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
"""`kv_cache_dtype=` values (vLLM's `--kv-cache-dtype`): "auto" = the model dtype; "fp8" and "fp8_e4m3" (the same)
store the K/V and index-key pools in fp8 e4m3 with per-tensor scales (runner/kv_cache.py). vLLM's "fp8_e5m2" is
refused by name."""
DEFAULT_CPU_KV_TOKENS = 32768
SCHEDULING_POLICIES = ("fcfs", "priority")
MM_MODALITIES = ("image", "video")
"""What a prompt may carry besides text (limit_mm_per_prompt's keys)."""
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


@dataclass
class EngineConfig:
    """What an engine is built from. Field names follow vLLM's engine arguments."""

    model: str = "m3-mini"
    """A checkpoint directory, the trained m3-mini that ships in the package, or a preset with random weights
    (m3-tiny, m3-slice)."""
    tokenizer: str | None = None
    dtype: str = "auto"
    quantization: str | None = None
    """Weight format (vLLM's `--quantization`): None = the checkpoint's (bf16, or MXFP8 when config.json's
    quantization_config says so); "mxfp8" quantizes a bf16 checkpoint or preset at load; "bf16" dequantizes an MXFP8
    checkpoint at load (to the model dtype)."""
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
    kv_cache_dtype: str = "auto"
    """The KV cache's element type (vLLM's `--kv-cache-dtype`): "auto" = the model dtype; "fp8" / "fp8_e4m3" = fp8
    e4m3, one byte per element (twice the tokens in the same memory), written as x / scale saturated to +-448 and
    read back times the scale (per layer, per tensor: the checkpoint's k_scale / v_scale, else 1.0). Changes
    outputs within fp8 rounding; docs/optimizations.md."""
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    seed: int = 0
    max_waiting_requests: int = 1024
    scheduling_policy: str = "fcfs"
    """vLLM's: "fcfs" (first come, first served) or "priority" (a request's `priority`, lower first, then its
    arrival; preemption takes the worst such sequence first)."""
    max_logprobs: int = 20
    logprobs_mode: str = "raw_logprobs"
    """What logprobs report (vLLM's values): raw_* of the model's logits before any sampling step; processed_* of
    the logits the draw used (after allowed_token_ids, bad_words, min_tokens, logit_bias, penalties, temperature
    and top-k/top-p/min-p); *_logprobs as log-softmax, *_logits as the logits themselves."""
    served_model_name: str | None = None
    distributed_init_method: str | None = None
    """torch.distributed rendezvous (tcp://host:port or env://); None picks a free loopback port."""
    worker_timeout: float | None = None
    """Tensor parallelism: seconds after which a worker that does not answer (no heartbeat, or a step's peers
    silent) fails the engine; None = $NANOSERVE_WORKER_TIMEOUT, else 30; 0 = never (distributed/watchdog.py)."""
    speculative_config: dict[str, Any] | None = None
    """Speculative decoding (vLLM's argument): {"method": "ngram", "num_speculative_tokens": k,
    "prompt_lookup_max": n, "prompt_lookup_min": m}, {"method": "mtp", "num_speculative_tokens": k} or
    {"method": "eagle3", "model": DRAFT_DIR, "num_speculative_tokens": k}; None = none. Checked when the engine is built
    (spec_decode/config.py); docs/speculative_decoding.md."""
    spec_steps_per_launch: int = 4
    """Speculative decoding with switch spec_multi_step: the most speculative steps one launch runs on the device
    (spec_decode/multi_step.py); 1 = one per launch."""
    kv_events_config: dict[str, Any] | None = None
    """KV-cache events for KV-aware routers (vLLM's `--kv-events-config`): {"enable_kv_cache_events": true,
    "publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": ..., "topic": ..., "buffer_steps": ...,
    "hwm": ..., "max_queue_size": ...}; None = none. Checked by engine/kv_events.py; docs/scale_out.md."""
    limit_mm_per_prompt: dict[str, int] | None = None
    """The most images and videos one prompt may carry (vLLM's argument), e.g. {"image": 4, "video": 1}; a modality
    left out allows 999, 0 refuses it."""
    kv_transfer_config: dict[str, Any] | None = None
    """Prefill/decode disaggregation (vLLM's `--kv-transfer-config`): {"kv_connector": "NixlConnector",
    "kv_role": "kv_producer" | "kv_consumer" | "kv_both", ...}; None = none. Checked by kv_transfer/config.py;
    docs/scale_out.md."""
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
        need(self.quantization in QUANTIZATIONS, "quantization", "None (the checkpoint's), 'mxfp8' or 'bf16'")
        need(self.device in DEVICES, "device", f"one of {', '.join(DEVICES)}")
        need(self.kv_cache_dtype != "fp8_e5m2", "kv_cache_dtype",
             "fp8_e5m2 is not supported: the fp8 KV cache is e4m3 ('fp8' or 'fp8_e4m3')")
        need(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype", f"one of {', '.join(KV_CACHE_DTYPES)}")
        int_in("max_model_len", 1, optional=True)
        int_in("block_size", 1, optional=True)
        int_in("max_num_seqs", 1)
        int_in("spec_steps_per_launch", 1)
        int_in("max_num_batched_tokens", 1, optional=True)
        need(isinstance(self.gpu_memory_utilization, (int, float)) and not isinstance(self.gpu_memory_utilization, bool)
             and 0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization", "a fraction in (0, 1]")
        int_in("num_gpu_blocks_override", 1, optional=True)
        int_in("kv_cache_tokens", 1, optional=True)
        int_in("tensor_parallel_size", 1, 64)
        need(isinstance(self.enable_expert_parallel, bool), "enable_expert_parallel", "True or False")
        need(is_int(self.seed), "seed", "an integer")
        int_in("max_waiting_requests", 1)
        need(self.scheduling_policy in SCHEDULING_POLICIES, "scheduling_policy",
             f"one of {', '.join(SCHEDULING_POLICIES)}")
        int_in("max_logprobs", 0, 1000)
        need(self.worker_timeout is None or (isinstance(self.worker_timeout, (int, float))
                                             and not isinstance(self.worker_timeout, bool)
                                             and self.worker_timeout >= 0), "worker_timeout",
             "a number of seconds >= 0 (0 = no hang detection) or None")
        need(self.logprobs_mode in LOGPROBS_MODES, "logprobs_mode", f"one of {', '.join(LOGPROBS_MODES)}")
        need(isinstance(self.optimizations, Optimizations), "optimizations", "an Optimizations instance")
        need(self.speculative_config is None or isinstance(self.speculative_config, dict), "speculative_config",
             "a dict (method, num_speculative_tokens, ...) or None")
        need(self.kv_events_config is None or isinstance(self.kv_events_config, dict), "kv_events_config",
             "a dict (enable_kv_cache_events, publisher, endpoint, ...) or None")
        need(self.kv_transfer_config is None or isinstance(self.kv_transfer_config, dict), "kv_transfer_config",
             "a dict (kv_connector, kv_role, ...) or None")
        need(self.limit_mm_per_prompt is None or (
            isinstance(self.limit_mm_per_prompt, dict) and all(
                k in MM_MODALITIES and is_int(v) and v >= 0 for k, v in self.limit_mm_per_prompt.items())),
            "limit_mm_per_prompt", f"a dict from a modality ({', '.join(MM_MODALITIES)}) to a count >= 0, or None")
