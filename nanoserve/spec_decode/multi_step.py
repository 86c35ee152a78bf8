"""Several speculative steps per launch (switch `spec_multi_step`, `EngineConfig.spec_steps_per_launch` = K).

On a small model a speculative step costs its host work more than its arithmetic: the host stages the inputs,
replays the verify graph and the draft chain's graph, waits for the tokens and appends them (about 1.1 ms of host
time per step for m3-mini on an H100, against a few hundred microseconds of device time). With the draft chain
(spec_decode/draft_chain.py) and the in-graph feed (GraphRunner._take_feed) everything a step needs is already on
the device after the step before it: the chain accepts from the verified argmax, drafts the next step and writes
its query (`next_ids`: the bonus token, then the drafts) and its first position (`next_pos`). So one graph can run
K steps back to back:

    for i in 0 .. K - 1:
        take the query: step 0 as the host staged it (or fed from the previous launch's chain), every later step
            from next_ids / next_pos, where step i - 1's chain left it
        the target's verify forward (k + 1 positions per sequence; logits, what the drafter keeps)
        the chain: accept, draft passes, next_ids / next_pos
        keep step i's verified ids and argmax ([K, tokens] static outputs)

The host stages once, replays once and copies the K steps' ids and argmax back with the last chain's drafts; it
applies the acceptance rule to each step in turn (spec_decode/verify.py) and appends all the tokens through the
stop checks, which drop the tokens past a stop. Each step's tokens are those one step per launch gives; only the
engine's view lags: a sequence's blocks cover the farthest K fully accepted steps and their drafts can reach
(`LLMEngine._spec_steps` reserves them, `Scheduler.accept_drafts` trims them), and the engine runs K steps only
where max_tokens and max_model_len leave room for all of them, nothing waits to be admitted and every sequence is
plain greedy with k drafts. A graph is keyed by (batch bucket, context bucket of the farthest position, k + 1).
Reference: the switch off, one speculative step per launch.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from nanoserve.runner.cuda_graphs import Replay

if TYPE_CHECKING:
    from nanoserve.batch import VerifyFeed
    from nanoserve.spec_decode.draft_chain import DraftChain

logger = logging.getLogger(__name__)


def reach(max_seq_len: int, query_len: int, steps: int) -> int:
    """The farthest context a launch of `steps` verify steps of query_len tokens reaches, the first at context
    max_seq_len: each later step starts at most query_len positions further, and the last chain drafts
    query_len - 2 positions past its step (DraftChain.run)."""
    return max_seq_len + (steps - 1) * query_len + query_len - 2


class MultiStep:
    """The multi-step graphs of one draft chain (see the module docstring)."""

    def __init__(self, chain: DraftChain, steps: int):
        target = chain.target
        self.chain, self.target, self.steps = chain, target, steps
        t, device = target.max_tokens, target.device
        # each step's verified input ids and the argmax of each verified position
        self.ids = torch.zeros(steps, t, dtype=torch.int64, device=device)
        self.argmax = torch.zeros(steps, t, dtype=torch.int64, device=device)
        self.graphs: dict[tuple[int, int, int], Replay] = {}
        self.disabled: str | None = None

    @torch.inference_mode()
    def run(self, input_ids: list[int], seq_lens: list[int], block_tables: list[list[int]], query_len: int,
            feed: VerifyFeed | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Stage one launch and replay its graph: (verified ids [K, n * q], argmax [K, n * q], the last chain's
        drafts [n, q - 1]), views of static buffers valid until the next replay; None where no graph fits (the
        caller runs one step)."""
        target, chain, n, q = self.target, self.chain, len(seq_lens), query_len
        farthest = reach(max(seq_lens), q, self.steps)
        if (self.disabled is not None or chain.disabled is not None or not target.feed_in_graph or q < 2
                or not target.fits(n, farthest, max(len(t) for t in block_tables), q)):
            return None
        bs, length = target.key(n, farthest)
        target.stage(input_ids, seq_lens, block_tables, bs, q, feed.rows if feed is not None else [])
        key = (bs, length, q)
        replay = self.graphs.get(key) or self._capture(key)
        if replay is None:
            return None
        replay()
        t = n * q
        return self.ids[:, :t], self.argmax[:, :t], chain.drafts[:n, : q - 1]

    def _capture(self, key: tuple[int, int, int]) -> Replay | None:
        """Warm up and capture one graph. The eager warm-up runs all K steps, which moves the staged inputs and
        the chain's next queries on: they are put back after it, run or failed, so the first replay (or the one
        step the caller runs instead) starts where the host staged it (the K/V it writes are the same values
        again)."""
        target, chain = self.target, self.chain
        fn = self._forward(*key)
        state = [target.i64, target.i32, target.feed, chain.next_ids, chain.next_pos]
        saved = [x.clone() for x in state]
        try:
            try:
                fn()
            finally:
                for x, y in zip(state, saved):
                    x.copy_(y)
            if target.device.type == "cuda":
                torch.cuda.synchronize(target.device)
            replay = target._capture(fn)
        except Exception as e:  # noqa: BLE001 - a failed capture must not take the engine down
            if target.device.type == "cuda":
                torch.cuda.synchronize(target.device)
            self.disabled = f"capture of batch {key[0]} / context {key[1]} / query length {key[2]} x " \
                            f"{self.steps} steps failed: {type(e).__name__}: {e}"
            logger.warning("multi-step speculative graphs disabled, one step per launch: %s", self.disabled,
                           exc_info=True)
            self.graphs.clear()
            return None
        self.graphs[key] = replay
        return replay

    def _forward(self, bs: int, length: int, q: int):
        target, chain, steps = self.target, self.chain, self.steps
        t = bs * q
        first = target._forward(bs, length, q)  # takes the staged feed, as a verify graph does
        later = target._forward(bs, length, q, take_feed=False)
        accept_and_draft = chain._forward(bs, length, q)
        verified, slots = target.i64[0, :t], target.i64[2, :t]
        ids, argmax = self.ids[:, :t], self.argmax[:, :t]
        # made before the capture and held by the closure (a replay keeps its function alive)
        rows = torch.arange(bs, device=target.device)
        real = torch.zeros(bs, dtype=torch.bool, device=target.device)

        def forward() -> None:
            real.copy_(slots.view(bs, q)[:, 0] >= 0)  # padding sequences write nothing and are never fed
            for i in range(steps):
                if i:
                    target._take_feed(bs, q, rows, real)  # sequence r's query where step i - 1's chain left it
                    later()
                else:
                    first()
                ids[i].copy_(verified)
                accept_and_draft()
                argmax[i].copy_(chain.argmax[:t])

        forward.key = ("multi", bs, length, q, steps)  # for the capture seam (logs, tests)
        return forward
