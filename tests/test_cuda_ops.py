"""CudaOps op by op against CpuOps (the spec), on random inputs, ragged batches and chunk
boundaries. New outputs are NaN-poisoned (CudaOps.poison), so an element a kernel forgets to
write fails the test. bf16 paths: ||out - ref|| / ||ref|| <= 1e-2; fp32 paths: 1e-5.

Runs on the H200 through perf/gpu_run.sh (marked gpu: skipped without a GPU)."""
from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest

from metrale.backends.cpu import CpuOps
from metrale.forward import contiguous_batch

pytestmark = pytest.mark.gpu

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
TOL = {BF16: 1e-2, F32: 1e-5}


@pytest.fixture(scope="module")
def ops():
    from metrale.backends.cuda import CudaOps

    o = CudaOps()
    o.poison = True
    return o


@pytest.fixture(scope="module")
def cpu():
    return CpuOps(np.float32)


def rnd(rng, shape, dtype, scale=1.0):
    """Random values already representable in `dtype` (so CPU and GPU see the same inputs)."""
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(dtype)


def check(out, ref, dtype, what=""):
    out = np.asarray(out).astype(np.float32)
    ref = np.asarray(ref).astype(np.float32)
    assert out.shape == ref.shape, f"{what}: shape {out.shape} != {ref.shape}"
    assert np.isfinite(out).all(), f"{what}: {np.count_nonzero(~np.isfinite(out))} non-finite outputs (unwritten?)"
    err = np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)
    assert err <= TOL[np.dtype(dtype)], f"{what}: relative error {err:.3g} > {TOL[np.dtype(dtype)]}"


def f32(a):
    return np.asarray(a).astype(np.float32)


DTYPES = [BF16, F32]


# -- data movement ------------------------------------------------------------------------------
def test_asarray_roundtrip_and_upload(ops):
    rng = np.random.default_rng(0)
    x = rnd(rng, (5, 7), BF16)
    assert ops.to_numpy(ops.asarray(x)).tobytes() == x.tobytes()
    b = contiguous_batch([[1, 2, 3], [4], [5, 6]], [0, 17, 3], [[3], [7, 9], [2]], [0, 1, 2], 16)
    d = ops.upload_batch(b)
    for f in ("input_ids", "positions", "query_start_loc", "seq_lens", "block_tables", "slot_mapping",
              "state_slots", "logits_indices"):
        np.testing.assert_array_equal(ops.to_numpy(getattr(d, f)), getattr(b, f), err_msg=f)
    assert d.host is b and d.num_tokens == 6 and not d.is_decode


# -- elementwise / norms ------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("v,h,t", [(50, 64, 9), (1000, 4096, 33), (17, 100, 5), (7, 36, 1)])
def test_embedding(ops, cpu, dtype, v, h, t):
    rng = np.random.default_rng(1)
    table = rnd(rng, (v, h), dtype)
    ids = rng.integers(0, v, t).astype(np.int32)
    out = ops.embedding(ops.asarray(ids, np.int32), ops.asarray(table, dtype))
    check(ops.to_numpy(out), cpu.embedding(ids, f32(table)), dtype, "embedding")


def test_embedding_out_of_range_ids_give_zeros(ops):
    table = ops.asarray(np.ones((4, 64), np.float32))
    out = ops.to_numpy(ops.embedding(ops.asarray(np.array([0, -1, 4, 3], np.int32), np.int32), table))
    assert f32(out[[1, 2]]).sum() == 0 and f32(out[[0, 3]]).min() == 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,h", [(1, 64), (7, 1001), (33, 4096), (5, 5120), (3, 40000), (130, 256)])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_and_add(ops, dtype, rows, h, offset):
    rng = np.random.default_rng(2)
    ref = CpuOps(dtype)   # storage rounding of the residual sum matches the spec's storage dtype
    x, r, w = rnd(rng, (rows, h), dtype), rnd(rng, (rows, h), dtype), rnd(rng, (h,), dtype, 0.5)
    dx, dr, dw = ops.asarray(x, dtype), ops.asarray(r, dtype), ops.asarray(w, dtype)
    check(ops.to_numpy(ops.rms_norm(dx, dw, 1e-6, offset)), ref.rms_norm(x, w, 1e-6, offset), dtype, "rms_norm")
    out, res = ops.add_rms_norm(dx, dr, dw, 1e-6, offset)
    rout, rres = ref.add_rms_norm(x, r, w, 1e-6, offset)
    check(ops.to_numpy(res), rres, dtype, "add_rms_norm residual")
    check(ops.to_numpy(out), rout, dtype, "add_rms_norm out")
    out, res = ops.add_rms_norm(dx, None, dw, 1e-6, offset)
    check(ops.to_numpy(out), ref.rms_norm(x, w, 1e-6, offset), dtype, "add_rms_norm(residual=None)")
    assert res is dx


