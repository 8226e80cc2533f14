"""Kernel launches through the driver's cuLaunchKernel (ctypes), for eager steps.

Why: a CuPy RawKernel launch costs ~21 us of host time (DESIGN.md §7), most of it argument
marshalling. Decode steps replay CUDA graphs, but prefill and mixed prefill + decode steps run
eagerly: ~12 kernels per layer, so a SmolLM2 prefill spends ~8 ms of its ~10 ms TTFT launching,
and every arriving request costs the engine one such step. Here a launch packs its arguments
with one `struct.pack_into` into a buffer whose layout is cached per tuple of argument types, and
calls cuLaunchKernel with `kernelParams` pointing into it (the driver copies each parameter by
the kernel's own parameter sizes, so only the values' byte images matter).

Arguments a kernel may take: cupy arrays (their device pointer), None (a null pointer), and
numpy scalars of fixed width (np.uint64/int64/uint32/int32/float32/float64, ...). Python ints
and floats have no width of their own (CuPy guesses one): a call passing one is launched by
CuPy, unchanged. So is every call when the first launch of the process, a self-test kernel
(kernels_cuda/launch_selftest.cu) with arguments of every width in padding-forcing order, does
not read back what it was given, or when METRALE_FAST_LAUNCH=0.

Programmatic dependent launch (PDL, sm_90+; on unless METRALE_PDL=0): every kernel of
kernels_cuda/ except the self-test lets its successor launch at entry and waits for its
predecessor in-kernel (common.cuh: `pdl_enter`, or gemv.cu's first weight round then `pdl_wait`),
and reads what other kernels write with coherent loads only. Inside `pdl_capture()` (the decode
and step graph captures, metrale/cuda_graphs.py) such a kernel is launched through
cuLaunchKernelEx with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION when the launch just
before it was one of ours too (never the first kernel of a capture, nor one after a cuBLAS call
or a CuPy memset: `foreign_launch()`); capture turns that into a programmatic edge. Measured on
the H200 (kernels_cuda/README.md): SmolLM2 decodes at C=1 in 0.63 ms a step instead of 0.82-0.92,
the 9B in 4.42-4.66 ms instead of 4.71. Eager launches are always plain (so `--profile`, which captures
no graphs, runs without it). Off before sm_90 or when the self-test's PDL launch fails.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import struct

import numpy as np

from metrale import levers

log = logging.getLogger("metrale.launch")

_FORMATS = {
    np.dtype(np.uint64): "Q", np.dtype(np.int64): "q", np.dtype(np.uint32): "I",
    np.dtype(np.int32): "i", np.dtype(np.uint16): "H", np.dtype(np.int16): "h",
    np.dtype(np.uint8): "B", np.dtype(np.int8): "b", np.dtype(np.float32): "f",
    np.dtype(np.float64): "d", np.dtype(np.bool_): "?",
}
_POINTER = "Q"


def arg_layout(codes: str) -> tuple[str, list[int], int]:
    """(struct format, byte offset of each argument, total size) for arguments of the struct
    codes `codes`, each at its natural alignment (what the CUDA parameter ABI does)."""
    fmt, offsets, off = "<", [], 0
    for c in codes:
        size = struct.calcsize(c)
        pad = -off % size
        if pad:
            fmt += f"{pad}x"
            off += pad
        offsets.append(off)
        fmt += c
        off += size
    return fmt, offsets, max(off, 1)


class _Layout:
    """A packed-argument buffer and its kernelParams array, for one tuple of argument types."""
    __slots__ = ("buf", "fmt", "params", "ptr_args")

    def __init__(self, codes: str, ptr_args: tuple[int, ...]):
        self.fmt, offsets, size = arg_layout(codes)
        self.buf = ctypes.create_string_buffer(size)
        base = ctypes.addressof(self.buf)
        self.params = (ctypes.c_void_p * max(1, len(offsets)))(*[base + o for o in offsets])
        self.ptr_args = ptr_args      # positions holding cupy arrays / None (-> device pointer)


CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6   # cuda.h, CUlaunchAttributeID


class LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: the id, padding to 8 bytes, a 64-byte value union (cuda.h)."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("value_pad", ctypes.c_char * 60)]


class LaunchConfig(ctypes.Structure):
    """CUlaunchConfig (cuda.h)."""
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


class _Driver:
    """libcuda's cuLaunchKernel and cuLaunchKernelEx (the library CuPy already loaded)."""

    def __init__(self):
        lib = ctypes.CDLL("libcuda.so.1")
        u, vp = ctypes.c_uint, ctypes.c_void_p
        self.launch = lib.cuLaunchKernel
        self.launch.argtypes = [vp, u, u, u, u, u, u, u, vp, ctypes.POINTER(vp), ctypes.POINTER(vp)]
        self.launch.restype = ctypes.c_int
        self.launch_ex = getattr(lib, "cuLaunchKernelEx", None)     # CUDA >= 11.8 drivers
        if self.launch_ex is not None:
            self.launch_ex.argtypes = [ctypes.POINTER(LaunchConfig), vp, ctypes.POINTER(vp), ctypes.POINTER(vp)]
            self.launch_ex.restype = ctypes.c_int
        # one config for every PDL launch (launches are issued from one thread, the engine's)
        self.pdl_attr = LaunchAttribute(id=CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
        self.pdl_cfg = LaunchConfig(attrs=ctypes.pointer(self.pdl_attr), numAttrs=1)
        self.pdl_cfg_ref = ctypes.byref(self.pdl_cfg)
        self.error_name = lib.cuGetErrorName
        self.error_name.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        self.error_name.restype = ctypes.c_int

    def launch_pdl(self, func, gx, gy, gz, bx, by, bz, smem, stream, params) -> int:
        c = self.pdl_cfg
        c.gridDimX, c.gridDimY, c.gridDimZ = gx, gy, gz
        c.blockDimX, c.blockDimY, c.blockDimZ = bx, by, bz
        c.sharedMemBytes = smem
        c.hStream = stream
        return self.launch_ex(self.pdl_cfg_ref, func, params, None)

    def name(self, status: int) -> str:
        s = ctypes.c_char_p()
        return s.value.decode() if self.error_name(status, ctypes.byref(s)) == 0 and s.value else str(status)


class _NoDeviceArray:
    """Stands for cupy.ndarray where CuPy is not installed: no argument is ever one."""


@functools.cache
def _device_array_type() -> type:
    """cupy.ndarray, imported on first use (the launch path's packing is testable without CuPy)."""
    try:
        import cupy
    except ImportError:
        return _NoDeviceArray
    return cupy.ndarray


class FastKernel:
    """A RawKernel launched through cuLaunchKernel; the CuPy launch where that does not apply.
    Same call as the RawKernel: k(grid, block, args, shared_mem=0, stream=None)."""

    def __init__(self, raw, driver: _Driver, pdl: bool = False):
        self.raw = raw
        self._driver = driver
        self.pdl = pdl                  # the kernel keeps the PDL rule (common.cuh)
        self._func = None
        self._layouts: dict = {}
        self._ndarray = _device_array_type()
        self._current_stream = None     # cupy.cuda.get_current_stream, bound on first use

    def __getattr__(self, name):          # name, attributes, num_regs, ...: the RawKernel's
        return getattr(self.raw, name)

    @property
    def max_dynamic_shared_size_bytes(self):
        return self.raw.max_dynamic_shared_size_bytes

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, value):
        self.raw.max_dynamic_shared_size_bytes = value   # an attribute of the one CUfunction

    def _layout(self, args) -> _Layout | None:
        key = tuple(type(a) for a in args)
        lay = self._layouts.get(key)
        if lay is None and key not in self._layouts:
            codes, ptrs = [], []
            for i, a in enumerate(args):
                if a is None or isinstance(a, self._ndarray):
                    codes.append(_POINTER)
                    ptrs.append(i)
                elif isinstance(a, np.generic) and a.dtype in _FORMATS:
                    codes.append(_FORMATS[a.dtype])
                else:                      # a Python scalar: CuPy decides its width
                    self._layouts[key] = None
                    return None
            lay = self._layouts[key] = _Layout("".join(codes), tuple(ptrs))
        return lay

    def __call__(self, grid, block, args, shared_mem=0, stream=None):
        lay = self._layout(args)
        if lay is None:
            _prev_own[0] = False
            return self.raw(grid, block, args, shared_mem=shared_mem, stream=stream)
        if self._func is None:
            self._func = self.raw.kernel.ptr        # the CUfunction (loads the module once)
        if lay.ptr_args:
            args = list(args)
            for i in lay.ptr_args:
                a = args[i]
                args[i] = 0 if a is None else a.data.ptr
        struct.pack_into(lay.fmt, lay.buf, 0, *args)
        if stream is None:
            if self._current_stream is None:
                import cupy

                self._current_stream = cupy.cuda.get_current_stream
            stream = self._current_stream()
        g = tuple(grid) + (1, 1)
        b = tuple(block) + (1, 1)
        pdl = self.pdl and _capture[0] and _prev_own[0]
        _prev_own[0] = self.pdl
        if pdl:
            status = self._driver.launch_pdl(self._func, g[0], g[1], g[2], b[0], b[1], b[2], shared_mem,
                                             stream.ptr, lay.params)
        else:
            status = self._driver.launch(self._func, g[0], g[1], g[2], b[0], b[1], b[2], shared_mem,
                                         stream.ptr, lay.params, None)
        if status:
            raise RuntimeError(f"cuLaunchKernel({self.raw.name}) failed: {self._driver.name(status)}")


