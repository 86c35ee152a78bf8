"""A processed prompt's images and videos as the engine takes them: one `MultiModalFeature` each (nanoserve/step.py),
with its content hash and where its placeholder tokens sit in the prompt.

    process_prompt(processor, tokenizer, prompt, vision, images=..., videos=...)
        -> (token ids, [MultiModalFeature, ...])     what LLM.generate / LLM.chat and the server hand the engine

The content hash covers what the vision tower reads - the modality, the grid and every pixel value after the
resize - so two requests with the same picture (even sent as different files) share encoder-cache entries and
prefix-cache blocks, and two different pictures never do.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch

from nanoserve.model.vision.config import VisionConfig
from nanoserve.multimodal.processor import IMAGE_TOKEN, VIDEO_TOKEN, MultiModalInputs, MultiModalProcessor
from nanoserve.step import MultiModalFeature


def content_hash(modality: str, pixel_values: torch.Tensor | np.ndarray, grid_thw: list[tuple[int, int, int]]) -> str:
    """A hex digest of an item as the tower reads it."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{modality}:{[tuple(g) for g in grid_thw]}:".encode())
    values = pixel_values.numpy() if isinstance(pixel_values, torch.Tensor) else pixel_values
    h.update(np.ascontiguousarray(values, dtype=np.float32).data)
    return h.hexdigest()


def placeholder_runs(token_ids: list[int], token_id: int) -> list[tuple[int, int]]:
    """(start, length) of every run of `token_id` in the prompt, in order."""
    ids = np.asarray(token_ids, dtype=np.int64)
    hit = np.flatnonzero(ids == token_id)
    if not hit.size:
        return []
    breaks = np.flatnonzero(np.diff(hit) != 1)
    starts = np.concatenate([hit[:1], hit[breaks + 1]])
    ends = np.concatenate([hit[breaks], hit[-1:]]) + 1
    return [(int(s), int(e - s)) for s, e in zip(starts, ends)]


def engine_features(mm: MultiModalInputs, vision: VisionConfig) -> list[MultiModalFeature]:
    """The processed items of a prompt (its ids expanded: `mm.input_ids`) as engine features, in prompt order.
    ValueError when the prompt's placeholder runs do not match the items."""
    assert mm.input_ids is not None, "process the prompt with a tokenizer first"
    image_runs = placeholder_runs(mm.input_ids, vision.image_token_id)
    video_runs = placeholder_runs(mm.input_ids, vision.video_token_id)
    frames = [v.num_frames for v in mm.videos]
    if len(image_runs) != len(mm.images) or len(video_runs) != sum(frames):
        raise ValueError(f"the prompt has {len(image_runs)} image and {len(video_runs)} video placeholder runs for "
                         f"{len(mm.images)} image(s) and {sum(frames)} video frame pair(s)")
    out = []
    for image, run in zip(mm.images, image_runs):
        if run[1] != image.num_tokens:
            raise ValueError(f"an image of {image.num_tokens} tokens has a placeholder run of {run[1]}")
        grid = [tuple(image.grid_thw)]
        pixels = image.pixel_values.numpy()
        out.append(MultiModalFeature("image", content_hash("image", pixels, grid), [run], pixels, grid))
    at = 0
    for video, n in zip(mm.videos, frames):
        runs = video_runs[at:at + n]
        at += n
        if any(length != video.tokens_per_frame for _, length in runs):
            raise ValueError(f"a video of {video.tokens_per_frame} tokens per frame pair has placeholder runs of "
                             f"{sorted({length for _, length in runs})}")
        grid = [tuple(g) for g in video.grid_thw]
        pixels = video.pixel_values.numpy()
        out.append(MultiModalFeature("video", content_hash("video", pixels, grid), runs, pixels, grid))
    return sorted(out, key=lambda f: f.offset)


def process_prompt(processor: MultiModalProcessor, tokenizer: Any, prompt: str, vision: VisionConfig,
                   images: list | None = None, videos: list | None = None, add_special_tokens: bool = False
                   ) -> tuple[list[int], list[MultiModalFeature]]:
    """A prompt with one `]<]image[>[` / `]<]video[>[` marker per item (as the chat template renders image and video
    parts) and the items -> the expanded prompt's token ids and the engine's features. ValueError naming the
    problem for a bad or mismatched item."""
    for marker, token_id in ((IMAGE_TOKEN, vision.image_token_id), (VIDEO_TOKEN, vision.video_token_id)):
        if tokenizer.convert_tokens_to_ids(marker) != token_id:
            raise ValueError(f"the tokenizer does not hold {marker} as the model's placeholder token {token_id}")
    mm = processor(prompt, images=images, videos=videos, tokenizer=tokenizer, add_special_tokens=add_special_tokens)
    return mm.input_ids, engine_features(mm, vision)
