"""Op benchmarks of the CUDA backend (a benchmark, not a test).

Measures the ceilings first (device-to-device copy bandwidth, bf16 GEMM rate at 8192^3), then:
  * cuBLAS decode GEMMs (our ctypes handle) at M = 1, 8, 64, 128 for [in x out] = 4096x12288,
    12288x4096, 4096x248320 (the lm head), eager and replayed from a captured CUDA graph, as a
    fraction of the copy bandwidth (bytes = weights + activations);
  * decode attention (Qwen3.5-27B attention shape: 24 q / 4 kv heads of 256, block 16; and
    9/3 x 64) at B = 1..128 x context 1k..8k, from a captured graph, as a fraction of the copy
    bandwidth (the tensor-core kernels);
  * prefill attention FLOP rate (causal, one sequence up to 16k, and a 2k chunk after 6k of
    context; 24/4 x 256, 32/8 x 128, 9/3 x 64);
  * MoE layer (Qwen3.5-35B-A3B: 256 experts, top-8, H 2048, I 512) at T = 1, 8, 64 (and 512)
    tokens, from a captured graph rotating over 16 token
    sets (so the active experts change every call and are not L2-resident), as a fraction of the
    copy bandwidth for the bytes of the active experts.
Writes perf/results/ops_<date>_<commit>.json (and a copy under --out) and prints a table.
CudaOps.linear runs the autotuned cuBLASLt path (METRALE_GEMM_TUNE=1, the default).

--gemm-only: the decode GEMMs alone, [out x in] = 12288x4096, 4096x12288, 248320x4096 and
SmolLM2-135M's 576x576, 192x576, 960x576, 3072x576, 576x1536 (bf16, fp32 accumulate) at M = 1, 2,
4, ..., 128, for cublasGemmEx (CUBLAS_GEMM_DEFAULT), cuBLASLt's heuristic #0, the autotuner without
and with our GEMV kernels as candidates (the latter is CudaOps.linear) and the GEMV kernels alone
(M <= 8), eager and replayed from a captured CUDA graph: microseconds,
fraction of the copy bandwidth (bytes = weights + x + y), the chosen algorithm and the tuning time
of the first call. Writes perf/results/gemm_<date>_<commit>.json (and a copy under --out).

    python perf/bench_ops.py [--out DIR] [--quick] [--moe-only | --gemm-only]
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import cupy  # noqa: E402
import ml_dtypes  # noqa: E402

from metrale.backends.cuda.gemm import cublas as cb  # noqa: E402
from metrale.backends.cuda.gemm import cublaslt as lt  # noqa: E402
from metrale.backends.cuda import CudaOps  # noqa: E402
from metrale.forward import ForwardBatch  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)


def commit() -> str:
    if os.environ.get("GIT_COMMIT"):      # the device's copy of the tree has no (or a stale) .git
        return os.environ["GIT_COMMIT"][:7]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
    except Exception:
        return "unknown"


def time_gpu(fn, iters: int, warmup: int = 3) -> float:
    """Mean seconds per call of fn() on the current stream (CUDA events around `iters` calls)."""
    for _ in range(warmup):
        fn()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) / 1e3 / iters


def time_graph(fn, calls_per_graph: int, replays: int, capture=contextlib.nullcontext):
    """Capture `calls_per_graph` calls of fn() in one graph (inside the context `capture()`);
    mean seconds per call over replays."""
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        fn()
        fn()
        stream.synchronize()
        stream.begin_capture()
        with capture():
            for _ in range(calls_per_graph):
                fn()
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        for _ in range(replays):
            graph.launch(stream)
        end.record(stream)
        end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) / 1e3 / (replays * calls_per_graph)


def rand_bf16(shape, scale=1.0):
    return (cupy.random.standard_normal(shape, dtype=cupy.float32) * scale).astype(BF16)


def bench_ceilings(ops: CudaOps) -> dict:
    n = 1 << 30  # 1 GiB each way
    a = cupy.empty(n, dtype=cupy.uint8)
    b = cupy.empty(n, dtype=cupy.uint8)
    a.fill(1)
    t = time_gpu(lambda: cupy.copyto(b, a), 20)
    copy_bw = 2 * n / t
    m = 8192
    x, w = rand_bf16((m, m)), rand_bf16((m, m))
    t = time_gpu(lambda: ops.linear(x, w), 10)
    return {"copy_bytes_per_s": copy_bw, "gemm_bf16_flop_per_s": 2 * m ** 3 / t, "gemm_shape": [m, m, m]}


def bench_gemms(ops: CudaOps, copy_bw: float, quick: bool) -> list[dict]:
    rows = []
    for k, n in [(4096, 12288), (12288, 4096), (4096, 248320)]:
        w = rand_bf16((n, k), k ** -0.5)
        for m in (1, 8, 64, 128):
            x = rand_bf16((m, k))
            nbytes = (n * k + m * k + m * n) * 2
            iters = 20 if quick else 100
            eager = time_gpu(lambda: ops.linear(x, w), iters)
            plan = getattr(ops._blas(), "last_plan", None)   # the tuned cuBLASLt plan (or gemmex)
            try:
                graph = time_graph(lambda: ops.linear(x, w), 10, 5 if quick else 20)
            except Exception as e:  # report, keep benchmarking
                graph, err = float("nan"), repr(e)
            else:
                err = None
            rows.append({"in": k, "out": n, "M": m, "bytes": nbytes, "eager_s": eager, "graph_s": graph,
                         "eager_frac_copy_bw": nbytes / eager / copy_bw,
                         "graph_frac_copy_bw": nbytes / graph / copy_bw if graph == graph else None,
                         "graph_error": err, "flop_per_s_graph": 2 * m * n * k / graph if graph == graph else None,
                         "algo": plan.name if plan is not None else "gemmex"})
        del w
    return rows


# [out x in]: Qwen3.5-sized, then SmolLM2-135M's decode GEMMs (q/o, k/v, fused qkv, fused
# gate_up, down: latency-bound, where the own GEMV kernels compete)
GEMM_SHAPES = [(12288, 4096), (4096, 12288), (248320, 4096), (576, 576), (192, 576), (960, 576), (3072, 576),
               (576, 1536)]
GEMM_MS = (1, 2, 4, 8, 16, 32, 64, 128)
# lt_tuned: what CudaOps.linear runs (cuBLASLt + own GEMV candidates); lt_tuned_lt: the same tuner
# without the GEMV candidates; gemv: the fastest own GEMV config alone (M <= 8)
GEMM_VARIANTS = ("gemmex", "lt_heuristic0", "lt_tuned_lt", "lt_tuned", "gemv")


class GemvOnly:
    """Our GEMV kernels alone, as a GEMM variant: the first call of a shape times every config
    (eagerly, CUDA events) and keeps the fastest; shapes the kernel does not take are skipped."""

    def __init__(self, own: lt.OwnGemv):
        self.own, self._best, self.last_plan = own, {}, None

    def applies(self, m: int, k: int) -> bool:
        return lt.OwnGemv.applies(m, k, k, k, cb.CUDA_R_16BF, 256, 256)

    def gemm_rowmajor_xwT(self, stream_ptr, x_ptr, x_ld, w_ptr, w_ld, y_ptr, y_ld, t, n_out, k, code,
                          accumulate=False):
        key = (t, n_out, k, x_ld, w_ld, y_ld, code)
        cfg = self._best.get(key)
        if cfg is None:
            times = []
            for c in lt.OwnGemv.configs(k):
                def fn(c=c):
                    self.own.launch(c, stream_ptr, x_ptr, x_ld, w_ptr, w_ld, y_ptr, y_ld, t, n_out, k, code, False)
                times.append((time_gpu(fn, 50), c))
            cfg = self._best[key] = min(times)[1]
            self.last_plan = lt.Plan(name=lt.OwnGemv.describe(cfg), tuned=True, own=cfg)
            self.last_plan.time_s = min(times)[0]
        self.own.launch(cfg, stream_ptr, x_ptr, x_ld, w_ptr, w_ld, y_ptr, y_ld, t, n_out, k, code, accumulate)


def gemm_variants(ops: CudaOps) -> dict:
    """{variant: object with gemm_rowmajor_xwT}: cublasGemmEx (our cuBLAS handle), cuBLASLt's
    heuristic #0 and the autotuned cuBLASLt plan (the one CudaOps.linear uses), one workspace."""
    blas = ops._blas()
    if not isinstance(blas, lt.LtGemm):   # METRALE_GEMM_TUNE=0 or no libcublasLt
        major = cupy.cuda.runtime.runtimeGetVersion() // 1000
        try:
            blas = lt.LtGemm(lt.load_libcublaslt(major), blas, ops._workspace.data.ptr, cb.WORKSPACE_BYTES)
        except cb.CublasError as e:
            print(f"cuBLASLt unavailable: {e}")
            return {"gemmex": blas}
    heur = lt.LtGemm(blas.lib, blas.blas, blas.workspace_ptr, blas.workspace_bytes, mode="heuristic")
    lt_only = lt.LtGemm(blas.lib, blas.blas, blas.workspace_ptr, blas.workspace_bytes)
    out = {"gemmex": blas.blas, "lt_heuristic0": heur, "lt_tuned_lt": lt_only, "lt_tuned": blas}
    if blas.own_gemv is not None:
        out["gemv"] = GemvOnly(blas.own_gemv)
    return out


