"""The MTP drafter: `--speculative` on a checkpoint whose MTP head was loaded (metrale.models.mtp).

The head follows the target. After every step (`observe`) it runs over the positions the step
computed and kept, with the target's hidden states of those positions (after the final norm,
`ModelRunner.last_forward`) and the shifted ids (the token after each position: the next prompt
token, the sampled one, or for a verify the accepted drafts then the emitted token), writing its
own K/V at those positions' slots. Its output hidden at the last kept position of a decoding
request is kept; `propose` drafts from it:

    draft 1     argmax of the head's logits at that position (`--mtp-vocab N`: ids [0, N) only)
    draft j+1   one head row further: token draft j, the head's own output hidden of the row
                before, at the next position (writing the head's K/V there; the next observe
                overwrites the positions it keeps), argmax of its logits
    up to the request's limit (K = num_drafts drafts), one batched head forward per chain step
    over every drafting request. `--draft-confidence-stop TAU`: a chain goes past a draft only
    while that draft's top-1 probability (softmax of the head's logits) is >= TAU; the draft
    below TAU is still proposed.

Rows of rejected drafts are never run through the head (their hidden states are of tokens not
kept): the head KV at those positions is what the chain wrote, overwritten once kept.

Where the head's KV lives: its own ModelCaches (one attention layer), indexed by the main block
tables and slot mapping (the main pool's num_blocks and block_size), plus a few blocks of its
own after them: private copies of cached blocks (below) and scratch blocks for chain rows past
the blocks a request holds.

Prefix-cache hits. A cached block's head KV was written by whoever computed the block, and is
right for this request except, possibly, at the block's LAST position: the head row there reads
the token after the block, which the block's hash does not cover. The drafter keeps, per KV
block, the target hidden state at its last position and the token that row used (written when
the block is computed). When a request starts at a cached prefix, every matched block whose
recorded next token differs from this request's gets a private copy of its head KV with that
last row recomputed (stored hidden, this request's token); the request's head block table
points there. Its head then equals a run that computed the whole prefix. A block whose record
is missing, or no private block left, leaves the request without drafts (never wrong ones).

Preemption: recompute drops the request's head state, the recompute's prefill chunks rebuild it
(observe sees them again); swap copies the head's KV and records of the swapped blocks to host
memory with the main KV (not counted in --swap-space-gb) and back at swap-in. Compaction
(--auto-compact) is a recompute.

On CUDA the target's decode, prefill and verify steps replay their graphs while this drafter
is on (`keep_hidden`: the graphs keep the final-norm hidden states of every token row, and the
runner hands the drafter a view of them with the step's host batch), and the head's own
forwards (observe, one per chain step) replay decode graphs of the head (`capture_graphs`: every
head row as a one-token decode row; more rows than the largest bucket run eagerly).

`MTP_DEFAULT_DRAFTS`: the drafts per verify when --num-drafts is left at 1 (Speculation).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from metrale.cache.kv import ModelCaches
from metrale.config import ConfigError
from metrale.forward import ForwardBatch
from metrale.request import Request, RequestStatus

log = logging.getLogger("metrale.spec.mtp")

# Drafts per verify when --num-drafts is left at its default (1), by model type. Qwen3.5 / 3.6
# (dense and MoE): 3, K = 4 rows per verify, the operator reference's MODEL.toml default for
# qwen3.6-27b. Only the MTP drafter reads this table.
MTP_DEFAULT_DRAFTS = {"qwen3_5": 3, "qwen3_5_moe": 3}
_TEXT_TYPES = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}

PRIVATE_BLOCKS_PER_SEQ = 2      # private copies of cached blocks, per running request (a pool)


def default_drafts(model, num_drafts: int) -> int:
    """--num-drafts as given, or the model's MTP default when it is left at 1."""
    if num_drafts != 1:
        return num_drafts
    config = getattr(model, "config", None) or {}
    model_type = _TEXT_TYPES.get(config.get("model_type"), config.get("model_type"))
    return MTP_DEFAULT_DRAFTS.get(model_type, num_drafts)


