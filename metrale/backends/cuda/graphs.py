"""Decode steps as captured CUDA graphs, one per batch-size bucket; optionally (`--prefill-graphs`)
every other step too (prefill chunks, mixed prefill + decode), one graph per token bucket.

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

from metrale._hot.pack import PADDING, pack_batch, pack_decode
from metrale.forward import ForwardBatch, prefill_work_list

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


def _layout_size(layout) -> int:
    return sum(int(np.prod(shape)) for _, shape in layout)


def _views(buf, layout) -> dict:
    """Consecutive views of the flat buffer `buf` (numpy or cupy), one per (name, shape)."""
    views, off = {}, 0
    for name, shape in layout:
        n = int(np.prod(shape))
        views[name] = buf[off: off + n].reshape(shape)
        off += n
    return views


def _checked_host(host: np.ndarray, size: int, bucket: int) -> np.ndarray:
    if host.dtype != np.int32 or host.shape != (size,):
        raise ValueError(f"bucket {bucket}: host buffer must be int32 [{size}], got {host.dtype} {host.shape}")
    host[:] = 0
    return host


def _pinned_allocator(cp):
    """(alloc, pinned): alloc(n) returns an int32 [n] numpy view of new pinned host memory;
    pinned[id(view)] keeps that memory (the graphs hold it as long as they live)."""
    pinned: dict[int, object] = {}

    def alloc(n: int) -> np.ndarray:
        mem = cp.cuda.alloc_pinned_memory(n * 4)
        view = np.frombuffer(mem, np.int32, n)
        pinned[id(view)] = mem
        return view

    return alloc, pinned


class GraphInputs:
    """One bucket's input buffer on the host: int32, laid out as the ForwardBatch fields
    (`_layout`), with a numpy view per field. On CUDA the buffer is pinned memory and the
    source of the step's one host->device copy."""

    def __init__(self, bucket: int, width: int, host: np.ndarray):
        self.bucket, self.width = bucket, width
        self.layout = _layout(bucket, width)
        self.size = _layout_size(self.layout)
        self.host_view = _checked_host(host, self.size, bucket)
        self.views: dict[str, np.ndarray] = _views(host, self.layout)
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
            size = _layout_size(_layout(b, width))
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


def capture_forward(model, batch: ForwardBatch, caches, stream, launch):
    """The one capture routine of the decode and step graphs: a warm-up forward over `batch`
    (kernels loaded, the pool filled), then the forward captured on `stream` with programmatic
    edges between our kernels (`launch`: the ops' LaunchContext, kernels.py). Returns (graph,
    logits, hidden): the final-norm hidden states of every token row stay in the graph's memory
    too (the MTP drafter reads them: ModelRunner.keep_hidden); on an error the stream leaves
    capture mode before it propagates."""
    model.forward(batch, caches)
    stream.synchronize()
    stream.begin_capture()
    try:
        with launch.capture():
            logits, hidden = model.forward_with_hidden(batch, caches)
    except BaseException:
        try:
            stream.end_capture()
        except Exception:  # noqa: BLE001 - the capture's own error is the one to report
            pass
        raise
    graph = stream.end_capture()
    stream.synchronize()
    return graph, logits, hidden


class _Graph:
    def __init__(self, inputs: GraphInputs, host, cp):
        self.inputs = inputs
        self.bucket = inputs.bucket
        self.host = host                     # the pinned allocation behind inputs.host_view
        self.host_view = inputs.host_view
        self.device = cp.zeros(inputs.size, dtype=np.int32)
        self.graph = None
        self.logits = None
        self.hidden = None

    def batch(self, block_size: int) -> ForwardBatch:
        return ForwardBatch(**_views(self.device, self.inputs.layout), block_size=block_size)


class DecodeGraphs:
    def __init__(self, model, ops, caches, max_batch: int, max_blocks_per_seq: int,
                 spare_block: int, spare_slot: int):
        self.model, self.ops, self.caches = model, ops, caches
        self.cp = ops.cp
        self.launch = ops.launch
        self.width = max_blocks_per_seq
        self.spare_block, self.spare_slot = spare_block, spare_slot
        self.block_size = caches.block_size
        self.stream = self.cp.cuda.get_current_stream()   # the engine's non-default stream
        self.pool = self.cp.cuda.MemoryPool()
        alloc, pinned = _pinned_allocator(self.cp)
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
                g.graph, g.logits, g.hidden = capture_forward(
                    self.model, g.batch(self.block_size), self.caches, self.stream, self.launch)
        self.pdl = self.launch.pdl_enabled      # what the graphs were captured with

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
            self.last_hidden = g.hidden         # its first n rows are the step's tokens
            return g.logits[:n]

    def _pack(self, g: _Graph, batch: ForwardBatch) -> None:
        """Write `batch` padded to g.bucket rows into g's pinned host buffer."""
        g.inputs.pack(batch, self.spare_block, self.spare_slot)


