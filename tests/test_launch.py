"""The packed-argument kernel launch path (metrale/backends/cuda/kernels.py).

CPU: the argument layout equals the C ABI's, with ctypes.Structure as the independent oracle
(natural alignment, padding between 4- and 8-byte members). GPU: the self-test passes, a
launch through the packed path equals CuPy's launch bit for bit, a Python scalar argument
falls back to CuPy, and the packed path captures into a CUDA graph."""
import ctypes
import struct

import numpy as np
import pytest

from metrale.backends.cuda.kernels import arg_layout

_CTYPES = {"Q": ctypes.c_uint64, "q": ctypes.c_int64, "I": ctypes.c_uint32, "i": ctypes.c_int32,
           "H": ctypes.c_uint16, "h": ctypes.c_int16, "B": ctypes.c_uint8, "b": ctypes.c_int8,
           "f": ctypes.c_float, "d": ctypes.c_double, "?": ctypes.c_bool}


@pytest.mark.parametrize("codes", ["Q", "i", "qiqfiQQfi", "iQ", "fifq", "BQhIq?d", "QQQiiif",
                                   "iiiiiiiiQ", "?Q", "hbQ"])
def test_layout_matches_the_c_abi(codes):
    fields = [(f"a{i}", _CTYPES[c]) for i, c in enumerate(codes)]
    S = type("S", (ctypes.Structure,), {"_fields_": fields})
    fmt, offsets, size = arg_layout(codes)
    assert offsets == [getattr(S, f"a{i}").offset for i in range(len(codes))]
    assert struct.calcsize(fmt) == size
    # the packed bytes are the struct's bytes (up to the struct's own tail padding)
    rng = np.random.default_rng(len(codes))
    vals = []
    for c in codes:
        if c in "fd":
            vals.append(float(np.float32(rng.standard_normal())))
        elif c == "?":
            vals.append(bool(rng.integers(2)))
        else:
            lo, hi = (0, 2 ** (8 * struct.calcsize(c)) - 1) if c.isupper() else \
                (-(2 ** (8 * struct.calcsize(c) - 1)), 2 ** (8 * struct.calcsize(c) - 1) - 1)
            vals.append(int(rng.integers(lo, hi, dtype=np.int64 if hi < 2 ** 63 else np.uint64)))
    s = S(*vals)
    packed = struct.pack(fmt, *vals)
    assert packed == bytes(s)[:size]


def test_numpy_scalars_pack_as_their_values():
    fmt, _, _ = arg_layout("ifQ")
    a = struct.pack(fmt, np.int32(-3), np.float32(0.5), np.uint64(2 ** 63 + 5))
    b = struct.pack(fmt, -3, 0.5, 2 ** 63 + 5)
    assert a == b


