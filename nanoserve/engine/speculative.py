"""Speculative decoding in the engine loop: draft, verify in one pass, accept (switch `speculative_decoding`,
with a `speculative_config`).

    1. Draft. Before each schedule, every decoding sequence that may speculate (`speculable`) gets up to k draft
       tokens in `Sequence.spec_token_ids` from the drafter (spec_decode/ngram.py), fewer near max_tokens or
       max_model_len so that a fully accepted draft never runs past them.
    2. Schedule. The scheduler gives such a sequence 1 + k positions in one step (its newest token and the
       drafts), as far as the token budget and the KV pool allow (`ScheduledSeq.num_draft`): one prefill-like
       query of k + 1 tokens over its paged cache, which every attention path (dense and MSA, whose selection is
       per query position) already computes causally.
    3. Verify. The runner returns the logits of all k + 1 positions; `verify` turns them into the distributions
       the sampler would draw from (`Sampler.target_distributions`) and applies the acceptance rule
       (spec_decode/rejection.py): greedy keeps the longest prefix equal to the argmax, sampling keeps the target
       distribution exactly. A sequence gains its accepted drafts plus one token per step.
    4. Roll back. The engine appends the tokens one at a time with the usual stop checks (EOS, stop ids,
       max_tokens, stop strings: a stop inside the accepted run drops the tokens after it), and
       `Scheduler.accept_drafts` keeps the K/V of the accepted positions and returns the blocks only the rejected
       ones needed. The rejected slots' K/V is garbage that the next step overwrites before anything reads it
       (a query reads positions up to its own).

Sequences that do not speculate decode as before, in the same batch: those whose sampling reads their own output
on the host (structured outputs, bad_words, penalties), those still under min_tokens, and any while a speculative
step cannot be formed. Async scheduling is off while speculating (a draft needs the previous step's tokens on the
host); verify steps run eagerly (a CUDA graph captures one-token decodes only).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from nanoserve.engine.sampler import DeviceSample, Sampler, SampleResult
from nanoserve.engine.sequence import Sequence
from nanoserve.spec_decode.config import SpeculativeConfig
from nanoserve.spec_decode.ngram import NgramProposer
from nanoserve.spec_decode.rejection import rejection_sample

if TYPE_CHECKING:
    from nanoserve.engine.scheduler import ScheduledSeq

logger = logging.getLogger(__name__)


@dataclass
class DeviceVerify:
    """A verify step's outcome, still on the device: row r of `sample` holds position j of sequence seqs[r // w]
    (w = width = max drafts + 1): its accepted drafts, then the drawn token, then -1."""

    seqs: list[Sequence]
    num_draft: list[int]
    width: int
    sample: DeviceSample


def speculable(seq: Sequence) -> bool:
    """May seq verify drafts? Not when a processing step of its sampling reads its own output (a grammar,
    bad_words, penalties) or min_tokens still holds back a stop: the target distributions of the k + 1 positions
    are computed at once, from what is known before the step."""
    p = seq.params
    return (seq.grammar is None and not p.bad_words_token_ids and p.repetition_penalty == 1.0
            and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
            and seq.num_output_tokens >= p.min_tokens and seq.num_pending == 0)


class Speculator:
    """The engine's drafter and verifier for one SpeculativeConfig (see the module docstring)."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.config = config
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max, self.k)

    def propose(self, running: list[Sequence]) -> None:
        """Set each running sequence's drafts for the next step ([] for one that does not speculate now)."""
        for seq in running:
            seq.spec_token_ids = []
            if seq.num_computed_tokens != seq.num_tokens - 1 or seq.num_computed_tokens < seq.num_prompt_tokens \
                    or not speculable(seq):
                continue
            room = self.max_model_len - seq.num_tokens - 1
            if seq.params.max_tokens is not None:
                room = min(room, seq.params.max_tokens - seq.num_output_tokens - 1)
            if room > 0:
                seq.spec_token_ids = self.proposer.propose(seq.token_ids, min(self.k, room))

    def verify(self, logits: torch.Tensor, scheduled: list[ScheduledSeq], sampler: Sampler) -> DeviceVerify:
        """Queue the acceptance of the scheduled drafts on the device. `logits`: the k_r + 1 rows of each
        sequence in `scheduled`, in order (the newest token's position first)."""
        seqs = [s.seq for s in scheduled]
        counts = [s.num_draft for s in scheduled]
        k_max = max(counts)
        device = logits.device
        row_seqs = [s.seq for s in scheduled for _ in range(s.num_draft + 1)]
        probs, source = sampler.target_distributions(logits, row_seqs)
        offsets = [0]
        for n in counts[:-1]:
            offsets.append(offsets[-1] + n + 1)
        starts = torch.tensor(offsets, dtype=torch.int64).to(device)
        drafts = torch.tensor([s.draft + [0] * (k_max - s.num_draft) for s in scheduled], dtype=torch.int64).to(device)
        num_drafts = torch.tensor(counts, dtype=torch.int64).to(device)
        uniforms = torch.empty(len(seqs), k_max, device=device)
        exponentials = torch.empty(len(seqs), probs.shape[-1], device=device)
        shared = [r for r, seq in enumerate(seqs) if seq.params.seed is None]
        if shared:  # one draw for the rows on the engine's generator, then each seeded row from its own
            idx = torch.tensor(shared, dtype=torch.int64).to(device)
            uniforms[idx] = torch.empty(len(shared), k_max, device=device).uniform_(generator=sampler.generator)
            exponentials[idx] = torch.empty(len(shared), probs.shape[-1], device=device).exponential_(
                generator=sampler.generator)
        for r, seq in enumerate(seqs):
            if seq.params.seed is not None:
                g = sampler.generator_for(seq)
                uniforms[r].uniform_(generator=g)
                exponentials[r].exponential_(generator=g)
        tokens, _ = rejection_sample(probs, starts, drafts, num_drafts, uniforms, exponentials)
        width = k_max + 1
        flat_tokens = tokens.reshape(-1)
        # logprobs of each emitted token at its position (rows past a sequence's own positions repeat its last)
        num_logprobs = [None if s.params.logprobs is None else
                        (probs.shape[-1] if s.params.logprobs == -1 else s.params.logprobs)
                        for s in seqs for _ in range(width)]
        chosen = top_vals = top_ids = None
        if source is not None:
            pos = torch.arange(width, device=device)[None, :]
            rows = (starts[:, None] + torch.minimum(pos, num_drafts[:, None])).reshape(-1)
            chosen = source[rows].gather(1, flat_tokens.clamp(min=0)[:, None])[:, 0]
            k = min(max(n or 0 for n in num_logprobs), probs.shape[-1])
            if k:
                top_vals, top_ids = source[rows].topk(k, dim=-1)
        sample = DeviceSample(flat_tokens, num_logprobs, chosen, top_vals, top_ids).start_host_copy()
        return DeviceVerify(seqs, counts, width, sample)

    @staticmethod
    def to_host(verify: DeviceVerify) -> SampleResult:
        return Sampler.to_host(verify.sample)
