"""MXFP8 weights on the GPU (marked `gpu`; tests/kernels/test_kernel_fp8.py and tests/model/test_mxfp8.py check the
same kernels and paths at small widths on the CPU, where Triton's interpreter cannot compute bf16).

- The Triton fp8-weight GEMM against `reference.fp8_linear` at M3's projection widths and at a ragged K, for
  decode-sized (split-K, GEMV) and prefill-sized row counts, in bf16.
- On Hopper, the Gluon fp8 linear (`fp8_linear_wgmma`) against the same reference at decode sizes, and its
  captured replay bit for bit.
- The fused MoE with fp8 experts and the folded shared expert against `reference.moe_experts` on the same fp8
  weights, plus the shared expert through F.linear.
- Both replayed from a CUDA graph equal their eager call bit for bit.
- m3-slice served natively in MXFP8 against the same weights dequantised at load: every projection equal bit for
  bit (at prefill sizes it makes the dequantised model's own F.linear call), so the first module that may differ
  is a fused MoE, whose two tile tables choose apart (docs/mxfp8.md); the log-probabilities within the tolerance
  below; on failure it names the first module where the two forwards differ.

Tolerance of the kernels: max |kernel - reference| <= 2e-2 x max |reference| (bf16 outputs; both accumulate in
fp32).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

RTOL = 2e-2
ALPHA, LIMIT, SCALE = 1.702, 7.0, 2.0


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|; inf when `got` holds a non-finite value."""
    if not torch.isfinite(got).all():
        return float("inf")
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def quantized(n: int, k: int, gen: torch.Generator):
    from nanoserve.model.mxfp8 import quantize_mxfp8

    return quantize_mxfp8(torch.empty(n, k, device="cuda").normal_(0, 0.02, generator=gen))


@pytest.mark.parametrize("n,k", [(9856, 6144), (6144, 8192), (1000, 544)])
@pytest.mark.parametrize("m", [1, 5, 64, 200, 4096])
def test_fp8_linear_matches_the_reference_bf16(m, n, k):
    from nanoserve.kernels import reference
    from nanoserve.kernels.fp8_linear import fp8_linear

    gen = torch.Generator(device="cuda").manual_seed(m * 7 + n)
    q, s = quantized(n, k, gen)
    x = torch.empty(m, k, device="cuda").normal_(0, 1, generator=gen).bfloat16()
    assert rel_err(fp8_linear(x, q, s), reference.fp8_linear(x, q, s)) <= RTOL


