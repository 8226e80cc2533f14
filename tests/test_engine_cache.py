"""End to end through `EngineCore` on the CPU backend: the prefix cache, preemption (recompute
and swap) and auto-compaction change where tokens come from, never which tokens come out.

Tiny random checkpoints (tests/tiny_models.make_tiny), greedy sampling; every run is compared
with a plain run of the same requests (no prefix cache, a roomy pool, no preemption)."""
import os
import random

import pytest

from metrale.cache.swap import SwapSpace
from metrale.config import EngineConfig
from metrale.engine_core import EngineCore
from metrale.models.loader import load_checkpoint
from metrale.request import Request
from metrale.sampling import SamplingParams
from tiny_models import VOCAB, make_tiny

ARCHS = ("qwen3_5", "llama")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine_cache")
    return {arch: load_checkpoint(make_tiny(arch, root / arch, seed=7)) for arch in ARCHS}


def engine(ckpt, **overrides) -> EngineCore:
    settings = dict(device="cpu", block_size=4, max_batch_size=4, max_num_seqs=64,
                    max_prefill_tokens=64, max_seq_len=256, ssm_checkpoint_interval=8,
                    ssm_cache_slots=32, request_timeout=0, swap_space_gb=0.0)
    settings.update(overrides)
    auto_compact = settings.pop("auto_compact", None)
    config = EngineConfig(**settings)
    if auto_compact is not None:          # a field of EngineConfig once metrale/config.py has it
        config.auto_compact = auto_compact
    return EngineCore(ckpt, config)


def prompts(seed=0) -> dict[str, list[int]]:
    """Prompts sharing a 45-token system prefix to various depths: on and off block (4) and
    checkpoint (8) boundaries, one prompt a strict prefix of another, and unrelated ones."""
    rng = random.Random(seed)
    system = [rng.randrange(1, VOCAB) for _ in range(45)]

    def tail(n):
        return [rng.randrange(1, VOCAB) for _ in range(n)]

    out = {f"shared{n}": system[:n] + tail(5) for n in (3, 8, 13, 16, 21, 24, 37)}
    out["system"] = list(system)                      # the others' prefix, whole
    out["system+"] = system + tail(3)                 # "system" is its strict prefix
    out["system20"] = system[:20]                     # a strict prefix, off every boundary
    out["system20+"] = system[:20] + tail(11)
    out["other"] = tail(17)
    out["other+"] = out["other"] + tail(9)
    return out


def greedy(max_tokens=6) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run(core: EngineCore, waves, max_tokens=6, check=None) -> dict[str, list[int]]:
    """Submit each wave of {id: prompt} once the previous wave has finished; returns the output
    tokens of every request, checked to arrive one delta per step."""
    tokens: dict[str, list[int]] = {}
    for wave in waves:
        for rid, prompt in wave.items():
            core.add_request(Request(rid, list(prompt), greedy(max_tokens)))
            tokens[rid] = []
        finished = set()
        while core.has_unfinished():
            for o in core.step():
                assert o.request_id not in finished
                tokens[o.request_id] += o.token_ids
                assert o.num_output_tokens == len(tokens[o.request_id])
                if o.finished:
                    finished.add(o.request_id)
                    assert o.finish_reason == "length"
            core.scheduler.check_integrity()
            if check:
                check(core)
        assert finished == set(wave)
    return tokens


def split(ps: dict, first: list[str]) -> list[dict]:
    return [{k: ps[k] for k in first}, {k: v for k, v in ps.items() if k not in first}]


@pytest.fixture(scope="module")
def expected(checkpoints):
    """Reference outputs: each request alone through a plain engine (no cache, no pressure)."""
    ps = prompts()
    return {arch: run(engine(checkpoints[arch]), [{k: v} for k, v in ps.items()])
            for arch in ARCHS}


# -- prefix cache ---------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_cache_gives_the_same_tokens_together_and_in_waves(arch, checkpoints, expected):
    ps = prompts()
    together = engine(checkpoints[arch], enable_prefix_caching=True)
    assert run(together, [ps]) == expected[arch]

    warm = engine(checkpoints[arch], enable_prefix_caching=True)
    assert run(warm, split(ps, ["system", "other", "shared13"])) == expected[arch]
    cache = warm.scheduler.prefix_cache
    assert cache.num_hits >= 8 and cache.num_tokens_saved >= 8 * 8
    # the same prompts again over the warm cache: every one hits but "shared3", whose 8 tokens
    # hold no reusable checkpoint of a hybrid model (a hit must leave a token to compute)
    hits_before = cache.num_hits
    again = run(warm, [{f"{k}#2": v for k, v in ps.items()}])
    assert {k[:-2]: v for k, v in again.items()} == expected[arch]
    assert cache.num_hits - hits_before == len(ps) - (arch == "qwen3_5")


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_cache_reports_cached_tokens_per_request(arch, checkpoints):
    ps = prompts()
    core = engine(checkpoints[arch], enable_prefix_caching=True)
    run(core, [{"system": ps["system"]}])
    core.add_request(Request("hit", ps["system+"], greedy(1)))
    outs = []
    while core.has_unfinished():
        outs += core.step()
    assert outs[-1].num_cached_tokens == (40 if arch == "qwen3_5" else 44)


