"""Our decode GEMV kernels (kernels_cuda/gemv.cu, launched by metrale.backends.cuda.gemm.cublaslt.OwnGemv)
against a cupy float32 matmul: every row count 1..8 (3, 5, 7 run the next compiled T), every
(R, k split) config, n not a multiple of R, k not a multiple of a round, strided x and y rows,
accumulate, bf16 and fp16; relative Frobenius error <= 1e-2 (16-bit output rounding). Then
through CudaOps.linear with tuning on: right on the first (tuning) call, a captured graph's replay
equals the eager call bit for bit, and the plan chosen for SmolLM2-135M's decode shapes at t = 1
is printed (which one wins is measured on the H200, not asserted).

GPU only (skipped without one); runs on the H200 through perf/gpu_run.sh."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from metrale.backends.cuda.gemm import cublaslt as lt

pytestmark = pytest.mark.gpu

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
CODES = {BF16: lt.CUDA_R_16BF, F16: lt.CUDA_R_16F}
NAN_BITS = {BF16: 0x7FC0, F16: 0x7E00}
NS = (1, 7, 64, 576, 3072)
KS = (8, 64, 576, 1536, 4096)
SMOLLM2 = [(576, 576), (192, 576), (960, 576), (3072, 576), (576, 1536)]   # [out x in] decode GEMMs


@pytest.fixture(scope="module")
def cp():
    import cupy

    return cupy


@pytest.fixture(scope="module")
def ops():
    from metrale.backends.cuda import CudaOps

    return CudaOps()


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


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
@pytest.mark.parametrize("t", range(1, 9))
def test_gemv_kernel_matches_fp32_matmul(cp, ops, dtype, t):
    gemv = lt.OwnGemv(ops.kernel)
    code = CODES[dtype]
    stream = cp.cuda.get_current_stream()
    for n in NS:
        for k in KS:
            cp.random.seed(1000 * t + 10 * n + k)
            w = rnd(cp, (n, k), dtype, k ** -0.5)
            xbig = rnd(cp, (t, k + 24), dtype)          # strided rows: x_ld = k + 24 (16-byte multiple)
            x = xbig[:, 8: 8 + k]                       # ... starting 16 bytes into the row
            ref = x.astype(cp.float32) @ w.astype(cp.float32).T
            assert lt.OwnGemv.applies(t, k, ld(x), ld(w), code, lt._align(x.data.ptr), lt._align(w.data.ptr))
            for cfg in lt.OwnGemv.configs(k):
                what = f"t={t} n={n} k={k} {lt.OwnGemv.describe(cfg)}"
                ybig = poison(cp, cp.empty((t, n + 5), dtype=dtype))   # y_ld > n, odd
                y = ybig[:, :n]
                gemv.launch(cfg, stream.ptr, x.data.ptr, ld(x), w.data.ptr, ld(w), y.data.ptr, ld(ybig), t, n, k,
                            code, False)
                assert rel_err(cp, y, ref) <= 1e-2, what
                assert bool(cp.isnan(ybig[:, n:].astype(cp.float32)).all()), f"{what}: wrote past n"
                # accumulate: y += x @ w.T on top of the previous result
                y0 = rnd(cp, (t, n), dtype)
                y[...] = y0
                gemv.launch(cfg, stream.ptr, x.data.ptr, ld(x), w.data.ptr, ld(w), y.data.ptr, ld(ybig), t, n, k,
                            code, True)
                assert rel_err(cp, y, ref + y0.astype(cp.float32)) <= 1e-2, f"{what} accumulate"
                assert bool(cp.isnan(ybig[:, n:].astype(cp.float32)).all()), f"{what}: accumulate wrote past n"


def test_gemv_is_deterministic(cp, ops):
    """Same config, same inputs: the same bits (no atomics; fixed reduction order)."""
    gemv = lt.OwnGemv(ops.kernel)
    cp.random.seed(7)
    t, n, k = 4, 960, 1536
    x, w = rnd(cp, (t, k), BF16), rnd(cp, (n, k), BF16, k ** -0.5)
    s = cp.cuda.get_current_stream().ptr
    for cfg in lt.OwnGemv.configs(k):
        a, b = cp.empty((t, n), BF16), cp.empty((t, n), BF16)
        for y in (a, b):
            gemv.launch(cfg, s, x.data.ptr, k, w.data.ptr, k, y.data.ptr, n, t, n, k, lt.CUDA_R_16BF, False)
        assert cp.array_equal(a.view(np.uint16), b.view(np.uint16)), lt.OwnGemv.describe(cfg)


@pytest.mark.parametrize("t", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("n_out,k", SMOLLM2)
def test_linear_tuned_with_gemv_first_call_and_graph(cp, n_out, k, t):
    """CudaOps.linear (tuning on, own GEMV a candidate): right on the first (tuning) call; a
    captured graph of the same call, replayed on new x, equals the eager call bit for bit."""
    from metrale.backends.cuda import CudaOps

    ops = CudaOps()                                   # a fresh tuner: the first call tunes
    blas = ops._blas()
    assert isinstance(blas, lt.LtGemm) and blas.own_gemv is not None
    cp.random.seed(n_out + k + t)
    w = rnd(cp, (n_out, k), BF16, k ** -0.5)
    x = rnd(cp, (t, k), BF16)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        y = ops.linear(x, w)                          # tunes (t a bucket) or borrows / gemmex (t = 3)
        stream.synchronize()
        assert rel_err(cp, y, x.astype(cp.float32) @ w.astype(cp.float32).T) <= 1e-2, blas.last_plan.name
        plan = blas.last_plan
        if t in lt.TUNE_T:
            assert plan.tuned and plan.tune_s is not None, "decode buckets are tuned, any weight size, t <= 8"
        ops.linear(x, w)                              # warm (pool, kernels)
        stream.synchronize()
        stream.begin_capture()
        y_graph = ops.linear(x, w)
        graph = stream.end_capture()
        x[...] = rnd(cp, (t, k), BF16)                # new input, same buffer
        graph.launch(stream)
        y_eager = ops.linear(x, w)
        stream.synchronize()
    assert blas.last_plan is plan or not plan.tuned
    assert rel_err(cp, y_graph, x.astype(cp.float32) @ w.astype(cp.float32).T) <= 1e-2, plan.name
    assert cp.array_equal(y_graph.view(np.uint16), y_eager.view(np.uint16)), \
        f"graph replay differs from the eager call ({plan.name})"
    print(f"\nt={t} {n_out}x{k}: {plan.name}  ({plan.as_dict()})")


def test_smollm2_plans_at_t1(cp, capsys):
    """Reports (does not assert) which plan wins each SmolLM2-135M decode GEMM at t = 1."""
    from metrale.backends.cuda import CudaOps

    ops = CudaOps()
    blas = ops._blas()
    rows = []
    for n_out, k in SMOLLM2:
        cp.random.seed(n_out * 3 + k)
        w = rnd(cp, (n_out, k), BF16, k ** -0.5)
        x = rnd(cp, (1, k), BF16)
        y = ops.linear(x, w)
        cp.cuda.get_current_stream().synchronize()
        assert rel_err(cp, y, x.astype(cp.float32) @ w.astype(cp.float32).T) <= 1e-2
        p = blas.last_plan
        rows.append(f"{n_out:>5}x{k:<5} {p.name:<45} {1e6 * (p.time_s or 0):7.2f} us "
                    f"(gemmex {1e6 * (p.gemmex_s or 0):7.2f} us, {p.candidates} timed)")
    with capsys.disabled():
        print("\nSmolLM2-135M decode GEMMs at t=1, tuned plans:\n" + "\n".join(rows))


@pytest.mark.parametrize("t", [1, 2, 3, 8])
def test_gemv_fp32_output_matches_fp32_matmul(cp, ops, t):
    """gemv_t*_bf16_f32 (the lm head's logits): bf16 inputs, fp32 y, never rounded to bf16:
    within fp32 accumulation-order error of a cupy fp32 matmul (1e-5 relative), for every config,
    n not a multiple of R, a strided y, accumulate."""
    gemv = lt.OwnGemv(ops.kernel)
    stream = cp.cuda.get_current_stream()
    for n, k in ((7, 64), (3072, 576), (49152, 576)):
        cp.random.seed(31 * t + n + k)
        w = rnd(cp, (n, k), BF16, k ** -0.5)
        x = rnd(cp, (t, k), BF16)
        ref = x.astype(cp.float32) @ w.astype(cp.float32).T
        assert lt.OwnGemv.applies(t, k, k, k, lt.CUDA_R_16BF, 256, 256, lt.CUDA_R_32F)
        assert not lt.OwnGemv.applies(t, k, k, k, lt.CUDA_R_16F, 256, 256, lt.CUDA_R_32F)
        for cfg in lt.OwnGemv.configs(k):
            what = f"t={t} n={n} k={k} {lt.OwnGemv.describe(cfg)}"
            ybig = cp.full((t, n + 3), cp.nan, dtype=cp.float32)
            y = ybig[:, :n]
            gemv.launch(cfg, stream.ptr, x.data.ptr, k, w.data.ptr, k, y.data.ptr, n + 3, t, n, k,
                        lt.CUDA_R_16BF, False, lt.CUDA_R_32F)
            assert rel_err(cp, y, ref) <= 1e-5, what
            assert bool(cp.isnan(ybig[:, n:]).all()), f"{what}: wrote past n"
            y0 = cp.random.standard_normal((t, n), dtype=cp.float32)
            y[...] = y0
            gemv.launch(cfg, stream.ptr, x.data.ptr, k, w.data.ptr, k, y.data.ptr, n + 3, t, n, k,
                        lt.CUDA_R_16BF, True, lt.CUDA_R_32F)
            assert rel_err(cp, y, ref + y0) <= 1e-5, f"{what} accumulate"


@pytest.mark.parametrize("t", [1, 4, 16, 64, 200])
def test_lm_head_returns_fp32_logits_with_ties_intact(cp, t):
    """CudaOps.lm_head: fp32 logits (tuned path at decode sizes, cuBLAS past them) equal to an
    fp32 matmul of the bf16 operands within 1e-5 relative on the first (tuning) call and on the
    tuned plan; and the planted exact tie of two rows of w stays a tie the sampler breaks to the lower id."""
    from metrale.backends.cuda import CudaOps
    from metrale.backends.cuda.sampling import GpuSampler
    from metrale.sampling import SamplingParams

    ops = CudaOps()
    n, k = 49152, 576
    cp.random.seed(t)
    w = rnd(cp, (n, k), BF16, k ** -0.5)
    w[777] = w[4242]                                 # two tokens with identical logits
    x = rnd(cp, (t, k), BF16)
    w[4242] = x[0] * 4                               # ... and the largest ones for row 0
    w[777] = w[4242]
    ref = x.astype(cp.float32) @ w.astype(cp.float32).T
    y = ops.lm_head(x, w)                            # first call tunes
    assert y.dtype == cp.float32 and y.shape == (t, n)
    assert rel_err(cp, y, ref) <= 1e-5
    y2 = ops.lm_head(x, w)                           # the tuned plan
    assert rel_err(cp, y2, ref) <= 1e-5
    assert float(y2[0, 777]) == float(y2[0, 4242])
    sampler = GpuSampler(ops, vocab_size=n, max_batch=max(t, 1))
    toks = sampler.sample(y2, [SamplingParams(temperature=0.0)] * t, [0] * t)
    assert int(toks[0]) == 777
