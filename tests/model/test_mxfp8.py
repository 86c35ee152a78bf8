"""MXFP8 weights served natively (the `mxfp8_weights` switch) against the dequantise-at-load reference path.

On an MXFP8 checkpoint written by the project's checkpoint writer (transformers' layout: fp8 e4m3 `X.weight` +
uint8 E8M0 `X.weight_scale_inv`), the model keeps every quantized projection in fp8 with its scales; the reference
path holds the same weights dequantised. In fp32 on the CPU (kernels' reference paths: dequantise, then the op) the
two compute on identical weight values, so logits are equal exactly and greedy tokens identical. `quantization=
"mxfp8"` on a bf16 checkpoint or a preset drawn on the device quantises the same draw at load, giving the same
model as the MXFP8 checkpoint. The Triton kernels themselves are compared with their references in
tests/kernels/test_kernel_fp8.py.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.config import EngineConfig
from nanoserve.model.loader import CheckpointError, load_model
from nanoserve.model.m3 import M3ForCausalLM
from nanoserve.model.memory_plan import weight_bytes_per_gpu
from nanoserve.model.mxfp8 import is_quantized_matrix
from nanoserve.parallel_state import set_tp
from nanoserve.presets.catalog import get_preset
from nanoserve.presets.make_checkpoint import write_checkpoint
from nanoserve.presets.resolve import init_random_weights
from tests.helpers.tp_helpers import CPU_REFERENCE
from tests.model.test_hf_parity import full_forward, random_ids

PROMPT = random_ids(70, seed=11)  # longer than top_k x block (48): MSA drops blocks
NATIVE = CPU_REFERENCE.replace(mxfp8_weights=True, triton_fp8_linear=False)
DEQUANTISED = CPU_REFERENCE.replace(mxfp8_weights=False, triton_fp8_linear=False)
ENGINE_ARGS = dict(device="cpu", dtype="float32", max_model_len=512, num_gpu_blocks_override=48)


@pytest.fixture(scope="module")
def mxfp8_dir(tmp_path_factory) -> str:
    p = get_preset("m3-tiny")
    path = str(tmp_path_factory.mktemp("m3-tiny-mxfp8"))
    write_checkpoint(path, p.config, p, mxfp8=True)
    return path


def quantized_params(model: M3ForCausalLM) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if p.dtype == torch.float8_e4m3fn}


def test_native_model_keeps_fp8_weights_and_scales(mxfp8_dir):
    model, _ = load_model(mxfp8_dir, NATIVE, torch.bfloat16)
    assert model.weight_format == "mxfp8"
    params = dict(model.named_parameters())
    fp8 = quantized_params(model)
    # attention (q|k|v|index_q|index_k and o), dense MLP, routed experts with the folded shared expert
    assert {n.rsplit(".", 1)[0] for n in fp8} >= {"layers.0.self_attn.qkv_proj", "layers.0.self_attn.o_proj",
                                                   "layers.0.mlp.gate_up_proj", "layers.0.mlp.down_proj",
                                                   "layers.1.self_attn.qkv_proj", "layers.1.mlp"}
    for name, w in fp8.items():
        scale = params[name.replace("weight", "weight_scale") if name.endswith("weight") else name + "_scale"]
        assert scale.dtype == torch.uint8 and scale.shape == (*w.shape[:-1], w.shape[-1] // 32)
    for name in ("embed_tokens.weight", "lm_head.weight", "layers.1.mlp.gate"):
        assert params[name].dtype in (torch.bfloat16, torch.float32), name
    # the bytes the memory plan counts for the quantized matrices are the bytes the model holds
    plan = weight_bytes_per_gpu(model.cfg, 1, "mxfp8")
    held = sum(p.numel() * p.element_size() for p in model.parameters() if p.dtype in (torch.float8_e4m3fn,
                                                                                      torch.uint8))
    assert held == plan.quantized + plan.scales
    reference, _ = load_model(mxfp8_dir, DEQUANTISED, torch.bfloat16)
    assert reference.weight_format is None and not quantized_params(reference)


def test_native_logits_equal_the_dequantised_path(mxfp8_dir):
    native, _ = load_model(mxfp8_dir, NATIVE, torch.float32)
    reference, _ = load_model(mxfp8_dir, DEQUANTISED, torch.float32)
    got, want = full_forward(native, PROMPT), full_forward(reference, PROMPT)
    assert torch.equal(got, want)


def test_native_greedy_tokens_equal_the_dequantised_path(mxfp8_dir):
    prompts = [random_ids(n, seed=n) for n in (70, 21, 5)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for label, opts in (("native", NATIVE), ("dequantised", DEQUANTISED)):
        llm = LLM(mxfp8_dir, optimizations=opts, **ENGINE_ARGS)
        try:
            assert llm.engine.executor.runner.model.weight_format == ("mxfp8" if label == "native" else None)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            tokens[label] = [o.outputs[0].token_ids for o in outs]
        finally:
            llm.engine.shutdown()
    assert tokens["native"] == tokens["dequantised"]


@pytest.mark.parametrize("opts", [NATIVE, DEQUANTISED], ids=["native", "dequantised"])
def test_quantization_flag_quantises_bf16_weights_at_load(tiny_dir, mxfp8_dir, opts):
    """quantization="mxfp8" on the bf16 checkpoint, and on the same draw made in memory (how m3-slice is built on
    the GPU), gives the model the MXFP8 checkpoint of that draw gives."""
    want = full_forward(load_model(mxfp8_dir, opts, torch.float32)[0], PROMPT)
    online, _ = load_model(tiny_dir, opts, torch.float32, quantization="mxfp8")
    assert torch.equal(full_forward(online, PROMPT), want)
    drawn = M3ForCausalLM(get_preset("m3-tiny").config, opts, torch.float32, "cpu", quantization="mxfp8")
    init_random_weights(drawn, "m3-tiny", "cpu")
    assert torch.equal(full_forward(drawn, PROMPT), want)


def test_quantization_argument_is_checked(tiny_dir, mxfp8_dir, tmp_path):
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(model=tiny_dir, quantization="fp8")
    with pytest.raises(ValueError, match="quantization"):
        load_model(tiny_dir, NATIVE, quantization="awq")
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in os.listdir(mxfp8_dir):
        os.symlink(os.path.join(mxfp8_dir, f), bad / f)
    os.remove(bad / "config.json")
    with open(os.path.join(mxfp8_dir, "config.json")) as f:
        raw = json.load(f)
    raw["quantization_config"]["quant_method"] = "fp8"
    (bad / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="quant_method='fp8'"):
        load_model(str(bad), NATIVE)


def test_shards_that_split_a_scale_block_are_refused(mxfp8_dir):
    """m3-tiny's experts have 64 intermediate columns: 4 ranks would hold 16, half a 32-column scale block."""
    set_tp(0, 4)
    try:
        with pytest.raises(ValueError, match="mxfp8_weights"):
            M3ForCausalLM(get_preset("m3-tiny").config, NATIVE, quantization="mxfp8")
        M3ForCausalLM(get_preset("m3-tiny").config, DEQUANTISED, quantization="mxfp8")  # the reference path can
    finally:
        set_tp(0, 1)


