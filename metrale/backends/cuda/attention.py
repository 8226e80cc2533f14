"""Paged causal GQA attention on tensor cores (kernels_cuda/attention.cu).

Decode batches (one token per sequence) run flash-decoding (`decode_mma_d<D>_h<NH>`, partitions
merged by `decode_reduce`); prefill and mixed batches the FA2-style `prefill_mma_d<D>` over a work
list of query tiles built on the host (captured step graphs carry fixed-size lists). Functions
take the CudaOps instance first; CudaOps binds them as its methods.
"""
from __future__ import annotations

import numpy as np

from metrale.backends.cuda.kernels import declare
from metrale.backends.cuda.kv_quant import cache_shape, fp8_pool
from metrale.backends.cuda.layout import BF16, F32, host_of
from metrale.backends.cuda.layout import aligned as _aligned
from metrale.backends.cuda.layout import estride as _estride
from metrale.cache.kv_dtypes import is_quantized_kv
from metrale.forward import ForwardBatch, prefill_work_list

# tiling, must match kernels_cuda/attention.cu (MT_PREFILL_MMA / MT_DECODE_MMA): prefill 8 warps x
# 16 rows, keys in tiles of ATTN_MMA_BN[D], two stages; decode 4 warps, 16-key tiles, per-warp
# pipelines of ATTN_MMA_DECODE_STAGES[D] stages, 8 or 16 q heads per CTA (kernel suffix _h1 / _h2)
ATTN_MMA_BN = {64: 64, 128: 64, 256: 32}
ATTN_MMA_ROWS, ATTN_MMA_THREADS = 128, 256
ATTN_MMA_DECODE_STAGES = {64: 4, 128: 3, 256: 3}
ATTN_MMA_DECODE_WARPS, ATTN_MMA_DECODE_TILE = 4, 16

declare("attention", "decode_reduce", "const float* part_o, const float* part_m, const float* part_l, "
        "const int* seq_lens, const int* qsl, bf16* out, int Hq, int D, int part_tokens, int nparts")
declare("attention", "prefill_mma_d{}", "const bf16* q, long long qs_t, long long qs_h, const bf16* k_cache, "
        "const bf16* v_cache, const int* block_tables, int bt_stride, const int* seq_lens, const int* qsl, "
        "const int* work, bf16* out, int Hk, int G, int BQ, int block_size, float scale_log2")
declare("attention", "prefill_mma_fp8_d{}", "const bf16* q, long long qs_t, long long qs_h, "
        "const unsigned char* k_cache, const unsigned char* v_cache, long long kv_block_bytes, int kv_scale_off, "
        "const int* block_tables, int bt_stride, const int* seq_lens, const int* qsl, "
        "const int* work, bf16* out, int Hk, int G, int BQ, int block_size, float scale_log2")
declare("attention", "decode_mma_fp8_d{}_h{}", "const bf16* q, long long qs_t, long long qs_h, "
        "const unsigned char* k_cache, const unsigned char* v_cache, long long kv_block_bytes, int kv_scale_off, "
        "const int* block_tables, int bt_stride, const int* seq_lens, const int* qsl, "
        "bf16* out, float* part_o, float* part_m, float* part_l, int Hk, int G, int nchunks, int block_size, "
        "int part_tokens, int nparts, float scale_log2")
declare("attention", "decode_mma_d{}_h{}", "const bf16* q, long long qs_t, long long qs_h, const bf16* k_cache, "
        "const bf16* v_cache, const int* block_tables, int bt_stride, const int* seq_lens, const int* qsl, "
        "bf16* out, float* part_o, float* part_m, float* part_l, int Hk, int G, int nchunks, int block_size, "
        "int part_tokens, int nparts, float scale_log2")


def _kv_args(k_cache, v_cache) -> tuple[str, dict]:
    """(kernel infix, the cache arguments) of a layer's K and V sides: plain bf16 arrays, or
    fp8 byte pools of one layout (kernels `_fp8`)."""
    if not (is_quantized_kv(k_cache) or is_quantized_kv(v_cache)):
        if not (k_cache.dtype == v_cache.dtype == BF16):
            raise TypeError("attention runs on bfloat16 q and caches")
        return "", dict(k_cache=k_cache, v_cache=v_cache)
    if not (is_quantized_kv(k_cache) and is_quantized_kv(v_cache)) or k_cache.layout != v_cache.layout:
        raise NotImplementedError("CUDA attention: K and V of a layer in different KV formats")
    kp, bb, so = fp8_pool(k_cache)
    vp, _, _ = fp8_pool(v_cache)
    return "fp8_", dict(k_cache=kp, v_cache=vp, kv_block_bytes=bb, kv_scale_off=so)


