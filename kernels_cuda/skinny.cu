// Decode "skinny GEMMs" on tensor cores: y[t, n] (+)= x[t, k] @ w[n, k]^T for 1-64 rows of x,
// bf16 / fp16 in and out, fp32 accumulation.
//
// Why: at t = 4..64 the decode GEMMs of a 9B model (w 4096 x 12288 and 12288 x 4096, 100 MB
// each) are weight-streaming problems: every byte of w is used t times, so the FLOPs are cheap
// and the kernel must keep HBM busy. cuBLASLt / cublasGemmEx reach 78-84 % of the copy bandwidth
// there (few output tiles over a long k; split-k with a separate reduction), the CUDA-core GEMV
// of gemv.cu falls to 62 % at t = 8 (FMA-bound). Here w streams through a deep cp.async ring in
// shared memory, the products run on mma.sync, and a k split is reduced inside a thread-block
// cluster (distributed shared memory), in a fixed order, with no workspace and no second launch.
//
// Entry points (extern "C"): skinny_t<T>_ks<KS>_<bf16|f16>, T in {8, 16, 32, 64} (rows of x the
// kernel is compiled for, in 8-row mma n-tiles; it runs nt <= T of them: the host picks the
// smallest T >= nt), KS in {1, 2, 4, 8} (CTAs of one cluster splitting k; KS > 1 needs sm_90).
// Arguments:
//   x        [nt, k]  row stride x_ld (elements), 16-byte aligned, x_ld % 8 == 0
//   w        [n, k]   row stride w_ld (elements), 16-byte aligned, w_ld % 8 == 0
//   y        [nt, n]  row stride y_ld (elements), any alignment; y = x @ w^T, or
//                     y += x @ w^T when accumulate != 0 (fp32 sum of the old y and the product,
//                     rounded once: cublasGemmEx's beta = 1)
//   nt (1..T), n >= 1, k (k % 8 == 0), rg (1..8: row groups of 32 rows), kw (1 or 2: warps per
//   row group, splitting each stage's two k-blocks), stages (2..8: depth of the cp.async ring),
//   accumulate
// Launch: grid (ceil(n / (32 rg)), KS), block 32 * rg * kw threads (<= 256), dynamic shared
// memory max(stages * (32 rg + 8 T) * 128, 8 T * (32 rg + 4) * 4) bytes (the host computes it:
// metrale/backends/cublaslt.py, OwnSkinny, which checks every requirement above and otherwise
// runs cuBLAS). KS > 1 kernels carry __cluster_dims__(1, KS, 1): the KS CTAs of a grid column
// are one cluster (a plain cuLaunchKernel honours the compile-time cluster shape).
//
// Layout. A CTA owns rows = 32 rg consecutive rows of w (outputs n0 .. n0 + rows - 1) and the
// k range of its cluster rank z: stages [z * nk / KS, (z + 1) * nk / KS) of nk = ceil(k / 64)
// stages of 64 k-elements (128 bytes of every row: one full cache line per row per stage). Each
// stage is copied global -> shared with 16-byte cp.async: w rows (evict-first in L2: streamed
// once) and the T * 8 rows of x of that k range (zero-filled past nt, past k, and w rows past
// n: nothing out of bounds is read). `stages` of them form a ring (CUTLASS "multistage"): while
// stage i is multiplied, stages i+1 .. i+stages-1 are in flight, so at rows = 256 and 4 stages
// ~96 KB of w per SM are outstanding, with no registers held for them. One __syncthreads per stage.
// Warp (row group r, k-warp kwi) owns rows r*32 .. r*32+31 (two 16-row m-tiles) and all T n-tiles
// of tokens, and multiplies k-block j (32 wide) of each stage for j = kwi, kwi + kw, ... < 2.
// Why w goes through shared memory rather than straight into registers (gemv.cu's way, where
// the 16-byte loads would land directly in A fragments): registers cap the bytes in flight (16
// loads of 16 B per thread = 64 regs at 256 threads = 64 KB per SM, and only while nothing else
// is live: at T = 64 the 64 accumulators leave room for half of that), and a warp that issues a
// round of loads and then multiplies it stalls one DRAM latency per round unless it
// double-buffers (twice the registers again). At t = 64 the mma work per byte is real (64
// FLOP/byte: ~45 % of the SM's mma.sync rate at 4.3 TB/s), so memory and mma must overlap; the
// ring does that with no registers, at the cost of a shared-memory round trip (~3-4 x the w
// bytes of shared-memory traffic at T = 64, within its 128 B/clk per SM).
// Why rows per CTA and the k split are runtime / template choices: the grid must fill the 132 SMs
// in whole waves (n = 4096: 16 x 256 rows x 8 splits = 128 CTAs; n = 12288: 64 x 192 rows x 2),
// x is re-read from L2 once per row block (t / rows of the w bytes) and the split costs a
// reduction of t x rows x 4 bytes per CTA: the best trade differs per shape and t, so the host
// proposes a few (a bandwidth model) and the autotuner times them.
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
// (one 16-byte shared-memory load each; .x/.y/.z/.w = elements 8q+0,1 / 2,3 / 4,5 / 6,7) and runs
//   k-step 0: A = {wa.x, wb.x, wa.y, wb.y}, B = {xv.x, xv.y}
//             (logical k 2q, 2q+1, 2q+8, 2q+9 = physical kb + 8q + 0, 1, 2, 3)
//   k-step 1: A = {wa.z, wb.z, wa.w, wb.w}, B = {xv.z, xv.w}
//             (logical k 2q, 2q+1, 2q+8, 2q+9 = physical kb + 8q + 4, 5, 6, 7)
// Over q = 0..3 step 0 covers physical kb + {8q + 0..3} and step 1 kb + {8q + 4..7}: all 32 k of
// the block, each once, with A's column and B's row always the same physical k.
// Shared-memory layout: a row is 128 bytes (8 chunks of 16 bytes); chunk c of row r is stored at
// chunk c ^ (4 * (r & 1)). A warp's 16-byte loads are served 8 lanes at a time (lanes g = 2p,
// 2p+1, q = 0..3: chunks 4j+q of an even row and 4(1-j)+q of an odd one) = 8 distinct chunks,
// all 32 banks: conflict-free, as are the cp.async stores (8 lanes fill one row).
//
// Split-k reduction (KS > 1). Each CTA stages its fp32 partial tile y^T[rows][T*8] in its own
// shared memory (as [token][rows + 4]: conflict-free fragment stores), the cluster barriers, then
// CTA z reduces slice z of the tile (1/KS of its float4s) by reading the partial of every rank
// 0..KS-1 in that order through distributed shared memory (mapa + ld.shared::cluster), adds the
// old y when accumulating, rounds once and stores y; a second cluster barrier keeps every CTA's
// shared memory alive until the others have read it. Deterministic (fixed order, no atomics: a
// graph replay equals the eager call bit for bit), nothing to reset between launches, no
// workspace, and each CTA moves (KS-1)/KS of a tile instead of one CTA reading KS-1 tiles (a
// global-memory "serial fixup" would put 7 x 64 KB on the last CTA of a 256-row block at
// t = 64, KS = 8: several us of tail on a ~25 us kernel, plus the partials' L2 / HBM traffic).
// kw = 2 first folds the two k-warps' tiles (k-warp 0 stores, k-warp 1 adds: fixed order too).
// KS = 1 stores straight from its tile.
// If a KS > 1 kernel ever ran without its cluster shape (%cluster_nctarank != KS) it writes NaN
// over its outputs instead of touching another CTA's memory: the autotuner's check rejects it.
//
// Bytes: n*k*2 (w, once, from HBM) + ceil(n / rows) * nt*k*2 (x, from L2) + nt*n*2 (y; x2 with
// accumulate). FLOPs: 2*nt*n*k (the mma computes T*8 columns; those past nt are zeros).
// Registers (sm_90, nvcc 13.0): 53-55 (T = 8), 67-70 (16), 89-90 (32), 119-121 (64), no spills
// (tests/test_kernels_compile.py); <= 128 keeps two 256-thread CTAs per SM possible.
// Reference: cublasGemmEx (CUBLAS_COMPUTE_32F), which the autotuner checks every candidate
// against; tests/test_cuda_skinny.py checks against a cupy fp32 matmul.
#include "common.cuh"

