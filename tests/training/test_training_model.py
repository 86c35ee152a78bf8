"""training/model.py computes the forward pass nanoserve serves: a trainable M3 written out by training/export.py
and read back by nanoserve's loader gives the same logits in fp32, on a prompt attended densely (shorter than
MSA's top-k x block size) and on one where MSA really drops blocks (the trainable model's `sparse` mode runs the
same block selection). Also: the MoE computed densely for training (every expert weighted by its routing weight)
equals gathering each expert's tokens, values and gradients."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanoserve.config import Optimizations
from nanoserve.model.loader import load_model
from nanoserve.presets.catalog import SHIPPED
from tests.model.test_hf_parity import full_forward
from training.config import MINI
from training.export import export
from training.model import M3Train, MoE, swiglu_oai
from training.train import load_checkpoint

FP32_RTOL = 1e-5
"""fp32: max |nanoserve - training| <= FP32_RTOL x max |logit| (the two sum in different orders; ~8e-7 seen)."""


def test_exported_training_model_matches_the_loader(tmp_path):
    torch.manual_seed(0)
    model = M3Train(MINI)
    model.reset_parameters(std=0.05)  # larger than the init so that every layer moves the logits
    with torch.no_grad():
        for moe in model.moe_layers():
            moe.e_score_correction_bias.normal_(0.0, 0.05)
    export(model, str(tmp_path), f"{SHIPPED['m3-mini']}/tokenizer.json")
    load_checkpoint(model, str(tmp_path))  # the exported weights are bf16: both sides read the same values
    ours, _ = load_model(str(tmp_path), Optimizations.reference(), torch.float32, "cpu")
    for length, mode in ((300, "dense"), (1500, "sparse")):  # 1,500 > 16 blocks x 64: blocks are dropped
        ids = torch.randint(3, MINI.vocab_size, (length,), generator=torch.Generator().manual_seed(length))
        with torch.inference_mode():
            got = full_forward(ours, ids.tolist())
            ref, _, _ = model(ids[None], torch.tensor([length]), mode=mode, mtp=False)
        ref = ref[0].float()
        assert (got - ref).abs().max().item() <= FP32_RTOL * ref.abs().max().item(), (length, mode)


def gathered_moe(m: MoE, x: torch.Tensor) -> torch.Tensor:
    """The MoE as serving computes it: each expert on the tokens routed to it."""
    cfg = m.cfg
    xf = x.reshape(-1, x.shape[-1])
    s = torch.sigmoid(F.linear(xf.float(), m.gate.weight.float()))
    ids = torch.topk(s.detach() + m.e_score_correction_bias, cfg.num_experts_per_tok, dim=-1).indices
    w = s.gather(1, ids)
    w = w / w.sum(-1, keepdim=True)
    out = torch.zeros_like(xf)
    for e in range(cfg.num_local_experts):
        tok, slot = torch.where(ids == e)
        a = swiglu_oai(F.linear(xf[tok], m.w1[e]), F.linear(xf[tok], m.w3[e]), cfg.swiglu_alpha, cfg.swiglu_limit)
        out = out.index_add(0, tok, F.linear(a, m.w2[e]) * w[tok, slot, None])
    return (cfg.routed_scaling_factor * out + m.shared_experts(xf)).view(x.shape)


def test_dense_moe_equals_gathered_experts():
    torch.manual_seed(1)
    m = MoE(MINI)
    for p in m.parameters():
        torch.nn.init.normal_(p, 0.0, 0.05)
    m.e_score_correction_bias.normal_(0.0, 0.1)
    x = torch.randn(3, 40, MINI.hidden_size, requires_grad=True)
    ref = gathered_moe(m, x)
    got = m(x, torch.ones(3, 40, dtype=torch.bool))
    params = [x, m.w1, m.w2, m.w3, m.gate.weight]
    g_ref = torch.autograd.grad(ref.square().sum(), params)
    g_got = torch.autograd.grad(got.square().sum(), params)
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()  # fp32
    for a, b in zip(g_got, g_ref):
        assert (a - b).abs().max() <= 1e-4 * b.abs().max()  # fp32 gradients, summed in another order
    assert int(m.load.sum()) == 3 * 40 * MINI.num_experts_per_tok  # every live token's choices counted


def test_eager_modes_bypass_compiled_blocks_and_compute_the_same():
    """train.py compiles the decoder blocks in place and puts "sparse" in `eager_modes`, so the rare sparse
    retrieval steps call each block's plain forward instead of compiling every block once more. Here a block's
    compiled call is emulated (a counting wrapper of its own call): dense steps go through it, sparse steps do not,
    and either way the logits are those of the plain model."""
    torch.manual_seed(0)
    model = M3Train(MINI).eval()
    ids = torch.randint(3, MINI.vocab_size, (1, 96), generator=torch.Generator().manual_seed(1))
    lengths = torch.tensor([96])
    with torch.no_grad():
        want = {mode: model(ids, lengths, mode=mode)[0] for mode in ("dense", "sparse")}
    calls = []
    blocks = [*model.layers, model.mtp.transformer_layer]
    for block in blocks:
        def compiled(*args, _block=block, **kwargs):
            calls.append(_block)
            return _block._call_impl(*args, **kwargs)
        block._compiled_call_impl = compiled  # what nn.Module.compile() sets
    model.eager_modes = {"sparse"}
    with torch.no_grad():
        dense = model(ids, lengths, mode="dense")[0]
        assert len(calls) == len(blocks)
        sparse = model(ids, lengths, mode="sparse")[0]
        assert len(calls) == len(blocks)  # no block went through its compiled call
    assert torch.equal(dense, want["dense"]) and torch.equal(sparse, want["sparse"])
