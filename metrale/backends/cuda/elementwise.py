"""Elementwise ops, norms and the attention prologue of the CUDA backend (kernels_cuda/elementwise.cu).

Each function takes the CudaOps instance first (its kernel cache, output allocator and layout
helpers) and otherwise the metrale.backends.base.Ops signature; CudaOps binds them as its
methods. bf16 and fp32 arrays run the `_bf16` / `_f32` instantiation of each kernel.
"""
from __future__ import annotations

import numpy as np

from metrale.backends.base import compose_qk_norm_rope_write_kv
from metrale.backends.cuda.kernels import declare
from metrale.backends.cuda.kv_quant import write_kv_quant
from metrale.backends.cuda.layout import F32, SplitK
from metrale.backends.cuda.layout import SUFFIX as _SUFFIX
from metrale.backends.cuda.layout import aligned as _aligned
from metrale.backends.cuda.layout import block_for as _block_for
from metrale.backends.cuda.layout import estride as _estride
from metrale.cache.kv_dtypes import is_quantized_kv
from metrale.models.checkpoint import CheckpointError

# kernels_cuda/elementwise.cu, one instantiation per storage type ({} = bf16 | f32)
declare("elementwise", "embedding_{}", "const int* ids, const T* table, T* out, int H, long long V, int vec")
declare("elementwise", "rms_norm_vec_{}", "const T* x, long long xs, const T* res, long long rs, const T* w, "
        "T* out, T* res_out, int H, float eps, float offset")
declare("elementwise", "rms_norm_parts2_{}", "const float* parts, long long ps, const T* res, long long rs, "
        "const T* w, T* out, T* res_out, int H, float eps, float offset")
declare("elementwise", "rms_norm_scalar_{}", "const T* x, long long xs, const T* res, long long rs, "
        "const T* w, T* out, T* res_out, int H, float eps, float offset")
declare("elementwise", "head_norm_rope_{}", "const T* x, long long xs_t, long long xs_h, T* y, long long ys_t, "
        "long long ys_h, int ntok, int nheads, int D, const T* w, float eps, float offset, "
        "const int* positions, const float* inv_freq, int rot")
declare("elementwise", "qk_norm_rope_kv_{}", "const T* q, long long qs_t, long long qs_h, const T* k, "
        "long long ks_t, long long ks_h, const T* v, long long vs_t, long long vs_h, T* q_out, T* k_cache, "
        "T* v_cache, const int* slot_mapping, int ntok, int Hq, int Hk, int D, const T* qw, const T* kw, "
        "float eps, float offset, const int* positions, const float* inv_freq, int rot")
declare("elementwise", "silu_mul_{}", "const T* x, long long xs, T* y, long long rows, int I, int vec")
declare("elementwise", "sigmoid_mul_{}", "const T* x, long long xa, long long xb, const T* g, long long ga, "
        "long long gb, long long gc, T* y, long long A, int B, int C, int vec")
declare("elementwise", "write_kv_{}", "const T* k, long long ks_t, long long ks_h, const T* v, long long vs_t, "
        "long long vs_h, T* k_cache, T* v_cache, const int* slot_mapping, long long ntok, int Hk, int D, int vec")
declare("elementwise", "bias_add_{}", "T* y, const T* b, long long rows, int n")
declare("elementwise", "copy_rows", "const unsigned long long* ptrs, const long long* row_words, "
        "const int* src, const int* dst, int A, int R")


def bias_add(ops, y, b, t: int, n_out: int) -> None:
    """y [t, n_out] += b [n_out] in place."""
    ops.kernel("elementwise", f"bias_add_{ops._suffix(y)}")(
        (ops._grid1d(t * n_out),), (256,), y=y, b=b, rows=t, n=n_out)


