"""Sampling parameters and the CPU samplers.

`SamplingParams` is the one description of how a request picks tokens; it crosses the wire
(frontend -> engine) as a plain dict (`to_dict` / `from_dict`). The frontend builds it with
`apply_generation_defaults` (request > model generation_config.json > engine defaults) and checks
it with `validate()`; the engine hands each step's logits to `Sampler.sample`.

Processing order inside `Sampler` (one row = one sequence); penalties come first and greedy
rows leave before temperature, as in vLLM's sampler:

    1. penalties         repetition (prompt + output), then presence / frequency (output only);
                         then the grammar mask of a constrained row (metrale.grammar): -inf
                         where the grammar forbids the token
    2. logprobs          log_softmax of the penalised logits (see "Logprobs" below)
    3. min-tokens        stop/EOS tokens -> -inf while the output is shorter than min_tokens
                         (vLLM masks before the penalties; the two commute)
    4. greedy rows       temperature == 0: argmax, done
    5. temperature       logits / T
    6. top-n-sigma       keep logit >= max - n * std (std over the finite logits of the row)
    7. top-k             keep the k largest (ties at the k-th value are kept, as in HF)
    8. top-p             keep the smallest prefix of the descending order with mass >= top_p
    9. min-p             keep prob >= min_p * max prob
   10. adaptive gate     with adaptive_sampling (--adaptive-sampling): argmax when the entropy
                         of the processed distribution is below ADAPTIVE_ENTROPY_NATS
   11. sample            Gumbel-max with the request's own np.random.Generator

Steps 6-9 are HF's warper order (temperature, top-k, top-p, min-p); vLLM applies min-p before
top-k/top-p, which gives a different set only when both min-p and top-p cut. Greedy ties
(exactly equal maximal logits) go to the lowest token id, on the CPU and on the GPU.

The draw: argmax(logit - log E) with E ~ Exponential(1) in float64, redrawn where a draw is
exactly 0 (its -log would be +inf and pick a uniformly random token), so a token of
probability p is drawn with probability p down to ~1e-16.

Adaptive sampling (--adaptive-sampling, the `adaptive_sampling` field): a sampled row whose
processed distribution (after temperature and truncation) has entropy H < 0.2 nats takes its
argmax instead of a draw. The rule bounds what the shortcut changes: for a top probability
above 1/2, H >= h(1 - p_top) (h the binary entropy), and h(0.05) = 0.199 nats, so the row goes
greedy only when the tokens it never draws held less than ~5 % of the mass.

Seeds: a request's `seed` (an integer in [0, 2^64)) seeds its own generator, so it draws the
same tokens whatever shares its batch. An unseeded request's generator is seeded from
(engine seed, admission counter): the engine seed is --seed N, or `pick_engine_seed()` draws one
from the OS at engine start, so a restart does not repeat the "random" text while --seed N makes
a whole run reproducible.

Logprobs: by default ("penalized") they are log_softmax of the logits after penalties and before
temperature and truncation, so they describe the model (plus the request's penalties), not the
truncated distribution the token was drawn from. `Sampler(logprobs_mode="raw")` uses the logits
before penalties too, which is what vLLM v1's default `raw_logprobs` returns.
"""
from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import NamedTuple

import numpy as np

from metrale.config import EngineConfig
from metrale.grammar import apply_token_bitmask


