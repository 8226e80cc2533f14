"""Prefill / mixed steps padded into a token bucket (metrale.backends.cuda.graphs.StepInputs: what the
step graphs of --prefill-graphs replay) compute what the unpadded step does.

CPU: the padded step's logits for the real rows equal the eager step's (fp32, rtol 1e-5: the
same rows through matrix products with more rows); it writes the same KV (same tolerance) and
nothing else (its padding tokens have slot -1); its attention work lists cover every real tile
once and pad with items the kernels skip; an engine whose every step runs padded
(CpuStepGraphs) serves the same greedy tokens as one that does not (Llama, Qwen3.5 hybrid and
MoE). GPU (H200, bf16, not yet run): engines with --prefill-graphs on and off agree on greedy
continuations up to near-ties (Llama, Qwen3.5), and a graphed mixed step's logits match the
eager step's within 2e-2 of the largest logit.
"""
from __future__ import annotations

import numpy as np
import pytest
from tiny_models import VOCAB, load_tiny, make_tiny

from metrale.backends.cpu import CpuOps
from metrale.cache.kv import ModelCaches
from metrale.backends.cuda.graphs import (
    StepBuckets,
    StepInputs,
    _layout_size,
    _step_layout,
    step_buckets_for,
    step_graph_support,
    step_rows,
)
from metrale.forward import contiguous_batch, prefill_work_list
from metrale.models.registry import build_model

BS = 16
NUM_BLOCKS, SLOTS = 40, 4


def _inputs(tokens: int, rows: int, width: int, tiles=(16,), pad_cap=None) -> StepInputs:
    return StepInputs(tokens, rows, width, tiles,
                      np.zeros(_layout_size(_step_layout(tokens, rows, width, tiles)), np.int32),
                      pad_cap=pad_cap)


def test_buckets():
    assert step_buckets_for(8192) == [16, 32, 64, 128, 256, 512, 1024, 2048]
    assert step_buckets_for(300) == [16, 32, 64, 128, 256, 300]
    assert step_buckets_for(16) == [16]
    assert step_buckets_for(10) == [10]


