"""cuBLASLt GEMMs with per-shape autotuning (metrale/backends/cuda/gemm/cublaslt.py) against a cupy float32
matmul reference: the very first (tuning) call, odd sizes, strided rows, accumulate, bf16 / fp16 /
fp32, graph capture of tuned and of never-tuned keys, and the METRALE_GEMM_TUNE=0 lever.
16-bit outputs: relative Frobenius error <= 1e-2; fp32: 1e-4.

The GPU tests (marked gpu, skipped without a GPU) run on the H200 through perf/gpu_run.sh. The
struct-layout test runs anywhere; the descriptor test wherever libcublasLt can be loaded (a GPU
is not needed to create descriptors)."""
from __future__ import annotations

import ctypes

import ml_dtypes
import numpy as np
import pytest

from metrale.backends.cuda.gemm import cublaslt as lt

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
CODES = {BF16: lt.CUDA_R_16BF, F16: lt.CUDA_R_16F, F32: lt.CUDA_R_32F}
TOL = {BF16: 1e-2, F16: 1e-2, F32: 1e-4}
gpu = pytest.mark.gpu


# -- no GPU needed --------------------------------------------------------------------------------
def test_struct_layouts_match_the_header():
    """cublasLt.h (13.x): cublasLtMatmulAlgo_t is uint64_t data[8]; cublasLtMatmulHeuristicResult_t
    is {algo; size_t workspaceSize; cublasStatus_t state; float wavesCount; int reserved[4]}."""
    assert ctypes.sizeof(lt.MatmulAlgo) == 64
    assert ctypes.sizeof(lt.HeuristicResult) == 96
    offsets = {name: getattr(lt.HeuristicResult, name).offset
               for name in ("algo", "workspaceSize", "state", "wavesCount", "reserved")}
    assert offsets == {"algo": 0, "workspaceSize": 64, "state": 72, "wavesCount": 76, "reserved": 80}
    arr = (lt.HeuristicResult * 3)()
    assert ctypes.addressof(arr[1]) - ctypes.addressof(arr[0]) == 96


@pytest.mark.gpu   # needs libcublasLt, which comes with the GPU machine's CUDA (not with CI's)
def test_descriptor_attribute_ids_and_sizes():
    """The library itself checks each attribute's size (CUBLAS_STATUS_INVALID_VALUE = 7 on a
    mismatch): our ids and value types are right if the right size succeeds and a wrong one fails."""
    lib = lt.load_libcublaslt()
    lt.declare(lib)
    vp = ctypes.c_void_p
    desc, pref, lay = vp(), vp(), vp()
    assert lib.cublasLtMatmulDescCreate(ctypes.byref(desc), lt.CUBLAS_COMPUTE_32F, lt.CUDA_R_32F) == 0
    assert lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)) == 0
    assert lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), lt.CUDA_R_16BF, 4096, 8, 4104) == 0
    try:
        for attr in (lt.CUBLASLT_MATMUL_DESC_TRANSA, lt.CUBLASLT_MATMUL_DESC_TRANSB):
            v32, v64 = ctypes.c_int32(lt.CUBLAS_OP_T), ctypes.c_int64(lt.CUBLAS_OP_T)
            assert lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(v32), 4) == 0
            assert lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(v64), 8) == 7
        ws = ctypes.c_uint64(32 << 20)
        assert lib.cublasLtMatmulPreferenceSetAttribute(
            pref, lt.CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws), 8) == 0
        assert lib.cublasLtMatmulPreferenceSetAttribute(
            pref, lt.CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws), 4) == 7
        for attr in (lt.CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, lt.CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                     lt.CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, lt.CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES):
            al = ctypes.c_uint32(16)
            assert lib.cublasLtMatmulPreferenceSetAttribute(pref, attr, ctypes.byref(al), 4) == 0
            assert lib.cublasLtMatmulPreferenceSetAttribute(pref, attr, ctypes.byref(al), 8) == 7
    finally:
        lib.cublasLtMatrixLayoutDestroy(lay)
        lib.cublasLtMatmulPreferenceDestroy(pref)
        lib.cublasLtMatmulDescDestroy(desc)