def head_precision(head) -> str:
    """The precision the MTP head's weights ship in: "bf16" (not quantized: the checkpoint's
    float dtype), "fp8" or "nvfp4" (QuantizedTensor / StackedParts on the host, QWeight /
    PartsWeight on CUDA), or "mixed (...)" when its linears mix FP8 and NVFP4. Read from the
    head's decoder layer (its fc is always held dequantised; embed and lm head are the main
    model's)."""
    formats: set[str] = set()
    seen: set[int] = set()
    stack = [head.layer]
    while stack:
        obj = stack.pop()
        if obj is None or id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool)):
            continue
        seen.add(id(obj))
        fmt = getattr(obj, "format", None)
        if fmt in ("fp8", "nvfp4"):
            formats.add(fmt)
            continue
        parts = getattr(obj, "parts", None)
        if isinstance(parts, tuple):
            stack.extend(parts)
            continue
        if isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif hasattr(obj, "__dict__") and not hasattr(obj, "shape"):
            stack.extend(v for k, v in vars(obj).items() if k != "ops")
    if not formats:
        return "bf16"
    if len(formats) == 1:
        return formats.pop()
    return "mixed (" + " + ".join(sorted(formats)) + ")"


def check_quantization(head, wanted: str) -> None:
    """--mtp-quantization must name the precision the checkpoint's MTP tensors ship in."""
    have = head_precision(head)
    if have != wanted:
        what = ("are not quantized (bf16: the checkpoint's float dtype)" if have == "bf16"
                else f"are {have}")
        hint = (f"; set --mtp-quantization {have}" if have in ("bf16", "fp8", "nvfp4")
                else "; no --mtp-quantization setting serves it")
        raise ConfigError(f"--mtp-quantization {wanted}: this checkpoint's MTP head tensors "
                          f"(mtp.layers.0.*) {what}{hint}")


@dataclass
class _Head:
    """One request's head state."""
    row: int                        # its row of MtpDrafter._last
    next_pos: int = 0               # head KV valid at positions [0, next_pos); _last[row] is
                                    # the head's output hidden at next_pos - 1
    # logical block -> (private head block, the token after it): cached blocks whose last row
    # was recomputed for this request
    private: dict[int, tuple[int, int]] = field(default_factory=dict)
    broken: bool = False            # the head cannot follow this request: no drafts


@dataclass
class _Swapped:
    next_pos: int
    kv: list                        # ModelCaches.read_blocks of the head's blocks
    hidden: np.ndarray              # stored target hidden at each block's last position
    next_tokens: np.ndarray


