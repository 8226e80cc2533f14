"""Speculative decoding end to end through `EngineCore` on the CPU backend (metrale.spec).

Every emitted token is the target's own pick, so greedy output with drafts must equal greedy
output without them, whatever the drafts are and however many are accepted: on the hybrid
models (GDN state restored to the accepted prefix from the verify rows) and the attention-only
ones, at batch sizes 1-64, with chunked prefill, preemption (recompute and swap) and prefix-cache
hits with GDN snapshots. The drafts come from `ReplayDrafter` (the target's own recorded
continuation, each draft corrupted with probability 1 - p: acceptance under control), and from
the real drafters (n-gram, prompt lookup) on prompts that repeat themselves. Sampled output keeps
the target's distribution: a chi-square test of the second token against the exact conditional
distribution computed from the model's logits.
"""
from __future__ import annotations

import random

import numpy as np
import pytest

from metrale.config import ConfigError, EngineConfig
from metrale.engine_core import EngineCore
from metrale.models.loader import load_checkpoint
from metrale.request import Request
from metrale.sampling import SamplingParams
from metrale.spec import parse_k_ladder
from metrale.spec.drafters import NgramDrafter, PromptLookupDrafter, ReplayDrafter
from sampling_stats import P_VALUE_FLOOR, chi_square_p_value
from tiny_models import VOCAB, make_tiny

ARCHS = ("qwen3_5", "qwen3_5_moe", "qwen3", "llama")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    return {arch: load_checkpoint(make_tiny(arch, root / arch, seed=11)) for arch in ARCHS}


def engine(ckpt, drafts=0, **overrides) -> EngineCore:
    """A CPU engine; `drafts` > 0 turns speculation on (n-gram drafter, replaced by the test's)."""
    settings = dict(device="cpu", block_size=4, max_batch_size=4, max_num_seqs=128,
                    max_prefill_tokens=64, max_seq_len=256, ssm_checkpoint_interval=8,
                    ssm_cache_slots=32, request_timeout=0, swap_space_gb=0.0)
    if drafts:
        settings.update(ngram_speculative=True, num_drafts=drafts)
    settings.update(overrides)
    return EngineCore(ckpt, EngineConfig(**settings))


def greedy(max_tokens=12, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def make_prompts(n, seed=0, lo=3, hi=40) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f"r{i}": [rng.randrange(1, VOCAB) for _ in range(rng.randrange(lo, hi))]
            for i in range(n)}


def run(core: EngineCore, prompts, params, waves=1) -> dict[str, list[int]]:
    """Every prompt to the end; the requests arrive in `waves` groups, each once the previous
    one has run a few steps (so verifies and prefills share steps). Checks the scheduler's
    invariants after every step and that each delta's count matches the running total."""
    tokens = {rid: [] for rid in prompts}
    ids = list(prompts)
    groups = [ids[i::waves] for i in range(waves)]
    for group in groups:
        for rid in group:
            core.add_request(Request(rid, list(prompts[rid]), params))
        for _ in range(3):
            _step(core, tokens)
    while core.has_unfinished():
        _step(core, tokens)
    return tokens


def _step(core, tokens):
    for o in core.step():
        tokens[o.request_id] += o.token_ids
        assert o.num_output_tokens == len(tokens[o.request_id])
    core.scheduler.check_integrity()


def with_replay(core: EngineCore, expected, p: float, seed=0) -> EngineCore:
    core.speculation.drafter = ReplayDrafter(expected, p, VOCAB, seed=seed)
    core.speculation.method = "replay"
    return core


