// Decode "skinny GEMMs" on tensor cores: y[t, n] (+)= x[t, k] @ w[n, k]^T for 1-64 rows of x,
// bf16 / fp16 in and out, fp32 accumulation, the weight streamed straight into registers.
//
// Why: at t = 4..64 the decode GEMMs of a 9B model (w 4096 x 12288 and 12288 x 4096, 100 MB
// each) are weight-streaming problems (t FLOPs per weight byte... 2t / 2): the kernel must keep
// HBM busy. cuBLASLt / cublasGemmEx reach 78-84 % of the copy bandwidth there (few output tiles
// over a long k: split-k with a separate reduction, x re-read per 64-128-row tile), the CUDA-core
// GEMV of gemv.cu is FMA-bound from t = 4 (62 % at t = 8). Here every 16-byte load of w lands in
// the register that the mma.sync A fragment needs (gemv.cu's way of keeping loads in flight: no
// shared-memory ring, no barrier in the main loop), a warp double-buffers its next round of loads
// against the mma of the current one, and a k split is reduced inside the CTA (k-warps, shared
// memory) and across a thread-block cluster (distributed shared memory), in a fixed order, with
// no workspace and no second launch.
//
// Entry points (extern "C"): skinny_n<NT>_d<D>_ks<KS>_<bf16|f16>:
//   NT in {1, 2, 4, 8}: 8-token mma n-tiles the kernel is compiled for (it runs nt <= 8 NT rows
//     of x; the host picks the smallest NT with 8 NT >= nt);
//   D in {2, 4}: 32-wide k blocks per round of loads (a warp has 2 D x 4 x 16 bytes of w in flight
//     per buffer: 2 KB x D per warp);
//   KS in {1, 2, 4, 8}: CTAs of one cluster splitting k (KS > 1: sm_90, __cluster_dims__(1, KS, 1):
//     a plain cuLaunchKernel honours the compile-time cluster shape).
// Arguments:
//   x        [nt, k]  row stride x_ld (elements), 16-byte aligned, x_ld % 8 == 0
//   w        [n, k]   row stride w_ld (elements), 16-byte aligned, w_ld % 8 == 0
//   y        [nt, n]  row stride y_ld (elements), any alignment; y = x @ w^T, or y += x @ w^T when
//                     accumulate != 0 (fp32 sum of the old y and the product, rounded once:
//                     cublasGemmEx's beta = 1)
//   nt (1 .. 8 NT), n >= 1, k >= 8 (k % 8 == 0), rg (row groups of 32 rows per CTA), kw (k-warps
//   per row group), accumulate
// Launch: grid (ceil(n / (32 rg)), KS), block 32 rg kw threads (<= 256), dynamic shared memory
// 8 NT (32 rg + 4) 4 bytes (the fp32 partial tile; metrale/backends/cublaslt.py, OwnSkinny,
// computes it, raises the kernel's limit past 48 KB when needed and checks every requirement).
//
// Layout. A CTA owns rows n0 .. n0 + 32 rg - 1 of w; warp (row group r, k-warp j) owns rows
// n0 + 32 r .. + 31 (two 16-row m-tiles) and k slice s = z kw + j of the KS kw slices of the
// nb = ceil(k / 32) k blocks (z: the cluster rank), and every n-tile of tokens. It loops over its
// blocks D at a time: issue the next round's 4 D 16-byte loads of w (ld.global.nc, no L1
// allocation: streamed once), then multiply the current round: per block, NT 16-byte loads of x
// (ld.global.nc through L1: the CTA's rg warps of one k slice read the same x, so it comes from L1
// after the first) and 4 NT mma.sync. Two register buffers alternate (the loop is unrolled by 2),
// so one round of w is always in flight while the other is multiplied.
// Bytes in flight per warp: 2 KB x D. At rg kw = 8 warps and D = 4, 64 KB per SM.
//
// The mma: mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}: A = 16 rows of w (row-major
// 16 x 16), B = x^T (16 k x 8 tokens: x rows are B's columns), C = y^T (16 rows x 8 tokens).
// PTX ISA fragment layouts, g = lane / 4, q = lane % 4 (each .b32 register holds two 16-bit
// elements, the lower column / k index in the low half):
//   A: a0a1 = (row g,   cols 2q, 2q+1)    a2a3 = (row g+8, cols 2q, 2q+1)
//      a4a5 = (row g,   cols 2q+8, 2q+9)  a6a7 = (row g+8, cols 2q+8, 2q+9)
//   B: b0b1 = (k 2q, 2q+1; token g)       b2b3 = (k 2q+8, 2q+9; token g)
//   C: c0c1 = (row g, tokens 2q, 2q+1)    c2c3 = (row g+8, tokens 2q, 2q+1)
// A thread's A and B fragments cover the same logical k set {2q, 2q+1, 2q+8, 2q+9}, and the sum
// over k does not care about its order, so k is permuted (identically for A and B) to let every
// thread read 16 contiguous bytes: within a 32-wide k block kb, thread (g, q) loads
//   wa = w[row g][kb + 8q .. kb + 8q + 8),  wb = w[row g + 8][same],  xv = x[token g][same]
// (.x/.y/.z/.w = elements 8q+0,1 / 2,3 / 4,5 / 6,7) and runs
//   k-step 0: A = {wa.x, wb.x, wa.y, wb.y}, B = {xv.x, xv.y}   (physical kb + 8q + 0..3)
//   k-step 1: A = {wa.z, wb.z, wa.w, wb.w}, B = {xv.z, xv.w}   (physical kb + 8q + 4..7)
// Over q = 0..3 the two steps cover all 32 k of the block once, with A's column and B's row
// always the same physical k. A warp-wide load of w reads 8 rows x 64 contiguous bytes.
//
// Reduction (fixed order everywhere: a graph replay equals the eager call bit for bit; nothing to
// reset between launches). The fp32 partial tile red[token][32 rg + 4] (row stride = 4 mod 32
// words: the fragment stores of lanes (g, q) hit banks 8q + g): k-warp 0 stores, k-warps 1 ..
// kw-1 add in turn (a barrier between). KS = 1: the CTA stores y from it. KS > 1: cluster
// barrier, then CTA z reduces slice z of the tile (1/KS of its float4s) over ranks 0 .. KS-1 in
// that order through distributed shared memory (mapa + ld.shared::cluster), adds the old y when
// accumulating, rounds once and stores; a second cluster barrier keeps every CTA's shared memory
// alive until the others have read it. A KS > 1 kernel launched without its cluster shape
// (%cluster_nctarank != KS) writes NaN over its outputs instead of touching another CTA's memory:
// the autotuner's check rejects it.
// Out of range: rows past n read row n-1, tokens past nt read token nt-1 (in bounds, discarded);
// k past k (the last block) loads zeros (predicated loads: nothing out of bounds is touched).
//
// Bytes: n*k*2 (w, once, from HBM) + ceil(n / (32 rg)) * KS... = ceil(n / (32 rg)) * nt*k*2 (x,
// from L2, once per CTA row block) + nt*n*2 (y; x2 with accumulate). FLOPs: 2*nt*n*k (the mma
// computes 8 NT columns; those past nt are discarded). Registers: tests/test_kernels_compile.py
// prints them (sm_90), no spills.
// Reference: cublasGemmEx (CUBLAS_COMPUTE_32F), which the autotuner checks every candidate
// against; tests/test_cuda_skinny.py checks against a cupy fp32 matmul.
#include "common.cuh"

