"""Where the model runs: in this process (one device), or across tensor-parallel worker processes.

The engine talks to an executor only through `execute_model(ModelInput) -> logits`, so tensor parallelism is a
different executor, not a different engine.
"""

from __future__ import annotations

import os

import torch

from nanoserve.config import EngineConfig
from nanoserve.distributed.parallel_state import get_tp
from nanoserve.engine.model_runner import ModelInput, ModelRunner
from nanoserve.model.m3_config import M3Config


class Executor:
    """Interface: a model (config), a KV pool of `num_blocks`, and one forward step at a time."""

    model_config: M3Config
    model_dir: str
    device: torch.device
    num_blocks: int
    block_size: int

    def initialize_cache(self, max_model_len: int, max_num_batched_tokens: int, max_num_seqs: int) -> int:
        raise NotImplementedError

    def execute_model(self, inp: ModelInput) -> torch.Tensor:
        raise NotImplementedError

    def check_health(self) -> None:
        """Raise if a worker is gone."""

    def shutdown(self) -> None:
        raise NotImplementedError


class LocalExecutor(Executor):
    """tensor_parallel_size == 1: the runner lives in this process."""

    def __init__(self, config: EngineConfig):
        if get_tp().size > 1:  # the layers would read that state and build a shard, not the whole model
            raise RuntimeError("a tensor-parallel engine is running in this process: shut it down first")
        self.runner = ModelRunner(config)
        self.model_config = self.runner.cfg
        self.model_dir = self.runner.model_dir
        self.device = self.runner.device
        self.block_size = self.runner.block_size
        self.num_blocks = 0

    def initialize_cache(self, max_model_len: int, max_num_batched_tokens: int, max_num_seqs: int) -> int:
        self.num_blocks = self.runner.determine_num_blocks(max_model_len, max_num_batched_tokens, max_num_seqs)
        self.runner.allocate_kv_cache(self.num_blocks)
        return self.num_blocks

    def execute_model(self, inp: ModelInput) -> torch.Tensor:
        return self.runner.execute(inp)

    def shutdown(self) -> None:
        self.runner.shutdown()


def make_executor(config: EngineConfig) -> Executor:
    # Under a torchrun launch (WORLD_SIZE > 1) the multi-process executor checks the sizes agree, rather than
    # every rank silently running a whole engine of its own.
    if config.tensor_parallel_size == 1 and int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return LocalExecutor(config)
    from nanoserve.distributed.executor import MultiprocExecutor

    return MultiprocExecutor(config)
