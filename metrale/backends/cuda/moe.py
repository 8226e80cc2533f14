"""Mixture of experts on the CUDA backend (kernels_cuda/moe.cu; semantics: metrale.backends.base.Ops.moe).

Routing (softmax + top-k, in one CTA for decode-sized steps), token permutation by expert,
expert GEMMs on tensor cores (or CUDA-core GEMVs for steps of a few tokens) and the weighted
combine, bf16 only. Every launch has a shape fixed by the array shapes alone (CUDA graphs).
CudaOps binds `moe` as its method.
"""
from __future__ import annotations

from metrale.backends.cuda.gdn import _empty, _kernel, _sfx, cp
from metrale.backends.cuda.kernels import declare

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

# kernels_cuda/moe.cu ({} = bf16; the tensor-core tilings moe_mma_<gate_up|down>_m<MT>_n<NTW>_s<ST>)
declare("moe", "moe_route_{}", "const T* logits, int T_, int E, int k, int renorm, int shared, int* ids, "
        "float* wts, int* counts")
declare("moe", "moe_plan_{}", "const T* logits, int T_, int E, int k, int renorm, int shared, int nwr, "
        "int max_tiles, int bm, float* wts, int* offsets, int* tile_expert, int* tile_row0, int* sorted_pair, "
        "int* pair_pos, int* ids")
declare("moe", "moe_combine_{}", "const T* y, const int* pair_pos, const float* wts, int k, int H, T* out")
declare("moe", "moe_scan_tiles", "const int* counts, int E, int max_tiles, int bm, int* offsets, "
        "int* tile_expert, int* tile_row0")
declare("moe", "moe_scatter", "const int* ids, int P, const int* offsets, int* fill, int* sorted_pair, "
        "int* pair_pos")
declare("moe", "moe_gemv_gate_up", "const bf16* x, const int* ids, const int* sorted_pair, int kk, "
        "const bf16* gate_up, int I, int H, int P, bf16* act")
declare("moe", "moe_gemv_down_combine", "const bf16* act, const int* ids, const int* pair_pos, const float* wts, "
        "int kk, const bf16* down, int H, int I, int T_, bf16* out")
_MOE_MMA_ARGS = ("const bf16* a, const int* sorted_pair, int topk, const bf16* w, int N, int K, "
                 "const int* tile_expert, const int* tile_row0, const int* offsets, bf16* out")
declare("moe", "moe_mma_gate_up_m{}_n{}_s{}", _MOE_MMA_ARGS)
declare("moe", "moe_mma_down_m{}_n{}_s{}", _MOE_MMA_ARGS)


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
        ops.launch.foreign()    # the memset of the counters: moe_route must follow it plainly
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
            logits=logits, T_=T, E=E, k=top_k, renorm=int(bool(renormalize)), shared=S, nwr=nwr,
            max_tiles=max_tiles, bm=bm, wts=wts, offsets=offsets, tile_expert=tile_expert, tile_row0=tile_row0,
            sorted_pair=sorted_pair, pair_pos=pair_pos, ids=ids, shared_mem=4 * (nwr * E + P))
    else:
        counts, fill = ints[:Et], ints[Et:counters]
        _kernel(ops, "moe.cu", f"moe_route_{_sfx(logits)}")(
            ((T + 3) // 4,), (128,),
            logits=logits, T_=T, E=E, k=top_k, renorm=int(bool(renormalize)), shared=S, ids=ids, wts=wts,
            counts=counts, shared_mem=4 * E * 4)
        _kernel(ops, "moe.cu", "moe_scan_tiles")(
            (1,), (1024,), counts=counts, E=Et, max_tiles=max_tiles, bm=bm, offsets=offsets,
            tile_expert=tile_expert, tile_row0=tile_row0)
        _kernel(ops, "moe.cu", "moe_scatter")(
            ((P + 255) // 256,), (256,), ids=ids, P=P, offsets=offsets, fill=fill, sorted_pair=sorted_pair,
            pair_pos=pair_pos)
    act = _empty(ops, (P, I), x.dtype)
    rows = MOE_GEMV_ROWS
    few = T == 1 or T * top_k * MOE_GEMV_PAIR_SPREAD <= E
    if T <= MOE_GEMV_MAX_TOKENS and few and I % (rows // 2) == 0 and H % MOE_DC_ROWS == 0:
        _kernel(ops, "moe.cu", "moe_gemv_gate_up")(
            (-(-P * I // (rows // 2) // 4),), (128,),
            x=x, ids=ids, sorted_pair=sorted_pair, kk=kk, gate_up=gate_up, I=I, H=H, P=P, act=act)
        _kernel(ops, "moe.cu", "moe_gemv_down_combine")(
            (-(-T * H // MOE_DC_ROWS // 4),), (128,),
            act=act, ids=ids, pair_pos=pair_pos, wts=wts, kk=kk, down=down, H=H, I=I, T_=T, out=out)
        return out
    y = _empty(ops, (P, H), x.dtype)
    for name, ntw, stages, gated, n_out, k_in, a, sp, w, dst in (
            ("gate_up", gu_ntw, gu_st, True, I, H, x, sorted_pair, gate_up, act),
            ("down", dn_ntw, dn_st, False, H, I, act, None, down, y)):
        bn = 8 * (ntw // 2 if gated else ntw)
        smem = moe_mma_smem(mt, ntw, stages)
        _kernel(ops, "moe.cu", f"moe_mma_{name}_m{mt}_n{ntw}_s{stages}", smem)(
            ((n_out + bn - 1) // bn, max_tiles), (32 * MOE_MMA_WARPS,),
            a=a, sorted_pair=sp, topk=kk, w=w, N=n_out, K=k_in, tile_expert=tile_expert, tile_row0=tile_row0,
            offsets=offsets, out=dst, shared_mem=smem)
    _kernel(ops, "moe.cu", f"moe_combine_{sfx}")(
        (T, (H + 255) // 256), (256,), y=y, pair_pos=pair_pos, wts=wts, k=kk, H=H, out=out)
    return out
