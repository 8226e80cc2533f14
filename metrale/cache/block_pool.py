"""The KV block pool: a fixed number of blocks of `block_size` tokens, reference-counted.

Every block is in exactly one of three states:

    free        refcount 0, holds nothing anyone can find          (the free list)
    evictable   refcount 0, but registered under a content hash    (LRU; reusable by a prefix hit)
    in use      refcount > 0                                       (held by running requests)

`allocate` takes from the free list first, then evicts the least recently freed evictable block
(dropping its hash). Blocks are content-addressed only once FULL and computed, and a request
only ever writes past its computed tokens, i.e. into its own last, partial blocks: shared blocks
are never written, so no copy-on-write is needed (vLLM v1's approach).
"""
from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence


class IntegrityError(RuntimeError):
    """A cache bookkeeping invariant broke: a bug, never a user error."""


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"BlockPool needs num_blocks > 0 and block_size > 0, "
                             f"got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()   # least recently freed first
        self._hash_of_block: dict[int, bytes] = {}
        self._block_of_hash: dict[bytes, int] = {}
        self.num_evictions = 0

    # -- counters --------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks `allocate` can hand out now (free + evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._block_of_hash)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def num_unreferenced(self, block_ids: Iterable[int]) -> int:
        """How many of these blocks sit in the evictable LRU (taking them shrinks the free count)."""
        return sum(1 for b in block_ids if self.ref_counts[b] == 0)

    # -- allocation ------------------------------------------------------------------------------
    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def allocate(self, num_blocks: int) -> list[int]:
        if not self.can_allocate(num_blocks):
            raise RuntimeError(f"asked for {num_blocks} KV blocks, {self.num_free_blocks} free: "
                               "call can_allocate first")
        blocks = [self._pop_free() for _ in range(num_blocks)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block. Freed in reverse, so a request's tail blocks (the
        deepest nodes of its prefix chain) are evicted before the head it shares with others."""
        for b in reversed(block_ids):
            if self.ref_counts[b] <= 0:
                raise IntegrityError(f"block {b} freed with refcount {self.ref_counts[b]}")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                if b in self._hash_of_block:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    def _pop_free(self) -> int:
        if self._free:
            return self._free.popleft()
        block, _ = self._evictable.popitem(last=False)
        del self._block_of_hash[self._hash_of_block.pop(block)]
        self.num_evictions += 1
        return block

    # -- content addressing ----------------------------------------------------------------------
    def cached_block(self, block_hash: bytes) -> int | None:
        return self._block_of_hash.get(block_hash)

    def acquire(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on cached blocks (a prefix hit)."""
        for b in block_ids:
            if self.ref_counts[b] == 0:
                del self._evictable[b]
            self.ref_counts[b] += 1

    def cache(self, block_id: int, block_hash: bytes) -> bool:
        """Register a full, computed, in-use block under its hash. A hash already held by an
        in-use block keeps that block (this one stays private and goes to the free list when
        freed); one held only by an evictable copy moves to this live block, the copy is freed."""
        if block_id in self._hash_of_block:
            return False
        if self.ref_counts[block_id] <= 0:
            raise IntegrityError(f"caching block {block_id}, which nobody holds")
        old = self._block_of_hash.get(block_hash)
        if old is not None:
            if self.ref_counts[old] > 0:
                return False
            del self._evictable[old]
            del self._hash_of_block[old]
            self._free.append(old)
        self._block_of_hash[block_hash] = block_id
        self._hash_of_block[block_id] = block_hash
        return True

    # -- invariants ------------------------------------------------------------------------------
    def check_integrity(self, block_tables: Iterable[Sequence[int]] | None = None) -> None:
        """Raise IntegrityError unless free + evictable + in-use == all blocks, each block is in
        exactly one state, and (given the block tables of every holder) each refcount equals the
        number of tables holding that block."""
        free, evictable = set(self._free), set(self._evictable)
        in_use = {b for b, r in enumerate(self.ref_counts) if r > 0}
        if len(free) != len(self._free):
            raise IntegrityError("a block is on the free list twice")
        if free & evictable or (free | evictable) & in_use:
            raise IntegrityError("a block is in two states at once")
        if len(free) + len(evictable) + len(in_use) != self.num_blocks:
            raise IntegrityError(f"free {len(free)} + evictable {len(evictable)} + in use "
                                 f"{len(in_use)} != {self.num_blocks} blocks")
        if any(b in self._hash_of_block for b in free) or any(
                b not in self._hash_of_block for b in evictable):
            raise IntegrityError("free blocks must be uncached and evictable blocks cached")
        if any(self._block_of_hash.get(h) != b for b, h in self._hash_of_block.items()) or len(
                self._block_of_hash) != len(self._hash_of_block):
            raise IntegrityError("block <-> hash maps disagree")
        if block_tables is None:
            return
        expected = [0] * self.num_blocks
        for table in block_tables:
            for b in table:
                expected[b] += 1
        for b, (got, want) in enumerate(zip(self.ref_counts, expected)):
            if got != want:
                raise IntegrityError(f"block {b} has refcount {got}, held by {want} requests")
