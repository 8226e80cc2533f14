// Mixture of experts: routing (softmax + top-k), token permutation by expert, grouped expert
// GEMMs (gate|up with fused SiLU*up, then down) and the weighted combine.
//
// Reference: metrale/backends/cpu.py (CpuOps.moe / _route), which follows HF transformers'
// Qwen3_5MoeTopKRouter + Qwen3_5MoeExperts. Tested in tests/test_cuda_gdn.py.
//
// Pipeline (T tokens, E experts, k = top_k, P = T*k routed pairs, H hidden, I expert width):
//   moe_route_<T>   logits T [T, E + S] (router GEMM done by the caller) -> ids i32 [T, k + S],
//                   wts f32 [T, k + S] (renormalised when asked), counts i32 [E + S] += (atomics).
//                   One warp per token, E <= 1024 floats of dynamic shared memory per warp.
//                   S = `shared` (0 or 1): the shared expert rides along as expert E, pair k of
//                   every token, weight sigmoid(logits[t, E]) (its gate's logit): the callers
//                   append its weights to gate_up / down and its gate to the router.
//   moe_scan_tiles  counts -> offsets i32 [E+1] (exclusive scan), tile list for the GEMMs:
//                   tile_expert i32 [max_tiles] (-1 = unused), tile_row0 i32 [max_tiles]
//                   (tiles of bm = 16 or 64 rows inside each expert's rows). One CTA of 1024
//                   threads.
//   moe_scatter     pair p = t*k + j -> sorted row pos = offsets[e] + atomicAdd(fill[e]);
//                   sorted_pair i32 [P], pair_pos i32 [P]. Order inside an expert varies run to
//                   run, results do not (every row is computed independently).
//   moe_mma_gate_up_m<MT>_n<NTW>_s<ST>  act [P, I] = silu(x[tok] Wg^T) * (x[tok] Wu^T), Wg|Wu =
//                   gate_up[e] [2I, H]; grid (ceil(I/BN), max_tiles); rows gathered through
//                   sorted_pair.
//   moe_mma_down_m<MT>_n<NTW>_s<ST>     y [P, H] = act down[e]^T, down [E, H, I];
//                   grid (ceil(H/BN), max_tiles)
//   moe_combine_<T> out T [T, H] = sum_j wts[t, j] * y[pair_pos[t*k+j]] (fp32, no atomics).
//   moe_plan_<T>    route + scan + scatter in one CTA for steps of few pairs (decode), counts in
//                   shared memory: one launch instead of a memset and three; ids i32 [P] too.
//   moe_gemv_gate_up / moe_gemv_down_combine  the expert GEMMs (and the combine) of steps of a
//                   few tokens on CUDA cores (bf16; see their comment).
// max_tiles = P/bm + min(E, P) + 1 bounds the tiles of any routing, so every launch has a
// static shape (CUDA graphs). Requires H % 8 == 0 and I % 8 == 0 (16-byte loads). bf16 only.
// Bytes: decode is weight-streaming: (active experts) * 3*H*I*2; FLOPs 6*P*H*I.
//
// The expert GEMMs run on tensor cores (mma.sync m16n8k16, bf16 in, fp32 accumulate).
//   MT = 1: tiles of 16 rows (decode: a few rows per expert); MT = 4: 64 rows (prefill).
// One CTA = one row tile x BN output columns (NTW n-tiles of 8 weight rows: gated, half gate and
// half up), 4 warps splitting K: warp w takes the 64-wide k-blocks w, w+4, ... and streams them
// through its own STAGES-deep cp.async pipeline (16-byte cp.async.cg, no block barrier in the
// loop); the warps' fp32 partial sums are added through shared memory at the end. At decode
// every active expert's weights are read exactly once, split over ceil(N/BN) CTAs per expert
// (gate_up at I = 512: 32 CTAs of 128 KB each; down at H = 2048: 64 CTAs of 32 KB).
// Fragments without ldmatrix: k is permuted inside each 32-wide chunk (the sum does not care),
// so that lane (g = lane/4, tq = lane%4) needs exactly the 16 bytes k = 8tq..8tq+7 of W row g
// (B fragment, both k-steps) and of A rows g and g+8 (A fragments): for k-step s the mma takes
// u32 words 2s (logical k 2tq..+1) and 2s+1 (logical k 8+2tq..+1) of those 16 bytes. Every lane
// copies exactly the 16-byte pieces it later reads, stored lane-contiguous (conflict-free), so
// shared memory is only a lane-private staging area and the pipeline needs no __syncwarp.
#include "common.cuh"

