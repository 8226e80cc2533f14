"""The CUDA backend's kernels: the one compile cache, the declarations, the packed launcher.

Compile cache (`KernelCache`): kernels_cuda/<name>.cu compiled once per (source, headers, arch,
nvcc version, options) with nvcc into ~/.cache/metrale/kernels/<name>-<hash>-sm<arch>.cubin
(override: METRALE_KERNEL_CACHE; sources: METRALE_KERNELS_DIR), for the device's own
architecture; without nvcc (or when nvcc does not know the arch) CuPy's NVRTC builds it.

Declarations (`declare`): every extern "C" entry point of kernels_cuda/ is declared once, in the
Python module of its op family, with its argument names and C types in the order of its .cu
signature (tests/test_kernel_declarations.py parses the preprocessed .cu files and fails on any
difference). A declared kernel is launched by name: `k(grid, block, x=..., xs=..., ...)`; the
declaration fixed the order and the width of every argument when it was made, so a launch
packs its values straight into a buffer laid out once per kernel (no per-launch type checks,
no lookups): cupy arrays, None (NULL) or ints for pointers, ints for integers, floats for
float. A missing or unknown argument is a TypeError from the call itself.

Packed launches: a CuPy RawKernel launch costs ~21 us of host time (DESIGN.md §7), most of it
argument marshalling. Decode steps replay CUDA graphs, but prefill and mixed prefill + decode
steps run eagerly: ~12 kernels per layer. Here a launch packs its arguments with one
`struct.pack_into` and calls the driver's cuLaunchKernel (ctypes) with `kernelParams` pointing
into the buffer (the driver copies each parameter by the kernel's own parameter sizes, so only
the values' byte images matter). CuPy launches every kernel instead when the first launch of a
KernelCache, a self-test kernel (kernels_cuda/launch_selftest.cu) with arguments of every width in
padding-forcing order, does not read back what it was given, or when METRALE_FAST_LAUNCH=0.
`FastKernel` also keeps the positional call of a RawKernel (args a tuple of cupy arrays, None
and fixed-width numpy scalars; a Python scalar there falls back to CuPy), for the self-test.

Programmatic dependent launch (PDL, sm_90+; on unless METRALE_PDL=0): every kernel of
kernels_cuda/ except the self-test lets its successor launch at entry and waits for its
predecessor in-kernel (common.cuh: `pdl_enter`, or gemv.cu's first weight round then `pdl_wait`),
and reads what other kernels write with coherent loads only. The `LaunchContext` of a KernelCache
(`CudaOps.launch`) holds the state: inside `capture()` (the decode and step graph captures,
metrale/backends/cuda/graphs.py) such a kernel is launched through cuLaunchKernelEx with
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION when the launch just before it was one of
ours too (never the first kernel of a capture, nor one after a cuBLAS call or a CuPy memset:
`foreign()`); capture turns that into a programmatic edge. Measured on the H200
(kernels_cuda/README.md): SmolLM2 decodes at C=1 in 0.63 ms a step instead of 0.82-0.92, the 9B
in 4.42-4.66 ms instead of 4.71. Eager launches are always plain (so `--profile`, which captures
no graphs, runs without it). Off before sm_90 or when the self-test's PDL launch fails.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import re
import shutil
import struct
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from metrale import levers

log = logging.getLogger("metrale.launch")

KERNEL_DIR = Path(levers.get("METRALE_KERNELS_DIR") or Path(__file__).resolve().parents[3] / "kernels_cuda")
CACHE_DIR = Path(levers.get("METRALE_KERNEL_CACHE") or Path.home() / ".cache" / "metrale" / "kernels")
NVCC_OPTIONS = ("-std=c++17", "-O3", "-lineinfo")   # no --use_fast_math: accuracy-sensitive kernels


# -- declarations -----------------------------------------------------------------------------

# C parameter type -> struct code (the CUDA parameter ABI: natural alignment, pointers 8 bytes)
_C_TYPES = {"int": "i", "long long": "q", "unsigned long long": "Q", "float": "f", "unsigned": "I",
            "unsigned int": "I"}
_POINTER = "Q"
_PARAM = re.compile(r"^(?:const\s+)?([A-Za-z_][\w\s]*?)\s*(\*?)\s*([A-Za-z_]\w*)$")


def parse_params(signature: str) -> tuple[tuple[str, str], ...]:
    """'const T* x, long long xs, ...' -> (('x', 'ptr'), ('xs', 'long long'), ...): each
    argument's name and ABI type ('ptr' for any pointer, else its C scalar type)."""
    out = []
    for part in signature.split(","):
        part = " ".join(part.replace("*", " * ").split())
        m = _PARAM.match(part.replace(" *", "*").replace("* ", "* "))
        if m is None:
            raise ValueError(f"cannot read the kernel parameter {part!r}")
        ctype, star, name = " ".join(m.group(1).split()), m.group(2), m.group(3)
        if star:
            out.append((name, "ptr"))
        elif ctype in _C_TYPES:
            out.append((name, ctype))
        else:
            raise ValueError(f"kernel parameter {part!r}: type {ctype!r} has no launch ABI here")
    return tuple(out)


