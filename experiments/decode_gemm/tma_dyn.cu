// experiment: skinny GEMM, 2-D TMA ring, persistent grid with dynamic units (see below): y[t, n] = x[t, k] @ w[n, k]^T, t <= 8 NT.
// CW consumer warps (16 rows each) + 1 producer warp; stage = KC k-elements of R = 16 CW rows
// (KC*2 contiguous bytes per row per copy) + the 8 NT x rows; STAGES deep; KS-CTA cluster k split.
#include "common.cuh"

namespace {
__device__ __forceinline__ uint32_t saddr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void mbar_init(uint32_t a, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(a), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect(uint32_t a, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(a), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t a) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(a) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t a, uint32_t parity) {
    asm volatile(
        "{\n"
        "  .reg .pred done;\n"
        "WAIT_%=:\n"
        "  mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "  @!done bra WAIT_%=;\n"
        "}\n" ::"r"(a), "r"(parity) : "memory");
}
__device__ __forceinline__ void bulk_g2s(uint32_t dst, const void* src, uint32_t bytes, uint32_t mbar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 ::"r"(dst), "l"(src), "r"(bytes), "r"(mbar) : "memory");
}
__device__ __forceinline__ void tma_2d(uint32_t dst, const void* tmap, int c0, int c1, uint32_t mbar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
                 ::"r"(dst), "l"(tmap), "r"(c0), "r"(c1), "r"(mbar) : "memory");
}
__device__ __forceinline__ void mma16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t cluster_rank() { uint32_t r; asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r)); return r; }
__device__ __forceinline__ void cluster_barrier() {
    asm volatile("barrier.cluster.arrive.aligned;\nbarrier.cluster.wait.aligned;\n" ::: "memory");
}
__device__ __forceinline__ uint32_t map_rank(uint32_t a, uint32_t rank) {
    uint32_t r; asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(rank)); return r;
}
__device__ __forceinline__ float4 ld_cluster_f4(uint32_t a) {
    float4 v;
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(a) : "memory");
    return v;
}


