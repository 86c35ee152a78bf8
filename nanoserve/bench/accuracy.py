"""How far MXFP8 weights served natively are from the same weights dequantised, and from the unquantised model:
log-probabilities of every position of a few prompts, over the whole vocabulary.

    python -m nanoserve.bench --mxfp8-accuracy                       # m3-slice on a GPU, two 1024-token prompts
    python -m nanoserve.bench --mxfp8-accuracy --model m3-tiny --device cpu --no-cpu-reference-kernels --dtype float16

The same weights are built up to three times, one model resident at a time:

- native: the MXFP8 weights kept as fp8 + scales (`mxfp8_weights` on), run by the kernels the switches select;
- dequantised: the same MXFP8 weights dequantised to the model dtype at load (`mxfp8_weights` off), the reference
  path. Both compute the same model: any difference is the kernels' arithmetic (summation order, the rounding of
  16-bit outputs). No activation is quantised on either path;
- unquantised (a bf16 checkpoint or preset only, quantised to MXFP8 for the other two): the original weights,
  which shows what quantising the weights changed.

Each runs one prefill over each prompt (every position's logits, the LM head in the model dtype, log-softmax in
fp32). Reported per pair: max and mean |difference| of the log-probabilities over all positions x vocabulary,
the max |difference| at the reference's top-1 token, and how often the two top-1 tokens agree.

With `locate=True` the first prompt's forward is also recorded module by module in the native and the dequantised
build (`ModuleRecorder`: every submodule's tensor inputs and outputs as it returns, the kernel path each linear
and MoE took, and the MoE routing and MSA block choices), and `first_divergence` names the first module whose
output differs between the two and whether its inputs were still equal (then that module's own computation
differs) - where the two paths part, from one run.
"""

from __future__ import annotations

import contextlib
import gc
import time
from dataclasses import dataclass, field

import torch

from nanoserve.bench.report import table
from nanoserve.config import Optimizations

PAIRS = (("native", "dequantised"), ("dequantised", "unquantised"))
"""(compared, reference) pairs of the report."""


