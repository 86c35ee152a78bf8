"""The vision tower under tensor parallelism (model/vision/data_parallel.py): two real processes in a gloo group,
each with the whole (replicated) tower, encode a batch's items in shares and all-gather the features; both must end
with exactly what one process computes alone, in item order."""

from __future__ import annotations

import datetime
import multiprocessing
import socket

import torch
import torch.distributed as dist

from nanoserve.config import Optimizations
from nanoserve.model.vision.config import VisionConfig
from nanoserve.model.vision.data_parallel import assign_items, encode_data_parallel
from nanoserve.model.vision.model import M3VisionModel
from nanoserve.parallel_state import set_tp

CFG = VisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                   projector_hidden_size=40, text_hidden_size=24)
GRIDS = [(1, 4, 6), (6, 2, 2), (1, 2, 2), (1, 6, 6), (2, 2, 4)]
"""Two images, a video of 6 temporal patches (two segments), two more images: unequal shares."""


def inputs() -> tuple[M3VisionModel, torch.Tensor]:
    torch.manual_seed(0)
    model = M3VisionModel(CFG, Optimizations.reference())
    for p in model.parameters():
        p.copy_(0.1 * torch.randn(p.shape))
    pix = torch.randn(sum(t * h * w for t, h, w in GRIDS), CFG.patch_dim)
    return model, pix


def rank(init_method: str, r: int) -> torch.Tensor:
    """Join the two-rank group as rank r and encode the batch data-parallel."""
    dist.init_process_group("gloo", init_method=init_method, rank=r, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    set_tp(r, 2, dist.group.WORLD)
    model, pix = inputs()
    return encode_data_parallel(model, pix, GRIDS)


def peer(init_method: str) -> None:
    model, pix = inputs()
    got = rank(init_method, 1)
    dist.destroy_process_group()
    torch.testing.assert_close(got, model(pix, GRIDS), rtol=1e-6, atol=1e-6)  # a GEMM's rows may sum in another
    # order when the batch is smaller; nothing else may differ


def test_items_are_shared_by_size():
    assert assign_items([96, 24, 4, 36, 16], 2) == [[0], [1, 2, 3, 4]]
    assert assign_items([5, 5, 5], 4) == [[0], [1], [2], []]


def test_two_ranks_encode_what_one_does():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    other = multiprocessing.get_context("spawn").Process(target=peer, args=(init,), daemon=True)
    other.start()
    try:
        got = rank(init, 0)
    finally:
        set_tp(0, 1)
        if dist.is_initialized():
            dist.destroy_process_group()
        other.join(60)
        if other.is_alive():
            other.kill()
            other.join()
    model, pix = inputs()
    torch.testing.assert_close(got, model(pix, GRIDS), rtol=1e-6, atol=1e-6)
    assert other.exitcode == 0, "rank 1's gathered features differ from a one-process encode"
