"""CUDA implementations of the Gated DeltaNet and MoE ops (semantics: metrale.backends.base.Ops).

CudaOps (metrale/backends/cuda.py) delegates to these functions; each takes the CudaOps instance
first (for its kernel loader) and otherwise the base.Ops signature. Kernels live in
kernels_cuda/gdn_conv.cu, gdn_delta.cu and moe.cu; each file's header states its layouts, bytes
and FLOPs. Every launch has a shape fixed by the array shapes alone (no device->host reads), so
the decode path can be captured in a CUDA graph.

GDN activations may be bf16 (ml_dtypes.bfloat16 cupy arrays) or fp32: the kernel suffix follows
the array's item size; the MoE kernels are bf16 only. Small per-channel weights (conv kernel, A_log, dt_bias, norm weight) are used
as fp32 copies made once per weight array.
"""
from __future__ import annotations

import cupy as cp
import numpy as np

from metrale.backends.launch import foreign_launch

GDN_CHUNK = 64                   # must match CH in gdn_delta.cu
CONV_SEG = 64                    # tokens per thread segment in gdn_conv.cu
# tensor-core expert GEMMs, one of the tilings moe.cu instantiates
# (moe_mma_<gate_up|down>_m<MT>_n<NTW>_s<STAGES>): variant -> (m-tiles of 16 rows, gate_up
# (n-tiles of 8 weight rows, stages), down (n-tiles, stages)); 4 warps, 64-wide k-blocks. "m1"
# (16-row tiles) for decode-like routing, "m4" (64-row tiles) once the experts average
# MOE_MMA_M4_MIN_ROWS rows or more.
# m1: perf/moe_tune.py on the H200 (2026-11-30, 35B-A3B layer with its shared expert, T = 1-32):
# gate_up (4, 3) and down (4, 2) within 1 % of the best of 11 tilings at every T; the old
# (4, 4) gate_up (96 KB, two CTAs per SM) ran the 9 experts of T = 1 in two waves (+10 %).
MOE_MMA = {"m1": (1, (4, 3), (4, 2)), "m4": (4, (4, 2), (4, 2))}
MOE_MMA_WARPS = 4
MOE_MMA_M4_MIN_ROWS = 32
# moe_plan (routing in one CTA) for steps of at most this many (token, expert) pairs; its warps'
# softmax scratch stays within MOE_PLAN_ROUTE_SMEM bytes (plus 4 bytes per pair: 48 KB in all
# with the 12 KB of static shared memory)
MOE_PLAN_MAX_PAIRS = 1024
MOE_PLAN_ROUTE_SMEM = 30 * 1024
# steps of at most this many tokens run their expert GEMMs as CUDA-core GEMVs over the pairs
# (moe_gemv_*, bf16): 576-1152 small CTAs balance where the tensor-core tiles
# left 2-3 CTAs of 128 KB per SM. perf/moe_tune.py, H200, 35B-A3B layer with its shared expert:
# T = 1 / 2 / 4 / 8 / 16: 30.8 / 43.0 / 66.8 / 113 / 205 us against the best m1 tiling's
# 34.7 / 49.8 / 73.0 / 115 / 187 (the GEMVs re-read an expert once per pair that takes it);
# with the down GEMVs and the combine fused (moe_gemv_down_combine), T = 1 / 2 / 4: 28.4 / 40.1
# / 63.2 us
MOE_GEMV_MAX_TOKENS = 4
# ... and past one token only while T * top_k * MOE_GEMV_PAIR_SPREAD <= E: the GEMVs read an
# expert once per pair that takes it, so they need the pairs few next to the experts
# (duplicates rare; measured at E = 256, k = 8)
MOE_GEMV_PAIR_SPREAD = 4
MOE_GEMV_ROWS = 4                # must match GV_ROWS in moe.cu
MOE_DC_ROWS = 2                  # must match DC_ROWS in moe.cu (moe_gemv_down_combine)
GDN_HEAD_DIMS = {(16, 16), (32, 32), (64, 64), (128, 128), (64, 128), (128, 64)}
SMEM_LIMIT = 232448              # H100/H200 max dynamic shared memory per block

