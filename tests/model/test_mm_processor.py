"""nanoserve's multimodal processor (nanoserve/multimodal/) against transformers' MiniMaxM3VLProcessor.

The cases: images of several sizes and aspect ratios (upscaled to the minimum, kept, downscaled to the maximum;
RGB, RGBA composited on white, greyscale, a palette with a transparent entry) and short videos (frames padded to
whole temporal patches, cut into segments of 4, with and without timestamps), in prompts with several markers.
Every image is drawn from a formula (no random generator), so the inputs are the same on every machine.

transformers' image and video processors need torchvision. Where it imports, `test_matches_transformers_live`
runs them and requires equal token ids and bit-equal pixel tensors. Everywhere, `test_matches_transformers_record`
compares against test_mm_processor_oracle.json: the token ids, grids and a fingerprint of every pixel tensor
(patches x 2 weighted sums, weights in [0.5, 1.5], so a one-level change of any pixel moves one by >= 0.007)
that transformers' processor produced. Rewrite the record where torchvision imports:

    python -m tests.model.test_mm_processor --write
"""

from __future__ import annotations

import io
import json
import struct
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from nanoserve.multimodal.image import smart_resize
from nanoserve.multimodal.processor import SPECIAL_TOKENS, MultiModalProcessor, Video

RECORD = Path(__file__).with_name("test_mm_processor_oracle.json")
FINGERPRINT_ATOL = 1e-4
"""Largest |ours - record| of a fingerprint value (fp32 sums of ~1176 terms; a one-level pixel change is >= 7e-3)."""
PROMPT = "]~!b[]~b]user\n{}What do you see?[e~[\n]~b]ai\n"


def picture(width: int, height: int, mode: str = "RGB", shift: int = 0) -> Image.Image:
    """A deterministic picture: stripes, a product pattern and an xor texture in the three channels."""
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([(x * 7 + y * 3 + shift) % 256, (x * x + y * 5 + 3 * shift) % 256, ((x ^ y) * 11) % 256], -1)
    image = Image.fromarray(rgb.astype(np.uint8))
    if mode == "RGBA":
        image.putalpha(Image.fromarray(((x + y) * 9 % 256).astype(np.uint8)))
    elif mode == "P":
        image = image.convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
        image.info["transparency"] = 3
    elif mode != "RGB":
        image = image.convert(mode)
    return image


def frames(n: int, width: int, height: int) -> np.ndarray:
    return np.stack([np.asarray(picture(width, height, shift=17 * i)) for i in range(n)])


IMAGES = {
    "tiny_upscaled": lambda: picture(20, 20),
    "wide": lambda: picture(300, 120),
    "tall_rgba": lambda: picture(90, 250, "RGBA"),
    "grey_odd": lambda: picture(123, 77, "L"),
    "palette_transparent": lambda: picture(64, 48, "P"),
    "downscaled_to_max": lambda: picture(800, 600),
    "exact_grid": lambda: picture(56, 84),
}
VIDEOS = {
    "video_5_frames": lambda: Video(frames(5, 90, 60)),
    "video_18_frames_timestamps": lambda: Video(frames(18, 40, 30), fps=3.0, frame_indices=list(range(0, 36, 2))),
}
CASES = {
    **{name: ([name], []) for name in IMAGES},
    **{name: ([], [name]) for name in VIDEOS},
    "mixed": (["wide", "tiny_upscaled"], ["video_18_frames_timestamps"]),
}
"""case -> (image names, video names); a case's prompt holds its markers in that order."""


def case_prompt(images: list[str], videos: list[str]) -> str:
    return PROMPT.format("".join(["]<]image[>[ "] * len(images) + ["]<]video[>[ "] * len(videos)))


def tokenizer():
    """m3-tiny's tokenizer with M3's four vision tokens added (as the released tokenizer has them)."""
    from transformers import PreTrainedTokenizerFast

    from nanoserve.presets.tokenizer import build_tokenizer

    tok = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer())
    tok.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS)})
    return tok


def fingerprint(pixels: torch.Tensor) -> list[list[float]]:
    """[patches, 2]: each patch's sums weighted by 1 + cos(...) / 2 (fixed weights in [0.5, 1.5])."""
    i = torch.arange(pixels.shape[1], dtype=torch.float64)[:, None]
    weights = 1.0 + 0.5 * torch.cos(i * torch.tensor([0.37, 1.91], dtype=torch.float64))
    return [[round(v, 5) for v in row] for row in (pixels.double() @ weights).tolist()]


def summary(input_ids, pixels, image_grid, pixels_videos, video_grid) -> dict:
    as_list = lambda t: None if t is None else t.tolist()  # noqa: E731
    return {"input_ids": list(input_ids), "image_grid_thw": as_list(image_grid),
            "video_grid_thw": as_list(video_grid),
            "pixel_values": None if pixels is None else fingerprint(pixels),
            "pixel_values_videos": None if pixels_videos is None else fingerprint(pixels_videos)}


def ours(case: str, tok):
    images, videos = CASES[case]
    return MultiModalProcessor()(case_prompt(images, videos), [IMAGES[n]() for n in images],
                                 [VIDEOS[n]() for n in videos], tokenizer=tok)


def transformers_processor(tok):
    from transformers import MiniMaxM3VLImageProcessor, MiniMaxM3VLProcessor, MiniMaxM3VLVideoProcessor

    return MiniMaxM3VLProcessor(image_processor=MiniMaxM3VLImageProcessor(), tokenizer=tok,
                                video_processor=MiniMaxM3VLVideoProcessor())


