"""The paged KV block manager: ownership, prefix caching, LRU eviction, all-or-nothing allocation.

The property test drives a BlockManager with random operations and simulates the KV the model would write (each
computed token's id stored at its slot), so a wrong block (shared while written, reused while owned, a cache hit
on different content) shows up as a sequence reading tokens that are not its own - independently of the
manager's own check_integrity(), which is asserted too.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from nanoserve.engine import block_manager as bm_module
from nanoserve.engine.block_manager import BlockManager, chain_hash
from nanoserve.engine.sequence import Sequence
from nanoserve.sampling import SamplingParams

BS = 4  # small blocks: many full blocks, many hits, many evictions in short sequences

_ids = itertools.count()


def make_seq(tokens: list[int], cache_salt: str | None = None) -> Sequence:
    return Sequence(next(_ids), "r", 0, list(tokens), SamplingParams(), cache_salt=cache_salt)


def admit(bm: BlockManager, seq: Sequence) -> bool:
    """What the scheduler and model do: attach the prefix-cache hits, allocate the rest, compute every token,
    register the full blocks."""
    if not bm.allocate(seq, seq.num_tokens, bm.computed_blocks(seq)):
        return False
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)
    return True


def snapshot(bm: BlockManager):
    return (list(bm.free), dict(bm.cached), {k: list(v) for k, v in bm.tables.items()},
            [(b.ref_count, b.hash, b.token_ids) for b in bm.blocks])


# -- property test ------------------------------------------------------------------------------------------

class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / grow / fork-by-prefix / free / pressure sequences against a simulated KV pool."""

    @initialize(num_blocks=st.integers(4, 16))
    def setup(self, num_blocks: int):
        self.bm = BlockManager(num_blocks, BS, enable_prefix_caching=True)
        self.kv: dict[int, list[int | None]] = {b: [None] * BS for b in range(num_blocks)}
        self.live: list[Sequence] = []
        self.history: list[list[int]] = []  # token lists of every sequence ever admitted, to fork from
        self.pressure_tokens = itertools.count(1000)  # never equal to the small-alphabet tokens: no hits

    # the model, simulated: write each newly computed token at its slot, never into a shared block
    def compute(self, seq: Sequence, start: int, end: int) -> None:
        for p in range(start, end):
            block = seq.block_table[p // BS]
            assert self.bm.blocks[block].ref_count == 1, f"writing into shared block {block}"
            self.kv[block][p % BS] = seq.token_at(p)

    def try_admit(self, tokens: list[int], chunk: int) -> None:
        seq = make_seq(tokens)
        computed = self.bm.computed_blocks(seq)
        num_cached = len(computed) * BS
        assert num_cached <= seq.num_tokens - 1, "a prefix hit must leave the last token to compute"
        end = min(seq.num_tokens, num_cached + chunk)
        before = snapshot(self.bm)
        if not self.bm.allocate(seq, end, computed):
            assert snapshot(self.bm) == before, "a failed allocation changed the pool"
            assert not seq.block_table
            return
        # the hit blocks must already hold exactly this sequence's tokens
        for p in range(num_cached):
            assert self.kv[seq.block_table[p // BS]][p % BS] == seq.token_at(p), "prefix hit on other content"
        self.compute(seq, num_cached, end)
        seq.num_computed_tokens = end
        self.bm.cache_full_blocks(seq)
        self.live.append(seq)
        self.history.append(list(tokens))

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=24), chunk=st.integers(1, 24))
    def allocate(self, tokens, chunk):
        self.try_admit(tokens, chunk)

    @precondition(lambda self: self.history)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 2), min_size=1, max_size=8), chunk=st.integers(1, 24))
    def fork_by_prefix(self, data, extra, chunk):
        source = data.draw(st.sampled_from(self.history))
        cut = data.draw(st.integers(0, len(source)))
        self.try_admit(source[:cut] + extra, chunk)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), new=st.lists(st.integers(0, 2), max_size=9), steps=st.integers(1, 9))
    def grow(self, data, new, steps):
        """Finish a chunked prefill and/or append sampled tokens, as decoding does."""
        seq = data.draw(st.sampled_from(self.live))
        seq.output_token_ids.extend(new)
        end = min(seq.num_tokens, seq.num_computed_tokens + steps)
        before = snapshot(self.bm)
        if not self.bm.allocate(seq, end):
            assert snapshot(self.bm) == before, "a failed allocation changed the pool"
            return
        self.compute(seq, seq.num_computed_tokens, end)
        seq.num_computed_tokens = end
        self.bm.cache_full_blocks(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(self.live))
        self.live.remove(seq)
        self.bm.free_seq(seq)
        assert not seq.block_table

    @rule(fraction=st.floats(0.3, 1.0))
    def evict_by_pressure(self, fraction):
        """A sequence of fresh tokens filling much of the free pool, which evicts free cached blocks."""
        n = max(1, int(self.bm.num_free_blocks * fraction)) * BS
        self.try_admit([next(self.pressure_tokens) for _ in range(n)], n)

    @invariant()
    def consistent(self):
        if not hasattr(self, "bm"):
            return
        self.bm.check_integrity()
        owners: dict[int, list[tuple[Sequence, int]]] = {}
        for seq in self.live:
            assert self.bm.tables[seq.seq_id] is seq.block_table
            assert len(seq.block_table) >= self.bm.blocks_needed(seq.num_computed_tokens)
            for i, b in enumerate(seq.block_table):
                owners.setdefault(b, []).append((seq, i))
            for p in range(seq.num_computed_tokens):  # every sequence reads back its own tokens
                assert self.kv[seq.block_table[p // BS]][p % BS] == seq.token_at(p)
        for b, own in owners.items():
            if len(own) > 1:  # shared: only as the same cached, full prefix block of every owner
                assert self.bm.blocks[b].hash is not None
                assert len({i for _, i in own}) == 1
                i = own[0][1]
                assert len({tuple(s.token_ids[: (i + 1) * BS]) for s, _ in own}) == 1
        assert self.bm.num_free_blocks == self.bm.num_blocks - len(owners)

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for seq in self.live:
            self.bm.free_seq(seq)
        self.bm.check_integrity()
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert not self.bm.tables
        assert all(b.ref_count == 0 for b in self.bm.blocks)


BlockManagerMachine.TestCase.settings = settings(derandomize=True, max_examples=120, stateful_step_count=30,
                                                 deadline=None, suppress_health_check=[HealthCheck.too_slow])
TestBlockManagerProperties = BlockManagerMachine.TestCase


# -- unit tests ---------------------------------------------------------------------------------------------

def test_lru_eviction_order():
    bm = BlockManager(6, BS, enable_prefix_caching=True)
    a, b = make_seq([1] * 8), make_seq([2] * 8)
    assert admit(bm, a) and admit(bm, b)  # 2 full cached blocks each, 2 blocks never used
    cached_blocks = set(a.block_table) | set(b.block_table)
    bm.free_seq(a)
    bm.free_seq(b)  # a freed before b: a is the least recently used
    assert len(bm.computed_blocks(make_seq([1] * 8 + [0]))) == 2

    # the two never-cached blocks go first, then a's tail block (a tail is evicted before its head)
    c = make_seq([100 + i for i in range(10)])  # 3 blocks, the last one partial (never cached)
    assert admit(bm, c)
    assert cached_blocks.isdisjoint(c.block_table[:2])
    assert len(bm.computed_blocks(make_seq([1] * 8 + [0]))) == 1  # a lost its second block
    assert len(bm.computed_blocks(make_seq([2] * 8 + [0]))) == 2  # b untouched
    bm.free_seq(c)

    # reviving b (a hit) and freeing it again makes it the most recent: a's head goes before b
    d = make_seq([2] * 8 + [0])
    assert admit(bm, d)
    bm.free_seq(d)
    e = make_seq([200 + i for i in range(4 * 4)])  # 4 blocks: the uncached one, a's head, c's two cached ones
    assert admit(bm, e)
    assert len(bm.computed_blocks(make_seq([1] * 8 + [0]))) == 0
    assert len(bm.computed_blocks(make_seq([2] * 8 + [0]))) == 2
    bm.check_integrity()


def test_uncached_free_blocks_are_reused_before_cached_ones():
    bm = BlockManager(4, BS, enable_prefix_caching=True)
    cached = make_seq([5] * 8)
    partial = make_seq([7, 7])  # one partial block: freed without a hash
    assert admit(bm, cached) and admit(bm, partial)
    bm.free_seq(cached)
    bm.free_seq(partial)
    events = []
    bm.on_event = lambda name, **kw: events.append(name)
    assert admit(bm, make_seq([9] * 8))  # 2 blocks: the 2 uncached ones, no eviction
    assert "evict" not in events
    assert len(bm.computed_blocks(make_seq([5] * 8 + [0]))) == 2


def test_full_prefix_hit_still_computes_last_token():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    assert admit(bm, make_seq(list(range(8))))
    same = make_seq(list(range(8)))  # every block cached, but the last token's logits are needed
    assert len(bm.computed_blocks(same)) == 1
    longer = make_seq(list(range(9)))
    assert len(bm.computed_blocks(longer)) == 2
    assert len(bm.computed_blocks(make_seq(list(range(5))))) == 1
    assert len(bm.computed_blocks(make_seq(list(range(4))))) == 0


def test_hash_chaining_same_block_after_other_prefix_does_not_hit():
    assert chain_hash(chain_hash(None, [1] * BS), [2] * BS) != chain_hash(chain_hash(None, [3] * BS), [2] * BS)
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    assert admit(bm, make_seq([1] * 4 + [2] * 4))
    assert bm.computed_blocks(make_seq([3] * 4 + [2] * 4 + [0])) == []
    assert len(bm.computed_blocks(make_seq([1] * 4 + [2] * 4 + [0]))) == 2


def test_hits_are_verified_against_tokens_and_parent(monkeypatch):
    """With a hash that collides (it ignores the parent and keeps only the first token), a hit still needs the
    block's own tokens and its parent to match, so colliding blocks are never handed out."""
    monkeypatch.setattr(bm_module, "chain_hash", lambda parent, tokens, extra=(): bytes([tokens[0]]))
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    assert admit(bm, make_seq([1, 1, 1, 1, 2, 2, 2, 2]))
    assert bm.computed_blocks(make_seq([1, 9, 9, 9, 0])) == []  # same hash, other tokens
    assert admit(bm, make_seq([3, 3, 3, 3, 4, 4, 4, 4]))
    # [4,4,4,4] is cached after [3,3,3,3]; after [1,1,1,1] the hash collides but the parent differs
    assert len(bm.computed_blocks(make_seq([1, 1, 1, 1, 4, 4, 4, 4, 0]))) == 1
    assert len(bm.computed_blocks(make_seq([3, 3, 3, 3, 4, 4, 4, 4, 0]))) == 2


def test_cache_salt_shares_blocks_only_with_the_same_salt(monkeypatch):
    """A salted request's chain starts from its salt: the same tokens under another salt (or none) are a miss,
    under the same salt a hit - also when the hash itself would collide (the verified parent differs)."""
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    tokens = list(range(8))
    assert admit(bm, make_seq(tokens, cache_salt="tenant-a"))
    assert bm.computed_blocks(make_seq(tokens + [0])) == []
    assert bm.computed_blocks(make_seq(tokens + [0], cache_salt="tenant-b")) == []
    assert len(bm.computed_blocks(make_seq(tokens + [0], cache_salt="tenant-a"))) == 2
    assert admit(bm, make_seq(tokens))  # unsalted: its own chain, beside the salted one
    assert len(bm.computed_blocks(make_seq(tokens + [0]))) == 2
    bm.check_integrity()
    monkeypatch.setattr(bm_module, "chain_hash", lambda parent, tokens, extra=(): bytes([tokens[0]]))
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    assert admit(bm, make_seq(tokens, cache_salt="tenant-a"))
    assert bm.computed_blocks(make_seq(tokens + [0], cache_salt="tenant-b")) == []


def test_allocate_is_all_or_nothing():
    bm = BlockManager(4, BS, enable_prefix_caching=True)
    a = make_seq([1] * 8)
    assert admit(bm, a)
    bm.free_seq(a)  # 2 free cached blocks
    b = make_seq([6] * 4)
    assert admit(bm, b)
    c = make_seq([1] * 8 + [0] * 9)  # 2 hits + 3 new blocks, but only 1 is left after reviving the hits
    computed = bm.computed_blocks(c)
    assert len(computed) == 2
    assert not bm.can_allocate(c, c.num_tokens, computed)
    before = snapshot(bm)
    assert not bm.allocate(c, c.num_tokens, computed)
    assert snapshot(bm) == before and not c.block_table
    # growing an existing sequence beyond the pool fails the same way
    assert not bm.allocate(b, 4 * BS + 1)
    assert snapshot(bm) == before
    assert bm.allocate(b, 4 * BS)  # exactly the pool: evicts both cached blocks
    assert bm.computed_blocks(make_seq([1] * 8 + [0])) == []
    bm.free_seq(b)
    bm.check_integrity()
    assert bm.num_free_blocks == 4


def test_prefix_caching_off_never_hits():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    assert admit(bm, make_seq([1] * 8))
    assert bm.computed_blocks(make_seq([1] * 9)) == []
    assert not bm.cached


def test_reset_prefix_cache_forgets_only_free_blocks():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    held, freed = make_seq([1] * 8), make_seq([2] * 8)
    assert admit(bm, held) and admit(bm, freed)
    bm.free_seq(freed)
    bm.reset_prefix_cache()
    assert bm.computed_blocks(make_seq([2] * 9)) == []
    assert len(bm.computed_blocks(make_seq([1] * 9))) == 2
    bm.check_integrity()


def test_check_integrity_catches_corruption():
    bm = BlockManager(4, BS, enable_prefix_caching=True)
    a, b = make_seq([1] * 6), make_seq([2] * 6)
    assert admit(bm, a) and admit(bm, b)
    bm.check_integrity()
    b.block_table[1] = a.block_table[1]  # a partial, uncached block owned twice
    with pytest.raises(AssertionError, match="shared"):
        bm.check_integrity()


@pytest.mark.parametrize("num_blocks, block_size", [(0, 4), (4, 0)])
def test_bad_pool_size(num_blocks, block_size):
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(num_blocks, block_size, enable_prefix_caching=True)
