"""Host time of one kernel launch up to the driver call, on the CPU (a benchmark, no GPU).

A stand-in driver (returns 0) takes the place of cuLaunchKernel, as tests/test_launch.py does, and
a stand-in device array class (with .data.ptr) that of cupy.ndarray. Times the launch site of
rms_norm (10 arguments: 5 pointers, 2 long long, 1 int, 2 float) and of the decode attention
kernel (21 arguments), as a declared kernel called by name (metrale/backends/cuda/kernels.py).
With --old PATH (a copy of the positional launcher, metrale/backends/launch.py before the
declarations), the same launch sites as they were: a tuple of np.uint64(ptr) / np.int64 /
np.int32 / np.float32 built at the call site and packed by FastKernel's per-type-tuple layout.

    python perf/launch_host_cost.py [--old /path/to/old_launch.py]
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import timeit
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from metrale.backends.cuda import kernels as K  # noqa: E402


class FakeArray:
    __slots__ = ("data",)

    def __init__(self, ptr):
        self.data = SimpleNamespace(ptr=ptr)


class Driver:
    def launch(self, *a):
        return 0

    def launch_pdl(self, *a):
        return 0


RMS = "const T* x, long long xs, const T* res, long long rs, const T* w, T* out, T* res_out, int H, float eps, float offset"
ATTN = ("const bf16* q, long long qs_t, long long qs_h, const bf16* k_cache, const bf16* v_cache, const int* block_tables, "
        "int bt_stride, const int* seq_lens, const int* qsl, bf16* out, float* part_o, float* part_m, float* part_l, "
        "int Hk, int G, int nchunks, int block_size, int part_tokens, int nparts, float scale_log2")


def us_per_call(fn, n=200_000) -> float:
    best = min(timeit.repeat(fn, number=n, repeat=5))
    return best / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", help="the old positional launcher (metrale/backends/launch.py of an older commit)")
    args = ap.parse_args()
    K._device_array_type.cache_clear()
    K._typed_class.cache_clear()
    orig = K._device_array_type
    K._device_array_type = lambda: FakeArray
    stream = SimpleNamespace(ptr=7)
    raw = SimpleNamespace(kernel=SimpleNamespace(ptr=1), name="k")
    x, r, w, o, ro = (FakeArray(0x1000 * i) for i in range(1, 6))
    rms = K.typed_kernel(raw, K.KernelDecl("e", "rms", K.parse_params(RMS)), K.LaunchContext(), Driver())
    attn = K.typed_kernel(raw, K.KernelDecl("a", "attn", K.parse_params(ATTN)), K.LaunchContext(), Driver())
    K._device_array_type = orig
    res = {
        "rms_norm, declared": us_per_call(lambda: rms(
            (64,), (256,), x=x, xs=1024, res=r, rs=1024, w=w, out=o, res_out=ro, H=1024, eps=1e-6, offset=1.0,
            stream=stream)),
        "decode attention, declared": us_per_call(lambda: attn(
            (8, 4, 2), (128,), q=x, qs_t=1024, qs_h=128, k_cache=r, v_cache=w, block_tables=o, bt_stride=80,
            seq_lens=ro, qsl=x, out=o, part_o=r, part_m=w, part_l=ro, Hk=4, G=6, nchunks=1, block_size=16,
            part_tokens=512, nparts=2, scale_log2=0.127, stream=stream)),
    }
    if args.old:
        spec = importlib.util.spec_from_file_location("old_launch", args.old)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
        old_k = old.FastKernel(raw, Driver())
        old_k._ndarray = FakeArray
        null = np.uint64(0)

        def ptr(a):
            return null if a is None else np.uint64(a.data.ptr)

        res["rms_norm, positional (old)"] = us_per_call(lambda: old_k(
            (64,), (256,), (ptr(x), np.int64(1024), ptr(r), np.int64(1024), ptr(w), ptr(o), ptr(ro), np.int32(1024),
                            np.float32(1e-6), np.float32(1.0)), stream=stream))
        res["decode attention, positional (old)"] = us_per_call(lambda: old_k(
            (8, 4, 2), (128,), (ptr(x), np.int64(1024), np.int64(128), ptr(r), ptr(w), ptr(o), np.int32(80), ptr(ro),
                                ptr(x), ptr(o), ptr(r), ptr(w), ptr(ro), np.int32(4), np.int32(6), np.int32(1),
                                np.int32(16), np.int32(512), np.int32(2), np.float32(0.127)), stream=stream))
    for name, us in res.items():
        print(f"{name:38s} {us:6.2f} us per launch")


if __name__ == "__main__":
    main()
