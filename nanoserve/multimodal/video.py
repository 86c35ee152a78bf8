"""Video frames -> patches, as transformers' MiniMaxM3VLVideoProcessor makes them (with resizing on, as vLLM
calls it).

Every frame is resized like an image (smart_resize, with the video bounds: 4 to 768 text tokens per frame),
normalised, and the frame count padded to a multiple of the temporal patch (2) by repeating the last frame. Two
consecutive frames make one temporal patch: patches are ordered temporal patch, then 2 x 2 group, then patch in
group, each flattened channel, time, row, column. The video's grid (t, h, w) is cut into attention segments of
at most `vision_segment_max_frames` (4) temporal patches: `grid_thw` lists the segments, `num_segments` how many
belong to this video.

Timestamps: given the frames' rate and their indices in the source (`fps`, `frame_indices`), each temporal patch
is announced in the prompt by `]<]{seconds:.1f} seconds[>[`, the time of its first frame (processor.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from nanoserve.model.vision.grid import segments
from nanoserve.multimodal.image import ProcessorConfig, normalize, resize, smart_resize
from nanoserve.multimodal.media import MAX_IMAGE_PIXELS, check_size, to_rgb

MAX_FRAMES = 768
"""transformers' video processor samples at most this many frames."""


@dataclass
class ProcessedVideo:
    """One video as the tower takes it: patches [t x h x w, 1176] fp32, its segments' grids (each (t_i, h, w),
    sum of t_i = t) and the time of each temporal patch (None without a frame rate)."""

    pixel_values: torch.Tensor
    grid_thw: list[tuple[int, int, int]]
    merge_size: int
    timestamps: list[float] | None

    @property
    def num_segments(self) -> int:
        return len(self.grid_thw)

    @property
    def tokens_per_frame(self) -> int:
        """Placeholder tokens per temporal patch: h x w / 4."""
        _, h, w = self.grid_thw[0]
        return h * w // self.merge_size ** 2

    @property
    def num_frames(self) -> int:
        """Temporal patches (pairs of frames)."""
        return sum(t for t, _, _ in self.grid_thw)

    @property
    def num_tokens(self) -> int:
        return self.num_frames * self.tokens_per_frame


def frames_array(frames: np.ndarray | list, max_pixels: int = MAX_IMAGE_PIXELS) -> np.ndarray:
    """[T, H, W, 3] uint8 RGB from an array of that shape or a list of Pillow images / [H, W, 3] arrays."""
    if isinstance(frames, np.ndarray):
        arr = frames
    else:
        if not frames:
            raise ValueError("a video needs at least one frame")
        arr = np.stack([to_rgb(f) if isinstance(f, Image.Image) else np.asarray(f) for f in frames])
    if arr.ndim != 4 or arr.shape[-1] != 3 or arr.dtype != np.uint8:
        raise ValueError(f"video frames must be [frames, height, width, 3] uint8 RGB, got {list(arr.shape)} "
                         f"{arr.dtype}")
    if not 1 <= arr.shape[0] <= MAX_FRAMES:
        raise ValueError(f"a video has {arr.shape[0]} frames: 1 to {MAX_FRAMES} are accepted")
    check_size(arr.shape[2], arr.shape[1], max_pixels, "a video frame")
    return arr


def process_video(frames: np.ndarray, cfg: ProcessorConfig, fps: float | None = None,
                  frame_indices: list[int] | None = None) -> ProcessedVideo:
    """[T, H, W, 3] uint8 RGB frames -> the tower's patches, cut into segments."""
    n, height, width = frames.shape[:3]
    new_h, new_w = smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    video = torch.from_numpy(np.require(frames, requirements=["C", "W"])).permute(0, 3, 1, 2).contiguous()
    video = normalize(resize(video, new_h, new_w), cfg.image_mean, cfg.image_std, cfg.rescale_factor)
    tp, p, m = cfg.temporal_patch_size, cfg.patch_size, cfg.merge_size
    if pad := -n % tp:
        video = torch.cat([video, video[-1:].expand(pad, -1, -1, -1)])
    gt, gh, gw = video.shape[0] // tp, new_h // p, new_w // p
    c = video.shape[1]
    x = video.reshape(gt, tp, c, gh // m, m, p, gw // m, m, p)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # t, merged row, merged col, row / col in group, channel, time, y, x
    pixel_values = x.reshape(gt * gh * gw, c * tp * p * p)
    timestamps = None
    if fps is not None and frame_indices is not None:
        if len(frame_indices) != n or fps <= 0:
            raise ValueError(f"video metadata: {len(frame_indices)} frame indices for {n} frames at fps {fps}")
        timestamps = [frame_indices[min(i * tp, n - 1)] / fps for i in range(gt)]
    return ProcessedVideo(pixel_values, segments([(gt, gh, gw)], cfg.vision_segment_max_frames), m, timestamps)
