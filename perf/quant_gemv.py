"""FP8 / NVFP4 projections on the CUDA backend against bf16 (a benchmark, not a test).

For the decode projections of Qwen3.5-9B and -27B ([out x in] as our model fuses them: GDN
in_proj q|k|v|z, out_proj, attention q|gate|k|v, o, MLP gate|up, down) with synthetic weights
(metrale.models.dummy.random_quantized: block FP8 128 x 128, NVFP4 with e4m3 scales per 16):
  * rows M = 1, 2, 4, 8, 16, 32, 64 through CudaOps.linear (the decode kernels of kernels_cuda/
    gemv_quant.cu, tuned on the first call: the config it chose is recorded), replayed from a
    captured CUDA graph of 20 calls that cycle over enough copies of the weight to exceed the
    50 MB L2 (as in a real step, where no weight is L2-resident): microseconds and the fraction
    of the copy bandwidth its bytes take (bytes = packed weight + scales + x + y), next to bf16
    (CudaOps.linear, cuBLASLt tuned with our bf16 GEMVs) measured the same way;
  * M = 16, 32, 64 also down the prefill path (dequantise + bf16 GEMM): where
    QUANT_MMA_MAX_ROWS comes from;
  * M = 512, 2048, 8192 (prefill): TFLOP/s of the dequantise + bf16 GEMM path against bf16.
  * --variants v1,v2: the decode rows (M <= 64) once per METRALE_QUANT_GEMV variant (v1: the
    CUDA-core GEMVs and x-as-A GEMMs; v2: also the weights-as-A tensor-core GEMVs for M <= 8),
    each tuned afresh: per row <fmt>_<variant>_us / _bw / _tflops / _vs_bf16 / _config; prefill
    rows run once (the variant does not touch them).
Writes perf/results/quant_gemv_<date>_<commit>.json (or --out), stamped and signed by
metrale.records.finish.

    python perf/quant_gemv.py [--out DIR] [--quick] [--variants v1,v2]
"""
from __future__ import annotations

import argparse
import datetime as _dt
import os
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "perf"))

from ladder import measure_copy_bw  # noqa: E402  (the one copy-bandwidth measurement)

SHAPES = {
    "qwen3_5_9b": {"gdn_in_qkvz": (12288, 4096), "gdn_out": (4096, 4096), "attn_qkv": (10240, 4096),
                   "attn_o": (4096, 4096), "mlp_gate_up": (24576, 4096), "mlp_down": (4096, 12288)},
    "qwen3_5_27b": {"gdn_in_qkvz": (16384, 5120), "gdn_out": (5120, 6144), "attn_qkv": (14336, 5120),
                    "attn_o": (5120, 6144), "mlp_gate_up": (34816, 5120), "mlp_down": (5120, 17408)},
}


def commit() -> str:
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"][:7]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True).strip()
    except Exception:
        return "unknown"


def graph_time_us(cp, fn, calls: int = 20, reps: int = 5, copies: int = 1) -> float:
    """Per-call microseconds of fn(i) replayed from one captured graph of `calls` calls, i cycling
    over `copies` weight copies."""
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        for i in range(copies):
            fn(i)
            fn(i)
        stream.synchronize()
        stream.begin_capture()
        for c in range(calls):
            fn(c % copies)
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
        s, e = cp.cuda.Event(), cp.cuda.Event()
        s.record(stream)
        for _ in range(reps):
            graph.launch(stream)
        e.record(stream)
        e.synchronize()
    return cp.cuda.get_elapsed_time(s, e) * 1e3 / (calls * reps)


def _summary(rows: list[dict], variants: list[str]) -> list[str]:
    """One line per (format, decode M): each variant's fraction of copy bandwidth over the shapes."""
    out = []
    for fmt in ("fp8", "nvfp4"):
        for m in sorted({r["m"] for r in rows if r["m"] <= 64}):
            cells = []
            for v in variants:
                bws = [r[f"{fmt}_{v}_bw"] for r in rows if r["m"] == m and f"{fmt}_{v}_bw" in r]
                if bws:
                    cells.append(f"{v} " + " ".join(f"{b:.2f}" for b in bws))
            out.append(f"{fmt:5s} M={m:2d} bw: " + " | ".join(cells))
    return out


