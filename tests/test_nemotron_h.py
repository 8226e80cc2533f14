"""Nemotron-H on the CPU backend against HF transformers' NemotronHForCausalLM (fp32), on tiny
random checkpoints (tests/tiny_models: Mamba-2 heads of 8 in 2 groups, a 16-token SSD chunk,
attention without rope, relu2 MLPs; the MoE variant with latent relu2 experts, a shared expert,
scaled sigmoid routing and biases everywhere). The common family checks (one-shot, prefill then
decode, chunked prefill at sizes off the SSD chunk, mixed batches, engine greedy with prefix-cache
hits) run in tests/test_family_logits.py; here: the SSD scan's forms against each other, the dt
clamp, the checkpoint layouts and config spellings, refusals, preemption (recompute and swap) and
prefix caching through the engine, speculative decoding (drafted and self-speculative), a 16-bit
state pool, and the refusal on a backend without the ops (CUDA). GGUF: tests/test_gguf_families.py.

Tolerance: 1e-4 relative to the largest logit, as every family (observed ~1e-6)."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import family_checks as fc
from family_checks import ops_without
from metrale.backends.cpu import CpuOps
from metrale.forward import contiguous_batch
from metrale.models.checkpoint import CheckpointError
from metrale.models.registry import build_model
from tiny_models import VOCAB, load_tiny, make_tiny_family, rewrite_config

PROMPT_LEN = 70


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_family("nemotron_h", tmp_path_factory.mktemp("nemotron_h"))


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    return make_tiny_family("nemotron_h_moe", tmp_path_factory.mktemp("nemotron_h_moe"))


@pytest.fixture(scope="module")
def prompt():
    return np.random.default_rng(1).integers(0, VOCAB, PROMPT_LEN).tolist()


@pytest.fixture(scope="module")
def ref(ckpt, prompt):
    return fc.reference(ckpt, prompt)


# -- the SSD scan: chunked, recurrent and verify forms agree ---------------------------------
def _scan_inputs(rng, t, h=6, p=4, g=3, n=5):
    x = rng.standard_normal((t, h, p)).astype(np.float32)
    dt = rng.standard_normal((t, h)).astype(np.float32)
    b, c = (rng.standard_normal((t, g, n)).astype(np.float32) for _ in range(2))
    params = dict(A_log=np.log(rng.uniform(0.5, 4, h)).astype(np.float32),
                  D=rng.standard_normal(h).astype(np.float32),
                  dt_bias=rng.standard_normal(h).astype(np.float32), dt_limit=(0.05, np.inf))
    return x, dt, b, c, params


def _scan(ops, inputs, rows, context, state, chunk, state_out=None):
    """ssd_scan of rows [lo, hi) of `inputs` as one sequence on slot 0, `context` tokens cached."""
    x, dt, b, c, params = inputs
    lo, hi = rows
    batch = contiguous_batch([list(range(hi - lo))], [context], [[0] * 64], [0], 16)
    batch.state_out = state_out
    return ops.ssd_scan(x[lo:hi], dt[lo:hi], b[lo:hi], c[lo:hi], ssm_state=state, batch=batch,
                        chunk_size=chunk, **params)


@pytest.mark.parametrize("chunk", [1, 3, 8, 64])
def test_the_chunked_scan_equals_the_recurrent_one(chunk):
    """One 37-token run in chunks of `chunk`, then 9 more tokens continuing from its state,
    against the same tokens fed one at a time (the decode form)."""
    ops, rng = CpuOps(), np.random.default_rng(0)
    inputs = _scan_inputs(rng, 46)
    state = np.full((1, 6, 4, 5), 9.0, np.float32)       # dirty: a fresh sequence ignores it
    y = np.concatenate([_scan(ops, inputs, (0, 37), 0, state, chunk),
                        _scan(ops, inputs, (37, 46), 37, state, chunk)])
    one = np.full((1, 6, 4, 5), 9.0, np.float32)
    steps = np.concatenate([_scan(ops, inputs, (i, i + 1), i, one, chunk) for i in range(46)])
    assert np.max(np.abs(y - steps)) <= 1e-5 * np.max(np.abs(steps))
    assert np.max(np.abs(state - one)) <= 1e-5 * np.max(np.abs(one))


def test_verify_rows_keep_the_state_after_each_token():
    ops, rng = CpuOps(), np.random.default_rng(1)
    inputs = _scan_inputs(rng, 12)
    state = np.zeros((6, 6, 4, 5), np.float32)
    _scan(ops, inputs, (0, 8), 0, state, 4)
    out = np.array([-1, 2, 3, 4], np.int32)               # keep the states after tokens 9, 10, 11
    y = _scan(ops, inputs, (8, 12), 8, state, 4, state_out=out)
    ref = np.zeros((1, 6, 4, 5), np.float32)
    _scan(ops, inputs, (0, 8), 0, ref, 4)
    for i, row in zip(range(8, 12), out):
        y_ref = _scan(ops, inputs, (i, i + 1), i, ref, 4)
        assert np.allclose(y[i - 8], y_ref[0], rtol=1e-5, atol=1e-6)
        if row >= 0:
            assert np.allclose(state[row], ref[0], rtol=1e-5, atol=1e-6)
    assert np.allclose(state[0], ref[0], rtol=1e-5, atol=1e-6)   # the working row ends at the window's end


# -- the model ----------------------------------------------------------------------------------
def test_the_dt_clamp_matches_hf_and_holds_in_every_form(tmp_path, prompt):
    """dt_bias near HF's own init (inverse softplus of dt in [1e-3, 0.1], here pushed lower) puts
    many heads under time_step_min: HF's chunked form clamps there; ours clamps in every form,
    so prefill-then-decode and small chunks equal the one-shot HF logits."""
    path = make_tiny_family("nemotron_h", tmp_path / "m", time_step_min=0.01)
    state = load_file(f"{path}/model.safetensors")
    rng = np.random.default_rng(3)
    for k in [k for k in state if k.endswith("dt_bias")]:
        state[k] = rng.uniform(-9, -2, state[k].shape).astype(np.float32)
    save_file(state, f"{path}/model.safetensors", metadata={"format": "pt"})
    ref = fc.reference(path, prompt)
    fc.check_one_shot(path, prompt, ref)
    fc.check_prefill_then_decode(path, prompt, ref)
    fc.check_chunked(path, prompt, ref, 5)
    rewrite_config(path, time_step_min=0.0)           # the clamp is live: without it, other logits
    h = fc.Harness(path)
    assert fc.rel_err(h.step([prompt], [0], [h.blocks_for(PROMPT_LEN)], [2]), ref) > 1e-3


def _transformers_layout(src: str, dst) -> str:
    """The checkpoint with transformers 5's in-memory names: `model.` for `backbone.`, the
    experts stacked as experts.up_proj [E, I, W] / experts.down_proj [E, W, I]."""
    shutil.copytree(src, dst)
    state = load_file(f"{src}/model.safetensors")
    out, experts = {}, {}
    for k, v in state.items():
        k = k.replace("backbone.", "model.", 1)
        head, sep, tail = k.partition(".experts.")
        if sep:
            e, name = tail.split(".", 1)
            experts.setdefault((head, name), {})[int(e)] = v
        else:
            out[k] = v
    for (head, name), per in experts.items():
        out[f"{head}.experts.{name.removesuffix('.weight')}"] = np.stack([per[e] for e in sorted(per)])
    save_file(out, f"{dst}/model.safetensors", metadata={"format": "pt"})
    return str(dst)


def test_the_transformers_layout_loads_like_the_release_layout(moe_ckpt, prompt, tmp_path):
    ref = fc.reference(moe_ckpt, prompt)
    fc.check_one_shot(_transformers_layout(moe_ckpt, tmp_path / "t5"), prompt, ref)


def test_the_hub_config_spelling_loads_the_same(ckpt, prompt, ref, tmp_path):
    """hybrid_override_pattern and the mamba_* names of the hub releases' config.json."""
    path = shutil.copytree(ckpt, tmp_path / "hub")
    config = json.load(open(f"{path}/config.json"))
    config.pop("layers_block_type")
    config["hybrid_override_pattern"] = "M-*M-M"
    for old, new in (("mamba_n_groups", "n_groups"), ("mamba_d_conv", "conv_kernel"),
                     ("mamba_chunk_size", "chunk_size")):
        config[old] = config.pop(new)
    json.dump(config, open(f"{path}/config.json", "w"))
    fc.check_one_shot(str(path), prompt, ref)


