"""Where a decode step's time goes, on the GPU: per-kernel device time inside the captured decode
graphs, the GPU's busy time per step against the step's wall time (the rest is host work and
launch gaps), and the roofline. A profiling tool (CUPTI through torch.profiler, which records
every kernel of the process, graph replays included); torch is used here only, never in the
serving path.

    python perf/decode_profile.py --shape qwen3_5_9b --batch 1,64 --out DIR

First one eager prefill step of ISL tokens at B = 1: wall vs GPU busy (the host time TTFT pays).
Per batch size: B requests of ISL prompt tokens are prefilled, then STEPS steady decode steps
are timed (wall) and PROF steps profiled. Reported per step: wall ms, GPU busy ms (sum of kernel
durations), GPU span ms (first kernel start to last kernel end), and the kernels by total time
(calls/step, us/step, share). JSON to --out.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from perf.ladder import (SHAPES, decode_step_bytes, git_commit, measure_copy_bw,  # noqa: E402
                         synthetic_checkpoint)


def _short(name: str, n: int = 70) -> str:
    return name if len(name) <= n else name[:n - 3] + "..."


def steady_decode(core, batch: int, isl: int, vocab: int, rng):
    from metrale.request import Request
    from metrale.sampling import SamplingParams

    params = SamplingParams(max_tokens=100_000, temperature=0, ignore_eos=True)
    tag = time.perf_counter()
    rids = [f"p{batch}-{i}-{tag}" for i in range(batch)]
    for rid in rids:
        ids = [int(t) for t in rng.integers(100, vocab - 100, isl)]
        core.add_request(Request(rid, ids, params))
    for _ in range(10_000):
        core.step()
        st = core.last_step
        if st and st.num_seqs == batch and st.num_tokens == batch:
            break
    for _ in range(5):   # graphs captured, pools warm
        core.step()
    return rids


def profile_prefill(core, isl: int, vocab: int, rng, reps: int = 5) -> dict:
    """One eager prefill step of `isl` tokens (B = 1): its wall time against the GPU's busy
    time in it. The difference is host time, mostly kernel launches (prefill steps are not
    graphed), which is what TTFT pays."""
    import cupy as cp
    import torch
    from torch.profiler import ProfilerActivity, profile

    from metrale.request import Request
    from metrale.sampling import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    walls, busy = [], []
    for rep in range(reps + 1):           # the first one warms up
        ids = [int(t) for t in rng.integers(100, vocab - 100, isl)]
        core.add_request(Request(f"prefill-{rep}-{time.perf_counter()}", ids, params))
        cp.cuda.runtime.deviceSynchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            core.step()
            walls.append(time.perf_counter() - t0)
            cp.cuda.runtime.deviceSynchronize()
        while core.has_unfinished():
            core.step()
        busy.append(sum(e.time_range.elapsed_us() for e in prof.events()
                        if e.device_type == torch.autograd.DeviceType.CUDA) / 1e6)
    walls, busy = walls[1:], busy[1:]
    return dict(isl=isl, wall_ms_p50=1e3 * statistics.median(walls),
                gpu_busy_ms_p50=1e3 * statistics.median(busy))


def profile_batch(core, batch: int, args, vocab: int, rng) -> dict:
    import cupy as cp
    import torch
    from torch.profiler import ProfilerActivity, profile

    rids = steady_decode(core, batch, args.isl, vocab, rng)
    walls = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        core.step()
        walls.append(time.perf_counter() - t0)
    cp.cuda.runtime.deviceSynchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.prof_steps):
            core.step()
        cp.cuda.runtime.deviceSynchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and e.name and not e.name.startswith("Memcpy") and not e.name.startswith("Memset")]
    copies = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
              and e.name and (e.name.startswith("Memcpy") or e.name.startswith("Memset"))]
    per = defaultdict(lambda: [0, 0.0])
    for e in kernels:
        per[e.name][0] += 1
        per[e.name][1] += e.time_range.elapsed_us()
    busy_us = sum(v[1] for v in per.values()) / args.prof_steps
    span_us = 0.0
    if kernels:
        starts = [e.time_range.start for e in kernels]
        ends = [e.time_range.end for e in kernels]
        span_us = (max(ends) - min(starts)) / args.prof_steps
    rows = sorted(((n, c / args.prof_steps, t / args.prof_steps) for n, (c, t) in per.items()),
                  key=lambda r: -r[2])
    for rid in rids:   # free the sequences before the next batch size
        core.abort_request(rid)
    return dict(batch=batch, wall_ms_p50=1e3 * statistics.median(walls),
                wall_ms_mean=1e3 * statistics.mean(walls), gpu_busy_ms=busy_us / 1e3,
                gpu_span_ms=span_us / 1e3, kernels_per_step=sum(r[1] for r in rows),
                copies_per_step=len(copies) / args.prof_steps,
                kernels=[dict(name=n, calls=c, us=t, share=t / busy_us if busy_us else 0)
                         for n, c, t in rows])


def main() -> int:
    import cupy as cp

    from metrale.config import EngineConfig
    from metrale.engine_core import EngineCore

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3_5_9b", choices=sorted(SHAPES))
    ap.add_argument("--batch", default="1,64")
    ap.add_argument("--isl", type=int, default=256)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--prof-steps", type=int, default=20)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default="perf/results")
    args = ap.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    bw = measure_copy_bw()
    ckpt, shapes = synthetic_checkpoint(args.shape)
    cfg = ckpt.config
    core = EngineCore(ckpt, EngineConfig(device="cuda", max_seq_len=args.isl + 4096,
                                         max_batch_size=max(batches), max_num_seqs=max(batches),
                                         seed=0))
    import numpy as np
    rng = np.random.default_rng(0)
    prefill = profile_prefill(core, args.isl, cfg["vocab_size"], rng)
    print(f"{args.shape} prefill of {args.isl} tokens: wall {prefill['wall_ms_p50']:.2f} ms, GPU busy "
          f"{prefill['gpu_busy_ms_p50']:.2f} ms (the rest is host time: launches)")
    results = []
    for b in batches:
        r = profile_batch(core, b, args, cfg["vocab_size"], rng)
        r["roofline_ms"] = 1e3 * decode_step_bytes(shapes, cfg, b, args.isl) / bw
        results.append(r)
        print(f"\n{args.shape} B={b}: wall {r['wall_ms_p50']:.3f} ms  GPU busy {r['gpu_busy_ms']:.3f} ms"
              f"  span {r['gpu_span_ms']:.3f} ms  roofline {r['roofline_ms']:.3f} ms  "
              f"{r['kernels_per_step']:.0f} kernels + {r['copies_per_step']:.0f} copies/step")
        print(f"  {'kernel':70s} {'calls':>6s} {'us/step':>9s} {'us/call':>8s} {'share':>6s}")
        for k in r["kernels"][:args.top]:
            print(f"  {_short(k['name']):70s} {k['calls']:6.0f} {k['us']:9.1f} "
                  f"{k['us'] / max(k['calls'], 1e-9):8.2f} {100 * k['share']:5.1f}%")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d_%H%M%S")
    path = out / f"decode_profile_{args.shape}_{stamp}.json"
    path.write_text(json.dumps(dict(
        commit=git_commit(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
        device=cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), shape=args.shape,
        model_config=SHAPES[args.shape], isl=args.isl, copy_bandwidth_Bps=bw, prefill=prefill,
        results=results),
        indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
