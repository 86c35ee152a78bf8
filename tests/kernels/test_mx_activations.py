"""The `mx_activations` switch: activations quantized to MXFP8 and multiplied fp8 x fp8 (kernels/mx_linear.py).

- The quantizer (`reference.quantize_mx_activations`, the OCP MX rule) against values worked out by hand: the
  scale 2^(floor(log2(amax)) - 8), rounding to nearest e4m3 with ties to even, subnormals, saturation at +-448,
  an all-zero block.
- The Triton quantizer writes the reference's bytes; the Triton GEMM (`tl.dot_scaled`, e4m3 x e4m3) against
  `reference.mx_linear` on fresh random inputs, as max |kernel - reference| <= RTOL x max |reference|:
      fp32: 1e-5   (both multiply the same exact fp8 values and scales; only the summation order differs)
      fp16: 1e-2   (the reference rounds its fp32 result to fp16 once; split-K partials stay fp32)
      bf16: 2e-2   (as fp16, with bf16's 8-bit mantissa; the interpreter also rounds bf16 casts its own way)
  Runs under TRITON_INTERPRET=1 on the CPU (tests/conftest.py), whose tl.dot_scaled computes e4m3 x e4m3 with
  both scales in fp32, or compiled on a GPU when one is present.
- The reference against the bf16-activation MXFP8 path (`reference.fp8_linear`, same weights) within the MX
  quantization error: each activation moves by at most 1/16 of itself when rounded (3 fraction bits), by less
  than 1/8 when the saturation clips it, and by at most 2^-10 of its block's scale in the subnormal range; so
  |y_mx - y| <= (|x| @ |W|^T) / 8 + 2^-10 scale terms, element by element.
- m3-tiny with MXFP8 weights: the switch on gives finite logits close to the switch off, with the Triton path
  and the reference path agreeing.
"""

from __future__ import annotations

import pytest
import torch

from nanoserve.config import Optimizations
from nanoserve.kernels import reference
from nanoserve.kernels.fp8_linear import LinearTiles
from nanoserve.kernels.mx_linear import MX_LINEAR_TILES, mx_linear, quantize_mx
from nanoserve.model.loader import load_model
from nanoserve.model.mxfp8 import quantize_mxfp8
from tests.model.test_hf_parity import full_forward, random_ids

RTOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FP8_MAX = 448.0


