"""Turn the `model` a user names - a shipped model, a preset or a checkpoint directory - into a loaded model.

A directory, or a model shipped in the package (m3-mini), goes straight to the loader. A preset is either generated once
into the cache as a real checkpoint directory (make_checkpoint.ensure_preset_checkpoint) and then loaded like any other,
or - for presets too large to write (`Preset.draw_on_device`) - built with its random weights drawn directly in device
memory.
"""

from __future__ import annotations

import os

import torch

from nanoserve.config import Optimizations
from nanoserve.model.checkpoint_names import VISION_WEIGHT_NAMES, loader_for, name_map, weight_loaders
from nanoserve.model.loader import CheckpointError, load_model, resolve_quantization
from nanoserve.model.m3 import M3ForCausalLM
from nanoserve.model.mxfp8 import QuantizeOnLoad, is_quantized_matrix
from nanoserve.model.vision.model import M3VisionModel
from nanoserve.presets.catalog import MODEL_NAMES, PRESETS, SHIPPED, get_preset
from nanoserve.presets.checkpoint_layout import random_tensors, random_vision_tensors


def resolve_model_dir(model: str) -> str:
    """A shipped model's name becomes its directory in the package, a preset name its generated cache directory;
    a path must exist."""
    if model in SHIPPED:
        return SHIPPED[model]
    if model in PRESETS:
        from nanoserve.presets.make_checkpoint import ensure_preset_checkpoint

        return ensure_preset_checkpoint(model)
    if not os.path.isdir(model):
        raise CheckpointError(f"model directory {model!r} does not exist (and is not a preset: "
                              f"{', '.join(MODEL_NAMES)})")
    return model


def preset_tokenizer_dir(preset: str) -> str:
    """A directory holding just the preset's tokenizer (written on first use), for presets drawn on the device."""
    from nanoserve.presets.make_checkpoint import preset_cache_dir
    from nanoserve.presets.tokenizer import write_tokenizer

    path = preset_cache_dir(preset) + "-tokenizer"
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        write_tokenizer(path, vision=get_preset(preset).vision is not None)
    return path


def init_random_weights(model: M3ForCausalLM, preset: str, device: torch.device | str) -> None:
    """Fill a model with a preset's random weights drawn directly on `device` (m3-slice on the GPU, whose 50 GB
    checkpoint need not touch disk). For an MXFP8 model (`model.quantization`) the same draw is quantised on the
    device as it is loaded, so bf16 and MXFP8 runs of a preset share their weights."""
    p = get_preset(preset)
    loaders = weight_loaders(model)
    for key, t in random_tensors(model.cfg, p.init_std, p.random_norms, p.seed, device=device):
        src = QuantizeOnLoad(t) if model.quantization and is_quantized_matrix(key, t.shape) else t
        loaders[key](src)


def random_vision_model(preset: str, opts: Optimizations | None, dtype: torch.dtype, device: torch.device | str
                        ) -> M3VisionModel | None:
    """A preset drawn on the device that sees (m3-slice-vl): its vision path with the random weights a written
    checkpoint of it would hold (checkpoint_layout.random_vision_tensors), or None for a text-only preset."""
    p = get_preset(preset)
    if p.vision is None:
        return None
    vision = M3VisionModel(p.vision, opts, dtype, device)
    targets = name_map(vision, VISION_WEIGHT_NAMES, prefix="")
    for key, t in random_vision_tensors(p.vision, p.init_std, p.seed).items():
        loader_for(vision, key, targets[key])(t.to(device))
    return vision


def load_model_or_preset(model: str, opts: Optimizations | None = None, dtype: torch.dtype = torch.float32,
                         device: torch.device | str = "cpu", quantization: str | None = None
                         ) -> tuple[M3ForCausalLM, str]:
    """Build and fill the model named by `model` (a preset or a directory). Returns (model, directory holding the
    tokenizer). `quantization` as in loader.resolve_quantization: "mxfp8" serves bf16 weights as MXFP8, quantised
    at load (presets are bf16)."""
    if model in PRESETS and get_preset(model).draw_on_device:
        quant = resolve_quantization(None, quantization, f"preset {model}")
        m = M3ForCausalLM(get_preset(model).config, opts, dtype, device, quantization=quant)
        init_random_weights(m, model, device)
        return m, preset_tokenizer_dir(model)
    return load_model(resolve_model_dir(model), opts, dtype, device, quantization)