def test_work_lists_cover_every_tile_once_and_pad_with_no_ops():
    inp = _inputs(64, 6, 4, tiles=(8, 16))
    # 3 sequences: 20 new tokens after 5 cached, 1 (a decode), 30 from scratch
    qsl = np.array([0, 20, 21, 51], np.int32)
    seq_lens = np.array([25, 9, 30], np.int32)
    b = inp.pack_arrays(np.arange(51, dtype=np.int32), np.zeros(51, np.int32), qsl, seq_lens,
                        np.ones((3, 2), np.int32), np.arange(51, dtype=np.int32),
                        np.zeros(3, np.int32), spare_block=99, spare_slot=7)
    assert b == 3
    v = inp.views
    q = v["query_start_loc"]
    assert list(q) == [0, 20, 21, 51, 64, 64, 64]             # row 3 owns the 13 padding tokens
    assert list(v["seq_lens"]) == [25, 9, 30, 13, 0, 0]
    assert (v["block_tables"][3:] == 99).all() and (v["state_slots"][3:] == 7).all()
    assert (v["slot_mapping"][51:] == -1).all()
    assert list(v["logits_indices"][:3]) == [19, 20, 50]
    for bq in (8, 16):
        work = v[f"work{bq}"]
        qlens = np.diff(q)
        real = [(int(s), int(q0)) for s, q0 in work if q0 < qlens[s]]
        want = [(s, q0) for s in range(len(qlens)) for q0 in range(0, int(qlens[s]), bq)]
        assert sorted(real) == sorted(want)                  # every tile once, padding row included
        skipped = [(int(s), int(q0)) for s, q0 in work if q0 >= qlens[s]]
        assert len(real) + len(skipped) == len(work) == -(-64 // bq) + 6
        assert all(q0 >= 64 for _, q0 in skipped)
        assert np.array_equal(work[: len(real)], prefill_work_list(q, v["seq_lens"], bq))


def test_padding_longer_than_a_block_table_spreads_over_rows():
    """Padding rows own at most pad_cap tokens (one block table's span, so their attention reads
    stay inside their tables): 44 padding tokens at 16 a row take three rows."""
    inp = _inputs(64, 5, 1, pad_cap=16)
    z = np.zeros
    b = inp.pack_arrays(np.arange(20, dtype=np.int32), np.arange(20, dtype=np.int32), np.array([0, 20], np.int32),
                        np.array([20], np.int32), z((1, 1), np.int32), np.arange(20, dtype=np.int32),
                        z(1, np.int32), spare_block=9, spare_slot=3)
    assert b == 1
    v = inp.views
    assert list(v["query_start_loc"]) == [0, 20, 36, 52, 64, 64]
    assert list(v["seq_lens"]) == [20, 16, 16, 12, 0]
    assert list(v["positions"][20:]) == list(range(16)) * 2 + list(range(12))
    assert (v["slot_mapping"][20:] == -1).all() and (v["block_tables"][1:] == 9).all()
    # 3 real rows + 43 padding tokens (3 rows) need 6 of the 5; with 31 padding tokens, 2 rows
    assert inp.fits(21, 2) and not inp.fits(21, 3) and inp.fits(33, 3)
    assert step_rows(64, 8, 16) == 12 and step_rows(64, 64, 16) == 68


def test_steps_that_do_not_fit_are_refused():
    inp = _inputs(16, 3, 2)
    z = np.zeros
    # 17 tokens
    assert inp.pack_arrays(z(17, np.int32), z(17, np.int32), np.array([0, 17], np.int32), np.array([17], np.int32),
                           z((1, 2), np.int32), z(17, np.int32), z(1, np.int32), 0, 0) == -1
    # 3 sequences: no row left for the padding
    assert inp.pack_arrays(z(3, np.int32), z(3, np.int32), np.arange(4, dtype=np.int32), np.ones(3, np.int32),
                           z((3, 1), np.int32), z(3, np.int32), z(3, np.int32), 0, 0) == -1
    # a block table wider than the buffer's
    assert inp.pack_arrays(z(2, np.int32), z(2, np.int32), np.array([0, 2], np.int32), np.array([40], np.int32),
                           z((1, 3), np.int32), z(2, np.int32), z(1, np.int32), 0, 0) == -1


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = make_tiny("llama", tmp_path_factory.mktemp("llama"))
    ops = CpuOps()
    return ops, build_model(load_tiny(path), ops)


def test_support_and_rows(llama, tmp_path):
    _, model = llama
    assert step_graph_support(model) is None
    for arch in ("qwen3_5", "qwen3_5_moe"):
        assert step_graph_support(build_model(load_tiny(make_tiny(arch, tmp_path / arch)), CpuOps())) is None

    class Mixer:
        pass

    class Layer:
        mixer, mlp = Mixer(), None

    assert "layer 0's mixer is Mixer" in step_graph_support(type("M", (), {"layers": [Layer()]})())
    assert step_graph_support(type("M", (), {"layers": []})()) == "the model has no decoder layers"
    assert step_rows(64, 8) == 9 and step_rows(16, 256) == 17
    assert step_rows(16, 15) == 17          # never as many rows as tokens (that shape means decode)


@pytest.mark.parametrize("pad_cap", [None, 16])
def test_padded_step_computes_the_eager_step(llama, pad_cap):
    """A mixed step (a cached prefix continued, a decode, a fresh prompt) eagerly and padded
    into a 64-token bucket from the same cache state: same logits for the real rows, same KV;
    the 41 padding tokens in one row, or in three of at most 16."""
    ops, model = llama
    rng = np.random.default_rng(0)
    caches = ModelCaches(model.cache_spec(), ops, NUM_BLOCKS + 1, BS, SLOTS + 1)
    spare_block, spare_slot = NUM_BLOCKS, SLOTS
    blocks = [int(b) for b in rng.permutation(NUM_BLOCKS)]
    tables = [blocks[0:3], blocks[3:5], blocks[5:8]]
    a, d = rng.integers(0, VOCAB, 40).tolist(), rng.integers(0, VOCAB, 19).tolist()
    # fill the cache: a's first 20 tokens, d's first 18
    model.forward(contiguous_batch([a[:20], d[:18]], [0, 0], tables[:2], [0, 1], BS), caches)
    fresh = rng.integers(0, VOCAB, 23).tolist()
    step = contiguous_batch([a[20:], d[18:], fresh], [20, 18, 0], tables, [0, 1, 2], BS)
    before = [np.array(c) for layer in range(len(model.layers)) for c in caches.kv(layer)]

    eager = ops.to_numpy(model.forward(step, caches))
    after_eager = [np.array(c) for layer in range(len(model.layers)) for c in caches.kv(layer)]

    i = 0
    for layer in range(len(model.layers)):      # back to the state before the step
        for c in caches.kv(layer):
            c[...] = before[i]
            i += 1
    width = 4
    inp = _inputs(64, 6, width, pad_cap=pad_cap)
    b = inp.pack_arrays(step.input_ids, step.positions, step.query_start_loc, step.seq_lens,
                        step.block_tables, step.slot_mapping, step.state_slots, spare_block, spare_slot)
    assert b == 3
    padded = ops.to_numpy(model.forward(inp.batch(inp.views, BS), caches))
    assert padded.shape[0] == 6
    np.testing.assert_allclose(padded[:b], eager, rtol=1e-5, atol=1e-5 * float(np.abs(eager).max()))
    i = 0
    for layer in range(len(model.layers)):
        for c in caches.kv(layer):
            now = np.asarray(c)
            np.testing.assert_allclose(now, after_eager[i], rtol=1e-5,
                                       atol=1e-5 * float(np.abs(after_eager[i]).max()))   # the same writes
            untouched = before[i] == after_eager[i]
            assert np.array_equal(now[untouched], before[i][untouched])          # and no others
            i += 1


class CpuStepGraphs:
    """StepGraphs.run_step's contract on the CPU backend: the step padded into the smallest token
    bucket that holds it (StepBuckets, the host side of the CUDA step graphs) and run as one
    forward; None when none holds it. Lets the engine's use of step graphs (the runner keeping
    the sampling rows, chunked prefills, prefix hits, mixed steps) run end to end without a GPU."""

    def __init__(self, core, max_tokens=64):
        self.model, self.caches, self.bs = core.model, core.caches, core.config.block_size
        width = -(-core.config.max_seq_len // self.bs)
        self.inputs = StepBuckets(max_tokens, core.config.max_batch_size, width, (16,), self.bs,
                                  core._num_blocks, core._num_slots)
        self.replayed = 0

    def run_step(self, seqs):
        packed = self.inputs.pack(seqs)
        if packed is None:
            return None
        inputs, b = packed
        self.replayed += 1
        return self.model.forward(inputs.batch(inputs.views, self.bs), self.caches)[:b]


@pytest.mark.parametrize("arch", ["llama", "qwen3_5", "qwen3_5_moe"])
def test_engine_with_padded_steps_serves_like_eager(tmp_path, arch):
    """Engines on the CPU backend with and without padded steps: the same greedy tokens for
    one-shot prompts, a prompt longer than the largest bucket (chunked: its middle chunks do
    not sample), prefix-cache hits (hybrid models: GDN state snapshots restored) and arrivals
    while others decode (mixed steps)."""
    from metrale.config import EngineConfig
    from metrale.engine_core import EngineCore
    from metrale.models.loader import load_checkpoint
    from metrale.request import Request
    from metrale.sampling import SamplingParams

    path = make_tiny(arch, tmp_path / arch, seed=4)
    rng = np.random.default_rng(3)
    shared = rng.integers(0, VOCAB, 21).tolist()
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in (3, 11, 30, 90)]
    prompts += [shared + rng.integers(0, VOCAB, k).tolist() for k in (2, 9)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True).validate()
    outs, replays = {}, {}
    for padded in (False, True):
        core = EngineCore(load_checkpoint(str(path)), EngineConfig(
            device="cpu", block_size=4, max_batch_size=4, max_num_seqs=8, max_prefill_tokens=48,
            max_seq_len=160, enable_prefix_caching=True, ssm_checkpoint_interval=8, request_timeout=0,
            swap_space_gb=0.0, seed=5))
        if padded:
            core.runner.step_graphs = CpuStepGraphs(core)
        got = {}
        for i, p in enumerate(prompts):
            core.add_request(Request(f"r{i}", list(p), params))
            for o in core.step():                            # later arrivals join running ones
                got.setdefault(o.request_id, []).extend(o.token_ids)
        while core.has_unfinished():
            for o in core.step():
                got.setdefault(o.request_id, []).extend(o.token_ids)
        outs[padded] = got
        replays[padded] = core.runner.step_graphs.replayed if padded else 0
    assert replays[True] >= 5                                # the padded path did run
    assert all(len(v) == 10 for v in outs[True].values())
    assert outs[True] == outs[False]


# -- on the GPU ------------------------------------------------------------------------------

SHAPES = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
              head_dim=64)
