"""Where the decode GEMMs lose against copy bandwidth, from Nsight Compute's counters (a benchmark
helper for the open #7 target: down 4096x12288 at t >= 4 streams at 77-83 % through cuBLAS, the
GEMV reaches 93-96 % at t = 1-2).

Run under ncu on the GPU machine (Firecracker: ncu reads the counters; leave the clocks alone):

    ncu --clock-control none --target-processes all --profile-from-start off \\
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,\\
    dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sector_hit_rate.pct,\\
    sm__cycles_active.avg,sm__cycles_active.max,sm__cycles_active.min,gpc__cycles_elapsed.max,\\
    launch__grid_size,launch__block_size,launch__registers_per_thread,\\
    launch__shared_mem_per_block_dynamic,launch__occupancy_limit_registers \\
        --csv python3 perf/gemm_ncu.py > $OUT/gemm_ncu.csv

(perf/gpu_run.sh does this with GEMM_NCU=1.) What to read from it, per kernel:
  * dram__bytes_read.sum against the weight bytes: > 1.0x means re-reads (split-k workspace, x);
  * sm__cycles_active.max / .avg: the tail (one SM busy while the others are done);
  * gpu__time_duration against weight bytes / copy bandwidth, and the DRAM throughput while it ran.

The workload: each case runs CudaOps.linear (the tuned plan: our GEMV or cuBLASLt, named on
stdout) on the 9B shapes, once to tune and load (outside the profiled range: the tuner launches
many kernels), then REPS times between cudaProfilerStart / Stop (--profile-from-start off).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import cupy  # noqa: E402
import cupy.cuda.profiler  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

from metrale.backends.cuda import CudaOps  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
SHAPES = [(4096, 12288), (12288, 4096)]          # [out x in]: down, then one of gate / up


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ts", default="1,2,4,16,64")
    ap.add_argument("--reps", type=int, default=int(os.environ.get("REPS", "3")))
    args = ap.parse_args()
    ops = CudaOps()
    for n, k in SHAPES:
        w = (cupy.random.standard_normal((n, k), dtype=cupy.float32) * k ** -0.5).astype(BF16)
        for t in (int(v) for v in args.ts.split(",")):
            x = cupy.random.standard_normal((t, k), dtype=cupy.float32).astype(BF16)
            ops.linear(x, w)                         # tunes the shape (many kernels), loads
            cupy.cuda.runtime.deviceSynchronize()
            plan = getattr(getattr(ops._blas(), "last_plan", None), "name", "gemmex")
            print(f"case out={n} in={k} t={t} plan={plan} weight_bytes={n * k * 2}", flush=True)
            cupy.cuda.profiler.start()
            for _ in range(args.reps):
                ops.linear(x, w)
            cupy.cuda.runtime.deviceSynchronize()
            cupy.cuda.profiler.stop()


if __name__ == "__main__":
    main()
