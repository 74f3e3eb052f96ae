"""Block accounting, prefix caching, LRU eviction: values, not just that calls ran."""
from __future__ import annotations

import random

import pytest

from pdchat.engine.block_manager import BlockManager
from pdchat.engine.config import SamplingParams
from pdchat.engine.sequence import Sequence


def seq(tokens, rid="r"):
    return Sequence(rid, list(tokens), SamplingParams())


def test_allocation_and_free_counts():
    bm = BlockManager(8, 4)
    s = seq(range(10))
    assert bm.ensure_capacity(s, 10)
    assert len(s.block_table) == 3 and bm.num_used == 3 and bm.num_free == 5
    assert bm.ensure_capacity(s, 12) and len(s.block_table) == 3     # still fits in 3 blocks
    assert bm.ensure_capacity(s, 13) and len(s.block_table) == 4
    assert not bm.ensure_capacity(seq(range(100), "big"), 100)       # needs 25 blocks: nothing taken
    assert bm.num_used == 4
    bm.free_seq(s)
    assert bm.num_used == 0 and bm.num_free == 8 and s.block_table == []


def test_prefix_hit_needs_committed_full_blocks_and_never_covers_last_token():
    bm = BlockManager(16, 4)
    a = seq(range(10), "a")
    bm.ensure_capacity(a, 10)
    bm.commit(a, 10)                       # two full blocks are hashable, the third is partial
    assert len(a.block_hashes) == 2
    b = seq(list(range(10)) + [99], "b")
    assert bm.match_prefix(b) == 8         # both full blocks shared
    assert b.block_table == a.block_table[:2]
    assert bm.blocks[a.block_table[0]].ref == 2
    c = seq(range(8), "c")                 # exactly two blocks: the last token must stay uncached
    assert bm.match_prefix(c) == 4
    d = seq([0, 1, 2, 7, 4, 5, 6, 7, 8], "d")   # differs inside the first block
    assert bm.match_prefix(d) == 0


def test_cached_blocks_survive_free_and_are_evicted_lru_tail_first():
    bm = BlockManager(4, 2)
    a = seq([1, 2, 3, 4, 5, 6, 7], "a")
    bm.ensure_capacity(a, 7)
    bm.commit(a, 7)
    bm.free_seq(a)
    assert bm.num_used == 0 and bm.num_cached_free == 3 and bm.num_free == 4
    # A new unrelated sequence takes the uncached block first, then the *tail* of a's prefix.
    x = seq([9, 9, 9], "x")
    bm.ensure_capacity(x, 3)
    assert bm.num_cached_free == 2
    again = seq([1, 2, 3, 4, 5, 6, 7], "again")
    assert bm.match_prefix(again) == 4     # head blocks [1,2] and [3,4] survived; [5,6] was evicted


def test_collision_guard_compares_tokens():
    bm = BlockManager(4, 2)
    a = seq([1, 2, 3], "a")
    bm.ensure_capacity(a, 3)
    bm.commit(a, 3)
    block = bm.blocks[a.block_table[0]]
    block.tokens = (7, 7)                  # simulate a hash collision with different tokens
    assert bm.match_prefix(seq([1, 2, 3], "b")) == 0


def test_collision_guard_compares_the_parent(monkeypatch):
    # A hash that ignores the parent makes blocks with the same tokens after different prefixes
    # collide; the guard must still refuse them.
    from pdchat.engine import block_manager
    monkeypatch.setattr(block_manager, "block_hash", lambda parent, tokens, namespace=None: hash(tokens))
    bm = BlockManager(8, 2)
    for rid, tokens in (("a", [1, 2, 5, 6, 9]), ("b", [3, 4, 5, 6, 9])):
        s = seq(tokens, rid)
        bm.ensure_capacity(s, 5)
        bm.commit(s, 5)
        bm.free_seq(s)
    # The table holds a's [5, 6] (after [1, 2]); b's [5, 6] found its hash taken. "c" may reuse
    # b's [3, 4] but not a's [5, 6].
    c = seq([3, 4, 5, 6, 9], "c")
    assert bm.match_prefix(c) == 2


