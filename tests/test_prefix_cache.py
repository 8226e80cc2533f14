"""Prefix caching through the Scheduler: full-block hits, GDN snapshots at checkpoints (Marconi),
state saves/copies, LRU eviction of blocks and snapshots, metrics counters."""
import pytest

from metrale.config import ConfigError, EngineConfig
from metrale.request import Request
from metrale.sampling import SamplingParams
from metrale.scheduler import Scheduler

BS, INTERVAL, BATCH = 4, 8, 4


def make(hybrid: bool, num_kv_blocks: int = 64, **overrides) -> Scheduler:
    settings = dict(block_size=BS, max_batch_size=BATCH, max_prefill_tokens=64, max_seq_len=256,
                    enable_prefix_caching=True, ssm_checkpoint_interval=INTERVAL,
                    ssm_cache_slots=4, request_timeout=0)
    settings.update(overrides)
    config = EngineConfig(**settings).validate()
    return Scheduler(config, num_kv_blocks, Scheduler.num_state_slots_needed(config, hybrid),
                     hybrid)


def request(rid: str, tokens, max_tokens: int = 1) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens))


def step(sched: Scheduler):
    out = sched.schedule()
    sched.check_integrity()
    sched.update_from_output(out, {s.request.request_id: 7 for s in out.seqs if s.sample})
    sched.check_integrity()
    return out


def run(sched: Scheduler, *reqs: Request):
    """Add the requests, step until all finish, return every step's output."""
    for r in reqs:
        sched.add_request(r)
    outs = []
    while sched.has_unfinished():
        outs.append(step(sched))
    return outs


def seqs_of(outs, rid):
    return [(o, s) for o in outs for s in o.seqs if s.request.request_id == rid]


PROMPT = list(range(100, 122))          # 22 tokens: 5 full blocks + 2


@pytest.mark.parametrize("hybrid", [False, True])
def test_shared_prefix_hits_full_blocks_or_deepest_snapshot(hybrid):
    sched = make(hybrid)
    outs_a = run(sched, request("a", PROMPT))
    a_blocks = list(seqs_of(outs_a, "a")[0][1].block_table)
    b = request("b", PROMPT[:19] + [1, 2, 3, 4, 5])      # shares 19 tokens = 4 full blocks
    outs_b = run(sched, b)
    # 16 tokens: 4 full blocks, and 16 is also a checkpoint whose snapshot `a` saved
    assert b.num_cached_tokens == 16
    first_out, first = seqs_of(outs_b, "b")[0]
    assert first.num_new_tokens == 24 - 16
    assert first.block_table[:4] == a_blocks[:4]
    if hybrid:
        a_first_out, a_first = seqs_of(outs_a, "a")[0]
        assert a_first.num_new_tokens == 16              # cut at the last checkpoint crossed
        (a_save,) = a_first_out.state_saves
        assert a_save[0] == a_first.state_slot and BATCH <= a_save[1] < BATCH + 4
        assert first_out.state_copies == [(a_save[1], first.state_slot)]
    else:
        assert first_out.state_copies == []
    assert (sched.prefix_cache.num_hits, sched.prefix_cache.num_misses) == (1, 1)
    assert sched.prefix_cache.num_tokens_saved == 16


@pytest.mark.parametrize("hybrid", [False, True])
def test_identical_prompt_still_computes_a_token(hybrid):
    prompt = list(range(50, 74))                          # 24 tokens = exactly 6 blocks
    sched = make(hybrid)
    run(sched, request("a", prompt))
    again = request("b", prompt)
    outs = run(sched, again)
    assert again.num_cached_tokens == (20 if not hybrid else 16)
    assert seqs_of(outs, "b")[0][1].num_new_tokens == 24 - again.num_cached_tokens