# -- step graphs: prefill / mixed steps ------------------------------------------------------
#
# A step with T new tokens over B sequences is padded to a token bucket Tb >= T and R sequence
# rows (step_rows: min(Tb, max_batch) + the padding rows, never Tb): the B real sequences, then
# padding sequences that own the Tb - T padding tokens, at most one block table's span
# (width x block size) each (positions 0.., slot -1: no KV write; their block tables are the spare
# block, whose KV only ever holds what decode padding rows wrote, so their rows stay finite), then
# empty sequences. The prefill
# attention work list of each tile size the model uses is part of the input buffer, padded with
# (padding row, Tb) items that the kernels skip (q0 past the sequence's tokens). One pinned host
# buffer, one host->device copy and one graph launch per step, whatever the depth: an eager
# SmolLM2-135M prefill step of 1 x 128 tokens costs ~9 ms of Python against 1.2 ms of GPU.
# Logits come back for every real row (the runner keeps the sampling ones). GDN rows: padding rows
# start fresh and leave their state in the spare state row; empty rows touch no state.

STEP_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048)
# Verify steps (speculative decoding, metrale.spec) replay step graphs of their own, up to this
# many tokens: their layout adds ForwardBatch.state_out and a logits row per token, and the GDN
# layers of a step with state_out run the recurrent kernel token by token (a decode step's form),
# which a long prefill chunk in the same step would pay for; larger verify steps run eagerly.
# Small buckets first: a single stream's window of 4 tokens in a 16-token bucket paid 12
# padding rows through every GDN and attention layer.
VERIFY_BUCKETS = (4, 8, 16, 32, 64, 128)


def step_buckets_for(max_tokens: int, buckets=STEP_BUCKETS) -> list[int]:
    """Token buckets up to min(max_tokens, the largest of `buckets`)."""
    top = min(max_tokens, buckets[-1])
    return [b for b in buckets if b < top] + [top]