# head dims the CUDA kernels are built for (GDN 32 x 32, as tests/test_warmup.py)
GDN_SHAPES = dict(linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=2,
                  linear_num_value_heads=4)


def _engine(path, prefill_graphs: str):
    from metrale.config import EngineConfig
    from metrale.engine_core import EngineCore
    from metrale.models.loader import load_checkpoint

    return EngineCore(load_checkpoint(path), EngineConfig(
        device="cuda", warmup="off", prefill_graphs=prefill_graphs, block_size=16, max_batch_size=8,
        max_num_seqs=16, max_prefill_tokens=256, max_seq_len=512, enable_prefix_caching=True,
        request_timeout=0, swap_space_gb=0.0, seed=5))


def _greedy(core, prompts, max_tokens=24, tag=""):
    from metrale.request import Request
    from metrale.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True).validate()
    out = {}
    for i, p in enumerate(prompts):
        core.add_request(Request(f"{tag}{i}", list(p), params))
        if i == 1:              # later arrivals join a running batch: mixed steps
            for o in core.step():
                out.setdefault(o.request_id, []).extend(o.token_ids)
    while core.has_unfinished():
        for o in core.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
    return [out[f"{tag}{i}"] for i in range(len(prompts))]


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_gpu_prefill_graphs_serve_like_eager_steps(tmp_path, arch):
    """Greedy continuations with and without step graphs: one-shot prompts of several lengths
    (buckets 16 .. 256), a prompt longer than the largest bucket's share (chunked), a shared
    prefix (prefix cache: cached context in a graphed step) and arrivals during decoding (mixed
    steps). bf16 on both sides: every request's first token agrees, and 80 % of all tokens lie
    before their request's first difference (a near-tie)."""
    pytest.importorskip("cupy")
    path = make_tiny(arch, tmp_path / arch, dtype="bfloat16", **SHAPES,
                     **(GDN_SHAPES if arch == "qwen3_5" else {}))
    rng = np.random.default_rng(1)
    shared = rng.integers(0, VOCAB, 40).tolist()
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in (5, 17, 60, 130, 300)]
    prompts += [shared + rng.integers(0, VOCAB, 7).tolist(), shared + rng.integers(0, VOCAB, 12).tolist()]
    outs = {}
    for mode in ("off", "on"):
        eng = _engine(path, mode)
        assert (eng.runner.step_graphs is not None) == (mode == "on")
        first = _greedy(eng, prompts[:3], tag="a")
        second = _greedy(eng, prompts[3:], tag="b")         # prefix hits, a 300-token prompt in chunks
        outs[mode] = first + second
    # tokens equal up to each request's first difference (a bf16 near-tie: the graphs' matrix
    # products run at the bucket's row count, so cuBLAS may pick another algorithm)
    same_prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                   for a, b in zip(outs["off"], outs["on"])]
    print("tokens equal before the first difference:", same_prefix)
    assert all(n >= 1 for n in same_prefix), same_prefix
    assert sum(same_prefix) >= 0.8 * sum(len(a) for a in outs["off"]), same_prefix


