"""The checkpoint maker and loader: real key names in and out, sharding, both config.json dialects, MXFP8, skipped
MTP/vision tensors, and a named error for every way a checkpoint directory can be wrong."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from nanoserve.config import Optimizations
from nanoserve.model.checkpoint_names import canonical_names, name_map, weight_loaders
from nanoserve.model.loader import CheckpointError, MXFP8Slice, SafeSlice, load_model, read_config
from nanoserve.model.m3_config import M3Config
from nanoserve.model.mxfp8 import MXFP8_BLOCK, dequantize_mxfp8, quantize_mxfp8
from nanoserve.presets.catalog import get_preset
from nanoserve.presets.checkpoint_layout import PROJ, checkpoint_specs
from nanoserve.presets.make_checkpoint import write_checkpoint
from nanoserve.presets.resolve import load_model_or_preset
from tests.helpers.hf_oracle import load_hf_oracle
from tests.model.test_hf_parity import FP32_RTOL, full_forward, random_ids

LOADER_LOGGER = "nanoserve.model.loader"
PROMPT = random_ids(70, seed=7)  # longer than top_k x block (48): MSA drops blocks


def logits(model_dir: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    model, _ = load_model(model_dir, Optimizations.reference(), dtype)
    return full_forward(model, PROMPT)


def tensors_of(model_dir: str) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(os.listdir(model_dir)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(model_dir, f)))
    return out


def copy_dir(src: str, dst) -> str:
    dst = str(dst)
    shutil.copytree(src, dst)
    return dst


def rewrite_tensors(model_dir: str, tensors: dict[str, torch.Tensor]) -> None:
    """Replace the directory's weights by one model.safetensors holding `tensors`."""
    for f in os.listdir(model_dir):
        if f.endswith(".safetensors") or f == "model.safetensors.index.json":
            os.remove(os.path.join(model_dir, f))
    save_file(tensors, os.path.join(model_dir, "model.safetensors"))


def edit_config(model_dir: str, edit) -> None:
    """Rewrite config.json as edit(raw); an edit returning None changed raw in place."""
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        raw = json.load(f)
    new = edit(raw)
    with open(path, "w") as f:
        json.dump(raw if new is None else new, f)


@pytest.fixture(scope="module")
def tiny_logits(tiny_dir):
    return logits(tiny_dir)


@pytest.fixture(scope="module")
def mxfp8_dir(tmp_path_factory):
    p = get_preset("m3-tiny")
    path = str(tmp_path_factory.mktemp("m3-tiny-mxfp8"))
    write_checkpoint(path, p.config, p, mxfp8=True)
    return path


# -- round trip ---------------------------------------------------------------------------------------------------


