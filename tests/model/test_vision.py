"""nanoserve's vision path (reference kernels) against transformers' `minimax_m3_vl` on the same checkpoint.

Both sides read one checkpoint directory: m3-tiny's text weights plus a random vision tower, projector and patch
merger under the released key names (`vision_tower.vision_model....`, `multi_modal_projector.`, `patch_merge_mlp.`),
which transformers renames on load and nanoserve maps with VISION_WEIGHT_NAMES. Two towers:

- real width: 2 layers at M3's widths (1280, 16 heads of 80, MLP 5120, 14-px patches, 3-D RoPE bands of 26);
- full depth: M3's 32 layers at a tiny width (64, 4 heads of 16).

The batch mixes two images and a 6-temporal-patch video, which both sides cut into segments of 4 + 2 (transformers
through the grid its video processor would give, nanoserve from the uncut grid), so the segment boundaries and the
per-segment temporal positions are checked too. The placeholder ids are moved inside m3-tiny's small vocabulary.

Tolerance (fp32, CPU): max |ours - transformers| <= FP32_ATOL x max(1, max |transformers|), for the projected and
merged features and for the text embeddings with the features scattered in (the language model's input).
`test_bf16_features_on_gpu` (marked gpu) compares bf16 runs on a GPU, with the Triton kernels, against the fp32
reference, at transformers' own bf16 error.

Run: python -m pytest tests/model/test_vision.py -q -s
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanoserve.config import Optimizations
from nanoserve.model.loader import load_model, load_vision_model
from nanoserve.model.vision.config import VisionConfig
from nanoserve.model.vision.model import merge_multimodal_embeddings
from nanoserve.presets.catalog import get_preset
from nanoserve.presets.checkpoint_layout import random_vision_tensors
from nanoserve.presets.make_checkpoint import write_checkpoint

FP32_ATOL = 1e-4
"""fp32 parity bound, relative to max(1, the reference's largest magnitude) (measured: ~1e-6)."""
REAL_WIDTH = VisionConfig(num_hidden_layers=2, projector_hidden_size=256)
"""M3's tower widths with 2 layers; the projector / merger end at m3-tiny's text width (set when written)."""
FULL_DEPTH = VisionConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, projector_hidden_size=96)
"""M3's 32 layers at a tiny width."""
IMAGES = [(1, 8, 12), (1, 6, 4)]
VIDEO = (6, 4, 4)
"""Patch grids (t, h, w): two images and a video of 6 temporal patches (12 frames), cut 4 + 2."""


VISION_STD = 0.05
"""The random vision weights' std (presets/checkpoint_layout.random_vision_tensors draws them)."""


def write_vl_checkpoint(path: str, cfg: VisionConfig, mxfp8: bool = False, seed: int = 0,
                        tensors: dict[str, torch.Tensor] | None = None) -> VisionConfig:
    """m3-tiny's text checkpoint plus `cfg`'s vision weights in its model.safetensors (transformers reads only that
    file when there is no index), and the vision fields in config.json. The placeholder ids move into m3-tiny's
    vocabulary. Returns the config as written (text width filled in)."""
    preset = get_preset("m3-tiny")
    write_checkpoint(path, preset.config, preset, mxfp8=mxfp8)
    vocab = preset.config.vocab_size
    cfg = cfg.replace(text_hidden_size=preset.config.hidden_size, image_token_id=vocab - 2, video_token_id=vocab - 1)
    weights = load_file(os.path.join(path, "model.safetensors"))
    weights.update(random_vision_tensors(cfg, VISION_STD, seed) if tensors is None else tensors)
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config.update(cfg.to_dict())
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return cfg


def pixels(grids: list[tuple[int, int, int]], cfg: VisionConfig, seed: int = 1) -> torch.Tensor:
    n = sum(t * h * w for t, h, w in grids)
    return torch.randn(n, cfg.patch_dim, generator=torch.Generator().manual_seed(seed))


def load_hf(path: str):
    from transformers.models.minimax_m3_vl import MiniMaxM3SparseForConditionalGeneration
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model = MiniMaxM3SparseForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    finally:
        hf_logging.set_verbosity(verbosity)
    model.config.vision_config._attn_implementation = "eager"
    return model.eval()


def hf_features(hf, pix: torch.Tensor, grids: list[tuple[int, int, int]], max_frames: int) -> torch.Tensor:
    """transformers' projected + merged features, the grid cut into segments as its video processor cuts it."""
    cut = [(min(max_frames, t - s), h, w) for t, h, w in grids for s in range(0, t, max_frames)]
    with torch.no_grad():  # (the grid on the pixels' device: transformers computes its rotary positions from it)
        out = hf.model.get_image_features(pix, torch.tensor(cut, device=pix.device))
    pooled = out.pooler_output  # one tensor per image in 5.25; already concatenated in 5.17 (the GPU image's)
    return pooled if isinstance(pooled, torch.Tensor) else torch.cat(pooled)


