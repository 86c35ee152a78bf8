"""The vision side of an M3 config.json: the tower, the projector, the patch merger and the placeholder tokens.

A released checkpoint (`model_type` "minimax_m3_vl") describes the tower under `vision_config` (CLIP's field names,
plus `rope_theta`, `img_token_compression_config` and `vision_segment_max_frames`) and the projector at the top
level (`projector_hidden_size`, `multimodal_projector_bias`, `image_token_index`, ...). transformers writes a second
dialect of the same facts (`spatial_merge_size` / `temporal_patch_size` in `vision_config`, the theta in
`rope_parameters`). `VisionConfig.from_dict` reads both; `to_dict` writes the released one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

IMAGE_TOKEN_ID, VIDEO_TOKEN_ID = 200025, 200026
"""The placeholder ids of the released tokenizer (`]<]image[>[`, `]<]video[>[`): one per merged 2x2 patch group."""


@dataclass
class VisionConfig:
    """Every number the vision path needs, with the released model's values as defaults."""

    # the tower (CLIP-style encoder)
    hidden_size: int = 1280
    intermediate_size: int = 5120
    num_hidden_layers: int = 32
    num_attention_heads: int = 16
    num_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    layer_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    vision_segment_max_frames: int | None = 4
    """Video segments attend within themselves: at most this many temporal patches each (None: a whole video)."""
    # projector (per patch) and patch merger (per 2x2 group), both GELU MLPs into the text width
    projector_hidden_size: int = 6144
    text_hidden_size: int = 6144
    projector_bias: bool = True
    # placeholders
    image_token_id: int = IMAGE_TOKEN_ID
    video_token_id: int = VIDEO_TOKEN_ID

    def __post_init__(self) -> None:
        self.validate()

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def patch_dim(self) -> int:
        """Values in one flattened patch: channels x temporal x patch x patch (3 x 2 x 14 x 14 = 1176)."""
        return self.num_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def rope_band(self) -> int:
        """Rotated dims per axis (t, h, w): the largest even number <= head_dim / 3 (26 of M3's 80)."""
        return 2 * ((self.head_dim // 3) // 2)

    @property
    def merge_unit(self) -> int:
        """Patches per text token: spatial_merge_size^2 (4)."""
        return self.spatial_merge_size ** 2

    def validate(self) -> None:
        def need(cond: bool, name: str, msg: str) -> None:
            if not cond:
                raise ValueError(f"vision config field '{name}': {msg}")

        need(self.hidden_size % self.num_attention_heads == 0, "num_attention_heads",
             f"hidden_size {self.hidden_size} is not a multiple of {self.num_attention_heads}")
        need(self.rope_band >= 2, "hidden_size", f"head_dim {self.head_dim} is too small for 3-D RoPE")
        for name in ("patch_size", "temporal_patch_size", "spatial_merge_size", "num_hidden_layers"):
            need(int(getattr(self, name)) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        need(self.vision_segment_max_frames is None or self.vision_segment_max_frames >= 1,
             "vision_segment_max_frames", f"must be >= 1 or None, got {self.vision_segment_max_frames}")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "VisionConfig | None":
        """The vision config of a top-level config.json dict, or None when it has no `vision_config`."""
        vision = raw.get("vision_config")
        if vision is None:
            return None
        if not isinstance(vision, dict):
            raise ValueError("config.json: 'vision_config' must be an object")
        act = vision.get("hidden_act", "gelu")
        if act != "gelu" or raw.get("projector_hidden_act", "gelu") != "gelu":
            raise ValueError(f"config.json: vision hidden_act {act!r} / projector_hidden_act "
                             f"{raw.get('projector_hidden_act')!r} not supported (M3 uses 'gelu')")
        if raw.get("vision_feature_layer", -1) != -1 or raw.get("vision_feature_select_strategy", "full") != "full":
            raise ValueError("config.json: only vision_feature_layer -1 with vision_feature_select_strategy 'full' "
                             "(the last encoder layer, every patch) is supported, as M3 uses")
        compression = {**(raw.get("img_token_compression_config") or {}),
                       **(vision.get("img_token_compression_config") or {})}
        if compression.get("method", "patch_merge") != "patch_merge":
            raise ValueError(f"config.json: img_token_compression_config.method {compression['method']!r} is not "
                             f"supported (M3 uses 'patch_merge')")
        kw: dict[str, Any] = {}
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_channels",
                     "patch_size", "layer_norm_eps"):
            if vision.get(name) is not None:
                kw[name] = vision[name]
        for name in ("spatial_merge_size", "temporal_patch_size"):
            value = vision.get(name, compression.get(name))
            if value is not None:
                kw[name] = int(value)
        theta = vision.get("rope_theta", (vision.get("rope_parameters") or {}).get("rope_theta"))
        if theta is not None:
            kw["rope_theta"] = float(theta)
        if "vision_segment_max_frames" in vision:
            kw["vision_segment_max_frames"] = vision["vision_segment_max_frames"]
        text = raw.get("text_config") or {}
        kw["text_hidden_size"] = int(text.get("hidden_size", cls.text_hidden_size))
        kw["projector_hidden_size"] = int(raw.get("projector_hidden_size") or kw["text_hidden_size"])
        kw["projector_bias"] = bool(raw.get("multimodal_projector_bias", True))
        kw["image_token_id"] = int(raw.get("image_token_index", raw.get("image_token_id", IMAGE_TOKEN_ID)))
        kw["video_token_id"] = int(raw.get("video_token_index", raw.get("video_token_id", VIDEO_TOKEN_ID)))
        return cls(**kw)

    def to_dict(self) -> dict[str, Any]:
        """The released layout: `vision_config` plus the top-level projector and placeholder fields (merge them
        into M3Config.to_hf_dict's output)."""
        compression = {"method": "patch_merge", "spatial_merge_size": self.spatial_merge_size,
                       "temporal_patch_size": self.temporal_patch_size}
        vision = {"model_type": "clip_vision_model", "hidden_size": self.hidden_size,
                  "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
                  "num_attention_heads": self.num_attention_heads, "num_channels": self.num_channels,
                  "patch_size": self.patch_size, "layer_norm_eps": self.layer_norm_eps, "hidden_act": "gelu",
                  "position_embedding_type": "rope", "rope_mode": "3d", "rope_theta": self.rope_theta,
                  "projection_dim": self.text_hidden_size, "img_token_compression_config": compression,
                  "vision_segment_max_frames": self.vision_segment_max_frames}
        return {"vision_config": vision, "projector_hidden_size": self.projector_hidden_size,
                "projector_hidden_act": "gelu", "multimodal_projector_bias": self.projector_bias,
                "img_token_compression_config": compression, "vision_feature_layer": -1,
                "vision_feature_select_strategy": "full", "image_token_index": self.image_token_id,
                "video_token_index": self.video_token_id}

    def replace(self, **changes: Any) -> "VisionConfig":
        d = asdict(self)
        d.update(changes)
        return VisionConfig(**d)
