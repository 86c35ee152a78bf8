"""Building an engine from its config: which executor runs the model.

Kept apart from the step loop (llm_engine.py) so that the loop reads without the set-up around it.
"""

from __future__ import annotations

import os

from nanoserve.config import EngineConfig
from nanoserve.executor.base import Executor
from nanoserve.executor.local import LocalExecutor


def make_executor(config: EngineConfig) -> Executor:
    """LocalExecutor for one device, MultiprocExecutor for tensor parallelism (or any torchrun launch)."""
    # Under a torchrun launch (WORLD_SIZE > 1) the multi-process executor checks the sizes agree, rather than
    # every rank silently running a whole engine of its own.
    if config.tensor_parallel_size == 1 and int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return LocalExecutor(config)
    from nanoserve.distributed.executor import MultiprocExecutor  # only when used: it brings torch.distributed

    return MultiprocExecutor(config)
