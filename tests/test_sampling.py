"""Sampling: parameter validation, generation defaults, and the batched CPU sampler, checked
against HF transformers' logits processors (torch, test-time only) and against exact arithmetic."""

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from metrale.config import ConfigError, EngineConfig
from metrale.sampling import (
    Sampler,
    SamplingParams,
    TokenHistory,
    apply_generation_defaults,
    engine_sampling_defaults,
    make_generator,
)

VOCAB = 512


def random_logits(seed: int, rows: int = 4, vocab: int = VOCAB, scale: float = 3.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((rows, vocab)) * scale).astype(np.float32)


def hf_processed(logits: np.ndarray, p: SamplingParams, context: list[int] | None = None):
    """HF's view of the same request: repetition penalty, then temperature, top-k, top-p, min-p
    (HF's warper order), one row at a time."""
    scores = torch.from_numpy(logits.copy()).unsqueeze(0)
    if p.repetition_penalty != 1.0:
        ids = torch.tensor([context], dtype=torch.long)
        scores = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, scores)
    warpers = [TemperatureLogitsWarper(p.temperature)]
    if p.top_k > 0:
        warpers.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1.0:
        warpers.append(TopPLogitsWarper(p.top_p))
    if p.min_p > 0:
        warpers.append(MinPLogitsWarper(p.min_p))
    for warp in warpers:
        scores = warp(None, scores)
    return scores[0].numpy()


def assert_same_distribution(ours: np.ndarray, theirs: np.ndarray) -> None:
    np.testing.assert_array_equal(np.isfinite(ours), np.isfinite(theirs))
    p = torch.softmax(torch.from_numpy(ours.astype(np.float64)), -1).numpy()
    q = torch.softmax(torch.from_numpy(theirs.astype(np.float64)), -1).numpy()
    np.testing.assert_allclose(p, q, atol=1e-6)


# ---- validation ------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value, message", [
    ("temperature", -0.1, r"temperature must be >= 0 \(0 = greedy\), got -0.1"),
    ("temperature", float("nan"), r"temperature must be >= 0"),
    ("top_p", 0.0, r"top_p must be in \(0, 1\] .*got 0.0"),
    ("top_p", 1.5, r"top_p must be in \(0, 1\]"),
    ("top_k", -2, r"top_k must be >= -1 \(0 or -1 = off\), got -2"),
    ("top_k", 2.5, r"top_k must be an integer"),
    ("min_p", 1.01, r"min_p must be in \[0, 1\]"),
    ("top_n_sigma", -1.0, r"top_n_sigma must be >= 0"),
    ("presence_penalty", 2.5, r"presence_penalty must be in \[-2, 2\], got 2.5"),
    ("frequency_penalty", -2.01, r"frequency_penalty must be in \[-2, 2\]"),
    ("repetition_penalty", 0.0, r"repetition_penalty must be > 0"),
    ("n", 0, r"n must be >= 1, got 0"),
    ("max_tokens", 0, r"max_tokens must be >= 1, got 0"),
    ("logprobs", 21, r"logprobs must be in \[0, 20\] \(or null = off\), got 21"),
    ("logprobs", -1, r"logprobs must be in \[0, 20\]"),
    ("seed", "7", r"seed must be an integer in \[0, 2\^64\) or null"),
    ("seed", -1, r"seed must be an integer in \[0, 2\^64\) or null, got -1"),
    ("seed", 2**64, r"seed must be an integer in \[0, 2\^64\)"),
    ("adaptive_sampling", "yes", r"adaptive_sampling must be true or false"),
    ("max_tokens", True, r"max_tokens must be an integer"),
])
def test_validate_names_the_field_and_its_range(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value}).validate()


