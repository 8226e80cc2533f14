// scratch: skinny GEMM with a 1-D bulk-copy (TMA) ring: y[t, n] = x[t, k] @ w[n, k]^T, t <= 8 NT.
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

template <int NT, int CW, int KC, int STAGES, int KS>
__device__ __forceinline__ void skinny_tma(const __nv_bfloat16* __restrict__ x, long long x_ld,
                                           const __nv_bfloat16* __restrict__ w, long long w_ld,
                                           __nv_bfloat16* __restrict__ y, long long y_ld, int nt, int n, int k) {
    constexpr int R = 16 * CW;
    constexpr int RS = KC * 2 + 64;            // row stride in shared memory (bytes): 64 mod 128
    constexpr int XR = 8 * NT;
    constexpr int STAGE = (R + XR) * RS;
    extern __shared__ __align__(128) unsigned char smem[];
    uint64_t* bars = reinterpret_cast<uint64_t*>(smem + STAGES * STAGE);   // full[STAGES], empty[STAGES]
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int n0 = blockIdx.x * R;
    const int z = KS > 1 ? static_cast<int>(cluster_rank()) : 0;
    const int nsk = (k + KC - 1) / KC;                       // stages over all of k
    const int s0 = static_cast<int>(static_cast<long long>(z) * nsk / KS);
    const int s1 = static_cast<int>(static_cast<long long>(z + 1) * nsk / KS);
    const int cnt = s1 - s0;
    const uint32_t sb = saddr(smem);
    const uint32_t full0 = saddr(bars), empty0 = saddr(bars + STAGES);
    if (tid == 0) {
        for (int i = 0; i < STAGES; ++i) {
            mbar_init(full0 + 8 * i, 1);
            mbar_init(empty0 + 8 * i, CW);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    float acc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;

    if (warp == CW) {   // producer
        const int rows_here = min(R, n - n0);
        for (int i = 0; i < cnt; ++i) {
            const int slot = i % STAGES;
            if (i >= STAGES) mbar_wait(empty0 + 8 * slot, ((i / STAGES) - 1) & 1);
            const int kk = (s0 + i) * KC;
            const int kl = min(KC, k - kk);
            const uint32_t bytes = static_cast<uint32_t>(kl) * 2u;
            if (lane == 0) mbar_expect(full0 + 8 * slot, bytes * static_cast<uint32_t>(rows_here + nt));
            __syncwarp();
            const uint32_t dst = sb + slot * STAGE;
            for (int r = lane; r < rows_here; r += 32)
                bulk_g2s(dst + r * RS, w + static_cast<long long>(n0 + r) * w_ld + kk, bytes, full0 + 8 * slot);
            for (int t = lane; t < nt; t += 32)
                bulk_g2s(dst + (R + t) * RS, x + static_cast<long long>(t) * x_ld + kk, bytes, full0 + 8 * slot);
        }
    } else {   // consumers: rows warp*16 + g, + 8
        const int g = lane >> 2, q = lane & 3;
        for (int i = 0; i < cnt; ++i) {
            const int slot = i % STAGES;
            mbar_wait(full0 + 8 * slot, (i / STAGES) & 1);
            const int kk = (s0 + i) * KC;
            const int kl = min(KC, k - kk);
            const unsigned char* st = smem + slot * STAGE;
            const unsigned char* a0 = st + (warp * 16 + g) * RS + 16 * q;
            const unsigned char* a1 = a0 + 8 * RS;
            const unsigned char* xb = st + (R + g) * RS + 16 * q;
#pragma unroll 4
            for (int kb = 0; kb < KC / 32; ++kb) {
                const bool ok = kb * 32 + 8 * q < kl;
                uint4 A0 = *reinterpret_cast<const uint4*>(a0 + kb * 64);
                uint4 A1 = *reinterpret_cast<const uint4*>(a1 + kb * 64);
                if (!ok) A0 = A1 = make_uint4(0, 0, 0, 0);
#pragma unroll
                for (int j = 0; j < NT; ++j) {
                    uint4 B = *reinterpret_cast<const uint4*>(xb + j * 8 * RS + kb * 64);
                    if (!ok) B = make_uint4(0, 0, 0, 0);
                    mma16816(acc[j], A0.x, A1.x, A0.y, A1.y, B.x, B.y);
                    mma16816(acc[j], A0.z, A1.z, A0.w, A1.w, B.z, B.w);
                }
            }
            __syncwarp();
            if (lane == 0) mbar_arrive(empty0 + 8 * slot);
        }
    }
    __syncthreads();   // every stage consumed: the ring becomes the fp32 tile red[token][R + 4]
    float* red = reinterpret_cast<float*>(smem);
    constexpr int RSF = R + 4;
    if (warp < CW) {
        const int g = lane >> 2, q = lane & 3;
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            float* r = red + (j * 8 + 2 * q) * RSF + warp * 16 + g;
            r[0] = acc[j][0];
            r[RSF] = acc[j][1];
            r[8] = acc[j][2];
            r[RSF + 8] = acc[j][3];
        }
    }
    __syncthreads();
    const int nthreads = blockDim.x;
    if constexpr (KS == 1) {
        for (int tok = 0; tok < nt; ++tok)
            for (int i = tid; i < R && n0 + i < n; i += nthreads)
                y[static_cast<long long>(tok) * y_ld + n0 + i] = __float2bfloat16_rn(red[tok * RSF + i]);
    } else {
        cluster_barrier();
        const uint32_t rb = saddr(red);
        constexpr int Q4 = R / 4;
        const int units = nt * Q4;
        for (int u = z * units / KS + tid; u < (z + 1) * units / KS; u += nthreads) {
            const int tok = u / Q4, i = (u - tok * Q4) * 4;
            const uint32_t a = rb + static_cast<uint32_t>(tok * RSF + i) * 4u;
            float4 s = ld_cluster_f4(map_rank(a, 0));
#pragma unroll
            for (int r = 1; r < KS; ++r) {
                const float4 p = ld_cluster_f4(map_rank(a, r));
                s.x += p.x; s.y += p.y; s.z += p.z; s.w += p.w;
            }
            const float v[4] = {s.x, s.y, s.z, s.w};
            for (int e = 0; e < 4; ++e)
                if (n0 + i + e < n) y[static_cast<long long>(tok) * y_ld + n0 + i + e] = __float2bfloat16_rn(v[e]);
        }
        cluster_barrier();
    }
}
}  // namespace

