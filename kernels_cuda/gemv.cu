// Decode GEMVs: y[t, n] (+)= x[t, k] @ w[n, k]^T for 1-8 rows of x, fp32 accumulation.
//
// Why: at decode sizes (SmolLM2-135M: w 192..3072 x 576 and 576 x 1536, 0.2-3.5 MB) cuBLAS runs
// a tensor-core tile kernel (nvjet_sm90_tst_8x64...) for ~3.8 us although the weight streams in
// ~0.2-1 us at 4 TB/s: the GEMM is latency-bound. Here every 16-byte load of a CTA's weight rows
// is issued before the first FMA that needs one (one dependent DRAM round trip for k <= 4096
// with the split below), then a warp-shuffle reduction and one rounded store per output.
//
// Entry points (extern "C"): gemv_t<T>_r<R>_<bf16|f16>, T in {1, 2, 4, 8} (rows of x the
// kernel is compiled for; it runs nt <= T of them: the host picks the smallest T >= nt),
// R in {2, 4} (output columns n per row group); gemv_t<T>_r<R>_bf16_f32 store y in fp32 (the
// lm head: logits rounded to bf16 tie exactly between tokens often enough that greedy output
// then depends on the batch). Arguments:
//   x        [nt, k]  row stride x_ld (elements), 16-byte aligned, x_ld % 8 == 0
//   w        [n, k]   row stride w_ld (elements), 16-byte aligned, w_ld % 8 == 0
//   y        [nt, n]  row stride y_ld (elements), any alignment, x's type or fp32 (_f32);
//                     y = x @ w^T, or
//                     y += x @ w^T when accumulate != 0 (fp32 sum of the old y and the product,
//                     rounded once: cublasGemmEx's beta = 1)
//   nt (1..T), n, k (k % 8 == 0), ks_log2 (0, 1, 2: see the layout), accumulate
// The host (metrale/backends/cuda/gemm/cublaslt.py, OwnGemv) checks every alignment requirement and
// otherwise runs cuBLAS.
//
// Layout: 128 threads (4 warps) per CTA. The 4 warps form 4 >> ks_log2 row groups of
// ksplit = 1 << ks_log2 warps; a row group owns R consecutive rows of w (outputs n0..n0+R-1),
// its ksplit warps split k: lane `l` of slice `s` reads the 16-byte vectors v = s*32 + l +
// j * 32*ksplit of each row (each warp-wide load is 512 contiguous bytes), U of them per row per
// round (U = 4 at T <= 2, 2 at T >= 4: registers), all R x U weight loads (then the T x U x
// loads) in flight before any FMA. One round covers 32 * ksplit * U * 8 elements of k (U = 4:
// 1024 / 2048 / 4096 at ksplit 1 / 2 / 4). __launch_bounds__(128, 1): with the default
// occupancy target ptxas sank each load next to its first use (checked in the SASS: one DRAM
// round trip per load); one CTA per SM as the target keeps them together. Partial sums: warp_sum per
// (t, r), then across the ksplit warps in shared memory (fixed order: deterministic, so a graph
// replay equals the eager call bit for bit). Output j = t * R + r is stored by lane j.
// Rows past n read row n-1 (in bounds, discarded); x rows past nt read row nt-1 (same).
//
// Why R = 2 and 4 both, and the split: SmolLM2's n = 192..3072 over 132 SMs leaves few warps
// per SM at R = 4 (n = 576: 144 warps); R = 2 doubles the warps, R = 4 halves the x loads per
// weight byte (x comes from L1). ksplit trades a shared-memory reduction and a barrier for more
// loads in flight per row and fewer rounds (k = 1536 in one round needs ksplit >= 2). Which one
// wins is measured: the autotuner times every (R, ksplit) against cuBLASLt and cublasGemmEx.
//
// Programmatic dependent launch (common.cuh): each lane issues its first round of weight loads,
// then waits for the previous kernel (x, y and the split-k scratch come after), so when the
// launcher lets this grid start early the weight stream overlaps the previous kernel's tail.
//
// Bytes: n*k*2 (w, once) + nt*k*2 (x, from L2/L1) + nt*n*2 (y, 4 with _f32; x2 with accumulate).
// FLOPs: 2*nt*n*k. Registers (sm_90): 72..192, no spills (tests/test_kernels_compile.py).
// Reference: cublasGemmEx (CUBLAS_COMPUTE_32F, op_T(w) @ x, column-major view), which the
// autotuner checks every candidate against; tests/test_cuda_gemv.py checks against a cupy fp32
// matmul.
#include "common.cuh"

