"""Images in: bytes (PNG, JPEG, WebP), Pillow images or arrays -> RGB uint8 arrays, with the limits checked first.

Every problem with an input is a ValueError that names it (the server turns it into a 400): bytes Pillow cannot
identify or decode, a format outside PNG / JPEG / WebP, a truncated file, an image larger than `max_pixels`
(checked from the header, before anything is decoded, so a decompression bomb costs nothing), an aspect ratio of
200 or more (the resize rule's limit), a wrong array shape or dtype.

RGB conversion follows transformers (`image_transforms.convert_to_rgb`): an image with an alpha channel or a
transparent palette entry is composited onto white, anything else is converted by Pillow's `convert("RGB")`.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
from PIL import Image

FORMATS = ("PNG", "JPEG", "WEBP")
"""Encoded formats accepted from bytes (Pillow's names)."""
MAX_IMAGE_PIXELS = 64 * 2**20
"""Default limit on an image's decoded size in pixels (about 8192 x 8192); M3 resizes every image to at most
451,584 pixels anyway, so anything larger only costs decode time and memory."""
MAX_ASPECT_RATIO = 200
"""transformers' resize rule refuses a longer side of 200 or more times the shorter."""


def check_size(width: int, height: int, max_pixels: int, what: str = "image") -> None:
    """ValueError unless a width x height image is within max_pixels and the aspect ratio limit."""
    if width < 1 or height < 1:
        raise ValueError(f"{what} is {width} x {height} pixels: empty")
    if width * height > max_pixels:
        raise ValueError(f"{what} is {width} x {height} = {width * height:,} pixels, over the limit of "
                         f"{max_pixels:,} pixels")
    if max(width, height) / min(width, height) >= MAX_ASPECT_RATIO:
        raise ValueError(f"{what} is {width} x {height} pixels: its aspect ratio must be below {MAX_ASPECT_RATIO}")


def to_rgb(image: Image.Image) -> np.ndarray:
    """[H, W, 3] uint8: transparency composited onto white, as transformers converts."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        image = Image.alpha_composite(background, rgba).convert("RGB")
    else:
        image = image.convert("RGB")
    return np.asarray(image, dtype=np.uint8)


def decode_image(data: bytes, max_pixels: int = MAX_IMAGE_PIXELS) -> np.ndarray:
    """Encoded image bytes -> [H, W, 3] uint8 RGB. ValueError naming the problem for anything unusable: whatever
    Pillow raises on bytes it cannot read (its decoders raise OSError, SyntaxError, EOFError, struct errors and
    more on broken files) becomes one."""
    if not data:
        raise ValueError("image is empty (0 bytes)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
    except (Image.DecompressionBombWarning, Image.DecompressionBombError) as e:  # Pillow's own, larger limit
        raise ValueError(f"image is over the limit of {max_pixels:,} pixels ({e})") from e
    except Exception as e:  # noqa: BLE001 - untrusted bytes: any failure to identify them is the request's
        raise ValueError(f"image cannot be read: not a PNG, JPEG or WebP file Pillow can identify ({e})") from e
    with image:
        if image.format not in FORMATS:
            raise ValueError(f"image format {image.format} is not accepted: PNG, JPEG or WebP")
        check_size(image.width, image.height, max_pixels)
        try:
            image.load()
            return to_rgb(image)
        except Exception as e:  # noqa: BLE001 - a decoder's failure on untrusted bytes
            raise ValueError(f"image is corrupt: the {image.format} data cannot be decoded ({e})") from e


def as_rgb_array(image: bytes | Image.Image | np.ndarray, max_pixels: int = MAX_IMAGE_PIXELS) -> np.ndarray:
    """Any accepted image input -> [H, W, 3] uint8 RGB: bytes are decoded, a Pillow image converted, an array
    ([H, W, 3] uint8, RGB) checked."""
    if isinstance(image, (bytes, bytearray, memoryview)):
        return decode_image(bytes(image), max_pixels)
    if isinstance(image, Image.Image):
        check_size(image.width, image.height, max_pixels)
        return to_rgb(image)
    if isinstance(image, np.ndarray):
        if image.ndim != 3 or image.shape[-1] != 3 or image.dtype != np.uint8:
            raise ValueError(f"an image array must be [height, width, 3] uint8 RGB, got {list(image.shape)} "
                             f"{image.dtype}")
        check_size(image.shape[1], image.shape[0], max_pixels)
        return image
    raise ValueError(f"an image must be bytes, a PIL image or a numpy array, got {type(image).__name__}")
