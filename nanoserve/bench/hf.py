"""The Hugging Face baseline: transformers' `MiniMaxM3VLForCausalLM.generate` on the same weights as nanoserve.

The model is built directly in device memory (m3-slice is 50 GB; the GPU machine's disk is 64 GB): the module tree
is created on the meta device, then every parameter is filled from `checkpoint_layout.random_tensors` - the same
generator, seed and device nanoserve's loader draws from - mapped from the real checkpoint names to transformers'
fused layout:

    self_attn.{q,k,v,o}_proj, q_norm, k_norm            -> same names
    self_attn.index_{q,k}_proj / index_{q,k}_norm         -> self_attn.indexer.{q,k}_proj / {q,k}_norm
    mlp.{gate,up}_proj (dense layers)                    -> mlp.gate_up_proj = cat(gate, up); mlp.down_proj
    block_sparse_moe.gate.weight / e_score_correction_bias -> mlp.gate.weight / mlp.gate.e_score_correction_bias
    block_sparse_moe.experts.E.{w1,w3,w2}                -> mlp.experts.gate_up_proj[E] = cat(w1, w3),
                                                            mlp.experts.down_proj[E] = w2
    block_sparse_moe.shared_experts.{gate,up,down}_proj  -> mlp.shared_experts.gate_up_proj = cat(gate, up), down_proj

The router weight and its bias stay fp32 (as in the checkpoint and in nanoserve); everything else takes the
model dtype. Two configurations (docs/benchmarks.md, Baseline): "eager" = generate() with the dynamic cache;
"static" = generate(cache_implementation="static"), which transformers compiles on a GPU (torch.compile,
reduce-overhead);
its first call on a shape compiles, so it is warmed up on exactly the timed shapes.

Timing: a streamer that synchronises the device and stamps each generated token; TTFT = first token - start,
TPOT = (last token - first token) / (n - 1), tokens/s = batch x n / wall.
"""

from __future__ import annotations

import gc
import time

import torch

from nanoserve.bench.floor import H200, Ceilings, ModelCost
from nanoserve.bench.offline import RunResult, performance, stats
from nanoserve.bench.workloads import Workload
from nanoserve.model.m3_config import M3Config
from nanoserve.presets.catalog import Preset
from nanoserve.presets.checkpoint_layout import random_tensors

MODES = ("eager", "static")
FP32_SUFFIXES = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")
EAGER_MASK_MEMORY_FRACTION = 0.5
"""transformers' eager/sdpa MSA path builds dense [batch, heads, S, S] masks: skip a run whose masks alone would
take more than this share of the free device memory."""


def _hf_dialect(cfg: M3Config) -> dict:
    """The text config in transformers' own field names."""
    return dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, rotary_dim=cfg.rotary_dim,
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, tie_word_embeddings=cfg.tie_word_embeddings,
        num_experts_per_tok=cfg.num_experts_per_tok, num_local_experts=cfg.num_local_experts,
        dense_intermediate_size=cfg.dense_intermediate_size, shared_intermediate_size=cfg.shared_intermediate_size,
        routed_scaling_factor=cfg.routed_scaling_factor, swiglu_alpha=cfg.swiglu_alpha, swiglu_limit=cfg.swiglu_limit,
        rope_parameters={"rope_theta": cfg.rope_theta, "partial_rotary_factor": cfg.rotary_dim / cfg.head_dim,
                         "rope_type": "default"},
        layer_types=["minimax_m3_sparse" if cfg.is_sparse_attention(i) else "full_attention"
                     for i in range(cfg.num_hidden_layers)],
        mlp_layer_types=["sparse" if cfg.is_moe(i) else "dense" for i in range(cfg.num_hidden_layers)],
        index_n_heads=cfg.index_n_heads, index_head_dim=cfg.index_head_dim, index_block_size=cfg.index_block_size,
        index_topk_blocks=cfg.index_topk_blocks, index_local_blocks=cfg.index_local_blocks)


def _config_mismatches(text, want: dict) -> list[str]:
    bad = []
    for key, value in want.items():
        got = getattr(text, key, None)
        if key == "rope_parameters":
            got = {k: (got or {}).get(k) for k in value}
        if got != value:
            bad.append(f"{key}={got!r} (want {value!r})")
    return bad


def hf_text_config(cfg: M3Config, attn_implementation: str = "sdpa"):
    """transformers' MiniMaxM3VLTextConfig for `cfg`: built from transformers' own field names, else (an older
    release) parsed from the released config.json dialect; checked field by field either way."""
    from transformers.models.minimax_m3_vl import MiniMaxM3VLConfig, MiniMaxM3VLTextConfig

    from nanoserve.presets.make_checkpoint import TINY_VISION_CONFIG

    want = _hf_dialect(cfg)
    try:
        text = MiniMaxM3VLTextConfig(**want)
        bad = _config_mismatches(text, want)
    except Exception as e:  # noqa: BLE001 - fall back to the released dialect below
        bad = [f"{type(e).__name__}: {e}"]
    if bad:
        text = MiniMaxM3VLConfig.from_dict(cfg.to_hf_dict(vision_config=TINY_VISION_CONFIG)).text_config
        still = _config_mismatches(text, want)
        if still:
            raise ValueError(f"transformers' MiniMaxM3VLTextConfig does not hold this model: {'; '.join(still)}")
    text._attn_implementation = attn_implementation
    return text