@pytest.fixture(scope="module")
def plain(checkpoints):
    """Reference greedy outputs per arch: no speculation, a roomy pool."""
    cache = {}

    def get(arch, prompts, params, **kw):
        key = (arch, tuple(map(tuple, prompts.values())), params.max_tokens, tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = run(engine(checkpoints[arch], **kw), prompts, params)
        return cache[key]
    return get


# -- greedy output is the target's, at any acceptance ------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("p", [0.0, 0.6, 1.0])
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_output_is_the_same_at_any_acceptance(arch, p, k, checkpoints, plain):
    prompts = make_prompts(7, seed=1)
    params = greedy(14)
    expected = plain(arch, prompts, params)
    core = with_replay(engine(checkpoints[arch], drafts=k), expected, p)
    got = run(core, prompts, params, waves=3)
    assert got == expected
    st = core.speculation.stats
    assert st.num_verifies > 0 and st.draft_tokens > 0
    if p == 1.0:        # the replay is the target's own continuation: every draft kept
        assert st.accepted_tokens == st.draft_tokens
    elif p == 0.0:
        assert st.accepted_tokens == 0
    else:
        assert 0 < st.accepted_tokens < st.draft_tokens
    # fewer steps than tokens: a verify emitted more than one
    if p > 0:
        assert st.mean_accepted_length > 1.0


@pytest.mark.parametrize("arch", ["qwen3_5", "llama"])
def test_batches_of_1_to_64_sequences(arch, checkpoints, plain):
    prompts = make_prompts(64, seed=2, lo=2, hi=12)
    params = greedy(9)
    expected = plain(arch, prompts, params, max_batch_size=64)
    for batch in (1, 5, 64):
        core = with_replay(engine(checkpoints[arch], drafts=3, max_batch_size=batch,
                                  max_prefill_tokens=96), expected, 0.7, seed=batch)
        assert run(core, prompts, params, waves=4) == expected


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_chunked_prefill_beside_verifies(arch, checkpoints, plain):
    """A tiny token budget: prompts prefill in chunks in the same steps as other sequences'
    verifies (drafts cut to the budget left)."""
    prompts = make_prompts(6, seed=3, lo=20, hi=60)
    params = greedy(10)
    expected = plain(arch, prompts, params)
    core = with_replay(engine(checkpoints[arch], drafts=4, max_prefill_tokens=7), expected, 0.8)
    assert run(core, prompts, params, waves=3) == expected


@pytest.mark.parametrize("arch", ["qwen3_5", "llama"])
@pytest.mark.parametrize("swap", [False, True])
def test_preemption_by_recompute_and_swap(arch, swap, checkpoints, plain):
    prompts = make_prompts(6, seed=4, lo=8, hi=20)
    params = greedy(16)
    expected = plain(arch, prompts, params)
    core = with_replay(engine(checkpoints[arch], drafts=4, num_kv_blocks=14,
                              swap_space_gb=0.01 if swap else 0.0), expected, 0.8)
    got = run(core, prompts, params, waves=1)
    assert core.scheduler.num_preemptions > 0
    assert got == expected


def test_prefix_cache_hits_and_gdn_snapshots_with_speculation(checkpoints, plain):
    """Hybrid model, prefix caching with GDN snapshots every 8 tokens: verify windows end at
    checkpoints, a snapshot is kept only when its window was accepted whole, and later requests
    that hit the cache (and its snapshots) decode the same tokens."""
    rng = random.Random(5)
    system = [rng.randrange(1, VOCAB) for _ in range(30)]
    prompts = {f"s{n}": system[:n] + [rng.randrange(1, VOCAB) for _ in range(4)]
               for n in (8, 13, 16, 24, 30)}
    prompts["again"] = list(prompts["s24"])
    params = greedy(20)
    expected = plain("qwen3_5", prompts, params)
    core = with_replay(engine(checkpoints["qwen3_5"], drafts=4, enable_prefix_caching=True),
                       expected, 0.8)
    got = run(core, prompts, params, waves=3)
    assert got == expected
    cache = core.scheduler.prefix_cache
    assert cache.num_hits > 0 and cache.snapshots.num_snapshots > 0
    # and a second pass served from the cache: every prompt hits, same tokens
    again = run(core, {f"{k}-2": v for k, v in prompts.items()}, params)
    assert again == {f"{k}-2": v for k, v in expected.items()}


def test_a_stop_token_inside_the_accepted_drafts_ends_the_request_there(checkpoints, plain):
    prompts = make_prompts(4, seed=6)
    ref = plain("qwen3_5", prompts, greedy(16))
    # stop at the 6th token of each request's own continuation
    for rid, toks in ref.items():
        params = SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=[toks[5]])
        cut = toks[: toks.index(toks[5]) + 1]
        core = with_replay(engine(checkpoints["qwen3_5"], drafts=8), {rid: toks}, 1.0)
        core.add_request(Request(rid, list(prompts[rid]), params))
        out, reason = [], None
        while core.has_unfinished():
            for o in core.step():
                out += o.token_ids
                reason = o.finish_reason or reason
        assert out == cut and reason == "stop"