def dequantized(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return reference.dequantize_mxfp8(q, s, torch.float32)


def activations(m: int, k: int, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """[m, k] normal values whose 32-column blocks span many octaves (a scale on the wrong block shows), with an
    outlier per row (a block's amax far above its other values, as real activations have)."""
    x = torch.randn(m, k, generator=gen)
    low, high = (-12, -2) if dtype == torch.float16 else (-30, 8)  # fp16: products and sums stay in range
    octaves = torch.randint(low, high + 1, (m, k // 32), generator=gen).float()
    x = x * torch.exp2(octaves).repeat_interleave(32, dim=1)
    x[torch.arange(m), torch.randint(0, k, (m,), generator=gen)] *= 40.0
    return x.to(dtype)


# -- the quantizer ----------------------------------------------------------------------------------------------


def test_quantizer_matches_a_hand_worked_example():
    x = torch.zeros(1, 96)
    # block 0: amax 3.0 -> floor(log2) = 1 -> scale 2^(1 - 8) = 2^-7 (E8M0 byte 120); values are x * 2^7
    x[0, :8] = torch.tensor([3.0, -3.0, 2.9, 0.1, 12.5 * 2.0 ** -7, 13.5 * 2.0 ** -7, 3 * 2.0 ** -17, 2.0 ** -30])
    # block 1: amax 7.5 -> scale 2^(2 - 8) = 2^-6 (byte 121); 7.5 * 2^6 = 480 saturates to 448
    x[0, 32:35] = torch.tensor([7.5, -7.5, 7.0])
    # block 2: all zeros -> the smallest scale nanoserve writes, 2^-126 (byte 1)
    q, s = reference.quantize_mx_activations(x)
    assert s.tolist() == [[120, 121, 1]]
    got = dequantized(q, s)[0]
    want = {
        0: 3.0, 1: -3.0,
        2: 3.0,                  # 2.9 * 2^7 = 371.2; e4m3 spacing 32 in [256, 512): 384 -> 3.0
        3: 13 * 2.0 ** -7,       # 12.8, spacing 1 in [8, 16): 13
        4: 12 * 2.0 ** -7,       # 12.5: a tie, to the even 12 (fraction bits 100)
        5: 14 * 2.0 ** -7,       # 13.5: a tie, to the even 14 (fraction bits 110)
        6: 2.0 ** -15,           # 3 * 2^-10: subnormal, spacing 2^-9, 1.5 spacings -> 2 (ties to even)
        7: 0.0,                  # 2^-23 after scaling: under half the smallest subnormal
        32: 7.0, 33: -7.0,       # saturated: 448 * 2^-6
        34: 7.0,
    }
    for i, v in want.items():
        assert got[i].item() == v, (i, got[i].item(), v)
    assert torch.all(got[8:32] == 0) and torch.all(got[35:] == 0)


def test_quantizer_error_is_within_the_e4m3_bound():
    gen = torch.Generator().manual_seed(1)
    x = activations(64, 512, gen, torch.float32)
    q, s = reference.quantize_mx_activations(x)
    scale = torch.exp2(s.float() - 127).repeat_interleave(32, dim=1)
    err = (dequantized(q, s) - x).abs()
    saturated = (x.abs() / scale) > FP8_MAX
    bound = torch.where(saturated, x.abs() / 8, torch.maximum(x.abs() / 16, scale * 2.0 ** -10))
    assert torch.all(err <= bound)
    assert saturated.any() and (err > 0).any()  # the draw exercises clipping and rounding


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_quantizer_writes_the_reference_bytes(dtype):
    gen = torch.Generator().manual_seed(2)
    x = activations(19, 352, gen, dtype)  # rows and columns not multiples of the kernel's tile
    x[3, :64] = 0.0
    q, s = quantize_mx(x.to(DEVICE))
    want_q, want_s = reference.quantize_mx_activations(x)
    assert torch.equal(s.cpu(), want_s)
    assert torch.equal(q.cpu().float(), want_q.float())  # values (+0 and -0 compare equal)


# -- the GEMM -------------------------------------------------------------------------------------------------------


def mx_weight(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, generator=gen) * torch.exp2(torch.randint(-6, 7, (n, k // 32), generator=gen).float()
                                                      ).repeat_interleave(32, dim=1)
    return quantize_mxfp8(w)


CASES = [  # (m, n, k, tiles, split_k): ragged M / N tiles, a K tail, split-K
    (1, 72, 320, None, None),
    (5, 40, 96, LinearTiles(16, 32, 64, 4, 1, "mx"), 1),
    (33, 64, 256, LinearTiles(16, 32, 64, 4, 1, "mx"), 2),
    (20, 48, 160, LinearTiles(16, 16, 128, 4, 1, "mx"), 1),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,tiles,split_k", CASES)
def test_mx_linear_matches_the_reference(m, n, k, tiles, split_k, dtype):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = activations(m, k, gen, dtype)
    w, ws = mx_weight(n, k, gen)
    got = mx_linear(x.to(DEVICE), w.to(DEVICE), ws.to(DEVICE), tiles=tiles, split_k=split_k).cpu()
    want = reference.mx_linear(x, w, ws)
    assert got.dtype == dtype and got.shape == (m, n)
    err = (got.float() - want.float()).abs().max().item()
    assert err <= RTOL[dtype] * want.float().abs().max().item(), err


def test_mx_linear_keeps_leading_dims_and_checks_its_inputs():
    gen = torch.Generator().manual_seed(3)
    x = activations(6, 64, gen, torch.float32).reshape(2, 3, 64)
    w, ws = mx_weight(32, 64, gen)
    got = mx_linear(x.to(DEVICE), w.to(DEVICE), ws.to(DEVICE)).cpu()
    assert got.shape == (2, 3, 32)
    assert torch.allclose(got, reference.mx_linear(x, w, ws), rtol=0, atol=1e-5 * got.abs().max().item())
    assert mx_linear(x[:0].to(DEVICE), w.to(DEVICE), ws.to(DEVICE)).shape == (0, 3, 32)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        mx_linear(x.to(DEVICE), w.float().to(DEVICE), ws.to(DEVICE))
    with pytest.raises(ValueError, match="do not fit"):
        mx_linear(x[..., :32].to(DEVICE), w.to(DEVICE), ws.to(DEVICE))


def test_tile_tables_use_the_native_shapes():
    """sm_100's block-scaled tcgen05.mma takes 128-row tiles (Triton falls back to a bf16 mma.sync below that);
    gfx950's scaled MFMA 16 rows or more and K steps of 128 or more; every K step is whole scale blocks."""
    assert all(t.block_m == 128 for t in MX_LINEAR_TILES["cuda"].values())
    assert all(t.block_m >= 16 and t.block_k >= 128 and t.num_stages <= 2 for t in MX_LINEAR_TILES["hip"].values())
    assert all(t.block_k % 32 == 0 for table in MX_LINEAR_TILES.values() for t in table.values())


# -- against the bf16-activation path --------------------------------------------------------------------------------


def test_reference_is_within_the_mx_quantization_error_of_the_bf16_activation_path():
    gen = torch.Generator().manual_seed(4)
    x = activations(48, 512, gen, torch.float32)
    w, ws = mx_weight(96, 512, gen)
    mx = reference.mx_linear(x, w, ws)
    plain = reference.fp8_linear(x, w, ws)  # the MXFP8 path with unquantized activations (fp32 here)
    wd = reference.dequantize_mxfp8(w, ws, torch.float32)
    _, s = reference.quantize_mx_activations(x)
    scale = torch.exp2(s.float() - 127).repeat_interleave(32, dim=1)
    # per activation: |x|/8 (rounding 1/16, clipping under 1/8) or, in the subnormal range, 2^-10 of its scale
    bound = torch.maximum(x.abs() / 8, scale * 2.0 ** -10) @ wd.abs().T
    diff = (mx - plain).abs()
    assert torch.all(diff <= bound * (1 + 1e-5)), (diff / bound).max()
    # and what it is in practice: rounding errors of random sign average out over K
    rel = ((mx - plain).norm() / plain.norm()).item()
    assert 1e-3 < rel < 2.0 ** -4, rel


# -- the model --------------------------------------------------------------------------------------------------------


def test_m3_tiny_with_mx_activations_gives_finite_logits_close_to_the_switch_off(tiny_dir):
    """MXFP8 weights; the switch flipped on the model's shared Optimizations (read at forward time). The Triton
    path (interpreter on the CPU) and the reference path agree; both stay near the unquantized-activation
    logits: MX activations move them about as much as quantizing the weights to MXFP8 does (m3-tiny's random
    weights make both about 18 % of the logits' norm), and far less than twice that."""
    prompt = random_ids(40, seed=5)
    unquantized = full_forward(load_model(tiny_dir, Optimizations.reference_kernels(), torch.float32)[0], prompt)
    opts = Optimizations.reference_kernels().replace(cuda_graphs=False)
    model, _ = load_model(tiny_dir, opts, torch.float32, quantization="mxfp8")
    off = full_forward(model, prompt)
    opts.mx_activations = True
    on = full_forward(model, prompt)
    opts.triton_fp8_linear = True
    on_triton = full_forward(model, prompt)
    assert torch.isfinite(on).all() and torch.isfinite(on_triton).all()
    assert not torch.equal(on, off)  # the switch did act
    assert (on_triton - on).abs().max() <= 1e-4 * on.abs().max()
    rel = ((on - off).norm() / off.norm()).item()
    weights_rel = ((off - unquantized).norm() / unquantized.norm()).item()
    assert 0 < rel < 2 * weights_rel, (rel, weights_rel)
