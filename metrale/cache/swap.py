"""Swap space: where a preempted request's KV blocks and GDN state row wait, instead of being
recomputed when it resumes.

Who does what:
  * the scheduler (CPU only) decides. On preemption it asks `can_hold(num_blocks, with_state)`;
    if yes it `reserve`s the room and emits `(request_id, block_ids, state_slot)` in
    `SchedulerOutput.swap_out`, then frees the blocks and the row as usual. When the request is
    admitted again it gets fresh blocks and a row and emits the same triple in `swap_in`.
  * the runner executes, first thing in a step, before state copies and the forward:
    `swap.execute(out, caches)` copies every swap-out to storage, then every swap-in back into
    its new blocks (so a block freed by a swap-out and reused in the same step is read before
    anyone writes it).

Storage: host numpy arrays up to `host_bytes` (`--swap-space-gb`), then raw files in a private
temp dir (`tempfile.mkdtemp(prefix="metrale-swap-")`) up to `disk_bytes` (by default the same
size again). The dir is removed by `close()`, or at interpreter exit. When neither has room the
scheduler falls back to recompute.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import weakref
from dataclasses import dataclass, field

import numpy as np

GIB = 2**30


@dataclass
class _Entry:
    nbytes: int
    on_disk: bool
    num_kv_arrays: int = 0
    arrays: list[np.ndarray] | None = None                           # host copies
    layout: list[tuple[tuple, np.dtype]] = field(default_factory=list)  # disk: shape, dtype


class SwapSpace:
    def __init__(self, block_bytes: int, state_bytes: int, host_bytes: int,
                 disk_bytes: int | None = None):
        self.block_bytes = block_bytes
        self.state_bytes = state_bytes
        self.host_bytes = host_bytes
        self.disk_bytes = host_bytes if disk_bytes is None else disk_bytes
        self.host_used_bytes = 0
        self.disk_used_bytes = 0
        self._entries: dict[str, _Entry] = {}
        self._dir: str | None = None
        self._cleanup = None
        self.num_swap_outs = 0
        self.num_swap_ins = 0
        self.num_disk_swap_outs = 0

    @classmethod
    def for_caches(cls, caches, swap_space_gb: float) -> SwapSpace | None:
        """Swap space sized for `caches` (a ModelCaches); None when `swap_space_gb` is 0."""
        if swap_space_gb <= 0:
            return None
        return cls(caches.kv_bytes_per_block, caches.state_bytes_per_slot,
                   int(swap_space_gb * GIB))

    # -- accounting (the scheduler) --------------------------------------------------------------
    def nbytes(self, num_blocks: int, with_state: bool) -> int:
        return num_blocks * self.block_bytes + (self.state_bytes if with_state else 0)

    def can_hold(self, num_blocks: int, with_state: bool) -> bool:
        n = self.nbytes(num_blocks, with_state)
        return (self.host_used_bytes + n <= self.host_bytes
                or self.disk_used_bytes + n <= self.disk_bytes)

    def reserve(self, request_id: str, num_blocks: int, with_state: bool) -> None:
        """Room for one request's blocks (+ state row): host if it fits, else disk."""
        if request_id in self._entries:
            raise RuntimeError(f"request {request_id!r} is already swapped out")
        n = self.nbytes(num_blocks, with_state)
        if self.host_used_bytes + n <= self.host_bytes:
            self.host_used_bytes += n
            self._entries[request_id] = _Entry(n, on_disk=False)
        elif self.disk_used_bytes + n <= self.disk_bytes:
            self.disk_used_bytes += n
            self._entries[request_id] = _Entry(n, on_disk=True)
        else:
            raise RuntimeError(f"no swap space for {n} bytes: call can_hold first")

    def holds(self, request_id: str) -> bool:
        return request_id in self._entries

    def discard(self, request_id: str) -> None:
        """Forget a swapped request (aborted or timed out while waiting)."""
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return
        if entry.on_disk:
            self.disk_used_bytes -= entry.nbytes
            if self._dir is not None:
                try:
                    os.remove(self._path(request_id))
                except FileNotFoundError:
                    pass
        else:
            self.host_used_bytes -= entry.nbytes

    @property
    def num_swapped(self) -> int:
        return len(self._entries)

    @property
    def request_ids(self) -> set[str]:
        return set(self._entries)

    # -- data movement (the runner) --------------------------------------------------------------
    def execute(self, out, caches) -> None:
        """Run a step's swap-outs, then its swap-ins (call before state copies and the forward)."""
        for request_id, block_ids, state_slot in out.swap_out:
            entry = self._entries.get(request_id)
            if entry is None:                   # discarded between schedule() and now
                continue
            arrays = caches.read_blocks(block_ids)
            entry.num_kv_arrays = len(arrays)
            if state_slot is not None:
                arrays += caches.read_state(state_slot)
            self._store(request_id, entry, arrays)
            self.num_swap_outs += 1
        for request_id, block_ids, state_slot in out.swap_in:
            entry = self._entries.get(request_id)
            if entry is None:                   # aborted between schedule() and now
                continue
            arrays = self._load(request_id, entry)
            caches.write_blocks(block_ids, arrays[:entry.num_kv_arrays])
            if state_slot is not None:
                caches.write_state(state_slot, arrays[entry.num_kv_arrays:])
            self.discard(request_id)
            self.num_swap_ins += 1

    def _store(self, request_id: str, entry: _Entry, arrays: list[np.ndarray]) -> None:
        if not entry.on_disk:
            entry.arrays = arrays
            return
        entry.layout = [(a.shape, a.dtype) for a in arrays]
        with open(self._path(request_id), "wb") as f:
            for a in arrays:
                f.write(np.ascontiguousarray(a).tobytes())
        self.num_disk_swap_outs += 1

    def _load(self, request_id: str, entry: _Entry) -> list[np.ndarray]:
        if not entry.on_disk:
            return entry.arrays
        arrays = []
        with open(self._path(request_id), "rb") as f:
            for shape, dtype in entry.layout:
                count = int(np.prod(shape))
                data = f.read(count * np.dtype(dtype).itemsize)
                arrays.append(np.frombuffer(data, dtype=dtype).reshape(shape))
        return arrays

    def _path(self, request_id: str) -> str:
        if self._dir is None:
            self._dir = tempfile.mkdtemp(prefix="metrale-swap-")
            self._cleanup = weakref.finalize(self, shutil.rmtree, self._dir, True)
        name = hashlib.blake2b(request_id.encode(), digest_size=16).hexdigest()
        return os.path.join(self._dir, name + ".bin")

    @property
    def directory(self) -> str | None:
        """The temp dir of disk swap (None until the first disk swap-out, and after close)."""
        return self._dir

    def close(self) -> None:
        """Drop everything swapped and remove the temp dir."""
        for request_id in list(self._entries):
            self.discard(request_id)
        if self._cleanup is not None:
            self._cleanup()
            self._dir = self._cleanup = None