def assert_close(ours: torch.Tensor, ref: torch.Tensor, label: str, atol: float = FP32_ATOL) -> None:
    diff = (ours.float() - ref.float()).abs().max().item()
    scale = max(1.0, ref.float().abs().max().item())
    print(f"\n[vision parity] {label}: max |diff| = {diff:.3e}, max |ref| = {ref.abs().max().item():.3f}")
    assert diff <= atol * scale, f"{label}: max |diff| {diff:.3e} > {atol} x {scale:.3f}"


@pytest.fixture(scope="module", params=["real_width", "full_depth"])
def vl(request, tmp_path_factory):
    """(checkpoint directory, its vision config, nanoserve's vision model, transformers' model), once per tower."""
    path = str(tmp_path_factory.mktemp(f"vl-{request.param}"))
    cfg = write_vl_checkpoint(path, REAL_WIDTH if request.param == "real_width" else FULL_DEPTH)
    return path, cfg, load_vision_model(path, Optimizations.reference(), torch.float32), load_hf(path)


def test_features_match_transformers(vl):
    path, cfg, ours, hf = vl
    grids = [*IMAGES, VIDEO]
    pix = pixels(grids, cfg)
    want = hf_features(hf, pix, grids, cfg.vision_segment_max_frames)
    got = ours(pix, grids)
    assert got.shape == (sum(ours.tokens_per_item(grids)), cfg.text_hidden_size)
    assert_close(got, want, f"{cfg.num_hidden_layers} layers at {cfg.hidden_size}: features")
    # the grid cut by the processor gives the same features as the uncut one
    cut = [*IMAGES, (4, 4, 4), (2, 4, 4)]
    assert torch.equal(ours(pix, cut), got)


def test_merged_embeddings_match_transformers(vl):
    """The language model's input: text embeddings with image and video features at their placeholders."""
    path, cfg, vision, hf = vl
    text, _ = load_model(path, Optimizations.reference(), torch.float32)
    images, video = IMAGES, [VIDEO]
    img_pix, vid_pix = pixels(images, cfg, seed=2), pixels(video, cfg, seed=3)
    n_img, n_vid = sum(vision.tokens_per_item(images)), sum(vision.tokens_per_item(video))
    ids = torch.cat([torch.tensor([1, 40, 41]), torch.full((n_img - 5,), cfg.image_token_id), torch.tensor([42]),
                     torch.full((5,), cfg.image_token_id), torch.full((n_vid,), cfg.video_token_id),
                     torch.tensor([43, 44])])
    seen = {}
    hook = hf.model.language_model.register_forward_pre_hook(
        lambda mod, args, kwargs: seen.update(embeds=kwargs["inputs_embeds"]), with_kwargs=True)
    cut = [(min(4, VIDEO[0] - s), VIDEO[1], VIDEO[2]) for s in range(0, VIDEO[0], 4)]
    with torch.no_grad():
        hf(input_ids=ids[None], pixel_values=img_pix, image_grid_thw=torch.tensor(images),
           pixel_values_videos=vid_pix, video_grid_thw=torch.tensor(cut))
    hook.remove()
    with torch.inference_mode():
        embeds = text.embed_tokens(ids)
    got = merge_multimodal_embeddings(embeds, ids, cfg, vision(img_pix, images), vision(vid_pix, video))
    assert_close(got, seen["embeds"][0], "merged embeddings")
    with pytest.raises(ValueError, match="placeholder"):
        merge_multimodal_embeddings(embeds, ids, cfg, vision(img_pix[:96], images[:1]))  # the first image only


@pytest.mark.gpu
def test_bf16_features_on_gpu(tmp_path):
    """bf16 on the GPU with the Triton kernels (and with the reference path) against the fp32 reference, beside
    transformers' own bf16 error on the same inputs: ours may be at most 1.5x transformers'."""
    path = str(tmp_path)
    cfg = write_vl_checkpoint(path, REAL_WIDTH)
    grids = [*IMAGES, VIDEO, (1, 32, 32)]
    pix = pixels(grids, cfg)
    exact = load_vision_model(path, Optimizations.reference(), torch.float32)(pix, grids).float()
    hf = load_hf(path).to("cuda", torch.bfloat16)
    hf_err = (hf_features(hf, pix.cuda().bfloat16(), grids, 4).float().cpu() - exact).abs().mean().item()
    for opts in (Optimizations(), Optimizations.reference()):
        ours = load_vision_model(path, opts, torch.bfloat16, "cuda")
        err = (ours(pix.cuda(), grids).float().cpu() - exact).abs().mean().item()
        print(f"\n[vision bf16] mean |bf16 - fp32|: ours {err:.3e} (kernels {opts.triton_vision_attention}), "
              f"transformers {hf_err:.3e}")
        assert err <= 1.5 * hf_err
