"""Speculative decoding in the engine loop: draft, verify in one pass, accept (switch `speculative_decoding`,
with a `speculative_config`).

    1. Draft. Before each schedule, every decoding sequence that may speculate (`speculable`) gets up to k draft
       tokens in `Sequence.spec_token_ids` from the drafter - prompt lookup on the host (spec_decode/ngram.py), or
       a draft model on the device (MTP: model/mtp.py; EAGLE-3: model/eagle3.py; run by runner/drafter.py over
       the positions the last step made final) - fewer near max_tokens or max_model_len so that a fully accepted
       draft never runs past them.
    2. Schedule. The scheduler gives such a sequence 1 + k positions in one step (its newest token and the
       drafts), as far as the token budget and the KV pool allow (`ScheduledSeq.num_draft`): one prefill-like
       query of k + 1 tokens over its paged cache, which every attention path (dense and MSA, whose selection is
       per query position) already computes causally.
    3. Verify. The runner returns the logits of all k + 1 positions; `verify` turns them into the distributions
       the sampler would draw from (`Sampler.target_distributions`) and applies the acceptance rule
       (spec_decode/rejection.py): greedy keeps the longest prefix equal to the argmax, sampling keeps the target
       distribution exactly. A sequence gains its accepted drafts plus one token per step. Where every verifying
       sequence is plain greedy (switch spec_greedy_accept) the rule needs only each position's argmax: one
       argmax is queued and the drafts are compared with it on the host, after the copy the step waits for anyway.
    4. Roll back. The engine appends the tokens one at a time with the usual stop checks (EOS, stop ids,
       max_tokens, stop strings: a stop inside the accepted run drops the tokens after it), and
       `Scheduler.accept_drafts` keeps the K/V of the accepted positions and returns the blocks only the rejected
       ones needed. The rejected slots' K/V is garbage that the next step overwrites before anything reads it
       (a query reads positions up to its own).

Structured outputs speculate under their grammar: a draft is cut where the grammar forbids it, and each verified
position is masked with the grammar's state after the draft tokens before it (`grammar_masks`). Sequences that do
not speculate decode as before, in the same batch: those whose sampling reads their own output on the host
otherwise (bad_words, penalties), those still under min_tokens, and any while a speculative step cannot be
formed. Async scheduling is off while speculating (a draft needs the previous step's tokens on the
host); with spec_cuda_graphs a verify step whose sequences all feed the same number of tokens replays a CUDA graph
(runner/cuda_graphs.py), other verify steps run eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from nanoserve.engine.sampler import DeviceSample, Sampler, SampleResult, plain_greedy
from nanoserve.engine.sequence import Sequence, SequenceStatus
from nanoserve.engine.structured_output import GrammarBitmask
from nanoserve.spec_decode.config import SpeculativeConfig
from nanoserve.spec_decode.draft_input import DraftInput
from nanoserve.spec_decode.ngram import NgramProposer
from nanoserve.spec_decode.rejection import rejection_sample

if TYPE_CHECKING:
    from nanoserve.engine.scheduler import ScheduledSeq
    from nanoserve.executor.base import Executor

StepRows = tuple[Sequence, int, int, int]
"""A sequence's part of the last step: its first position, its first row in the step's flat batch, and how many
of its positions are final (computed, and their next token known: a verify step's accepted ones)."""

@dataclass
class DeviceVerify:
    """A verify step's outcome, still on the device: row r of `sample` holds position j of sequence seqs[r // w]
    (w = width = max drafts + 1): its accepted drafts, then the drawn token, then -1."""

    seqs: list[Sequence]
    num_draft: list[int]
    width: int
    sample: DeviceSample
    drafts: list[list[int]] | None = None
    """Set where the step accepts greedily on the host (switch spec_greedy_accept): `sample` then holds the argmax
    of every verified position (sequence r's k_r + 1 rows in turn), and `to_host` compares each draft with it."""


def speculable(seq: Sequence) -> bool:
    """May seq verify drafts? Not when a processing step of its sampling reads its own output on the host
    (bad_words, penalties) or min_tokens still holds back a stop: the target distributions of the k + 1 positions
    are computed at once, from what is known before the step. A structured output may (its grammar gives each
    position's mask by walking the draft and rolling back: `grammar_masks`), once its format holds (not in the
    thinking before it) and its grammar has seen every output token."""
    p = seq.params
    g = seq.grammar
    return ((g is None or (g.active and not g.failed and g.num_seen == len(seq.output_token_ids)))
            and not p.bad_words_token_ids and p.repetition_penalty == 1.0
            and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
            and seq.num_output_tokens >= p.min_tokens and seq.num_pending == 0)


def grammar_prefix(seq: Sequence, drafts: list[int]) -> list[int]:
    """The longest prefix of `drafts` that seq's grammar allows (ending at a token that terminates it); the
    grammar is left as it was. A draft token the format forbids could never be accepted, and the masks of the
    positions after it could not be computed."""
    matcher = seq.grammar.matcher
    n = 0
    for token in drafts:
        if matcher.is_terminated() or not matcher.accept_token(token):
            break
        n += 1
    if n:
        matcher.rollback(n)
    return drafts[:n]


def grammar_masks(scheduled: list[ScheduledSeq], vocab_size: int) -> GrammarBitmask | None:
    """The structured-output masks of a verify step's rows (a sequence's k + 1 positions in turn): position j's
    is the grammar's after the first j draft tokens, which it accepts one by one and then rolls back."""
    constrained = [i for i, s in enumerate(scheduled) if s.seq.grammar is not None]
    if not constrained:
        return None
    import xgrammar as xgr

    starts = [0]
    for s in scheduled:
        starts.append(starts[-1] + s.num_draft + 1)
    bitmask = xgr.allocate_token_bitmask(starts[-1], vocab_size)
    rows = []
    for i in constrained:
        s = scheduled[i]
        matcher = s.seq.grammar.matcher
        for j in range(s.num_draft + 1):
            matcher.fill_next_token_bitmask(bitmask, starts[i] + j)
            rows.append(starts[i] + j)
            if j < s.num_draft and not matcher.accept_token(s.draft[j]):
                raise RuntimeError(f"sequence {s.seq.seq_id}: its grammar rejects draft token {s.draft[j]}, which "
                                   f"grammar_prefix let through")
        matcher.rollback(s.num_draft)
    return GrammarBitmask(bitmask, rows, vocab_size)


class Speculator:
    """The engine's drafter and verifier for one SpeculativeConfig (see the module docstring)."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, executor: Executor,
                 allocate: Callable[[Sequence, int], bool], greedy_accept: bool = True, draft_chain: bool = False):
        """`executor`: runs a model-based drafter (mtp, eagle3); `allocate(seq, num_tokens)`: the block manager's,
        for the positions a draft model computes its later drafts at; `greedy_accept`, `draft_chain`: switches
        spec_greedy_accept and spec_draft_chain."""
        self.config = config
        self.greedy_accept = greedy_accept
        self.draft_chain = draft_chain and greedy_accept and config.method in ("mtp", "eagle3")
        self.premade: dict[int, list[int]] = {}
        """spec_draft_chain: the drafts that the last verify step made on the device, by seq_id, for `propose`."""
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.executor = executor
        self.allocate = allocate
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max, self.k) \
            if config.method == "ngram" else None

    def room(self, seq: Sequence) -> int:
        """How many draft tokens seq may verify next step: 0 unless it is decoding and speculable; at most k, and
        no more than max_tokens and max_model_len leave for the drafts and the bonus token."""
        if seq.num_computed_tokens != seq.num_tokens - 1 or seq.num_computed_tokens < seq.num_prompt_tokens \
                or not speculable(seq):
            return 0
        room = self.max_model_len - seq.num_tokens - 1
        if seq.params.max_tokens is not None:
            room = min(room, seq.params.max_tokens - seq.num_output_tokens - 1)
        return max(0, min(self.k, room))

    def propose(self, running: list[Sequence], last_rows: list[StepRows]) -> None:
        """Set each running sequence's drafts for the next step ([] for one that does not speculate now).
        `last_rows`: the last step's sequences and their final positions (what a draft model reads). A sequence
        whose drafts the last verify step made on the device (`premade`) keeps them, cut to its room."""
        premade, self.premade = self.premade, {}
        for seq in running:
            seq.spec_token_ids = premade[seq.seq_id][: self.room(seq)] if seq.seq_id in premade else []
        if self.proposer is None:
            # (the chain wrote the draft model's K/V at those sequences' final positions already)
            self._propose_by_model([r for r in last_rows if r[0].seq_id not in premade])
        else:
            for seq in running:
                room = self.room(seq)
                if room:
                    seq.spec_token_ids = self.proposer.propose(seq.token_ids, room)
        for seq in running:
            if seq.grammar is not None and seq.spec_token_ids:
                seq.spec_token_ids = grammar_prefix(seq, seq.spec_token_ids)

    def _propose_by_model(self, last_rows: list[StepRows]) -> None:
        """A draft model (MTP, EAGLE-3): its K/V over every position the last step made final (so later drafts
        can attend to them: also for sequences that do not draft now), and the drafts of the sequences that may
        speculate."""
        entries = [(seq, start, offset, n) for seq, start, offset, n in last_rows
                   if seq.status == SequenceStatus.RUNNING and n > 0 and start + n == seq.num_computed_tokens]
        if not entries:
            return
        entries.sort(key=lambda e: e[3] != 1)  # one-row sequences first, as the attention kernels take them
        inp = DraftInput([], [], [], [], [], [])
        for seq, start, offset, n in entries:
            k = self.room(seq)
            # each draft after the first is computed one position further: those positions need blocks
            if k > 1 and not self.allocate(seq, start + n + k - 1):
                k = 1
            inp.rows.extend(range(offset, offset + n))
            inp.next_ids.extend(seq.token_at(p + 1) for p in range(start, start + n))
            inp.query_lens.append(n)
            inp.seq_lens.append(start + n)
            inp.block_tables.append(list(seq.block_table))
            inp.num_drafts.append(k)
        for (seq, *_), drafts in zip(entries, self.executor.propose_drafts(inp)):
            seq.spec_token_ids = drafts

    def prepare_chain(self, scheduled: list[ScheduledSeq]) -> bool:
        """Before a step is staged (switch spec_draft_chain): may its verify graph be followed by the draft chain
        (runner/draft_chain.py)? Only where every scheduled sequence verifies k drafts and is plain greedy; then
        each gets the blocks the chain's passes write to (positions up to start + 2k - 1; trimmed at receive).
        The runner still decides whether a graph fits."""
        k = self.k
        if not self.draft_chain or not scheduled or any(
                s.num_draft != k or s.seq.grammar is not None or not plain_greedy(s.seq) for s in scheduled):
            return False
        reach = [s.seq.num_computed_tokens + 2 * k for s in scheduled]
        return all(n <= self.max_model_len and self.allocate(s.seq, n) for s, n in zip(scheduled, reach))

    def keep_chain(self, verify: DeviceVerify, drafts: SampleResult, accepted: dict[int, int]) -> None:
        """At receive: the drafts the chain made after a verify step (row r * k + j: sequence r's j-th), for the
        sequences the step left unfinished (`accepted`, by seq_id); `propose` hands them out."""
        k = len(drafts.token_ids) // len(verify.seqs)
        for r, seq in enumerate(verify.seqs):
            if seq.seq_id in accepted:
                self.premade[seq.seq_id] = drafts.token_ids[r * k: (r + 1) * k]

    def verify(self, logits: torch.Tensor, scheduled: list[ScheduledSeq], sampler: Sampler) -> DeviceVerify:
        """Queue the acceptance of the scheduled drafts on the device. `logits`: the k_r + 1 rows of each
        sequence in `scheduled`, in order (the newest token's position first)."""
        seqs = [s.seq for s in scheduled]
        counts = [s.num_draft for s in scheduled]
        k_max = max(counts)
        if self.greedy_accept and all(s.grammar is None and plain_greedy(s) for s in seqs):
            # greedy acceptance needs nothing but each position's argmax: one launch and one copy, where the
            # rejection sampler below launches dozens of small kernels (a verify step's cost at batch 1)
            argmax = logits.argmax(dim=-1)
            sample = DeviceSample(argmax, [None] * len(argmax), None, None, None).start_host_copy()
            return DeviceVerify(seqs, counts, k_max + 1, sample, [s.draft for s in scheduled])
        device = logits.device
        row_seqs = [s.seq for s in scheduled for _ in range(s.num_draft + 1)]
        probs, source = sampler.target_distributions(logits, row_seqs, grammar_masks(scheduled, logits.shape[-1]))
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
        """Wait for a verify step's outcome: row r * width + j holds sequence r's j-th emitted token (its accepted
        drafts, then the drawn one, then -1)."""
        result = Sampler.to_host(verify.sample)
        if verify.drafts is None:
            return result
        tokens: list[int] = []
        start = 0
        for drafts in verify.drafts:  # the longest prefix equal to the argmax, then the argmax after it
            argmax = result.token_ids[start: start + len(drafts) + 1]
            n = 0
            while n < len(drafts) and drafts[n] == argmax[n]:
                n += 1
            tokens += drafts[:n] + [argmax[n]] + [-1] * (verify.width - n - 1)
            start += len(drafts) + 1
        none: list[None] = [None] * len(tokens)
        return SampleResult(tokens, none, none, None, None)
