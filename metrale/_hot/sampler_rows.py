"""The GPU sampler's per-row parameters, packed on the host (no GPU needed): one int32 row of
NPRM words per sampling row, laid out as kernels_cuda/sampling.cu reads them:

    f32  0 temperature   1 top_p   2 min_p   3 presence   4 frequency   5 repetition
         6 top_n_sigma   7 adaptive entropy threshold, nats (0 = off; metrale.sampling)
    i32  8 top_k (0 = off)   9, 10 seed (low, high 32 bits)   11 step (mod 2^32)
        12 slot (-1: none)   13 has penalties   14 logprobs k (-1: off)   15 (0)

A row depends only on the SamplingParams, the slot and the slot's seed, so it is packed once
per (slot, params object) and cached; a step gathers the cached rows of its slots and writes
the step column (`pack`). A SamplingParams is taken as immutable while its request samples.

Seeds: a row whose params carry no seed uses its slot's seed, drawn from the sampler's own
generator when the slot is first seen or begins a new sequence (`begin`); a row without a valid
slot draws a fresh seed every step.
"""
from __future__ import annotations

import numpy as np

from metrale._hot.pack import gather_param_rows
from metrale.sampling import ADAPTIVE_ENTROPY_NATS

NPRM = 16
MAX_LOGPROBS = 20


class SamplerParamRows:
    def __init__(self, vocab_size: int, num_slots: int, max_batch: int,
                 rng: np.random.Generator, out: np.ndarray | None = None):
        """`out`: the int32 [max_batch, NPRM] staging buffer a step is packed into (pinned
        memory on CUDA); plain numpy when None."""
        self.vocab_size = int(vocab_size)
        self.num_slots = int(num_slots)
        self.rng = rng
        self.out = np.zeros((max_batch, NPRM), np.int32) if out is None else out
        self.rows = np.zeros((self.num_slots, NPRM), dtype=np.int32)
        self.owners: list = [None] * self.num_slots    # params object rows[slot] was packed from
        self.slot_seed = np.zeros(self.num_slots, dtype=np.uint64)
        self.slot_seeded = np.zeros(self.num_slots, dtype=bool)

    def begin(self, slot: int) -> None:
        """A sequence starts in `slot`: draw its default seed (and forget the cached row)."""
        self.slot_seed[slot] = self.rng.integers(0, 2**63, dtype=np.uint64)
        self.slot_seeded[slot] = True
        self.owners[slot] = None

    def pack(self, params, steps, slots) -> np.ndarray:
        """Rows for `params[i]` in `slots[i]` at `steps[i]` -> int32 [B, NPRM], a view of the
        staging buffer (valid until the next pack)."""
        B = len(params)
        if B > self.out.shape[0]:
            raise ValueError(f"{B} sampling rows, staging buffer holds {self.out.shape[0]}")
        params = params if isinstance(params, list) else list(params)
        slots = np.ascontiguousarray(slots, dtype=np.int64)
        steps = np.ascontiguousarray(steps, dtype=np.int64)
        out = self.out[:B]
        i = gather_param_rows(params, slots, steps, self.owners, self.rows, out, 0)
        while i < B:
            slot = int(slots[i])
            if 0 <= slot < self.num_slots:
                self._pack_row(params[i], slot, self.rows[slot])
                self.owners[slot] = params[i]
                out[i] = self.rows[slot]
            else:
                self._pack_row(params[i], slot, out[i])
            i = gather_param_rows(params, slots, steps, self.owners, self.rows, out, i + 1)
        return out

    def _seed(self, p, slot: int) -> int:
        if p.seed is not None:
            return int(p.seed) & (2**64 - 1)
        if 0 <= slot < self.num_slots:
            if not self.slot_seeded[slot]:
                self.slot_seed[slot] = self.rng.integers(0, 2**63, dtype=np.uint64)
                self.slot_seeded[slot] = True
            return int(self.slot_seed[slot])
        return int(self.rng.integers(0, 2**63))

    def _pack_row(self, p, slot: int, row: np.ndarray) -> None:
        seed = self._seed(p, slot)
        row[:] = 0
        row.view(np.float32)[:8] = (p.temperature, p.top_p, p.min_p, p.presence_penalty,
                                    p.frequency_penalty, p.repetition_penalty, p.top_n_sigma,
                                    ADAPTIVE_ENTROPY_NATS if p.adaptive_sampling else 0.0)
        row[8] = p.top_k if 0 < p.top_k < self.vocab_size else 0
        row[9] = np.uint32(seed & 0xFFFFFFFF).view(np.int32)
        row[10] = np.uint32(seed >> 32).view(np.int32)
        row[12] = slot if 0 <= slot < self.num_slots else -1
        row[13] = int(p.presence_penalty != 0 or p.frequency_penalty != 0
                      or p.repetition_penalty != 1)
        row[14] = -1 if p.logprobs is None else min(int(p.logprobs), MAX_LOGPROBS)
