"""Prompt logprobs: for every prompt token after the first, its log-probability under the model given the tokens
before it, its rank in the vocabulary, and the top-N alternatives (SamplingParams.prompt_logprobs = N).

The model runner computes the LM head on the prompt rows of the requests that asked for them (only those) and
returns those logits beside the sampling rows'. The logits at prompt position p predict token p + 1, so a prefill
chunk covering positions [start, end) yields the logprobs of prompt tokens start + 1 .. end (token `end` only if
it is still a prompt token: the last prompt position's logits are the ones the first output token is drawn from).

Like the sampler, this is split in two for overlap scheduling: `compute` queues the work on the device (no wait),
`to_host` waits and builds the per-position dicts. The values are of the raw logits (no sampling step touches
them), log-softmaxed unless the engine's logprobs_mode reports logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoserve.step import PromptLogprobEntry, PromptLogprobRows


@dataclass
class DevicePromptLogprobs:
    """A step's prompt logprobs, still on the device (see `compute`)."""

    rows: list[PromptLogprobRows]
    targets: list[int]  # per row, the prompt token whose logprob it gives
    target_logprob: torch.Tensor  # [K]
    target_rank: torch.Tensor  # [K] 1 = the most likely token
    top_logprobs: torch.Tensor | None  # [K, k], k = the largest num_top of the step
    top_ids: torch.Tensor | None


ROW_SLICE = 1024
"""Rows log-softmaxed and ranked at a time: each slice's fp32 temporaries are [ROW_SLICE, V], not [K, V]."""


def compute(logits: torch.Tensor, rows: list[PromptLogprobRows], targets: list[int], as_logits: bool = False
            ) -> DevicePromptLogprobs:
    """logits [K, V] (K = sum of the rows' counts, in order) -> the logprob and rank of each target token and the
    top-k, queued on the device, ROW_SLICE rows at a time. `as_logits`: report the logits themselves
    (logprobs_mode *_logits)."""
    idx = torch.tensor(targets, dtype=torch.long)
    if logits.device.type == "cuda":
        idx = idx.pin_memory().to(logits.device, non_blocking=True)
    k = min(max((r.num_top for r in rows), default=0), logits.shape[-1])
    temps = None
    if any(r.temperature not in (None, 1.0) for r in rows):  # each row's prompt_logprobs_temperature
        temps = torch.tensor([r.temperature or 1.0 for r in rows for _ in range(r.count)], dtype=torch.float32)
        temps = temps.to(logits.device)
    parts: list[tuple] = []
    for lo in range(0, logits.shape[0], ROW_SLICE):
        values = logits[lo:lo + ROW_SLICE].float()
        if temps is not None:
            values = values / temps[lo:lo + ROW_SLICE, None]
        if not as_logits:
            values = torch.log_softmax(values, dim=-1)
        target = values.gather(1, idx[lo:lo + ROW_SLICE, None])[:, 0]
        # rank as vLLM counts it: 1 + the number of tokens strictly more likely
        rank = (values > target[:, None]).sum(dim=-1) + 1
        parts.append((target, rank) + (values.topk(k, dim=-1) if k else (None, None)))
    target, rank = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    top_vals = torch.cat([p[2] for p in parts]) if k else None
    top_ids = torch.cat([p[3] for p in parts]) if k else None
    return DevicePromptLogprobs(rows, targets, target, rank, top_vals, top_ids)


def to_host(dev: DevicePromptLogprobs) -> dict[int, list[PromptLogprobEntry]]:
    """Wait for `dev` and build, per sequence id, (prompt position, [(token id, logprob, rank)]) pairs: the prompt
    token first, then its top-N alternatives (the engine adds each token's text)."""
    target_lp = dev.target_logprob.tolist()
    target_rank = dev.target_rank.tolist()
    top_vals = dev.top_logprobs.tolist() if dev.top_logprobs is not None else None
    top_ids = dev.top_ids.tolist() if dev.top_ids is not None else None
    out: dict[int, list[PromptLogprobEntry]] = {}
    row = 0
    for r in dev.rows:
        entries = out.setdefault(r.seq_id, [])
        for j in range(r.count):
            token = dev.targets[row]
            ranked = [(token, target_lp[row], target_rank[row])]
            seen = {token}
            for rank in range(r.num_top):
                alt = top_ids[row][rank]
                if alt not in seen:
                    seen.add(alt)
                    ranked.append((alt, top_vals[row][rank], rank + 1))
            entries.append((r.first_token + j, ranked))
            row += 1
    return out
