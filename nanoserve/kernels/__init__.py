"""Triton kernels and their plain-PyTorch reference (`reference.py`).

A kernel runs on a GPU (CUDA, or HIP on ROCm builds of PyTorch), or on the CPU under Triton's interpreter
(`TRITON_INTERPRET=1`, for tests). Everywhere else the reference path runs, whatever the switches say.
"""

from __future__ import annotations

import functools
import os

import torch


@functools.lru_cache(maxsize=None)
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # a broken or missing Triton install means: use the reference path
        return False
    return True


def triton_usable(device: torch.device | torch.Tensor) -> bool:
    """Can a Triton kernel run on this device in this process?"""
    if isinstance(device, torch.Tensor):
        device = device.device
    if device.type == "cuda":
        return _triton_importable()
    return os.environ.get("TRITON_INTERPRET") == "1" and _triton_importable()


def check_tuned_files() -> None:
    """Read the tile tables named by $NANOSERVE_GEMV_TUNED_CONFIG and $NANOSERVE_FP8_TUNED_CONFIG, if set: a file
    that cannot be read raises ValueError naming it (the engine calls this at start, before the weights load)."""
    from nanoserve.kernels import configs, fp8_configs

    configs.tuned_gemv_tables()
    fp8_configs.tuned_tables()
