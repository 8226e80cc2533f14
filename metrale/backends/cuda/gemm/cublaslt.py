"""cuBLASLt through ctypes: the linear GEMM of `cublas.Cublas`, with a per-shape autotuner.

Why: at decode sizes (few rows, e.g. y[M, 4096] = x[M, 12288] @ w.T) cublasGemmEx's default
choice leaves most of the 132 SMs idle (few output tiles, long K) and streams the weights at
73-81 % of the copy bandwidth. cuBLASLt lists several algorithms per shape (split-K, other tiles
and cluster shapes); timing them once on the real operands and keeping the fastest fixes that.

`LtGemm.gemm_rowmajor_xwT` has the semantics of `Cublas.gemm_rowmajor_xwT` (row-major
y[t, n_out] (+)= x[t, k] @ w[n_out, k].T, fp32 compute), in cuBLASLt's column-major terms:
D (n_out x t, ld y_ld) = op_T(A = w: k x n_out, ld w_ld) @ (B = x: k x t, ld x_ld) (+ C = D).

Plans are cached per key (t, n_out, k, x_ld, w_ld, y_ld, dtype, accumulate, alignment of the
x / w / y pointers). Policy, for a weight of n_out * k >= TUNE_MIN_WEIGHTS elements:
  * t in `tune_t` (the decode-graph batch buckets, TUNE_T): the key's first call outside stream
    capture tunes it. The heuristic's algorithms (up to MAX_HEURISTICS), split-K variants of its
    best ones, and cublasGemmEx itself are each checked against a cublasGemmEx reference on a few
    rows, then timed from a captured CUDA graph (what decode runs) on a private stream, writing a
    scratch buffer laid out like y; the fastest wins, and the caller's y is written once, by the
    winner. A key first seen during capture never times anything: it runs the heuristic's first
    algorithm (correct, maybe slower) until a call outside capture tunes it.
  * other t <= TUNE_MAX_T (prefill chunks, mixed steps: any row count): never timed, so a new
    prompt length never stalls a step; the plan of the nearest tuned t of the same weight
    (the smallest above, else the largest below) is reused when cublasLtMatmulAlgoCheck accepts
    it for this t, else cublasGemmEx (re-resolved once a neighbour gets tuned).
  * t > TUNE_MAX_T or a small weight: cublasGemmEx, as before.
Own GEMV kernels (kernels_cuda/gemv.cu, `OwnGemv`, handed in by CudaOps as `own_gemv`): for
t <= GEMV_MAX_T with 16-byte aligned x / w (k, x_ld, w_ld multiples of 8; bf16 / fp16) they are
candidates too, checked and timed like the cuBLASLt algorithms and winning by the same margin.
Why: decode GEMMs of small models (SmolLM2-135M: 0.2-3.5 MB weights) are latency-bound, and
cuBLAS's tile kernels take ~3.8 us where the weight streams in well under 1 us. For those row
counts every weight size is tuned (the TUNE_MIN_WEIGHTS skip holds for t > GEMV_MAX_T, or where
the kernel does not apply); row counts between the decode buckets borrow a tuned gemv plan only
when t <= GEMV_MAX_T (the kernel variant is the smallest compiled T >= t).

Candidates besides the heuristic's answers: the heuristic's split-K algorithms unsplit (their
reduction kernel costs more than the split gains on the 9B decode shapes), split-K variants of
unsplit ones, cublasGemmEx and our GEMVs. And for a consumer that sums partials itself
(CudaOps.linear_parts -> add_rms_norm), `ksplit_plan`: the product as fp32 partials over two
slices of k in one strided-batched call, kept per shape when it beats the plain plan with the
weight out of L2 (kernels_cuda/README.md has the measurements).

Every enum value and struct layout below is from cublasLt.h of the nvidia-cublas 13.10.0.20 wheel
(nvidia/cu13/include/cublasLt.h), checked by compiling a C file against it (sizeof / offsetof /
enum values); the comments name the header's identifiers. These values have been stable across
cuBLASLt releases, and tests/test_cuda_cublaslt.py has the library itself check the attribute
sizes.
"""
from __future__ import annotations

import ctypes
import logging
import math
import time

from metrale.backends.cuda.gemm import cublas as _cublas
from metrale.backends.cuda.gemm.cublas import (CUBLAS_COMPUTE_32F, CUBLAS_OP_N, CUBLAS_OP_T, CUDA_R_16BF, CUDA_R_16F,
                                    CUDA_R_32F, CublasError)
from metrale.backends.cuda.kernels import LaunchContext
from metrale.backends.cuda.kernels import declare as declare_kernel

log = logging.getLogger("metrale.gemm")

# cublasLtMatmulDescAttributes_t (int32_t cublasOperation_t values)
CUBLASLT_MATMUL_DESC_TRANSA = 3
CUBLASLT_MATMUL_DESC_TRANSB = 4
# cublasLtMatmulPreferenceAttributes_t
CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES = 1      # uint64_t
CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES = 5    # uint32_t each, default 256
CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES = 6
CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES = 7
CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES = 8
# cublasLtMatmulAlgoConfigAttributes_t, with the size of each value
CUBLASLT_ALGO_CONFIG_ID = 0                 # int32_t
CUBLASLT_ALGO_CONFIG_TILE_ID = 1            # uint32_t
CUBLASLT_ALGO_CONFIG_SPLITK_NUM = 2         # int32_t
CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME = 3   # uint32_t
CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION = 5      # uint32_t
CUBLASLT_ALGO_CONFIG_STAGES_ID = 6          # uint32_t
CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID = 8   # uint16_t
# cublasLtMatmulAlgoCapAttributes_t
CUBLASLT_ALGO_CAP_SPLITK_SUPPORT = 0           # int32_t
CUBLASLT_ALGO_CAP_REDUCTION_SCHEME_MASK = 1    # uint32_t
# cublasLtReductionScheme_t
CUBLASLT_REDUCTION_SCHEME_NONE = 0
CUBLASLT_REDUCTION_SCHEME_INPLACE = 1        # in the output buffer, counters in the workspace
CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE = 2   # fp32 partials in the workspace, separate reduction
CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE = 4

