"""Paged KV memory: a pool of fixed-size blocks, reference counts, and a prefix cache.

Every sequence owns a block table (a list of block ids). Blocks are handed out on demand as sequences grow, so a
sequence holds only ceil(tokens / block_size) blocks instead of max_model_len worth (the paged_kv switch; off,
the scheduler reserves max_model_len up front).

Prefix caching: once a block is full, its content is identified by a hash chained over the whole prefix
(sha256 of the parent block's hash + this block's token ids), so equal hashes mean equal prefixes. A new sequence
whose first blocks hash to cached blocks shares them (ref_count > 1) instead of recomputing them. The last prompt
token is always recomputed, since its logits are needed. Freed blocks keep their content and hash: they sit in
the free list in LRU order and are only "evicted" (hash dropped) when the pool hands them out again, so a later
request can still revive them. Blocks without a hash go to the front of the free list (reused first).

A request's `cache_salt` (vLLM's field) starts its chain from a hash of the salt instead of nothing, so only
requests that know the same salt share blocks: one tenant cannot learn from timing what another's prompts hold.

Images and videos: a block that holds placeholder tokens of an item adds the item's content hash to its own hash
(vLLM's extra keys), since the placeholders are the same tokens whatever the picture - the same prompt with another
image never hits, the same image again does.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from nanoserve.engine.sequence import Sequence

EventHook = Callable[..., None]


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None  # set once the block is full and registered in the prefix cache
    # the hash's inputs, kept to verify hits: a hit must match both, so even a hash collision cannot hand out
    # a block computed after a different prefix or holding different tokens
    parent: bytes | None = None
    token_ids: tuple[int, ...] | None = None
    extra: tuple[str, ...] = ()  # the content hashes of the images / videos with placeholders in it


def salt_root(salt: str | None) -> bytes | None:
    """Where a sequence's hash chain starts: nothing, or a hash of its cache_salt."""
    return None if salt is None else hashlib.sha256(b"cache_salt\0" + salt.encode()).digest()


def chain_hash(parent: bytes | None, token_ids: list[int] | tuple[int, ...], extra: tuple[str, ...] = ()) -> bytes:
    """sha256(parent hash || token ids as int64 [|| the images' content hashes]): equal hashes <=> equal prefixes
    (collisions are not a concern)."""
    h = hashlib.sha256(parent or b"")
    h.update(array("q", token_ids).tobytes())
    if extra:
        h.update(b"\0mm\0" + "\0".join(extra).encode())
    return h.digest()


def block_extra_keys(seq: Sequence, index: int, block_size: int) -> tuple[str, ...]:
    """The content hashes of seq's images and videos with placeholders in its block `index` (in prompt order)."""
    if not seq.mm_features:
        return ()
    start, end = index * block_size, (index + 1) * block_size
    return tuple(f.identifier for f in seq.mm_features if f.offset < end and f.end > start)


