"""The one-row GEMVs (kernels/gemv.py, switch `triton_gemv`) against F.linear and, for MXFP8 weights, against
reference.fp8_linear (dequantise, then F.linear), on fresh random inputs.

Runs on the CPU under TRITON_INTERPRET=1 (tests/conftest.py) or compiled on a GPU. Both accumulate in fp32; only
the summation order differs. Tolerances, as max |gemv - F.linear in fp32| <= RTOL x max |F.linear in fp32|:
    fp32: 1e-5
    fp16 / bf16 (GPU only for bf16): 1e-2 (the output is rounded to 16 bits; F.linear in 16 bits is held to the
          same bound)

Run: python -m pytest tests/kernels/test_kernel_gemv.py -q
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanoserve.config import Optimizations
from nanoserve.kernels import reference
from nanoserve.kernels.configs import GEMV_MXFP8_TILES, GEMV_TILES
from nanoserve.kernels.gemv import gemv, gemv_applies, gemv_mxfp8
from nanoserve.model.layers.linear import linear
from nanoserve.model.mxfp8 import quantize_mxfp8

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
RTOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def draw(n: int, k: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, k, generator=gen)
    w = torch.randn(n, k, generator=gen) / k**0.5
    return x.to(DEVICE, dtype), w.to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k,tiles", [
    (96, 256, (16, 64, 4, 1)),     # even N and K
    (100, 200, (16, 64, 4, 1)),    # N and K that are no multiple of the tile
    (33, 512, (8, 256, 4, 1)),     # another tile
])
def test_matches_f_linear(dtype, n, k, tiles):
    x, w = draw(n, k, dtype, seed=n + k)
    out = gemv(x, w, tiles)
    ref = F.linear(x.float(), w.float())
    assert out.dtype == dtype and out.shape == (1, n)
    diff = (out.float() - ref).abs().max().item()
    assert diff <= RTOL[dtype] * ref.abs().max().item()


def test_argument_errors():
    x, w = draw(16, 64, torch.float32, seed=0)
    with pytest.raises(ValueError, match="x \\[1, K\\]"):
        gemv(torch.cat([x, x]), w)
    with pytest.raises(ValueError, match="weight must have x's dtype or float32"):
        gemv(x, w.half())


@pytest.mark.parametrize("dtype", [torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else []))
def test_fp32_weight_as_the_router(dtype):
    """A 16-bit row times an fp32 weight into fp32: F.linear(x.float(), W) without the copy (M3's router)."""
    x, w = draw(40, 192, torch.float32, seed=7)
    x = x.to(dtype)
    out = gemv(x, w, (8, 64, 4, 1), out_dtype=torch.float32)
    ref = F.linear(x.float(), w)
    assert out.dtype == torch.float32
    assert (out - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


def test_linear_takes_it_only_for_tuned_shapes(monkeypatch):
    """linear(): one row of a tuned shape -> the GEMV (switch on), else F.linear."""
    x, w = draw(48, 128, torch.float32, seed=1)
    kind = "interpret" if DEVICE.type == "cpu" else ("hip" if torch.version.hip else "cuda")
    assert not gemv_applies(torch.zeros(1, 128, device=DEVICE), torch.zeros(47, 128, device=DEVICE))
    calls = []
    monkeypatch.setitem(GEMV_TILES, kind, {(48, 128): (16, 64, 4, 1)})
    monkeypatch.setattr("nanoserve.kernels.gemv._gemv_kernel", _counting(calls))
    ref = F.linear(x, w)
    for opts, rows, used in [(Optimizations(), 1, True), (Optimizations(triton_gemv=False), 1, False),
                             (Optimizations(), 2, False)]:
        calls.clear()
        xs = x.expand(rows, -1).contiguous()
        out = linear(xs, w, None, opts)
        assert bool(calls) == used
        assert (out - ref.expand(rows, -1)).abs().max().item() <= 1e-5 * ref.abs().max().item()


def _counting(calls: list, name: str = "_gemv_kernel"):
    from nanoserve.kernels import gemv as mod

    real = getattr(mod, name)

    class Counting:
        def __getitem__(self, grid):
            calls.append(grid)
            return real[grid]

    return Counting()


def draw_mxfp8(n: int, k: int, dtype: torch.dtype, seed: int):
    x, w = draw(n, k, torch.float32, seed)
    q, scale = quantize_mxfp8(w.cpu())
    return x.to(dtype), q.to(DEVICE), scale.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k,tiles", [
    (96, 256, (16, 64, 4, 1)),     # even N and K
    (100, 224, (16, 64, 4, 1)),    # N no multiple of the tile, K a multiple of 32 but not of block_k
    (33, 512, (8, 256, 4, 1)),     # another tile
])
def test_mxfp8_matches_reference(dtype, n, k, tiles):
    x, q, scale = draw_mxfp8(n, k, dtype, seed=n * k)
    out = gemv_mxfp8(x, q, scale, tiles)
    ref = reference.fp8_linear(x.float(), q, scale)
    assert out.dtype == dtype and out.shape == (1, n)
    assert (out.float() - ref).abs().max().item() <= RTOL[dtype] * ref.abs().max().item()


