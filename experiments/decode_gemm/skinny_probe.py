"""Scratch: sweep kernels_cuda/skinny.cu configs on the 9B decode GEMMs against the tuned cuBLAS
path (CudaOps.linear), graph replay. Not committed."""
import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import cupy
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from perf.bench_ops import BF16, bench_ceilings, rand_bf16, time_graph, time_gpu  # noqa: E402
from metrale.backends.cuda import CudaOps  # noqa: E402

out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/tmp")
mode = sys.argv[2] if len(sys.argv) > 2 else "sweep"

cubin = out / "skinny.cubin"
if not cubin.exists():
    subprocess.run(["nvcc", "-arch=sm_90", "-cubin", "-O3", "-std=c++17", "-I", str(ROOT / "kernels_cuda"),
                    str(ROOT / "experiments/decode_gemm/skinny_regdirect.cu"), "-o", str(cubin)], check=True)
mod = cupy.RawModule(path=str(cubin))
fns = {}
tcubin = out / "tma.cubin"
if not tcubin.exists():
    subprocess.run(["nvcc", "-arch=sm_90", "-cubin", "-O3", "-std=c++17", "-I", str(ROOT / "kernels_cuda"),
                    str(ROOT / "experiments/decode_gemm/tma_2d.cu"), "-o", str(tcubin)], check=True)
tmod = cupy.RawModule(path=str(tcubin))
dcubin = out / "dyn.cubin"
if not dcubin.exists():
    subprocess.run(["nvcc", "-arch=sm_90", "-cubin", "-O3", "-std=c++17", "-I", str(ROOT / "kernels_cuda"),
                    str(ROOT / "experiments/decode_gemm/tma_dyn.cu"), "-o", str(dcubin)], check=True)
dmod = cupy.RawModule(path=str(dcubin))
DYN = [(1, 4, 256, 5, 1024), (1, 4, 256, 5, 512), (1, 2, 512, 5, 1024), (2, 4, 256, 5, 1024), (2, 4, 256, 5, 512),
       (4, 4, 256, 4, 1024), (8, 4, 256, 3, 1024)]
SMS = cupy.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
_ws = {}
TMA = [(1, 4, 256, 5), (1, 2, 512, 5), (1, 4, 512, 3), (1, 2, 1024, 2), (2, 2, 512, 4), (2, 4, 512, 2),
       (2, 2, 1024, 2), (4, 2, 512, 3), (4, 4, 256, 4), (8, 4, 256, 3)]
import ctypes
_cu = ctypes.CDLL("libcuda.so.1")
_enc = _cu.cuTensorMapEncodeTiled
_enc.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64),
                 ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
                 ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
_tmaps = {}


def tmap_for(w, n, k, ld, rows):
    key = (w.data.ptr, n, k, ld, rows)
    if key not in _tmaps:
        buf = np.zeros(256, np.uint8)
        off = (-buf.ctypes.data) % 64
        dims = (ctypes.c_uint64 * 2)(k, n)
        strides = (ctypes.c_uint64 * 1)(ld * 2)
        box = (ctypes.c_uint32 * 2)(64, rows)
        es = (ctypes.c_uint32 * 2)(1, 1)
        r = _enc(buf.ctypes.data + off, 9, 2, w.data.ptr, dims, strides, box, es, 0, 3, 3, 0)
        if r != 0:
            raise RuntimeError(f"cuTensorMapEncodeTiled: {r}")
        _tmaps[key] = cupy.asarray(buf[off:off + 128].copy())
    return _tmaps[key]


def fn(nt_tiles, d, ks, p):
    key = (nt_tiles, d, ks, p)
    if key not in fns:
        f = mod.get_function(f"skinny_n{nt_tiles}_d{d}_ks{ks}_{p}_bf16")
        f.max_dynamic_shared_size_bytes = 200 * 1024
        fns[key] = f
    return fns[key]