_f32_cache: dict[int, tuple[object, object]] = {}


# -- kernel loading ---------------------------------------------------------------------------

def _kernel(ops, file: str, name: str, smem: int = 0):
    """Kernel `name` of kernels_cuda/`file`, through CudaOps.kernel (compiled once, cached; it
    raises the dynamic shared-memory limit to `smem`)."""
    return ops.kernel(file[:-3] if file.endswith(".cu") else file, name, smem)


def _empty(ops, shape, dtype):
    """Output buffer; CudaOps NaN-fills new outputs when METRALE_CUDA_POISON=1 (tests)."""
    return ops._new(shape, dtype)


def _sfx(a) -> str:
    return "bf16" if a.dtype.itemsize == 2 else "f32"


def _dev(a):
    return a if isinstance(a, cp.ndarray) else cp.asarray(a)


def _i32(a):
    a = _dev(a)
    return a if a.dtype == cp.int32 else a.astype(cp.int32)


def _f32(w):
    """fp32 view/copy of a small weight, made once per weight array."""
    if w.dtype == cp.float32 and w.flags.c_contiguous:
        return w
    hit = _f32_cache.get(id(w))
    if hit is not None and hit[0] is w:
        return hit[1]
    w32 = cp.ascontiguousarray(w.astype(cp.float32))
    _f32_cache[id(w)] = (w, w32)
    return w32