def test_collision_guard_compares_the_namespace(monkeypatch):
    # Tenants are kept apart by the namespace in the hash; a hash that ignored it must still not
    # hand one tenant's cached block to another.
    from pdchat.engine import block_manager
    monkeypatch.setattr(block_manager, "block_hash", lambda parent, tokens, namespace=None: hash((parent, tokens)))
    bm = BlockManager(8, 2)
    a = Sequence("a", [1, 2, 3], SamplingParams(), namespace="tenant-a")
    bm.ensure_capacity(a, 3)
    bm.commit(a, 3)
    bm.free_seq(a)
    assert bm.match_prefix(Sequence("b", [1, 2, 3], SamplingParams(), namespace="tenant-b")) == 0
    assert bm.match_prefix(Sequence("a2", [1, 2, 3], SamplingParams(), namespace="tenant-a")) == 2


def test_prefix_cache_off_matches_nothing_and_clears_table():
    bm = BlockManager(8, 2)
    a = seq([1, 2, 3, 4, 5])
    bm.ensure_capacity(a, 5)
    bm.commit(a, 5)
    bm.set_prefix_cache(False)
    assert bm.table == {} and bm.match_prefix(seq([1, 2, 3, 4, 5], "b")) == 0


def test_truncate_releases_tail_blocks():
    bm = BlockManager(8, 4)
    s = seq(range(14))
    bm.ensure_capacity(s, 14)
    bm.commit(s, 12)
    bm.truncate(s, 9)
    assert len(s.block_table) == 3 and len(s.block_hashes) == 2 and bm.num_used == 3


def test_random_operations_never_leak():
    rng = random.Random(0)
    bm = BlockManager(32, 4)
    live: list[Sequence] = []
    for step in range(3000):
        op = rng.random()
        if op < 0.4 or not live:
            prefix = [rng.randrange(3)] * rng.randrange(0, 12)       # shared prefixes are common
            s = seq(prefix + [rng.randrange(50) for _ in range(rng.randrange(1, 20))], f"s{step}")
            s.num_computed_tokens = bm.match_prefix(s)
            if bm.ensure_capacity(s, len(s.token_ids)):
                s.num_computed_tokens = len(s.token_ids)
                bm.commit(s, s.num_computed_tokens)
                live.append(s)
            else:
                bm.free_seq(s)
        elif op < 0.6:
            s = rng.choice(live)
            s.token_ids.append(rng.randrange(50))
            if bm.ensure_capacity(s, len(s.token_ids)):
                s.num_computed_tokens = len(s.token_ids)
                bm.commit(s, s.num_computed_tokens)
        elif op < 0.7:                       # a speculative step: reserve k drafts, keep some
            s = rng.choice(live)
            k = rng.randrange(1, 6)
            if bm.ensure_capacity(s, len(s.token_ids) + k):
                kept = rng.randrange(0, k + 1)
                s.token_ids.extend(rng.randrange(50) for _ in range(kept))
                s.num_computed_tokens = len(s.token_ids)
                bm.commit(s, s.num_computed_tokens)
                bm.truncate(s, len(s.token_ids))
                assert len(s.block_table) == bm.blocks_for(len(s.token_ids))
                assert len(s.block_hashes) == len(s.token_ids) // bm.block_size
        else:
            s = live.pop(rng.randrange(len(live)))
            bm.free_seq(s)
        refs = sum(b.ref for b in bm.blocks)
        assert refs == sum(len(s.block_table) for s in live)
        assert bm.num_used == len({b for s in live for b in s.block_table})
        assert bm.num_cached_free == sum(1 for b in bm.blocks if b.ref == 0 and b.hash is not None)
    for s in live:
        bm.free_seq(s)
    assert bm.num_used == 0 and bm.num_free == 32
    assert all(b.ref == 0 for b in bm.blocks)


