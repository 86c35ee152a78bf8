"""The vision tower under tensor parallelism: replicated weights, images spread over the ranks (vLLM's
`--mm-encoder-tp-mode data`).

Sharding a 1280-wide tower over 8 ranks would cost two all-reduces per layer for GEMMs too narrow to be worth
splitting; replicating it costs 1.7 GB of bf16 weights per rank (next to M3's ~50 GB per rank at TP 8) and no
communication inside the tower. Every rank holds the whole tower (model/vision/layers.py loads each tensor whole)
and, given the same batch, `encode_data_parallel` gives each rank a share of its items (whole images or whole
videos, balanced by patch count, the same plan on every rank), encodes that share, and all-gathers the features
so every rank ends with the whole batch's features in item order - what each rank's embedding needs, since the
embedding output is replicated after its all-reduce.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from nanoserve.model.vision.model import M3VisionModel
from nanoserve.parallel_state import get_tp


def assign_items(sizes: list[int], ranks: int) -> list[list[int]]:
    """Item indices per rank: the largest item first, each to the least-loaded rank (ties: the lowest rank), each
    rank's items then in item order. Deterministic, so every rank computes the same plan."""
    load = [0] * ranks
    plan: list[list[int]] = [[] for _ in range(ranks)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        plan[r].append(i)
        load[r] += sizes[i]
    return [sorted(items) for items in plan]


@torch.inference_mode()
def encode_data_parallel(vision: M3VisionModel, pixel_values: torch.Tensor,
                         grid_thw: list[tuple[int, int, int]] | torch.Tensor) -> torch.Tensor:
    """`vision(pixel_values, grid_thw)` with the items spread over the tensor-parallel group (every rank calls it
    with the same batch; at one rank it is the plain call). Returns the whole batch's features on every rank."""
    tp = get_tp()
    if tp.size == 1:
        return vision(pixel_values, grid_thw)
    grids = [tuple(g) for g in (grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else grid_thw)]
    rows = [t * h * w for t, h, w in grids]
    tokens = vision.tokens_per_item(grids)
    row_start = [sum(rows[:i]) for i in range(len(rows))]
    plan = assign_items(rows, tp.size)
    mine = plan[tp.rank]
    hidden = vision.cfg.text_hidden_size
    if mine:
        pix = torch.cat([pixel_values[row_start[i]:row_start[i] + rows[i]] for i in mine])
        features = vision(pix, [grids[i] for i in mine])
    else:
        features = torch.empty(0, hidden, dtype=vision.dtype, device=pixel_values.device)
    counts = [sum(tokens[i] for i in items) for items in plan]
    padded = torch.zeros(max(counts), hidden, dtype=features.dtype, device=features.device)
    padded[:features.shape[0]] = features
    gathered = [torch.empty_like(padded) for _ in range(tp.size)]
    dist.all_gather(gathered, padded, group=tp.group)
    token_start = [sum(tokens[:i]) for i in range(len(tokens))]
    out = torch.empty(sum(tokens), hidden, dtype=features.dtype, device=features.device)
    for r, items in enumerate(plan):
        at = 0
        for i in items:
            out[token_start[i]:token_start[i] + tokens[i]] = gathered[r][at:at + tokens[i]]
            at += tokens[i]
    return out
