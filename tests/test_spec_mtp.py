"""The MTP drafter (metrale.spec.mtp) end to end through `EngineCore` on the CPU backend, on tiny
qwen3_5 / qwen3_5_moe checkpoints carrying random `mtp.*` tensors (tests.tiny_models.add_mtp).

Random heads rarely guess the target's next tokens, so acceptance is low; what is checked is
correctness:
  - greedy output with --speculative equals the output without it (batches of 1-8, chunked
    prefill, preemption by recompute and by swap, prefix-cache hits, --auto-compact);
  - the drafts are the head's own: every proposal equals an independent computation, the
    MtpHead run directly over the target's hidden states of the request's whole context (one
    shot, fresh caches) and chained from there. That holds at any acceptance (a replay drafter
    verifies the target's own continuation while the MTP drafter's proposals are recorded),
    after prefix-cache hits whose cached blocks' last head rows read another token (private
    copies), after swap-in and recompute;
  - --draft-confidence-stop, --mtp-vocab, --mtp-quantization, prompt lookup falling back to the
    head, the default of 3 drafts for Qwen3.5 / 3.6.
"""
from __future__ import annotations

import random

import numpy as np
import pytest

from metrale.cache.kv import ModelCaches
from metrale.config import ConfigError, EngineConfig
from metrale.engine_core import EngineCore
from metrale.forward import contiguous_batch
from metrale.models.loader import load_checkpoint
from metrale.request import Request
from metrale.sampling import SamplingParams
from metrale.spec.drafters import PromptLookupDrafter, ReplayDrafter
from metrale.spec.mtp import MTP_DEFAULT_DRAFTS, MtpDrafter, default_drafts, head_precision
from tiny_models import VOCAB, add_mtp, make_tiny, quantize_tiny

ARCHS = ("qwen3_5", "qwen3_5_moe")
BLOCK = 4
TIE = 1e-4          # oracle logits this close to the runner-up: either pick is the head's


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec-mtp")
    return {arch: add_mtp(make_tiny(arch, root / arch, seed=11), seed=3) for arch in ARCHS}


@pytest.fixture(scope="module")
def checkpoints(paths):
    return {arch: load_checkpoint(p) for arch, p in paths.items()}


def engine(ckpt, mtp=True, **overrides) -> EngineCore:
    settings = dict(device="cpu", block_size=BLOCK, max_batch_size=4, max_num_seqs=128,
                    max_prefill_tokens=64, max_seq_len=256, ssm_checkpoint_interval=8,
                    ssm_cache_slots=32, request_timeout=0, swap_space_gb=0.0)
    if mtp:
        settings.update(speculative=True)
    settings.update(overrides)
    return EngineCore(ckpt, EngineConfig(**settings))


def greedy(max_tokens=12) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def make_prompts(n, seed=0, lo=3, hi=40) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f"r{i}": [rng.randrange(1, VOCAB) for _ in range(rng.randrange(lo, hi))]
            for i in range(n)}


def run(core: EngineCore, prompts, params, waves=1) -> dict[str, list[int]]:
    """Every prompt to the end, arriving in `waves` groups a few steps apart; the scheduler's
    invariants checked after every step."""
    tokens = {rid: [] for rid in prompts}
    ids = list(prompts)
    for group in (ids[i::waves] for i in range(waves)):
        for rid in group:
            core.add_request(Request(rid, list(prompts[rid]), params))
        for _ in range(3):
            _step(core, tokens)
    while core.has_unfinished():
        _step(core, tokens)
    _check_released(core)
    return tokens


def _step(core, tokens):
    for o in core.step():
        tokens[o.request_id] += o.token_ids
    core.scheduler.check_integrity()


def _check_released(core):
    """Nothing runs: the drafter holds no request state, rows or private blocks."""
    mtp = core.speculation.mtp if core.speculation is not None else None
    if mtp is None:
        return
    assert not mtp._state and not mtp._swapped
    assert len(mtp._free_rows) == core.config.max_batch_size + 1
    assert len(mtp._private_free) == 2 * core.config.max_batch_size