#include <cuda_fp16.h>

#define SKINNY_MAX_THREADS 256

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define SKINNY_NO_CLUSTERS 1    // thread-block clusters are sm_90+: only the KS = 1 kernels
#endif

namespace {

// 16 bytes of w: read-only path, not allocated in L1 (streamed once); zeros when !pred
__device__ __forceinline__ uint4 ldw16(const uint4* p, bool pred) {
    uint4 v;
    asm volatile(
        "{\n"
        "  .reg .pred p;\n"
        "  setp.ne.b32 p, %5, 0;\n"
        "  mov.b32 %0, 0;\n"
        "  mov.b32 %1, 0;\n"
        "  mov.b32 %2, 0;\n"
        "  mov.b32 %3, 0;\n"
        "  @p ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
        "}\n"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p), "r"(static_cast<int>(pred)));
    return v;
}
// 16 bytes of x: read-only path through L1 (every row group of the CTA reads it); zeros when !pred
__device__ __forceinline__ uint4 ldx16(const uint4* p, bool pred) {
    uint4 v;
    asm volatile(
        "{\n"
        "  .reg .pred p;\n"
        "  setp.ne.b32 p, %5, 0;\n"
        "  mov.b32 %0, 0;\n"
        "  mov.b32 %1, 0;\n"
        "  mov.b32 %2, 0;\n"
        "  mov.b32 %3, 0;\n"
        "  @p ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n"
        "}\n"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p), "r"(static_cast<int>(pred)));
    return v;
}

