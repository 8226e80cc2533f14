"""What fp32 logits cost: the lm head at decode shapes with a bf16 store (ops.linear) and with
an fp32 store (ops.lm_head), tuned plans, timed inside CUDA graphs.

    python perf/lm_head_cost.py --out DIR

Shapes: the lm heads of SmolLM2-135M (49152 x 576), Qwen3.5-9B (248320 x 4096) and Qwen3.5-27B
(248320 x 5120) at t = 1 ... 128 rows. Bytes a call must move: V*H*2 (the weight, read once) +
t*H*2 (x) + t*V*2 or t*V*4 (the logits); the weight alternates between two copies so that it
comes from DRAM, not L2. Achieved bandwidth is against the 4.27 TB/s copy ceiling measured on the
H200. Writes lm_head_cost_<commit>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cupy  # noqa: E402

from bench_ops import BF16, rand_bf16, time_graph  # noqa: E402
from greedy_batch import device_name  # noqa: E402
from metrale.backends.cuda import CudaOps  # noqa: E402

COPY_BW = 4.27e12
SHAPES = {"smollm2_135m": (49152, 576), "qwen3_5_9b": (248320, 4096), "qwen3_5_27b": (248320, 5120)}
TS = (1, 2, 4, 8, 16, 32, 64, 128)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="perf/results")
    args = ap.parse_args()
    ops = CudaOps()
    rows = []
    for shape, (v, h) in SHAPES.items():
        ws = [rand_bf16((v, h), h ** -0.5), rand_bf16((v, h), h ** -0.5)]
        for t in TS:
            x = rand_bf16((t, h))
            fig = {"shape": shape, "vocab": v, "hidden": h, "t": t}
            for name, op, out_bytes in (("bf16", ops.linear, 2), ("fp32", ops.lm_head, 4)):
                turn = [0]

                def call():
                    turn[0] ^= 1
                    op(x, ws[turn[0]])

                call(), call()                       # tune both copies' keys outside capture
                s = time_graph(call, 8, 20)
                nbytes = v * h * 2 + t * h * 2 + t * v * out_bytes
                fig[f"{name}_us"] = round(s * 1e6, 2)
                fig[f"{name}_pct_copy_bw"] = round(100 * nbytes / s / COPY_BW, 1)
            fig["fp32_over_bf16"] = round(fig["fp32_us"] / fig["bf16_us"], 3)
            rows.append(fig)
            print(json.dumps(fig), flush=True)
        del ws
        cupy.get_default_memory_pool().free_all_blocks()
    commit = os.environ.get("GIT_COMMIT", "unknown")
    record = {"benchmark": "lm_head_cost", "commit": commit,
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "device": device_name(),
              "dtype": "bf16 weights and activations", "copy_bw_ceiling": COPY_BW,
              "timing": "CUDA graph of 8 calls alternating two weight copies, mean of 20 replays",
              "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"lm_head_cost_{commit[:7]}.json").write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
