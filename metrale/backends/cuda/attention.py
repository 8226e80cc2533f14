"""Paged causal GQA attention on tensor cores (kernels_cuda/attention.cu).

Decode batches (one token per sequence) run flash-decoding (`decode_mma_d<D>_h<NH>`, partitions
merged by `decode_reduce`); prefill and mixed batches the FA2-style `prefill_mma_d<D>` over a work
list of query tiles built on the host (captured step graphs carry fixed-size lists). Functions
take the CudaOps instance first; CudaOps binds them as its methods.
"""
from __future__ import annotations

import numpy as np

from metrale.backends.cuda.kernels import declare
from metrale.backends.cuda.layout import BF16, F32, host_of
from metrale.backends.cuda.layout import aligned as _aligned
from metrale.backends.cuda.layout import estride as _estride
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
declare("attention", "decode_mma_d{}_h{}", "const bf16* q, long long qs_t, long long qs_h, const bf16* k_cache, "
        "const bf16* v_cache, const int* block_tables, int bt_stride, const int* seq_lens, const int* qsl, "
        "bf16* out, float* part_o, float* part_m, float* part_l, int Hk, int G, int nchunks, int block_size, "
        "int part_tokens, int nparts, float scale_log2")


def attention(ops, q, k_cache, v_cache, batch, scale):
    cp = ops.cp
    q = ops._heads(q)
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
        stages = ATTN_MMA_DECODE_STAGES[d]
        smem = max(ATTN_MMA_DECODE_WARPS * stages * 2 * ATTN_MMA_DECODE_TILE * (d + 8) * 2,
                   ATTN_MMA_DECODE_WARPS * 8 * nh * (d + 2) * 4)
        resident = max(1, (228 * 1024) // (smem + 1024))
        part = _decode_partition(ops, b * hk * nchunks, m * bs, 2 * resident)
        nparts = max(1, -(-(m * bs) // part))  # from shapes only: graph-safe
        if nparts > 1:
            part_o = cp.empty((b, hq, nparts, d), dtype=F32)
            part_m = cp.empty((b, hq, nparts), dtype=F32)
            part_l = cp.empty((b, hq, nparts), dtype=F32)
        else:
            part_o = part_m = part_l = None
        ops.kernel("attention", f"decode_mma_d{d}_h{nh}", smem)(
            (b, hk * nchunks, nparts), (32 * ATTN_MMA_DECODE_WARPS,),
            q=q, qs_t=qs_t, qs_h=qs_h, k_cache=k_cache, v_cache=v_cache, block_tables=bt, bt_stride=m,
            seq_lens=batch.seq_lens, qsl=batch.query_start_loc, out=out, part_o=part_o, part_m=part_m,
            part_l=part_l, Hk=hk, G=g, nchunks=nchunks, block_size=bs, part_tokens=part, nparts=nparts,
            scale_log2=scale_log2, shared_mem=smem)
        if nparts > 1:
            ops.kernel("attention", "decode_reduce")(
                (b, hq), (min(d, 256),),
                part_o=part_o, part_m=part_m, part_l=part_l, seq_lens=batch.seq_lens,
                qsl=batch.query_start_loc, out=out, Hq=hq, D=d, part_tokens=part, nparts=nparts)
        return out
    rows, threads, bn = ATTN_MMA_ROWS, ATTN_MMA_THREADS, ATTN_MMA_BN[d]
    smem = (rows + 4 * bn) * (d + 8) * 2
    fn = f"prefill_mma_d{d}"
    bq = prefill_tile_tokens(ops, hq, hk, d)
    work = _work_list(ops, batch, bq)
    ops.kernel("attention", fn, smem)(
        (work.shape[0], hk), (threads,),
        q=q, qs_t=qs_t, qs_h=qs_h, k_cache=k_cache, v_cache=v_cache, block_tables=bt, bt_stride=m,
        seq_lens=batch.seq_lens, qsl=batch.query_start_loc, work=work, out=out, Hk=hk, G=g, BQ=bq,
        block_size=bs, scale_log2=scale_log2, shared_mem=smem)
    return out


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
