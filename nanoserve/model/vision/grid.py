"""Where each patch of a batch sits: attention segments, 3-D positions and their RoPE angles.

A batch of images and videos reaches the tower as one flat run of patches, `grid_thw` giving each item's
(temporal, height, width) patch counts in order. An image is one temporal patch (its frame duplicated across the
2 frames of a temporal patch); a video has t = ceil(frames / 2). Within an item, patches come 2x2-group-major: the
four patches of one merged text token are consecutive (rows of merged tokens, then the token's 2x2 patches,
then, for a video, the next temporal patch), which is the order the processor writes them in and the order the
patch merger folds them back in.

Attention is bidirectional within a segment and never crosses one: an image is one segment, a video is cut into
segments of at most `vision_segment_max_frames` (4) temporal patches, each with its own temporal positions from 0
(as transformers' video processor and vLLM's tower both cut it). `segments` does the cut, so a grid already cut
by the processor passes through unchanged.

3-D RoPE: a patch's position is (t, h, w) within its segment; each axis gets a band of `rope_band` dims (26 of
M3's 80-dim heads) with frequencies theta^(-2i/band), the bands laid out t|h|w over the first half of the
rotated dims and again over the second half (rotate-half / NeoX form, 78 dims rotated, the last 2 passed through).
"""

from __future__ import annotations

import torch


def segments(grid_thw: list[tuple[int, int, int]] | torch.Tensor, max_frames: int | None) -> list[tuple[int, int, int]]:
    """Each item's (t, h, w) cut into attention segments of at most max_frames temporal patches (None: uncut)."""
    out = []
    for t, h, w in (grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else grid_thw):
        step = t if max_frames is None else max_frames
        out.extend((min(step, t - start), h, w) for start in range(0, t, step))
    return out


def cu_seqlens(segs: list[tuple[int, int, int]], device: torch.device | str = "cpu") -> torch.Tensor:
    """[num_segments + 1] int32: where each segment's patches start in the flat batch, then the total."""
    lens = torch.tensor([0] + [t * h * w for t, h, w in segs], dtype=torch.int64)
    return lens.cumsum(0).to(device=device, dtype=torch.int32)


def positions(segs: list[tuple[int, int, int]], merge: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[N, 3] int64 (t, h, w) of every patch, in the 2x2-group-major order described above."""
    out = []
    for t, h, w in segs:
        if h % merge or w % merge:
            raise ValueError(f"a grid of {h} x {w} patches is not a multiple of the {merge} x {merge} merge")
        hh, ww = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        block = (h // merge, merge, w // merge, merge)
        hh = hh.reshape(block).transpose(1, 2).flatten()  # merged row, merged col, row in group, col in group
        ww = ww.reshape(block).transpose(1, 2).flatten()
        tt = torch.arange(t).repeat_interleave(h * w)
        out.append(torch.stack([tt, hh.repeat(t), ww.repeat(t)], dim=-1))
    return torch.cat(out).to(device)


def rope_inv_freq(band: int, theta: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """[band / 2] fp32 inverse frequencies of one axis' band (the same for t, h and w)."""
    return 1.0 / (theta ** (torch.arange(0, band, 2, dtype=torch.float32, device=device) / band))


def rope_cos_sin(pos: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, 3 x band / 2] fp32 of the angles pos[:, axis] x inv_freq, the t, h, w bands in order."""
    angles = (pos[:, :, None].float() * inv_freq[None, None, :]).flatten(1)
    return angles.cos(), angles.sin()
