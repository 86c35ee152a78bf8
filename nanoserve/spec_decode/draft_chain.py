"""The next step's drafts of a draft model (MTP or EAGLE-3), made on the device right after a greedy verify step
(switch `spec_draft_chain`).

Without it, a speculative step with a draft model synchronises with the device twice: once for the verify step's
tokens (the engine's receive), and once in the next step's `DraftRunner.propose`, which runs the draft layer's
passes from the accepted tokens and reads the drafts back before the next verify step can be staged. The device
idles while the host decides acceptance, builds the draft input and stages each pass.

For a verify step whose sequences are all plain greedy with k drafts each (replayed as a CUDA graph of q = k + 1
tokens per sequence), everything that proposal needs is already on the device, in the verify graph's static
buffers: the verified input ids (each sequence's newest token, then its drafts), the logits of every position,
what the drafter reads of each position (`kept`), the positions, slots and block tables. So one more graph, keyed
by (batch bucket, context bucket, q) and replayed right after the verify graph, does it there:

1. accept: each position's argmax; sequence s keeps the longest prefix of its drafts equal to the argmax before
   each (`num_accepted`, the same rule the host applies to the same argmax: engine/speculative.py);
2. the draft layer's first pass over all q verified positions (EAGLE-3: its fc over the kept taps first), with each
   position's argmax as the token after it: at every position up to the last accepted one P that is the true next
   token (an accepted draft equals the argmax before it, and the argmax at P is the bonus token), so the draft K/V
   written there is final and the output at P gives the first draft. Rows past P hold rejected positions: their K/V
   is garbage that the passes below and the next step overwrite before anything reads it, as for the target's
   rejected positions;
3. the k - 1 one-token passes at positions P + 1 .. P + k - 1, whose positions, slots and context lengths are
   computed on the device from P (padding sequences, slot -1 in the verify step, write nothing).

The drafts come back with one copy, which the engine's receive waits for beside the verify step's tokens; the next
step then skips `propose` for those sequences. Their blocks cover positions up to P + k - 1 <= start + 2k - 1:
the engine allocates them before the verify step is staged (`Speculator.prepare_chain`) and trims them at
receive, like the rejected positions' blocks.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from nanoserve.batch import AttentionMetadata
from nanoserve.runner.cuda_graphs import GraphRunner, Replay

if TYPE_CHECKING:
    from nanoserve.spec_decode.drafter import DraftRunner

logger = logging.getLogger(__name__)


class DraftChain:
    """The chain graphs of one draft model over one target GraphRunner (see the module docstring)."""

    def __init__(self, draft: DraftRunner, target: GraphRunner):
        self.draft, self.target = draft, target
        device, n = target.device, target.max_bs
        k = max(1, target.max_query_len - 1)
        # the one-token passes' positions and slots [2, bs], query starts and context lengths [2 bs + 1], written
        # on the device inside the graph; the drafts [bs, k] its output
        self.i64 = torch.zeros(2, n, dtype=torch.int64, device=device)
        self.i32 = torch.zeros(2 * n + 1, dtype=torch.int32, device=device)
        self.drafts = torch.zeros(n, k, dtype=torch.int64, device=device)
        self.argmax = torch.zeros(target.max_tokens, dtype=torch.int64, device=device)  # each verified row's
        # what the next verify step takes on the device when it is launched before this one's tokens reach the
        # host (async scheduling): each sequence's next input ids - the bonus token, then the drafts - and the
        # position of the first of them (one past the last accepted one); the target's buffers, which its verify
        # graphs read themselves with switch spec_feed_in_graph
        self.next_ids, self.next_pos = target.next_ids, target.next_pos
        self.graphs: dict[tuple[int, int, int], Replay] = {}
        self.disabled: str | None = None

    def run(self, n: int, query_len: int, max_seq_len: int) -> torch.Tensor | None:
        """After the target's verify graph of n sequences x query_len tokens (max_seq_len: their longest context
        after it) replayed: each sequence's query_len - 1 drafts for the next step [n, k] (a view of the static
        output, valid until the next replay), or None where no chain graph fits (the next step proposes as usual)."""
        target = self.target
        reach = max_seq_len + query_len - 2  # the last draft pass's context: positions up to start + 2k - 1
        if self.disabled is not None or query_len < 2 or not target.fits(n, reach, 0, query_len):
            return None
        bs, length = target.key(n, reach)
        key = (bs, length, query_len)
        replay = self.graphs.get(key) or self._capture(key)
        if replay is None:
            return None
        replay()
        return self.drafts[:n, : query_len - 1]

    def _capture(self, key: tuple[int, int, int]) -> Replay | None:
        """Warm up and capture one chain graph over this step's buffers (its K/V writes are idempotent)."""
        fn = self._forward(*key)
        try:
            fn()
            if self.target.device.type == "cuda":
                torch.cuda.synchronize(self.target.device)
            replay = self.target._capture(fn)
        except Exception as e:  # noqa: BLE001 - a failed capture must not take the engine down
            if self.target.device.type == "cuda":
                torch.cuda.synchronize(self.target.device)
            self.disabled = f"capture of batch {key[0]} / context {key[1]} / query length {key[2]} failed: " \
                            f"{type(e).__name__}: {e}"
            logger.warning("draft chain graphs disabled, the drafts are proposed at each step's start: %s",
                           self.disabled, exc_info=True)
            self.graphs.clear()
            return None
        self.graphs[key] = replay
        return replay

    def _forward(self, bs: int, length: int, q: int):
        target, draft = self.target, self.draft
        t, k, block = bs * q, q - 1, target.block_size
        verified, meta = target.static_inputs(bs, length, q)  # the verify step's inputs, as its graph read them
        logits, kept, tables = target.logits[:t], target.kept[:t], target.tables[:bs]
        combine = getattr(draft.drafter, "combine", None)  # EAGLE-3: its fc over the taps the graph kept
        positions, slots, starts, lens = self.i64[0, :bs], self.i64[1, :bs], self.i32[: bs + 1], \
            self.i32[bs + 1: 2 * bs + 1]
        one = AttentionMetadata(positions=positions, query_start_loc=starts, seq_lens=lens, block_tables=tables,
                                slot_mapping=slots, block_size=block, max_query_len=1, max_seq_len=length,
                                num_decode_seqs=bs, query_lens_cpu=[1] * bs, seq_lens_cpu=[length] * bs)
        drafts, next_ids, next_pos, argmax_out = self.drafts[:bs], self.next_ids[:bs, :q], self.next_pos[:bs], \
            self.argmax[:t]
        # made before the capture and held by the closure (a replay keeps its function alive)
        rows = torch.arange(bs, device=target.device)
        query_starts = torch.arange(bs + 1, dtype=torch.int32, device=target.device)
        last_block = tables.shape[1] - 1

        def forward() -> None:
            argmax = torch.argmax(logits, dim=-1, out=argmax_out)
            guess = verified.view(bs, q)[:, 1:]  # each sequence's drafts
            accepted = (guess == argmax.view(bs, q)[:, :-1]).to(torch.int64).cumprod(dim=1).sum(dim=1)
            out, carry = draft._step(argmax, combine(kept) if combine is not None else kept, meta)
            last = rows * q + accepted
            carry = carry[last]
            token = draft._tokens(out[last])
            drafts[:, 0].copy_(token)
            at = meta.positions.view(bs, q)[:, 0] + accepted  # P: the last accepted position
            next_ids[:, 0].copy_(argmax.view(bs, q).gather(1, accepted[:, None])[:, 0])  # the bonus token, at P + 1
            next_pos.copy_(at + 1)
            real = meta.slot_mapping.view(bs, q)[:, 0] >= 0  # padding sequences write nothing
            starts.copy_(query_starts)
            for j in range(1, k):
                pos = at + j
                positions.copy_(pos)
                lens.copy_(pos + 1)
                page = tables.gather(1, (pos // block).clamp(max=last_block)[:, None])[:, 0].to(torch.int64)
                slots.copy_(torch.where(real, page * block + pos % block, torch.full_like(pos, -1)))
                out, carry = draft._step(token, carry, one)
                token = draft._tokens(out)
                drafts[:, j].copy_(token)
            next_ids[:, 1:].copy_(drafts)

        forward.key = ("chain", bs, length, q)  # for the capture seam (logs, tests)
        return forward