namespace {

// One token routed by one warp: softmax over its E routed logits `lg` (p: E floats of scratch),
// top-k (ties: the lowest index), weights renormalised over the k when asked. With `shared`,
// pair k is the shared expert: id E, weight sigmoid(lg[E]) (its gate logit; not renormalised).
// Lane 0 writes ids_out[0 .. k + shared) and wts_out (any memory) and counts[id] += 1 (shared or
// global memory, atomics).
template <typename T>
__device__ __forceinline__ void route_token(const T* lg, int E, int k, int renorm,
                                            int shared, float* p, int* ids_out, float* wts_out,
                                            int* counts) {
    const int lane = threadIdx.x & 31;
    float m = -MT_INF;
    for (int e = lane; e < E; e += 32) {
        const float v = mt::to_f(lg[e]);
        p[e] = v;
        m = fmaxf(m, v);
    }
    m = mt::warp_max(m);
    float s = 0.f;
    for (int e = lane; e < E; e += 32) {
        const float v = expf(p[e] - m);
        p[e] = v;
        s += v;
    }
    s = mt::warp_sum(s);
    __syncwarp();
    float picked = 0.f;
    for (int j = 0; j < k; ++j) {
        // each lane's best untaken expert (the lowest index among equals), then the warp's: the
        // largest value by __reduce_max_sync over order-preserving keys (probabilities are >= 0:
        // their bits + 1; taken ones, -2, key 0), the lowest index holding it by __reduce_min_sync
        float best = -1.f;
        int bi = E;
        for (int e = lane; e < E; e += 32)
            if (p[e] > best) { best = p[e]; bi = e; }
        const unsigned key = best >= 0.f ? __float_as_uint(best) + 1u : 0u;
        const unsigned kmax = __reduce_max_sync(0xffffffffu, key);
        bi = __reduce_min_sync(0xffffffffu, key == kmax ? bi : 0x7fffffff);
        best = __uint_as_float(kmax - 1u);
        const float prob = best / s;
        picked += prob;
        if (lane == 0) {
            ids_out[j] = bi;
            wts_out[j] = prob;
            atomicAdd(&counts[bi], 1);
            p[bi] = -2.f;  // taken
        }
        __syncwarp();
    }
    if (renorm)
        for (int j = lane; j < k; j += 32) wts_out[j] /= picked;
    if (shared && lane == 0) {
        ids_out[k] = E;
        wts_out[k] = mt::sigmoid(mt::to_f(lg[E]));
        atomicAdd(&counts[E], 1);
    }
    __syncwarp();
}

// logits [T, E + shared] -> ids / wts [T, k + shared], counts (global, zeroed by the caller).
template <typename T>
__device__ __forceinline__ void moe_route(const T* logits, int T_, int E, int k,
                                          int renorm, int shared, int* ids,
                                          float* wts, int* counts) {
    extern __shared__ float rbuf[];
    const int warp = threadIdx.x >> 5;
    const int t = blockIdx.x * (blockDim.x >> 5) + warp;
    if (t >= T_) return;
    const int kk = k + shared;
    route_token(logits + (long long)t * (E + shared), E, k, renorm, shared, rbuf + warp * E,
                ids + t * kk, wts + t * kk, counts);
}

__device__ __forceinline__ int block_excl_scan(int v, int* scratch, int* total) {
    // blockDim.x == 1024
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    __syncthreads();
    if (lane == 31) scratch[warp] = x;
    __syncthreads();
    if (warp == 0) {
        int w = scratch[lane];
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int y = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += y;
        }
        scratch[lane] = w;  // inclusive over warps
    }
    __syncthreads();
    const int before = (warp > 0 ? scratch[warp - 1] : 0) + x - v;
    *total = scratch[31];
    return before;
}

template <typename T>
__device__ __forceinline__ void moe_combine(const T* y, const int* pair_pos,
                                            const float* wts, int k, int H,
                                            T* out) {
    const int t = blockIdx.x;
    for (int h = blockIdx.y * blockDim.x + threadIdx.x; h < H; h += gridDim.y * blockDim.x) {
        float acc = 0.f;
        for (int j = 0; j < k; ++j)
            acc = fmaf(wts[t * k + j], mt::to_f(y[(long long)pair_pos[t * k + j] * H + h]), acc);
        out[(long long)t * H + h] = mt::from_f<T>(acc);
    }
}