def test_validate_accepts_the_edges_and_normalises_top_k_minus_one():
    edge = SamplingParams(temperature=0, top_p=1.0, top_k=-1, min_p=1.0, presence_penalty=-2,
                          frequency_penalty=2, repetition_penalty=1e-3, n=1, max_tokens=1,
                          logprobs=20, seed=3, top_n_sigma=0.0)
    assert edge.validate() is edge
    assert edge.top_k == 0
    assert SamplingParams(logprobs=0).validate().logprobs == 0
    assert SamplingParams(logprobs=None).validate().logprobs is None


def test_validate_rejects_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match=r"min_tokens must be <= max_tokens \(4\), got 5"):
        SamplingParams(max_tokens=4, min_tokens=5).validate()


# ---- generation defaults ---------------------------------------------------------------------

GEN_CONFIG = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0,
              "repetition_penalty": 1.05, "do_sample": True, "eos_token_id": [1, 2],
              "max_new_tokens": 99}


def test_generation_config_fills_only_unset_fields():
    p = apply_generation_defaults({"temperature": 0.0, "top_p": None, "max_tokens": 17}, GEN_CONFIG)
    assert p.temperature == 0.0            # explicit 0 is set: the request wins
    assert p.top_p == 0.95                 # None = unset: generation_config fills it
    assert p.top_k == 20 and p.repetition_penalty == 1.05   # absent = unset
    assert p.max_tokens == 17              # not a generation_config field


def test_generation_config_ignores_keys_outside_the_sampling_five():
    p = apply_generation_defaults({}, GEN_CONFIG)
    assert p.max_tokens == SamplingParams().max_tokens
    assert p.stop_token_ids == []


def test_engine_defaults_are_the_operator_references():
    engine = engine_sampling_defaults(EngineConfig())
    assert engine == {"min_p": 0.08, "top_n_sigma": 1.0, "adaptive_sampling": False}
    assert apply_generation_defaults({}, {}, engine_sampling_defaults(
        EngineConfig(adaptive_sampling=True))).adaptive_sampling is True


@pytest.mark.parametrize("field, value, message", [
    ("default_min_p", 1.5, r"--default-min-p must be in \[0, 1\]"),
    ("default_top_n_sigma", -0.5, r"--default-top-n-sigma must be >= 0"),
    ("seed", -3, r"--seed must be an integer in \[0, 2\^63\), got -3"),
])
def test_engine_config_rejects_sampling_settings_out_of_range(field, value, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**{field: value}).validate()


def test_precedence_request_then_model_then_engine_then_dataclass():
    engine = engine_sampling_defaults(EngineConfig(default_min_p=0.08, default_top_n_sigma=1.0))
    assert apply_generation_defaults({}, {}, engine).min_p == 0.08
    assert apply_generation_defaults({}, {"min_p": 0.02}, engine).min_p == 0.02
    assert apply_generation_defaults({"min_p": 0.0}, {"min_p": 0.02}, engine).min_p == 0.0
    assert apply_generation_defaults({}, None, engine).top_n_sigma == 1.0
    assert apply_generation_defaults({}, None, None) == SamplingParams()


def test_generation_defaults_validate_the_result():
    assert apply_generation_defaults({}, {"top_k": -1}).top_k == 0
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        apply_generation_defaults({}, {"top_p": 0.0})
    with pytest.raises(ValueError, match=r"unknown sampling parameter\(s\) \['temprature'\]"):
        apply_generation_defaults({"temprature": 0.5}, {})


# ---- truncation against HF -------------------------------------------------------------------

HF_CASES = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=10),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=0.5, min_p=0.05),
    SamplingParams(temperature=0.9, top_k=40, top_p=0.7, min_p=0.1),
    SamplingParams(temperature=2.0, top_k=300, top_p=0.95),
    SamplingParams(temperature=1.0, top_p=0.3, repetition_penalty=1.3),
]


