"""Load an M3 checkpoint directory into an `M3ForCausalLM`.

Reads config.json in either dialect, then the safetensors files (one file, or shards listed in
`model.safetensors.index.json`) by the released key names, which model/checkpoint_names.py maps to parameters.
Each rank reads only its slice of each tensor through safetensors' lazy slices. MXFP8 weights (fp8 e4m3 + per-1x32
E8M0 `weight_scale_inv`) reach a parameter's weight_loader paired with their scales, which shards both alike; it
keeps them as stored when the `mxfp8_weights` switch is on, else they are dequantised on load (as they are for a
model built with `quantization="bf16"`: a layer without MXFP8 parameters slices the pair, which dequantises).
An fp8 KV cache's scales (`...self_attn.k_scale` / `v_scale`, optional scalars) go to the layers' attention.
The vision tower, projector and patch merger (`vision_tower.`, `multi_modal_projector.`, `patch_merge_mlp.`)
fill an `M3VisionModel` when one is given (`load_vision_model` builds it from config.json's `vision_config`), by
the names of VISION_WEIGHT_NAMES, always unquantized; without one they are skipped, as MTP tensors are, with one log
line each. Preset names are resolved to a directory (or to
weights drawn on the device) above this module, in nanoserve/presets/resolve.py.
"""

from __future__ import annotations

import json
import logging
import os
from contextlib import ExitStack
from typing import Any

import torch
from safetensors import safe_open

from nanoserve.config import Optimizations
from nanoserve.model.checkpoint_names import (
    KV_SCALE_NAME,
    VISION_PREFIXES,
    VISION_WEIGHT_NAMES,
    Target,
    canonical_names,
    loader_for,
    name_map,
)
from nanoserve.model.m3 import M3ForCausalLM
from nanoserve.model.m3_config import M3Config
from nanoserve.model.mxfp8 import (
    MXFP8_BLOCK,
    QUANT_METHODS,
    QuantizeOnLoad,
    block_columns,
    dequantize_mxfp8,
    is_quantized_matrix,
)
from nanoserve.model.vision.config import VisionConfig
from nanoserve.model.vision.model import M3VisionModel

logger = logging.getLogger(__name__)

SKIPPED_PREFIXES = {
    "MTP (speculative) heads": ("language_model.model.mtp.", "model.mtp.", "mtp."),
    "vision tower / projector": VISION_PREFIXES,
}
SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = ("F8_E4M3", "F8_E4M3FN")  # how safetensors names float8_e4m3fn


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be served, with the reason."""


class SafeSlice:
    """A lazily-read safetensors tensor: `.shape`, and slicing reads only the requested part."""

    def __init__(self, handle: Any, key: str):
        self._slice = handle.get_slice(key)
        self.shape = tuple(self._slice.get_shape())

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self._slice[index]


class MXFP8Slice:
    """An fp8 weight plus its E8M0 block scales; slicing dequantises just the requested rows/columns."""

    def __init__(self, weight: SafeSlice, scale: SafeSlice, name: str):
        self.weight, self.scale, self.shape = weight, scale, weight.shape
        if len(self.shape) != 2 or scale.shape != (self.shape[0], -(-self.shape[1] // MXFP8_BLOCK)):
            raise CheckpointError(f"MXFP8 scale of {name} has shape {list(scale.shape)}, expected "
                                  f"[{self.shape[0]}, {-(-self.shape[1] // MXFP8_BLOCK)}] "
                                  f"for weight {list(self.shape)}")

    def read_mxfp8(self, rows: slice, cols: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored fp8 rows/columns and their scales (for layers that keep MXFP8 weights)."""
        c0, c1, b0, b1 = block_columns(cols, self.shape[1])
        if c0 != b0 * MXFP8_BLOCK:
            raise CheckpointError(f"MXFP8 weights can only be read from a {MXFP8_BLOCK}-column block start, got {c0}")
        return self.weight[rows, c0:c1], self.scale[rows, b0:b1]

    def __getitem__(self, index: Any) -> torch.Tensor:
        rows, cols = (index if isinstance(index, tuple) else (index, slice(None)))
        c0, c1, b0, b1 = block_columns(cols, self.shape[1])
        # Read whole 32-column scale blocks around the requested columns (a tensor-parallel slice need not
        # start on a block boundary), dequantise them, then cut out the requested columns.
        q = self.weight[rows, b0 * MXFP8_BLOCK: min(b1 * MXFP8_BLOCK, self.shape[1])]
        s = self.scale[rows, b0:b1]
        w = dequantize_mxfp8(q, s, torch.bfloat16)
        return w[..., c0 - b0 * MXFP8_BLOCK: c1 - b0 * MXFP8_BLOCK]


