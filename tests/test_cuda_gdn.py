"""GPU tests of the Gated DeltaNet and MoE kernels (metrale/backends/cuda/gdn.py, moe.py) against the CPU
backend (the executable spec) and HF's torch reference (torch_chunk_gated_delta_rule).

Inputs are random, batches ragged across chunk boundaries (1, 63, 64, 65, 200 tokens) with and
without cached context, outputs NaN-poisoned (METRALE_CUDA_POISON=1), the state rows of fresh
sequences filled with garbage (they must be ignored). bf16 outputs: relative error <= 1e-2;
fp32 paths and the fp32 state tighter. Verify steps (ForwardBatch.state_out) are checked against
the CPU spec and, bit for bit, against the same tokens run as single-token decode steps.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

os.environ.setdefault("METRALE_CUDA_POISON", "1")

LENS = [1, 63, 64, 65, 200]
CTXS = [0, 7, 3, 0, 12]


def _rel(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    assert np.isfinite(a).all(), "non-finite values in the CUDA result (unwritten output?)"
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.fixture(scope="module")
def cuda_ops():
    from metrale.backends.cuda import BF16, CudaOps
    return {"bf16": CudaOps(dtype=BF16), "f32": CudaOps(dtype=np.float32)}


@pytest.fixture(scope="module")
def cpu():
    from metrale.backends.cpu import CpuOps
    return CpuOps()


def _batch(lens, ctxs, slots):
    from metrale.forward import contiguous_batch
    toks = [[1] * n for n in lens]
    tables = [list(range((c + n) // 16 + 1)) for n, c in zip(lens, ctxs)]  # GDN ignores KV blocks
    return contiguous_batch(toks, ctxs, tables, slots, block_size=16)


def _round(ops, x):
    """Host values rounded through the device dtype (so CPU and GPU see the same inputs)."""
    return ops.to_numpy(ops.asarray(x)).astype(np.float32)


def _garbage_fresh_rows(state, batch, rng):
    for i in range(batch.num_seqs):
        if batch.context_lens[i] == 0:
            state[batch.state_slots[i]] = rng.standard_normal(state.shape[1:]) * 100


# -- causal conv1d ----------------------------------------------------------------------------

@pytest.mark.parametrize("dt", ["bf16", "f32"])
@pytest.mark.parametrize("state_f32", [False, True])
@pytest.mark.parametrize("case", ["prefill", "decode", "strided"])
def test_causal_conv1d(cuda_ops, cpu, dt, state_f32, case):
    import cupy as cp
    ops = cuda_ops[dt]
    if dt == "f32" and not state_f32:
        pytest.skip("fp32 activations keep an fp32 state")
    rng = np.random.default_rng(0)
    C, K = 200, 4
    lens, ctxs = (LENS, CTXS) if case != "decode" else ([1] * 7, [5, 0, 1, 2, 9, 3, 0])
    slots = list(range(len(lens) * 2 - 1, -1, -2))
    batch = _batch(lens, ctxs, slots)
    T = batch.num_tokens
    x = _round(ops, rng.standard_normal((T, C)))
    w = _round(ops, rng.standard_normal((C, K)) * 0.5)
    st_dtype = np.float32 if state_f32 else ops.dtype
    state0 = rng.standard_normal((2 * len(lens), C, K - 1)).astype(np.float32)
    _garbage_fresh_rows(state0, batch, rng)
    state0 = ops.to_numpy(ops.asarray(state0, dtype=st_dtype)).astype(np.float32)

    ref_state = state0.copy()
    ref = cpu.causal_conv1d(x, w, ref_state, batch)

    d_state = ops.asarray(state0, dtype=st_dtype)
    if case == "strided":  # x as a column slice of a wider projection
        wide = ops.asarray(np.concatenate([x, rng.standard_normal((T, 24)).astype(np.float32)], 1))
        d_x = wide[:, :C]
    else:
        d_x = ops.asarray(x)
    out = ops.causal_conv1d(d_x, ops.asarray(w), d_state, ops.upload_batch(batch))
    cp.cuda.Device().synchronize()
    tol = 1e-2 if dt == "bf16" else 1e-5
    assert _rel(ops.to_numpy(out), ref) < tol
    got_state = ops.to_numpy(d_state).astype(np.float32)
    for i in range(batch.num_seqs):
        s = batch.state_slots[i]
        assert _rel(got_state[s], ref_state[s]) < (1e-2 if st_dtype != np.float32 else 1e-6), i
    untouched = sorted(set(range(state0.shape[0])) - set(slots))
    np.testing.assert_array_equal(got_state[untouched], state0[untouched])


# -- gates and gated norm ---------------------------------------------------------------------

@pytest.mark.parametrize("dt", ["bf16", "f32"])
def test_gdn_gates(cuda_ops, cpu, dt):
    ops = cuda_ops[dt]
    rng = np.random.default_rng(1)
    T, Hv = 333, 48
    a = _round(ops, rng.standard_normal((T, Hv)) * 4)
    b = _round(ops, rng.standard_normal((T, Hv)) * 4)
    a[0, 0] = 30.0  # softplus threshold branch
    A_log = np.log(rng.uniform(0.01, 16, Hv)).astype(np.float32)
    dt_bias = rng.standard_normal(Hv).astype(np.float32)
    g_ref, b_ref = cpu.gdn_gates(a, b, A_log, dt_bias)
    g, beta = ops.gdn_gates(ops.asarray(a), ops.asarray(b), ops.asarray(A_log, np.float32),
                            ops.asarray(dt_bias, np.float32))
    assert g.dtype == np.float32 and beta.dtype == np.float32
    assert _rel(ops.to_numpy(g), g_ref) < 1e-5
    assert _rel(ops.to_numpy(beta), b_ref) < 1e-5
    # bf16 weights too (converted once inside)
    g2, _ = ops.gdn_gates(ops.asarray(a), ops.asarray(b), ops.asarray(A_log), ops.asarray(dt_bias))
    assert _rel(ops.to_numpy(g2), g_ref) < 2e-2


@pytest.mark.parametrize("dt", ["bf16", "f32"])
@pytest.mark.parametrize("D", [16, 128, 96])
def test_gated_rms_norm(cuda_ops, cpu, dt, D):
    ops = cuda_ops[dt]
    rng = np.random.default_rng(2)
    x = _round(ops, rng.standard_normal((77, 5, D)))
    z = _round(ops, rng.standard_normal((77, 5, D)))
    w = _round(ops, rng.standard_normal(D))
    ref = cpu.gated_rms_norm(x, z, w, 1e-6)
    out = ops.gated_rms_norm(ops.asarray(x), ops.asarray(z), ops.asarray(w), 1e-6)
    assert out.shape == x.shape
    assert _rel(ops.to_numpy(out), ref) < (1e-2 if dt == "bf16" else 1e-5)
    # z as the model passes it: a column slice of a wider projection, [T, H, D] with a token
    # stride of its own (read in place) -- the same result
    wide = np.concatenate([_round(ops, rng.standard_normal((77, 3))), z.reshape(77, 5 * D),
                           _round(ops, rng.standard_normal((77, 7)))], axis=1)
    z_view = ops.asarray(wide)[:, 3: 3 + 5 * D].reshape(77, 5, D)
    assert z_view.strides[0] != 5 * D * z_view.itemsize
    out2 = ops.gated_rms_norm(ops.asarray(x), z_view, ops.asarray(w), 1e-6)
    np.testing.assert_array_equal(ops.to_numpy(out2), ops.to_numpy(out))


# -- gated delta rule -------------------------------------------------------------------------

def _gdn_inputs(ops, rng, T, Hk, Hv, Dk, Dv):
    q = _round(ops, rng.standard_normal((T, Hk, Dk)))
    k = _round(ops, rng.standard_normal((T, Hk, Dk)))
    v = _round(ops, rng.standard_normal((T, Hv, Dv)))
    g = (-np.exp(rng.uniform(-3, 1, (T, Hv)))).astype(np.float32)   # includes strong decay
    g[::17] = -40.0                                                 # exp(-40) underflows chunkwise
    beta = rng.uniform(0, 1, (T, Hv)).astype(np.float32)
    return q, k, v, g, beta


def _run_gdn(ops, cpu, dims, lens, ctxs, seed, strided=False, tol_o=1e-2, tol_s=2e-3,
             pool=np.float32):
    """`pool`: the state pool's dtype (fp32, or f16 / bf16 for --ssm-h-dtype); the CPU runs on
    a pool of the same dtype, so both round the state at the same points."""
    import cupy as cp
    Hk, Hv, Dk, Dv = dims
    rng = np.random.default_rng(seed)
    slots = [2 * i + 1 for i in range(len(lens))]
    batch = _batch(lens, ctxs, slots)
    T = batch.num_tokens
    q, k, v, g, beta = _gdn_inputs(ops, rng, T, Hk, Hv, Dk, Dv)
    state0 = (rng.standard_normal((2 * len(lens) + 1, Hv, Dk, Dv)) * 0.3).astype(pool)
    _garbage_fresh_rows(state0, batch, rng)
    ref_state = state0.copy()
    ref = cpu.gated_delta_rule(q, k, v, g, beta, ref_state, batch)

    d_state = cp.asarray(state0)
    if strided:  # q, k, v as slices of one [T, 2*Hk*Dk + Hv*Dv] projection (the model's layout)
        mixed = ops.asarray(np.concatenate([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], 1))
        kd = Hk * Dk
        dq = mixed[:, :kd].reshape(T, Hk, Dk)
        dk = mixed[:, kd:2 * kd].reshape(T, Hk, Dk)
        dv = mixed[:, 2 * kd:].reshape(T, Hv, Dv)
    else:
        dq, dk, dv = ops.asarray(q), ops.asarray(k), ops.asarray(v)
    out = ops.gated_delta_rule(dq, dk, dv, cp.asarray(g), cp.asarray(beta), d_state,
                               ops.upload_batch(batch))
    cp.cuda.Device().synchronize()
    got = ops.to_numpy(out).astype(np.float32)
    assert got.shape == (T, Hv, Dv)
    for i in range(batch.num_seqs):
        rows = slice(batch.query_start_loc[i], batch.query_start_loc[i + 1])
        assert _rel(got[rows], ref[rows]) < tol_o, f"seq {i} len {lens[i]} ctx {ctxs[i]}"
    gs = d_state.get()
    assert gs.dtype == np.dtype(pool)
    for i in range(batch.num_seqs):
        s = slots[i]
        assert _rel(gs[s].astype(np.float32), ref_state[s].astype(np.float32)) < tol_s, f"state of seq {i}"
    np.testing.assert_array_equal(gs[0::2].view(np.uint8), state0[0::2].view(np.uint8))  # rows nobody owns stay untouched


DIMS = [(2, 4, 128, 128), (1, 3, 64, 64), (2, 2, 32, 32), (1, 2, 16, 16), (2, 4, 64, 128),
        (2, 4, 128, 64)]


@pytest.mark.parametrize("dims", DIMS)
def test_gated_delta_rule_prefill_bf16(cuda_ops, cpu, dims):
    _run_gdn(cuda_ops["bf16"], cpu, dims, LENS, CTXS, seed=3)


@pytest.mark.parametrize("dims", [(2, 4, 128, 128), (1, 2, 16, 16)])
def test_gated_delta_rule_prefill_f32(cuda_ops, cpu, dims):
    _run_gdn(cuda_ops["f32"], cpu, dims, LENS, CTXS, seed=4, tol_o=1e-4, tol_s=1e-4)


def test_gated_delta_rule_strided_qkv(cuda_ops, cpu):
    _run_gdn(cuda_ops["bf16"], cpu, (2, 4, 128, 128), [65, 3], [0, 9], seed=5, strided=True)


@pytest.mark.parametrize("dims", DIMS)
@pytest.mark.parametrize("dt", ["bf16", "f32"])
def test_gated_delta_rule_decode(cuda_ops, cpu, dims, dt):
    # every sequence adds one token: the recurrent kernel; one of them starts fresh
    tol = (1e-2, 1e-3) if dt == "bf16" else (1e-5, 1e-5)
    _run_gdn(cuda_ops[dt], cpu, dims, [1] * 6, [4, 0, 1, 30, 2, 7], seed=6,
             tol_o=tol[0], tol_s=tol[1])


@pytest.mark.parametrize("dims", [(2, 4, 128, 128), (1, 3, 64, 64), (2, 4, 64, 128)])
@pytest.mark.parametrize("dt", ["bf16", "f32"])
@pytest.mark.parametrize("lens", [[1] * 5, [3, 1, 2]])
def test_gated_delta_rule_with_gates(cuda_ops, cpu, dims, dt, lens):
    """The fused decode kernel (gates computed inside) == gdn_gates + gated_delta_rule bit for
    bit, output and state, with a and b read in place as columns of one projection (the model's
    layout), a fresh sequence among them; a prefill batch takes the two kernels; both match the
    CPU's composition."""
    import cupy as cp
    ops = cuda_ops[dt]
    Hk, Hv, Dk, Dv = dims
    rng = np.random.default_rng(40 + Hv + Dk)
    ctxs = [5, 0, 12, 1, 9][:len(lens)]
    slots = [2 * i + 1 for i in range(len(lens))]
    batch = _batch(lens, ctxs, slots)
    T = batch.num_tokens
    q, k, v, _, _ = _gdn_inputs(ops, rng, T, Hk, Hv, Dk, Dv)
    # [x | a | y | b | z] columns, as in the input projection
    proj = _round(ops, np.concatenate([rng.standard_normal((T, 3)), rng.standard_normal((T, Hv)) * 2,
                                       rng.standard_normal((T, 5)), rng.standard_normal((T, Hv)),
                                       rng.standard_normal((T, 7))], 1))
    A_log = rng.uniform(-1, 1, Hv).astype(np.float32)
    dt_bias = rng.uniform(-1, 1, Hv).astype(np.float32)
    state0 = (rng.standard_normal((2 * len(lens) + 1, Hv, Dk, Dv)) * 0.3).astype(np.float32)
    _garbage_fresh_rows(state0, batch, rng)
    dproj = ops.asarray(proj)
    da, db = dproj[:, 3:3 + Hv], dproj[:, 8 + Hv:8 + 2 * Hv]
    dev = ops.upload_batch(batch)
    args = [ops.asarray(x) for x in (q, k, v)]
    s_fused, s_two = cp.asarray(state0), cp.asarray(state0)
    fused = ops.gated_delta_rule_with_gates(*args, da, db, cp.asarray(A_log), cp.asarray(dt_bias),
                                            s_fused, dev)
    g, beta = ops.gdn_gates(da, db, cp.asarray(A_log), cp.asarray(dt_bias))
    two = ops.gated_delta_rule(*args, g, beta, s_two, dev)
    assert ops.to_numpy(fused).tobytes() == ops.to_numpy(two).tobytes()
    assert s_fused.get().tobytes() == s_two.get().tobytes()
    ref_state = state0.copy()
    ref = cpu.gated_delta_rule_with_gates(q, k, v, proj[:, 3:3 + Hv], proj[:, 8 + Hv:8 + 2 * Hv], A_log,
                                          dt_bias, ref_state, batch)
    tol = (1e-2, 2e-3) if dt == "bf16" else (1e-5, 1e-5)
    assert _rel(ops.to_numpy(fused).astype(np.float32), ref) < tol[0]
    for s in slots:
        assert _rel(s_fused.get()[s], ref_state[s]) < tol[1]