def test_alignment_class():
    assert lt._align(0x7F0000000000) == 256
    assert lt._align(0x7F0000000000 + 64) == 64
    assert lt._align(0x7F0000000000 + 6) == 2


# -- GPU ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cp():
    import cupy

    return cupy


def rnd(cp, shape, dtype, scale=1.0):
    return (cp.random.standard_normal(shape, dtype=cp.float32) * scale).astype(dtype)


_NAN_BITS = {2: (np.uint16, {BF16: 0x7FC0, F16: 0x7E00}), 4: (np.uint32, {F32: 0x7FC00000})}


def bits(a):
    """The same array as unsigned integers of its width (bitwise comparisons)."""
    return a.view(_NAN_BITS[a.itemsize][0])


def poisoned(cp, shape, dtype):
    """A new array full of NaN: an element the GEMM forgets to write fails the test."""
    a = cp.empty(shape, dtype=dtype)
    utype, nans = _NAN_BITS[np.dtype(dtype).itemsize]
    a.view(utype).fill(nans[np.dtype(dtype)])
    return a


def ld(a) -> int:
    return a.strides[0] // a.itemsize


def gemm(g, cp, x, w, y, accumulate=False):
    t, k = x.shape
    n_out = w.shape[0]
    assert x.strides[1] == w.strides[1] == y.strides[1] == x.itemsize
    g.gemm_rowmajor_xwT(cp.cuda.get_current_stream().ptr, x.data.ptr, max(ld(x), k), w.data.ptr, ld(w),
                        y.data.ptr, ld(y), t, n_out, k, CODES[np.dtype(x.dtype)], accumulate)


def reference(cp, x, w, y0=None):
    r = x.astype(cp.float32) @ w.astype(cp.float32).T
    return r if y0 is None else r + y0.astype(cp.float32)


def rel_err(cp, out, ref) -> float:
    out = out.astype(cp.float32)
    assert bool(cp.isfinite(out).all()), "non-finite outputs (unwritten?)"
    return float(cp.linalg.norm((out - ref).ravel()) / max(float(cp.linalg.norm(ref.ravel())), 1e-30))


def new_gemm(mode="tune"):
    return lt.LtGemm.open(mode=mode)


# decode-sized (tuned: t a decode bucket, n_out * k >= 1M), odd ones (n_out / k not multiples of
# 16), row counts that borrow (t <= 256 not a bucket: cublasGemmEx in a fresh LtGemm), and shapes
# that are never tuned (t > 256; n_out * k < 1M)
SHAPES = [(1, 1024, 1024), (2, 1027, 1030), (16, 2048, 1536), (64, 4096, 1024), (64, 1000, 4104),
          (3, 1027, 1030), (17, 2048, 1536), (300, 1024, 2048), (17, 3, 4096), (5, 129, 77)]


@gpu
@pytest.mark.parametrize("mode", ["tune", "heuristic"])
@pytest.mark.parametrize("dtype", [BF16, F16, F32], ids=["bf16", "f16", "f32"])
@pytest.mark.parametrize("t,n_out,k", SHAPES)
def test_first_call_and_cached_plan(cp, mode, dtype, t, n_out, k):
    cp.random.seed(t * 7 + n_out + k)
    g = new_gemm(mode)
    x, w = rnd(cp, (t, k), dtype), rnd(cp, (n_out, k), dtype, k ** -0.5)
    y = poisoned(cp, (t, n_out), dtype)
    gemm(g, cp, x, w, y)                                     # the tuning call
    ref = reference(cp, x, w)
    assert rel_err(cp, y, ref) <= TOL[dtype], f"first call ({g.last_plan.name})"
    plan = g.last_plan
    if mode == "tune":
        big = n_out * k >= lt.TUNE_MIN_WEIGHTS
        if big and t in lt.TUNE_T:
            assert plan.tuned and plan.tune_s is not None, "a decode bucket is tuned on its first call"
        else:
            assert plan.algo is None, "no neighbour to borrow from / not tuneable: cublasGemmEx"
            assert g.tune_seconds == 0.0, "only decode buckets are ever timed"
    y2 = poisoned(cp, (t, n_out), dtype)
    gemm(g, cp, x, w, y2)                                     # the cached plan
    assert g.last_plan is plan
    assert cp.array_equal(bits(y), bits(y2)), "the same plan must give the same bits"
    g.close()