// --- mma.sync m16n8k16, fp32 accumulate: c += A (16x16) * B (16x8) ---------------------------
__device__ __forceinline__ void mma16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1, __nv_bfloat16) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1, __half) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// the same, volatile: NVVM keeps it after the (volatile) loads of the round before it, so every
// load of a round is issued before the first mma (skinny_wide; ptxas then keeps them in flight)
__device__ __forceinline__ void mma16816v(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint32_t b0, uint32_t b1, __nv_bfloat16) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma16816v(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint32_t b0, uint32_t b1, __half) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float load_f(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ float load_f(const __half* p) { return __half2float(*p); }
__device__ __forceinline__ void store_f(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void store_f(__half* p, float v) { *p = __float2half_rn(v); }

#ifndef SKINNY_NO_CLUSTERS
// --- thread-block clusters (sm_90) -----------------------------------------------------------
__device__ __forceinline__ uint32_t cluster_rank() {
    uint32_t r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}
__device__ __forceinline__ uint32_t cluster_size() {
    uint32_t r;
    asm volatile("mov.u32 %0, %%cluster_nctarank;\n" : "=r"(r));
    return r;
}
// all threads of every CTA of the cluster; release (arrive) / acquire (wait) at cluster scope
__device__ __forceinline__ void cluster_barrier() {
    asm volatile("barrier.cluster.arrive.aligned;\n"
                 "barrier.cluster.wait.aligned;\n" ::: "memory");
}
// the shared::cluster address of shared::cta address `a` in the CTA of rank `rank`
__device__ __forceinline__ uint32_t map_rank(uint32_t a, uint32_t rank) {
    uint32_t r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(rank));
    return r;
}
__device__ __forceinline__ float4 ld_cluster_f4(uint32_t a) {
    float4 v;
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"(a)
                 : "memory");
    return v;
}
#endif