@pytest.mark.parametrize("case", range(len(HF_CASES)))
def test_processed_distribution_matches_hf_warpers(case):
    p = HF_CASES[case]
    logits = random_logits(100 + case, rows=6)
    rng = np.random.default_rng(case)
    contexts = [rng.integers(0, VOCAB, 30).tolist() for _ in logits]
    histories = [TokenHistory(c[:20], c[20:]) for c in contexts]
    ours = Sampler().processed_logits(logits, [p] * len(logits), histories)
    for row, context, mine in zip(logits, contexts, ours):
        assert_same_distribution(mine, hf_processed(row, p, context))


def test_top_p_matches_hf_on_a_full_size_vocab_where_the_nucleus_spills_past_the_head():
    logits = random_logits(7, rows=3, vocab=151_936, scale=1.0)
    cases = [SamplingParams(top_p=0.9), SamplingParams(top_p=0.01), SamplingParams(top_p=0.999)]
    ours = Sampler().processed_logits(logits, cases)
    for row, p, mine in zip(logits, cases, ours):
        assert_same_distribution(mine, hf_processed(row, p))
    assert np.isfinite(ours[0]).sum() > 1024   # the nucleus was wider than the sorted head


def test_rows_with_different_params_are_processed_independently():
    logits = random_logits(8, rows=len(HF_CASES))
    together = Sampler().processed_logits(logits, HF_CASES, [TokenHistory([1, 2], [3])] * 7)
    for b, p in enumerate(HF_CASES):
        alone = Sampler().processed_logits(logits[b:b + 1], [p], [TokenHistory([1, 2], [3])])
        np.testing.assert_array_equal(together[b], alone[0])


def test_top_k_keeps_ties_at_the_kth_value_like_hf():
    row = np.array([[5, 3, 3, 3, 1, 0]], dtype=np.float32)
    p = SamplingParams(top_k=2)
    ours = Sampler().processed_logits(row, [p])[0]
    assert_same_distribution(ours, hf_processed(row[0], p))
    assert np.isfinite(ours).sum() == 4


def test_top_n_sigma_keeps_exactly_logits_within_n_std_of_the_max():
    logits = random_logits(9, rows=5)
    for n in (0.5, 1.0, 2.5):
        p = SamplingParams(temperature=1.0, top_n_sigma=n)
        ours = Sampler().processed_logits(logits, [p] * 5)
        keep = logits >= logits.max(axis=1, keepdims=True) - n * logits.std(axis=1, keepdims=True)
        np.testing.assert_array_equal(np.isfinite(ours), keep)
        np.testing.assert_array_equal(ours[keep], logits[keep])


def test_top_n_sigma_set_does_not_depend_on_temperature():
    logits = random_logits(10, rows=3)
    cold = Sampler().processed_logits(logits, [SamplingParams(temperature=0.3, top_n_sigma=1.0)] * 3)
    hot = Sampler().processed_logits(logits, [SamplingParams(temperature=3.0, top_n_sigma=1.0)] * 3)
    np.testing.assert_array_equal(np.isfinite(cold), np.isfinite(hot))


# ---- penalties -------------------------------------------------------------------------------

def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    row = np.array([[2.0, -2.0, 4.0, -1.0, 0.5]], dtype=np.float32)
    p = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    out = Sampler().processed_logits(row, [p], [TokenHistory(prompt_ids=[0, 1], output_ids=[1, 3])])
    np.testing.assert_allclose(out[0], [1.0, -4.0, 4.0, -2.0, 0.5])


def test_presence_and_frequency_penalties_count_output_tokens_only():
    row = np.zeros((1, 6), dtype=np.float32)
    p = SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25)
    history = TokenHistory(prompt_ids=[4, 4, 5], output_ids=[1, 2, 2, 2, 5])
    out = Sampler().processed_logits(row, [p], [history])
    # logit -= presence * (count > 0) + frequency * count, counts over the output only
    np.testing.assert_allclose(out[0], [0, -0.75, -1.25, 0, 0, -0.75])
    as_pair = Sampler().processed_logits(row, [p], [([4, 4, 5], [1, 2, 2, 2, 5])])
    np.testing.assert_array_equal(as_pair, out)