def attention(ops, q, k_cache, v_cache, batch, scale):
    cp = ops.cp
    q = ops._heads(q)
    t, hq, d = q.shape
    _, bs, hk, dc = cache_shape(k_cache)
    if dc != d or hq % hk:
        raise ValueError(f"attention: q [T, {hq}, {d}] does not fit the cache [.., {bs}, {hk}, {dc}]")
    if d not in ATTN_MMA_BN:
        raise NotImplementedError(f"attention: head_dim {d} not instantiated (have {sorted(ATTN_MMA_BN)})")
    if q.dtype != BF16:
        raise TypeError("attention runs on bfloat16 q and caches")
    kv, kv_args = _kv_args(k_cache, v_cache)
    if _estride(q, 0) % 8 or _estride(q, 1) % 8 or not _aligned(q):
        q = cp.ascontiguousarray(q)
    g = hq // hk
    out = ops._new((t, hq, d), BF16)
    if t == 0:
        return out
    if not isinstance(batch.query_start_loc, cp.ndarray):
        batch = ops.upload_batch(batch)
    scale_log2 = float(np.float32(scale * 1.4426950408889634))
    bt = batch.block_tables
    m = bt.shape[1]
    qs_t, qs_h = _estride(q, 0), _estride(q, 1)
    if batch.is_decode:
        b = t
        nh = 1 if g <= 8 else 2                    # n-tiles of 8 q heads per CTA
        nchunks = -(-g // (8 * nh))
        smem = decode_smem(d, nh, fp8=bool(kv))
        resident = max(1, (228 * 1024) // (smem + 1024))
        part = _decode_partition(ops, b * hk * nchunks, m * bs, 2 * resident)
        nparts = max(1, -(-(m * bs) // part))  # from shapes only: graph-safe
        if nparts > 1:
            part_o = cp.empty((b, hq, nparts, d), dtype=F32)
            part_m = cp.empty((b, hq, nparts), dtype=F32)
            part_l = cp.empty((b, hq, nparts), dtype=F32)
        else:
            part_o = part_m = part_l = None
        ops.kernel("attention", f"decode_mma_{kv}d{d}_h{nh}", smem)(
            (b, hk * nchunks, nparts), (32 * ATTN_MMA_DECODE_WARPS,),
            q=q, qs_t=qs_t, qs_h=qs_h, **kv_args, block_tables=bt, bt_stride=m,
            seq_lens=batch.seq_lens, qsl=batch.query_start_loc, out=out, part_o=part_o, part_m=part_m,
            part_l=part_l, Hk=hk, G=g, nchunks=nchunks, block_size=bs, part_tokens=part, nparts=nparts,
            scale_log2=scale_log2, shared_mem=smem)
        if nparts > 1:
            ops.kernel("attention", "decode_reduce")(
                (b, hq), (min(d, 256),),
                part_o=part_o, part_m=part_m, part_l=part_l, seq_lens=batch.seq_lens,
                qsl=batch.query_start_loc, out=out, Hq=hq, D=d, part_tokens=part, nparts=nparts)
        return out
    threads = ATTN_MMA_THREADS
    smem = prefill_smem(d, fp8=bool(kv))
    fn = f"prefill_mma_{kv}d{d}"
    bq = prefill_tile_tokens(ops, hq, hk, d)
    work = _work_list(ops, batch, bq)
    ops.kernel("attention", fn, smem)(
        (work.shape[0], hk), (threads,),
        q=q, qs_t=qs_t, qs_h=qs_h, **kv_args, block_tables=bt, bt_stride=m,
        seq_lens=batch.seq_lens, qsl=batch.query_start_loc, work=work, out=out, Hk=hk, G=g, BQ=bq,
        block_size=bs, scale_log2=scale_log2, shared_mem=smem)
    return out


def decode_smem(d: int, nh: int, fp8: bool = False) -> int:
    """Dynamic shared memory of decode_mma[_fp8]_d<d>_h<nh>: the warps' pipelines (bf16 tiles;
    fp8: byte stages and one bf16 tile per warp), or the final merge's scratch if larger."""
    stages, tk, w = ATTN_MMA_DECODE_STAGES[d], ATTN_MMA_DECODE_TILE, ATTN_MMA_DECODE_WARPS
    if fp8:
        pipes = w * (stages * (2 * tk * d + 2 * tk * 4) + 2 * tk * (d + 8) * 2)
    else:
        pipes = w * stages * 2 * tk * (d + 8) * 2
    return max(pipes, w * 8 * nh * (d + 2) * 4)


def prefill_smem(d: int, fp8: bool = False) -> int:
    """Dynamic shared memory of prefill_mma[_fp8]_d<d>: Q rows and two stages of K / V tiles
    (fp8: one bf16 tile and two byte stages)."""
    rows, bn = ATTN_MMA_ROWS, ATTN_MMA_BN[d]
    if fp8:
        return (rows + 2 * bn) * (d + 8) * 2 + 2 * (2 * bn * d + 2 * bn * 4)
    return (rows + 4 * bn) * (d + 8) * 2


def _decode_partition(ops, groups: int, max_keys: int, ctas_per_sm: int = 4) -> int:
    """Keys per decode CTA: enough partitions for ~`ctas_per_sm` CTAs per SM, at least 64
    keys and a multiple of 64; at most 4096 (4 warps, each its own pipeline, so long
    partitions stay parallel). Depends on shapes only (graph-safe)."""
    if ops.part_tokens:
        return int(ops.part_tokens)
    cap = 4096
    per = -(-groups * max_keys // (ctas_per_sm * ops.sm_count))
    return int(min(cap, max(64, -(-per // 64) * 64)))


def _work_list(ops, batch: ForwardBatch, bq: int):
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
        host = host_of(batch)
        if host is not None:
            qsl, seq_lens = host.query_start_loc, host.seq_lens
        else:  # a sync: only without .host
            qsl, seq_lens = ops.cp.asnumpy(batch.query_start_loc), ops.cp.asnumpy(batch.seq_lens)
        cache[bq] = ops.cp.asarray(prefill_work_list(qsl, seq_lens, bq))
    return cache[bq]


def prefill_tile_tokens(ops, n_heads: int, n_kv_heads: int, head_dim: int) -> int:
    """Query tokens per work item of the prefill attention kernel for this head shape (the
    `bq` of its work list)."""
    rows = ATTN_MMA_ROWS
    g = n_heads // n_kv_heads
    if head_dim not in ATTN_MMA_BN:
        raise NotImplementedError(f"attention: head_dim {head_dim} not instantiated (have {sorted(ATTN_MMA_BN)})")
    if g > rows:
        raise NotImplementedError(f"attention: {g} q heads per kv head (at most {rows})")
    return rows // g