def test_max_tokens_is_never_exceeded(checkpoints, plain):
    prompts = make_prompts(3, seed=7)
    for n in (1, 2, 5):
        expected = plain("llama", prompts, greedy(n))
        core = with_replay(engine(checkpoints["llama"], drafts=6), plain("llama", prompts, greedy(12)), 1.0)
        assert run(core, prompts, greedy(n)) == expected


# -- the real drafters ---------------------------------------------------------------------------
def repetitive_prompts(seed=8) -> dict[str, list[int]]:
    """Prompts that repeat a phrase (code being edited, a list): copies have something to find."""
    rng = random.Random(seed)
    out = {}
    for i in range(4):
        phrase = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(6, 14))]
        out[f"rep{i}"] = phrase * 4 + phrase[: rng.randrange(2, 6)]
    return out


@pytest.mark.parametrize("arch", ["qwen3_5", "llama"])
@pytest.mark.parametrize("method", ["ngram", "prompt_lookup"])
def test_ngram_and_prompt_lookup_keep_greedy_output(arch, method, checkpoints, plain):
    """The tiny random llama falls into loops within 60 greedy tokens (it repeats itself, as
    code being edited does): copies are proposed and kept there. The random hybrid model does
    not loop; its output must be unchanged by whatever drafts the matches give."""
    prompts = repetitive_prompts()
    params = greedy(60)
    expected = plain(arch, prompts, params)
    kw = dict(ngram_speculative=True, num_drafts=4) if method == "ngram" else dict(
        speculative=True, prompt_lookup_decoding=True, prompt_lookup_min_match=4)
    for batch in (1, 4):
        core = engine(checkpoints[arch], max_batch_size=batch, **kw)
        assert core.speculation.method == ("ngram" if method == "ngram" else "prompt-lookup")
        assert run(core, prompts, params) == expected
        if arch == "llama":
            st = core.speculation.stats
            assert st.accepted_tokens > 0 and st.mean_accepted_length > 1.5


def test_ngram_drafter_proposes_what_followed_the_last_match():
    d = NgramDrafter()
    req = Request("a", [5, 6, 7, 8, 9, 1, 2, 5, 6, 7], greedy())
    d.propose([req], [3])
    assert req.draft_token_ids == [8, 9, 1]      # 5 6 7 matched (n = 3 ... 4 tried first)
    req.output_token_ids += [8, 9, 4]            # context grows: the index extends
    d.propose([req], [2])
    assert req.draft_token_ids == []             # "9 4", "4" never seen before... except
    req.output_token_ids += [5, 6]
    d.propose([req], [2])
    assert req.draft_token_ids == [7, 8]         # most recent "4 5 6"? no: "5 6" -> 7 8