def test_penalties_need_a_history():
    with pytest.raises(ValueError, match="row 0 uses repetition_penalty but its TokenHistory"):
        Sampler().sample(random_logits(0, rows=1), [SamplingParams(repetition_penalty=1.2)],
                         [make_generator(0, 0)])


def test_min_tokens_forbids_eos_and_stop_tokens_until_reached():
    logits = np.zeros((2, 8), dtype=np.float32)
    logits[:, 7] = 10.0                                    # EOS would win
    p = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[6])
    sampler = Sampler(eos_token_ids=[7])
    short, done = TokenHistory([], [1, 2]), TokenHistory([], [1, 2, 3])
    out = sampler.processed_logits(logits, [p, p], [short, done])
    assert np.isneginf(out[0, [6, 7]]).all() and np.isfinite(out[1]).all()
    result = sampler.sample(logits, [p, p], [None, None], [short, done])
    assert result.token_ids[0] != 7 and result.token_ids[1] == 7


# ---- drawing ---------------------------------------------------------------------------------

def test_greedy_picks_the_argmax_after_penalties():
    logits = random_logits(11, rows=8)
    greedy = Sampler().sample(logits, [SamplingParams(temperature=0)] * 8, [None] * 8)
    np.testing.assert_array_equal(greedy.token_ids, logits.argmax(axis=1))
    top = int(logits[0].argmax())
    penalised = Sampler().sample(logits[:1], [SamplingParams(temperature=0, presence_penalty=2.0,
                                                             frequency_penalty=2.0)],
                                 [None], [TokenHistory([], [top] * 50)])
    assert penalised.token_ids[0] != top


def draw_sequence(logits_row, p: SamplingParams, steps: int, batch_with: int = 0, at: int = 0):
    """Tokens drawn for one seeded request over `steps` steps, sitting at row `at` of a batch
    padded with `batch_with` other unseeded requests."""
    sampler, mine = Sampler(), make_generator(p.seed, fallback_seed=0)
    others = [make_generator(None, fallback_seed=1000 + i) for i in range(batch_with)]
    tokens = []
    for _ in range(steps):
        gens = others[:at] + [mine] + others[at:]
        batch = np.repeat(logits_row[None], len(gens), axis=0)
        tokens.append(int(sampler.sample(batch, [p] * len(gens), gens).token_ids[at]))
    return tokens


def test_same_seed_draws_the_same_tokens_whatever_the_batch():
    row = random_logits(12, rows=1, scale=1.0)[0]
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)
    alone = draw_sequence(row, p, steps=20)
    assert draw_sequence(row, p, steps=20, batch_with=5, at=3) == alone
    assert draw_sequence(row, p, steps=20, batch_with=2, at=0) == alone


def test_different_seeds_draw_different_tokens():
    row = random_logits(13, rows=1, scale=1.0)[0]
    a = draw_sequence(row, SamplingParams(seed=1), steps=20)
    b = draw_sequence(row, SamplingParams(seed=2), steps=20)
    assert a != b


def test_make_generator_uses_the_fallback_only_without_a_seed():
    draw = lambda g: g.integers(0, 1 << 30, 4).tolist()  # noqa: E731
    assert draw(make_generator(5, fallback_seed=1)) == draw(make_generator(5, fallback_seed=2))
    assert draw(make_generator(None, 1)) == draw(make_generator(None, 1))
    assert draw(make_generator(None, 1)) != draw(make_generator(None, 2))


# chi-square critical value for 7 degrees of freedom at p = 1e-4
CHI2_7DF_1E4 = 29.88


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = counts.sum() * probs
    return float(((counts - expected) ** 2 / expected).sum())