def test_the_moe_routing_bias_and_scale_are_live(moe_ckpt, prompt, tmp_path):
    ref = fc.reference(moe_ckpt, prompt)
    path = shutil.copytree(moe_ckpt, tmp_path / "scaled")
    rewrite_config(path, routed_scaling_factor=1.0)
    h = fc.Harness(path)
    assert fc.rel_err(h.step([prompt], [0], [h.blocks_for(PROMPT_LEN)], [2]), ref) > 1e-2


def test_cache_spec_holds_the_mamba_and_attention_blocks_only(ckpt):
    from metrale.cache.kv import AttentionSpec, Mamba2Spec

    model = build_model(load_tiny(ckpt), CpuOps())
    spec = model.cache_spec()
    assert [type(s) for s in spec.layers] == [Mamba2Spec, AttentionSpec, Mamba2Spec, Mamba2Spec]
    assert spec.gdn_layers == [0, 2, 3]
    m = spec.layers[0]       # conv over x|B|C (64 + 2 * 2 * 16), state [8 heads, 8, 16]
    assert (m.conv_dim, m.kernel_size, m.n_v_heads, m.head_k_dim, m.head_v_dim) == (128, 4, 8, 8, 16)
    assert len(model.layers) == 6


def test_dummy_weights_build_and_run(moe_ckpt):
    """--load-format dummy (benchmarks of real shapes): the builder gets every tensor it asks for."""
    from metrale.cache.kv import ModelCaches
    from metrale.models.dummy import dummy_from

    ops = CpuOps()
    model = build_model(dummy_from(load_tiny(moe_ckpt), "cpu"), ops)
    caches = ModelCaches(model.cache_spec(), ops, 8, 16, 2)
    batch = contiguous_batch([list(range(1, 20))], [0], [[0, 1]], [1], 16)
    logits = model.forward(batch, caches)
    assert logits.shape == (1, VOCAB) and np.isfinite(logits).all()


