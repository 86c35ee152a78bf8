"""Why native MXFP8 and the same weights dequantised at load agree bit for bit at prefill sizes, on any card
(docs/mxfp8.md, "Accuracy"): the kernel choices both paths make, checked on the CPU with the device queries
faked.

- Every quantized projection of a prefill (more than fp8_configs.PREFILL_ROWS rows) takes the "dequant" variant:
  a transient 16-bit copy of W, then the same F.linear call, on the same values, that the dequantised model
  makes. That holds for every M3 projection shape - including the dense layers' QKV (9,216 x 6,144), which the
  CUDA table does not list and which used to run the in-register Triton GEMM against the other path's library
  GEMM - on both GPU backends, whatever the card's name or multiprocessor count.
- The "dequant" call equals F.linear on the dequantised weights exactly.
- The fused MoE at m3-slice prefill sizes runs, in both weight formats, a tensor-core dot of the same 16-bit
  weights accumulated along K in order: the MXFP8 table names no variant that rescales partial sums ("acc") or
  sums on CUDA cores ("gemv") there.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from nanoserve.kernels import configs, fp8_configs, fp8_linear
from nanoserve.kernels.fp8_linear import fp8_linear as fp8_linear_call
from nanoserve.kernels.fp8_linear import select_tiles, variant_code
from nanoserve.model.mxfp8 import dequantize_mxfp8, quantize_mxfp8
from nanoserve.presets.catalog import get_preset

CARDS = [("NVIDIA H100 80GB HBM3", 132), ("NVIDIA H100 PCIe", 114), ("NVIDIA H200", 132), ("NVIDIA B200", 148),
         ("NVIDIA L40S", 142), ("AMD Instinct MI300X", 304), ("a small card", 8)]
"""(device name, multiprocessors) of the cards simulated."""
PREFILL_ROWS = [fp8_configs.PREFILL_ROWS + 1, 200, 256, 257, 512, 513, 1000, 1024, 2048, 4096, 8192, 16384]
"""Row counts of a prefill step: every bucket boundary of the tables and a few between."""


@pytest.fixture(params=CARDS, ids=[name for name, _ in CARDS])
def card(request, monkeypatch):
    """A CUDA device whose name and multiprocessor count the kernels' queries see (nothing else changes)."""
    name, sms = request.param
    props = SimpleNamespace(name=name, multi_processor_count=sms, total_memory=80 << 30, major=9, minor=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a, **k: props)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: name)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    configs._sm_count.cache_clear()
    yield torch.device("cuda", 0), sms
    configs._sm_count.cache_clear()


def m3_slice_linear_shapes() -> set[tuple[int, int]]:
    """(N, K) of every quantized projection of m3-slice at tensor parallel 1."""
    cfg = get_preset("m3-slice").config
    h, d = cfg.hidden_size, cfg.head_dim
    qkv = cfg.q_size + 2 * cfg.kv_size
    index = cfg.index_n_heads * cfg.index_head_dim + cfg.index_head_dim
    return {(qkv, h), (qkv + index, h), (h, cfg.num_attention_heads * d),
            (2 * cfg.dense_intermediate_size, h), (h, cfg.dense_intermediate_size)}


def test_m3_slice_projections_are_among_the_m3_shapes():
    """The shape list the tables and this file check holds m3-slice's projections (dense QKV 9,216 x 6,144)."""
    assert (9216, 6144) in m3_slice_linear_shapes()
    assert m3_slice_linear_shapes() <= set(fp8_configs.M3_LINEAR_SHAPES)