@pytest.mark.parametrize("pool", ["f16", "bf16"])
@pytest.mark.parametrize("case", ["decode", "prefill"])
@pytest.mark.parametrize("dims", [(2, 4, 128, 128), (1, 3, 64, 64), (2, 4, 64, 128)])
def test_gated_delta_rule_16bit_state_pool(cuda_ops, cpu, dims, case, pool):
    """--ssm-h-dtype f16-pool / bf16-pool: the kernels read and write a 16-bit pool (fp32
    inside), against the CPU on a pool of the same dtype; rows nobody owns stay untouched."""
    import ml_dtypes
    dt = np.float16 if pool == "f16" else ml_dtypes.bfloat16
    lens, ctxs = ([1] * 6, [4, 0, 1, 30, 2, 7]) if case == "decode" else (LENS, CTXS)
    # a state rounded to 16 bits once per step: the state rel error is that rounding (f16 ~5e-4,
    # bf16 ~4e-3 per element, on both sides independently)
    _run_gdn(cuda_ops["bf16"], cpu, dims, lens, ctxs, seed=7, tol_o=1.5e-2,
             tol_s=2e-3 if pool == "f16" else 1e-2, pool=dt)


def test_gated_delta_rule_decode_steps_match_prefill(cuda_ops):
    """Prefill 100 tokens in one go == prefill 37 then 63 decode steps (fp32)."""
    import cupy as cp
    from metrale.backends.cuda import gdn
    ops = cuda_ops["f32"]
    rng = np.random.default_rng(7)
    Hk, Hv, Dk, Dv = 2, 4, 128, 128
    T = 100
    q, k, v, g, beta = _gdn_inputs(ops, rng, T, Hk, Hv, Dk, Dv)
    s1 = cp.zeros((1, Hv, Dk, Dv), cp.float32)
    o1 = ops.gated_delta_rule(*map(cp.asarray, (q, k, v, g, beta)), s1,
                              ops.upload_batch(_batch([T], [0], [0])))
    s2 = cp.zeros((1, Hv, Dk, Dv), cp.float32)
    parts = [ops.gated_delta_rule(*(cp.asarray(a[:37]) for a in (q, k, v, g, beta)), s2,
                                  ops.upload_batch(_batch([37], [0], [0])))]
    for t in range(37, T):
        parts.append(ops.gated_delta_rule(*(cp.asarray(a[t:t + 1]) for a in (q, k, v, g, beta)),
                                          s2, ops.upload_batch(_batch([1], [t], [0]))))
    o2 = cp.concatenate(parts)
    assert _rel(o2.get(), o1.get()) < 1e-4
    assert _rel(s2.get(), s1.get()) < 1e-4
    # the recurrent kernel over a whole multi-token batch agrees with the chunked one
    s3 = cp.zeros((1, Hv, Dk, Dv), cp.float32)
    o3 = gdn.recurrent_gated_delta_rule(ops, *map(cp.asarray, (q, k, v, g, beta)), s3,
                                             ops.upload_batch(_batch([T], [0], [0])))
    assert _rel(o3.get(), o1.get()) < 1e-4
    assert _rel(s3.get(), s1.get()) < 1e-4


