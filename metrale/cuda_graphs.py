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

The host side (`DecodeInputs`: the per-bucket input buffers and how a step is packed into them)
needs no GPU. A scheduled decode step is packed straight from its ScheduledSeqs into the pinned
buffer (`pack_decode`, Cython): no ForwardBatch is built, the identity fields (query_start_loc,
logits_indices) are written once, and of the block tables only the entries that changed since
the bucket's last step are written (a sequence keeps its row while the batch keeps its order).
"""
from __future__ import annotations

import numpy as np

from metrale._hot.pack import PADDING, pack_decode
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


class GraphInputs:
    """One bucket's input buffer on the host: int32, laid out as the ForwardBatch fields
    (`_layout`), with a numpy view per field. On CUDA the buffer is pinned memory and the
    source of the step's one host->device copy."""

    def __init__(self, bucket: int, width: int, host: np.ndarray):
        self.bucket, self.width = bucket, width
        self.layout = _layout(bucket, width)
        self.size = sum(int(np.prod(s)) for _, s in self.layout)
        if host.dtype != np.int32 or host.shape != (self.size,):
            raise ValueError(f"bucket {bucket}: host buffer must be int32 [{self.size}], "
                             f"got {host.dtype} {host.shape}")
        self.host_view = host
        self.views: dict[str, np.ndarray] = {}
        off = 0
        for name, shape in self.layout:
            n = int(np.prod(shape))
            self.views[name] = host[off: off + n].reshape(shape)
            off += n
        host[:] = 0
        self.views["query_start_loc"][:] = np.arange(bucket + 1, dtype=np.int32)
        self.views["logits_indices"][:] = np.arange(bucket, dtype=np.int32)
        # what each block-table row holds (see metrale._hot.pack.pack_decode): unknown at first
        self.row_tables: list = [None] * bucket
        self.row_lens = np.full(bucket, width, dtype=np.int32)

    def pack(self, batch: ForwardBatch, spare_block: int, spare_slot: int) -> None:
        """Write host batch `batch` (a decode step) padded to the bucket."""
        n, v = batch.num_seqs, self.views
        bs = batch.block_size
        tables = v["block_tables"]
        tables[:] = 0
        tables[:n, : batch.block_tables.shape[1]] = batch.block_tables
        tables[n:, 0] = spare_block
        for name, pad in (("input_ids", 0), ("positions", 0), ("seq_lens", 1),
                          ("slot_mapping", spare_block * bs), ("state_slots", spare_slot)):
            v[name][:n] = getattr(batch, name)
            v[name][n:] = pad
        self.row_tables[:n] = [None] * n
        self.row_tables[n:] = [PADDING] * (self.bucket - n)
        self.row_lens[:n] = batch.block_tables.shape[1]
        self.row_lens[n:] = 1

    def pack_decode(self, seqs, block_size: int, spare_block: int, spare_slot: int) -> int:
        """Write the decode step `seqs` (ScheduledSeqs, one new token each) padded to the
        bucket; -1 (nothing written) when it is not such a step or a table is too wide."""
        v = self.views
        return pack_decode(seqs, v["input_ids"], v["positions"], v["seq_lens"],
                           v["block_tables"], v["slot_mapping"], v["state_slots"], block_size,
                           spare_block, spare_slot, self.row_tables, self.row_lens)


class DecodeInputs:
    """The host side of the decode graphs: one GraphInputs per bucket. `alloc(n)` returns an
    int32 [n] host buffer (pinned memory on CUDA; plain numpy by default)."""

    def __init__(self, max_batch: int, width: int, block_size: int, spare_block: int,
                 spare_slot: int, alloc=None):
        alloc = alloc or (lambda n: np.zeros(n, dtype=np.int32))
        self.width, self.block_size = width, block_size
        self.spare_block, self.spare_slot = spare_block, spare_slot
        self.buckets: dict[int, GraphInputs] = {}
        for b in buckets_for(max_batch):
            size = sum(int(np.prod(s)) for _, s in _layout(b, width))
            self.buckets[b] = GraphInputs(b, width, alloc(size))
        self.max_batch = max(self.buckets)
        self._bucket_of = [min(b for b in self.buckets if b >= n)
                           for n in range(self.max_batch + 1)]

    def bucket(self, num_seqs: int) -> GraphInputs:
        """The smallest bucket that holds `num_seqs` rows."""
        return self.buckets[self._bucket_of[num_seqs]]

    def supports(self, batch: ForwardBatch) -> bool:
        return (batch.is_decode and batch.num_seqs <= self.max_batch
                and batch.block_tables.shape[1] <= self.width)

    def pack(self, batch: ForwardBatch) -> GraphInputs:
        g = self.bucket(batch.num_seqs)
        g.pack(batch, self.spare_block, self.spare_slot)
        return g

    def pack_decode(self, seqs) -> GraphInputs | None:
        """Pack ScheduledSeqs straight into their bucket; None when `seqs` is not a decode step
        the graphs hold (more rows than the largest bucket, a chunk longer than one token, a
        block table wider than the graphs')."""
        if not seqs or len(seqs) > self.max_batch:
            return None
        g = self.bucket(len(seqs))
        if g.pack_decode(seqs, self.block_size, self.spare_block, self.spare_slot) < 0:
            return None
        return g


class _Graph:
    def __init__(self, inputs: GraphInputs, host, cp):
        self.inputs = inputs
        self.bucket = inputs.bucket
        self.host = host                     # the pinned allocation behind inputs.host_view
        self.host_view = inputs.host_view
        self.device = cp.zeros(inputs.size, dtype=np.int32)
        self.graph = None
        self.logits = None

    def batch(self, block_size: int) -> ForwardBatch:
        views, off = {}, 0
        for name, shape in self.inputs.layout:
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
        pinned: dict[int, object] = {}

        def alloc(n: int) -> np.ndarray:
            mem = self.cp.cuda.alloc_pinned_memory(n * 4)
            view = np.frombuffer(mem, np.int32, n)
            pinned[id(view)] = mem
            return view

        self.inputs = DecodeInputs(max_batch, self.width, self.block_size, spare_block,
                                   spare_slot, alloc)
        self.graphs = {b: _Graph(g, pinned[id(g.host_view)], self.cp)
                       for b, g in self.inputs.buckets.items()}

    @property
    def max_batch(self) -> int:
        return self.inputs.max_batch

    def supports(self, batch: ForwardBatch) -> bool:
        return self.inputs.supports(batch)

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
        g = self.inputs.pack(batch)
        return self._replay(self.graphs[g.bucket], batch.num_seqs)

    def run_decode(self, seqs):
        """Replay a decode step given as ScheduledSeqs (packed straight into the pinned buffer,
        no ForwardBatch); None, with nothing run, when `seqs` is not a decode step the graphs
        hold. Returns the device logits of its real rows, valid until the next run."""
        g = self.inputs.pack_decode(seqs)
        if g is None:
            return None
        return self._replay(self.graphs[g.bucket], len(seqs))

    def _replay(self, g: _Graph, n: int):
        with self.stream:
            g.device.set(g.host_view, stream=self.stream)
            g.graph.launch(stream=self.stream)
            return g.logits[:n]

    def _pack(self, g: _Graph, batch: ForwardBatch) -> None:
        """Write `batch` padded to g.bucket rows into g's pinned host buffer."""
        g.inputs.pack(batch, self.spare_block, self.spare_slot)
