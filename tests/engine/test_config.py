"""EngineConfig / Optimizations validation and switch aliases; M3Config parsing of the real M3 config.json and
its validation errors."""

from __future__ import annotations

import copy

import pytest

from nanoserve.config import SWITCH_ALIASES, EngineConfig, Optimizations
from nanoserve.model.m3_config import DENSE, SPARSE, M3Config
from nanoserve.presets.catalog import PRESETS, get_preset

# The text_config of MiniMaxAI/MiniMax-M3 (BF16), every field, values as released.
REAL_TEXT_CONFIG = {
    "architectures": ["MiniMaxM3SparseForCausalLM"],
    "hidden_size": 6144,
    "intermediate_size": 3072,
    "num_hidden_layers": 60,
    "num_attention_heads": 64,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 200064,
    "max_position_embeddings": 1048576,
    "rms_norm_eps": 1e-06,
    "use_gemma_norm": True,
    "attention_output_gate": False,
    "rope_theta": 5000000,
    "rotary_dim": 64,
    "partial_rotary_factor": 0.5,
    "hidden_act": "swigluoai",
    "use_qk_norm": True,
    "tie_word_embeddings": False,
    "dense_intermediate_size": 12288,
    "shared_intermediate_size": 3072,
    "num_local_experts": 128,
    "num_experts_per_tok": 4,
    "n_shared_experts": 1,
    "scoring_func": "sigmoid",
    "use_routing_bias": True,
    "moe_layer_freq": [0, 0, 0] + [1] * 57,
    "qk_norm_type": "per_head",
    "num_mtp_modules": 7,
    "num_nextn_predict_layers": 1,
    "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0,
    "routed_scaling_factor": 2.0,
    "sparse_attention_config": {
        "use_sparse_attention": True,
        "sparse_index_dim": 128,
        "sparse_num_index_heads": 4,
        "sparse_topk_blocks": 16,
        "sparse_block_size": 128,
        "sparse_disable_index_value": [0, 0, 0] + [1] * 57,
        "sparse_score_type": "max",
        "sparse_init_block": 0,
        "sparse_local_block": 1,
        "sparse_attention_freq": [0, 0, 0] + [1] * 57,
    },
}
REAL_CONFIG = {
    "architectures": ["MiniMaxM3SparseForConditionalGeneration"],
    "model_type": "minimax_m3_vl",
    "text_config": REAL_TEXT_CONFIG,
    "image_token_index": 200025,
    "video_token_index": 200026,
    "torch_dtype": "bfloat16",
}


# -- M3Config -----------------------------------------------------------------------------------------------------


def test_real_m3_config_parses():
    cfg = M3Config.from_dict(copy.deepcopy(REAL_CONFIG))
    assert cfg.num_hidden_layers == 60
    assert cfg.attn_layer_types == [DENSE] * 3 + [SPARSE] * 57
    assert cfg.mlp_layer_types == [DENSE] * 3 + [SPARSE] * 57
    assert [cfg.is_sparse_attention(i) for i in (0, 2, 3, 59)] == [False, False, True, True]
    assert [cfg.is_moe(i) for i in (0, 2, 3, 59)] == [False, False, True, True]
    assert cfg.num_sparse_attn_layers == 57
    assert cfg.rotary_dim == 64 and cfg.rope_theta == 5e6 and cfg.head_dim == 128
    assert cfg.index_block_size == 128 and cfg.index_topk_blocks == 16 and cfg.index_local_blocks == 1
    assert cfg.index_n_heads == 4 and cfg.index_head_dim == 128 and cfg.index_init_blocks == 0
    assert (cfg.q_size, cfg.kv_size) == (8192, 512)
    assert (cfg.num_local_experts, cfg.num_experts_per_tok, cfg.routed_scaling_factor) == (128, 4, 2.0)
    assert (cfg.intermediate_size, cfg.dense_intermediate_size, cfg.shared_intermediate_size) == (3072, 12288, 3072)
    assert (cfg.swiglu_alpha, cfg.swiglu_limit) == (1.702, 7.0)
    assert cfg.max_position_embeddings == 1048576 and cfg.vocab_size == 200064
    # absent from the file: the M3 defaults
    assert (cfg.bos_token_id, cfg.eos_token_id) == (200034, 200020)
    assert cfg == M3Config()  # the dataclass defaults are the real model