def gluon_linear_or_skip(x, q, s, monkeypatch) -> list:
    """Skip where fp8_linear_wgmma's kernel does not apply; else a list that gets an entry per call to it."""
    from nanoserve.kernels import fp8_linear_wgmma

    if not fp8_linear_wgmma.supported(x, q, s):
        pytest.skip("the Gluon fp8 linear is for CUDA sm_90 with Triton's Gluon")
    calls, kernel = [], fp8_linear_wgmma.partial_sums
    monkeypatch.setattr(fp8_linear_wgmma, "partial_sums", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    return calls


@pytest.mark.parametrize("n,k", [(9856, 6144), (6144, 12288), (24576, 6144), (1000, 640)])
@pytest.mark.parametrize("m", [1, 5, 33, 64])
def test_gluon_fp8_linear_matches_the_reference_bf16(m, n, k, monkeypatch):
    """Switch fp8_linear_wgmma on Hopper: decode-sized calls run the Gluon kernel (kernels/fp8_linear_wgmma.py,
    split over K or not, 128 or 256 weight rows per program, a ragged last column tile at N = 1,000) within the
    kernels' tolerance of the reference, without an operation that waits for the GPU. (From 65 rows up an eager
    call of these shapes takes the transient bf16 copy; the graph test below covers 256 rows.)"""
    from nanoserve.kernels import reference
    from nanoserve.kernels.fp8_linear import FP8_WGMMA_MAX_ROWS, fp8_linear

    gen = torch.Generator(device="cuda").manual_seed(m * 7 + n)
    q, s = quantized(n, k, gen)
    x = torch.empty(m, k, device="cuda").normal_(0, 1, generator=gen).bfloat16()
    calls = gluon_linear_or_skip(x, q, s, monkeypatch)
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = fp8_linear(x, q, s, wgmma_max_rows=FP8_WGMMA_MAX_ROWS)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert calls == [1]
    assert rel_err(got, reference.fp8_linear(x, q, s)) <= RTOL


class FP8Experts:
    """16 fp8 experts of M3's widths plus the shared one as the last slot."""

    def __init__(self, hidden=6144, inter=3072, experts=16, top_k=4, seed=0):
        from nanoserve.model.mxfp8 import quantize_mxfp8

        self.h, self.inter, self.e, self.k = hidden, inter, experts, top_k
        self.gen = torch.Generator(device="cuda").manual_seed(seed)
        q13, s13, q2, s2 = [], [], [], []
        for _ in range(experts + 1):
            w13 = torch.empty(2 * inter, hidden, device="cuda", dtype=torch.bfloat16).normal_(0, 0.02,
                                                                                            generator=self.gen)
            w2 = torch.empty(hidden, inter, device="cuda", dtype=torch.bfloat16).normal_(0, 0.02, generator=self.gen)
            for (q, s), qs, ss in ((quantize_mxfp8(w13), q13, s13), (quantize_mxfp8(w2), q2, s2)):
                qs.append(q)
                ss.append(s)
        self.q13, self.s13, self.q2, self.s2 = (torch.stack(t) for t in (q13, s13, q2, s2))

    def inputs(self, tokens: int):
        from nanoserve.kernels import reference

        x = torch.empty(tokens, self.h, device="cuda").normal_(0, 1, generator=self.gen).bfloat16()
        logits = torch.empty(tokens, self.e, device="cuda").normal_(0, 1, generator=self.gen)
        weights, ids = reference.route(logits, torch.zeros(self.e, device="cuda"), self.k)
        return x, weights, ids

    def fused(self, x, weights, ids):
        from nanoserve.kernels.moe import fused_moe

        return fused_moe(x, self.q13, self.q2, weights, ids, alpha=ALPHA, limit=LIMIT, routed_scaling_factor=SCALE,
                         fold_shared=True, w13_scale=self.s13, w2_scale=self.s2)

    def reference(self, x, weights, ids):
        from nanoserve.kernels import reference

        e = self.e
        want = reference.moe_experts(x, self.q13[:e], self.q2[:e], ids, weights, ALPHA, LIMIT, None,
                                     self.s13[:e], self.s2[:e]).float() * SCALE
        up = reference.weight(self.q13[e], self.s13[e], x.dtype)
        down = reference.weight(self.q2[e], self.s2[e], x.dtype)
        gu = torch.nn.functional.linear(x, up)
        act = reference.swiglu_oai(gu[:, :self.inter], gu[:, self.inter:], ALPHA, LIMIT).to(x.dtype)
        return want + torch.nn.functional.linear(act, down).float()


@pytest.fixture(scope="module")
def experts() -> FP8Experts:
    return FP8Experts()


@pytest.mark.parametrize("tokens", [1, 37, 1024])
def test_fused_moe_with_fp8_experts_matches_the_reference(experts, tokens):
    x, weights, ids = experts.inputs(tokens)
    assert rel_err(experts.fused(x, weights, ids), experts.reference(x, weights, ids)) <= RTOL


def test_long_calls_dequantise_the_experts_in_groups_bit_for_bit(experts):
    """Switch moe_dequant_prefill at the engine's threshold (16,384 tokens): the MXFP8 experts dequantised a group
    of slots at a time (groups of about a quarter of the stacks here; whole stacks) equal the 16-bit kernels on the
    dequantised stacks bit for bit, without an operation that waits for the GPU (torch's sync debug mode), and the
    MXFP8 kernels within the bf16 tolerance."""
    from nanoserve.kernels import reference
    from nanoserve.kernels.moe import MOE_DEQUANT_MIN_TOKENS, fused_moe

    x, weights, ids = experts.inputs(MOE_DEQUANT_MIN_TOKENS)
    args = dict(alpha=ALPHA, limit=LIMIT, routed_scaling_factor=SCALE, fold_shared=True)
    sixteen = fused_moe(x, reference.weight(experts.q13, experts.s13, x.dtype),
                        reference.weight(experts.q2, experts.s2, x.dtype), weights, ids, **args)
    slot_bytes = 3 * experts.inter * experts.h * x.element_size()
    for group_bytes in (slot_bytes * (experts.e + 1) // 4, 1 << 40):
        got = fused_moe(x, experts.q13, experts.q2, weights, ids, w13_scale=experts.s13, w2_scale=experts.s2,
                        dequant_min_tokens=MOE_DEQUANT_MIN_TOKENS, dequant_group_bytes=group_bytes, **args)
        assert torch.equal(got, sixteen)
        # the engine launches a step while the GPU runs the previous one: nothing here may wait for the GPU
        torch.cuda.set_sync_debug_mode("error")
        try:
            fused_moe(x, experts.q13, experts.q2, weights, ids, w13_scale=experts.s13, w2_scale=experts.s2,
                      dequant_min_tokens=MOE_DEQUANT_MIN_TOKENS, dequant_group_bytes=group_bytes, **args)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert rel_err(experts.fused(x, weights, ids), sixteen) <= RTOL


@pytest.mark.parametrize("tokens", [256, 1024, 4096])
def test_gluon_moe_equals_the_16_bit_kernels_on_the_dequantised_stacks(experts, tokens, monkeypatch):
    """Switch moe_wgmma on Hopper: from MOE_WGMMA_MIN_TOKENS tokens the MXFP8 experts run the Gluon kernels
    (kernels/moe_wgmma.py), whose outputs equal the 16-bit kernels on the dequantised stacks bit for bit, without an
    operation that waits for the GPU."""
    from nanoserve.kernels import moe_wgmma, reference
    from nanoserve.kernels.moe import MOE_WGMMA_MIN_TOKENS, fused_moe

    x, weights, ids = experts.inputs(tokens)
    if not moe_wgmma.supported(x, experts.q13, experts.q2, experts.s13, experts.s2):
        pytest.skip("the Gluon MoE kernels are for CUDA sm_90 with Triton's Gluon")
    calls = []
    gluon_gemms = moe_wgmma.gemms
    monkeypatch.setattr(moe_wgmma, "gemms", lambda *a, **k: calls.append(1) or gluon_gemms(*a, **k))
    args = dict(alpha=ALPHA, limit=LIMIT, routed_scaling_factor=SCALE, fold_shared=True)
    sixteen = fused_moe(x, reference.weight(experts.q13, experts.s13, x.dtype),
                        reference.weight(experts.q2, experts.s2, x.dtype), weights, ids, **args)
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = fused_moe(x, experts.q13, experts.q2, weights, ids, w13_scale=experts.s13, w2_scale=experts.s2,
                        wgmma_min_tokens=MOE_WGMMA_MIN_TOKENS, **args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert calls == [1]
    assert torch.equal(got, sixteen)


def captured(step):
    """`step` run once on a side stream (its kernels compiled, its allocations made), then captured: the graph and
    the outputs its replays write."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    return graph, outs


def test_fp8_launches_replay_from_a_cuda_graph_bit_for_bit(experts):
    """A decode step's fp8 launches (the split-K / GEMV linear of one row, the fused MoE of four tokens)."""
    from nanoserve.kernels.fp8_linear import fp8_linear

    q, s = quantized(6144, 6144, experts.gen)
    x1 = torch.empty(1, 6144, device="cuda").normal_(0, 1, generator=experts.gen).bfloat16()
    x4, weights, ids = experts.inputs(4)

    def step():
        return fp8_linear(x1, q, s), experts.fused(x4, weights, ids)

    eager = step()
    graph, outs = captured(step)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(outs, eager))


@pytest.mark.parametrize("m", [64, 256])
def test_gluon_fp8_linear_replays_from_a_cuda_graph_bit_for_bit(m, monkeypatch):
    """A decode step's projection on the Gluon kernel, captured (64 rows; 256 rows, which eagerly would take the
    transient bf16 copy): a replay equals the eager call bit for bit, also after the input is overwritten."""
    from nanoserve.kernels.fp8_linear import FP8_WGMMA_MAX_ROWS, fp8_linear

    gen = torch.Generator(device="cuda").manual_seed(m)
    q, s = quantized(6144, 8192, gen)
    x = torch.empty(m, 8192, device="cuda").normal_(0, 1, generator=gen).bfloat16()
    calls = gluon_linear_or_skip(x, q, s, monkeypatch)

    def step():
        return fp8_linear(x, q, s, wgmma_max_rows=FP8_WGMMA_MAX_ROWS)

    graph, out = captured(step)
    assert calls  # the captured call took the Gluon kernel
    for _ in range(2):  # the second round with a new input written into the captured buffer
        calls.clear()
        eager = step() if m <= 128 else None
        graph.replay()
        torch.cuda.synchronize()
        if eager is not None:
            assert calls == [1] and torch.equal(out, eager)
        x.copy_(torch.empty_like(x).normal_(0, 1, generator=gen))
    from nanoserve.kernels import reference

    graph.replay()
    assert rel_err(out, reference.fp8_linear(x, q, s)) <= RTOL


def test_gluon_moe_replays_from_a_cuda_graph_bit_for_bit(experts):
    """Decode batches of 256 to 512 tokens are captured in CUDA graphs (runner/cuda_graphs.py BATCH_BUCKETS) and
    take the Gluon kernels from MOE_WGMMA_MIN_TOKENS on: a replay equals the eager call bit for bit, also after
    the inputs are overwritten in place."""
    from nanoserve.kernels import moe_wgmma
    from nanoserve.kernels.moe import MOE_WGMMA_MIN_TOKENS, fused_moe

    x, weights, ids = experts.inputs(MOE_WGMMA_MIN_TOKENS)
    if not moe_wgmma.supported(x, experts.q13, experts.q2, experts.s13, experts.s2):
        pytest.skip("the Gluon MoE kernels are for CUDA sm_90 with Triton's Gluon")

    def step():
        return fused_moe(x, experts.q13, experts.q2, weights, ids, alpha=ALPHA, limit=LIMIT,
                         routed_scaling_factor=SCALE, fold_shared=True, w13_scale=experts.s13, w2_scale=experts.s2,
                         wgmma_min_tokens=MOE_WGMMA_MIN_TOKENS)

    graph, out = captured(step)
    for _ in range(2):  # the second round with new inputs written into the captured buffers
        eager = step()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
        x2, w2_, ids2 = experts.inputs(MOE_WGMMA_MIN_TOKENS)
        x.copy_(x2), weights.copy_(w2_), ids.copy_(ids2)


def test_native_mxfp8_logprobs_match_the_dequantised_weights():
    """m3-slice, two 256-token prompts, every position over the whole vocabulary, bf16. The first prompt's forward
    is recorded module by module in both builds (`locate`): every projection is equal bit for bit (at prefill sizes
    both make the same F.linear call), so the first module that may differ is a fused MoE, whose fp8 and bf16 tile
    tables choose their tiles apart (measured on an H100: inputs equal, max |d| 0.0625 at the first MoE); from
    there a flipped routing choice moves later layers. Tolerance (bf16): top-1 agreement >= 95 % and mean |d
    logprob| <= 0.02 (the H100: 97.3 %, 0.011)."""
    from nanoserve.bench.accuracy import divergence_text, mxfp8_accuracy
    from nanoserve.config import Optimizations

    res = mxfp8_accuracy("m3-slice", Optimizations(), torch.bfloat16, torch.device("cuda"), prompt_len=256,
                         unquantised=False, locate=True)
    pair = res["pairs"]["native vs dequantised"]
    assert pair["positions"] == 512
    why = f"{pair}\n{divergence_text(res['divergence'])}\n{torch.cuda.get_device_name()}"
    first = res["divergence"]["first"]
    assert first is None or (first["kind"] == "M3MoE" and first["inputs_equal"]), why
    assert pair["top1_agreement"] >= 0.95 and pair["mean_abs_logprob_diff"] <= 0.02, why
