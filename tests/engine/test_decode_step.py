"""The decode-step switches fused_rmsnorm, rope_table and captured_argmax, each against its reference path, on
fresh random inputs on the CPU (kernels under Triton's interpreter; the decode graph with the emulated capture
that re-runs the recorded function at each replay). tests/engine/test_cuda_graphs.py runs the captured argmax under
real CUDA graphs on a GPU.

Tolerances: fused_rmsnorm fp32 (rtol, atol) = (1e-5, 1e-5), fp16 (1e-2, 1e-2) (a sum in another order moves
the last bit); rope_table and captured_argmax compute the same values by the same operations: exact.
"""

from __future__ import annotations

import random

import pytest
import torch

from nanoserve import SamplingParams
from nanoserve.config import Optimizations
from nanoserve.engine.sequence import Sequence
from nanoserve.kernels import reference
from nanoserve.kernels.norm_rope import fused_rmsnorm
from nanoserve.model.m3 import M3ForCausalLM
from nanoserve.presets.catalog import get_preset
from nanoserve.runner.sampler import Sampler, plain_greedy
from tests.engine.test_overlap import drive, make_llm
from tests.helpers.engine_utils import random_tokens

RMSNORM_TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-2, 1e-2)}  # (rtol, atol) beside the dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("rows,hidden", [(1, 128), (7, 96), (33, 256)])
def test_fused_rmsnorm_matches_reference(rows, hidden, dtype, device):
    gen = torch.Generator().manual_seed(rows * hidden)
    x = (3 * torch.randn(rows, hidden, generator=gen)).to(dtype).to(device)
    w = (0.3 * torch.randn(hidden, generator=gen)).to(device)  # fp32, as GemmaRMSNorm keeps it
    out = fused_rmsnorm(x, w, 1e-6)
    ref = reference.gemma_rmsnorm(x, w, 1e-6)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    rtol, atol = RMSNORM_TOLERANCE[dtype]
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)
    # a strided input (a column slice) gives the same rows
    wide = torch.cat([x, x], dim=-1)[:, :hidden]
    torch.testing.assert_close(fused_rmsnorm(wide, w, 1e-6), ref, rtol=rtol, atol=atol)


def test_rope_table_matches_reference():
    """Gathered rows of the table equal cos/sin computed from the positions, exactly; a longer context grows the
    table and the replaced one stays alive (a captured graph may still read it)."""
    cfg = get_preset("m3-tiny").config
    model = M3ForCausalLM(cfg, Optimizations(rope_table=True))
    gen = torch.Generator().manual_seed(3)
    for max_len in (17, 4096, 5000, 12000):
        positions = torch.randint(0, max_len, (29,), generator=gen)
        positions[0] = max_len - 1
        cos, sin = model.rope(positions, max_len)
        ref_cos, ref_sin = reference.rope_cos_sin(positions, model.inv_freq)
        assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
        assert model.rope_table.shape[0] >= max_len
    assert len(model._old_rope_tables) >= 1
    model.opts.rope_table = False
    cos, _ = model.rope(positions, 12000)
    assert torch.equal(cos, ref_cos)


def _seq(i: int, params: SamplingParams) -> Sequence:
    return Sequence(i, f"r{i}", 0, [1, 2, 3], params)


def test_sampler_uses_captured_argmax_only_for_plain_greedy_rows():
    """Plain greedy rows take the offered argmax (a copy: the graph's buffer is overwritten by the next replay);
    a batch with any row that processes its logits or asks for logprobs ignores it and samples as the reference."""
    gen = torch.Generator().manual_seed(5)
    sampler = Sampler(torch.device("cpu"), 0, eos_token_id=None)
    plain = [_seq(i, SamplingParams(temperature=0.0)) for i in range(4)]
    assert all(plain_greedy(s) for s in plain)
    for _ in range(5):
        logits = torch.randn(4, 1000, generator=gen)
        argmax = logits.argmax(-1)
        got = sampler.sample(logits, plain, argmax=argmax)
        assert torch.equal(got.token_ids, sampler.sample(logits, plain).token_ids)
        argmax.fill_(-1)  # the next replay overwrites the buffer: the draw must not change
        assert got.token_ids.tolist() == logits.argmax(-1).tolist()
    others = [SamplingParams(temperature=0.0, logit_bias={7: 100.0}), SamplingParams(temperature=0.0, logprobs=1),
              SamplingParams(temperature=0.0, min_tokens=2), SamplingParams(temperature=0.0, presence_penalty=1.0),
              SamplingParams(temperature=0.0, allowed_token_ids=[3, 4]), SamplingParams(temperature=0.7)]
    for params in others:
        seqs = plain[:3] + [_seq(9, params)]
        assert not plain_greedy(seqs[-1])
        logits = torch.randn(4, 1000, generator=gen)
        wrong = torch.zeros(4, dtype=torch.long)  # a buffer that is not the answer: it must not be used
        sampler.generator.manual_seed(11)
        got = sampler.sample(logits, seqs, argmax=wrong).token_ids
        sampler.generator.manual_seed(11)
        assert torch.equal(got, sampler.sample(logits, seqs).token_ids), params


