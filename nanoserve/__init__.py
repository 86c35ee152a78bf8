"""nanoserve: a compact inference engine for MiniMax M3, in PyTorch and Triton.

    from nanoserve import LLM, SamplingParams
    llm = LLM(model="m3-mini")
    print(llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=16))[0].outputs[0].text)

The names below are imported on first use (PEP 562), so that importing a light submodule - the server's request
models, which its body-parsing worker processes load - does not import torch and the engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nanoserve.config import EngineConfig, Optimizations
    from nanoserve.engine.llm_engine import LLMEngine
    from nanoserve.engine.outputs import CompletionOutput, RequestOutput
    from nanoserve.entrypoints.llm import LLM
    from nanoserve.sampling import SamplingParams

_EXPORTS = {"LLM": "nanoserve.entrypoints.llm", "LLMEngine": "nanoserve.engine.llm_engine",
            "EngineConfig": "nanoserve.config", "Optimizations": "nanoserve.config",
            "SamplingParams": "nanoserve.sampling", "RequestOutput": "nanoserve.engine.outputs",
            "CompletionOutput": "nanoserve.engine.outputs"}

__all__ = ["LLM", "LLMEngine", "EngineConfig", "Optimizations", "SamplingParams", "RequestOutput",
           "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'nanoserve' has no attribute {name!r}")