@pytest.mark.parametrize("t", [16, 64])
def test_k_split_down_projection_into_add_rms_norm(t):
    """The 9B down projection (4096 x 12288) as linear_parts: with the k-split plan forced, the
    result is fp32 partials (SplitK) that add_rms_norm sums on the way in. Against the CPU spec of
    add_rms_norm(linear(x, w), residual): bf16 tolerance; residual None and a captured graph
    (replayed with new inputs) too. The first call of a shape tunes and runs plain."""
    import cupy

    from metrale.backends.cuda import CudaOps, SplitK

    o = CudaOps()
    o.poison = True
    blas = o._blas()
    blas.ksplit_mode = "force"
    rng = np.random.default_rng(t)
    h, i = 4096, 12288
    x, r = rnd(rng, (t, i), BF16), rnd(rng, (t, h), BF16)
    w, nw = rnd(rng, (h, i), BF16, i ** -0.5), rnd(rng, (h,), BF16, 0.5)
    dx, dr, dw, dnw = (o.asarray(a, BF16) for a in (x, r, w, nw))
    ref = CpuOps(BF16)
    rout, rres = ref.add_rms_norm(ref.linear(x, w), r, nw, 1e-6, 1.0)
    first = o.linear_parts(dx, dw)                    # tunes plain, then decides the k-split
    assert not isinstance(first, SplitK)
    y = o.linear_parts(dx, dw)
    assert isinstance(y, SplitK), "k-split plan forced but not used"
    assert y.shape == (t, h) and y.parts.dtype == np.float32
    check(o.to_numpy(y.materialize()), ref.linear(x, w), BF16, "materialized partials")
    out, res = o.add_rms_norm(y, dr, dnw, 1e-6, 1.0)
    check(o.to_numpy(res), rres, BF16, "k-split add_rms_norm residual")
    check(o.to_numpy(out), rout, BF16, "k-split add_rms_norm out")
    out0, _ = o.add_rms_norm(o.linear_parts(dx, dw), None, dnw, 1e-6, 1.0)   # no residual: materialized
    check(o.to_numpy(out0), ref.rms_norm(ref.linear(x, w), nw, 1e-6, 1.0), BF16, "k-split, residual None")
    # graph capture: the same ops replay with new contents of x
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        gx = dx.copy()
        stream.synchronize()
        stream.begin_capture()
        g_out, g_res = o.add_rms_norm(o.linear_parts(gx, dw), dr, dnw, 1e-6, 1.0)
        graph = stream.end_capture()
        x2 = rnd(rng, (t, i), BF16)
        gx[...] = o.asarray(x2, BF16)
        graph.launch(stream)
        stream.synchronize()
    rout2, rres2 = ref.add_rms_norm(ref.linear(x2, w), r, nw, 1e-6, 1.0)
    check(o.to_numpy(g_res), rres2, BF16, "graph replay residual")
    check(o.to_numpy(g_out), rout2, BF16, "graph replay out")


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_strided_and_3d(ops, dtype):
    rng = np.random.default_rng(3)
    ref = CpuOps(dtype)
    big = rnd(rng, (6, 3 * 256), dtype)
    w = rnd(rng, (256,), dtype)
    view = ops.asarray(big, dtype)[:, 256:512]         # row stride 768
    check(ops.to_numpy(ops.rms_norm(view, ops.asarray(w, dtype), 1e-5, 0.0)),
          ref.rms_norm(big[:, 256:512], w, 1e-5, 0.0), dtype, "rms_norm strided")
    x3 = rnd(rng, (4, 3, 256), dtype)
    check(ops.to_numpy(ops.rms_norm(ops.asarray(x3, dtype), ops.asarray(w, dtype), 1e-5, 1.0)),
          ref.rms_norm(x3, w, 1e-5, 1.0), dtype, "rms_norm 3d")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,i", [(1, 17408), (33, 100), (5, 13), (64, 1536)])
def test_silu_mul(ops, dtype, rows, i):
    rng = np.random.default_rng(4)
    x = rnd(rng, (rows, 2 * i), dtype, 2.0)
    check(ops.to_numpy(ops.silu_mul(ops.asarray(x, dtype))), CpuOps(dtype).silu_mul(x), dtype, "silu_mul")
    # a column-slice view (row stride > 2I)
    wide = rnd(rng, (rows, 2 * i + 8), dtype)
    check(ops.to_numpy(ops.silu_mul(ops.asarray(wide, dtype)[:, : 2 * i])), CpuOps(dtype).silu_mul(wide[:, : 2 * i]),
          dtype, "silu_mul view")