def test_real_config_as_a_bare_text_config_and_in_the_transformers_dialect():
    released = M3Config.from_dict(copy.deepcopy(REAL_CONFIG))
    assert M3Config.from_dict(dict(REAL_TEXT_CONFIG, model_type="minimax_m3_vl_text")) == released
    assert M3Config.from_dict(copy.deepcopy(REAL_TEXT_CONFIG)) == released  # no model_type at all
    hf_text = {k: v for k, v in REAL_TEXT_CONFIG.items()
               if k not in ("sparse_attention_config", "moe_layer_freq", "rope_theta", "partial_rotary_factor")}
    hf_text.update(
        model_type="minimax_m3_vl_text",
        layer_types=["full_attention"] * 3 + ["minimax_m3_sparse"] * 57,
        mlp_layer_types=["dense"] * 3 + ["sparse"] * 57,
        index_n_heads=4, index_head_dim=128, index_block_size=128, index_topk_blocks=16, index_local_blocks=1,
        rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "partial_rotary_factor": 0.5},
    )
    assert M3Config.from_dict({"model_type": "minimax_m3_vl", "text_config": hf_text}) == released


def test_transformers_dialect_trusts_partial_rotary_factor_over_rotary_dim():
    """transformers ignores rotary_dim (and writes its class default, 64, whatever head_dim is): the rotated
    width is head_dim x partial_rotary_factor."""
    text = {"head_dim": 32, "rotary_dim": 64, "index_head_dim": 32, "num_hidden_layers": 1,
            "layer_types": ["full_attention"], "mlp_layer_types": ["dense"],
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}
    cfg = M3Config.from_dict({"model_type": "minimax_m3_vl_text", **text})
    assert cfg.rotary_dim == 16 and cfg.rope_theta == 1e4
    no_factor = dict(text, rope_parameters={"rope_type": "default", "rope_theta": 1e4}, rotary_dim=8)
    assert M3Config.from_dict(no_factor).rotary_dim == 8


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_to_hf_dict_round_trips(preset):
    cfg = get_preset(preset).config
    assert M3Config.from_dict(cfg.to_hf_dict()) == cfg
    assert M3Config.from_dict(M3Config().to_hf_dict()) == M3Config()


def _text(**changes):
    raw = copy.deepcopy(REAL_CONFIG)
    raw["text_config"].update(changes)
    return raw


def _sparse(**changes):
    raw = copy.deepcopy(REAL_CONFIG)
    raw["text_config"]["sparse_attention_config"].update(changes)
    return raw


M3_CONFIG_ERRORS = {
    "unknown model_type": ({"model_type": "llama", "text_config": {}}, ["unknown model_type 'llama'"]),
    "not an object": ([1, 2], ["expected a JSON object"]),
    "text_config not an object": ({"model_type": "minimax_m3_vl", "text_config": [1]}, ["'text_config'"]),
    "layer count mismatch": (_text(num_hidden_layers=59), ["attn_layer_types", "60 entries", "59"]),
    "heads not a multiple of KV heads": (_text(num_key_value_heads=3, sparse_attention_config={}),
                                         ["num_attention_heads", "num_key_value_heads=3"]),
    "odd rotary dim": (_text(partial_rotary_factor=None, rotary_dim=63), ["rotary_dim", "63"]),
    "rotary dim above head dim": (_text(partial_rotary_factor=1.5), ["rotary_dim", "192"]),
    "index heads != KV heads": (_sparse(sparse_num_index_heads=8), ["index_n_heads", "num_key_value_heads=4"]),
    "sink blocks": (_sparse(sparse_init_block=1), ["index_init_blocks", "got 1"]),
    "top-k below local blocks": (_sparse(sparse_topk_blocks=1, sparse_local_block=2), ["index_topk_blocks"]),
    "score type": (_sparse(sparse_score_type="mean"), ["sparse_score_type", "'mean'"]),
    "index value branch": (_sparse(sparse_disable_index_value=[0] * 60), ["sparse_disable_index_value"]),
    "rope scaling": (_text(rope_scaling={"type": "yarn", "factor": 4.0}), ["rope scaling"]),
    "top-k experts above expert count": (_text(num_experts_per_tok=129), ["num_experts_per_tok", "129"]),
    "unknown layer type": ({"model_type": "minimax_m3_vl_text", "num_hidden_layers": 2,
                            "layer_types": ["full_attention", "sliding_attention"], "mlp_layer_types": ["dense"] * 2},
                           ["layer_types", "'sliding_attention'"]),
    "unknown MLP type": ({"model_type": "minimax_m3_vl_text", "num_hidden_layers": 1,
                          "layer_types": ["full_attention"], "mlp_layer_types": ["moe"]}, ["mlp_layer_types", "'moe'"]),
}