class BlockManager:
    """Allocates KV blocks to sequences, shares cached prefix blocks, and evicts them in LRU order (all O(1))."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 on_event: EventHook | None = None):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # front = next out
        self.cached: dict[bytes, int] = {}  # hash -> block id
        self.tables: dict[int, list[int]] = {}  # seq_id -> that sequence's block table (same list object)
        self._hashes: dict[int, list[bytes]] = {}  # seq_id -> hashes of its registered full blocks
        self.on_event = on_event or (lambda *a, **k: None)

    # -- queries ------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by running sequences (free cached blocks count as free)."""
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def computed_blocks(self, seq: Sequence) -> list[int]:
        """The cached blocks matching the longest prefix of seq's tokens, leaving at least the last token to
        compute. Takes no references (see allocate). Nothing for a sequence that still needs prompt logprobs (the
        prefix must be recomputed to have logits)."""
        if not self.enable_prefix_caching or seq.needs_prompt_logprobs:
            return []
        tokens = seq.token_ids
        hits: list[int] = []
        parent = salt_root(seq.cache_salt)
        for i in range((len(tokens) - 1) // self.block_size):
            chunk = tokens[i * self.block_size: (i + 1) * self.block_size]
            extra = block_extra_keys(seq, i, self.block_size)
            h = chain_hash(parent, chunk, extra)
            block_id = self.cached.get(h)
            if block_id is None or not self._holds(block_id, parent, chunk, extra):
                break
            hits.append(block_id)
            parent = h
        return hits

    def can_allocate(self, seq: Sequence, num_tokens: int, computed: list[int] | None = None) -> bool:
        """Would allocate(seq, num_tokens, computed) succeed?"""
        return self._blocks_to_take(seq, num_tokens, computed or []) <= len(self.free)

    def _blocks_to_take(self, seq: Sequence, num_tokens: int, computed: list[int]) -> int:
        have = len(self.tables.get(seq.seq_id, [])) + len(computed)
        revived = sum(1 for b in computed if self.blocks[b].ref_count == 0)  # free cached blocks come off the list
        return max(0, self.blocks_needed(num_tokens) - have) + revived

    # -- allocation ---------------------------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_tokens: int, computed: list[int] | None = None) -> bool:
        """Grow seq's block table to cover num_tokens tokens, first attaching the prefix-cache hits `computed`
        (only when the table is empty). All or nothing: returns False and changes nothing if blocks run short."""
        computed = computed or []
        table = self.tables.setdefault(seq.seq_id, seq.block_table)
        if computed and table:
            raise RuntimeError("prefix-cache blocks can only be attached to an empty block table")
        if self._blocks_to_take(seq, num_tokens, computed) > len(self.free):
            if not table:
                del self.tables[seq.seq_id]
            return False
        if computed:
            for b in computed:
                self._take(b)
            table.extend(computed)
            self._hashes[seq.seq_id] = [self.blocks[b].hash for b in computed]  # type: ignore[misc]
            self.on_event("prefix_hit", seq=seq, blocks=list(computed), tokens=len(computed) * self.block_size)
        new = []
        while len(table) < self.blocks_needed(num_tokens):
            block_id = next(iter(self.free))
            self._evict_if_cached(block_id)
            self._take(block_id)
            table.append(block_id)
            new.append(block_id)
        if new:
            self.on_event("allocate", seq=seq, blocks=new)
        return True

    def free_seq(self, seq: Sequence) -> None:
        """Release seq's blocks. Blocks go back in reverse order so a prefix's tail is evicted before its head."""
        table = self.tables.pop(seq.seq_id, None)
        self._hashes.pop(seq.seq_id, None)
        if table is None:
            return
        for block_id in reversed(table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
                if block.hash is None:
                    self.free.move_to_end(block_id, last=False)
        self.on_event("free", seq=seq, blocks=list(table))
        table.clear()

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back seq's blocks past the first `num_tokens` tokens: speculative decoding allocated room for
        every draft token, and the rejected ones' slots hold nothing to keep. Those blocks were never full of
        computed tokens, so none is cached or shared."""
        table = self.tables.get(seq.seq_id)
        keep = self.blocks_needed(num_tokens)
        if not table or len(table) <= keep:
            return
        dropped = table[keep:]
        del table[keep:]
        for block_id in reversed(dropped):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
                if block.hash is None:
                    self.free.move_to_end(block_id, last=False)
        self.on_event("free", seq=seq, blocks=dropped)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register seq's full, computed blocks in the prefix cache (call after each step)."""
        if not self.enable_prefix_caching:
            return
        hashes = self._hashes.setdefault(seq.seq_id, [])
        table = self.tables.get(seq.seq_id, [])
        # pending tokens (async scheduling) are computed but not yet known: their blocks are hashed once they are
        full = min(min(seq.num_computed_tokens, seq.num_known_tokens) // self.block_size, len(table))
        tokens = None
        cached = []
        while len(hashes) < full:
            i = len(hashes)
            tokens = tokens or seq.token_ids
            chunk = tuple(tokens[i * self.block_size: (i + 1) * self.block_size])
            parent = hashes[-1] if hashes else salt_root(seq.cache_salt)
            extra = block_extra_keys(seq, i, self.block_size)
            h = chain_hash(parent, chunk, extra)
            block = self.blocks[table[i]]
            if block.hash is None and h not in self.cached:
                block.hash, block.parent, block.token_ids, block.extra = h, parent, chunk, extra
                self.cached[h] = block.block_id
                cached.append((h, parent, chunk, extra))
            hashes.append(h)
            # else: another sequence computed the same prefix concurrently; the first copy stays the cached one
        if cached:  # (hash, parent hash, token ids, image hashes) of each block that entered the cache: KV events
            self.on_event("cache", seq=seq, cached=cached)

    # -- internals ----------------------------------------------------------------------------------------
    def _holds(self, block_id: int, parent: bytes | None, chunk: list[int], extra: tuple[str, ...]) -> bool:
        block = self.blocks[block_id]
        return block.parent == parent and block.token_ids == tuple(chunk) and block.extra == extra

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def _evict_if_cached(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.hash is not None:
            del self.cached[block.hash]
            evicted = block.hash
            block.hash, block.parent, block.token_ids, block.extra = None, None, None, ()
            self.on_event("evict", block=block_id, hash=evicted)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix held only by free blocks."""
        for block_id in list(self.free):
            self._evict_if_cached(block_id)
        self.on_event("reset", all=not self.cached)  # all: no cached block is left (none was in use)

    # -- invariants ---------------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Assert the invariants: ref counts equal table references; free <=> ref 0; the hash table and block
        hashes agree; a block is shared only as the same full cached prefix block of every owner."""
        refs = [0] * self.num_blocks
        position: dict[int, int] = {}
        for seq_id, table in self.tables.items():
            if len(set(table)) != len(table):
                raise AssertionError(f"sequence {seq_id} holds a block twice: {table}")
            for i, b in enumerate(table):
                refs[b] += 1
                if refs[b] > 1:
                    blk = self.blocks[b]
                    if blk.hash is None or position.get(b) != i:
                        raise AssertionError(f"block {b} shared by several sequences but not as the same cached "
                                             f"prefix block (hash={blk.hash is not None}, positions "
                                             f"{position.get(b)} and {i})")
                position[b] = i
        for blk in self.blocks:
            if blk.ref_count != refs[blk.block_id]:
                raise AssertionError(f"block {blk.block_id}: ref_count {blk.ref_count} but {refs[blk.block_id]} "
                                     f"references")
            if (blk.ref_count == 0) != (blk.block_id in self.free):
                raise AssertionError(f"block {blk.block_id}: ref_count {blk.ref_count} but "
                                     f"{'in' if blk.block_id in self.free else 'not in'} the free list")
            if blk.hash is not None and self.cached.get(blk.hash) != blk.block_id:
                raise AssertionError(f"block {blk.block_id} has a hash the prefix cache does not map to it")
        for h, b in self.cached.items():
            if self.blocks[b].hash != h:
                raise AssertionError(f"prefix cache maps a hash to block {b}, which holds another")
        if len(self.free) + sum(1 for r in refs if r) != self.num_blocks:
            raise AssertionError("free + used blocks do not add up to the pool size")
