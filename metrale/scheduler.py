"""CPU-only scheduler: admission, chunked prefill, continuous batching, preemption, policies.

One step reads like nano-vllm's: `out = scheduler.schedule()` -> runner executes `out` ->
`scheduler.update_from_output(out, sampled)`. Each request's `num_computed_tokens` catches up
with its `num_tokens` chunk by chunk; there are no prefill/decode phases.

A step, in order:
  1. requests past their deadline finish with "timeout";
  2. running decodes (one uncomputed token), oldest first;
  3. running partial prefills, oldest first;
  4. waiting requests (FIFO, or by deadline slack under `--scheduler slai`), unless someone was
     preempted in this step. A waiting request is admitted only when its whole first chunk fits.
Limits per step: at most `max_batch_size` sequences and at most the token budget
(`max_prefill_tokens`; SLAI may lower it) new tokens, a decode counting as one. At most
`max_batch_size` requests run (hold KV blocks and a state row) at once.

When a running request cannot get a block, the most recently arrived running request not yet
scheduled in this step is preempted: its blocks and state row are freed, `num_computed_tokens`
drops to 0 and it goes back to the FRONT of the queue. With swap space (`--swap-space-gb`, a
`SwapSpace` from metrale.cache.swap) that has room, its computed blocks and state row are first
copied out (`swap_out`) and copied back into fresh blocks when it is admitted again (`swap_in`);
otherwise (recompute) its output tokens are kept and recomputed as prompt. A partial prefill
first shrinks its chunk to the space left.

`--auto-compact F` (0 < F <= 1): when a request's context reaches F x max_seq_len tokens it is
compacted StreamingLLM-style: the first `sink` tokens (the start of the prompt: the system
prompt) and the most recent tokens are kept, the middle is dropped, and the kept tokens are
recomputed at positions 0..n-1 (the request re-queues at the front like a recompute
preemption; a prefix-cache hit can serve the sink). The kept context is half the trigger:
sink = min(prompt length, trigger // 4), recent window = trigger // 2 - sink. The output stream
is unaffected (`max_tokens` counts every output token); `num_compactions` counts the events.
With compaction on, reaching max_seq_len never ends a request.

Never deadlocks: `add_request` rejects a prompt that cannot fit the pool alone (prompt + the
first output token), and a request that runs alone and still cannot grow finishes with "length"
(the KV pool is its effective context limit).

State pool layout (`num_state_slots_needed`): rows [0, max_batch_size) are working rows, one per
running request; for hybrid models with prefix caching, rows [max_batch_size, max_batch_size +
ssm_cache_slots) hold GDN snapshots. The runner executes `swap_out` then `swap_in` (SwapSpace.execute),
then `state_copies` before the forward, and `state_saves` after it.
"""
from __future__ import annotations

import bisect
import math
import time
from collections import deque
from dataclasses import dataclass, field

from metrale._hot.pack import steady_decode_seqs
from metrale.cache.block_pool import BlockPool, IntegrityError
from metrale.cache.prefix_cache import PrefixCache, PrefixMatch
from metrale.cache.swap import SwapSpace
from metrale.config import ConfigError, EngineConfig
from metrale.request import Request, RequestStatus, check_context_length


@dataclass
class ScheduledSeq:
    request: Request
    num_new_tokens: int     # computes all_token_ids[num_computed_tokens : + num_new_tokens]
    block_table: list[int]  # the request's KV blocks (live list: read it before update_from_output)
    state_slot: int         # working row of the GDN state pool
    sample: bool            # the chunk ends at the request's last known token
    num_drafts: int = 0     # speculative drafts verified after it (request.draft_token_ids[:n]):
                            # the sequence then adds num_new_tokens + num_drafts rows, each
                            # projected to logits


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)          # decodes, then prefills
    state_copies: list[tuple[int, int]] = field(default_factory=list)  # before the forward
    state_saves: list[tuple[int, int]] = field(default_factory=list)   # after the forward
    preempted: list[Request] = field(default_factory=list)
    # (request id, block ids, GDN state row or None): run swap_out, then swap_in, before all else
    swap_out: list[tuple[str, list[int], int | None]] = field(default_factory=list)
    swap_in: list[tuple[str, list[int], int | None]] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)  # timeouts, "length" when alone

    @property
    def num_new_tokens(self) -> int:
        """Rows of the step: new tokens plus the drafts verified after them."""
        return sum(s.num_new_tokens + s.num_drafts for s in self.seqs)

    @property
    def num_drafts(self) -> int:
        return sum(s.num_drafts for s in self.seqs)


