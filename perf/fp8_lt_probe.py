"""Which cuBLASLt block-scaled FP8 configurations this machine's cuBLAS runs (a probe, not a test):
for (A scale mode, B scale mode) in the VEC128 / BLK128x128 combinations and both attribute
numberings, the heuristic's status, and for each that returns an algorithm the relative error
of D against numpy (W8A8 reference). Prints one line per configuration and writes JSON."""
from __future__ import annotations

import ctypes
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    import cupy as cp
    import ml_dtypes

    from metrale.backends.cuda import CudaOps
    from metrale.backends.cuda.gemm import blas
    from metrale.backends.cuda.gemm import cublas as cb
    from metrale.backends.cuda.gemm.cublaslt import HeuristicResult

    E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
    ops = CudaOps()
    lt = blas(ops)
    lib = lt.lib
    out = {"lt_version": lt.lt_version, "cublas_version": lt.version, "rows": []}
    print("cublasLt", lt.lt_version, "cublas", lt.version, flush=True)
    rng = np.random.default_rng(0)
    m, n, k = 256, 512, 1024
    w = (rng.standard_normal((n, k)) * 60).astype(E4M3)
    ws = rng.uniform(0.5, 2, (n // 128, k // 128)).astype(np.float32) / 64
    x = (rng.standard_normal((m, k))).astype(E4M3)
    xs = rng.uniform(0.5, 2, (m, k // 128)).astype(np.float32)
    wd = w.astype(np.float32) * np.repeat(np.repeat(ws, 128, 0), 128, 1)
    xd = x.astype(np.float32) * np.repeat(xs, 128, 1)
    ref = xd @ wd.T
    dw, dws, dx, dxs = (cp.asarray(np.ascontiguousarray(a).view(np.uint8) if a.dtype == E4M3 else a)
                        for a in (w, ws, x, xs))
    # transposed scale tables too (to see which layout a mode reads)
    dws_t, dxs_t = cp.asarray(np.ascontiguousarray(ws.T)), cp.asarray(np.ascontiguousarray(xs.T))
    y = cp.empty((m, n), dtype=np.float32)
    vp = ctypes.c_void_p
    tables = {"w": {"plain": dws, "transposed": dws_t}, "x": {"plain": dxs, "transposed": dxs_t}}
    y16 = cp.empty((m, n), dtype=np.dtype(ml_dtypes.bfloat16))
    for amode, bmode in ((5, 4),):
        for wt in ("plain", "transposed"):
            for xt in ("plain", "transposed"):
                for dcode, yy in ((cb.CUDA_R_32F, y), (cb.CUDA_R_16BF, y16)):
                    desc = vp()
                    lt._check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), 68, cb.CUDA_R_32F), "create")
                    for attr, val in ((3, 1), (4, 0), (31, amode), (32, bmode)):
                        v = ctypes.c_int32(val)
                        lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(v), 4)
                    for attr, p in ((17, tables["w"][wt].data.ptr), (18, tables["x"][xt].data.ptr)):
                        v = vp(p)
                        lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(v), 8)
                    la, lb, ld = (lt._layout(28, k, n, k), lt._layout(28, k, m, k), lt._layout(dcode, n, m, n))
                    pref = vp()
                    lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref))
                    wsb = ctypes.c_uint64(lt.workspace_bytes)
                    lib.cublasLtMatmulPreferenceSetAttribute(pref, 1, ctypes.byref(wsb), 8)
                    res, cnt = HeuristicResult(), ctypes.c_int(0)
                    st = lib.cublasLtMatmulAlgoGetHeuristic(lt.handle, desc, la, lb, ld, ld, pref, 1, ctypes.byref(res),
                                                            ctypes.byref(cnt))
                    row = dict(a_mode=amode, b_mode=bmode, w_table=wt, x_table=xt, d_type=dcode,
                               heuristic_status=st, found=cnt.value)
                    if st == 0 and cnt.value:
                        one, zero = ctypes.c_float(1), ctypes.c_float(0)
                        algo = res.algo
                        row["matmul_status"] = lib.cublasLtMatmul(
                            lt.handle, desc, ctypes.addressof(one), dw.data.ptr, la, dx.data.ptr, lb,
                            ctypes.addressof(zero), yy.data.ptr, ld, yy.data.ptr, ld, ctypes.byref(algo),
                            lt.workspace_ptr, lt.workspace_bytes, None)
                        cp.cuda.runtime.deviceSynchronize()
                        got = cp.asnumpy(yy).astype(np.float32)
                        row["rel_err"] = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
                    print(row, flush=True)
                    out["rows"].append(row)
                    lib.cublasLtMatmulPreferenceDestroy(pref)
                    lib.cublasLtMatmulDescDestroy(desc)
    # the engine's own path on a 128 x 128 block-FP8 weight
    from metrale.backends.cuda.gemm import quant as q
    from metrale.models.quant import QuantizedTensor
    qt = QuantizedTensor("fp8", w, ws, (128, 128), None, "probe")
    qw = ops.asarray(qt)
    xb = cp.asarray(xd.astype(ml_dtypes.bfloat16))
    yb = cp.empty((m, n), dtype=np.dtype(ml_dtypes.bfloat16))
    ok = q._w8a8_into(ops, xb, k, qw, yb, n, cb.CUDA_R_16BF)
    cp.cuda.runtime.deviceSynchronize()
    row = dict(engine_path=True, w8a8_applies=q.w8a8_applies(qw), ran=bool(ok), s_rlog2=qw.s_rlog2,
               s_clog2=qw.s_clog2, blas=type(lt).__name__)
    if ok:
        row["rel_err_vs_weight_only"] = float(np.linalg.norm(cp.asnumpy(yb).astype(np.float32) - xd @ wd.T)
                                              / np.linalg.norm(xd @ wd.T))
    print(row, flush=True)
    out["rows"].append(row)
    d = Path(sys.argv[1] if len(sys.argv) > 1 else "perf/results")
    d.mkdir(parents=True, exist_ok=True)
    (d / f"fp8_lt_probe_{os.environ.get('GIT_COMMIT', 'x')[:7]}.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
