"""W8A8 FP8 GEMMs of block-FP8 weights through cuBLASLt (prefill rows: tensor-core FP8 at twice
the bf16 rate instead of dequantising the weight).

y[m, n] = x[m, k] @ w[n, k]^T with w e4m3 and fp32 scales per 128 x 128 block (transformers'
fine-grained FP8, the Qwen / DeepSeek FP8 releases) and x quantized on the fly per row and 128
columns (kernels_cuda/gemv_quant.cu quant_act_fp8: the DeepSeek-V3 activation scheme). In
cuBLASLt's column-major terms, as gemm/cublaslt.py: D (n x m) = op_T(A) @ B with A = w (k x n,
scale mode BLK128x128_32F: the checkpoint's own [n / 128, k / 128] row-major table) and B = x
(k x m, VEC128_32F: a [k / 128, m] row-major table, the rows of one 128-column block adjacent;
measured on the H200 with cuBLAS 13.1 by perf/fp8_lt_probe.py: that pairing matches numpy to
1.3e-4, the other three orders are off by 38-59 %), fp32 compute, D bf16 (or fp32: an lm head).
The heuristic answers NOT_SUPPORTED until both scale pointers are set, so `prepare` sets them
first. cuBLASLt reads
both scale tensors itself; the block-scaled modes are the Hopper ones of cuBLAS 12.9+. Where the
library lacks them (older cuBLAS, or no algorithm for a shape) `run` returns False and the
caller dequantises instead.
"""
from __future__ import annotations

import ctypes
import logging

from metrale.backends.cuda.gemm import cublas as _cublas
from metrale.backends.cuda.gemm.cublaslt import (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                                 CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                                 CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                                                 CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, HeuristicResult, _align)

log = logging.getLogger("metrale.gemm")

CUDA_R_8F_E4M3 = 28
CUBLAS_COMPUTE_32F = 68
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
# cublasLtMatmulDescAttributes_t
DESC_TRANSA, DESC_TRANSB = 3, 4
DESC_A_SCALE_POINTER, DESC_B_SCALE_POINTER = 17, 18
DESC_A_SCALE_MODE, DESC_B_SCALE_MODE = 31, 32
# cublasLtMatmulMatrixScale_t
SCALE_VEC128_32F, SCALE_BLK128x128_32F = 4, 5
PREF_MAX_WORKSPACE_BYTES = 1


class Fp8BlockLt:
    """The block-scaled FP8 matmul on an LtGemm's library, handle and workspace."""

    def __init__(self, lt):
        self.lt, self.lib = lt, lt.lib
        self.desc = ctypes.c_void_p()
        self._check(self.lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), CUBLAS_COMPUTE_32F,
                                                      _cublas.CUDA_R_32F), "cublasLtMatmulDescCreate")
        for attr, val in ((DESC_TRANSA, CUBLAS_OP_T), (DESC_TRANSB, CUBLAS_OP_N),
                          (DESC_A_SCALE_MODE, SCALE_BLK128x128_32F), (DESC_B_SCALE_MODE, SCALE_VEC128_32F)):
            self._set(attr, ctypes.c_int32(val))
        self._one, self._zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self._algos: dict = {}          # (m, n, k, y_code, y_ld, y alignment) -> (algo, layouts) | None

    def _check(self, status: int, what: str) -> None:
        self.lt._check(status, what)

    def _set(self, attr: int, value) -> None:
        self._check(self.lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(value),
                                                            ctypes.sizeof(value)),
                    f"cublasLtMatmulDescSetAttribute({attr})")

    def prepare(self, m: int, n: int, k: int, y_code: int, y_ld: int, y_ptr: int, w_scale_ptr: int,
                x_scale_ptr: int):
        """Sets this call's scale pointers; the algorithm for the shape (cuBLASLt's heuristic #0,
        cached), or None when there is none."""
        self._set(DESC_A_SCALE_POINTER, ctypes.c_void_p(w_scale_ptr))
        self._set(DESC_B_SCALE_POINTER, ctypes.c_void_p(x_scale_ptr))
        key = (m, n, k, y_code, y_ld, _align(y_ptr))
        if key in self._algos:
            return self._algos[key]
        layouts = (self.lt._layout(CUDA_R_8F_E4M3, k, n, k), self.lt._layout(CUDA_R_8F_E4M3, k, m, k),
                   self.lt._layout(y_code, n, m, y_ld))
        pref = ctypes.c_void_p()
        self._check(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
        try:
            ws = ctypes.c_uint64(self.lt.workspace_bytes)
            self._check(self.lib.cublasLtMatmulPreferenceSetAttribute(
                pref, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws), ctypes.sizeof(ws)), "MAX_WORKSPACE_BYTES")
            for attr, al in ((CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, 256),
                             (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, 256),
                             (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, _align(y_ptr)),
                             (CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, _align(y_ptr))):
                v = ctypes.c_uint32(al)
                self._check(self.lib.cublasLtMatmulPreferenceSetAttribute(pref, attr, ctypes.byref(v),
                                                                          ctypes.sizeof(v)), "MIN_ALIGNMENT")
            result, found = HeuristicResult(), ctypes.c_int(0)
            st = self.lib.cublasLtMatmulAlgoGetHeuristic(self.lt.handle, self.desc, layouts[0], layouts[1],
                                                         layouts[2], layouts[2], pref, 1, ctypes.byref(result),
                                                         ctypes.byref(found))
        finally:
            self.lib.cublasLtMatmulPreferenceDestroy(pref)
        plan = None
        if st == 0 and found.value and result.state == 0:
            algo = result.algo
            plan = (algo, ctypes.pointer(algo), layouts)
        else:
            log.info("cuBLASLt has no block-scaled FP8 algorithm for m=%d n=%d k=%d (status %s): "
                     "those rows dequantise", m, n, k, _cublas.status_name(st))
        self._algos[key] = plan
        return plan

    def run(self, plan, stream_ptr: int, w_ptr: int, x8_ptr: int, y_ptr: int) -> None:
        """y = dequant(x8) @ dequant(w)^T with the plan and scale pointers of `prepare` (w and
        x8 256-byte aligned)."""
        _algo, p_algo, (a_lay, b_lay, d_lay) = plan
        self.lt.launch.foreign()
        self._check(self.lib.cublasLtMatmul(
            self.lt.handle, self.desc, ctypes.addressof(self._one), w_ptr, a_lay, x8_ptr, b_lay,
            ctypes.addressof(self._zero), y_ptr, d_lay, y_ptr, d_lay, p_algo, self.lt.workspace_ptr,
            self.lt.workspace_bytes, stream_ptr or None), "cublasLtMatmul(fp8 block-scaled)")