@pytest.mark.parametrize("case", list(M3_CONFIG_ERRORS))
def test_m3_config_errors_name_the_field(case):
    raw, fragments = M3_CONFIG_ERRORS[case]
    with pytest.raises(ValueError) as info:
        M3Config.from_dict(raw)
    for fragment in fragments:
        assert fragment in str(info.value), (case, str(info.value))


def test_released_config_without_index_value_list_is_accepted():
    raw = copy.deepcopy(REAL_CONFIG)
    del raw["text_config"]["sparse_attention_config"]["sparse_disable_index_value"]
    assert M3Config.from_dict(raw) == M3Config()


# -- Optimizations ------------------------------------------------------------------------------------------------


def test_reference_turns_every_switch_off():
    ref = Optimizations.reference()
    assert ref.as_dict() and not any(ref.as_dict().values())
    assert "on: -" in ref.describe()


MEASURED_SLOWER = {"spec_multi_step"}
"""Exact switches off by default because a GPU run measured them slower than their reference (each says so in its
declaration; docs/speculative_decoding.md has the numbers)."""


def test_defaults_on_except_approximations():
    opts = Optimizations()
    expected = {"paged_kv", "prefix_caching", "continuous_batching", "chunked_prefill", "cuda_graphs",
                "triton_attention", "triton_msa", "fused_moe", "fold_shared_expert", "fused_qk_norm_rope",
                "overlap_scheduling", "msa_topk_reuse"}
    assert expected <= set(Optimizations.names())  # the names the docs promise
    for name, value in opts.as_dict().items():  # every exact switch is on, but those measured slower
        assert value is (name not in Optimizations.approximations() and name not in MEASURED_SLOWER), name
    assert Optimizations.approximations() == ["msa_topk_reuse", "mx_activations"]
    assert opts.msa_topk_reuse is False and opts.mx_activations is False
    assert all("measured slower" in next(sw.does for sw in Optimizations.switches() if sw.name == name)
               for name in MEASURED_SLOWER)


def test_every_switch_declares_its_module_layer_and_reference():
    from nanoserve.config import LAYERS

    for sw in Optimizations.switches():
        assert sw.module.endswith(".py") and sw.layer in LAYERS and sw.reference, sw.name
        assert sw.doc.startswith(sw.module) and ("APPROXIMATION" in sw.doc) is (not sw.exact), sw.name


def test_optimizations_validation_names_the_switch():
    with pytest.raises(ValueError, match=r"unknown optimization switch 'fused_mo'.*fused_moe"):
        Optimizations().replace(fused_mo=False)
    with pytest.raises(ValueError, match=r"paged_kv='yes' is invalid: must be True or False"):
        Optimizations(paged_kv="yes")
    with pytest.raises(ValueError, match=r"cuda_graphs=1 is invalid"):
        Optimizations().replace(cuda_graphs=1)
    assert Optimizations().replace(fused_moe=False).fused_moe is False