template <int NT, int D, int KS, bool PIPE, typename E>
__device__ __forceinline__ void skinny(const E* __restrict__ x, long long x_ld, const E* __restrict__ w,
                                       long long w_ld, E* __restrict__ y, long long y_ld, int nt, int n, int k,
                                       int rg, int kw, int accumulate) {
    extern __shared__ __align__(16) float red[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int nthreads = blockDim.x;   // 32 rg kw
    const int rows = 32 * rg;
    const int g = lane >> 2, q = lane & 3;
    const int rgi = warp % rg, kwi = warp / rg;
    const int n0 = blockIdx.x * rows;

    int z = 0;   // cluster rank = k slice of the CTA
#ifndef SKINNY_NO_CLUSTERS
    if constexpr (KS > 1) {
        if (cluster_size() != KS) {   // launched without its cluster shape: poison, never touch DSMEM
            if (blockIdx.y == 0)
                for (int tok = 0; tok < nt; ++tok)
                    for (int i = tid; i < rows && n0 + i < n; i += nthreads)
                        store_f(y + static_cast<long long>(tok) * y_ld + n0 + i, __int_as_float(0x7fc00000));
            return;
        }
        z = static_cast<int>(cluster_rank());
    }
#endif
    // this warp's k blocks [b0, b1)
    const int nb = (k + 31) >> 5;
    const int slices = KS * kw, s = z * kw + kwi;
    const int b0 = static_cast<int>(static_cast<long long>(s) * nb / slices);
    const int b1 = static_cast<int>(static_cast<long long>(s + 1) * nb / slices);

    // row pointers (16-byte vectors, at this thread's chunk q of block 0): m-tile m, half h
    const uint4* wr[2][2];
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = min(n0 + rgi * 32 + m * 16 + h * 8 + g, n - 1);
            wr[m][h] = reinterpret_cast<const uint4*>(w + static_cast<long long>(row) * w_ld) + q;
        }
    const uint4* xr[NT];
#pragma unroll
    for (int j = 0; j < NT; ++j)
        xr[j] = reinterpret_cast<const uint4*>(x + static_cast<long long>(min(j * 8 + g, nt - 1)) * x_ld) + q;
    const int kv = k >> 3;   // 16-byte vectors per row; block b's chunk q is vector 4b + q

    float acc[2][NT][4];
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[m][j][e] = 0.f;

    // a round's registers: D blocks of w (2 m-tiles x rows g, g+8) and of x (NT n-tiles), all
    // loads issued together so the x loads (L2, or L1 when another warp of the CTA read the same
    // k range) wait in the shadow of the w loads (HBM)
    struct Round {
        uint4 w[D][2][2];
        uint4 x[D][NT];
    };
    Round ra, rb;
    auto load = [&](Round& r, int b) {
#pragma unroll
        for (int d = 0; d < D; ++d) {
            const int v = 4 * (b + d);
            const bool ok = b + d < b1 && v + q < kv;
#pragma unroll
            for (int m = 0; m < 2; ++m)
#pragma unroll
                for (int h = 0; h < 2; ++h) r.w[d][m][h] = ldw16(wr[m][h] + v, ok);
        }
#pragma unroll
        for (int d = 0; d < D; ++d) {
            const int v = 4 * (b + d);
            const bool ok = b + d < b1 && v + q < kv;
#pragma unroll
            for (int j = 0; j < NT; ++j) r.x[d][j] = ldx16(xr[j] + v, ok);
        }
    };
    auto multiply = [&](const Round& r) {
#pragma unroll
        for (int d = 0; d < D; ++d)
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int m = 0; m < 2; ++m) {
                    const uint4& A0 = r.w[d][m][0];
                    const uint4& A1 = r.w[d][m][1];
                    const uint4& B = r.x[d][j];
                    mma16816(acc[m][j], A0.x, A1.x, A0.y, A1.y, B.x, B.y, E());
                    mma16816(acc[m][j], A0.z, A1.z, A0.w, A1.w, B.z, B.w, E());
                }
    };

    if constexpr (PIPE) {
        // two rounds in registers: the next round's loads are issued before the current round
        // is multiplied
        int b = b0;
        if (b < b1) load(ra, b);
        while (b < b1) {
            if (b + D < b1) load(rb, b + D);
            multiply(ra);
            b += D;
            if (b >= b1) break;
            if (b + D < b1) load(ra, b + D);
            multiply(rb);
            b += D;
        }
    } else {
        // one round: load it, multiply it; the SM's other warps (several CTAs per SM, fewer
        // registers each) keep the memory system busy meanwhile
        (void)rb;
        for (int b = b0; b < b1; b += D) {
            load(ra, b);
            multiply(ra);
        }
    }

    // fp32 partial tile red[token][rows + 4]: k-warp 0 stores, the others add in turn
    const int rs = rows + 4;
    for (int p = 0; p < kw; ++p) {   // uniform: every thread reaches every barrier
        if (kwi == p) {
#pragma unroll
            for (int m = 0; m < 2; ++m)
#pragma unroll
                for (int j = 0; j < NT; ++j) {
                    float* r = red + (j * 8 + 2 * q) * rs + rgi * 32 + m * 16 + g;
                    if (p == 0) {
                        r[0] = acc[m][j][0];
                        r[rs] = acc[m][j][1];
                        r[8] = acc[m][j][2];
                        r[rs + 8] = acc[m][j][3];
                    } else {
                        r[0] += acc[m][j][0];
                        r[rs] += acc[m][j][1];
                        r[8] += acc[m][j][2];
                        r[rs + 8] += acc[m][j][3];
                    }
                }
        }
        __syncthreads();
    }

    if constexpr (KS == 1) {
        for (int tok = 0; tok < nt; ++tok) {
            E* yrow = y + static_cast<long long>(tok) * y_ld + n0;
            for (int i = tid; i < rows && n0 + i < n; i += nthreads) {
                float v = red[tok * rs + i];
                if (accumulate) v += load_f(yrow + i);
                store_f(yrow + i, v);
            }
        }
    } else {
#ifndef SKINNY_NO_CLUSTERS
        cluster_barrier();   // every rank's tile is complete (release / acquire)
        const uint32_t sbase = static_cast<uint32_t>(__cvta_generic_to_shared(red));
        const int q4 = rows >> 2;   // float4s per token row
        const int units = nt * q4;
        const int u1 = (z + 1) * units / KS;
        for (int u = z * units / KS + tid; u < u1; u += nthreads) {
            const int tok = u / q4, i = (u - tok * q4) * 4;
            const uint32_t a = sbase + static_cast<uint32_t>(tok * rs + i) * 4u;
            float4 part[KS];
#pragma unroll
            for (int r = 0; r < KS; ++r) part[r] = ld_cluster_f4(map_rank(a, r));
            float4 sum = part[0];
#pragma unroll
            for (int r = 1; r < KS; ++r) {   // ranks in order: deterministic
                sum.x += part[r].x;
                sum.y += part[r].y;
                sum.z += part[r].z;
                sum.w += part[r].w;
            }
            const float v[4] = {sum.x, sum.y, sum.z, sum.w};
            E* yrow = y + static_cast<long long>(tok) * y_ld + n0 + i;
#pragma unroll
            for (int e = 0; e < 4; ++e)
                if (n0 + i + e < n) store_f(yrow + e, accumulate ? v[e] + load_f(yrow + e) : v[e]);
        }
        cluster_barrier();   // nobody leaves while another CTA may still read its tile
#endif
    }
}