def hf_name(name: str, cfg: M3Config) -> tuple[str, tuple]:
    """A real checkpoint name -> (transformers parameter name, where in it: () whole, ("rows", lo, hi),
    ("expert", e) or ("expert_rows", e, lo, hi))."""
    p = "language_model."
    if not name.startswith(p):
        raise ValueError(f"not a language-model tensor: {name}")
    n = name[len(p):]
    if n in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        return n, ()
    parts = n.split(".")  # model.layers.{i}.<rest>
    layer = f"model.layers.{parts[2]}"
    rest = ".".join(parts[3:])
    if rest.startswith(("input_layernorm", "post_attention_layernorm")):
        return f"{layer}.{rest}", ()
    if rest.startswith("self_attn.index_"):
        which = rest[len("self_attn.index_"):]  # q_proj.weight, k_norm.weight, ...
        return f"{layer}.self_attn.indexer.{which}", ()
    if rest.startswith("self_attn."):
        return f"{layer}.{rest}", ()
    if rest.startswith("mlp."):  # dense MLP
        inter = cfg.dense_intermediate_size
        if rest == "mlp.gate_proj.weight":
            return f"{layer}.mlp.gate_up_proj.weight", ("rows", 0, inter)
        if rest == "mlp.up_proj.weight":
            return f"{layer}.mlp.gate_up_proj.weight", ("rows", inter, 2 * inter)
        return f"{layer}.mlp.down_proj.weight", ()
    moe = rest[len("block_sparse_moe."):]
    if moe == "gate.weight":
        return f"{layer}.mlp.gate.weight", ()
    if moe == "e_score_correction_bias":
        return f"{layer}.mlp.gate.e_score_correction_bias", ()
    if moe.startswith("experts."):
        _, e, w, _ = moe.split(".")
        inter = cfg.intermediate_size
        if w == "w1":
            return f"{layer}.mlp.experts.gate_up_proj", ("expert_rows", int(e), 0, inter)
        if w == "w3":
            return f"{layer}.mlp.experts.gate_up_proj", ("expert_rows", int(e), inter, 2 * inter)
        return f"{layer}.mlp.experts.down_proj", ("expert", int(e))
    if moe.startswith("shared_experts."):
        inter = cfg.shared_intermediate_size
        if moe == "shared_experts.gate_proj.weight":
            return f"{layer}.mlp.shared_experts.gate_up_proj.weight", ("rows", 0, inter)
        if moe == "shared_experts.up_proj.weight":
            return f"{layer}.mlp.shared_experts.gate_up_proj.weight", ("rows", inter, 2 * inter)
        return f"{layer}.mlp.shared_experts.down_proj.weight", ()
    raise ValueError(f"no transformers name for {name}")


def build_hf_model(cfg: M3Config, preset: Preset, device: torch.device | str, dtype: torch.dtype,
                   attn_implementation: str = "sdpa"):
    """transformers' MiniMaxM3VLForCausalLM holding the preset's weights (the same draw as nanoserve's), built
    directly on `device`."""
    from transformers.models.minimax_m3_vl import MiniMaxM3VLForCausalLM

    device = torch.device(device)
    text = hf_text_config(cfg, attn_implementation)
    with torch.device("meta"):
        model = MiniMaxM3VLForCausalLM(text)
    shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    dest = {n: torch.empty(s, dtype=torch.float32 if n.endswith(FP32_SUFFIXES) else dtype, device=device)
            for n, s in shapes.items()}
    filled: dict[str, int] = {n: 0 for n in dest}
    for name, t in random_tensors(cfg, preset.init_std, preset.random_norms, preset.seed, device=device):
        target, where = hf_name(name, cfg)
        d = dest[target]
        if not where:
            d.copy_(t)
        elif where[0] == "rows":
            d[where[1]: where[2]].copy_(t)
        elif where[0] == "expert":
            d[where[1]].copy_(t)
        else:
            d[where[1], where[2]: where[3]].copy_(t)
        filled[target] += t.numel()
        del t
    missing = [n for n, c in filled.items() if c != dest[n].numel()]
    if missing:
        raise RuntimeError(f"HF weight mapping left {len(missing)} tensor(s) unfilled: {missing[:5]}")
    model.load_state_dict(dest, strict=True, assign=True)
    # non-persistent buffers (the rotary inverse frequencies) are not in the state dict: rebuild their modules
    for name, mod in list(model.named_modules()):
        if any(b.device.type == "meta" for b in mod.buffers(recurse=False)):
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, type(mod)(text).to(device))
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.device.type == "meta"]
    if left:
        raise RuntimeError(f"HF model still has meta tensors: {left[:5]}")
    return model.eval()


