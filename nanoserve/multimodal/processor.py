"""The multimodal processor: a prompt with image / video markers plus the media -> the expanded prompt (and its
token ids) and the tower's inputs, exactly as transformers' MiniMaxM3VLProcessor does it.

Each `]<]image[>[` marker in the text, in order, becomes

    ]<]start of image[>[  +  ]<]image[>[ x (one per 2 x 2 patch group)  +  ]<]end of image[>[

and each `]<]video[>[` marker, for every temporal patch of its video in turn,

    [ ]<]{seconds:.1f} seconds[>[ ]  +  ]<]start of image[>[  +  ]<]video[>[ x (tokens per frame)  +  ]<]end of image[>[

(the timestamp only when the frame rate and the frames' source indices are known). The placeholder tokens
(`]<]image[>[` = 200025, `]<]video[>[` = 200026 in M3's tokenizer) are where the vision features go
(model/vision/model.py `scatter_features`). The markers in the prompt must match the media given, one for one.

    proc = MultiModalProcessor.from_model_dir(model_dir)       # preprocessor_config.json, else the defaults
    out = proc("]<]image[>[What is in this picture?", images=[png_bytes], tokenizer=tokenizer)
    out.input_ids, out.pixel_values, out.image_grid_thw        # -> the engine; the tower
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from PIL import Image

from nanoserve.multimodal.image import ProcessedImage, ProcessorConfig, process_image
from nanoserve.multimodal.media import MAX_IMAGE_PIXELS, as_rgb_array
from nanoserve.multimodal.video import ProcessedVideo, frames_array, process_video

IMAGE_TOKEN = "]<]image[>["
VIDEO_TOKEN = "]<]video[>["
VISION_START_TOKEN = "]<]start of image[>["
VISION_END_TOKEN = "]<]end of image[>["
SPECIAL_TOKENS = (IMAGE_TOKEN, VIDEO_TOKEN, VISION_START_TOKEN, VISION_END_TOKEN)
"""The tokenizer must hold each of these as one (special) token."""
_MARKERS = re.compile(f"(?P<image>{re.escape(IMAGE_TOKEN)})|(?P<video>{re.escape(VIDEO_TOKEN)})")


@dataclass
class Video:
    """Frames ([T, H, W, 3] uint8 RGB, or a list of Pillow images) and, optionally, their rate and indices in
    the source video (both needed for the per-frame timestamps)."""

    frames: Any
    fps: float | None = None
    frame_indices: list[int] | None = None


@dataclass
class MultiModalInputs:
    """What a processed request carries: the expanded prompt, its ids (when a tokenizer was given) and the
    tower's inputs for its images and videos, in prompt order."""

    prompt: str
    input_ids: list[int] | None
    images: list[ProcessedImage] = field(default_factory=list)
    videos: list[ProcessedVideo] = field(default_factory=list)

    @property
    def pixel_values(self) -> torch.Tensor | None:
        return torch.cat([i.pixel_values for i in self.images]) if self.images else None

    @property
    def image_grid_thw(self) -> torch.Tensor | None:
        return torch.tensor([i.grid_thw for i in self.images]) if self.images else None

    @property
    def pixel_values_videos(self) -> torch.Tensor | None:
        return torch.cat([v.pixel_values for v in self.videos]) if self.videos else None

    @property
    def video_grid_thw(self) -> torch.Tensor | None:
        """Every video's segments, in order (num_segments_per_video says whose they are)."""
        return torch.tensor([g for v in self.videos for g in v.grid_thw]) if self.videos else None

    @property
    def num_segments_per_video(self) -> list[int]:
        return [v.num_segments for v in self.videos]


class MultiModalProcessor:
    """Images and videos -> patches and the prompt's placeholder runs (see the module docstring)."""

    def __init__(self, image_config: ProcessorConfig | None = None, video_config: ProcessorConfig | None = None,
                 max_image_pixels: int = MAX_IMAGE_PIXELS):
        self.image_config = image_config or ProcessorConfig()
        self.video_config = video_config or ProcessorConfig.video_defaults()
        self.max_image_pixels = max_image_pixels

    @classmethod
    def from_model_dir(cls, model_dir: str, **kwargs: Any) -> "MultiModalProcessor":
        """Settings from the checkpoint's preprocessor_config.json / video_preprocessor_config.json where present."""
        def read(name: str, video: bool) -> ProcessorConfig | None:
            path = os.path.join(model_dir, name)
            if not os.path.isfile(path):
                return None
            with open(path) as f:
                return ProcessorConfig.from_dict(json.load(f), video=video)

        return cls(read("preprocessor_config.json", False), read("video_preprocessor_config.json", True), **kwargs)

    def image(self, image: bytes | Image.Image | np.ndarray) -> ProcessedImage:
        return process_image(as_rgb_array(image, self.max_image_pixels), self.image_config)

    def video(self, video: Video | np.ndarray | list) -> ProcessedVideo:
        if not isinstance(video, Video):
            video = Video(video)
        frames = frames_array(video.frames, self.max_image_pixels)
        return process_video(frames, self.video_config, video.fps, video.frame_indices)

    @staticmethod
    def image_placeholder(image: ProcessedImage) -> str:
        return VISION_START_TOKEN + IMAGE_TOKEN * image.num_tokens + VISION_END_TOKEN

    @staticmethod
    def video_placeholder(video: ProcessedVideo) -> str:
        frame = VISION_START_TOKEN + VIDEO_TOKEN * video.tokens_per_frame + VISION_END_TOKEN
        if video.timestamps is None:
            return frame * video.num_frames
        return "".join(f"]<]{ts:.1f} seconds[>[" + frame for ts in video.timestamps)

    def expand(self, text: str, images: list[ProcessedImage], videos: list[ProcessedVideo]) -> str:
        """The prompt with each marker replaced by its item's placeholder run."""
        n_img, n_vid = text.count(IMAGE_TOKEN), text.count(VIDEO_TOKEN)
        if n_img != len(images) or n_vid != len(videos):
            raise ValueError(f"the prompt has {n_img} image and {n_vid} video marker(s) ({IMAGE_TOKEN}, "
                             f"{VIDEO_TOKEN}) for {len(images)} image(s) and {len(videos)} video(s)")
        runs = {"image": iter(map(self.image_placeholder, images)), "video": iter(map(self.video_placeholder, videos))}
        return _MARKERS.sub(lambda m: next(runs[m.lastgroup]), text)

    def __call__(self, text: str, images: list | None = None, videos: list | None = None, tokenizer: Any = None,
                 add_special_tokens: bool = True) -> MultiModalInputs:
        """Process the media, expand the prompt and (given a Hugging Face tokenizer holding SPECIAL_TOKENS as
        single tokens) tokenize it."""
        done_images = [self.image(i) for i in images or []]
        done_videos = [self.video(v) for v in videos or []]
        prompt = self.expand(text, done_images, done_videos)
        ids = None
        if tokenizer is not None:
            ids = list(tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"])
            expected = sum(i.num_tokens for i in done_images) + sum(v.num_tokens for v in done_videos)
            found = sum(ids.count(tokenizer.convert_tokens_to_ids(t)) for t in (IMAGE_TOKEN, VIDEO_TOKEN))
            if found != expected:
                raise ValueError(f"the tokenizer made {found} placeholder tokens of the {expected} expected: it must "
                                 f"hold {', '.join(SPECIAL_TOKENS)} as single tokens")
        return MultiModalInputs(prompt, ids, done_images, done_videos)