def bench_gemm_variants(ops: CudaOps, copy_bw: float, quick: bool) -> list[dict]:
    variants = gemm_variants(ops)
    rows = []
    for n, k in GEMM_SHAPES:
        w = rand_bf16((n, k), k ** -0.5)
        for m in ((1, 8, 64) if quick else GEMM_MS):
            x = rand_bf16((m, k))
            y = cupy.empty((m, n), dtype=BF16)
            nbytes = (n * k + m * k + m * n) * 2
            row = {"out": n, "in": k, "M": m, "bytes": nbytes}
            outs = {}
            for name, g in variants.items():
                if isinstance(g, GemvOnly) and not g.applies(m, k):
                    continue
                def fn(g=g):
                    g.gemm_rowmajor_xwT(cupy.cuda.get_current_stream().ptr, x.data.ptr, k, w.data.ptr, k,
                                        y.data.ptr, n, m, n, k, cb.CUDA_R_16BF)
                t0 = time.perf_counter()
                fn()                                     # tunes (lt_tuned), outside any capture
                cupy.cuda.get_current_stream().synchronize()
                first = time.perf_counter() - t0
                outs[name] = y.copy()
                eager = time_gpu(fn, 20 if quick else 100)
                try:
                    graph, err = time_graph(fn, 10, 5 if quick else 20), None
                except Exception as e:  # report, keep benchmarking
                    graph, err = float("nan"), repr(e)
                plan = getattr(g, "last_plan", None)
                row[name] = {"eager_s": eager, "graph_s": graph, "graph_error": err, "first_call_s": first,
                             "eager_frac_copy_bw": nbytes / eager / copy_bw,
                             "graph_frac_copy_bw": nbytes / graph / copy_bw if graph == graph else None,
                             "algo": plan.name if plan is not None else "gemmex",
                             "algo_id": plan.algo_id if plan is not None else None,
                             "plan": plan.as_dict() if plan is not None else None}
            ref = outs["gemmex"].astype(cupy.float32)
            for name, o in outs.items():   # every variant computes the same product
                d = o.astype(cupy.float32) - ref
                row[name]["rel_vs_gemmex"] = float(cupy.sqrt((d * d).sum() / max(float((ref * ref).sum()), 1e-30)))
            rows.append(row)
        w = x = y = None   # the 2 GB lm head goes before the next shape
        cupy.get_default_memory_pool().free_all_blocks()
    return rows


