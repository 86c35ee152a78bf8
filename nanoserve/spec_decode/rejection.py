"""The acceptance rule of speculative decoding, for a batch of drafts at once, on the device.

A sequence drafted d_1..d_k; one target pass scored its k + 1 positions, giving the target's distributions
p_0..p_k (p_j: the next token after d_1..d_j), each the distribution the sampler would draw from (temperature,
top-k/p, min-p applied; a greedy row's is one-hot at its argmax). Walking j = 1..k, d_j is accepted with
probability min(1, p_{j-1}(d_j) / q_j(d_j)) (q_j: the drafter's distribution; a deterministic drafter such as
ngram has q_j one-hot at d_j, so the test is u < p_{j-1}(d_j)). At the first rejection the token is drawn from
the residual max(0, p_{j-1} - q_j), renormalised; if all k are accepted a bonus token is drawn from p_k. This
is the rule of Leviathan et al. (2023) and Chen et al. (2023): every emitted token is distributed exactly as the
target model alone would draw it. For a greedy row it reduces to "accept the longest prefix of the draft that
equals the target's argmax, then the argmax", so greedy output with speculation equals greedy output without.

The random numbers come in as tensors (uniforms for the tests, Exp(1) samples for the final draw, which is an
exponential race as in runner/sampler.py), so a caller draws them from each request's own generator and a test
from a fixed one.
"""

from __future__ import annotations

import torch


def rejection_sample(target_probs: torch.Tensor, starts: torch.Tensor, draft_ids: torch.Tensor,
                     num_drafts: torch.Tensor, uniforms: torch.Tensor, exponentials: torch.Tensor,
                     draft_probs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept or reject R rows of drafts.

    target_probs  [N, V] the target's distributions, row r's k_r + 1 positions at starts[r] .. starts[r] + k_r
    starts        [R] int64
    draft_ids     [R, K] int64, row r's drafts in its first num_drafts[r] entries (the rest: any valid id)
    num_drafts    [R] int64, k_r (0 <= k_r <= K)
    uniforms      [R, K] U[0, 1) for the accept tests
    exponentials  [R, V] Exp(1) for the final draw
    draft_probs   [R, K, V] the drafter's distributions q_j, or None: a deterministic drafter (q_j one-hot at d_j)

    Returns tokens [R, K + 1] (row r: its accepted drafts, then the drawn token, then -1) and num_accepted [R].
    """
    num_rows, k_max = draft_ids.shape
    device = draft_ids.device
    rows = torch.arange(num_rows, device=device)
    pos = torch.arange(k_max, device=device)[None, :]
    valid = pos < num_drafts[:, None]
    # p_{j-1}(d_j): the target's probability of each draft token where it was proposed
    flat = (starts[:, None] + pos).clamp(max=target_probs.shape[0] - 1)
    p_draft = target_probs[flat, draft_ids]
    if draft_probs is None:
        accept = uniforms < p_draft
    else:
        q_draft = draft_probs.gather(2, draft_ids[..., None])[..., 0]
        accept = uniforms * q_draft < p_draft
    accept &= valid
    num_accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)
    # the token after the accepted drafts: from the residual where a draft was rejected, else the bonus from p_k
    p_next = target_probs[starts + num_accepted]
    rejected = num_accepted < num_drafts
    at = num_accepted.clamp(max=max(k_max - 1, 0))
    if k_max == 0:
        residual = p_next
    elif draft_probs is None:
        residual = p_next.scatter(1, draft_ids[rows, at][:, None], 0.0)
    else:
        residual = (p_next - draft_probs[rows, at]).clamp(min=0.0)
    residual = torch.where(rejected[:, None], residual, p_next)
    # a residual of no mass can only come from rounding (p == q): fall back to p itself
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p_next)
    drawn = (residual / exponentials).argmax(dim=-1)
    tokens = torch.full((num_rows, k_max + 1), -1, dtype=torch.int64, device=device)
    tokens[:, :k_max] = torch.where(pos < num_accepted[:, None], draft_ids, -1)
    tokens[rows, num_accepted] = drawn
    return tokens, num_accepted