// ---------------------------------------------------------------------------------------------
// Tensor-core expert GEMMs (see the header). bf16 in, fp32 accumulate (mma.sync m16n8k16).
constexpr int MMA_KB = 64;   // k per pipeline stage of one warp (two 32-wide chunks)
constexpr int MMA_NW = 4;    // warps per CTA (split K)

// c += a * b, 16x8x16 bf16 -> fp32. Fragment layouts as in attention.cu's mma16816.
__device__ __forceinline__ void moe_mma16816(float (&c)[4], unsigned a0, unsigned a1, unsigned a2,
                                             unsigned a3, unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                 "{%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// cp.async / wait with a memory clobber: the staged data is read back with plain shared loads,
// which must not move across them.
__device__ __forceinline__ void moe_cp16(void* smem, const void* gmem, bool valid) {
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem),
                 "r"(valid ? 16 : 0) : "memory");
}
__device__ __forceinline__ void moe_cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void moe_cp_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ unsigned moe_pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (low 16 bits) = lo
    return *reinterpret_cast<unsigned*>(&v);
}

// Row tile of MT*16 rows of one expert x NTW n-tiles of 8 weight rows (GATED: NTW/2 of gate rows
// n0.., NTW/2 of up rows N + n0..), over all of K. Shared memory per warp and stage (uint4 units,
// index = piece * 32 + lane): W pieces j*2 + c (n-tile j, 32-wide chunk c), then A pieces
// WP + (mi*2 + h)*2 + c (m-tile mi, rows h*8 + g). After the loop it holds the warps' partial
// accumulators, red[((w*MT + mi)*NTW + j)*4 + e][lane].
template <bool GATED, int MT, int NTW, int STAGES>
__device__ __forceinline__ void moe_mma_gemm(const __nv_bfloat16* A,
                                             const int* sorted_pair, int topk,
                                             const __nv_bfloat16* W, int N, int K,
                                             const int* tile_expert,
                                             const int* tile_row0,
                                             const int* offsets,
                                             __nv_bfloat16* out) {
    constexpr int NB = GATED ? NTW / 2 : NTW;  // output n-tiles per CTA
    constexpr int BN = NB * 8;
    constexpr int WP = NTW * 2;                // W pieces per stage (16 B per lane each)
    constexpr int AP = MT * 4;                 // A pieces per stage
    constexpr int STAGE = (WP + AP) * 32;      // uint4 per warp and stage
    static_assert(!GATED || NTW % 2 == 0, "gated tiles pair gate and up n-tiles");
    static_assert(STAGES >= 2, "pipeline depth");
    static_assert(MT * NTW * 4 * 32 <= STAGES * STAGE * 4, "reduction fits in the stages");
    extern __shared__ uint4 moe_smem[];

    const int e = tile_expert[blockIdx.y];
    if (e < 0) return;
    const int row0 = tile_row0[blockIdx.y], row_end = offsets[e + 1];
    const int n0 = blockIdx.x * BN;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, tq = lane & 3;
    uint4* wbuf = moe_smem + warp * STAGES * STAGE;

    // this lane's weight rows (row g of each n-tile) and activation rows (g, g + 8 of each m-tile)
    const long long wrows = GATED ? 2LL * N : (long long)N;
    const __nv_bfloat16* We = W + (long long)e * wrows * K + tq * 8;
    const __nv_bfloat16* wp[NTW];
    bool wv[NTW];
#pragma unroll
    for (int j = 0; j < NTW; ++j) {
        const int jj = GATED ? j % NB : j;
        wv[j] = n0 + jj * 8 < N;  // N % 8 == 0: an n-tile is all in or all out
        const long long r = (GATED && j >= NB ? N : 0) + (wv[j] ? n0 + jj * 8 + g : 0);
        wp[j] = We + r * K;
    }
    const __nv_bfloat16* ap[MT][2];
    bool av[MT][2];
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = row0 + mi * 16 + h * 8 + g;
            av[mi][h] = r < row_end;
            const long long src = av[mi][h] ? (sorted_pair ? sorted_pair[r] / topk : r) : 0;
            ap[mi][h] = A + src * K + tq * 8;
        }

    const int nkb = (K + MMA_KB - 1) / MMA_KB;
    const int nmine = nkb > warp ? (nkb - warp + MMA_NW - 1) / MMA_NW : 0;
    // stage k-block i of this warp (block warp + NW*i); always commits a group
    auto issue = [&](int i) {
        if (i < nmine) {
            const int k0 = (warp + MMA_NW * i) * MMA_KB;
            uint4* st = wbuf + (i % STAGES) * STAGE + lane;
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int kc = k0 + c * 32;
                const bool kv = kc + tq * 8 < K;  // K % 8 == 0: a 16-byte piece is all in or out
#pragma unroll
                for (int j = 0; j < NTW; ++j) {
                    const bool ok = wv[j] && kv;
                    moe_cp16(st + (j * 2 + c) * 32, ok ? wp[j] + kc : W, ok);
                }
#pragma unroll
                for (int mi = 0; mi < MT; ++mi)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const bool ok = av[mi][h] && kv;
                        moe_cp16(st + (WP + (mi * 2 + h) * 2 + c) * 32, ok ? ap[mi][h] + kc : A, ok);
                    }
            }
        }
        moe_cp_commit();
    };
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) issue(s);

    float acc[MT][NTW][4];
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
        for (int j = 0; j < NTW; ++j) acc[mi][j][0] = acc[mi][j][1] = acc[mi][j][2] = acc[mi][j][3] = 0.f;

    for (int i = 0; i < nmine; ++i) {
        moe_cp_wait<STAGES - 2>();  // block i landed (this lane's own copies)
        issue(i + STAGES - 1);      // into the stage this lane finished reading last iteration
        const uint4* st = wbuf + (i % STAGES) * STAGE + lane;
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            uint4 a[MT][2], b[NTW];
#pragma unroll
            for (int mi = 0; mi < MT; ++mi)
#pragma unroll
                for (int h = 0; h < 2; ++h) a[mi][h] = st[(WP + (mi * 2 + h) * 2 + c) * 32];
#pragma unroll
            for (int j = 0; j < NTW; ++j) b[j] = st[(j * 2 + c) * 32];
#pragma unroll
            for (int mi = 0; mi < MT; ++mi)
#pragma unroll
                for (int j = 0; j < NTW; ++j) {
                    moe_mma16816(acc[mi][j], a[mi][0].x, a[mi][1].x, a[mi][0].y, a[mi][1].y, b[j].x, b[j].y);
                    moe_mma16816(acc[mi][j], a[mi][0].z, a[mi][1].z, a[mi][0].w, a[mi][1].w, b[j].z, b[j].w);
                }
        }
    }
    moe_cp_wait<0>();

    // add the warps' partial sums (fixed order: deterministic), epilogue, store
    __syncthreads();  // every warp is done with its stages
    float* red = reinterpret_cast<float*>(moe_smem);
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
        for (int j = 0; j < NTW; ++j)