def _step_layout(tokens: int, rows: int, width: int, tiles,
                 verify: bool = False) -> list[tuple[str, tuple[int, ...]]]:
    """A step bucket's buffer; a verify bucket projects every token to logits and carries
    state_out (its last field, after the work lists)."""
    return ([("input_ids", (tokens,)), ("positions", (tokens,)), ("query_start_loc", (rows + 1,)),
             ("seq_lens", (rows,)), ("block_tables", (rows, width)), ("slot_mapping", (tokens,)),
             ("state_slots", (rows,)), ("logits_indices", (tokens if verify else rows,))]
            + [(f"work{bq}", (-(-tokens // bq) + rows, 2)) for bq in tiles]
            + ([("state_out", (tokens,))] if verify else []))


class StepInputs:
    """One token bucket's input buffer on the host (int32, `_step_layout`), and how a step is
    padded into it. `host` is the int32 buffer (pinned memory on CUDA)."""

    def __init__(self, tokens: int, rows: int, width: int, tiles, host: np.ndarray,
                 pad_cap: int | None = None, verify: bool = False):
        self.tokens, self.rows, self.width, self.tiles = tokens, rows, width, tuple(sorted(tiles))
        self.verify = verify
        self.pad_cap = pad_cap or tokens        # padding tokens per padding row (one table's span)
        self._pad_positions = np.arange(tokens, dtype=np.int32) % self.pad_cap
        self.layout = _step_layout(tokens, rows, width, self.tiles, verify)
        self.size = _layout_size(self.layout)
        self.host_view = _checked_host(host, self.size, tokens)
        self.views: dict[str, np.ndarray] = _views(host, self.layout)

    def fits(self, num_tokens: int, num_seqs: int) -> bool:
        return (num_tokens <= self.tokens
                and num_seqs + padding_rows(self.tokens - num_tokens, self.pad_cap) <= self.rows)

    def pack(self, seqs, block_size: int, spare_block: int, spare_slot: int,
             state_out=None) -> int:
        """Pad the step `seqs` (ScheduledSeqs) into the buffer; returns its number of real
        rows (a verify bucket: of logits rows), or -1 (nothing written) when it does not fit
        (tokens, rows, block-table width)."""
        ids, pos, qsl, seq_lens, tables, slots, state, li = pack_batch(seqs, block_size)
        b = self.pack_arrays(ids, pos, qsl, seq_lens, tables, slots, state, spare_block, spare_slot,
                             li if self.verify else None, state_out)
        return len(li) if self.verify and b >= 0 else b

    def pack_arrays(self, ids, pos, qsl, seq_lens, tables, slots, state, spare_block: int,
                    spare_slot: int, logits_indices=None, state_out=None) -> int:
        """pack() from a step's flat arrays (ForwardBatch layouts)."""
        t, b = len(ids), len(seq_lens)
        if not self.fits(t, b) or tables.shape[1] > self.width:
            return -1
        v, tb = self.views, self.tokens
        v["input_ids"][:t] = ids
        v["input_ids"][t:] = 0
        # rows b .. b + npad - 1: the padding tokens, pad_cap each (the last the rest); then empty
        pad, cap = tb - t, self.pad_cap
        npad = padding_rows(pad, cap)
        lens = np.full(npad, cap, np.int32)
        lens[-1] = pad - cap * (npad - 1)
        v["positions"][:t] = pos
        v["positions"][t:] = self._pad_positions[:pad]
        q = v["query_start_loc"]
        q[: b + 1] = qsl
        q[b + 1: b + 1 + npad] = t + np.cumsum(lens)
        q[b + 1 + npad:] = tb
        sl = v["seq_lens"]
        sl[:b] = seq_lens
        sl[b: b + npad] = lens
        sl[b + npad:] = 0
        bt = v["block_tables"]
        bt[:b] = 0
        bt[:b, : tables.shape[1]] = tables
        bt[b:] = spare_block
        v["slot_mapping"][:t] = slots
        v["slot_mapping"][t:] = -1          # padding tokens write no KV
        v["state_slots"][:b] = state
        v["state_slots"][b:] = spare_slot
        li = v["logits_indices"]
        if self.verify:                     # the step's own logits rows (every verify row)
            n = 0 if logits_indices is None else len(logits_indices)
            if n:
                li[:n] = logits_indices
            li[n:] = 0
            so = v["state_out"]
            so[:t] = -1 if state_out is None else state_out
            so[t:] = -1
        else:
            li[:b] = q[1: b + 1] - 1        # every real row's last token (the runner keeps the samplers)
            li[b:] = 0
        for bq in self.tiles:
            work = prefill_work_list(q, sl, bq)
            w = v[f"work{bq}"]
            w[: len(work)] = work
            w[len(work):, 0] = b            # no-op items: past the padding row's tokens
            w[len(work):, 1] = tb
        return b

    def pack_padding(self, spare_block: int, spare_slot: int) -> None:
        """A step of padding only (capture): no real rows."""
        z = np.zeros(0, np.int32)
        self.pack_arrays(z, z, np.zeros(1, np.int32), z, np.zeros((0, 1), np.int32), z, z,
                         spare_block, spare_slot)

    def batch(self, arrays: dict, block_size: int) -> ForwardBatch:
        """The ForwardBatch over `arrays` (this layout's views of a buffer: host or device),
        with its work lists as `.work` ({bq: [W, 2]})."""
        fb = ForwardBatch(**{n: arrays[n] for n, _ in self.layout[:8]}, block_size=block_size,
                          state_out=arrays["state_out"] if self.verify else None)
        fb.work = {bq: arrays[f"work{bq}"] for bq in self.tiles}
        return fb


def step_graph_support(model) -> str | None:
    """Why `model`'s steps cannot be captured with static shapes (None when they can). The
    layers known to launch with grids fixed by array shapes alone: attention (its prefill work
    list comes with the step), Gated DeltaNet (grids (channels, T / seg + B) and (heads, B); rows
    without new tokens return at once), dense MLPs and MoE (token permutation sized by T x
    top-k)."""
    from metrale.models.layers import Attention, DenseMLP, SparseMoe
    from metrale.models.qwen3_5 import GatedDeltaNet

    layers = getattr(model, "layers", None)
    if not layers:
        return "the model has no decoder layers"
    for i, layer in enumerate(layers):
        if not isinstance(layer.mixer, (Attention, GatedDeltaNet)):
            return f"layer {i}'s mixer is {type(layer.mixer).__name__}"
        if not isinstance(layer.mlp, (DenseMLP, SparseMoe)):
            return f"layer {i}'s MLP is {type(layer.mlp).__name__}"
    return None


def padding_rows(pad: int, cap: int) -> int:
    """Padding rows for `pad` padding tokens at most `cap` per row (at least one)."""
    return max(1, -(-pad // cap))


def step_rows(tokens: int, max_batch: int, pad_cap: int | None = None) -> int:
    """Sequence rows of a token bucket: every real row, the padding rows (at most `pad_cap`
    tokens each: one block table's span), and never exactly as many rows as tokens (a batch with
    T == B would look like a decode step to the ops that pick their decode kernels by shape)."""
    rows = min(tokens, max_batch) + padding_rows(tokens, pad_cap or tokens)
    return rows + 1 if rows == tokens else rows


class StepBuckets:
    """The host side of the step graphs: one StepInputs per token bucket, and which one a step
    goes to. `alloc(n)` returns an int32 [n] host buffer (pinned memory on CUDA; plain numpy by
    default). `tiles`: the prefill attention tile sizes (tokens per work item) the model uses."""

    def __init__(self, max_tokens: int, max_batch: int, width: int, tiles, block_size: int,
                 spare_block: int, spare_slot: int, alloc=None, verify: bool = False):
        alloc = alloc or (lambda n: np.zeros(n, dtype=np.int32))
        self.block_size, self.spare_block, self.spare_slot = block_size, spare_block, spare_slot
        self.buckets: dict[int, StepInputs] = {}
        # a padding row's tokens must fit its block table; a verify bucket's padding rows hold
        # one token each: its GDN layers walk each row's tokens one after another, and one
        # row of 11 padding tokens beside a 5-token window took twice the window's time
        cap = 1 if verify else width * block_size
        for tokens in step_buckets_for(max_tokens, VERIFY_BUCKETS if verify else STEP_BUCKETS):
            rows = step_rows(tokens, max_batch, cap)
            size = _layout_size(_step_layout(tokens, rows, width, tiles, verify))
            self.buckets[tokens] = StepInputs(tokens, rows, width, tiles, alloc(size), pad_cap=cap,
                                              verify=verify)
        self.max_tokens = max(self.buckets)

    def pack(self, seqs, state_out=None) -> tuple[StepInputs, int] | None:
        """Pad the step `seqs` (ScheduledSeqs) into the smallest bucket that holds it: (its
        inputs, the number of real rows, or of logits rows in a verify bucket), or None (nothing
        written) when none does."""
        t = sum(s.num_new_tokens + s.num_drafts for s in seqs)
        if not seqs or t > self.max_tokens:
            return None
        for inputs in self.buckets.values():          # ascending
            if inputs.fits(t, len(seqs)):
                b = inputs.pack(seqs, self.block_size, self.spare_block, self.spare_slot, state_out)
                return None if b < 0 else (inputs, b)
        return None


class StepGraphs:
    """Prefill / mixed steps replayed from graphs captured per token bucket (see above). Shares
    the decode graphs' memory pool and stream: graphs replay one at a time."""

    def __init__(self, model, ops, caches, max_tokens: int, max_batch: int, max_blocks_per_seq: int,
                 spare_block: int, spare_slot: int, pool, stream, verify: bool = False):
        from metrale.models.layers import Attention

        self.model, self.caches = model, caches
        self.cp = ops.cp
        self.launch = ops.launch
        self.block_size = caches.block_size
        self.pool, self.stream = pool, stream
        tiles = sorted({ops.prefill_tile_tokens(l.mixer.shape.n_heads, l.mixer.shape.n_kv_heads,
                                                l.mixer.shape.head_dim)
                        for l in model.layers if isinstance(l.mixer, Attention)})
        alloc, self._pinned = _pinned_allocator(self.cp)
        self.verify = verify
        self.inputs = StepBuckets(max_tokens, max_batch, max_blocks_per_seq, tiles, self.block_size,
                                  spare_block, spare_slot, alloc, verify=verify)
        # per bucket: the device copy of its inputs, the captured graph, its logits
        self.graphs: dict[int, dict] = {tokens: {} for tokens in self.inputs.buckets}

    def capture(self) -> None:
        """Capture every bucket, largest first (its pool blocks then serve the smaller ones)."""
        cp, ins = self.cp, self.inputs
        with cp.cuda.using_allocator(self.pool.malloc), self.stream:
            for tokens in sorted(self.graphs, reverse=True):
                g, inputs = self.graphs[tokens], ins.buckets[tokens]
                g["device"] = cp.zeros(inputs.size, dtype=np.int32)
                inputs.pack_padding(ins.spare_block, ins.spare_slot)
                g["device"].set(inputs.host_view, stream=self.stream)
                batch = inputs.batch(_views(g["device"], inputs.layout), self.block_size)
                g["graph"], g["logits"], g["hidden"] = capture_forward(
                    self.model, batch, self.caches, self.stream, self.launch)

    def run_step(self, seqs, state_out=None):
        """Replay the smallest bucket that holds the step `seqs` (ScheduledSeqs); None, with
        nothing run, when none does. Returns the device logits of its real rows (one per
        sequence, in order; verify graphs: the step's logits rows, as pack_batch orders them),
        valid until the next run on this stream."""
        packed = self.inputs.pack(seqs, state_out)
        if packed is None:
            return None
        inputs, b = packed
        g = self.graphs[inputs.tokens]
        with self.stream:
            g["device"].set(inputs.host_view, stream=self.stream)
            g["graph"].launch(stream=self.stream)
            self.last_hidden = g["hidden"]      # real tokens first, in the step's order
            return g["logits"][:b]