def _token_stride(x, inner: tuple[int, ...]):
    """(array, token stride in elements) with everything but dim 0 contiguous."""
    isz = x.dtype.itemsize
    want = isz
    ok = True
    for dim, stride in zip(reversed(inner), reversed(x.strides[1:])):
        if dim > 1 and stride != want:
            ok = False
        want *= dim
    if not ok or x.strides[0] % isz or x.strides[0] < want:
        x = cp.ascontiguousarray(x)
    return x, np.int64(x.strides[0] // isz if x.shape[0] > 1 else int(np.prod(inner)))


def _state_kernel_suffix(x, ssm_state) -> str:
    """The delta-rule kernels' suffix for activations `x` and the state pool's dtype: fp32
    pools with either activation dtype, 16-bit pools (--ssm-h-dtype f16-pool / bf16-pool) with
    bf16 activations (the CUDA engine's)."""
    if ssm_state.dtype == cp.float32:
        return _sfx(x)
    name = "sf16" if ssm_state.dtype == np.float16 else ("sbf16" if ssm_state.dtype.name == "bfloat16" else None)
    if name is None or _sfx(x) != "bf16":
        raise ValueError(f"ssm_state {ssm_state.dtype} with {x.dtype} activations is not built (fp32 state "
                         "with either, or an f16 / bf16 state with bf16 activations)")
    return f"bf16_{name}"


def _batch_arrays(batch):
    return (_i32(batch.query_start_loc), _i32(batch.seq_lens), _i32(batch.state_slots))


# -- Gated DeltaNet ---------------------------------------------------------------------------

def causal_conv1d(ops, x, weight, conv_state, batch):
    """Depthwise causal conv (K = 4) + SiLU over each sequence's new tokens, continuing from and
    updating conv_state[state_slots[i]] (zeros when the sequence starts fresh)."""
    T, C = x.shape
    K = weight.shape[-1]
    if K != 4:
        raise ValueError(f"causal_conv1d: kernel size {K} is not supported (the CUDA kernel is "
                         "built for K = 4, Qwen3.5's linear_conv_kernel_dim)")
    if conv_state.shape[1:] != (C, K - 1) or not conv_state.flags.c_contiguous:
        raise ValueError(f"conv_state must be a contiguous [slots, {C}, {K - 1}] array, "
                         f"got {conv_state.shape}")
    out = _empty(ops, (T, C), x.dtype)
    B = batch.num_seqs
    if T == 0 or B == 0:
        return out
    x, sx = _token_stride(x, (C,))
    # the cache is keyed by the weight array itself: a reshaped view is a new object every call,
    # which missed the cache (a captured bf16 -> fp32 copy per GDN layer per step) and kept
    # every miss alive in the cache
    w = _f32(weight).reshape(C, K)
    sfx = f"{_sfx(x)}_{_sfx(conv_state)}"
    if sfx == "f32_bf16":
        raise ValueError("causal_conv1d: fp32 activations with a bf16 conv state are not built")
    qsl, seq_lens, slots = _batch_arrays(batch)
    grid = ((C + 127) // 128, T // CONV_SEG + B)
    _kernel(ops, "gdn_conv.cu", f"gdn_conv4_{sfx}")(
        grid, (128,), (x, sx, w, conv_state, out, qsl, seq_lens, slots,
                       np.int32(B), np.int32(C), np.int32(CONV_SEG)))
    return out


def gdn_gates(ops, a, b, A_log, dt_bias):
    """g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b); fp32 [T, Hv]."""
    T, Hv = a.shape
    g = _empty(ops, (T, Hv), cp.float32)
    beta = _empty(ops, (T, Hv), cp.float32)
    if T == 0:
        return g, beta
    if a.dtype != b.dtype:
        b = b.astype(a.dtype)
    a, sa = _token_stride(a, (Hv,))
    b, sb = _token_stride(b, (Hv,))
    n = T * Hv
    _kernel(ops, "gdn_delta.cu", f"gdn_gates_{_sfx(a)}")(
        ((n + 255) // 256,), (256,),
        (a, b, sa, sb, _f32(A_log), _f32(dt_bias), g, beta, np.int32(T), np.int32(Hv)))
    return g, beta


def chunk_smem_bytes(dk: int, dv: int) -> int:
    """Dynamic shared memory of the chunked kernel (ChunkSmem in gdn_delta.cu)."""
    c = GDN_CHUNK
    return 4 * (dk * dv + 3 * c * (dk + 1) + c * (dv + 1) + c * (c + 1) + 2 * c)


def _check_delta_rule(q, v, ssm_state) -> None:
    _, Hk, Dk = q.shape
    _, Hv, Dv = v.shape
    if (Dk, Dv) not in GDN_HEAD_DIMS:
        raise ValueError(f"gated_delta_rule: head dims (k {Dk}, v {Dv}) are not built; "
                         f"supported: {sorted(GDN_HEAD_DIMS)} (add a GDN_INST line in gdn_delta.cu)")
    if Hv % Hk:
        raise ValueError(f"gated_delta_rule: {Hv} value heads are not a multiple of {Hk} key heads")
    if not ssm_state.flags.c_contiguous or ssm_state.shape[1:] != (Hv, Dk, Dv):
        raise ValueError(f"ssm_state must be contiguous [slots, {Hv}, {Dk}, {Dv}], got "
                         f"{ssm_state.dtype} {ssm_state.shape}")


def _qkv_operands(q, k, v):
    """(q, k, v, sq, sk, sv): k and v in q's dtype, each with its token stride (heads
    contiguous: column slices of the input projection are read in place)."""
    _, Hk, Dk = q.shape
    _, Hv, Dv = v.shape
    k = k if k.dtype == q.dtype else k.astype(q.dtype)
    v = v if v.dtype == q.dtype else v.astype(q.dtype)
    q, sq = _token_stride(q, (Hk, Dk))
    k, sk = _token_stride(k, (Hk, Dk))
    v, sv = _token_stride(v, (Hv, Dv))
    return q, k, v, sq, sk, sv


def _recurrent_block(Dk: int, Dv: int) -> tuple[int]:
    return (min(256, Dk * Dv // 4),)    # RecShape<DK, DV>::NT in gdn_delta.cu


def gated_delta_rule(ops, q, k, v, g, beta, ssm_state, batch):
    """The gated delta rule per sequence from/into ssm_state[state_slots[i]] (fp32, or a
    16-bit pool): the recurrent kernel when every sequence adds one token (decode), the
    chunked one otherwise."""
    T, Hk, Dk = q.shape
    _, Hv, Dv = v.shape
    _check_delta_rule(q, v, ssm_state)
    sfx = _state_kernel_suffix(q, ssm_state)
    o = _empty(ops, (T, Hv, Dv), q.dtype)
    B = batch.num_seqs
    if T == 0 or B == 0:
        return o
    g = cp.ascontiguousarray(g, dtype=cp.float32)
    beta = cp.ascontiguousarray(beta, dtype=cp.float32)
    q, k, v, sq, sk, sv = _qkv_operands(q, k, v)
    qsl, seq_lens, slots = _batch_arrays(batch)
    args = (q, k, v, sq, sk, sv, g, beta, ssm_state, o, qsl, seq_lens, slots,
            np.int32(Hk), np.int32(Hv))
    if T == B:   # decode: one token per sequence
        fn = _kernel(ops, "gdn_delta.cu", f"gdn_recurrent_{Dk}x{Dv}_{sfx}")
        fn((Hv, B), _recurrent_block(Dk, Dv), args)
    else:
        smem = chunk_smem_bytes(Dk, Dv)
        if smem > SMEM_LIMIT:
            raise ValueError(f"gated_delta_rule: {smem} B of shared memory needed")
        fn = _kernel(ops, "gdn_delta.cu", f"gdn_chunked_{Dk}x{Dv}_{sfx}", smem)
        fn((Hv, B), (256,), args, shared_mem=smem)
    return o


def gated_delta_rule_with_gates(ops, q, k, v, a, b, A_log, dt_bias, ssm_state, batch):
    """gdn_gates + gated_delta_rule; a decode step (one token per sequence) runs both in one
    launch (gdn_recurrent_gates_*: the gates computed inside, bit-identical), anything else the
    two kernels."""
    from metrale.backends.base import compose_gated_delta_rule_with_gates

    T, Hk, Dk = q.shape
    _, Hv, Dv = v.shape
    B = batch.num_seqs
    if not (T == B and T > 0 and a.dtype == b.dtype == q.dtype and a.shape == b.shape == (T, Hv)):
        return compose_gated_delta_rule_with_gates(ops, q, k, v, a, b, A_log, dt_bias, ssm_state, batch)
    _check_delta_rule(q, v, ssm_state)
    o = _empty(ops, (T, Hv, Dv), q.dtype)
    q, k, v, sq, sk, sv = _qkv_operands(q, k, v)
    a, sa = _token_stride(a, (Hv,))
    b, sb = _token_stride(b, (Hv,))
    qsl, seq_lens, slots = _batch_arrays(batch)
    fn = _kernel(ops, "gdn_delta.cu", f"gdn_recurrent_gates_{Dk}x{Dv}_{_state_kernel_suffix(q, ssm_state)}")
    fn((Hv, B), _recurrent_block(Dk, Dv),
       (q, k, v, sq, sk, sv, a, b, sa, sb, _f32(A_log), _f32(dt_bias), ssm_state, o, qsl, seq_lens,
        slots, np.int32(Hk), np.int32(Hv)))
    return o


def recurrent_gated_delta_rule(ops, q, k, v, g, beta, ssm_state, batch):
    """The recurrent kernel for any batch (token by token); for tests and tiny batches."""
    T, Hk, Dk = q.shape
    _, Hv, Dv = v.shape
    o = _empty(ops, (T, Hv, Dv), q.dtype)
    q, k, v, sq, sk, sv = _qkv_operands(q, k, v)
    qsl, seq_lens, slots = _batch_arrays(batch)
    fn = _kernel(ops, "gdn_delta.cu", f"gdn_recurrent_{Dk}x{Dv}_{_state_kernel_suffix(q, ssm_state)}")
    fn((Hv, batch.num_seqs), _recurrent_block(Dk, Dv),
       (q, k, v, sq, sk, sv, cp.ascontiguousarray(g, dtype=cp.float32),
        cp.ascontiguousarray(beta, dtype=cp.float32), ssm_state, o, qsl, seq_lens, slots,
        np.int32(Hk), np.int32(Hv)))
    return o


def gated_rms_norm(ops, x, z, w, eps):
    """rms_norm(x) * w * silu(z) over the last dim (w not zero-centred)."""
    D = x.shape[-1]
    x = cp.ascontiguousarray(x)
    if z.dtype != x.dtype:
        z = z.astype(x.dtype)
    out = _empty(ops, x.shape, x.dtype)
    rows = x.size // D if D else 0
    if rows == 0:
        return out
    isz = z.dtype.itemsize
    if (z.ndim == 3 and z.shape == x.shape and z.strides[2] == isz and z.strides[1] == D * isz
            and z.strides[0] % isz == 0 and z.shape[0] > 0):
        # [T, H, D] with only the token stride free (z is a column slice of the GDN input
        # projection): read in place instead of copying it out each step
        zs, zh = z.strides[0] // isz, z.shape[1]
    else:
        z, zs, zh = cp.ascontiguousarray(z), D, 1
    _kernel(ops, "gdn_conv.cu", f"gated_rms_norm_{_sfx(x)}")(
        ((rows + 7) // 8,), (256,), (x, z, np.int64(zs), np.int32(zh), _f32(w), out, np.int32(rows),
                                     np.int32(D), np.float32(eps)))
    return out


# -- mixture of experts -----------------------------------------------------------------------

def moe_mma_smem(mt: int, ntw: int, stages: int) -> int:
    """Dynamic shared memory of moe_mma_* (per warp and stage: 2*ntw + 4*mt pieces of 32 x 16 B)."""
    return MOE_MMA_WARPS * stages * (2 * ntw + 4 * mt) * 512


def moe(ops, x, router_w, gate_up, down, top_k, renormalize, shared=False):
    """softmax router over E experts, top-k (renormalised when asked), weighted sum of the
    experts' SiLU MLPs. x [T, H], router_w [E + S, H], gate_up [E + S, 2I, H], down [E + S, H, I]
    with S = 1 when `shared`: the last expert is a shared expert every token takes with weight
    sigmoid(x . router_w[E]) (see kernels_cuda/moe.cu). Routing of steps of at most
    MOE_PLAN_MAX_PAIRS pairs (decode) in one launch (moe_plan), larger ones in four. Steps of
    at most MOE_GEMV_MAX_TOKENS tokens: expert GEMVs on CUDA cores, the down one with the
    combine (moe_gemv_*, bf16 "mma").
    Expert GEMMs on tensor cores (bf16 only): 16-row tiles, or 64-row tiles once
    P >= MOE_MMA_M4_MIN_ROWS * E; see kernels_cuda/moe.cu."""
    T, H = x.shape
    S = int(bool(shared))
    Et = router_w.shape[0]
    E = Et - S
    I = down.shape[2]
    if gate_up.shape != (Et, 2 * I, H) or down.shape != (Et, H, I):
        raise ValueError(f"moe: gate_up {gate_up.shape} / down {down.shape} do not match "
                         f"{Et} experts, H={H}, I={I}")
    if Et > 1024 or E < 1 or not 0 < top_k <= E:
        raise ValueError(f"moe: E={E} (+{S} shared), top_k={top_k} not supported "
                         f"(E + shared <= 1024, 0 < top_k <= E)")
    if H % 8 or I % 8:
        raise ValueError(f"moe: H={H} and I={I} must be multiples of 8 (16-byte loads)")
    out = _empty(ops, (T, H), x.dtype)
    if T == 0:
        return out
    if x.dtype.name != "bfloat16":
        raise TypeError(f"moe: the CUDA MoE kernels are bf16 only, got {x.dtype} activations")
    x = cp.ascontiguousarray(x)
    if gate_up.dtype != x.dtype or down.dtype != x.dtype:
        raise ValueError(f"moe: weights {gate_up.dtype}/{down.dtype} differ from x {x.dtype}")
    gate_up = cp.ascontiguousarray(gate_up)
    down = cp.ascontiguousarray(down)
    logits = cp.ascontiguousarray(ops.linear(x, router_w))
    kk = top_k + S                       # pairs per token
    P = T * kk
    variant = "m4" if P >= MOE_MMA_M4_MIN_ROWS * Et else "m1"
    mt, (gu_ntw, gu_st), (dn_ntw, dn_st) = MOE_MMA[variant]
    bm = 16 * mt
    max_tiles = P // bm + min(Et, P) + 1
    wts = cp.empty(P, dtype=cp.float32)
    sfx = _sfx(x)
    # int32 scratch: [counts, fill (E + S each: the four-launch routing's atomics, zeroed)],
    # offsets [E + S + 1], tile_expert, tile_row0 [max_tiles], sorted_pair, pair_pos, ids [P]
    plan = P <= MOE_PLAN_MAX_PAIRS
    counters = 0 if plan else 2 * Et
    if not plan:
        foreign_launch()        # the memset of the counters: moe_route must follow it plainly
    ints = (cp.empty if plan else cp.zeros)(counters + (Et + 1) + 2 * max_tiles + 3 * P,
                                             dtype=cp.int32)
    offsets = ints[counters:counters + Et + 1]
    meta = ints[counters + Et + 1:]
    tile_expert, tile_row0 = meta[:max_tiles], meta[max_tiles:2 * max_tiles]
    sorted_pair, pair_pos, ids = (meta[2 * max_tiles + i * P:2 * max_tiles + (i + 1) * P]
                                  for i in range(3))
    if plan:
        nwr = max(1, min(32, T, MOE_PLAN_ROUTE_SMEM // (4 * E)))
        _kernel(ops, "moe.cu", f"moe_plan_{_sfx(logits)}")(
            (1,), (1024,),
            (logits, np.int32(T), np.int32(E), np.int32(top_k), np.int32(bool(renormalize)),
             np.int32(S), np.int32(nwr), np.int32(max_tiles), np.int32(bm), wts, offsets,
             tile_expert, tile_row0, sorted_pair, pair_pos, ids), shared_mem=4 * (nwr * E + P))
    else:
        counts, fill = ints[:Et], ints[Et:counters]
        _kernel(ops, "moe.cu", f"moe_route_{_sfx(logits)}")(
            ((T + 3) // 4,), (128,),
            (logits, np.int32(T), np.int32(E), np.int32(top_k), np.int32(bool(renormalize)),
             np.int32(S), ids, wts, counts), shared_mem=4 * E * 4)
        _kernel(ops, "moe.cu", "moe_scan_tiles")(
            (1,), (1024,), (counts, np.int32(Et), np.int32(max_tiles), np.int32(bm), offsets,
                            tile_expert, tile_row0))
        _kernel(ops, "moe.cu", "moe_scatter")(
            ((P + 255) // 256,), (256,), (ids, np.int32(P), offsets, fill, sorted_pair, pair_pos))
    act = _empty(ops, (P, I), x.dtype)
    rows = MOE_GEMV_ROWS
    few = T == 1 or T * top_k * MOE_GEMV_PAIR_SPREAD <= E
    if T <= MOE_GEMV_MAX_TOKENS and few and I % (rows // 2) == 0 and H % MOE_DC_ROWS == 0:
        _kernel(ops, "moe.cu", "moe_gemv_gate_up")(
            (-(-P * I // (rows // 2) // 4),), (128,),
            (x, ids, sorted_pair, np.int32(kk), gate_up, np.int32(I), np.int32(H), np.int32(P), act))
        _kernel(ops, "moe.cu", "moe_gemv_down_combine")(
            (-(-T * H // MOE_DC_ROWS // 4),), (128,),
            (act, ids, pair_pos, wts, np.int32(kk), down, np.int32(H), np.int32(I), np.int32(T), out))
        return out
    y = _empty(ops, (P, H), x.dtype)
    for name, ntw, stages, gated, n_out, k_in, a, sp, w, dst in (
            ("gate_up", gu_ntw, gu_st, True, I, H, x, sorted_pair, gate_up, act),
            ("down", dn_ntw, dn_st, False, H, I, act, None, down, y)):
        bn = 8 * (ntw // 2 if gated else ntw)
        smem = moe_mma_smem(mt, ntw, stages)
        _kernel(ops, "moe.cu", f"moe_mma_{name}_m{mt}_n{ntw}_s{stages}", smem)(
            ((n_out + bn - 1) // bn, max_tiles), (32 * MOE_MMA_WARPS,),
            (a, sp if sp is not None else np.uint64(0), np.int32(kk), w, np.int32(n_out),
             np.int32(k_in), tile_expert, tile_row0, offsets, dst), shared_mem=smem)
    _kernel(ops, "moe.cu", f"moe_combine_{sfx}")(
        (T, (H + 255) // 256), (256,), (y, pair_pos, wts, np.int32(kk), np.int32(H), out))
    return out
