"""Scheduler behaviour through its public interface, driven by a toy runner.

`ToyRunner` executes a SchedulerOutput the way the real runner must: state copies, then the
forward (KV written at each new token's slot, the GDN state of the row advanced), then state saves.
Its "KV" is the token itself and its "GDN state" the tuple of tokens consumed, so it can check that
every chunk starts from exactly the context its request has computed (a wrong prefix hit, a stale
snapshot or a shared writable block shows up as a mismatch)."""
import os
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from metrale.cache.swap import SwapSpace
from metrale.config import EngineConfig
from metrale.request import Request, RequestStatus
from metrale.sampling import SamplingParams
from metrale.scheduler import Scheduler

EOS = 0


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class ToyRunner:
    def __init__(self, sched: Scheduler, hybrid: bool):
        self.sched, self.hybrid, self.bs = sched, hybrid, sched.block_size
        self.kv: dict[tuple[int, int], int] = {}
        self.state: dict[int, tuple] = {}

    def run(self, out, sample) -> dict[str, int]:
        if self.sched.swap is not None:
            self.sched.swap.execute(out, self)
        for src, dst in out.state_copies:
            self.state[dst] = self.state[src]
        for seq in out.seqs:
            self._forward(seq)
        for src, dst in out.state_saves:
            self.state[dst] = self.state[src]
        return {s.request.request_id: sample(s.request) for s in out.seqs if s.sample}

    # the ModelCaches swap interface, over the toy KV and state
    def read_blocks(self, block_ids):
        return [np.array([[self.kv.get((b, i), -1) for i in range(self.bs)] for b in block_ids])]

    def write_blocks(self, block_ids, arrays):
        for b, row in zip(block_ids, arrays[0]):
            for i, token in enumerate(row):
                self.kv[(b, i)] = int(token)

    def read_state(self, slot):
        return [np.array(self.state[slot], dtype=np.int64)]

    def write_state(self, slot, arrays):
        self.state[slot] = tuple(int(t) for t in arrays[0])

    def _forward(self, seq):
        req, bs, table = seq.request, self.bs, seq.block_table
        start, tokens = req.num_computed_tokens, req.all_token_ids
        end = start + seq.num_new_tokens
        assert seq.num_new_tokens >= 1 and end <= req.num_tokens
        assert len(table) * bs >= end, "block table does not cover the chunk"
        assert seq.sample == (end == req.num_tokens)
        for pos in range(start):
            assert self.kv[(table[pos // bs], pos % bs)] == tokens[pos], "wrong cached KV"
        if self.hybrid:
            state = self.state[seq.state_slot] if start else ()
            assert state == tuple(tokens[:start]), "GDN state does not match the context"
            self.state[seq.state_slot] = tuple(tokens[:end])
        for pos in range(start, end):
            block = table[pos // bs]
            assert self.sched.block_pool.ref_counts[block] == 1, "writing a shared block"
            self.kv[(block, pos % bs)] = tokens[pos]


def make(num_kv_blocks=64, hybrid=False, clock=None, swap=None, **overrides) -> Scheduler:
    settings_ = dict(block_size=4, max_batch_size=4, max_num_seqs=16, max_prefill_tokens=32,
                     max_seq_len=128, ssm_checkpoint_interval=8, ssm_cache_slots=4,
                     request_timeout=0)
    settings_.update(overrides)
    config = EngineConfig(**settings_).validate()
    return Scheduler(config, num_kv_blocks, Scheduler.num_state_slots_needed(config, hybrid),
                     hybrid, now=clock or Clock(), swap=swap)


def request(rid, n_prompt=6, max_tokens=4, **params) -> Request:
    prompt = [(hash(rid) + i) % 90 + 10 for i in range(n_prompt)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **params),
                   eos_token_ids=frozenset({EOS}))


def counting(req: Request) -> int:
    """Deterministic fake sampler: a function of the request and its position only."""
    return (sum(req.prompt_token_ids) + 7 * req.num_tokens) % 90 + 10


def drive(sched, runner=None, sample=counting, max_steps=2000):
    runner = runner or ToyRunner(sched, sched.hybrid)
    outs = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return outs
        out = sched.schedule()
        sched.check_integrity()
        sched.update_from_output(out, runner.run(out, sample))
        sched.check_integrity()
        outs.append(out)
    raise AssertionError("scheduler did not drain")


# -- stop conditions ------------------------------------------------------------------------------
def test_prefill_then_decode_until_max_tokens():
    sched = make()
    req = request("a", n_prompt=6, max_tokens=3)
    sched.add_request(req)
    outs = drive(sched)
    assert [s.num_new_tokens for o in outs for s in o.seqs] == [6, 1, 1]
    assert req.finish_reason == "length" and req.num_output_tokens == 3
    assert sched.block_pool.num_free_blocks == sched.block_pool.num_blocks


@pytest.mark.parametrize("params, outputs, reason, n_out", [
    ({}, [5, EOS, 6], "stop", 2),
    ({"min_tokens": 3}, [5, EOS, 6], "length", 3),
    ({"ignore_eos": True}, [EOS, EOS, EOS], "length", 3),
    ({"stop_token_ids": [42]}, [5, 42, 6], "stop", 2),
])
def test_stop_conditions(params, outputs, reason, n_out):
    sched = make()
    req = request("a", max_tokens=3, **params)
    sched.add_request(req)
    tokens = iter(outputs)
    drive(sched, sample=lambda r: next(tokens))
    assert (req.finish_reason, req.num_output_tokens) == (reason, n_out)


def test_max_seq_len_caps_prompt_plus_output():
    sched = make(max_seq_len=10)
    req = request("a", n_prompt=7, max_tokens=100)
    sched.add_request(req)
    drive(sched)
    assert req.num_tokens == 10 and req.finish_reason == "length"


# -- admission ------------------------------------------------------------------------------------
def test_add_request_rejects_what_can_never_run():
    sched = make(num_kv_blocks=4, max_seq_len=64)
    with pytest.raises(ValueError, match="max-seq-len"):
        sched.add_request(request("long", n_prompt=64))
    with pytest.raises(ValueError, match="KV cache"):
        sched.add_request(request("big", n_prompt=16))       # 16 + 1 tokens need 5 blocks
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(Request("e", [], SamplingParams()))
    sched.add_request(request("ok", n_prompt=15))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(request("ok"))


def test_can_admit_until_max_num_seqs():
    sched = make(max_num_seqs=5)
    for i in range(5):
        assert sched.can_admit()
        sched.add_request(request(str(i)))
    assert not sched.can_admit()
    with pytest.raises(ValueError, match="queue full"):
        sched.add_request(request("x"))


# -- batching -------------------------------------------------------------------------------------
def test_long_prompt_is_chunked_while_others_decode():
    sched = make(max_prefill_tokens=8, max_seq_len=256)
    short = request("short", n_prompt=3, max_tokens=10)
    sched.add_request(short)
    runner = ToyRunner(sched, False)
    out = sched.schedule()
    sched.update_from_output(out, runner.run(out, counting))
    long = request("long", n_prompt=30, max_tokens=2)
    sched.add_request(long)
    chunks = []
    while long.num_computed_tokens < 30:
        out = sched.schedule()
        assert out.seqs[0].request is short and out.seqs[0].num_new_tokens == 1   # decode first
        assert out.num_new_tokens <= 8
        chunks.append(out.seqs[1].num_new_tokens)
        sched.update_from_output(out, runner.run(out, counting))
    assert chunks == [7, 7, 7, 7, 2]


def test_step_limits_on_sequences_and_tokens():
    sched = make(max_batch_size=3, max_prefill_tokens=10)
    for i in range(8):
        sched.add_request(request(str(i), n_prompt=5, max_tokens=3))
    for out in drive(sched):
        assert len(out.seqs) <= 3 and out.num_new_tokens <= 10
        kinds = [s.request.num_uncomputed_tokens == 1 for s in out.seqs]
        assert kinds == sorted(kinds, reverse=True)          # decodes before prefills


# -- aborts and timeouts --------------------------------------------------------------------------
def test_abort_waiting_and_running():
    sched = make(max_batch_size=1)
    a, b = request("a"), request("b")
    sched.add_request(a)
    sched.add_request(b)
    sched.schedule()                                          # a running, b waiting
    assert sched.abort_request("b") is b and b.finish_reason == "abort"
    assert sched.abort_request("a") is a and a.status is RequestStatus.FINISHED
    assert sched.abort_request("a") is None
    assert not sched.has_unfinished()
    sched.check_integrity()
    assert sched.block_pool.num_free_blocks == sched.block_pool.num_blocks


def test_abort_between_schedule_and_update_is_ignored_by_update():
    sched = make(hybrid=True, enable_prefix_caching=True)
    req = request("a", n_prompt=9)
    sched.add_request(req)
    out = sched.schedule()
    assert out.state_saves                                    # chunk ends on checkpoint 8
    sched.abort_request("a")
    assert sched.update_from_output(out, {}) == []
    sched.check_integrity()


def test_requests_past_their_deadline_time_out():
    clock = Clock()
    sched = make(clock=clock, request_timeout=5.0)
    running, queued = request("run", max_tokens=50), request("queued")
    queued.deadline = clock.t + 1.0
    sched.add_request(running)
    sched.add_request(queued)
    assert running.deadline == clock.t + 5.0
    out = sched.schedule()
    sched.update_from_output(out, {s.request.request_id: 11 for s in out.seqs if s.sample})
    clock.t += 2.0
    out = sched.schedule()
    assert out.finished == [queued] and queued.finish_reason == "timeout"
    sched.update_from_output(out, {s.request.request_id: 11 for s in out.seqs if s.sample})
    clock.t += 4.0
    out = sched.schedule()
    assert out.finished == [running] and running.finish_reason == "timeout" and not out.seqs
    assert not sched.has_unfinished()


# -- preemption -----------------------------------------------------------------------------------
SWAPS = {"recompute": None, "host": (10**6, 0), "disk": (0, 10**6), "host+disk": (3, 3),
         "too small": (1, 1)}


@pytest.mark.parametrize("swap", SWAPS)
@pytest.mark.parametrize("hybrid, prefix", [(False, False), (False, True), (True, True)])
def test_tiny_pool_preempts_and_everyone_finishes_with_the_same_tokens(hybrid, prefix, swap):
    def workload():
        return [request(f"r{i}", n_prompt=5 + i, max_tokens=12) for i in range(6)]
    roomy = make(num_kv_blocks=256, hybrid=hybrid, enable_prefix_caching=prefix)
    for r in (expected := workload()):
        roomy.add_request(r)
    drive(roomy)
    space = SwapSpace(1, 1, *SWAPS[swap]) if SWAPS[swap] else None    # sizes in blocks
    tiny = make(num_kv_blocks=9, hybrid=hybrid, enable_prefix_caching=prefix, swap=space)
    for r in (got := workload()):
        tiny.add_request(r)
    runner = ToyRunner(tiny, hybrid)
    seen_preempted = {}
    while tiny.has_unfinished():
        out = tiny.schedule()
        tiny.check_integrity()
        for r in out.preempted:
            assert r.num_computed_tokens == 0 and r.status is RequestStatus.PREEMPTED
            assert tiny.waiting[0] is r or r in tiny.waiting
            seen_preempted[r.request_id] = list(r.all_token_ids)
        for rid, _, _ in out.swap_in:                        # resumes where it stopped
            assert tiny._requests[rid].num_computed_tokens > 0
        tiny.update_from_output(out, runner.run(out, counting))
        tiny.check_integrity()
    assert tiny.num_preemptions > 0
    if space is not None:
        assert space.num_swapped == 0 and space.host_used_bytes == space.disk_used_bytes == 0
        swapped = space.num_swap_outs
        assert swapped == space.num_swap_ins
        if swap == "too small":                               # recompute is the fallback
            assert swapped < tiny.num_preemptions
        else:
            assert 0 < swapped <= tiny.num_preemptions
        assert (space.num_disk_swap_outs > 0) == (swap in ("disk", "host+disk"))
        space.close()
    for e, g in zip(expected, got):
        assert g.all_token_ids == e.all_token_ids and g.finish_reason == "length"
        if g.request_id in seen_preempted:
            assert g.all_token_ids[:len(seen_preempted[g.request_id])] == \
                seen_preempted[g.request_id]
    assert tiny.block_pool.num_free_blocks == tiny.block_pool.num_blocks


def test_preempted_request_goes_to_the_front_and_newest_is_preempted():
    sched = make(num_kv_blocks=4, max_prefill_tokens=64)
    old, new = request("old", n_prompt=7, max_tokens=20), request("new", n_prompt=7,
                                                                     max_tokens=20)
    sched.add_request(old)
    sched.add_request(new)
    sched.add_request(third := request("third", n_prompt=3))
    runner = ToyRunner(sched, False)
    out = sched.schedule()                                    # old + new: 2 blocks each
    assert [s.request for s in out.seqs] == [old, new]
    sched.update_from_output(out, runner.run(out, counting))
    out = sched.schedule()                                    # decode position 7: no new block
    assert not out.preempted
    sched.update_from_output(out, runner.run(out, counting))
    out = sched.schedule()                                    # position 8 needs a 5th block
    assert out.preempted == [new] and list(sched.waiting) == [new, third]
    assert [s.request for s in out.seqs] == [old]


def test_request_that_outgrows_the_pool_alone_finishes_with_length():
    sched = make(num_kv_blocks=3, max_seq_len=128)
    req = request("a", n_prompt=5, max_tokens=100)
    sched.add_request(req)
    outs = drive(sched)
    assert req.finish_reason == "length" and req.num_tokens == 12 + 1
    assert outs[-1].finished == [req]


# -- SLAI -----------------------------------------------------------------------------------------
def test_slai_cost_model_learns_a_and_b():
    sched = make(scheduler="slai")
    for n in [1, 10, 100, 400, 50, 3] * 5:
        sched.observe_step_time(n, 0.002 + 0.0001 * n)
    assert sched.cost_model.a == pytest.approx(0.002, rel=1e-3)
    assert sched.cost_model.b == pytest.approx(0.0001, rel=1e-3)


def test_slai_bounds_prefill_while_streams_decode():
    sched = make(scheduler="slai", max_prefill_tokens=64, tbt_deadline_ms=10.0,
                 max_seq_len=512, num_kv_blocks=256)
    for n in [1, 100] * 4:
        sched.observe_step_time(n, 0.002 + 0.0004 * n)    # 10 ms buys 20 tokens
    runner = ToyRunner(sched, False)
    sched.add_request(stream := request("stream", n_prompt=3, max_tokens=50))
    out = sched.schedule()
    assert out.num_new_tokens == 3                         # nobody decoding: full budget
    sched.update_from_output(out, runner.run(out, counting))
    sched.add_request(request("long", n_prompt=200, max_tokens=1))
    out = sched.schedule()
    assert out.seqs[0].request is stream and out.num_new_tokens == 20
    fifo = make(max_prefill_tokens=64, max_seq_len=512, num_kv_blocks=256)
    fifo.add_request(request("long", n_prompt=200, max_tokens=1))
    assert fifo.schedule().num_new_tokens == 64


def test_slai_admits_least_slack_first():
    clock = Clock()
    sched = make(scheduler="slai", clock=clock, max_batch_size=1)
    relaxed, urgent, none = request("relaxed"), request("urgent"), request("none")
    relaxed.deadline, urgent.deadline = clock.t + 60, clock.t + 5
    for r in (none, relaxed, urgent):
        sched.add_request(r)
    assert [s.request for s in sched.schedule().seqs] == [urgent]


# -- random workloads -----------------------------------------------------------------------------
class Workload:
    """Random arrivals (some sharing prefixes), aborts, clock ticks and steps with random samples,
    checking the scheduler's invariants after every operation."""

    def __init__(self, hybrid, prefix, policy, blocks, batch, budget, seed, swap=None):
        self.clock = Clock()
        self.swap = SwapSpace(1, 1, *swap) if swap else None
        self.sched = make(num_kv_blocks=blocks, hybrid=hybrid, enable_prefix_caching=prefix,
                          scheduler=policy, max_batch_size=batch, max_prefill_tokens=budget,
                          max_seq_len=48, clock=self.clock, swap=self.swap)
        self.runner = ToyRunner(self.sched, hybrid)
        self.rng = random.Random(seed)
        self.prefixes = [[self.rng.randrange(1, 50) for _ in range(20)] for _ in range(3)]
        self.live: dict[str, Request] = {}
        self.done: list[Request] = []
        self.count = 0

    def arrive(self, shared, extra, which, max_tokens, timeout):
        if not self.sched.can_admit():
            return
        prompt = self.prefixes[which][:shared] + [self.rng.randrange(1, 50) for _ in range(extra)]
        self.count += 1
        req = Request(f"q{self.count}", prompt, SamplingParams(max_tokens=max_tokens),
                      eos_token_ids=frozenset({EOS}),
                      deadline=None if timeout is None else self.clock.t + timeout)
        try:
            self.sched.add_request(req)
        except ValueError:
            assert len(prompt) + 1 > self.sched.block_pool.num_blocks * 4
            return
        self.live[req.request_id] = req

    def abort(self, pick):
        if self.live:
            rid = sorted(self.live)[pick % len(self.live)]
            assert self.sched.abort_request(rid) is self.live.pop(rid)

    def step(self):
        out = self.sched.schedule()
        cfg = self.sched.config
        assert len(out.seqs) <= cfg.max_batch_size and out.num_new_tokens <= cfg.max_prefill_tokens
        assert len({s.request.request_id for s in out.seqs}) == len(out.seqs)
        assert len({s.state_slot for s in out.seqs}) == len(out.seqs)
        self.sched.check_integrity()
        for name, happened in [("preemption", out.preempted), ("state copy", out.state_copies),
                               ("state save", out.state_saves), ("timeout", out.finished),
                               ("swap out", out.swap_out), ("swap in", out.swap_in)]:
            if happened:
                event(name)
        before = {r.request_id: list(r.all_token_ids) for r in out.preempted}
        sampled = self.runner.run(out, lambda r: self.rng.choice([EOS, 5, 6, 7, 8, 9]))
        finished = self.sched.update_from_output(out, sampled)
        for r in out.preempted:
            assert r.all_token_ids == before[r.request_id]
        for r in finished + out.finished:
            assert r.is_finished and r.num_tokens <= cfg.max_seq_len
            assert r.num_output_tokens <= r.sampling_params.max_tokens
            self.done.append(self.live.pop(r.request_id))
        self.sched.check_integrity()
        assert self.sched.num_running <= cfg.max_batch_size

    def drain(self):
        for _ in range(3000):
            if not self.sched.has_unfinished():
                break
            self.step()
        assert not self.sched.has_unfinished() and not self.live
        pool = self.sched.block_pool
        assert pool.num_free_blocks == pool.num_blocks              # free or cached: no leaks
        assert all(r.finish_reason in ("stop", "length", "timeout") for r in self.done)
        if self.swap is not None:
            assert self.swap.num_swapped == 0 and self.swap.host_used_bytes == 0
            assert self.swap.disk_used_bytes == 0
            self.swap.close()


OPS = st.one_of(
    st.tuples(st.just("arrive"), st.integers(0, 20), st.integers(1, 12), st.integers(0, 1),
              st.integers(1, 12), st.one_of(st.none(), st.floats(0.5, 20))),
    st.tuples(st.just("abort"), st.integers(0, 1000)),
    st.tuples(st.just("tick"), st.floats(0, 1)),
    st.tuples(st.just("step"), st.integers(1, 4)),
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hybrid=st.booleans(), prefix=st.booleans(), policy=st.sampled_from(["fifo", "slai"]),
       blocks=st.integers(6, 16), batch=st.integers(1, 4), budget=st.integers(1, 24),
       seed=st.integers(0, 2**16), ops=st.lists(OPS, min_size=10, max_size=50),
       swap=st.one_of(st.none(), st.tuples(st.integers(0, 12), st.integers(0, 12))))
def test_random_workloads_keep_invariants_and_drain(hybrid, prefix, policy, blocks, batch,
                                                    budget, seed, ops, swap):
    w = Workload(hybrid, prefix, policy, blocks, batch, budget, seed, swap)
    for op, *args in ops:
        if op == "arrive":
            w.arrive(*args)
        elif op == "abort":
            w.abort(*args)
        elif op == "tick":
            w.clock.t += args[0]
        else:
            for _ in range(args[0]):
                w.step()
    w.drain()


def simulate_token_gaps(policy: str, step_cost=lambda n: 0.002 + 0.0001 * n) -> list[float]:
    """Three streams decode while long prompts keep arriving; each step takes `step_cost(new
    tokens)` of simulated time and is reported to the scheduler like the engine does. Returns
    the simulated time between consecutive tokens of every request (its inter-token gaps)."""
    clock = Clock()
    sched = make(scheduler=policy, clock=clock, max_batch_size=8, max_prefill_tokens=512,
                 tbt_deadline_ms=20.0, max_seq_len=2048, num_kv_blocks=4096)
    for i in range(3):
        sched.add_request(request(f"stream{i}", n_prompt=5 + i, max_tokens=80))
    last_token: dict[str, float] = {}
    gaps: list[float] = []
    for step in range(400):
        if step % 25 == 5 and step < 200:
            sched.add_request(request(f"long{step}", n_prompt=900, max_tokens=3))
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        clock.t += step_cost(out.num_new_tokens)
        sched.observe_step_time(out.num_new_tokens, step_cost(out.num_new_tokens))
        sampled = {s.request.request_id: 11 for s in out.seqs if s.sample}
        sched.update_from_output(out, sampled)
        for rid in sampled:
            if rid in last_token:
                gaps.append(clock.t - last_token[rid])
            last_token[rid] = clock.t
    assert not sched.has_unfinished()
    return gaps


def test_slai_keeps_token_gaps_under_the_deadline_where_fifo_does_not():
    slai, fifo = simulate_token_gaps("slai"), simulate_token_gaps("fifo")
    assert len(slai) == len(fifo) > 3 * 60
    assert max(slai) <= 0.020 + 1e-9
    assert max(fifo) > 0.040                   # a 512-token prefill chunk rides along: 53 ms
    assert sum(g > 0.020 for g in fifo) >= 8


@pytest.mark.parametrize("when", ["swapped", "swap-in pending"])
def test_aborting_a_swapped_request_frees_its_swap_space(when):
    space = SwapSpace(1, 1, 0, 100)                          # disk only: files to remove
    sched = make(num_kv_blocks=4, max_prefill_tokens=64, swap=space)
    old, new = request("old", n_prompt=7, max_tokens=3), request("new", n_prompt=7, max_tokens=20)
    sched.add_request(old)
    sched.add_request(new)
    runner = ToyRunner(sched, False)
    while not space.num_swapped:
        out = sched.schedule()
        sched.update_from_output(out, runner.run(out, counting))
    assert new.num_swapped_tokens == 8 and new.status is RequestStatus.PREEMPTED
    if when == "swap-in pending":
        while not (out := sched.schedule()).swap_in:
            sched.update_from_output(out, runner.run(out, counting))
        assert new.status is RequestStatus.RUNNING and new.num_computed_tokens == 8
    sched.abort_request("new")
    assert space.num_swapped == 0 and space.disk_used_bytes == 0
    assert not os.listdir(space.directory)
    space.execute(out, runner)                               # a stale swap-in is skipped
    sched.check_integrity()
    space.close()
