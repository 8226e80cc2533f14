"""Where an eager (prefill / mixed) step's host time goes and why it varies in a server: repeated
steps of one shape (spread, the time spent in Python's garbage collector in each, and a cProfile
of them by own time), and the first step of each new token count (CuPy memory-pool growth:
cudaMalloc), cProfiled. A diagnostic, not a test.

    python perf/step_jitter.py --shape smollm2_135m --out DIR

Engine-only, synthetic weights (perf/ladder.py's shapes). JSON to --out.
"""
from __future__ import annotations

import argparse
import cProfile
import datetime
import gc
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from perf.ladder import SHAPES, git_commit, synthetic_checkpoint  # noqa: E402


class GcClock:
    """Seconds spent in the garbage collector, and collections per generation, since reset()."""

    def __init__(self):
        self.seconds, self.counts, self._t0 = 0.0, [0, 0, 0], None
        gc.callbacks.append(self._cb)

    def _cb(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.seconds += time.perf_counter() - self._t0
            self.counts[info["generation"]] += 1
            self._t0 = None

    def reset(self):
        self.seconds, self.counts = 0.0, [0, 0, 0]


def print_profile(prof: cProfile.Profile, top: int, title: str) -> None:
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    print(f"{title}, Python functions by own time:\n{buf.getvalue()}")


def main() -> int:
    import cupy as cp
    import numpy as np

    from metrale.config import EngineConfig
    from metrale.engine_core import EngineCore
    from metrale.request import Request
    from metrale.sampling import SamplingParams

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="smollm2_135m", choices=sorted(SHAPES))
    ap.add_argument("--isl", type=int, default=128)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default="perf/results")
    ap.add_argument("--prefill-graphs", default="on", choices=("on", "off"),
                    help="the engine's --prefill-graphs: the steps replay captured graphs")
    args = ap.parse_args()
    ckpt, _ = synthetic_checkpoint(args.shape)
    vocab = ckpt.config["vocab_size"]
    core = EngineCore(ckpt, EngineConfig(device="cuda", max_seq_len=args.isl + 512, max_batch_size=32,
                                         max_num_seqs=32, seed=0, prefill_graphs=args.prefill_graphs))
    pool = cp.get_default_memory_pool()
    rng = np.random.default_rng(0)
    clock = GcClock()
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    n = [0]

    def prefill_step(nseq: int, prof: cProfile.Profile | None = None) -> dict:
        for _ in range(nseq):
            n[0] += 1
            core.add_request(Request(f"j{n[0]}", [int(t) for t in rng.integers(100, vocab - 100, args.isl)], one))
        cp.cuda.runtime.deviceSynchronize()
        before = pool.total_bytes()
        clock.reset()
        if prof:
            prof.enable()
        t0 = time.perf_counter()
        core.step()
        wall = time.perf_counter() - t0
        if prof:
            prof.disable()
        rec = dict(nseq=nseq, tokens=core.last_step.num_tokens, wall_ms=1e3 * wall, gc_ms=1e3 * clock.seconds,
                   gc_counts=list(clock.counts), pool_growth_mib=(pool.total_bytes() - before) / 2**20)
        while core.has_unfinished():
            core.step()
        return rec

    prefill_step(1)   # warm-up (first-use costs)
    same = [prefill_step(1) for _ in range(args.reps)]
    walls = [r["wall_ms"] for r in same]
    print(f"{args.shape} {args.reps} x prefill 1 x {args.isl}: wall ms p50 {statistics.median(walls):.2f} "
          f"min {min(walls):.2f} max {max(walls):.2f}; gc ms total {sum(r['gc_ms'] for r in same):.2f}")
    for r in same:
        print(f"   {r['wall_ms']:7.2f} ms  gc {r['gc_ms']:6.2f} ms {r['gc_counts']}  pool +{r['pool_growth_mib']:.1f} MiB")
    prof = cProfile.Profile()
    for _ in range(5):
        prefill_step(1, prof)
    print_profile(prof, 30, f"5 x prefill 1 x {args.isl}, steady state")
    firsts = []
    for nseq in (3, 5, 7, 3, 5, 7):
        prof = cProfile.Profile()
        r = prefill_step(nseq, prof if len(firsts) < 3 else None)
        firsts.append(r)
        print(f"prefill {nseq} x {args.isl} ({'first' if len(firsts) <= 3 else 'again'}): wall {r['wall_ms']:.2f} ms, "
              f"gc {r['gc_ms']:.2f} ms, pool +{r['pool_growth_mib']:.1f} MiB")
        if len(firsts) <= 3:
            print_profile(prof, 12, f"first prefill {nseq} x {args.isl}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"step_jitter_{args.shape}_{datetime.datetime.now().strftime('%Y%m%d_%H%M%S')}.json"
    path.write_text(json.dumps(dict(
        commit=git_commit(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
        device=cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), shape=args.shape, isl=args.isl,
        prefill_graphs=args.prefill_graphs,
        repeated=same, new_shapes=firsts), indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