@pytest.mark.parametrize("T,with_state", [(200, True), (64, False), (1, True), (130, False)])
def test_gated_delta_rule_vs_hf_torch(cuda_ops, T, with_state):
    """Against HF's torch_chunk_gated_delta_rule run by torch on the GPU (k heads repeated)."""
    torch = pytest.importorskip("torch")
    hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    import cupy as cp
    ops = cuda_ops["bf16"]
    rng = np.random.default_rng(8)
    Hk, Hv, Dk, Dv = 16, 48, 128, 128  # Qwen3.5-27B GDN heads
    q, k, v, g, beta = _gdn_inputs(ops, rng, T, Hk, Hv, Dk, Dv)
    state0 = (rng.standard_normal((1, Hv, Dk, Dv)) * 0.3).astype(np.float32)
    dev = torch.device("cuda")
    tq, tk, tv = (torch.tensor(a, device=dev).to(torch.bfloat16)[None] for a in (q, k, v))
    rep = Hv // Hk
    tq, tk = tq.repeat_interleave(rep, dim=2), tk.repeat_interleave(rep, dim=2)
    ref_o, ref_s = hf.torch_chunk_gated_delta_rule(
        tq, tk, tv, g=torch.tensor(g, device=dev)[None], beta=torch.tensor(beta, device=dev)[None],
        initial_state=torch.tensor(state0, device=dev) if with_state else None,
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    ref_o = ref_o[0].float().cpu().numpy()
    ref_s = ref_s[0].float().cpu().numpy()
    d_state = cp.asarray(state0)
    out = ops.gated_delta_rule(ops.asarray(q), ops.asarray(k), ops.asarray(v), cp.asarray(g),
                               cp.asarray(beta), d_state,
                               ops.upload_batch(_batch([T], [5 if with_state else 0], [0])))
    assert _rel(ops.to_numpy(out), ref_o) < 1e-2
    assert _rel(d_state.get()[0], ref_s) < 2e-3


def test_gated_delta_rule_empty_sequence(cuda_ops, cpu):
    """A sequence with no new tokens in the batch leaves its state alone."""
    _run_gdn(cuda_ops["bf16"], cpu, (2, 4, 64, 64), [5, 0, 70], [0, 3, 2], seed=9)


# -- speculative verify steps (ForwardBatch.state_out) ----------------------------------------
# Windows of 1..8 tokens, ragged, one sequence fresh (context 0, garbage in its row); the state
# after each token lands in a row of its own except every third token's (-1: nothing written).
# The rows that receive a state start as NaN (a save left out shows as non-finite).

VERIFY_LENS = [3, 6, 8, 1, 2, 5]
VERIFY_CTXS = [7, 0, 12, 1, 30, 64]


def _verify_batch(lens=VERIFY_LENS, ctxs=VERIFY_CTXS):
    """(batch with state_out, working slots, pool rows): working rows 1, 3, .., 2B-1; token t
    saves into row 2B+1+t (or -1); the even rows and the rows of -1 tokens are nobody's."""
    B = len(lens)
    slots = [2 * i + 1 for i in range(B)]
    batch = _batch(lens, ctxs, slots)
    T = batch.num_tokens
    t = np.arange(T)
    batch.state_out = np.where(t % 3 == 1, -1, 2 * B + 1 + t).astype(np.int32)
    return batch, slots, 2 * B + 1 + T


def _decode_steps(batch, slots):
    """The verify window's tokens as single-token decode steps: step j carries token j of each
    window longer than j -> [(sequences, their token rows in the verify batch, decode batch)]."""
    qsl, lens = batch.query_start_loc, batch.query_lens
    steps = []
    for j in range(int(lens.max())):
        seqs = [i for i in range(batch.num_seqs) if lens[i] > j]
        steps.append((seqs, np.array([qsl[i] + j for i in seqs]),
                      _batch([1] * len(seqs), [int(batch.context_lens[i]) + j for i in seqs],
                             [slots[i] for i in seqs])))
    return steps


def _bits(a):
    return np.ascontiguousarray(a).view(np.uint8)


def _saved_rows(batch):
    return sorted(int(r) for r in batch.state_out if r >= 0)


def _untouched_rows(batch, slots, nrows):
    return sorted(set(range(nrows)) - set(_saved_rows(batch)) - set(slots))


@pytest.mark.parametrize("dt,state_dt", [("bf16", "bf16"), ("bf16", "f32"), ("f32", "f32")])
@pytest.mark.parametrize("windows", ["verify", "long"])
def test_causal_conv1d_verify_window(cuda_ops, cpu, dt, state_dt, windows):
    """state_out: the window after each token with a row >= 0 lands in that row, equal to the
    CPU spec's (a window is inputs: exact); rows of -1 tokens and rows nobody owns stay as
    they were; outputs, working rows and saved windows are bit for bit those of the same tokens
    run as single-token decode steps. "long": a 130-token window, so threads of later segments
    (64 tokens each) save too, while the first one still holds the old window."""
    import cupy as cp
    ops = cuda_ops[dt]
    rng = np.random.default_rng(50)
    C, K = 200, 4
    batch, slots, nrows = _verify_batch() if windows == "verify" else _verify_batch([3, 130, 1], [7, 0, 12])
    T = batch.num_tokens
    x = _round(ops, rng.standard_normal((T, C)))
    w = _round(ops, rng.standard_normal((C, K)) * 0.5)
    st_dtype = np.float32 if state_dt == "f32" else ops.dtype
    state0 = rng.standard_normal((nrows, C, K - 1)).astype(np.float32)
    _garbage_fresh_rows(state0, batch, rng)
    state0[_saved_rows(batch)] = np.nan
    state0 = ops.to_numpy(ops.asarray(state0, dtype=st_dtype)).astype(np.float32)

    ref_state = state0.copy()
    ref = cpu.causal_conv1d(x, w, ref_state, batch)
    d_state = ops.asarray(state0, dtype=st_dtype)
    dw = ops.asarray(w)
    dev = ops.upload_batch(batch)
    assert dev.state_out.dtype == np.int32
    out = ops.causal_conv1d(ops.asarray(x), dw, d_state, dev)
    cp.cuda.Device().synchronize()
    got_out = ops.to_numpy(out)
    assert _rel(got_out, ref) < (1e-2 if dt == "bf16" else 1e-5)
    got = ops.to_numpy(d_state).astype(np.float32)
    for t, row in enumerate(batch.state_out):
        if row >= 0:
            np.testing.assert_array_equal(got[row], ref_state[row], err_msg=f"window after token {t}")
    np.testing.assert_array_equal(got[slots], ref_state[slots])
    untouched = _untouched_rows(batch, slots, nrows)
    np.testing.assert_array_equal(got[untouched], state0[untouched])

    # the same tokens as decode steps (CUDA): the same bits
    d_dec = ops.asarray(state0, dtype=st_dtype)
    dec_out = np.empty_like(got_out)
    snaps = {}
    for seqs, rows, b in _decode_steps(batch, slots):
        dec_out[rows] = ops.to_numpy(ops.causal_conv1d(ops.asarray(x[rows]), dw, d_dec, ops.upload_batch(b)))
        for i, t in zip(seqs, rows):
            snaps[int(t)] = ops.to_numpy(d_dec[slots[i]])
    np.testing.assert_array_equal(_bits(got_out), _bits(dec_out))
    got_raw = ops.to_numpy(d_state)
    for t, row in enumerate(batch.state_out):
        if row >= 0:
            np.testing.assert_array_equal(_bits(got_raw[row]), _bits(snaps[t]), err_msg=f"token {t}")
    np.testing.assert_array_equal(_bits(got_raw[slots]), _bits(ops.to_numpy(d_dec)[slots]))


# (activations, state pool) -> (output tolerance, state tolerance): the existing tests' bounds
VERIFY_POOLS = {("bf16", "f32"): (1e-2, 2e-3), ("bf16", "f16"): (1.5e-2, 2e-3),
                ("bf16", "bf16"): (1.5e-2, 1e-2), ("f32", "f32"): (1e-4, 1e-4)}


@pytest.mark.parametrize("gates", [False, True], ids=["g_beta", "fused_gates"])
@pytest.mark.parametrize("dt,pool", list(VERIFY_POOLS))
@pytest.mark.parametrize("dims", [(2, 4, 128, 128), (1, 3, 64, 64), (2, 4, 64, 128)])
def test_gated_delta_rule_verify_window(cuda_ops, cpu, dims, dt, pool, gates):
    """state_out (a verify step), through gated_delta_rule and the fused-gates kernel: outputs,
    saved rows and working rows against the CPU spec (token by token, the state rounded only
    where the pool stores it); rows of -1 tokens and rows nobody owns untouched; and against
    the same tokens run as single-token decode steps on CUDA: with an fp32 pool every output
    and every saved row bit for bit (verify rows reproduce decode exactly); with a 16-bit pool,
    whose decode steps round the state between tokens, the first token of each window."""
    import cupy as cp
    import ml_dtypes
    ops = cuda_ops[dt]
    tol_o, tol_s = VERIFY_POOLS[(dt, pool)]
    pool_dt = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}[pool]
    Hk, Hv, Dk, Dv = dims
    rng = np.random.default_rng(60 + Dk + Dv + gates)
    batch, slots, nrows = _verify_batch()
    T = batch.num_tokens
    q, k, v, g, beta = _gdn_inputs(ops, rng, T, Hk, Hv, Dk, Dv)
    # [x | a | y | b] columns, as in the input projection (the fused kernel reads them in place)
    proj = _round(ops, np.concatenate([rng.standard_normal((T, 3)), rng.standard_normal((T, Hv)) * 2,
                                       rng.standard_normal((T, 5)), rng.standard_normal((T, Hv))], 1))
    cols_a, cols_b = slice(3, 3 + Hv), slice(8 + Hv, 8 + 2 * Hv)
    A_log = rng.uniform(-1, 1, Hv).astype(np.float32)
    dt_bias = rng.uniform(-1, 1, Hv).astype(np.float32)
    state0 = (rng.standard_normal((nrows, Hv, Dk, Dv)) * 0.3).astype(pool_dt)
    _garbage_fresh_rows(state0, batch, rng)
    state0[_saved_rows(batch)] = np.nan

    def run(rows, b, state):     # rows: the tokens of a decode step (None: the whole batch)
        pick = (lambda a: a) if rows is None else (lambda a: np.ascontiguousarray(a[rows]))
        dq, dk, dv = (ops.asarray(pick(a)) for a in (q, k, v))
        dev = ops.upload_batch(b)
        if gates:
            dp = ops.asarray(pick(proj))
            return ops.gated_delta_rule_with_gates(dq, dk, dv, dp[:, cols_a], dp[:, cols_b], cp.asarray(A_log),
                                                   cp.asarray(dt_bias), state, dev)
        return ops.gated_delta_rule(dq, dk, dv, cp.asarray(pick(g)), cp.asarray(pick(beta)), state, dev)

    ref_state = state0.copy()
    if gates:
        ref = cpu.gated_delta_rule_with_gates(q, k, v, proj[:, cols_a], proj[:, cols_b], A_log, dt_bias,
                                              ref_state, batch)
    else:
        ref = cpu.gated_delta_rule(q, k, v, g, beta, ref_state, batch)
    d_state = cp.asarray(state0)
    out = ops.to_numpy(run(None, batch, d_state))
    cp.cuda.Device().synchronize()
    got = d_state.get()
    assert got.dtype == np.dtype(pool_dt)
    qsl = batch.query_start_loc
    for i in range(batch.num_seqs):
        rows = slice(qsl[i], qsl[i + 1])
        assert _rel(out[rows].astype(np.float32), ref[rows]) < tol_o, f"seq {i}"
        assert _rel(got[slots[i]].astype(np.float32), ref_state[slots[i]].astype(np.float32)) < tol_s, i
    for t, row in enumerate(batch.state_out):
        if row >= 0:
            assert _rel(got[row].astype(np.float32), ref_state[row].astype(np.float32)) < tol_s, f"token {t}"
    untouched = _untouched_rows(batch, slots, nrows)
    np.testing.assert_array_equal(_bits(got[untouched]), _bits(state0[untouched]))

    # the same tokens as decode steps on CUDA
    d_dec = cp.asarray(state0)
    dec_out = np.empty_like(out)
    snaps = {}
    for seqs, rows, b in _decode_steps(batch, slots):
        dec_out[rows] = ops.to_numpy(run(rows, b, d_dec))
        for i, t in zip(seqs, rows):
            snaps[int(t)] = d_dec[slots[i]].get()
    exact = [int(qsl[i]) for i in range(batch.num_seqs)] if pool != "f32" else range(T)
    for t in exact:
        np.testing.assert_array_equal(_bits(out[t]), _bits(dec_out[t]), err_msg=f"output of token {t}")
        if batch.state_out[t] >= 0:
            np.testing.assert_array_equal(_bits(got[batch.state_out[t]]), _bits(snaps[t]), err_msg=f"token {t}")
    if pool == "f32":
        np.testing.assert_array_equal(_bits(got[slots]), _bits(d_dec.get()[slots]))


