"""The CUDA backend: cupy arrays + our kernels (kernels_cuda/*.cu) + cuBLAS through ctypes.

`CudaOps` is a small facade: it owns the device, the kernel cache (kernels.py), the output
allocator, the batch upload and the layout helpers, and binds the ops of each family module as
its methods (elementwise.py, attention.py, gdn.py, moe.py, gemm/); each of those mirrors one
kernels_cuda/ source and declares its entry points there.

Storage is bf16 as cupy arrays of dtype `ml_dtypes.bfloat16` (CuPy 14 accepts that dtype; the
kernels see the same 2-byte bits as `__nv_bfloat16`). fp32 inputs run the `_f32` twin of each
elementwise kernel; attention and MoE are bf16 only. Every op is graph-capturable: no host
syncs, no `.get()`, outputs from `cupy.empty` (the runner captures with a private memory pool),
cuBLAS through our own handle (gemm/cublas.py). FP8 / NVFP4 checkpoint weights come out of
`asarray` packed (gemm/quant.py QWeight / PartsWeight), never as a bf16 copy; `linear` takes
them like any weight. The exception is attention over a batch that is
not pure decode (prefill / mixed): it builds its work list from the host copy of the batch that
`upload_batch` keeps, so prefill steps are not captured (unless the step graphs supply lists).
"""
from __future__ import annotations

import logging

import numpy as np

from metrale import levers
from metrale.backends.base import EngineGraphs, Ops
from metrale.backends.cuda import attention as _attention
from metrale.backends.cuda import elementwise as _elementwise
from metrale.backends.cuda import gdn as _gdn
from metrale.backends.cuda import gemm as _gemm
from metrale.backends.cuda.gemm import quant as _gemm_quant
from metrale.backends.cuda import moe as _moe
from metrale.backends.cuda.device import CudaDevice
from metrale.backends.cuda.kernels import KernelCache, LaunchContext
from metrale.backends.cuda.layout import BF16, F32, SUFFIX
from metrale.backends.cuda.layout import estride as _estride
from metrale.forward import ForwardBatch
from metrale.models.quant import is_quantized

log = logging.getLogger("metrale.engine_core")