@pytest.mark.gpu
def test_gpu_graphed_step_logits_match_eager(tmp_path):
    """The step graph's logits of a mixed step against the eager forward of the same step, from
    the same cache state (bf16: within 2e-2 of the largest logit)."""
    cp = pytest.importorskip("cupy")
    from metrale.backends.cuda.graphs import StepGraphs
    from metrale.request import Request
    from metrale.sampling import SamplingParams
    from metrale.scheduler import ScheduledSeq

    path = make_tiny("llama", tmp_path / "llama", dtype="bfloat16", **SHAPES)
    eng = _engine(path, "on")
    steps = eng.runner.step_graphs
    assert isinstance(steps, StepGraphs)
    rng = np.random.default_rng(2)
    params = SamplingParams(max_tokens=4, temperature=0.0).validate()

    def req(ids, computed):
        r = Request(f"x{len(ids)}-{computed}", ids, params)
        r.num_computed_tokens = computed
        return r

    def step_of(seqs):
        return type("Out", (), {"seqs": seqs})()

    tables = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    a, d, f = (rng.integers(0, VOCAB, n).tolist() for n in (40, 19, 50))
    warm = [ScheduledSeq(req(a, 0), 20, tables[0], 0, False), ScheduledSeq(req(d, 0), 18, tables[1], 1, False)]
    eng.model.forward(eng.ops.upload_batch(eng.runner.build_batch(step_of(warm))), eng.caches)
    seqs = [ScheduledSeq(req(a, 20), 20, tables[0], 0, True), ScheduledSeq(req(d, 18), 1, tables[1], 1, True),
            ScheduledSeq(req(f, 0), 50, tables[2], 2, True)]
    kv = [[c.copy() for c in eng.caches.kv(layer)] for layer in range(len(eng.model.layers))]
    eager = cp.asnumpy(eng.model.forward(eng.ops.upload_batch(eng.runner.build_batch(step_of(seqs))),
                                         eng.caches)).astype(np.float32)
    for layer, pair in enumerate(kv):
        for c, saved in zip(eng.caches.kv(layer), pair):
            c[...] = saved
    graphed = cp.asnumpy(steps.run_step(seqs)).astype(np.float32)
    assert graphed.shape == eager.shape == (3, VOCAB)
    assert float(np.abs(graphed - eager).max()) <= 2e-2 * float(np.abs(eager).max())