// lds16: 16 bytes from shared memory (x fragments of skinny_wide)
__device__ __forceinline__ uint4 lds16(const uint4* p) { return *p; }

// The wide variant: one 16-row m-tile per warp, D (8 or 16) k blocks per round (512 B / 1 KB of
// each row per round), x of the CTA's k range staged once in shared memory.
template <int NT, int D, int KS, typename E>
__device__ __forceinline__ void skinny_wide(const E* __restrict__ x, long long x_ld, const E* __restrict__ w,
                                            long long w_ld, E* __restrict__ y, long long y_ld, int nt, int n,
                                            int k, int rg, int kw, int accumulate) {
    extern __shared__ __align__(16) uint4 smem4[];
    float* red = reinterpret_cast<float*>(smem4);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int nthreads = blockDim.x;   // 32 rg kw
    const int rows = 16 * rg;
    const int g = lane >> 2, q = lane & 3;
    const int rgi = warp % rg, kwi = warp / rg;
    const int n0 = blockIdx.x * rows;

    int z = 0;
#ifndef SKINNY_NO_CLUSTERS
    if constexpr (KS > 1) {
        if (cluster_size() != KS) {
            if (blockIdx.y == 0)
                for (int tok = 0; tok < nt; ++tok)
                    for (int i = tid; i < rows && n0 + i < n; i += nthreads)
                        store_f(y + static_cast<long long>(tok) * y_ld + n0 + i, __int_as_float(0x7fc00000));
            return;
        }
        z = static_cast<int>(cluster_rank());
    }
#endif
    const int nb = (k + 31) >> 5;
    const int cb0 = static_cast<int>(static_cast<long long>(z) * nb / KS);
    const int cb1 = static_cast<int>(static_cast<long long>(z + 1) * nb / KS);
    const int cvec = (cb1 - cb0) * 4;     // 16-byte vectors of one x row in the CTA's range
    const int xs = cvec + 4;              // shared row stride (vectors): 64 B of padding
    const int kv = k >> 3;

    // stage x[8 NT tokens][CTA range] (tokens past nt and k past k: zeros)
    for (int idx = tid; idx < 8 * NT * cvec; idx += nthreads) {
        const int tok = idx / cvec, c = idx - tok * cvec;
        const int v = cb0 * 4 + c;
        const bool ok = tok < nt && v < kv;
        const E* src = ok ? x + static_cast<long long>(tok) * x_ld + static_cast<long long>(v) * 8 : x;
        mt::cp_async16(smem4 + tok * xs + c, src, ok);
    }
    mt::cp_async_commit();

    const int b0 = cb0 + static_cast<int>(static_cast<long long>(kwi) * (cb1 - cb0) / kw);
    const int b1 = cb0 + static_cast<int>(static_cast<long long>(kwi + 1) * (cb1 - cb0) / kw);
    const uint4* wr[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = min(n0 + rgi * 16 + h * 8 + g, n - 1);
        wr[h] = reinterpret_cast<const uint4*>(w + static_cast<long long>(row) * w_ld) + q;
    }
    float acc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;

    uint4 wv[D][2];
    bool first = true;
    for (int b = b0; b < b1; b += D) {
#pragma unroll
        for (int d = 0; d < D; ++d) {
            const int v = 4 * (b + d);
            const bool ok = b + d < b1 && v + q < kv;
#pragma unroll
            for (int h = 0; h < 2; ++h) wv[d][h] = ldw16(wr[h] + v, ok);
        }
        if (first) {   // x has landed (the first round's w loads are already in flight)
            mt::cp_async_wait_all();
            __syncthreads();
            first = false;
        }
#pragma unroll
        for (int d = 0; d < D; ++d) {
            const int c = 4 * (b + d - cb0) + q;
            uint4 xv[NT];
#pragma unroll
            for (int j = 0; j < NT; ++j) xv[j] = lds16(smem4 + (j * 8 + g) * xs + min(c, cvec - 1));
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                mma16816v(acc[j], wv[d][0].x, wv[d][1].x, wv[d][0].y, wv[d][1].y, xv[j].x, xv[j].y, E());
                mma16816v(acc[j], wv[d][0].z, wv[d][1].z, wv[d][0].w, wv[d][1].w, xv[j].z, xv[j].w, E());
            }
        }
    }
    if (first) {   // no k block for this warp: still join the CTA's barrier
        mt::cp_async_wait_all();
        __syncthreads();
    }
    __syncthreads();   // x is no longer read: the tile reuses its memory

    const int rs = rows + 4;
    for (int p = 0; p < kw; ++p) {
        if (kwi == p) {
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                float* r = red + (j * 8 + 2 * q) * rs + rgi * 16 + g;
                if (p == 0) {
                    r[0] = acc[j][0];
                    r[rs] = acc[j][1];
                    r[8] = acc[j][2];
                    r[rs + 8] = acc[j][3];
                } else {
                    r[0] += acc[j][0];
                    r[rs] += acc[j][1];
                    r[8] += acc[j][2];
                    r[rs + 8] += acc[j][3];
                }
            }
        }
        __syncthreads();
    }

    if constexpr (KS == 1) {
        for (int tok = 0; tok < nt; ++tok) {
            E* yrow = y + static_cast<long long>(tok) * y_ld + n0;
            for (int i = tid; i < rows && n0 + i < n; i += nthreads) {
                float v = red[tok * rs + i];
                if (accumulate) v += load_f(yrow + i);
                store_f(yrow + i, v);
            }
        }
    } else {
#ifndef SKINNY_NO_CLUSTERS
        cluster_barrier();
        const uint32_t sbase = static_cast<uint32_t>(__cvta_generic_to_shared(red));
        const int q4 = rows >> 2;
        const int units = nt * q4;
        const int u1 = (z + 1) * units / KS;
        for (int u = z * units / KS + tid; u < u1; u += nthreads) {
            const int tok = u / q4, i = (u - tok * q4) * 4;
            const uint32_t a = sbase + static_cast<uint32_t>(tok * rs + i) * 4u;
            float4 part[KS];
#pragma unroll
            for (int r = 0; r < KS; ++r) part[r] = ld_cluster_f4(map_rank(a, r));
            float4 sum = part[0];
#pragma unroll
            for (int r = 1; r < KS; ++r) {
                sum.x += part[r].x;
                sum.y += part[r].y;
                sum.z += part[r].z;
                sum.w += part[r].w;
            }
            const float v[4] = {sum.x, sum.y, sum.z, sum.w};
            E* yrow = y + static_cast<long long>(tok) * y_ld + n0 + i;
#pragma unroll
            for (int e = 0; e < 4; ++e)
                if (n0 + i + e < n) store_f(yrow + e, accumulate ? v[e] + load_f(yrow + e) : v[e]);
        }
        cluster_barrier();
#endif
    }
}

}  // namespace