class CudaOps(Ops):
    """cupy + kernels_cuda implementation of metrale.backends.base.Ops."""

    name = "cuda"

    def __init__(self, device: int | None = None, dtype=BF16, part_tokens: int | None = None):
        import cupy

        self.cp = cupy
        self.device = CudaDevice(cupy, device)     # made current
        self.dtype = np.dtype(dtype)
        self.arch = str(self.device.compute_capability)
        self.launch = LaunchContext()       # PDL state of this device's launches (kernels.py)
        self.kernels = KernelCache(self.arch, launch=self.launch)
        self.sm_count = cupy.cuda.runtime.getDeviceProperties(self.device.id)["multiProcessorCount"]
        self.part_tokens = part_tokens      # flash-decoding partition (keys per CTA); None = adaptive
        self.poison = levers.get("METRALE_CUDA_POISON") == "1"  # NaN-fill new outputs (tests)
        self._cublas = None
        self._smem_set: set = set()
        self._staging: list = []            # pinned upload buffers, with their copy-done events
        self._staging_next = 0

    # -- what the engine builds on this device (base.Ops) -------------------------------------
    def device_sampler(self, vocab_size: int, max_batch: int, num_slots: int, seed: int):
        from metrale.backends.cuda.sampling import GpuSampler

        return GpuSampler(self, vocab_size, max_batch=max_batch, num_slots=num_slots, seed=seed)

    def capture_graphs(self, model, caches, config, spare_block: int, spare_slot: int,
                       speculation=None) -> EngineGraphs:
        from metrale.backends.cuda.capture import capture_engine_graphs

        return capture_engine_graphs(self, model, caches, config, spare_block, spare_slot,
                                     speculation)

    def close(self) -> None:
        """The cuBLAS / cuBLASLt handles destroyed (a hot swap builds new ops; the old handles
        would leak)."""
        handle, self._cublas = self._cublas, None
        if handle is None:
            return
        try:
            self.device.synchronize()
            handle.close()
        except Exception as e:  # noqa: BLE001 - a broken context: nothing left to give back
            log.warning("closing the cuBLAS handles: %s", e)

    # -- kernel access (the op-family modules launch through it) ------------------------------
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
            return SUFFIX[np.dtype(a.dtype)]
        except KeyError:
            raise TypeError(f"CudaOps supports bfloat16 and float32 arrays, got {a.dtype}") from None

    def _grid1d(self, work: int, threads: int = 256) -> int:
        return max(1, min((work + threads - 1) // threads, self.sm_count * 16))

    def _new(self, shape, dtype):
        out = self.cp.empty(shape, dtype=dtype)
        if self.poison:
            self.launch.foreign()   # a CuPy fill: the next kernel must not start before it
            out.view(np.uint8 if np.dtype(dtype).itemsize == 1 else
                     {2: np.uint16, 4: np.uint32, 8: np.uint64}[np.dtype(dtype).itemsize]).fill(
                {1: 0xFF, 2: 0x7FC0, 4: 0x7FC00000, 8: 0x7FF8000000000000}[np.dtype(dtype).itemsize])
        return out

    @property
    def stream_ptr(self) -> int:
        return self.cp.cuda.get_current_stream().ptr

    # -- data movement ---------------------------------------------------------------------
    def asarray(self, x, dtype=None):
        if is_quantized(x):     # FP8 / NVFP4: uploaded packed, never a bf16 copy (gemm/quant.py)
            w = _gemm_quant.upload(self, x)
            _gemm_quant.ensure_scratch(self, w)
            return w
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
        self.launch.foreign()       # a memset (see _new)
        return self.cp.zeros(shape, dtype=dtype or self.dtype)

    _BATCH_FIELDS = ("input_ids", "positions", "query_start_loc", "seq_lens", "block_tables",
                     "slot_mapping", "state_slots", "logits_indices")

    def upload_batch(self, batch: ForwardBatch) -> ForwardBatch:
        """One pinned staging buffer -> one async H2D copy -> int32 device views (state_out too
        when the batch has one: a verify step; None stays None). The host batch stays reachable
        as `.host` (prefill attention builds its work list from it)."""
        fields = self._BATCH_FIELDS if batch.state_out is None else self._BATCH_FIELDS + ("state_out",)
        host = [np.ascontiguousarray(getattr(batch, f), dtype=np.int32) for f in fields]
        dev = self.upload_int32(*host)
        views, off = [], 0
        for a in host:
            views.append(dev[off: off + a.size].reshape(a.shape))
            off += a.size
        out = ForwardBatch(**dict(zip(fields, views)), block_size=batch.block_size)
        out.host = batch
        return out

    def upload_int32(self, *arrays):
        """Host int32 arrays, concatenated, into one new device array by an asynchronous copy
        from a pinned staging buffer on the current stream (a pageable copy would wait for the
        device)."""
        cp = self.cp
        total = max(1, sum(a.size for a in arrays))
        stage, done = self._staging_buffer(total)
        done.synchronize()  # the previous copy out of this buffer has finished (normally long ago)
        off = 0
        for a in arrays:
            stage[off: off + a.size] = a.ravel()
            off += a.size
        dev = cp.empty(total, dtype=np.int32)
        stream = cp.cuda.get_current_stream()
        dev.set(stage[:total], stream=stream)
        done.record(stream)
        return dev

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

    def _dev_f32(self, a):
        if isinstance(a, self.cp.ndarray):
            return a if a.dtype == F32 else a.astype(F32)
        return self.cp.asarray(np.asarray(a, dtype=np.float32))

    # -- the op families (each function takes this instance first) ----------------------------
    embedding = _elementwise.embedding
    copy_rows = _elementwise.copy_rows
    rms_norm = _elementwise.rms_norm
    add_rms_norm = _elementwise.add_rms_norm
    silu_mul = _elementwise.silu_mul
    sigmoid_mul = _elementwise.sigmoid_mul
    head_rms_norm = _elementwise.head_rms_norm
    rope = _elementwise.rope
    write_kv = _elementwise.write_kv
    qk_norm_rope_write_kv = _elementwise.qk_norm_rope_write_kv
    linear = _gemm.linear
    linear_parts = _gemm.linear_parts
    lm_head = _gemm.lm_head
    _blas = _gemm.blas
    attention = _attention.attention
    prefill_tile_tokens = _attention.prefill_tile_tokens
    causal_conv1d = _gdn.causal_conv1d
    gdn_gates = _gdn.gdn_gates
    gated_delta_rule = _gdn.gated_delta_rule
    gated_delta_rule_with_gates = _gdn.gated_delta_rule_with_gates
    gated_rms_norm = _gdn.gated_rms_norm
    moe = _moe.moe
