"""`--profile`: time every op of the ops interface (CUDA graphs are off in this mode).

`ProfiledOps(ops)` stands in for the backend: each Ops method call is timed and accumulated per
op name; everything else (arrays, kernel loaders, attributes) passes through untouched. On CUDA
a call is bracketed by events and synchronised (the seed's "per-kernel sync + timing": slower,
but it attributes device time to ops); on the CPU it is wall time.

    ops = ProfiledOps(make_ops(config))
    ...
    print(ops.report())     # op, calls, total ms, mean us, share
"""
from __future__ import annotations

import time
from collections import defaultdict

from metrale.backends.base import Ops

OP_NAMES = tuple(name for name in vars(Ops) if not name.startswith("_")
                 and callable(vars(Ops)[name]) and name not in ("asarray", "to_numpy", "empty",
                                                                "zeros", "upload_batch",
                                                                "device_sampler", "capture_graphs",
                                                                "close"))


class ProfiledOps:
    def __init__(self, ops):
        self._ops = ops
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._cuda = getattr(ops, "name", "") == "cuda"

    def __getattr__(self, name):
        attr = getattr(self._ops, name)
        if name not in OP_NAMES:
            return attr
        return self._cuda_timed(name, attr) if self._cuda else self._wall_timed(name, attr)

    def _wall_timed(self, name, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t0
                self.calls[name] += 1
        return timed

    def _cuda_timed(self, name, fn):
        cp = self._ops.cp

        def timed(*args, **kwargs):
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            try:
                return fn(*args, **kwargs)
            finally:
                end.record()
                end.synchronize()
                self.seconds[name] += cp.cuda.get_elapsed_time(start, end) / 1000
                self.calls[name] += 1
        return timed

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def report(self) -> str:
        """One line per op, most time first."""
        total = sum(self.seconds.values()) or 1.0
        rows = sorted(self.seconds.items(), key=lambda kv: -kv[1])
        lines = [f"{'op':<18}{'calls':>9}{'total ms':>12}{'mean us':>10}{'share':>8}"]
        for name, sec in rows:
            n = self.calls[name]
            lines.append(f"{name:<18}{n:>9}{sec * 1e3:>12.2f}{sec / n * 1e6:>10.1f}"
                         f"{sec / total:>8.1%}")
        return "\n".join(lines)