#include <cuda_fp16.h>

#define GEMV_WARPS 4

namespace {

// 16-byte vectors per row per round and lane: 4, or 2 at T = 8 (the (R + T) x U vectors of a
// round live in registers: 4 x (4 + 8) x 2 = 96 at T = 8, R = 4)
__host__ __device__ constexpr int gemv_u(int T) { return T >= 4 ? 2 : 4; }

__device__ __forceinline__ float lo_f(uint32_t u, __nv_bfloat16) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float hi_f(uint32_t u, __nv_bfloat16) { return __uint_as_float(u & 0xffff0000u); }
__device__ __forceinline__ float lo_f(uint32_t u, __half) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(u & 0xffffu)));
}
__device__ __forceinline__ float hi_f(uint32_t u, __half) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(u >> 16)));
}

__device__ __forceinline__ float load_f(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ float load_f(const __half* p) { return __half2float(*p); }
__device__ __forceinline__ void store_f(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void store_f(__half* p, float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ float load_f(const float* p) { return *p; }
__device__ __forceinline__ void store_f(float* p, float v) { *p = v; }

// 16 bytes, zeros when !pred (volatile, predicated: common.cuh): w through the read-only path
// (no kernel writes it; kept out of L1), x coherent (the previous kernel may still write it
// under programmatic dependent launch)
__device__ __forceinline__ uint4 ldg16_w(const uint4* p, bool pred) { return mt::ldg16_if<true>(p, pred); }
__device__ __forceinline__ uint4 ldg16_x(const uint4* p, bool pred) { return mt::ldg16_if<false>(p, pred); }

// acc + sum of the 8 products of two 16-byte vectors of E (element 0 first)
template <typename E>
__device__ __forceinline__ float dot8(const uint4& a, const uint4& b, float acc) {
    acc = fmaf(lo_f(a.x, E()), lo_f(b.x, E()), acc);
    acc = fmaf(hi_f(a.x, E()), hi_f(b.x, E()), acc);
    acc = fmaf(lo_f(a.y, E()), lo_f(b.y, E()), acc);
    acc = fmaf(hi_f(a.y, E()), hi_f(b.y, E()), acc);
    acc = fmaf(lo_f(a.z, E()), lo_f(b.z, E()), acc);
    acc = fmaf(hi_f(a.z, E()), hi_f(b.z, E()), acc);
    acc = fmaf(lo_f(a.w, E()), lo_f(b.w, E()), acc);
    acc = fmaf(hi_f(a.w, E()), hi_f(b.w, E()), acc);
    return acc;
}

template <int T, int R, typename E, typename O>
__device__ __forceinline__ void gemv(const E* x, long long x_ld, const E* w,
                                     long long w_ld, O* y, long long y_ld, int nt, int n, int k,
                                     int ks_log2, int accumulate) {
    static_assert(T * R <= 32, "one output per lane");
    __shared__ float red[GEMV_WARPS][T * R];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int slice = warp & ((1 << ks_log2) - 1);
    const int n0 = (blockIdx.x * (GEMV_WARPS >> ks_log2) + (warp >> ks_log2)) * R;
    const int kv = k >> 3;                 // 16-byte vectors per row
    const int step = 32 << ks_log2;        // vectors between a lane's loads of one row

    const uint4* wrow[R];
#pragma unroll
    for (int r = 0; r < R; ++r)
        wrow[r] = reinterpret_cast<const uint4*>(w + static_cast<long long>(min(n0 + r, n - 1)) * w_ld);
    const uint4* xrow[T];
#pragma unroll
    for (int t = 0; t < T; ++t)
        xrow[t] = reinterpret_cast<const uint4*>(x + static_cast<long long>(min(t, nt - 1)) * x_ld);

    float acc[T][R];
#pragma unroll
    for (int t = 0; t < T; ++t)
#pragma unroll
        for (int r = 0; r < R; ++r) acc[t][r] = 0.f;

    constexpr int U = gemv_u(T);
    bool waited = false;
    for (int v0 = slice * 32 + lane; v0 < kv; v0 += step * U) {
        // every load of the round first (w and x, zeros past k), then the FMAs: the loads are
        // independent, so the round costs one memory latency, not one per load
        uint4 wv[U][R], xv[U][T];
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int r = 0; r < R; ++r) wv[u][r] = ldg16_w(wrow[r] + v0 + u * step, v0 + u * step < kv);
        // the first round's weight loads are in flight before waiting for the previous kernel
        // (programmatic dependent launch, common.cuh): only w, which no kernel writes
        if (!waited) {
            mt::pdl_wait();
            mt::pdl_after_wait();
            waited = true;
        }
        // x after w: if the compiler defers loads, these (L1 / L2 hits: x is tiny and every warp
        // reads it) are the ones, not the DRAM ones
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int t = 0; t < T; ++t) xv[u][t] = ldg16_x(xrow[t] + v0 + u * step, v0 + u * step < kv);
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int t = 0; t < T; ++t)
#pragma unroll
                for (int r = 0; r < R; ++r) acc[t][r] = dot8<E>(wv[u][r], xv[u][t], acc[t][r]);
    }

    if (!waited) {   // a lane with no vector of k: it may still store an output
        mt::pdl_wait();
        mt::pdl_after_wait();
    }

    // lane j keeps output j = t * R + r (selected with constant indices: acc stays in registers)
    float mine = 0.f;
#pragma unroll
    for (int t = 0; t < T; ++t)
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const float s = mt::warp_sum(acc[t][r]);
            if (lane == t * R + r) mine = s;
        }
    if (ks_log2 > 0) {   // uniform over the CTA: every thread reaches the barrier
        if (lane < T * R) red[warp][lane] = mine;
        __syncthreads();
        if (slice != 0) return;
        for (int s = 1; s < (1 << ks_log2); ++s) mine += red[warp + s][lane < T * R ? lane : 0];
    }
    const int t = lane / R, r = lane % R;
    if (lane < T * R && t < nt && n0 + r < n) {
        O* dst = y + static_cast<long long>(t) * y_ld + n0 + r;
        store_f(dst, accumulate ? mine + load_f(dst) : mine);
    }
}

}  // namespace

#define MT_GEMV(T, R, SUF, E, O)                                                                        \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, 1)                                    \
        gemv_t##T##_r##R##_##SUF(const E* x, long long x_ld, const E* w,                               \
                                 long long w_ld, O* y, long long y_ld, int nt, int n, int k,           \
                                 int ks_log2, int accumulate) {                                         \
        gemv<T, R, E, O>(x, x_ld, w, w_ld, y, y_ld, nt, n, k, ks_log2, accumulate);                     \
        mt::pdl_exit();                                                                                 \
    }

#define MT_GEMV_T(T)                                   \
    MT_GEMV(T, 2, bf16, __nv_bfloat16, __nv_bfloat16)  \
    MT_GEMV(T, 4, bf16, __nv_bfloat16, __nv_bfloat16)  \
    MT_GEMV(T, 2, f16, __half, __half)                 \
    MT_GEMV(T, 4, f16, __half, __half)                 \
    MT_GEMV(T, 2, bf16_f32, __nv_bfloat16, float)      \
    MT_GEMV(T, 4, bf16_f32, __nv_bfloat16, float)

MT_GEMV_T(1)
MT_GEMV_T(2)
MT_GEMV_T(4)
MT_GEMV_T(8)
