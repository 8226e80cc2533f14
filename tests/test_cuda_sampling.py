"""GPU tests of GpuSampler (metrale/backends/cuda/sampling.py, kernels_cuda/sampling.cu) against
numpy statements of the rules documented there: greedy, filters (top-k, top-p, min-p,
top-n-sigma) as exact kept sets, penalties on the prepared logits, seeded reproducibility,
empirical distributions, logprobs."""
from __future__ import annotations

import numpy as np
import pytest

from metrale.sampling import SamplingParams

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def ops():
    from metrale.backends.cuda import BF16, CudaOps
    return CudaOps(dtype=BF16)


def _sampler(ops, V, B=64, **kw):
    from metrale.backends.cuda.sampling import GpuSampler
    return GpuSampler(ops, V, B, **kw)


def _softmax(l):
    e = np.exp(l - l.max())
    return e / e.sum()


def _kept(l, p: SamplingParams):
    """The kept set of the documented rules (l = processed logits, fp32)."""
    V = l.size
    keep = np.ones(V, bool)
    if 0 < p.top_k < V:
        keep &= l >= np.sort(l)[::-1][p.top_k - 1]
    if p.top_p < 1:
        sub = np.where(keep, l, -np.inf)
        pr = _softmax(sub)
        order = np.argsort(-sub, kind="stable")
        cum = np.cumsum(pr[order])
        n = int(np.searchsorted(cum, p.top_p - 1e-6)) + 1
        keep &= l >= sub[order[min(n, V) - 1]]
    if p.min_p > 0:
        keep &= l >= l.max() + np.log(p.min_p)
    if p.top_n_sigma > 0:
        keep &= l >= l.max() - p.top_n_sigma * l.std()
    return keep


def test_greedy_matches_argmax(ops):
    import cupy as cp
    rng = np.random.default_rng(0)
    V, B = 248320, 8
    logits = rng.standard_normal((B, V)).astype(np.float32)
    logits[3, [10, 20]] = 50.0  # tie: lowest id wins
    s = _sampler(ops, V, B)
    d = ops.asarray(logits)
    toks = s.sample(d, [SamplingParams(temperature=0.0)] * B, np.zeros(B))
    host = ops.to_numpy(d).astype(np.float32)
    np.testing.assert_array_equal(toks, host.argmax(1))
    assert toks[3] == 10
    # fp32 logits too, and top_k = 1 at temperature 1 is greedy (ties at the k-th value are
    # all kept, so row 3 draws between its two tied tokens)
    toks = s.sample(cp.asarray(logits), [SamplingParams(top_k=1)] * B, np.arange(B))
    rest = np.arange(B) != 3
    np.testing.assert_array_equal(toks[rest], logits.argmax(1)[rest])
    assert toks[3] in (10, 20)


def test_seed_reproducible(ops):
    rng = np.random.default_rng(1)
    V, B = 5000, 16
    logits = ops.asarray(rng.standard_normal((B, V)) * 2)
    s = _sampler(ops, V, B)
    params = [SamplingParams(seed=1234 + (i % 4)) for i in range(B)]
    a = s.sample(logits, params, np.full(B, 7))
    b = s.sample(logits, params, np.full(B, 7))
    np.testing.assert_array_equal(a, b)
    # same seed, same step, same logits row -> same token whatever the row position
    row = ops.asarray(np.tile(ops.to_numpy(logits)[:1].astype(np.float32), (B, 1)))
    c = s.sample(row, [SamplingParams(seed=99)] * B, np.full(B, 3))
    assert len(set(c.tolist())) == 1
    d = s.sample(row, [SamplingParams(seed=99)] * B, np.arange(B))  # different steps differ
    assert len(set(d.tolist())) > 4


@pytest.mark.parametrize("p", [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.6),
    SamplingParams(temperature=1.0, top_k=10, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.2),
    SamplingParams(temperature=1.0, top_n_sigma=1.0),
])
def test_distribution(ops, p):
    """Empirical frequencies over many (seed, step) draws match the renormalised softmax."""
    import cupy as cp
    rng = np.random.default_rng(2)
    V, B, rounds = 64, 256, 16
    l = (rng.standard_normal(V) * 1.5).astype(np.float32)
    s = _sampler(ops, V, B, penalties=False)
    logits = cp.asarray(np.tile(l, (B, 1)))
    counts = np.zeros(V)
    for r in range(rounds):
        toks = s.sample(logits, [p] * B, np.arange(B) + r * B)
        np.add.at(counts, toks, 1)
    lt = l / p.temperature
    keep = _kept(lt, p)
    assert counts[~keep].sum() == 0, "sampled a token outside the kept set"
    want = _softmax(np.where(keep, lt, -np.inf))
    emp = counts / counts.sum()
    assert np.abs(emp - want).max() < 0.03
    assert 0.5 * np.abs(emp - want).sum() < 0.06


