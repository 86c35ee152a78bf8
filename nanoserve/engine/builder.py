"""Building an engine from its config: which executor runs the model, and the limits the engine runs under.

Kept apart from the step loop (llm_engine.py) so that the loop reads without the set-up around it.

    make_executor(config)            LocalExecutor for one device, MultiprocExecutor for tensor parallelism
    resolve_limits(config, model, block_size)   max_model_len and the per-step token budget, checked
    check_kv_capacity(blocks, ...)   the KV pool must hold at least one max_model_len sequence
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from nanoserve.config import EngineConfig
from nanoserve.executor.base import Executor
from nanoserve.executor.local import LocalExecutor
from nanoserve.model.m3_config import M3Config

DEFAULT_MAX_NUM_BATCHED_TOKENS = 16384


def make_executor(config: EngineConfig) -> Executor:
    """LocalExecutor for one device, MultiprocExecutor for tensor parallelism (or any torchrun launch)."""
    # Under a torchrun launch (WORLD_SIZE > 1) the multi-process executor checks the sizes agree, rather than
    # every rank silently running a whole engine of its own.
    if config.tensor_parallel_size == 1 and int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return LocalExecutor(config)
    from nanoserve.distributed.executor import MultiprocExecutor  # only when used: it brings torch.distributed

    return MultiprocExecutor(config)


@dataclass(frozen=True)
class EngineLimits:
    """The sizes the engine runs under, resolved from the config and the model."""

    block_size: int  # tokens per KV block = the model's MSA block size (the executor's)
    max_model_len: int  # prompt + output tokens of one sequence
    max_num_batched_tokens: int  # tokens per step


def resolve_limits(config: EngineConfig, model_config: M3Config, block_size: int) -> EngineLimits:
    """The engine's limits, or a ValueError naming the setting that cannot work with this model. `block_size`: the
    executor's (derived once, by the runner: runner/kv_cache.py `kv_block_size`)."""
    max_model_len = config.max_model_len or model_config.max_position_embeddings
    if max_model_len > model_config.max_position_embeddings:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
                         f"{model_config.max_position_embeddings}")
    chunked = config.optimizations.chunked_prefill
    if config.max_num_batched_tokens is not None:
        budget = config.max_num_batched_tokens
        if not chunked and budget < max_model_len:
            raise ValueError(f"max_num_batched_tokens={budget} is smaller than max_model_len={max_model_len}; "
                             f"without chunked prefill a whole prompt must fit one step")
    else:
        budget = DEFAULT_MAX_NUM_BATCHED_TOKENS if chunked else max(DEFAULT_MAX_NUM_BATCHED_TOKENS, max_model_len)
    return EngineLimits(block_size, max_model_len, budget)


def check_kv_capacity(num_blocks: int, limits: EngineLimits) -> None:
    if num_blocks * limits.block_size < limits.max_model_len:
        raise ValueError(f"the KV cache holds {num_blocks * limits.block_size} tokens, fewer than max_model_len="
                         f"{limits.max_model_len}: lower --max-model-len or give the cache more memory")
