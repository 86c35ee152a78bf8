"""Small test images: random PNGs, their data URLs, JPEG frames of a video, and broken files (truncated, a header
that claims more pixels than the limit)."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
from PIL import Image


def png(seed: int, height: int = 64, width: int = 80) -> bytes:
    """A PNG of random pixels."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def jpeg(seed: int, height: int = 56, width: int = 56) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG")
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def video_url(frames: list[bytes]) -> str:
    """vLLM's video data URL: base64 JPEG frames joined by commas."""
    return "data:video/jpeg;base64," + ",".join(base64.b64encode(f).decode() for f in frames)


def huge_header_png(width: int = 20000, height: int = 20000) -> bytes:
    """A 1 x 1 PNG whose header claims width x height pixels (its data is too short for that): a decompression
    bomb's signature, refused from the header before anything is decoded."""
    data = png(0, 1, 1)
    ihdr = struct.pack(">II", width, height) + data[24:29]
    chunk = b"IHDR" + ihdr
    return data[:8] + struct.pack(">I", 13) + chunk + struct.pack(">I", zlib.crc32(chunk)) + data[33:]


def image_tokens(height: int, width: int) -> int:
    """The placeholder tokens M3's processor gives an image of this size (multimodal/image.py smart_resize)."""
    from nanoserve.multimodal.image import ProcessorConfig, smart_resize

    cfg = ProcessorConfig()
    h, w = smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    return (h // cfg.factor) * (w // cfg.factor)
