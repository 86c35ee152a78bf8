"""The Hugging Face reference model, loaded from the same checkpoint directory nanoserve reads.

Import it from any test as

    from tests.helpers.hf_oracle import load_hf_oracle

This works because `tests/` is a package (`tests/__init__.py`): pytest's default "prepend" import mode then puts
the repository root on sys.path, so `tests.*` resolves from any test file (and from `python -m pytest tests`).

transformers' text-only `MiniMaxM3VLForCausalLM` cannot read the real checkpoint key names
(`language_model.model.layers.N.block_sparse_moe.experts.E.w1.weight`, ...: the released names) - it expects its
own fused names. The full VL class `MiniMaxM3SparseForConditionalGeneration` converts the real names on load, so
we load that and copy its language model and LM head into a text-only model. The checkpoint maker writes a tiny
`vision_config` so the unused vision tower is cheap; vision weights are absent from our checkpoints and are
randomly initialised (harmless: text-only inputs never reach them). HF's load report (which lists those missing
vision weights) and its progress bars are silenced while loading.
"""

from __future__ import annotations

import torch
from transformers.utils import logging as hf_logging


def load_hf_oracle(model_dir: str, dtype: torch.dtype = torch.float32,
                   attn_implementation: str = "eager") -> "MiniMaxM3VLForCausalLM":  # noqa: F821
    """transformers' `MiniMaxM3VLForCausalLM` with the weights of the checkpoint in `model_dir`, in eval mode.

    `attn_implementation` defaults to "eager" (the plainest path; "sdpa" computes the same thing)."""
    from transformers.models.minimax_m3_vl import MiniMaxM3SparseForConditionalGeneration, MiniMaxM3VLForCausalLM

    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        full = MiniMaxM3SparseForConditionalGeneration.from_pretrained(model_dir, dtype=dtype)
        text_config = full.config.text_config
        text_config._attn_implementation = attn_implementation
        hf = MiniMaxM3VLForCausalLM(text_config).to(dtype)
        hf.model.load_state_dict(full.model.language_model.state_dict(), strict=True)
        hf.lm_head.load_state_dict(full.lm_head.state_dict(), strict=True)
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    return hf.eval()