#pragma unroll
            for (int q = 0; q < 4; ++q) red[(((warp * MT + mi) * NTW + j) * 4 + q) * 32 + lane] = acc[mi][j][q];
    __syncthreads();
    for (int it = tid; it < MT * NB * 32; it += MMA_NW * 32) {
        const int l = it & 31, mj = it >> 5, mi = mj / NB, jj = mj % NB;
        if (n0 + jj * 8 >= N) continue;
        float v[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            float s = 0.f, u = 0.f;
#pragma unroll
            for (int w = 0; w < MMA_NW; ++w) {
                s += red[(((w * MT + mi) * NTW + jj) * 4 + q) * 32 + l];
                if (GATED) u += red[(((w * MT + mi) * NTW + jj + NB) * 4 + q) * 32 + l];
            }
            v[q] = GATED ? mt::silu(s) * u : s;
        }
        const int r = row0 + mi * 16 + (l >> 2);
        const int n = n0 + jj * 8 + 2 * (l & 3);
        if (r < row_end)
            *reinterpret_cast<unsigned*>(out + (long long)r * N + n) = moe_pack_bf16(v[0], v[1]);
        if (r + 8 < row_end)
            *reinterpret_cast<unsigned*>(out + (long long)(r + 8) * N + n) = moe_pack_bf16(v[2], v[3]);
    }
}


}  // namespace