def test_hybrid_hit_falls_back_to_deepest_snapshot_and_recomputes_past_it():
    sched = make(True)
    run(sched, request("a", PROMPT))                      # snapshot at 16 only
    b = request("b", PROMPT[:14] + [9] * 6)               # shares 3 full blocks (12 tokens)
    outs_b = run(sched, b)
    assert b.num_cached_tokens == 0                       # no snapshot at 8: KV alone is useless
    # Marconi's branch point: b's first chunk ends at the checkpoint inside the shared prefix,
    # snapshotting it for the next request that branches there
    first_out, first = seqs_of(outs_b, "b")[0]
    assert first.num_new_tokens == 8 and len(first_out.state_saves) == 1
    c = request("c", PROMPT[:13] + [5] * 4)
    outs_c = run(sched, c)
    assert c.num_cached_tokens == 8
    c_out, c_first = seqs_of(outs_c, "c")[0]
    assert c_out.state_copies == [(first_out.state_saves[0][1], c_first.state_slot)]


def test_chunks_end_on_every_checkpoint_they_cross_and_save_there():
    sched = make(True, max_prefill_tokens=6)
    outs = run(sched, request("a", PROMPT))
    ends, saves, computed = [], [], 0
    for out, seq in seqs_of(outs, "a"):
        computed += seq.num_new_tokens
        ends.append(computed)
        saves.append(out.state_saves == [(seq.state_slot, out.state_saves[0][1])]
                     if out.state_saves else False)
    assert ends == [6, 8, 14, 16, 22]
    assert saves == [False, True, False, True, False]


def test_decode_reaching_a_checkpoint_saves_the_state():
    sched = make(True)
    outs = run(sched, request("a", list(range(6)), max_tokens=4))
    computed, saved_at = 0, []
    for out, seq in seqs_of(outs, "a"):
        computed += seq.num_new_tokens
        if out.state_saves:
            assert out.state_saves[0][0] == seq.state_slot
            saved_at.append(computed)
    assert saved_at == [8]


def test_non_hybrid_model_never_touches_snapshots():
    sched = make(False, max_prefill_tokens=6)
    outs = run(sched, request("a", PROMPT, max_tokens=5))
    assert all(not o.state_saves and not o.state_copies for o in outs)
    # chunks are not cut at checkpoints either
    assert [s.num_new_tokens for o, s in seqs_of(outs, "a")][:4] == [6, 6, 6, 4]


def test_snapshot_lru_eviction():
    sched = make(True, ssm_cache_slots=1)
    first, second = list(range(10)), list(range(200, 210))
    both = run(sched, request("a", first), request("b", second))
    # one slot: in the shared step only one of the two can reserve it
    assert [len(o.state_saves) for o in both] == [1, 0]
    run(sched, request("b2", second))
    assert sched.prefix_cache.snapshots.num_evictions == 1   # b2's save evicted a's snapshot
    again_second, again_first = request("c", second), request("d", first)
    run(sched, again_second)
    run(sched, again_first)
    assert again_second.num_cached_tokens == 8
    assert again_first.num_cached_tokens == 0           # its snapshot was evicted


def test_block_eviction_under_pressure():
    sched = make(False, num_kv_blocks=8)
    run(sched, request("a", PROMPT))                     # 6 blocks, 5 of them cached
    assert sched.block_pool.num_cached_blocks == 5
    run(sched, request("b", list(range(300, 326))))      # 7 blocks: must evict a's tail
    assert sched.block_pool.num_evictions > 0
    again = request("c", PROMPT)
    run(sched, again)
    assert again.num_cached_tokens < 20
    assert sched.block_pool.num_free_blocks == sched.block_pool.num_blocks


def test_identical_prompts_in_one_step_do_not_hit_uncomputed_blocks():
    sched = make(False)
    a, b = request("a", PROMPT), request("b", PROMPT)
    run(sched, a, b)
    assert a.num_cached_tokens == b.num_cached_tokens == 0


def test_checkpoint_interval_must_be_a_multiple_of_block_size():
    with pytest.raises(ConfigError, match="multiple"):
        make(True, ssm_checkpoint_interval=6)
    make(False, ssm_checkpoint_interval=6)               # attention-only: interval unused


def test_hybrid_needs_snapshot_rows_in_the_state_pool():
    config = EngineConfig(max_batch_size=4, enable_prefix_caching=True,
                          ssm_cache_slots=3).validate()
    assert Scheduler.num_state_slots_needed(config, True) == 7
    with pytest.raises(ConfigError, match="state rows"):
        Scheduler(config, 64, 6, hybrid=True)