def test_captured_argmax_same_tokens_emulated_graphs():
    """Greedy decoding through the (emulated) decode graphs: the captured argmax gives exactly the tokens of the
    sampler's own argmax, and a batch mixing in a sampled row still matches."""
    rng = random.Random(7)
    requests = [(f"a{i}", random_tokens(rng, n), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
                for i, n in enumerate([9, 21, 5])]
    requests.append(("mixed", random_tokens(rng, 13), SamplingParams(temperature=1.0, seed=3, max_tokens=8,
                                                                     ignore_eos=True)))
    runs = {}
    for on in (True, False):
        for batch in (requests[:3], requests):
            llm = make_llm("async", cuda_graphs=True, max_num_seqs=4, num_gpu_blocks_override=32)
            llm.engine.config.optimizations.captured_argmax = on
            runner = llm.engine.executor.runner
            runner.graph_capture = lambda fn: fn
            seen = []
            run = runner.execute

            def spy(inp, feed=None, *args, run=run, runner=runner, seen=seen, **kwargs):
                out = run(inp, feed, *args, **kwargs)
                seen.append(runner.last_argmax is not None)
                return out

            runner.execute = spy
            streams, _ = drive(llm.engine, batch)
            assert runner.graphs is not None and runner.graphs.graphs, "no decode step replayed a graph"
            assert any(seen) == on
            runs[on, len(batch)] = streams
            llm.engine.shutdown()
    assert runs[True, 3] == runs[False, 3]
    assert runs[True, 4] == runs[False, 4]


SWIGLU_TOLERANCE = {torch.float32: (1e-6, 1e-6), torch.float16: (1e-3, 1e-3)}  # (rtol, atol) beside the dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("rows,inter", [(1, 64), (5, 1500), (17, 96)])
def test_fused_swiglu_matches_reference(rows, inter, dtype, device):
    """kernels/swiglu.py against reference.swiglu_oai + the cast, on gate / up values beyond the clamp (+-7) both
    ways, and on a strided gate|up (a slice of a wider tensor); a tensor that is not [T, 2I] is refused."""
    from nanoserve.kernels.swiglu import swiglu_oai

    gen = torch.Generator().manual_seed(rows * inter)
    gate_up = (6 * torch.randn(rows, 2 * inter, generator=gen)).to(dtype).to(device)
    ref = reference.swiglu_oai(gate_up[:, :inter], gate_up[:, inter:], 1.702, 7.0).to(dtype)
    rtol, atol = SWIGLU_TOLERANCE[dtype]
    got = swiglu_oai(gate_up, 1.702, 7.0)
    assert got.dtype == dtype and got.shape == (rows, inter)
    torch.testing.assert_close(got, ref, rtol=rtol, atol=atol)
    wide = torch.cat([gate_up, gate_up], dim=-1)[:, : 2 * inter]
    torch.testing.assert_close(swiglu_oai(wide, 1.702, 7.0), ref, rtol=rtol, atol=atol)
    with pytest.raises(ValueError, match="gate_up must be"):
        swiglu_oai(gate_up[:, :-1], 1.702, 7.0)


def test_fused_swiglu_switch_in_the_dense_mlp(device):
    """The dense MLP with the switch on and off: the same output (fp32 1e-5)."""
    from nanoserve.model.layers.mlp import SwiGLUOAIMLP

    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1)).to(device)
    outs = []
    for on in (True, False):
        mlp = SwiGLUOAIMLP(64, 96, 1.702, 7.0, torch.float32, device, opts=Optimizations(fused_swiglu=on))
        gen = torch.Generator().manual_seed(2)
        for p in mlp.parameters():
            p.data.copy_(0.3 * torch.randn(p.shape, generator=gen))
        outs.append(mlp(x))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