def test_every_checkpoint_tensor_lands_where_its_name_says(tiny_dir):
    """Each real-named tensor the maker wrote is found, unchanged, in the parameter that name denotes."""
    cfg = read_config(tiny_dir)
    model, tok_dir = load_model(tiny_dir, Optimizations.reference(), torch.float32)
    assert tok_dir == tiny_dir and os.path.isfile(os.path.join(tok_dir, "tokenizer.json"))
    ckpt = tensors_of(tiny_dir)
    # the released spelling of each target is the table's first (aliases follow it)
    released = {aliases[0] for aliases in canonical_names(name_map(model)).values()}
    assert set(ckpt) == set(checkpoint_specs(cfg)) == released and released < set(weight_loaders(model))
    p = "language_model.model"
    eq = torch.equal

    def w(key):
        return ckpt[key].float()

    assert eq(model.embed_tokens.weight, w(f"{p}.embed_tokens.weight"))
    assert eq(model.lm_head.weight, w("language_model.lm_head.weight"))
    assert eq(model.norm.weight, w(f"{p}.norm.weight"))
    inter, shared, q, kv, di = cfg.intermediate_size, cfg.shared_intermediate_size, cfg.q_size, cfg.kv_size, \
        cfg.index_head_dim
    for i, layer in enumerate(model.layers):
        lp = f"{p}.layers.{i}"
        attn = layer.self_attn
        names = ["q_proj", "k_proj", "v_proj"] + (["index_q_proj", "index_k_proj"] if attn.sparse else [])
        assert eq(attn.qkv_proj.weight, torch.cat([w(f"{lp}.self_attn.{n}.weight") for n in names]))
        assert eq(attn.o_proj.weight, w(f"{lp}.self_attn.o_proj.weight"))
        assert eq(attn.q_norm, w(f"{lp}.self_attn.q_norm.weight"))
        assert eq(attn.k_norm, w(f"{lp}.self_attn.k_norm.weight"))
        if attn.sparse:
            assert attn.qkv_proj.weight.shape[0] == q + 2 * kv + cfg.index_n_heads * di + di
            assert eq(attn.index_q_norm, w(f"{lp}.self_attn.index_q_norm.weight"))
            assert eq(attn.index_k_norm, w(f"{lp}.self_attn.index_k_norm.weight"))
        assert eq(layer.input_layernorm.weight, w(f"{lp}.input_layernorm.weight"))
        assert eq(layer.post_attention_layernorm.weight, w(f"{lp}.post_attention_layernorm.weight"))
        mlp = layer.mlp
        if cfg.is_moe(i):
            mp = f"{lp}.block_sparse_moe"
            assert eq(mlp.gate, ckpt[f"{mp}.gate.weight"]) and ckpt[f"{mp}.gate.weight"].dtype == torch.float32
            assert eq(mlp.e_score_correction_bias, ckpt[f"{mp}.e_score_correction_bias"])
            for e in range(cfg.num_local_experts):
                assert eq(mlp.w13[e, :inter], w(f"{mp}.experts.{e}.w1.weight"))  # w1 = gate
                assert eq(mlp.w13[e, inter:], w(f"{mp}.experts.{e}.w3.weight"))  # w3 = up
                assert eq(mlp.w2[e], w(f"{mp}.experts.{e}.w2.weight"))  # w2 = down
            se = f"{mp}.shared_experts"
            assert shared == inter and mlp.shared_in_stack  # m3-tiny folds the shared expert into the last slot
            assert eq(mlp.w13[-1], torch.cat([w(f"{se}.gate_proj.weight"), w(f"{se}.up_proj.weight")]))
            assert eq(mlp.w2[-1], w(f"{se}.down_proj.weight"))
        else:
            assert eq(mlp.gate_up_proj.weight, torch.cat([w(f"{lp}.mlp.gate_proj.weight"),
                                                          w(f"{lp}.mlp.up_proj.weight")]))
            assert eq(mlp.down_proj.weight, w(f"{lp}.mlp.down_proj.weight"))


def test_checkpoint_maker_is_deterministic_and_writes_the_released_layout(tiny_dir, tmp_path):
    p = get_preset("m3-tiny")
    write_checkpoint(str(tmp_path), p.config, p)
    a, b = tensors_of(tiny_dir), tensors_of(str(tmp_path))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for name, spec in checkpoint_specs(p.config).items():
        assert a[name].dtype == spec.dtype and tuple(a[name].shape) == spec.shape, name
    with open(os.path.join(tiny_dir, "config.json")) as f:
        raw = json.load(f)
    assert raw["model_type"] == "minimax_m3_vl"
    assert raw["architectures"] == ["MiniMaxM3SparseForConditionalGeneration"]
    text = raw["text_config"]
    assert "sparse_attention_config" in text and "moe_layer_freq" in text and "layer_types" not in text
    assert M3Config.from_dict(raw) == p.config
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert os.path.isfile(os.path.join(tiny_dir, f))


def test_sharded_checkpoint_with_index_loads_the_same_model(tmp_path, tiny_logits):
    p = get_preset("m3-tiny")
    write_checkpoint(str(tmp_path), p.config, p, shards=3)
    files = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    with open(tmp_path / "model.safetensors.index.json") as f:
        index = json.load(f)
    assert set(index["weight_map"].values()) == set(files)
    assert set(index["weight_map"]) == set(checkpoint_specs(p.config))
    assert torch.equal(logits(str(tmp_path)), tiny_logits)


def test_rewriting_a_checkpoint_replaces_its_old_weight_files(tmp_path, tiny_logits):
    """Writing over an earlier (sharded, other-weights) checkpoint leaves no stale index or shard behind."""
    p = get_preset("m3-tiny")
    other = get_preset("m3-tiny").config.replace(num_hidden_layers=2, attn_layer_types=["dense", "sparse"],
                                                 mlp_layer_types=["dense", "sparse"])
    write_checkpoint(str(tmp_path), other, p, shards=3)
    write_checkpoint(str(tmp_path), p.config, p)
    assert sorted(f for f in os.listdir(tmp_path) if "safetensors" in f) == ["model.safetensors"]
    assert torch.equal(logits(str(tmp_path)), tiny_logits)