def test_state_out_of_minus_ones_is_a_plain_decode(cuda_ops):
    """A decode batch with state_out all -1 runs the kernels' save branch and saves nothing:
    outputs and pools bit for bit those of state_out None (the decode graphs' NULL)."""
    import cupy as cp
    ops = cuda_ops["bf16"]
    rng = np.random.default_rng(70)
    Hk, Hv, Dk, Dv, C = 2, 4, 128, 128, 64
    lens, ctxs, slots = [1] * 5, [4, 0, 9, 1, 30], [1, 3, 5, 7, 9]
    plain = _batch(lens, ctxs, slots)
    marked = _batch(lens, ctxs, slots)
    marked.state_out = np.full(5, -1, np.int32)
    q, k, v, _, _ = _gdn_inputs(ops, rng, 5, Hk, Hv, Dk, Dv)
    ab = _round(ops, rng.standard_normal((5, 2 * Hv)))
    x = _round(ops, rng.standard_normal((5, C)))
    w = ops.asarray(rng.standard_normal((C, 4)) * 0.5)
    ssm0 = (rng.standard_normal((11, Hv, Dk, Dv)) * 0.3).astype(np.float32)
    conv0 = rng.standard_normal((11, C, 3)).astype(np.float32)
    results = []
    for b in (plain, marked):
        ssm, conv = cp.asarray(ssm0), ops.asarray(conv0)
        dab = ops.asarray(ab)
        o = ops.gated_delta_rule_with_gates(ops.asarray(q), ops.asarray(k), ops.asarray(v), dab[:, :Hv],
                                            dab[:, Hv:], cp.zeros(Hv, cp.float32), cp.zeros(Hv, cp.float32),
                                            ssm, ops.upload_batch(b))
        xo = ops.causal_conv1d(ops.asarray(x), w, conv, ops.upload_batch(b))
        results.append([_bits(ops.to_numpy(a)) for a in (o, xo, ssm, conv)])
    for a, b, what in zip(*results, ("output", "conv output", "ssm pool", "conv pool")):
        np.testing.assert_array_equal(a, b, err_msg=what)


