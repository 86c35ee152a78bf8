"""The models nanoserve knows by name.

- `m3-mini` ships in the package: a small M3 trained for real (docs/m3_mini.md), a checkpoint directory like any
  other. It is the default model of the server, `LLM()` and the walkthrough.
- Presets with random weights, generated on first use: `m3-tiny` for unit tests (every mechanism at CPU size),
  `m3-tiny-vl` (m3-tiny with a tiny random vision tower and the image markers in its tokenizer: images and video
  end to end on the CPU, docs/vision.md), `m3-slice` for GPU benchmarks (the released model's widths with 4 layers;
  docs/benchmarks.md), `m3-slice-vl` (m3-slice with the released 32-layer vision tower: the vision benchmark).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from nanoserve.model.m3_config import DENSE, SPARSE, M3Config
from nanoserve.model.vision.config import VisionConfig
from nanoserve.presets.tokenizer import BOS_ID, EOS_ID, IMAGE_TOKEN_ID, VIDEO_TOKEN_ID, VISION_TOKENS, VOCAB_SIZE


@dataclass(frozen=True)
class Preset:
    """A config plus how to draw its random weights."""

    config: M3Config
    init_std: float  # normal std for every projection
    random_norms: bool  # draw norm offsets (and the router bias) instead of zeros, to exercise (1 + w)
    seed: int = 0
    draw_on_device: bool = False  # serve by drawing the weights in device memory, not via a written checkpoint
    vision: VisionConfig | None = None  # a vision tower with random weights too (and the image markers' tokens)


def _tiny() -> Preset:
    # Small enough for 2 CPU cores, but every mechanism is there: one dense layer then MSA+MoE layers;
    # MSA blocks of 16 tokens with top-3 selection, so prompts over 48 tokens really drop blocks;
    # 4 KV heads (TP=2 and TP=4 split them) and 16 experts (EP=2 splits them).
    cfg = M3Config(
        vocab_size=VOCAB_SIZE, hidden_size=128, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
        head_dim=32, rotary_dim=16, rope_theta=5_000_000.0, max_position_embeddings=4096,
        intermediate_size=64, dense_intermediate_size=256, shared_intermediate_size=64,
        num_local_experts=16, num_experts_per_tok=4, index_n_heads=4, index_head_dim=32,
        index_block_size=16, index_topk_blocks=3, index_local_blocks=1,
        attn_layer_types=[DENSE, SPARSE, SPARSE, SPARSE], mlp_layer_types=[DENSE, SPARSE, SPARSE, SPARSE],
        bos_token_id=BOS_ID, eos_token_id=EOS_ID,
    )
    return Preset(cfg, init_std=0.08, random_norms=True)


def _tiny_vl() -> Preset:
    # m3-tiny's text model with the image and video markers in its vocabulary, and M3's vision path at tiny widths:
    # the same 1176-value patches, 2x2 merge, 3-D RoPE and segments, a 64-wide tower of 2 layers (heads of 16).
    tiny = _tiny()
    cfg = tiny.config.replace(vocab_size=VOCAB_SIZE + len(VISION_TOKENS))
    vision = VisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          projector_hidden_size=128, text_hidden_size=cfg.hidden_size,
                          image_token_id=IMAGE_TOKEN_ID, video_token_id=VIDEO_TOKEN_ID)
    return Preset(cfg, init_std=tiny.init_std, random_norms=True, seed=1, vision=vision)


def _slice() -> Preset:
    cfg = M3Config(
        num_hidden_layers=4, attn_layer_types=[DENSE] + [SPARSE] * 3, mlp_layer_types=[DENSE] + [SPARSE] * 3,
        max_position_embeddings=262_144, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
    )
    # ~50 GB of weights: drawn straight into device memory rather than written to disk and read back.
    return Preset(cfg, init_std=0.02, random_norms=False, draw_on_device=True)


def _slice_vl() -> Preset:
    # m3-slice's text model with the image and video markers, and the released vision path at its real widths
    # (32 layers of 1280, projector and merger into 6144): ~1.6 GB more, drawn on the device too
    s = _slice()
    cfg = s.config.replace(vocab_size=s.config.vocab_size + len(VISION_TOKENS))
    vision = VisionConfig(text_hidden_size=cfg.hidden_size, image_token_id=IMAGE_TOKEN_ID,
                          video_token_id=VIDEO_TOKEN_ID)
    return Preset(cfg, init_std=s.init_std, random_norms=False, draw_on_device=True, vision=vision)


PRESETS = {"m3-tiny": _tiny, "m3-tiny-vl": _tiny_vl, "m3-slice": _slice, "m3-slice-vl": _slice_vl}
SHIPPED = {"m3-mini": os.path.join(os.path.dirname(__file__), "m3_mini")}
"""Trained models in the package: name -> checkpoint directory."""
MODEL_NAMES = sorted(SHIPPED) + sorted(PRESETS)
DEFAULT_MODEL = "m3-mini"


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)} (random weights), "
                         f"{sorted(SHIPPED)} (trained) or pass a directory")
    return PRESETS[name]()