class _TokenClock:
    """A generate() streamer: stamps every put (the prompt first, then each generated token) after a device
    sync, so the stamps are when each token was actually ready."""

    def __init__(self, device: torch.device):
        self.device = device
        self.times: list[float] = []

    def put(self, value) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def eager_mask_bytes(cfg: M3Config, batch: int, total_len: int) -> int:
    """Rough size of the dense masks transformers' sdpa MSA path materialises for one layer's prefill."""
    return batch * cfg.num_attention_heads * total_len * total_len * 4


class HFBench:
    """The HF model plus runs of uniform workloads in either configuration."""

    def __init__(self, cfg: M3Config, preset: Preset, device: torch.device, dtype: torch.dtype,
                 hw: Ceilings = H200):
        self.cfg, self.device, self.dtype, self.hw = cfg, device, dtype, hw
        t0 = time.perf_counter()
        self.model = build_hf_model(cfg, preset, device, dtype)
        self.build_s = time.perf_counter() - t0
        self.cost = ModelCost(cfg, weight_bytes=torch.empty((), dtype=dtype).element_size(),
                              kv_bytes=torch.empty((), dtype=dtype).element_size())
        self.eos = cfg.eos_token_id

    def _generate(self, ids: torch.Tensor, n: int, mode: str, streamer=None) -> torch.Tensor:
        kwargs = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=self.eos,
                      attention_mask=torch.ones_like(ids), streamer=streamer)
        if mode == "static":
            kwargs["cache_implementation"] = "static"
        return self.model.generate(ids, **kwargs)  # generate() runs under no_grad itself

    def skip_reason(self, wl: Workload, mode: str) -> str | None:
        if any(r.json_schema is not None for r in wl.requests):
            return "structured outputs: the HF baseline has no grammar-constrained decoding"
        if not wl.uniform:
            return "requests of different lengths: HF generate() runs static batches only (and its continuous " \
                   "batching fails on M3: 'Invalid group type: minimax_m3_sparse')"
        if self.device.type == "cuda":
            need = eager_mask_bytes(self.cfg, wl.num_requests, wl.max_total_len)
            free = torch.cuda.mem_get_info(self.device)[0]
            if need > EAGER_MASK_MEMORY_FRACTION * free:
                return f"its MSA path would build ~{need / 2**30:.0f} GiB of dense masks per layer " \
                       f"({free / 2**30:.0f} GiB free)"
        return None

    def run(self, wl: Workload, mode: str, max_tokens: int | None = None) -> RunResult:
        """Warm up (eager: 2 tokens; static: the exact timed call, which compiles), then time one generate()."""
        if mode not in MODES:
            raise ValueError(f"HF mode {mode!r}: choose from {MODES}")
        n = min(wl.requests[0].max_tokens, max_tokens or wl.requests[0].max_tokens)
        ids = torch.tensor([r.prompt_ids for r in wl.requests], dtype=torch.long, device=self.device)
        t0 = time.perf_counter()
        self._generate(ids, n if mode == "static" else min(n, 2), mode)
        warm_s = time.perf_counter() - t0
        clock = _TokenClock(self.device)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        out = self._generate(ids, n, mode, streamer=clock)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        wall = time.perf_counter() - start
        stamps = clock.times[1:]  # the first put is the prompt
        ttft = (stamps[0] - start) if stamps else wall
        tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else float("nan")
        batch = ids.shape[0]
        tokens = out[:, ids.shape[1]:].tolist()
        used = wl.scaled(max_tokens=n, seed=0) if n != wl.requests[0].max_tokens else wl
        res = RunResult(
            workload=wl.name, engine="hf", mode=mode, num_requests=batch, prompt_tokens=int(ids.numel()),
            output_tokens=batch * n, wall_s=wall, output_tok_s=batch * n / wall,
            total_tok_s=(ids.numel() + batch * n) / wall,
            ttft_ms=stats([ttft * 1e3] * batch), tpot_ms=stats([tpot * 1e3] * batch if tpot == tpot else []),
            e2e_ms=stats([wall * 1e3] * batch), decode_tok_s=batch / tpot if tpot == tpot and tpot > 0 else 0.0,
            perf=performance(self.cost, used, wall, tpot if tpot == tpot else 0.0, ttft, self.hw),
            extra={"warmup_s": warm_s, "compiled": mode == "static" and self.device.type == "cuda",
                   "output_len": n, "attn_implementation": self.model.config._attn_implementation,
                   "experts_implementation": getattr(self.model.config, "_experts_implementation", None)},
            token_ids=tokens)
        return res

    def close(self) -> None:
        self.model = None
        gc.collect()
        if self.device.type == "cuda":
            torch._dynamo.reset()
            torch.cuda.empty_cache()
