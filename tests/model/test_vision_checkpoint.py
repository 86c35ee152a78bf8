"""The vision tensors of a checkpoint: the released names and shapes, loading BF16 and MXFP8 checkpoints, refusals.

The released key list (its vision part: 523 tensors, of the BF16 checkpoint's 23,416) is written out below from the
checkpoint's tensor table; the full-size tower is built on the meta device, so checking every name and shape
costs no memory. The parameter counts are the checkpoint's: tower 631,185,920, projector 45,625,344, patch merger
188,755,968.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanoserve.config import Optimizations
from nanoserve.model.checkpoint_names import VISION_WEIGHT_NAMES, loader_for, name_map
from nanoserve.model.loader import CheckpointError, load_model, load_vision_model
from nanoserve.model.vision.config import VisionConfig
from nanoserve.model.vision.model import M3VisionModel
from nanoserve.presets.checkpoint_layout import random_vision_tensors
from tests.model.test_vision import VISION_STD, write_vl_checkpoint

RELEASED_CONFIG = {  # the vision part of the released config.json (top level + vision_config)
    "model_type": "minimax_m3_vl", "text_config": {"hidden_size": 6144}, "image_token_index": 200025,
    "video_token_index": 200026, "image_seq_length": 576, "process_image_mode": "dynamic_res",
    "projector_hidden_act": "gelu", "projector_hidden_size": 6144, "multimodal_projector_bias": True,
    "vision_feature_layer": -1, "vision_feature_select_strategy": "full",
    "img_token_compression_config": {"method": "patch_merge", "spatial_merge_size": 2, "temporal_patch_size": 2},
    "image_grid_pinpoints": [[h, w] for h in range(336, 2017, 336) for w in range(336, 2017, 336)],
    "vision_config": {
        "hidden_size": 1280, "num_attention_heads": 16, "num_hidden_layers": 32, "intermediate_size": 5120,
        "patch_size": 14, "image_size": 2016, "projection_dim": 6144, "position_embedding_type": "rope",
        "rope_mode": "3d", "rope_theta": 10000.0, "attention_dropout": 0.0, "hidden_act": "gelu",
        "initializer_factor": 1.0, "initializer_range": 0.02, "layer_norm_eps": 1e-05,
        "model_type": "clip_vision_model", "num_channels": 3, "vocab_size": 32000, "vision_segment_max_frames": 4,
        "img_token_compression_config": {"method": "patch_merge", "spatial_merge_size": 2,
                                         "temporal_patch_size": 2}}}


def released_vision_keys() -> dict[str, tuple[int, ...]]:
    """Every vision tensor of the released checkpoint with its stored shape."""
    d, i = 1280, 5120
    keys = {"vision_tower.vision_model.embeddings.patch_embedding.weight": (d, 3, 2, 14, 14),
            "vision_tower.vision_model.pre_layrnorm.weight": (d,), "vision_tower.vision_model.pre_layrnorm.bias": (d,)}
    for layer in range(32):
        p = f"vision_tower.vision_model.encoder.layers.{layer}."
        for norm in ("layer_norm1", "layer_norm2"):
            keys[p + norm + ".weight"] = keys[p + norm + ".bias"] = (d,)
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            keys[p + f"self_attn.{proj}.weight"], keys[p + f"self_attn.{proj}.bias"] = (d, d), (d,)
        keys[p + "mlp.fc1.weight"], keys[p + "mlp.fc1.bias"] = (i, d), (i,)
        keys[p + "mlp.fc2.weight"], keys[p + "mlp.fc2.bias"] = (d, i), (d,)
    for module, first_in in (("multi_modal_projector", d), ("patch_merge_mlp", 4 * 6144)):
        keys[f"{module}.linear_1.weight"], keys[f"{module}.linear_1.bias"] = (6144, first_in), (6144,)
        keys[f"{module}.linear_2.weight"], keys[f"{module}.linear_2.bias"] = (6144, 6144), (6144,)
    return keys


def test_released_names_and_shapes_fill_the_tower():
    cfg = VisionConfig.from_dict(RELEASED_CONFIG)
    assert cfg == VisionConfig()  # the defaults are the released model
    model = M3VisionModel(cfg, device="meta")
    names = name_map(model, VISION_WEIGHT_NAMES, prefix="")
    keys = released_vision_keys()
    assert len(keys) == 523 and set(names) == set(keys)
    for name, shape in keys.items():
        load = loader_for(model, name, names[name])
        load(torch.empty(shape, device="meta"))  # accepted at its released shape ...
        with pytest.raises(ValueError, match="shape mismatch"):
            load(torch.empty((shape[0] + 1, *shape[1:]), device="meta"))  # ... and at no other
    # every parameter is filled, by exactly the tensors of its rows
    covered = {}
    for target in names.values():
        covered[target.param] = covered.get(target.param, 0) + 1
    assert set(covered) == {n for n, _ in model.named_parameters()}
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert (count(model.tower), count(model.projector), count(model.merger)) == (631_185_920, 45_625_344,
                                                                                  188_755_968)


def test_transformers_config_dialect_reads_the_same():
    from transformers.models.minimax_m3_vl import MiniMaxM3VLConfig

    raw = MiniMaxM3VLConfig(vision_config={"num_hidden_layers": 3, "rope_parameters": {"rope_theta": 5000.0}},
                            text_config={"hidden_size": 256}, projector_hidden_size=512).to_dict()
    cfg = VisionConfig.from_dict(raw)
    assert (cfg.num_hidden_layers, cfg.rope_theta, cfg.text_hidden_size, cfg.projector_hidden_size) == (3, 5000.0,
                                                                                                        256, 512)
    assert (cfg.spatial_merge_size, cfg.temporal_patch_size, cfg.image_token_id) == (2, 2, 200025)
    with pytest.raises(ValueError, match="hidden_act"):
        VisionConfig.from_dict({**RELEASED_CONFIG, "vision_config": {"hidden_act": "quick_gelu"}})


SMALL = VisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                     projector_hidden_size=40)


@pytest.mark.parametrize("mxfp8", [False, True], ids=["bf16", "mxfp8"])
def test_checkpoint_round_trips(mxfp8, tmp_path):
    """Written under the released names (vision unquantized beside MXFP8 text weights), read back bit for bit;
    the text model loads from the same directory as before, the vision tensors skipped."""
    cfg = write_vl_checkpoint(str(tmp_path), SMALL, mxfp8=mxfp8)
    written = random_vision_tensors(cfg, VISION_STD)
    vision = load_vision_model(str(tmp_path), Optimizations.reference(), torch.float32)
    assert vision is not None and vision.cfg == cfg
    names = name_map(vision, VISION_WEIGHT_NAMES, prefix="")
    for name, tensor in written.items():
        target = names[name]
        param = vision.get_parameter(target.param)
        if target.shard:
            r0, r1 = vision.get_submodule(target.param.rsplit(".", 1)[0]).offsets[target.shard]
            param = param[r0:r1]
        assert torch.equal(param, tensor.float().reshape(param.shape)), name
    text, _ = load_model(str(tmp_path), Optimizations.reference(), torch.float32)
    assert text.cfg.num_hidden_layers == 4


def test_loader_refuses_what_does_not_fit(tmp_path, tiny_dir):
    assert load_vision_model(tiny_dir) is None  # a preset: a vision_config for transformers, no vision tensors
    path = str(tmp_path)
    cfg = write_vl_checkpoint(path, SMALL)
    file = os.path.join(path, "model.safetensors")
    good = load_file(file)

    def refuses(tensors: dict[str, torch.Tensor], message: str) -> None:
        save_file(tensors, file, metadata={"format": "pt"})
        with pytest.raises(CheckpointError, match=message):
            load_vision_model(path)

    extra = "vision_tower.vision_model.encoder.layers.2.mlp.fc1.weight"  # a third layer the config does not have
    refuses({**good, extra: torch.zeros(48, 32)}, "1 unexpected tensor.*layers.2.mlp.fc1.weight")
    gone = "patch_merge_mlp.linear_2.bias"
    refuses({k: v for k, v in good.items() if k != gone}, f"1 missing tensor.*{gone}")
    fp8 = "multi_modal_projector.linear_1.weight"
    refuses({**good, fp8: good[fp8].to(torch.float8_e4m3fn)}, "is quantized")
    refuses({**good, fp8: torch.zeros(3, 3)}, "shape mismatch")
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["vision_feature_layer"] = -2
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    save_file(good, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="vision_feature_layer"):
        load_vision_model(path)
    assert cfg.text_hidden_size == 128


def test_a_preset_drawn_on_the_device_draws_the_vision_weights_its_checkpoint_would_hold():
    # m3-slice-vl is drawn in device memory, vision path included (presets/resolve.random_vision_model); the same
    # function on m3-tiny-vl must give exactly the tensors its written checkpoint holds
    from nanoserve.presets.catalog import get_preset
    from nanoserve.presets.resolve import random_vision_model, resolve_model_dir

    drawn = random_vision_model("m3-tiny-vl", None, torch.float32, "cpu").state_dict()
    loaded = load_vision_model(resolve_model_dir("m3-tiny-vl")).state_dict()
    assert drawn.keys() == loaded.keys() and all(torch.equal(drawn[k], loaded[k]) for k in drawn)
    assert random_vision_model("m3-tiny", None, torch.float32, "cpu") is None
    slice_vl = get_preset("m3-slice-vl")  # the released tower's widths, into m3-slice's text width
    assert slice_vl.draw_on_device and slice_vl.vision == VisionConfig(
        text_hidden_size=6144, image_token_id=slice_vl.vision.image_token_id,
        video_token_id=slice_vl.vision.video_token_id)
    assert slice_vl.config.vocab_size == get_preset("m3-slice").config.vocab_size + 4