def test_mxfp8_argument_errors():
    x, q, scale = draw_mxfp8(16, 64, torch.float32, seed=0)
    with pytest.raises(ValueError, match="fp8 e4m3 weight"):
        gemv_mxfp8(x, q.float(), scale)
    with pytest.raises(ValueError, match="uint8 scales"):
        gemv_mxfp8(x, q, scale[:, :1])
    with pytest.raises(ValueError, match="multiple of 32"):
        gemv_mxfp8(x, q, scale, (16, 48, 4, 1))


def test_linear_takes_the_mxfp8_gemv_only_for_tuned_shapes(monkeypatch):
    x, q, scale = draw_mxfp8(48, 128, torch.float32, seed=2)
    kind = "interpret" if DEVICE.type == "cpu" else ("hip" if torch.version.hip else "cuda")
    calls = []
    monkeypatch.setitem(GEMV_MXFP8_TILES, kind, {(48, 128): (16, 64, 4, 1)})
    monkeypatch.setattr("nanoserve.kernels.gemv._gemv_mxfp8_kernel", _counting(calls, "_gemv_mxfp8_kernel"))
    ref = reference.fp8_linear(x, q, scale)
    for opts, rows, used in [(Optimizations(), 1, True), (Optimizations(triton_gemv=False), 1, False),
                             (Optimizations(), 2, False)]:
        calls.clear()
        out = linear(x.expand(rows, -1).contiguous(), q, scale, opts)
        assert bool(calls) == used
        assert (out - ref.expand(rows, -1)).abs().max().item() <= 1e-5 * ref.abs().max().item()


