"""KVPool: ref counts, the prefix cache, LRU eviction, reclaim, and invariants under random use."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epserve.models.traits import PrefixReclaim
from epserve.worker.kv_pool import KVPool, KVPoolExhausted

BS = 4


def _prefill(pool: KVPool, tokens: list[int], adapter_id: int = 0) -> list[int]:
    """What a runner does for a prompt: reuse the cached prefix, allocate the rest, cache it."""
    blocks = pool.match_prefix(tokens, adapter_id, max_tokens=len(tokens) - 1)
    need = -(-len(tokens) // BS) - len(blocks)
    blocks += pool.allocate(need)
    pool.cache_blocks(tokens, blocks, len(tokens), adapter_id)
    return blocks


def test_shared_prefix_blocks_are_ref_counted():
    pool = KVPool(16, BS)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    a = _prefill(pool, prompt)
    b = _prefill(pool, prompt + [99])
    assert b[:2] == a[:2], "second sequence reuses the two full cached blocks"
    assert b[2] != a[2], "the partial last block is never shared"
    assert [pool.ref_count(x) for x in a[:2]] == [2, 2]
    pool.free(a)
    assert [pool.ref_count(x) for x in b[:2]] == [1, 1]
    assert pool.num_used_blocks() == 3
    assert pool.match_prefix(prompt, max_tokens=9) == a[:2], "still cached while b holds them"
    pool.check()


def test_free_caches_full_blocks_and_releases_partial_ones():
    pool = KVPool(8, BS)
    blocks = _prefill(pool, list(range(6)))  # 1 full block, 1 partial
    pool.free(blocks)
    assert pool.num_cached_free_blocks() == 1
    assert pool.num_free_blocks() == 7
    assert pool.usage() == 0.0
    assert pool.peek_prefix(list(range(6))) == 1
    assert pool.peek_prefix(list(range(4)) + [7, 7]) == 1
    assert pool.peek_prefix([0, 1, 2, 3, 4, 5, 6, 7]) == 1, "the partial block was never cached"
    pool.check()


def test_lru_evicts_least_recently_freed_first():
    pool = KVPool(6, BS)
    first, second = [1, 1, 1, 1], [2, 2, 2, 2]
    a = _prefill(pool, first + [0])
    b = _prefill(pool, second + [0])
    pool.free(a)
    pool.free(b)
    assert pool.num_cached_free_blocks() == 2
    assert pool.reclaim_prefix_blocks(1) == 1
    assert pool.peek_prefix(first) == 0, "the older one went first"
    assert pool.peek_prefix(second) == 1
    assert pool.reclaim_prefix_blocks(5) == 1
    assert pool.num_free_blocks() == 6
    pool.check()


def test_tail_blocks_of_one_sequence_are_evicted_before_its_head():
    pool = KVPool(8, BS)
    prompt = list(range(12))
    blocks = _prefill(pool, prompt + [0])
    pool.free(blocks)
    assert pool.reclaim_prefix_blocks(1) == 1
    assert pool.peek_prefix(prompt) == 2, "the third block went; the first two still match"


def test_matched_block_is_revived_from_lru_and_not_evicted():
    pool = KVPool(6, BS)
    old, new = [5, 5, 5, 5], [6, 6, 6, 6]
    pool.free(_prefill(pool, old + [0]))
    pool.free(_prefill(pool, new + [0]))
    revived = pool.match_prefix(old)
    assert len(revived) == 1 and pool.ref_count(revived[0]) == 1
    assert pool.num_cached_free_blocks() == 1
    assert pool.reclaim_prefix_blocks(10) == 1
    assert pool.peek_prefix(old) == 1, "in use again, so not evictable"
    assert pool.peek_prefix(new) == 0
    pool.free(revived)
    assert pool.num_cached_free_blocks() == 1
    pool.check()


def test_reclaim_for_protects_the_prompts_own_prefix():
    pool = KVPool(8, BS)
    mine, other = list(range(8)), [9] * 8
    pool.free(_prefill(pool, mine + [0]))   # mine: 2 cached blocks, freed first (oldest)
    pool.free(_prefill(pool, other + [0]))  # other: 2 cached blocks
    assert pool.num_free_blocks() == 4 and pool.num_cached_free_blocks() == 4
    # A prefill of mine + 12 more tokens needs 5 blocks; 2 are reused, so the target is 3.
    r = pool.reclaim_prefix_blocks_for(mine + [1] * 12, 0, 5)
    assert r == PrefixReclaim(target=3, free=4), "already enough: nothing evicted"
    assert pool.num_cached_free_blocks() == 4
    r = pool.reclaim_prefix_blocks_for(mine + [1] * 20, 0, 7)
    assert r == PrefixReclaim(target=5, free=5)
    assert pool.peek_prefix(mine) == 2, "mine is older in the LRU but protected"
    assert pool.peek_prefix(other) == 1, "other's tail block was the one evicted"
    r = pool.reclaim_prefix_blocks_for(mine + [1] * 40, 0, 12)
    assert r == PrefixReclaim(target=10, free=6), "free < target: nothing more evictable"
    assert pool.peek_prefix(mine) == 2 and pool.peek_prefix(other) == 0
    pool.check()


def test_reclaim_for_with_max_tokens_counts_only_reusable_blocks():
    pool = KVPool(4, BS)
    prompt = list(range(8))
    pool.free(_prefill(pool, prompt + [0]))
    # With max_tokens = len - 1 only the first block is reusable: target 2 - 1 = 1.
    r = pool.reclaim_prefix_blocks_for(prompt, 0, 2, max_tokens=7)
    assert r == PrefixReclaim(target=1, free=2)


def test_exhausted_allocate_raises_and_changes_nothing():
    pool = KVPool(4, BS)
    pool.free(_prefill(pool, list(range(4)) + [0]))  # 1 cached, 3 free
    held = pool.allocate(2)
    with pytest.raises(KVPoolExhausted, match=r"need 2 blocks, 1 free, 1 cached-free"):
        pool.allocate(2)
    assert pool.num_free_blocks() == 1 and pool.num_cached_free_blocks() == 1
    assert pool.num_used_blocks() == 2 and all(pool.ref_count(b) == 1 for b in held)
    pool.check()
    assert pool.reclaim_prefix_blocks(1) == 1
    assert len(pool.allocate(2)) == 2


def test_adapter_id_namespaces_hashes():
    pool = KVPool(8, BS)
    prompt = list(range(8))
    pool.free(_prefill(pool, prompt + [0], adapter_id=3))
    assert pool.peek_prefix(prompt, adapter_id=3) == 2
    assert pool.peek_prefix(prompt, adapter_id=0) == 0
    assert pool.match_prefix(prompt, adapter_id=4) == []


def test_partial_last_block_is_never_cached():
    pool = KVPool(8, BS)
    blocks = pool.allocate(2)
    pool.cache_blocks(list(range(7)), blocks, 7)
    pool.free(blocks)
    assert pool.num_cached_free_blocks() == 1
    assert pool.peek_prefix(list(range(8))) == 1


def test_cache_blocks_keeps_the_first_owner_of_a_hash():
    pool = KVPool(8, BS)
    a, b = pool.allocate(1), pool.allocate(1)
    pool.cache_blocks([7] * 4, a, 4)
    pool.cache_blocks([7] * 4, b, 4)  # same content computed twice (a race between prefills)
    assert pool.match_prefix([7] * 4) == a
    pool.free(b)
    assert pool.num_cached_free_blocks() == 0, "the duplicate was freed uncached"
    pool.cache_blocks([7] * 4, a, 4)  # re-registering is a no-op
    with pytest.raises(ValueError, match="different prefix"):
        pool.cache_blocks([8] * 4, a, 4)
    pool.check()


def test_disabled_prefix_caching_never_matches():
    pool = KVPool(8, BS, enable_prefix_caching=False)
    blocks = pool.allocate(2)
    pool.cache_blocks(list(range(8)), blocks, 8)
    assert pool.peek_prefix(list(range(8))) == 0 and pool.match_prefix(list(range(8))) == []
    pool.free(blocks)
    assert pool.num_cached_free_blocks() == 0 and pool.num_free_blocks() == 8
    assert pool.reclaim_prefix_blocks_for(list(range(8)), 0, 3) == PrefixReclaim(3, 8)
    pool.check()


def test_misuse_is_refused():
    pool = KVPool(4, BS)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(ValueError, match="not in use"):
        pool.free(blocks)
    with pytest.raises(ValueError, match="out of range"):
        pool.free([4])
    with pytest.raises(ValueError, match="not in use"):
        pool.incref(blocks)
    with pytest.raises(ValueError, match="not in use"):
        pool.cache_blocks([1] * 4, blocks, 4)
    pool.check()


def test_reset_prefix_cache():
    pool = KVPool(8, BS)
    held = _prefill(pool, list(range(8)) + [0])
    pool.free(_prefill(pool, [3] * 8 + [0]))
    assert pool.reset_prefix_cache() == 2
    assert pool.num_free_blocks() == 5 and pool.peek_prefix(list(range(8))) == 0
    pool.free(held)
    assert pool.num_free_blocks() == 8 and pool.num_cached_free_blocks() == 0
    pool.check()


def test_incref_shares_blocks_until_last_free():
    pool = KVPool(4, BS)
    blocks = pool.allocate(2)
    pool.incref(blocks)
    pool.free(blocks)
    assert pool.num_used_blocks() == 2 and pool.usage() == 0.5
    pool.free(blocks)
    assert pool.num_free_blocks() == 4


# --------------------------------------------------------------------------- property test

_op = st.one_of(
    st.tuples(st.just("prefill"), st.lists(st.integers(0, 2), min_size=1, max_size=14),
              st.integers(0, 1)),
    st.tuples(st.just("free"), st.integers(0, 1000)),
    st.tuples(st.just("fork"), st.integers(0, 1000)),
    st.tuples(st.just("reclaim"), st.integers(0, 4)),
    st.tuples(st.just("reclaim_for"), st.lists(st.integers(0, 2), min_size=1, max_size=14),
              st.integers(0, 6)),
    st.tuples(st.just("reset"),),
)


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(_op, max_size=40), caching=st.booleans())
def test_random_operations_keep_invariants(ops, caching):
    pool = KVPool(12, BS, enable_prefix_caching=caching)
    live: list[list[int]] = []
    for op in ops:
        kind = op[0]
        if kind == "prefill":
            tokens, adapter = op[1], op[2]
            need = -(-len(tokens) // BS) - pool.peek_prefix(tokens, adapter, len(tokens) - 1)
            if pool.reclaim_prefix_blocks_for(tokens, adapter, -(-len(tokens) // BS),
                                              len(tokens) - 1).free < need:
                with pytest.raises(KVPoolExhausted):
                    pool.allocate(need)
            else:
                live.append(_prefill(pool, tokens, adapter))
        elif kind in ("free", "fork") and live:
            seq = live[op[1] % len(live)]
            if kind == "fork":
                pool.incref(seq)
                live.append(list(seq))
            else:
                live.remove(seq)
                pool.free(seq)
        elif kind == "reclaim":
            before = pool.num_cached_free_blocks()
            assert pool.reclaim_prefix_blocks(op[1]) == min(op[1], before)
        elif kind == "reclaim_for":
            r = pool.reclaim_prefix_blocks_for(op[1], 0, op[2])
            assert r.free == pool.num_free_blocks()
            assert r.free >= r.target or pool.num_cached_free_blocks() <= pool.peek_prefix(op[1])
        elif kind == "reset":
            pool.reset_prefix_cache()
        pool.check()
        assert pool.num_used_blocks() == len({b for s in live for b in s})
    for seq in live:
        pool.free(seq)
    pool.check()
    assert pool.num_used_blocks() == 0
    assert pool.num_free_blocks() + pool.num_cached_free_blocks() == 12