def test_prompt_lookup_rules_window_batch_cut_and_miss_backoff():
    d = PromptLookupDrafter(ngram=2, max_drafts=8, min_match=3, miss_backoff=4, max_seqs=2)
    phrase = list(range(10, 30))
    req = Request("a", phrase + phrase[:3], greedy(100))
    d.propose([req], [16])
    assert req.draft_token_ids == phrase[3:11]   # window starts at max_drafts
    # a broken copy (2 of 8 kept): the window halves
    req.last_verify = (8, 2)
    req.output_token_ids += phrase[3:6]
    d.propose([req], [16])
    assert len(req.draft_token_ids) == 4
    # inside a batch a copy is cut to 3 drafts
    other = Request("b", phrase + phrase[:3], greedy(100))
    req.last_verify = (4, 4)                     # full: window back to 8
    req.output_token_ids += phrase[6:11]
    d.propose([req, other], [16, 16])
    assert len(req.draft_token_ids) == 3 and len(other.draft_token_ids) == 3
    # more than max_seqs decoding: no copies
    third = Request("c", phrase + phrase[:3], greedy(100))
    d.propose([req, other, third], [16, 16, 16])
    assert not any(r.draft_token_ids for r in (req, other, third))
    # a miss (a copy that kept nothing) skips the next round, a second miss the next 2, ...
    lone = Request("d", phrase + phrase[:3], greedy(100))
    rounds = []
    for _ in range(7):
        d.propose([lone], [16])
        rounds.append(bool(lone.draft_token_ids))
        lone.last_verify = (len(lone.draft_token_ids), 0) if lone.draft_token_ids else None
        lone.output_token_ids.append(phrase[3 + len(lone.output_token_ids)])  # still matching
    assert rounds == [True, False, True, False, False, True, False]
    # a third miss (round 6) skips 4 rounds (the ceiling); then any accepted copied token
    # clears the backoff
    for _ in range(3):
        d.propose([lone], [16])
        assert lone.draft_token_ids == []
    d.propose([lone], [16])
    assert lone.draft_token_ids
    lone.last_verify = (len(lone.draft_token_ids), 1)
    lone.output_token_ids.append(phrase[3 + len(lone.output_token_ids)])
    d.propose([lone], [16])
    assert lone.draft_token_ids and d._state["d"].misses == 0


def test_prompt_lookup_min_match_spans_back_from_the_end():
    d = PromptLookupDrafter(ngram=2, max_drafts=4, min_match=5, miss_backoff=0, max_seqs=8)
    # "3 4" occurs earlier, but only "2 3 4" matches back from the end (3 < 5 tokens)
    req = Request("a", [1, 2, 3, 4, 5, 6, 9, 2, 3, 4], greedy())
    d.propose([req], [4])
    assert req.draft_token_ids == []
    req2 = Request("b", [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5], greedy())
    d.propose([req2], [4])
    assert req2.draft_token_ids == [6, 7, 1, 2]


# -- sampling keeps the target's distribution ----------------------------------------------------
def test_sampled_tokens_keep_the_target_distribution(checkpoints):
    """temperature 1, top-k 8: the second output token, conditioned on the first, is drawn
    from the target's exact distribution whether or not the draft of it was accepted. The draft
    is always the target's argmax of that row (so it is accepted often, rejected often); the
    empirical distribution over 2400 runs must pass a chi-square test against the softmax of
    the model's own logits at that position."""
    ckpt = checkpoints["llama"]
    prompt = [17, 101, 44, 250, 3]
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=8, min_p=0.0, top_n_sigma=0.0,
                            ignore_eos=True)
    ref = engine(ckpt)
    first = int(np.argmax(_logits(ref, prompt)[-1]))
    row = _logits(ref, prompt + [first])[-1].astype(np.float64)
    keep = np.argsort(-row)[:8]
    probs = np.exp(row[keep] - row[keep].max())
    probs /= probs.sum()

    class FixedDraft:
        name = "fixed"

        def propose(self, requests, limits):
            for r in requests:
                r.draft_token_ids = [int(keep[0])] if r.num_output_tokens == 1 else []

        def release(self, rid):
            pass

    core = engine(ckpt, drafts=1, max_batch_size=64, max_num_seqs=256, seed=3)
    core.speculation.drafter = FixedDraft()
    counts = dict.fromkeys(map(int, keep), 0)
    seconds, n = [], 0
    for wave in range(12):
        for i in range(200):
            core.add_request(Request(f"w{wave}-{i}", list(prompt), params))
        outs = {}
        while core.has_unfinished():
            for o in core.step():
                outs.setdefault(o.request_id, []).extend(o.token_ids)
        for toks in outs.values():
            if toks[0] == first:
                counts[toks[1]] += 1
                n += 1
    st = core.speculation.stats
    assert st.num_verifies > 0 and 0 < st.accepted_tokens < st.num_verifies
    observed = np.array([counts[int(t)] for t in keep])
    assert observed.sum() == n and n > 500
    assert chi_square_p_value(observed, probs) > P_VALUE_FLOOR


