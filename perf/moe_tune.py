"""One Qwen3.5-35B-A3B MoE layer at decode sizes: the shared expert run beside the routed experts
(the engine before 2026-11-30: ops.moe + a DenseMLP, its gate GEMM, sigmoid-mul and the add) vs
inside ops.moe(shared=True), the tensor-core tilings of the decode ("m1") expert GEMMs, and the
CUDA-core expert GEMVs (moe_gemv_*, the engine's choice at T = 1) at every T.

    GIT_COMMIT=<hash> python perf/moe_tune.py [--out DIR]

Every variant is timed as graph replays rotating over 16 token sets (the weights, 1.6 GB, stream
from DRAM). Bytes per call: the experts the tokens reach (routed, unique, + the shared one) x
3 x H x I x 2, the router, x and out; the floor is that over the measured copy bandwidth. The
fused result is checked against the unfused one (rel err, bf16). Writes moe_tune_<date>.json.
"""
from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import cupy
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from metrale.backends.cuda import moe as cuda_moe  # noqa: E402
from metrale.backends.cuda import CudaOps  # noqa: E402
from perf.bench_ops import bench_ceilings, commit, rand_bf16, time_graph  # noqa: E402

E, H, I, K = 256, 2048, 512, 8
# (gate_up (ntw, stages), down (ntw, stages)) candidates for the m1 tiles (moe.cu instantiates them)
GU = [(4, 4), (4, 3), (4, 2), (2, 4), (2, 6), (8, 2)]
DN = [(4, 4), (4, 3), (4, 2), (2, 4), (2, 6), (8, 2)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="perf/results")
    ap.add_argument("--ts", default="1,2,4,8,16,32")
    ap.add_argument("--no-sweep", action="store_true", help="only the engine's m1 tiling, not the others")
    args = ap.parse_args()
    ops = CudaOps()
    bw = bench_ceilings(ops)["copy_bytes_per_s"]
    nsets = 16
    gate_up = rand_bf16((E + 1, 2 * I, H), H ** -0.5)
    down = rand_bf16((E + 1, H, I), I ** -0.5)
    router = rand_bf16((E + 1, H), 1.5 * H ** -0.5)
    routed = (router[:E], gate_up[:E], down[:E])          # views: the same bytes
    shared_gu, shared_dn, shared_gate = gate_up[E], down[E], router[E:]
    rw_host = cupy.asnumpy(router[:E].astype(cupy.float32))
    default = dict(cuda_moe.MOE_MMA)
    rows = []
    for T in [int(t) for t in args.ts.split(",")]:
        xs = [rand_bf16((T, H)) for _ in range(nsets)]
        active = np.mean([len(np.unique(np.argsort(-(cupy.asnumpy(x.astype(cupy.float32)) @ rw_host.T),
                                                    axis=1, kind="stable")[:, :K])) for x in xs]) + 1
        nbytes = active * 3 * H * I * 2 + (E + 1) * H * 2 + 2 * T * H * 2
        row = {"T": T, "active_experts": float(active), "bytes": float(nbytes), "floor_s": nbytes / bw}
        it = {"i": 0}

        def unfused():
            x = xs[it["i"] % nsets]
            it["i"] += 1
            y = ops.moe(x, *routed, K, True)
            s = ops.linear(ops.silu_mul(ops.linear(x, shared_gu)), shared_dn)
            return y + ops.sigmoid_mul(s, ops.linear(x, shared_gate))

        def fused():
            x = xs[it["i"] % nsets]
            it["i"] += 1
            return ops.moe(x, router, gate_up, down, K, True, shared=True)

        def run(fn, m1=None, gemv_max=0):
            """fn's result on xs[0] and its graph time, with the decode tiling `m1` (the engine's
            when None) and the expert GEMVs for steps of up to `gemv_max` tokens (0: none)."""
            keep = cuda_moe.MOE_GEMV_MAX_TOKENS
            cuda_moe.MOE_GEMV_MAX_TOKENS = gemv_max
            if m1 is not None:
                cuda_moe.MOE_MMA["m1"] = (1, *m1)
            try:
                it["i"] = 0
                got = cupy.asnumpy(fn().astype(cupy.float32)).astype(np.float64)
                it["i"] = 0
                return got, time_graph(fn, nsets, 20)
            finally:
                cuda_moe.MOE_MMA.update(default)
                cuda_moe.MOE_GEMV_MAX_TOKENS = keep

        def record(got, t, **kw):
            return dict(kw, s=t, frac_copy_bw=nbytes / t / bw,
                        rel_vs_unfused=float(np.linalg.norm(got - ref) / np.linalg.norm(ref)))

        ref, t = run(unfused)                                  # the tensor-core tiles, as before
        row["unfused"] = {"s": t, "frac_copy_bw": nbytes / t / bw}
        gu0, dn0 = default["m1"][1], default["m1"][2]          # the engine's tiling first
        cands = [(gu0, dn0)] + ([] if args.no_sweep else
                                [(g, dn0) for g in GU if g != gu0] + [(gu0, d) for d in DN if d != dn0])
        row["fused"] = [record(*run(fused, (gu, dn)), gate_up=gu, down=dn) for gu, dn in cands]
        # the CUDA-core GEMVs of steps of a few tokens (moe_gemv_*), at every T
        row["gemv"] = record(*run(fused, gemv_max=1 << 30))
        best = min(row["fused"], key=lambda r: r["s"])
        print(f"T={T:>3} experts {active:5.1f} floor {row['floor_s'] * 1e6:6.1f} us | unfused "
              f"{row['unfused']['s'] * 1e6:6.1f} us ({100 * row['unfused']['frac_copy_bw']:.0f}%) | fused "
              + " ".join(f"{r['gate_up']}/{r['down']}:{r['s'] * 1e6:.1f}" for r in row["fused"])
              + f" | best {best['gate_up']}/{best['down']} {best['s'] * 1e6:.1f} us "
              f"({100 * best['frac_copy_bw']:.0f}%), rel {best['rel_vs_unfused']:.1e} | gemv "
              f"{row['gemv']['s'] * 1e6:.1f} us ({100 * row['gemv']['frac_copy_bw']:.0f}%), "
              f"rel {row['gemv']['rel_vs_unfused']:.1e}", flush=True)
        rows.append(row)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.now(timezone.utc)
    res = {"benchmark": "moe_tune", "commit": commit(), "date": now.isoformat(),
           "device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
           "shape": {"E": E, "H": H, "I": I, "top_k": K, "shared_expert": True, "dtype": "bfloat16"},
           "copy_bytes_per_s": bw, "rows": rows}
    path = out / f"moe_tune_{now.strftime('%Y%m%d_%H%M%S')}.json"
    path.write_text(json.dumps(res, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
