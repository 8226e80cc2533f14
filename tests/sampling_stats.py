"""The exact distribution a sampling row must draw from, restated from the definitions in
metrale/sampling.py's docstring (independently of the sampler's code), and a chi-square
goodness-of-fit test, shared by the CPU (tests/test_sampling.py) and GPU
(tests/test_cuda_sampling.py) statistical tests.

Order (one row, after penalties): logits / temperature, then top-n-sigma (keep l >= max - n*std,
population std of the finite logits), top-k (keep l >= the k-th largest), top-p (over the
survivors' renormalised softmax, in descending order: keep a token while the mass strictly
before it is < top_p), min-p (keep p >= min_p * p_max); the draw is the survivors' softmax.
"""
from __future__ import annotations

import numpy as np
import torch

P_VALUE_FLOOR = 1e-4
"""A sampler passes when the chi-square p-value of its draws is above this (fixed seeds make
each test deterministic; a correct sampler fails one case in 10,000 seeds)."""
DRAWS = 100_000


def kept_set(logits: np.ndarray, p) -> np.ndarray:
    """Boolean mask of the tokens `p` (a SamplingParams) keeps, from the definitions above."""
    l = logits.astype(np.float64) / p.temperature
    keep = np.isfinite(l)
    if p.top_n_sigma > 0:
        keep &= l >= l[keep].max() - p.top_n_sigma * l[keep].std()
    if 0 < p.top_k < l.size:
        keep &= l >= np.sort(l[keep])[::-1][min(p.top_k, keep.sum()) - 1]
    if p.top_p < 1.0:
        probs = _softmax(np.where(keep, l, -np.inf))
        order = np.argsort(-probs, kind="stable")
        before = np.concatenate([[0.0], np.cumsum(probs[order])[:-1]])
        nucleus = order[before < p.top_p]
        keep &= l >= l[nucleus].min()
    if p.min_p > 0:
        probs = _softmax(np.where(keep, l, -np.inf))
        keep &= probs >= p.min_p * probs.max()
    return keep


def exact_distribution(logits: np.ndarray, p) -> np.ndarray:
    """float64 probabilities of every token under `p` (0 outside the kept set)."""
    l = logits.astype(np.float64) / p.temperature
    return _softmax(np.where(kept_set(logits, p), l, -np.inf))


def _softmax(l: np.ndarray) -> np.ndarray:
    e = np.exp(l - l.max())
    return e / e.sum()


def chi_square_p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    """p-value of Pearson's chi-square test of `counts` (per token) against `probs`; tokens
    expected fewer than 5 times are pooled into one bin. Draws of a token of probability 0
    give p = 0."""
    counts = np.asarray(counts, dtype=np.float64)
    if counts[probs == 0].sum():
        return 0.0
    n = counts.sum()
    expected = n * probs
    big = expected >= 5
    obs = np.append(counts[big], counts[~big & (probs > 0)].sum())
    exp = np.append(expected[big], expected[~big & (probs > 0)].sum())
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = obs.size - 1
    if dof < 1:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def planted_logits(vocab: int = 48, seed: int = 7) -> np.ndarray:
    """A fixed float32 row with a spread of probabilities (a few likely tokens, a long tail)."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(vocab) * 1.7 + np.linspace(2.0, -2.0, vocab)).astype(np.float32)


def statistical_cases():
    """The (name, SamplingParams) cases both samplers are tested on: each truncation alone, then
    all of them together (the engine's --default-min-p 0.08 / --default-top-n-sigma 1.0 with a
    request's top-k and top-p)."""
    from metrale.sampling import SamplingParams

    return [
        ("temperature", SamplingParams(temperature=0.7)),
        ("top_k", SamplingParams(temperature=1.0, top_k=6)),
        ("top_p", SamplingParams(temperature=1.2, top_p=0.8)),
        ("min_p", SamplingParams(temperature=1.0, min_p=0.05)),
        ("top_n_sigma", SamplingParams(temperature=1.0, top_n_sigma=1.0)),
        ("combined", SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.08,
                                    top_n_sigma=1.0)),
    ]