@pytest.mark.parametrize("backend", ["cuda", "hip"])
def test_every_prefill_projection_takes_the_dequantised_models_gemm_on_any_card(card, backend, monkeypatch):
    device, sms = card
    monkeypatch.setattr(fp8_linear, "backend", lambda dev: backend)
    monkeypatch.setattr(configs, "backend", lambda dev: backend)
    assert configs.sm_count(device) == sms  # the faked card is the one the kernels see
    for n, k in fp8_configs.M3_LINEAR_SHAPES:
        for m in PREFILL_ROWS:
            for dtype in (torch.bfloat16, torch.float16):
                t = select_tiles(m, n, k, device, dtype)
                assert t.variant == "dequant", (backend, n, k, m, dtype, t)


def test_the_dense_qkv_is_the_m3_slice_projection_without_a_cuda_entry():
    """The dense layers' QKV has no CUDA table entry: its prefill rests on the heuristic, which sends it to
    "dequant" like the table entries of the other projections."""
    assert fp8_configs.linear_entry("cuda", 9216, 6144, 256) is None
    for n, k in m3_slice_linear_shapes() - {(9216, 6144)}:
        assert fp8_configs.linear_entry("cuda", n, k, 256)[0] == "dequant"


def test_decode_sized_batches_keep_the_triton_kernels(card, monkeypatch):
    """The rule is the prefill's: up to PREFILL_ROWS rows the untabled dense QKV keeps the in-register kernel."""
    device, _ = card
    monkeypatch.setattr(fp8_linear, "backend", lambda dev: "cuda")
    for m in (1, 8, 64, fp8_configs.PREFILL_ROWS):
        assert select_tiles(m, 9216, 6144, device).variant != "dequant"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_prefill_equals_f_linear_on_the_dequantised_weights_exactly(dtype, monkeypatch):
    """Through the selection (the CUDA column, faked here), an untabled shape's prefill runs the dequant kernel
    (the interpreter's, on the CPU) and then F.linear: the dequantised model's own call, bit for bit."""
    monkeypatch.setattr(fp8_linear, "backend", lambda dev: "cuda")
    gen = torch.Generator().manual_seed(3)
    q, s = quantize_mxfp8(torch.randn(96, 128, generator=gen) * 0.05)
    rows = fp8_configs.PREFILL_ROWS + 3
    x = torch.randn(rows, 128, generator=gen).to(dtype)
    assert select_tiles(rows, 96, 128, x.device, dtype).variant == "dequant"
    want = F.linear(x, dequantize_mxfp8(q, s, dtype))
    assert torch.equal(fp8_linear_call(x, q, s), want)


def test_moe_prefill_tiles_multiply_the_same_weights_in_the_same_order(monkeypatch):
    """m3-slice's experts at every prefill size: the MXFP8 entry's variant (as fused_moe and variant_code resolve
    it) is a tensor-core dot of the dequantised bf16 tile accumulated along K ("bcast" / "gather" / "scaled"),
    as the bf16 kernel's dot of the same values is; no split of K on either side."""
    from nanoserve.kernels import moe
    from nanoserve.kernels.moe import MOE_GEMV_MAX_TOKENS, select_config

    monkeypatch.setattr(moe, "backend", lambda dev: "cuda")  # the tables' CUDA column, not the interpreter's
    cfg = get_preset("m3-slice").config
    shape = (cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts)
    same_order = {fp8_configs.FP8_VARIANTS.index(v) for v in ("gather", "bcast", "scaled")}
    for tokens in [MOE_GEMV_MAX_TOKENS + 1, 16, 64, 65, 128, 129, 256, 257, 512, 513, 1024, 4096, 16384]:
        fp8 = select_config(tokens, *shape, cfg.num_experts_per_tok, torch.device("cuda", 0), torch.bfloat16,
                            w_fp8=True)
        variant = "bcast" if fp8.fp8_variant == "gemv" else fp8.fp8_variant  # fused_moe's rule past 4 tokens
        for k, gemm in ((cfg.hidden_size, fp8.up), (cfg.intermediate_size, fp8.down)):
            code = variant_code(variant, fp8.block_m, k % gemm.block_k == 0, torch.bfloat16)
            assert code in same_order, (tokens, fp8)