@pytest.fixture(scope="module")
def plain(checkpoints):
    cache = {}

    def get(arch, prompts, params, **kw):
        key = (arch, tuple(map(tuple, prompts.values())), params.max_tokens, tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = run(engine(checkpoints[arch], mtp=False, **kw), prompts, params)
        return cache[key]
    return get


# -- the independent computation -----------------------------------------------------------------
class Spy:
    """Stands in for the drafter: lets the MTP drafter propose and records each proposal
    (request, its context, the drafts, the limit asked), then leaves them, or replaces them by
    `inner`'s (a replay of the target's continuation: acceptance under control). The MTP drafter
    still follows every step (Speculation.mtp observes whoever drafts)."""

    name = "spy"

    def __init__(self, mtp: MtpDrafter, inner=None):
        self.mtp, self.inner, self.log = mtp, inner, []

    def propose(self, requests, limits):
        self.mtp.propose(requests, limits)
        for r, k in zip(requests, limits):
            k = min(k, self.mtp.cap) if self.mtp.cap is not None else k
            if k > 0:
                self.log.append((r.request_id, r.all_token_ids, list(r.draft_token_ids), k))
        if self.inner is not None:
            self.inner.propose(requests, limits)

    def release(self, request_id):
        pass


def spy_on(core: EngineCore, inner=None) -> Spy:
    spy = Spy(core.speculation.mtp, inner)
    core.speculation.drafter = spy
    return spy


class Oracle:
    """The drafts of a context, computed from scratch: the target's final-norm hidden states of
    the whole context (CausalLM.forward_with_hidden), the MtpHead over every position of it in
    one shot with the shifted ids, then one head row per further draft (the previous draft,
    the head's own hidden), in caches of its own."""

    def __init__(self, core: EngineCore):
        self.model, self.ops = core.model, core.ops
        self.head = core.model.mtp
        self.vocab = core.config.mtp_vocab
        self._full: dict[tuple, tuple] = {}

    def _one_shot(self, tokens: tuple):
        """Head caches and outputs over positions 0..len - 2 of `tokens`."""
        if tokens not in self._full:
            n = len(tokens)
            nb = -(-(n + 32) // BLOCK)
            table = list(range(nb))
            main = ModelCaches(self.model.cache_spec(), self.ops, nb, BLOCK, 2)
            _, hidden = self.model.forward_with_hidden(
                contiguous_batch([list(tokens[:-1])], [0], [table], [0], BLOCK, True), main)
            caches = ModelCaches(self.head.cache_spec(), self.ops, nb, BLOCK, 0)
            out = self.head.forward(contiguous_batch([list(tokens[1:])], [0], [table], [0], BLOCK, True),
                                    hidden, caches)
            self._full[tokens] = (caches, np.asarray(out), table)
        return self._full[tokens]

    def chain(self, tokens: list[int], k: int):
        """[(draft, its top-1 probability, margin over the runner-up)] * k for `tokens`."""
        caches, out, table = self._one_shot(tuple(tokens))
        mine = ModelCaches(self.head.cache_spec(), self.ops, len(table), BLOCK, 0)
        for a, b in zip(mine.kv(0), caches.kv(0)):
            a[...] = b
        h, pos, result = out[-1:], len(tokens) - 1, []
        while True:
            logits = np.asarray(self.head.logits(h, self.vocab), np.float64)[0]
            top2 = np.sort(logits)[-2:]
            p = np.exp(logits - top2[1])
            result.append((int(np.argmax(logits)), float(1.0 / p.sum()), float(top2[1] - top2[0])))
            if len(result) == k:
                return result
            h = self.head.forward(contiguous_batch([[result[-1][0]]], [pos], [table], [0], BLOCK, True),
                                  h, mine)
            pos += 1


def check_drafts(core: EngineCore, spy: Spy, tau: float = 0.0) -> int:
    """Every recorded proposal is the oracle's: the same drafts (up to a near tie, after which
    the chains may part) and, with TAU, the chain stopping after the first draft below it.
    Returns the number of proposals checked."""
    oracle = Oracle(core)
    assert spy.log
    for rid, tokens, drafts, k in spy.log:
        want = oracle.chain(tokens, k)
        assert drafts, (rid, len(tokens))
        for j, (d, (o, p, margin)) in enumerate(zip(drafts, want)):
            if margin < TIE:
                break
            assert d == o, (rid, len(tokens), j, drafts, want)
            if tau and abs(p - tau) < 1e-5:
                break
            last = j == len(drafts) - 1
            if tau:
                assert (p >= tau) == (not last) or (last and len(drafts) == k), (rid, j, p, drafts)
            elif last:
                assert len(drafts) == k
    return len(spy.log)


# -- greedy output is the target's; the drafts are the head's ------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("batch", [1, 4, 8])
def test_greedy_output_unchanged_and_drafts_are_the_heads(arch, batch, checkpoints, plain):
    prompts = make_prompts(8, seed=1)
    params = greedy(14)
    expected = plain(arch, prompts, params)
    core = engine(checkpoints[arch], max_batch_size=batch)
    sp = core.speculation
    assert sp.method == "mtp" and sp.num_drafts == 3
    spy = spy_on(core)
    assert run(core, prompts, params, waves=3) == expected
    assert sp.stats.num_verifies > 0 and sp.stats.draft_tokens > sp.stats.num_verifies
    check_drafts(core, spy)


class _DecodeRowsEagerly:
    """Stands in for the head's CUDA graphs (MtpDrafter.capture_graphs) on the CPU: every head
    forward goes through the same one-token-per-row layout (_Rows.decode_batch), run eagerly."""

    max_batch = 1 << 20

    def __init__(self, drafter):
        from metrale.spec.mtp import _HeadStep

        self.drafter = drafter
        drafter._step = _HeadStep(drafter.head, drafter.ops, 4096)
        self.calls = 0

    def supports(self, batch):
        return True

    def run(self, batch):
        d = self.drafter
        self.calls += 1
        n = batch.num_tokens
        return d.head.forward(d.ops.upload_batch(batch), d._step.target[:n], d.caches)


@pytest.mark.parametrize("arch", ARCHS)
def test_head_rows_as_one_token_decode_rows_draft_the_same(arch, checkpoints, plain):
    """The layout the head's CUDA graphs replay: a sequence's consecutive head rows as separate
    one-token rows (each layer writes every row's K/V before any row attends). Greedy output
    unchanged and every proposal equal to the oracle's, with prefill chunks, verifies that keep
    several drafts, and batches of several requests."""
    prompts = make_prompts(6, seed=4)
    params = greedy(14)
    expected = plain(arch, prompts, params)
    core = engine(checkpoints[arch], max_prefill_tokens=9)
    spy = spy_on(core, ReplayDrafter(expected, 0.7, VOCAB, seed=2))
    head = core.speculation.mtp
    head.graphs = _DecodeRowsEagerly(head)
    assert run(core, prompts, params, waves=2) == expected
    assert head.graphs.calls > 0
    check_drafts(core, spy)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("p", [0.5, 1.0])
def test_the_head_follows_accepted_drafts(arch, p, checkpoints, plain):
    """A replay of the target's own continuation is verified (p = 1: every draft kept), while
    the MTP drafter's proposals are recorded: after verifies that keep several drafts the head
    has run over exactly the kept rows (the accepted drafts, then the emitted token, as ids)."""
    prompts = make_prompts(6, seed=2)
    params = greedy(16)
    expected = plain(arch, prompts, params)
    core = engine(checkpoints[arch])
    spy = spy_on(core, ReplayDrafter(expected, p, VOCAB, seed=1))
    assert run(core, prompts, params, waves=2) == expected
    st = core.speculation.stats
    assert st.accepted_tokens > 0 and (p < 1 or st.accepted_tokens == st.draft_tokens)
    check_drafts(core, spy)


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_beside_verifies(arch, checkpoints, plain):
    prompts = make_prompts(6, seed=3, lo=20, hi=60)
    params = greedy(10)
    expected = plain(arch, prompts, params)
    core = engine(checkpoints[arch], max_prefill_tokens=7)
    spy = spy_on(core, ReplayDrafter(expected, 0.7, VOCAB))
    assert run(core, prompts, params, waves=3) == expected
    check_drafts(core, spy)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("how", ["recompute", "swap", "recompute+prefix-cache", "swap+prefix-cache"])
def test_preemption(arch, how, checkpoints, plain):
    """A small pool preempts: recompute rebuilds the head's KV from the prefill chunks again
    (with prefix caching, from the request's own cached blocks); swap carries it to host memory
    and back with the main KV."""
    prompts = make_prompts(6, seed=4, lo=8, hi=20)
    params = greedy(16)
    expected = plain(arch, prompts, params)
    core = engine(checkpoints[arch], num_kv_blocks=14,
                  swap_space_gb=0.01 if how.startswith("swap") else 0.0,
                  enable_prefix_caching=how.endswith("prefix-cache"))
    spy = spy_on(core, ReplayDrafter(expected, 0.7, VOCAB))
    assert run(core, prompts, params) == expected
    assert core.scheduler.num_preemptions > 0
    if how.startswith("swap"):
        assert core.swap.num_swap_ins > 0
    check_drafts(core, spy)


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_cache_hits(arch, checkpoints, plain):
    """Prompts sharing a prefix that ends on a block boundary (and on GDN checkpoints), inside a
    block, and a second turn over a first turn's output: the hits' cached blocks whose last
    head row read another token get private copies, and every draft is the one a run over the
    whole context would make."""
    rng = random.Random(5)
    system = [rng.randrange(1, VOCAB) for _ in range(30)]
    tail = lambda n: [rng.randrange(1, VOCAB) for _ in range(n)]     # noqa: E731
    prompts = {"a": system[:24] + tail(5), "b": system[:16] + tail(6), "c": system[:12] + tail(4),
               "d": system[:16] + tail(3), "e": system[:21] + tail(7)}
    prompts["f"] = prompts["b"][:19] + tail(5)                        # b's tokens, then another
    params = greedy(12)
    first = plain(arch, {"a": prompts["a"]}, params)["a"]
    prompts["turn2"] = prompts["a"] + first + tail(6)
    prompts["again"] = list(prompts["c"])
    expected = plain(arch, prompts, params)
    core = engine(checkpoints[arch], enable_prefix_caching=True)
    spy = spy_on(core, ReplayDrafter(expected, 0.6, VOCAB))
    assert run(core, prompts, params, waves=len(prompts)) == expected
    cache, mtp = core.scheduler.prefix_cache, core.speculation.mtp
    assert cache.num_hits >= 4 and mtp.num_private_copies > 0
    check_drafts(core, spy)
    # a second pass, every prompt served from the cache
    spy.log.clear()
    again = {f"{k}-2": v for k, v in prompts.items()}
    assert run(core, again, params, waves=2) == {f"{k}-2": v for k, v in expected.items()}
    check_drafts(core, spy)


def test_auto_compaction_recomputes_the_head(checkpoints):
    """--auto-compact drops the middle of a long context and recomputes the rest at new
    positions: the head follows (output as without speculation)."""
    prompts = make_prompts(3, seed=6, lo=20, hi=30)
    params = greedy(40)
    kw = dict(auto_compact=0.5, max_seq_len=64)
    expected = run(engine(checkpoints["qwen3_5"], mtp=False, **kw), prompts, params)
    core = engine(checkpoints["qwen3_5"], **kw)
    assert run(core, prompts, params) == expected
    assert core.scheduler.num_compactions > 0 and core.speculation.stats.num_verifies > 0


def test_aborts_release_the_head_state(checkpoints):
    core = engine(checkpoints["qwen3_5"])
    for rid, p in make_prompts(4, seed=7).items():
        core.add_request(Request(rid, p, greedy(30)))
    for _ in range(6):
        core.step()
    mtp = core.speculation.mtp
    assert mtp._state
    for rid in list(mtp._state):
        core.abort_request(rid)
    assert not core.has_unfinished()
    _check_released(core)


# -- flags -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_draft_confidence_stop(arch, checkpoints, plain):
    """TAU close to 1: a random head is never that sure, so every chain stops after its first
    draft (the draft below TAU is still verified); a TAU inside the head's range stops chains
    exactly where the oracle's probabilities say. Emitted tokens unchanged."""
    prompts = make_prompts(5, seed=8)
    params = greedy(14)
    expected = plain(arch, prompts, params)
    core = engine(checkpoints[arch], draft_confidence_stop=0.999)
    assert run(core, prompts, params) == expected
    st = core.speculation.stats
    assert st.num_verifies > 0 and {k for k, _ in st.verifies} == {1}
    # the head's top-1 probabilities here: pick the median as TAU
    core = engine(checkpoints[arch])
    spy = spy_on(core)
    run(core, prompts, params)
    oracle = Oracle(core)
    probs = [p for _, toks, d, k in spy.log for _, p, _ in oracle.chain(toks, len(d))]
    tau = float(np.median(probs))
    core = engine(checkpoints[arch], draft_confidence_stop=tau)
    spy = spy_on(core)
    assert run(core, prompts, params) == expected
    lengths = {len(d) for _, _, d, _ in spy.log}
    assert len(lengths) > 1
    check_drafts(core, spy, tau=tau)


def test_mtp_vocab_limits_the_drafts(checkpoints, plain):
    prompts = make_prompts(5, seed=9)
    params = greedy(14)
    expected = plain("qwen3_5", prompts, params)
    core = engine(checkpoints["qwen3_5"], mtp_vocab=40)
    spy = spy_on(core)
    assert run(core, prompts, params) == expected
    drafts = [t for _, _, d, _ in spy.log for t in d]
    assert drafts and max(drafts) < 40
    check_drafts(core, spy)
    # 0 = the whole vocabulary: drafts beyond 40 appear
    core = engine(checkpoints["qwen3_5"], mtp_vocab=0)
    spy = spy_on(core)
    run(core, prompts, params)
    assert max(t for _, _, d, _ in spy.log for t in d) >= 40


@pytest.fixture(scope="module")
def quantized(paths, tmp_path_factory):
    """{precision of the MTP head: checkpoint path}: block-FP8 everywhere, ModelOpt NVFP4
    everywhere, FP8 with the MTP head kept in its float dtype."""
    root = tmp_path_factory.mktemp("spec-mtp-q")
    src = paths["qwen3_5"]
    return {"fp8": quantize_tiny(src, root / "fp8", "fp8-block", block=(16, 16)),
            "nvfp4": quantize_tiny(src, root / "nvfp4", "modelopt-nvfp4"),
            "bf16": quantize_tiny(src, root / "fp8-mtp-bf16", "fp8-block", keep=("mtp.",),
                                  block=(16, 16))}


@pytest.mark.parametrize("precision", ["fp8", "nvfp4", "bf16"])
def test_mtp_quantization_must_match_the_checkpoint(precision, quantized):
    ckpt = load_checkpoint(quantized[precision])
    for other in {"bf16", "fp8", "nvfp4"} - {precision}:
        with pytest.raises(ConfigError, match=f"--mtp-quantization {other}: .*MTP head.*"
                                              f"--mtp-quantization {precision}"):
            engine(ckpt, mtp_quantization=other)
    core = engine(ckpt, mtp_quantization=precision)
    assert head_precision(core.model.mtp) == precision
    prompts = make_prompts(3, seed=10)
    expected = run(engine(ckpt, mtp=False), prompts, greedy(8))
    assert run(core, prompts, greedy(8)) == expected


def test_bf16_checkpoint_refuses_a_quantized_mtp_setting(checkpoints):
    for q in ("fp8", "nvfp4"):
        with pytest.raises(ConfigError, match="are not quantized"):
            engine(checkpoints["qwen3_5"], mtp_quantization=q)


def test_prompt_lookup_falls_back_to_the_head(checkpoints, plain):
    """--speculative --prompt-lookup-decoding on an MTP checkpoint: copies where the context
    repeats, the head's drafts in rounds without a copy (cut to the MTP's drafts per verify).
    The random hybrid model does not continue repeated phrases, so copies are looked up from
    one token back (n-gram 1): whenever the last token occurred before."""
    prompts = make_prompts(6, seed=12, lo=20, hi=50)
    params = greedy(30)
    expected = plain("qwen3_5", prompts, params)
    for batch in (1, 4):
        core = engine(checkpoints["qwen3_5"], max_batch_size=batch, prompt_lookup_decoding=True,
                      prompt_lookup_ngram=1, prompt_lookup_min_match=1)
        sp = core.speculation
        assert sp.method == "prompt-lookup+mtp" and isinstance(sp.drafter, PromptLookupDrafter)
        assert sp.drafter.fallback is sp.mtp and core.runner.keep_hidden
        head_drafts = []
        propose = sp.mtp.propose

        def recording(requests, limits, propose=propose):
            propose(requests, limits)
            head_drafts.extend(len(r.draft_token_ids) for r in requests if r.draft_token_ids)
        sp.mtp.propose = recording
        assert run(core, prompts, params) == expected
        assert head_drafts and max(head_drafts) <= sp.num_drafts
        assert sp.stats.draft_tokens > sum(head_drafts)      # copies were verified too
        _check_released(core)


def test_default_drafts_for_qwen3_5_and_the_ladder(checkpoints, monkeypatch):
    assert MTP_DEFAULT_DRAFTS == {"qwen3_5": 3, "qwen3_5_moe": 3}
    for arch in ARCHS:
        assert engine(checkpoints[arch]).speculation.num_drafts == 3
    assert engine(checkpoints["qwen3_5"], num_drafts=2).speculation.num_drafts == 2
    # the n-gram drafter takes precedence and keeps --num-drafts as given
    core = engine(checkpoints["qwen3_5"], ngram_speculative=True)
    assert core.speculation.method == "ngram" and core.speculation.num_drafts == 1
    assert core.speculation.mtp is None and not core.runner.keep_hidden

    class Other:
        config = {"model_type": "llama"}
    assert default_drafts(Other(), 1) == 1
    monkeypatch.setenv("METRALE_MTP_K_LADDER", "1:5,2:1")
    sp = engine(checkpoints["qwen3_5"]).speculation
    assert [sp.drafts_for_batch(n) for n in (1, 2, 3)] == [5, 1, 1]


def test_the_head_is_sized_with_the_kv_pool(checkpoints):
    """Without --num-kv-blocks the pool is sized from a budget: the head's KV and stored hidden
    per block count in it; the head's caches cover the main pool's blocks (+ its own)."""
    ckpt = checkpoints["qwen3_5"]
    core = engine(ckpt, kv_cache_memory_mb=1)
    sp = core.speculation
    head = core.model.mtp
    per = head.cache_spec().kv_bytes_per_block(BLOCK, core.ops.dtype) + head.hidden_size * 4
    assert sp.kv_bytes_per_block(BLOCK, core.ops.dtype) == per
    main = core.model.cache_spec().kv_bytes_per_block(BLOCK, core.ops.dtype)
    assert core._num_blocks == min(2**20 // (main + per),
                                   core.config.max_batch_size * -(-core.config.max_seq_len // BLOCK))
    assert sp.mtp.caches.num_blocks > core.caches.num_blocks
    plain_core = engine(ckpt, mtp=False, kv_cache_memory_mb=1)
    assert plain_core._num_blocks > core._num_blocks


def test_a_checkpoint_without_mtp_still_refuses_plain_speculative(tmp_path):
    path = make_tiny("qwen3_5", tmp_path / "plain", seed=1)
    with pytest.raises(ConfigError, match="no mtp"):
        engine(load_checkpoint(path))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tau", [0.0, "median"])
def test_the_chain_as_one_pass_drafts_the_same(arch, tau, checkpoints, plain):
    """The draft chain the CUDA chain graphs replay (metrale.spec.mtp._Chain: every step for
    every request, each reading the previous step's argmax from the device buffer), run
    eagerly over the same buffers on the CPU: every proposal equal to the oracle's, including
    chains cut by --draft-confidence-stop and by a request's head blocks running out."""
    from metrale.spec.mtp import _Chain

    prompts = make_prompts(6, seed=7)
    params = greedy(14)
    expected = plain(arch, prompts, params)
    stop = 0.0
    if tau == "median":         # a TAU inside the head's range: chains of several lengths
        probe = engine(checkpoints[arch])
        spy = spy_on(probe)
        run(probe, prompts, params)
        oracle = Oracle(probe)
        stop = float(np.median([p for _, toks, d, _ in spy.log
                                for _, p, _ in oracle.chain(toks, len(d))]))
    core = engine(checkpoints[arch], draft_confidence_stop=stop or None)
    spy = spy_on(core, ReplayDrafter(expected, 0.7, VOCAB, seed=3))
    head = core.speculation.mtp
    width = -(-core.config.max_seq_len // BLOCK) + 1
    head.chain = _Chain(head, [1, 2, 4], width, core._num_blocks)
    calls = []
    run_chain = head.chain.run
    head.chain.run = lambda todo, tables: calls.append(len(todo)) or run_chain(todo, tables)
    assert run(core, prompts, params, waves=2) == expected
    assert calls and max(calls) > 1
    check_drafts(core, spy, tau=stop)
