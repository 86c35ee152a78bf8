"""Pixels -> patches, as transformers' MiniMaxM3VLImageProcessor makes them.

1. Resize to M3's dynamic-resolution grid (`smart_resize`): both sides become multiples of 28 px (14-px patches,
   2 x 2 of them per text token), the aspect ratio kept as closely as possible, the area brought within
   [min_pixels, max_pixels] (defaults 3,136 and 451,584 = 672 x 672: from 4 to 576 text tokens). The resize is
   bicubic with antialiasing on the uint8 image (torchvision's rule on the CPU, which `F.interpolate` computes
   natively in uint8), skipped when the size is already right.
2. Rescale and normalise: (x - 255 mean) / (255 std) per channel in fp32, CLIP's mean and std.
3. Cut into 14 x 14 patches, ordered 2 x 2-group-major (the four patches of one text token consecutive), each
   flattened channel, time, row, column: 3 x 2 x 14 x 14 = 1176 values, the image repeated across the two frames
   of a temporal patch. grid_thw = (1, height / 14, width / 14).

The config's `image_grid_pinpoints` (every size from 336 to 2016 in steps of 336) describe the resolutions the
model was trained at; neither transformers nor vLLM resizes to them: both use this area rule, and so does this.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from nanoserve.multimodal.media import MAX_ASPECT_RATIO

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56,
                 max_pixels: int = 14 * 14 * 4 * 1280) -> tuple[int, int]:
    """The (height, width) an image is resized to: multiples of `factor`, area within [min_pixels, max_pixels],
    the aspect ratio kept as closely as possible (transformers' rule, number for number)."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"image is {width} x {height} pixels: its aspect ratio must be below {MAX_ASPECT_RATIO}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def resize(images: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """uint8 [B, C, H, W] -> uint8 [B, C, height, width], bicubic with antialiasing (torchvision's resize on the
    CPU; unchanged when the size already matches)."""
    if tuple(images.shape[-2:]) == (height, width):
        return images
    return F.interpolate(images, size=[height, width], mode="bicubic", align_corners=False, antialias=True)


def normalize(images: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...],
              rescale_factor: float) -> torch.Tensor:
    """uint8 [..., C, H, W] -> fp32 (x - mean / rescale_factor) / (std / rescale_factor), computed as transformers
    fuses its rescale into the normalisation."""
    m = torch.tensor(mean) * (1.0 / rescale_factor)
    s = torch.tensor(std) * (1.0 / rescale_factor)
    return (images.to(torch.float32) - m[:, None, None]) / s[:, None, None]


@dataclass
class ProcessorConfig:
    """The image (or video) processor's settings: transformers' defaults, or a preprocessor_config.json's."""

    min_pixels: int = 4 * 28 * 28
    max_pixels: int = 672 * 672
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    rescale_factor: float = 1 / 255
    vision_segment_max_frames: int | None = 4
    """Videos only: temporal patches per attention segment."""
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def factor(self) -> int:
        """Pixels per text token along a side: patch_size x merge_size (28)."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_dict(cls, raw: dict[str, Any], video: bool = False) -> "ProcessorConfig":
        """From a preprocessor_config.json (or video_preprocessor_config.json) dict; absent keys keep the defaults.
        transformers' quirk is kept: a `size` of [672, 672] (what the released file holds) means the defaults."""
        base = cls.video_defaults() if video else cls()
        kw: dict[str, Any] = {}
        size = raw.get("size")
        if isinstance(size, dict):
            if size.get("shortest_edge") is not None:
                kw["min_pixels"] = int(size["shortest_edge"])
            if size.get("longest_edge") is not None:
                kw["max_pixels"] = int(size["longest_edge"])
        for name in ("min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size"):
            if raw.get(name) is not None:
                kw[name] = int(raw[name])
        for name in ("image_mean", "image_std"):
            if raw.get(name) is not None:
                kw[name] = tuple(float(v) for v in raw[name])
        if raw.get("rescale_factor") is not None:
            kw["rescale_factor"] = float(raw["rescale_factor"])
        if "vision_segment_max_frames" in raw:
            kw["vision_segment_max_frames"] = raw["vision_segment_max_frames"]
        out = base.replace(**kw)
        if out.min_pixels > out.max_pixels or out.factor < 1:
            raise ValueError(f"preprocessor config: min_pixels {out.min_pixels} > max_pixels {out.max_pixels}")
        return out

    @classmethod
    def video_defaults(cls) -> "ProcessorConfig":
        """transformers' MiniMaxM3VLVideoProcessor: frames of 4 to 768 text tokens."""
        return cls(max_pixels=768 * 28 * 28)

    def replace(self, **changes: Any) -> "ProcessorConfig":
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d.update(changes)
        return ProcessorConfig(**d)


@dataclass
class ProcessedImage:
    """One image as the tower takes it: patches [h x w, 1176] fp32 and its grid (1, h, w) in patches."""

    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    merge_size: int

    @property
    def num_tokens(self) -> int:
        """Placeholder tokens (text positions) it fills: one per 2 x 2 patch group."""
        t, h, w = self.grid_thw
        return t * h * w // self.merge_size ** 2


def patchify_image(pixels: torch.Tensor, cfg: ProcessorConfig) -> torch.Tensor:
    """fp32 [C, H, W] -> [H / 14 x W / 14, C x 2 x 14 x 14], 2 x 2-group-major, each frame repeated over time."""
    c, height, width = pixels.shape
    p, m = cfg.patch_size, cfg.merge_size
    gh, gw = height // p, width // p
    x = pixels.reshape(c, gh // m, m, p, gw // m, m, p)
    x = x.permute(1, 4, 2, 5, 0, 3, 6)  # merged row, merged col, row in group, col in group, channel, y, x
    x = x.unsqueeze(5).expand(-1, -1, -1, -1, -1, cfg.temporal_patch_size, -1, -1)
    return x.reshape(gh * gw, c * cfg.temporal_patch_size * p * p)


def process_image(rgb: np.ndarray, cfg: ProcessorConfig) -> ProcessedImage:
    """[H, W, 3] uint8 RGB -> the tower's patches (resize, normalise, patchify)."""
    height, width = rgb.shape[:2]
    new_h, new_w = smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    image = torch.from_numpy(np.require(rgb, requirements=["C", "W"])).permute(2, 0, 1).contiguous()[None]
    image = normalize(resize(image, new_h, new_w), cfg.image_mean, cfg.image_std, cfg.rescale_factor)[0]
    return ProcessedImage(patchify_image(image, cfg), (1, new_h // cfg.patch_size, new_w // cfg.patch_size),
                          cfg.merge_size)