def test_sampling_frequencies_match_softmax_of_logits_over_temperature():
    logits = np.array([1.0, 0.5, 0.0, -0.5, 2.0, 1.5, -1.0, 0.2], dtype=np.float32)
    temperature, draws = 0.7, 40_000
    gen = make_generator(2024, 0)
    batch = np.repeat(logits[None], draws, axis=0)
    tokens = Sampler().sample(batch, [SamplingParams(temperature=temperature)] * draws,
                              [gen] * draws).token_ids
    counts = np.bincount(tokens, minlength=8)
    expected = torch.softmax(torch.tensor(logits, dtype=torch.float64) / temperature, -1).numpy()
    assert chi_square(counts, expected) < CHI2_7DF_1E4
    untempered = torch.softmax(torch.tensor(logits, dtype=torch.float64), -1).numpy()
    assert chi_square(counts, untempered) > CHI2_7DF_1E4   # the test can tell T apart


def test_sampled_tokens_stay_inside_the_truncated_set():
    logits = random_logits(14, rows=64, scale=1.0)
    params = [SamplingParams(temperature=1.5, top_k=5, top_p=0.9, seed=i) for i in range(64)]
    result = Sampler().sample(logits, params, [make_generator(p.seed, 0) for p in params])
    kept = np.isfinite(Sampler().processed_logits(logits, params))
    assert kept[np.arange(64), result.token_ids].all()


# ---- logprobs --------------------------------------------------------------------------------

def test_logprobs_are_log_softmax_of_penalised_logits_before_temperature():
    logits = random_logits(15, rows=3, vocab=16)
    history = TokenHistory([0, 1], [2, 2])
    params = [SamplingParams(temperature=t, top_k=3, repetition_penalty=1.5,
                             frequency_penalty=0.5, logprobs=16, seed=1) for t in (0.0, 0.4, 3.0)]
    result = Sampler().sample(logits, params, [make_generator(1, 0)] * 3, [history] * 3)
    for b, lp in enumerate(result.logprobs):
        scores = torch.from_numpy(logits[b:b + 1].copy())
        scores = RepetitionPenaltyLogitsProcessor(1.5)(torch.tensor([[0, 1, 2, 2]]), scores)
        scores[0, 2] -= 2 * 0.5
        oracle = torch.log_softmax(scores.double(), -1)[0].numpy()
        assert lp.token_id == result.token_ids[b]
        np.testing.assert_allclose(lp.logprob, oracle[lp.token_id], atol=1e-5)
        np.testing.assert_allclose(np.exp(lp.top_logprobs).sum(), 1.0, atol=1e-5)
        np.testing.assert_allclose(lp.top_logprobs, np.sort(oracle)[::-1], atol=1e-5)
        assert lp.rank == 1 + int((oracle > oracle[lp.token_id]).sum())


def test_raw_logprobs_mode_ignores_penalties():
    logits = random_logits(16, rows=1, vocab=16)
    p = SamplingParams(temperature=0, repetition_penalty=3.0, logprobs=0)
    lp = Sampler(logprobs_mode="raw").sample(logits, [p], [None], [TokenHistory([0], [])])
    oracle = torch.log_softmax(torch.from_numpy(logits).double(), -1)[0].numpy()
    np.testing.assert_allclose(lp.logprobs[0].logprob, oracle[lp.token_ids[0]], atol=1e-5)


def test_top_logprobs_are_in_descending_order_and_only_where_asked():
    logits = random_logits(17, rows=3, vocab=151_936)
    params = [SamplingParams(logprobs=5, seed=0), SamplingParams(), SamplingParams(logprobs=0,
                                                                                  temperature=0)]
    gens = [make_generator(0, 0), make_generator(1, 0), None]
    result = Sampler().sample(logits, params, gens)
    first, none, zero = result.logprobs
    assert none is None and zero.top == [] and zero.rank == 1
    assert len(first.top) == 5 and (np.diff(first.top_logprobs) <= 0).all()
    np.testing.assert_array_equal(first.top_token_ids, np.argsort(-logits[0])[:5])


