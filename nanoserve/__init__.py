"""nanoserve: a compact inference engine for MiniMax M3, in PyTorch and Triton.

    from nanoserve import LLM, SamplingParams
    llm = LLM(model="m3-tiny")
    print(llm.generate("Hello", SamplingParams(temperature=0.0, max_tokens=16))[0].outputs[0].text)
"""

from nanoserve.config import EngineConfig, Optimizations
from nanoserve.engine.llm_engine import LLMEngine
from nanoserve.engine.outputs import CompletionOutput, RequestOutput
from nanoserve.entrypoints.llm import LLM
from nanoserve.sampling import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "Optimizations", "SamplingParams", "RequestOutput",
           "CompletionOutput"]
__version__ = "0.1.0"