# -- EngineConfig -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("alias, value, switch, expected", [
    ("enable_prefix_caching", False, "prefix_caching", False),
    ("enable_prefix_caching", True, "prefix_caching", True),
    ("enforce_eager", True, "cuda_graphs", False),
    ("enforce_eager", False, "cuda_graphs", True),
    ("enable_chunked_prefill", False, "chunked_prefill", False),
])
def test_switch_aliases(alias, value, switch, expected):
    cfg = EngineConfig.from_kwargs(**{alias: value})
    assert getattr(cfg.optimizations, switch) is expected
    others = {k: v for k, v in cfg.optimizations.as_dict().items() if k != switch}
    assert others == {k: v for k, v in Optimizations().as_dict().items() if k != switch}
    assert SWITCH_ALIASES[alias][0] == switch


def test_aliases_apply_on_top_of_given_optimizations():
    cfg = EngineConfig.from_kwargs(optimizations=Optimizations.reference(), enable_prefix_caching=True,
                                   enforce_eager=None, max_num_seqs=4)
    assert cfg.optimizations.prefix_caching is True and cfg.max_num_seqs == 4
    assert sum(cfg.optimizations.as_dict().values()) == 1


@pytest.mark.parametrize("kwargs, fragments", [
    ({"dtype": "fp8"}, ["dtype='fp8'", "float32", "bfloat16"]),
    ({"device": "tpu"}, ["device='tpu'", "cpu", "cuda"]),
    ({"model": ""}, ["model=''"]),
    ({"max_model_len": 0}, ["max_model_len=0", ">= 1"]),
    ({"max_model_len": "4096"}, ["max_model_len='4096'", "integer"]),
    ({"block_size": -16}, ["block_size=-16", ">= 1"]),
    ({"max_num_seqs": 0}, ["max_num_seqs=0", ">= 1"]),
    ({"max_num_seqs": True}, ["max_num_seqs=True", "integer"]),
    ({"max_num_batched_tokens": 0}, ["max_num_batched_tokens=0", ">= 1"]),
    ({"gpu_memory_utilization": 1.5}, ["gpu_memory_utilization=1.5", "(0, 1]"]),
    ({"gpu_memory_utilization": 0}, ["gpu_memory_utilization=0", "(0, 1]"]),
    ({"num_gpu_blocks_override": 0}, ["num_gpu_blocks_override=0", ">= 1"]),
    ({"kv_cache_tokens": 0}, ["kv_cache_tokens=0", ">= 1"]),
    ({"tensor_parallel_size": 0}, ["tensor_parallel_size=0", "[1, 64]"]),
    ({"tensor_parallel_size": 65}, ["tensor_parallel_size=65", "[1, 64]"]),
    ({"enable_expert_parallel": "yes"}, ["enable_expert_parallel='yes'", "True or False"]),
    ({"seed": 1.5}, ["seed=1.5", "integer"]),
    ({"max_waiting_requests": 0}, ["max_waiting_requests=0", ">= 1"]),
    ({"max_logprobs": 1001}, ["max_logprobs=1001", "[0, 1000]"]),
    ({"optimizations": {"fused_moe": False}}, ["optimizations", "Optimizations"]),
])
def test_engine_config_validation_names_field_and_range(kwargs, fragments):
    for build in (lambda: EngineConfig(**kwargs), lambda: EngineConfig.from_kwargs(**kwargs)):
        with pytest.raises(ValueError) as info:
            build()
        for fragment in fragments:
            assert fragment in str(info.value), (kwargs, str(info.value))


def test_engine_config_rejects_unknown_and_mistyped_arguments():
    with pytest.raises(ValueError, match="unknown engine argument.*max_num_seq\\b"):
        EngineConfig.from_kwargs(max_num_seq=4)
    with pytest.raises(ValueError, match="enforce_eager must be a bool"):
        EngineConfig.from_kwargs(enforce_eager="yes")


def test_engine_config_defaults_are_valid():
    cfg = EngineConfig()
    assert cfg.model == "m3-mini" and cfg.optimizations == Optimizations()
    cfg = EngineConfig.from_kwargs(model="m3-slice", dtype="bfloat16", tensor_parallel_size=2,
                                   enable_expert_parallel=True, max_model_len=4096, block_size=128)
    assert (cfg.tensor_parallel_size, cfg.enable_expert_parallel, cfg.block_size) == (2, True, 128)