def test_unquantized_names_follow_the_checkpoint(mxfp8_dir):
    """The names the on-load quantiser treats as quantized are exactly those the writer stored in fp8."""
    from safetensors import safe_open

    with safe_open(os.path.join(mxfp8_dir, "model.safetensors"), framework="pt") as h:
        for key in h.keys():
            if key.endswith("_scale_inv"):
                continue
            t = h.get_slice(key)
            stored_fp8 = t.get_dtype().startswith("F8")
            assert is_quantized_matrix(key, tuple(t.get_shape())) == stored_fp8, key


# -- quantization= on LLM and --quantization on the server ----------------------------------------------------------


def greedy(llm: LLM, prompts: list[list[int]], n: int = 8) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)]


def served_model(llm: LLM) -> M3ForCausalLM:
    return llm.engine.executor.runner.model


def test_llm_quantization_argument(tiny_dir, mxfp8_dir):
    """None reads the format from config.json; "mxfp8" quantizes the bf16 checkpoint at load (the model the MXFP8
    checkpoint of the same draw gives); "bf16" dequantizes the MXFP8 checkpoint at load (the mxfp8_weights-off
    model). In fp32 on the CPU all of them compute on the same weight values: the same greedy tokens."""
    prompts = [random_ids(n, seed=n) for n in (70, 13)]
    runs = {}
    for label, model, quant in (("auto", mxfp8_dir, None), ("quantized", tiny_dir, "mxfp8"),
                                ("dequantized", mxfp8_dir, "bf16"), ("bf16 as is", tiny_dir, "bf16")):
        with LLM(model, quantization=quant, optimizations=NATIVE, **ENGINE_ARGS) as llm:
            m = served_model(llm)
            runs[label] = (m.weight_format, {n: p.clone() for n, p in m.named_parameters()}, greedy(llm, prompts))
    assert runs["auto"][0] == runs["quantized"][0] == "mxfp8"
    assert runs["dequantized"][0] is None and runs["bf16 as is"][0] is None
    assert not any(p.dtype == torch.float8_e4m3fn for p in runs["dequantized"][1].values())
    dequantised, _ = load_model(mxfp8_dir, DEQUANTISED, torch.float32)  # the switch-off path
    for name, p in dequantised.named_parameters():
        assert torch.equal(runs["dequantized"][1][name], p), name
    assert runs["auto"][2] == runs["quantized"][2] == runs["dequantized"][2]
    with pytest.raises(ValueError, match="quantization='fp8' is invalid"):
        LLM(tiny_dir, quantization="fp8", **ENGINE_ARGS)