@gpu
def test_other_row_counts_borrow_a_tuned_plan(cp):
    """t not a decode bucket (a prefill chunk, a mixed step) is never timed: it reuses the plan of
    the nearest tuned t (the smallest above, else the largest below), re-resolved once one exists."""
    cp.random.seed(5)
    g = new_gemm()
    n_out, k = 4096, 4096
    w = rnd(cp, (n_out, k), BF16, k ** -0.5)

    def run(t):
        x = rnd(cp, (t, k), BF16)
        y = poisoned(cp, (t, n_out), BF16)
        gemm(g, cp, x, w, y)
        assert rel_err(cp, y, reference(cp, x, w)) <= 1e-2, (t, g.last_plan.name)
        return g.last_plan

    assert run(13).algo is None and g.tune_seconds == 0.0        # nothing tuned yet: cublasGemmEx
    p16 = run(16)
    assert p16.tuned and g.tune_seconds > 0
    spent = g.tune_seconds
    p13 = run(13)                                                 # borrows t=16's plan now
    assert p13.tuned and g.tune_seconds == spent
    assert "t=16" in p13.name, p13.name                          # "<algo> (as t=16)"
    assert p13.algo_id == p16.algo_id, f"t=16's algorithm refused for t=13: {p13.name}"
    p40 = run(40)                                                 # the largest below: 16
    assert "t=16" in p40.name and g.tune_seconds == spent, p40.name
    g.close()


@gpu
@pytest.mark.parametrize("mode", ["tune", "heuristic"])
@pytest.mark.parametrize("x_off", [0, 8, 3])   # elements: 256-, 16- and 2-byte aligned rows
def test_strided_x_column_slice(cp, mode, x_off):
    """x is a column slice of a wider tensor (x_ld > k, pointer offset): the plan must hold for
    the pointer's alignment class."""
    cp.random.seed(11 + x_off)
    g = new_gemm(mode)
    t, n_out, k = 8, 2048, 1024
    big = rnd(cp, (t, k + 64), BF16)
    x = big[:, x_off: x_off + k]
    w = rnd(cp, (n_out, k), BF16, k ** -0.5)
    y = poisoned(cp, (t, n_out), BF16)
    gemm(g, cp, x, w, y)
    assert rel_err(cp, y, reference(cp, x, w)) <= 1e-2, g.last_plan.name
    # a 1-row x (decode) from the same slice
    y1 = poisoned(cp, (1, n_out), BF16)
    gemm(g, cp, x[:1], w, y1)
    assert rel_err(cp, y1, reference(cp, x[:1], w)) <= 1e-2, g.last_plan.name
    g.close()


@gpu
@pytest.mark.parametrize("mode", ["tune", "heuristic"])
@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "f32"])
@pytest.mark.parametrize("t", [1, 16, 64])
def test_accumulate(cp, mode, dtype, t):
    """y (+)= x @ w.T: the tuning call accumulates exactly once into the caller's y (tuning runs
    on a scratch copy); y is a column slice of a wider buffer (y_ld > n_out) whose other columns
    stay untouched."""
    cp.random.seed(20 + t)
    g = new_gemm(mode)
    n_out, k = 1536, 2048
    x, w = rnd(cp, (t, k), dtype), rnd(cp, (n_out, k), dtype, k ** -0.5)
    y_full = rnd(cp, (t, n_out + 40), dtype)
    y0 = y_full.copy()
    y = y_full[:, :n_out]
    gemm(g, cp, x, w, y, accumulate=True)
    assert rel_err(cp, y, reference(cp, x, w, y0[:, :n_out])) <= TOL[dtype], g.last_plan.name
    assert cp.array_equal(bits(y_full[:, n_out:]), bits(y0[:, n_out:]))
    y1 = y.copy()
    gemm(g, cp, x, w, y, accumulate=True)
    assert rel_err(cp, y, reference(cp, x, w, y1)) <= TOL[dtype], g.last_plan.name
    g.close()