TUNE_MAX_T = 256             # more rows than this: prefill, GemmEx (tuning would not pay)
# row counts that are tuned: the decode-graph buckets (metrale/backends/cuda/graphs.py BUCKETS; a runner
# whose largest bucket is not among them adds it to LtGemm.tune_t)
TUNE_T = frozenset((1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256))
TUNE_MIN_WEIGHTS = 1 << 20   # n_out * k below this: a tiny GEMM, host-bound anyway
MAX_HEURISTICS = 16          # algorithms asked of cublasLtMatmulAlgoGetHeuristic
SPLITK_BASES = 3             # split-K variants are built from this many of the best ones ...
SPLITK = (2, 4, 8, 16)       # ... with these splits (each split at least SPLITK_MIN_K deep)
SPLITK_MIN_K = 256
TUNE_BUDGET_S = 1.0          # no new candidate is timed past this much wall time per key
GRAPH_TARGET_S = 0.5e-3      # GPU time of one timing graph (calls per graph follow from it)
GRAPH_REPLAYS = 3            # timed replays per candidate (the fastest counts), after one warm-up
WIN_MARGIN = 0.01            # a cuBLASLt algorithm or own GEMV replaces GemmEx only if this much faster
CHECK_ROWS = 4               # rows (plus the last) each candidate is checked on against GemmEx
# own GEMV kernels (kernels_cuda/gemv.cu): row counts compiled in (a call with t rows runs the
# smallest >= t), output rows per warp group, k split over 1 / 2 / 4 warps, 128-thread CTAs
GEMV_MAX_T = 8
GEMV_T = (1, 2, 4, 8)
GEMV_R = (2, 4)
GEMV_KS_LOG2 = (0, 1, 2)
GEMV_WARPS = 4
declare_kernel("gemv", "gemv_t{}_r{}_{*}", "const E* x, long long x_ld, const E* w, long long w_ld, O* y, long long y_ld, "
        "int nt, int n, int k, int ks_log2, int accumulate")

# cublasLtMatrixLayoutAttribute_t
CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT = 5             # int32_t
CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET = 6    # int64_t
# k-split GEMMs (LtGemm.ksplit_plan): the product as KSPLIT_S fp32 partials over slices of k, one
# strided-batched cuBLASLt call, summed by the consumer (CudaOps.add_rms_norm); tried for decode
# buckets with at least KSPLIT_MIN_T rows, kept when faster than the tuned plain plan by
# WIN_MARGIN plus the consumer's extra reads (the partials: S x 4 bytes per output instead of 2)
# at KSPLIT_READ_BYTES_PER_S
KSPLIT_S = 2
KSPLIT_MIN_T = 16
KSPLIT_READ_BYTES_PER_S = 3.0e12
COLD_COPY_MAX_BYTES = 1 << 30   # the k-split decision times plain and k-split over 2 weight copies up to this size

_ITEMSIZE = {CUDA_R_16BF: 2, CUDA_R_16F: 2, CUDA_R_32F: 4}