def test_server_quantization_flag(tiny_dir, tmp_path):
    """A real server process with `--quantization mxfp8` on the bf16 m3-tiny checkpoint: it logs the format it
    serves, its greedy tokens equal LLM(quantization="mxfp8")'s, its KV-cache info metric is the usual one; an
    unknown format is refused naming the flag."""
    import subprocess
    import sys

    import httpx
    import openai

    from tests.helpers.server_utils import FAST_CPU, KV_CACHE_TOKENS, MAX_MODEL_LEN, ServerProcess, metric

    prompts = [random_ids(n, seed=n) for n in (70, 13)]
    with LLM(tiny_dir, quantization="mxfp8", optimizations=FAST_CPU, device="cpu", max_model_len=MAX_MODEL_LEN,
             kv_cache_tokens=KV_CACHE_TOKENS) as llm:
        assert served_model(llm).weight_format == "mxfp8"
        offline = greedy(llm, prompts)
        blocks = llm.engine.block_manager.num_blocks
    with ServerProcess(tiny_dir, tmp_path / "server.log", "--quantization", "mxfp8") as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=60)
        online = []
        for p in prompts:
            out = client.completions.create(model="tiny", prompt=p, max_tokens=8, temperature=0.0,
                                            extra_body={"ignore_eos": True, "return_token_ids": True})
            online.append(out.choices[0].token_ids)
        text = httpx.get(f"{srv.url}/metrics", timeout=10).text
        log = srv.log()
    assert online == offline
    assert "quantization=mxfp8" in log and "weights: mxfp8 (fp8 e4m3" in log
    assert metric(text, "vllm:cache_config_info", num_gpu_blocks=str(blocks), block_size="16") == 1.0
    bad = subprocess.run([sys.executable, "-m", "nanoserve.server", "--model", tiny_dir, "--quantization", "fp8"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "argument --quantization/-q: invalid choice: 'fp8'" in bad.stderr


def test_accuracy_report_on_a_preset_and_an_mxfp8_checkpoint(mxfp8_dir, tmp_path):
    """`python -m nanoserve.bench --mxfp8-accuracy`: with the reference kernels the native and dequantised paths
    compute the same logprobs exactly; quantising changes them (the bf16 preset gets the unquantised comparison,
    an MXFP8 checkpoint has no unquantised weights to compare with); the report lands in results.json."""
    import json

    from nanoserve.bench.__main__ import main
    from nanoserve.bench.accuracy import mxfp8_accuracy

    rc = main(["--mxfp8-accuracy", "--model", "m3-tiny", "--device", "cpu", "--prompt-len", "40",
               "--out", str(tmp_path)])
    assert rc == 0
    res = json.loads((tmp_path / "results.json").read_text())["mxfp8_accuracy"]
    same, quantised = res["pairs"]["native vs dequantised"], res["pairs"]["dequantised vs unquantised"]
    assert same["positions"] == 80 and same["max_abs_logprob_diff"] == 0.0 and same["top1_agreement"] == 1.0
    assert quantised["max_abs_logprob_diff"] > 1e-3
    assert res["builds"]["native"]["weight_format"] == "mxfp8"
    assert "native vs dequantised" in (tmp_path / "mxfp8_accuracy.txt").read_text()

    stored = mxfp8_accuracy(mxfp8_dir, CPU_REFERENCE, torch.float32, torch.device("cpu"), prompt_len=8,
                            num_prompts=1)
    assert list(stored["builds"]) == ["native", "dequantised"]
    assert stored["pairs"]["native vs dequantised"]["max_abs_logprob_diff"] == 0.0
    with pytest.raises(ValueError, match="prompt_len=0"):
        mxfp8_accuracy("m3-tiny", CPU_REFERENCE, torch.float32, torch.device("cpu"), prompt_len=0)


def test_moe_dequant_prefill_switch_runs_the_16_bit_kernels_on_long_batches(mxfp8_dir, monkeypatch):
    """Switch moe_dequant_prefill: a prefill of at least MOE_DEQUANT_MIN_TOKENS tokens (lowered here to the prompt's
    length) dequantises each MoE layer's MXFP8 experts and runs the fused MoE's 16-bit kernels; the logits equal the
    reference path's (the MoE as a loop over experts on the MXFP8 weights) within fp32 1e-5 of the largest."""
    from nanoserve.kernels import moe as moe_kernels

    calls = []
    real = moe_kernels.dequantize

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(moe_kernels, "MOE_DEQUANT_MIN_TOKENS", len(PROMPT))
    monkeypatch.setattr(moe_kernels, "dequantize", counting)
    reference, _ = load_model(mxfp8_dir, NATIVE, torch.float32)
    on, _ = load_model(mxfp8_dir, NATIVE.replace(fused_moe=True, moe_dequant_prefill=True), torch.float32)
    want = full_forward(reference, PROMPT)
    assert not calls
    got = full_forward(on, PROMPT)
    moe_layers = sum(t == "sparse" for t in on.cfg.mlp_layer_types)
    assert len(calls) == 2 * moe_layers  # both stacks of every MoE layer
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