class StateSlotPool:
    """The working rows of the GDN state pool: one per running request."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def can_allocate(self) -> bool:
        return bool(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("no working state slot free: call can_allocate first")
        return self._free.pop()

    def free(self, slot: int) -> None:
        self._free.append(slot)


class StepCostModel:
    """step_seconds ~= a + b * new_tokens, fitted online by exponentially weighted least squares
    from the engine's `observe_step_time` calls. Defaults until data arrives: 5 ms + 50 us/token."""

    def __init__(self, a: float = 5e-3, b: float = 5e-5, decay: float = 0.95):
        self.a, self.b, self.decay = a, b, decay
        self._w = self._sx = self._sy = self._sxx = self._sxy = 0.0

    def observe(self, num_tokens: int, seconds: float) -> None:
        d, x, y = self.decay, float(num_tokens), float(seconds)
        self._w = d * self._w + 1.0
        self._sx, self._sy = d * self._sx + x, d * self._sy + y
        self._sxx, self._sxy = d * self._sxx + x * x, d * self._sxy + x * y
        mx, my = self._sx / self._w, self._sy / self._w
        var = self._sxx / self._w - mx * mx
        if var > 1e-6 * max(1.0, mx * mx):
            self.b = max((self._sxy / self._w - mx * my) / var, 1e-9)
        self.a = max(my - self.b * mx, 0.0)

    def estimate(self, num_tokens: int) -> float:
        return self.a + self.b * num_tokens

    def max_tokens_within(self, seconds: float) -> int:
        return max(int((seconds - self.a) / self.b), 0)


class FifoPolicy:
    """Arrival order; the whole `max_prefill_tokens` budget every step."""

    def __init__(self, config: EngineConfig, cost: StepCostModel):
        self.config = config

    def order(self, waiting: deque[Request], now: float) -> None:
        """Preempted requests sit at the front already; the rest arrived in order."""

    def token_budget(self, num_decodes: int) -> int:
        return self.config.max_prefill_tokens


class SlaiPolicy:
    """SLO-aware: keep each step under `tbt_deadline_ms` while streams are decoding, and admit
    the waiting request with the least deadline slack first (preempted requests stay first)."""

    def __init__(self, config: EngineConfig, cost: StepCostModel):
        self.config = config
        self.cost = cost

    def order(self, waiting: deque[Request], now: float) -> None:
        def key(req: Request):
            slack = math.inf if req.deadline is None else (
                req.deadline - now - self.cost.estimate(req.num_uncomputed_tokens))
            return (req.status is not RequestStatus.PREEMPTED, slack, req.arrival_time)
        ordered = sorted(waiting, key=key)
        waiting.clear()
        waiting.extend(ordered)

    def token_budget(self, num_decodes: int) -> int:
        if num_decodes == 0:
            return self.config.max_prefill_tokens
        within = self.cost.max_tokens_within(self.config.tbt_deadline_ms / 1000.0)
        floor = num_decodes + self.config.block_size   # prefills always make some progress
        return min(max(within, floor), self.config.max_prefill_tokens)


POLICIES = {"fifo": FifoPolicy, "slai": SlaiPolicy}


@dataclass
class _StepBudget:
    num_tokens: int
    num_seqs: int

    @property
    def exhausted(self) -> bool:
        return self.num_tokens <= 0 or self.num_seqs <= 0


class QueueFull(ValueError):
    """--max-num-seqs requests are queued or running already (the server answers 429)."""