def gemm_section(res: dict, ops: CudaOps, copy_bw: float, quick: bool) -> None:
    res["gemm_variants"] = rows = bench_gemm_variants(ops, copy_bw, quick)
    names = [n for n in GEMM_VARIANTS if any(n in r for r in rows)]
    print(f"\n{'GEMM out x in':>15} {'M':>4} " + " ".join(f"{n + ' eager/graph us, %bw':>34}" for n in names)
          + "  tuned algo (tuning ms)")
    for r in rows:
        cols = []
        for n in names:
            v = r.get(n)
            if v is None:
                cols.append("-")
                continue
            g = v["graph_frac_copy_bw"]
            cols.append(f"{v['eager_s'] * 1e6:>8.1f} {v['graph_s'] * 1e6:>8.1f} {100 * v['eager_frac_copy_bw']:>6.0f}% "
                        f"{(100 * g if g else float('nan')):>6.0f}%")
        tuned = r.get("lt_tuned")
        extra = f"  {tuned['algo']} ({tuned['first_call_s'] * 1e3:.0f})" if tuned else ""
        print(f"{r['out']:>7}x{r['in']:<7} {r['M']:>4} " + " ".join(f"{c:>34}" for c in cols) + extra)


def decode_batch(b: int, ctx: int, bs: int, rng) -> tuple[ForwardBatch, int]:
    per = -(-(ctx + 1) // bs)
    nb = b * per + 1
    perm = rng.permutation(np.arange(1, nb)).astype(np.int32)
    bt = perm.reshape(b, per)
    seq_lens = np.full(b, ctx + 1, np.int32)
    pos = np.full(b, ctx, np.int32)
    slots = (bt[:, ctx // bs] * bs + ctx % bs).astype(np.int32)
    batch = ForwardBatch(np.zeros(b, np.int32), pos, np.arange(b + 1, dtype=np.int32), seq_lens, bt, slots,
                         np.arange(b, dtype=np.int32), np.arange(b, dtype=np.int32), bs)
    return batch, nb


ATTN_IMPLS = ("mma",)   # the tensor-core kernels (the CUDA-core fallback is gone)


def bench_decode_attention(impls: dict, copy_bw: float, quick: bool) -> list[dict]:
    """Decode attention from captured graphs, every impl on the same inputs (bytes = K and V of
    every sequence read once + q and out). Shapes: Qwen3.5 (24/4 x 256) and SmolLM2-like (9/3 x 64).
    The K/V pool is several times the L2 (50 MB), and sequences' blocks are shuffled."""
    rows = []
    shapes = [(24, 4, 256, 16)] + ([] if quick else [(9, 3, 64, 16)])
    for hq, hk, d, bs in shapes:
        rng = np.random.default_rng(0)
        max_tokens = 128 * (8192 + bs)
        kc = rand_bf16((max_tokens // bs + 2, bs, hk, d))
        vc = rand_bf16((max_tokens // bs + 2, bs, hk, d))
        for b in ((1, 8, 64, 128) if quick else (1, 2, 4, 8, 16, 32, 64, 128)):
            for ctx in (1024, 2048, 4096, 8192):
                batch, nb = decode_batch(b, ctx, bs, rng)
                q = rand_bf16((b, hq, d))
                k_, v_ = kc[:nb], vc[:nb]
                nbytes = 2 * b * (ctx + 1) * hk * d * 2 + 2 * b * hq * d * 2
                row = {"B": b, "context": ctx, "heads": [hq, hk, d], "bytes": nbytes}
                for name, ops in impls.items():
                    dev = ops.upload_batch(batch)
                    fn = lambda: ops.attention(q, k_, v_, dev, d ** -0.5)  # noqa: E731
                    try:
                        t = time_graph(fn, 10, 5 if quick else 20)
                        mode = "graph"
                    except Exception:
                        t, mode = time_gpu(fn, 20), "eager"
                    row[name] = {"s": t, "mode": mode, "frac_copy_bw": nbytes / t / copy_bw}
                rows.append(row)
        del kc, vc
    return rows


def bench_prefill_attention(impls: dict, quick: bool) -> list[dict]:
    """Causal prefill of one sequence (FLOPs = 4 * D * Hq * L(L+1)/2), and a 2k chunk continuing
    a 6k context (FLOPs = 4 * D * Hq * sum of visible keys), every impl on the same inputs."""
    rows = []
    cases = [(L, 0) for L in ((1024, 4096) if quick else (1024, 4096, 8192, 16384))] + [(2048, 6144)]
    for hq, hk, d in [(24, 4, 256), (32, 8, 128), (9, 3, 64)]:
        for L, ctx in cases:
            bs = 16
            n = ctx + L
            nb = -(-n // bs) + 1
            bt = np.arange(1, nb, dtype=np.int32)[None, :]
            batch = ForwardBatch(np.zeros(L, np.int32), np.arange(ctx, n, dtype=np.int32),
                                 np.array([0, L], np.int32), np.array([n], np.int32), bt,
                                 np.arange(bs + ctx, bs + n, dtype=np.int32), np.zeros(1, np.int32),
                                 np.array([L - 1], np.int32), bs)
            kc, vc = rand_bf16((nb, bs, hk, d)), rand_bf16((nb, bs, hk, d))
            q = rand_bf16((L, hq, d))
            flops = 4 * d * hq * (L * ctx + L * (L + 1) / 2)
            row = {"L": L, "context": ctx, "heads": [hq, hk, d], "flop": flops}
            for name, ops in impls.items():
                dev = ops.upload_batch(batch)
                iters = 3 if quick else 10
                t = time_gpu(lambda: ops.attention(q, kc, vc, dev, d ** -0.5), iters, warmup=3)
                row[name] = {"s": t, "flop_per_s": flops / t}
            rows.append(row)
    return rows


MOE_IMPLS = ("mma",)    # tensor-core expert GEMMs (the CUDA-core tiles are gone)


def bench_moe(copy_bw: float, quick: bool) -> list[dict]:
    """One Qwen3.5-35B-A3B MoE layer (router GEMM, routing, expert GEMMs, combine; not the
    shared expert) per call. bytes = the active experts' gate_up + down (each read once) + x and
    out; the active experts are counted from the host routing of each token set (fp32 logits;
    the device rounds them to bf16, which can move a near-tie, a negligible change in the count)."""
    E, H, I, K = 256, 2048, 512, 8
    nsets = 16
    gate_up = rand_bf16((E, 2 * I, H), H ** -0.5)
    down = rand_bf16((E, H, I), I ** -0.5)
    router_w = rand_bf16((E, H), 1.5 * H ** -0.5)
    rw_host = cupy.asnumpy(router_w.astype(cupy.float32))
    expert_bytes = 3 * H * I * 2
    impls = {"mma": CudaOps()}
    rows = []
    for T in ((1, 8, 64) if quick else (1, 8, 64, 512)):
        xs = [rand_bf16((T, H)) for _ in range(nsets)]
        active = []
        for x in xs:
            logits = cupy.asnumpy(x.astype(cupy.float32)) @ rw_host.T
            active.append(len(np.unique(np.argsort(-logits, axis=1, kind="stable")[:, :K])))
        n_active = float(np.mean(active))
        nbytes = n_active * expert_bytes + 2 * T * H * 2 + E * H * 2
        row = {"T": T, "E": E, "H": H, "I": I, "top_k": K, "active_experts": n_active,
               "bytes": nbytes, "floor_s": nbytes / copy_bw}
        outs = {}
        for name, ops in impls.items():
            state = {"i": 0}

            def fn(ops=ops, state=state, xs=xs, w=(router_w, gate_up, down)):
                x = xs[state["i"] % nsets]
                state["i"] += 1
                return ops.moe(x, *w, K, True)
            try:
                t = time_graph(fn, nsets, 5 if quick else 20)
                mode = "graph"
            except Exception as e:  # report, keep benchmarking
                t, mode = time_gpu(fn, 2 * nsets), f"eager ({type(e).__name__})"
            outs[name] = cupy.asnumpy(ops.moe(xs[0], router_w, gate_up, down, K, True).astype(cupy.float32))
            row[name] = {"s": t, "mode": mode, "frac_copy_bw": nbytes / t / copy_bw}
        rows.append(row)
    return rows


def moe_section(res: dict, copy_bw: float, quick: bool) -> None:
    res["moe"] = rows = bench_moe(copy_bw, quick)
    cupy.get_default_memory_pool().free_all_blocks()   # the 1.6 GB of expert weights
    print(f"\n{'MoE 35B-A3B T':>13} {'experts':>7} {'MB':>6} {'floor us':>8} "
          + " ".join(f"{n + ' us':>9} {'%bw':>5}" for n in MOE_IMPLS))
    for r in rows:
        cols = " ".join(f"{r[n]['s'] * 1e6:>9.1f} {100 * r[n]['frac_copy_bw']:>4.0f}%" for n in MOE_IMPLS)
        print(f"{r['T']:>13} {r['active_experts']:>7.1f} {r['bytes'] / 1e6:>6.1f} {r['floor_s'] * 1e6:>8.1f} "
              f"{cols}")
    modes = {r[n]["mode"] for r in rows for n in MOE_IMPLS}
    if modes != {"graph"}:
        print(f"MoE timing modes: {sorted(modes)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--moe-only", action="store_true", help="ceilings + the MoE section only")
    ap.add_argument("--gemm-only", action="store_true",
                    help="ceilings + decode GEMMs: cublasGemmEx vs cuBLASLt heuristic #0 vs autotuned")
    args = ap.parse_args()
    ops = CudaOps()
    props = cupy.cuda.runtime.getDeviceProperties(ops.device.id)
    res = {"commit": commit(), "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "device": props["name"].decode() if isinstance(props["name"], bytes) else props["name"],
           "sm_count": props["multiProcessorCount"], "cupy": cupy.__version__,
           "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(), "cublas": ops._blas().version,
           "cublaslt": getattr(ops._blas(), "lt_version", None), "dtype": "bfloat16"}
    res["ceilings"] = c = bench_ceilings(ops)
    print(f"copy {c['copy_bytes_per_s'] / 1e12:.2f} TB/s   bf16 GEMM 8192^3 {c['gemm_bf16_flop_per_s'] / 1e12:.0f} TFLOP/s")
    if args.moe_only:
        moe_section(res, c["copy_bytes_per_s"], args.quick)
        write_results(res, args.out)
        return
    if args.gemm_only:
        logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
        logging.getLogger("metrale.gemm").setLevel(logging.DEBUG)   # one line per tuned shape
        gemm_section(res, ops, c["copy_bytes_per_s"], args.quick)
        write_results(res, args.out, prefix="gemm")
        return
    res["gemm_decode"] = bench_gemms(ops, c["copy_bytes_per_s"], args.quick)
    print(f"\n{'GEMM in x out':>16} {'M':>4} {'eager us':>9} {'graph us':>9} {'eager %bw':>9} {'graph %bw':>9}  algo")
    for r in res["gemm_decode"]:
        g = r["graph_frac_copy_bw"]
        print(f"{r['in']:>7}x{r['out']:<8} {r['M']:>4} {r['eager_s'] * 1e6:>9.1f} {r['graph_s'] * 1e6:>9.1f} "
              f"{100 * r['eager_frac_copy_bw']:>8.0f}% {(100 * g if g else float('nan')):>8.0f}%  {r['algo']}")
    impls = {"mma": ops}
    res["attention_decode"] = bench_decode_attention(impls, c["copy_bytes_per_s"], args.quick)
    print(f"\n{'decode attn heads':>17} {'B':>4} {'ctx':>6} " + " ".join(f"{n + ' us':>9} {'%bw':>5}" for n in impls))
    for r in res["attention_decode"]:
        cols = " ".join(f"{r[n]['s'] * 1e6:>9.1f} {100 * r[n]['frac_copy_bw']:>4.0f}%" for n in impls)
        print(f"{str(r['heads']):>17} {r['B']:>4} {r['context']:>6} {cols}")
    res["attention_prefill"] = bench_prefill_attention(impls, args.quick)
    print(f"\n{'prefill attn heads':>20} {'L':>6} {'ctx':>6} " + " ".join(f"{n + ' ms':>9} {'TFLOP/s':>8}" for n in impls))
    for r in res["attention_prefill"]:
        cols = " ".join(f"{r[n]['s'] * 1e3:>9.2f} {r[n]['flop_per_s'] / 1e12:>8.1f}" for n in impls)
        print(f"{str(r['heads']):>20} {r['L']:>6} {r['context']:>6} {cols}")
    moe_section(res, c["copy_bytes_per_s"], args.quick)
    write_results(res, args.out)


def write_results(res: dict, out: str, prefix: str = "ops") -> None:
    name = f"{prefix}_{_dt.date.today():%Y%m%d}_{res['commit']}.json"
    paths = [ROOT / "perf" / "results" / name] + ([Path(out) / name] if out else [])
    for p in paths:
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(json.dumps(res, indent=1))
            print(f"wrote {p}")
        except OSError as e:
            print(f"could not write {p}: {e}")


if __name__ == "__main__":
    main()