@dataclass(frozen=True)
class KernelDecl:
    """One entry point (or a family of instantiations: `{}` in the name stands for one
    alphanumeric field, `{*}` for one that may hold underscores) of kernels_cuda/<module>.cu."""
    module: str
    name: str
    params: tuple[tuple[str, str], ...]
    pdl: bool = True            # keeps the PDL rule of common.cuh (all but the self-test)

    @functools.cached_property
    def pattern(self) -> re.Pattern:
        parts = re.split(r"(\{\*?\})", self.name)
        rx = "".join("[0-9A-Za-z_]+" if p == "{*}" else "[0-9A-Za-z]+" if p == "{}" else re.escape(p)
                     for p in parts)
        return re.compile(rx + r"\Z")

    @functools.cached_property
    def codes(self) -> str:
        return "".join(_POINTER if t == "ptr" else _C_TYPES[t] for _, t in self.params)


_DECLS: dict[str, list[KernelDecl]] = {}


def declare(module: str, name: str, signature: str, pdl: bool = True) -> KernelDecl:
    """Declare kernels_cuda/<module>.cu's entry point `name` with its C parameter list (copied
    from the .cu; tests/test_kernel_declarations.py holds the two equal)."""
    d = KernelDecl(module, name, parse_params(signature), pdl)
    _DECLS.setdefault(module, []).append(d)
    return d


def declarations() -> dict[str, list[KernelDecl]]:
    """Every declaration, by module (importing the op-family modules that make them)."""
    from metrale.backends.cuda import attention, elementwise, gdn, moe, sampling  # noqa: F401
    from metrale.backends.cuda.gemm import cublaslt, quant  # noqa: F401
    return _DECLS


def find_decl(module: str, fn: str) -> KernelDecl:
    found = [d for d in declarations().get(module, ()) if d.pattern.match(fn)]
    if len(found) != 1:
        raise KeyError(f"kernels_cuda/{module}.cu: {fn} has {len(found)} declarations "
                       f"({[d.name for d in found]}); declare it once in its op module")
    return found[0]


declare("launch_selftest", "launch_selftest",
        "long long* out, int a, long long b, float c, int d, const void* p, unsigned long long e, "
        "float f, int g", pdl=False)


# -- packing ------------------------------------------------------------------------------------

_FORMATS = {
    np.dtype(np.uint64): "Q", np.dtype(np.int64): "q", np.dtype(np.uint32): "I",
    np.dtype(np.int32): "i", np.dtype(np.uint16): "H", np.dtype(np.int16): "h",
    np.dtype(np.uint8): "B", np.dtype(np.int8): "b", np.dtype(np.float32): "f",
    np.dtype(np.float64): "d", np.dtype(np.bool_): "?",
}


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


class LaunchContext:
    """The PDL state of one device's launches: whether PDL is on (METRALE_PDL, the self-test,
    `set_pdl`), whether a graph capture is under way, and whether the last launch issued was
    one of our PDL-ready kernels. Launches are issued from one thread (the engine's)."""
    __slots__ = ("pdl_ok", "pdl_want", "pdl", "capturing", "prev_own")

    def __init__(self):
        self.pdl_ok = False         # the PDL self-test passed on this device
        self.pdl_want = levers.get("METRALE_PDL") == "1"
        self.pdl = False            # effective: wanted and ok
        self.capturing = False      # inside capture() with PDL on
        self.prev_own = False

    @property
    def pdl_enabled(self) -> bool:
        return self.pdl

    def foreign(self) -> None:
        """Called before a stream operation that is not one of our kernels (a cuBLAS call, a
        CuPy memset or copy): the kernel after it is launched plainly."""
        self.prev_own = False

    @contextlib.contextmanager
    def capture(self):
        """Around a graph capture: our kernels in it get programmatic edges to the kernel before
        them where that one is ours too (the first one never: on replay it follows whatever the
        stream did before the graph)."""
        prev = self.capturing
        self.capturing, self.prev_own = self.pdl, False
        try:
            yield
        finally:
            self.capturing, self.prev_own = prev, False

    def set_pdl(self, on: bool) -> bool:
        """Ask for PDL launches on or off (on takes effect only where the self-test's PDL launch
        passed, now or when it runs later); returns the previous effective state. Applies to
        launches issued after it, and so to graphs captured after it."""
        prev = self.pdl
        self.pdl_want = bool(on)
        self.pdl = self.pdl_want and self.pdl_ok
        return prev


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