GREEDY_TEMPERATURE = 1e-5   # temperatures below this sample greedily
ADAPTIVE_ENTROPY_NATS = 0.2
"""--adaptive-sampling: rows whose processed distribution has entropy below this take the argmax
(see the module docstring: the skipped tokens held < ~5 % of the mass)."""
SEED_LIMIT = 2 ** 64
"""Request seeds are integers in [0, SEED_LIMIT): what the GPU sampler's Philox key holds."""


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0          # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                    # 0 = off
    min_p: float = 0.0
    top_n_sigma: float = 0.0          # 0 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    n: int = 1
    logprobs: int | None = None       # None = off; k >= 0 = chosen token's logprob + top-k
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    # thinking budget (metrale.thinking_budget): after `thinking_budget` tokens in the think block
    # the engine emits `forced_close_ids` instead of sampling. None = no budget.
    thinking_budget: int | None = None
    think_start_id: int | None = None
    think_end_id: int | None = None
    forced_close_ids: list[int] = field(default_factory=list)
    starts_in_thinking: bool = False  # the prompt already opened the think block
    adaptive_sampling: bool = False   # entropy-gated greedy (--adaptive-sampling; module doc)
    grammar: str | None = None        # structured output: an llguidance grammar (metrale.grammar)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def validate(self) -> "SamplingParams":
        """Check every field against its accepted range; raise ValueError naming the field, the
        range and the value. Normalises top_k == -1 (the vLLM spelling of "off") to 0, and a
        temperature below GREEDY_TEMPERATURE to 0 (greedy): dividing logits by it would
        overflow to inf/NaN (as vLLM does). Returns self, so `SamplingParams(**d).validate()`
        chains."""
        for name, rule in INT_RULES.items():
            _check(name, getattr(self, name), rule, integer=True)
        for name, rule in FLOAT_RULES.items():
            _check(name, getattr(self, name), rule, integer=False)
        if self.top_k == -1:
            self.top_k = 0
        if self.temperature < GREEDY_TEMPERATURE:
            self.temperature = 0.0
        self._validate_optional_fields()
        return self

    def _validate_optional_fields(self) -> None:
        if self.logprobs is not None:
            _check("logprobs", self.logprobs, _LOGPROBS_RULE, integer=True)
        if self.seed is not None and not (_is_int(self.seed) and 0 <= self.seed < SEED_LIMIT):
            raise ValueError(f"seed must be an integer in [0, 2^64) or null, got {self.seed!r}")
        if not isinstance(self.adaptive_sampling, (bool, np.bool_)):
            raise ValueError(f"adaptive_sampling must be true or false, got "
                             f"{self.adaptive_sampling!r}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), "
                             f"got {self.min_tokens}")
        bad = [t for t in self.stop_token_ids if not _is_int(t) or t < 0]
        if bad:
            raise ValueError(f"stop_token_ids must be non-negative integers, got {bad!r}")
        if self.thinking_budget is not None:
            if not _is_int(self.thinking_budget) or self.thinking_budget < 0:
                raise ValueError(f"thinking_budget must be an integer >= 0, got "
                                 f"{self.thinking_budget!r}")
            if self.think_end_id is None or not self.forced_close_ids:
                raise ValueError("thinking_budget needs think_end_id and forced_close_ids")


@dataclass(frozen=True)
class _Rule:
    """An accepted range: `low` / `high` bounds (None = unbounded), each open or closed."""
    low: float | None
    high: float | None
    low_open: bool = False
    high_open: bool = False
    note: str = ""

    def accepts(self, v: float) -> bool:
        # written so that NaN fails every comparison and is rejected
        above = self.low is None or (v > self.low if self.low_open else v >= self.low)
        below = self.high is None or (v < self.high if self.high_open else v <= self.high)
        return bool(above and below)

    def describe(self) -> str:
        if self.high is None:
            text = f"{'>' if self.low_open else '>='} {self.low:g}"
        else:
            text = (f"in {'(' if self.low_open else '['}{self.low:g}, "
                    f"{self.high:g}{')' if self.high_open else ']'}")
        return f"{text} ({self.note})" if self.note else text


INT_RULES = {
    "max_tokens": _Rule(1, None),
    "n": _Rule(1, None),
    "top_k": _Rule(-1, None, note="0 or -1 = off"),
    "min_tokens": _Rule(0, None),
}
FLOAT_RULES = {
    "temperature": _Rule(0, None, note="0 = greedy"),
    "top_p": _Rule(0, 1, low_open=True, note="1 = off"),
    "min_p": _Rule(0, 1, note="0 = off"),
    "top_n_sigma": _Rule(0, None, note="0 = off"),
    "presence_penalty": _Rule(-2, 2),
    "frequency_penalty": _Rule(-2, 2),
    "repetition_penalty": _Rule(0, None, low_open=True, note="1 = off"),
}
_LOGPROBS_RULE = _Rule(0, 20, note="or null = off")


def _is_int(v: object) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _check(name: str, value: object, rule: _Rule, integer: bool) -> None:
    """Raise ValueError unless `value` is a number of the right kind inside `rule`."""
    kind_ok = _is_int(value) if integer else (
        isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool))
    if not kind_ok:
        kind = "an integer" if integer else "a number"
        raise ValueError(f"{name} must be {kind} {rule.describe()}, got {value!r}")
    if not rule.accepts(value):
        raise ValueError(f"{name} must be {rule.describe()}, got {value!r}")