def prompt_logprobs(model, prompts: list[list[int]], device: torch.device,
                    recorder: ModuleRecorder | None = None) -> torch.Tensor:
    """fp32 log-probabilities [sum of prompt lengths, vocab] of one prefill per prompt (a KV pool of its own).
    `recorder` records the first prompt's forward."""
    from nanoserve.batch import AttentionMetadata
    from nanoserve.runner.kv_cache import allocate_kv_caches

    bs = model.cfg.index_block_size
    out = []
    for i, ids in enumerate(prompts):
        n_blocks = -(-len(ids) // bs)
        kv, index = allocate_kv_caches(model.cfg, n_blocks, bs, model.dtype, device)
        model.bind_kv_caches(kv, index)
        meta = AttentionMetadata.build([len(ids)], [len(ids)], [list(range(n_blocks))], bs, device)
        attached = recorder.attached(model) if recorder is not None and i == 0 else contextlib.nullcontext()
        with torch.inference_mode(), attached:
            hidden = model(torch.tensor(ids, device=device), meta.positions, meta)
            out.append(torch.log_softmax(model.compute_logits(hidden), -1))
    return torch.cat(out)


def compare(got: torch.Tensor, want: torch.Tensor) -> dict:
    """The agreement of two [positions, vocab] log-probability tensors (`want` the reference)."""
    d = (got - want).abs()
    top = want.argmax(-1)
    return {"max_abs_logprob_diff": d.max().item(), "mean_abs_logprob_diff": d.mean().item(),
            "max_abs_diff_at_reference_top1": d.gather(1, top[:, None]).max().item(),
            "top1_agreement": (got.argmax(-1) == top).float().mean().item(), "positions": int(top.numel())}


def mxfp8_accuracy(model: str, opts: Optimizations, dtype: torch.dtype, device: torch.device,
                   prompt_len: int = 1024, num_prompts: int = 2, seed: int = 5, unquantised: bool = True,
                   locate: bool = False) -> dict:
    """Build `model` (a preset or checkpoint directory) natively in MXFP8, dequantised, and (a bf16 one, unless
    `unquantised` is False) unquantised, run the same random prompts through each, and compare (module
    docstring). `locate`: record the first prompt's forward module by module in the native and dequantised builds
    and report where they first differ (res["divergence"], `first_divergence`)."""
    from nanoserve.model.loader import checkpoint_quantization
    from nanoserve.presets.catalog import PRESETS
    from nanoserve.presets.resolve import load_model_or_preset, resolve_model_dir

    if prompt_len < 1 or num_prompts < 1:
        raise ValueError(f"prompt_len={prompt_len} and num_prompts={num_prompts} must be at least 1")
    stored = None if model in PRESETS else checkpoint_quantization(resolve_model_dir(model))
    builds = {"native": (opts.replace(mxfp8_weights=True), "mxfp8"),
              "dequantised": (opts.replace(mxfp8_weights=False), "mxfp8")}
    if stored != "mxfp8" and unquantised:
        builds["unquantised"] = (opts, None)
    gen = torch.Generator().manual_seed(seed)
    prompts = None
    logprobs: dict[str, torch.Tensor] = {}
    recorders = {label: ModuleRecorder() for label in ("native", "dequantised")} if locate else {}
    res: dict = {"model": model, "dtype": str(dtype).removeprefix("torch."), "prompt_len": prompt_len,
                 "num_prompts": num_prompts, "builds": {}, "pairs": {}}
    for label, (build_opts, quant) in builds.items():
        t0 = time.perf_counter()
        m, _ = load_model_or_preset(model, build_opts, dtype, device, quant)
        if prompts is None:  # the same token ids for every build
            prompts = [torch.randint(0, m.cfg.vocab_size, (prompt_len,), generator=gen).tolist()
                       for _ in range(num_prompts)]
        logprobs[label] = prompt_logprobs(m, prompts, device, recorders.get(label))
        res["builds"][label] = {"weight_format": m.weight_format or str(m.dtype).removeprefix("torch."),
                                "seconds": time.perf_counter() - t0}
        del m
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for got, want in PAIRS:
        if got in logprobs and want in logprobs:
            res["pairs"][f"{got} vs {want}"] = compare(logprobs[got], logprobs[want])
    if locate:
        res["divergence"] = first_divergence(recorders["native"].records, recorders["dequantised"].records)
    res["table"] = accuracy_table(res)
    return res


def accuracy_table(res: dict) -> str:
    rows = [[name, r["positions"], f"{r['max_abs_logprob_diff']:.3e}", f"{r['mean_abs_logprob_diff']:.3e}",
             f"{r['max_abs_diff_at_reference_top1']:.3e}", f"{100 * r['top1_agreement']:.2f} %"]
            for name, r in res["pairs"].items()]
    weights = ", ".join(f"{k}: {v['weight_format']}" for k, v in res["builds"].items())
    title = (f"MXFP8 accuracy: {res['model']}, {res['dtype']}, {res['num_prompts']} x {res['prompt_len']}-token "
             f"prompts, full vocabulary ({weights})")
    text = table(("compared", "positions", "max |d logprob|", "mean |d logprob|", "max |d| at top-1", "top-1 agree"),
                 rows, title)
    if "divergence" in res:  # the first prompt, native against dequantised
        text += "\nnative vs dequantised, first prompt, " + divergence_text(res["divergence"])
    return text


# Locating where the native and dequantised forwards part (locate=True)


@dataclass
class Record:
    """One module's call (or one traced choice) in a recorded forward: its tensors copied to the CPU."""

    name: str
    kind: str
    """The module's class, or the trace event ("moe_route": top-k expert ids, "msa_select": KV block choice)."""
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]
    path: str = ""
    """The kernel path a quantized linear or MoE took, where this module chooses one (`kernel_path`)."""


def _tensors(obj) -> list[torch.Tensor]:
    """The tensors in a (nested) tuple / list / dict, detached copies on the CPU."""
    if isinstance(obj, torch.Tensor):
        return [obj.detach().to("cpu", copy=True)]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (tuple, list)):
        return [t for item in obj for t in _tensors(item)]
    return []


def kernel_path(module, x: torch.Tensor) -> str:
    """What a linear with MXFP8 weights or an MoE layer runs for the input x: the fp8 linear's variant (kernels/
    fp8_linear.select_tiles; "dequant" = a 16-bit copy of W, then F.linear), or the fused MoE's tiles
    (kernels/moe.select_config) - or "" for any other module, a 16-bit linear (F.linear), or a CPU run."""
    if x.device.type != "cuda":
        return ""
    from nanoserve.model.layers.moe import M3MoE

    if isinstance(module, M3MoE):
        from nanoserve.kernels.moe import select_config

        slots, two_inter, hidden = module.w13.shape
        fold = module.opts.fold_shared_expert and module.shared_in_stack
        cfg = select_config(x.shape[0], hidden, two_inter // 2, slots - int(fold), module.top_k, x.device, x.dtype,
                            module.w13_scale is not None)
        return f"fused MoE {cfg}"
    scale = getattr(module, "weight_scale", None)
    if scale is None or x.dim() < 2:
        return ""
    from nanoserve.kernels.fp8_linear import select_tiles

    n, k = module.weight.shape
    m = x.numel() // k
    gemv = " (one row: the GEMV instead where its table has the shape)" if m == 1 else ""
    return f"fp8 linear [{m} x {k}] x [{n} x {k}]^T: {select_tiles(m, n, k, x.device, x.dtype)}{gemv}"