@gpu
@pytest.mark.parametrize("t", [1, 8, 64])
def test_tuned_gemm_replays_from_a_cuda_graph(cp, t):
    """Tuned eagerly, captured, replayed on new x in the same buffer: equal (bit for bit: one
    plan, deterministic) to the eager call, and right."""
    cp.random.seed(30 + t)
    g = new_gemm()
    n_out, k = 4096, 3072
    w = rnd(cp, (n_out, k), BF16, k ** -0.5)
    x = rnd(cp, (t, k), BF16)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        y_eager = cp.empty((t, n_out), dtype=BF16)
        gemm(g, cp, x, w, y_eager)                           # tunes
        assert g.last_plan.tuned
        plan = g.last_plan
        y_graph = poisoned(cp, (t, n_out), BF16)
        stream.synchronize()
        stream.begin_capture()
        gemm(g, cp, x, w, y_graph)
        graph = stream.end_capture()
        assert g.last_plan is plan
        x_new = rnd(cp, (t, k), BF16)
        x.data.copy_from_device_async(x_new.data, x.nbytes, stream)   # new input, same buffer
        graph.launch(stream)
        gemm(g, cp, x, w, y_eager)
        stream.synchronize()
    assert rel_err(cp, y_graph, reference(cp, x, w)) <= 1e-2, plan.name
    assert cp.array_equal(bits(y_graph), bits(y_eager)), \
        f"graph replay differs from the eager call ({plan.name})"
    g.close()


@gpu
def test_untuned_key_inside_capture(cp):
    """A key first seen during capture is not timed (nothing may sync or launch extra work): it
    runs the heuristic's first algorithm, correctly; the next eager call tunes it."""
    cp.random.seed(40)
    g = new_gemm()
    t, n_out, k = 4, 4096, 4096
    w = rnd(cp, (n_out, k), BF16, k ** -0.5)
    x = rnd(cp, (t, k), BF16)
    y = poisoned(cp, (t, n_out), BF16)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        gemm(g, cp, x, w, y)
        graph = stream.end_capture()
        assert not g.last_plan.tuned and g.tune_seconds == 0.0
        graph.launch(stream)
        stream.synchronize()
        assert rel_err(cp, y, reference(cp, x, w)) <= 1e-2, g.last_plan.name
        y2 = poisoned(cp, (t, n_out), BF16)
        gemm(g, cp, x, w, y2)                                # eager: tunes now
        stream.synchronize()
        assert g.last_plan.tuned and g.tune_seconds > 0
        assert rel_err(cp, y2, reference(cp, x, w)) <= 1e-2, g.last_plan.name
        bits(y).fill(0x7FC0)
        graph.launch(stream)                                 # the captured (provisional) plan still runs
        stream.synchronize()
    assert rel_err(cp, y, reference(cp, x, w)) <= 1e-2
    g.close()


@gpu
def test_cudaops_linear_uses_tuned_lt(cp):
    from metrale.backends.cuda import CudaOps

    ops = CudaOps()
    blas = ops._blas()
    assert isinstance(blas, lt.LtGemm), "libcublasLt should load next to libcublas"
    cp.random.seed(50)
    x, w = rnd(cp, (8, 4096), BF16), rnd(cp, (4096, 4096), BF16, 4096 ** -0.5)
    y = ops.linear(x, w)
    assert blas.last_plan.tuned
    assert rel_err(cp, y, reference(cp, x, w)) <= 1e-2


@gpu
def test_tune_lever_off_gives_gemmex(cp, monkeypatch):
    from metrale.backends.cuda.gemm import cublas
    from metrale.backends.cuda import CudaOps

    monkeypatch.setenv("METRALE_GEMM_TUNE", "0")
    ops = CudaOps()
    blas = ops._blas()
    assert type(blas) is cublas.Cublas
    cp.random.seed(60)
    x, w = rnd(cp, (8, 4096), BF16), rnd(cp, (4096, 4096), BF16, 4096 ** -0.5)
    assert rel_err(cp, ops.linear(x, w), reference(cp, x, w)) <= 1e-2


