"""Our tensor-core skinny GEMMs (kernels_cuda/skinny.cu, launched by metrale.backends.cublaslt.OwnSkinny)
against a cupy float32 matmul: row counts 1..64 (sampled: 1, 3, 8, 9, 16, 17, 33, 64; those
between the compiled 8 / 16 / 32 / 64 run the next one up), every config `OwnSkinny.configs`
proposes plus a fixed set covering every k split (cluster of 1 / 2 / 4 / 8 CTAs), 1 and 2 warps
per row group, the shallowest ring and the smallest / largest CTAs, and a T = 64 kernel running
few rows (what a borrowed plan does); n not a multiple of the CTA's rows, k not a multiple of 32
or of a 64-wide stage, Qwen3.5-9B's decode shapes (4096 x 12288, 12288 x 4096) and small ones,
strided x and y rows, accumulate on and off, bf16 and fp16; y poisoned with NaN first; relative
Frobenius error <= 1e-2 (16-bit output rounding), nothing written past n. Then: a graph-captured
launch replayed twice equals the eager call bit for bit (fixed reduction order, nothing to reset
between launches); borrowed skinny plans are used only where their compiled T covers t; and
through CudaOps.linear with tuning on, a 4096 x 12288 weight at t = 16 and 64 is right on the
first (tuning) call and in a graph replay, and the winning plan is printed with its bandwidth
(which one wins is measured on the H200, not asserted).

GPU only (skipped without one); runs on the H200 through perf/gpu_run.sh."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from metrale.backends import cublaslt as lt

pytestmark = pytest.mark.gpu

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
CODES = {BF16: lt.CUDA_R_16BF, F16: lt.CUDA_R_16F}
NAN_BITS = {BF16: 0x7FC0, F16: 0x7E00}
TS = (1, 3, 8, 9, 16, 17, 33, 64)
# (n, k): tiny; n not a multiple of 32 and k % 32 == 8; n between CTA sizes, k not a multiple of
# a 64-wide stage; Qwen3.5-9B's o_proj / down (4096 x 12288) and qkv-sized (12288 x 4096)
SHAPES = [(64, 64), (200, 136), (1000, 520), (4096, 12288), (12288, 4096)]


@pytest.fixture(scope="module")
def cp():
    import cupy

    return cupy


@pytest.fixture(scope="module")
def ops():
    from metrale.backends.cuda import CudaOps

    return CudaOps()


@pytest.fixture(scope="module")
def skinny(ops):
    return lt.OwnSkinny(ops.kernel)


def rnd(cp, shape, dtype, scale=1.0):
    return (cp.random.standard_normal(shape, dtype=cp.float32) * scale).astype(dtype)


def poison(cp, a):
    a.view(np.uint16).fill(NAN_BITS[np.dtype(a.dtype)])
    return a


def rel_err(cp, out, ref) -> float:
    out = out.astype(cp.float32)
    assert bool(cp.isfinite(out).all()), "non-finite outputs (unwritten?)"
    return float(cp.linalg.norm((out - ref).ravel()) / max(float(cp.linalg.norm(ref.ravel())), 1e-30))


def ld(a) -> int:
    return a.strides[0] // a.itemsize


def coverage_configs(skinny, t, n, k) -> list[tuple]:
    """Configs beyond the model's picks, so that every shape runs every k split, kw = 1 and 2,
    the shallowest ring, 32- and 256-row CTAs, and a T = 64 kernel for any t (a borrowed plan)."""
    d = skinny._props()
    tt = next(v for v in lt.SKINNY_T if v >= t)
    nk = -(-k // lt.SKINNY_KC)
    want = [(tt, 1, 2, 1, 2), (tt, 8, 1, 1, 3), (tt, 3, 1, 2, 2), (tt, 2, 2, 4, 4), (tt, 4, 2, 8, 2),
            (tt, 1, 1, 8, 3), (64, 2, 2, 2, 3)]
    out = []
    for cfg in want:
        ks = cfg[3]
        if ks > 1 and (d["cc"] < 90 or nk < ks):
            continue
        if lt.OwnSkinny.smem_bytes(cfg) > d["smem_cta"]:
            continue
        out.append(cfg)
    return out


def all_configs(skinny, t, n, k) -> list[tuple]:
    seen, out = set(), []
    for cfg in [*skinny.configs(t, n, k), *coverage_configs(skinny, t, n, k)]:
        if cfg not in seen:
            seen.add(cfg)
            out.append(cfg)
    return out


_W: dict = {}


def weight(cp, dtype, n, k):
    """The same random weight (and its fp32 copy) for every t of a shape: the 9B ones are 100 MB."""
    key = (np.dtype(dtype).str, n, k)
    if key not in _W:
        _W.clear()
        cp.random.seed(n * 7 + k)
        w = rnd(cp, (n, k), dtype, k ** -0.5)
        _W[key] = (w, w.astype(cp.float32))
    return _W[key]


@pytest.mark.parametrize("t", TS)          # (the top decorator varies fastest: one weight per shape)
@pytest.mark.parametrize("n,k", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
def test_skinny_kernel_matches_fp32_matmul(cp, skinny, dtype, n, k, t):
    code = CODES[dtype]
    stream = cp.cuda.get_current_stream()
    w, w32 = weight(cp, dtype, n, k)
    cp.random.seed(1000 * t + n + k)
    xbig = rnd(cp, (t, k + 24), dtype)              # strided rows: x_ld = k + 24 (16-byte multiple)
    x = xbig[:, 8: 8 + k]                           # ... starting 16 bytes into the row
    ref = x.astype(cp.float32) @ w32.T
    assert lt.OwnSkinny.applies(t, k, ld(x), ld(w), code, lt._align(x.data.ptr), lt._align(w.data.ptr))
    cfgs = all_configs(skinny, t, n, k)
    assert cfgs
    for cfg in cfgs:
        what = f"t={t} n={n} k={k} {lt.OwnSkinny.describe(cfg)}"
        ybig = poison(cp, cp.empty((t, n + 5), dtype=dtype))   # y_ld > n, odd
        y = ybig[:, :n]
        skinny.launch(cfg, stream.ptr, x.data.ptr, ld(x), w.data.ptr, ld(w), y.data.ptr, ld(ybig), t, n, k, code,
                      False)
        assert rel_err(cp, y, ref) <= 1e-2, what
        assert bool(cp.isnan(ybig[:, n:].astype(cp.float32)).all()), f"{what}: wrote past n"
        # accumulate: y += x @ w.T on top of the previous contents
        y0 = rnd(cp, (t, n), dtype)
        y[...] = y0
        skinny.launch(cfg, stream.ptr, x.data.ptr, ld(x), w.data.ptr, ld(w), y.data.ptr, ld(ybig), t, n, k, code,
                      True)
        assert rel_err(cp, y, ref + y0.astype(cp.float32)) <= 1e-2, f"{what} accumulate"
        assert bool(cp.isnan(ybig[:, n:].astype(cp.float32)).all()), f"{what}: accumulate wrote past n"


@pytest.mark.parametrize("t,n,k", [(5, 1000, 4104), (16, 4096, 12288), (64, 12288, 4096)])
def test_skinny_graph_replay_equals_eager(cp, skinny, t, n, k):
    """Every config, eager vs. one captured launch replayed twice (and again after new x in the
    same buffer): the same bits. The k split is reduced in a fixed order inside the cluster and
    leaves nothing behind, so replays are independent of each other and of the eager calls."""
    code = lt.CUDA_R_16BF
    cp.random.seed(t + n + k)
    w = rnd(cp, (n, k), BF16, k ** -0.5)
    x = rnd(cp, (t, k), BF16)
    stream = cp.cuda.Stream(non_blocking=True)
    for cfg in all_configs(skinny, t, n, k):
        what = lt.OwnSkinny.describe(cfg)
        with stream:
            def run(y, acc=False, cfg=cfg):
                skinny.launch(cfg, stream.ptr, x.data.ptr, k, w.data.ptr, k, y.data.ptr, n, t, n, k, code, acc)

            eager = poison(cp, cp.empty((t, n), BF16))
            run(eager)
            again = poison(cp, cp.empty((t, n), BF16))
            run(again)
            graph_y = poison(cp, cp.empty((t, n), BF16))
            stream.synchronize()
            stream.begin_capture()
            run(graph_y)
            graph = stream.end_capture()
            graph.launch(stream)
            stream.synchronize()
            first = graph_y.copy()
            poison(cp, graph_y)
            graph.launch(stream)
            stream.synchronize()
            assert cp.array_equal(eager.view(np.uint16), again.view(np.uint16)), f"{what}: not deterministic"
            assert cp.array_equal(first.view(np.uint16), eager.view(np.uint16)), f"{what}: replay 1 != eager"
            assert cp.array_equal(graph_y.view(np.uint16), eager.view(np.uint16)), f"{what}: replay 2 != eager"
            x[...] = rnd(cp, (t, k), BF16)              # new input, same buffer
            graph.launch(stream)
            run(eager)
            stream.synchronize()
            assert cp.array_equal(graph_y.view(np.uint16), eager.view(np.uint16)), f"{what}: replay on new x"
            assert rel_err(cp, graph_y, x.astype(cp.float32) @ w.astype(cp.float32).T) <= 1e-2, what


def test_borrowed_skinny_plan_only_where_t_fits(cp, ops):
    """Row counts between the decode buckets borrow a tuned skinny plan only when its compiled T
    covers t: the smallest tuned t above always does; the largest tuned t below only while
    t <= its T; otherwise cublasGemmEx. Every result is right either way."""
    g = lt.LtGemm.open(own_skinny=lt.OwnSkinny(ops.kernel))
    n, k = 2048, 4096
    cp.random.seed(77)
    w = rnd(cp, (n, k), BF16, k ** -0.5)
    s = cp.cuda.get_current_stream()

    def run(t):
        x = rnd(cp, (t, k), BF16)
        y = poison(cp, cp.empty((t, n), BF16))
        g.gemm_rowmajor_xwT(s.ptr, x.data.ptr, k, w.data.ptr, k, y.data.ptr, n, t, n, k, lt.CUDA_R_16BF)
        s.synchronize()
        assert rel_err(cp, y, x.astype(cp.float32) @ w.astype(cp.float32).T) <= 1e-2, (t, g.last_plan.name)
        return g.last_plan

    run(48)                                             # tuned (whatever wins)
    tuned = next(iter(g._tuned.values()))
    skinny = g.own_skinny.configs(48, n, k)[0]         # T = 64
    tuned[48] = lt.Plan(name=lt.OwnSkinny.describe(skinny), tuned=True, own=skinny, family="skinny")
    g._generation += 1
    for t in (40, 56):                                  # 40: 48 is above; 56: 48 below, T = 64 covers it
        p = run(t)
        assert p.family == "skinny" and p.own == skinny and "(as t=48)" in p.name, (t, p.name)
    tuned.clear()
    small = g.own_skinny.configs(16, n, k)[0]           # T = 16
    tuned[16] = lt.Plan(name=lt.OwnSkinny.describe(small), tuned=True, own=small, family="skinny")
    g._plans.clear()
    g._generation += 1
    p = run(13)                                         # 16 above: borrowed
    assert p.family == "skinny" and p.own == small, p.name
    p = run(20)                                         # only 16 below: T = 16 does not cover 20
    assert p.own is None and p.algo is None and "does not cover" in p.name, p.name
    g.close()


def _copy_bw(cp) -> float:
    a = cp.empty(1 << 30, dtype=cp.uint8)
    b = cp.empty_like(a)
    a.fill(1)
    cp.copyto(b, a)
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(5):
        cp.copyto(b, a)
    end.record()
    end.synchronize()
    return 2 * a.nbytes * 5 / (cp.cuda.get_elapsed_time(start, end) / 1e3)


@pytest.mark.parametrize("t", [16, 64])
def test_linear_tuned_9b_shape(cp, t, capsys):
    """CudaOps.linear (tuning on, skinny candidates included) on the 4096 x 12288 weight: right on
    the first (tuning) call; a captured graph of the same call, replayed on new x, equals the eager
    call bit for bit. Prints the plan that won, with its bandwidth (the tuner's graph timing)."""
    from metrale.backends.cuda import CudaOps

    ops = CudaOps()                                   # a fresh tuner: the first call tunes
    blas = ops._blas()
    assert isinstance(blas, lt.LtGemm) and blas.own_skinny is not None
    n_out, k = 4096, 12288
    cp.random.seed(t)
    w = rnd(cp, (n_out, k), BF16, k ** -0.5)
    x = rnd(cp, (t, k), BF16)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        y = ops.linear(x, w)
        stream.synchronize()
        plan = blas.last_plan
        assert plan.tuned and plan.tune_s is not None
        assert rel_err(cp, y, x.astype(cp.float32) @ w.astype(cp.float32).T) <= 1e-2, plan.name
        ops.linear(x, w)
        stream.synchronize()
        stream.begin_capture()
        y_graph = ops.linear(x, w)
        graph = stream.end_capture()
        x[...] = rnd(cp, (t, k), BF16)
        graph.launch(stream)
        y_eager = ops.linear(x, w)
        stream.synchronize()
    assert blas.last_plan is plan
    assert rel_err(cp, y_graph, x.astype(cp.float32) @ w.astype(cp.float32).T) <= 1e-2, plan.name
    assert cp.array_equal(y_graph.view(np.uint16), y_eager.view(np.uint16)), \
        f"graph replay differs from the eager call ({plan.name})"
    nbytes = (n_out * k + t * k + t * n_out) * 2
    bw = _copy_bw(cp)
    with capsys.disabled():
        frac = nbytes / plan.time_s / bw if plan.time_s else float("nan")
        base = nbytes / plan.gemmex_s / bw if plan.gemmex_s else float("nan")
        print(f"\nt={t} {n_out}x{k}: {plan.name}  {1e6 * (plan.time_s or 0):.1f} us = {100 * frac:.1f} % of copy bw "
              f"({bw / 1e12:.2f} TB/s); gemmex {1e6 * (plan.gemmex_s or 0):.1f} us = {100 * base:.1f} %; "
              f"{plan.candidates} timed, tuning {1e3 * (plan.tune_s or 0):.0f} ms")