// Expert e = threadIdx.x (blockDim.x == 1024) with c rows: offsets[e] (exclusive scan; offsets[E]
// = the total), its tiles of bm rows appended to tile_expert / tile_row0, the unused ones -1.
// Returns offsets[e].
__device__ __forceinline__ int scan_tiles(int c, int E, int max_tiles, int bm, int* offsets,
                                          int* tile_expert, int* tile_row0) {
    __shared__ int scratch[32];
    const int e = threadIdx.x;
    int total_rows, total_tiles;
    const int off = block_excl_scan(c, scratch, &total_rows);
    const int nt = (c + bm - 1) / bm;
    const int toff = block_excl_scan(nt, scratch, &total_tiles);
    if (e < E) offsets[e] = off;
    if (e == 0) offsets[E] = total_rows;
    for (int j = 0; j < nt; ++j) {
        if (toff + j < max_tiles) {
            tile_expert[toff + j] = e;
            tile_row0[toff + j] = off + j * bm;
        }
    }
    for (int j = total_tiles + e; j < max_tiles; j += blockDim.x) tile_expert[j] = -1;
    return off;
}

__device__ __forceinline__ void moe_scan_impl(const int* counts, int E, int max_tiles, int bm,
                                              int* offsets, int* tile_expert, int* tile_row0) {
    const int e = threadIdx.x;
    scan_tiles(e < E ? counts[e] : 0, E, max_tiles, bm, offsets, tile_expert, tile_row0);
}

// counts -> offsets and the GEMMs' tile list, tiles of `bm` rows (16 or 64).
extern "C" __global__ void __launch_bounds__(1024) moe_scan_tiles(const int* counts, int E,
                                                                  int max_tiles, int bm,
                                                                  int* offsets, int* tile_expert,
                                                                  int* tile_row0) { mt::pdl_enter();
    moe_scan_impl(counts, E, max_tiles, bm, offsets, tile_expert, tile_row0);
    mt::pdl_exit();
}

extern "C" __global__ void moe_scatter(const int* ids, int P, const int* offsets, int* fill,
                                       int* sorted_pair, int* pair_pos) { mt::pdl_enter();
    const int p = blockIdx.x * blockDim.x + threadIdx.x;
    if (p >= P) return;
    const int e = ids[p];
    const int pos = offsets[e] + atomicAdd(&fill[e], 1);
    sorted_pair[pos] = p;
    pair_pos[p] = pos;
    mt::pdl_exit();
}

// moe_plan: moe_route + moe_scan_tiles + moe_scatter in one CTA of 1024 threads, for steps of
// few pairs (decode: P = T * (k + shared) <= MOE_PLAN_MAX_PAIRS); counts and fills live in shared
// memory (no memset, one launch instead of four). Warps 0 .. nwr-1 route tokens w, w + nwr, ...
// (dynamic shared memory: nwr * E floats of softmax scratch, then the P expert ids).
// E + shared <= 1024.
template <typename T>
__device__ __forceinline__ void moe_plan(const T* logits, int T_, int E, int k,
                                         int renorm, int shared, int nwr, int max_tiles, int bm,
                                         float* wts, int* offsets,
                                         int* tile_expert, int* tile_row0,
                                         int* sorted_pair, int* pair_pos,
                                         int* ids_out) {
    extern __shared__ float dyn[];
    __shared__ int counts[1024], fill[1024], offs[1024];
    const int tid = threadIdx.x, warp = tid >> 5;
    const int kk = k + shared, Et = E + shared, P = T_ * kk;
    int* ids = reinterpret_cast<int*>(dyn + nwr * E);
    counts[tid] = 0;
    fill[tid] = 0;
    __syncthreads();
    if (warp < nwr)
        for (int t = warp; t < T_; t += nwr)
            route_token(logits + (long long)t * Et, E, k, renorm, shared, dyn + warp * E, ids + t * kk,
                        wts + t * kk, counts);
    __syncthreads();
    offs[tid] = scan_tiles(tid < Et ? counts[tid] : 0, Et, max_tiles, bm, offsets, tile_expert,
                           tile_row0);
    __syncthreads();
    for (int p = tid; p < P; p += blockDim.x) {
        const int e = ids[p];
        const int pos = offs[e] + atomicAdd(&fill[e], 1);
        sorted_pair[pos] = p;
        pair_pos[p] = pos;
        ids_out[p] = e;
    }
}