def test_fast_kernel_hands_the_driver_each_value_at_its_param_pointer():
    """FastKernel.__call__ up to the driver call, on the CPU: a stand-in driver reads every
    kernelParams pointer back with the argument's C type, as cuLaunchKernel copies them."""
    from types import SimpleNamespace

    from metrale.backends.cuda.kernels import FastKernel

    seen = {}

    class Driver:
        def launch(self, func, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
            types = [ctypes.c_uint64, ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_int32,
                     ctypes.c_uint64, ctypes.c_uint64, ctypes.c_float, ctypes.c_uint8]
            seen["values"] = [ctypes.cast(params[i], ctypes.POINTER(t)).contents.value
                              for i, t in enumerate(types)]
            seen["launch"] = (func, gx, gy, gz, bx, by, bz, smem, stream, extra)
            return 0

    raw = SimpleNamespace(kernel=SimpleNamespace(ptr=0xABC), name="k")
    k = FastKernel(raw, Driver())
    args = (None, np.int32(-7), np.int64(1 << 40), np.float32(2.5), np.int32(11), np.uint64(2 ** 63 + 3),
            np.uint64(0), np.float32(-0.125), np.uint8(200))
    k((3, 2), (128,), args, shared_mem=4096, stream=SimpleNamespace(ptr=77))
    assert seen["values"] == [0, -7, 1 << 40, 2.5, 11, 2 ** 63 + 3, 0, -0.125, 200]
    assert seen["launch"] == (0xABC, 3, 2, 1, 128, 1, 1, 4096, 77, None)
    # the layout is cached per argument types: a second call with new values reuses it
    k((1,), (1,), args[:1] + (np.int32(5),) + args[2:], stream=SimpleNamespace(ptr=0))
    assert seen["values"][1] == 5 and len(k._layouts) == 1


def test_driver_binds_every_entry_point_and_names_errors(monkeypatch):
    """_Driver on a stand-in libcuda (no GPU here): cuLaunchKernel, cuLaunchKernelEx and
    cuGetErrorName are all bound, a failed launch status gets its driver name, and a PDL launch
    hands cuLaunchKernelEx a config with the grid, block, stream and the one attribute."""
    from metrale.backends.cuda import kernels as launch

    class Fn:
        def __init__(self, impl):
            self.impl = impl

        def __call__(self, *a):
            return self.impl(*a)

    seen = {}

    def error_name(status, out):
        out._obj.value = b"CUDA_ERROR_INVALID_VALUE" if status == 1 else None
        return 0

    def launch_ex(cfg, func, params, extra):
        c = cfg._obj
        attr = c.attrs[0]
        seen["cfg"] = (c.gridDimX, c.gridDimY, c.gridDimZ, c.blockDimX, c.blockDimY, c.blockDimZ,
                       c.sharedMemBytes, c.hStream, c.numAttrs, attr.id, attr.value, func)
        return 0

    fake = type("Lib", (), {})()
    fake.cuLaunchKernel = Fn(lambda *a: 0)
    fake.cuLaunchKernelEx = Fn(launch_ex)
    fake.cuGetErrorName = Fn(error_name)
    monkeypatch.setattr(launch.ctypes, "CDLL", lambda name: fake)
    d = launch._Driver()
    assert d.name(1) == "CUDA_ERROR_INVALID_VALUE"
    assert d.launch_pdl(0xF00, 3, 2, 1, 128, 1, 1, 4096, 77, None) == 0
    assert seen["cfg"] == (3, 2, 1, 128, 1, 1, 4096, 77, 1,
                           launch.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, 1, 0xF00)


def test_pdl_attribute_only_between_our_kernels_inside_a_capture(monkeypatch):
    """Which launches carry the PDL attribute (on the CPU, a stand-in driver records them): none
    outside LaunchContext.capture(); inside, not the first kernel, not one after a foreign launch (cuBLAS,
    a CuPy memset), not a kernel without the in-kernel wait (pdl=False), every other one."""
    from types import SimpleNamespace

    from metrale.backends.cuda import kernels as launch

    calls = []

    class Driver:
        def launch(self, *a):
            calls.append("plain")
            return 0

        def launch_pdl(self, *a):
            calls.append("pdl")
            return 0

    ctx = launch.LaunchContext()
    ctx.pdl_ok = True
    prev = ctx.set_pdl(True)
    try:
        raw = SimpleNamespace(kernel=SimpleNamespace(ptr=1), name="k")
        ours = launch.FastKernel(raw, Driver(), pdl=True, ctx=ctx)
        selftest = launch.FastKernel(raw, Driver(), pdl=False, ctx=ctx)
        stream = SimpleNamespace(ptr=0)

        def go(k):
            k((1,), (32,), (np.int32(0),), stream=stream)

        go(ours)
        go(ours)                       # eager: plain
        with ctx.capture():
            go(ours)                   # first in the capture: plain
            go(ours)
            go(ours)
            ctx.foreign()    # a cuBLAS call
            go(ours)
            go(ours)
            go(selftest)               # no in-kernel wait: plain
            go(ours)                   # after a kernel that is not PDL-ready: plain
            go(ours)
        go(ours)
        assert calls == ["plain", "plain", "plain", "pdl", "pdl", "plain", "pdl", "plain", "plain", "pdl", "plain"]
        ctx.set_pdl(False)
        calls.clear()
        with ctx.capture():
            go(ours)
            go(ours)
        assert calls == ["plain", "plain"]
    finally:
        ctx.set_pdl(prev)


# -- on the GPU --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ops():
    from metrale.backends.cuda import CudaOps
    return CudaOps()


@pytest.mark.gpu
def test_self_test_passes_and_model_kernels_use_the_packed_path(ops):
    from metrale.backends.cuda.kernels import FastKernel
    k = ops.kernel("elementwise", "silu_mul_bf16")
    assert isinstance(k, FastKernel), "the packed launch path failed its self-test (see the log)"


@pytest.mark.gpu
def test_packed_launch_equals_cupy_launch(ops):
    import cupy

    rng = np.random.default_rng(0)
    x = ops.asarray(rng.standard_normal((37, 1001)))
    res = ops.asarray(rng.standard_normal((37, 1001)))
    w = ops.asarray(rng.standard_normal(1001))
    fast = ops.to_numpy(ops.add_rms_norm(x, res, w, 1e-6, 1.0)[0])
    k = ops.kernel("elementwise", "rms_norm_scalar_bf16")
    raw = k.raw
    # the same kernel through CuPy's launch
    out = ops.empty((37, 1001))
    res_out = ops.empty((37, 1001))
    raw((37,), (256,), (x, np.int64(1001), res, np.int64(1001), w, out, res_out, np.int32(1001),
                        np.float32(1e-6), np.float32(1.0)))
    cupy.cuda.get_current_stream().synchronize()
    assert ops.to_numpy(out).tobytes() == fast.tobytes()


@pytest.mark.gpu
def test_python_scalars_fall_back_to_cupy(ops):
    import cupy

    k = ops.kernel("launch_selftest", "launch_selftest")
    out = cupy.zeros(8, dtype=cupy.int64)
    marker = cupy.zeros(1, dtype=cupy.int64)
    k((1,), (1,), (out, np.int32(1), np.int64(2), np.float32(3.0), np.int32(4), marker,
                   np.uint64(5), np.float32(6.0), np.int32(7)))
    assert out.get().tolist()[:2] == [1, 2]
    # a Python int has no width of its own: no packed layout, CuPy launches such a call
    assert k._layout((out, 1)) is None
    assert k._layout((out, 1.0)) is None


@pytest.mark.gpu
def test_packed_launch_captures_in_a_graph(ops):
    import cupy

    out = cupy.zeros(8, dtype=cupy.int64)
    marker = cupy.zeros(1, dtype=cupy.int64)
    k = ops.kernel("launch_selftest", "launch_selftest")
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        k((1,), (1,), (out, np.int32(9), np.int64(8), np.float32(7.0), np.int32(6), marker,
                       np.uint64(5), np.float32(4.0), np.int32(3)))
        graph = stream.end_capture()
        out.fill(0)
        graph.launch(stream)
        stream.synchronize()
    assert out.get().tolist()[0:2] == [9, 8] and out.get().tolist()[7] == 3


# -- programmatic dependent launch ---------------------------------------------------------------

def _sm90(ops) -> bool:
    return int(ops.arch) >= 90


@pytest.mark.gpu
def test_pdl_launches_pass_their_self_test_on_sm90(ops):
    from metrale.backends.cuda import kernels as launch

    ops.kernel("elementwise", "silu_mul_bf16")       # the packed path decided (self-test run)
    if not _sm90(ops):
        assert not ops.launch.pdl_enabled
        return
    assert ops.launch.pdl_ok, "the PDL self-test launch failed (see the log)"
    assert ops.launch.pdl_enabled == (launch.levers.get("METRALE_PDL") == "1")
    assert ops.kernel("gemv", "gemv_t1_r2_bf16").pdl
    assert not ops.kernel("launch_selftest", "launch_selftest").pdl


def _layer_chain(ops, h, res, layers):
    """add+RMSNorm -> gate_up -> SiLU-mul -> down per layer: every kernel reads what the one
    before it wrote, and buffers freed by one layer are reused by the next (write-after-read)."""
    for wn, wgu, wd in layers:
        x, res = ops.add_rms_norm(h, res, wn, 1e-6, 1.0)
        h = ops.linear(ops.silu_mul(ops.linear(x, wgu)), wd)
    return h, res


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 3, 16])
def test_pdl_chain_equals_plain_stream_order_eager_and_graphed(ops, t):
    """A dependent chain (GEMVs at t <= 2, which prefetch weights before waiting; cuBLAS at
    t = 16; small kernels between) captured with programmatic edges replays the same bits as
    the chain run eagerly in plain stream order. The input changes from replay to replay (a
    copy into the graph's input buffer just before it), so a kernel that read its input before
    the kernel (or copy) before it had written it would see the previous replay's values and
    differ. Eager launches are plain in both passes (PDL applies inside LaunchContext.capture only)."""
    import cupy

    if not _sm90(ops):
        pytest.skip("PDL needs sm_90")
    H, I, L, N = 2048, 5632, 6, 4
    rng = np.random.default_rng(t)
    layers = [(ops.asarray(1 + 0.1 * rng.standard_normal(H)),
               ops.asarray(rng.standard_normal((2 * I, H)) / np.sqrt(H)),
               ops.asarray(rng.standard_normal((H, I)) / np.sqrt(I))) for _ in range(L)]
    inputs = [(ops.asarray(rng.standard_normal((t, H))), ops.asarray(rng.standard_normal((t, H))))
              for _ in range(N)]
    stream = cupy.cuda.Stream(non_blocking=True)
    pool = cupy.cuda.MemoryPool()
    got = {}
    prev = ops.launch.pdl_enabled
    try:
        for pdl in (False, True):
            ops.launch.set_pdl(pdl)
            assert ops.launch.pdl_enabled == pdl
            with cupy.cuda.using_allocator(pool.malloc), stream:
                eager = []
                for h, r in inputs:          # eager (the first pass tunes the GEMMs)
                    out, res = _layer_chain(ops, h.copy(), r.copy(), layers)
                    eager.append((ops.to_numpy(out), ops.to_numpy(res)))
                h_in, r_in = inputs[0][0].copy(), inputs[0][1].copy()
                stream.synchronize()
                stream.begin_capture()
                with ops.launch.capture():
                    g_out, g_res = _layer_chain(ops, h_in, r_in, layers)
                graph = stream.end_capture()
                replays = []
                for rep in range(3 * N):
                    h_in[...] = inputs[rep % N][0]
                    r_in[...] = inputs[rep % N][1]
                    graph.launch(stream)
                    replays.append((ops.to_numpy(g_out), ops.to_numpy(g_res)))
                stream.synchronize()
            got[pdl] = (eager, replays)
    finally:
        ops.launch.set_pdl(prev)
    ref = got[False][0]
    assert all(np.isfinite(a.astype(np.float32)).all() for pair in ref for a in pair)
    assert len({ref[i][0].tobytes() for i in range(N)}) == N        # the inputs do matter

    def same(a, b):
        return a[0].tobytes() == b[0].tobytes() and a[1].tobytes() == b[1].tobytes()

    assert all(same(got[False][1][rep], ref[rep % N]) for rep in range(3 * N))
    assert all(same(got[True][0][i], ref[i]) for i in range(N))
    bad = [rep for rep in range(3 * N) if not same(got[True][1][rep], ref[rep % N])]
    assert not bad, f"graph replays {bad} with PDL edges differ from plain stream order"