@pytest.mark.parametrize("changes, message", [
    (dict(mamba_hidden_act="gelu"), "mamba_hidden_act 'gelu'"),
    (dict(mlp_hidden_act="silu"), "mlp_hidden_act 'silu'"),
    (dict(layers_block_type=None, hybrid_override_pattern="M-X"), "hybrid_override_pattern"),
    (dict(layers_block_type=["mamba", "conv"]), "layers_block_type has \\['conv'\\]"),
    (dict(mamba_num_heads=6), "mamba_num_heads 6 must be a multiple of n_groups 4"),
])
def test_unsupported_settings_are_refused_naming_the_field(tmp_path, changes, message):
    path = make_tiny_family("nemotron_h", tmp_path / "m")
    if "mamba_num_heads" in changes:
        changes = dict(changes, n_groups=4)
    rewrite_config(path, **changes)
    with pytest.raises(CheckpointError, match=message):
        build_model(load_tiny(path), CpuOps())


def test_group_limited_routing_is_refused(tmp_path):
    path = make_tiny_family("nemotron_h_moe", tmp_path / "m")
    rewrite_config(path, n_group=2, topk_group=1)
    with pytest.raises(CheckpointError, match="n_group 2 with topk_group 1"):
        build_model(load_tiny(path), CpuOps())


