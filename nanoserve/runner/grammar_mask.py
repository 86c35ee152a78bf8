"""Structured outputs on the device: the token bitmask the engine filled on the host (engine/structured_output.py)
applied to a step's logits - the tokens a constrained row's format forbids set to -inf, the sampler's first step.

On a GPU the mask goes up without waiting for the device: it is copied into one of two pinned host buffers used in
turn (`MaskUploader`), from which the copy to the device is queued on the stream; xgrammar's kernel then applies it
to every constrained row in one launch. An event recorded after each upload guards its buffer: refilling a buffer
waits for the upload queued from it two masks ago (long done in practice: the engine waited for a step between).
"""

from __future__ import annotations

from typing import Any

import torch

from nanoserve.step import GrammarMask


class MaskUploader:
    """Applies GrammarMasks to logits on their device (see the module docstring)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.buffers: list[torch.Tensor | None] = [None, None]
        self.events: list[Any] = [None, None]
        self.next = 0

    def apply(self, logits: torch.Tensor, mask: GrammarMask | None) -> torch.Tensor:
        """Set the forbidden tokens of the constrained rows of `logits` [S, V] to -inf, in place; returns logits."""
        if mask is None:
            return logits
        import xgrammar as xgr

        vocab = min(mask.vocab_size, logits.shape[-1])
        if logits.device.type != "cuda":
            xgr.apply_token_bitmask_inplace(logits, mask.bitmask, vocab_size=vocab, indices=mask.rows)
            return logits
        staged = self._pinned(mask.bitmask)
        on_device = staged.to(logits.device, non_blocking=True)
        self._uploaded()
        rows = torch.tensor(mask.rows, dtype=torch.int32).pin_memory().to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, on_device, vocab_size=vocab, indices=rows)
        return logits

    def _pinned(self, bitmask: torch.Tensor) -> torch.Tensor:
        """`bitmask` copied into the next pinned buffer (grown to fit), once that buffer's last upload is done."""
        slot = self.next
        if self.events[slot] is not None:
            self.events[slot].synchronize()
            self.events[slot] = None
        buf = self.buffers[slot]
        if buf is None or buf.shape[0] < bitmask.shape[0] or buf.shape[1] != bitmask.shape[1]:
            buf = self.buffers[slot] = torch.empty(bitmask.shape, dtype=bitmask.dtype, pin_memory=True)
        view = buf[: bitmask.shape[0]]
        view.copy_(bitmask)
        return view

    def _uploaded(self) -> None:
        """An upload from the current buffer was just queued: guard it, and use the other buffer next."""
        self.events[self.next] = torch.cuda.Event()
        self.events[self.next].record()
        self.next = 1 - self.next