def test_preset_cache_is_keyed_by_the_preset_contents(monkeypatch, tmp_path):
    """`load_model_or_preset("m3-tiny")` generates the preset once into the cache; a changed preset definition gets a
    new directory instead of silently reusing files generated by an older version."""
    from nanoserve.presets import catalog, make_checkpoint, resolve

    monkeypatch.setenv("NANOSERVE_CACHE", str(tmp_path))
    model, path = load_model_or_preset("m3-tiny", Optimizations.reference())
    assert os.path.dirname(path) == str(tmp_path) and os.path.basename(path).startswith("m3-tiny-")
    assert os.listdir(tmp_path) == [os.path.basename(path)]  # no temporary directory left behind
    stamp = os.path.getmtime(os.path.join(path, "config.json"))
    assert load_model_or_preset("m3-tiny", Optimizations.reference())[1] == path  # reused, not rewritten
    assert os.path.getmtime(os.path.join(path, "config.json")) == stamp

    original = catalog.get_preset

    def changed(name):
        pr = original(name)
        return dataclasses.replace(pr, init_std=pr.init_std * 2) if name == "m3-tiny" else pr

    monkeypatch.setattr(make_checkpoint, "get_preset", changed)
    monkeypatch.setattr(catalog, "get_preset", changed)
    monkeypatch.setattr(resolve, "get_preset", changed)
    new_model, new_path = load_model_or_preset("m3-tiny", Optimizations.reference())
    assert new_path != path and os.path.isfile(os.path.join(new_path, "config.json"))
    assert not torch.equal(new_model.lm_head.weight, model.lm_head.weight)


# -- config.json dialects -----------------------------------------------------------------------------------------


def test_transformers_config_dialect_loads_the_same_model(tiny_dir, tmp_path, tiny_logits):
    """config.json as transformers writes it (layer_types / mlp_layer_types / index_* / rope_parameters)."""
    from transformers.models.minimax_m3_vl import MiniMaxM3VLConfig

    d = copy_dir(tiny_dir, tmp_path / "ckpt")
    with open(os.path.join(d, "config.json")) as f:
        released = json.load(f)
    MiniMaxM3VLConfig(**released).save_pretrained(d)
    with open(os.path.join(d, "config.json")) as f:
        text = json.load(f)["text_config"]
    assert "layer_types" in text and "mlp_layer_types" in text and "rope_parameters" in text
    assert "index_topk_blocks" in text and "sparse_attention_config" not in text
    assert read_config(d) == read_config(tiny_dir)
    assert torch.equal(logits(d), tiny_logits)


def test_bare_text_config_loads_the_same_model(tiny_dir, tmp_path, tiny_logits):
    d = copy_dir(tiny_dir, tmp_path / "ckpt")
    edit_config(d, lambda raw: raw["text_config"])
    with open(os.path.join(d, "config.json")) as f:
        assert "text_config" not in json.load(f)
    assert read_config(d) == read_config(tiny_dir)
    assert torch.equal(logits(d), tiny_logits)