def _address(a) -> int:
    """A pointer argument that is not a cupy array: None (NULL), an int or a numpy integer."""
    if a is None:
        return 0
    data = getattr(a, "data", None)
    return int(a) if data is None or isinstance(a, np.generic) else data.ptr


class _RawKernelView:
    """What a launcher shows of the cupy RawKernel it wraps (`self.raw`): name, attributes,
    num_regs, ... read through, and the one CUfunction's dynamic shared memory limit set on it."""

    def __getattr__(self, name):
        return getattr(self.raw, name)

    @property
    def max_dynamic_shared_size_bytes(self):
        return self.raw.max_dynamic_shared_size_bytes

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, value):
        self.raw.max_dynamic_shared_size_bytes = value


class FastKernel(_RawKernelView):
    """A RawKernel launched through cuLaunchKernel; the CuPy launch where that does not apply.
    Same call as the RawKernel: k(grid, block, args, shared_mem=0, stream=None)."""

    def __init__(self, raw, driver: _Driver, pdl: bool = False, ctx: LaunchContext | None = None):
        self.raw = raw
        self._driver = driver
        self.pdl = pdl                  # the kernel keeps the PDL rule (common.cuh)
        self._ctx = ctx if ctx is not None else LaunchContext()
        self._func = None
        self._layouts: dict = {}
        self._ndarray = _device_array_type()
        self._current_stream = None     # cupy.cuda.get_current_stream, bound on first use

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
            self._ctx.prev_own = False
            return self.raw(grid, block, args, shared_mem=shared_mem, stream=stream)
        if lay.ptr_args:
            args = list(args)
            for i in lay.ptr_args:
                a = args[i]
                args[i] = 0 if a is None else a.data.ptr
        struct.pack_into(lay.fmt, lay.buf, 0, *args)
        self._go(lay.params, grid, block, shared_mem, stream)

    def _go(self, params, grid, block, shared_mem, stream):
        """The driver call for packed `params` (PDL inside a capture after one of ours)."""
        if self._func is None:
            self._func = self.raw.kernel.ptr        # the CUfunction (loads the module once)
        if stream is None:
            if self._current_stream is None:
                import cupy

                self._current_stream = cupy.cuda.get_current_stream
            stream = self._current_stream()
        g = tuple(grid) + (1, 1)
        b = tuple(block) + (1, 1)
        ctx = self._ctx
        pdl = self.pdl and ctx.capturing and ctx.prev_own
        ctx.prev_own = self.pdl
        if pdl:
            status = self._driver.launch_pdl(self._func, g[0], g[1], g[2], b[0], b[1], b[2], shared_mem,
                                             stream.ptr, params)
        else:
            status = self._driver.launch(self._func, g[0], g[1], g[2], b[0], b[1], b[2], shared_mem,
                                         stream.ptr, params, None)
        if status:
            raise RuntimeError(f"cuLaunchKernel({self.raw.name}) failed: {self._driver.name(status)}")


# -- declared (typed) kernels -------------------------------------------------------------------

def _typed_source(decl: KernelDecl, fast: bool) -> str:
    """The source of `__call__(self, grid, block, *, <decl's names>, shared_mem=0, stream=None)`
    for a declared kernel: its arguments in the declaration's order, pointers as addresses."""
    names = [n for n, _ in decl.params]
    if len(set(names)) != len(names) or {"grid", "block", "shared_mem", "stream", "self"} & set(names):
        raise ValueError(f"{decl.name}: parameter names must be unique and not grid/block/shared_mem/stream")
    vals = []
    for n, t in decl.params:
        if t == "ptr":
            addr = f"({n}.data.ptr if {n}.__class__ is _nd else _address({n}))"
            vals.append(addr if fast else f"_u64({addr})")
        else:
            vals.append(n if fast else f"{ {'i': '_i32', 'q': '_i64', 'Q': '_u64', 'f': '_f32', 'I': '_u32'}[_C_TYPES[t]] }({n})")
    sig = ", ".join(["self", "grid", "block", "*"] + names + ["shared_mem=0", "stream=None"])
    if fast:
        body = (f"    self._pack(self._buf, 0, {', '.join(vals)})\n"
                f"    self._go(self._params, grid, block, shared_mem, stream)\n")
    else:
        body = (f"    self._ctx.prev_own = False\n"
                f"    self.raw(grid, block, ({', '.join(vals)},), shared_mem=shared_mem, stream=stream)\n")
    return f"def __call__({sig}):\n{body}"