@pytest.mark.parametrize("dtype", DTYPES)
def test_sigmoid_mul(ops, dtype):
    rng = np.random.default_rng(5)
    ref = CpuOps(dtype)
    for shape in [(1, 64), (9, 3, 128), (33, 1000), (4, 7)]:
        x, g = rnd(rng, shape, dtype), rnd(rng, shape, dtype, 3.0)
        check(ops.to_numpy(ops.sigmoid_mul(ops.asarray(x, dtype), ops.asarray(g, dtype))),
              ref.sigmoid_mul(x, g), dtype, f"sigmoid_mul {shape}")
    # the gated-attention case: gate is a column slice of the fused qkv output
    t, hq, d = 5, 4, 64
    qkv = rnd(rng, (t, 2 * hq * d + 2 * d), dtype)
    o = rnd(rng, (t, hq * d), dtype)
    dq = ops.asarray(qkv, dtype)
    check(ops.to_numpy(ops.sigmoid_mul(ops.asarray(o, dtype), dq[:, hq * d: 2 * hq * d])),
          ref.sigmoid_mul(o, qkv[:, hq * d: 2 * hq * d]), dtype, "sigmoid_mul gate view")
    # the shared-expert case: gate [T, 1] broadcasts over the hidden size
    x, g = rnd(rng, (6, 256), dtype), rnd(rng, (6, 1), dtype)
    check(ops.to_numpy(ops.sigmoid_mul(ops.asarray(x, dtype), ops.asarray(g, dtype))),
          ref.sigmoid_mul(x, g), dtype, "sigmoid_mul broadcast gate")


# -- matrices -----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,k,n,bias", [(1, 64, 128, False), (7, 4096, 1536, True), (130, 1000, 3, True),
                                        (64, 512, 4096, False), (1, 5120, 1, False)])
def test_linear(ops, cpu, dtype, t, k, n, bias):
    rng = np.random.default_rng(6)
    x, w = rnd(rng, (t, k), dtype), rnd(rng, (n, k), dtype, k ** -0.5)
    b = rnd(rng, (n,), dtype) if bias else None
    out = ops.linear(ops.asarray(x, dtype), ops.asarray(w, dtype), ops.asarray(b, dtype) if bias else None)
    ref = cpu.linear(f32(x), f32(w), f32(b) if bias else None)
    check(ops.to_numpy(out), ref, dtype, "linear")


def test_linear_strided_input(ops, cpu):
    rng = np.random.default_rng(7)
    x = rnd(rng, (9, 3, 256), BF16)
    w = rnd(rng, (96, 128), BF16, 0.1)
    view = ops.asarray(x)[:, 1, 64:192]           # row stride 768
    check(ops.to_numpy(ops.linear(view, ops.asarray(w))), cpu.linear(f32(x[:, 1, 64:192]), f32(w)), BF16, "linear view")


