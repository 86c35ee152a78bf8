"""Write a preset model as a real-layout checkpoint directory.

    python -m nanoserve.model.make_checkpoint --preset m3-tiny --out DIR [--mxfp8] [--shards N]

The directory holds config.json (the released `minimax_m3_vl` layout), safetensors with the real key names
(m3_spec.md section 3) - optionally MXFP8 (fp8 e4m3 weights + per-1x32 E8M0 `weight_scale_inv`) and optionally
sharded with `model.safetensors.index.json` - and a tokenizer with M3's special tokens and chat template.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import asdict

import torch
from safetensors.torch import save_file

from nanoserve.model.checkpoint_layout import PROJ, checkpoint_specs, random_tensors
from nanoserve.model.m3_config import M3Config
from nanoserve.model.presets import Preset, get_preset
from nanoserve.model.tokenizer_files import CHAT_TEMPLATE, build_tokenizer, write_tokenizer

CHECKPOINT_FORMAT_VERSION = 1
"""Bump when the maker's output changes in a way the preset fingerprint cannot see (e.g. how weights are drawn)."""
SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
MXFP8_BLOCK = 32
E8M0_BIAS = 127
FP8_E4M3_MAX = 448.0

# A small vision config so Hugging Face's full VL class can build the (unused) vision tower cheaply.
TINY_VISION_CONFIG = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                      "model_type": "minimax_m3_vl_vision"}


def quantize_mxfp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [out, in] -> (fp8 e4m3 [out, in], uint8 E8M0 exponents [out, in/32]) with W ~= fp8 * 2^(scale - 127).
    Each 1x32 block's scale is the power of two that brings its max |w| within fp8's range."""
    out_f, in_f = w.shape
    if in_f % MXFP8_BLOCK:
        raise ValueError(f"MXFP8 needs the input dim to be a multiple of {MXFP8_BLOCK}, got {in_f}")
    blocks = w.float().reshape(out_f, in_f // MXFP8_BLOCK, MXFP8_BLOCK)
    amax = blocks.abs().amax(-1).clamp(min=2.0 ** -100)
    exp = torch.ceil(torch.log2(amax / FP8_E4M3_MAX)).clamp(-E8M0_BIAS, 127)
    q = (blocks / torch.exp2(exp)[..., None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(out_f, in_f), (exp + E8M0_BIAS).to(torch.uint8)


def dequantize_mxfp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Inverse of quantize_mxfp8 (and the checkpoint's rule): W[o, i] = fp8[o, i] * 2^(S[o, i // 32] - 127)."""
    factor = torch.exp2(scale.float() - E8M0_BIAS).repeat_interleave(MXFP8_BLOCK, dim=-1)[..., : q.shape[-1]]
    return (q.float() * factor).to(dtype)


def _is_quantized(name: str, spec_role: str) -> bool:
    # MXFP8 checkpoints keep embeddings, lm_head, norms and the router unquantized (m3_spec.md 3.6).
    return spec_role == PROJ and "embed_tokens" not in name and "lm_head" not in name


def _remove_previous_weights(out: str) -> None:
    """Delete weight files an earlier write left in `out` (only our own file names), so a stale index or shard
    can never be mixed with the new ones."""
    for name in os.listdir(out):
        if name in ("model.safetensors", "model.safetensors.index.json") or SHARD_NAME.fullmatch(name):
            os.remove(os.path.join(out, name))


def write_checkpoint(out: str, cfg: M3Config, preset: Preset, mxfp8: bool = False, shards: int = 1,
                     dtype: torch.dtype | None = None) -> None:
    """Write weights + config + tokenizer into `out` (created if needed; weight files of an earlier write there
    are replaced)."""
    os.makedirs(out, exist_ok=True)
    _remove_previous_weights(out)
    specs = checkpoint_specs(cfg)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in random_tensors(cfg, preset.init_std, preset.random_norms, preset.seed, dtype=dtype):
        if mxfp8 and _is_quantized(name, specs[name].role):
            q, s = quantize_mxfp8(t)
            tensors[name], tensors[name + "_scale_inv"] = q, s
        else:
            tensors[name] = t.contiguous()
    names = list(tensors)
    if shards <= 1:
        save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    else:
        per = -(-len(names) // shards)
        weight_map = {}
        for i in range(shards):
            fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            chunk = {n: tensors[n] for n in names[i * per: (i + 1) * per]}
            save_file(chunk, os.path.join(out, fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in chunk})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    config = cfg.to_hf_dict(vision_config=TINY_VISION_CONFIG)
    if mxfp8:
        config["quantization_config"] = {"quant_method": "mxfp8", "activation_scheme": "dynamic",
                                         "weight_block_size": [1, MXFP8_BLOCK]}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    write_tokenizer(out)


def preset_fingerprint(preset: str) -> str:
    """A short hash of everything a preset's generated checkpoint depends on: its config, how its weights are
    drawn, its tokenizer and this file's format version. A changed preset gets a new cache directory instead of
    silently reusing the files generated by an older nanoserve."""
    p = get_preset(preset)
    tokenizer = build_tokenizer().to_str() + CHAT_TEMPLATE
    facts = json.dumps({"format": CHECKPOINT_FORMAT_VERSION, "config": asdict(p.config), "init_std": p.init_std,
                        "random_norms": p.random_norms, "seed": p.seed,
                        "tokenizer": hashlib.sha256(tokenizer.encode()).hexdigest()}, sort_keys=True)
    return hashlib.sha256(facts.encode()).hexdigest()[:12]


def preset_cache_dir(preset: str) -> str:
    root = os.environ.get("NANOSERVE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "nanoserve"))
    return os.path.join(root, f"{preset}-{preset_fingerprint(preset)}")


def ensure_preset_checkpoint(preset: str) -> str:
    """The embedded default models: generate the preset's checkpoint once (deterministically) into the cache
    directory and return its path. Written to a temporary directory first so a crash never leaves half a model."""
    path = preset_cache_dir(preset)
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    p = get_preset(preset)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{preset}-", dir=os.path.dirname(path))
    try:
        write_checkpoint(tmp, p.config, p)
        try:
            os.rename(tmp, path)
        except OSError:  # another process got there first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="m3-tiny", help="m3-tiny or m3-slice")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--mxfp8", action="store_true", help="write MXFP8 weights (fp8 e4m3 + E8M0 scales)")
    ap.add_argument("--shards", type=int, default=1, help="number of safetensors files")
    ap.add_argument("--num-layers", type=int, default=None, help="override the preset's layer count "
                    "(the first layer dense, the rest MSA + MoE)")
    args = ap.parse_args()
    preset = get_preset(args.preset)
    cfg = preset.config
    if args.num_layers is not None:
        if args.num_layers < 1:
            raise SystemExit("--num-layers must be >= 1")
        kinds = ["dense"] + ["sparse"] * (args.num_layers - 1)
        cfg = cfg.replace(num_hidden_layers=args.num_layers, attn_layer_types=kinds, mlp_layer_types=kinds)
    write_checkpoint(args.out, cfg, preset, mxfp8=args.mxfp8, shards=args.shards)
    print(f"wrote {args.preset} ({cfg.num_hidden_layers} layers{', MXFP8' if args.mxfp8 else ''}) to {args.out}")


if __name__ == "__main__":
    main()