// Persistent grid (one CTA per SM), units = (row block of R rows, k chunk of KCH) taken from an
// atomic counter in the order chunk-major (CTAs working at once share the x chunk in L2); each
// unit's fp32 partial goes to part[chunk][t][n] and a second kernel sums the chunks in order
// (deterministic whatever CTA ran which unit) and resets the counter (graph-safe). Why: every
// one-wave design (128 equal CTAs) plateaued at 80-85 % of copy bandwidth while the CUDA-core
// GEMV (1024 small CTAs) reaches 94 %; the hypothesis is the tail of a static partition (the
// slowest SM sets the end), which dynamic units of ~1/6 of a CTA's share remove.
template <int NT, int CW, int KC, int STAGES, int KCH>
__device__ __forceinline__ void skinny_dyn(const __nv_bfloat16* __restrict__ x, long long x_ld,
                                           const void* __restrict__ tmap, float* __restrict__ part,
                                           int* __restrict__ counter, int nt, int n, int k) {
    constexpr int R = 16 * CW;
    constexpr int NB = KC / 64;
    constexpr int RS = KC * 2 + 64;
    constexpr int XR = 8 * NT;
    constexpr int STAGE = (R * KC * 2 + XR * RS + 1023) / 1024 * 1024;
    constexpr int SPU = KCH / KC;                   // stages per unit
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char* smem = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
    uint64_t* bars = reinterpret_cast<uint64_t*>(smem + STAGES * STAGE);
    int* meta = reinterpret_cast<int*>(bars + 2 * STAGES);      // unit of each ring slot (-1: done)
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int nrb = (n + R - 1) / R, nch = (k + KCH - 1) / KCH;
    const int units = nrb * nch;
    const uint32_t sb = saddr(smem);
    const uint32_t full0 = saddr(bars), empty0 = saddr(bars + STAGES);
    if (tid == 0) {
        asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;\n" ::"l"(tmap) : "memory");
        for (int i = 0; i < STAGES; ++i) {
            mbar_init(full0 + 8 * i, 1);
            mbar_init(empty0 + 8 * i, CW);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (warp == CW) {   // producer: one lane takes units and issues their stages
        if (lane == 0) {
            int i = 0;   // ring position
            while (true) {
                const int u = atomicAdd(counter, 1);
                const int nst = u < units ? SPU : 1;
                for (int s = 0; s < nst; ++s, ++i) {
                    const int slot = i % STAGES;
                    if (i >= STAGES) mbar_wait(empty0 + 8 * slot, ((i / STAGES) - 1) & 1);
                    if (u >= units) {
                        meta[slot] = -1;
                        mbar_arrive(full0 + 8 * slot);
                        break;
                    }
                    const int c = u / nrb, rb = u - c * nrb;
                    const int kk = c * KCH + s * KC;
                    const int kl = max(0, min(KC, k - kk));
                    meta[slot] = u * SPU + s;
                    const uint32_t dst = sb + slot * STAGE;
                    mbar_expect(full0 + 8 * slot, static_cast<uint32_t>(NB) * R * 128u +
                                                      static_cast<uint32_t>(kl) * 2u * static_cast<uint32_t>(nt));
                    for (int b = 0; b < NB; ++b) tma_2d(dst + b * R * 128, tmap, kk + 64 * b, rb * R, full0 + 8 * slot);
                    if (kl > 0)
                        for (int t = 0; t < nt; ++t)
                            bulk_g2s(dst + R * KC * 2 + t * RS, x + static_cast<long long>(t) * x_ld + kk,
                                     static_cast<uint32_t>(kl) * 2u, full0 + 8 * slot);
                }
                if (u >= units) break;
            }
        }
    } else {   // consumers
        const int g = lane >> 2, q = lane & 3;
        float acc[NT][4];
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
        for (int i = 0;; ++i) {
            const int slot = i % STAGES;
            mbar_wait(full0 + 8 * slot, (i / STAGES) & 1);
            const int m = meta[slot];
            if (m < 0) break;
            const int u = m / SPU, s = m - u * SPU;
            const int c = u / nrb, rb = u - c * nrb;
            const int kk = c * KCH + s * KC;
            const unsigned char* st = smem + slot * STAGE;
            const unsigned char* a0 = st + (warp * 16 + g) * 128;
            const unsigned char* xb = st + R * KC * 2 + g * RS;
#pragma unroll 8
            for (int kb = 0; kb < KC / 32; ++kb) {
                const int b = kb >> 1, h = kb & 1;
                const int ch = (h << 2) + q;
                const bool ok = kk + b * 64 + ch * 8 < k;
                const uint4 A0 = *reinterpret_cast<const uint4*>(a0 + b * R * 128 + ((ch ^ g) << 4));
                const uint4 A1 = *reinterpret_cast<const uint4*>(a0 + b * R * 128 + 8 * 128 + ((ch ^ g) << 4));
#pragma unroll
                for (int j = 0; j < NT; ++j) {
                    uint4 B = *reinterpret_cast<const uint4*>(xb + j * 8 * RS + b * 128 + ch * 16);
                    if (!ok) B = make_uint4(0, 0, 0, 0);
                    mma16816(acc[j], A0.x, A1.x, A0.y, A1.y, B.x, B.y);
                    mma16816(acc[j], A0.z, A1.z, A0.w, A1.w, B.z, B.w);
                }
            }
            __syncwarp();
            if (lane == 0) mbar_arrive(empty0 + 8 * slot);
            if (s == SPU - 1) {   // the unit's partial: part[c][t][rb R + row]
                const int r0 = rb * R + warp * 16 + g;
#pragma unroll
                for (int j = 0; j < NT; ++j) {
                    const int t0 = j * 8 + 2 * q;
                    float* p = part + (static_cast<long long>(c) * XR + t0) * n;
                    if (t0 < nt && r0 < n) p[r0] = acc[j][0];
                    if (t0 + 1 < nt && r0 < n) p[n + r0] = acc[j][1];
                    if (t0 < nt && r0 + 8 < n) p[r0 + 8] = acc[j][2];
                    if (t0 + 1 < nt && r0 + 8 < n) p[n + r0 + 8] = acc[j][3];
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
                }
            }
        }
    }
}

// y[t][n] = sum over chunks (in order) of part[c][t][n]; resets the unit counter for the next call
template <int XR>
__device__ __forceinline__ void skinny_dyn_reduce(const float* __restrict__ part, __nv_bfloat16* __restrict__ y,
                                                  long long y_ld, int* __restrict__ counter, int nt, int n, int nch) {
    const long long total = static_cast<long long>(nt) * n;
    for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < total;
         i += static_cast<long long>(gridDim.x) * blockDim.x) {
        const int t = static_cast<int>(i / n), col = static_cast<int>(i - static_cast<long long>(t) * n);
        float s = 0.f;
        for (int c = 0; c < nch; ++c) s += part[(static_cast<long long>(c) * XR + t) * n + col];
        y[static_cast<long long>(t) * y_ld + col] = __float2bfloat16_rn(s);
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) *counter = 0;
}
}  // namespace

#define DYN(NT, CW, KC, ST, KCH)                                                                              \
    extern "C" __global__ void __launch_bounds__(32 * (CW + 1), 1)                                             \
        dyn_n##NT##_c##CW##_k##KC##_s##ST##_ch##KCH(const __nv_bfloat16* __restrict__ x, long long x_ld,      \
                                                    const void* __restrict__ tmap, float* __restrict__ part,   \
                                                    int* __restrict__ counter, int nt, int n, int k) {         \
        skinny_dyn<NT, CW, KC, ST, KCH>(x, x_ld, tmap, part, counter, nt, n, k);                              \
    }
#define DYN_RED(NT)                                                                                           \
    extern "C" __global__ void dyn_reduce_n##NT(const float* __restrict__ part, __nv_bfloat16* __restrict__ y, \
                                                long long y_ld, int* __restrict__ counter, int nt, int n,      \
                                                int nch) {                                                     \
        skinny_dyn_reduce<8 * NT>(part, y, y_ld, counter, nt, n, nch);                                        \
    }
DYN(1, 4, 256, 5, 1024)
DYN(1, 4, 256, 5, 512)
DYN(1, 2, 512, 5, 1024)
DYN(2, 4, 256, 5, 1024)
DYN(2, 4, 256, 5, 512)
DYN(4, 4, 256, 4, 1024)
DYN(8, 4, 256, 3, 1024)
DYN_RED(1)
DYN_RED(2)
DYN_RED(4)
DYN_RED(8)