#define MT_SKINNY_KS1(NT, D, P, PIPE, LBT, LBM, SUF, E)                                                          \
    extern "C" __global__ void __launch_bounds__(LBT, LBM)                                                        \
        skinny_n##NT##_d##D##_ks1_##P##_##SUF(const E* __restrict__ x, long long x_ld,                      \
                                              const E* __restrict__ w, long long w_ld, E* __restrict__ y,  \
                                              long long y_ld, int nt, int n, int k, int rg, int kw,         \
                                              int accumulate) {                                             \
        skinny<NT, D, 1, PIPE, E>(x, x_ld, w, w_ld, y, y_ld, nt, n, k, rg, kw, accumulate);                 \
    }

#define MT_SKINNY_KS(NT, D, KS, P, PIPE, LBT, LBM, SUF, E)                                                       \
    extern "C" __global__ void __cluster_dims__(1, KS, 1) __launch_bounds__(LBT, LBM)                             \
        skinny_n##NT##_d##D##_ks##KS##_##P##_##SUF(const E* __restrict__ x, long long x_ld,                 \
                                                   const E* __restrict__ w, long long w_ld,                 \
                                                   E* __restrict__ y, long long y_ld, int nt, int n, int k, \
                                                   int rg, int kw, int accumulate) {                        \
        skinny<NT, D, KS, PIPE, E>(x, x_ld, w, w_ld, y, y_ld, nt, n, k, rg, kw, accumulate);                \
    }

