"""The host fast paths of a decode step give exactly what the general paths give.

  * Scheduler: the steady decode path (`_schedule_decodes`) vs the general schedule, on twin
    schedulers driven by the same random workload (preemption, swap, prefix cache, GDN
    snapshots, deadlines, aborts): equal SchedulerOutputs step by step.
  * Runner: `build_batch` (metrale._hot.pack.pack_batch) vs the ForwardBatch built the general
    way, and a decode step packed straight into a graph's input buffer
    (DecodeInputs.pack_decode, incremental block tables) vs the same ForwardBatch packed into it.
  * GPU sampler: cached parameter rows (SamplerParamRows) vs packing every row every step.
"""
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from metrale._hot.pack import pack_indices
from test_scheduler import EOS, Clock, ToyRunner

from metrale._hot.sampler_rows import MAX_LOGPROBS, NPRM, SamplerParamRows
from metrale.cache.swap import SwapSpace
from metrale.config import EngineConfig
from metrale.backends.cuda.graphs import DecodeInputs
from metrale.forward import ForwardBatch
from metrale.request import Request
from metrale.runner import ModelRunner
from metrale.sampling import SamplingParams
from metrale.scheduler import Scheduler

BS = 4


# -- scheduler ------------------------------------------------------------------------------------
def _scheduler(hybrid, prefix, policy, blocks, batch, budget, clock, swap, compact):
    config = EngineConfig(block_size=BS, max_batch_size=batch, max_num_seqs=16,
                          max_prefill_tokens=budget, max_seq_len=64, ssm_checkpoint_interval=8,
                          ssm_cache_slots=4, request_timeout=0, scheduler=policy,
                          enable_prefix_caching=prefix, auto_compact=compact).validate()
    space = None if swap is None else SwapSpace(BS * 8, 64, swap[0] * BS * 8 + 64,
                                                 swap[1] * BS * 8)
    return Scheduler(config, blocks, Scheduler.num_state_slots_needed(config, hybrid), hybrid,
                     now=clock, swap=space)


def _summary(out):
    """Everything a SchedulerOutput says, by value (block tables read before the update)."""
    return ([(s.request.request_id, s.num_new_tokens, list(s.block_table), s.state_slot, s.sample)
             for s in out.seqs], list(out.state_copies), list(out.state_saves),
            [r.request_id for r in out.preempted],
            [(rid, list(b), slot) for rid, b, slot in out.swap_out],
            [(rid, list(b), slot) for rid, b, slot in out.swap_in],
            [r.request_id for r in out.finished])


class Twins:
    """Two schedulers fed the same operations: `fast` may take the steady decode path, `slow`
    never does."""

    def __init__(self, seed, tokens=(EOS, 5, 6, 7, 8, 9, 11), **kw):
        self.tokens = tokens
        self.clock = Clock()
        self.fast = _scheduler(clock=self.clock, **kw)
        self.slow = _scheduler(clock=self.clock, **kw)
        self.slow._schedule_decodes = lambda out: False
        self.num_fast = 0
        take = self.fast._schedule_decodes

        def counted(out):
            taken = take(out)
            self.num_fast += taken
            return taken
        self.fast._schedule_decodes = counted
        self.runners = {id(s): ToyRunner(s, s.hybrid) for s in (self.fast, self.slow)}
        self.rng = random.Random(seed)
        self.count = 0
        self.live: set[str] = set()

    def arrive(self, n_prompt, max_tokens, timeout, stop):
        if not self.fast.can_admit():
            return
        self.count += 1
        rid = f"q{self.count}"
        prompt = [self.rng.randrange(1, 40) for _ in range(n_prompt)]
        for s in (self.fast, self.slow):
            params = SamplingParams(max_tokens=max_tokens, stop_token_ids=[stop] if stop else [])
            req = Request(rid, list(prompt), params, eos_token_ids=frozenset({EOS}),
                          deadline=None if timeout is None else self.clock.t + timeout)
            try:
                s.add_request(req)
            except ValueError:
                return
        self.live.add(rid)

    def abort(self, pick):
        if self.live:
            rid = sorted(self.live)[pick % len(self.live)]
            self.live.discard(rid)
            assert (self.fast.abort_request(rid) is None) == (self.slow.abort_request(rid) is None)

    def step(self):
        outs = [s.schedule() for s in (self.fast, self.slow)]
        assert _summary(outs[0]) == _summary(outs[1])
        token = self.rng.choice(self.tokens)
        finished = []
        for s, out in zip((self.fast, self.slow), outs):
            sampled = self.runners[id(s)].run(out, lambda r: token)
            finished.append([r.request_id for r in s.update_from_output(out, sampled)])
            s.check_integrity()
        assert finished[0] == finished[1]
        self.live -= set(finished[0]) | {r.request_id for r in outs[0].finished}
        for a, b in zip(self.fast.running, self.slow.running):
            assert (a.request_id, a.output_token_ids, a.num_computed_tokens) == \
                (b.request_id, b.output_token_ids, b.num_computed_tokens)