// -- decode expert GEMVs (T <= 4, MOE_GEMV_MAX_TOKENS): CUDA cores, weights streamed ----------
//
// moe_gemv_gate_up: act [P, I] (sorted pair order pos) = silu(Wg x) * (Wu x) with
//   Wg|Wu = gate_up[e] [2I, H], e = ids[sorted_pair[pos]], x = x[sorted_pair[pos] / kk];
// moe_gemv_down_combine (below): out = the weighted sum of down[e] act[pos] over each token's
// pairs. One warp = GV_ROWS weight rows of one pair (GV_ROWS / 2 outputs, their gate and up
// rows) over all of k:
// lane l reads the 16-byte vectors l, l + 32, ... of every row (512 contiguous bytes per row
// per warp instruction), GV_U per row per round, all issued before the FMAs (volatile loads);
// fp32 sums, warp-shuffle reduction, lane 0 stores. Why: at T = 1 the 9 experts of a
// Qwen3.5-35B-A3B layer are 36 MB of gate_up in 288 tensor-core CTAs of 128 KB (2.2 per SM:
// the slowest SM's third CTA sets the end); here 576-1152 CTAs of 4 warps balance like the
// dense GEMV (gemv.cu). A pair re-reads an expert another pair of the step also took (T > 1).
// Bytes: P x (2I + I) x H x 2 (weights) + (P + T) x H x 2 + 2 P x I x 2; FLOPs 6 P H I.
constexpr int GV_ROWS = 4, GV_U = 4;

// weights through the read-only path (no kernel writes them; read once: kept out of L1),
// activations coherent (common.cuh: programmatic dependent launch)
__device__ __forceinline__ uint4 moe_ldg16_w(const void* p, bool pred) { return mt::ldg16_if<true>(p, pred); }
__device__ __forceinline__ uint4 moe_ldg16_x(const void* p, bool pred) { return mt::ldg16_if<false>(p, pred); }

__device__ __forceinline__ float moe_dot8(const uint4& a, const uint4& b, float acc) {
    const uint32_t aw[4] = {a.x, a.y, a.z, a.w}, bw[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        acc = fmaf(__uint_as_float(aw[i] << 16), __uint_as_float(bw[i] << 16), acc);
        acc = fmaf(__uint_as_float(aw[i] & 0xffff0000u), __uint_as_float(bw[i] & 0xffff0000u), acc);
    }
    return acc;
}

// acc[r] = w[r] . x over k (k % 8 == 0), summed over the warp (every lane gets the totals)
__device__ __forceinline__ void moe_warp_rows(const __nv_bfloat16* const (&w)[GV_ROWS],
                                              const __nv_bfloat16* x, int k,
                                              float (&acc)[GV_ROWS]) {
    const int lane = threadIdx.x & 31;
    const int nv = k >> 3;
#pragma unroll
    for (int r = 0; r < GV_ROWS; ++r) acc[r] = 0.f;
    for (int v0 = 0; v0 < nv; v0 += 32 * GV_U) {
        uint4 wv[GV_ROWS][GV_U], xv[GV_U];
#pragma unroll
        for (int u = 0; u < GV_U; ++u) {
            const int v = v0 + u * 32 + lane;
#pragma unroll
            for (int r = 0; r < GV_ROWS; ++r) wv[r][u] = moe_ldg16_w(w[r] + v * 8, v < nv);
        }
#pragma unroll
        for (int u = 0; u < GV_U; ++u) {
            const int v = v0 + u * 32 + lane;
            xv[u] = moe_ldg16_x(x + v * 8, v < nv);
        }
#pragma unroll
        for (int u = 0; u < GV_U; ++u)
#pragma unroll
            for (int r = 0; r < GV_ROWS; ++r) acc[r] = moe_dot8(wv[r][u], xv[u], acc[r]);
    }
#pragma unroll
    for (int r = 0; r < GV_ROWS; ++r) acc[r] = mt::warp_sum(acc[r]);
}

