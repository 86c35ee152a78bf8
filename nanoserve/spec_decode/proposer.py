"""Drafting: after a step's tokens are known, the draft tokens each decoding sequence verifies in its next step.

    Proposer.propose(step, emitted, premade)   -> {seq_id: drafts}

Which sequences draft, and how many: one that got a token this step, whose sampling reads nothing of its own
output on the host (no bad_words, no penalties: `speculable`), no longer held back by min_tokens, at most k drafts
and never more than max_tokens and max_model_len leave for the drafts and the token after them (`room`). The
engine may lower that (`StepSeq.max_drafts`: the KV blocks a draft model writes its later drafts into could not be
allocated) and drops the drafts a structured output's grammar forbids.

The drafters:
- ngram (spec_decode/ngram.py): prompt lookup on the host, over the sequence's tokens including this step's;
- a draft model (MTP: spec_decode/mtp.py, EAGLE-3: spec_decode/eagle3.py, run by spec_decode/drafter.py): its K/V
  over every position this step made final - the positions whose next token is now known, also of sequences that
  do not draft now (a prompt chunk), so that later drafts can attend to them - then greedy drafts from the last
  one. Sequences whose drafts the draft chain already made on the device (`premade`, spec_decode/draft_chain.py)
  skip it: the chain wrote their K/V.
"""

from __future__ import annotations

from typing import Callable

from nanoserve.sampling import SamplingParams
from nanoserve.spec_decode.config import SpeculativeConfig
from nanoserve.spec_decode.draft_input import DraftInput
from nanoserve.spec_decode.ngram import NgramProposer
from nanoserve.step import StepInput, StepSeq


def speculable(params: SamplingParams) -> bool:
    """May a sequence with these parameters verify drafts? Not when a processing step of its sampling reads its own
    output on the host (bad_words, penalties): the target distributions of the k + 1 positions are computed at
    once, from what is known before the step. (A structured output may: its grammar masks each position.)"""
    p = params
    return (not p.bad_words_token_ids and p.repetition_penalty == 1.0 and p.presence_penalty == 0.0
            and p.frequency_penalty == 0.0)


def room(seq: StepSeq, num_emitted: int, k: int, max_model_len: int) -> int:
    """How many drafts `seq` may verify in its next step, once this step emitted `num_emitted` tokens for it."""
    p = seq.params
    # (the engine's list, as it is now: a step launched ahead of this one's tokens left its count behind)
    num_output = len(seq.output_token_ids) + num_emitted
    if not seq.samples or not seq.max_drafts or num_output < p.min_tokens or not speculable(p):
        return 0
    left = max_model_len - (len(seq.prompt_token_ids) + num_output) - 1
    if p.max_tokens is not None:
        left = min(left, p.max_tokens - num_output - 1)
    return max(0, min(k, seq.max_drafts, left))


ProposeByModel = Callable[[DraftInput], list[list[int]]]


class Proposer:
    """The drafter of one SpeculativeConfig (see the module docstring). `by_model`: the runner's draft-model
    passes (None for ngram)."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, by_model: ProposeByModel | None):
        self.config = config
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.by_model = by_model
        self.ngram = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max, self.k) \
            if config.method == "ngram" else None

    def propose(self, step: StepInput, emitted: dict[int, list[int]], premade: dict[int, list[int]]
                ) -> dict[int, list[int]]:
        """The next step's drafts of the sequences of `step` that got tokens (`emitted`, by seq_id)."""
        rooms = {s.seq_id: room(s, len(emitted[s.seq_id]), self.k, self.max_model_len)
                 for s in step.seqs if s.seq_id in emitted}
        drafts = {sid: premade[sid][: rooms[sid]] for sid in premade}
        if self.ngram is not None:
            for s in step.seqs:
                n = rooms.get(s.seq_id, 0)
                if n:
                    drafts[s.seq_id] = self.ngram.propose(s.token_ids + emitted[s.seq_id], n)
            return drafts
        inp, order = self._draft_input(step, emitted, rooms, premade)
        if order:
            for sid, proposed in zip(order, self.by_model(inp)):
                drafts[sid] = proposed
        return drafts

    def _draft_input(self, step: StepInput, emitted: dict[int, list[int]], rooms: dict[int, int],
                     premade: dict[int, list[int]]) -> tuple[DraftInput, list[int]]:
        """The draft model's input: per sequence the positions this step made final (their rows of the step's
        batch and the token after each) and how many drafts it makes; and the seq_ids in that order."""
        entries = []
        offset = 0
        for i, s in enumerate(step.seqs):
            final = s.query_len - s.num_draft + (len(emitted[s.seq_id]) - 1 if s.draft else 0)
            if final > 0 and s.seq_id not in premade:
                entries.append((i, s, offset, final))
            offset += s.query_len
        entries.sort(key=lambda e: e[3] != 1)  # one-row sequences first, as the attention kernels take them
        inp = DraftInput([], [], [], [], [], [])
        for i, s, offset, final in entries:
            new = emitted.get(s.seq_id, [])
            inp.rows.extend(range(offset, offset + final))
            inp.next_ids.extend(token_at(s, new, p + 1) for p in range(s.start, s.start + final))
            inp.query_lens.append(final)
            inp.seq_lens.append(s.start + final)
            inp.block_tables.append(step.model.block_tables[i])
            inp.num_drafts.append(rooms.get(s.seq_id, 0))
        return inp, [e[1].seq_id for e in entries]


def token_at(seq: StepSeq, emitted: list[int], position: int) -> int:
    """The token at `position` of seq once this step's `emitted` tokens follow its known ones."""
    prompt, out = seq.prompt_token_ids, seq.output_token_ids
    if position < len(prompt):
        return prompt[position]
    position -= len(prompt)
    return out[position] if position < len(out) else emitted[position - len(out)]