#ifdef SKINNY_NO_CLUSTERS
#define MT_SKINNY_ALL(NT, D, P, PIPE, LBT, LBM, SUF, E) MT_SKINNY_KS1(NT, D, P, PIPE, LBT, LBM, SUF, E)
#else
#define MT_SKINNY_ALL(NT, D, P, PIPE, LBT, LBM, SUF, E) \
    MT_SKINNY_KS1(NT, D, P, PIPE, LBT, LBM, SUF, E)     \
    MT_SKINNY_KS(NT, D, 2, P, PIPE, LBT, LBM, SUF, E)   \
    MT_SKINNY_KS(NT, D, 4, P, PIPE, LBT, LBM, SUF, E)   \
    MT_SKINNY_KS(NT, D, 8, P, PIPE, LBT, LBM, SUF, E)
#endif

#define MT_SKINNY_ND(NT, D, P, PIPE, LBT, LBM)                            \
    MT_SKINNY_ALL(NT, D, P, PIPE, LBT, LBM, bf16, __nv_bfloat16)          \
    MT_SKINNY_ALL(NT, D, P, PIPE, LBT, LBM, f16, __half)

// p: double-buffered, up to 256 threads and 255 registers (one CTA per SM);
// f: one buffer, up to 128 threads in <= 128 registers (4+ CTAs per SM)
MT_SKINNY_ND(1, 4, p, true, SKINNY_MAX_THREADS, 1)
MT_SKINNY_ND(2, 4, p, true, SKINNY_MAX_THREADS, 1)
MT_SKINNY_ND(4, 2, p, true, SKINNY_MAX_THREADS, 1)
MT_SKINNY_ND(8, 1, p, true, SKINNY_MAX_THREADS, 1)
MT_SKINNY_ND(1, 4, f, false, 128, 4)
MT_SKINNY_ND(2, 4, f, false, 128, 3)
MT_SKINNY_ND(4, 2, f, false, 128, 4)
MT_SKINNY_ND(8, 1, f, false, 128, 3)

#define MT_WIDE(NT, D, KS, LBM)                                                                           \
    extern "C" __global__ void __cluster_dims__(1, KS, 1) __launch_bounds__(128, 1)                       \
        skinny_n##NT##_d##D##_ks##KS##_w_bf16(const __nv_bfloat16* __restrict__ x, long long x_ld,         \
                                              const __nv_bfloat16* __restrict__ w, long long w_ld,         \
                                              __nv_bfloat16* __restrict__ y, long long y_ld, int nt, int n, \
                                              int k, int rg, int kw, int accumulate) {                     \
        skinny_wide<NT, D, KS, __nv_bfloat16>(x, x_ld, w, w_ld, y, y_ld, nt, n, k, rg, kw, accumulate);    \
    }
#define MT_WIDE_KS(NT, D, LBM) MT_WIDE(NT, D, 1, LBM) MT_WIDE(NT, D, 2, LBM) MT_WIDE(NT, D, 4, LBM) MT_WIDE(NT, D, 8, LBM)
#ifndef SKINNY_NO_CLUSTERS
MT_WIDE_KS(1, 8, 3)
MT_WIDE_KS(1, 16, 2)
MT_WIDE_KS(2, 8, 3)
MT_WIDE_KS(2, 16, 2)
MT_WIDE_KS(4, 8, 3)
MT_WIDE_KS(4, 16, 2)
#endif