def read_config(model_dir: str) -> M3Config:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise CheckpointError(f"{model_dir}: config.json is missing")
    try:
        with open(path) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e
    try:
        return M3Config.from_dict(raw)
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from e


def checkpoint_files(model_dir: str) -> dict[str, str]:
    """key -> safetensors file path, from the index if there is one, else from every *.safetensors file."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index (valid JSON with a 'weight_map'): {e!r}") from e
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: 'weight_map' must map tensor names to file names")
        missing = sorted({f for f in weight_map.values() if not os.path.isfile(os.path.join(model_dir, f))})
        if missing:
            raise CheckpointError(f"{model_dir}: safetensors file(s) listed in the index are missing: "
                                  f"{', '.join(missing)}")
        return {k: os.path.join(model_dir, f) for k, f in weight_map.items()}
    return scan_safetensors(model_dir, model_dir)


def scan_safetensors(directory: str, what: str) -> dict[str, str]:
    """key -> file path over every *.safetensors file in `directory` (opened for their key lists); `what` names the
    directory in the error when there is none."""
    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"{what}: no *.safetensors files found")
    out = {}
    for fname in files:
        with safe_open(os.path.join(directory, fname), framework="pt") as h:
            out.update({k: os.path.join(directory, fname) for k in h.keys()})
    return out


def checkpoint_quantization(model_dir: str) -> str | None:
    """The weight format config.json declares: None (bf16) or "mxfp8" (`quantization_config.quant_method`)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        raw = json.load(f)
    qc = raw.get("quantization_config") if isinstance(raw, dict) else None
    if qc is None:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method not in QUANT_METHODS:
        raise CheckpointError(f"{model_dir}: quantization_config.quant_method={method!r} is not supported "
                              f"(supported: {', '.join(QUANT_METHODS)})")
    return method


UNQUANTIZED = "bf16"
"""The `quantization=` value asking for 16-bit weights in the model dtype, whatever the checkpoint holds."""


def resolve_quantization(checkpoint: str | None, requested: str | None, where: str) -> str | None:
    """The weight format to serve, None (the model dtype) or "mxfp8", from the checkpoint's (config.json) and the
    `quantization=` asked for: None = the checkpoint's; "mxfp8" quantizes a bf16 checkpoint at load; "bf16"
    dequantizes an MXFP8 checkpoint at load."""
    if requested is not None and requested != UNQUANTIZED and requested not in QUANT_METHODS:
        raise ValueError(f"quantization={requested!r} is invalid: None (the checkpoint's format) or one of "
                         f"{', '.join((*QUANT_METHODS, UNQUANTIZED))}")
    served = checkpoint if requested is None else (None if requested == UNQUANTIZED else requested)
    if served != checkpoint:
        logger.info("%s holds %s weights: %s them at load (quantization=%r)", where, checkpoint or "bf16",
                    "quantizing" if served else "dequantizing", requested)
    return served