def test_sample_reports_batch_mistakes():
    logits = random_logits(18, rows=2)
    with pytest.raises(ValueError, match="params has 1 entries for 2 logits rows"):
        Sampler().sample(logits, [SamplingParams(temperature=0)], [None, None])
    with pytest.raises(ValueError, match="row 1 samples .* but has no generator"):
        Sampler().sample(logits, [SamplingParams(temperature=0), SamplingParams()], [None, None])
    logits[1, 3] = np.nan
    with pytest.raises(ValueError, match=r"logits rows \[1\] contain NaN"):
        Sampler().sample(logits, [SamplingParams(temperature=0)] * 2, [None, None])


def test_vanishing_temperature_is_greedy_not_nan():
    """A positive temperature too small to divide by (found by the API fuzzer: 1.6e-166 turned
    every logit into inf and the sampler's error took the engine down) samples greedily."""
    from metrale.sampling import Sampler, SamplingParams, make_generator

    logits = np.random.default_rng(3).standard_normal((2, 320)).astype(np.float32)
    tiny = SamplingParams(temperature=1.5804286388211614e-166, top_p=0.9, top_k=8385).validate()
    assert tiny.temperature == 0.0
    out = Sampler().sample(logits, [tiny, SamplingParams(top_p=5e-324).validate()],
                           [make_generator(1, 1), make_generator(2, 2)], [([1], []), ([1], [])])
    assert out.token_ids[0] == logits[0].argmax()
    assert out.token_ids[1] == logits[1].argmax()   # the smallest nucleus keeps the top token


# ---- statistics of the draw ------------------------------------------------------------------

from tests.sampling_stats import (  # noqa: E402
    DRAWS,
    P_VALUE_FLOOR,
    chi_square_p_value,
    exact_distribution,
    kept_set,
    planted_logits,
    statistical_cases,
)

CASES = statistical_cases()


def draw_counts(row: np.ndarray, p: SamplingParams, draws: int = DRAWS, seed: int = 2024,
                chunk: int = DRAWS) -> np.ndarray:
    """Token counts of `draws` draws from one logits row: rows of one batch sharing a
    generator (fixed seed), `chunk` rows per sample call."""
    gen, counts = make_generator(seed, 0), np.zeros(row.size, dtype=np.int64)
    for start in range(0, draws, chunk):
        n = min(chunk, draws - start)
        tokens = Sampler().sample(np.repeat(row[None], n, axis=0), [p] * n, [gen] * n).token_ids
        counts += np.bincount(tokens, minlength=row.size)
    return counts


@pytest.mark.parametrize("name, p", CASES, ids=[c[0] for c in CASES])
def test_draws_follow_the_exact_distribution(name, p):
    """100k draws against the softmax of the processed logits computed from the definitions
    (tests/sampling_stats.py): chi-square p-value above P_VALUE_FLOOR, nothing outside the
    kept set."""
    row = planted_logits()
    probs = exact_distribution(row, p)
    kept = np.isfinite(Sampler().processed_logits(row[None], [p])[0])
    np.testing.assert_array_equal(kept, kept_set(row, p))
    if name != "temperature":
        assert 1 < kept.sum() < row.size, "the case must cut, or it tests nothing"
    counts = draw_counts(row, p)
    assert counts[~kept].sum() == 0
    assert chi_square_p_value(counts, probs) > P_VALUE_FLOOR


def test_the_chi_square_check_tells_a_wrong_distribution_apart():
    row = planted_logits()
    counts = draw_counts(row, SamplingParams(temperature=0.7))
    assert chi_square_p_value(counts, exact_distribution(row, SamplingParams(temperature=0.75))) \
        < P_VALUE_FLOOR