_pdl = [False]       # PDL on (METRALE_PDL, the self-test, set_pdl): used inside pdl_capture()
_capture = [False]   # inside pdl_capture() with PDL on
_prev_own = [False]  # the last launch issued (by this process) was one of our PDL-ready kernels


def foreign_launch() -> None:
    """Called before a stream operation that is not one of our kernels (a cuBLAS call, a CuPy
    memset or copy): the kernel after it is launched plainly."""
    _prev_own[0] = False


@contextlib.contextmanager
def pdl_capture():
    """Around a graph capture: our kernels in it get programmatic edges to the kernel before
    them where that one is ours too (the first one never: on replay it follows whatever the
    stream did before the graph)."""
    prev = _capture[0]
    _capture[0], _prev_own[0] = _pdl[0], False
    try:
        yield
    finally:
        _capture[0], _prev_own[0] = prev, False


def pdl_enabled() -> bool:
    return _pdl[0]


def set_pdl(on: bool) -> bool:
    """Ask for PDL launches on or off (on takes effect only where the self-test's PDL launch
    passed, now or when it runs later); returns the previous effective state. Applies to
    launches issued after it, and so to graphs captured after it."""
    prev = _pdl[0]
    _state["pdl_want"] = bool(on)
    _pdl[0] = bool(on) and bool(_state.get("pdl_ok"))
    return prev