def main(argv=None) -> int:
    import cupy as cp
    from metrale import records
    from metrale.backends.cuda import CudaOps
    from metrale.backends.cuda.gemm import quant as q
    from metrale.models.dummy import _cuda_random, random_quantized

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "perf" / "results"))
    ap.add_argument("--quick", action="store_true", help="9B shapes, fewer rows")
    ap.add_argument("--variants", default=None,
                    help="comma-separated METRALE_QUANT_GEMV variants to time the decode rows under "
                         f"({', '.join(q.QUANT_GEMV_VARIANTS)}); default: the environment's")
    args = ap.parse_args(argv)
    variants = [v.strip() for v in (args.variants or q.variant()).split(",") if v.strip()]
    bad = [v for v in variants if v not in q.QUANT_GEMV_VARIANTS]
    if bad:
        ap.error(f"--variants {','.join(bad)}: one of {', '.join(q.QUANT_GEMV_VARIANTS)}")
    env_before = os.environ.get("METRALE_QUANT_GEMV")
    ops = CudaOps()
    bw = measure_copy_bw()
    dev = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    decode_rows = (1, 2, 4, 8, 16, 32, 64) if not args.quick else (1, 8, 32)
    prefill_rows = (512, 2048, 8192) if not args.quick else (2048,)
    rows_out = []
    shapes = SHAPES if not args.quick else {"qwen3_5_9b": SHAPES["qwen3_5_9b"]}
    for model, projections in shapes.items():
        for proj, (n, k) in projections.items():
            l2 = 150 * 2 ** 20             # > the H200's 50 MB L2, three times over
            nb = max(1, -(-l2 // (n * k * 2)))
            wb = [_cuda_random((n, k)) for _ in range(nb)]
            wq = {}
            for fmt in ("fp8", "nvfp4"):
                one = ops.asarray(random_quantized((n, k), fmt, "cuda", seed=n + k))
                wq[fmt] = [one] + [ops.asarray(random_quantized((n, k), fmt, "cuda", seed=n + k + c))
                                   for c in range(1, max(1, -(-l2 // one.nbytes)))]
            for m in decode_rows + prefill_rows:
                x = _cuda_random((m, k))
                rec = dict(model=model, proj=proj, n=n, k=k, m=m)
                t_b = graph_time_us(cp, lambda i: ops.linear(x, wb[i]), calls=20 if m <= 64 else 3,
                                    copies=len(wb) if m <= 64 else 1)
                rec["bf16_us"] = t_b
                rec["bf16_bw"] = (n * k * 2 + m * (n + k) * 2) / (t_b * 1e-6) / bw
                rec["bf16_tflops"] = 2 * m * n * k / (t_b * 1e-6) / 1e12
                for fmt, ws in wq.items():
                    w = ws[0]
                    moved = w.nbytes + m * (n + k) * 2
                    for v in (variants if m <= 64 else variants[:1]):
                        os.environ["METRALE_QUANT_GEMV"] = v
                        t = graph_time_us(cp, lambda i: ops.linear(x, ws[i]), calls=20 if m <= 64 else 3,
                                          copies=len(ws) if m <= 64 else 1)
                        key = f"{fmt}_{v}"
                        rec[f"{key}_us"] = t
                        rec[f"{key}_bw"] = moved / (t * 1e-6) / bw
                        rec[f"{key}_tflops"] = 2 * m * n * k / (t * 1e-6) / 1e12
                        rec[f"{key}_vs_bf16"] = t_b / t
                        if m <= 64:
                            rec[f"{key}_config"] = q.tuned_config(ops, w, m)
                    if 8 < m <= 64:                     # the prefill path at these rows
                        keep = q.QUANT_MMA_MAX_ROWS, q.QUANT_GEMV_MAX_ROWS
                        q.QUANT_MMA_MAX_ROWS = q.QUANT_GEMV_MAX_ROWS = 0
                        try:
                            rec[f"{fmt}_other_path_us"] = graph_time_us(cp, lambda i: ops.linear(x, ws[i]),
                                                                        copies=len(ws))
                        finally:
                            q.QUANT_MMA_MAX_ROWS, q.QUANT_GEMV_MAX_ROWS = keep
                print(f"{model:12s} {proj:12s} {n:6d}x{k:<6d} M={m:5d}  bf16 {t_b:8.1f} us "
                      f"({rec['bf16_bw']:.0%} bw, {rec['bf16_tflops']:.0f} TF)", flush=True)
                for key in [f"{f}_{v}" for f in wq for v in variants if f"{f}_{v}_us" in rec]:
                    f = key.split("_")[0]
                    print(f"      {key:9s} {rec[f'{key}_us']:8.1f} us ({rec[f'{key}_bw']:.0%} bw, "
                          f"{rec[f'{key}_tflops']:.0f} TF, x{rec[f'{key}_vs_bf16']:.2f})"
                          + (f" other {rec[f'{f}_other_path_us']:.1f}" if f"{f}_other_path_us" in rec else "")
                          + (f" {rec.get(f'{key}_config')}" if m <= 64 else ""), flush=True)
                rows_out.append(rec)
            wb = wq = None
            cp.get_default_memory_pool().free_all_blocks()
    if env_before is None:
        os.environ.pop("METRALE_QUANT_GEMV", None)
    else:
        os.environ["METRALE_QUANT_GEMV"] = env_before
    summary = _summary(rows_out, variants)
    for line in summary:
        print(line)
    record = dict(benchmark="quant_gemv", commit=commit(), date=_dt.datetime.now(_dt.timezone.utc).isoformat(),
                  device=dev, copy_bandwidth_Bps=bw, quant_mma_max_rows=q.QUANT_MMA_MAX_ROWS,
                  variants=variants, summary=summary,
                  formats={"fp8": "block 128x128 e4m3, fp32 scales", "nvfp4": "e2m1, e4m3 scale / 16, fp32 global / row"},
                  rows=rows_out)
    records.write(Path(args.out) / f"quant_gemv_{_dt.datetime.now():%Y%m%d_%H%M%S}_{commit()}.json",
                  record, harness=__file__)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