@dataclass
class ModuleRecorder:
    """Records one forward of a model module by module: every submodule's tensor inputs and outputs in the order
    the calls return (a parent after its children), with the kernel path of quantized linears and MoE layers, and
    the routing / block choices the model's trace hook reports (M3ForCausalLM.set_trace). Copies go to the CPU,
    so a recording outlives its model."""

    records: list[Record] = field(default_factory=list)

    @contextlib.contextmanager
    def attached(self, model):
        handles = [module.register_forward_hook(self._hook(name), with_kwargs=True)
                   for name, module in model.named_modules() if name]
        model.set_trace(self._trace)
        try:
            yield self
        finally:
            model.set_trace(None)
            for h in handles:
                h.remove()

    def _hook(self, name: str):
        def hook(module, args, kwargs, output):
            first = args[0] if args and isinstance(args[0], torch.Tensor) else None
            path = kernel_path(module, first) if first is not None else ""
            self.records.append(Record(name, type(module).__name__, _tensors((args, kwargs)), _tensors(output),
                                       path))
        return hook

    def _trace(self, event: str, layer: int | None = None, **payload):
        chosen = payload.get("topk_ids") if event == "moe_route" else payload.get("selection")
        self.records.append(Record(f"layers.{layer}.{event}", event, [], _tensors(chosen)))


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y)
                                    for x, y in zip(a, b))


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float | None:
    """max |a - b| over tensors of equal shapes (None when the shapes differ)."""
    diffs = [(x.double() - y.double()).abs().max().item() for x, y in zip(a, b) if x.shape == y.shape and x.numel()]
    return max(diffs) if diffs and len(a) == len(b) else None


def first_divergence(got: list[Record], want: list[Record]) -> dict:
    """Where two recordings of the same forward (`got` against the reference `want`) first part: the first record
    whose outputs differ, whether its inputs were still equal (yes: that module's own computation - or the traced
    choice - differs; no: its inputs changed in code between the record before it and this one, e.g. a parent's
    own operations), both builds' kernel paths for it, and every differing record's name in order. None as
    "first" when every record is equal."""
    report: dict = {"records": min(len(got), len(want)), "first": None, "differing": []}
    if [r.name for r in got] != [r.name for r in want]:
        report["note"] = "the two forwards called different modules; compared up to the first mismatch"
    for i, (a, b) in enumerate(zip(got, want)):
        if a.name != b.name:
            break
        if _equal(a.outputs, b.outputs):
            continue
        report["differing"].append(a.name)
        if report["first"] is None:
            report["first"] = {"module": a.name, "kind": a.kind, "inputs_equal": _equal(a.inputs, b.inputs),
                               "max_abs_output_diff": _max_diff(a.outputs, b.outputs),
                               "differing_elements": sum(int((x != y).sum()) for x, y in zip(a.outputs, b.outputs)
                                                         if x.shape == y.shape),
                               "path": a.path, "reference_path": b.path,
                               "previous_equal": got[i - 1].name if i else None}
    return report


def divergence_text(report: dict) -> str:
    """One paragraph of `first_divergence`'s report."""
    first = report["first"]
    if first is None:
        return f"module by module: all {report['records']} records equal"
    where = ("its inputs equal: this module's own computation differs" if first["inputs_equal"] else
             f"its inputs already differ: the change is between {first['previous_equal']} and this call")
    diff = first["max_abs_output_diff"]
    lines = [f"first difference: {first['module']} ({first['kind']}), {where}; max |d| "
             f"{'(shapes differ)' if diff is None else f'{diff:.3g}'}, {first['differing_elements']} elements differ"]
    if first["path"] or first["reference_path"]:
        lines.append(f"  kernel path: {first['path'] or 'F.linear / none chosen'} | reference: "
                     f"{first['reference_path'] or 'F.linear / none chosen'}")
    lines.append(f"  {len(report['differing'])} of {report['records']} records differ: "
                 + ", ".join(report["differing"][:12]) + (" ..." if len(report["differing"]) > 12 else ""))
    return "\n".join(lines)