extern "C" __global__ void __launch_bounds__(128, 1) moe_gemv_gate_up(
    const __nv_bfloat16* x, const int* ids,
    const int* sorted_pair, int kk, const __nv_bfloat16* gate_up, int I,
    int H, int P, __nv_bfloat16* act) { mt::pdl_enter();
    constexpr int NO = GV_ROWS / 2;                       // outputs per warp (I % NO == 0)
    const long long wg = (long long)blockIdx.x * 4 + (threadIdx.x >> 5);
    const int per_pos = I / NO;
    const int pos = (int)(wg / per_pos);
    if (pos >= P) return;
    const int j0 = (int)(wg % per_pos) * NO;
    const int pair = sorted_pair[pos];
    const __nv_bfloat16* We = gate_up + (long long)ids[pair] * 2 * I * H;
    const __nv_bfloat16* w[GV_ROWS];
#pragma unroll
    for (int r = 0; r < NO; ++r) {
        w[r] = We + (long long)(j0 + r) * H;
        w[NO + r] = We + (long long)(I + j0 + r) * H;
    }
    float acc[GV_ROWS];
    moe_warp_rows(w, x + (long long)(pair / kk) * H, H, acc);
    if ((threadIdx.x & 31) == 0)
#pragma unroll
        for (int r = 0; r < NO; ++r)
            act[(long long)pos * I + j0 + r] = __float2bfloat16_rn(mt::silu(acc[r]) * acc[NO + r]);
    mt::pdl_exit();
}

// moe_gemv_down_combine: out [T, H] = sum_j wts[t*kk + j] * (down[e] [H, I] act[pos]) over the
// kk pairs j of token t, e = ids[t*kk + j], pos = pair_pos[t*kk + j]: the down GEMVs and
// moe_combine in one pass (no y, no rounding of the per-expert rows to bf16). One warp = DC_ROWS
// outputs n of one token; DC_J pairs' rows in flight at a time; the weighted sum in each lane in
// pair order, then one warp reduction (fixed order: deterministic).
constexpr int DC_ROWS = 2, DC_J = 4, DC_U = 2;

template <int J>
__device__ __forceinline__ void dc_pairs(const __nv_bfloat16* act,
                                         const int* ids,
                                         const int* pair_pos,
                                         const float* wts, int p0,
                                         const __nv_bfloat16* down, int H, int I,
                                         int n0, float (&tot)[DC_ROWS]) {
    const int lane = threadIdx.x & 31;
    const __nv_bfloat16* w[J][DC_ROWS];
    const __nv_bfloat16* xa[J];
    float wt[J];
#pragma unroll
    for (int j = 0; j < J; ++j) {
        const int p = p0 + j;
        const long long e = ids[p];
        xa[j] = act + (long long)pair_pos[p] * I;
        wt[j] = wts[p];
#pragma unroll
        for (int r = 0; r < DC_ROWS; ++r) w[j][r] = down + (e * H + n0 + r) * I;
    }
    float acc[J][DC_ROWS];
#pragma unroll
    for (int j = 0; j < J; ++j)
#pragma unroll
        for (int r = 0; r < DC_ROWS; ++r) acc[j][r] = 0.f;
    const int nv = I >> 3;
    for (int v0 = 0; v0 < nv; v0 += 32 * DC_U) {
        uint4 wv[J][DC_ROWS][DC_U], xv[J][DC_U];
#pragma unroll
        for (int u = 0; u < DC_U; ++u) {
            const int v = v0 + u * 32 + lane;
#pragma unroll
            for (int j = 0; j < J; ++j)
#pragma unroll
                for (int r = 0; r < DC_ROWS; ++r) wv[j][r][u] = moe_ldg16_w(w[j][r] + v * 8, v < nv);
        }
#pragma unroll
        for (int u = 0; u < DC_U; ++u) {
            const int v = v0 + u * 32 + lane;
#pragma unroll
            for (int j = 0; j < J; ++j) xv[j][u] = moe_ldg16_x(xa[j] + v * 8, v < nv);
        }
#pragma unroll
        for (int u = 0; u < DC_U; ++u)
#pragma unroll
            for (int j = 0; j < J; ++j)
#pragma unroll
                for (int r = 0; r < DC_ROWS; ++r) acc[j][r] = moe_dot8(wv[j][r][u], xv[j][u], acc[j][r]);
    }
#pragma unroll
    for (int j = 0; j < J; ++j)
#pragma unroll
        for (int r = 0; r < DC_ROWS; ++r) tot[r] = fmaf(wt[j], acc[j][r], tot[r]);
}