def _logits(core, ids):
    from metrale.forward import contiguous_batch

    batch = contiguous_batch([ids], [0], [list(range(-(-len(ids) // 4)))], [0], 4, all_logits=True)
    return np.asarray(core.model.forward(batch, core.caches))


# -- flags -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("settings, message", [
    (dict(prompt_lookup_decoding=True), "requires --speculative"),
    (dict(speculative=True, prompt_lookup_decoding=True, ngram_speculative=True), "conflicts with --ngram"),
    (dict(speculative=True, prompt_lookup_decoding=True, self_speculative=True), "conflicts with --self"),
    (dict(speculative=True, dflash=True), "--dflash conflicts with --speculative"),
    (dict(dflash=True), "DFlash"),
    (dict(num_drafts=0), "--num-drafts"),
    (dict(num_drafts=17), "--num-drafts"),
    (dict(draft_confidence_stop=0.5), "needs --speculative"),
    (dict(speculative=True, draft_confidence_stop=1.5), "(0, 1)"),
    (dict(mtp_quantization="int4"), "--mtp-quantization"),
    (dict(prompt_lookup_max_drafts=17), "1..16"),
    (dict(prompt_lookup_miss_backoff=-1), "miss-backoff"),
])
def test_flag_rules(settings, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EngineConfig(**settings).validate()


def test_speculative_without_mtp_weights_is_refused_unless_prompt_lookup_drafts(checkpoints):
    with pytest.raises(ConfigError, match="no mtp"):
        engine(checkpoints["llama"], speculative=True)
    core = engine(checkpoints["llama"], speculative=True, prompt_lookup_decoding=True)
    assert core.speculation.method == "prompt-lookup"


def test_the_k_ladder_and_the_batch_ceiling(checkpoints, monkeypatch):
    assert parse_k_ladder("4:2, 1:3,2:1") == [(1, 3), (2, 1), (4, 2)]
    with pytest.raises(ConfigError, match="BATCH:DRAFTS"):
        parse_k_ladder("1-3")
    monkeypatch.setenv("METRALE_MTP_K_LADDER", "1:3,2:1,4:2")
    monkeypatch.setenv("METRALE_SPEC_MAX_BATCH", "6")
    core = engine(checkpoints["llama"], drafts=1, max_batch_size=8)
    sp = core.speculation
    assert [sp.drafts_for_batch(n) for n in (1, 2, 3, 4, 6, 7)] == [3, 1, 1, 2, 2, 0]


def test_penalised_requests_are_not_drafted_on_cuda_and_are_on_the_cpu(checkpoints):
    core = engine(checkpoints["llama"], drafts=2)
    req = Request("p", [1, 2, 3], SamplingParams(max_tokens=4, repetition_penalty=1.2))
    assert core.speculation.eligible(req)
    core.speculation.on_cuda = True
    assert not core.speculation.eligible(req)


# -- through met serve ---------------------------------------------------------------------------
def test_met_serve_with_ngram_speculation_streams_the_same_text_and_counts_verifies(tmp_path):
    """A real server with --ngram-speculative: streamed and non-streamed completions equal the
    server without it (greedy), several tokens arrive per delta when copies are kept, and the
    verify counters and the per-request log line report them."""
    import openai

    from tests.serving import Server, make_tiny_chat_model, metric

    model = make_tiny_chat_model(tmp_path / "tiny-llama")
    prompt = "abcabcabcabcabcabc"
    texts = {}
    for name, extra in (("off", []), ("on", ["--ngram-speculative", "--num-drafts", "4"])):
        args = ["serve", str(model), "--frontends", "1", "--max-batch-size", "8",
                "--max-seq-len", "1024", *extra]
        with Server(args, tmp_path / f"serve-{name}.log").serving(workers=1) as srv:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0,
                                   timeout=120)
            full = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=80,
                                             temperature=0)
            chunks = [c.choices[0].text for c in client.completions.create(
                model="tiny-llama", prompt=prompt, max_tokens=80, temperature=0, stream=True)
                if c.choices]
            assert "".join(chunks) == full.choices[0].text
            assert full.usage.completion_tokens == 80
            texts[name] = full.choices[0].text
            if name == "on":
                assert metric(srv.url, "metrale_spec_decode_draft_tokens_total") > 0
                accepted = metric(srv.url, "metrale_spec_decode_accepted_tokens_total")
                assert accepted > 0
                assert metric(srv.url, "metrale_spec_decode_mean_accepted_length") > 1.0
        log = (tmp_path / f"serve-{name}.log").read_text()
        assert ("spec_accepted_tokens" in log) == (name == "on")
    assert texts["on"] == texts["off"]


# -- verify steps padded into the verify step graphs' buckets (their host side, on the CPU) ------
class CpuVerifyGraphs:
    """StepGraphs(verify=True).run_step's contract on the CPU backend: the verify step padded
    into the smallest VERIFY_BUCKETS bucket (StepBuckets(verify=True), the host side of the CUDA
    verify graphs: state_out and a logits row per token in the buffer) and run as one forward."""

    def __init__(self, core):
        from metrale.backends.cuda.graphs import StepBuckets

        self.model, self.caches, self.bs = core.model, core.caches, core.config.block_size
        width = -(-core.config.max_seq_len // self.bs)
        self.inputs = StepBuckets(128, core.config.max_batch_size, width, (16,), self.bs,
                                  core._num_blocks, core._num_slots, verify=True)
        self.replayed = 0

    def run_step(self, seqs, state_out=None):
        packed = self.inputs.pack(seqs, state_out)
        if packed is None:
            return None
        inputs, n = packed
        self.replayed += 1
        batch = inputs.batch(inputs.views, self.bs)
        assert batch.state_out is not None and len(batch.logits_indices) == inputs.tokens
        return self.model.forward(batch, self.caches)[:n]


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe", "llama"])
def test_verify_steps_padded_into_verify_buckets_give_the_same_tokens(arch, checkpoints, plain):
    prompts = make_prompts(6, seed=9, lo=3, hi=30)
    params = greedy(16)
    expected = plain(arch, prompts, params)
    core = with_replay(engine(checkpoints[arch], drafts=4, max_prefill_tokens=40), expected, 0.7)
    graphs = core.runner.verify_graphs = CpuVerifyGraphs(core)
    assert run(core, prompts, params, waves=3) == expected
    assert graphs.replayed > 0


# -- self-speculation --------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_self_speculation_keeps_greedy_output(arch, checkpoints, plain):
    prompts = make_prompts(5, seed=10)
    params = greedy(20)
    expected = plain(arch, prompts, params)
    core = engine(checkpoints[arch], self_speculative=True, num_drafts=3)
    assert core.speculation.method == "self-spec" and core.speculation.drafter.skip
    assert run(core, prompts, params, waves=2) == expected
    assert core.speculation.stats.draft_tokens > 0


@pytest.mark.parametrize("arch", ["qwen3_5", "llama"])
def test_self_speculation_with_no_layer_skipped_drafts_the_greedy_continuation(
        arch, checkpoints, plain, monkeypatch):
    """The machinery's own check: with every layer kept the drafter is the target, so (fp32, the
    same context) its drafts are the target's greedy continuation and nearly all are kept; the
    drafts' K/V writes and scratch GDN rows leave the output unchanged."""
    monkeypatch.setenv("METRALE_SELF_SPEC_SKIP", "none")
    prompts = make_prompts(4, seed=11)
    params = greedy(24)
    expected = plain(arch, prompts, params)
    core = engine(checkpoints[arch], self_speculative=True, num_drafts=4, max_batch_size=2)
    assert run(core, prompts, params, waves=2) == expected
    st = core.speculation.stats
    assert st.accepted_tokens >= 0.95 * st.draft_tokens > 0


def test_self_spec_layer_choice():
    from metrale.spec.self_spec import skipped_layers

    assert skipped_layers("auto", 8) == (3, 5)
    assert skipped_layers("none", 8) == ()
    assert skipped_layers("1, 2", 4) == (1, 2)
    with pytest.raises(ConfigError, match="indices"):
        skipped_layers("0,1,2,3", 4)
    with pytest.raises(ConfigError, match="indices"):
        skipped_layers("x", 4)


class _ArgmaxDeviceSampler:
    """A stand-in for metrale.backends.cuda.sampling.GpuSampler on the CPU backend (greedy
    rows: the argmax; logprobs of the chosen token and the top ones from a log-softmax), so the
    runner's device-sampler paths (decode and verify rows) run without a GPU."""

    def __init__(self):
        self.begun, self.calls = [], []

    def begin(self, slot, prompt_ids=()):
        self.begun.append(slot)

    def sample(self, logits, params, steps, slots=None, logprobs=False, before_wait=None):
        from metrale.backends.cuda.sampling import SampleResult

        if before_wait is not None:
            before_wait()
        x = np.asarray(logits, np.float64)
        self.calls.append((len(params), list(np.asarray(steps)), list(np.asarray(slots))))
        toks = x.argmax(-1).astype(np.int32)
        if not logprobs:
            return toks
        lsm = x - x.max(-1, keepdims=True)
        lsm -= np.log(np.exp(lsm).sum(-1, keepdims=True))
        top = np.argsort(-lsm, axis=-1)[:, :5]
        return SampleResult(tokens=toks, logprobs=lsm[np.arange(len(toks)), toks].astype(np.float32),
                            top_ids=top, top_logprobs=np.take_along_axis(lsm, top, -1).astype(np.float32))


def test_device_sampler_paths_of_decode_and_verify_steps(checkpoints, plain):
    """The runner's device-sampler code (ModelRunner._sample_gpu for decode steps,
    _sample_rows_gpu for verify rows: step = output tokens + row, the sequence's slot) with a
    stand-in sampler: the same greedy tokens and logprobs as the host sampler's."""
    prompts = make_prompts(4, seed=12)
    params = greedy(12, logprobs=2)
    expected = plain("llama", prompts, greedy(12))
    core = with_replay(engine(checkpoints["llama"], drafts=3), expected, 1.0)
    core.runner.gpu_sampler = fake = _ArgmaxDeviceSampler()
    from metrale.request import Request as R

    outs, lps = {r: [] for r in prompts}, {r: [] for r in prompts}
    for rid, ids in prompts.items():
        core.add_request(R(rid, list(ids), params))
    while core.has_unfinished():
        for o in core.step():
            outs[o.request_id] += o.token_ids
            lps[o.request_id] += [lp.logprob for lp in o.logprobs]
    assert outs == expected
    assert all(len(lps[r]) == len(outs[r]) and all(v <= 0 for v in lps[r]) for r in prompts)
    assert len(fake.begun) == len(prompts)      # each request began in its slot once
    verify_calls = [c for c in fake.calls if c[0] > len(set(c[2]))]
    assert verify_calls, "no verify rows went through the device sampler"
    n, steps, slots = verify_calls[0]
    # rows of one sequence: consecutive steps in one slot
    for i in range(1, n):
        if slots[i] == slots[i - 1]:
            assert steps[i] == steps[i - 1] + 1


def test_logprobs_of_verified_tokens_are_the_targets(checkpoints):
    """Tokens emitted by a verify carry the logprobs of the row that chose them: the same as
    decoding gives (host sampler, fp32)."""
    prompts = make_prompts(3, seed=13)
    params = greedy(10, logprobs=3)

    def collect(core):
        from metrale.request import Request as R

        toks, lps = {r: [] for r in prompts}, {r: [] for r in prompts}
        for rid, ids in prompts.items():
            core.add_request(R(rid, list(ids), params))
        while core.has_unfinished():
            for o in core.step():
                toks[o.request_id] += o.token_ids
                lps[o.request_id] += [(lp.logprob, lp.top_logprobs) for lp in o.logprobs]
        return toks, lps

    ref_toks, ref_lps = collect(engine(checkpoints["qwen3_5"]))
    core = with_replay(engine(checkpoints["qwen3_5"], drafts=3), ref_toks, 1.0)
    toks, lps = collect(core)
    assert toks == ref_toks and core.speculation.stats.accepted_tokens > 0
    for rid in prompts:
        assert len(lps[rid]) == len(ref_lps[rid])
        for (a, ta), (b, tb) in zip(lps[rid], ref_lps[rid]):
            assert abs(a - b) <= 1e-4 and [t for t, _ in ta] == [t for t, _ in tb]


# -- acceptance-adaptive draft counts (metrale.spec.adaptive) ----------------------------------
def test_best_drafts_maximises_expected_tokens_per_step_cost():
    from metrale.spec.adaptive import best_drafts

    def rate(a, j, c):
        return sum(a ** i for i in range(j + 1)) / (1 + c * j)
    for a in (0.0, 0.05, 0.2, 0.5, 0.8, 0.95, 1.0):
        for limit in (0, 1, 3, 6):
            for c in (0.0, 0.08, 0.5):
                j = best_drafts(a, limit, c)
                assert 0 <= j <= limit
                assert rate(a, j, c) >= max(rate(a, i, c) for i in range(limit + 1)) - 1e-12
    assert best_drafts(0.0, 4, 0.08) == 0           # every draft rejected: none pays
    assert best_drafts(0.8, 3, 0.08) == 3


def test_adaptive_limit_skips_then_probes_with_doubling_backoff():
    from metrale.spec.adaptive import MAX_SKIP, AdaptiveDrafts

    ad = AdaptiveDrafts(0.08)
    req = Request("a", [1, 2, 3], greedy(500))
    schedule = []
    for _ in range(300):
        j = ad.limit(req, 3)
        schedule.append(j)
        req.last_verify = (j, 0) if j else None      # every draft rejected
    drafted = [i for i, j in enumerate(schedule) if j]
    gaps = [b - a for a, b in zip(drafted, drafted[1:])]
    # a few windows to learn, then probes after 1, 2, 4 ... MAX_SKIP skipped steps
    assert len(drafted) < 25
    tail = gaps[-4:]
    assert tail == [MAX_SKIP + 1] * 4
    assert any(g == 2 for g in gaps) and any(g == 5 for g in gaps)
    # drafts that start being accepted again are noticed at the next probe
    ad2 = AdaptiveDrafts(0.08)
    for _ in range(60):
        j = ad2.limit(req, 3)
        req.last_verify = (j, 0) if j else None
    for _ in range(MAX_SKIP + 1):
        j = ad2.limit(req, 3)
        req.last_verify = (j, j) if j else None
        if j:
            break
    assert j == 3
    climb = []
    for _ in range(5):          # every window accepted whole: back to the full count
        climb.append(ad2.limit(req, 3))
        req.last_verify = (climb[-1], climb[-1])
    assert climb == sorted(climb) and climb[0] >= 1 and climb[-3:] == [3, 3, 3]


@pytest.mark.parametrize("arch", ["qwen3_5", "llama"])
def test_rejected_drafts_stop_being_drafted_and_output_is_unchanged(arch, checkpoints, plain,
                                                                    monkeypatch):
    prompts = make_prompts(3, seed=5)
    params = greedy(120)
    expected = plain(arch, prompts, params)
    counts = {}
    for adaptive in ("1", "0"):
        monkeypatch.setenv("METRALE_SPEC_ADAPTIVE", adaptive)
        core = with_replay(engine(checkpoints[arch], drafts=3), expected, 0.0)
        assert run(core, prompts, params) == expected
        counts[adaptive] = core.speculation.stats.num_verifies
    # fixed: (nearly) every decode step verifies 3 drafts; adaptive: a few windows, then probes
    assert counts["0"] > 3 * 100
    assert counts["1"] < counts["0"] / 4
    # all accepted: the adaptive count stays at the configured 3 drafts
    monkeypatch.setenv("METRALE_SPEC_ADAPTIVE", "1")
    core = with_replay(engine(checkpoints[arch], drafts=3), expected, 1.0)
    assert run(core, prompts, params) == expected
    st = core.speculation.stats
    short = sum(n for (k, _), n in st.verifies.items() if k < 3)   # cut by max_tokens at the end
    assert st.num_verifies > 3 * 20 and short <= len(prompts)