def test_upload_batch_carries_state_out(cuda_ops):
    """upload_batch: state_out to the device as int32 in the same staging copy; None stays None."""
    ops = cuda_ops["bf16"]
    b = _batch([3, 1], [5, 0], [2, 4])
    assert ops.upload_batch(b).state_out is None
    b.state_out = np.array([7, -1, 9, 11], np.int64)
    dev = ops.upload_batch(b)
    assert dev.state_out.dtype == np.int32 and dev.state_out.shape == (4,)
    np.testing.assert_array_equal(ops.to_numpy(dev.state_out), [7, -1, 9, 11])
    np.testing.assert_array_equal(ops.to_numpy(dev.state_slots), [2, 4])
    assert dev.host is b


# -- MoE ------------------------------------------------------------------------------------

def _route_margin_ok(x, router_w, top_k, eps=3e-2):
    logits = x @ router_w.T
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    s = -np.sort(-p, axis=1)
    if top_k >= p.shape[1]:
        return np.ones(len(x), bool)
    return (s[:, top_k - 1] - s[:, top_k]) > eps * s[:, top_k - 1]


@pytest.mark.parametrize("dt", ["bf16"])
@pytest.mark.parametrize("T,E,top_k,renorm", [(1, 16, 4, True), (8, 64, 8, True),
                                               (100, 16, 2, False), (300, 128, 8, True),
                                               (5, 8, 8, False)])