def test_tool_parser_default():
    from metrale.api.tool_parsers import default_tool_parser

    assert default_tool_parser("nemotron_h") == "qwen3_coder"


# -- the backend without the ops (CUDA) ---------------------------------------------------------
MAMBA_OPS = ("causal_conv1d_bias", "ssd_scan", "group_rms_norm_gated", "relu2", "moe_topk_relu2")


def _CommonOpsOnly():
    """A backend with the common ops only (as the CUDA backend is today)."""
    return ops_without(*MAMBA_OPS, "route_topk", "moe_topk")


def test_backend_without_the_ops_refuses_at_load(moe_ckpt):
    with pytest.raises(CheckpointError) as err:
        build_model(load_tiny(moe_ckpt), _CommonOpsOnly())
    text = str(err.value)
    assert "nemotron_h needs" in text and "the Mamba-2 selective scan (SSD) (ops.ssd_scan)" in text
    assert "non-gated squared-ReLU MoE experts" in text
    assert "cuda kernels do not implement yet" in text and "--device cpu" in text


def test_the_real_cuda_backend_lacks_the_ops():
    """What the refusal keys on: CudaOps (imported without a GPU) has none of the Mamba-2 ops."""
    cuda_ops = pytest.importorskip("metrale.backends.cuda.ops")
    cls = next(c for n, c in vars(cuda_ops).items() if n.endswith("Ops") and isinstance(c, type)
               and hasattr(c, "attention"))
    assert not any(hasattr(cls, op) for op in MAMBA_OPS)


# -- through the engine: prefix cache with state snapshots, preemption, speculation -------------
ARCHS = ("nemotron_h", "nemotron_h_moe")


@pytest.fixture(scope="module")
def checkpoints(ckpt, moe_ckpt):
    from metrale.models.loader import load_checkpoint

    return {"nemotron_h": load_checkpoint(ckpt), "nemotron_h_moe": load_checkpoint(moe_ckpt)}


@pytest.fixture(scope="module")
def expected(checkpoints):
    """Each request of test_engine_cache.prompts() alone through a plain engine."""
    import test_engine_cache as ec

    ps = ec.prompts()
    return {arch: ec.run(ec.engine(c), [{k: v} for k, v in ps.items()]) for arch, c in checkpoints.items()}


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_cache_hits_resume_from_state_snapshots(arch, checkpoints, expected):
    import test_engine_cache as ec

    ps = ec.prompts()
    warm = ec.engine(checkpoints[arch], enable_prefix_caching=True)
    assert ec.run(warm, ec.split(ps, ["system", "other", "shared13"])) == expected[arch]
    cache = warm.scheduler.prefix_cache
    assert cache.num_hits >= 8 and cache.num_tokens_saved >= 8 * 8
    assert cache.snapshots.num_snapshots > 0


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("prefix", [False, True])
def test_preemption_by_recompute_gives_the_same_tokens(arch, prefix, checkpoints, expected):
    import test_engine_cache as ec

    core = ec.engine(checkpoints[arch], enable_prefix_caching=prefix, num_kv_blocks=18)
    assert ec.run(core, [ec.prompts()]) == expected[arch]
    assert core.scheduler.num_preemptions > 0


def test_preemption_by_swapping_gives_the_same_tokens(checkpoints, expected):
    import test_engine_cache as ec

    core = ec.engine(checkpoints["nemotron_h"], num_kv_blocks=18, swap_space_gb=1.0)
    swap = ec.with_swap(core)
    assert ec.run(core, [ec.prompts()]) == expected["nemotron_h"]
    assert swap.num_swap_outs == swap.num_swap_ins == core.scheduler.num_preemptions > 0


@pytest.fixture(scope="module")
def spec_expected(checkpoints):
    import test_speculative as sp

    prompts, params = sp.make_prompts(7, seed=1), sp.greedy(14)
    return prompts, params, {arch: sp.run(sp.engine(c), prompts, params) for arch, c in checkpoints.items()}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("p", [0.0, 0.6, 1.0])