def test_no_token_of_negligible_probability_is_ever_drawn():
    """The draw's exponential noise was float32 and could be exactly 0; -log(0) = +inf then
    picked a uniformly random surviving token (measured: ~0.6 % of draws at a 152k vocab).
    Here 511 tokens have probability ~1e-13 each: 100k draws must all pick token 0."""
    row = np.full(512, -30.0, dtype=np.float32)
    row[0] = 0.0
    counts = draw_counts(row, SamplingParams(temperature=1.0), chunk=10_000)
    assert exact_distribution(row, SamplingParams())[1:].max() < 1e-9
    assert counts[0] == DRAWS, f"{DRAWS - counts[0]} draws picked a token of probability ~1e-13"


# ---- adaptive sampling -----------------------------------------------------------------------

def two_token_row(q: float, vocab: int = 64) -> np.ndarray:
    """Token 0 with probability 1 - q, token 1 with q, the rest ~1e-13 (pruned by min_p)."""
    row = np.full(vocab, -40.0, dtype=np.float32)
    row[0], row[1] = np.log(1 - q), np.log(q)
    return row


def test_adaptive_sampling_goes_greedy_below_the_entropy_threshold():
    from metrale.sampling import ADAPTIVE_ENTROPY_NATS, entropy_nats

    low, high = two_token_row(0.04), two_token_row(0.06)   # H = 0.168 and 0.227 nats
    assert entropy_nats(low[None])[0] < ADAPTIVE_ENTROPY_NATS < entropy_nats(high[None])[0]
    adaptive = SamplingParams(temperature=1.0, min_p=1e-6, adaptive_sampling=True)
    assert draw_counts(low, adaptive, draws=20_000)[0] == 20_000
    assert draw_counts(low, SamplingParams(temperature=1.0, min_p=1e-6), draws=20_000)[1] > 600
    counts = draw_counts(high, adaptive, draws=20_000)
    assert chi_square_p_value(counts, exact_distribution(high, adaptive)) > P_VALUE_FLOOR


def test_adaptive_gate_reads_the_processed_distribution():
    """A flat row is above the threshold untruncated, but top_k=1 (or a cold temperature) makes
    it peaked: the gate looks after temperature and truncation."""
    row = planted_logits()
    gated = SamplingParams(temperature=1.0, adaptive_sampling=True)
    assert (draw_counts(row, gated, draws=5000) > 0).sum() > 5
    cold = SamplingParams(temperature=0.05, adaptive_sampling=True)
    assert draw_counts(row, cold, draws=5000)[int(row.argmax())] == 5000


# ---- greedy ties, input dtypes, seeds --------------------------------------------------------

def test_greedy_ties_go_to_the_lowest_token_id():
    logits = random_logits(19, rows=6)
    for b, ids in enumerate([[3, 9], [0, 511], [100, 101, 400], [7, 8], [250, 5], [42]]):
        logits[b, ids] = 20.0
    out = Sampler().sample(logits, [SamplingParams(temperature=0)] * 6, [None] * 6).token_ids
    np.testing.assert_array_equal(out, [3, 0, 100, 7, 5, 42])
    np.testing.assert_array_equal(out, np.argmax(logits, axis=1))


def test_bf16_and_fp32_logits_sample_alike():
    import ml_dtypes

    bf16 = random_logits(20, rows=8).astype(ml_dtypes.bfloat16)
    fp32 = bf16.astype(np.float32)
    params = [SamplingParams(temperature=0)] * 4 + [SamplingParams(top_p=0.9, seed=i)
                                                    for i in range(4)]

    def run(x):
        return Sampler().sample(x, params, [make_generator(p.seed, 0) for p in params]).token_ids
    np.testing.assert_array_equal(run(bf16), run(fp32))


def test_make_generator_refuses_a_seed_out_of_range():
    for bad in (-1, 2**64, "3"):
        with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\^64\)"):
            make_generator(bad, 0)
    assert make_generator(2**64 - 1, 0).integers(0, 10) >= 0


def test_engine_seed_is_the_flag_or_fresh_randomness():
    from metrale.sampling import pick_engine_seed

    assert pick_engine_seed(7) == 7
    assert len({pick_engine_seed(None) for _ in range(4)}) == 4