def test_moe(cuda_ops, cpu, dt, T, E, top_k, renorm):
    ops = cuda_ops[dt]
    rng = np.random.default_rng(10)
    H, I = 136, 72   # not multiples of the 64-wide tiles
    x = _round(ops, rng.standard_normal((T, H)))
    router_w = _round(ops, rng.standard_normal((E, H)) * 0.3)
    gate_up = _round(ops, rng.standard_normal((E, 2 * I, H)) / np.sqrt(H))
    down = _round(ops, rng.standard_normal((E, H, I)) / np.sqrt(I))
    ref = cpu.moe(x, router_w, gate_up, down, top_k, renorm)
    out = ops.moe(ops.asarray(x), ops.asarray(router_w), ops.asarray(gate_up), ops.asarray(down),
                  top_k, renorm)
    got = ops.to_numpy(out).astype(np.float32)
    assert got.shape == (T, H)
    ok = _route_margin_ok(x, router_w, top_k) if dt == "bf16" else np.ones(T, bool)
    assert ok.sum() >= 1
    assert _rel(got[ok], ref[ok]) < (1.5e-2 if dt == "bf16" else 1e-4)


@pytest.mark.parametrize("T,E,top_k", [(1, 16, 4), (8, 64, 8), (300, 16, 4)])
def test_moe_shared_expert(cpu, T, E, top_k):
    """ops.moe(shared=True): the last expert taken by every token with weight sigmoid(its
    router row), against the CPU spec; T = 1, 8 route in one launch (moe_plan), T = 300 (1500
    pairs) through moe_route / scan / scatter. bf16, rel < 1.5e-2 (test_moe's bound)."""
    from metrale.backends.cuda import BF16, CudaOps
    ops = CudaOps(dtype=BF16)
    rng = np.random.default_rng(30 + T)
    H, I = 136, 72
    x = _bf(rng.standard_normal((T, H)))
    router_w = _bf(rng.standard_normal((E + 1, H)) * 0.3)
    gate_up = _bf(rng.standard_normal((E + 1, 2 * I, H)) / np.sqrt(H))
    down = _bf(rng.standard_normal((E + 1, H, I)) / np.sqrt(I))
    ref = cpu.moe(x, router_w, gate_up, down, top_k, True, shared=True)
    out = ops.moe(ops.asarray(x), ops.asarray(router_w), ops.asarray(gate_up), ops.asarray(down),
                  top_k, True, shared=True)
    got = ops.to_numpy(out).astype(np.float32)
    ok = _route_margin_ok(x, router_w[:E], top_k)
    assert ok.sum() >= 1
    assert _rel(got[ok], ref[ok]) < 1.5e-2
    # the shared expert is really in there: without it the result is far off
    plain = cpu.moe(x, router_w[:E], gate_up[:E], down[:E], top_k, True)
    assert _rel(plain[ok], ref[ok]) > 0.1