_state: dict = {}


def fast_launcher(kernel_cache):
    """A function raw kernel -> FastKernel, or -> raw itself when the packed path is off or
    failed its one-time self-test on `kernel_cache`'s device; None while the current stream is
    capturing a graph (the self-test synchronises: decide on a later, eager call)."""
    if "driver" not in _state:
        import cupy

        try:
            capturing = cupy.cuda.runtime.streamIsCapturing(cupy.cuda.get_current_stream().ptr)
        except Exception:  # noqa: BLE001 - the query is illegal while another stream captures
            capturing = True
        if capturing:
            return None
        _state["driver"] = _self_test(kernel_cache)
    driver = _state["driver"]
    if driver is None:
        return lambda raw, pdl=False: raw
    return lambda raw, pdl=False: FastKernel(raw, driver, pdl)


def _self_test(kernel_cache) -> _Driver | None:
    if levers.get("METRALE_FAST_LAUNCH") == "0":
        return None
    import cupy

    try:
        driver = _Driver()
        k = FastKernel(kernel_cache.module("launch_selftest").get_function("launch_selftest"), driver)
        out = cupy.zeros(8, dtype=cupy.int64)
        marker = cupy.zeros(1, dtype=cupy.int64)
        # widths in an order that needs padding between them (what the kernels' own use)
        args = (out, np.int32(-7), np.int64(1 << 40), np.float32(2.5), np.int32(11), marker,
                np.uint64(0xFEDCBA9876543210), np.float32(-0.125), np.int32(3))
        k((1,), (1,), args)
        got = out.get().tolist()
        want = [-7, 1 << 40, int(np.float32(2.5).view(np.int32)), 11, marker.data.ptr,
                int(np.uint64(0xFEDCBA9876543210).view(np.int64)),
                int(np.float32(-0.125).view(np.int32)), 3]
        if got != want:
            log.warning("packed kernel launches disabled: the self-test read back %s, expected %s",
                        got, want)
            return None
        _state["pdl_ok"] = _pdl_self_test(kernel_cache, driver)
        set_pdl(_state.get("pdl_want", levers.get("METRALE_PDL") == "1"))
        return driver
    except Exception as e:  # noqa: BLE001 - no driver library, no entry point: CuPy launches
        log.warning("packed kernel launches disabled: %s", e)
        return None


def _pdl_self_test(kernel_cache, driver: _Driver) -> bool:
    """sm_90+ only (before it the attribute is accepted but griddepcontrol compiles to nothing):
    y = 0; y += b launched plainly, then y += b with the PDL attribute after it; y must be 2b
    (the second launch read y only after the first one's write)."""
    import cupy

    try:
        major = int(str(kernel_cache.arch)[:-1] or 0)
    except ValueError:
        major = 0
    if major < 9 or driver.launch_ex is None:
        return False
    try:
        k = FastKernel(kernel_cache.module("elementwise").get_function("bias_add_f32"), driver, pdl=True)
        n = 4096
        y = cupy.zeros(n, dtype=cupy.float32)
        b = cupy.arange(n, dtype=cupy.float32)
        args = (y, b, np.int64(1), np.int32(n))
        prev = _capture[0], _prev_own[0]
        try:
            _capture[0], _prev_own[0] = True, False          # the first launch: plain
            k((4,), (256,), args)
            k((4,), (256,), args)                            # after one of ours: PDL
        finally:
            _capture[0], _prev_own[0] = prev
        cupy.cuda.get_current_stream().synchronize()
        if not bool((y == 2 * b).all()):
            log.warning("PDL launches disabled: the self-test's dependent launch read a stale input")
            return False
        return True
    except Exception as e:  # noqa: BLE001 - the driver refused the attribute: plain launches
        log.warning("PDL launches disabled: %s", e)
        return False
