// Mixture of experts: routing (softmax + top-k), token permutation by expert, grouped expert
// GEMMs (gate|up with fused SiLU*up, then down) and the weighted combine.
//
// Reference: metrale/backends/cpu.py (CpuOps.moe / _route), which follows HF transformers'
// Qwen3_5MoeTopKRouter + Qwen3_5MoeExperts. Tested in tests/test_cuda_gdn.py.
//
// Pipeline (T tokens, E experts, k = top_k, P = T*k routed pairs, H hidden, I expert width):
//   moe_route_<T>   logits T [T, E] (router GEMM done by the caller) -> ids i32 [T, k],
//                   wts f32 [T, k] (renormalised when asked), counts i32 [E] += (atomics).
//                   One warp per token, E <= 1024 floats of dynamic shared memory per warp.
//   moe_scan        counts -> offsets i32 [E+1] (exclusive scan), tile list for the GEMMs:
//                   tile_expert i32 [max_tiles] (-1 = unused), tile_row0 i32 [max_tiles]
//                   (tiles of 64 rows inside each expert's rows). One CTA of 1024 threads.
//   moe_scatter     pair p = t*k + j -> sorted row pos = offsets[e] + atomicAdd(fill[e]);
//                   sorted_pair i32 [P], pair_pos i32 [P]. Order inside an expert varies run to
//                   run, results do not (every row is computed independently).
//   moe_gemm_gate_up_<T>  act T [P, I] = silu(x[tok] Wg^T) * (x[tok] Wu^T), Wg|Wu = gate_up[e]
//                   [2I, H]; grid (I/64, max_tiles); rows gathered through sorted_pair.
//   moe_gemm_down_<T>     y T [P, H] = act down[e]^T, down [E, H, I]; grid (H/64, max_tiles).
//   moe_combine_<T> out T [T, H] = sum_j wts[t, j] * y[pair_pos[t*k+j]] (fp32, no atomics).
// max_tiles = P/64 + min(E, P) + 1 bounds the tiles of any routing, so every launch has a
// static shape (CUDA graphs). Requires H % 8 == 0 and I % 8 == 0 (16-byte loads).
// Bytes: decode is weight-streaming: (active experts) * 3*H*I*2; FLOPs 6*P*H*I.
// The GEMMs are a simple 64x64x32 fp32-FMA tiling from shared memory (correctness first):
// at prefill sizes they run far below the tensor-core roofline (~790 TFLOP/s), and at decode
// (<= 8 rows per expert) the weight stream is what matters; mma.sync / wgmma tiles are the next
// step.
#include "common.cuh"