class MtpDrafter:
    name = "mtp"

    def __init__(self, config, head):
        self.config = config
        self.head = head
        self.vocab_limit = int(config.mtp_vocab)
        self.tau = float(config.draft_confidence_stop or 0.0)
        self.cap: int | None = None     # Speculation: drafts per request this step (prompt
                                        # lookup's fallback receives prompt lookup's limits)
        self.max_seqs = max(1, config.max_batch_size)   # drafting sequences at once (size())
        self.max_drafts = 16
        self.caches: ModelCaches | None = None
        self.ops = None
        self._state: dict[str, _Head] = {}
        self._swapped: dict[str, _Swapped] = {}
        self.num_private_copies = 0     # cached blocks whose last head row was recomputed
        self.graphs = None              # CUDA: the head's forwards as decode graphs (capture_graphs)
        self._step = None
        self.chain = None               # CUDA: a step's whole draft chain as one graph (_Chain)

    def size(self, max_seqs: int, max_drafts: int) -> None:
        """Speculation's limits (sizes the scratch blocks of chains; before bind)."""
        self.max_seqs, self.max_drafts = max(1, max_seqs), max(1, max_drafts)

    # -- the drafter hooks (metrale.spec.Speculation) ---------------------------------------
    def kv_bytes_per_block(self, block_size: int, dtype) -> int:
        """The head's KV and the stored hidden state per main KV block."""
        return (self.head.cache_spec().kv_bytes_per_block(block_size, dtype)
                + self.head.hidden_size * np.dtype(dtype).itemsize)

    def bind(self, caches, ops) -> bool:
        bs = caches.block_size
        self.ops, self.block_size = ops, bs
        self.main_blocks = caches.num_blocks
        n_private = PRIVATE_BLOCKS_PER_SEQ * self.config.max_batch_size
        n_scratch = self.max_seqs * (-(-self.max_drafts // bs) + 1)
        first_scratch = self.main_blocks + n_private
        self._private_free = list(range(first_scratch - 1, self.main_blocks - 1, -1))
        self._scratch = range(first_scratch, first_scratch + n_scratch)
        self.caches = ModelCaches(self.head.cache_spec(), ops, first_scratch + n_scratch, bs, 0)
        log.info("MTP drafter: head KV of %d blocks (the main pool's %d, %d private copies, %d "
                 "chain scratch), %.1f MiB; --mtp-vocab %d, --draft-confidence-stop %g",
                 self.caches.num_blocks, self.main_blocks, n_private, n_scratch,
                 self.caches.total_bytes / 2**20, self.vocab_limit, self.tau)
        hid = self.head.hidden_size
        self._hidden_store = ops.zeros((self.main_blocks, hid))    # target hidden at a block's end
        self._next_tokens = np.full(self.main_blocks, -1, np.int64)  # the token its head row read
        rows = self.config.max_batch_size + 1
        self._last = ops.zeros((rows + 1, hid))     # the last row: padding rows of the chain graphs
        self._free_rows = list(range(rows - 1, -1, -1))
        return True

    def release(self, request_id: str) -> None:
        self._drop(request_id)
        self._swapped.pop(request_id, None)

    def capture_graphs(self, main) -> None:
        """CUDA: the head's forwards replayed from decode graphs of its own (`main`: the
        target's DecodeGraphs, whose spare block, block-table width and stream they share).
        Every head row runs as a one-token decode row, a sequence's consecutive rows included:
        each layer writes every row's K/V before any row attends, so row j sees rows < j of its
        own sequence (the same result as one multi-token row). Steps with more rows than the
        largest bucket (long prefill chunks) run eagerly."""
        from metrale.backends.cuda.graphs import DecodeGraphs

        rows = min(256, self.max_seqs * (self.max_drafts + 1))
        self._step = _HeadStep(self.head, self.ops, rows)
        with main.stream:           # the engine's stream (DecodeGraphs captures on the current one)
            graphs = DecodeGraphs(self._step, self.ops, self.caches, rows, main.width + 1,
                                  spare_block=main.spare_block, spare_slot=0)
            graphs.capture()
            self.graphs = graphs
            if self.max_drafts > 1:
                self.chain = _Chain(self, graphs.graphs, main.width + 1, main.spare_block)
                self.chain.capture(main.stream, graphs.pool)
        log.info("MTP drafter: captured %d head graphs (row buckets %s)%s", len(graphs.graphs),
                 sorted(graphs.graphs), f", draft chains of {self.max_drafts} as one graph per "
                 "bucket" if self.chain is not None else "")

    def _head_forward(self, rows: "_Rows", target):
        """The head over `rows` reading the target hidden rows `target` ([rows, H]): output
        hidden [rows, H] (a graph's buffer when replayed: valid until its next replay)."""
        n = rows.num_rows
        if self.graphs is not None and n <= self.graphs.max_batch:
            batch = rows.decode_batch(self.block_size)
            if self.graphs.supports(batch):
                self._step.target[:n] = target
                return self.graphs.run(batch)
        return self.head.forward(self.ops.upload_batch(rows.batch(self.block_size)), target,
                                 self.caches)

    # -- following the target ---------------------------------------------------------------
    def observe(self, out, emitted, forward) -> None:
        """Run the head over the positions the step computed and kept (module docstring)."""
        if self.caches is None:
            return
        for rid, blocks, _ in out.swap_out:
            self._save(rid, blocks)
        for req in out.preempted:
            self._drop(req.request_id)
        restored = {rid for rid, blocks, _ in out.swap_in if self._restore(rid, blocks)}
        if not out.seqs:
            return
        if forward is None:             # no hidden states (not bound to the runner): lost
            for seq in out.seqs:
                self._state.setdefault(seq.request.request_id, _Head(-1, broken=True)).broken = True
            self._drop_stopped(out)
            return
        batch, hidden = forward
        if batch.num_tokens != out.num_new_tokens or batch.num_seqs != len(out.seqs):
            raise RuntimeError(f"MTP drafter: the step's batch has {batch.num_tokens} rows for "
                               f"{out.num_new_tokens} scheduled tokens")
        bs = self.block_size
        qsl = batch.query_start_loc
        rows = _Rows()
        fixes = _Rows()                  # recomputed last rows of cached blocks (K/V only)
        tails = []                       # (state, row index in `rows`, next_pos)
        for i, seq in enumerate(out.seqs):
            req = seq.request
            rid = req.request_id
            q0 = int(qsl[i])
            start = int(batch.positions[q0])
            tokens = emitted.get(rid)
            accepted = len(tokens) - 1 if seq.num_drafts and isinstance(tokens, list) else 0
            m = seq.num_new_tokens + accepted
            st = self._state.get(rid)
            table = [int(b) for b in batch.block_tables[i][: -(-(start + m) // bs)]]
            if st is None:
                st = self._new_state(rid)
                if st.broken:
                    continue
                if start > 0 and rid not in restored:
                    self._catch_up(st, req, table, start, fixes)
            elif st.next_pos != start:
                st.broken = True
            if st.broken or m <= 0:
                continue
            if seq.sample:
                nxt = tokens[-1] if isinstance(tokens, list) else tokens
            else:
                nxt = _token_at(req, start + seq.num_new_tokens)
            for lb, (blk, _) in st.private.items():
                if lb < len(table):
                    table[lb] = blk
            ids = batch.input_ids[q0 + 1: q0 + m].tolist() + [int(nxt)]
            rows.add_seq(ids, start, table, batch.slot_mapping[q0: q0 + m].tolist(),
                         list(range(q0, q0 + m)))
            tails.append((st, rows.num_rows - 1, start + m))
        if rows.num_rows or fixes.num_rows:
            self._run_observe(rows, fixes, hidden, tails)
        self._drop_stopped(out)

    def _drop_stopped(self, out) -> None:
        """Requests of the step that no longer run: finished, aborted, compacted (which
        recomputes: the head catches up again from its chunks)."""
        for seq in out.seqs:
            if seq.request.status is not RequestStatus.RUNNING:
                self._drop(seq.request.request_id)

    def _run_observe(self, rows: "_Rows", fixes: "_Rows", hidden, tails) -> None:
        ops, bs = self.ops, self.block_size
        n, nf = rows.num_rows, fixes.num_rows
        src = np.asarray(rows.src, np.int32)
        target = ops.embedding(src, hidden) if n else None
        if nf:
            both = ops.empty((n + nf, self.head.hidden_size))
            if n:
                both[:n] = target
            both[n:] = ops.embedding(np.asarray(fixes.src, np.int32), self._hidden_store)
            target = both
        rows.extend(fixes)
        out = self._head_forward(rows, target)
        if tails:       # per request: the head's output at its last kept position
            st_rows = np.asarray([st.row for st, _, _ in tails], np.int64)
            self._last[ops.asarray(st_rows, dtype=np.int64)] = ops.embedding(
                np.asarray([r for _, r, _ in tails], np.int32), out)
        for st, _, next_pos in tails:
            st.next_pos = next_pos
        # per computed block end: the target hidden there and the token its head row read
        pos = np.asarray(rows.positions[:n], np.int32)
        ends = np.nonzero(pos % bs == bs - 1)[0]
        if len(ends):
            blocks = np.asarray(rows.slots, np.int32)[ends] // bs
            self._hidden_store[ops.asarray(blocks.astype(np.int64), dtype=np.int64)] = \
                ops.embedding(src[ends], hidden)
            self._next_tokens[blocks] = np.asarray(rows.ids, np.int32)[ends]

    def _catch_up(self, st: _Head, req: Request, table: list[int], start: int, fixes) -> None:
        """A request starting at a cached prefix of `start` tokens: give every matched block
        whose last head row read another token than this request's a private copy with that
        row recomputed (module docstring)."""
        bs = self.block_size
        if start % bs:
            st.broken = True            # not a prefix hit (those end on blocks): cannot follow
            return
        tokens = req.all_token_ids
        wanted = []
        for lb in range(start // bs):
            block, ours = table[lb], int(tokens[(lb + 1) * bs])
            recorded = int(self._next_tokens[block])
            if recorded == ours:
                continue
            if recorded < 0 or not self._private_free:
                st.broken = True        # no record of the block's end, or no room: no drafts
                self._free_private(st)
                return
            wanted.append((lb, block, ours))
            st.private[lb] = (self._private_free.pop(), ours)
        view = list(table)
        for lb, (blk, _) in st.private.items():
            view[lb] = blk
        for lb, block, ours in wanted:
            private = st.private[lb][0]
            self.caches.copy_block(block, private)
            pos = (lb + 1) * bs - 1
            fixes.add_seq([ours], pos, view[: lb + 1], [private * bs + bs - 1], [block])
            self.num_private_copies += 1

    # -- drafting ------------------------------------------------------------------------------
    def propose(self, requests: list[Request], limits: list[int]) -> None:
        todo = []
        for req, k in zip(requests, limits):
            req.draft_token_ids = []
            st = self._state.get(req.request_id)
            if self.cap is not None:
                k = min(k, self.cap)
            if k > 0 and st is not None and not st.broken and st.next_pos == req.num_tokens - 1:
                todo.append((req, st, min(k, self.max_drafts)))
        if not todo:
            return
        if self.chain is not None and self._propose_chain(todo):
            return
        ops, bs = self.ops, self.block_size
        h = ops.embedding(np.asarray([st.row for _, st, _ in todo], np.int32), self._last)
        ids, probs = self._pick(h)
        drafts = [[int(t)] for t in ids]
        keep = [self._goes_on(1, todo[i][2], probs, i) for i in range(len(todo))]
        active = [i for i in range(len(todo)) if keep[i]]
        tables = self._chain_tables(todo, active)
        at = {i: i for i in range(len(todo))}     # request -> its row of h
        step = 0
        while True:
            # the chain's next row: position next_pos + step (a scratch block where it has none)
            active = [i for i in active if (todo[i][1].next_pos + step) // bs < len(tables[i])]
            if not active:
                break
            rows = _Rows()
            for i in active:
                pos = todo[i][1].next_pos + step
                table = tables[i]
                rows.add_seq([drafts[i][-1]], pos, table[: pos // bs + 1],
                             [table[pos // bs] * bs + pos % bs], [at[i]])
            idx = np.asarray(rows.src, np.int32)
            same = len(idx) == h.shape[0] and np.array_equal(idx, np.arange(len(idx)))
            h = self._head_forward(rows, h if same else ops.embedding(idx, h))
            ids, probs = self._pick(h)
            for r, i in enumerate(active):
                drafts[i].append(int(ids[r]))
                at[i] = r
            active = [i for r, i in enumerate(active)
                      if self._goes_on(len(drafts[i]), todo[i][2], probs, r)]
            step += 1
        for (req, _, _), d in zip(todo, drafts):
            req.draft_token_ids = d

    def _propose_chain(self, todo) -> bool:
        """The chain of every drafting request as one replay (_Chain): all its steps run for
        every request (rows past a request's table write the spare block), and each request
        keeps what the step-by-step loop would have drafted: up to its limit, ended by
        --draft-confidence-stop or where its head blocks run out. False (nothing done) when the
        chain graphs do not hold this step."""
        tables = self._chain_tables(todo, range(len(todo)))
        got = self.chain.run(todo, tables)
        if got is None:
            return False
        ids, probs = got
        bs = self.block_size
        for i, (req, st, k) in enumerate(todo):
            drafts = [int(ids[0, i])]
            while (self._goes_on(len(drafts), k, probs, i, len(drafts) - 1)
                   and (st.next_pos + len(drafts) - 1) // bs < len(tables[i])):
                drafts.append(int(ids[len(drafts), i]))
            req.draft_token_ids = drafts
        return True

    def _goes_on(self, have: int, k: int, probs, r: int, j: int | None = None) -> bool:
        if j is not None:       # the chain graph's [steps + 1, rows] probabilities
            return have < k and (self.tau <= 0 or float(probs[j, r]) >= self.tau)
        return have < k and (self.tau <= 0 or float(probs[r]) >= self.tau)

    def _pick(self, hidden):
        """(argmax ids, their softmax probabilities or None) of the head's logits, on the host."""
        logits = self.head.logits(hidden, self.vocab_limit)
        ids = self.ops.to_numpy(logits.argmax(axis=1))
        if self.tau <= 0:
            return ids, None
        xp = getattr(self.ops, "cp", np)
        top = logits.max(axis=1, keepdims=True)
        probs = 1.0 / xp.exp(logits - top).sum(axis=1)
        return ids, self.ops.to_numpy(probs)

    def _chain_tables(self, todo, active) -> dict[int, list[int]]:
        """Head block tables for the chains: the request's blocks (private copies in place),
        then scratch blocks for the positions past them the chain reaches."""
        bs = self.block_size
        scratch = iter(self._scratch)
        tables = {}
        for i in active:
            req, st, k = todo[i]
            table = list(req.block_ids)
            for lb, (blk, _) in st.private.items():
                if lb < len(table):
                    table[lb] = blk
            last = (st.next_pos + k - 2) // bs      # the chain's rows: next_pos .. + k - 2
            for _ in range(len(table), last + 1):
                blk = next(scratch, None)
                if blk is None:
                    break
                table.append(blk)
            tables[i] = table
        return tables

    # -- state -----------------------------------------------------------------------------------
    def _new_state(self, rid: str) -> _Head:
        if not self._free_rows:
            st = _Head(-1, broken=True)
        else:
            st = _Head(self._free_rows.pop())
        self._state[rid] = st
        return st

    def _drop(self, rid: str) -> None:
        st = self._state.pop(rid, None)
        if st is None:
            return
        if st.row >= 0:
            self._free_rows.append(st.row)
        self._free_private(st)

    def _free_private(self, st: _Head) -> None:
        self._private_free.extend(blk for blk, _ in st.private.values())
        st.private.clear()

    def _save(self, rid: str, blocks: list[int]) -> None:
        """Swap-out: host copies of the head's KV and records of the request's blocks."""
        st = self._state.get(rid)
        if st is None or st.broken:
            return
        heads = [st.private[lb][0] if lb in st.private else b for lb, b in enumerate(blocks)]
        nxt = np.array([st.private[lb][1] if lb in st.private else self._next_tokens[b]
                        for lb, b in enumerate(blocks)], np.int64)
        idx = self.ops.asarray(np.asarray(blocks, np.int64), dtype=np.int64)
        self._swapped[rid] = _Swapped(st.next_pos, self.caches.read_blocks(heads),
                                      self.ops.to_numpy(self._hidden_store[idx]), nxt)

    def _restore(self, rid: str, blocks: list[int]) -> bool:
        """Swap-in: the head's KV and records back into the request's new blocks."""
        saved = self._swapped.pop(rid, None)
        self._drop(rid)
        if saved is None or len(blocks) != len(saved.next_tokens):
            return False
        st = self._new_state(rid)
        if st.broken:
            return False
        self.caches.write_blocks(blocks, saved.kv)
        idx = self.ops.asarray(np.asarray(blocks, np.int64), dtype=np.int64)
        self._hidden_store[idx] = self.ops.asarray(saved.hidden)
        self._next_tokens[np.asarray(blocks, np.int64)] = saved.next_tokens
        st.next_pos = saved.next_pos
        return True


class _Rows:
    """Head rows being gathered into one ForwardBatch: sequences of consecutive positions."""

    def __init__(self):
        self.ids: list[int] = []
        self.positions: list[int] = []
        self.slots: list[int] = []
        self.src: list[int] = []         # row of the hidden states each row reads
        self.qsl: list[int] = [0]
        self.seq_lens: list[int] = []
        self.tables: list[list[int]] = []

    @property
    def num_rows(self) -> int:
        return len(self.ids)

    def add_seq(self, ids, start: int, table, slots, src) -> None:
        n = len(ids)
        self.ids += ids
        self.positions += range(start, start + n)
        self.slots += slots
        self.src += src
        self.qsl.append(self.qsl[-1] + n)
        self.seq_lens.append(start + n)
        self.tables.append(table)

    def extend(self, other: "_Rows") -> None:
        for i in range(len(other.seq_lens)):
            a, b = other.qsl[i], other.qsl[i + 1]
            self.add_seq(other.ids[a:b], other.positions[a], other.tables[i], other.slots[a:b],
                         other.src[a:b])

    def batch(self, block_size: int) -> ForwardBatch:
        width = max((len(t) for t in self.tables), default=1) or 1
        tables = np.zeros((len(self.tables), width), np.int32)
        for i, t in enumerate(self.tables):
            tables[i, : len(t)] = t
        qsl = np.asarray(self.qsl, np.int32)
        return ForwardBatch(
            input_ids=np.asarray(self.ids, np.int32),
            positions=np.asarray(self.positions, np.int32),
            query_start_loc=qsl,
            seq_lens=np.asarray(self.seq_lens, np.int32),
            block_tables=tables,
            slot_mapping=np.asarray(self.slots, np.int32),
            state_slots=np.zeros(len(self.seq_lens), np.int32),
            logits_indices=(qsl[1:] - 1).astype(np.int32),
            block_size=block_size,
        )


    def decode_batch(self, block_size: int) -> ForwardBatch:
        """The same rows as one-token sequences (a decode step's layout): row r at position p
        attends to positions [0, p] of its sequence's table."""
        n = self.num_rows
        per_row = [self.tables[s] for s in range(len(self.seq_lens))
                   for _ in range(self.qsl[s + 1] - self.qsl[s])]
        width = max((len(t) for t in per_row), default=1) or 1
        tables = np.zeros((n, width), np.int32)
        for r, t in enumerate(per_row):
            tables[r, : len(t)] = t
        positions = np.asarray(self.positions, np.int32)
        return ForwardBatch(
            input_ids=np.asarray(self.ids, np.int32),
            positions=positions,
            query_start_loc=np.arange(n + 1, dtype=np.int32),
            seq_lens=positions + 1,
            block_tables=tables,
            slot_mapping=np.asarray(self.slots, np.int32),
            state_slots=np.zeros(n, np.int32),
            logits_indices=np.arange(n, dtype=np.int32),
            block_size=block_size,
        )


class _Chain:
    """A step's draft chains as one CUDA graph per row bucket: the first draft from each
    request's kept head output (MtpDrafter._last), then `steps` head rows, each reading the
    previous row's argmax on the device (no host round trip between drafts), the argmax ids
    (and with --draft-confidence-stop the top-1 probabilities) of every step left in a buffer
    read once. Positions, block tables and slots of every step are known before the chain runs
    (they do not depend on the drafts): the host writes them all at once. Without `capture`
    (the CPU backend, tests) the same forward runs eagerly over the same buffers."""

    def __init__(self, drafter, buckets, width: int, spare_block: int):
        self.d = drafter
        self.steps = drafter.max_drafts - 1
        self.width, self.bs = width, drafter.block_size
        self.spare_block = spare_block
        self.spare_row = drafter._last.shape[0] - 1
        self.buckets = {b: self._buffers(b) for b in sorted(buckets) if b <= drafter.max_seqs}
        if not self.buckets or max(self.buckets) < drafter.max_seqs:
            self.buckets[drafter.max_seqs] = self._buffers(drafter.max_seqs)

    def _buffers(self, b: int) -> dict:
        ops, S, W = self.d.ops, self.steps, self.width
        host = dict(src=np.full(b, self.spare_row, np.int32), pos=np.zeros((S, b), np.int32),
                    lens=np.ones((S, b), np.int32), slots=np.full((S, b), self.spare_block * self.bs,
                                                                  np.int32),
                    tables=np.full((S, b, W), self.spare_block, np.int32))
        xp = getattr(ops, "cp", np)         # int32 / fp32 buffers in the backend's array module
        dev = {k: xp.array(v) for k, v in host.items()}
        dev.update(ids=xp.zeros((S + 1, b), dtype=np.int32),
                   probs=xp.zeros((S + 1, b), dtype=np.float32),
                   qsl=xp.arange(b + 1, dtype=np.int32), state=xp.zeros(b, dtype=np.int32),
                   li=xp.arange(b, dtype=np.int32))
        return dict(host=host, dev=dev, graph=None)

    def capture(self, stream, pool) -> None:
        """Capture every bucket on the engine's stream, from the head graphs' memory pool (the
        graphs replay one at a time on that stream, so they may share it)."""
        from metrale.backends.cuda.graphs import capture_forward

        d = self.d
        self.stream = stream
        with d.ops.cp.cuda.using_allocator(pool.malloc), stream:
            for b in sorted(self.buckets, reverse=True):
                g = self.buckets[b]
                g["graph"] = capture_forward(_ChainStep(self, g), None, d.caches, stream,
                                             d.ops.launch)[0]

    def forward(self, g) -> None:
        """The chain over bucket `g`'s device buffers."""
        d, ops, dev = self.d, self.d.ops, g["dev"]
        h = ops.embedding(dev["src"], d._last)
        self._pick(h, dev, 0)
        for s in range(self.steps):
            batch = ForwardBatch(input_ids=dev["ids"][s], positions=dev["pos"][s],
                                 query_start_loc=dev["qsl"], seq_lens=dev["lens"][s],
                                 block_tables=dev["tables"][s], slot_mapping=dev["slots"][s],
                                 state_slots=dev["state"], logits_indices=dev["li"],
                                 block_size=self.bs)
            h = d.head.forward(batch, h, d.caches)
            self._pick(h, dev, s + 1)

    def _pick(self, h, dev, j: int) -> None:
        d = self.d
        logits = d.head.logits(h, d.vocab_limit)
        dev["ids"][j] = logits.argmax(axis=1).astype(np.int32)
        if d.tau > 0:
            xp = getattr(d.ops, "cp", np)
            top = logits.max(axis=1, keepdims=True)
            dev["probs"][j] = 1.0 / xp.exp(logits - top).sum(axis=1)

    def run(self, todo, tables):
        """([steps + 1, n] draft ids, the same of probabilities or None) on the host, or None
        when no bucket holds `todo` (or a table is wider than the graphs')."""
        n = len(todo)
        b = next((b for b in self.buckets if b >= n), None)
        if b is None or any(len(tables[i]) > self.width for i in range(n)):
            return None
        g = self.buckets[b]
        h, bs = g["host"], self.bs
        h["src"][:] = self.spare_row
        h["pos"][:] = 0
        h["lens"][:] = 1
        h["slots"][:] = self.spare_block * bs
        h["tables"][:] = self.spare_block
        for i, (_, st, _) in enumerate(todo):
            h["src"][i] = st.row
            table = tables[i]
            for s in range(self.steps):
                pos = st.next_pos + s
                if pos // bs >= len(table):
                    break           # no head block there: the row stays on the spare block
                h["pos"][s, i], h["lens"][s, i] = pos, pos + 1
                h["slots"][s, i] = table[pos // bs] * bs + pos % bs
                h["tables"][s, i, : len(table)] = table
        ops, dev = self.d.ops, g["dev"]
        if g["graph"] is None:          # eager (CPU backend, tests)
            for k, v in h.items():
                dev[k][...] = v
            self.forward(g)
        else:
            with self.stream:
                for k, v in h.items():
                    dev[k].set(v, stream=self.stream)
                g["graph"].launch(stream=self.stream)
                return self._read(dev, n)
        return self._read(dev, n)

    def _read(self, dev, n: int):
        ops = self.d.ops
        ids = ops.to_numpy(dev["ids"])[:, :n]
        probs = ops.to_numpy(dev["probs"])[:, :n] if self.d.tau > 0 else None
        return ids, probs


class _ChainStep:
    """capture_forward's model for one chain bucket (its batch argument is unused)."""

    def __init__(self, chain: _Chain, g: dict):
        self.chain, self.g = chain, g

    def forward(self, batch, caches):
        self.chain.forward(self.g)

    def forward_with_hidden(self, batch, caches):
        self.chain.forward(self.g)
        return None, None


class _HeadStep:
    """The MTP head as a model DecodeGraphs captures: its forward over a decode-layout batch
    reads the target hidden rows from `target` (a fixed buffer the drafter fills before each
    replay) and gives the head's output hidden as both results (the drafter takes the logits
    of the rows it drafts from itself: MtpDrafter._pick)."""

    def __init__(self, head, ops, rows: int):
        self.head = head
        self.target = ops.zeros((rows, head.hidden_size))

    def forward_with_hidden(self, batch, caches):
        n = batch.input_ids.shape[0]
        h = self.head.forward(batch, self.target[:n], caches)
        return h, h

    def forward(self, batch, caches):
        return self.forward_with_hidden(batch, caches)[0]


def _token_at(req: Request, i: int) -> int:
    """all_token_ids[i] without building the list."""
    if req.num_dropped_tokens:
        return req.all_token_ids[i]
    prompt = req.prompt_token_ids
    return prompt[i] if i < len(prompt) else req.output_token_ids[i - len(prompt)]