def test_moe_router_takes_the_gemv_when_tuned(monkeypatch):
    """M3MoE.router_logits at one row: the GEMV on the fp32 router weight (tuned shape, switch on) equals
    F.linear(x.float(), gate); the switch off or two rows take F.linear."""
    from nanoserve.model.layers.moe import M3MoE
    from nanoserve.presets.catalog import get_preset

    cfg = get_preset("m3-tiny").config
    kind = "interpret" if DEVICE.type == "cpu" else ("hip" if torch.version.hip else "cuda")
    monkeypatch.setitem(GEMV_TILES, kind, {(cfg.num_local_experts, cfg.hidden_size): (4, 64, 4, 1)})
    calls = []
    monkeypatch.setattr("nanoserve.kernels.gemv._gemv_kernel", _counting(calls))
    torch.manual_seed(0)
    for on, rows, used in [(True, 1, True), (False, 1, False), (True, 2, False)]:
        layer = M3MoE(cfg, Optimizations(triton_gemv=on), torch.float32, DEVICE)
        layer.gate.data.normal_(0, 0.1)
        x = torch.randn(rows, cfg.hidden_size, device=DEVICE).half()
        calls.clear()
        got = layer.router_logits(x)
        ref = F.linear(x.float(), layer.gate)
        assert bool(calls) == used and got.dtype == torch.float32
        assert (got - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


def test_lm_head_takes_the_gemv_when_tuned(monkeypatch):
    """ParallelLMHead at one row: the GEMV (its vocabulary slice's shape tuned, switch on) gives the fp32 logits of
    F.linear; the switch off or two rows take F.linear."""
    from nanoserve.model.layers.embedding import ParallelLMHead

    vocab, hidden = 300, 128
    kind = "interpret" if DEVICE.type == "cpu" else ("hip" if torch.version.hip else "cuda")
    monkeypatch.setitem(GEMV_TILES, kind, {(vocab, hidden): (16, 64, 4, 1)})
    calls = []
    monkeypatch.setattr("nanoserve.kernels.gemv._gemv_kernel", _counting(calls))
    torch.manual_seed(0)
    for on, rows, used in [(True, 1, True), (False, 1, False), (True, 2, False)]:
        head = ParallelLMHead(vocab, hidden, torch.float32, DEVICE, Optimizations(triton_gemv=on))
        head.weight.data.normal_(0, hidden**-0.5)
        x = torch.randn(rows, hidden, device=DEVICE)
        calls.clear()
        got = head(x)
        ref = F.linear(x, head.weight)
        assert bool(calls) == used and got.dtype == torch.float32 and got.shape == (rows, vocab)
        assert (got - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


def test_tuned_config_file_adds_shapes(tmp_path, monkeypatch):
    """$NANOSERVE_GEMV_TUNED_CONFIG (what `scripts/tune_gemv.py --write` writes): its shapes take the GEMV, per
    weight format, on top of the built-in tables."""
    import json

    from nanoserve.kernels import configs

    path = tmp_path / "gemv.json"
    path.write_text(json.dumps({"16bit": {"48,128": [16, 64, 4, 1]}, "mxfp8": {"96,256": [16, 64, 4, 1]}}))
    x = torch.zeros(1, 128, device=DEVICE)
    assert not gemv_applies(x, torch.zeros(48, 128, device=DEVICE))
    monkeypatch.setenv(configs.GEMV_TUNED_CONFIG_ENV, str(path))
    assert gemv_applies(x, torch.zeros(48, 128, device=DEVICE))
    assert configs.gemv_tiles(48, 128, DEVICE) == (16, 64, 4, 1)
    assert configs.gemv_tiles(48, 128, DEVICE, mxfp8=True) is None
    assert configs.gemv_tiles(96, 256, DEVICE, mxfp8=True) == (16, 64, 4, 1)
    calls = []
    monkeypatch.setattr("nanoserve.kernels.gemv._gemv_kernel", _counting(calls))
    x, w = draw(48, 128, torch.float32, seed=3)
    ref = F.linear(x, w)
    assert (linear(x, w, None, Optimizations()) - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    assert calls


@pytest.mark.parametrize("variable", ["NANOSERVE_GEMV_TUNED_CONFIG", "NANOSERVE_FP8_TUNED_CONFIG"])
@pytest.mark.parametrize("content", [None, "{not json", '{"16bit": {"48,128": [16, 64]}}', '{"linear": 3}'],
                         ids=["missing", "not-json", "short-tile", "other-table"])
def test_bad_tuned_config_file_stops_the_engine_at_start(tmp_path, monkeypatch, variable, content):
    """A tile-table file that is missing, malformed or the other script's stops the engine before it loads
    anything, with a ValueError naming the variable and the file (not a failure inside a decode step later)."""
    from nanoserve import LLM
    from nanoserve.kernels import configs

    path = tmp_path / "tiles.json"
    if content is not None:
        path.write_text(content)
    monkeypatch.setenv(variable, str(path))
    configs._read_tuned_file.cache_clear()
    with pytest.raises(ValueError, match=f"{variable}={path}"):
        LLM(model="m3-tiny", device="cpu", dtype="float32", max_model_len=64, num_gpu_blocks_override=8)
