"""Verification: one target pass has scored each drafting sequence's k + 1 positions (its newest token, then its
k drafts); this turns their logits into the tokens the step emits - the accepted drafts, then one more.

    verify(...)     queue the acceptance on the device: the distributions the sampler would draw each position's
                    token from (`Sampler.target_distributions`: the structured-output mask of each position,
                    allowed_token_ids, logit_bias, temperature, top-k/p, min-p; one-hot at the argmax for a greedy
                    row), then the rule of spec_decode/rejection.py - greedy keeps the longest prefix equal to the
                    argmax, sampling keeps the target distribution exactly
    to_host(...)    wait for it: each sequence's emitted tokens, and the SampleResult their logprobs come from

Where every verifying sequence is plain greedy (switch spec_greedy_accept) the rule needs only each position's
argmax: one argmax is queued and the drafts are compared with it on the host, after the copy the step waits for
anyway - where the rejection sampler launches dozens of small kernels (a verify step's cost at batch 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoserve.runner.sampler import DeviceSample, Sampler, SampleResult, plain_greedy
from nanoserve.spec_decode.rejection import rejection_sample
from nanoserve.step import GrammarMask, StepSeq


@dataclass
class DeviceVerify:
    """A verify step's outcome, still on the device: row r * width + j of `sample` holds position j of sequence
    seqs[r] (width = max drafts + 1): its accepted drafts, then the drawn token, then -1."""

    seqs: list[StepSeq]
    width: int
    sample: DeviceSample
    greedy: bool = False
    """Accepted on the host (switch spec_greedy_accept): `sample` then holds the argmax of every verified position
    (sequence r's k_r + 1 rows in turn), and `to_host` compares each draft with it."""
    fed: DeviceSample | None = None
    """A step that took its queries on the device (async speculative decoding): the input ids it verified, copied
    back beside the argmax - the drafts `to_host` compares with it (the host's are placeholders)."""
    steps: int = 1
    """Greedy only: how many verify steps ran in one launch (spec_decode/multi_step.py); `sample` and `fed` then
    hold one block of rows per step, each laid out as one step's."""


def verify(logits: torch.Tensor, seqs: list[StepSeq], sampler: Sampler, mask: GrammarMask | None,
           greedy_accept: bool, fed_ids: torch.Tensor | None = None) -> DeviceVerify:
    """Queue the acceptance of `seqs`' drafts on the device. `logits`: the k_r + 1 rows of each sequence in turn
    (the newest token's position first); `mask`: the structured-output masks of those rows; `fed_ids`: the
    queries, where the step took them on the device (they are accepted greedily: the draft chain made them)."""
    counts = [s.num_draft for s in seqs]
    k_max = max(counts)
    if greedy_accept and mask is None and all(plain_greedy(s) for s in seqs):
        argmax = logits.argmax(dim=-1)
        sample = DeviceSample.of_tokens(argmax)
        fed = None if fed_ids is None else DeviceSample.of_tokens(fed_ids.clone())
        return DeviceVerify(seqs, k_max + 1, sample, greedy=True, fed=fed)
    if fed_ids is not None:
        raise RuntimeError("a verify step whose queries are on the device is accepted greedily only")
    device = logits.device
    row_seqs = [s for s in seqs for _ in range(s.num_draft + 1)]
    probs, source = sampler.target_distributions(logits, row_seqs, mask)
    offsets = [0]
    for n in counts[:-1]:
        offsets.append(offsets[-1] + n + 1)
    starts = torch.tensor(offsets, dtype=torch.int64).to(device)
    drafts = torch.tensor([s.draft + [0] * (k_max - s.num_draft) for s in seqs], dtype=torch.int64).to(device)
    num_drafts = torch.tensor(counts, dtype=torch.int64).to(device)
    uniforms = torch.empty(len(seqs), k_max, device=device)
    exponentials = torch.empty(len(seqs), probs.shape[-1], device=device)
    shared = [r for r, s in enumerate(seqs) if s.params.seed is None]
    if shared:  # one draw for the rows on the engine's generator, then each seeded row from its own
        idx = torch.tensor(shared, dtype=torch.int64).to(device)
        uniforms[idx] = torch.empty(len(shared), k_max, device=device).uniform_(generator=sampler.generator)
        exponentials[idx] = torch.empty(len(shared), probs.shape[-1], device=device).exponential_(
            generator=sampler.generator)
    for r, s in enumerate(seqs):
        if s.params.seed is not None:
            g = sampler.generator_for(s)
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
    return DeviceVerify(seqs, width, sample)


def to_host(verify: DeviceVerify) -> tuple[list[list[int]], list[list[int]] | None, SampleResult]:
    """Wait for a verify step's outcome: each sequence's emitted tokens (its accepted drafts, then the drawn one);
    for a launch of several steps, each sequence's accepted drafts per step (None for one step: its emitted tokens
    less one); and the draw on the host, whose row r * width + j is sequence r's j-th emitted token (for its
    logprobs)."""
    result = Sampler.to_host(verify.sample)
    if not verify.greedy:
        rows = [result.token_ids[r * verify.width: (r + 1) * verify.width] for r in range(len(verify.seqs))]
        return [[t for t in row if t >= 0] for row in rows], None, result
    fed = Sampler.to_host(verify.fed).token_ids if verify.fed is not None else None
    emitted: list[list[int]] = [[] for _ in verify.seqs]
    accepted: list[list[int]] = [[] for _ in verify.seqs]
    rows = len(result.token_ids) // verify.steps
    for step in range(verify.steps):  # (several: each step's queries are the one before's bonus token and drafts)
        start = step * rows
        for r, s in enumerate(verify.seqs):  # the longest prefix equal to the argmax, then the argmax after it
            argmax = result.token_ids[start: start + s.num_draft + 1]
            draft = s.draft if fed is None else fed[start + 1: start + s.num_draft + 1]
            n = 0
            while n < s.num_draft and draft[n] == argmax[n]:
                n += 1
            emitted[r] += draft[:n] + [argmax[n]]
            accepted[r].append(n)
            start += s.num_draft + 1
    return emitted, (accepted if verify.steps > 1 else None), result
