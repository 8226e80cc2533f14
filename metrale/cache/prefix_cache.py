"""Prefix cache: reuse the KV (and, for hybrid models, the GDN state) of a shared prompt prefix.

Blocks are identified by a hash chain: hash(block i) = H(hash(block i-1) || token ids of block i),
so one hash names the whole prefix up to the end of its block, and the set of cached hashes is a
radix tree over token blocks whose nodes live in the `BlockPool` (a cached-but-unreferenced block
is an evictable leaf-first LRU entry there). Only FULL, computed blocks are cached.

Hybrid models (GDN layers, `hybrid=True`) need more than attention KV to resume at position k:
the GDN conv + recurrent state after k tokens. Following Marconi, the state is snapshotted into a
small LRU pool of snapshot slots at checkpoint positions (multiples of `ssm_checkpoint_interval`,
itself a multiple of `block_size`). The scheduler cuts prefill chunks so that they end on a
checkpoint and asks `reserve_snapshot` for a slot: the runner copies the request's working state
row into it AFTER that step's forward (a *state save*); `commit_snapshot` then publishes it under
the hash of the block ending at the checkpoint. A hit resumes from the DEEPEST checkpoint whose
blocks are all cached and which has a snapshot: its blocks are reused, blocks past it are
recomputed, and the snapshot is copied into the request's row BEFORE the forward (a *state copy*).

A hit never covers the whole sequence: at least one token is computed so there are logits to
sample from.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

from metrale.cache.block_pool import BlockPool, IntegrityError
from metrale.request import Request

ROOT_HASH = b""


def hash_block(parent_hash: bytes, token_ids: list[int]) -> bytes:
    """Chain hash of one full block (128-bit BLAKE2b: collisions are not a practical concern)."""
    return hashlib.blake2b(parent_hash + array("q", token_ids).tobytes(), digest_size=16).digest()


class SnapshotPool:
    """State-pool rows that hold GDN snapshots, keyed by the block hash of their checkpoint.

    A row is free, pending (reserved for a save in the current step) or committed (findable, in
    LRU order). Committed rows are never pinned: a state copy runs before the forward and a save
    after it, so a row evicted for a save in the same step it is copied from is still correct.
    """

    def __init__(self, slots: range):
        self.slots = slots
        self._free: list[int] = list(reversed(slots))
        self._pending: set[int] = set()
        self._slot_of_hash: OrderedDict[bytes, int] = OrderedDict()   # least recently used first
        self.num_evictions = 0

    @property
    def num_snapshots(self) -> int:
        return len(self._slot_of_hash)

    def peek(self, block_hash: bytes) -> int | None:
        return self._slot_of_hash.get(block_hash)

    def touch(self, block_hash: bytes) -> None:
        self._slot_of_hash.move_to_end(block_hash)

    def can_allocate(self) -> bool:
        return bool(self._free or self._slot_of_hash)

    def allocate(self) -> int:
        if self._free:
            slot = self._free.pop()
        elif self._slot_of_hash:
            _, slot = self._slot_of_hash.popitem(last=False)
            self.num_evictions += 1
        else:
            raise RuntimeError("no snapshot slot free or evictable: call can_allocate first")
        self._pending.add(slot)
        return slot

    def commit(self, block_hash: bytes, slot: int) -> None:
        self._pending.remove(slot)
        if block_hash in self._slot_of_hash:          # saved twice in one step: keep the first
            self._free.append(slot)
        else:
            self._slot_of_hash[block_hash] = slot

    def release(self, slot: int) -> None:
        """Give back a reserved slot whose save never happened."""
        self._pending.remove(slot)
        self._free.append(slot)

    def check_integrity(self) -> None:
        committed = list(self._slot_of_hash.values())
        held = self._free + committed + list(self._pending)
        if len(held) != len(self.slots) or set(held) != set(self.slots):
            raise IntegrityError(f"snapshot slots: free {len(self._free)} + committed "
                                 f"{len(committed)} + pending {len(self._pending)} do not "
                                 f"partition {len(self.slots)} slots")


@dataclass
class PrefixMatch:
    block_ids: list[int] = field(default_factory=list)   # cached blocks to reuse, in order
    num_tokens: int = 0                                  # tokens they cover (resume point)
    snapshot_slot: int | None = None                     # hybrid: state to copy in first
    num_kv_tokens: int = 0                               # longest cached KV prefix (>= num_tokens)


class PrefixCache:
    def __init__(self, pool: BlockPool, checkpoint_interval: int | None = None,
                 snapshot_slots: range = range(0)):
        """`checkpoint_interval` None: attention-only model (any full-block prefix is a hit).
        Otherwise a hybrid model with GDN snapshots every `checkpoint_interval` tokens."""
        self.pool = pool
        self.block_size = pool.block_size
        self.checkpoint_interval = checkpoint_interval
        self.snapshots = SnapshotPool(snapshot_slots) if checkpoint_interval else None
        self._pending: dict[str, tuple[bytes, int]] = {}   # request id -> (hash, slot) this step
        self.num_hits = 0
        self.num_misses = 0
        self.num_tokens_saved = 0

    @property
    def checkpointing(self) -> bool:
        return self.snapshots is not None

    # -- hashing ---------------------------------------------------------------------------------
    def block_hashes(self, req: Request, num_blocks: int) -> list[bytes]:
        """The chain hashes of the request's first `num_blocks` full blocks (extended lazily)."""
        hashes = req.block_hashes
        if len(hashes) < num_blocks:
            tokens, bs = req.all_token_ids, self.block_size
            for i in range(len(hashes), num_blocks):
                hashes.append(hash_block(hashes[i - 1] if i else ROOT_HASH,
                                         tokens[i * bs:(i + 1) * bs]))
        return hashes[:num_blocks]

    # -- lookup ----------------------------------------------------------------------------------
    def match(self, req: Request) -> PrefixMatch:
        """The longest reusable prefix of `req` (nothing is acquired yet)."""
        hashes = self.block_hashes(req, (req.num_tokens - 1) // self.block_size)
        block_ids: list[int] = []
        for h in hashes:
            block = self.pool.cached_block(h)
            if block is None:
                break
            block_ids.append(block)
        num_kv_tokens = len(block_ids) * self.block_size
        if self.snapshots is None:
            return PrefixMatch(block_ids, num_kv_tokens, None, num_kv_tokens)
        step = self.checkpoint_interval // self.block_size
        n = len(block_ids) - len(block_ids) % step
        while n and self.snapshots.peek(hashes[n - 1]) is None:
            n -= step
        slot = self.snapshots.peek(hashes[n - 1]) if n else None
        return PrefixMatch(block_ids[:n], n * self.block_size, slot, num_kv_tokens)

    def acquire(self, req: Request, match: PrefixMatch) -> None:
        """Take references on the matched blocks and mark the snapshot recently used."""
        self.pool.acquire(match.block_ids)
        if match.snapshot_slot is not None:
            self.snapshots.touch(req.block_hashes[len(match.block_ids) - 1])

    def record(self, match: PrefixMatch) -> None:
        """Count one request's first admission for metrics."""
        if match.num_tokens:
            self.num_hits += 1
            self.num_tokens_saved += match.num_tokens
        else:
            self.num_misses += 1

    # -- insertion -------------------------------------------------------------------------------
    def cache_blocks(self, req: Request, start: int, end: int) -> None:
        """Register the blocks that became full while tokens [start, end) were computed."""
        first, last = start // self.block_size, end // self.block_size
        if last <= first:
            return
        hashes = self.block_hashes(req, last)
        for i in range(first, last):
            self.pool.cache(req.block_ids[i], hashes[i])

    def has_snapshot(self, req: Request, position: int) -> bool:
        h = self.block_hashes(req, position // self.block_size)[-1]
        return self.snapshots.peek(h) is not None

    def reserve_snapshot(self, req: Request, position: int) -> int | None:
        """A slot to save `req`'s state after `position` tokens into, when `position` is a
        checkpoint not yet snapshotted (None otherwise, or when every slot is pending)."""
        if position <= 0 or position % self.checkpoint_interval or req.request_id in self._pending:
            return None
        h = self.block_hashes(req, position // self.block_size)[-1]
        if self.snapshots.peek(h) is not None or not self.snapshots.can_allocate():
            return None
        if any(h == pending_hash for pending_hash, _ in self._pending.values()):
            return None
        slot = self.snapshots.allocate()
        self._pending[req.request_id] = (h, slot)
        return slot

    def commit_snapshot(self, req: Request) -> None:
        """The step that saved `req`'s snapshot ran: publish it."""
        if req.request_id in self._pending:
            self.snapshots.commit(*self._pending.pop(req.request_id))

    def drop_snapshot(self, req: Request) -> None:
        """Give back the row reserved for `req`'s snapshot in this step, unsaved (a verify kept
        fewer tokens than the window the snapshot was of)."""
        pending = self._pending.pop(req.request_id, None)
        if pending is not None:
            self.snapshots.release(pending[1])

    def release_pending(self) -> None:
        """Drop snapshot reservations whose step result never arrived (aborted requests)."""
        for _, slot in self._pending.values():
            self.snapshots.release(slot)
        self._pending.clear()

    def check_integrity(self) -> None:
        if self.snapshots is not None:
            self.snapshots.check_integrity()