OPS = st.one_of(
    st.tuples(st.just("arrive"), st.integers(1, 20), st.integers(1, 30),
              st.one_of(st.none(), st.floats(0.5, 20)), st.sampled_from([0, 0, 0, 6])),
    st.tuples(st.just("abort"), st.integers(0, 1000)),
    st.tuples(st.just("tick"), st.floats(0, 1)),
    st.tuples(st.just("step"), st.integers(1, 12)),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hybrid=st.booleans(), prefix=st.booleans(), policy=st.sampled_from(["fifo", "slai"]),
       blocks=st.integers(6, 40), batch=st.integers(1, 5), budget=st.integers(1, 24),
       seed=st.integers(0, 2**16), ops=st.lists(OPS, min_size=5, max_size=40),
       swap=st.one_of(st.none(), st.tuples(st.integers(0, 12), st.integers(0, 12))),
       compact=st.sampled_from([0.0, 0.0, 0.5]))
def test_steady_decode_path_schedules_what_the_general_path_does(
        hybrid, prefix, policy, blocks, batch, budget, seed, ops, swap, compact):
    t = Twins(seed, hybrid=hybrid, prefix=prefix, policy=policy, blocks=blocks, batch=batch,
              budget=budget, swap=swap, compact=compact)
    for op, *args in ops:
        if op == "arrive":
            t.arrive(*args)
        elif op == "abort":
            t.abort(*args)
        elif op == "tick":
            t.clock.t += args[0]
        else:
            for _ in range(args[0]):
                t.step()
    for _ in range(500):
        if not t.fast.has_unfinished():
            break
        t.step()
    assert not t.fast.has_unfinished() and not t.slow.has_unfinished()


@pytest.mark.parametrize("hybrid,prefix", [(False, False), (True, True), (False, True)])
def test_steady_decode_path_is_taken_across_block_boundaries_and_checkpoints(hybrid, prefix):
    t = Twins(0, tokens=(5, 6), hybrid=hybrid, prefix=prefix, policy="fifo", blocks=60,
              batch=4, budget=64, swap=None, compact=0.0)
    for n in (5, 5, 8, 11):     # two cross block boundaries in the same steps
        t.arrive(n, 45, 1000.0, 0)
    for _ in range(40):
        t.step()
        t.clock.t += 0.1
    assert t.num_fast >= 25


# -- runner: ForwardBatch and graph inputs --------------------------------------------------------
def reference_batch(out, block_size) -> ForwardBatch:
    """The ForwardBatch as the runner built it before the hot path (all_token_ids, numpy)."""
    seqs = out.seqs
    context = np.fromiter((s.request.num_computed_tokens for s in seqs), np.int32, len(seqs))
    qlens = np.fromiter((s.num_new_tokens for s in seqs), np.int32, len(seqs))
    width = max(len(s.block_table) for s in seqs)
    tables = np.zeros((len(seqs), width), dtype=np.int32)
    for i, s in enumerate(seqs):
        tables[i, : len(s.block_table)] = s.block_table
    positions, slots, qsl, seq_lens = pack_indices(context, qlens, tables, block_size)
    ids = np.empty(int(qsl[-1]), dtype=np.int32)
    for i, s in enumerate(seqs):
        start = int(context[i])
        ids[qsl[i]: qsl[i + 1]] = s.request.all_token_ids[start: start + int(qlens[i])]
    sample_rows = [i for i, s in enumerate(seqs) if s.sample]
    return ForwardBatch(ids, positions, qsl, seq_lens, tables, slots,
                        np.fromiter((s.state_slot for s in seqs), np.int32, len(seqs)),
                        (qsl[1:][sample_rows] - 1).astype(np.int32), block_size)


FIELDS = ("input_ids", "positions", "query_start_loc", "seq_lens", "block_tables",
          "slot_mapping", "state_slots", "logits_indices")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), batch=st.integers(1, 6), blocks=st.integers(8, 60),
       budget=st.integers(1, 40), compact=st.sampled_from([0.0, 0.5]),
       hybrid=st.booleans(), prefix=st.booleans())