def theirs(case: str, processor):
    """transformers' output for a case (resizing videos, as vLLM asks it to; timestamps from VideoMetadata)."""
    from transformers.video_utils import VideoMetadata

    images, videos = CASES[case]
    vids = [VIDEOS[n]() for n in videos]
    kwargs: dict = {"do_resize": True}
    if vids:
        kwargs["video_metadata"] = [VideoMetadata(total_num_frames=len(v.frames), fps=v.fps,
                                                  frames_indices=v.frame_indices) for v in vids]
    out = processor(text=[case_prompt(images, videos)], images=[IMAGES[n]() for n in images] or None,
                    videos=[v.frames for v in vids] or None, videos_kwargs=kwargs, return_tensors="pt")
    return out


def torchvision_imports() -> bool:
    try:
        import torchvision  # noqa: F401
    except Exception:  # absent, or a build for another torch
        return False
    return True


@pytest.fixture(scope="module")
def tok():
    return tokenizer()


@pytest.mark.parametrize("case", list(CASES))
def test_matches_transformers_record(case, tok):
    record = json.loads(RECORD.read_text())[case]
    got = ours(case, tok)
    assert got.input_ids == record["input_ids"]
    mine = summary(got.input_ids, got.pixel_values, got.image_grid_thw, got.pixel_values_videos,
                   got.video_grid_thw)
    assert mine["image_grid_thw"] == record["image_grid_thw"] and mine["video_grid_thw"] == record["video_grid_thw"]
    for key in ("pixel_values", "pixel_values_videos"):
        if record[key] is None:
            assert mine[key] is None
            continue
        diff = (torch.tensor(mine[key]) - torch.tensor(record[key])).abs().max().item()
        assert diff <= FINGERPRINT_ATOL, f"{case} {key}: fingerprint off by {diff:.2e}"


@pytest.mark.skipif(not torchvision_imports(), reason="transformers' image processors need torchvision")
@pytest.mark.parametrize("case", list(CASES))
def test_matches_transformers_live(case, tok):
    want, got = theirs(case, transformers_processor(tok)), ours(case, tok)
    assert want["input_ids"][0].tolist() == got.input_ids
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
        if key in want:
            assert torch.equal(want[key], getattr(got, key)), key
        else:
            assert getattr(got, key) is None, key


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_encoded_images_decode_as_pillow_does(fmt):
    """Bytes of each accepted format give the patches of the image Pillow decodes from them."""
    buf = io.BytesIO()
    picture(150, 100).save(buf, format=fmt)
    proc = MultiModalProcessor()
    from_bytes = proc.image(buf.getvalue())
    from_pillow = proc.image(Image.open(io.BytesIO(buf.getvalue())))
    assert torch.equal(from_bytes.pixel_values, from_pillow.pixel_values)
    assert from_bytes.grid_thw == (1, 8, 10) and from_bytes.num_tokens == 20  # 100 x 150 -> 112 x 140 px


def png_claiming(width: int, height: int) -> bytes:
    """A 1 x 1 PNG whose header claims width x height (CRC fixed): nothing of that size exists to decode."""
    buf = io.BytesIO()
    Image.new("RGB", (1, 1)).save(buf, format="PNG")
    data = bytearray(buf.getvalue())
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def test_unusable_images_raise_a_clear_value_error():
    proc = MultiModalProcessor()
    good = io.BytesIO()
    picture(64, 64).save(good, format="PNG")
    gif = io.BytesIO()
    picture(8, 8).save(gif, format="GIF")
    cases = {
        b"": "empty",
        b"definitely not an image": "cannot be read",
        good.getvalue()[: len(good.getvalue()) // 2]: "corrupt",
        gif.getvalue(): "format GIF is not accepted",
        png_claiming(20000, 20000): "over the limit",
        png_claiming(4000, 10): "aspect ratio",
    }
    for data, message in cases.items():
        with pytest.raises(ValueError, match=message):
            proc.image(data)
    with pytest.raises(ValueError, match="over the limit"):
        MultiModalProcessor(max_image_pixels=1000).image(picture(40, 30))
    with pytest.raises(ValueError, match=r"\[height, width, 3\] uint8"):
        proc.image(np.zeros((4, 4), dtype=np.uint8))
    with pytest.raises(ValueError, match="frames"):
        proc.video(np.zeros((3, 28, 28), dtype=np.uint8))
    with pytest.raises(ValueError, match="1 image and 0 video marker"):
        proc("]<]image[>[ two images?", [picture(28, 28), picture(28, 28)])


def test_grid_follows_the_area_rule():
    """Sides are multiples of 28 and the area is within the bounds, from 1 x 1 to 3000 x 200 and back."""
    for h, w in [(1, 1), (27, 29), (1000, 1000), (3000, 200), (200, 3000), (672, 672), (673, 4)]:
        rh, rw = smart_resize(h, w, 28, 3136, 451584)
        assert rh % 28 == 0 and rw % 28 == 0 and 3136 <= rh * rw <= 451584, (h, w, rh, rw)


def write_record() -> None:
    tok = tokenizer()
    processor = transformers_processor(tok)
    record = {}
    for case in CASES:
        out = theirs(case, processor)
        record[case] = summary(out["input_ids"][0].tolist(), out.get("pixel_values"), out.get("image_grid_thw"),
                               out.get("pixel_values_videos"), out.get("video_grid_thw"))
    RECORD.write_text(json.dumps(record, separators=(",", ":")) + "\n")
    print(f"wrote {RECORD} ({RECORD.stat().st_size:,} bytes) from transformers' processor")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        raise SystemExit("usage: python -m tests.model.test_mm_processor --write")
    write_record()