@functools.cache
def _typed_class(decl: KernelDecl, fast: bool) -> type:
    """A FastKernel subclass (fast) or a CuPy-launching wrapper whose __call__ takes `decl`'s
    arguments by name; made once per declaration and launch path."""
    env = {"_nd": _device_array_type(), "_address": _address, "_u64": np.uint64, "_i64": np.int64,
           "_i32": np.int32, "_u32": np.uint32, "_f32": np.float32}
    exec(_typed_source(decl, fast), env)  # noqa: S102 - our own declarations, not input
    base = TypedKernel if fast else CupyTypedKernel
    return type(f"{base.__name__}_{decl.name}", (base,), {"__call__": env["__call__"], "__slots__": ()})


class TypedKernel(FastKernel):
    """A declared kernel on the packed path: one fixed layout from the declaration."""

    def __init__(self, raw, driver, decl: KernelDecl, ctx: LaunchContext):
        super().__init__(raw, driver, decl.pdl, ctx)
        self.decl = decl
        fmt, offsets, size = arg_layout(decl.codes)
        self._buf = ctypes.create_string_buffer(size)
        base = ctypes.addressof(self._buf)
        self._params = (ctypes.c_void_p * max(1, len(offsets)))(*[base + o for o in offsets])
        self._pack = struct.Struct(fmt).pack_into


class CupyTypedKernel(_RawKernelView):
    """A declared kernel launched by CuPy (the packed path off or failed): the same call."""

    def __init__(self, raw, decl: KernelDecl, ctx: LaunchContext):
        self.raw, self.decl, self._ctx, self.pdl = raw, decl, ctx, False


def typed_kernel(raw, decl: KernelDecl, ctx: LaunchContext, driver: _Driver | None):
    """`raw` (a CuPy RawKernel, or a stand-in with .kernel.ptr) called by `decl`'s names."""
    if driver is None:
        return _typed_class(decl, False)(raw, decl, ctx)
    return _typed_class(decl, True)(raw, driver, decl, ctx)


# -- the compile cache ---------------------------------------------------------------------------

def find_nvcc() -> str | None:
    for cand in (shutil.which("nvcc"), os.path.join(os.environ.get("CUDA_PATH", "/usr/local/cuda"), "bin", "nvcc"),
                 "/usr/local/cuda/bin/nvcc"):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