def test_checkpoint_saved_by_transformers_loads_and_matches_it(tmp_path, request, caplog):
    """A checkpoint written by transformers' own MiniMaxM3SparseForConditionalGeneration.save_pretrained: its
    config dialect (with the stale class-default rotary_dim=64 that transformers ignores, here for head_dim 32),
    its real-named weights plus vision tower/projector weights (skipped with a log line). nanoserve's logits
    match the saved model's own."""
    from transformers.models.minimax_m3_vl import (
        MiniMaxM3SparseForConditionalGeneration,
        MiniMaxM3VLConfig,
        MiniMaxM3VLTextConfig,
        MiniMaxM3VLVisionConfig,
    )
    from transformers.utils import logging as hf_logging

    text = MiniMaxM3VLTextConfig(
        vocab_size=300, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, intermediate_size=32, dense_intermediate_size=96, shared_intermediate_size=64,
        num_local_experts=8, num_experts_per_tok=2, index_n_heads=2, index_head_dim=32, index_block_size=8,
        index_topk_blocks=2, index_local_blocks=1, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
        layer_types=["full_attention", "minimax_m3_sparse", "minimax_m3_sparse"],
        mlp_layer_types=["dense", "sparse", "sparse"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    vision = MiniMaxM3VLVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    torch.manual_seed(0)
    hf_full = MiniMaxM3SparseForConditionalGeneration(MiniMaxM3VLConfig(text_config=text, vision_config=vision))
    with torch.no_grad():  # transformers initialises norms and the router bias to zero: make them matter
        for name, param in hf_full.named_parameters():
            param.normal_(0.0, 0.1 if "norm" in name else 0.08)
        for name, buf in hf_full.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.02)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        hf_full.save_pretrained(tmp_path)
    finally:
        hf_logging.set_verbosity(verbosity)
    with open(tmp_path / "config.json") as f:
        saved = json.load(f)["text_config"]
    assert saved["rotary_dim"] == 64 and saved["head_dim"] == 32  # the stale field the loader must not trust

    cfg = read_config(str(tmp_path))
    assert cfg.rotary_dim == 16 and cfg.shared_intermediate_size == 64 and cfg.index_block_size == 8
    assert cfg.attn_layer_types == ["dense", "sparse", "sparse"]
    caplog.set_level(logging.INFO, logger=LOADER_LOGGER)
    ids = random_ids(40, seed=2, vocab=300)  # 5 blocks of 8, top-2: sparse
    model, _ = load_model(str(tmp_path), Optimizations.reference(), torch.float32)
    assert "vision tower / projector" in caplog.text
    ours = full_forward(model, ids)
    with torch.no_grad():
        ref = hf_full.eval()(input_ids=torch.tensor([ids])).logits[0]
    scale = ref.abs().max().item()
    max_d = (ours - ref).abs().max().item()
    print(f"\n[parity] transformers-saved checkpoint: max |diff| = {max_d:.3e} (max |logit| {scale:.3f})")
    assert max_d <= FP32_RTOL * scale


# -- MXFP8 --------------------------------------------------------------------------------------------------------


def test_mxfp8_checkpoint_layout(mxfp8_dir):
    """fp8 e4m3 weights with uint8 E8M0 scales [out, in/32] for every projection but embed/lm_head."""
    cfg = read_config(mxfp8_dir)
    ckpt = tensors_of(mxfp8_dir)
    specs = checkpoint_specs(cfg)
    quantized = [n for n, s in specs.items() if s.role == PROJ and "embed_tokens" not in n and "lm_head" not in n]
    assert any("index_q_proj" in n for n in quantized) and any("experts.0.w2" in n for n in quantized)
    for name in quantized:
        out_f, in_f = specs[name].shape
        assert ckpt[name].dtype == torch.float8_e4m3fn, name
        assert ckpt[name + "_scale_inv"].dtype == torch.uint8
        assert tuple(ckpt[name + "_scale_inv"].shape) == (out_f, in_f // MXFP8_BLOCK)
    for name in set(specs) - set(quantized):
        assert ckpt[name].dtype in (torch.bfloat16, torch.float32) and name + "_scale_inv" not in ckpt
    assert len(ckpt) == len(specs) + len(quantized)
    with open(os.path.join(mxfp8_dir, "config.json")) as f:
        q = json.load(f)["quantization_config"]
    assert q["quant_method"] == "mxfp8" and q["weight_block_size"] == [1, MXFP8_BLOCK]


def test_mxfp8_logits_match_the_dequantised_bf16_checkpoint(mxfp8_dir, tmp_path, request, tiny_logits):
    """Dequantise the MXFP8 checkpoint independently (W = fp8 * 2^(S - 127), one scale per 1x32 block), write it as a
    plain bf16 checkpoint, and compare: nanoserve's logits from the MXFP8 files equal those from the bf16 files,
    in fp32 and in bf16; transformers agrees on the dequantised checkpoint; and quantisation really happened (the
    logits differ measurably from the unquantised m3-tiny)."""
    ckpt = tensors_of(mxfp8_dir)
    deq = {}
    for name, t in ckpt.items():
        if name.endswith("_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            scale = ckpt[name + "_scale_inv"].to(torch.int32) - 127
            factor = torch.pow(2.0, scale.double()).repeat_interleave(MXFP8_BLOCK, dim=1)
            exact = t.double() * factor
            deq[name] = exact.to(torch.bfloat16)
            assert torch.equal(deq[name].double(), exact), f"{name}: dequantised value not exact in bf16"
        else:
            deq[name] = t
    d = copy_dir(mxfp8_dir, tmp_path / "dequantised")
    rewrite_tensors(d, deq)
    edit_config(d, lambda raw: {k: v for k, v in raw.items() if k != "quantization_config"})

    for dtype in (torch.float32, torch.bfloat16):
        ours, ref = logits(mxfp8_dir, dtype), logits(d, dtype)
        assert torch.equal(ours, ref), f"MXFP8 vs dequantised bf16 checkpoint differ in {dtype}"
    ours = logits(mxfp8_dir)
    hf = load_hf_oracle(d)
    with torch.no_grad():
        hf_logits = hf(torch.tensor([PROMPT])).logits[0]
    scale = hf_logits.abs().max().item()
    max_d = (ours - hf_logits).abs().max().item()
    quant_effect = (ours - tiny_logits).abs().max().item()
    print(f"\n[parity] MXFP8 vs HF on dequantised weights: max |diff| = {max_d:.3e}; "
          f"MXFP8 vs unquantised bf16: max |diff| = {quant_effect:.3e}")
    assert max_d <= FP32_RTOL * scale
    assert 1e-3 < quant_effect < 0.5 * scale


def test_mxfp8_slices_dequantise_any_column_range(mxfp8_dir):
    """A tensor-parallel rank reads a slice of an MXFP8 weight; the slice need not start on a 32-column block."""
    name = "language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight"  # [128, 64]
    with safe_open(os.path.join(mxfp8_dir, "model.safetensors"), framework="pt") as h:
        src = MXFP8Slice(SafeSlice(h, name), SafeSlice(h, name + "_scale_inv"), name)
        full = dequantize_mxfp8(h.get_tensor(name), h.get_tensor(name + "_scale_inv"))
        assert torch.equal(src[:], full)
        for rows, cols in [(slice(0, 128), slice(0, 32)), (slice(5, 70), slice(16, 48)),
                           (slice(None), slice(48, 64)), (slice(0, 1), slice(7, 9))]:
            assert torch.equal(src[rows, cols], full[rows, cols]), (rows, cols)


def test_quantize_dequantize_round_trip():
    gen = torch.Generator().manual_seed(0)
    # rows of very different magnitudes, and a zero block
    w = torch.randn(8, 96, generator=gen) * torch.logspace(-6, 3, 8)[:, None]
    w[3, 32:64] = 0.0
    q, s = quantize_mxfp8(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert s.dtype == torch.uint8 and s.shape == (8, 3)
    back = dequantize_mxfp8(q, s, torch.float32)
    block_scale = torch.exp2(s.float() - 127).repeat_interleave(MXFP8_BLOCK, dim=1)
    # e4m3: 3 mantissa bits (relative error <= 2^-4), subnormal spacing 2^-9 (absolute, in scaled units)
    assert bool(((back - w).abs() <= w.abs() * 2 ** -4 + block_scale * 2 ** -10).all())
    assert torch.equal(back[3, 32:64], torch.zeros(32))
    # each block's largest value uses the top binade of fp8 (no wasted range) and never overflows 448
    amax = (w.abs().reshape(8, 3, 32).amax(-1) / torch.exp2(s.float() - 127))[w.reshape(8, 3, 32).abs().amax(-1) > 0]
    assert bool(((amax > 224) & (amax <= 448)).all())
    # values already on the fp8 grid times a power of two come back exactly
    exact = torch.tensor([1.0, -0.5, 0.375, 448.0, -2.0 ** -6] * 6 + [0.0, 3.5]).reshape(1, 32) * 2.0 ** -20
    q2, s2 = quantize_mxfp8(exact)
    assert torch.equal(dequantize_mxfp8(q2, s2, torch.float32), exact)
    bf = dequantize_mxfp8(q, s)  # default: bf16, exact since fp8 values x 2^k fit in bf16
    assert bf.dtype == torch.bfloat16 and torch.equal(bf.float(), back)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp8(torch.randn(4, 40))


# -- skipped tensors ----------------------------------------------------------------------------------------------


def test_mtp_and_vision_tensors_are_skipped_with_a_log_line(tiny_dir, tmp_path, caplog, tiny_logits):
    d = copy_dir(tiny_dir, tmp_path / "ckpt")
    extra = {
        "language_model.model.mtp.layers.0.enorm.weight": torch.zeros(128),
        "language_model.model.mtp.layers.0.eh_proj.weight": torch.zeros(128, 256),
        "language_model.model.mtp.layers.0.transformer_layer.self_attn.q_proj.weight": torch.zeros(256, 128),
        "vision_tower.vision_model.pre_layrnorm.weight": torch.zeros(32),
        "multi_modal_projector.linear_1.weight": torch.zeros(128, 32),
        "patch_merge_mlp.linear_1.weight": torch.zeros(128, 512),
    }
    save_file(extra, os.path.join(d, "extra.safetensors"))
    caplog.set_level(logging.INFO, logger=LOADER_LOGGER)
    assert torch.equal(logits(d), tiny_logits)
    lines = [r.getMessage() for r in caplog.records if r.name == LOADER_LOGGER]
    assert any("skipped 3 MTP" in line for line in lines), lines
    assert any("skipped 3 vision tower / projector" in line for line in lines), lines


# -- errors -------------------------------------------------------------------------------------------------------


def _drop(key):
    def edit(t):
        del t[key]
    return edit


def _tensors_edit(edit):
    def make(d):
        t = tensors_of(d)
        edit(t)
        rewrite_tensors(d, t)
    return make


def _config_text(text):
    def make(d):
        with open(os.path.join(d, "config.json"), "w") as f:
            f.write(text)
    return make


Q0 = "language_model.model.layers.0.self_attn.q_proj.weight"
W2 = "language_model.model.layers.2.block_sparse_moe.experts.5.w2.weight"


def _remove(*names):
    def make(d):
        for n in names:
            os.remove(os.path.join(d, n))
    return make


def _remove_weights(d):
    for f in os.listdir(d):
        if f.endswith(".safetensors"):
            os.remove(os.path.join(d, f))


def _shard_then_remove_one(d):
    p = get_preset("m3-tiny")
    _remove_weights(d)
    write_checkpoint(d, p.config, p, shards=2)
    os.remove(os.path.join(d, "model-00002-of-00002.safetensors"))


def _set(key, value):
    return _tensors_edit(lambda t: t.__setitem__(key, value))


def _fp8_without_scale(t):
    t[Q0] = t[Q0].float().to(torch.float8_e4m3fn)


def _bf16_with_scale(t):
    t[Q0 + "_scale_inv"] = torch.full((256, 4), 127, dtype=torch.uint8)


def _fp8_with_wrong_scale(t):
    q, s = quantize_mxfp8(t[Q0].float())
    t[Q0], t[Q0 + "_scale_inv"] = q, s[:, :2].contiguous()


def _index_points_to_the_wrong_shard(d):
    p = get_preset("m3-tiny")
    _remove_weights(d)
    write_checkpoint(d, p.config, p, shards=2)
    path = os.path.join(d, "model.safetensors.index.json")
    with open(path) as f:
        index = json.load(f)
    index["weight_map"][W2] = next(f for f in set(index["weight_map"].values()) if f != index["weight_map"][W2])
    with open(path, "w") as f:
        json.dump(index, f)


def _corrupt_index(d):
    p = get_preset("m3-tiny")
    _remove_weights(d)
    write_checkpoint(d, p.config, p, shards=2)
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        f.write("{ nope")


ERROR_CASES = {
    # case: (break the copied directory, expected message fragments)
    "missing config.json": (_remove("config.json"), ["config.json is missing"]),
    "invalid JSON": (_config_text('{"model_type": "minimax_m3_vl", '), ["config.json", "not valid JSON"]),
    "config not an object": (_config_text("[1, 2]"), ["expected a JSON object"]),
    "unknown model_type": (_config_text('{"model_type": "llama"}'), ["unknown model_type 'llama'"]),
    "bad config value": (lambda d: edit_config(d, lambda r: r["text_config"].update(num_key_value_heads=3)),
                         ["num_attention_heads", "num_key_value_heads=3"]),
    "no safetensors files": (_remove_weights, ["no *.safetensors files"]),
    "shard listed in the index is missing": (_shard_then_remove_one, ["model-00002-of-00002.safetensors",
                                                                      "listed in the index"]),
    "index is not JSON": (_corrupt_index, ["model.safetensors.index.json", "not a safetensors index"]),
    "index names the wrong shard": (_index_points_to_the_wrong_shard, [W2, "does not contain it"]),
    "missing tensor": (_tensors_edit(_drop(W2)), ["1 missing tensor", W2]),
    "extra tensor": (_set("language_model.model.layers.0.self_attn.bogus.weight", torch.zeros(2)),
                     ["1 unexpected tensor", "language_model.model.layers.0.self_attn.bogus.weight"]),
    "shape mismatch": (_set(W2, torch.zeros(128, 65, dtype=torch.bfloat16)),
                       ["shape mismatch", W2, "[128, 65]", "[128, 64]"]),
    "shape mismatch of a fused projection": (_set(Q0, torch.zeros(255, 128, dtype=torch.bfloat16)),
                                             ["shape mismatch", Q0, "[255, 128]", "[256, 128]"]),
    "fp8 weight without scale": (_tensors_edit(_fp8_without_scale), [Q0, "fp8", Q0 + "_scale_inv", "missing"]),
    "scale on a non-fp8 weight": (_tensors_edit(_bf16_with_scale), [Q0, "_scale_inv", "not fp8"]),
    "MXFP8 scale of the wrong shape": (_tensors_edit(_fp8_with_wrong_scale), [Q0, "[256, 2]", "[256, 4]"]),
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_broken_checkpoint_raises_a_named_error(case, tiny_dir, tmp_path):
    make, fragments = ERROR_CASES[case]
    d = copy_dir(tiny_dir, tmp_path / "ckpt")
    make(d)
    with pytest.raises(CheckpointError) as info:
        load_model(d, Optimizations.reference(), torch.float32)
    assert isinstance(info.value, ValueError)
    for fragment in fragments:
        assert fragment in str(info.value), (case, str(info.value))


def test_missing_directory_raises_a_named_error(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(CheckpointError, match="no-such-model.*does not exist"):
        load_model(missing)


def test_an_alias_is_one_row_of_the_name_table(tiny_dir, tmp_path, monkeypatch, tiny_logits):
    """A checkpoint spelling the routed experts gate_proj/up_proj/down_proj under `mlp.` loads the same model once
    the name table has one row per alias; naming a parameter both ways is an error naming both."""
    from nanoserve.model import checkpoint_names as names

    spelled = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    stack = {"w1": ("w13", "gate"), "w3": ("w13", "up"), "w2": ("w2", "down")}
    aliases = tuple(names.NameRule(f"model.layers.{{layer}}.mlp.experts.{{expert}}.{new}.weight",
                                   f"layers.{{layer}}.mlp.{stack[old][0]}", stack[old][1])
                    for old, new in spelled.items())
    d = copy_dir(tiny_dir, tmp_path / "alias")
    t = tensors_of(d)
    renamed = {}
    for k, v in t.items():
        m = re.fullmatch(r"(.*)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight", k)
        renamed[f"{m[1]}.mlp.experts.{m[2]}.{spelled[m[3]]}.weight" if m else k] = v
    assert renamed.keys() != t.keys()
    rewrite_tensors(d, renamed)
    with pytest.raises(CheckpointError, match="missing tensor"):
        load_model(d, Optimizations.reference())  # not in the table yet
    monkeypatch.setattr(names, "WEIGHT_NAMES", names.WEIGHT_NAMES + aliases)
    assert torch.equal(logits(d), tiny_logits)

    key = "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight"
    rewrite_tensors(d, {**renamed, key: t[key].clone()})
    with pytest.raises(CheckpointError, match=r"named twice: .*experts\.0\.w1\.weight and .*experts\.0\.gate_proj"):
        load_model(d, Optimizations.reference())


# -- the checkpoint maker's command line --------------------------------------------------------------------------


def test_make_checkpoint_cli(tmp_path):
    out = tmp_path / "cli"
    proc = subprocess.run(
        [sys.executable, "-m", "nanoserve.presets.make_checkpoint", "--preset", "m3-tiny", "--out", str(out),
         "--mxfp8", "--shards", "2", "--num-layers", "2"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "wrote m3-tiny (2 layers, MXFP8)" in proc.stdout
    assert os.path.isfile(out / "model.safetensors.index.json")
    cfg = read_config(str(out))
    assert cfg.num_hidden_layers == 2 and cfg.attn_layer_types == ["dense", "sparse"]
    model, _ = load_model(str(out), Optimizations.reference(), torch.float32)
    assert bool(torch.isfinite(full_forward(model, PROMPT)).all())


def test_make_checkpoint_cli_rejects_bad_layer_count(tmp_path, monkeypatch):
    from nanoserve.presets import make_checkpoint

    monkeypatch.setattr(sys, "argv", ["make_checkpoint", "--out", str(tmp_path / "x"), "--num-layers", "0"])
    with pytest.raises(SystemExit, match="--num-layers must be >= 1"):
        make_checkpoint.main()


# -- the dense MLP under either spelling --------------------------------------------------------------------------

DENSE_MLP = re.compile(r"(language_model\.model\.layers\.\d+)\.mlp\.((?:gate|up|down)_proj\.weight(?:_scale_inv)?)")


def spelled_as_transformers_5_17(model_dir: str, dst) -> str:
    """A copy of the checkpoint with the dense layers' MLP (and its MXFP8 scales) saved under block_sparse_moe, as
    transformers 5.17's save_pretrained names it."""
    d = copy_dir(model_dir, dst)
    t = tensors_of(d)
    renamed = {DENSE_MLP.sub(r"\1.block_sparse_moe.\2", k): v for k, v in t.items()}
    assert sum(k != DENSE_MLP.sub(r"\1.block_sparse_moe.\2", k) for k in t) >= 3  # layer 0 is dense
    rewrite_tensors(d, renamed)
    return d


@pytest.mark.parametrize("fmt", ["bf16", "mxfp8"])
def test_dense_mlp_loads_under_either_spelling(fmt, tiny_dir, mxfp8_dir, tmp_path):
    """`mlp.{gate,up,down}_proj` (the released checkpoint, newer transformers) and `block_sparse_moe.{gate,up,
    down}_proj` (transformers 5.17) fill the same parameters - fp8 weights and their scales too - and give the same
    greedy tokens; a checkpoint with both spellings is refused, naming both."""
    from nanoserve import LLM, SamplingParams

    src = tiny_dir if fmt == "bf16" else mxfp8_dir
    old = spelled_as_transformers_5_17(src, tmp_path / "old")
    keys = set(tensors_of(old))
    assert "language_model.model.layers.0.block_sparse_moe.gate_proj.weight" in keys
    assert not any(DENSE_MLP.fullmatch(k) for k in keys)
    if fmt == "mxfp8":
        assert "language_model.model.layers.0.block_sparse_moe.down_proj.weight_scale_inv" in keys
    opts = Optimizations.reference_kernels().replace(cuda_graphs=False)  # mxfp8_weights on: fp8 kept as stored
    new_model, _ = load_model(src, opts, torch.float32)
    old_model, _ = load_model(old, opts, torch.float32)
    assert new_model.weight_format == old_model.weight_format == ("mxfp8" if fmt == "mxfp8" else None)
    new_params, old_params = dict(new_model.named_parameters()), dict(old_model.named_parameters())
    assert new_params.keys() == old_params.keys()
    for name, p in new_params.items():
        assert p.dtype == old_params[name].dtype and torch.equal(p.float(), old_params[name].float()), name
    if fmt == "mxfp8":
        assert new_params["layers.0.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn

    prompts = [{"prompt_token_ids": random_ids(n, seed=n)} for n in (70, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = []
    for d in (src, old):
        with LLM(d, optimizations=opts, device="cpu", dtype="float32", max_model_len=256,
                 num_gpu_blocks_override=32) as llm:
            tokens.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert tokens[0] == tokens[1] and all(len(t) == 8 for t in tokens[0])

    both = copy_dir(old, tmp_path / "both")
    key = "language_model.model.layers.0.mlp.up_proj.weight"
    rewrite_tensors(both, {**tensors_of(old), **{k: v for k, v in tensors_of(src).items() if k.startswith(key)}})
    with pytest.raises(CheckpointError, match=r"named twice: \S*layers\.0\.mlp\.up_proj\.weight and \S*layers\.0\."
                                              r"block_sparse_moe\.up_proj\.weight \(two spellings"):
        load_model(both, opts, torch.float32)
