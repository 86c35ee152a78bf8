"""What the speculative-decoding benchmarks share: the engine they build for a model, how long a task's answers may
be (nanoserve/bench/speculative.py's acceptance, nanoserve/bench/speculative_host.py's host times), where two
greedy outputs part, and the draft chain's reference configuration."""

from __future__ import annotations

from nanoserve.bench.quality import RETRIEVAL_TOKENS, TASK_TOKENS

NO_ASYNC = "mtp k=3, host in step"
"""MTP k=3 with switch spec_async off, its reference: each speculative step launched once the previous step's tokens
are on the host (the draft chain on). The async path takes a step's queries from the chain's graph, so the two
differ on a GPU only."""

NO_CHAIN = "mtp k=3, no draft chain"
"""MTP k=3 with switch spec_draft_chain off, its reference (spec_decode/draft_chain.py): the chain replays CUDA
graphs, so the two differ on a GPU only."""

NO_FEED = "mtp k=3, feed on host"
"""MTP k=3 with switch spec_feed_in_graph off, its reference: an ahead step's verify query is copied into the verify
graph's inputs by separate launches on the host (cuda_graphs.apply_verify_feed) instead of inside the graph; the
feed exists only on the async path's graphs, so the two differ on a GPU only."""

MULTI = "mtp k=3, 4 steps per launch"
"""MTP k=3 with switch spec_multi_step on (off by default; spec_decode/multi_step.py): four speculative steps per
launch, in one graph, instead of one; the multi-step graphs exist on a GPU only."""

REFERENCE_SWITCH = {NO_ASYNC: "spec_async", NO_CHAIN: "spec_draft_chain", NO_FEED: "spec_feed_in_graph"}
"""Each reference configuration and the switch it turns off (MTP k=3 otherwise)."""

ON_SWITCH = {MULTI: "spec_multi_step"}
"""Each configuration that turns on a switch that is off by default (MTP k=3 otherwise)."""


def no_chain_skip(no_mtp: str | None, device: str) -> str | None:
    """Why NO_CHAIN is not measured (None: it is): the model has no MTP module (`no_mtp`), or the run is on the CPU."""
    import torch

    on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    return no_mtp or ("the draft chain replays CUDA graphs: a GPU only" if on_cpu else None)


def switches_for(name: str, optimizations):
    """The engine's switches for the configuration `name`: the given ones (None: the defaults), with
    REFERENCE_SWITCH[name] off for a reference configuration and ON_SWITCH[name] on."""
    if name not in REFERENCE_SWITCH and name not in ON_SWITCH:
        return optimizations
    from nanoserve.config import Optimizations

    change = {REFERENCE_SWITCH[name]: False} if name in REFERENCE_SWITCH else {ON_SWITCH[name]: True}
    return (optimizations or Optimizations()).replace(**change)


def max_tokens_for(task: str) -> int:
    return TASK_TOKENS.get(task, RETRIEVAL_TOKENS)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (the shorter one's length if one is a prefix), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


MAX_NUM_SEQS = 4
"""The benchmarks answer one prompt at a time; the warm-up captures graphs for batch buckets up to this."""

MAX_MODEL_LEN = 12_288
"""Room for the longest held-out prompts (retrieval at 8k tokens) and their answers."""


def build_llm(model: str, device: str, dtype: str, speculative_config: dict | None, optimizations=None,
              max_num_seqs: int = MAX_NUM_SEQS):
    from nanoserve.engine.warmup import DEFAULT_GPU_BUDGET_S, warm_up
    from nanoserve.entrypoints.llm import LLM
    from nanoserve.model.loader import read_config
    from nanoserve.presets.resolve import resolve_model_dir

    max_len = min(MAX_MODEL_LEN, read_config(resolve_model_dir(model)).max_position_embeddings)
    # batch 1 only: a few sequences' graphs to capture, not the server's 256
    llm = LLM(model=model, device=device, dtype=dtype, max_model_len=max_len, kv_cache_tokens=65_536, seed=0,
              max_num_seqs=max(max_num_seqs, MAX_NUM_SEQS), speculative_config=speculative_config,
              **({"optimizations": optimizations} if optimizations else {}))
    if llm.engine.executor.device.type != "cpu":
        # as the server does before it serves: kernels built and graphs captured (decode, and the verify and draft
        # graphs of every length) before anything is timed, so no request's TPOT pays for them
        print(warm_up(llm.engine, DEFAULT_GPU_BUDGET_S).summary(), flush=True)
    return llm