class KernelCache:
    """Compiles kernels_cuda/<name>.cu once per content hash and arch; loads cupy RawModules;
    hands out declared kernels on the packed launch path of its `LaunchContext`."""

    def __init__(self, arch: str, kernel_dir: Path = KERNEL_DIR, cache_dir: Path = CACHE_DIR,
                 launch: LaunchContext | None = None):
        self.arch, self.kernel_dir, self.cache_dir = arch, Path(kernel_dir), Path(cache_dir)
        self.launch = launch if launch is not None else LaunchContext()
        self._modules: dict = {}
        self._kernels: dict = {}
        self._driver = None             # decided on the first kernel (self-test)
        self._decided = False
        self._nvcc = find_nvcc()
        self._nvcc_version = self._version() if self._nvcc else ""

    def _version(self) -> str:
        try:
            return subprocess.run([self._nvcc, "--version"], capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            self._nvcc = None
            return ""

    def _source_key(self, name: str) -> tuple[str, str]:
        src = self.kernel_dir / f"{name}.cu"
        if not src.is_file():
            raise FileNotFoundError(f"kernel source {src} not found (set METRALE_KERNELS_DIR to the "
                                    "repository's kernels_cuda/ folder)")
        h = hashlib.sha256()
        for p in [src, *sorted(self.kernel_dir.glob("*.cuh"))]:
            h.update(p.name.encode())
            h.update(p.read_bytes())
        h.update(f"{self.arch}|{NVCC_OPTIONS}|{self._nvcc_version}".encode())
        return src.read_text(), h.hexdigest()[:20]

    def cubin_path(self, name: str) -> Path:
        """Compile (if not cached) and return the cubin path; raises with nvcc's log on failure."""
        _, key = self._source_key(name)
        path = self.cache_dir / f"{name}-{key}-sm{self.arch}.cubin"
        if path.exists():
            return path
        if not self._nvcc:
            raise FileNotFoundError("nvcc not found")
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".cubin", dir=self.cache_dir)
        os.close(fd)
        cmd = [self._nvcc, f"-arch=sm_{self.arch}", "-cubin", *NVCC_OPTIONS, "-I", str(self.kernel_dir),
               "-o", tmp, str(self.kernel_dir / f"{name}.cu")]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            os.unlink(tmp)
            raise RuntimeError(f"nvcc failed on kernels_cuda/{name}.cu:\n{' '.join(cmd)}\n{res.stderr}")
        os.replace(tmp, path)  # atomic: concurrent compilers are safe
        return path

    def module(self, name: str):
        import cupy

        mod = self._modules.get(name)
        if mod is None:
            try:
                mod = cupy.RawModule(path=str(self.cubin_path(name)))
            except (FileNotFoundError, RuntimeError) as e:
                if self._nvcc and "nvcc failed" in str(e) and f"sm_{self.arch}" not in str(e):
                    raise
                # no nvcc, or nvcc does not know this arch: NVRTC (cached by CuPy)
                code, _ = self._source_key(name)
                mod = cupy.RawModule(code=code, options=("-std=c++17", f"-I{self.kernel_dir}"),
                                     backend="nvrtc")
            self._modules[name] = mod
        return mod

    def kernel(self, module: str, fn: str):
        """Entry point `fn` of kernels_cuda/<module>.cu, called by its declared names, launched
        through cuLaunchKernel with packed arguments (~4x less host time per launch than CuPy's)
        once that path has passed its self-test, else by CuPy."""
        key = (module, fn)
        k = self._kernels.get(key)
        if k is None:
            decl = find_decl(module, fn)
            raw = self.module(module).get_function(fn)
            if not self._decided and not self._decide():
                return typed_kernel(raw, decl, self.launch, None)   # capturing: decide later
            if module == "launch_selftest":     # the launch path's own probe: positional calls
                k = raw if self._driver is None else FastKernel(raw, self._driver, False, self.launch)
            else:
                k = typed_kernel(raw, decl, self.launch, self._driver)
            self._kernels[key] = k
        return k

    def _decide(self) -> bool:
        """Run the packed path's self-test once (False while the stream captures: it syncs)."""
        import cupy

        try:
            capturing = cupy.cuda.runtime.streamIsCapturing(cupy.cuda.get_current_stream().ptr)
        except Exception:  # noqa: BLE001 - the query is illegal while another stream captures
            capturing = True
        if capturing:
            return False
        self._driver = _self_test(self)
        self._decided = True
        return True


def _self_test(cache: KernelCache) -> _Driver | None:
    if levers.get("METRALE_FAST_LAUNCH") == "0":
        return None
    import cupy

    try:
        driver = _Driver()
        k = FastKernel(cache.module("launch_selftest").get_function("launch_selftest"), driver,
                       ctx=cache.launch)
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
        cache.launch.pdl_ok = _pdl_self_test(cache, driver)
        cache.launch.set_pdl(cache.launch.pdl_want)
        return driver
    except Exception as e:  # noqa: BLE001 - no driver library, no entry point: CuPy launches
        log.warning("packed kernel launches disabled: %s", e)
        return None


def _pdl_self_test(cache: KernelCache, driver: _Driver) -> bool:
    """sm_90+ only (before it the attribute is accepted but griddepcontrol compiles to nothing):
    y = 0; y += b launched plainly, then y += b with the PDL attribute after it; y must be 2b
    (the second launch read y only after the first one's write)."""
    import cupy

    try:
        major = int(str(cache.arch)[:-1] or 0)
    except ValueError:
        major = 0
    if major < 9 or driver.launch_ex is None:
        return False
    ctx = cache.launch
    try:
        k = FastKernel(cache.module("elementwise").get_function("bias_add_f32"), driver, pdl=True, ctx=ctx)
        n = 4096
        y = cupy.zeros(n, dtype=cupy.float32)
        b = cupy.arange(n, dtype=cupy.float32)
        args = (y, b, np.int64(1), np.int32(n))
        prev = ctx.capturing, ctx.prev_own
        try:
            ctx.capturing, ctx.prev_own = True, False          # the first launch: plain
            k((4,), (256,), args)
            k((4,), (256,), args)                            # after one of ours: PDL
        finally:
            ctx.capturing, ctx.prev_own = prev
        cupy.cuda.get_current_stream().synchronize()
        if not bool((y == 2 * b).all()):
            log.warning("PDL launches disabled: the self-test's dependent launch read a stale input")
            return False
        return True
    except Exception as e:  # noqa: BLE001 - the driver refused the attribute: plain launches
        log.warning("PDL launches disabled: %s", e)
        return False
