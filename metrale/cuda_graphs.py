"""Decode steps as captured CUDA graphs, one per batch-size bucket.

A decode step (every sequence adds one token) has a static shape once the batch is padded to a
bucket: its index arrays live in one device buffer per bucket, laid out as the ForwardBatch
fields, and the model's forward is captured over that buffer. A step then costs one pinned
host->device copy of the packed indices plus one graph launch, whatever the model's depth
(a RawKernel launch costs ~21 us of Python, a replayed kernel ~1 us: DESIGN.md section 7).

Padding rows compute a throw-away token: position 0, context 1, a block table pointing at the
spare KV block and the spare GDN state row that ModelCaches allocates past what the scheduler
hands out, so they never touch a live sequence's cache.

All graphs allocate from one private cupy memory pool that nothing else uses; graphs replay one
at a time, so intermediates of different graphs may share memory, and outputs stay alive as
long as their graph does.
"""
from __future__ import annotations

import numpy as np

from metrale.forward import ForwardBatch

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)

_FIELDS = ("input_ids", "positions", "query_start_loc", "seq_lens", "block_tables",
           "slot_mapping", "state_slots", "logits_indices")


def buckets_for(max_batch: int) -> list[int]:
    sizes = [b for b in BUCKETS if b < max_batch]
    return sizes + [max_batch]


def _layout(bucket: int, width: int) -> list[tuple[str, tuple[int, ...]]]:
    return [("input_ids", (bucket,)), ("positions", (bucket,)),
            ("query_start_loc", (bucket + 1,)), ("seq_lens", (bucket,)),
            ("block_tables", (bucket, width)), ("slot_mapping", (bucket,)),
            ("state_slots", (bucket,)), ("logits_indices", (bucket,))]


class _Graph:
    def __init__(self, bucket: int, width: int, cp):
        self.bucket = bucket
        self.layout = _layout(bucket, width)
        self.size = sum(int(np.prod(s)) for _, s in self.layout)
        self.device = cp.zeros(self.size, dtype=np.int32)
        self.host = cp.cuda.alloc_pinned_memory(self.size * 4)
        self.host_view = np.frombuffer(self.host, np.int32, self.size)
        self.graph = None
        self.logits = None

    def batch(self, block_size: int) -> ForwardBatch:
        views, off = {}, 0
        for name, shape in self.layout:
            n = int(np.prod(shape))
            views[name] = self.device[off: off + n].reshape(shape)
            off += n
        return ForwardBatch(**views, block_size=block_size)


class DecodeGraphs:
    def __init__(self, model, ops, caches, max_batch: int, max_blocks_per_seq: int,
                 spare_block: int, spare_slot: int):
        self.model, self.ops, self.caches = model, ops, caches
        self.cp = ops.cp
        self.width = max_blocks_per_seq
        self.spare_block, self.spare_slot = spare_block, spare_slot
        self.block_size = caches.block_size
        self.stream = self.cp.cuda.get_current_stream()   # the engine's non-default stream
        self.pool = self.cp.cuda.MemoryPool()
        self.graphs = {b: _Graph(b, self.width, self.cp) for b in buckets_for(max_batch)}

    @property
    def max_batch(self) -> int:
        return max(self.graphs)

    def supports(self, batch: ForwardBatch) -> bool:
        return (batch.is_decode and batch.num_seqs <= self.max_batch
                and batch.block_tables.shape[1] <= self.width)

    # -- capture ----------------------------------------------------------------------------
    def capture(self) -> None:
        """Capture every bucket, largest first (its pool blocks then serve the smaller ones)."""
        cp = self.cp
        with cp.cuda.using_allocator(self.pool.malloc), self.stream:
            for bucket in sorted(self.graphs, reverse=True):
                g = self.graphs[bucket]
                self._pack(g, self._padding_batch(0))
                g.device.set(g.host_view, stream=self.stream)
                batch = g.batch(self.block_size)
                self.model.forward(batch, self.caches)          # warm-up: kernels loaded, pool filled
                self.stream.synchronize()
                self.stream.begin_capture()
                g.logits = self.model.forward(batch, self.caches)
                g.graph = self.stream.end_capture()
                self.stream.synchronize()

    def _padding_batch(self, n: int) -> ForwardBatch:
        return ForwardBatch(*(np.zeros(0 if f != "query_start_loc" else 1, np.int32)
                              for f in _FIELDS[:4]),
                            np.zeros((0, 1), np.int32), np.zeros(0, np.int32),
                            np.zeros(0, np.int32), np.zeros(0, np.int32), self.block_size)

    # -- replay -----------------------------------------------------------------------------
    def run(self, batch: ForwardBatch):
        """Replay the smallest bucket that holds `batch` (a host batch); returns the device
        logits of its real rows, valid until the next run on this stream."""
        n = batch.num_seqs
        g = self.graphs[min(b for b in self.graphs if b >= n)]
        self._pack(g, batch)
        with self.stream:
            g.device.set(g.host_view, stream=self.stream)
            g.graph.launch(stream=self.stream)
            return g.logits[:n]

    def _pack(self, g: _Graph, batch: ForwardBatch) -> None:
        """Write `batch` padded to g.bucket rows into g's pinned host buffer."""
        n, b, bs = batch.num_seqs, g.bucket, self.block_size
        out, off = g.host_view, 0
        for name, shape in g.layout:
            size = int(np.prod(shape))
            dst = out[off: off + size].reshape(shape)
            off += size
            src = getattr(batch, name)
            if name == "block_tables":
                dst[:] = 0
                dst[:n, : src.shape[1]] = src
                dst[n:, 0] = self.spare_block
            elif name == "query_start_loc":
                dst[:] = np.arange(b + 1, dtype=np.int32)
            elif name == "logits_indices":
                dst[:] = np.arange(b, dtype=np.int32)
            else:
                dst[:n] = src
                dst[n:] = {"input_ids": 0, "positions": 0, "seq_lens": 1,
                           "slot_mapping": self.spare_block * bs,
                           "state_slots": self.spare_slot}[name]