# ---------------------------------------------------------------------------------------------
# Defaults: request > model generation_config.json > engine defaults > SamplingParams defaults

GENERATION_CONFIG_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
"""The generation_config.json keys that supply defaults (the ones vLLM reads, bar max_new_tokens)."""


def engine_sampling_defaults(engine_config: EngineConfig) -> dict:
    """The sampling defaults an `EngineConfig` carries (--default-min-p, --default-top-n-sigma,
    --adaptive-sampling), keyed by `SamplingParams` field name, ready for
    `apply_generation_defaults`."""
    return {
        "min_p": engine_config.default_min_p,
        "top_n_sigma": engine_config.default_top_n_sigma,
        "adaptive_sampling": engine_config.adaptive_sampling,
    }


def apply_generation_defaults(
    request: Mapping[str, object],
    generation_config: Mapping[str, object] | None = None,
    engine_defaults: Mapping[str, object] | None = None,
) -> SamplingParams:
    """Build validated `SamplingParams` from a request's sampling fields.

    A field is *unset* in a source when that source lacks the key or maps it to None (JSON null);
    an explicit value, including 0 or 1.0, is set and wins. For each field the first source that
    sets it wins: `request`, then the model's generation_config.json (only the keys in
    `GENERATION_CONFIG_FIELDS`; other keys such as do_sample or eos_token_id are ignored, as vLLM
    does), then `engine_defaults` (see `engine_sampling_defaults`), then the dataclass default.
    `logprobs` and `seed` keep None as their meaning ("off" / "unseeded").

    Raises ValueError for a request key that is not a `SamplingParams` field, or for a resulting
    value out of range (the message names the field)."""
    names = {f.name for f in fields(SamplingParams)}
    unknown = sorted(set(request) - names)
    if unknown:
        raise ValueError(f"unknown sampling parameter(s) {unknown}; accepted: {sorted(names)}")
    merged: dict[str, object] = {}
    gen = {k: v for k, v in (generation_config or {}).items() if k in GENERATION_CONFIG_FIELDS}
    for source in (engine_defaults or {}, gen, request):
        merged.update({k: v for k, v in source.items() if v is not None and k in names})
    return SamplingParams(**merged).validate()


def pick_engine_seed(configured: int | None) -> int:
    """The engine seed: --seed N when given, else 63 random bits from the OS (picked once, at
    engine start)."""
    if configured is not None:
        return int(configured)
    return secrets.randbits(63)


def make_generator(seed: int | None, fallback_seed: int | Sequence[int]) -> np.random.Generator:
    """The request's own random stream: seeded from `seed` when the request gave one (so the same
    seed draws the same tokens whatever else is in the batch), else from `fallback_seed` (the
    engine uses (engine seed, admission counter)). Create it once per request, at admission
    (a seed out of range raises ValueError there, not inside a step), and reuse it every step."""
    if seed is not None and not (_is_int(seed) and 0 <= seed < SEED_LIMIT):
        raise ValueError(f"seed must be an integer in [0, 2^64) or null, got {seed!r}")
    return np.random.default_rng(seed if seed is not None else fallback_seed)


# ---------------------------------------------------------------------------------------------
# The sampler


class TokenHistory(NamedTuple):
    """Token ids a row's penalties look at: the prompt and the output generated so far. A plain
    `(prompt_ids, output_ids)` pair is accepted wherever a TokenHistory is."""
    prompt_ids: Sequence[int] | np.ndarray = ()
    output_ids: Sequence[int] | np.ndarray = ()


class TokenLogprobs(NamedTuple):
    """Logprobs of one sampled token: its own logprob, the row's top-k as (token_id, logprob)
    pairs in descending order (ties by lower id), the token, and its 1-based rank in the row."""
    logprob: float
    top: list[tuple[int, float]]
    token_id: int
    rank: int

    @property
    def top_token_ids(self) -> np.ndarray:
        return np.array([t for t, _ in self.top], dtype=np.int64)

    @property
    def top_logprobs(self) -> np.ndarray:
        return np.array([lp for _, lp in self.top], dtype=np.float32)


