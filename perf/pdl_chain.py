"""Decode GEMMs in a chain, with and without programmatic dependent launch (a benchmark).

The GEMM benchmark (bench_ops.py --gemm-only) replays one GEMM ten times from a graph: each call
starts only after the previous one has drained. In a decode step a GEMM follows another kernel,
and with PDL (metrale/backends/cuda/kernels.py) our kernels start during the previous kernel's tail:
the GEMV issues its first weight loads before it waits. This measures that, per GEMM, on the
issue's 9B shapes and at t = 1..64 tokens, as the engine runs them (CudaOps.linear: the tuned
plan, our GEMV or cuBLASLt), each captured in a graph with PDL off and on:

  * gemm chain: R distinct weight copies of one shape (>= 400 MB in all, so nothing is served
    from the 50 MB L2 between uses), GEMMs back to back, 2 x R per graph. Bytes per call =
    weights + x + y; figure = bytes / time / copy bandwidth.
  * k-split rows (where the tuner keeps it: the down projection at t >= 16): the same chain of
    CudaOps.linear_parts, which leaves fp32 partials for the next add_rms_norm to sum; figure =
    the plain GEMM's bytes / time (also with its own bytes, the partials written).
  * mlp chain: 8 layers of Qwen3.5-9B's MLP (add+RMSNorm -> gate_up 24576x4096 -> SiLU-mul ->
    down 4096x12288, through linear_parts as in a decoder layer), distinct weights per layer,
    each kernel reading the one before it.
    Figure = weight bytes / time per layer / copy bandwidth (the small kernels' own bytes are
    counted as overhead).

Writes perf/results/pdl_chain_<date>_<commit>.json (and a copy under --out).

    python perf/pdl_chain.py [--out DIR] [--ts 1,2,4,8,16,32,64] [--reps 20]
"""
from __future__ import annotations

import argparse
import datetime as _dt
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "perf"))

import cupy  # noqa: E402
import numpy as np  # noqa: E402

import bench_ops as bo  # noqa: E402
from metrale.backends.cuda.gemm.cublaslt import KSPLIT_S  # noqa: E402
from metrale.backends.cuda import CudaOps, SplitK  # noqa: E402

SHAPES = [(12288, 4096), (4096, 12288), (248320, 4096)]    # [out x in], the 9B shapes
H, I = 4096, 12288                                           # Qwen3.5-9B hidden / MLP width
FOOTPRINT = 400e6


def graph_time(ops: CudaOps, body, calls: int, reps: int, pdl: bool) -> float:
    """Seconds per call: `body()` (issuing `calls` calls) captured once with PDL on or off
    (bench_ops.time_graph: two eager runs first, which tune new shapes), replayed `reps` times."""
    prev = ops.launch.set_pdl(pdl)
    try:
        return bo.time_graph(body, 1, reps, capture=ops.launch.capture) / calls
    finally:
        ops.launch.set_pdl(prev)