#include <cuda_fp16.h>

#define SKINNY_KC 64            // k elements per pipeline stage (128 bytes of each row)
#define SKINNY_MAX_THREADS 256  // rg * kw <= 8 warps

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define SKINNY_NO_CLUSTERS 1    // thread-block clusters are sm_90+: only the KS = 1 kernels
#endif

namespace {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// --- cp.async, 16 bytes, zero-filled when !valid (src-size 0: nothing is read) --------------
__device__ __forceinline__ void cp16(uint32_t dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
}
// the same with an L2 cache policy (w: evict-first, it is streamed once per call)
__device__ __forceinline__ void cp16_policy(uint32_t dst, const void* src, bool valid, uint64_t pol) {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(dst), "l"(src),
                 "r"(valid ? 16 : 0), "l"(pol)
                 : "memory");
}
__device__ __forceinline__ uint64_t evict_first_policy() {
    uint64_t pol;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(pol));
    return pol;
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// wait until at most n (0..6) of this thread's committed groups are pending (n is uniform)
__device__ __forceinline__ void cp_wait_pending(int n) {
    switch (n) {
        case 0: asm volatile("cp.async.wait_group 0;\n" ::: "memory"); break;
        case 1: asm volatile("cp.async.wait_group 1;\n" ::: "memory"); break;
        case 2: asm volatile("cp.async.wait_group 2;\n" ::: "memory"); break;
        case 3: asm volatile("cp.async.wait_group 3;\n" ::: "memory"); break;
        case 4: asm volatile("cp.async.wait_group 4;\n" ::: "memory"); break;
        case 5: asm volatile("cp.async.wait_group 5;\n" ::: "memory"); break;
        default: asm volatile("cp.async.wait_group 6;\n" ::: "memory"); break;
    }
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

template <int TT, int KS, typename E>
__device__ __forceinline__ void skinny(const E* __restrict__ x, long long x_ld, const E* __restrict__ w,
                                       long long w_ld, E* __restrict__ y, long long y_ld, int nt, int n, int k,
                                       int rg, int kw, int stages, int accumulate) {
    extern __shared__ __align__(128) unsigned char smem[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int nthreads = blockDim.x;              // 32 * rg * kw
    const int rows = 32 * rg;
    const int g = lane >> 2, q = lane & 3;
    const int rgi = warp / kw, kwi = warp - rgi * kw;
    const int n0 = blockIdx.x * rows;

    int z = 0;   // cluster rank = k slice
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
    const int nk = (k + SKINNY_KC - 1) / SKINNY_KC;
    const int s_begin = static_cast<int>(static_cast<long long>(z) * nk / KS);
    const int cnt = static_cast<int>(static_cast<long long>(z + 1) * nk / KS) - s_begin;
    const int w_bytes = rows * 128;
    const int stage_bytes = w_bytes + TT * 8 * 128;
    const uint32_t sbase = smem_addr(smem);

    // copy assignment: thread tid fills chunk (tid & 7) of rows tid/8, tid/8 + nthreads/8, ...
    const int lc = tid & 7;
    const int lr0 = tid >> 3, lrstep = nthreads >> 3;
    const uint64_t pol = evict_first_policy();

    auto load_stage = [&](int buf, int s) {
        const uint32_t sb = sbase + buf * stage_bytes;
        const int kk = s * SKINNY_KC + lc * 8;
        const bool kok = kk < k;
        for (int r = lr0; r < rows; r += lrstep) {   // rows * 8 / nthreads = 8 / kw per thread
            const bool ok = kok && n0 + r < n;
            const E* src = ok ? w + static_cast<long long>(n0 + r) * w_ld + kk : w;
            cp16_policy(sb + r * 128 + ((lc ^ ((r & 1) << 2)) << 4), src, ok, pol);
        }
        for (int idx = tid; idx < TT * 64; idx += nthreads) {
            const int tok = idx >> 3, c = idx & 7;
            const int kx = s * SKINNY_KC + c * 8;
            const bool ok = tok < nt && kx < k;
            const E* src = ok ? x + static_cast<long long>(tok) * x_ld + kx : x;
            cp16(sb + w_bytes + tok * 128 + ((c ^ ((tok & 1) << 2)) << 4), src, ok);
        }
    };

    float acc[2][TT][4];
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int j = 0; j < TT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[m][j][e] = 0.f;

    auto compute = [&](int buf) {
        const unsigned char* sw = smem + buf * stage_bytes;
        const unsigned char* sx = sw + w_bytes;
        for (int kb = kwi; kb < 2; kb += kw) {
            // every row this thread reads has parity g & 1: one swizzled chunk offset for all
            const int cofs = ((4 * kb + q) ^ ((g & 1) << 2)) << 4;
            uint4 a[2][2];
#pragma unroll
            for (int m = 0; m < 2; ++m) {
                const int r = rgi * 32 + m * 16 + g;
                a[m][0] = *reinterpret_cast<const uint4*>(sw + r * 128 + cofs);
                a[m][1] = *reinterpret_cast<const uint4*>(sw + (r + 8) * 128 + cofs);
            }
            uint4 b[TT];
#pragma unroll
            for (int j = 0; j < TT; ++j) b[j] = *reinterpret_cast<const uint4*>(sx + (j * 8 + g) * 128 + cofs);
#pragma unroll
            for (int j = 0; j < TT; ++j)
#pragma unroll
                for (int m = 0; m < 2; ++m) {
                    mma16816(acc[m][j], a[m][0].x, a[m][1].x, a[m][0].y, a[m][1].y, b[j].x, b[j].y, E());
                    mma16816(acc[m][j], a[m][0].z, a[m][1].z, a[m][0].w, a[m][1].w, b[j].z, b[j].w, E());
                }
        }
    };

    // the ring: stages - 1 stages in flight ahead of the one being multiplied
    for (int s = 0; s < stages - 1; ++s) {
        if (s < cnt) load_stage(s, s_begin + s);
        cp_commit();   // (empty groups too: the wait counts stay uniform)
    }
    int rd = 0, wr = stages - 1;
    for (int it = 0; it < cnt; ++it) {
        cp_wait_pending(stages - 2);   // this thread's copies of stage `it` have landed
        __syncthreads();               // everyone's have; everyone is done with buffer `wr`
        if (it + stages - 1 < cnt) load_stage(wr, s_begin + it + stages - 1);
        cp_commit();
        compute(rd);
        rd = rd + 1 == stages ? 0 : rd + 1;
        wr = wr + 1 == stages ? 0 : wr + 1;
    }
    cp_wait_pending(0);
    __syncthreads();   // the ring is free: it becomes the fp32 tile

    // partial tile red[token][row] (row stride rows + 4 = 4 mod 32 words: lanes (g, q) hit
    // banks 8q + g), k-warp 0 stores, k-warp 1 adds
    float* red = reinterpret_cast<float*>(smem);
    const int rs = rows + 4;
    auto put = [&](bool add) {
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int j = 0; j < TT; ++j) {
                float* p = red + (j * 8 + 2 * q) * rs + rgi * 32 + m * 16 + g;
                if (add) {
                    p[0] += acc[m][j][0];
                    p[rs] += acc[m][j][1];
                    p[8] += acc[m][j][2];
                    p[rs + 8] += acc[m][j][3];
                } else {
                    p[0] = acc[m][j][0];
                    p[rs] = acc[m][j][1];
                    p[8] = acc[m][j][2];
                    p[rs + 8] = acc[m][j][3];
                }
            }
    };
    if (kwi == 0) put(false);
    __syncthreads();
    if (kw > 1) {   // uniform
        if (kwi == 1) put(true);
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
        const int q4 = rows >> 2;   // float4s per token row
        const int units = nt * q4;
        const int u1 = (z + 1) * units / KS;
        for (int u = z * units / KS + tid; u < u1; u += nthreads) {
            const int tok = u / q4, i = (u - tok * q4) * 4;
            const uint32_t a = sbase + static_cast<uint32_t>(tok * rs + i) * 4u;
            float4 part[KS];
#pragma unroll
            for (int r = 0; r < KS; ++r) part[r] = ld_cluster_f4(map_rank(a, r));
            float4 s = part[0];
#pragma unroll
            for (int r = 1; r < KS; ++r) {   // ranks in order: deterministic
                s.x += part[r].x;
                s.y += part[r].y;
                s.z += part[r].z;
                s.w += part[r].w;
            }
            const float v[4] = {s.x, s.y, s.z, s.w};
            E* yrow = y + static_cast<long long>(tok) * y_ld + n0 + i;
#pragma unroll
            for (int e = 0; e < 4; ++e)
                if (n0 + i + e < n) store_f(yrow + e, accumulate ? v[e] + load_f(yrow + e) : v[e]);
        }
        cluster_barrier();   // nobody leaves while another CTA may still read its tile
#endif
    }
}

}  // namespace