# -- heads: norm + rotary -----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128, 256])
def test_head_rms_norm_and_rope(ops, dtype, d):
    rng = np.random.default_rng(8)
    ref = CpuOps(dtype)
    t, hq, hk = 11, 6, 2
    qkv = rnd(rng, (t, (hq + 2 * hk) * d), dtype)
    dq = ops.asarray(qkv, dtype)
    q_view = dq[:, : hq * d].reshape(t, hq, d)
    k_view = dq[:, hq * d: (hq + hk) * d].reshape(t, hk, d)
    hq_ = qkv[:, : hq * d].reshape(t, hq, d)
    hk_ = qkv[:, hq * d: (hq + hk) * d].reshape(t, hk, d)
    w = rnd(rng, (d,), dtype, 0.3)
    for off in (0.0, 1.0):
        check(ops.to_numpy(ops.head_rms_norm(q_view, ops.asarray(w, dtype), 1e-6, off)),
              ref.head_rms_norm(hq_, w, 1e-6, off), dtype, "head_rms_norm")
    positions = rng.integers(0, 40000, t).astype(np.int32)
    for rot in (d, d // 4):
        base = 10000.0 if rot == d else 1e7
        inv_freq = (1.0 / base ** (np.arange(0, rot, 2, dtype=np.float32) / rot)).astype(np.float32)
        q2, k2 = ops.rope(q_view, k_view, ops.asarray(positions, np.int32), ops.asarray(inv_freq, np.float32), rot)
        rq, rk = ref.rope(hq_, hk_, positions, inv_freq, rot)
        check(ops.to_numpy(q2), rq, dtype, f"rope q rot={rot}")
        check(ops.to_numpy(k2), rk, dtype, f"rope k rot={rot}")


# -- paged KV + attention -----------------------------------------------------------------------
def paged_batch(rng, ctx_lens, q_lens, bs, spare_blocks=3):
    """A ForwardBatch over a shuffled block pool: sequence i holds ctx_lens[i] cached tokens and
    adds q_lens[i] new ones."""
    need = [-(-(c + q) // bs) for c, q in zip(ctx_lens, q_lens)]
    num_blocks = sum(need) + spare_blocks
    pool = rng.permutation(num_blocks)
    tables, at = [], 0
    for n in need:
        tables.append([int(x) for x in pool[at: at + n]])
        at += n
    batch = contiguous_batch([[1] * q for q in q_lens], list(ctx_lens), tables, list(range(len(q_lens))), bs)
    return batch, num_blocks


def seq_slots(batch, i):
    pos = np.arange(int(batch.seq_lens[i]))
    return batch.block_tables[i, pos // batch.block_size].astype(np.int64) * batch.block_size + pos % batch.block_size


def test_write_kv(ops):
    rng = np.random.default_rng(9)
    bs, hk, d = 16, 2, 128
    batch, nb = paged_batch(rng, [5, 0, 31], [3, 20, 1], bs)
    batch.slot_mapping[1] = -1                      # a padding token: skipped
    t = batch.num_tokens
    kv = rnd(rng, (t, 2 * hk * d + 64), BF16)       # k, v as views of one projection
    dkv = ops.asarray(kv)
    k, v = dkv[:, : hk * d].reshape(t, hk, d), dkv[:, hk * d: 2 * hk * d].reshape(t, hk, d)
    kc = ops.asarray(np.full((nb, bs, hk, d), np.nan, np.float32))
    vc = ops.asarray(np.full((nb, bs, hk, d), np.nan, np.float32))
    ops.write_kv(k, v, kc, vc, ops.upload_batch(batch))
    kc_h, vc_h = f32(ops.to_numpy(kc)).reshape(-1, hk, d), f32(ops.to_numpy(vc)).reshape(-1, hk, d)
    hk_ = f32(kv[:, : hk * d]).reshape(t, hk, d)
    hv_ = f32(kv[:, hk * d: 2 * hk * d]).reshape(t, hk, d)
    valid = batch.slot_mapping >= 0
    np.testing.assert_array_equal(kc_h[batch.slot_mapping[valid]], hk_[valid])
    np.testing.assert_array_equal(vc_h[batch.slot_mapping[valid]], hv_[valid])
    untouched = np.setdiff1d(np.arange(kc_h.shape[0]), batch.slot_mapping[valid])
    assert np.isnan(kc_h[untouched]).all() and np.isnan(vc_h[untouched]).all()


def poisoned_kv(rng, batch, nb, bs, hk, d):
    """Paged K/V caches [nb, bs, hk, d] holding bf16-rounded values in every sequence's slots and
    NaN everywhere else: any read past a sequence's end poisons the output."""
    k = np.full((nb * bs, hk, d), np.nan, np.float32)
    v = np.full((nb * bs, hk, d), np.nan, np.float32)
    for i in range(batch.num_seqs):
        s = seq_slots(batch, i)
        k[s] = f32(rnd(rng, (len(s), hk, d), BF16))
        v[s] = f32(rnd(rng, (len(s), hk, d), BF16))
    return k.reshape(nb, bs, hk, d), v.reshape(nb, bs, hk, d)


def run_attention(ops, cpu, rng, ctx_lens, q_lens, hq, hk, d, bs, part_tokens=None, q_scale=1.0):
    """CudaOps.attention (the tensor-core kernels) vs CpuOps (bf16 outputs)."""
    batch, nb = paged_batch(rng, ctx_lens, q_lens, bs)
    k, v = poisoned_kv(rng, batch, nb, bs, hk, d)
    q = f32(rnd(rng, (batch.num_tokens, hq, d), BF16, q_scale))
    scale = d ** -0.5
    ref = cpu.attention(q, k, v, batch, scale)
    what = f"ctx={ctx_lens} q={q_lens} hq={hq} hk={hk} d={d} bs={bs} decode={batch.is_decode}"
    outs = {}
    for o in [ops]:
        impl = "mma"
        old = o.part_tokens
        o.part_tokens = part_tokens
        try:
            out = o.attention(o.asarray(q), o.asarray(k), o.asarray(v), o.upload_batch(batch), scale)
        finally:
            o.part_tokens = old
        outs[impl] = ops.to_numpy(out)
        check(outs[impl], ref, BF16, f"attention[{impl}] {what}")
    return outs


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("hq,hk", [(4, 4), (8, 2), (24, 4), (9, 3), (64, 4), (40, 2)])
# G = 1, 4, 6 (Qwen3.5), 3 (SmolLM2), 16 (two n-tiles of 8 heads), 20 (> 16 per CTA: 2 chunks)
def test_decode_attention(ops, cpu, d, hq, hk):
    rng = np.random.default_rng(10 + d + hq)
    ctx = [0, 1, 15, 16, 511, 512, 1500, 4100]                      # partition boundaries at 512
    run_attention(ops, cpu, rng, ctx, [1] * len(ctx), hq, hk, d, 16)


@pytest.mark.parametrize("part_tokens", [None, 16, 32, 64, 100, 512, 100000])
def test_decode_attention_partitions(ops, cpu, part_tokens):
    # part_tokens not a multiple of the 16-key tile (100) or of the block size (32): tiles that
    # straddle blocks, partitions with fewer tiles than warps
    rng = np.random.default_rng(11)
    ctx = list(rng.integers(0, 700, 13))
    run_attention(ops, cpu, rng, ctx, [1] * len(ctx), 16, 4, 128, 32, part_tokens)


@pytest.mark.parametrize("bs", [1, 8, 16, 32])
def test_decode_attention_block_sizes(ops, cpu, bs):
    rng = np.random.default_rng(12 + bs)
    run_attention(ops, cpu, rng, [3, 70, 333, 1025], [1] * 4, 24, 4, 256, bs)


def test_decode_attention_peaked_scores(ops, cpu):
    """Large logits (q scaled x8): the online-softmax rescaling across tiles, warps and
    partitions must stay exact (a wrong max or alpha shows up here first)."""
    rng = np.random.default_rng(13)
    run_attention(ops, cpu, rng, [2000, 77, 4000], [1] * 3, 24, 4, 256, 16, q_scale=8.0)
    run_attention(ops, cpu, rng, [2000, 77, 4000], [1] * 3, 24, 4, 256, 16, part_tokens=64,
                  q_scale=8.0)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("hq,hk", [(4, 4), (8, 2), (24, 4), (9, 3), (32, 1)])
def test_prefill_attention(ops, cpu, d, hq, hk):
    rng = np.random.default_rng(20 + d + hq)
    # fresh prompts, chunked prefill continuing a context, single tokens in a mixed batch,
    # lengths around the 64/128-row and BN tiles
    ctx = [0, 0, 37, 300, 0, 5, 64, 0]
    ql = [1, 200, 64, 33, 17, 1, 65, 129]
    run_attention(ops, cpu, rng, ctx, ql, hq, hk, d, 16)


def test_prefill_attention_block_size_and_long(ops, cpu):
    rng = np.random.default_rng(30)
    run_attention(ops, cpu, rng, [0, 1000], [1100, 7], 8, 8, 128, 32)


@pytest.mark.parametrize("d,hq,hk", [(256, 24, 4), (128, 32, 8), (64, 9, 3)])
def test_prefill_attention_long_chunked(ops, cpu, d, hq, hk):
    """Long causal prompts and a chunk continuing a long context (many K/V tiles through the
    double buffer, diagonal tiles at a context offset not a multiple of the tile), peaked scores."""
    rng = np.random.default_rng(31 + d)
    run_attention(ops, cpu, rng, [0, 1531, 3], [1500, 300, 1], hq, hk, d, 16, q_scale=4.0)


# -- CUDA graph capture -------------------------------------------------------------------------
def test_decode_step_captures_in_a_cuda_graph(ops):
    """linear (cuBLAS via our handle) + add_rms_norm + rope + write_kv + split-KV attention +
    sigmoid_mul captured once, replayed on new inputs: equal to the eager ops."""
    import cupy

    rng = np.random.default_rng(40)
    b, hq, hk, d, hidden, bs, width = 8, 8, 2, 128, 1024, 16, 80   # 80 blocks: 1280 keys, 3 partitions
    ctx = [int(c) for c in rng.integers(1, 1200, b)]
    nb = b * width + 1
    tables = [[1 + i * width + j for j in range(width)] for i in range(b)]
    w_qkv = ops.asarray(rnd(rng, ((hq + 2 * hk) * d, hidden), BF16, hidden ** -0.5))
    w_norm = ops.asarray(rnd(rng, (hidden,), BF16, 0.2))
    inv_freq = ops.asarray((1.0 / 10000 ** (np.arange(0, d, 2) / d)).astype(np.float32), np.float32)
    kc = ops.asarray(rnd(rng, (nb, bs, hk, d), BF16))
    vc = ops.asarray(rnd(rng, (nb, bs, hk, d), BF16))
    static = {"x": ops.asarray(rnd(rng, (b, hidden), BF16)), "r": ops.asarray(rnd(rng, (b, hidden), BF16))}

    def host_batch(ctx):
        return contiguous_batch([[1]] * b, ctx, tables, list(range(b)), bs)

    dev = ops.upload_batch(host_batch(ctx))

    def step():
        h, res = ops.add_rms_norm(static["x"], static["r"], w_norm, 1e-6, 1.0)
        qkv = ops.linear(h, w_qkv)
        q = qkv[:, : hq * d].reshape(b, hq, d)
        k = qkv[:, hq * d: (hq + hk) * d].reshape(b, hk, d)
        v = qkv[:, (hq + hk) * d:].reshape(b, hk, d)
        q, k = ops.rope(q, k, dev.positions, inv_freq, d)
        ops.write_kv(k, v, kc, vc, dev)
        o = ops.attention(q, kc, vc, dev, d ** -0.5)
        return ops.sigmoid_mul(o.reshape(b, hq * d), h)

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        for _ in range(2):
            step()                                        # warm the pool and the kernel cache
        stream.synchronize()
        stream.begin_capture()
        out_graph = step()
        graph = stream.end_capture()
        # new inputs in the same buffers, one more token per sequence
        ctx2 = [c + 1 for c in ctx]
        nb_ = host_batch(ctx2)
        for f in ("positions", "seq_lens", "slot_mapping", "query_start_loc"):
            getattr(dev, f).set(np.ascontiguousarray(getattr(nb_, f), np.int32), stream=stream)
        static["x"].set(rnd(rng, (b, hidden), BF16), stream=stream)
        graph.launch(stream)
        stream.synchronize()
        got = ops.to_numpy(out_graph).copy()
        expect = ops.to_numpy(step())
        stream.synchronize()
    check(got, expect, BF16, "graph replay vs eager")
    assert np.array_equal(f32(got), f32(expect)), "graph replay must be bit-identical to the eager ops"


# -- fused attention prologue (qk_norm_rope_write_kv) -------------------------------------------
PROLOGUE_CASES = {
    # name: (hq, hk, d, qk_norm, offset, rotary_dim, gated)
    "llama": (9, 3, 64, False, 0.0, 64, False),
    "qwen3": (8, 2, 128, True, 0.0, 128, False),
    "qwen3_5": (6, 1, 256, True, 1.0, 64, True),
}


def _prologue_inputs(rng, case, ntok, dtype):
    hq, hk, d, qk_norm, offset, rot, gated = PROLOGUE_CASES[case]
    bs = 16
    ctx = [int(c) for c in rng.integers(0, 40, 3)]
    q_lens = [ntok // 3, ntok // 3, ntok - 2 * (ntok // 3)]
    keep = [i for i, n in enumerate(q_lens) if n > 0]
    batch, nb = paged_batch(rng, [ctx[i] for i in keep], [q_lens[i] for i in keep], bs)
    if ntok > 2:
        batch.slot_mapping[1] = -1                   # padding tokens: skipped
        batch.slot_mapping[ntok - 1] = -1
    q_end = hq * d * (2 if gated else 1)
    qkv = rnd(rng, (ntok, q_end + 2 * hk * d), dtype)  # [q | gate | k | v] as Attention lays it out
    w = (rnd(rng, (d,), dtype, 0.3), rnd(rng, (d,), dtype, 0.3)) if qk_norm else (None, None)
    inv_freq = (1.0 / 1e6 ** (np.arange(0, rot, 2, dtype=np.float64) / rot)).astype(np.float32)
    return batch, nb, bs, qkv, w, inv_freq, (hq, hk, d, offset, rot, q_end)


def _split_qkv(qkv, t, hq, hk, d, q_end):
    return (qkv[:, : hq * d].reshape(t, hq, d), qkv[:, q_end: q_end + hk * d].reshape(t, hk, d),
            qkv[:, q_end + hk * d:].reshape(t, hk, d))


@pytest.mark.parametrize("case", list(PROLOGUE_CASES))
@pytest.mark.parametrize("ntok", [1, 7, 33, 300])
@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_write_kv(ops, cpu, case, ntok, dtype):
    """The fused prologue vs the unfused CUDA ops (bit-identical q and caches) and vs the CPU."""
    rng = np.random.default_rng(50 + ntok)
    batch, nb, bs, qkv, (qw, kw), inv_freq, (hq, hk, d, offset, rot, q_end) = _prologue_inputs(rng, case, ntok, dtype)
    dev = ops.upload_batch(batch)
    dqkv = ops.asarray(qkv, dtype)
    dqw = None if qw is None else ops.asarray(qw, dtype)
    dkw = None if kw is None else ops.asarray(kw, dtype)
    dinv = ops.asarray(inv_freq, np.float32)
    nan = np.full((nb, bs, hk, d), np.nan, np.float32)
    caches = {}
    for mode in ("fused", "composed"):
        kc, vc = ops.asarray(nan, dtype), ops.asarray(nan, dtype)
        q, k, v = _split_qkv(dqkv, ntok, hq, hk, d, q_end)
        if mode == "fused":
            qo = ops.qk_norm_rope_write_kv(q, k, v, dqw, dkw, 1e-6, offset, dev.positions, dinv, rot, kc, vc, dev)
        else:
            from metrale.backends.base import compose_qk_norm_rope_write_kv

            qo = compose_qk_norm_rope_write_kv(ops, q, k, v, dqw, dkw, 1e-6, offset, dev.positions, dinv, rot,
                                               kc, vc, dev)
        caches[mode] = (ops.to_numpy(qo), ops.to_numpy(kc), ops.to_numpy(vc))
    for name, a, b in zip(("q", "k_cache", "v_cache"), caches["fused"], caches["composed"]):
        assert a.shape == b.shape and a.tobytes() == b.tobytes(), f"fused {name} differs from the unfused ops"
    # vs the CPU spec (storage dtype rounding as the GPU's). Its write_kv indexes with the slot as
    # is (-1 = the last row), so padding tokens go to an extra row past the pool there.
    ref = CpuOps(dtype)
    kc_r = np.full((nb * bs + 1, hk, d), np.nan, np.float32).astype(dtype)
    vc_r = kc_r.copy()
    cpu_batch = dataclasses.replace(batch, slot_mapping=np.where(batch.slot_mapping < 0, nb * bs,
                                                                 batch.slot_mapping).astype(np.int32))
    q, k, v = _split_qkv(qkv, ntok, hq, hk, d, q_end)
    q_r = ref.qk_norm_rope_write_kv(q, k, v, qw, kw, 1e-6, offset, batch.positions, inv_freq, rot, kc_r, vc_r,
                                    cpu_batch)
    q_f, kc_f, vc_f = caches["fused"]
    check(q_f, q_r, dtype, f"{case} q")
    valid = batch.slot_mapping >= 0
    s = batch.slot_mapping[valid]
    check(f32(kc_f).reshape(-1, hk, d)[s], f32(kc_r).reshape(-1, hk, d)[s], dtype, f"{case} k_cache")
    check(f32(vc_f).reshape(-1, hk, d)[s], f32(vc_r).reshape(-1, hk, d)[s], dtype, f"{case} v_cache")
    untouched = np.setdiff1d(np.arange(nb * bs), s)
    assert np.isnan(f32(kc_f).reshape(-1, hk, d)[untouched]).all(), "wrote a padding token's k"
    assert np.isnan(f32(vc_f).reshape(-1, hk, d)[untouched]).all(), "wrote a padding token's v"


def test_qk_norm_rope_write_kv_fallback(ops, cpu):
    """A case the kernel does not take (norm weight in another dtype than q, caches of another
    dtype -> composed path raises like write_kv)."""
    rng = np.random.default_rng(60)
    batch, nb, bs, qkv, (qw, kw), inv_freq, (hq, hk, d, offset, rot, q_end) = _prologue_inputs(rng, "qwen3", 7, BF16)
    dev = ops.upload_batch(batch)
    q, k, v = _split_qkv(ops.asarray(qkv), 7, hq, hk, d, q_end)
    kc = ops.asarray(np.zeros((nb, bs, hk, d), np.float32), np.float32)
    vc = ops.asarray(np.zeros((nb, bs, hk, d), np.float32), np.float32)
    with pytest.raises(TypeError):
        ops.qk_norm_rope_write_kv(q, k, v, ops.asarray(qw), ops.asarray(kw), 1e-6, 0.0, dev.positions,
                                  ops.asarray(inv_freq, np.float32), rot, kc, vc, dev)


# -- decode attention over short contexts in wide block tables (as decode graphs see them) -------
@pytest.mark.parametrize("d,hq,hk", [(64, 9, 3), (128, 16, 4), (256, 24, 4)])
@pytest.mark.parametrize("width", [1, 4, 64])
def test_decode_attention_short_contexts(ops, cpu, d, hq, hk, width):
    """Short contexts in a wide or narrow block table: one partition for the whole batch
    (nparts == 1), or many partitions of which each sequence fills only the first few (the
    split-KV merge of a single live partition, and of several)."""
    rng = np.random.default_rng(70 + d + width)
    bs = 16
    ctx = [0, 1, 5, 14, 15] if width == 1 else [0, 3, 15, 31, 40, 63]
    batch, nb = paged_batch(rng, ctx, [1] * len(ctx), bs, spare_blocks=0)
    m = batch.block_tables.shape[1]
    if width > m:                                   # widen the table (as a decode graph's is)
        extra = np.zeros((batch.num_seqs, width - m), np.int32)
        batch.block_tables = np.concatenate([batch.block_tables, extra], axis=1)
    k, v = poisoned_kv(rng, batch, nb, bs, hk, d)
    q = f32(rnd(rng, (batch.num_tokens, hq, d), BF16))
    ref = cpu.attention(q, k, v, batch, d ** -0.5)
    for o in (ops,):
        for part in (None, 16, 64):
            old = o.part_tokens
            o.part_tokens = part
            try:
                out = o.attention(o.asarray(q), o.asarray(k), o.asarray(v), o.upload_batch(batch), d ** -0.5)
                out2 = o.attention(o.asarray(q), o.asarray(k), o.asarray(v), o.upload_batch(batch), d ** -0.5)
            finally:
                o.part_tokens = old
            check(ops.to_numpy(out), ref, BF16, f"decode short ctx={ctx} width={width} part={part}")
            # deterministic: a second launch gives the same bits
            assert ops.to_numpy(out).tobytes() == ops.to_numpy(out2).tobytes()


@pytest.mark.parametrize("part_tokens", [None, 32, 4096])
def test_decode_short_contexts_in_a_cuda_graph(ops, cpu, part_tokens):
    """Decode attention (fused prologue + attention) captured with a wide block table while the
    sequences are short (1 or few live partitions each), replayed as they grow: equal to the
    eager ops bit for bit and to the CPU within bf16 tolerance."""
    import cupy

    rng = np.random.default_rng(80)
    b, hq, hk, d, bs, width = 4, 9, 3, 64, 16, 64
    ctx = [0, 2, 17, 40]
    nb = b * width + 1
    tables = [[1 + i * width + j for j in range(width)] for i in range(b)]
    inv_freq = (1.0 / 10000 ** (np.arange(0, d, 2) / d)).astype(np.float32)
    dinv = ops.asarray(inv_freq, np.float32)
    kc_h = rnd(rng, (nb, bs, hk, d), BF16)
    vc_h = rnd(rng, (nb, bs, hk, d), BF16)
    kc, vc = ops.asarray(kc_h), ops.asarray(vc_h)
    qkv_buf = ops.asarray(rnd(rng, (b, (hq + 2 * hk) * d), BF16))

    def host_batch(ctx):
        return contiguous_batch([[1]] * b, ctx, tables, list(range(b)), bs)

    dev = ops.upload_batch(host_batch(ctx))

    def step():
        q, k, v = _split_qkv(qkv_buf, b, hq, hk, d, hq * d)
        q = ops.qk_norm_rope_write_kv(q, k, v, None, None, 1e-6, 0.0, dev.positions, dinv, d, kc, vc, dev)
        return ops.attention(q, kc, vc, dev, d ** -0.5)

    old = ops.part_tokens
    ops.part_tokens = part_tokens
    try:
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            for _ in range(2):
                step()
            stream.synchronize()
            stream.begin_capture()
            out_graph = step()
            graph = stream.end_capture()
            for grow in (1, 2, 30):
                ctx2 = [c + grow for c in ctx]
                hb = host_batch(ctx2)
                for f in ("positions", "seq_lens", "slot_mapping", "query_start_loc"):
                    getattr(dev, f).set(np.ascontiguousarray(getattr(hb, f), np.int32), stream=stream)
                qkv_new = rnd(rng, (b, (hq + 2 * hk) * d), BF16)
                qkv_buf.set(qkv_new, stream=stream)
                graph.launch(stream)
                stream.synchronize()
                got = ops.to_numpy(out_graph).copy()
                kc_after, vc_after = ops.to_numpy(kc).copy(), ops.to_numpy(vc).copy()
                expect = ops.to_numpy(step())
                stream.synchronize()
                assert got.tobytes() == expect.tobytes(), f"graph replay != eager (grow {grow})"
                # CPU reference over the caches as the graph left them
                qh, kh, vh = _split_qkv(f32(qkv_new), b, hq, hk, d, hq * d)
                cpu_kc, cpu_vc = f32(kc_after), f32(vc_after)
                q_r = cpu.qk_norm_rope_write_kv(qh, kh, vh, None, None, 1e-6, 0.0, hb.positions, inv_freq, d,
                                                cpu_kc, cpu_vc, hb)
                check(got, cpu.attention(q_r, cpu_kc, cpu_vc, hb, d ** -0.5), BF16, f"graph vs cpu (grow {grow})")
    finally:
        ops.part_tokens = old