extern "C" __global__ void __launch_bounds__(128, 1) moe_gemv_down_combine(
    const __nv_bfloat16* act, const int* ids,
    const int* pair_pos, const float* wts, int kk,
    const __nv_bfloat16* down, int H, int I, int T_, __nv_bfloat16* out) { mt::pdl_enter();
    const long long wg = (long long)blockIdx.x * 4 + (threadIdx.x >> 5);
    const int per_tok = H / DC_ROWS;                      // H % DC_ROWS == 0
    const int t = (int)(wg / per_tok);
    if (t >= T_) return;
    const int n0 = (int)(wg % per_tok) * DC_ROWS;
    float tot[DC_ROWS];
#pragma unroll
    for (int r = 0; r < DC_ROWS; ++r) tot[r] = 0.f;
    int j = 0;
    for (; j + DC_J <= kk; j += DC_J) dc_pairs<DC_J>(act, ids, pair_pos, wts, t * kk + j, down, H, I, n0, tot);
    for (; j < kk; ++j) dc_pairs<1>(act, ids, pair_pos, wts, t * kk + j, down, H, I, n0, tot);
#pragma unroll
    for (int r = 0; r < DC_ROWS; ++r) tot[r] = mt::warp_sum(tot[r]);
    if ((threadIdx.x & 31) == 0)
#pragma unroll
        for (int r = 0; r < DC_ROWS; ++r) out[(long long)t * H + n0 + r] = __float2bfloat16_rn(tot[r]);
    mt::pdl_exit();
}

#define MOE_INST(T, SUF)                                                                          \
    extern "C" __global__ void __launch_bounds__(128) moe_route_##SUF(                            \
        const T* logits, int T_, int E, int k, int renorm, int shared, int* ids, float* wts,      \
        int* counts) { mt::pdl_enter();                                                           \
        moe_route<T>(logits, T_, E, k, renorm, shared, ids, wts, counts);                         \
        mt::pdl_exit();                                                                           \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(1024) moe_plan_##SUF(                            \
        const T* logits, int T_, int E, int k, int renorm, int shared, int nwr, int max_tiles,    \
        int bm, float* wts, int* offsets, int* tile_expert, int* tile_row0, int* sorted_pair,     \
        int* pair_pos, int* ids) { mt::pdl_enter();                                               \
        moe_plan<T>(logits, T_, E, k, renorm, shared, nwr, max_tiles, bm, wts, offsets,           \
                    tile_expert, tile_row0, sorted_pair, pair_pos, ids);                          \
        mt::pdl_exit();                                                                           \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(256) moe_combine_##SUF(                          \
        const T* y, const int* pair_pos, const float* wts, int k, int H, T* out) { mt::pdl_enter(); \
        moe_combine<T>(y, pair_pos, wts, k, H, out);                                              \
        mt::pdl_exit();                                                                           \
    }
MOE_INST(__nv_bfloat16, bf16)

// Tensor-core GEMMs (bf16 only), 128 threads, dynamic shared memory.
#define MOE_MMA_INST(NAME, GATED, MT, NTW, ST)                                                    \
    extern "C" __global__ void __launch_bounds__(MMA_NW * 32) NAME(                               \
        const __nv_bfloat16* a, const int* sorted_pair, int topk, const __nv_bfloat16* w, int N,   \
        int K, const int* tile_expert, const int* tile_row0, const int* offsets,                  \
        __nv_bfloat16* out) { mt::pdl_enter();                                                    \
        moe_mma_gemm<GATED, MT, NTW, ST>(a, sorted_pair, topk, w, N, K, tile_expert, tile_row0,   \
                                         offsets, out);                                           \
        mt::pdl_exit();                                                                           \
    }
// Tilings: moe_mma_<gate_up|down>_m<MT>_n<NTW>_s<STAGES> (the host picks one through MOE_MMA in
// metrale/backends/cuda/moe.py; perf/moe_tune.py times the rest). Shared memory per CTA:
// 4 warps x STAGES x (2 NTW + 4 MT) x 512 B (n4_s4: 96 KB, two CTAs per SM).
#define MOE_MMA_CFG(MT, NTW, ST)                                                                  \
    MOE_MMA_INST(moe_mma_gate_up_m##MT##_n##NTW##_s##ST, true, MT, NTW, ST)                       \
    MOE_MMA_INST(moe_mma_down_m##MT##_n##NTW##_s##ST, false, MT, NTW, ST)
MOE_MMA_CFG(1, 2, 4)
MOE_MMA_CFG(1, 2, 6)
MOE_MMA_CFG(1, 4, 2)
MOE_MMA_CFG(1, 4, 3)
MOE_MMA_CFG(1, 4, 4)
MOE_MMA_CFG(1, 8, 2)
MOE_MMA_CFG(4, 4, 2)
