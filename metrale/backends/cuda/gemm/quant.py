"""FP8 and NVFP4 weights on the CUDA backend: uploaded packed, multiplied packed.

`upload` turns a metrale.models.quant QuantizedTensor (or StackedParts) into its device form —
`QWeight`: the packed codes and the scales in the layouts of kernels_cuda/gemv_quant.cu, nothing
dequantised. `linear` runs y = x @ dequant(w)^T:

  * steps of at most QUANT_GEMV_MAX_ROWS rows (decode): the weight-only GEMVs of gemv_quant.cu,
    in chunks of 8 rows, streaming the packed bytes: the CUDA-core gemvq_<fp8|nvfp4>_t<T>_r<R>
    (v1, the default) and, with METRALE_QUANT_GEMV=v2, also the tensor-core
    gemvq_<fp8|nvfp4>_t8_w<NW> (weights as the mma's A operand) where they apply; up to
    QUANT_MMA_MAX_ROWS the tensor-core GEMMs gemmq_*. Each config (kernel, tile, k split) is
    timed once per shape on its first eager call (_plan) and the fastest kept;
  * larger steps (prefill), block-FP8 weights (128 x 128 scales): W8A8 on FP8 tensor cores
    (gemm/fp8_lt.py: x quantized per row and 128 columns by quant_act_fp8, cuBLASLt's block-
    scaled FP8 matmul); METRALE_FP8_W8A8=0 turns it off;
  * other prefill steps: the weight dequantised into one bf16 scratch buffer (dequant_*_bf16,
    the weight's bytes read once and n*k*2 written), then the bf16 cuBLAS(Lt) GEMM of
    gemm.linear.

StackedParts (quantized rows beside bf16 rows, or parts of different scale layouts) become a
`PartsWeight`: each part writes its own columns of one output.
MoE experts (3-D) are refused until the expert kernels read them packed.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import metrale.backends.cuda.gemm as _gemm     # blas, GEMM_TYPES (this module is imported by it)
from metrale import levers
from metrale.backends.cuda.elementwise import bias_add
from metrale.backends.cuda.gemm.cublaslt import LtGemm, _capturing
from metrale.backends.cuda.gemm.fp8_lt import Fp8BlockLt
from metrale.backends.cuda.kernels import declare
from metrale.backends.cuda.layout import BF16, F32
from metrale.models.checkpoint import CheckpointError
from metrale.models.quant import QuantizedTensor, StackedParts

GEMVQ_WARPS = 4
GEMVQ_T = (1, 2, 4, 8)
GEMVQ_R = (2, 4)
GEMVQ_KS_LOG2 = (0, 1, 2)
# rows up to which the decode kernels run; beyond, the dequantise + bf16 GEMM path. The GEMVs
# in chunks of 8 re-read the weight per chunk: on the H200 (perf/quant_gemv.py, e44b90a) 16 rows
# that way took 0.8x the dequantise path and 32 rows 1.6x, so the GEMV-only layouts stop at 16.
QUANT_MMA_MAX_ROWS = 64
QUANT_GEMV_MAX_ROWS = 16
GEMMQ_MT = (1, 2, 4)
GEMMQ_NW = (2, 4)
GEMVQT_NW = (1, 2)       # 16-row tiles per warp of gemvq_*_t8_w<NW> (v2)
QUANT_GEMV_VARIANTS = ("v1", "v2")
_WIDE = 30          # a log2 block size that covers every row / column (per tensor, per channel)

_GEMVQ_ARGS = ("const bf16* x, long long x_ld, const uint8_t* w, long long w_ld, const void* s, long long s_ld, "
               "int s_rlog2, int s_clog2, const float* g, O* y, long long y_ld, int nt, int n, int k, int ks_log2")
declare("gemv_quant", "gemvq_{}_t{}_r{}", _GEMVQ_ARGS)          # y bf16
declare("gemv_quant", "gemvq_{}_t{}_r{}_f32", _GEMVQ_ARGS)      # y fp32
declare("gemv_quant", "gemvq_{}_t{}_w{}", _GEMVQ_ARGS)          # y bf16 (v2: tensor cores)
declare("gemv_quant", "gemvq_{}_t{}_w{}_f32", _GEMVQ_ARGS)      # y fp32
declare("gemv_quant", "gemmq_{}_m{}_w{}", _GEMVQ_ARGS)          # y bf16
declare("gemv_quant", "gemmq_{}_m{}_w{}_f32", _GEMVQ_ARGS)      # y fp32
declare("gemv_quant", "quant_act_fp8", "const bf16* x, long long x_ld, uint8_t* q, float* qs, int m, int k")
declare("gemv_quant", "dequant_{}_bf16",
        "const uint8_t* w, long long w_ld, const void* s, long long s_ld, int s_rlog2, int s_clog2, "
        "const float* g, bf16* out, int n, int k")


@dataclass(eq=False)
class QWeight:
    """A quantized [n, k] weight on the device (kernels_cuda/gemv_quant.cu's layouts)."""
    format: str                  # "fp8" | "nvfp4"
    shape: tuple[int, int]
    data: object                 # uint8 [n, k] (fp8) | [n, k / 2] (nvfp4)
    scale: object                # fp32 [ceil(n / 2^s_rlog2), ceil(k / 2^s_clog2)] | uint8 e4m3 [n, k / 16]
    global_scale: object | None  # fp32 [n] (nvfp4)
    s_rlog2: int
    s_clog2: int
    scheme: str

    ndim = 2

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes + self.scale.nbytes +
                   (0 if self.global_scale is None else self.global_scale.nbytes))

    @property
    def s_ld(self) -> int:
        return int(self.scale.shape[1])


