"""A step on its way: what `LLMEngine._launch` queued on the device (`LaunchedStep`), and what `_receive` hands
`_process` once its tokens are on the host (`Received`). Both step loops pass these - the plain one in
engine/llm_engine.py and the overlapped one in engine/overlap.py."""

from __future__ import annotations

from dataclasses import dataclass, field

from nanoserve.engine import prompt_logprobs as prompt_lp
from nanoserve.engine.sampler import DeviceSample, SampleResult
from nanoserve.engine.sequence import Sequence
from nanoserve.engine.speculative import DeviceVerify, StepRows


@dataclass
class LaunchedStep:
    """A step whose forward and device-side sampling are queued: the sampled sequences (in row order) and their
    draw, not yet on the host (None when the step only ran prefill chunks), and the prompt logprobs it computes
    (None when no scheduled sequence asked) with the sequences they belong to."""

    seqs: list[Sequence]
    sample: DeviceSample | None
    prompt_logprobs: prompt_lp.DevicePromptLogprobs | None = None
    prompt_seqs: dict[int, Sequence] = field(default_factory=dict)
    verify: DeviceVerify | None = None  # speculative decoding: the sequences that verified drafts, their outcome
    rows: list[StepRows] = field(default_factory=list)  # (speculative decoding) each sequence's rows in the batch
    chain: DeviceSample | None = None  # (spec_draft_chain) the next step's drafts, made on the device


Received = tuple[Sequence, SampleResult | None, int, bool]  # a sequence, its step's draw on the host (None: it
# ended without a token of this step), its row in it, and whether its stop strings were checked already (a
# verified token)