#define MT_SKINNY_KS1(T, SUF, E)                                                                         \
    extern "C" __global__ void __launch_bounds__(SKINNY_MAX_THREADS, 1)                                   \
        skinny_t##T##_ks1_##SUF(const E* __restrict__ x, long long x_ld, const E* __restrict__ w,        \
                                long long w_ld, E* __restrict__ y, long long y_ld, int nt, int n, int k,  \
                                int rg, int kw, int stages, int accumulate) {                             \
        skinny<T / 8, 1, E>(x, x_ld, w, w_ld, y, y_ld, nt, n, k, rg, kw, stages, accumulate);            \
    }

#define MT_SKINNY_CL(T, KS, SUF, E)                                                                      \
    extern "C" __global__ void __cluster_dims__(1, KS, 1) __launch_bounds__(SKINNY_MAX_THREADS, 1)        \
        skinny_t##T##_ks##KS##_##SUF(const E* __restrict__ x, long long x_ld, const E* __restrict__ w,   \
                                     long long w_ld, E* __restrict__ y, long long y_ld, int nt, int n,   \
                                     int k, int rg, int kw, int stages, int accumulate) {                 \
        skinny<T / 8, KS, E>(x, x_ld, w, w_ld, y, y_ld, nt, n, k, rg, kw, stages, accumulate);           \
    }

#ifdef SKINNY_NO_CLUSTERS
#define MT_SKINNY_T(T, SUF, E) MT_SKINNY_KS1(T, SUF, E)
#else
#define MT_SKINNY_T(T, SUF, E)      \
    MT_SKINNY_KS1(T, SUF, E)        \
    MT_SKINNY_CL(T, 2, SUF, E)      \
    MT_SKINNY_CL(T, 4, SUF, E)      \
    MT_SKINNY_CL(T, 8, SUF, E)
#endif

MT_SKINNY_T(8, bf16, __nv_bfloat16)
MT_SKINNY_T(16, bf16, __nv_bfloat16)
MT_SKINNY_T(32, bf16, __nv_bfloat16)
MT_SKINNY_T(64, bf16, __nv_bfloat16)
MT_SKINNY_T(8, f16, __half)
MT_SKINNY_T(16, f16, __half)
MT_SKINNY_T(32, f16, __half)
MT_SKINNY_T(64, f16, __half)
