"""nanoserve: a compact inference engine for MiniMax M3, in PyTorch and Triton."""

from nanoserve.config import EngineConfig, Optimizations

__all__ = ["EngineConfig", "Optimizations"]
__version__ = "0.1.0"
