"""The encoder cache, as the scheduler keeps its books: which images' and videos' features the runner holds, who
uses them, and what the vision model may encode in one step (vLLM's EncoderCacheManager and encoder budget).

The features themselves live on the runner's device (runner/multimodal.py), one tensor per key; this module only
counts them, in feature rows (one per placeholder token):

- `budget` rows may be encoded per step (the encoder's share of a step, as the token budget is the text model's);
- at most `size` rows are held at once. An entry stays while a running sequence still has placeholders of it to
  compute; after that it is kept, least recently used first out, until a new entry needs its room - so the same
  image sent again (the same content hash, `MultiModalFeature.identifier`) is found here and not encoded twice.
  An evicted key is handed to the runner with the next step (`take_freed`), which drops its tensor first.

With switch `encoder_cache` off (the reference), entries are never shared nor kept: each sequence's items are
encoded for it under a key of their own and dropped once its prefill has passed them.
"""

from __future__ import annotations

from collections import OrderedDict

from nanoserve.engine.sequence import Sequence
from nanoserve.step import MultiModalFeature


class EncoderCacheManager:
    """The books of the runner's encoder cache (see the module docstring)."""

    def __init__(self, size: int, budget: int, share: bool = True):
        self.size = size
        self.budget = budget
        self.share = share
        self.rows: dict[str, int] = {}  # key -> feature rows, for every entry the runner holds
        self.users: dict[str, set[int]] = {}  # key -> seq_ids that still need it (entries in use)
        self.unused: OrderedDict[str, None] = OrderedDict()  # held, needed by nobody; least recently used first
        self.freed: list[str] = []  # evicted since the last step: the runner drops them
        self.held = 0  # rows held
        self.hits = 0  # items a sequence found here instead of encoding them
        self.encoded = 0  # items encoded

    def key(self, seq: Sequence, feature: MultiModalFeature) -> str:
        """The key a sequence's item is kept under: its content hash (one entry for every sequence that sends the
        same item), or with sharing off one of the sequence's own."""
        return feature.identifier if self.share else f"{feature.identifier}:{seq.seq_id}"

    def fits(self, feature: MultiModalFeature) -> bool:
        """Could this item ever be encoded (its rows within the step budget and the cache)?"""
        return feature.num_tokens <= min(self.size, self.budget)

    # -- scheduling --------------------------------------------------------------------------------------------
    def use_cached(self, seq: Sequence, feature: MultiModalFeature) -> bool:
        """If the item's features are held, count seq among their users and say so (nothing to encode)."""
        key = self.key(seq, feature)
        if key not in self.rows:
            return False
        users = self.users.setdefault(key, set())
        if seq.seq_id not in users:
            users.add(seq.seq_id)
            self.unused.pop(key, None)
            self.hits += 1
        return True

    def can_encode(self, feature: MultiModalFeature, budget_left: int, pending: int = 0) -> bool:
        """Does the item fit what is left of this step's encoder budget, and the cache once every unused entry is
        evicted (beside `pending` rows planned before it and not entered yet)?"""
        n = feature.num_tokens
        reclaimable = sum(self.rows[k] for k in self.unused)
        return n <= budget_left and self.held - reclaimable + pending + n <= self.size

    def allocate(self, seq: Sequence, feature: MultiModalFeature) -> str:
        """Make room (evicting unused entries, oldest first) and enter the item for seq; returns its key."""
        key, n = self.key(seq, feature), feature.num_tokens
        while self.held + n > self.size:
            if not self.unused:
                raise RuntimeError(f"encoder cache: no room for {n} rows ({self.held} of {self.size} in use)")
            old, _ = self.unused.popitem(last=False)
            self._drop(old)
        self.rows[key] = n
        self.users[key] = {seq.seq_id}
        self.held += n
        self.encoded += 1
        return key

    # -- releasing ----------------------------------------------------------------------------------------------
    def release(self, seq: Sequence, feature: MultiModalFeature) -> None:
        """seq needs the item no more (its prefill has passed its placeholders)."""
        self._release(seq.seq_id, self.key(seq, feature))

    def release_all(self, seq: Sequence) -> None:
        """seq needs none of its items (finished, aborted or preempted)."""
        for feature in seq.mm_features:
            self._release(seq.seq_id, self.key(seq, feature))

    def _release(self, seq_id: int, key: str) -> None:
        users = self.users.get(key)
        if users is None or seq_id not in users:
            return
        users.discard(seq_id)
        if users:
            return
        del self.users[key]
        if self.share:
            self.unused[key] = None  # kept for a later request with the same item, until its room is needed
        else:
            self._drop(key)

    def _drop(self, key: str) -> None:
        self.held -= self.rows.pop(key)
        self.unused.pop(key, None)
        self.freed.append(key)

    def take_freed(self) -> list[str]:
        """The keys evicted since the last call: the runner drops their features before the step's encoding."""
        freed, self.freed = self.freed, []
        return freed

    def check_integrity(self) -> None:
        """Every held entry is either in use or unused, never both; the row count adds up."""
        if self.held != sum(self.rows.values()) or self.held > self.size:
            raise AssertionError(f"encoder cache holds {self.held} rows by its count, {sum(self.rows.values())} "
                                 f"by its entries (size {self.size})")
        for key in self.rows:
            if (key in self.users) == (key in self.unused):
                raise AssertionError(f"encoder cache entry {key}: in use and unused at once, or neither")
