"""Sampling on the GPU: one host->device copy of the per-row parameters, three kernels at most,
one device->host copy of the result per step (kernels_cuda/sampling.cu states the rules).

    sampler = GpuSampler(ops, vocab_size, max_batch)
    sampler.begin(slot, prompt_ids)             # a sequence takes a count-table row
    tokens = sampler.sample(logits, params, steps, slots=slots)   # np.int32 [B]
    result = sampler.sample(..., logprobs=True) # SampleResult with logprobs

Order of the rules per row (HF's logits-processor order): repetition penalty (prompt and output
tokens), presence/frequency penalties (output tokens), temperature (0 = greedy argmax, lowest
id on ties), then the kept set, in metrale/sampling.py's order: top-n-sigma (l >= max - n*std),
top-k of its survivors (ties at the k-th value kept), top-p over the survivors' renormalised
distribution (the shortest run of the largest values whose mass reaches top_p), min-p
(p >= min_p * p_max); with adaptive_sampling a kept set of entropy < ADAPTIVE_ENTROPY_NATS
takes the argmax, else the token is argmax(l + Gumbel) over it: an exact draw from the
renormalised softmax (the noise is never +inf: kernels_cuda/sampling.cu).

Randomness: Philox4x32-10 keyed by the row's seed, counter (token id / 4, step). The same
(seed, step) gives the same token whatever the batch; rows without a seed get one drawn from
the sampler's own generator when they are first seen in a slot (so a sequence keeps one seed).
`steps[i]` is the number of tokens sequence i has generated so far.

Penalty counts live on the device, one row per slot (the engine's sequence slot, like the GDN
`state_slots`): `begin` resets a slot and marks its prompt; every `sample` adds the chosen
token to its slot's counts inside the kernel. Without `slots`, row i uses slot i.
Logprobs are those of the raw logits (the model's distribution, before penalties and
temperature): the chosen token's and the top `max(p.logprobs)` ids with theirs.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from metrale._hot.sampler_rows import MAX_LOGPROBS, NPRM, SamplerParamRows
from metrale.backends.cuda.gdn import _kernel, _sfx, cp
from metrale.backends.cuda.kernels import declare
from metrale.sampling import SamplingParams

# kernels_cuda/sampling.cu ({} = bf16 | f32 logits)
declare("sampling", "sample_prepare_{}", "const T* logits, long long ld, const int* prm, const int* counts, "
        "const unsigned char* prompt, float* work, int V")
declare("sampling", "sample_select_f32", "const float* work, int V, const int* prm, int* counts, int* out, int OW")
declare("sampling", "sample_logprobs_{}", "const T* logits, long long ld, int V, const int* prm, int* out, int OW, "
        "int K")
declare("sampling", "grammar_mask_{}", "T* logits, long long ld, const int* rows, const int* bits, int W, int V")


@dataclass
class SampleResult:
    tokens: np.ndarray                      # int32 [B]
    logprobs: np.ndarray | None = None      # float32 [B]    logprob of the chosen token
    top_ids: np.ndarray | None = None       # int32 [B, K]   -1 past a row's own k
    top_logprobs: np.ndarray | None = None  # float32 [B, K]


class GpuSampler:
    def __init__(self, ops, vocab_size: int, max_batch: int, num_slots: int | None = None,
                 penalties: bool = True, seed: int | None = None):
        self.ops = ops
        self.vocab_size = int(vocab_size)
        self.max_batch = int(max_batch)
        self.num_slots = int(num_slots or max_batch)
        self.work = cp.empty((self.max_batch, self.vocab_size), dtype=cp.float32)
        self.out = cp.empty((self.max_batch, 2 + 2 * MAX_LOGPROBS), dtype=cp.int32)
        self.prm = cp.empty((self.max_batch, NPRM), dtype=cp.int32)
        self.counts = (cp.zeros((self.num_slots, self.vocab_size), dtype=cp.int32)
                       if penalties else None)
        self.prompt = (cp.zeros((self.num_slots, self.vocab_size), dtype=cp.uint8)
                       if penalties else None)
        self._rng = np.random.default_rng(seed if seed is not None
                                          else int.from_bytes(os.urandom(8), "little"))
        # per-row parameters: packed on the host into a pinned staging buffer (cached per
        # slot, see SamplerParamRows), one async host->device copy per step
        self._stage_mem = cp.cuda.alloc_pinned_memory(self.max_batch * NPRM * 4)
        stage = np.frombuffer(self._stage_mem, np.int32, self.max_batch * NPRM).reshape(
            self.max_batch, NPRM)
        self.rows = SamplerParamRows(self.vocab_size, self.num_slots, self.max_batch, self._rng,
                                     out=stage)
        self._slot_seed = self.rows.slot_seed
        self._mask_mem = self._mask_stage = self._mask_dev = None   # grammar masks (_mask)
        self._slot_seeded = self.rows.slot_seeded

    # -- the stream that seeds rows without a seed ---------------------------------------------
    @property
    def seed_stream_state(self) -> dict:
        return self._rng.bit_generator.state

    @seed_stream_state.setter
    def seed_stream_state(self, state: dict) -> None:
        self._rng.bit_generator.state = state   # in place: SamplerParamRows holds this generator

    # -- per-sequence state ---------------------------------------------------------------------
    def begin(self, slot: int, prompt_ids=()) -> None:
        """Sequence starts in `slot`: clear its counts, mark its prompt tokens (repetition
        penalty), draw its default seed."""
        self.rows.begin(slot)
        if self.counts is None:
            return
        self.counts[slot] = 0
        self.prompt[slot] = 0
        ids = np.asarray(prompt_ids, dtype=np.int64)
        ids = ids[(ids >= 0) & (ids < self.vocab_size)]
        if ids.size:
            self.prompt[slot, cp.asarray(ids)] = 1

    # -- one step -------------------------------------------------------------------------------
    def _pack(self, params, steps, slots) -> np.ndarray:
        """int32 [B, NPRM] rows in the pinned staging buffer (valid until the next step)."""
        return self.rows.pack(params, steps, slots)

    def sample(self, logits, params: list[SamplingParams], steps, slots=None,
               logprobs: bool = False, before_wait=None, grammar_masks=None):
        """logits [B, V] (bf16 or fp32, on the device) -> np.int32 [B] (or a SampleResult with
        logprobs filled in when `logprobs` is True). `before_wait()`, when given, runs once the
        step's kernels are queued and before the host waits for the chosen ids: host work
        there overlaps the GPU's. `grammar_masks`: (rows, packed bitmasks int32 [R, W]) of the
        constrained rows (metrale.grammar): uploaded and applied to `logits` in place first."""
        B, V = logits.shape
        if V != self.vocab_size or B > self.max_batch or len(params) != B:
            raise ValueError(f"sample: logits {logits.shape}, {len(params)} params; sampler "
                             f"built for vocab {self.vocab_size}, max batch {self.max_batch}")
        if B == 0:
            if before_wait is not None:
                before_wait()
            return np.zeros(0, np.int32) if not logprobs else SampleResult(np.zeros(0, np.int32))
        slots = np.arange(B) if slots is None else np.asarray(slots)
        if logits.strides[-1] != logits.dtype.itemsize:
            logits = cp.ascontiguousarray(logits)
        ld = logits.strides[0] // logits.dtype.itemsize
        prm = self.prm[:B]
        # pinned source: asynchronous on the current stream, ordered before the kernels; the
        # staging buffer is rewritten only after this step's result came back (.get() below)
        prm.set(self._pack(params, steps, slots), stream=cp.cuda.get_current_stream())
        counts, prompt = self.counts, self.prompt      # None (NULL) without penalties
        sfx = _sfx(logits)
        if grammar_masks is not None:
            self._mask(logits, ld, *grammar_masks)
        chunks = min(64, (V + 1023) // 1024)
        _kernel(self.ops, "sampling.cu", f"sample_prepare_{sfx}")(
            (chunks, B), (256,), logits=logits, ld=ld, prm=prm, counts=counts, prompt=prompt, work=self.work, V=V)
        ow = self.out.shape[1]
        _kernel(self.ops, "sampling.cu", "sample_select_f32")(
            (B,), (1024,), work=self.work, V=V, prm=prm, counts=counts, out=self.out, OW=ow)
        kmax = max((min(p.logprobs, MAX_LOGPROBS) for p in params if p.logprobs is not None),
                   default=-1)
        if not logprobs or kmax < 0:
            if before_wait is not None:
                before_wait()
            toks = self.out[:B, 0].get()
            return toks if not logprobs else SampleResult(toks)
        K = max(kmax, 0)
        _kernel(self.ops, "sampling.cu", f"sample_logprobs_{sfx}")(
            (B,), (1024,), logits=logits, ld=ld, V=V, prm=prm, out=self.out, OW=ow, K=K)
        if before_wait is not None:
            before_wait()
        host = self.out[:B, :2 + 2 * K].get()          # the one device->host copy
        res = SampleResult(
            tokens=host[:, 0].copy(),
            logprobs=host[:, 1].view(np.float32).copy(),
            top_ids=host[:, 2:2 + K].copy(),
            top_logprobs=host[:, 2 + K:2 + 2 * K].view(np.float32).copy(),
        )
        off = np.array([p.logprobs is None for p in params])
        res.logprobs[off] = np.nan
        res.top_ids[off] = -1
        res.top_logprobs[off] = -np.inf
        return res

    def _mask(self, logits, ld: int, rows, bits) -> None:
        """logits[rows[i], v] = -inf where bit v of bits[i] is 0 (kernels_cuda/sampling.cu).
        rows and bits go through a pinned staging buffer in one asynchronous copy on the current
        stream (a pageable cp.asarray would block the host until the forward ahead of it has
        finished, serialising the sampler's launches behind it); the staging is rewritten only
        after the step's tokens came back."""
        n, W = len(rows), int(bits.shape[1])
        M = self.max_batch                      # layout: rows [M], then bits [n, W] contiguous
        if self._mask_stage is None or self._mask_stage.size < M * (W + 1):
            self._mask_mem = cp.cuda.alloc_pinned_memory(M * (W + 1) * 4)
            self._mask_stage = np.frombuffer(self._mask_mem, np.int32, M * (W + 1))
            self._mask_dev = cp.empty(M * (W + 1), dtype=cp.int32)
        used = M + n * W
        self._mask_stage[:n] = rows
        self._mask_stage[M:used] = np.asarray(bits, dtype=np.int32).reshape(-1)
        self._mask_dev[:used].set(self._mask_stage[:used], stream=cp.cuda.get_current_stream())
        V = self.vocab_size
        _kernel(self.ops, "sampling.cu", f"grammar_mask_{_sfx(logits)}")(
            ((V + 1023) // 1024, n), (256,), logits=logits, ld=ld, rows=self._mask_dev[:n],
            bits=self._mask_dev[M:used], W=W, V=V)
