"""`mxfp8_accuracy(..., locate=True)` (nanoserve/bench/accuracy.py): the native and dequantised forwards recorded
module by module, and the first module whose output differs named - what tests/model/test_gpu_mxfp8.py reports when
the two paths are not equal bit for bit. On the CPU with the reference kernels the paths are equal; a change made
to one quantized projection of the native path is found at that module, with its inputs still equal."""

from __future__ import annotations

import pytest
import torch

from nanoserve.bench import accuracy
from nanoserve.kernels import reference
from tests.helpers.tp_helpers import CPU_REFERENCE


def run(**kw) -> dict:
    return accuracy.mxfp8_accuracy("m3-tiny", CPU_REFERENCE, torch.float32, torch.device("cpu"), prompt_len=12,
                                   num_prompts=1, unquantised=False, locate=True, **kw)


def test_equal_paths_record_equal_modules():
    res = run()
    div = res["divergence"]
    assert res["pairs"]["native vs dequantised"]["max_abs_logprob_diff"] == 0.0
    assert div["first"] is None and div["differing"] == [] and "note" not in div
    assert div["records"] > 20  # every layer's modules, the routing and block choices, the LM head
    assert f"all {div['records']} records equal" in res["table"]


def test_a_change_in_one_native_projection_is_located_there(monkeypatch):
    plain = reference.fp8_linear
    shapes = []

    def changed(x, w, s):
        out = plain(x, w, s)
        shapes.append(tuple(w.shape))
        if len(shapes) == 2:  # the native build's second quantized projection: layer 0's o_proj
            out = out.clone()
            out.view(-1)[5] += 0.5
        return out

    monkeypatch.setattr(reference, "fp8_linear", changed)
    res = run()
    first = res["divergence"]["first"]
    assert first["module"] == "layers.0.self_attn.o_proj" and first["kind"] == "RowParallelLinear"
    assert first["inputs_equal"] and first["differing_elements"] == 1
    assert first["max_abs_output_diff"] == pytest.approx(0.5, rel=1e-5)
    assert first["previous_equal"] == "layers.0.self_attn.qkv_proj"
    differing = res["divergence"]["differing"]
    assert differing[0] == first["module"] and "layers.0.self_attn" in differing and "lm_head" in differing
    assert "first difference: layers.0.self_attn.o_proj (RowParallelLinear), its inputs equal" in res["table"]


def test_changed_inputs_point_before_the_call():
    """A record whose inputs already differ says so and names the last equal record before it."""
    a = [accuracy.Record("x", "Linear", [torch.zeros(2)], [torch.zeros(2)]),
         accuracy.Record("y", "Linear", [torch.zeros(2)], [torch.ones(2)])]
    b = [accuracy.Record("x", "Linear", [torch.zeros(2)], [torch.zeros(2)]),
         accuracy.Record("y", "Linear", [torch.ones(2)], [torch.zeros(2)])]
    first = accuracy.first_divergence(a, b)["first"]
    assert first["module"] == "y" and not first["inputs_equal"] and first["previous_equal"] == "x"
    assert "its inputs already differ: the change is between x and this call" in accuracy.divergence_text(
        accuracy.first_divergence(a, b))