@dataclass
class SampleResult:
    """One step's picks: `token_ids[b]` for row b, and `logprobs[b]` (None where not asked)."""
    token_ids: np.ndarray
    logprobs: list[TokenLogprobs | None]


class Sampler:
    """Batched CPU sampler over logits [B, V] (see the module docstring for the order of steps).

    Vectorised over the rows that share a step; only the noise of the final Gumbel draw is made
    row by row, since each row draws from its own generator (for surviving tokens only). Top-k is an
    O(V) partition; top-p sorts only the survivors of the earlier steps, and of those only the
    1024 largest unless the nucleus is wider. At B=128, V=152k one step takes ~0.1 s greedy and
    ~0.5 s sampled on one core, dominated by the Gumbel noise over untruncated rows."""

    def __init__(self, eos_token_ids: Sequence[int] = (), logprobs_mode: str = "penalized"):
        if logprobs_mode not in ("penalized", "raw"):
            raise ValueError(f"logprobs_mode must be 'penalized' or 'raw', got {logprobs_mode!r}")
        self.eos_token_ids = np.asarray(list(eos_token_ids), dtype=np.int64)
        self.logprobs_mode = logprobs_mode

    def sample(
        self,
        logits: np.ndarray,
        params: Sequence[SamplingParams],
        generators: Sequence[np.random.Generator | None],
        histories: Sequence[TokenHistory | None] | None = None,
        grammar_masks: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> SampleResult:
        """Pick one token per row of logits [B, V]. `generators[b]` may be None only for greedy
        rows; `histories[b]` may be None (or `histories` None) only for rows without penalties
        or min_tokens. `grammar_masks`: (rows, packed bitmasks) of the constrained rows
        (metrale.grammar.StepMasks.select). Params are assumed validated."""
        raw, x, histories = self._penalised(logits, params, histories)
        apply_token_bitmask(x, grammar_masks)
        _check_generators(params, generators)
        logprobs = _row_log_softmax(raw if self.logprobs_mode == "raw" else x,
                                    _logprob_rows(params))
        _mask_min_tokens(x, params, histories, self.eos_token_ids)
        token_ids = np.empty(len(params), dtype=np.int64)
        greedy = np.array([p.greedy for p in params], dtype=bool)
        token_ids[greedy] = np.argmax(x[greedy], axis=1)
        rows = np.flatnonzero(~greedy)
        if rows.size:
            kept = truncate(x[rows], [params[r] for r in rows])
            token_ids[rows] = _draw(kept, [params[r] for r in rows], [generators[r] for r in rows])
        return SampleResult(token_ids, _gather_logprobs(logprobs, token_ids, params))

    def processed_logits(
        self,
        logits: np.ndarray,
        params: Sequence[SamplingParams],
        histories: Sequence[TokenHistory | None] | None = None,
    ) -> np.ndarray:
        """The logits each row is drawn from (every step but the draw; -inf = filtered out).
        Greedy rows stop after penalties and min-tokens: their token is the row's argmax."""
        _, x, histories = self._penalised(logits, params, histories)
        _mask_min_tokens(x, params, histories, self.eos_token_ids)
        rows = np.array([not p.greedy for p in params], dtype=bool)
        if rows.any():
            x[rows] = truncate(x[rows], [p for p in params if not p.greedy])
        return x

    @staticmethod
    def _penalised(logits, params, histories):
        """(the float32 input, a penalised copy, histories with None spelled out per row)."""
        raw = _as_batch(logits, params, histories)
        histories = histories if histories is not None else [None] * len(params)
        x = raw.copy()
        apply_penalties(x, params, histories)
        return raw, x, histories


def _as_batch(logits, params, histories) -> np.ndarray:
    """Check the batch's shapes agree and the logits hold no NaN; return float32 [B, V]."""
    x = np.asarray(logits, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] == 0:
        raise ValueError(f"logits must be [batch, vocab] with vocab > 0, got shape {x.shape}")
    for what, seq in (("params", params), ("histories", histories)):
        if seq is not None and len(seq) != x.shape[0]:
            raise ValueError(f"{what} has {len(seq)} entries for {x.shape[0]} logits rows")
    nan_rows = np.flatnonzero(np.isnan(x).any(axis=1))
    if nan_rows.size:
        raise ValueError(f"logits rows {nan_rows.tolist()} contain NaN")
    return x


def _check_generators(params, generators) -> None:
    if len(generators) != len(params):
        raise ValueError(f"generators has {len(generators)} entries for {len(params)} rows")
    for b, (p, g) in enumerate(zip(params, generators)):
        if g is None and not p.greedy:
            raise ValueError(f"row {b} samples (temperature {p.temperature}) but has no "
                             "generator; make one with make_generator")


# ---- step 1: min tokens ----------------------------------------------------------------------

def _mask_min_tokens(x: np.ndarray, params, histories, eos_token_ids: np.ndarray) -> None:
    """Forbid EOS (unless ignore_eos) and stop_token_ids while a row's output is shorter than
    min_tokens, in place."""
    for b, p in enumerate(params):
        if p.min_tokens <= 0 or len(_history(histories, b, "min_tokens").output_ids) >= p.min_tokens:
            continue
        banned = list(p.stop_token_ids) + ([] if p.ignore_eos else eos_token_ids.tolist())
        if banned:
            ids = np.asarray(banned, dtype=np.int64)
            kept = x[b, ids]
            x[b, ids] = -np.inf
            if not np.isfinite(x[b]).any():     # a finished grammar allows only EOS: it wins
                x[b, ids] = kept


def _history(histories, b: int, why: str) -> TokenHistory:
    h = histories[b]
    if h is None:
        raise ValueError(f"row {b} uses {why} but its TokenHistory is missing")
    return TokenHistory(*h)


# ---- step 2: penalties -----------------------------------------------------------------------

def apply_penalties(
    x: np.ndarray,
    params: Sequence[SamplingParams],
    histories: Sequence[TokenHistory | None],
) -> None:
    """Apply each row's penalties to logits x [B, V] in place.

    Repetition (HF / vLLM): every token seen in prompt + output gets logit / r when the logit is
    > 0 and logit * r otherwise. Presence / frequency (OpenAI), over output tokens only:
    logit -= presence * (count > 0) + frequency * count."""
    for b, p in enumerate(params):
        if p.repetition_penalty != 1.0:
            h = _history(histories, b, "repetition_penalty")
            seen = np.unique(np.concatenate([np.asarray(h.prompt_ids, dtype=np.int64),
                                             np.asarray(h.output_ids, dtype=np.int64)]))
            vals = x[b, seen]
            r = np.float32(p.repetition_penalty)
            x[b, seen] = np.where(vals > 0, vals / r, vals * r)
        if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
            h = _history(histories, b, "presence/frequency penalty")
            ids, counts = np.unique(np.asarray(h.output_ids, dtype=np.int64), return_counts=True)
            x[b, ids] -= np.float32(p.presence_penalty) + np.float32(p.frequency_penalty) * counts


# ---- steps 5-9: temperature and truncation ---------------------------------------------------

def truncate(x: np.ndarray, params: Sequence[SamplingParams]) -> np.ndarray:
    """Temperature, then top-n-sigma, top-k, top-p and min-p over sampled rows x [R, V]
    (`params[i]` for row i). Returns new logits with filtered tokens at -inf; every row keeps
    at least its largest logit."""
    temps = np.array([p.temperature for p in params], dtype=np.float32)
    y = x / temps[:, None]
    _top_n_sigma(y, np.array([p.top_n_sigma for p in params], dtype=np.float64))
    _top_k(y, np.array([p.top_k for p in params], dtype=np.int64))
    _top_p(y, np.array([p.top_p for p in params], dtype=np.float64))
    _min_p(y, np.array([p.min_p for p in params], dtype=np.float64))
    return y


def _top_n_sigma(y: np.ndarray, n: np.ndarray) -> None:
    """Keep logit >= max - n * std, std the population std of the row's finite logits."""
    rows = np.flatnonzero(n > 0)
    if not rows.size:
        return
    z = y[rows]
    finite = np.isfinite(z)
    count = finite.sum(axis=1)
    mean = np.where(finite, z, 0.0).sum(axis=1, dtype=np.float64) / count
    dev = np.where(finite, z - mean[:, None].astype(np.float32), 0.0)
    var = np.einsum("ij,ij->i", dev, dev, dtype=np.float64) / count
    threshold = z.max(axis=1) - n[rows] * np.sqrt(var)
    _mask_below(y, rows, threshold)


def _top_k(y: np.ndarray, k: np.ndarray) -> None:
    """Keep the k largest logits of each row (and any tied with the k-th); rows grouped by k so
    each group is one O(V) partition."""
    vocab = y.shape[1]
    for kk in np.unique(k[(k > 0) & (k < vocab)]):
        rows = np.flatnonzero(k == kk)
        kth = np.partition(y[rows], vocab - kk, axis=1)[:, vocab - kk]
        _mask_below(y, rows, kth)


_TOP_P_HEAD = 1024
"""Top-p first sorts only each row's 1024 largest logits; a row falls back to sorting all its
finite logits only when those hold less than top_p of the mass."""


def _top_p(y: np.ndarray, top_p: np.ndarray) -> None:
    """Keep the smallest descending prefix whose probability mass reaches top_p (a token is kept
    when the mass strictly before it is < top_p; ties with the last kept token are kept).
    Sorts only the row's largest finite logits (see _TOP_P_HEAD), never the whole vocab when
    top-k or a peaked distribution keeps the nucleus small."""
    rows = np.flatnonzero(top_p < 1.0)
    if not rows.size:
        return
    z = _finite_entries(y, rows)
    peak = z.max(axis=1, keepdims=True)
    total = np.exp(z - peak).sum(axis=1, dtype=np.float64)
    p = top_p[rows]
    cut = np.empty(rows.size, dtype=np.float64)
    head_n = min(z.shape[1], _TOP_P_HEAD)
    head = np.partition(z, z.shape[1] - head_n, axis=1)[:, z.shape[1] - head_n:]
    in_head = np.exp(head - peak).sum(axis=1, dtype=np.float64) >= p * total
    for sel, vals in ((in_head, head), (~in_head, z)):
        if sel.any():
            cut[sel] = _nucleus_cut(vals[sel], peak[sel], total[sel], p[sel])
    _mask_below(y, rows, cut)


def _nucleus_cut(vals: np.ndarray, peak: np.ndarray, total: np.ndarray, top_p: np.ndarray):
    """The smallest logit top-p keeps, per row of vals [R, W] (which must hold the row's nucleus;
    `peak` is the row max [R, 1] and `total` its full sum of exp(logit - peak))."""
    desc = -np.sort(-vals, axis=1)
    probs = np.exp(desc - peak) / total[:, None]
    mass_before = np.zeros_like(probs)
    np.cumsum(probs[:, :-1], axis=1, out=mass_before[:, 1:])
    n_keep = (mass_before < top_p[:, None]).sum(axis=1)
    return desc[np.arange(desc.shape[0]), n_keep - 1]


def _min_p(y: np.ndarray, min_p: np.ndarray) -> None:
    """Keep prob >= min_p * max prob, i.e. logit >= max logit + log(min_p)."""
    rows = np.flatnonzero(min_p > 0)
    if rows.size:
        _mask_below(y, rows, y[rows].max(axis=1) + np.log(min_p[rows]))


def _finite_entries(y: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The finite logits of each selected row, left-aligned and padded with -inf to the widest
    row: [len(rows), max finite count]. Earlier cuts (top-k, top-n-sigma) make this narrow."""
    z = y[rows]
    finite = np.isfinite(z)
    width = max(int(finite.sum(axis=1).max(initial=0)), 1)
    if width == y.shape[1]:
        return z
    order = np.argsort(~finite, axis=1, kind="stable")[:, :width]   # finite entries first
    out = np.take_along_axis(z, order, axis=1)
    out[~np.take_along_axis(finite, order, axis=1)] = -np.inf
    return out


def _mask_below(y: np.ndarray, rows: np.ndarray, threshold: np.ndarray) -> None:
    """Set y[r, v] = -inf where y[r, v] < threshold[i], for r = rows[i], in place."""
    z = y[rows]
    z[z < np.asarray(threshold)[:, None]] = -np.inf
    y[rows] = z


# ---- steps 10-11: the adaptive gate and the draw ---------------------------------------------

def _draw(kept: np.ndarray, params: Sequence[SamplingParams],
          generators: Sequence[np.random.Generator]) -> np.ndarray:
    """One token per row of the processed logits kept [R, V]: the argmax for adaptive rows of
    entropy < ADAPTIVE_ENTROPY_NATS (they draw no noise), a Gumbel-max draw for the others."""
    picks = np.argmax(kept, axis=1)
    draw = np.array([not p.adaptive_sampling for p in params], dtype=bool)
    if not draw.all():
        gated = np.flatnonzero(~draw)
        draw[gated] = entropy_nats(kept[gated]) >= ADAPTIVE_ENTROPY_NATS
    rows = np.flatnonzero(draw)
    if rows.size:
        picks[rows] = gumbel_argmax(kept[rows], [generators[r] for r in rows])
    return picks


def entropy_nats(logits: np.ndarray) -> np.ndarray:
    """Entropy (nats, float64) of softmax over each row of logits [R, V] (-inf = excluded)."""
    finite = np.isfinite(logits)
    z = np.where(finite, logits - logits.max(axis=1, keepdims=True), 0.0).astype(np.float64)
    e = np.where(finite, np.exp(z), 0.0)
    total = e.sum(axis=1)
    return np.log(total) - (e * z).sum(axis=1) / total


def gumbel_argmax(rows: np.ndarray, generators: Sequence[np.random.Generator]) -> np.ndarray:
    """Draw one token from softmax(rows[i]) for each row, as argmax(rows[i] - log E) with
    E ~ Exponential(1) from generators[i] (the Gumbel-max trick). Each row draws noise for its
    finite tokens only, in token-id order, in float64; a draw of exactly 0 (whose -log E = +inf
    would win whatever its token's probability) is redrawn from the row's generator."""
    finite = np.isfinite(rows)
    counts = finite.sum(axis=1)
    if not counts.all():
        raise ValueError("every token of a row was filtered out; check the row's logits for NaN")
    noise = np.concatenate([g.standard_exponential(size=int(c))
                            for g, c in zip(generators, counts)])
    zero = np.flatnonzero(noise == 0.0)
    if zero.size:
        owner = np.searchsorted(np.cumsum(counts), zero, side="right")
        for at, row in zip(zero, owner):
            while noise[at] == 0.0:
                noise[at] = generators[row].standard_exponential()
    np.log(noise, out=noise)
    if noise.size == rows.size:                     # nothing truncated: no scatter
        return np.argmax(rows - noise.reshape(rows.shape), axis=1)
    picks = np.empty(rows.shape[0], dtype=np.int64)
    at = 0
    for i, c in enumerate(counts.tolist()):         # each row's finite tokens, in id order
        idx = np.flatnonzero(finite[i])
        picks[i] = idx[np.argmax(rows[i, idx] - noise[at:at + c])]
        at += c
    return picks


# ---- logprobs --------------------------------------------------------------------------------

def _logprob_rows(params: Sequence[SamplingParams]) -> np.ndarray:
    return np.array([p.logprobs is not None for p in params], dtype=bool)


def _row_log_softmax(x: np.ndarray, rows: np.ndarray) -> np.ndarray | None:
    """log_softmax over the vocab of the selected rows (others left at 0), or None if no row
    asks for logprobs. float32, with the normalising sum accumulated in float64."""
    if not rows.any():
        return None
    out = np.zeros(x.shape, dtype=np.float32)
    z = x[rows] - x[rows].max(axis=1, keepdims=True)
    log_total = np.log(np.exp(z).sum(axis=1, keepdims=True, dtype=np.float64))
    out[rows] = z - log_total.astype(np.float32)
    return out


def _gather_logprobs(
    logprobs: np.ndarray | None, token_ids: np.ndarray, params: Sequence[SamplingParams]
) -> list[TokenLogprobs | None]:
    """Per row: the chosen token's logprob and rank, and the top `params.logprobs` tokens."""
    result: list[TokenLogprobs | None] = []
    for b, p in enumerate(params):
        if p.logprobs is None:
            result.append(None)
            continue
        row, tok = logprobs[b], int(token_ids[b])
        top_ids = _top_indices(row, p.logprobs)
        result.append(TokenLogprobs(
            logprob=float(row[tok]),
            top=[(int(t), float(row[t])) for t in top_ids],
            token_id=tok,
            rank=int((row > row[tok]).sum()) + 1,
        ))
    return result


def _top_indices(row: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest entries of row, largest first (ties by lower id)."""
    k = min(k, row.size)
    if k == 0:
        return np.zeros(0, dtype=np.int64)
    part = np.argpartition(-row, k - 1)[:k] if k < row.size else np.arange(row.size)
    order = np.lexsort((part, -row[part]))
    return part[order].astype(np.int64)