# -- preemption -----------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("prefix", [False, True])
def test_tiny_pool_preempts_by_recompute_and_gives_the_same_tokens(arch, prefix, checkpoints,
                                                                 expected):
    ps = prompts()
    core = engine(checkpoints[arch], enable_prefix_caching=prefix, num_kv_blocks=18)
    assert run(core, [ps]) == expected[arch]
    assert core.scheduler.num_preemptions > 0
    again = engine(checkpoints[arch], enable_prefix_caching=prefix, num_kv_blocks=18)
    assert run(again, split(ps, ["system+", "shared24", "other+", "shared3"])) == expected[arch]
    assert again.scheduler.num_preemptions > 0


def with_swap(core: EngineCore, space: SwapSpace | None = None) -> SwapSpace:
    """The engine's swap space (`space` replaces it: sizes in bytes for host and disk). Until
    metrale/engine_core.py and metrale/runner.py wire it (the lead's files: `EngineCore.swap`,
    `Scheduler(..., swap=)`, the hook at the top of `ModelRunner.execute`), this attaches it the
    same way from outside."""
    hooked = getattr(core, "swap", None) is not None
    if space is None:
        space = core.swap if hooked else SwapSpace.for_caches(core.caches,
                                                              core.config.swap_space_gb)
    core.swap = core.scheduler.swap = space
    if hasattr(core.runner, "swap"):
        core.runner.swap = space
    elif not hooked:
        execute = core.runner.execute

        def execute_with_swaps(out, on_launch=None, masks=None):
            core.swap.execute(out, core.caches)
            return execute(out, on_launch, masks)

        core.runner.execute = execute_with_swaps
    return space


def sized_swap(core: EngineCore, host_blocks: int, disk_blocks: int) -> SwapSpace:
    """Swap space for `host_blocks` / `disk_blocks` KV blocks plus one GDN state row each."""
    block, state = core.caches.kv_bytes_per_block, core.caches.state_bytes_per_slot
    return SwapSpace(block, state, host_blocks * block + state, disk_blocks * block + state)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("prefix", [False, True])
def test_tiny_pool_preempts_by_swapping_and_gives_the_same_tokens(arch, prefix, checkpoints,
                                                                 expected):
    ps = prompts()
    core = engine(checkpoints[arch], enable_prefix_caching=prefix, num_kv_blocks=18,
                  swap_space_gb=1.0)
    swap = with_swap(core)
    assert run(core, [ps]) == expected[arch]
    assert core.scheduler.num_preemptions > 0
    assert swap.num_swap_outs == swap.num_swap_ins == core.scheduler.num_preemptions
    assert swap.num_disk_swap_outs == 0 and swap.num_swapped == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_swap_to_disk_and_fallback_to_recompute_give_the_same_tokens(arch, checkpoints,
                                                                     expected):
    ps = prompts()
    core = engine(checkpoints[arch], num_kv_blocks=18, max_batch_size=6)
    swap = with_swap(core, sized_swap(core, 0, 1000))                # disk only
    assert run(core, [ps]) == expected[arch]
    assert swap.num_disk_swap_outs == swap.num_swap_ins == core.scheduler.num_preemptions > 0
    directory = swap.directory
    assert os.path.isdir(directory) and not os.listdir(directory)    # files go on swap-in
    swap.close()
    assert not os.path.exists(directory)

    core = engine(checkpoints[arch], num_kv_blocks=18, max_batch_size=6)
    swap = with_swap(core, sized_swap(core, 6, 6))                   # host, disk, recompute
    assert run(core, [ps]) == expected[arch]
    assert 0 < swap.num_disk_swap_outs < swap.num_swap_outs < core.scheduler.num_preemptions
    swap.close()


# -- auto-compaction ------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_auto_compact_keeps_sink_and_recent_window_past_max_seq_len(arch, checkpoints):
    """max_seq_len 64, --auto-compact 0.5: at 32 tokens of context the middle is dropped, keeping
    the first 8 prompt tokens (sink = 32 // 4) and the 8 most recent (32 // 2 - sink); the
    generation runs to 120 tokens. The token after each compaction is what a fresh request whose
    prompt is the compacted context would produce."""
    rng = random.Random(3)
    prompt = [rng.randrange(1, VOCAB) for _ in range(20)]
    reference = engine(checkpoints[arch], max_seq_len=64)
    results = []
    for prefix in (False, True):
        core = engine(checkpoints[arch], max_seq_len=64, auto_compact=0.5,
                      enable_prefix_caching=prefix)
        req = Request("long", list(prompt), greedy(120))
        core.add_request(req)
        out_tokens, contexts = [], []
        while core.has_unfinished():
            before = req.num_compactions
            for o in core.step():
                out_tokens += o.token_ids
            if req.num_compactions > before:
                full = prompt + out_tokens
                assert req.all_token_ids == full[:8] + full[-8:]
                assert req.num_tokens == 16 and req.num_sink_tokens == 8
                contexts.append((req.all_token_ids, len(out_tokens)))
            core.scheduler.check_integrity()
        assert req.finish_reason == "length" and len(out_tokens) == 120
        assert req.num_output_tokens == 120 and len(prompt) + 120 > 64
        assert req.num_compactions == len(contexts) >= 6
        assert req.num_tokens < 32
        for context, at in contexts[:3]:
            expect = run(reference, [{f"ctx{at}-{prefix}": context}], max_tokens=1)
            assert [out_tokens[at]] == expect[f"ctx{at}-{prefix}"]
        results.append(out_tokens)
    assert results[0] == results[1]