def test_filters_large_vocab(ops):
    """Kept sets at the real vocab size (bf16 logits): every draw lies in the kept set."""
    rng = np.random.default_rng(3)
    V, B = 248320, 6
    host = (rng.standard_normal((B, V)) * 3).astype(np.float32)
    d = ops.asarray(host)
    host = ops.to_numpy(d).astype(np.float32)
    params = [SamplingParams(top_k=50), SamplingParams(top_p=0.9), SamplingParams(min_p=0.05),
              SamplingParams(top_k=1000, top_p=0.5), SamplingParams(top_k=3, temperature=0.5),
              SamplingParams(top_p=0.01)]
    s = _sampler(ops, V, B)
    for step in range(5):
        toks = s.sample(d, params, np.full(B, step))
        for i, p in enumerate(params):
            assert _kept(host[i] / p.temperature, p)[toks[i]], (i, p)


def test_penalties(ops):
    """The prepared logits (sampler.work) follow the documented penalty rules, and the counts
    the kernel keeps match the tokens it returned."""
    import cupy as cp
    rng = np.random.default_rng(4)
    V, B = 1000, 3
    s = _sampler(ops, V, 8)
    prompts = [[1, 2, 3], [], [5, 5]]
    slots = np.array([6, 2, 4])
    for slot, pr in zip(slots, prompts):
        s.begin(int(slot), pr)
    params = [SamplingParams(temperature=0.8, repetition_penalty=1.3, seed=1),
              SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.25, seed=2),
              SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=1.0)]
    logits = (rng.standard_normal((B, V)) * 2).astype(np.float32)
    out_counts = np.zeros((B, V))
    for step in range(20):
        toks = s.sample(cp.asarray(logits), params, np.full(B, step), slots=slots)
        work = s.work[:B].get()
        for i, p in enumerate(params):
            c = out_counts[i]
            seen = (c > 0) | np.isin(np.arange(V), prompts[i])
            l = logits[i].copy()
            if p.repetition_penalty != 1:
                l = np.where(seen, np.where(l > 0, l / p.repetition_penalty, l * p.repetition_penalty), l)
            l = l - p.frequency_penalty * c - p.presence_penalty * (c > 0)
            if p.temperature > 0:
                l = l / p.temperature
            np.testing.assert_allclose(work[i], l, rtol=1e-5, atol=1e-5)
        np.add.at(out_counts, (np.arange(B), toks), 1)
    np.testing.assert_array_equal(s.counts[slots].get(), out_counts)
    s.begin(6, [])
    assert int(s.counts[6].sum().get()) == 0


def test_logprobs(ops):
    import cupy as cp
    rng = np.random.default_rng(5)
    V, B = 32000, 4
    logits = (rng.standard_normal((B, V)) * 3).astype(np.float32)
    s = _sampler(ops, V, B)
    params = [SamplingParams(logprobs=5, seed=1), SamplingParams(logprobs=0, temperature=0),
              SamplingParams(logprobs=None, seed=3), SamplingParams(logprobs=20, top_k=10, seed=4)]
    res = s.sample(cp.asarray(logits), params, np.zeros(B), logprobs=True)
    lsm = logits - logits.max(1, keepdims=True)
    lsm = lsm - np.log(np.exp(lsm).sum(1, keepdims=True))
    for i, p in enumerate(params):
        if p.logprobs is None:
            assert np.isnan(res.logprobs[i])
            continue
        np.testing.assert_allclose(res.logprobs[i], lsm[i, res.tokens[i]], atol=1e-4)
        k = p.logprobs
        order = np.argsort(-logits[i], kind="stable")[:k]
        np.testing.assert_array_equal(res.top_ids[i, :k], order)
        np.testing.assert_allclose(res.top_logprobs[i, :k], lsm[i, order], atol=1e-4)
        assert (res.top_ids[i, k:] == -1).all()
    # without logprobs requested: a plain int32 array
    toks = s.sample(cp.asarray(logits), params, np.zeros(B))
    assert toks.dtype == np.int32 and toks.shape == (B,)
    np.testing.assert_array_equal(toks, res.tokens)


