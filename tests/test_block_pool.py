"""BlockPool: allocation, reference counts, content addressing, LRU eviction, integrity."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metrale.cache.block_pool import BlockPool, IntegrityError


def test_allocate_and_free_round_trip():
    pool = BlockPool(num_blocks=4, block_size=16)
    assert pool.can_allocate(4) and not pool.can_allocate(5)
    blocks = pool.allocate(3)
    assert len(set(blocks)) == 3 and pool.num_free_blocks == 1
    pool.check_integrity([blocks])
    pool.free(blocks)
    assert pool.num_free_blocks == 4
    pool.check_integrity([])


def test_allocating_more_than_free_raises():
    pool = BlockPool(num_blocks=2, block_size=4)
    pool.allocate(2)
    with pytest.raises(RuntimeError, match="can_allocate"):
        pool.allocate(1)


def test_double_free_is_caught():
    pool = BlockPool(num_blocks=2, block_size=4)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(IntegrityError):
        pool.free(blocks)


def test_cached_block_survives_free_and_is_reacquired():
    pool = BlockPool(num_blocks=3, block_size=4)
    (b,) = pool.allocate(1)
    assert pool.cache(b, b"h")
    pool.free([b])
    assert pool.cached_block(b"h") == b and pool.num_free_blocks == 3
    pool.acquire([b])
    assert pool.ref_counts[b] == 1 and pool.num_free_blocks == 2
    pool.check_integrity([[b]])


def test_eviction_takes_free_list_first_then_least_recently_freed():
    pool = BlockPool(num_blocks=3, block_size=4)
    chain = pool.allocate(2)
    pool.cache(chain[0], b"head")
    pool.cache(chain[1], b"tail")
    pool.free(chain)                      # tail freed first -> evicted first
    (fresh,) = pool.allocate(1)
    assert fresh not in chain and pool.num_evictions == 0
    (evicted,) = pool.allocate(1)
    assert evicted == chain[1] and pool.cached_block(b"tail") is None
    assert pool.cached_block(b"head") == chain[0] and pool.num_evictions == 1
    pool.check_integrity([[fresh], [evicted]])


def test_duplicate_hash_keeps_live_block_findable():
    pool = BlockPool(num_blocks=3, block_size=4)
    a, b = pool.allocate(2)
    assert pool.cache(a, b"h") and not pool.cache(b, b"h")   # live a keeps the hash
    pool.free([a])
    assert pool.cache(b, b"h")                                 # evictable a gives it up
    assert pool.cached_block(b"h") == b and pool.num_cached_blocks == 1
    pool.check_integrity([[b]])


def test_integrity_detects_wrong_refcount():
    pool = BlockPool(num_blocks=2, block_size=4)
    blocks = pool.allocate(1)
    with pytest.raises(IntegrityError, match="refcount"):
        pool.check_integrity([blocks, blocks])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free", "cache", "hit"]),
                          st.integers(0, 7)), max_size=60))
def test_random_operations_keep_invariants(ops):
    """Holders allocate, free, cache and hit blocks at random: refcounts always equal holders."""
    pool = BlockPool(num_blocks=8, block_size=4)
    holders: list[list[int]] = []
    for op, arg in ops:
        if op == "alloc" and pool.can_allocate(arg % 3 + 1):
            holders.append(pool.allocate(arg % 3 + 1))
        elif op == "free" and holders:
            pool.free(holders.pop(arg % len(holders)))
        elif op == "cache" and holders:
            table = holders[arg % len(holders)]
            pool.cache(table[0], bytes([arg]))
        elif op == "hit":
            block = pool.cached_block(bytes([arg]))
            if block is not None:
                pool.acquire([block])
                holders.append([block])
        pool.check_integrity(holders)
    for table in holders:
        pool.free(table)
    pool.check_integrity([])
    assert pool.num_free_blocks == pool.num_blocks