def _moe_twice_bit_equal(ops, seed):
    rng = np.random.default_rng(seed)
    T, H, I, E = 257, 128, 64, 32
    args = [ops.asarray(a) for a in (rng.standard_normal((T, H)), rng.standard_normal((E, H)),
                                     rng.standard_normal((E, 2 * I, H)) * 0.1,
                                     rng.standard_normal((E, H, I)) * 0.1)]
    a = ops.to_numpy(ops.moe(*args, 4, True))
    b = ops.to_numpy(ops.moe(*args, 4, True))
    np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))


# -- MoE on tensor cores vs the CPU spec ------------------------------------------------------
# Router logits ~ N(0, 1.5^2) whatever H (router_w scaled by 1.5/sqrt(H)): the routing weights
# come from bf16 logits on the GPU, whose rounding (|logit| * 2^-9) must stay well under 1e-2.

def _bf(a):
    """Host values rounded to bf16 (ops.asarray rounds on the host the same way)."""
    import ml_dtypes
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


class _HostExperts:
    """Expert weights kept on the device; the CPU reference pulls one expert at a time (the
    35B-A3B shapes are 1.6 GB of bf16 at E = 256, too much to hold in fp32 on the host)."""

    def __init__(self, dev):
        self.dev = dev

    def __getitem__(self, e):
        import cupy as cp
        return cp.asnumpy(self.dev[int(e)]).astype(np.float32)


@pytest.fixture(scope="module")
def moe_ops():
    from metrale.backends.cuda import BF16, CudaOps
    return {"mma": CudaOps(dtype=BF16)}


def _moe_variant(monkeypatch, variant):
    """Force the expert GEMMs: "m1" (16-row tensor-core tiles), "m4" (64-row tiles), "gemv" (the
    CUDA-core GEMVs of single-token steps, for any T) or "auto"."""
    from metrale.backends.cuda import moe
    if variant in ("m1", "m4"):
        monkeypatch.setattr(moe, "MOE_GEMV_MAX_TOKENS", 0)
    if variant == "m1":
        monkeypatch.setattr(moe, "MOE_MMA_M4_MIN_ROWS", 1 << 30)
    elif variant == "m4":
        monkeypatch.setattr(moe, "MOE_MMA_M4_MIN_ROWS", 0)
    elif variant == "gemv":
        monkeypatch.setattr(moe, "MOE_GEMV_MAX_TOKENS", 1 << 30)
        monkeypatch.setattr(moe, "MOE_GEMV_PAIR_SPREAD", 0)


def _spy_kernels(monkeypatch, ops):
    names = []
    real = ops.kernel

    def spy(module, fn, smem=0):
        names.append(fn)
        return real(module, fn, smem)
    monkeypatch.setattr(ops, "kernel", spy)
    return names


def _check_moe_mma(moe_ops, cpu, x, router_w, gate_up, down, top_k, renorm, ref_gu, ref_dn,
                   monkeypatch, expect_kernel=None):
    """mma vs CPU reference (tokens with a clear top-k): rel < 1.5e-2 (one token at H = 136
    measured 1.21e-2: bf16 rounding of the activations between the two expert GEMMs)."""
    mma = moe_ops["mma"]
    T, H = x.shape
    ref = cpu.moe(x, router_w, ref_gu, ref_dn, top_k, renorm)
    args = (mma.asarray(x), mma.asarray(router_w), gate_up, down)
    names = _spy_kernels(monkeypatch, mma)
    got = mma.to_numpy(mma.moe(*args, top_k, renorm)).astype(np.float32)
    assert any(n.startswith(("moe_mma_gate_up_", "moe_gemv_gate_up")) for n in names), names
    if expect_kernel:
        assert any(n.startswith(expect_kernel) for n in names), names
    assert got.shape == (T, H)
    ok = _route_margin_ok(x, router_w, top_k, eps=5e-2)
    assert ok.sum() >= 1
    err_ref = _rel(got[ok], ref[ok])
    print(f"\n[moe mma] T={T} H={H} E={router_w.shape[0]} k={top_k}: rel vs cpu {err_ref:.2e}, "
          f"{int(ok.sum())}/{T} tokens")
    assert err_ref < 1.5e-2


MOE_TS = [1, 8, 64, 300]
MOE_EK = [(8, 2), (8, 8), (256, 2), (256, 8)]