def test_batches_and_graph_inputs_match_the_general_packing(seed, batch, blocks, budget, compact,
                                                            hybrid, prefix):
    rng = random.Random(seed)
    sched = _scheduler(hybrid, prefix, "fifo", blocks, batch, budget, Clock(), None, compact)
    toy = ToyRunner(sched, hybrid)
    runner = ModelRunner(None, None, None, BS)
    width = -(-sched.config.max_seq_len // BS)
    fast = DecodeInputs(batch, width, BS, spare_block=blocks, spare_slot=batch + 5)
    slow = DecodeInputs(batch, width, BS, spare_block=blocks, spare_slot=batch + 5)
    num_decodes = count = 0
    for step in range(300):
        if rng.random() < 0.3 and sched.can_admit():
            count += 1
            prompt = [rng.randrange(1, 40) for _ in range(rng.randrange(1, 30))]
            try:
                sched.add_request(Request(f"q{count}", prompt, SamplingParams(
                    max_tokens=rng.randrange(1, 40)), eos_token_ids=frozenset({EOS})))
            except ValueError:
                pass
        if not sched.has_unfinished():
            continue
        out = sched.schedule()
        if out.seqs:
            ref = reference_batch(out, BS)
            got = runner.build_batch(out)
            for f in FIELDS:
                a, b = getattr(got, f), getattr(ref, f)
                assert a.dtype == b.dtype == np.int32 and a.shape == b.shape, f
                assert np.array_equal(a, b), f
            g = fast.bucket(len(out.seqs)) if len(out.seqs) <= fast.max_batch else None
            before = None if g is None else g.host_view.copy()
            packed = fast.pack_decode(out.seqs)
            if slow.supports(ref):
                num_decodes += 1
                assert packed is not None
                expect = slow.pack(ref)
                assert packed.bucket == expect.bucket
                assert np.array_equal(packed.host_view, expect.host_view)
            else:
                assert packed is None
                if g is not None:
                    assert np.array_equal(g.host_view, before)     # nothing written
        sched.update_from_output(out, toy.run(out, lambda r: rng.choice([EOS, 5, 6, 7])))
    event(f"decode steps packed: {min(num_decodes, 10)}{'+' if num_decodes >= 10 else ''}")


# -- GPU sampler parameter rows ---------------------------------------------------------------------
class ReferenceRows:
    """GpuSampler's per-step packing before the row cache: every row packed every step."""

    def __init__(self, vocab_size, num_slots, rng):
        self.vocab_size, self.num_slots, self._rng = vocab_size, num_slots, rng
        self._slot_seed = np.zeros(num_slots, dtype=np.uint64)
        self._slot_seeded = np.zeros(num_slots, dtype=bool)

    def begin(self, slot):
        self._slot_seed[slot] = self._rng.integers(0, 2**63, dtype=np.uint64)
        self._slot_seeded[slot] = True

    def pack(self, params, steps, slots):
        prm = np.zeros((len(params), NPRM), dtype=np.int32)
        f = prm.view(np.float32)
        for i, p in enumerate(params):
            slot = int(slots[i])
            if p.seed is not None:
                seed = int(p.seed) & (2**64 - 1)
            else:
                if 0 <= slot < self.num_slots and not self._slot_seeded[slot]:
                    self._slot_seed[slot] = self._rng.integers(0, 2**63, dtype=np.uint64)
                    self._slot_seeded[slot] = True
                seed = int(self._slot_seed[slot]) if 0 <= slot < self.num_slots else \
                    int(self._rng.integers(0, 2**63))
            f[i, :7] = (p.temperature, p.top_p, p.min_p, p.presence_penalty,
                        p.frequency_penalty, p.repetition_penalty, p.top_n_sigma)
            prm[i, 8] = p.top_k if 0 < p.top_k < self.vocab_size else 0
            prm[i, 9] = np.uint32(seed & 0xFFFFFFFF).view(np.int32)
            prm[i, 10] = np.uint32(seed >> 32).view(np.int32)
            prm[i, 11] = np.uint32(int(steps[i]) & 0xFFFFFFFF).view(np.int32)
            prm[i, 12] = slot if 0 <= slot < self.num_slots else -1
            prm[i, 13] = int(p.presence_penalty != 0 or p.frequency_penalty != 0
                             or p.repetition_penalty != 1)
            prm[i, 14] = -1 if p.logprobs is None else min(int(p.logprobs), MAX_LOGPROBS)
        return prm


def _random_params(rng):
    return SamplingParams(
        temperature=rng.choice([0.0, 0.7, 1.0]), top_p=rng.choice([1.0, 0.9]),
        top_k=rng.choice([0, 5, 400]), min_p=rng.choice([0.0, 0.05]),
        presence_penalty=rng.choice([0.0, 0.5]), frequency_penalty=rng.choice([0.0, -0.3]),
        repetition_penalty=rng.choice([1.0, 1.2]), top_n_sigma=rng.choice([0.0, 1.5]),
        seed=rng.choice([None, None, 3, 2**63 + 5]), logprobs=rng.choice([None, 0, 3, 25]))


@pytest.mark.parametrize("seed", range(5))
def test_cached_sampler_rows_equal_packing_every_row(seed):
    rng = random.Random(seed)
    num_slots, max_batch, vocab = 6, 5, 320
    ref = ReferenceRows(vocab, num_slots, np.random.default_rng(seed))
    rows = SamplerParamRows(vocab, num_slots, max_batch, np.random.default_rng(seed))
    owners = {slot: _random_params(rng) for slot in range(-1, num_slots + 1)}
    for step in range(200):
        if rng.random() < 0.1:
            slot = rng.randrange(num_slots)
            ref.begin(slot)
            rows.begin(slot)
            owners[slot] = _random_params(rng)
        if rng.random() < 0.05:
            owners[rng.randrange(num_slots)] = _random_params(rng)   # a new request, no begin
        slots = rng.sample(range(-1, num_slots + 1), rng.randrange(0, max_batch + 1))
        params = [owners[s] for s in slots]
        steps = [rng.choice([step, 2**32 + step]) for _ in slots]
        want = ref.pack(params, steps, np.asarray(slots, dtype=np.int64))
        got = rows.pack(params, np.asarray(steps, dtype=np.int64), np.asarray(slots))
        assert np.array_equal(got, want), step