def load_weights(model: M3ForCausalLM | None, model_dir: str, quantize_on_load: bool = False,
                 vision: M3VisionModel | None = None) -> None:
    """Fill every parameter of `model` (and of `vision`, if given) from the checkpoint, checking names and shapes:
    every target of the name tables (model/checkpoint_names.py) filled by exactly one tensor, and no tensor left
    over (model None: only the vision tensors are read, the text ones skipped). With quantize_on_load, the
    projections of a bf16 checkpoint are served as MXFP8 (quantised as they are read; never the vision ones)."""
    files = checkpoint_files(model_dir)
    names: dict[str, Target] = name_map(model) if model is not None else {}
    vision_names = name_map(vision, VISION_WEIGHT_NAMES, prefix="") if vision is not None else {}
    skipped = {reason: 0 for reason in SKIPPED_PREFIXES}
    unexpected = []
    with ExitStack() as stack:
        handles: dict[str, tuple[Any, set[str]]] = {}  # path -> (open file, its tensor names)

        def source(key: str) -> SafeSlice:
            path = files[key]
            if path not in handles:
                h = stack.enter_context(safe_open(path, framework="pt", device="cpu"))
                handles[path] = (h, set(h.keys()))
            handle, keys = handles[path]
            if key not in keys:
                raise CheckpointError(f"{key} is listed in model.safetensors.index.json under "
                                      f"{os.path.basename(path)}, which does not contain it")
            return SafeSlice(handle, key)

        kv_scales: dict[str, tuple[int, str]] = {}  # name -> (layer, "k" or "v")
        for key in files:
            reason = next((r for r, prefixes in SKIPPED_PREFIXES.items() if key.startswith(prefixes)), None)
            scale_name = KV_SCALE_NAME.fullmatch(key)
            if vision is not None and key.startswith(VISION_PREFIXES):
                if key not in vision_names:
                    unexpected.append(key)
            elif model is None:
                continue  # a vision-only load leaves the text tensors alone
            elif reason:
                skipped[reason] += 1
            elif scale_name and int(scale_name[1]) < model.cfg.num_hidden_layers:
                kv_scales[key] = (int(scale_name[1]), scale_name[2])
            elif key.endswith(SCALE_SUFFIX) and key not in names and key[: -len(SCALE_SUFFIX)] in files:
                continue  # read together with its weight
            elif key not in names:
                unexpected.append(key)
        missing, twice = [], []
        chosen: list[str] = []
        for target, aliases in [*canonical_names(names).items(), *canonical_names(vision_names).items()]:
            present = [n for n in aliases if n in files]
            if not present:
                missing.append(aliases[0])
            elif len(present) > 1:
                twice.append(" and ".join(present))
            else:
                chosen.append(present[0])
        if missing or unexpected or twice:
            parts = []
            if missing:
                missing.sort()
                parts.append(f"{len(missing)} missing tensor(s): {', '.join(missing[:8])}"
                             + (" ..." if len(missing) > 8 else ""))
            if unexpected:
                parts.append(f"{len(unexpected)} unexpected tensor(s): {', '.join(sorted(unexpected)[:8])}"
                             + (" ..." if len(unexpected) > 8 else ""))
            if twice:
                parts.append(f"{len(twice)} parameter(s) named twice: {', '.join(sorted(twice)[:8])} (two "
                             f"spellings of one tensor; a checkpoint must use one)")
            raise CheckpointError(f"{model_dir}: " + "; ".join(parts))
        for key in chosen:
            src: Any = source(key)
            is_fp8 = src._slice.get_dtype() in FP8_DTYPES
            has_scale = (key + SCALE_SUFFIX) in files
            if key in vision_names:
                if is_fp8 or has_scale:
                    raise CheckpointError(f"{key} is quantized; the vision tower, projector and patch merger are "
                                          f"loaded unquantized (bf16 / fp32), as the released MXFP8 checkpoint "
                                          f"keeps them")
                try:
                    loader_for(vision, key, vision_names[key])(src)
                except ValueError as e:
                    raise CheckpointError(str(e)) from e
                continue
            if is_fp8 and not has_scale:
                raise CheckpointError(f"{key} is fp8 but its {key + SCALE_SUFFIX} is missing")
            if has_scale and not is_fp8:
                raise CheckpointError(f"{key} has a {key + SCALE_SUFFIX} but is {src._slice.get_dtype()}, "
                                      f"not fp8 e4m3 (MXFP8)")
            if is_fp8:
                src = MXFP8Slice(src, source(key + SCALE_SUFFIX), key)
            elif quantize_on_load and is_quantized_matrix(key, src.shape):
                src = QuantizeOnLoad(src)
            try:
                loader_for(model, key, names[key])(src)
            except ValueError as e:
                raise CheckpointError(str(e)) from e
        for key, (layer, kind) in kv_scales.items():
            assert model is not None
            setattr(model.layers[layer].self_attn, f"{kind}_scale", _kv_scale(source(key)[...], key))
        if kv_scales:
            logger.info("fp8 KV cache scales: %d k_scale / v_scale tensors (used with kv_cache_dtype fp8)",
                        len(kv_scales))
    for reason, n in skipped.items():
        if n:
            logger.info("skipped %d %s tensors (not part of the text model)", n, reason)