def test_turning_the_prefix_cache_off_forgets_every_cached_block_and_on_again_works():
    bm = BlockManager(8, 2)
    a = seq([1, 2, 3, 4, 5], "a")
    bm.ensure_capacity(a, 5)
    bm.commit(a, 5)
    bm.free_seq(a)
    assert bm.num_cached_free == 2
    bm.set_prefix_cache(False)
    assert bm.prefix_cache is False and bm.num_cached_free == 0 and bm.table == {}
    assert all(b.hash is None and b.parent is None and b.tokens is None for b in bm.blocks)
    # The forgotten blocks are plain free blocks now: reusing them must not touch the counts.
    s = seq(range(16), "s")
    assert bm.ensure_capacity(s, 16) and bm.num_cached_free == 0
    bm.free_seq(s)
    bm.set_prefix_cache(True)
    assert bm.prefix_cache is True
    b = seq([1, 2, 3, 4, 5], "b")
    bm.ensure_capacity(b, 5)
    bm.commit(b, 5)
    assert bm.match_prefix(seq([1, 2, 3, 4, 5], "c")) == 4


def test_hit_rate_adds_up_every_lookup():
    bm = BlockManager(4, 2)
    assert bm.hit_rate is None                              # nothing looked up yet
    bm.record_lookup(10, 4)
    bm.record_lookup(6, 0)
    assert (bm.queried_tokens, bm.hit_tokens) == (16, 4) and bm.hit_rate == 0.25


def test_a_pool_needs_at_least_one_block():
    with pytest.raises(ValueError, match="^the KV pool needs at least one block$"):
        BlockManager(0, 16)
    one = BlockManager(1, 16)
    assert one.num_blocks == one.num_free == 1 and one.num_used == 0


def cache(bm: BlockManager, tokens, rid: str, namespace=None) -> Sequence:
    """Run a request through: match, allocate, commit what it computed, free. Returns it."""
    s = seq(tokens, rid)
    s.namespace = namespace
    bm.match_prefix(s)
    assert bm.ensure_capacity(s, len(s.token_ids))
    bm.commit(s, len(s.token_ids))
    bm.free_seq(s)
    return s


def hit(bm: BlockManager, tokens, namespace=None) -> int:
    s = seq(tokens, "probe")
    s.namespace = namespace
    covered = bm.match_prefix(s)
    bm.free_seq(s)
    return covered


def test_requests_of_one_namespace_share_their_prefix():
    bm = BlockManager(8, 4)
    cache(bm, [1, 2, 3, 4, 5], "a", namespace="tenant")
    assert hit(bm, [1, 2, 3, 4, 9], namespace="tenant") == 4
    assert hit(bm, [1, 2, 3, 4, 9], namespace="other") == 0 and hit(bm, [1, 2, 3, 4, 9]) == 0


def test_a_prefix_grown_from_a_hit_chains_on_to_the_blocks_it_matched():
    bm = BlockManager(8, 4)
    cache(bm, range(1, 10), "a")                               # [1..4] and [5..8] cached
    cache(bm, [1, 2, 3, 4, 20, 21, 22, 23, 24], "b")           # hits [1..4], caches [20..23] after it
    assert hit(bm, [1, 2, 3, 4, 20, 21, 22, 23, 30]) == 8


def test_an_evicted_block_leaves_the_table_and_its_tokens_can_be_cached_again():
    bm = BlockManager(2, 4)
    cache(bm, [1, 2, 3, 4, 5], "a")
    assert len(bm.table) == 1
    cache(bm, range(50, 58), "b")                              # needs both blocks: evicts [1..4]
    assert hit(bm, [1, 2, 3, 4, 9]) == 0 and len(bm.table) == 2     # b's two blocks only
    cache(bm, [1, 2, 3, 4, 6], "c")
    assert hit(bm, [1, 2, 3, 4, 9]) == 4


def test_freed_plain_blocks_are_reused_before_cached_ones():
    bm = BlockManager(3, 4)
    a = seq([1, 2, 3, 4, 5], "a")                              # one cached block, one plain
    plain = seq([60, 61, 62], "plain")                         # one plain block
    assert bm.ensure_capacity(a, 5) and bm.ensure_capacity(plain, 3)
    bm.commit(a, 5)
    bm.free_seq(a)
    bm.free_seq(plain)                                         # freed last, yet reused first
    taker = seq(range(70, 78), "taker")
    assert bm.ensure_capacity(taker, 8)                        # two blocks: both plain ones
    assert bm.num_cached_free == 1 and hit(bm, [1, 2, 3, 4, 9]) == 4
