"""A thin ctypes binding to libcublas: one GEMM entry point that works inside CUDA graph capture.

Why not `cupy.matmul`: CuPy resets its cuBLAS handle's stream before every call and refuses to
call cuBLAS while a stream is capturing (DESIGN.md §7). cuBLAS itself captures fine when the
handle is ours, bound to the capturing stream, and has a user workspace (`cublasSetWorkspace`;
`cublasSetStream` resets it to the default pool, so it is set again after every stream change).

Row-major linear `y[T, out] = x[T, in] @ w[out, in].T` is the column-major product
`y^T (out x T) = w (as in x out, transposed) @ x^T (in x T)`: cublasGemmEx(op_a=T, op_b=N,
m=out, n=T, k=in, A=w lda=in, B=x ldb=x_row_stride, C=y ldc=out).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os

from metrale import levers
from metrale.backends.cuda.kernels import LaunchContext

# cudaDataType / cublasComputeType_t / cublasOperation_t / cublasGemmAlgo_t values (cublas_api.h,
# library_types.h)
CUDA_R_32F = 0
CUDA_R_16F = 2
CUDA_R_16BF = 14
CUBLAS_COMPUTE_32F = 68
CUBLAS_OP_N = 0
CUBLAS_OP_T = 1
CUBLAS_GEMM_DEFAULT = -1
CUBLAS_DEFAULT_MATH = 0

WORKSPACE_BYTES = 32 << 20  # cuBLAS's own recommendation for Hopper

_STATUS = {
    0: "CUBLAS_STATUS_SUCCESS", 1: "CUBLAS_STATUS_NOT_INITIALIZED", 3: "CUBLAS_STATUS_ALLOC_FAILED",
    7: "CUBLAS_STATUS_INVALID_VALUE", 8: "CUBLAS_STATUS_ARCH_MISMATCH", 11: "CUBLAS_STATUS_MAPPING_ERROR",
    13: "CUBLAS_STATUS_EXECUTION_FAILED", 14: "CUBLAS_STATUS_INTERNAL_ERROR",
    15: "CUBLAS_STATUS_NOT_SUPPORTED", 16: "CUBLAS_STATUS_LICENSE_ERROR",
}


class CublasError(RuntimeError):
    pass


def _candidates(major: int | None, name: str = "cublas") -> list[str]:
    """Where lib<name>.so may be (`name` is "cublas" or "cublasLt"): sonames, then files."""
    names = [f"lib{name}.so.{major}"] if major else []
    names += [f"lib{name}.so.13", f"lib{name}.so.12", f"lib{name}.so"]
    pattern = f"lib{name}.so*"   # "libcublas.so*" does not match libcublasLt.so*
    paths: list[str] = []
    env = levers.get("METRALE_CUBLAS")
    if env:   # libcublas itself; libcublasLt is looked for next to it
        paths += [env] if name == "cublas" else sorted(
            glob.glob(os.path.join(os.path.dirname(env), pattern)), reverse=True)
    try:  # the `nvidia-cublas` pip package (nvidia/cu13/lib or nvidia/cublas/lib)
        import nvidia  # type: ignore

        for root in list(getattr(nvidia, "__path__", [])):
            for sub in ("cu13/lib", "cublas/lib", "cu12/lib"):
                paths += sorted(glob.glob(os.path.join(root, sub, pattern)), reverse=True)
    except ImportError:
        pass
    try:
        import cupy

        cuda_path = cupy.cuda.get_cuda_path()
        if cuda_path:
            for lib in ("lib64", "lib", "targets/x86_64-linux/lib"):
                paths += sorted(glob.glob(os.path.join(cuda_path, lib, pattern)), reverse=True)
    except Exception:
        pass
    for root in ("/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*"), reverse=True)):
        paths += sorted(glob.glob(os.path.join(root, "lib64", pattern)), reverse=True)
    found = ctypes.util.find_library(name)
    if found:
        paths.append(found)
    # sonames first (a library CuPy or libcublas already loaded is reused), then files,
    # preferring `major`
    if major:
        paths.sort(key=lambda p: f".so.{major}" not in p)
    return names + paths


def load_library(name: str, major: int | None = None) -> ctypes.CDLL:
    """Load lib<name>.so ("cublas" or "cublasLt"), preferring the CUDA major version `major`
    (e.g. that of CuPy's runtime)."""
    tried = []
    for cand in _candidates(major, name):
        try:
            return ctypes.CDLL(cand, mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            tried.append(f"{cand}: {e}")
    raise CublasError(
        f"lib{name} not found. Install the `nvidia-cublas` wheel (nvidia/cu13/lib/lib{name}.so.13), "
        "put the CUDA toolkit's lib64 on LD_LIBRARY_PATH, or set METRALE_CUBLAS=/path/libcublas.so.13"
        " (libcublasLt is looked for next to it). Tried: " + "; ".join(tried[:8]))


def load_libcublas(major: int | None = None) -> ctypes.CDLL:
    """Load libcublas (preferring the CUDA major version `major`, e.g. that of CuPy's runtime)."""
    return load_library("cublas", major)


def status_name(status: int) -> str:
    return _STATUS.get(status, str(status))


class Cublas:
    """One cuBLAS handle with its own workspace, rebound to the caller's stream on every call."""

    def __init__(self, lib: ctypes.CDLL, workspace_ptr: int, workspace_bytes: int,
                 launch: LaunchContext | None = None):
        self.lib = lib
        self.launch = launch if launch is not None else LaunchContext()   # PDL state (kernels.py)
        vp, i, u64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
        lib.cublasCreate_v2.argtypes = [ctypes.POINTER(vp)]
        lib.cublasDestroy_v2.argtypes = [vp]
        lib.cublasSetStream_v2.argtypes = [vp, vp]
        lib.cublasSetWorkspace_v2.argtypes = [vp, vp, u64]
        lib.cublasSetMathMode.argtypes = [vp, i]
        lib.cublasGetVersion_v2.argtypes = [vp, ctypes.POINTER(i)]
        lib.cublasGemmEx.argtypes = [vp, i, i, i, i, i, vp, vp, i, i, vp, i, i, vp, vp, i, i, i, i]
        for f in ("cublasCreate_v2", "cublasDestroy_v2", "cublasSetStream_v2", "cublasSetWorkspace_v2",
                  "cublasSetMathMode", "cublasGetVersion_v2", "cublasGemmEx"):
            getattr(lib, f).restype = i
        self.handle = vp()
        self._check(lib.cublasCreate_v2(ctypes.byref(self.handle)), "cublasCreate")
        self._check(lib.cublasSetMathMode(self.handle, CUBLAS_DEFAULT_MATH), "cublasSetMathMode")
        self.workspace_ptr, self.workspace_bytes = workspace_ptr, workspace_bytes
        self._stream = None
        self._one = ctypes.c_float(1.0)
        self._zero = ctypes.c_float(0.0)
        self._p_one = ctypes.cast(ctypes.byref(self._one), vp)
        self._p_zero = ctypes.cast(ctypes.byref(self._zero), vp)

    @property
    def version(self) -> int:
        v = ctypes.c_int()
        self._check(self.lib.cublasGetVersion_v2(self.handle, ctypes.byref(v)), "cublasGetVersion")
        return v.value

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise CublasError(f"{what} failed: {status_name(status)}")

    def bind(self, stream_ptr: int) -> None:
        """Bind the handle to `stream_ptr` (a cudaStream_t as int; 0 = legacy default stream)."""
        if stream_ptr == self._stream:
            return
        self._check(self.lib.cublasSetStream_v2(self.handle, stream_ptr or None), "cublasSetStream")
        # cublasSetStream resets the workspace to cuBLAS's pool, which is not capturable
        self._check(self.lib.cublasSetWorkspace_v2(self.handle, self.workspace_ptr, self.workspace_bytes),
                    "cublasSetWorkspace")
        self._stream = stream_ptr

    def gemm_rowmajor_xwT(self, stream_ptr: int, x_ptr: int, x_ld: int, w_ptr: int, w_ld: int,
                          y_ptr: int, y_ld: int, t: int, n_out: int, k: int, dtype_code: int,
                          accumulate: bool = False, y_code: int | None = None) -> None:
        """y[t, n_out] (+)= x[t, k] @ w[n_out, k].T, row-major, leading dims in elements,
        fp32 compute. `dtype_code` is CUDA_R_16BF / CUDA_R_16F / CUDA_R_32F for x and w, and
        for y unless `y_code` names another (CUDA_R_32F: 16-bit inputs, fp32 output)."""
        self.bind(stream_ptr)
        self.launch.foreign()
        self._check(self.lib.cublasGemmEx(
            self.handle, CUBLAS_OP_T, CUBLAS_OP_N, n_out, t, k,
            self._p_one, w_ptr, dtype_code, w_ld, x_ptr, dtype_code, x_ld,
            self._p_one if accumulate else self._p_zero, y_ptr,
            dtype_code if y_code is None else y_code, y_ld,
            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT), "cublasGemmEx")

    def close(self) -> None:
        if self.handle:
            self.lib.cublasDestroy_v2(self.handle)
            self.handle = ctypes.c_void_p()
