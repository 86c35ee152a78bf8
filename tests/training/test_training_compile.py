"""`training.train --compile` compiles each kind of decoder block once: M3Train.compile_blocks marks the batch and
sequence dimensions dynamic from the first step, so the packed short steps, the long steps (another batch and
length) and any other shape share one graph per kind of block (the dense first layer, the MSA+MoE layers, which
are identical and share theirs, and the MTP block), the sparse steps run eagerly, and nothing breaks the graphs.
Left to torch.compile's automatic dynamic shapes the same run compiled six graphs: each kind once for the first
shape and again, dynamic, at the first long step. Counted with the aot_eager backend (dynamo and AOTAutograd, the
forward and backward graphs, without inductor's code generation): how many graphs dynamo builds does not depend on
the device, and on a GPU each of them is seconds of inductor compiling before training goes on."""

from __future__ import annotations

import torch
import torch._dynamo
from torch._dynamo.utils import counters

from training.config import MINI
from training.model import M3Train
from training.train import losses

STEPS = [  # (batch, tokens, attention mode): the kinds of step train.py runs, at small shapes
    (4, 96, "dense"),  # packed chat / corpus windows (--batch x --seq)
    (2, 192, "dense"),  # a long step (--long-tokens / --long-seq windows of --long-seq)
    (4, 96, "dense"),
    (2, 192, "sparse"),  # a late long step through MSA's selection: eager (train.py's eager_modes)
    (3, 160, "dense"),  # a shape of neither (unpacked steps pad to their longest chat)
]


def train_steps(model: M3Train) -> list[list[float]]:
    """A few optimizer steps as train.py takes them (bf16 autocast, the three losses); the losses of each."""
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    g = torch.Generator().manual_seed(1)
    out = []
    for step, (b, t, mode) in enumerate(STEPS):
        ids = torch.randint(3, MINI.vocab_size, (b, t), generator=g)
        trains = (torch.rand(b, t, generator=g) < 0.7).float()
        torch.manual_seed(step)  # the indexer-KL rows: the same draw for both models
        with torch.autocast("cpu", dtype=torch.bfloat16):
            main, mtp, kl = losses(model, ids, trains, torch.full((b,), t), mode, kl_rows=64)
            loss = main + 0.3 * mtp + 0.5 * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        for moe in model.moe_layers():
            moe.update_bias(1e-3)
        out.append([main.item(), mtp.item(), kl.item()])
    return out


def test_compiled_training_builds_one_graph_per_kind_of_block():
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    compiled = M3Train(MINI)
    torch.manual_seed(0)
    eager = M3Train(MINI)
    compiled.compile_blocks(backend="aot_eager")
    compiled.eager_modes = {"sparse"}
    got = train_steps(compiled)
    frames, graphs = dict(counters["frames"]), dict(counters["aot_autograd"])
    breaks = dict(counters["graph_break"])
    want = train_steps(eager)
    torch._dynamo.reset()
    assert frames.get("ok") == 3 and frames.get("total") == 3, frames
    assert graphs.get("ok") == 3, graphs  # each a forward and a backward graph
    assert not breaks, breaks
    for step, (a, b) in enumerate(zip(got, want)):
        # aot_eager runs the eager model's operations (equal here); the bound leaves room for another summation order
        assert all(abs(x - y) <= 1e-5 * max(abs(y), 1.0) for x, y in zip(a, b)), (step, a, b)