@gpu
def test_unsplit_copies_of_split_k_algorithms_are_candidates_and_correct(cp):
    """The 9B down projection at decode size: the heuristic answers with split-K algorithms (fp32
    partials + a reduction kernel); the tuner also times each of them unsplit. Every unsplit copy
    is a valid cuBLASLt configuration that computes the product."""
    cp.random.seed(70)
    t, n_out, k = 8, 4096, 12288
    g = new_gemm()
    x, w = rnd(cp, (t, k), BF16), rnd(cp, (n_out, k), BF16, k ** -0.5)
    y = poisoned(cp, (t, n_out), BF16)
    key = (t, n_out, k, k, k, n_out, lt.CUDA_R_16BF, False, lt._align(x.data.ptr), lt._align(w.data.ptr),
           lt._align(y.data.ptr), lt.CUDA_R_16BF)
    layouts = g._key_layouts(key)
    bases = [lt.MatmulAlgo.from_buffer_copy(r.algo) for r in g._heuristics(key, layouts, lt.MAX_HEURISTICS)]
    split = [b for b in bases if (g._cfg(b, lt.CUBLASLT_ALGO_CONFIG_SPLITK_NUM) or 1) > 1]
    assert split, "expected split-K algorithms from the heuristic for this shape (cuBLASLt 13.1, H200)"
    unsplit = g._unsplit_variants(bases, layouts)
    assert unsplit, "no split-K algorithm accepted its unsplit copy"
    assert len(unsplit) <= len(split)
    ref = reference(cp, x, w)
    for algo in unsplit:
        assert g._cfg(algo, lt.CUBLASLT_ALGO_CONFIG_SPLITK_NUM) == 1
        assert g._cfg(algo, lt.CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, ctypes.c_uint32) == lt.CUBLASLT_REDUCTION_SCHEME_NONE
        name, aid = g.describe(algo)
        plan = lt.Plan(algo, layouts, name, aid, tuned=True)
        y = poisoned(cp, (t, n_out), BF16)
        g._run(plan, cp.cuda.get_current_stream().ptr, x.data.ptr, k, w.data.ptr, k, y.data.ptr, n_out, t, n_out, k,
               lt.CUDA_R_16BF, False)
        assert rel_err(cp, y, ref) <= TOL[BF16], name
    gemm(g, cp, x, w, y)                                      # the tuning call: times them too
    assert g.last_plan.tuned and g.last_plan.candidates >= len(unsplit)
    assert rel_err(cp, y, ref) <= TOL[BF16], g.last_plan.name
    g.close()


@gpu
@pytest.mark.parametrize("mode", ["auto", "force"])
def test_k_split_plan_partials_sum_to_the_product(cp, mode):
    """ksplit_plan for the 9B down projection at t = 32: decided once, after the key's plain plan
    is tuned; when it answers with a plan, run_ksplit's fp32 partials sum to x @ w.T. "force"
    always answers with one; "auto" keeps it only when it times faster (either is valid here)."""
    cp.random.seed(80)
    t, n_out, k = 32, 4096, 12288
    g = new_gemm()
    g.ksplit_mode = mode
    x, w = rnd(cp, (t, k), BF16), rnd(cp, (n_out, k), BF16, k ** -0.5)
    args = (cp.cuda.get_current_stream().ptr, x.data.ptr, k, w.data.ptr, k, t, n_out, k, lt.CUDA_R_16BF)
    assert g.ksplit_plan(*args) is None, "no k-split before the plain plan is tuned"
    y = poisoned(cp, (t, n_out), BF16)
    gemm(g, cp, x, w, y)                                      # tunes the plain plan
    plan = g.ksplit_plan(*args)                               # decides
    assert g.ksplit_plan(*args) is plan, "decided once"
    if mode == "force":
        assert plan is not None
    if plan is not None:
        parts = cp.full((lt.KSPLIT_S, t, n_out), cp.nan, dtype=cp.float32)
        g.run_ksplit(plan, cp.cuda.get_current_stream().ptr, x.data.ptr, w.data.ptr, parts.data.ptr)
        assert rel_err(cp, parts.sum(axis=0), reference(cp, x, w)) <= 1e-3, plan.name
    small = (cp.cuda.get_current_stream().ptr, x.data.ptr, k, w.data.ptr, k, 8, n_out, k, lt.CUDA_R_16BF)
    assert g.ksplit_plan(*small) is None, "fewer rows than KSPLIT_MIN_T: never split"
    g.close()
