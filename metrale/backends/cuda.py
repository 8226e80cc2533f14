"""The CUDA backend: cupy arrays + our kernels (kernels_cuda/*.cu) + cuBLAS through ctypes.

Storage is bf16 as cupy arrays of dtype `ml_dtypes.bfloat16` (CuPy 14 accepts that dtype; the
kernels see the same 2-byte bits as `__nv_bfloat16`). fp32 inputs run the `_f32` twin of each
elementwise kernel; attention is bf16 only. Every op is graph-capturable: no host syncs, no
`.get()`, outputs from `cupy.empty` (the runner captures with a private memory pool), cuBLAS
through our own handle (metrale.backends.cublas). The exception is attention over a batch that
is not pure decode (prefill / mixed): it builds its work list from the host copy of the batch
that `upload_batch` keeps, so prefill steps are not captured.

Kernels are compiled once per (source, headers, arch, nvcc version, options) with nvcc into
~/.cache/metrale/kernels/<name>-<hash>-sm<arch>.cubin (override: METRALE_KERNEL_CACHE), for the
device's own architecture; without nvcc (or when nvcc does not know the arch) CuPy's NVRTC
builds it instead. GDN and MoE kernels live in metrale.backends.cuda_gdn (another owner); they
load their modules through `CudaOps.module(name)` / `CudaOps.kernel(module, fn)`.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np

from metrale import levers
from metrale.backends import cublas as _cublas
from metrale.backends.base import compose_qk_norm_rope_write_kv
from metrale.backends.cublaslt import KSPLIT_S
from metrale.backends.launch import foreign_launch
from metrale.forward import ForwardBatch, prefill_work_list
from metrale.models.checkpoint import CheckpointError
from metrale.models.quant import is_quantized

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
I32 = np.dtype(np.int32)

KERNEL_DIR = Path(levers.get("METRALE_KERNELS_DIR") or Path(__file__).resolve().parents[2] / "kernels_cuda")
CACHE_DIR = Path(levers.get("METRALE_KERNEL_CACHE") or Path.home() / ".cache" / "metrale" / "kernels")
NVCC_OPTIONS = ("-std=c++17", "-O3", "-lineinfo")   # no --use_fast_math: accuracy-sensitive kernels

# attention tiling, must match kernels_cuda/attention.cu (MT_PREFILL_MMA / MT_DECODE_MMA):
# tensor cores, prefill 8 warps x 16 rows, keys
# in tiles of ATTN_MMA_BN[D], two stages; decode 4 warps, 16-key tiles, per-warp pipelines of
# ATTN_MMA_DECODE_STAGES[D] stages, 8 or 16 q heads per CTA (kernel suffix _h1 / _h2)
ATTN_MMA_BN = {64: 64, 128: 64, 256: 32}
ATTN_MMA_ROWS, ATTN_MMA_THREADS = 128, 256
ATTN_MMA_DECODE_STAGES = {64: 4, 128: 3, 256: 3}
ATTN_MMA_DECODE_WARPS, ATTN_MMA_DECODE_TILE = 4, 16

_SUFFIX = {BF16: "bf16", F32: "f32"}
_NULL = np.uint64(0)


def find_nvcc() -> str | None:
    for cand in (shutil.which("nvcc"), os.path.join(os.environ.get("CUDA_PATH", "/usr/local/cuda"), "bin", "nvcc"),
                 "/usr/local/cuda/bin/nvcc"):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


class KernelCache:
    """Compiles kernels_cuda/<name>.cu once per content hash and arch; loads cupy RawModules."""

    def __init__(self, arch: str, kernel_dir: Path = KERNEL_DIR, cache_dir: Path = CACHE_DIR):
        self.arch, self.kernel_dir, self.cache_dir = arch, Path(kernel_dir), Path(cache_dir)
        self._modules: dict = {}
        self._kernels: dict = {}
        self._fast = None          # raw kernel -> launcher (decided on the first kernel)
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
        """The kernel, launched through cuLaunchKernel with packed arguments (~4x less host time
        per launch than CuPy's; metrale/backends/launch.py) once that path has passed its
        self-test, else CuPy's RawKernel."""
        key = (module, fn)
        k = self._kernels.get(key)
        if k is None:
            k = self.module(module).get_function(fn)
            if self._fast is None:
                from metrale.backends.launch import fast_launcher

                self._fast = fast_launcher(self)     # None: not decided yet (capturing)
            if self._fast is None:
                return k
            # every kernels_cuda entry point keeps the PDL rule (common.cuh) but the self-test
            k = self._kernels[key] = self._fast(k, module != "launch_selftest")
        return k


def _ptr(a) -> np.uint64:
    return _NULL if a is None else np.uint64(a.data.ptr)


def _estride(a, dim: int) -> int:
    return a.strides[dim] // a.itemsize


def _aligned(*arrays) -> bool:
    return all(a is None or a.data.ptr % 16 == 0 for a in arrays)


class SplitK:
    """A GEMM's output left as fp32 partial products over slices of k ([S, T, N], summed by the
    consumer): what CudaOps.linear_parts returns when the k-split plan wins (cublaslt.py
    ksplit_plan). add_rms_norm takes it as its x; `materialize` gives the plain [.., N] array."""
    __slots__ = ("parts", "shape", "dtype")

    def __init__(self, parts, shape: tuple, dtype):
        self.parts, self.shape, self.dtype = parts, tuple(shape), dtype

    def materialize(self):
        foreign_launch()   # CuPy kernels: the next kernel of ours is launched plainly
        return self.parts.sum(axis=0).astype(self.dtype).reshape(self.shape)


def _block_for(per_row: int) -> int:
    """Threads for one-block-per-row kernels: `per_row` rounded up to whole warps, 32..1024."""
    return min(1024, max(32, -(-per_row // 32) * 32))


def refuse_quantized(x) -> None:
    """Weight upload refuses quantized tensors (metrale.models.quant) until kernels that read
    them packed exist: never dequantised into a bf16 copy, never read as bf16."""
    if is_quantized(x):
        raise CheckpointError(
            f"FP8/NVFP4 kernels are not in this build yet: this checkpoint holds {x.scheme} "
            f"weights {tuple(x.shape)}; serve this checkpoint with --device cpu")


def _host_of(batch: ForwardBatch) -> ForwardBatch | None:
    if isinstance(batch.query_start_loc, np.ndarray):
        return batch
    return getattr(batch, "host", None)


class CudaOps:
    """cupy + kernels_cuda implementation of metrale.backends.base.Ops."""

    name = "cuda"

    def __init__(self, device: int | None = None, dtype=BF16, part_tokens: int | None = None):
        import cupy

        self.cp = cupy
        self.device = cupy.cuda.Device(device) if device is not None else cupy.cuda.Device()
        self.device.use()
        self.dtype = np.dtype(dtype)
        self.arch = str(self.device.compute_capability)
        self.kernels = KernelCache(self.arch)
        self.sm_count = cupy.cuda.runtime.getDeviceProperties(self.device.id)["multiProcessorCount"]
        self.part_tokens = part_tokens      # flash-decoding partition (keys per CTA); None = adaptive
        self.poison = levers.get("METRALE_CUDA_POISON") == "1"  # NaN-fill new outputs (tests)
        self._cublas = None
        self._smem_set: set = set()
        self._staging: list = []            # pinned upload buffers, with their copy-done events
        self._staging_next = 0

    # -- kernel access (also used by metrale.backends.cuda_gdn) -------------------------------
    def module(self, name: str):
        """cupy.RawModule of kernels_cuda/<name>.cu, compiled for this device once and cached."""
        return self.kernels.module(name)

    def kernel(self, module: str, fn: str, smem: int = 0):
        """A kernel of kernels_cuda/<module>.cu; raises its dynamic shared-memory limit to `smem`
        when that exceeds the default 48 KB."""
        k = self.kernels.kernel(module, fn)
        if smem > 48 * 1024 and (module, fn, smem) not in self._smem_set:
            k.max_dynamic_shared_size_bytes = smem
            self._smem_set.add((module, fn, smem))
        return k

    def _suffix(self, a) -> str:
        try:
            return _SUFFIX[np.dtype(a.dtype)]
        except KeyError:
            raise TypeError(f"CudaOps supports bfloat16 and float32 arrays, got {a.dtype}") from None

    def _grid1d(self, work: int, threads: int = 256) -> int:
        return max(1, min((work + threads - 1) // threads, self.sm_count * 16))

    def _new(self, shape, dtype):
        out = self.cp.empty(shape, dtype=dtype)
        if self.poison:
            foreign_launch()        # a CuPy fill: the next kernel must not start before it
            out.view(np.uint8 if np.dtype(dtype).itemsize == 1 else
                     {2: np.uint16, 4: np.uint32, 8: np.uint64}[np.dtype(dtype).itemsize]).fill(
                {1: 0xFF, 2: 0x7FC0, 4: 0x7FC00000, 8: 0x7FF8000000000000}[np.dtype(dtype).itemsize])
        return out

    @property
    def stream_ptr(self) -> int:
        return self.cp.cuda.get_current_stream().ptr

    # -- data movement ---------------------------------------------------------------------
    def asarray(self, x, dtype=None):
        refuse_quantized(x)
        dt = np.dtype(dtype) if dtype is not None else self.dtype
        if isinstance(x, self.cp.ndarray):
            if x.dtype == dt:
                return x
            x = self.cp.asnumpy(x)  # conversions through the host: weights / tests only
        return self.cp.asarray(np.ascontiguousarray(np.asarray(x).astype(dt, copy=False)))

    def to_numpy(self, x):
        return self.cp.asnumpy(x) if isinstance(x, self.cp.ndarray) else np.asarray(x)

    def empty(self, shape, dtype=None):
        return self.cp.empty(shape, dtype=dtype or self.dtype)

    def zeros(self, shape, dtype=None):
        foreign_launch()            # a memset (see _new)
        return self.cp.zeros(shape, dtype=dtype or self.dtype)

    _BATCH_FIELDS = ("input_ids", "positions", "query_start_loc", "seq_lens", "block_tables",
                     "slot_mapping", "state_slots", "logits_indices")

    def upload_batch(self, batch: ForwardBatch) -> ForwardBatch:
        """One pinned staging buffer -> one async H2D copy -> int32 device views. The host batch
        stays reachable as `.host` (prefill attention builds its work list from it)."""
        cp = self.cp
        host = [np.ascontiguousarray(getattr(batch, f), dtype=np.int32) for f in self._BATCH_FIELDS]
        sizes = [a.size for a in host]
        total = max(1, sum(sizes))
        stage, done = self._staging_buffer(total)
        done.synchronize()  # the previous copy out of this buffer has finished (normally long ago)
        off = 0
        for a in host:
            stage[off: off + a.size] = a.ravel()
            off += a.size
        dev = cp.empty(total, dtype=np.int32)
        stream = cp.cuda.get_current_stream()
        dev.set(stage[:total], stream=stream)
        done.record(stream)
        views, off = [], 0
        for a in host:
            views.append(dev[off: off + a.size].reshape(a.shape))
            off += a.size
        out = ForwardBatch(*views, block_size=batch.block_size)
        out.host = batch
        return out

    def _staging_buffer(self, n: int):
        cp = self.cp
        slot = self._staging_next % 4
        self._staging_next += 1
        while len(self._staging) <= slot:
            self._staging.append((np.empty(0, np.int32), None, cp.cuda.Event(disable_timing=True)))
        arr, mem, ev = self._staging[slot]
        if arr.size < n:
            cap = max(n, 1 << 16)
            mem = cp.cuda.alloc_pinned_memory(cap * 4)
            arr = np.frombuffer(mem, np.int32, cap)
            ev = cp.cuda.Event(disable_timing=True)
            self._staging[slot] = (arr, mem, ev)
        return arr, ev

    def _dev(self, a):
        return a if isinstance(a, self.cp.ndarray) else self.cp.asarray(np.asarray(a, dtype=np.int32))

    # -- layout helpers --------------------------------------------------------------------
    def _rows(self, x):
        """x [..., H] -> (2-D view [R, H] with contiguous last dim, row stride in elements)."""
        cp = self.cp
        if x.ndim == 1:
            x = x.reshape(1, -1)
        if x.ndim > 2:
            try:
                x = x.reshape(-1, x.shape[-1])  # a view when the leading dims merge
            except Exception:
                x = cp.ascontiguousarray(x).reshape(-1, x.shape[-1])
        if (x.shape[1] > 1 and _estride(x, 1) != 1) or x.strides[0] % x.itemsize or x.strides[0] < 0:
            x = cp.ascontiguousarray(x)
        rs = _estride(x, 0) if x.shape[0] > 1 else x.shape[1]
        return x, rs

    def _heads(self, x):
        """x [T, Hh, D] (or [T, D]) -> 3-D view with contiguous last dim."""
        if x.ndim == 2:
            x = x.reshape(x.shape[0], 1, x.shape[1])
        if x.shape[2] > 1 and _estride(x, 2) != 1:
            x = self.cp.ascontiguousarray(x)
        return x

    # -- elementwise / norms ---------------------------------------------------------------
    def embedding(self, ids, table):
        ids = self._dev(ids)
        table = self.cp.ascontiguousarray(table)
        t, (v, h) = ids.shape[0], table.shape
        out = self._new((t, h), table.dtype)
        if t:
            vec = int((h * table.itemsize) % 16 == 0 and _aligned(table, out))
            self.kernel("elementwise", f"embedding_{self._suffix(table)}")(
                (t,), (128,), (_ptr(ids), _ptr(table), _ptr(out), np.int32(h), np.int64(v), np.int32(vec)))
        return out

    def _rms(self, x, residual, w, eps, offset):
        shape = x.shape
        x2, xs = self._rows(x)
        r2, rs = self._rows(residual) if residual is not None else (None, 0)
        rows, h = x2.shape
        out = self._new((rows, h), x.dtype)
        res_out = self._new((rows, h), x.dtype) if residual is not None else None
        if rows:
            suf = self._suffix(x)
            n = 16 // x.itemsize
            nvec = h // n
            vec = (h % n == 0 and xs % n == 0 and rs % n == 0 and nvec <= 4096 and
                   _aligned(x2, r2, w, out, res_out) and w.dtype == x.dtype)
            args = (_ptr(x2), np.int64(xs), _ptr(r2), np.int64(rs), _ptr(w), _ptr(out), _ptr(res_out),
                    np.int32(h), np.float32(eps), np.float32(offset))
            if vec:
                threads = _block_for(-(-nvec // 4))
                self.kernel("elementwise", f"rms_norm_vec_{suf}")((rows,), (threads,), args)
            else:
                if w.dtype != x.dtype:
                    w = w.astype(x.dtype)
                    args = args[:4] + (_ptr(w),) + args[5:]
                threads = _block_for(-(-h // 4))
                self.kernel("elementwise", f"rms_norm_scalar_{suf}")((rows,), (threads,), args)
        return out.reshape(shape), (res_out.reshape(shape) if res_out is not None else None)

    def rms_norm(self, x, w, eps, offset):
        return self._rms(x, None, w, eps, offset)[0]

    def add_rms_norm(self, x, residual, w, eps, offset):
        if isinstance(x, SplitK):
            done = self._rms_parts(x, residual, w, eps, offset)
            if done is not None:
                return done
            x = x.materialize()
        if residual is None:
            return self.rms_norm(x, w, eps, offset), x
        return self._rms(x, residual, w, eps, offset)

    def _rms_parts(self, x: SplitK, residual, w, eps, offset):
        """add_rms_norm of a k-split GEMM's partials in one kernel (they are summed on the way in),
        or None where the vector kernel does not apply (the caller materializes x instead)."""
        parts = x.parts
        s_, rows, h = parts.shape
        if residual is None or residual.dtype != x.dtype or w.dtype != x.dtype or s_ != 2:
            return None
        r2, rs = self._rows(residual)
        n = 16 // x.dtype.itemsize
        if h % n or rs % n or h // n > 4096 or r2.shape != (rows, h) or not _aligned(parts, r2, w):
            return None
        out = self._new((rows, h), x.dtype)
        res_out = self._new((rows, h), x.dtype)
        if rows:
            # one 16-byte vector per thread up to 1024 (all of a thread's loads in flight at once:
            # the k-split runs at 16-64 rows, so this kernel is latency-bound), then up to 4
            threads = _block_for(h // n if h // n <= 1024 else -(-(h // n) // 4))
            self.kernel("elementwise", f"rms_norm_parts2_{self._suffix(residual)}")(
                (rows,), (threads,), (_ptr(parts), np.int64(rows * h), _ptr(r2), np.int64(rs), _ptr(w),
                                      _ptr(out), _ptr(res_out), np.int32(h), np.float32(eps), np.float32(offset)))
        return out.reshape(x.shape), res_out.reshape(x.shape)

    def silu_mul(self, x):
        shape = x.shape
        x2, xs = self._rows(x)
        rows, two_i = x2.shape
        i = two_i // 2
        out = self._new((rows, i), x.dtype)
        n = 16 // x.itemsize
        vec = int(i % n == 0 and xs % n == 0 and _aligned(x2, out))
        work = rows * (i // n if vec else i)
        if work:
            self.kernel("elementwise", f"silu_mul_{self._suffix(x)}")(
                (self._grid1d(work),), (256,), (_ptr(x2), np.int64(xs), _ptr(out), np.int64(rows), np.int32(i),
                                                np.int32(vec)))
        return out.reshape(*shape[:-1], i)

    @staticmethod
    def _abc(a):
        """(A, B, C) shape and element strides of a 1-3 D array."""
        s = [st // a.itemsize for st in a.strides]
        if a.ndim == 1:
            return (1, 1, a.shape[0]), (0, 0, s[0])
        if a.ndim == 2:
            return (a.shape[0], 1, a.shape[1]), (s[0], 0, s[1])
        return a.shape, tuple(s)

    def sigmoid_mul(self, x, gate):
        cp = self.cp
        shape = np.broadcast_shapes(x.shape, gate.shape)
        x = cp.broadcast_to(x, shape)
        g = cp.broadcast_to(gate, shape)
        if len(shape) > 3 or len(shape) == 0:
            x, g = cp.ascontiguousarray(x).reshape(-1), cp.ascontiguousarray(g).reshape(-1)
        (a, b, c), (xa, xb, xc) = self._abc(x)
        if c > 1 and xc != 1:
            x = cp.ascontiguousarray(x)
            (a, b, c), (xa, xb, xc) = self._abc(x)
        if g.dtype != x.dtype:
            g = g.astype(x.dtype)
        _, (ga, gb, gc) = self._abc(g)
        if c > 1 and gc not in (0, 1):
            g = cp.ascontiguousarray(g)
            _, (ga, gb, gc) = self._abc(g)
        if c == 1:
            gc = 1
        out = self._new(shape, x.dtype)
        n = 16 // x.itemsize
        vec = int(c % n == 0 and gc == 1 and all(s % n == 0 for s in (xa, xb, ga, gb)) and _aligned(x, g, out))
        work = a * b * (c // n if vec else c)
        if work:
            self.kernel("elementwise", f"sigmoid_mul_{self._suffix(x)}")(
                (self._grid1d(work),), (256,),
                (_ptr(x), np.int64(xa), np.int64(xb), _ptr(g), np.int64(ga), np.int64(gb), np.int64(gc),
                 _ptr(out), np.int64(a), np.int32(b), np.int32(c), np.int32(vec)))
        return out

    # -- matrices --------------------------------------------------------------------------
    def _blas(self):
        """The GEMM handle: cuBLASLt with per-shape autotuning (metrale.backends.cublaslt) over
        our cuBLAS handle, with our GEMV kernels (kernels_cuda/gemv.cu, through this KernelCache)
        as candidates for decode row counts; the plain cublasGemmEx handle when
        METRALE_GEMM_TUNE=0 or libcublasLt cannot be used. Both share one workspace."""
        if self._cublas is None:
            major = self.cp.cuda.runtime.runtimeGetVersion() // 1000
            lib = _cublas.load_libcublas(major)
            self._workspace = self.cp.empty(_cublas.WORKSPACE_BYTES, dtype=np.uint8)
            blas = _cublas.Cublas(lib, self._workspace.data.ptr, _cublas.WORKSPACE_BYTES)
            if levers.get("METRALE_GEMM_TUNE") != "0":
                from metrale.backends import cublaslt as _cublaslt

                try:
                    blas = _cublaslt.LtGemm(_cublaslt.load_libcublaslt(major), blas, self._workspace.data.ptr,
                                            _cublas.WORKSPACE_BYTES, own_gemv=_cublaslt.OwnGemv(self.kernel))
                except (_cublas.CublasError, AttributeError) as e:   # missing library / entry point
                    import logging

                    logging.getLogger("metrale.gemm").warning("cuBLASLt unavailable, plain cublasGemmEx: %s", e)
            self._cublas = blas
        return self._cublas

    _GEMM_TYPES = {BF16: _cublas.CUDA_R_16BF, F32: _cublas.CUDA_R_32F, np.dtype(np.float16): _cublas.CUDA_R_16F}

    def linear_parts(self, x, w):
        """x @ w.T for a consumer that is add_rms_norm (a layer's last projection): a SplitK of
        fp32 partials when the GEMM tuner's k-split plan beats the plain one for this shape
        (cublaslt.py ksplit_plan: the 9B down projection at 16-64 rows), else linear(x, w).
        The first call of a shape runs plain (and tunes both)."""
        blas = self._blas()
        ksplit = getattr(blas, "ksplit_plan", None)
        if ksplit is None or w.dtype != x.dtype or w.ndim != 2 or x.shape[-1] != w.shape[1]:
            return self.linear(x, w)
        code = self._GEMM_TYPES.get(np.dtype(x.dtype))
        x2, xs = self._rows(x)
        t, k = x2.shape
        n_out = w.shape[0]
        if code is None or _estride(w, 1) != 1:
            return self.linear(x, w)
        plan = ksplit(self.stream_ptr, x2.data.ptr, max(xs, k), w.data.ptr, _estride(w, 0), t, n_out, k, code)
        if plan is None:
            y = self.linear(x, w)
            ksplit(self.stream_ptr, x2.data.ptr, max(xs, k), w.data.ptr, _estride(w, 0), t, n_out, k, code)
            return y      # the first call decides (after linear tuned the plain plan); this one is plain
        parts = self._new((KSPLIT_S, t, n_out), F32)
        blas.run_ksplit(plan, self.stream_ptr, x2.data.ptr, w.data.ptr, parts.data.ptr)
        return SplitK(parts, (*x.shape[:-1], n_out), x.dtype)

    def lm_head(self, x, w):
        return self.linear(x, w, out_dtype=F32)

    def linear(self, x, w, bias=None, out_dtype=None):
        """y = x @ w.T (+ bias) via cuBLAS(Lt) or our GEMVs, fp32 compute, output in x's dtype
        (or fp32 with out_dtype=F32: the lm head)."""
        if w.dtype != x.dtype:
            raise TypeError(f"linear: x is {x.dtype} but w is {w.dtype}; convert one with ops.asarray")
        code = self._GEMM_TYPES.get(np.dtype(x.dtype))
        if code is None:
            raise TypeError(f"linear supports bfloat16, float16 and float32, got {x.dtype}")
        y_dtype = np.dtype(x.dtype if out_dtype is None else out_dtype)
        y_code = self._GEMM_TYPES.get(y_dtype)
        if y_code is None or (y_dtype != x.dtype and y_dtype != F32):
            raise TypeError(f"linear: output {y_dtype} from {x.dtype} inputs (x's dtype or float32 only)")
        lead = x.shape[:-1]
        x2, xs = self._rows(x)
        t, k = x2.shape
        n_out = w.shape[0]
        if w.ndim != 2 or w.shape[1] != k:
            raise ValueError(f"linear: x [..., {k}] does not match w {tuple(w.shape)} (expected [out, {k}])")
        if _estride(w, 1) != 1 and k > 1:
            w = self.cp.ascontiguousarray(w)
        wld = _estride(w, 0) if n_out > 1 else k
        y = self._new((t, n_out), y_dtype)
        if t and n_out:
            self._blas().gemm_rowmajor_xwT(self.stream_ptr, x2.data.ptr, max(xs, k), w.data.ptr, max(wld, k),
                                           y.data.ptr, n_out, t, n_out, k, code, False, y_code)
            if bias is not None:
                b = bias if bias.dtype == y.dtype else bias.astype(y.dtype)
                self.kernel("elementwise", f"bias_add_{self._suffix(y)}")(
                    (self._grid1d(t * n_out),), (256,), (_ptr(y), _ptr(b), np.int64(t), np.int32(n_out)))
        return y.reshape(*lead, n_out)

    # -- attention -------------------------------------------------------------------------
    def _head_norm_rope(self, x, w, eps, offset, positions, inv_freq, rot):
        x = self._heads(x)
        t, nh, d = x.shape
        out = self._new((t, nh, d), x.dtype)
        if t * nh:
            if w is not None and w.dtype != x.dtype:
                w = w.astype(x.dtype)
            if inv_freq is not None and inv_freq.dtype != F32:
                inv_freq = inv_freq.astype(F32)
            warps = 8
            self.kernel("elementwise", f"head_norm_rope_{self._suffix(x)}")(
                (-(-t * nh // warps),), (32 * warps,),
                (_ptr(x), np.int64(_estride(x, 0)), np.int64(_estride(x, 1)), _ptr(out), np.int64(nh * d),
                 np.int64(d), np.int32(t), np.int32(nh), np.int32(d), _ptr(w), np.float32(eps),
                 np.float32(offset), _ptr(positions), _ptr(inv_freq), np.int32(rot)),
                shared_mem=warps * d * 4)
        return out

    def head_rms_norm(self, x, w, eps, offset):
        shape = x.shape
        return self._head_norm_rope(x, w, eps, offset, None, None, 0).reshape(shape)

    def rope(self, q, k, positions, inv_freq, rotary_dim):
        """Returns new contiguous (q, k); the inputs are left untouched."""
        pos = self._dev(positions)
        inv = self._dev_f32(inv_freq)
        qs, ks = q.shape, k.shape
        return (self._head_norm_rope(q, None, 0.0, 0.0, pos, inv, rotary_dim).reshape(qs),
                self._head_norm_rope(k, None, 0.0, 0.0, pos, inv, rotary_dim).reshape(ks))

    def _dev_f32(self, a):
        if isinstance(a, self.cp.ndarray):
            return a if a.dtype == F32 else a.astype(F32)
        return self.cp.asarray(np.asarray(a, dtype=np.float32))

    def write_kv(self, k, v, k_cache, v_cache, batch):
        k, v = self._heads(k), self._heads(v)
        t, hk, d = k.shape
        if not (k.dtype == v.dtype == k_cache.dtype == v_cache.dtype):
            raise TypeError(f"write_kv: k {k.dtype}, v {v.dtype}, caches {k_cache.dtype}/{v_cache.dtype} differ")
        if not (k_cache.flags.c_contiguous and v_cache.flags.c_contiguous):
            raise ValueError("write_kv: the KV caches must be contiguous [blocks, block_size, Hk, D]")
        slots = self._dev(batch.slot_mapping)
        n = 16 // k.itemsize
        vec = int(d % n == 0 and all(_estride(a, i) % n == 0 for a in (k, v) for i in (0, 1)) and
                  _aligned(k, v, k_cache, v_cache))
        work = t * hk * (d // n if vec else d)
        if work:
            self.kernel("elementwise", f"write_kv_{self._suffix(k)}")(
                (self._grid1d(work),), (256,),
                (_ptr(k), np.int64(_estride(k, 0)), np.int64(_estride(k, 1)), _ptr(v), np.int64(_estride(v, 0)),
                 np.int64(_estride(v, 1)), _ptr(k_cache), _ptr(v_cache), _ptr(slots), np.int64(t), np.int32(hk),
                 np.int32(d), np.int32(vec)))

    def qk_norm_rope_write_kv(self, q, k, v, q_norm_w, k_norm_w, eps, offset, positions, inv_freq,
                              rotary_dim, k_cache, v_cache, batch):
        """head_rms_norm (q, k; when the weights are given) + rope + write_kv in one launch
        (qk_norm_rope_kv_<dtype>: one warp per (token, head) of the Hq + Hk heads), bit-identical
        to the unfused kernels. Returns the new contiguous q [T, Hq, D]. Cases the kernel does
        not cover (mixed dtypes, odd shapes, non-contiguous caches) take the composed path."""
        q, k, v = self._heads(q), self._heads(k), self._heads(v)
        t, hq, d = q.shape
        hk = k.shape[1]
        rot = int(rotary_dim)
        dt = np.dtype(q.dtype)
        ok = (dt in _SUFFIX and k.dtype == dt and v.dtype == dt and k_cache.dtype == dt and v_cache.dtype == dt
              and tuple(k.shape) == (t, hk, d) and tuple(v.shape) == (t, hk, d)
              and k_cache.ndim >= 2 and tuple(k_cache.shape[-2:]) == (hk, d)
              and tuple(v_cache.shape) == tuple(k_cache.shape)
              and k_cache.flags.c_contiguous and v_cache.flags.c_contiguous
              and 0 <= rot <= d and rot % 2 == 0 and positions is not None
              and all(a.strides[i] >= 0 and a.strides[i] % a.itemsize == 0 for a in (q, k, v) for i in (0, 1))
              and all(w is None or tuple(w.shape) == (d,) for w in (q_norm_w, k_norm_w)))
        if not ok:
            return compose_qk_norm_rope_write_kv(self, q, k, v, q_norm_w, k_norm_w, eps, offset, positions,
                                                 inv_freq, rotary_dim, k_cache, v_cache, batch)
        q_out = self._new((t, hq, d), dt)
        if t == 0:
            return q_out
        qw = q_norm_w if q_norm_w is None or q_norm_w.dtype == dt else q_norm_w.astype(dt)
        kw = k_norm_w if k_norm_w is None or k_norm_w.dtype == dt else k_norm_w.astype(dt)
        pos = self._dev(positions)
        inv = self._dev_f32(inv_freq) if rot else None
        slots = self._dev(batch.slot_mapping)
        warps = 8
        self.kernel("elementwise", f"qk_norm_rope_kv_{_SUFFIX[dt]}")(
            (-(-t * (hq + hk) // warps),), (32 * warps,),
            (_ptr(q), np.int64(_estride(q, 0)), np.int64(_estride(q, 1)),
             _ptr(k), np.int64(_estride(k, 0)), np.int64(_estride(k, 1)),
             _ptr(v), np.int64(_estride(v, 0)), np.int64(_estride(v, 1)),
             _ptr(q_out), _ptr(k_cache), _ptr(v_cache), _ptr(slots), np.int32(t), np.int32(hq), np.int32(hk),
             np.int32(d), _ptr(qw), _ptr(kw), np.float32(eps), np.float32(offset), _ptr(pos), _ptr(inv),
             np.int32(rot)),
            shared_mem=warps * d * 4)
        return q_out

    def attention(self, q, k_cache, v_cache, batch, scale):
        cp = self.cp
        q = self._heads(q)
        t, hq, d = q.shape
        _, bs, hk, dc = k_cache.shape
        if dc != d or hq % hk:
            raise ValueError(f"attention: q [T, {hq}, {d}] does not fit the cache [.., {bs}, {hk}, {dc}]")
        if d not in ATTN_MMA_BN:
            raise NotImplementedError(f"attention: head_dim {d} not instantiated (have {sorted(ATTN_MMA_BN)})")
        if not (q.dtype == k_cache.dtype == v_cache.dtype == BF16):
            raise TypeError("attention runs on bfloat16 q and caches")
        if _estride(q, 0) % 8 or _estride(q, 1) % 8 or not _aligned(q):
            q = cp.ascontiguousarray(q)
        g = hq // hk
        out = self._new((t, hq, d), BF16)
        if t == 0:
            return out
        if not isinstance(batch.query_start_loc, cp.ndarray):
            batch = self.upload_batch(batch)
        scale_log2 = np.float32(scale * 1.4426950408889634)
        bt = batch.block_tables
        m = bt.shape[1]
        common = (_ptr(q), np.int64(_estride(q, 0)), np.int64(_estride(q, 1)), _ptr(k_cache), _ptr(v_cache),
                  _ptr(bt), np.int32(m), _ptr(batch.seq_lens), _ptr(batch.query_start_loc))
        if batch.is_decode:
            b = t
            nh = 1 if g <= 8 else 2                    # n-tiles of 8 q heads per CTA
            nchunks = -(-g // (8 * nh))
            stages = ATTN_MMA_DECODE_STAGES[d]
            smem = max(ATTN_MMA_DECODE_WARPS * stages * 2 * ATTN_MMA_DECODE_TILE * (d + 8) * 2,
                       ATTN_MMA_DECODE_WARPS * 8 * nh * (d + 2) * 4)
            resident = max(1, (228 * 1024) // (smem + 1024))
            part = self._decode_partition(b * hk * nchunks, m * bs, 2 * resident)
            nparts = max(1, -(-(m * bs) // part))  # from shapes only: graph-safe
            if nparts > 1:
                part_o = cp.empty((b, hq, nparts, d), dtype=F32)
                part_m = cp.empty((b, hq, nparts), dtype=F32)
                part_l = cp.empty((b, hq, nparts), dtype=F32)
            else:
                part_o = part_m = part_l = None
            tail = (_ptr(out), _ptr(part_o), _ptr(part_m), _ptr(part_l), np.int32(hk), np.int32(g))
            self.kernel("attention", f"decode_mma_d{d}_h{nh}", smem)(
                (b, hk * nchunks, nparts), (32 * ATTN_MMA_DECODE_WARPS,),
                common + tail + (np.int32(nchunks), np.int32(bs), np.int32(part), np.int32(nparts),
                                 scale_log2),
                shared_mem=smem)
            if nparts > 1:
                self.kernel("attention", "decode_reduce")(
                    (b, hq), (min(d, 256),),
                    (_ptr(part_o), _ptr(part_m), _ptr(part_l), _ptr(batch.seq_lens), _ptr(batch.query_start_loc),
                     _ptr(out), np.int32(hq), np.int32(d), np.int32(part), np.int32(nparts)))
            return out
        rows, threads, bn = ATTN_MMA_ROWS, ATTN_MMA_THREADS, ATTN_MMA_BN[d]
        smem = (rows + 4 * bn) * (d + 8) * 2
        fn = f"prefill_mma_d{d}"
        bq = self.prefill_tile_tokens(hq, hk, d)
        work = self._work_list(batch, bq)
        self.kernel("attention", fn, smem)(
            (work.shape[0], hk), (threads,),
            common + (_ptr(work), _ptr(out), np.int32(hk), np.int32(g), np.int32(bq), np.int32(bs), scale_log2),
            shared_mem=smem)
        return out

    def _decode_partition(self, groups: int, max_keys: int, ctas_per_sm: int = 4) -> int:
        """Keys per decode CTA: enough partitions for ~`ctas_per_sm` CTAs per SM, at least 64
        keys and a multiple of 64; at most 4096 (4 warps, each its own pipeline, so long
        partitions stay parallel). Depends on shapes only (graph-safe)."""
        if self.part_tokens:
            return int(self.part_tokens)
        cap = 4096
        per = -(-groups * max_keys // (ctas_per_sm * self.sm_count))
        return int(min(cap, max(64, -(-per // 64) * 64)))

    def _work_list(self, batch: ForwardBatch, bq: int):
        """int32 [nwork, 2] (sequence, first new-token index) tiles of `bq` query tokens
        (metrale.forward.prefill_work_list), built on the host from the batch's host copy (one
        small upload per batch and tile size). A captured step graph's batch carries its own
        fixed-size lists in `batch.work` ({bq: device array}, padded with no-op items)."""
        static = getattr(batch, "work", None)
        if static is not None:
            if bq not in static:
                raise ValueError(f"attention: the batch's work lists are for tiles {sorted(static)}, "
                                 f"this layer needs {bq}")
            return static[bq]
        cache = getattr(batch, "_work", None)
        if cache is None:
            cache = batch._work = {}
        if bq not in cache:
            host = _host_of(batch)
            if host is not None:
                qsl, seq_lens = host.query_start_loc, host.seq_lens
            else:  # a sync: only without .host
                qsl, seq_lens = self.cp.asnumpy(batch.query_start_loc), self.cp.asnumpy(batch.seq_lens)
            cache[bq] = self.cp.asarray(prefill_work_list(qsl, seq_lens, bq))
        return cache[bq]

    def prefill_tile_tokens(self, n_heads: int, n_kv_heads: int, head_dim: int) -> int:
        """Query tokens per work item of the prefill attention kernel for this head shape (the
        `bq` of its work list)."""
        rows = ATTN_MMA_ROWS
        g = n_heads // n_kv_heads
        if head_dim not in ATTN_MMA_BN:
            raise NotImplementedError(f"attention: head_dim {head_dim} not instantiated (have {sorted(ATTN_MMA_BN)})")
        if g > rows:
            raise NotImplementedError(f"attention: {g} q heads per kv head (at most {rows})")
        return rows // g

    # -- Gated DeltaNet and MoE: metrale.backends.cuda_gdn (kernels_cuda/gdn*.cu, moe.cu) -----
    def _gdn(self, fn: str):
        try:
            from metrale.backends import cuda_gdn
        except ImportError as e:
            raise NotImplementedError(
                f"CudaOps.{fn} is implemented in metrale/backends/cuda_gdn.py (GDN/MoE kernels), which "
                f"could not be imported: {e}") from e
        impl = getattr(cuda_gdn, fn, None)
        if impl is None:
            raise NotImplementedError(f"metrale.backends.cuda_gdn has no {fn}() yet")
        return impl

    def causal_conv1d(self, x, weight, conv_state, batch):
        return self._gdn("causal_conv1d")(self, x, weight, conv_state, batch)

    def gdn_gates(self, a, b, A_log, dt_bias):
        return self._gdn("gdn_gates")(self, a, b, A_log, dt_bias)

    def gated_delta_rule(self, q, k, v, g, beta, ssm_state, batch):
        return self._gdn("gated_delta_rule")(self, q, k, v, g, beta, ssm_state, batch)

    def gated_delta_rule_with_gates(self, q, k, v, a, b, A_log, dt_bias, ssm_state, batch):
        return self._gdn("gated_delta_rule_with_gates")(self, q, k, v, a, b, A_log, dt_bias, ssm_state,
                                                         batch)

    def gated_rms_norm(self, x, z, w, eps):
        return self._gdn("gated_rms_norm")(self, x, z, w, eps)

    def moe(self, x, router_w, gate_up, down, top_k, renormalize, shared=False):
        return self._gdn("moe")(self, x, router_w, gate_up, down, top_k, renormalize, shared)
