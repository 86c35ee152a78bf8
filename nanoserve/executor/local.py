"""LocalExecutor: tensor_parallel_size 1, the model runner lives in the engine's process."""

from __future__ import annotations

from nanoserve.config import EngineConfig
from nanoserve.executor.base import Executor, StepFuture
from nanoserve.kv_transfer.transfer import KVTransferAgent
from nanoserve.parallel_state import get_tp
from nanoserve.runner.model_runner import ModelRunner
from nanoserve.spec_decode.draft_input import DraftInput
from nanoserve.step import GrammarMasks, StepInput


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
        self.platform = self.runner.platform
        self.vision_config = self.runner.vision_config
        self.num_blocks = 0

    def initialize_cache(self, max_model_len: int, max_num_batched_tokens: int, max_num_seqs: int) -> int:
        self.num_blocks = self.runner.determine_num_blocks(max_model_len, max_num_batched_tokens, max_num_seqs)
        self.runner.allocate_kv_cache(self.num_blocks)
        self.encoder_cache_size = self.runner.encoder_cache_size
        return self.num_blocks

    supports_token_feed = True

    def execute_model(self, step: StepInput) -> None:
        self.runner.execute_model(step)

    def sample_tokens(self, masks: GrammarMasks | None = None) -> StepFuture:
        return self.runner.sample_tokens(masks)

    def propose_drafts(self, inp: DraftInput) -> list[list[int]]:
        return self.runner.propose_drafts(inp)

    def kv_transfer_agent(self, engine_id: str, backends: list[str]) -> KVTransferAgent:
        return KVTransferAgent(engine_id, self.runner.kv_pools(), backends)

    def shutdown(self) -> None:
        self.runner.shutdown()