def gemm_chain(ops: CudaOps, ts, reps: int, copy_bw: float, shapes=SHAPES) -> list[dict]:
    rows = []
    for n, k in shapes:
        wbytes = n * k * 2
        copies = max(1, min(8, int(-(-FOOTPRINT // wbytes))))
        ws = [bo.rand_bf16((n, k), k ** -0.5) for _ in range(copies)]
        for t in ts:
            x = bo.rand_bf16((t, k))

            def body():
                for _ in range(2):
                    for w in ws:
                        ops.linear(x, w)

            nbytes = wbytes + 2 * t * (n + k)
            row = {"out": n, "in": k, "t": t, "bytes": nbytes, "copies": copies}
            for pdl in (False, True):
                s = graph_time(ops, body, 2 * copies, reps, pdl)
                row["pdl" if pdl else "plain"] = {"s": s, "frac_copy_bw": nbytes / s / copy_bw}
            row["plan"] = getattr(getattr(ops._blas(), "last_plan", None), "name", "gemmex")
            ops.linear_parts(x, ws[0])                # decides the k-split for this key (after linear tuned it)
            if isinstance(ops.linear_parts(x, ws[0]), SplitK):
                # the k-split form (fp32 partials, summed by the next add_rms_norm): the GEMM alone,
                # its bytes = weights + x + the partials it writes
                def body_parts():
                    for _ in range(2):
                        for w in ws:
                            ops.linear_parts(x, w)

                pbytes = wbytes + 2 * t * k + KSPLIT_S * 4 * t * n
                for pdl in (False, True):
                    s = graph_time(ops, body_parts, 2 * copies, reps, pdl)
                    row["ksplit_pdl" if pdl else "ksplit_plain"] = {"s": s, "frac_copy_bw": nbytes / s / copy_bw,
                                                                     "frac_copy_bw_own_bytes": pbytes / s / copy_bw}
                row["ksplit_plan"] = ops._blas().last_plan.name
                print(f"     k-split {row['ksplit_plan']:<60} plain {row['ksplit_plain']['s'] * 1e6:7.1f} us "
                      f"{100 * row['ksplit_plain']['frac_copy_bw']:5.1f}%   pdl {row['ksplit_pdl']['s'] * 1e6:7.1f} us "
                      f"{100 * row['ksplit_pdl']['frac_copy_bw']:5.1f}%", flush=True)
            rows.append(row)
            print(f"gemm {n:>6}x{k:<6} t={t:<3} {row['plan']:<52} plain {row['plain']['s'] * 1e6:7.1f} us "
                  f"{100 * row['plain']['frac_copy_bw']:5.1f}%   pdl {row['pdl']['s'] * 1e6:7.1f} us "
                  f"{100 * row['pdl']['frac_copy_bw']:5.1f}%", flush=True)
        ws = x = None
        cupy.get_default_memory_pool().free_all_blocks()
    return rows


def mlp_chain(ops: CudaOps, ts, reps: int, copy_bw: float, layers: int = 8) -> list[dict]:
    rng = np.random.default_rng(0)
    ws = [(ops.asarray(1 + 0.1 * rng.standard_normal(H)), bo.rand_bf16((2 * I, H), H ** -0.5),
           bo.rand_bf16((H, I), I ** -0.5)) for _ in range(layers)]
    wbytes = (2 * I * H + H * I + H) * 2
    rows = []
    for t in ts:
        h0, r0 = bo.rand_bf16((t, H)), bo.rand_bf16((t, H))

        def body():
            h, r = h0, r0
            for wn, wgu, wd in ws:
                x, r = ops.add_rms_norm(h, r, wn, 1e-6, 1.0)
                h = ops.linear_parts(ops.silu_mul(ops.linear(x, wgu)), wd)   # as DenseMLP in a layer

        row = {"t": t, "weight_bytes_per_layer": wbytes, "layers": layers}
        for pdl in (False, True):
            s = graph_time(ops, body, layers, reps, pdl)
            row["pdl" if pdl else "plain"] = {"s_per_layer": s, "frac_copy_bw": wbytes / s / copy_bw}
        rows.append(row)
        print(f"mlp  t={t:<3} plain {row['plain']['s_per_layer'] * 1e6:7.1f} us/layer "
              f"{100 * row['plain']['frac_copy_bw']:5.1f}%   pdl {row['pdl']['s_per_layer'] * 1e6:7.1f} us/layer "
              f"{100 * row['pdl']['frac_copy_bw']:5.1f}%", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="")
    ap.add_argument("--ts", default="1,2,4,8,16,32,64")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--shapes", default="", help="OUTxIN,... (default: the three 9B shapes)")
    ap.add_argument("--no-mlp", action="store_true")
    args = ap.parse_args()
    ts = [int(v) for v in args.ts.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")] if args.shapes else SHAPES
    ops = CudaOps()
    ops.kernel("elementwise", "silu_mul_bf16")        # decides the launch path (self-tests)
    props = cupy.cuda.runtime.getDeviceProperties(ops.device.id)
    res = {"commit": bo.commit(), "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "device": props["name"].decode() if isinstance(props["name"], bytes) else props["name"],
           "pdl_available": bool(ops.launch.pdl_ok), "dtype": "bfloat16",
           "metric": "bytes / time per call / copy bandwidth; graphs captured with PDL off ('plain') "
                     "and on ('pdl'); CudaOps.linear's tuned plan"}
    res["ceilings"] = c = bo.bench_ceilings(ops)
    print(f"copy {c['copy_bytes_per_s'] / 1e12:.2f} TB/s; PDL available: {res['pdl_available']}")
    res["gemm_chain"] = gemm_chain(ops, ts, args.reps, c["copy_bytes_per_s"], shapes)
    if not args.no_mlp:
        res["mlp_chain"] = mlp_chain(ops, ts, args.reps, c["copy_bytes_per_s"])
    bo.write_results(res, args.out, prefix="pdl_chain")


if __name__ == "__main__":
    main()