#define TMA(NT, CW, KC, ST, KS)                                                                               \
    extern "C" __global__ void __cluster_dims__(1, KS, 1) __launch_bounds__(32 * (CW + 1), 1)                 \
        tma_n##NT##_c##CW##_k##KC##_s##ST##_ks##KS(const __nv_bfloat16* __restrict__ x, long long x_ld,        \
                                                   const __nv_bfloat16* __restrict__ w, long long w_ld,        \
                                                   __nv_bfloat16* __restrict__ y, long long y_ld, int nt,      \
                                                   int n, int k) {                                             \
        skinny_tma<NT, CW, KC, ST, KS>(x, x_ld, w, w_ld, y, y_ld, nt, n, k);                                  \
    }
#define TMA_KS(NT, CW, KC, ST) TMA(NT, CW, KC, ST, 1) TMA(NT, CW, KC, ST, 2) TMA(NT, CW, KC, ST, 4)
TMA_KS(1, 4, 256, 4)
TMA_KS(1, 4, 512, 2)
TMA_KS(1, 8, 256, 2)
TMA_KS(1, 6, 256, 3)
TMA_KS(2, 4, 256, 4)
TMA_KS(2, 6, 256, 3)
TMA_KS(2, 8, 256, 2)
TMA_KS(4, 4, 256, 3)
TMA_KS(4, 8, 256, 2)
TMA_KS(8, 4, 256, 3)
TMA_KS(8, 8, 256, 2)
