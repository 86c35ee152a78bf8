"""M3's vision path, top-down: pixels in, one text-width feature per placeholder token out.

    patches [N, 1176]  (the processor's output: nanoserve/multimodal/processor.py)
      -> VisionTower                         [N, 1280]   model/vision/tower.py
      -> projector  (linear_1, GELU, linear_2, per patch)              [N, 6144]
      -> patch merger (4 consecutive patches = one 2x2 group, concatenated; linear_1, GELU, linear_2)
                                             [N / 4, 6144]
      -> scatter_features: row i replaces the embedding of the i-th placeholder token (200025 image, 200026 video)

The processor writes each 2x2 group's patches consecutively, so the merger's grouping is a reshape. Items keep
their order: the features of a batch are item 0's tokens, then item 1's, ... (`tokens_per_item` says how many).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanoserve.config import Optimizations
from nanoserve.model.vision.config import VisionConfig
from nanoserve.model.vision.layers import VisionLinear
from nanoserve.model.vision.tower import VisionTower


class GeluMLP(nn.Module):
    """linear_1 -> GELU (exact) -> linear_2: the projector and the patch merger."""

    def __init__(self, in_features: int, hidden: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__()
        self.linear_1 = VisionLinear(in_features, [("", hidden)], dtype, device, bias)
        self.linear_2 = VisionLinear(hidden, [("", out_features)], dtype, device, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.gelu(self.linear_1(x)))


class M3VisionModel(nn.Module):
    """The tower, the projector and the patch merger (checkpoint prefixes `vision_tower.vision_model.`,
    `multi_modal_projector.`, `patch_merge_mlp.`). `forward(pixel_values, grid_thw)` encodes a whole batch of
    images and video segments at once and returns [N / 4, text hidden] in the model dtype."""

    def __init__(self, cfg: VisionConfig, opts: Optimizations | None = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        super().__init__()
        self.cfg = cfg
        self.opts = opts if opts is not None else Optimizations()
        self.dtype = dtype
        self.tower = VisionTower(cfg, self.opts, dtype, device)
        self.projector = GeluMLP(cfg.hidden_size, cfg.projector_hidden_size, cfg.text_hidden_size,
                                 cfg.projector_bias, dtype, device)
        self.merger = GeluMLP(cfg.text_hidden_size * cfg.merge_unit, cfg.projector_hidden_size,
                              cfg.text_hidden_size, cfg.projector_bias, dtype, device)

    def tokens_per_item(self, grid_thw: list[tuple[int, int, int]] | torch.Tensor) -> list[int]:
        """Placeholder tokens (feature rows) of each item: t x h x w / 4."""
        rows = grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else grid_thw
        return [t * h * w // self.cfg.merge_unit for t, h, w in rows]

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]] | torch.Tensor) -> torch.Tensor:
        x = self.projector(self.tower(pixel_values, grid_thw))
        return self.merger(x.reshape(x.shape[0] // self.cfg.merge_unit, -1))

    def weight_summary(self) -> str:
        held = sum(p.numel() * p.element_size() for p in self.parameters())
        return f"vision {str(self.dtype).removeprefix('torch.')}, {held / 2**30:.2f} GiB of parameters"


def scatter_features(embeds: torch.Tensor, input_ids: torch.Tensor, features: torch.Tensor,
                     token_id: int) -> torch.Tensor:
    """A copy of embeds [T, hidden] whose rows at the placeholder token_id are features [P, hidden], in order (the
    i-th placeholder gets row i). The counts must match: a mismatch raises ValueError naming both."""
    where = input_ids == token_id
    count = int(where.sum())
    if count != features.shape[0]:
        raise ValueError(f"{count} placeholder token(s) {token_id} in the input, but {features.shape[0]} feature "
                         f"row(s) to put there")
    out = embeds.clone()
    out[where] = features.to(dtype=embeds.dtype, device=embeds.device)
    return out


def merge_multimodal_embeddings(embeds: torch.Tensor, input_ids: torch.Tensor, cfg: VisionConfig,
                                image_features: torch.Tensor | None = None,
                                video_features: torch.Tensor | None = None) -> torch.Tensor:
    """The text embeddings with image features at the image placeholders and video features at the video ones."""
    if image_features is not None:
        embeds = scatter_features(embeds, input_ids, image_features, cfg.image_token_id)
    if video_features is not None:
        embeds = scatter_features(embeds, input_ids, video_features, cfg.video_token_id)
    return embeds