@dataclass(eq=False)
class PartsWeight:
    """Row blocks of one [n, k] weight in different forms (QWeight or bf16 arrays)."""
    parts: tuple
    shape: tuple[int, int]

    ndim = 2

    @property
    def nbytes(self) -> int:
        return int(sum(p.nbytes for p in self.parts))

    @property
    def scheme(self) -> str:
        return " + ".join(sorted({getattr(p, "scheme", "bf16") for p in self.parts}))


def is_device_quantized(w) -> bool:
    return isinstance(w, (QWeight, PartsWeight))


def _log2_block(size: int, extent: int) -> int | None:
    if size >= extent:
        return _WIDE
    return size.bit_length() - 1 if size & (size - 1) == 0 else None


def upload(ops, x) -> QWeight | PartsWeight:
    """The device form of a QuantizedTensor / StackedParts (see the module docstring)."""
    if isinstance(x, StackedParts):
        parts = tuple(upload(ops, p) if isinstance(p, (QuantizedTensor, StackedParts))
                      else ops.asarray(p) for p in x.parts)
        return PartsWeight(parts, tuple(int(d) for d in x.shape))
    cp = ops.cp
    if x.ndim != 2:
        raise CheckpointError(
            f"{x.scheme} MoE expert weights {tuple(x.shape)} on CUDA: the expert kernels do not read "
            f"FP8/NVFP4 in this build yet; serve this checkpoint with --device cpu")
    n, k = (int(d) for d in x.shape)
    data = cp.asarray(_u8(x.data))
    if x.format == "fp8":
        if k % 16:
            raise CheckpointError(f"{x.scheme} weight {x.shape}: FP8 on CUDA needs k % 16 == 0")
        br, bc = int(x.block[0]), int(x.block[1])
        scale = np.asarray(x.scale if not hasattr(x.scale, "get") else x.scale.get()).astype(np.float32)
        rl, cl = _log2_block(br, n), _log2_block(bc, k)
        if rl is None:                     # rows of any block height: one scale row per weight row
            scale, rl = np.repeat(scale, br, 0)[:n], 0
        if cl is None or cl < 4:           # columns: a scale per 16-column vector
            if bc % 16:
                raise CheckpointError(f"{x.scheme} weight {x.shape}: scale blocks of {bc} columns are "
                                      f"not a multiple of 16 (not supported on CUDA)")
            scale, cl = np.repeat(scale, bc // 16, 1)[:, : k // 16], 4
        return QWeight("fp8", (n, k), data, cp.asarray(np.ascontiguousarray(scale)), None, rl, cl, x.scheme)
    if x.format == "nvfp4":
        if k % 32 or tuple(x.block) != (1, 16):
            raise CheckpointError(f"{x.scheme} weight {x.shape}: NVFP4 on CUDA needs k % 32 == 0 and "
                                  f"one scale per 16 columns (got block {x.block})")
        scale = cp.asarray(_u8(x.scale))
        if x.global_scale is None:
            raise CheckpointError(f"{x.scheme} weight {x.shape}: NVFP4 without its global scale")
        g = cp.asarray(x.global_scale, dtype=cp.float32).reshape(n)
        return QWeight("nvfp4", (n, k), data, cp.ascontiguousarray(scale), cp.ascontiguousarray(g), 0, 0, x.scheme)
    raise CheckpointError(f"{x.scheme}: format {x.format!r} has no CUDA kernel")


def _u8(a):
    """The bytes of a code / e4m3 array as uint8 (numpy e4m3, or device uint8 from dummy loads)."""
    if hasattr(a, "get"):                  # already a device array (synthetic checkpoints)
        return a if a.dtype == np.uint8 else a.view(np.uint8)
    return np.ascontiguousarray(np.asarray(a).view(np.uint8))


def ensure_scratch(ops, w) -> None:
    """The bf16 buffer prefill dequantises into, grown at upload time (never inside a capture)."""
    need = max((p.shape[0] * p.shape[1] for p in (w.parts if isinstance(w, PartsWeight) else (w,))
                if isinstance(p, QWeight)), default=0)
    cur = getattr(ops, "_qscratch", None)
    if cur is None or cur.size < need:
        ops._qscratch = ops.cp.empty(need, dtype=BF16)


# -- the decode kernels -------------------------------------------------------------------------
# a config: ("gemv", R, ks_log2) | ("tc", NW, ks_log2) | ("mma", NW, ks_log2)

def variant() -> str:
    """METRALE_QUANT_GEMV: which decode kernels the tuner may pick for 1-8 rows."""
    v = levers.get("METRALE_QUANT_GEMV")
    if v not in QUANT_GEMV_VARIANTS:
        raise ValueError(f"METRALE_QUANT_GEMV={v!r}: one of {', '.join(QUANT_GEMV_VARIANTS)}")
    return v


def mma_applies(w: QWeight) -> bool:
    """Whether the tensor-core decode GEMMs (gemmq_*) read this weight (see gemv_quant.cu)."""
    n, k = w.shape
    if w.format == "nvfp4":
        return k % 128 == 0
    return k % 64 == 0 and (w.s_clog2 >= _WIDE or (w.s_clog2 >= 6 and w.s_rlog2 >= 3))


def tc_applies(w: QWeight) -> bool:
    """Whether the weights-as-A tensor-core GEMVs (gemvq_*_t8_w*) read this weight."""
    k = w.shape[1]
    if w.format == "nvfp4":
        return k % 128 == 0
    return k % 64 == 0 and w.s_clog2 >= 6


def _configs(fmt: str, k: int, nt: int = 1, mma: bool = False, tc: bool = False) -> list[tuple]:
    out = []
    if nt <= GEMVQ_T[-1]:
        kv = k // (32 if fmt == "nvfp4" else 16)
        out += [("gemv", r, ks) for r in GEMVQ_R for ks in GEMVQ_KS_LOG2 if ks == 0 or kv > (32 << (ks - 1))]
        if tc:
            chunks = k // (128 if fmt == "nvfp4" else 64)
            out += [("tc", nw, ks) for nw in GEMVQT_NW for ks in GEMVQ_KS_LOG2 if chunks >= 2 << ks]
    if mma:
        chunks = k // (128 if fmt == "nvfp4" else 64)
        out += [("mma", nw, ks) for nw in GEMMQ_NW for ks in GEMVQ_KS_LOG2 if ks == 0 or chunks >= 2 << ks]
    return out


def _default_config(w: QWeight, nt: int, mma: bool, tc: bool = False) -> tuple:
    n, k = w.shape
    if tc and nt <= GEMVQ_T[-1]:
        chunks = k // (128 if w.format == "nvfp4" else 64)
        return ("tc", 2 if n >= 2 * 16 * 132 * GEMVQ_WARPS else 1, 2 if chunks >= 16 else 1 if chunks >= 4 else 0)
    if mma:
        return ("mma", 4 if n >= 4 * 8 * 4 * 132 else 2, 2 if k >= 4096 else 1)
    kv = k // (32 if w.format == "nvfp4" else 16)
    return ("gemv", 4 if n >= 4 * 132 * GEMVQ_WARPS else 2, 2 if kv >= 256 else 1 if kv >= 64 else 0)


def _launch(ops, w: QWeight, cfg, x, x_ld: int, y, y_ld: int, nt: int, f32: bool) -> None:
    kind, a, ks = cfg
    n, k = w.shape
    sfx = "_f32" if f32 else ""
    if kind == "gemv":
        tv = next(v for v in GEMVQ_T if v >= nt)
        fn = ops.kernel("gemv_quant", f"gemvq_{w.format}_t{tv}_r{a}{sfx}")
        rows_per_cta = a * (GEMVQ_WARPS >> ks)
    elif kind == "tc":
        if nt > GEMVQ_T[-1]:
            raise ValueError(f"gemvq_{w.format}_t8_w{a}: {nt} rows of x (at most {GEMVQ_T[-1]})")
        fn = ops.kernel("gemv_quant", f"gemvq_{w.format}_t{GEMVQ_T[-1]}_w{a}{sfx}")
        rows_per_cta = 16 * a * (GEMVQ_WARPS >> ks)
    else:
        mt = next(v for v in GEMMQ_MT if 16 * v >= nt)
        fn = ops.kernel("gemv_quant", f"gemmq_{w.format}_m{mt}_w{a}{sfx}")
        rows_per_cta = 8 * a * (GEMVQ_WARPS >> ks)
    fn((-(-n // rows_per_cta),), (32 * GEMVQ_WARPS,),
       x=x, x_ld=x_ld, w=w.data, w_ld=int(w.data.shape[1]), s=w.scale, s_ld=w.s_ld, s_rlog2=w.s_rlog2,
       s_clog2=w.s_clog2, g=w.global_scale, y=y, y_ld=y_ld, nt=nt, n=n, k=k, ks_log2=ks)


def tuned_config(ops, w: QWeight, nt: int, f32: bool = False):
    """The config _plan chose for this weight and row count (None before its first eager call)."""
    key = (w.format, _bucket(nt), w.shape, f32, mma_applies(w), variant() == "v2" and tc_applies(w))
    return getattr(ops, "_qtuned", {}).get(key)


def _bucket(nt: int) -> int:
    if nt <= GEMVQ_T[-1]:
        return next(v for v in GEMVQ_T if v >= nt)
    return 16 * next(v for v in GEMMQ_MT if 16 * v >= nt)


def _plan(ops, w: QWeight, nt: int, f32: bool, x, x_ld: int, y, y_ld: int, mma: bool):
    """The fastest config for (format, row bucket, shape, output type): timed on the first eager
    call over every candidate (each writes the same y); inside a capture a default until then."""
    tuned = getattr(ops, "_qtuned", None)
    if tuned is None:
        tuned = ops._qtuned = {}
    tc = variant() == "v2" and tc_applies(w)
    key = (w.format, _bucket(nt), w.shape, f32, mma, tc)
    cfg = tuned.get(key)
    if cfg is not None:
        return cfg
    if _capturing(ops.stream_ptr):
        return _default_config(w, nt, mma, tc)
    cp = ops.cp
    best, best_t = None, None
    for c in _configs(w.format, w.shape[1], nt, mma, tc):
        _launch(ops, w, c, x, x_ld, y, y_ld, nt, f32)     # warm (compile, caches)
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        for _ in range(5):
            _launch(ops, w, c, x, x_ld, y, y_ld, nt, f32)
        end.record()
        end.synchronize()
        t = cp.cuda.get_elapsed_time(start, end)
        if best_t is None or t < best_t:
            best, best_t = c, t
    tuned[key] = best
    return best


def _decode_into(ops, x2, x_ld: int, w: QWeight, y, y_ld: int, f32: bool, mma: bool) -> None:
    """y[:t, :n] = x2 @ w^T by the decode kernels (y a view with row stride y_ld): one launch
    where the tensor-core kernels apply, else the GEMVs 8 rows at a time."""
    t = x2.shape[0]
    step = GEMMQ_MT[-1] * 16 if mma else GEMVQ_T[-1]
    for r0 in range(0, t, step):
        nt = min(step, t - r0)
        xs, ys = x2[r0:r0 + nt], y[r0:r0 + nt]
        cfg = _plan(ops, w, nt, f32, xs, x_ld, ys, y_ld, mma)
        _launch(ops, w, cfg, xs, x_ld, ys, y_ld, nt, f32)


def dequantize(ops, w: QWeight):
    """w as bf16 [n, k] in the scratch buffer (valid until the next dequantize)."""
    n, k = w.shape
    ensure_scratch(ops, w)
    out = ops._qscratch[: n * k].reshape(n, k)
    vecs = n * k // (32 if w.format == "nvfp4" else 16)
    ops.kernel("gemv_quant", f"dequant_{w.format}_bf16")(
        (max(1, min(-(-vecs // 256), ops.sm_count * 8)),), (256,),
        w=w.data, w_ld=int(w.data.shape[1]), s=w.scale, s_ld=w.s_ld, s_rlog2=w.s_rlog2, s_clog2=w.s_clog2,
        g=w.global_scale, out=out, n=n, k=k)
    return out


def w8a8_applies(w: QWeight) -> bool:
    """Block-FP8 weights the W8A8 path multiplies (128 x 128 scale blocks, k % 128 == 0)."""
    return (w.format == "fp8" and w.s_rlog2 == 7 and w.s_clog2 == 7 and w.shape[1] % 128 == 0
            and levers.get("METRALE_FP8_W8A8") != "0")


def _w8a8_into(ops, x2, x_ld: int, w: QWeight, y, y_ld: int, y_code) -> bool:
    """y = x2 @ w^T as W8A8 FP8 (see fp8_lt.py); False when cuBLASLt cannot (nothing written)."""
    lt = _gemm.blas(ops)
    if not isinstance(lt, LtGemm):
        return False
    f8 = getattr(ops, "_fp8lt", None)
    if f8 is None:
        f8 = ops._fp8lt = Fp8BlockLt(lt)
    m, k = x2.shape
    n = w.shape[0]
    x8 = ops.cp.empty((m, k), dtype=np.uint8)
    xs = ops.cp.empty((k // 128, m), dtype=np.float32)     # per 128-column block, rows adjacent
    plan = f8.prepare(m, n, k, y_code, y_ld, y.data.ptr, w.scale.data.ptr, xs.data.ptr)
    if plan is None:
        return False
    ops.kernel("gemv_quant", "quant_act_fp8")(
        (-(-m * (k // 128) // 8),), (256,), x=x2, x_ld=x_ld, q=x8, qs=xs, m=m, k=k)
    f8.run(plan, ops.stream_ptr, w.data.data.ptr, x8.data.ptr, y.data.ptr)
    return True


def _part_into(ops, x2, x_ld: int, p, y, y_ld: int, y_code, f32: bool) -> None:
    t, k = x2.shape
    n = p.shape[0]
    mma = isinstance(p, QWeight) and mma_applies(p)
    if isinstance(p, QWeight) and t <= (QUANT_MMA_MAX_ROWS if mma else QUANT_GEMV_MAX_ROWS):
        _decode_into(ops, x2, x_ld, p, y, y_ld, f32, mma)
        return
    if isinstance(p, QWeight) and w8a8_applies(p) and _w8a8_into(ops, x2, x_ld, p, y, y_ld, y_code):
        return
    wb = dequantize(ops, p) if isinstance(p, QWeight) else p
    if wb.dtype != x2.dtype:
        raise TypeError(f"linear: x is {x2.dtype} but a weight part is {wb.dtype}")
    _gemm.blas(ops).gemm_rowmajor_xwT(ops.stream_ptr, x2.data.ptr, x_ld, wb.data.ptr, int(wb.strides[0] // wb.itemsize),
                                y.data.ptr, y_ld, t, n, k, _gemm.GEMM_TYPES[np.dtype(x2.dtype)], False, y_code)


def linear(ops, x, w, bias=None, out_dtype=None):
    """y = x @ dequant(w)^T (+ bias) for a QWeight / PartsWeight: bf16 x, y bf16 or fp32."""
    if np.dtype(x.dtype) != BF16:
        raise TypeError(f"linear over {w.scheme} weights takes bf16 activations, got {x.dtype}")
    y_dtype = np.dtype(BF16 if out_dtype is None else out_dtype)
    if y_dtype not in (BF16, F32):
        raise TypeError(f"linear over {w.scheme} weights: output {y_dtype} (bf16 or float32 only)")
    n_out, k = w.shape
    lead = x.shape[:-1]
    x2, xs = ops._rows(x)
    t = x2.shape[0]
    if x2.shape[1] != k:
        raise ValueError(f"linear: x [..., {x2.shape[1]}] does not match w {w.shape} (expected [out, {k}])")
    x_ld = max(xs, k)
    if x_ld % 8 or x2.data.ptr % 16:
        x2 = ops.cp.ascontiguousarray(x2)
        x_ld = k
    y = ops._new((t, n_out), y_dtype)
    if t and n_out:
        f32 = y_dtype == F32
        y_code = _gemm.GEMM_TYPES[y_dtype]
        off = 0
        for p in (w.parts if isinstance(w, PartsWeight) else (w,)):
            rows = p.shape[0]
            _part_into(ops, x2, x_ld, p, y[:, off:off + rows], n_out, y_code, f32)
            off += rows
        if bias is not None:
            b = bias if bias.dtype == y.dtype else bias.astype(y.dtype)
            bias_add(ops, y, b, t, n_out)
    return y.reshape(*lead, n_out)