# ---- the statistics of the draw (the CPU sampler's tests, tests/test_sampling.py) ------------

from tests.sampling_stats import (  # noqa: E402
    DRAWS,
    P_VALUE_FLOOR,
    chi_square_p_value,
    exact_distribution,
    planted_logits,
    statistical_cases,
)

CASES = statistical_cases()


def _gpu_counts(ops, row: np.ndarray, p: SamplingParams, draws: int = DRAWS, B: int = 1024):
    """Token counts of >= `draws` draws of one row: B rows a call, unseeded (each row's slot
    seed), a new step per call, so every draw has its own (seed, step)."""
    import cupy as cp
    s = _sampler(ops, row.size, B, penalties=False)
    logits = cp.asarray(np.tile(row, (B, 1)))
    counts = np.zeros(row.size, dtype=np.int64)
    for r in range(-(-draws // B)):
        np.add.at(counts, s.sample(logits, [p] * B, np.full(B, r)), 1)
    return counts


@pytest.mark.parametrize("name, p", CASES, ids=[c[0] for c in CASES])
def test_draws_follow_the_exact_distribution(ops, name, p):
    """100k draws against the exact distribution of the definitions (tests/sampling_stats.py,
    the CPU sampler's order): chi-square p-value above P_VALUE_FLOOR, nothing outside the
    kept set."""
    row = planted_logits()
    probs = exact_distribution(row, p)
    counts = _gpu_counts(ops, row, p)
    assert counts[probs == 0].sum() == 0, "sampled a token outside the kept set"
    assert chi_square_p_value(counts, probs) > P_VALUE_FLOOR


def test_no_token_of_negligible_probability_is_ever_drawn(ops):
    """u = ((bits >> 8) + 0.5) / 2^24 rounded to 1.0 once in 2^24 tokens, -log(-log 1) = +inf won:
    ~0.9 % of draws at a 152k vocab were a uniformly random token."""
    row = np.full(151_936, -30.0, dtype=np.float32)
    row[0] = 0.0
    counts = _gpu_counts(ops, row, SamplingParams(temperature=1.0), B=512)
    assert counts[1:].sum() == 0, f"{counts[1:].sum()} draws picked a token of probability ~1e-13"


def test_adaptive_sampling_goes_greedy_below_the_entropy_threshold(ops):
    def two_token_row(q):
        row = np.full(64, -40.0, dtype=np.float32)
        row[0], row[1] = np.log(1 - q), np.log(q)
        return row
    adaptive = SamplingParams(temperature=1.0, min_p=1e-6, adaptive_sampling=True)
    low = _gpu_counts(ops, two_token_row(0.04), adaptive, draws=20_000)      # H = 0.168 nats
    assert low[0] == low.sum()
    plain = _gpu_counts(ops, two_token_row(0.04), SamplingParams(temperature=1.0, min_p=1e-6),
                        draws=20_000)
    assert plain[1] > 600
    high = two_token_row(0.06)                                                # H = 0.227 nats
    counts = _gpu_counts(ops, high, adaptive, draws=20_000)
    assert chi_square_p_value(counts, exact_distribution(high, adaptive)) > P_VALUE_FLOOR


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_greedy_ties_go_to_the_lowest_token_id_like_np_argmax(ops, dtype):
    """Exactly tied maximal logits, planted within a thread's stride, across warps and across
    the row: the GPU argmax is np.argmax's (the lowest id), for bf16 and fp32 logits."""
    import cupy as cp
    rng = np.random.default_rng(11)
    V, B = 248_320, 8
    host = (rng.standard_normal((B, V)) * 2).astype(np.float32)
    ties = [[7, 7 + 1024], [1023, 1024], [200_000, 3], [5, 6, 7], [V - 1, V - 2],
            [40_000, 40_001, 100], [0, V - 1], [12_345]]
    for b, ids in enumerate(ties):
        host[b, ids] = 30.0
    d = ops.asarray(host) if dtype == "bf16" else cp.asarray(host)
    seen = (ops.to_numpy(d) if dtype == "bf16" else host).astype(np.float32)
    toks = _sampler(ops, V, B).sample(d, [SamplingParams(temperature=0.0)] * B, np.zeros(B))
    np.testing.assert_array_equal(toks, np.argmax(seen, axis=1))
    np.testing.assert_array_equal(toks, [min(ids) for ids in ties])
