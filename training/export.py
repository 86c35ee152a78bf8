"""Write a trained M3Train as a checkpoint directory in the released layout, which nanoserve and transformers load.

    export(model, out_dir, tokenizer_json)        # train.py calls it
    python -m training.export --checkpoint data/run/checkpoint --out nanoserve/presets/m3_mini
                                                  # ship it in the package, with its held-out set

The directory holds config.json (the released `minimax_m3_vl` dialect, with a tiny vision config so transformers'
VL class can build its unused tower, and `num_mtp_modules`), model.safetensors (matrices, embeddings and norms in
bf16; the router and its correction bias in fp32, as released; the MTP module under `language_model.model.mtp.*`),
and the tokenizer with nanoserve's M3 chat template and generation_config.json.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import save_file

from nanoserve.presets.make_checkpoint import TINY_VISION_CONFIG
from nanoserve.presets.tokenizer import write_tokenizer_files

# The defaults the server applies to requests that leave them unset: the model is small, so a low temperature
# keeps its answers on the formats it learned, and max_new_tokens (vLLM reads it as the default max_tokens) bounds
# a reply, thinking included: its longest trained answers are a few hundred tokens, and 1,024 tokens take
# 10-20 s on a CPU, where a reply that never ended once reasoned for 3,498.
GENERATION_CONFIG = {"bos_token_id": 1, "eos_token_id": [2], "temperature": 0.3, "top_p": 0.9, "top_k": 40,
                     "do_sample": True, "max_new_tokens": 1024}


def export(model, out: str, tokenizer_json: str) -> None:
    os.makedirs(out, exist_ok=True)
    tensors = {}
    for name, t in model.checkpoint_tensors().items():
        fp32 = name.endswith((".gate.weight", "e_score_correction_bias"))
        tensors[name] = t.detach().to("cpu", torch.float32 if fp32 else torch.bfloat16).contiguous()
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    config = model.cfg.to_hf_dict(vision_config=TINY_VISION_CONFIG)
    config["text_config"]["num_mtp_modules"] = 1 if model.mtp is not None else 0
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    from tokenizers import Tokenizer

    write_tokenizer_files(out, Tokenizer.from_file(tokenizer_json), GENERATION_CONFIG,
                          model.cfg.max_position_embeddings)


def ship(checkpoint: str, data: str, out: str, text_chars: int = 60_000) -> None:
    """Copy a trained checkpoint into the package with its held-out set: the prompts (heldout.jsonl.gz, from
    prepare.py) and the first `text_chars` characters of each corpus's held-out text (heldout_text.jsonl.gz),
    which `python -m nanoserve.bench --quality` grades."""
    import gzip

    from training.tokenizer import SOURCES

    os.makedirs(out, exist_ok=True)
    for name in os.listdir(checkpoint):
        shutil.copy(os.path.join(checkpoint, name), os.path.join(out, name))
    shutil.copy(os.path.join(data, "heldout.jsonl.gz"), os.path.join(out, "heldout.jsonl.gz"))
    with gzip.open(os.path.join(out, "heldout_text.jsonl.gz"), "wt", encoding="utf-8") as f:
        for source in SOURCES:
            text = open(os.path.join(data, f"heldout_{source}.txt"), encoding="utf-8").read()[:text_chars]
            f.write(json.dumps({"source": source, "text": text}) + "\n")


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="Copy a trained m3-mini checkpoint and its held-out set into the "
                                 "package (nanoserve/presets/m3_mini).")
    ap.add_argument("--checkpoint", default="data/run/checkpoint")
    ap.add_argument("--data", default="data/prepared")
    ap.add_argument("--out", default="nanoserve/presets/m3_mini")
    args = ap.parse_args()
    ship(args.checkpoint, args.data, args.out)
    print(f"shipped {args.checkpoint} -> {args.out}")


if __name__ == "__main__":
    main()
