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
"""
from __future__ import annotations

import ctypes
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


class _Driver:
    """libcuda's cuLaunchKernel (the library CuPy already loaded)."""

    def __init__(self):
        lib = ctypes.CDLL("libcuda.so.1")
        u, vp = ctypes.c_uint, ctypes.c_void_p
        self.launch = lib.cuLaunchKernel
        self.launch.argtypes = [vp, u, u, u, u, u, u, u, vp, ctypes.POINTER(vp), ctypes.POINTER(vp)]
        self.launch.restype = ctypes.c_int
        self.error_name = lib.cuGetErrorName
        self.error_name.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        self.error_name.restype = ctypes.c_int

    def name(self, status: int) -> str:
        s = ctypes.c_char_p()
        return s.value.decode() if self.error_name(status, ctypes.byref(s)) == 0 and s.value else str(status)


class FastKernel:
    """A RawKernel launched through cuLaunchKernel; the CuPy launch where that does not apply.
    Same call as the RawKernel: k(grid, block, args, shared_mem=0, stream=None)."""

    def __init__(self, raw, driver: _Driver):
        import cupy

        self.raw = raw
        self._driver = driver
        self._func = None
        self._layouts: dict = {}
        self._ndarray = cupy.ndarray
        self._current_stream = cupy.cuda.get_current_stream

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
            stream = self._current_stream()
        g = tuple(grid) + (1, 1)
        b = tuple(block) + (1, 1)
        status = self._driver.launch(self._func, g[0], g[1], g[2], b[0], b[1], b[2], shared_mem,
                                     stream.ptr, lay.params, None)
        if status:
            raise RuntimeError(f"cuLaunchKernel({self.raw.name}) failed: {self._driver.name(status)}")


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
        return lambda raw: raw
    return lambda raw: FastKernel(raw, driver)


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
        return driver
    except Exception as e:  # noqa: BLE001 - no driver library, no entry point: CuPy launches
        log.warning("packed kernel launches disabled: %s", e)
        return None