def _kv_scale(t: torch.Tensor, name: str) -> float:
    """One KV scale as a float: a single finite value > 0."""
    if t.numel() != 1:
        raise CheckpointError(f"{name} has shape {list(t.shape)}: a KV cache scale is one value per tensor")
    value = float(t.float().reshape(()))
    if not (value > 0 and value < float("inf")):
        raise CheckpointError(f"{name} is {value}: a KV cache scale must be finite and > 0")
    return value


def load_model(model_dir: str, opts: Optimizations | None = None, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu", quantization: str | None = None) -> tuple[M3ForCausalLM, str]:
    """Build the model for a checkpoint directory and load its weights. Returns (model, directory holding the
    tokenizer - the same directory). `quantization` (see `resolve_quantization`): None serves the checkpoint's
    format, "mxfp8" a bf16 checkpoint as MXFP8, "bf16" an MXFP8 checkpoint dequantized."""
    if not os.path.isdir(model_dir):
        raise CheckpointError(f"model directory {model_dir!r} does not exist")
    cfg = read_config(model_dir)
    stored = checkpoint_quantization(model_dir)
    quant = resolve_quantization(stored, quantization, model_dir)
    m = M3ForCausalLM(cfg, opts, dtype, device, quantization=quant)
    load_weights(m, model_dir, quantize_on_load=quant is not None and stored is None)
    return m, model_dir


def read_vision_config(model_dir: str) -> VisionConfig | None:
    """config.json's vision config (model/vision/config.py), or None when it has no `vision_config`."""
    with open(os.path.join(model_dir, "config.json")) as f:
        raw = json.load(f)
    try:
        return VisionConfig.from_dict(raw) if isinstance(raw, dict) else None
    except ValueError as e:
        raise CheckpointError(f"{model_dir}/config.json: {e}") from e


def has_vision_model(model_dir: str) -> bool:
    """Does the checkpoint hold a vision tower (a `vision_config` and vision tensors)? Reads no tensor."""
    return read_vision_config(model_dir) is not None and \
        any(key.startswith(VISION_PREFIXES) for key in checkpoint_files(model_dir))


def load_vision_model(model_dir: str, opts: Optimizations | None = None, dtype: torch.dtype = torch.float32,
                      device: torch.device | str = "cpu") -> M3VisionModel | None:
    """The checkpoint's vision tower, projector and patch merger, loaded (replicated: whole on every rank), or None
    for a text-only checkpoint: no `vision_config`, or no vision tensors (the presets write a vision_config for
    transformers but no vision weights). A checkpoint with some vision tensors must have all of them."""
    cfg = read_vision_config(model_dir)
    if cfg is None:
        return None
    if not any(key.startswith(VISION_PREFIXES) for key in checkpoint_files(model_dir)):
        logger.info("%s declares a vision_config but holds no vision tensors: serving text only", model_dir)
        return None
    vision = M3VisionModel(cfg, opts, dtype, device)
    load_weights(None, model_dir, vision=vision)
    logger.info("vision: %d layers, %s", cfg.num_hidden_layers, vision.weight_summary())
    return vision