class MatmulAlgo(ctypes.Structure):
    """cublasLtMatmulAlgo_t: `typedef struct { uint64_t data[8]; }` (64 bytes)."""
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class HeuristicResult(ctypes.Structure):
    """cublasLtMatmulHeuristicResult_t: { cublasLtMatmulAlgo_t algo; size_t workspaceSize;
    cublasStatus_t state; float wavesCount; int reserved[4]; } -- 96 bytes, offsets 0/64/72/76/80."""
    _fields_ = [("algo", MatmulAlgo), ("workspaceSize", ctypes.c_size_t), ("state", ctypes.c_int),
                ("wavesCount", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def load_libcublaslt(major: int | None = None) -> ctypes.CDLL:
    """libcublasLt (libcublas depends on it: once libcublas is loaded its soname resolves to the
    copy already in the process)."""
    return _cublas.load_library("cublasLt", major)


def declare(lib: ctypes.CDLL):
    """Set argtypes / restype of the cuBLASLt entry points we use (prototypes of cublasLt.h);
    returns cublasLtGetStatusName, or None where the library lacks it."""
    vp, i, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    P = ctypes.POINTER
    sigs = {
        "cublasLtCreate": [P(vp)],
        "cublasLtDestroy": [vp],
        "cublasLtMatmulDescCreate": [P(vp), i, i],              # cublasComputeType_t, cudaDataType_t
        "cublasLtMatmulDescDestroy": [vp],
        "cublasLtMatmulDescSetAttribute": [vp, i, vp, sz],
        "cublasLtMatrixLayoutCreate": [P(vp), i, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64],
        "cublasLtMatrixLayoutDestroy": [vp],
        "cublasLtMatrixLayoutSetAttribute": [vp, i, vp, sz],
        "cublasLtMatmulPreferenceCreate": [P(vp)],
        "cublasLtMatmulPreferenceDestroy": [vp],
        "cublasLtMatmulPreferenceSetAttribute": [vp, i, vp, sz],
        "cublasLtMatmulAlgoGetHeuristic": [vp, vp, vp, vp, vp, vp, vp, i, P(HeuristicResult), P(i)],
        "cublasLtMatmulAlgoCheck": [vp, vp, vp, vp, vp, vp, P(MatmulAlgo), P(HeuristicResult)],
        "cublasLtMatmulAlgoConfigGetAttribute": [P(MatmulAlgo), i, vp, sz, P(sz)],
        "cublasLtMatmulAlgoConfigSetAttribute": [P(MatmulAlgo), i, vp, sz],
        "cublasLtMatmulAlgoCapGetAttribute": [P(MatmulAlgo), i, vp, sz, P(sz)],
        # handle, desc, alpha, A, Adesc, B, Bdesc, beta, C, Cdesc, D, Ddesc, algo, workspace,
        # workspaceSizeInBytes, stream
        "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, P(MatmulAlgo), vp, sz, vp],
    }
    for name, args in sigs.items():
        f = getattr(lib, name)
        f.argtypes, f.restype = args, i
    lib.cublasLtGetVersion.argtypes, lib.cublasLtGetVersion.restype = [], sz
    try:
        f = lib.cublasLtGetStatusName
    except AttributeError:
        return None
    f.argtypes, f.restype = [i], ctypes.c_char_p
    return f


def _align(ptr: int) -> int:
    """Alignment class of a device pointer in bytes: its lowest set bit, capped at 256."""
    return min(256, ptr & -ptr) if ptr else 256


def _np_dtype(code: int):
    import ml_dtypes
    import numpy as np

    return {CUDA_R_16BF: np.dtype(ml_dtypes.bfloat16), CUDA_R_16F: np.dtype(np.float16),
            CUDA_R_32F: np.dtype(np.float32)}[code]


def _capturing(stream_ptr: int) -> bool:
    import cupy

    try:
        return bool(cupy.cuda.runtime.streamIsCapturing(stream_ptr))
    except Exception:   # the query itself is illegal (legacy stream while another one captures)
        return True


class Plan:
    """How one key runs: `own` set = our GEMV kernel with that (R, ks_log2) config (OwnGemv);
    else `algo` None = cublasGemmEx, else cublasLtMatmul with `algo` and the A/B/C layouts.
    `tuned` is False for a provisional plan (chosen during capture, or untimed)."""
    __slots__ = ("algo", "algo_id", "candidates", "gemmex_s", "layouts", "name", "own", "p_algo", "time_s",
                 "tune_s", "tuned")

    def __init__(self, algo=None, layouts=None, name="gemmex", algo_id=None, tuned=False, own=None):
        self.algo = algo
        self.p_algo = ctypes.pointer(algo) if algo is not None else None
        self.layouts = layouts
        self.own = own
        self.name, self.algo_id, self.tuned = name, algo_id, tuned
        self.time_s = self.gemmex_s = self.tune_s = None
        self.candidates = 0

    def as_dict(self) -> dict:
        return {"algo": self.name, "algo_id": self.algo_id, "own": self.own, "tuned": self.tuned,
                "time_s": self.time_s, "gemmex_s": self.gemmex_s, "candidates": self.candidates,
                "tune_s": self.tune_s}


class OwnGemv:
    """Launches kernels_cuda/gemv.cu (gemv_t<T>_r<R>_<bf16|f16>) for LtGemm. `kernel(module, fn)`
    returns the declared kernel (called by name, with stream=...): CudaOps.kernel
    (its KernelCache compiles the .cu once per arch). A config is (R, ks_log2): R output rows per
    group of 1 << ks_log2 warps splitting k (the layout of the .cu's header)."""

    def __init__(self, kernel):
        self._kernel = kernel
        self._fns: dict = {}
        self._streams: dict = {}

    @staticmethod
    def applies(t: int, k: int, x_ld: int, w_ld: int, dtype_code: int, x_align: int, w_align: int,
                y_code: int | None = None) -> bool:
        """The kernel's requirements: 16-byte vectors of x and w rows (k, leading dims multiples of
        8 elements, 16-byte aligned pointers), 16-bit types, 1..GEMV_MAX_T rows; y of the inputs'
        type, or fp32 from bf16 (the lm head's logits)."""
        y_ok = y_code in (None, dtype_code) or (dtype_code == CUDA_R_16BF and y_code == CUDA_R_32F)
        return (1 <= t <= GEMV_MAX_T and dtype_code in (CUDA_R_16BF, CUDA_R_16F) and y_ok and k > 0
                and k % 8 == 0 and x_ld % 8 == 0 and w_ld % 8 == 0 and x_align >= 16 and w_align >= 16)

    @staticmethod
    def configs(k: int) -> list[tuple[int, int]]:
        """The (R, ks_log2) candidates for a depth k: a wider k split only where the narrower one
        leaves a lane more than one vector per row (otherwise it adds a barrier and idle warps)."""
        kv = k // 8
        return [(r, ks) for r in GEMV_R for ks in GEMV_KS_LOG2 if ks == 0 or kv > (32 << (ks - 1))]

    @staticmethod
    def describe(cfg) -> str:
        return f"gemv[r={cfg[0]} ksplit={1 << cfg[1]}]"

    def _stream(self, ptr: int):
        s = self._streams.get(ptr)
        if s is None:
            import cupy

            s = self._streams[ptr] = cupy.cuda.ExternalStream(ptr)
        return s

    def launch(self, cfg, stream_ptr: int, x_ptr: int, x_ld: int, w_ptr: int, w_ld: int, y_ptr: int, y_ld: int,
               t: int, n_out: int, k: int, dtype_code: int, accumulate: bool, y_code: int | None = None) -> None:
        r, ks = cfg
        f32_out = y_code == CUDA_R_32F and dtype_code != CUDA_R_32F
        fkey = (t, r, dtype_code, f32_out)
        fn = self._fns.get(fkey)
        if fn is None:
            tv = next(v for v in GEMV_T if v >= t)
            suf = ("bf16" if dtype_code == CUDA_R_16BF else "f16") + ("_f32" if f32_out else "")
            fn = self._fns[fkey] = self._kernel("gemv", f"gemv_t{tv}_r{r}_{suf}")
        groups = -(-n_out // r)
        per_cta = GEMV_WARPS >> ks
        fn((-(-groups // per_cta),), (32 * GEMV_WARPS,),
           x=x_ptr, x_ld=x_ld, w=w_ptr, w_ld=w_ld, y=y_ptr, y_ld=y_ld, nt=t, n=n_out, k=k, ks_log2=ks,
           accumulate=1 if accumulate else 0, stream=self._stream(stream_ptr))


GEMMEX = Plan(tuned=True)   # shapes outside the tuning range (never mutated)


class LtGemm:
    """cuBLASLt GEMMs with per-shape plans; the `Cublas` handle runs cublasGemmEx (a candidate,
    and the fallback). Shares the caller's workspace (cuBLAS and cuBLASLt calls are serialised on
    the stream, so one buffer serves both).

    mode "tune": decode-sized shapes autotuned, the rest cublasGemmEx (the default);
    mode "heuristic": every shape cuBLASLt's heuristic #0, never timed (benchmarks, tests).
    own_gemv: an OwnGemv (or None): our GEMV kernels as extra candidates where they apply."""

    def __init__(self, lib: ctypes.CDLL, blas: _cublas.Cublas, workspace_ptr: int, workspace_bytes: int,
                 mode: str = "tune", own_gemv: OwnGemv | None = None, launch: LaunchContext | None = None):
        if mode not in ("tune", "heuristic"):
            raise ValueError(f"LtGemm mode {mode!r}: expected 'tune' or 'heuristic'")
        self.lib, self.blas, self.mode = lib, blas, mode
        self.own_gemv = own_gemv
        self.launch = launch if launch is not None else blas.launch   # PDL state (kernels.py)
        self.workspace_ptr, self.workspace_bytes = workspace_ptr, workspace_bytes
        vp = ctypes.c_void_p
        self._status_name = declare(lib)
        self.handle = vp()
        self._check(lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        # one operation descriptor for every call: fp32 compute and scale, D = op_T(w) @ x (+ D)
        self.desc = vp()
        self._check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), CUBLAS_COMPUTE_32F, CUDA_R_32F),
                    "cublasLtMatmulDescCreate")
        for attr, op in ((CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T), (CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N)):
            v = ctypes.c_int32(op)
            self._check(lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(v), ctypes.sizeof(v)),
                        "cublasLtMatmulDescSetAttribute")
        self._one, self._zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self._p_one, self._p_zero = ctypes.addressof(self._one), ctypes.addressof(self._zero)   # host scalars
        self._layouts: dict = {}         # (dtype, rows, cols, ld) -> cublasLtMatrixLayout_t (int)
        self._plans: dict = {}           # key -> Plan (final)
        self._provisional: dict = {}     # key -> (Plan, generation): chosen during capture, or
                                         # cublasGemmEx for want of a tuned neighbour, until then
        self._tuned: dict = {}           # key[1:] -> {t: tuned Plan}: the neighbours to borrow from
        self._generation = 0             # bumped on every tuned plan
        self.tune_t = set(TUNE_T)        # row counts that are tuned
        self._stream = None              # private stream the tuning runs on
        self.last_plan: Plan | None = None
        self.tune_seconds = 0.0          # wall time spent tuning, all keys
        self._ksplit: dict = {}          # k-split key -> Plan (algo None: plain wins) | None (n/a)
        self._ksplit_layouts: dict = {}  # (dtype, t, n_out, k slice, x_ld, w_ld, parts) -> (A, B, D) layouts
        self.ksplit_mode = "auto"        # "auto": timed against the plain plan; "force" (tests); "off"

    @classmethod
    def open(cls, major: int | None = None, workspace_bytes: int = _cublas.WORKSPACE_BYTES,
             mode: str = "tune", own_gemv: OwnGemv | None = None) -> LtGemm:
        """Both libraries loaded, a workspace of our own (cupy; kept alive by the object)."""
        import cupy
        import numpy as np

        if major is None:
            major = cupy.cuda.runtime.runtimeGetVersion() // 1000
        blas_lib = _cublas.load_libcublas(major)
        lt_lib = load_libcublaslt(major)
        ws = cupy.empty(workspace_bytes, dtype=np.uint8)
        self = cls(lt_lib, _cublas.Cublas(blas_lib, ws.data.ptr, workspace_bytes), ws.data.ptr, workspace_bytes,
                   mode, own_gemv)
        self._workspace = ws
        return self

    # -- plumbing ---------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self.blas.version

    @property
    def lt_version(self) -> int:
        return int(self.lib.cublasLtGetVersion())

    def _check(self, status: int, what: str) -> None:
        if status != 0:
            name = self._status_name(status) if self._status_name is not None else None
            name = name.decode(errors="replace") if name else None
            raise CublasError(f"{what} failed: {name or _cublas.status_name(status)}")

    def _layout(self, dtype: int, rows: int, cols: int, ld: int) -> int:
        key = (dtype, rows, cols, ld)
        lay = self._layouts.get(key)
        if lay is None:
            h = ctypes.c_void_p()
            self._check(self.lib.cublasLtMatrixLayoutCreate(ctypes.byref(h), dtype, rows, cols, ld),
                        "cublasLtMatrixLayoutCreate")
            lay = self._layouts[key] = h.value
        return lay

    def _key_layouts(self, key) -> tuple[int, int, int]:
        t, n_out, k, x_ld, w_ld, y_ld, dtype = key[:7]
        return (self._layout(dtype, k, n_out, w_ld),     # A = w, column-major k x n_out, op T
                self._layout(dtype, k, t, x_ld),         # B = x, column-major k x t
                self._layout(key[11], n_out, t, y_ld))   # C = D = y, column-major n_out x t

    def _cfg(self, algo: MatmulAlgo, attr: int, ctype=ctypes.c_int32):
        v, written = ctype(), ctypes.c_size_t()
        st = self.lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.byref(v),
                                                            ctypes.sizeof(v), ctypes.byref(written))
        return v.value if st == 0 else None

    def _cap(self, algo: MatmulAlgo, attr: int, ctype=ctypes.c_int32):
        v, written = ctype(), ctypes.c_size_t()
        st = self.lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, ctypes.byref(v),
                                                         ctypes.sizeof(v), ctypes.byref(written))
        return v.value if st == 0 else None

    def describe(self, algo: MatmulAlgo) -> tuple[str, int | None]:
        """('lt[id=.. tile=.. stages=.. splitk=.. red=.. custom=.. cluster=..]', algo id)."""
        u32, u16 = ctypes.c_uint32, ctypes.c_uint16
        aid = self._cfg(algo, CUBLASLT_ALGO_CONFIG_ID)
        parts = [f"id={aid}", f"tile={self._cfg(algo, CUBLASLT_ALGO_CONFIG_TILE_ID, u32)}",
                 f"stages={self._cfg(algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, u32)}",
                 f"splitk={self._cfg(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM)}",
                 f"red={self._cfg(algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, u32)}",
                 f"custom={self._cfg(algo, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, u32)}",
                 f"cluster={self._cfg(algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, u16)}"]
        return "lt[" + " ".join(parts) + "]", aid

    def _heuristics(self, key, layouts, count: int, aligns: tuple | None = None) -> list[HeuristicResult]:
        """cublasLtMatmulAlgoGetHeuristic for `key`, restricted to algorithms that fit the
        workspace and the pointers' actual alignment (`aligns` = x, w, y; default key[8:11]);
        [] when cuBLASLt has none."""
        a_lay, b_lay, c_lay = layouts
        pref = ctypes.c_void_p()
        self._check(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
        try:
            ws = ctypes.c_uint64(self.workspace_bytes)
            self._check(self.lib.cublasLtMatmulPreferenceSetAttribute(
                pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws), ctypes.sizeof(ws)),
                "cublasLtMatmulPreferenceSetAttribute(MAX_WORKSPACE_BYTES)")
            x_al, w_al, y_al = aligns or key[8:11]
            for attr, al in ((CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, w_al),
                             (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, x_al),
                             (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, y_al),
                             (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, y_al)):
                v = ctypes.c_uint32(al)
                self._check(self.lib.cublasLtMatmulPreferenceSetAttribute(pref, attr, ctypes.byref(v),
                                                                          ctypes.sizeof(v)),
                            "cublasLtMatmulPreferenceSetAttribute(MIN_ALIGNMENT)")
            results = (HeuristicResult * count)()
            n = ctypes.c_int(0)
            st = self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, self.desc, a_lay, b_lay, c_lay, c_lay, pref,
                                                         count, results, ctypes.byref(n))
        finally:
            self.lib.cublasLtMatmulPreferenceDestroy(pref)
        if st != 0:   # CUBLAS_STATUS_NOT_SUPPORTED: no algorithm for this configuration
            log.debug("cublasLtMatmulAlgoGetHeuristic %s: status %s", key[:8], _cublas.status_name(st))
            return []
        return [results[j] for j in range(n.value)
                if results[j].state == 0 and results[j].workspaceSize <= self.workspace_bytes]

    def _unsplit_variants(self, bases: list[MatmulAlgo], layouts) -> list[MatmulAlgo]:
        """Copies of the heuristic's split-K algorithms with the split removed (splitk 1, no
        reduction), validated by cublasLtMatmulAlgoCheck. Why: for the 9B decode GEMMs the heuristic
        picks split-K with fp32 partials (REDUCTION_SCHEME_COMPUTE_TYPE), which costs a second
        kernel (cublasLt::splitKreduce_kernel, 4.4-5.3 us alone under Nsight Compute) and 4-8 MB
        of partials; the same tile unsplit streams the weight faster on the H200 (2026-11-30,
        down 4096x12288 in a chain of 4 weights: 88 % of copy bandwidth at t = 4 and 8, 86 % at
        t = 16, against 81-83 % split)."""
        out = []
        for base in bases:
            if self._cfg(base, CUBLASLT_ALGO_CONFIG_SPLITK_NUM) in (None, 0, 1):
                continue
            algo = self._split_copy(base, 1, CUBLASLT_REDUCTION_SCHEME_NONE, layouts)
            if algo is not None:
                out.append(algo)
        return out

    def _split_copy(self, base: MatmulAlgo, split: int, scheme: int, layouts) -> MatmulAlgo | None:
        """A copy of `base` with SPLITK_NUM = split and REDUCTION_SCHEME = scheme, if cuBLASLt
        accepts it for these layouts (cublasLtMatmulAlgoCheck) within our workspace; else None."""
        a_lay, b_lay, c_lay = layouts
        algo = MatmulAlgo.from_buffer_copy(base)
        sv, rv = ctypes.c_int32(split), ctypes.c_uint32(scheme)
        if (self.lib.cublasLtMatmulAlgoConfigSetAttribute(
                ctypes.byref(algo), CUBLASLT_ALGO_CONFIG_SPLITK_NUM, ctypes.byref(sv), 4) != 0
                or self.lib.cublasLtMatmulAlgoConfigSetAttribute(
                    ctypes.byref(algo), CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, ctypes.byref(rv), 4) != 0):
            return None
        res = HeuristicResult()
        st = self.lib.cublasLtMatmulAlgoCheck(self.handle, self.desc, a_lay, b_lay, c_lay, c_lay,
                                              ctypes.byref(algo), ctypes.byref(res))
        return algo if st == 0 and res.workspaceSize <= self.workspace_bytes else None

    def _splitk_variants(self, bases: list[MatmulAlgo], layouts, k: int) -> list[MatmulAlgo]:
        """Split-K copies of the best heuristic algorithms that support it (the cure for few
        output tiles over a long K), each validated by cublasLtMatmulAlgoCheck and fitting the
        workspace. fp32 partials (COMPUTE_TYPE) are preferred over in-place reduction in y's type."""
        out = []
        for base in bases[:SPLITK_BASES]:
            if self._cfg(base, CUBLASLT_ALGO_CONFIG_SPLITK_NUM) not in (None, 0, 1):
                continue   # already split
            if not self._cap(base, CUBLASLT_ALGO_CAP_SPLITK_SUPPORT):
                continue
            mask = self._cap(base, CUBLASLT_ALGO_CAP_REDUCTION_SCHEME_MASK, ctypes.c_uint32) or 0
            schemes = [s for s in (CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE, CUBLASLT_REDUCTION_SCHEME_INPLACE,
                                   CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE) if mask & s]
            for split in SPLITK:
                if k // split < SPLITK_MIN_K:
                    break
                for scheme in schemes:            # the first scheme cuBLASLt accepts
                    algo = self._split_copy(base, split, scheme, layouts)
                    if algo is not None:
                        out.append(algo)
                        break
        return out

    # -- the GEMM ----------------------------------------------------------------------------
    def gemm_rowmajor_xwT(self, stream_ptr: int, x_ptr: int, x_ld: int, w_ptr: int, w_ld: int,
                          y_ptr: int, y_ld: int, t: int, n_out: int, k: int, dtype_code: int,
                          accumulate: bool = False, y_code: int | None = None) -> None:
        """y[t, n_out] (+)= x[t, k] @ w[n_out, k].T, row-major, leading dims in elements, fp32
        compute (as Cublas.gemm_rowmajor_xwT; `y_code` CUDA_R_32F: fp32 y from 16-bit inputs).
        The first call of a decode-sized key outside stream capture tunes it (synchronising the
        stream once); y holds the result either way."""
        y_code = dtype_code if y_code is None else y_code
        if self.mode == "tune" and (t > TUNE_MAX_T or (n_out * k < TUNE_MIN_WEIGHTS and not (
                self.own_gemv is not None and t <= GEMV_MAX_T
                and OwnGemv.applies(t, k, x_ld, w_ld, dtype_code, _align(x_ptr), _align(w_ptr), y_code)))):
            self.last_plan = GEMMEX    # prefill / tiny (no own kernel): as before, no key, no cache entry
            self.blas.gemm_rowmajor_xwT(stream_ptr, x_ptr, x_ld, w_ptr, w_ld, y_ptr, y_ld, t, n_out, k, dtype_code,
                                        accumulate, y_code)
            return
        key = (t, n_out, k, x_ld, w_ld, y_ld, dtype_code, bool(accumulate), _align(x_ptr), _align(w_ptr),
               _align(y_ptr), y_code)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plan_for(key, stream_ptr, x_ptr, w_ptr, y_ptr)
        self.last_plan = plan
        self._run(plan, stream_ptr, x_ptr, x_ld, w_ptr, w_ld, y_ptr, y_ld, t, n_out, k, dtype_code, accumulate,
                  y_code)

    def _run(self, plan: Plan, stream_ptr, x_ptr, x_ld, w_ptr, w_ld, y_ptr, y_ld, t, n_out, k, dtype_code,
             accumulate, y_code=None) -> None:
        if plan.own is not None:
            self.own_gemv.launch(plan.own, stream_ptr, x_ptr, x_ld, w_ptr, w_ld, y_ptr, y_ld, t, n_out, k, dtype_code,
                                 accumulate, y_code)
            return
        if plan.algo is None:
            self.blas.gemm_rowmajor_xwT(stream_ptr, x_ptr, x_ld, w_ptr, w_ld, y_ptr, y_ld, t, n_out, k, dtype_code,
                                        accumulate, y_code)
            return
        a_lay, b_lay, c_lay = plan.layouts
        self.launch.foreign()
        self._check(self.lib.cublasLtMatmul(
            self.handle, self.desc, self._p_one, w_ptr, a_lay, x_ptr, b_lay,
            self._p_one if accumulate else self._p_zero, y_ptr, c_lay, y_ptr, c_lay,
            plan.p_algo, self.workspace_ptr, self.workspace_bytes, stream_ptr or None), "cublasLtMatmul")

    def _heuristic_plan(self, key) -> Plan | None:
        layouts = self._key_layouts(key)
        found = self._heuristics(key, layouts, 1)
        if not found:
            return None
        algo = MatmulAlgo.from_buffer_copy(found[0].algo)
        name, aid = self.describe(algo)
        return Plan(algo, layouts, name, aid)

    def _plan_for(self, key, stream_ptr: int, x_ptr: int, w_ptr: int, y_ptr: int) -> Plan:
        t = key[0]
        if self.mode == "heuristic":
            plan = self._plans[key] = self._heuristic_plan(key) or Plan()
            return plan
        prov = self._provisional.get(key)
        if t not in self.tune_t:                          # borrow, never time
            if prov is not None and prov[1] == self._generation:
                return prov[0]
            plan = self._borrow(key)
            if plan is None:                              # no tuned neighbour yet
                plan = Plan()
                self._provisional[key] = (plan, self._generation)
                return plan
            self._provisional.pop(key, None)
            self._plans[key] = plan
            return plan
        if _capturing(stream_ptr):
            if prov is None:
                prov = self._provisional[key] = (self._heuristic_plan(key) or Plan(), None)
            return prov[0]
        plan = self._plans[key] = self._tune(key, stream_ptr, x_ptr, w_ptr, y_ptr)
        self._tuned.setdefault(key[1:], {})[t] = plan
        self._generation += 1
        self._provisional.pop(key, None)
        return plan

    def _borrow(self, key) -> Plan | None:
        """The plan of the nearest tuned row count of the same weight / layout / alignment,
        rebuilt for key's t; None when there is none yet."""
        tuned = self._tuned.get(key[1:])
        if not tuned:
            return None
        t = key[0]
        above = [u for u in tuned if u >= t]
        src_t = min(above) if above else max(tuned)
        src = tuned[src_t]
        if src.own is not None:   # the same kernel config, compiled for the smallest T >= t
            if self._own_applies(key):
                return Plan(name=f"{src.name} (as t={src_t})", tuned=True, own=src.own)
            return Plan(name=f"gemmex (t={src_t}'s gemv does not apply)", tuned=True)
        if src.algo is None:
            return Plan(name=f"gemmex (as t={src_t})", tuned=True)
        layouts = self._key_layouts(key)
        algo = MatmulAlgo.from_buffer_copy(src.algo)
        res = HeuristicResult()
        a_lay, b_lay, c_lay = layouts
        st = self.lib.cublasLtMatmulAlgoCheck(self.handle, self.desc, a_lay, b_lay, c_lay, c_lay, ctypes.byref(algo),
                                              ctypes.byref(res))
        if st != 0 or res.workspaceSize > self.workspace_bytes:
            return Plan(name=f"gemmex (t={src_t}'s algo does not fit)", tuned=True)
        return Plan(algo, layouts, f"{src.name} (as t={src_t})", src.algo_id, tuned=True)

    # -- k-split GEMMs: partial products for the consumer to sum --------------------------------
    def _ksplit_layout_handles(self, t: int, n_out: int, k: int, x_ld: int, w_ld: int, code: int, parts: int):
        """Strided-batched layouts of the k slices: A = w[:, s*ks:(s+1)*ks] (column-major ks x n_out,
        ld w_ld, batch offset ks), B = x[:, slice] likewise, D = fp32 partial s ([t, n_out]
        row-major, offset t * n_out)."""
        ks = k // parts
        key = (code, t, n_out, ks, x_ld, w_ld, parts)
        lays = self._ksplit_layouts.get(key)
        if lays is None:
            lays = []
            for dtype, rows, cols, ld, off in ((code, ks, n_out, w_ld, ks), (code, ks, t, x_ld, ks),
                                               (CUDA_R_32F, n_out, t, n_out, t * n_out)):
                h = ctypes.c_void_p()
                self._check(self.lib.cublasLtMatrixLayoutCreate(ctypes.byref(h), dtype, rows, cols, ld),
                            "cublasLtMatrixLayoutCreate")
                b, o = ctypes.c_int32(parts), ctypes.c_int64(off)
                self._check(self.lib.cublasLtMatrixLayoutSetAttribute(
                    h, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, ctypes.byref(b), ctypes.sizeof(b)),
                    "cublasLtMatrixLayoutSetAttribute(BATCH_COUNT)")
                self._check(self.lib.cublasLtMatrixLayoutSetAttribute(
                    h, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, ctypes.byref(o), ctypes.sizeof(o)),
                    "cublasLtMatrixLayoutSetAttribute(STRIDED_BATCH_OFFSET)")
                lays.append(h.value)
            lays = self._ksplit_layouts[key] = tuple(lays)
        return lays

    def ksplit_plan(self, stream_ptr: int, x_ptr: int, x_ld: int, w_ptr: int, w_ld: int, t: int, n_out: int,
                    k: int, dtype_code: int) -> Plan | None:
        """How to compute x @ w.T as KSPLIT_S fp32 partials (one strided-batched call over slices
        of k; the caller sums them): a Plan when that beats the key's tuned plain plan, else None.

        Why: the 9B down projection (4096 x 12288) at t = 32-64 has too few output tiles for the
        132 SMs; cuBLASLt's own split-K then runs a second reduction kernel (4-5 us alone) and
        streams the weight at 78-84 % of copy bandwidth, every other choice lower. As partials
        summed by the next kernel (which reads the GEMM's output anyway) the same tiles stream at
        89 % (H200, 2026-11-30, chains of 4 weights). Decided once per key outside capture (the
        key's plain plan must be tuned first: it is the baseline); during capture, or for row
        counts that are not decode buckets, the answer is whatever is cached, else None."""
        if (self.mode != "tune" or self.ksplit_mode == "off" or dtype_code not in (CUDA_R_16BF, CUDA_R_16F)
                or t not in self.tune_t or t < KSPLIT_MIN_T or k % (8 * KSPLIT_S)
                or x_ld % 8 or w_ld % 8 or n_out * k < TUNE_MIN_WEIGHTS):
            return None
        key = (t, n_out, k, x_ld, w_ld, dtype_code, _align(x_ptr), _align(w_ptr))
        if key in self._ksplit:
            plan = self._ksplit[key]
            return plan if plan is not None and plan.algo is not None else None
        if _capturing(stream_ptr):
            return None
        base = next((p for pk, p in self._plans.items()
                     if pk[:8] == (t, n_out, k, x_ld, w_ld, n_out, dtype_code, False) and pk[8:10] == key[6:8]
                     and pk[11] == dtype_code), None)
        if base is None or not base.tuned or base.time_s is None:
            return None                      # the plain plan is tuned by the key's first linear()
        plan = self._tune_ksplit(key, stream_ptr, x_ptr, w_ptr, base)
        self._ksplit[key] = plan
        return plan if plan is not None and plan.algo is not None else None

    def run_ksplit(self, plan: Plan, stream_ptr: int, x_ptr: int, w_ptr: int, parts_ptr: int) -> None:
        """parts[s] = x[:, slice s] @ w[:, slice s].T (fp32 [KSPLIT_S, t, n_out], contiguous)."""
        a_lay, b_lay, d_lay = plan.layouts
        self.last_plan = plan
        self.launch.foreign()
        self._check(self.lib.cublasLtMatmul(
            self.handle, self.desc, self._p_one, w_ptr, a_lay, x_ptr, b_lay, self._p_zero, parts_ptr, d_lay,
            parts_ptr, d_lay, plan.p_algo, self.workspace_ptr, self.workspace_bytes, stream_ptr or None),
            "cublasLtMatmul (k-split)")

    def _tune_ksplit(self, key, stream_ptr: int, x_ptr: int, w_ptr: int, base: Plan) -> Plan | None:
        import cupy

        t0 = time.perf_counter()
        t, n_out, k, x_ld, w_ld, code = key[:6]
        layouts = self._ksplit_layout_handles(t, n_out, k, x_ld, w_ld, code, KSPLIT_S)
        # x and w at their actual alignment, slice starts included; the partials are a fresh
        # allocation (256)
        step = _align((k // KSPLIT_S) * _ITEMSIZE[code])
        found = [MatmulAlgo.from_buffer_copy(r.algo) for r in self._heuristics(
            key, layouts, MAX_HEURISTICS, aligns=(min(key[6], step), min(key[7], step), 256))]
        seen = {bytes(a) for a in found}
        algos = found + [a for a in self._unsplit_variants(found, layouts) if bytes(a) not in seen]
        if not algos:
            return None
        cupy.cuda.runtime.streamSynchronize(stream_ptr)      # the operands are ready
        if self._stream is None:
            self._stream = cupy.cuda.Stream()
        ts = self._stream
        parts = cupy.zeros((KSPLIT_S, t, n_out), dtype=cupy.float32)
        ref = cupy.empty((t, n_out), dtype=_np_dtype(code))
        cupy.cuda.get_current_stream().synchronize()
        self.blas.gemm_rowmajor_xwT(ts.ptr, x_ptr, x_ld, w_ptr, w_ld, ref.data.ptr, n_out, t, n_out, k, code)
        ts.synchronize()
        ref32 = ref.astype(cupy.float32)
        ref_norm = float(cupy.sqrt((ref32 * ref32).sum()))
        calls = max(1, min(32, int(GRAPH_TARGET_S / max(base.time_s, 1e-7))))
        best, best_s = None, None
        for algo in algos:
            if time.perf_counter() - t0 > TUNE_BUDGET_S:
                break
            name, aid = self.describe(algo)
            plan = Plan(algo, layouts, f"ksplit{KSPLIT_S}:{name}", aid, tuned=True)
            try:
                parts.fill(0)
                cupy.cuda.get_current_stream().synchronize()
                self.run_ksplit(plan, ts.ptr, x_ptr, w_ptr, parts.data.ptr)
                ts.synchronize()
                if math.isfinite(ref_norm):
                    d = parts.sum(axis=0) - ref32
                    if float(cupy.sqrt((d * d).sum())) > 2e-2 * ref_norm:
                        log.warning("gemm k-split %s: %s disagrees with cublasGemmEx; not used", key[:6], name)
                        continue
                s = self._time_graph(lambda plan=plan: self.run_ksplit(plan, ts.ptr, x_ptr, w_ptr, parts.data.ptr),
                                     calls, GRAPH_REPLAYS)
            except (RuntimeError, cupy.cuda.runtime.CUDARuntimeError, cupy.cuda.driver.CUDADriverError) as e:
                log.debug("gemm k-split %s: %s failed: %s", key[:6], name, e)
                continue
            plan.time_s = s
            if best_s is None or s < best_s:
                best, best_s = plan, s
        ts.synchronize()
        if best is None:
            self.tune_seconds += time.perf_counter() - t0
            return None
        base_s, best_s = self._cold_pair_times(base, best, calls, x_ptr, x_ld, w_ptr, w_ld, t, n_out, k, code,
                                               parts.data.ptr) or (base.time_s, best_s)
        elapsed = time.perf_counter() - t0
        self.tune_seconds += elapsed
        extra_s = (4 * KSPLIT_S - 2) * t * n_out / KSPLIT_READ_BYTES_PER_S
        best.gemmex_s, best.tune_s = base_s, elapsed
        wins = best_s + extra_s < base_s * (1 - WIN_MARGIN)
        log.debug("gemm k-split t=%d n_out=%d k=%d: %s %.1f us (+%.1f us reading partials) vs %s %.1f us: %s",
                  t, n_out, k, best.name, best_s * 1e6, extra_s * 1e6, base.name, base_s * 1e6,
                  "k-split" if wins else "plain")
        if wins or self.ksplit_mode == "force":
            return best
        return Plan(name=f"plain ({base.name})", tuned=True)   # decided: plain

    def _cold_pair_times(self, base: Plan, split: Plan, calls: int, x_ptr, x_ld, w_ptr, w_ld, t, n_out, k, code,
                         parts_ptr) -> tuple[float, float] | None:
        """(plain, k-split) seconds per call with the weight not in L2: each timed over alternating
        copies of it (a temporary second copy), as in a decode step, where every other layer's
        weights pass through L2 between two uses of this one. Why: timed on one copy (as the
        tuner times everything else) a 100 MB weight is partly served from the 50 MB L2 at
        16-64 rows, which favours the plain tiles over the k-split by a few percent (H200,
        2026-11-30: the tuner kept plain at t = 64 where chains of 4 weights measured 83.8 %
        plain against 88.6 % k-split). None when the copy does not fit (then the warm times)."""
        import cupy

        item = _ITEMSIZE[code]
        nbytes = ((n_out - 1) * w_ld + k) * item
        if nbytes > COLD_COPY_MAX_BYTES:
            return None
        ts = self._stream
        try:
            w2 = cupy.empty(nbytes, dtype=cupy.uint8)
            y = cupy.empty((t, n_out), dtype=_np_dtype(code))
        except cupy.cuda.memory.OutOfMemoryError:
            return None
        cupy.cuda.get_current_stream().synchronize()
        cupy.cuda.runtime.memcpyAsync(w2.data.ptr, w_ptr, nbytes, cupy.cuda.runtime.memcpyDeviceToDevice, ts.ptr)
        ts.synchronize()
        ptrs = (w_ptr, w2.data.ptr)

        def plain():
            for wp in ptrs:
                self._run(base, ts.ptr, x_ptr, x_ld, wp, w_ld, y.data.ptr, n_out, t, n_out, k, code, False)

        def ksplit():
            for wp in ptrs:
                self.run_ksplit(split, ts.ptr, x_ptr, wp, parts_ptr)

        reps = max(1, calls // 2)
        try:
            times = (self._time_graph(plain, reps, GRAPH_REPLAYS) / 2, self._time_graph(ksplit, reps, GRAPH_REPLAYS) / 2)
        except (RuntimeError, cupy.cuda.runtime.CUDARuntimeError, cupy.cuda.driver.CUDADriverError) as e:
            log.debug("gemm k-split cold timing failed: %s", e)
            times = None
        ts.synchronize()
        return times

    def _own_applies(self, key) -> bool:
        t, _n_out, k, x_ld, w_ld, _y_ld, code = key[:7]
        return self.own_gemv is not None and OwnGemv.applies(t, k, x_ld, w_ld, code, key[8], key[9], key[11])

    # -- tuning ------------------------------------------------------------------------------
    def _tune(self, key, stream_ptr: int, x_ptr: int, w_ptr: int, y_ptr: int) -> Plan:
        import cupy

        t0 = time.perf_counter()
        t, n_out, k, x_ld, w_ld, y_ld, code, accumulate = key[:8]
        layouts = self._key_layouts(key)
        found = self._heuristics(key, layouts, MAX_HEURISTICS)
        algos = [MatmulAlgo.from_buffer_copy(r.algo) for r in found]
        seen = {bytes(a) for a in algos}
        for a in [*self._unsplit_variants(algos, layouts), *self._splitk_variants(algos, layouts, k)]:
            if bytes(a) not in seen:
                seen.add(bytes(a))
                algos.append(a)
        own = OwnGemv.configs(k) if self._own_applies(key) else []
        if not algos and not own:   # nothing but cublasGemmEx for this shape / alignment
            best, base_s, timed, rejected = Plan(tuned=True), None, 0, 0
        else:
            cupy.cuda.runtime.streamSynchronize(stream_ptr)   # the operands are ready
            if self._stream is None:
                # a blocking stream: like the engine's, it stays ordered with legacy-stream work
                self._stream = cupy.cuda.Stream()
            best, base_s, timed, rejected = self._tune_on(self._stream, key, layouts, algos, x_ptr, w_ptr, y_ptr,
                                                          t0, own)
        best.tune_s = time.perf_counter() - t0
        self.tune_seconds += best.tune_s
        if base_s is not None:
            log.debug("gemm t=%d n_out=%d k=%d ld=(%d,%d,%d) dtype=%d acc=%d: %s %.1f us vs gemmex %.1f us "
                      "(%.2fx); %d timed, %d rejected of %d, %.0f ms", t, n_out, k, x_ld, w_ld, y_ld, code,
                      accumulate, best.name, best.time_s * 1e6, base_s * 1e6, base_s / max(best.time_s, 1e-12),
                      timed, rejected, len(algos) + len(own) + 1, best.tune_s * 1e3)
        return best

    def _tune_on(self, ts, key, layouts, algos: list[MatmulAlgo], x_ptr: int, w_ptr: int, y_ptr: int, t0: float,
                 own=()):
        """Check and time cublasGemmEx, our GEMV configs `own` (first: the tuning budget never
        cuts them) and every algorithm on stream `ts` into a scratch y;
        returns (winning plan, GemmEx seconds, candidates timed, rejected). Allocations and the
        comparisons run on cupy's current stream (their memory goes back to the pool that stream
        uses, e.g. the engine's), every hand-over between it and `ts` is a synchronisation."""
        import cupy

        t, n_out, k, x_ld, w_ld, y_ld, code, accumulate = key[:8]
        y_code = key[11]
        item = _ITEMSIZE[y_code]        # y's element (x's: x_item)
        x_item = _ITEMSIZE[code]
        dt = _np_dtype(y_code)
        # scratch y at y's offset modulo 256 (same alignment), zeroed (timing accumulates into it)
        span = (t - 1) * y_ld + n_out
        pad = (y_ptr % 256) // item
        scratch = cupy.zeros(span + 256 // item, dtype=dt)
        s_ptr = scratch.data.ptr + pad * item
        s_view = cupy.ndarray((t, n_out), dt, memptr=scratch.data + pad * item, strides=(y_ld * item, item))
        # reference rows from cublasGemmEx: the first CHECK_ROWS and the last
        rows = list(range(min(t, CHECK_ROWS))) + ([t - 1] if t > CHECK_ROWS else [])
        ref = cupy.empty((len(rows), n_out), dtype=dt)
        cupy.cuda.get_current_stream().synchronize()   # the zero fill is done before ts writes
        r0 = min(t, CHECK_ROWS)
        self.blas.gemm_rowmajor_xwT(ts.ptr, x_ptr, x_ld, w_ptr, w_ld, ref.data.ptr, n_out, r0, n_out, k, code,
                                    False, y_code)
        if t > CHECK_ROWS:
            self.blas.gemm_rowmajor_xwT(ts.ptr, x_ptr + (t - 1) * x_ld * x_item, x_ld, w_ptr, w_ld,
                                        ref.data.ptr + r0 * n_out * item, n_out, 1, n_out, k, code, False, y_code)
        ts.synchronize()
        ref32 = ref.astype(cupy.float32)
        ref_norm = float(cupy.sqrt((ref32 * ref32).sum()))   # a sync
        tol = 1e-4 if code == CUDA_R_32F else 2e-2

        def agrees() -> bool:
            if not math.isfinite(ref_norm):
                return True   # inputs with inf/nan (warm-up garbage): nothing to compare
            d = s_view[rows].astype(cupy.float32) - ref32
            return float(cupy.sqrt((d * d).sum())) <= tol * ref_norm

        def call(plan: Plan, beta_one: bool):
            def fn():
                self._run(plan, ts.ptr, x_ptr, x_ld, w_ptr, w_ld, s_ptr, y_ld, t, n_out, k, code, beta_one, y_code)
            return fn

        # cublasGemmEx: the baseline, and the calibration of calls per timing graph
        gemmex = Plan(tuned=True)
        est = self._time_graph(call(gemmex, accumulate), 2, 1)
        reps = max(1, min(32, int(GRAPH_TARGET_S / max(est, 1e-7))))
        base_s = self._time_graph(call(gemmex, accumulate), reps, GRAPH_REPLAYS)
        best, best_s, timed, rejected = gemmex, base_s, 1, 0
        cands = [Plan(name=OwnGemv.describe(cfg), tuned=True, own=cfg) for cfg in own]
        for plan in [*cands, *algos]:
            if not isinstance(plan, Plan):
                if time.perf_counter() - t0 > TUNE_BUDGET_S:
                    break
                name, aid = self.describe(plan)
                plan = Plan(plan, layouts, name, aid, tuned=True)
            name = plan.name
            try:
                # first run (loads its kernel) on a zeroed scratch with the real beta, so that
                # y = 0 (+) x @ w.T, checked on a few rows against cublasGemmEx
                scratch.data.memset_async(0, scratch.nbytes, ts)
                call(plan, accumulate)()
                ts.synchronize()
                if not agrees():               # (a sync of the current stream)
                    rejected += 1
                    log.warning("gemm %s: %s disagrees with cublasGemmEx; not used", key[:8], name)
                    continue
                s = self._time_graph(call(plan, accumulate), reps, GRAPH_REPLAYS)
            except (RuntimeError, cupy.cuda.runtime.CUDARuntimeError, cupy.cuda.driver.CUDADriverError) as e:
                # CublasError, and a failed cuLaunchKernel of our GEMV (metrale.backends.cuda.kernels)
                rejected += 1
                log.debug("gemm %s: %s failed: %s", key[:8], name, e)
                continue
            timed += 1
            plan.time_s = s
            if s < best_s:
                best, best_s = plan, s
        if best is not gemmex and best_s > base_s * (1 - WIN_MARGIN):
            best, best_s = gemmex, base_s
        ts.synchronize()   # nothing of ours is left in flight on the scratch when it is freed
        best.time_s, best.gemmex_s, best.candidates = best_s, base_s, timed
        return best, base_s, timed, rejected

    def _time_graph(self, fn, reps: int, replays: int) -> float:
        """Seconds per call of fn() (which launches on the tuning stream), from `reps` calls
        captured in one CUDA graph: one warm-up replay, then the fastest of `replays`."""
        import cupy

        ts = self._stream
        ts.begin_capture()
        err = None
        try:
            for _ in range(reps):
                fn()
        except Exception as e:   # end the capture whatever happened, then report
            err = e
        try:
            graph = ts.end_capture()
        except Exception as e:
            err = err or e
        if err is not None:
            raise err
        graph.launch(ts)
        events = [cupy.cuda.Event() for _ in range(replays + 1)]
        events[0].record(ts)
        for j in range(replays):
            graph.launch(ts)
            events[j + 1].record(ts)
        events[-1].synchronize()
        return min(cupy.cuda.get_elapsed_time(events[j], events[j + 1]) for j in range(replays)) / 1e3 / reps

    def plans(self) -> dict:
        """{key: plan summary} of every final plan (benchmarks, logs)."""
        return {key: plan.as_dict() for key, plan in self._plans.items()}

    def close(self) -> None:
        for lay in [*self._layouts.values(), *(h for hs in self._ksplit_layouts.values() for h in hs)]:
            self.lib.cublasLtMatrixLayoutDestroy(lay)
        self._layouts.clear()
        self._ksplit_layouts.clear()
        self._ksplit.clear()
        self._plans.clear()
        self._provisional.clear()
        self._tuned.clear()
        if self.desc:
            self.lib.cublasLtMatmulDescDestroy(self.desc)
            self.desc = ctypes.c_void_p()
        if self.handle:
            self.lib.cublasLtDestroy(self.handle)
            self.handle = ctypes.c_void_p()
        self.blas.close()