namespace {

constexpr int BM = 64, BN = 64, BK = 32, GNT = 256;

template <typename T>
__device__ __forceinline__ void moe_route(const T* __restrict__ logits, int T_, int E, int k,
                                          int renorm, int* __restrict__ ids,
                                          float* __restrict__ wts, int* __restrict__ counts) {
    extern __shared__ float rbuf[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int t = blockIdx.x * (blockDim.x >> 5) + warp;
    if (t >= T_) return;
    float* p = rbuf + warp * E;
    float m = -MT_INF;
    for (int e = lane; e < E; e += 32) {
        const float v = mt::to_f(logits[(long long)t * E + e]);
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
        float best = -1.f;
        int bi = E;
        for (int e = lane; e < E; e += 32)
            if (p[e] > best) { best = p[e]; bi = e; }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ob = __shfl_xor_sync(0xffffffffu, best, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ob > best || (ob == best && oi < bi)) { best = ob; bi = oi; }
        }
        const float prob = best / s;
        picked += prob;
        if (lane == 0) {
            ids[t * k + j] = bi;
            wts[t * k + j] = prob;
            atomicAdd(&counts[bi], 1);
            p[bi] = -2.f;  // taken
        }
        __syncwarp();
    }
    if (renorm)
        for (int j = lane; j < k; j += 32) wts[t * k + j] /= picked;
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
__device__ __forceinline__ void load8(const T* p, bool valid, float* out);
template <>
__device__ __forceinline__ void load8<__nv_bfloat16>(const __nv_bfloat16* p, bool valid, float* out) {
    mt::Vec16<__nv_bfloat16> v;
    v.u = valid ? *reinterpret_cast<const uint4*>(p) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = __bfloat162float(v.v[i]);
}
template <>
__device__ __forceinline__ void load8<float>(const float* p, bool valid, float* out) {
    const float4 z = make_float4(0.f, 0.f, 0.f, 0.f);
    const float4 a = valid ? reinterpret_cast<const float4*>(p)[0] : z;
    const float4 b = valid ? reinterpret_cast<const float4*>(p)[1] : z;
    out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
    out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
}

// C[r, n] = sum_k A[row(r), k] * W_e[n, k] over one tile of 64 rows of one expert.
// GATED: second weight block at rows N + n (up), output silu(gate) * up.
template <typename T, bool GATED>
__device__ __forceinline__ void moe_gemm(const T* __restrict__ A, const int* __restrict__ sorted_pair,
                                         int topk, const T* __restrict__ W, int N, int K,
                                         const int* __restrict__ tile_expert,
                                         const int* __restrict__ tile_row0,
                                         const int* __restrict__ offsets, T* __restrict__ out) {
    __shared__ float As[BK][BM + 1];
    __shared__ float Bs[GATED ? 2 : 1][BK][BN + 1];
    const int e = tile_expert[blockIdx.y];
    if (e < 0) return;
    const int row0 = tile_row0[blockIdx.y], row_end = offsets[e + 1];
    const int n0 = blockIdx.x * BN;
    const int tid = threadIdx.x;
    const int lr = tid >> 2, lk = (tid & 3) * 8;  // loader: row/col of the tile, 8 k values
    const int arow = row0 + lr;
    const bool avalid = arow < row_end;
    const T* arow_p = A + (long long)(avalid ? (sorted_pair ? sorted_pair[arow] / topk : arow) : 0) * K;
    const long long wrows = GATED ? 2LL * N : (long long)N;
    const T* We = W + (long long)e * wrows * K;
    const bool bvalid = n0 + lr < N;
    const T* b0 = We + (long long)(bvalid ? n0 + lr : 0) * K;
    const T* b1 = We + (long long)(bvalid ? N + n0 + lr : 0) * K;

    const int tx = tid & 15, ty = tid >> 4;
    float acc[GATED ? 2 : 1][4][4] = {};
    for (int k0 = 0; k0 < K; k0 += BK) {
        const bool kvalid = k0 + lk < K;
        float va[8], vb[8];
        load8<T>(arow_p + k0 + lk, avalid && kvalid, va);
        load8<T>(b0 + k0 + lk, bvalid && kvalid, vb);
#pragma unroll
        for (int i = 0; i < 8; ++i) { As[lk + i][lr] = va[i]; Bs[0][lk + i][lr] = vb[i]; }
        if (GATED) {
            load8<T>(b1 + k0 + lk, bvalid && kvalid, vb);
#pragma unroll
            for (int i = 0; i < 8; ++i) Bs[GATED ? 1 : 0][lk + i][lr] = vb[i];
        }
        __syncthreads();
#pragma unroll 8
        for (int kk = 0; kk < BK; ++kk) {
            float a[4], b[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) a[i] = As[kk][ty + i * 16];
#pragma unroll
            for (int g = 0; g < (GATED ? 2 : 1); ++g) {
#pragma unroll
                for (int j = 0; j < 4; ++j) b[j] = Bs[g][kk][tx + j * 16];
#pragma unroll
                for (int i = 0; i < 4; ++i)
#pragma unroll
                    for (int j = 0; j < 4; ++j) acc[g][i][j] = fmaf(a[i], b[j], acc[g][i][j]);
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int r = row0 + ty + i * 16;
        if (r >= row_end) continue;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int n = n0 + tx + j * 16;
            if (n >= N) continue;
            float val = acc[0][i][j];
            if (GATED) val = mt::silu(val) * acc[GATED ? 1 : 0][i][j];
            out[(long long)r * N + n] = mt::from_f<T>(val);
        }
    }
}

template <typename T>
__device__ __forceinline__ void moe_combine(const T* __restrict__ y, const int* __restrict__ pair_pos,
                                            const float* __restrict__ wts, int k, int H,
                                            T* __restrict__ out) {
    const int t = blockIdx.x;
    for (int h = blockIdx.y * blockDim.x + threadIdx.x; h < H; h += gridDim.y * blockDim.x) {
        float acc = 0.f;
        for (int j = 0; j < k; ++j)
            acc = fmaf(wts[t * k + j], mt::to_f(y[(long long)pair_pos[t * k + j] * H + h]), acc);
        out[(long long)t * H + h] = mt::from_f<T>(acc);
    }
}

}  // namespace

extern "C" __global__ void __launch_bounds__(1024) moe_scan(const int* counts, int E, int max_tiles,
                                                            int* offsets, int* tile_expert,
                                                            int* tile_row0) {
    __shared__ int scratch[32];
    const int e = threadIdx.x;
    const int c = e < E ? counts[e] : 0;
    int total_rows, total_tiles;
    const int off = block_excl_scan(c, scratch, &total_rows);
    const int nt = (c + BM - 1) / BM;
    const int toff = block_excl_scan(nt, scratch, &total_tiles);
    if (e < E) offsets[e] = off;
    if (e == 0) offsets[E] = total_rows;
    for (int j = 0; j < nt; ++j) {
        if (toff + j < max_tiles) {
            tile_expert[toff + j] = e;
            tile_row0[toff + j] = off + j * BM;
        }
    }
    for (int j = total_tiles + e; j < max_tiles; j += blockDim.x) tile_expert[j] = -1;
}

extern "C" __global__ void moe_scatter(const int* ids, int P, const int* offsets, int* fill,
                                       int* sorted_pair, int* pair_pos) {
    const int p = blockIdx.x * blockDim.x + threadIdx.x;
    if (p >= P) return;
    const int e = ids[p];
    const int pos = offsets[e] + atomicAdd(&fill[e], 1);
    sorted_pair[pos] = p;
    pair_pos[p] = pos;
}

#define MOE_INST(T, SUF)                                                                          \
    extern "C" __global__ void __launch_bounds__(128) moe_route_##SUF(                            \
        const T* logits, int T_, int E, int k, int renorm, int* ids, float* wts, int* counts) {   \
        moe_route<T>(logits, T_, E, k, renorm, ids, wts, counts);                                 \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(GNT) moe_gemm_gate_up_##SUF(                     \
        const T* x, const int* sorted_pair, int topk, const T* gate_up, int I, int H,             \
        const int* tile_expert, const int* tile_row0, const int* offsets, T* act) {               \
        moe_gemm<T, true>(x, sorted_pair, topk, gate_up, I, H, tile_expert, tile_row0, offsets,   \
                          act);                                                                   \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(GNT) moe_gemm_down_##SUF(                        \
        const T* act, const T* down, int H, int I, const int* tile_expert, const int* tile_row0,  \
        const int* offsets, T* y) {                                                               \
        moe_gemm<T, false>(act, nullptr, 1, down, H, I, tile_expert, tile_row0, offsets, y);      \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(256) moe_combine_##SUF(                          \
        const T* y, const int* pair_pos, const float* wts, int k, int H, T* out) {                \
        moe_combine<T>(y, pair_pos, wts, k, H, out);                                              \
    }
MOE_INST(__nv_bfloat16, bf16)
MOE_INST(float, f32)