@pytest.mark.parametrize("variant", ["auto", "m1", "m4", "gemv"])
@pytest.mark.parametrize("E,top_k", MOE_EK)
@pytest.mark.parametrize("T", MOE_TS)
def test_moe_mma_small(moe_ops, cpu, monkeypatch, T, E, top_k, variant):
    """H, I multiples of 8 but not of the tiles (136 = 2*64 + 8: a partial 64-wide k-block;
    I = 72: a partial n-block), every variant (auto: the GEMVs at T <= 4), both routing
    densities. The GEMVs re-read an expert once per pair that takes it: slower at large T,
    same result."""
    _moe_variant(monkeypatch, variant)
    ops = moe_ops["mma"]
    rng = np.random.default_rng(20 + T + E + top_k)
    H, I = 136, 72
    x = _bf(rng.standard_normal((T, H)))
    router_w = _bf(rng.standard_normal((E, H)) * 1.5 / np.sqrt(H))
    gate_up = _bf(rng.standard_normal((E, 2 * I, H)) / np.sqrt(H))
    down = _bf(rng.standard_normal((E, H, I)) / np.sqrt(I))
    renorm = top_k == 8
    want = {"auto": "moe_gemv_gate_up" if T <= 4 else None, "gemv": "moe_gemv_gate_up"}.get(
        variant, f"moe_mma_gate_up_{variant}_")
    _check_moe_mma(moe_ops, cpu, x, router_w, ops.asarray(gate_up), ops.asarray(down), top_k,
                   renorm, gate_up, down, monkeypatch, want)


@pytest.mark.parametrize("E,top_k", [(8, 2), (256, 8)])
@pytest.mark.parametrize("T", MOE_TS)
def test_moe_mma_35b_a3b(moe_ops, cpu, monkeypatch, T, E, top_k):
    """Qwen3.5-35B-A3B expert sizes (H 2048, I 512); E = 256 is the real layer (1.6 GB of bf16
    weights, made on the device). E = 8, T = 300 runs the 64-row tiles."""
    import cupy as cp

    from metrale.backends.cuda import BF16
    rng = np.random.default_rng(40 + T + E)
    H, I = 2048, 512
    x = _bf(rng.standard_normal((T, H)))
    router_w = _bf(rng.standard_normal((E, H)) * 1.5 / np.sqrt(H))
    crng = cp.random.default_rng(41 + T + E)
    gate_up = (crng.standard_normal((E, 2 * I, H), dtype=cp.float32) * H ** -0.5).astype(BF16)
    down = (crng.standard_normal((E, H, I), dtype=cp.float32) * I ** -0.5).astype(BF16)
    try:
        _check_moe_mma(moe_ops, cpu, x, router_w, gate_up, down, top_k, True,
                       _HostExperts(gate_up), _HostExperts(down), monkeypatch)
    finally:
        del gate_up, down
        cp.get_default_memory_pool().free_all_blocks()


@pytest.mark.parametrize("variant", ["m1", "m4", "gemv"])
def test_moe_mma_deterministic(moe_ops, monkeypatch, variant):
    _moe_variant(monkeypatch, variant)
    _moe_twice_bit_equal(moe_ops["mma"], 13)


# -- bandwidth report (not a timed test: prints figures for the log) --------------------------

def test_report_decode_bandwidth(cuda_ops):
    import cupy as cp
    ops = cuda_ops["bf16"]
    B, Hk, Hv, D = 64, 16, 48, 128
    rng = np.random.default_rng(12)
    q, k, v, g, beta = _gdn_inputs(ops, rng, B, Hk, Hv, D, D)
    state = cp.zeros((B, Hv, D, D), cp.float32)
    batch = ops.upload_batch(_batch([1] * B, [3] * B, list(range(B))))
    args = [ops.asarray(q), ops.asarray(k), ops.asarray(v), cp.asarray(g), cp.asarray(beta)]
    ops.gated_delta_rule(*args, state, batch)
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    n = 20
    for _ in range(n):
        ops.gated_delta_rule(*args, state, batch)
    end.record()
    end.synchronize()
    ms = cp.cuda.get_elapsed_time(start, end) / n
    gbps = B * Hv * D * D * 4 * 2 / (ms * 1e-3) / 1e9
    print(f"\n[gdn decode] B={B} Hv={Hv} D={D}: {ms * 1e3:.1f} us/call (host launch incl.), "
          f"state traffic {gbps:.0f} GB/s")
    assert np.isfinite(ms)
    # a verify step: 16 windows of 4 tokens, the state saved after every token (recurrent kernel)
    Bv, L = 16, 4
    vq, vk, vv, vg, vbeta = _gdn_inputs(ops, rng, Bv * L, Hk, Hv, D, D)
    vargs = [ops.asarray(vq), ops.asarray(vk), ops.asarray(vv), cp.asarray(vg), cp.asarray(vbeta)]
    vbatch = _batch([L] * Bv, [3] * Bv, list(range(Bv)))
    vbatch.state_out = np.arange(Bv, Bv + Bv * L, dtype=np.int32)
    vbatch = ops.upload_batch(vbatch)
    vstate = cp.zeros((Bv + Bv * L, Hv, D, D), cp.float32)
    ops.gated_delta_rule(*vargs, vstate, vbatch)
    start.record()
    for _ in range(n):
        ops.gated_delta_rule(*vargs, vstate, vbatch)
    end.record()
    end.synchronize()
    ms = cp.cuda.get_elapsed_time(start, end) / n
    gbps = (Bv * 2 + Bv * L) * Hv * D * D * 4 / (ms * 1e-3) / 1e9
    print(f"[gdn verify] B={Bv} x {L} tokens, a save per token: {ms * 1e3:.1f} us/call, "
          f"state traffic {gbps:.0f} GB/s")
    # chunked prefill: one 4096-token sequence
    T = 4096
    q, k, v, g, beta = _gdn_inputs(ops, rng, T, Hk, Hv, D, D)
    args = [ops.asarray(q), ops.asarray(k), ops.asarray(v), cp.asarray(g), cp.asarray(beta)]
    batch = ops.upload_batch(_batch([T], [0], [0]))
    ops.gated_delta_rule(*args, state, batch)
    start.record()
    for _ in range(3):
        ops.gated_delta_rule(*args, state, batch)
    end.record()
    end.synchronize()
    ms = cp.cuda.get_elapsed_time(start, end) / 3
    flops = T * Hv * 160e3
    print(f"[gdn prefill] T={T} Hv={Hv} D={D}: {ms:.2f} ms, ~{flops / (ms * 1e-3) / 1e12:.1f} TFLOP/s")