def launch(cfg, x, w, y, t, n, k, acc=0):
    if cfg[-1] == "d":
        ntl, cw, kc, st, kch, _ = cfg
        if cfg not in fns:
            f = dmod.get_function(f"dyn_n{ntl}_c{cw}_k{kc}_s{st}_ch{kch}")
            f.max_dynamic_shared_size_bytes = 227 * 1024
            fns[cfg] = (f, dmod.get_function(f"dyn_reduce_n{ntl}"))
        f, red = fns[cfg]
        r = 16 * cw
        nch = -(-k // kch)
        if "part" not in _ws or _ws["part"].size < nch * 8 * ntl * n:
            _ws["part"] = cupy.empty(max(nch * 8 * ntl * n, 1 << 22), cupy.float32)
            _ws["counter"] = cupy.zeros(1, cupy.int32)
        stage = -(-(r * kc * 2 + 8 * ntl * (kc * 2 + 64)) // 1024) * 1024
        smem = st * stage + 16 * st + 4 * st + 1024
        tm = tmap_for(w, n, k, k, r)
        f((SMS,), (32 * (cw + 1),), (x, np.int64(k), tm, _ws["part"], _ws["counter"], np.int32(t), np.int32(n),
                                     np.int32(k)), shared_mem=smem)
        red((min(4 * SMS, -(-t * n // 256)),), (256,), (_ws["part"], y, np.int64(n), _ws["counter"], np.int32(t),
                                                       np.int32(n), np.int32(nch)))
        return
    if cfg[-1] == "t":
        ntl, cw, kc, st, ks, _ = cfg
        key = cfg
        if key not in fns:
            f = tmod.get_function(f"tma_n{ntl}_c{cw}_k{kc}_s{st}_ks{ks}")
            f.max_dynamic_shared_size_bytes = 227 * 1024
            fns[key] = f
        r = 16 * cw
        smem = st * (-(-(r * kc * 2 + 8 * ntl * (kc * 2 + 64)) // 1024) * 1024) + 16 * st + 1024
        tm = tmap_for(w, n, k, k, r)
        fns[key]((-(-n // r), ks), (32 * (cw + 1),), (x, np.int64(k), tm, np.int64(k), y, np.int64(n),
                 np.int32(t), np.int32(n), np.int32(k)), shared_mem=smem)
        return
    ntl, d, rg, kw, ks, p = cfg
    rows = 16 * rg if p == "w" else 32 * rg
    smem = 8 * ntl * (rows + 4) * 4
    if p == "w":
        cvec = -(-(-(-k // 32)) // ks) * 4
        smem = max(smem, 8 * ntl * (cvec + 4) * 16)
    fn(ntl, d, ks, p)((-(-n // rows), ks), (32 * rg * kw,), (x, np.int64(k), w, np.int64(k), y, np.int64(n),
                   np.int32(t), np.int32(n), np.int32(k), np.int32(rg), np.int32(kw), np.int32(acc)),
                   shared_mem=smem)


def configs(t, n, k):
    ntl = next(v for v in (1, 2, 4, 8) if 8 * v >= t)
    d = {1: 4, 2: 4, 4: 2, 8: 1}[ntl]
    out = []
    for p, maxw, maxc in ():
        for rg in range(1, 9):
            for kw in range(1, 9):
                if rg * kw > maxw:
                    continue
                for ks in (1, 2, 4, 8):
                    ctas = -(-n // (32 * rg)) * ks
                    if ctas < 96 or ctas > maxc:
                        continue
                    if (-(-k // 32)) < 2 * ks * kw * d:
                        continue
                    out.append((ntl, d, rg, kw, ks, p))
    for ntl_, cw, kc, st, kch in DYN:
        if ntl_ == ntl:
            out.append((ntl, cw, kc, st, kch, "d"))
    for ntl_, cw, kc, st in TMA:
        if ntl_ != ntl:
            continue
        for ks in (1, 2, 4):
            ctas = -(-n // (16 * cw)) * ks
            if 64 <= ctas <= 400:
                out.append((ntl, cw, kc, st, ks, "t"))
    if False:
        for d in (8, 16):
            for rg in range(1, 5):
                for kw in range(1, 5):
                    if rg * kw > 4:
                        continue
                    for ks in (1, 2, 4, 8):
                        ctas = -(-n // (16 * rg)) * ks
                        cvec = -(-(-(-k // 32)) // ks) * 4
                        if 8 * ntl * (cvec + 4) * 16 > 200 * 1024 or ctas < 96 or ctas > 4000:
                            continue
                        out.append((ntl, d, rg, kw, ks, "w"))
    return out


ops = CudaOps()
c = bench_ceilings(ops)
bw = c["copy_bytes_per_s"]
print(f"copy {bw / 1e12:.2f} TB/s", flush=True)
res = {"copy": bw, "rows": []}
shapes = [(4096, 12288), (12288, 4096)]
TS = {4096: [4, 8, 16, 32], 12288: [4, 8]}
if mode.startswith("ncu"):
    # ncu:<n>:<k>:<t>:<cfg tuple>
    _, n, k, t, cfg = mode.split(":", 4)
    n, k, t = int(n), int(k), int(t)
    cfg = tuple(int(v) if v.isdigit() else v for v in cfg.split(","))
    w, x, y = rand_bf16((n, k), k ** -0.5), rand_bf16((t, k)), cupy.empty((t, n), BF16)
    for _ in range(5):
        launch(cfg, x, w, y, t, n, k)
    cupy.cuda.Device().synchronize()
    sys.exit(0)
for n, k in shapes:
    w = rand_bf16((n, k), k ** -0.5)
    for t in TS[n]:
        x = rand_bf16((t, k))
        ref = x.astype(cupy.float32) @ w.astype(cupy.float32).T
        nbytes = (n * k + t * k + t * n) * 2
        base = time_graph(lambda: ops.linear(x, w), 10, 20)
        plan = getattr(ops._blas(), "last_plan", None)
        rows = []
        for cfg in configs(t, n, k):
            y = cupy.full((t, n), float("nan"), BF16)
            try:
                launch(cfg, x, w, y, t, n, k)
                cupy.cuda.Device().synchronize()
            except Exception as e:
                print("fail", cfg, e)
                continue
            err = float(cupy.max(cupy.abs(y.astype(cupy.float32) - ref)) / cupy.max(cupy.abs(ref)))
            if not err < 1e-2:
                print("WRONG", cfg, err, f"{time_gpu(lambda: launch(cfg, x, w, y, t, n, k), 10) * 1e6:.1f} us")
                continue
            tg = time_gpu(lambda: launch(cfg, x, w, y, t, n, k), 30)
            rows.append((tg, cfg, err))
        rows.sort()
        best = rows[:5]
        print(f"{n}x{k} t={t}: cublas {base * 1e6:.1f} us {nbytes / base / bw * 100:.0f}% ({plan.name if plan else '?'})")
        for tg, cfg, err in best:
            print(f"    {cfg} {tg * 1e6:.1f} us {nbytes / tg / bw * 100:.0f}%  err {err:.1e}")
        # graph replay of the best
        if best:
            cfg = best[0][1]
            y = cupy.empty((t, n), BF16)
            tgr = time_graph(lambda: launch(cfg, x, w, y, t, n, k), 10, 20)
            print(f"    best in graph: {tgr * 1e6:.1f} us {nbytes / tgr / bw * 100:.0f}%")
        res["rows"].append({"n": n, "k": k, "t": t, "cublas_s": base, "cublas": plan.name if plan else None,
                            "best": [(tg, cfg, err) for tg, cfg, err in best],
                            "all": [(tg, cfg) for tg, cfg, _ in rows]})
    del w
(out / "skinny_probe.json").write_text(json.dumps(res))