def copy_rows(ops, arrays, src, dst) -> None:
    """a[dst[r]] = a[src[r]] for every array of `arrays` (contiguous, first axis = rows) and
    every pair r, in one launch (src and dst rows distinct)."""
    if not arrays or not len(src):
        return
    key = tuple((a.data.ptr, a[0].nbytes) for a in arrays)
    table = _row_tables.get(key)
    if table is None:       # the arrays' addresses and row sizes: once per set of arrays
        for a in arrays:
            if not a.flags.c_contiguous or (a[0].nbytes % 4):
                raise ValueError(f"copy_rows: a contiguous array of whole 4-byte rows, got "
                                 f"{a.shape} {a.dtype}")
        table = _row_tables[key] = (
            ops.cp.asarray(np.array([p for p, _ in key], np.uint64)),
            ops.cp.asarray(np.array([a[0].nbytes // 4 for a in arrays], np.int64)),
            max(a[0].nbytes // 16 for a in arrays))
    ptrs, words, longest = table
    # the row pairs through the ops' pinned staging buffer: an asynchronous copy (a pageable
    # cp.asarray would wait for the device, and the step's host work would stop overlapping it)
    pairs = ops.upload_int32(np.concatenate([np.asarray(src, np.int32), np.asarray(dst, np.int32)]))
    r = len(src)
    grid = (max(1, min(64, -(-longest // 256))), r, len(arrays))
    ops.kernel("elementwise", "copy_rows")(grid, (256,), ptrs=ptrs, row_words=words, src=pairs[:r],
                                           dst=pairs[r:], A=len(arrays), R=r)


_row_tables: dict[tuple, tuple] = {}    # copy_rows' device tables, by the arrays' addresses


def embedding(ops, ids, table):
    if not hasattr(table, "dtype"):     # a quantized table (gemm/quant.py): no gather kernel reads one
        raise CheckpointError(f"a {table.scheme} embedding table {tuple(table.shape)} is not supported on "
                              f"CUDA (only projections may be FP8 / NVFP4)")
    ids = ops._dev(ids)
    table = ops.cp.ascontiguousarray(table)
    t, (v, h) = ids.shape[0], table.shape
    out = ops._new((t, h), table.dtype)
    if t:
        vec = int((h * table.itemsize) % 16 == 0 and _aligned(table, out))
        ops.kernel("elementwise", f"embedding_{ops._suffix(table)}")(
            (t,), (128,), ids=ids, table=table, out=out, H=h, V=v, vec=vec)
    return out


def _rms(ops, x, residual, w, eps, offset):
    shape = x.shape
    x2, xs = ops._rows(x)
    r2, rs = ops._rows(residual) if residual is not None else (None, 0)
    rows, h = x2.shape
    out = ops._new((rows, h), x.dtype)
    res_out = ops._new((rows, h), x.dtype) if residual is not None else None
    if rows:
        suf = ops._suffix(x)
        n = 16 // x.itemsize
        nvec = h // n
        vec = (h % n == 0 and xs % n == 0 and rs % n == 0 and nvec <= 4096 and
               _aligned(x2, r2, w, out, res_out) and w.dtype == x.dtype)
        if vec:
            threads = _block_for(-(-nvec // 4))
            ops.kernel("elementwise", f"rms_norm_vec_{suf}")(
                (rows,), (threads,), x=x2, xs=xs, res=r2, rs=rs, w=w, out=out, res_out=res_out, H=h,
                eps=eps, offset=offset)
        else:
            if w.dtype != x.dtype:
                w = w.astype(x.dtype)
            threads = _block_for(-(-h // 4))
            ops.kernel("elementwise", f"rms_norm_scalar_{suf}")(
                (rows,), (threads,), x=x2, xs=xs, res=r2, rs=rs, w=w, out=out, res_out=res_out, H=h,
                eps=eps, offset=offset)
    return out.reshape(shape), (res_out.reshape(shape) if res_out is not None else None)


def rms_norm(ops, x, w, eps, offset):
    return _rms(ops, x, None, w, eps, offset)[0]


def add_rms_norm(ops, x, residual, w, eps, offset):
    if isinstance(x, SplitK):
        done = _rms_parts(ops, x, residual, w, eps, offset)
        if done is not None:
            return done
        x = x.materialize()
    if residual is None:
        return rms_norm(ops, x, w, eps, offset), x
    return _rms(ops, x, residual, w, eps, offset)


def _rms_parts(ops, x: SplitK, residual, w, eps, offset):
    """add_rms_norm of a k-split GEMM's partials in one kernel (they are summed on the way in),
    or None where the vector kernel does not apply (the caller materializes x instead)."""
    parts = x.parts
    s_, rows, h = parts.shape
    if residual is None or residual.dtype != x.dtype or w.dtype != x.dtype or s_ != 2:
        return None
    r2, rs = ops._rows(residual)
    n = 16 // x.dtype.itemsize
    if h % n or rs % n or h // n > 4096 or r2.shape != (rows, h) or not _aligned(parts, r2, w):
        return None
    out = ops._new((rows, h), x.dtype)
    res_out = ops._new((rows, h), x.dtype)
    if rows:
        # one 16-byte vector per thread up to 1024 (all of a thread's loads in flight at once:
        # the k-split runs at 16-64 rows, so this kernel is latency-bound), then up to 4
        threads = _block_for(h // n if h // n <= 1024 else -(-(h // n) // 4))
        ops.kernel("elementwise", f"rms_norm_parts2_{ops._suffix(residual)}")(
            (rows,), (threads,), parts=parts, ps=rows * h, res=r2, rs=rs, w=w, out=out, res_out=res_out,
            H=h, eps=eps, offset=offset)
    return out.reshape(x.shape), res_out.reshape(x.shape)


def silu_mul(ops, x):
    shape = x.shape
    x2, xs = ops._rows(x)
    rows, two_i = x2.shape
    i = two_i // 2
    out = ops._new((rows, i), x.dtype)
    n = 16 // x.itemsize
    vec = int(i % n == 0 and xs % n == 0 and _aligned(x2, out))
    work = rows * (i // n if vec else i)
    if work:
        ops.kernel("elementwise", f"silu_mul_{ops._suffix(x)}")(
            (ops._grid1d(work),), (256,), x=x2, xs=xs, y=out, rows=rows, I=i, vec=vec)
    return out.reshape(*shape[:-1], i)


def _abc(a):
    """(A, B, C) shape and element strides of a 1-3 D array."""
    s = [st // a.itemsize for st in a.strides]
    if a.ndim == 1:
        return (1, 1, a.shape[0]), (0, 0, s[0])
    if a.ndim == 2:
        return (a.shape[0], 1, a.shape[1]), (s[0], 0, s[1])
    return a.shape, tuple(s)


def sigmoid_mul(ops, x, gate):
    cp = ops.cp
    shape = np.broadcast_shapes(x.shape, gate.shape)
    x = cp.broadcast_to(x, shape)
    g = cp.broadcast_to(gate, shape)
    if len(shape) > 3 or len(shape) == 0:
        x, g = cp.ascontiguousarray(x).reshape(-1), cp.ascontiguousarray(g).reshape(-1)
    (a, b, c), (xa, xb, xc) = _abc(x)
    if c > 1 and xc != 1:
        x = cp.ascontiguousarray(x)
        (a, b, c), (xa, xb, xc) = _abc(x)
    if g.dtype != x.dtype:
        g = g.astype(x.dtype)
    _, (ga, gb, gc) = _abc(g)
    if c > 1 and gc not in (0, 1):
        g = cp.ascontiguousarray(g)
        _, (ga, gb, gc) = _abc(g)
    if c == 1:
        gc = 1
    out = ops._new(shape, x.dtype)
    n = 16 // x.itemsize
    vec = int(c % n == 0 and gc == 1 and all(s % n == 0 for s in (xa, xb, ga, gb)) and _aligned(x, g, out))
    work = a * b * (c // n if vec else c)
    if work:
        ops.kernel("elementwise", f"sigmoid_mul_{ops._suffix(x)}")(
            (ops._grid1d(work),), (256,),
            x=x, xa=xa, xb=xb, g=g, ga=ga, gb=gb, gc=gc, y=out, A=a, B=b, C=c, vec=vec)
    return out


def _head_norm_rope(ops, x, w, eps, offset, positions, inv_freq, rot):
    x = ops._heads(x)
    t, nh, d = x.shape
    out = ops._new((t, nh, d), x.dtype)
    if t * nh:
        if w is not None and w.dtype != x.dtype:
            w = w.astype(x.dtype)
        if inv_freq is not None and inv_freq.dtype != F32:
            inv_freq = inv_freq.astype(F32)
        warps = 8
        ops.kernel("elementwise", f"head_norm_rope_{ops._suffix(x)}")(
            (-(-t * nh // warps),), (32 * warps,),
            x=x, xs_t=_estride(x, 0), xs_h=_estride(x, 1), y=out, ys_t=nh * d, ys_h=d, ntok=t, nheads=nh, D=d,
            w=w, eps=eps, offset=offset, positions=positions, inv_freq=inv_freq, rot=rot,
            shared_mem=warps * d * 4)
    return out


def head_rms_norm(ops, x, w, eps, offset):
    shape = x.shape
    return _head_norm_rope(ops, x, w, eps, offset, None, None, 0).reshape(shape)


def rope(ops, q, k, positions, inv_freq, rotary_dim):
    """Returns new contiguous (q, k); the inputs are left untouched."""
    pos = ops._dev(positions)
    inv = ops._dev_f32(inv_freq)
    qs, ks = q.shape, k.shape
    return (_head_norm_rope(ops, q, None, 0.0, 0.0, pos, inv, rotary_dim).reshape(qs),
            _head_norm_rope(ops, k, None, 0.0, 0.0, pos, inv, rotary_dim).reshape(ks))


def write_kv(ops, k, v, k_cache, v_cache, batch):
    k, v = ops._heads(k), ops._heads(v)
    if is_quantized_kv(k_cache) or is_quantized_kv(v_cache):
        return write_kv_quant(ops, k, v, k_cache, v_cache, batch)
    t, hk, d = k.shape
    if not (k.dtype == v.dtype == k_cache.dtype == v_cache.dtype):
        raise TypeError(f"write_kv: k {k.dtype}, v {v.dtype}, caches {k_cache.dtype}/{v_cache.dtype} differ")
    if not (k_cache.flags.c_contiguous and v_cache.flags.c_contiguous):
        raise ValueError("write_kv: the KV caches must be contiguous [blocks, block_size, Hk, D]")
    slots = ops._dev(batch.slot_mapping)
    n = 16 // k.itemsize
    vec = int(d % n == 0 and all(_estride(a, i) % n == 0 for a in (k, v) for i in (0, 1)) and
              _aligned(k, v, k_cache, v_cache))
    work = t * hk * (d // n if vec else d)
    if work:
        ops.kernel("elementwise", f"write_kv_{ops._suffix(k)}")(
            (ops._grid1d(work),), (256,),
            k=k, ks_t=_estride(k, 0), ks_h=_estride(k, 1), v=v, vs_t=_estride(v, 0), vs_h=_estride(v, 1),
            k_cache=k_cache, v_cache=v_cache, slot_mapping=slots, ntok=t, Hk=hk, D=d, vec=vec)


def qk_norm_rope_write_kv(ops, q, k, v, q_norm_w, k_norm_w, eps, offset, positions, inv_freq,
                          rotary_dim, k_cache, v_cache, batch):
    """head_rms_norm (q, k; when the weights are given) + rope + write_kv in one launch
    (qk_norm_rope_kv_<dtype>: one warp per (token, head) of the Hq + Hk heads), bit-identical
    to the unfused kernels. Returns the new contiguous q [T, Hq, D]. Cases the kernel does
    not cover (mixed dtypes, odd shapes, non-contiguous caches) take the composed path."""
    q, k, v = ops._heads(q), ops._heads(k), ops._heads(v)
    t, hq, d = q.shape
    hk = k.shape[1]
    rot = int(rotary_dim)
    dt = np.dtype(q.dtype)
    ok = (not (is_quantized_kv(k_cache) or is_quantized_kv(v_cache)) and dt in _SUFFIX and k.dtype == dt and v.dtype == dt and k_cache.dtype == dt and v_cache.dtype == dt
          and tuple(k.shape) == (t, hk, d) and tuple(v.shape) == (t, hk, d)
          and k_cache.ndim >= 2 and tuple(k_cache.shape[-2:]) == (hk, d)
          and tuple(v_cache.shape) == tuple(k_cache.shape)
          and k_cache.flags.c_contiguous and v_cache.flags.c_contiguous
          and 0 <= rot <= d and rot % 2 == 0 and positions is not None
          and all(a.strides[i] >= 0 and a.strides[i] % a.itemsize == 0 for a in (q, k, v) for i in (0, 1))
          and all(w is None or tuple(w.shape) == (d,) for w in (q_norm_w, k_norm_w)))
    if not ok:
        return compose_qk_norm_rope_write_kv(ops, q, k, v, q_norm_w, k_norm_w, eps, offset, positions,
                                             inv_freq, rotary_dim, k_cache, v_cache, batch)
    q_out = ops._new((t, hq, d), dt)
    if t == 0:
        return q_out
    qw = q_norm_w if q_norm_w is None or q_norm_w.dtype == dt else q_norm_w.astype(dt)
    kw = k_norm_w if k_norm_w is None or k_norm_w.dtype == dt else k_norm_w.astype(dt)
    pos = ops._dev(positions)
    inv = ops._dev_f32(inv_freq) if rot else None
    slots = ops._dev(batch.slot_mapping)
    warps = 8
    ops.kernel("elementwise", f"qk_norm_rope_kv_{_SUFFIX[dt]}")(
        (-(-t * (hq + hk) // warps),), (32 * warps,),
        q=q, qs_t=_estride(q, 0), qs_h=_estride(q, 1), k=k, ks_t=_estride(k, 0), ks_h=_estride(k, 1),
        v=v, vs_t=_estride(v, 0), vs_h=_estride(v, 1), q_out=q_out, k_cache=k_cache, v_cache=v_cache,
        slot_mapping=slots, ntok=t, Hq=hq, Hk=hk, D=d, qw=qw, kw=kw, eps=eps, offset=offset, positions=pos,
        inv_freq=inv, rot=rot, shared_mem=warps * d * 4)
    return q_out
