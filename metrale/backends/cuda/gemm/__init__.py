"""GEMMs of the CUDA backend: our cuBLAS / cuBLASLt handles (cublas.py, cublaslt.py: graph-capturable,
per-shape autotuning, with our decode GEMVs of kernels_cuda/gemv.cu as candidates) behind one `linear`.

Functions take the CudaOps instance first; CudaOps binds `linear`, `linear_parts` and `lm_head`
as its methods and `blas(ops)` builds its handle once.
"""
from __future__ import annotations

import logging

import numpy as np

from metrale import levers
from metrale.backends.cuda.elementwise import bias_add
from metrale.backends.cuda.gemm import cublas as _cublas
from metrale.backends.cuda.gemm import cublaslt as _cublaslt
from metrale.backends.cuda.gemm import quant as _quant
from metrale.backends.cuda.gemm.cublaslt import KSPLIT_S, OwnGemv
from metrale.backends.cuda.layout import BF16, F32, SplitK
from metrale.backends.cuda.layout import estride as _estride


def blas(ops):
    """The GEMM handle: cuBLASLt with per-shape autotuning (gemm/cublaslt.py) over
    our cuBLAS handle, with our GEMV kernels (kernels_cuda/gemv.cu, through this KernelCache)
    as candidates for decode row counts; the plain cublasGemmEx handle when
    METRALE_GEMM_TUNE=0 or libcublasLt cannot be used. Both share one workspace."""
    if ops._cublas is None:
        major = ops.cp.cuda.runtime.runtimeGetVersion() // 1000
        lib = _cublas.load_libcublas(major)
        ops._workspace = ops.cp.empty(_cublas.WORKSPACE_BYTES, dtype=np.uint8)
        handle = _cublas.Cublas(lib, ops._workspace.data.ptr, _cublas.WORKSPACE_BYTES, launch=ops.launch)
        if levers.get("METRALE_GEMM_TUNE") != "0":
            try:
                handle = _cublaslt.LtGemm(_cublaslt.load_libcublaslt(major), handle, ops._workspace.data.ptr,
                                          _cublas.WORKSPACE_BYTES, own_gemv=OwnGemv(ops.kernel),
                                          launch=ops.launch)
            except (_cublas.CublasError, AttributeError) as e:   # missing library / entry point
                logging.getLogger("metrale.gemm").warning("cuBLASLt unavailable, plain cublasGemmEx: %s", e)
        ops._cublas = handle
    return ops._cublas


GEMM_TYPES = {BF16: _cublas.CUDA_R_16BF, F32: _cublas.CUDA_R_32F, np.dtype(np.float16): _cublas.CUDA_R_16F}


def linear_parts(ops, x, w):
    """x @ w.T for a consumer that is add_rms_norm (a layer's last projection): a SplitK of
    fp32 partials when the GEMM tuner's k-split plan beats the plain one for this shape
    (cublaslt.py ksplit_plan: the 9B down projection at 16-64 rows), else linear(x, w).
    The first call of a shape runs plain (and tunes both)."""
    if _quant.is_device_quantized(w):
        return _quant.linear(ops, x, w)
    handle = blas(ops)
    ksplit = getattr(handle, "ksplit_plan", None)
    if ksplit is None or w.dtype != x.dtype or w.ndim != 2 or x.shape[-1] != w.shape[1]:
        return linear(ops, x, w)
    code = GEMM_TYPES.get(np.dtype(x.dtype))
    x2, xs = ops._rows(x)
    t, k = x2.shape
    n_out = w.shape[0]
    if code is None or _estride(w, 1) != 1:
        return linear(ops, x, w)
    plan = ksplit(ops.stream_ptr, x2.data.ptr, max(xs, k), w.data.ptr, _estride(w, 0), t, n_out, k, code)
    if plan is None:
        y = linear(ops, x, w)
        ksplit(ops.stream_ptr, x2.data.ptr, max(xs, k), w.data.ptr, _estride(w, 0), t, n_out, k, code)
        return y      # the first call decides (after linear tuned the plain plan); this one is plain
    parts = ops._new((KSPLIT_S, t, n_out), F32)
    handle.run_ksplit(plan, ops.stream_ptr, x2.data.ptr, w.data.ptr, parts.data.ptr)
    return SplitK(parts, (*x.shape[:-1], n_out), x.dtype, ops.launch)


def lm_head(ops, x, w):
    return linear(ops, x, w, out_dtype=F32)


def linear(ops, x, w, bias=None, out_dtype=None):
    """y = x @ w.T (+ bias) via cuBLAS(Lt) or our GEMVs, fp32 compute, output in x's dtype
    (or fp32 with out_dtype=F32: the lm head). FP8 / NVFP4 weights: gemm/quant.py."""
    if _quant.is_device_quantized(w):
        return _quant.linear(ops, x, w, bias, out_dtype)
    if w.dtype != x.dtype:
        raise TypeError(f"linear: x is {x.dtype} but w is {w.dtype}; convert one with ops.asarray")
    code = GEMM_TYPES.get(np.dtype(x.dtype))
    if code is None:
        raise TypeError(f"linear supports bfloat16, float16 and float32, got {x.dtype}")
    y_dtype = np.dtype(x.dtype if out_dtype is None else out_dtype)
    y_code = GEMM_TYPES.get(y_dtype)
    if y_code is None or (y_dtype != x.dtype and y_dtype != F32):
        raise TypeError(f"linear: output {y_dtype} from {x.dtype} inputs (x's dtype or float32 only)")
    lead = x.shape[:-1]
    x2, xs = ops._rows(x)
    t, k = x2.shape
    n_out = w.shape[0]
    if w.ndim != 2 or w.shape[1] != k:
        raise ValueError(f"linear: x [..., {k}] does not match w {tuple(w.shape)} (expected [out, {k}])")
    if _estride(w, 1) != 1 and k > 1:
        w = ops.cp.ascontiguousarray(w)
    wld = _estride(w, 0) if n_out > 1 else k
    y = ops._new((t, n_out), y_dtype)
    if t and n_out:
        blas(ops).gemm_rowmajor_xwT(ops.stream_ptr, x2.data.ptr, max(xs, k), w.data.ptr, max(wld, k),
                                       y.data.ptr, n_out, t, n_out, k, code, False, y_code)
        if bias is not None:
            b = bias if bias.dtype == y.dtype else bias.astype(y.dtype)
            bias_add(ops, y, b, t, n_out)
    return y.reshape(*lead, n_out)
