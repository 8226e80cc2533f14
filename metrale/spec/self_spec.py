"""--self-speculative: the target drafts for itself with some of its layers skipped (no extra
weights; Draft & Verify, Zhang et al. 2023; SWIFT, Xia et al. 2024).

A draft chain runs the kept layers one token at a time from the request's context: step 0
feeds the last known token at its position, step j the draft of step j - 1. The chains of all
drafting requests run as one batch per step. What a draft forward writes stays out of the way of
the real computation:

- attention layers write the drafts' K/V at positions not computed yet: in the request's own
  last block where it has room (those slots are the next verify's, which overwrites them) and
  past it in scratch blocks the engine keeps for the drafter at the end of the KV pool;
- GDN layers run from a copy of the request's working state in a scratch row (the verify rows,
  free between steps), so the working state is untouched.
Skipped layers are skipped whole (mixer and MLP): the residual stream passes them unchanged.

Which layers: METRALE_SELF_SPEC_SKIP, comma-separated layer indices, or "auto": every other
layer of the middle half (layers [L/4, 3L/4) with odd index), a quarter of the depth. Acceptance
depends on the model (a layer-skipped random model drafts noise); emitted tokens never do.

On CUDA the draft forwards run eagerly (not captured): correct, and slow for small models.
"""
from __future__ import annotations

import numpy as np

from metrale import levers
from metrale.config import ConfigError
from metrale.forward import ForwardBatch
from metrale.request import Request


def skipped_layers(spec: str, num_layers: int) -> tuple[int, ...]:
    """METRALE_SELF_SPEC_SKIP: "auto", "none" (the whole model drafts: tests, the machinery's
    own check: its drafts are the target's greedy continuation) or layer indices."""
    if spec.strip().lower() == "none":
        return ()
    if spec.strip().lower() in ("", "auto"):
        lo, hi = num_layers // 4, (3 * num_layers) // 4
        return tuple(i for i in range(lo, hi) if i % 2 == 1)
    try:
        skip = tuple(sorted({int(x) for x in spec.split(",") if x.strip()}))
    except ValueError:
        raise ConfigError(f"METRALE_SELF_SPEC_SKIP={spec!r}: comma-separated layer indices or "
                          "auto") from None
    if any(not 0 <= i < num_layers for i in skip) or len(skip) >= num_layers:
        raise ConfigError(f"METRALE_SELF_SPEC_SKIP={spec!r}: indices in [0, {num_layers}), "
                          "keeping at least one layer")
    return skip


class SelfSpecDrafter:
    name = "self-spec"
    needs_scratch = True        # Speculation gives it scratch KV blocks and state rows

    def __init__(self, model, max_drafts: int):
        self.model = model
        self.max_drafts = max_drafts
        layers = model.layers
        self.skip = skipped_layers(levers.get("METRALE_SELF_SPEC_SKIP"), len(layers))
        self.kept = [layer for i, layer in enumerate(layers) if i not in self.skip]
        self.caches = self.ops = None
        self.scratch_blocks: range = range(0)
        self.state_rows: range = range(0)
        self.hybrid = bool(model.cache_spec().gdn_layers)

    def scratch_blocks_needed(self, max_seqs: int, block_size: int) -> int:
        return max_seqs * (-(-self.max_drafts // block_size) + 1)

    def bind(self, caches, ops) -> bool:
        self.caches, self.ops = caches, ops
        return False

    def propose(self, requests: list[Request], limits: list[int]) -> None:
        todo = [(r, k) for r, k in zip(requests, limits) if k > 0]
        for r in requests:
            r.draft_token_ids = []
        if not todo:
            return
        bs = self.caches.block_size
        per_seq = -(-self.max_drafts // bs) + 1     # scratch blocks: the chain's positions
        room = len(self.scratch_blocks) // per_seq
        if self.hybrid:
            room = min(room, len(self.state_rows))
        todo = todo[:room]
        if self.hybrid:
            self.caches.copy_states([(r.state_slot, row)
                                     for (r, _), row in zip(todo, self.state_rows)])
        tables = []
        for i, (r, _) in enumerate(todo):
            scratch = self.scratch_blocks[i * per_seq: (i + 1) * per_seq]
            tables.append(list(r.block_ids) + list(scratch))
        last = [r.all_token_ids[-1] for r, _ in todo]
        for j in range(max(k for _, k in todo)):
            active = [i for i, (_, k) in enumerate(todo) if j < k]
            batch = self._batch([last[i] for i in active],
                                [todo[i][0].num_tokens - 1 + j for i in active],
                                [tables[i] for i in active],
                                [self.state_rows[i] if self.hybrid else 0 for i in active], bs)
            picks = np.asarray(self.ops.to_numpy(self._forward(batch))).argmax(axis=-1)
            for i, t in zip(active, picks.tolist()):
                todo[i][0].draft_token_ids.append(int(t))
                last[i] = int(t)

    @staticmethod
    def _batch(tokens, positions, tables, rows, bs) -> ForwardBatch:
        """One token per sequence at `positions` (its context: everything before it)."""
        b = len(tokens)
        width = max(len(t) for t in tables)
        table = np.zeros((b, width), np.int32)
        for i, t in enumerate(tables):
            table[i, : len(t)] = t
        pos = np.asarray(positions, np.int32)
        slots = table[np.arange(b), pos // bs] * bs + pos % bs
        return ForwardBatch(
            input_ids=np.asarray(tokens, np.int32), positions=pos,
            query_start_loc=np.arange(b + 1, dtype=np.int32), seq_lens=pos + 1,
            block_tables=table, slot_mapping=slots.astype(np.int32),
            state_slots=np.asarray(rows, np.int32), logits_indices=np.arange(b, dtype=np.int32),
            block_size=bs)

    def _forward(self, batch: ForwardBatch):
        """The model's forward through the kept layers only."""
        m, ops = self.model, self.ops
        dev = ops.upload_batch(batch)
        x, residual = ops.embedding(dev.input_ids, m.embed), None
        for layer in self.kept:
            x, residual = layer(x, residual, dev, self.caches)
        h, _ = ops.add_rms_norm(x, residual, m.final_norm, m.norm.eps, m.norm.offset)
        return ops.lm_head(h, m.lm_head)

    def release(self, request_id: str) -> None:
        pass