class Scheduler:
    def __init__(self, config: EngineConfig, num_kv_blocks: int, num_state_slots: int,
                 hybrid: bool, now=time.monotonic, swap: SwapSpace | None = None):
        self.config = config
        self.swap = swap
        self.now = now
        self.hybrid = hybrid
        self.block_size = config.block_size
        needed = self.num_state_slots_needed(config, hybrid)
        if hybrid and num_state_slots < needed:
            raise ConfigError(f"hybrid model needs {needed} GDN state rows (max_batch_size "
                              f"working rows + ssm_cache_slots snapshots), got {num_state_slots}")
        self.block_pool = BlockPool(num_kv_blocks, config.block_size)
        self.state_slots = StateSlotPool(config.max_batch_size)
        self.prefix_cache = self._make_prefix_cache(config, hybrid) \
            if config.enable_prefix_caching else None
        self.cost_model = StepCostModel()
        self.policy = POLICIES[config.scheduler](config, self.cost_model)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []          # arrival order
        self._requests: dict[str, Request] = {}
        self._scheduled: set[str] = set()         # ids scheduled in the step being built
        self.num_preemptions = 0
        self.num_compactions = 0
        self.compact_at = self._compaction_trigger(config)
        # hot-path state: no deadline is due before this time (a lower bound: finished requests
        # may still count); every running request sampled in the last update_from_output
        self._earliest_deadline = math.inf
        self._all_decoding = False
        self._decode_seqs: list[ScheduledSeq] = []   # the last steady step's (reused if equal)

    @staticmethod
    def num_state_slots_needed(config: EngineConfig, hybrid: bool) -> int:
        """GDN state-pool rows the runner must allocate (0 for attention-only models)."""
        if not hybrid:
            return 0
        return config.max_batch_size + (config.ssm_cache_slots if config.enable_prefix_caching
                                        else 0)

    @staticmethod
    def _compaction_trigger(config: EngineConfig) -> int:
        """Context length that triggers --auto-compact (0: off)."""
        fraction = getattr(config, "auto_compact", 0.0) or 0.0
        if fraction <= 0:
            return 0
        if fraction > 1:
            raise ConfigError(f"--auto-compact must be in (0, 1] (0 disables), got {fraction}")
        return max(int(fraction * config.max_seq_len), 4)

    def _make_prefix_cache(self, config: EngineConfig, hybrid: bool) -> PrefixCache:
        if not hybrid:
            return PrefixCache(self.block_pool)
        if config.ssm_checkpoint_interval % config.block_size:
            raise ConfigError(f"--ssm-checkpoint-interval ({config.ssm_checkpoint_interval}) "
                              f"must be a multiple of --block-size ({config.block_size})")
        first = config.max_batch_size
        return PrefixCache(self.block_pool, config.ssm_checkpoint_interval,
                           range(first, first + config.ssm_cache_slots))

    # -- queue -----------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def can_admit(self) -> bool:
        return self.num_waiting + self.num_running < self.config.max_num_seqs

    def add_request(self, req: Request) -> None:
        self._validate(req)
        if req.deadline is None and self.config.request_timeout > 0:
            req.deadline = self.now() + self.config.request_timeout
        req.status = RequestStatus.WAITING
        self._requests[req.request_id] = req
        self.waiting.append(req)
        if req.deadline is not None and req.deadline < self._earliest_deadline:
            self._earliest_deadline = req.deadline

    def _validate(self, req: Request) -> None:
        n, limit = req.num_tokens, self.config.max_seq_len
        if not self.can_admit():
            raise QueueFull(f"queue full ({self.config.max_num_seqs} requests, "
                             "--max-num-seqs): retry later")
        if req.request_id in self._requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        if n == 0:
            raise ValueError("the prompt is empty")
        check_context_length(n, limit)     # its one home: metrale.request
        # the sampling parameters' rules (max_tokens >= 1, ...): SamplingParams.validate, applied
        # at admission by EngineCore.add_request
        if self._num_blocks(n + 1) > self.block_pool.num_blocks:
            raise ValueError(f"the prompt has {n} tokens, more than the KV cache holds "
                             f"({self.block_pool.num_blocks} blocks of {self.block_size}): "
                             "shorten the prompt or give the cache more memory")

    def abort_request(self, request_id: str) -> Request | None:
        """Finish a queued or running request with "abort" (None if unknown or done). The caller
        reports it; it does not appear in a later SchedulerOutput."""
        req = self._requests.get(request_id)
        if req is not None:
            self._finish(req, "abort")
        return req

    # -- scheduling ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        now = self.now()
        self._expire(now, out)
        self._scheduled.clear()
        all_decoding, self._all_decoding = self._all_decoding, False
        if (all_decoding and not self.waiting and not out.finished and not self._has_drafts()
                and self._schedule_decodes(out)):
            return out
        num_decodes = min(sum(1 for r in self.running if r.num_uncomputed_tokens == 1),
                          self.config.max_batch_size)
        budget = _StepBudget(self.policy.token_budget(num_decodes), self.config.max_batch_size)
        self._schedule_running(out, budget, decodes=True)
        self._schedule_running(out, budget, decodes=False)
        if not out.preempted:
            self.policy.order(self.waiting, now)
            self._schedule_waiting(out, budget)
        return out

    def _schedule_decodes(self, out: SchedulerOutput) -> bool:
        """The steady decode step, when every running request is known to be decoding (each
        sampled in the last step) and nothing waits: all of them, oldest first, one token each,
        a block added where one crosses a block boundary. Gives exactly what the general path
        gives then; False (nothing done) when that could preempt or the token budget is short.
        A request's ScheduledSeq of the last steady step is reused when it is unchanged."""
        running = self.running
        n = len(running)
        if n > self.config.max_batch_size or self.policy.token_budget(n) < n:
            return False
        seqs, crossing = steady_decode_seqs(running, self._decode_seqs, self.block_size,
                                            ScheduledSeq)
        if len(crossing) > self.block_pool.num_free_blocks:
            return False
        for r in crossing:
            r.block_ids.extend(self.block_pool.allocate(1))
        self._decode_seqs = seqs
        out.seqs = list(seqs)
        cache = self.prefix_cache
        if cache is not None and cache.checkpointing:
            interval = self.config.ssm_checkpoint_interval
            for seq in out.seqs:
                r = seq.request
                if (r.num_computed_tokens + 1) % interval == 0:
                    slot = cache.reserve_snapshot(r, r.num_computed_tokens + 1)
                    if slot is not None:
                        out.state_saves.append((r.state_slot, slot))
        return True

    def _has_drafts(self) -> bool:
        for r in self.running:
            if r.draft_token_ids:
                return True
        return False

    def _num_drafts(self, req: Request, room: int, budget: int) -> int:
        """How many of `req`'s proposed drafts its decode verifies: at most the KV room and
        token budget left after its one new token, never past max_seq_len (the token after
        the last draft needs a position too), and, with GDN snapshots on, never past the next
        checkpoint (a snapshot is only taken at a window's end, when every draft is kept).
        A grammar-constrained request takes none (one mask per row: metrale.grammar)."""
        if req.sampling_params.grammar is not None:
            return 0
        n = min(len(req.draft_token_ids), room, budget,
                self.config.max_seq_len - req.num_tokens - 1)
        cache = self.prefix_cache
        if n > 0 and cache is not None and cache.checkpointing:
            interval = self.config.ssm_checkpoint_interval
            start = req.num_computed_tokens
            n = min(n, (start // interval + 1) * interval - start - 1)
        return max(n, 0)

    def _expire(self, now: float, out: SchedulerOutput) -> None:
        if now < self._earliest_deadline:
            return
        earliest = math.inf
        for req in [*self.running, *self.waiting]:
            if req.deadline is None:
                continue
            if now >= req.deadline:
                self._finish(req, "timeout")
                out.finished.append(req)
            elif req.deadline < earliest:
                earliest = req.deadline
        self._earliest_deadline = earliest

    def _schedule_running(self, out: SchedulerOutput, budget: _StepBudget, decodes: bool) -> None:
        for req in list(self.running):
            if budget.exhausted:
                return
            if (req.status is not RequestStatus.RUNNING or req.request_id in self._scheduled
                    or (req.num_uncomputed_tokens == 1) != decodes):
                continue
            capacity = self._make_room(req, out)
            if capacity:
                num_new = self._chunk_size(req, req.num_computed_tokens,
                                           min(capacity, budget.num_tokens))
                drafts = self._num_drafts(req, capacity - num_new, budget.num_tokens - num_new) \
                    if decodes and req.draft_token_ids else 0
                self._reserve_blocks(req, req.num_computed_tokens + num_new + drafts)
                self._add_seq(out, req, num_new, budget, drafts)

    def _make_room(self, req: Request, out: SchedulerOutput) -> int:
        """Tokens `req` can grow by with the blocks it holds plus the free ones, preempting the
        newest unscheduled running requests until that is at least one. 0 when `req` itself was
        preempted, or finished with "length" because it runs alone and still cannot grow."""
        while True:
            capacity = self._capacity(req)
            if capacity >= 1:
                return capacity
            victim = next(r for r in reversed(self.running)
                          if r.request_id not in self._scheduled)
            if victim is req and len(self.running) == 1:
                self._finish(req, "length")
                out.finished.append(req)
                return 0
            self._preempt(victim, out)
            if victim is req:
                return 0

    def _schedule_waiting(self, out: SchedulerOutput, budget: _StepBudget) -> None:
        while (self.waiting and not budget.exhausted
               and self.num_running < self.config.max_batch_size):
            if not self._admit(self.waiting[0], out, budget):
                return

    def _admit(self, req: Request, out: SchedulerOutput, budget: _StepBudget) -> bool:
        """Start `req` (prefix hit + first chunk) if that chunk's blocks fit; else False."""
        if req.num_swapped_tokens:
            return self._swap_in(req, out, budget)
        match = self.prefix_cache.match(req) if self.prefix_cache else PrefixMatch()
        start = match.num_tokens
        num_new = self._chunk_size(req, start, budget.num_tokens)
        branch = self._branch_checkpoint(req, match)
        if start < branch < start + num_new:
            num_new = branch - start
        num_blocks = (self._num_blocks(start + num_new) - len(match.block_ids)
                      + self.block_pool.num_unreferenced(match.block_ids))
        if not self.block_pool.can_allocate(num_blocks):
            return False
        self.waiting.popleft()
        if self.prefix_cache:
            self.prefix_cache.acquire(req, match)
            if req.status is RequestStatus.WAITING:
                self.prefix_cache.record(match)
                req.num_cached_tokens = match.num_tokens
        req.block_ids = list(match.block_ids)
        req.num_computed_tokens = start
        req.state_slot = self.state_slots.allocate()
        req.status = RequestStatus.RUNNING
        if match.snapshot_slot is not None:
            out.state_copies.append((match.snapshot_slot, req.state_slot))
        self._reserve_blocks(req, start + num_new)
        bisect.insort(self.running, req, key=lambda r: r.arrival_time)
        self._add_seq(out, req, num_new, budget)
        return True

    def _swap_in(self, req: Request, out: SchedulerOutput, budget: _StepBudget) -> bool:
        """Resume a swapped-out request: fresh blocks for its swapped tokens (filled from swap
        space before the forward) plus its next chunk, if they fit; else False."""
        start = req.num_swapped_tokens
        num_new = self._chunk_size(req, start, budget.num_tokens)
        if not self.block_pool.can_allocate(self._num_blocks(start + num_new)):
            return False
        self.waiting.popleft()
        req.block_ids = self.block_pool.allocate(self._num_blocks(start))
        req.state_slot = self.state_slots.allocate()
        out.swap_in.append((req.request_id, list(req.block_ids),
                            req.state_slot if self.hybrid else None))
        req.num_computed_tokens, req.num_swapped_tokens = start, 0
        req.status = RequestStatus.RUNNING
        if self.prefix_cache:
            self.prefix_cache.cache_blocks(req, 0, start)
        self._reserve_blocks(req, start + num_new)
        bisect.insort(self.running, req, key=lambda r: r.arrival_time)
        self._add_seq(out, req, num_new, budget)
        return True

    def _branch_checkpoint(self, req: Request, match: PrefixMatch) -> int:
        """Marconi's branch point: the last checkpoint inside the cached KV prefix that has no
        snapshot yet. Ending the first chunk there snapshots the shared prefix for the next
        request that branches off it. 0 when not applicable."""
        if self.prefix_cache is None or not self.prefix_cache.checkpointing:
            return 0
        interval = self.config.ssm_checkpoint_interval
        point = match.num_kv_tokens // interval * interval
        if point <= match.num_tokens or self.prefix_cache.has_snapshot(req, point):
            return 0
        return point

    def _chunk_size(self, req: Request, start: int, limit: int) -> int:
        """New tokens for a chunk starting at `start`, at most `limit`. With GDN snapshots on, a
        chunk crossing a checkpoint that has no snapshot yet is cut at the last one it crosses
        before the final token (a snapshot AT the final token still comes for free, but cannot
        serve the same prompt again: a hit must leave one token to compute)."""
        num_new = min(req.num_tokens - start, limit)
        if self.prefix_cache is None or not self.prefix_cache.checkpointing:
            return num_new
        interval = self.config.ssm_checkpoint_interval
        boundary = min(start + num_new, req.num_tokens - 1) // interval * interval
        if boundary > start and not self.prefix_cache.has_snapshot(req, boundary):
            return boundary - start
        return num_new

    def _add_seq(self, out: SchedulerOutput, req: Request, num_new: int,
                 budget: _StepBudget, num_drafts: int = 0) -> None:
        end = req.num_computed_tokens + num_new
        out.seqs.append(ScheduledSeq(req, num_new, req.block_ids, req.state_slot,
                                     sample=end == req.num_tokens, num_drafts=num_drafts))
        end += num_drafts
        self._scheduled.add(req.request_id)
        budget.num_tokens -= num_new + num_drafts
        budget.num_seqs -= 1
        if self.prefix_cache and self.prefix_cache.checkpointing:
            slot = self.prefix_cache.reserve_snapshot(req, end)
            if slot is not None:
                out.state_saves.append((req.state_slot, slot))

    # -- blocks and slots ------------------------------------------------------------------------
    def _num_blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _capacity(self, req: Request) -> int:
        held = len(req.block_ids) + self.block_pool.num_free_blocks
        return held * self.block_size - req.num_computed_tokens

    def _reserve_blocks(self, req: Request, num_tokens: int) -> None:
        missing = self._num_blocks(num_tokens) - len(req.block_ids)
        if missing > 0:
            req.block_ids.extend(self.block_pool.allocate(missing))

    def _release(self, req: Request) -> None:
        self.block_pool.free(req.block_ids)
        req.block_ids = []
        if req.state_slot is not None:
            self.state_slots.free(req.state_slot)
            req.state_slot = None

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        num_blocks = self._num_blocks(req.num_computed_tokens)
        if self.swap is not None and num_blocks and self.swap.can_hold(num_blocks, self.hybrid):
            self.swap.reserve(req.request_id, num_blocks, self.hybrid)
            out.swap_out.append((req.request_id, req.block_ids[:num_blocks],
                                 req.state_slot if self.hybrid else None))
            req.num_swapped_tokens = req.num_computed_tokens
        self._requeue(req)
        req.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(req)

    def _requeue(self, req: Request) -> None:
        """Free a running request's blocks and row and put it at the front of the queue."""
        self._release(req)
        self.running.remove(req)
        req.num_computed_tokens = 0
        req.draft_token_ids = []
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)

    def _compact(self, req: Request) -> None:
        """Drop the middle of `req`'s context: keep the sink and the recent window (see the module
        docstring), and requeue it to recompute the kept tokens."""
        keep = self.compact_at // 2
        sink = min(req.num_prompt_tokens, self.compact_at // 4)
        if req.num_compactions:
            sink = req.num_sink_tokens
        req.num_dropped_tokens += req.num_tokens - keep
        req.num_sink_tokens = sink
        req.block_hashes = []
        req.num_compactions += 1
        self.num_compactions += 1
        self._requeue(req)

    def _finish(self, req: Request, reason: str) -> None:
        if req.status is RequestStatus.RUNNING:
            self._release(req)
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        if self.swap is not None:       # swapped out, or its swap-in has not run yet
            self.swap.discard(req.request_id)
            req.num_swapped_tokens = 0
        req.finish(reason)
        del self._requests[req.request_id]

    # -- results ---------------------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int | list[int]],
                           stopped=()) -> list[Request]:
        """Advance every scheduled request, append its sampled token, and finish it on a stop
        condition (`stopped`: ids whose grammar ended with this token, metrale.grammar). A verify (a sequence with drafts) emits a list: its accepted drafts, then the
        target's token; the rejected drafts' KV and state are dropped (num_computed_tokens
        stops after the accepted ones). Returns the requests finished in this step."""
        finished = []
        cache = self.prefix_cache
        checkpointing = cache is not None and cache.checkpointing
        num_decoding = 0            # requests that sampled and keep running: now decoding
        for seq in out.seqs:
            req = seq.request
            if req.status is not RequestStatus.RUNNING:     # aborted after schedule()
                continue
            start = req.num_computed_tokens
            tokens = sampled.get(req.request_id) if seq.sample else None
            if seq.sample and tokens is None:
                raise ValueError(f"no sampled token for {req.request_id!r}, which sampled")
            req.last_verify = None
            accepted = self._accepted(req, seq, tokens) if seq.num_drafts else 0
            req.draft_token_ids = []
            # the emitted tokens first: accepted drafts are computed context (the prefix cache
            # hashes them); a stop inside them ends the request there
            reason = self._append_tokens(req, tokens) if seq.sample else None
            if reason is None and req.request_id in stopped:
                reason = "stop"
            req.num_computed_tokens = min(start + seq.num_new_tokens + accepted,
                                          req.num_tokens - (1 if seq.sample else 0))
            if cache is not None:
                cache.cache_blocks(req, start, req.num_computed_tokens)
                if checkpointing:
                    if accepted == seq.num_drafts:
                        cache.commit_snapshot(req)
                    else:       # the snapshot was of the window's end, which was not kept
                        cache.drop_snapshot(req)
            if seq.sample:
                if reason is not None:
                    self._finish(req, reason)
                    finished.append(req)
                elif self.compact_at and req.num_tokens >= self.compact_at:
                    self._compact(req)
                else:
                    num_decoding += 1
        if checkpointing:
            cache.release_pending()
        # every running request sampled and still runs: the next schedule() may take the
        # steady decode path (the running set can only shrink until then: aborts)
        self._all_decoding = num_decoding == len(self.running) > 0
        return finished

    @staticmethod
    def _accepted(req: Request, seq: ScheduledSeq, tokens) -> int:
        """A verify's outcome: the emitted tokens are the accepted drafts then the target's
        own token, so len(tokens) - 1 drafts were accepted."""
        accepted = len(tokens) - 1 if isinstance(tokens, list) else 0
        if not 0 <= accepted <= seq.num_drafts:
            raise ValueError(f"{req.request_id!r} verified {seq.num_drafts} drafts but emitted "
                             f"{accepted + 1} tokens")
        req.num_verifies += 1
        req.num_draft_tokens += seq.num_drafts
        req.num_accepted_tokens += accepted
        req.last_verify = (seq.num_drafts, accepted)
        return accepted

    def _append_tokens(self, req: Request, tokens) -> str | None:
        """Append a step's emitted token(s), stopping at the first that ends the request."""
        if not isinstance(tokens, list):
            req.output_token_ids.append(tokens)
            return self._stop_reason(req)
        for token in tokens:
            req.output_token_ids.append(token)
            reason = self._stop_reason(req)
            if reason is not None:
                return reason
        return None

    def _stop_reason(self, req: Request) -> str | None:
        params, output = req.sampling_params, req.output_token_ids
        token, num_output = output[-1], len(output)
        if num_output >= params.min_tokens and (
                token in params.stop_token_ids
                or (not params.ignore_eos and token in req.eos_token_ids)):
            return "stop"
        if num_output >= params.max_tokens or (
                not self.compact_at and req.num_tokens >= self.config.max_seq_len):
            return "length"
        return None

    def observe_step_time(self, num_tokens: int, seconds: float) -> None:
        """The engine reports how long a step of `num_tokens` new tokens took (SLAI's cost model)."""
        self.cost_model.observe(num_tokens, seconds)

    # -- invariants ------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise IntegrityError if the queues, blocks, slots or snapshots disagree."""
        self.block_pool.check_integrity([r.block_ids for r in self.running])
        if self.prefix_cache:
            self.prefix_cache.check_integrity()
        if self.num_running > self.config.max_batch_size:
            raise IntegrityError(f"{self.num_running} running > max_batch_size")
        slots = [r.state_slot for r in self.running]
        if len(set(slots)) != len(slots) or None in slots or (
                len(slots) + self.state_slots.num_free_slots != self.state_slots.num_slots):
            raise IntegrityError(f"working state slots are inconsistent: {slots}")
        for req in self.running:
            if req.status is not RequestStatus.RUNNING or not (
                    0 <= req.num_computed_tokens < req.num_tokens) or (
                    len(req.block_ids) < self._num_blocks(req.num_computed_tokens)):
                raise IntegrityError(f"running request {req.request_id} is inconsistent")
        for req in self.waiting:
            if req.block_ids or req.state_slot is not None or req.status not in (
                    RequestStatus.WAITING, RequestStatus.PREEMPTED):
                raise IntegrityError(f"waiting request {req.request_id} holds resources")
            if bool(req.num_swapped_tokens) != bool(self.swap and self.swap.holds(req.request_id)):
                raise IntegrityError(f"waiting request {req.request_id} and swap space disagree")
        if self.swap and not self.swap.request_ids <= {
                r.request_id for r in self.waiting if r.num_swapped_tokens} | {
                r.request_id for r in self.running}:          # running: swap-in not run yet
            raise IntegrityError("swap space holds requests that are not waiting")
        if len(self._requests) != self.num_running + self.num_waiting:
            raise IntegrityError("request index out of step with the queues")
