"""Images and videos on one rank: the vision model, the features it encoded (the device side of the encoder cache,
whose books the scheduler keeps: engine/encoder_cache.py), and the embeddings of a step that takes them.

    EncoderRunner.run(inp)      drop the features the engine evicted, then encode this step's images and videos in
                                one batch (spread over the tensor-parallel ranks: model/vision/data_parallel.py)
    EncoderRunner.embed(...)    the step's input embeddings with feature rows at its placeholder positions (None for
                                a step without any: the model embeds the ids itself)

Every rank runs both on the same ModelInput and holds the same features, as each rank's embedding output is the
whole (replicated) hidden state.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.nn as nn

from nanoserve.model.vision.data_parallel import encode_data_parallel
from nanoserve.model.vision.model import M3VisionModel
from nanoserve.step import ModelInput


class EncoderTiming:
    """How long one step's encoding took: CUDA events read once the step is done (no wait of its own), or the host
    clock on the CPU."""

    def __init__(self, device: torch.device):
        self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) \
            if device.type == "cuda" else None
        self.started = time.perf_counter()
        self.host_seconds = 0.0
        if self.events is not None:
            self.events[0].record()

    def stop(self) -> "EncoderTiming":
        if self.events is not None:
            self.events[1].record()
        else:
            self.host_seconds = time.perf_counter() - self.started
        return self

    def seconds(self) -> float:
        """Call after the step's results are on the host (its work, the encoding included, is done)."""
        if self.events is None:
            return self.host_seconds
        self.events[1].synchronize()
        return self.events[0].elapsed_time(self.events[1]) / 1000.0


class EncoderRunner:
    """The vision model on this rank and the features it keeps, by encoder-cache key."""

    def __init__(self, vision: M3VisionModel, device: torch.device, max_item_tokens: int):
        self.vision = vision
        self.device = device
        self.max_item_tokens = max_item_tokens
        """The placeholder tokens of the largest image the model's processor makes (576 for M3)."""
        self.cache: dict[str, torch.Tensor] = {}

    def cache_size(self, max_num_batched_tokens: int) -> int:
        """Feature rows the encoder cache holds and the encoder may make per step (vLLM's rule: the text model's
        token budget, and at least the largest image)."""
        return max(max_num_batched_tokens, self.max_item_tokens)

    @torch.inference_mode()
    def run(self, inp: ModelInput) -> EncoderTiming | None:
        """Drop the evicted features, then encode the step's images and videos; their timing (None: none)."""
        for key in inp.encoder_frees:
            self.cache.pop(key, None)
        if not inp.encoder_inputs:
            return None
        timing = EncoderTiming(self.device)
        features = [e.feature for e in inp.encoder_inputs]
        pixels = torch.from_numpy(np.concatenate([f.pixel_values for f in features]))
        pixels = pixels.to(self.device, non_blocking=self.device.type == "cuda")
        out = encode_data_parallel(self.vision, pixels, [g for f in features for g in f.grid_thw])
        at = 0
        for e in inp.encoder_inputs:
            n = e.feature.num_tokens
            # a copy each when the batch has several: one item's eviction then frees its own memory
            self.cache[e.key] = out[at:at + n] if len(features) == 1 else out[at:at + n].clone()
            at += n
        return timing.stop()

    @torch.inference_mode()
    def embed(self, embed_tokens: nn.Module, input_ids: torch.Tensor, inp: ModelInput) -> torch.Tensor | None:
        """The step's input embeddings with each placement's feature rows in place of its tokens' embeddings (None
        when the step has no placeholders)."""
        if not inp.placements:
            return None
        missing = [p.key for p in inp.placements if p.key not in self.cache]
        if missing:
            raise RuntimeError(f"the step places features the encoder cache does not hold: {missing[:3]}")
        embeds = embed_tokens(input_ids)
        rows = torch.cat([self.cache[p.key][p.row:p.row + p.count] for p in inp.placements])
        index = np.concatenate([np.arange(p.index, p.index + p.count) for p in inp.placements])
        embeds.index_copy_(0, torch.from_numpy(index).to(self.device), rows.to(embeds.dtype))
        return embeds

    @torch.inference_mode()
    def profile(self, rows: int) -> torch.Tensor:
        """A worst-case encoder step of `rows` feature rows (images of the largest size), for the KV pool's
        sizing; returns its output, which stands for a full encoder cache while the text model's worst step is
        measured."""
        merge = self.vision.cfg.spatial_merge_size
        side = max(1, int(self.max_item_tokens ** 0.5))  # the largest image's grid, in merged tokens per side
        grids, left = [], rows
        while left > 0:
            n = min(left, side * side)
            h = min(side, n)
            w = -(-n // h)
            grids.append((1, h * merge, w * merge))
            left -= h * w
        patches = sum(t * h * w for t, h, w in grids)
        pixels = torch.zeros(patches, self.vision.cfg.patch_dim, dtype=torch.float32, device=self.device)
        return encode_data_parallel(self.vision, pixels, grids)