def test_speculative_greedy_output_is_the_target_s(arch, p, checkpoints, spec_expected):
    """Drafts verified as extra rows, the Mamba-2 states restored to the accepted prefix from
    the verify rows (ForwardBatch.state_out): greedy output equals the plain run's at any
    acceptance (tests/test_speculative.py's check for Qwen3.5)."""
    import test_speculative as sp

    prompts, params, expected = spec_expected
    core = sp.with_replay(sp.engine(checkpoints[arch], drafts=4), expected[arch], p)
    assert sp.run(core, prompts, params, waves=3) == expected[arch]
    st = core.speculation.stats
    assert st.num_verifies > 0 and st.draft_tokens > 0
    assert (st.accepted_tokens == st.draft_tokens) if p == 1.0 else (st.accepted_tokens < st.draft_tokens)


def test_speculation_with_prefix_snapshots_chunked_prefill_and_preemption(checkpoints):
    import test_speculative as sp

    prompts, params = sp.make_prompts(6, seed=4, lo=12, hi=40), sp.greedy(16)
    expected = sp.run(sp.engine(checkpoints["nemotron_h"]), prompts, params)
    core = sp.with_replay(sp.engine(checkpoints["nemotron_h"], drafts=3, enable_prefix_caching=True,
                                    max_prefill_tokens=7), expected, 0.7)
    assert sp.run(core, prompts, params, waves=3) == expected
    again = sp.run(core, {f"{k}-2": v for k, v in prompts.items()}, params)
    assert again == {f"{k}-2": v for k, v in expected.items()}
    cache = core.scheduler.prefix_cache
    assert cache.num_hits > 0 and cache.snapshots.num_snapshots > 0
    tight = sp.with_replay(sp.engine(checkpoints["nemotron_h"], drafts=4, num_kv_blocks=18), expected, 0.7)
    assert sp.run(tight, prompts, params, waves=1) == expected
    assert tight.scheduler.num_preemptions > 0


def test_self_speculation_with_no_layer_skipped_keeps_the_greedy_output(checkpoints, spec_expected,
                                                                        monkeypatch):
    """--self-speculative with every block kept: its draft chains run the Mamba-2 blocks from
    scratch state rows, so the drafts are the target's greedy continuation and nearly all kept."""
    import test_speculative as sp

    monkeypatch.setenv("METRALE_SELF_SPEC_SKIP", "none")
    prompts, params, expected = spec_expected
    core = sp.engine(checkpoints["nemotron_h"], self_speculative=True, num_drafts=4, max_batch_size=2)
    assert sp.run(core, prompts, params, waves=2) == expected["nemotron_h"]
    st = core.speculation.stats
    assert st.accepted_tokens >= 0.95 * st.draft_tokens > 0


@pytest.mark.parametrize("pool, bound", [("f16-pool", 3e-3), ("bf16-pool", 2.5e-2)])
def test_a_16bit_state_pool_stays_close_to_hf(ckpt, prompt, ref, pool, bound):
    """--ssm-h-dtype: the Mamba-2 states rounded to 16 bits between steps (chunks of 7, then
    decode), within tests/test_ssm_pool_dtype.py's bounds for GDN."""
    from metrale.cache.kv import ModelCaches
    from metrale.config import ssm_pool_dtype

    ops = CpuOps()
    model = build_model(load_tiny(ckpt), ops)
    caches = ModelCaches(model.cache_spec(), ops, 16, 16, 3, ssm_dtype=ssm_pool_dtype(pool))
    assert caches.state(0)[1].dtype == ssm_pool_dtype(pool)
    outs, pos = [], 0
    for n in [7] * 6 + [1] * 18:
        batch = contiguous_batch([prompt[pos:pos + n]], [pos], [list(range(5))], [1], 16, True)
        outs.append(model.forward(batch, caches))
        pos += n
    assert fc.rel_err(np.concatenate(outs), ref[:pos]) <= bound
