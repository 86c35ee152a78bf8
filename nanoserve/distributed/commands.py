"""The commands rank 0 sends every tensor-parallel rank over the control channel, one typed value each.

    Configure(config)                 first: the EngineConfig every shard is built from
    InitCache(limits...)              size the KV pool (all ranks agree on the smallest)
    Step(inp, switches)               run one forward on this step's batch
    Stop()                            leave the worker loop

A worker answers nothing: the logits stay on each rank (only rank 0 samples), and the collectives inside a step
are the only traffic back.
"""

from __future__ import annotations

from dataclasses import dataclass

from nanoserve.config import EngineConfig
from nanoserve.step import ModelInput


@dataclass(frozen=True)
class Configure:
    """The engine's config; every shard is built from it, whatever command line started the rank."""

    config: EngineConfig


@dataclass(frozen=True)
class InitCache:
    """Size the KV pool for these limits (see `worker.initialize_cache`)."""

    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int


@dataclass(frozen=True)
class Step:
    """One forward step. `switches`: rank 0's optimization switches when they changed since the last step (the
    benchmark's ablation flips them on a live engine), else None."""

    inp: ModelInput
    switches: dict[str, bool] | None = None


@dataclass(frozen=True)
class Stop:
    """Leave the worker loop, free the shard, leave the process groups."""


Command = Configure | InitCache | Step | Stop
