// FP8 / NVFP4 weights, read packed (launched by metrale/backends/cuda/gemm/quant.py). Sections:
// the CUDA-core decode GEMVs (gemvq_*, this header), the tensor-core decode GEMMs (gemmq_*, up to
// 64 rows), the dequantisation into bf16 for prefill (dequant_*), and the activation
// quantization of the W8A8 block-FP8 prefill GEMM (quant_act_fp8); each has its own header.
//
// Decode GEMVs over quantized weights: y[t, n] = x[t, k] @ dequant(w)[n, k]^T for 1-8 rows of
// bf16 x, fp32 accumulation, weights read packed (never a bf16 copy): the bandwidth win that
// FP8 and NVFP4 checkpoints exist for. Weight-only: x stays bf16 (the H200 has no FP4 tensor
// cores; W8A8 is a prefill matter). The math is the CPU spec's (metrale/models/quant.py
// QuantizedTensor.dequantize, then x @ w^T): the dequantized weight is exact in fp32, so the
// kernel differs from the spec by the fp32 summation order only.
//
// Formats (metrale/backends/cuda/gemm/quant.py uploads them in exactly these layouts):
//   fp8   w  uint8 [n, k] e4m3 codes, row stride w_ld bytes;
//         s  fp32 scales, scale of (row, col) = s[(row >> s_rlog2) * s_ld + (col >> s_clog2)]:
//            block 128 x 128 (transformers fine-grained FP8): 7, 7; per channel: 0, 30; per
//            tensor: 30, 30; any block of 2^a rows x 2^b >= 16 columns.
//   nvfp4 w  uint8 [n, k / 2]: two e2m1 codes per byte, column 2j in the low nibble (the
//            producers' order); row stride w_ld bytes;
//         s  e4m3 scale per 16 columns [n, k / 16], row stride s_ld bytes;
//         g  fp32 [n]: the per-row global multiplier (per tensor in the checkpoint; per row
//            once q|k|v of different tensors share one matrix).
//         w = e2m1 * s * g.
// Entry points (extern "C"): gemvq_<fp8|nvfp4>_t<T>_r<R>[_f32], T in {1, 2, 4, 8} (the kernel
// runs nt <= T rows: the host picks the smallest T >= nt), R in {2, 4} weight rows per warp
// group; _f32 stores y in fp32 (a quantized lm head), else bf16. Arguments:
//   x [nt, k] bf16, row stride x_ld elements (x_ld % 8 == 0, 16-byte aligned rows)
//   w, s (, g) as above; k % 16 == 0 (fp8) or k % 32 == 0 (nvfp4); w 16-byte aligned rows
//   y [nt, n], row stride y_ld elements
//   nt (1..T), n, k, ks_log2 (0, 1, 2: warps splitting k, as in gemv.cu)
//
// Layout: gemv.cu's. 128 threads (4 warps) per CTA form 4 >> ks_log2 row groups of
// 1 << ks_log2 warps; a group owns R consecutive weight rows, its warps split k in 16-byte
// weight vectors (16 fp8 or 32 nvfp4 elements): lane l of slice s reads vectors s*32 + l +
// j*32*ksplit of each row (512 contiguous bytes per warp-wide load), U per row per round, every
// weight load of a round in flight before the first use. x comes from L1 (2 / 4 16-byte loads
// per weight vector and row of x, shared by the R weight rows), the scales from L1 / L2.
// Decoding, per 16-byte weight vector:
//   fp8:   8 cvt.rn.f16x2.e4m3x2 (exact), 16 f16 -> f32, 16 FMAs per row of x, then one FMA
//          with the vector's scale (every vector lies in one scale block: 16 | block columns).
//   nvfp4: per 32-bit word (8 codes) four half2 of exact magnitudes through one byte
//          permutation each (the fp16 high bytes of 0, .5, 1, 1.5, 2, 3, 4, 6 as an 8-entry
//          table: the low bytes are all zero), signs moved in by a second permutation; 32
//          f16 -> f32, 32 FMAs per row of x; the 16-column groups' sums times their e4m3
//          scale, the row's sum times g once.
// Rows past n read row n-1 (in bounds, discarded); x rows past nt read row nt-1 (same).
// Reduction: warp_sum, then across the k-split warps in shared memory in a fixed order
// (deterministic: a graph replay equals the eager call bit for bit).
//
// Programmatic dependent launch (common.cuh): the first round's weight loads (never written by
// any kernel) are issued before the wait; x, scales and y after it.
//
// Bytes: fp8 n*k (w) + 4 * n*k / (block rows * block cols) (s); nvfp4 n*k/2 (w) + n*k/16 (s) +
// 4n (g); + nt*k*2 (x, L2/L1) + nt*n*2 (y; 4 with _f32). FLOPs: 2*nt*n*k.
// Reference: the CPU spec above; tests/test_cuda_quant_gemv.py checks against it (ragged n, k,
// every T, both R and splits, poisoned outputs).
#include "common.cuh"

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#define GEMVQ_WARPS 4

namespace {

// weight vectors per row per round and lane (registers: R x U weight vectors + T x U x
// (2 | 4) x vectors)
template <bool FP4>
__host__ __device__ constexpr int gemvq_u(int T) { return FP4 ? (T >= 4 ? 1 : 2) : (T >= 4 ? 2 : 4); }

__device__ __forceinline__ uint4 ldg16_w(const void* p, bool pred) { return mt::ldg16_if<true>(p, pred); }
__device__ __forceinline__ uint4 ldg16_x(const void* p, bool pred) { return mt::ldg16_if<false>(p, pred); }

__device__ __forceinline__ float bf_lo(uint32_t u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float bf_hi(uint32_t u) { return __uint_as_float(u & 0xffff0000u); }

__device__ __forceinline__ float2 h2f(uint32_t h) {
    return __half22float2(*reinterpret_cast<const __half2*>(&h));
}

// two e4m3 codes (low 16 bits of u) -> exact half2 bits
__device__ __forceinline__ uint32_t e4m3x2_half2(uint32_t u) {
    const __half2_raw r = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(u & 0xffffu), __NV_E4M3);
    return static_cast<uint32_t>(r.x) | (static_cast<uint32_t>(r.y) << 16);
}

__device__ __forceinline__ float e4m3_f(uint32_t b) {
    const __half_raw r = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(b & 0xffu), __NV_E4M3);
    return __half2float(__half(r));
}

// fp16 high bytes of the e2m1 magnitudes 0, .5, 1, 1.5 | 2, 3, 4, 6 (low bytes all zero)
#define E2M1_LUT_LO 0x3E3C3800u
#define E2M1_LUT_HI 0x46444240u

// half2 of the codes in nibbles 1 and 3 of v (bits 4-7, 12-15): magnitudes by table, signs
// (bits 7, 15) moved to bits 15, 31. s_sel picks which two bytes of `sv` carry those signs.
__device__ __forceinline__ uint32_t e2m1_pair(uint32_t v, uint32_t sv, uint32_t s_sel) {
    const uint32_t mag = __byte_perm(E2M1_LUT_LO, E2M1_LUT_HI, v & 0x7070u);
    const uint32_t sgn = __byte_perm(sv, 0u, s_sel);
    return mag | (sgn & 0x80008000u);
}

// sum over the 8 codes of one word u (elements 0..7: nibble i is element i) times x elements
// 0..7 (xa: elements 0-3, xb: 4-7 as bf16 pairs)
__device__ __forceinline__ float e2m1_dot8(uint32_t u, const float xf[8], float acc) {
    const uint32_t u4 = u << 4;
    const float2 a = h2f(e2m1_pair(u, u, 0x1404u));             // elements 1, 3
    const float2 b = h2f(e2m1_pair(u4, u4, 0x1404u));           // elements 0, 2
    const float2 c = h2f(e2m1_pair(u >> 16, u, 0x3424u));       // elements 5, 7
    const float2 d = h2f(e2m1_pair(u >> 12, u4, 0x3424u));      // elements 4, 6
    acc = fmaf(b.x, xf[0], acc);
    acc = fmaf(a.x, xf[1], acc);
    acc = fmaf(b.y, xf[2], acc);
    acc = fmaf(a.y, xf[3], acc);
    acc = fmaf(d.x, xf[4], acc);
    acc = fmaf(c.x, xf[5], acc);
    acc = fmaf(d.y, xf[6], acc);
    acc = fmaf(c.y, xf[7], acc);
    return acc;
}

__device__ __forceinline__ void x_floats(const uint4& q, float xf[8]) {
    xf[0] = bf_lo(q.x); xf[1] = bf_hi(q.x); xf[2] = bf_lo(q.y); xf[3] = bf_hi(q.y);
    xf[4] = bf_lo(q.z); xf[5] = bf_hi(q.z); xf[6] = bf_lo(q.w); xf[7] = bf_hi(q.w);
}

// sum of 4 e4m3 codes of word u times x elements 0..3 of xf (offset o)
__device__ __forceinline__ float e4m3_dot4(uint32_t u, const float* xf, float acc) {
    const float2 a = h2f(e4m3x2_half2(u));
    const float2 b = h2f(e4m3x2_half2(u >> 16));
    acc = fmaf(a.x, xf[0], acc);
    acc = fmaf(a.y, xf[1], acc);
    acc = fmaf(b.x, xf[2], acc);
    acc = fmaf(b.y, xf[3], acc);
    return acc;
}

__device__ __forceinline__ void store_y(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
__device__ __forceinline__ void store_y(float* p, float v) { *p = v; }

template <bool FP4, int T, int R, typename O>
__device__ __forceinline__ void gemvq(const __nv_bfloat16* x, long long x_ld, const uint8_t* w, long long w_ld,
                                      const void* s, long long s_ld, int s_rlog2, int s_clog2, const float* g,
                                      O* y, long long y_ld, int nt, int n, int k, int ks_log2) {
    static_assert(T * R <= 32, "one output per lane");
    constexpr int EPV = FP4 ? 32 : 16;           // elements per 16-byte weight vector
    constexpr int XPV = EPV / 8;                 // 16-byte x vectors per weight vector
    constexpr int U = gemvq_u<FP4>(T);
    __shared__ float red[GEMVQ_WARPS][T * R];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int slice = warp & ((1 << ks_log2) - 1);
    const int n0 = (blockIdx.x * (GEMVQ_WARPS >> ks_log2) + (warp >> ks_log2)) * R;
    const int kv = k / EPV;                      // weight vectors per row
    const int step = 32 << ks_log2;

    int row[R];
    const uint4* wrow[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        row[r] = min(n0 + r, n - 1);
        wrow[r] = reinterpret_cast<const uint4*>(w + static_cast<long long>(row[r]) * w_ld);
    }
    const uint4* xrow[T];
#pragma unroll
    for (int t = 0; t < T; ++t)
        xrow[t] = reinterpret_cast<const uint4*>(x + static_cast<long long>(min(t, nt - 1)) * x_ld);

    float acc[T][R];
#pragma unroll
    for (int t = 0; t < T; ++t)
#pragma unroll
        for (int r = 0; r < R; ++r) acc[t][r] = 0.f;

    bool waited = false;
    for (int v0 = slice * 32 + lane; v0 < kv; v0 += step * U) {
        uint4 wv[U][R];
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int r = 0; r < R; ++r) wv[u][r] = ldg16_w(wrow[r] + v0 + u * step, v0 + u * step < kv);
        if (!waited) {
            mt::pdl_wait();
            mt::pdl_after_wait();
            waited = true;
        }
        // scales of each (u, r): fp8 one fp32 per vector, nvfp4 two e4m3 bytes (two groups)
        float sc[U][R][FP4 ? 2 : 1];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int v = min(v0 + u * step, kv - 1);
#pragma unroll
            for (int r = 0; r < R; ++r) {
                if constexpr (FP4) {
                    const uint16_t b2 = *reinterpret_cast<const uint16_t*>(
                        static_cast<const uint8_t*>(s) + static_cast<long long>(row[r]) * s_ld + 2 * v);
                    sc[u][r][0] = e4m3_f(b2);
                    sc[u][r][1] = e4m3_f(b2 >> 8);
                } else {
                    const long long si = static_cast<long long>(row[r] >> s_rlog2) * s_ld +
                                         ((static_cast<long long>(v) * EPV) >> s_clog2);
                    sc[u][r][0] = static_cast<const float*>(s)[si];
                }
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const bool in = v0 + u * step < kv;
#pragma unroll
            for (int t = 0; t < T; ++t) {
                float xf[XPV][8];
#pragma unroll
                for (int q = 0; q < XPV; ++q)
                    x_floats(ldg16_x(xrow[t] + (v0 + u * step) * XPV + q, in), xf[q]);
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    const uint4& wq = wv[u][r];
                    if constexpr (FP4) {
                        float p0 = e2m1_dot8(wq.x, xf[0], 0.f);
                        p0 = e2m1_dot8(wq.y, xf[1], p0);
                        float p1 = e2m1_dot8(wq.z, xf[2], 0.f);
                        p1 = e2m1_dot8(wq.w, xf[3], p1);
                        acc[t][r] = fmaf(p0, sc[u][r][0], fmaf(p1, sc[u][r][1], acc[t][r]));
                    } else {
                        float p = e4m3_dot4(wq.x, &xf[0][0], 0.f);
                        p = e4m3_dot4(wq.y, &xf[0][4], p);
                        p = e4m3_dot4(wq.z, &xf[1][0], p);
                        p = e4m3_dot4(wq.w, &xf[1][4], p);
                        acc[t][r] = fmaf(p, sc[u][r][0], acc[t][r]);
                    }
                }
            }
        }
    }

    if (!waited) {
        mt::pdl_wait();
        mt::pdl_after_wait();
    }

    float mine = 0.f;
#pragma unroll
    for (int t = 0; t < T; ++t)
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const float v = mt::warp_sum(acc[t][r]);
            if (lane == t * R + r) mine = v;
        }
    if (ks_log2 > 0) {
        if (lane < T * R) red[warp][lane] = mine;
        __syncthreads();
        if (slice != 0) return;
        for (int i = 1; i < (1 << ks_log2); ++i) mine += red[warp + i][lane < T * R ? lane : 0];
    }
    const int t = lane / R, r = lane % R;
    if (lane < T * R && t < nt && n0 + r < n) {
        if constexpr (FP4) mine *= g[n0 + r];
        store_y(y + static_cast<long long>(t) * y_ld + n0 + r, mine);
    }
}

}  // namespace

#define MT_GEMVQ(FMT, FP4, T, R, SUF, O)                                                             \
    extern "C" __global__ void __launch_bounds__(GEMVQ_WARPS * 32, 1) gemvq_##FMT##_t##T##_r##R##SUF( \
        const __nv_bfloat16* x, long long x_ld, const uint8_t* w, long long w_ld, const void* s,      \
        long long s_ld, int s_rlog2, int s_clog2, const float* g, O* y, long long y_ld, int nt, int n, \
        int k, int ks_log2) {                                                                        \
        gemvq<FP4, T, R, O>(x, x_ld, w, w_ld, s, s_ld, s_rlog2, s_clog2, g, y, y_ld, nt, n, k, ks_log2); \
        mt::pdl_exit();                                                                              \
    }

#define MT_GEMVQ_T(T)                                  \
    MT_GEMVQ(fp8, false, T, 2, , __nv_bfloat16)        \
    MT_GEMVQ(fp8, false, T, 4, , __nv_bfloat16)        \
    MT_GEMVQ(fp8, false, T, 2, _f32, float)            \
    MT_GEMVQ(fp8, false, T, 4, _f32, float)            \
    MT_GEMVQ(nvfp4, true, T, 2, , __nv_bfloat16)       \
    MT_GEMVQ(nvfp4, true, T, 4, , __nv_bfloat16)       \
    MT_GEMVQ(nvfp4, true, T, 2, _f32, float)           \
    MT_GEMVQ(nvfp4, true, T, 4, _f32, float)

MT_GEMVQ_T(1)
MT_GEMVQ_T(2)
MT_GEMVQ_T(4)
MT_GEMVQ_T(8)

// ---------------------------------------------------------------------------------------------
// Tensor-core decode GEMMs: the same y = x @ dequant(w)^T for up to 64 rows of x, the weights
// dequantised in registers into bf16 mma.sync m16n8k16 fragments (fp32 accumulate): the
// multiply-adds leave the CUDA cores, so 2-64 rows cost about what one does (the GEMVs above
// are FMA-bound past 2 rows). x stays bf16 (the spec's activations, unrounded).
//
// Entry points gemmq_<fp8|nvfp4>_m<MT>_w<NW>[_f32]: MT m-tiles of 16 rows of x (nt <= 16 * MT),
// NW n-tiles of 8 weight rows per warp; arguments as gemvq_* (ks_log2: warps splitting k).
// Layout: 128 threads; 4 >> ks_log2 row groups of 1 << ks_log2 warps; a group owns NW * 8
// consecutive weight rows. Lane l = 4g + c: weight row g of each n-tile (the B fragment's n),
// and the 16-byte vector c of each k-chunk of the row (a chunk: 64 fp8 / 128 nvfp4 elements,
// 4 x 16 bytes; the slice's chunks s, s + ksplit, ...). k is permuted inside a lane's vector
// (the sum does not care): mma step j of a vector takes its elements as B fragment
//   fp8:   b0 = (e[4j], e[4j+1]), b1 = (e[4j+2], e[4j+3])               (4 steps per vector)
//   nvfp4: per 32-bit word of 8 codes e0..e7: b0 = (e0, e4), b1 = (e1, e5); then (e2, e6), (e3, e7)
// and the A fragment (x rows 16i + g and 16i + g + 8) pairs the same elements (nvfp4: two
// byte permutations per pair of x words).
// Decoding: fp8 e4m3 pair -> f16 pair (hardware, exact) -> fp32 -> bf16 pair (exact: 4
// significant bits). nvfp4: each pair of codes (e_i, e_i+4) of a word is moved by two shifts and
// two masks into bf16 bits (sign to bit 15, the 3 magnitude bits to 6..8: the value times
// 2^-126, codes 1 / 9 subnormal), then one bf16 multiply by the group's e4m3 scale times 2^119
// (exact: <= 6 significant bits, range 2^-17 .. 21); the row's sum times g * 2^7 at the end.
// Scales: nvfp4 in the fragments (per lane: its own row, two groups per vector); fp8 per
// chunk on the fp32 partial sums when the scale block spans >= 64 columns and >= 8 rows
// (128 x 128), or per row at the end when it spans all columns (per channel / tensor); other
// fp8 layouts run the GEMVs above.
// Reduction across the k-split warps in shared memory, fixed order (deterministic).
// Bytes and FLOPs: as the GEMVs (the weight once); x (nt <= 64 rows) from L1 / L2.
__device__ __forceinline__ void mma_bf16_16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                               uint32_t a3, uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                 "{%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t f2_bf16x2(float lo, float hi) {
    const __nv_bfloat162 p = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&p);
}

// two e4m3 codes (low 16 bits of u) -> bf16 pair, exact
__device__ __forceinline__ uint32_t e4m3x2_bf16x2(uint32_t u) {
    const float2 f = h2f(e4m3x2_half2(u));
    return f2_bf16x2(f.x, f.y);
}

// codes i and i + 4 of word v -> bf16 bits of (value * 2^-126) pair
template <int I>
__device__ __forceinline__ uint32_t e2m1_pair_bf16_scaled(uint32_t v) {
    constexpr int MS = 6 - 4 * I;          // magnitude bits 4I..4I+2 -> 6..8
    constexpr int SS = 12 - 4 * I;         // sign bit 4I+3 -> 15
    const uint32_t m = MS >= 0 ? (v << (MS >= 0 ? MS : 0)) : (v >> (MS < 0 ? -MS : 0));
    const uint32_t s = v << SS;
    return (m & 0x01C001C0u) | (s & 0x80008000u);
}

__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
    const __nv_bfloat162 r = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&a),
                                     *reinterpret_cast<const __nv_bfloat162*>(&b));
    return *reinterpret_cast<const uint32_t*>(&r);
}

template <bool FP4, int MT, int NW, typename O>
__device__ __forceinline__ void gemmq(const __nv_bfloat16* x, long long x_ld, const uint8_t* w, long long w_ld,
                                      const void* s, long long s_ld, int s_rlog2, int s_clog2, const float* g,
                                      O* y, long long y_ld, int nt, int n, int k, int ks_log2) {
    constexpr int EPV = FP4 ? 32 : 16;           // elements per lane vector (16 bytes)
    constexpr int EPC = 4 * EPV;                 // elements per warp chunk (64 bytes per row)
    constexpr int U = MT * NW >= 8 ? 1 : 2;      // chunks per round (registers: two rounds live)
    __shared__ float red[GEMVQ_WARPS][MT * NW * 4][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int gq = lane >> 2, cq = lane & 3;
    const int slice = warp & ((1 << ks_log2) - 1);
    const int n0 = (blockIdx.x * (GEMVQ_WARPS >> ks_log2) + (warp >> ks_log2)) * NW * 8;
    const int chunks = k / EPC;
    const int ksplit = 1 << ks_log2;
    const bool chunk_scale = !FP4 && s_clog2 < 30;    // fp8 block scales: applied per chunk
    const float up = 6.64613997892457936451903530140172288e35f;   // 2^119

    const uint8_t* wrow[NW];
#pragma unroll
    for (int t = 0; t < NW; ++t)
        wrow[t] = w + static_cast<long long>(min(n0 + 8 * t + gq, n - 1)) * w_ld + 16 * cq;
    const __nv_bfloat16* xrow[MT][2];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h)
            xrow[i][h] = x + static_cast<long long>(min(16 * i + gq + 8 * h, nt - 1)) * x_ld + EPV * cq;

    float acc[MT][NW][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int t = 0; t < NW; ++t)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][t][e] = 0.f;

    // software pipeline: the next round's weight loads are issued before this round's math, so
    // every warp keeps a round in flight while it computes (the loads are volatile: they stay
    // ahead of the mma in program order)
    uint4 wv[U][NW];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
        for (int t = 0; t < NW; ++t) {
            const int ch = slice + u * ksplit;
            wv[u][t] = ldg16_w(wrow[t] + static_cast<long long>(ch < chunks ? ch : 0) * 64, ch < chunks);
        }
    mt::pdl_wait();
    mt::pdl_after_wait();
    for (int c0 = slice; c0 < chunks; c0 += ksplit * U) {
        uint4 nx[U][NW];
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int t = 0; t < NW; ++t) {
                const int ch = c0 + (U + u) * ksplit;
                nx[u][t] = ldg16_w(wrow[t] + static_cast<long long>(ch < chunks ? ch : 0) * 64, ch < chunks);
            }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int ch = c0 + u * ksplit;
            if (ch >= chunks) break;
            const int kel = ch * EPC + EPV * cq;      // this lane's first element of the chunk
            if constexpr (FP4) {
                uint32_t sc[NW][2];                   // the two groups' scale * 2^119, bf16 pairs
#pragma unroll
                for (int t = 0; t < NW; ++t) {
                    const int row = min(n0 + 8 * t + gq, n - 1);
                    const uint16_t b2 = *reinterpret_cast<const uint16_t*>(
                        static_cast<const uint8_t*>(s) + static_cast<long long>(row) * s_ld + kel / 16);
                    const float2 sf = h2f(e4m3x2_half2(b2));
                    sc[t][0] = f2_bf16x2(sf.x * up, sf.x * up);
                    sc[t][1] = f2_bf16x2(sf.y * up, sf.y * up);
                }
#pragma unroll
                for (int q = 0; q < 4; ++q) {        // weight word q: elements 8q .. 8q + 7
                    uint32_t bq[NW][4];
#pragma unroll
                    for (int t = 0; t < NW; ++t) {
                        const uint32_t v = q == 0 ? wv[u][t].x : q == 1 ? wv[u][t].y : q == 2 ? wv[u][t].z : wv[u][t].w;
                        const uint32_t f = sc[t][q >> 1];
                        bq[t][0] = bf16x2_mul(e2m1_pair_bf16_scaled<0>(v), f);    // (e0, e4)
                        bq[t][1] = bf16x2_mul(e2m1_pair_bf16_scaled<1>(v), f);    // (e1, e5)
                        bq[t][2] = bf16x2_mul(e2m1_pair_bf16_scaled<2>(v), f);    // (e2, e6)
                        bq[t][3] = bf16x2_mul(e2m1_pair_bf16_scaled<3>(v), f);    // (e3, e7)
                    }
#pragma unroll
                    for (int i = 0; i < MT; ++i) {
                        uint32_t a[2][4];             // rows g, g + 8: (x0,x4) (x1,x5) (x2,x6) (x3,x7)
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            const uint4 r = ldg16_x(reinterpret_cast<const uint4*>(xrow[i][h] + ch * EPC + 8 * q), true);
                            a[h][0] = __byte_perm(r.x, r.z, 0x5410u);
                            a[h][1] = __byte_perm(r.x, r.z, 0x7632u);
                            a[h][2] = __byte_perm(r.y, r.w, 0x5410u);
                            a[h][3] = __byte_perm(r.y, r.w, 0x7632u);
                        }
#pragma unroll
                        for (int t = 0; t < NW; ++t) {
                            mma_bf16_16816(acc[i][t], a[0][0], a[1][0], a[0][1], a[1][1], bq[t][0], bq[t][1]);
                            mma_bf16_16816(acc[i][t], a[0][2], a[1][2], a[0][3], a[1][3], bq[t][2], bq[t][3]);
                        }
                    }
                }
            } else {
                uint32_t bq[NW][8];
#pragma unroll
                for (int t = 0; t < NW; ++t) {
                    const uint32_t words[4] = {wv[u][t].x, wv[u][t].y, wv[u][t].z, wv[u][t].w};
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        bq[t][2 * j] = e4m3x2_bf16x2(words[j]);
                        bq[t][2 * j + 1] = e4m3x2_bf16x2(words[j] >> 16);
                    }
                }
                float sct[NW];
#pragma unroll
                for (int t = 0; t < NW; ++t) {
                    sct[t] = 1.f;
                    if (chunk_scale)
                        sct[t] = static_cast<const float*>(s)[static_cast<long long>(min(n0 + 8 * t, n - 1) >> s_rlog2) * s_ld +
                                                              ((static_cast<long long>(ch) * EPC) >> s_clog2)];
                }
#pragma unroll
                for (int i = 0; i < MT; ++i) {
                    uint32_t xw[2][8];
#pragma unroll
                    for (int h = 0; h < 2; ++h)
#pragma unroll
                        for (int v = 0; v < 2; ++v) {
                            const uint4 r = ldg16_x(reinterpret_cast<const uint4*>(xrow[i][h] + ch * EPC) + v, true);
                            xw[h][4 * v] = r.x; xw[h][4 * v + 1] = r.y; xw[h][4 * v + 2] = r.z; xw[h][4 * v + 3] = r.w;
                        }
#pragma unroll
                    for (int t = 0; t < NW; ++t) {
                        float part[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                        for (int j = 0; j < 4; ++j)
                            mma_bf16_16816(part, xw[0][2 * j], xw[1][2 * j], xw[0][2 * j + 1], xw[1][2 * j + 1],
                                           bq[t][2 * j], bq[t][2 * j + 1]);
#pragma unroll
                        for (int e = 0; e < 4; ++e) acc[i][t][e] = fmaf(part[e], sct[t], acc[i][t][e]);
                    }
                }
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int t = 0; t < NW; ++t) wv[u][t] = nx[u][t];
    }
    if (ks_log2 > 0) {
        if (slice != 0) {
#pragma unroll
            for (int i = 0; i < MT; ++i)
#pragma unroll
                for (int t = 0; t < NW; ++t)
#pragma unroll
                    for (int e = 0; e < 4; ++e) red[warp][(i * NW + t) * 4 + e][lane] = acc[i][t][e];
        }
        __syncthreads();
        if (slice != 0) return;
        for (int sl = 1; sl < (1 << ks_log2); ++sl)
#pragma unroll
            for (int i = 0; i < MT; ++i)
#pragma unroll
                for (int t = 0; t < NW; ++t)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc[i][t][e] += red[warp + sl][(i * NW + t) * 4 + e][lane];
    }
    // C fragment: e = 0, 1: x row 16i + g, weight rows 2c, 2c + 1 of the tile; e = 2, 3: x row + 8
#pragma unroll
    for (int t = 0; t < NW; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int col = n0 + 8 * t + 2 * cq + (e & 1);
            if (col >= n) continue;
            float f;
            if constexpr (FP4) {
                f = g[col] * 128.f;
            } else {
                f = chunk_scale ? 1.f : static_cast<const float*>(s)[static_cast<long long>(col >> s_rlog2) * s_ld];
            }
#pragma unroll
            for (int i = 0; i < MT; ++i) {
                const int row = 16 * i + gq + 8 * (e >> 1);
                if (row < nt) store_y(y + static_cast<long long>(row) * y_ld + col, acc[i][t][e] * f);
            }
        }
}

#define MT_GEMMQ(FMT, FP4, MT, NW, SUF, O)                                                            \
    extern "C" __global__ void __launch_bounds__(GEMVQ_WARPS * 32, 1) gemmq_##FMT##_m##MT##_w##NW##SUF( \
        const __nv_bfloat16* x, long long x_ld, const uint8_t* w, long long w_ld, const void* s,      \
        long long s_ld, int s_rlog2, int s_clog2, const float* g, O* y, long long y_ld, int nt, int n, \
        int k, int ks_log2) {                                                                        \
        gemmq<FP4, MT, NW, O>(x, x_ld, w, w_ld, s, s_ld, s_rlog2, s_clog2, g, y, y_ld, nt, n, k, ks_log2); \
        mt::pdl_exit();                                                                              \
    }

#define MT_GEMMQ_M(MT, NW)                              \
    MT_GEMMQ(fp8, false, MT, NW, , __nv_bfloat16)       \
    MT_GEMMQ(fp8, false, MT, NW, _f32, float)           \
    MT_GEMMQ(nvfp4, true, MT, NW, , __nv_bfloat16)      \
    MT_GEMMQ(nvfp4, true, MT, NW, _f32, float)

MT_GEMMQ_M(1, 2)
MT_GEMMQ_M(1, 4)
MT_GEMMQ_M(2, 2)
MT_GEMMQ_M(2, 4)
MT_GEMMQ_M(4, 2)
MT_GEMMQ_M(4, 4)

__device__ __forceinline__ uint32_t word_of(const uint4& v, int j) {
    return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w;
}

// gemvq_*_t8_w*: one nvfp4 chunk of a lane (see the layout below): NW tiles x rows g, g + 8 x one
// 16-byte vector (32 codes, two scale groups) each; xw the lane's 32 elements of x (bf16 pairs)
template <int NW>
__device__ __forceinline__ void gemvqt_fp4_chunk(float (&acc)[NW][4], const uint4 (&wv)[NW][2], const uint32_t (&xw)[16],
                                                 const void* s, long long s_ld, const int (&row)[NW][2], int sbyte,
                                                 float up) {
    uint32_t b[4][2][2];         // word j, mma hh: b0 = x (8j + 2hh, 8j + 2hh + 4), b1 = (+1, +5)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            b[j][hh][0] = __byte_perm(xw[4 * j + hh], xw[4 * j + hh + 2], 0x5410u);
            b[j][hh][1] = __byte_perm(xw[4 * j + hh], xw[4 * j + hh + 2], 0x7632u);
        }
#pragma unroll
    for (int t = 0; t < NW; ++t) {
        uint32_t sc[2][2];       // rows g, g + 8; the vector's two groups: scale * 2^119 as bf16 pairs
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const uint16_t b2 = *reinterpret_cast<const uint16_t*>(
                static_cast<const uint8_t*>(s) + static_cast<long long>(row[t][h]) * s_ld + sbyte);
            const float2 sf = h2f(e4m3x2_half2(b2));
            sc[h][0] = f2_bf16x2(sf.x * up, sf.x * up);
            sc[h][1] = f2_bf16x2(sf.y * up, sf.y * up);
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            uint32_t p[2][4];    // rows g, g + 8: pairs (e_i, e_i+4) of word j, scaled
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const uint32_t v = word_of(wv[t][h], j), f = sc[h][j >> 1];
                p[h][0] = bf16x2_mul(e2m1_pair_bf16_scaled<0>(v), f);
                p[h][1] = bf16x2_mul(e2m1_pair_bf16_scaled<1>(v), f);
                p[h][2] = bf16x2_mul(e2m1_pair_bf16_scaled<2>(v), f);
                p[h][3] = bf16x2_mul(e2m1_pair_bf16_scaled<3>(v), f);
            }
            mma_bf16_16816(acc[t], p[0][0], p[1][0], p[0][1], p[1][1], b[j][0][0], b[j][0][1]);
            mma_bf16_16816(acc[t], p[0][2], p[1][2], p[0][3], p[1][3], b[j][1][0], b[j][1][1]);
        }
    }
}

// gemvq_*_t8_w*: one fp8 chunk of a lane: NW tiles x rows g, g + 8 x 16 codes; xw the lane's 16
// elements of x
template <int NW>
__device__ __forceinline__ void gemvqt_fp8_chunk(float (&acc)[NW][4], const uint4 (&wv)[NW][2], const uint32_t (&xw)[8],
                                                 const void* s, long long s_ld, int s_rlog2, int s_clog2,
                                                 const int (&row)[NW][2], int ch, bool chunk_scale) {
#pragma unroll
    for (int t = 0; t < NW; ++t) {
        float part[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            uint32_t lo[2], hi[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const uint32_t v = word_of(wv[t][h], j);
                lo[h] = e4m3x2_bf16x2(v);
                hi[h] = e4m3x2_bf16x2(v >> 16);
            }
            mma_bf16_16816(part, lo[0], lo[1], hi[0], hi[1], xw[2 * j], xw[2 * j + 1]);
        }
        float s0 = 1.f, s1 = 1.f;
        if (chunk_scale) {
            const long long col = (static_cast<long long>(ch) * 64) >> s_clog2;
            s0 = static_cast<const float*>(s)[static_cast<long long>(row[t][0] >> s_rlog2) * s_ld + col];
            s1 = static_cast<const float*>(s)[static_cast<long long>(row[t][1] >> s_rlog2) * s_ld + col];
        }
        acc[t][0] = fmaf(part[0], s0, acc[t][0]);
        acc[t][1] = fmaf(part[1], s0, acc[t][1]);
        acc[t][2] = fmaf(part[2], s1, acc[t][2]);
        acc[t][3] = fmaf(part[3], s1, acc[t][3]);
    }
}

// ---------------------------------------------------------------------------------------------
// Tensor-core decode GEMVs with the weights as the A operand (gemvq_*_t8_w*; "v2" of the decode path:
// metrale/levers.py METRALE_QUANT_GEMV, quant.py picks them for 1-8 rows; gemvq_* above are v1):
// y = x @ dequant(w)^T for nt <= 8 rows of x, one mma.sync m16n8k16 per 16 weight rows x 16 k,
// the 8 rows of x the B operand (n = the row of x; columns past nt repeat row nt - 1, never stored). Why: the CUDA-core
// GEMVs spend per weight element an fp32 FMA per row of x, an f16 -> f32 conversion and the
// decode; on sm_90 the nvfp4 one issued 182 instructions per 16-byte weight vector (cuobjdump
// -sass of gemvq_nvfp4_t1_r4's loop: LOP3 37, PRMT 32, HADD2 34, FFMA 34, IMAD 20, SHF 11),
// above the ~126 warp instructions per 16 bytes an SM can issue at copy bandwidth. Here the
// multiply-adds are 4 HMMA per 16-byte vector (nvfp4; fp8: 2), no conversion to fp32 remains,
// and nt = 1..8 cost the same. (The gemmq_* GEMMs above put x in A: 16 rows of x per mma,
// 15/16 of the tensor work wasted at nt = 1.)
//
// Entry points gemvq_<fp8|nvfp4>_t8_w<NW>[_f32]: NW 16-row tiles per warp (1, 2); arguments as
// gemvq_* (nt 1..8; ks_log2: warps splitting k). k % 128 == 0 (nvfp4) / k % 64 == 0 (fp8);
// fp8 scale blocks of >= 64 columns (s_clog2 >= 6; any rows: each output row reads its own).
// Layout: 128 threads, 4 >> ks_log2 row groups of 1 << ks_log2 warps; a group owns 16 * NW
// consecutive weight rows. Lane l = 4g + c: weight rows g and g + 8 of each tile (A rows), row
// g of x (B column), and the 16-byte vector c of each 64-byte k-chunk of those rows (a chunk:
// 128 nvfp4 / 64 fp8 elements; the slice's chunks s, s + ksplit, ...). U = 4 / NW chunks per
// round; the next round's weight loads are issued before this round's math (software pipeline:
// a warp keeps 64 bytes per lane in flight while it computes). k is permuted inside a lane's
// vector (the sum does not care), identically in A and B:
//   fp8:   word j of the vector (elements 4j..4j+3): a0 / a1 (rows g / g+8) = (e[4j], e[4j+1]),
//          a2 / a3 = (e[4j+2], e[4j+3]); b0, b1 = the same elements of x (two bf16 words as
//          loaded). One mma per word and tile.
//   nvfp4: word j (codes e0..e7 of nibbles 0..7), pair p (0..3) = (e_p, e_p+4): mma (j, h) takes
//          pairs 2h (a0, a1) and 2h + 1 (a2, a3); b0, b1 = x at the same elements (one byte
//          permutation per x word pair). Two mma per word and tile.
// Decoding (exact): fp8 e4m3 pair -> f16 pair (hardware) -> fp32 -> bf16 pair (4 significant
// bits: exact). nvfp4 as the gemmq_ kernels: pair p of a word moved by two shifts and two masks
// into bf16 bits (sign to bit 15 / 31, the magnitude's 3 bits to 6..8 / 22..24: the value times
// 2^-126, code 1 / 9 a bf16 subnormal), then one bf16 multiply by the 16-column group's e4m3
// scale times 2^119 (exact: <= 6 significant bits, range 2^-17 .. 21); the row's sum times
// g * 2^7 at the end.
// Instructions per 16-byte weight vector (cuobjdump -sass of the main loop over its 16 weight
// loads, sm_90, CUDA 13.0), any nt <= 8: nvfp4 w2 108 (LOP3 32, IMAD 27, HMUL2 16, SHF 9, PRMT 4,
// HMMA 4), w1 116 (PRMT 8); fp8 w2 62 (F2FP 16, HADD2 16, IMAD 9, SHF 6, HMMA 2), w1 66. The
// v1 GEMVs: nvfp4 t1_r4 182, t8_r4 505; fp8 t1_r4 65, t8_r4 236. An SM issues ~126 warp
// instructions in the time copy bandwidth brings it 16 bytes per lane of a warp
// (4.27 TB/s / 132 SMs / 1.98 GHz = 16.3 B per clock, 4 issues per clock).
// Registers: 128 (4 CTAs per SM), nvfp4 w2 164 (3); 0 spills.
// Scales: fp8 per chunk on the fp32 partial sums (per row: rows g and g + 8 each read theirs),
// or per row at the end when a block spans all columns; nvfp4 in the fragments.
// Reduction across the k-split warps in shared memory, fixed order (deterministic).
// Numerics: products of exact bf16 weights and bf16 x summed in fp32 by the tensor cores (the
// same as gemmq_*: tests/test_cuda_quant_gemv.py holds both to the spec at the GEMVs'
// tolerances). Bytes: as the GEMVs.
// gemvq_*_t8_w*: the weight vectors of U chunks (c0, c0 + ksplit, ...) of a lane's 2 * NW rows; a chunk
// past the end leaves its registers as they were (never used: gemvqt_round stops there)
__device__ __forceinline__ void ldg16_w_keep(uint4& v, const void* p, bool pred) {
    asm volatile(
        "{\n"
        "  .reg .pred p;\n"
        "  setp.ne.b32 p, %5, 0;\n"
        "  @p ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
        "}\n"
        : "+r"(v.x), "+r"(v.y), "+r"(v.z), "+r"(v.w)
        : "l"(p), "r"(static_cast<int>(pred)));
}

// 16 bytes of an activation, coherent (see common.cuh), unpredicated (no zero fill to issue)
__device__ __forceinline__ uint4 ldg16_x_all(const void* p) {
    uint4 v;
    asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

template <int U, int NW>
__device__ __forceinline__ void gemvqt_load(uint4 (&wv)[U][NW][2], const uint8_t* const (&wrow)[NW][2], int c0,
                                            int ksplit, int chunks) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int ch = c0 + u * ksplit;
#pragma unroll
        for (int t = 0; t < NW; ++t)
#pragma unroll
            for (int h = 0; h < 2; ++h) ldg16_w_keep(wv[u][t][h], wrow[t][h] + static_cast<long long>(ch) * 64, ch < chunks);
    }
}

// gemvq_*_t8_w*: the math of U chunks whose weights are in wv
template <bool FP4, int U, int NW>
__device__ __forceinline__ void gemvqt_round(float (&acc)[NW][4], const uint4 (&wv)[U][NW][2], const __nv_bfloat16* xrow,
                                             const void* s, long long s_ld, int s_rlog2, int s_clog2,
                                             const int (&row)[NW][2], int c0, int ksplit, int chunks, bool chunk_scale) {
    constexpr int EPC = FP4 ? 128 : 64;
    constexpr int EPV = EPC / 4;
    const float up = 6.64613997892457936451903530140172288e35f;   // 2^119
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int ch = c0 + u * ksplit;
        if (ch >= chunks) break;
        uint32_t xw[EPV / 2];            // this lane's EPV elements of the chunk, row g of x
#pragma unroll
        for (int q = 0; q < EPV / 8; ++q) {
            const uint4 r = ldg16_x_all(reinterpret_cast<const uint4*>(xrow + static_cast<long long>(ch) * EPC) + q);
            xw[4 * q] = r.x; xw[4 * q + 1] = r.y; xw[4 * q + 2] = r.z; xw[4 * q + 3] = r.w;
        }
        if constexpr (FP4) {
            gemvqt_fp4_chunk<NW>(acc, wv[u], xw, s, s_ld, row, ch * 8 + 2 * (threadIdx.x & 3), up);
        } else {
            gemvqt_fp8_chunk<NW>(acc, wv[u], xw, s, s_ld, s_rlog2, s_clog2, row, ch, chunk_scale);
        }
    }
}

template <bool FP4, int NW, typename O>
__device__ __forceinline__ void gemvqt(const __nv_bfloat16* x, long long x_ld, const uint8_t* w, long long w_ld,
                                       const void* s, long long s_ld, int s_rlog2, int s_clog2, const float* g,
                                       O* y, long long y_ld, int nt, int n, int k, int ks_log2) {
    constexpr int EPC = FP4 ? 128 : 64;          // elements per row and chunk (64 bytes)
    constexpr int EPV = EPC / 4;                 // elements per lane vector (16 bytes)
    constexpr int U = 4 / NW;                    // chunks per round
    __shared__ float red[GEMVQ_WARPS][NW * 4][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int gq = lane >> 2, cq = lane & 3;
    const int slice = warp & ((1 << ks_log2) - 1);
    const int ksplit = 1 << ks_log2;
    const int n0 = (blockIdx.x * (GEMVQ_WARPS >> ks_log2) + (warp >> ks_log2)) * NW * 16;
    const int chunks = k / EPC;
    const bool chunk_scale = !FP4 && s_clog2 < 30;    // fp8 block scales: applied per chunk

    int row[NW][2];
    const uint8_t* wrow[NW][2];
#pragma unroll
    for (int t = 0; t < NW; ++t)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            row[t][h] = min(n0 + 16 * t + gq + 8 * h, n - 1);
            wrow[t][h] = w + static_cast<long long>(row[t][h]) * w_ld + 16 * cq;
        }
    // B column g: row g of x; columns past nt read row nt - 1 (in bounds; their sums are never stored)
    const __nv_bfloat16* xrow = x + static_cast<long long>(min(gq, nt - 1)) * x_ld + EPV * cq;

    float acc[NW][4];
#pragma unroll
    for (int t = 0; t < NW; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[t][e] = 0.f;

    // two buffers of U chunks: the loads of one are in flight while the other's math runs
    uint4 wa[U][NW][2], wb[U][NW][2];
    gemvqt_load<U, NW>(wa, wrow, slice, ksplit, chunks);
    mt::pdl_wait();
    mt::pdl_after_wait();
    const int round = ksplit * U;
    for (int c0 = slice; c0 < chunks; c0 += 2 * round) {
        gemvqt_load<U, NW>(wb, wrow, c0 + round, ksplit, chunks);
        gemvqt_round<FP4, U, NW>(acc, wa, xrow, s, s_ld, s_rlog2, s_clog2, row, c0, ksplit, chunks, chunk_scale);
        if (c0 + round >= chunks) break;
        gemvqt_load<U, NW>(wa, wrow, c0 + 2 * round, ksplit, chunks);
        gemvqt_round<FP4, U, NW>(acc, wb, xrow, s, s_ld, s_rlog2, s_clog2, row, c0 + round, ksplit, chunks,
                                 chunk_scale);
    }
    if (ks_log2 > 0) {
        if (slice != 0) {
#pragma unroll
            for (int t = 0; t < NW; ++t)
#pragma unroll
                for (int e = 0; e < 4; ++e) red[warp][t * 4 + e][lane] = acc[t][e];
        }
        __syncthreads();
        if (slice != 0) return;
        for (int sl = 1; sl < (1 << ks_log2); ++sl)
#pragma unroll
            for (int t = 0; t < NW; ++t)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[t][e] += red[warp + sl][t * 4 + e][lane];
    }
    // C fragment: e = 0, 1: weight row g of the tile, rows 2c, 2c + 1 of x; e = 2, 3: weight row g + 8
#pragma unroll
    for (int t = 0; t < NW; ++t)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int col = n0 + 16 * t + gq + 8 * h;
            if (col >= n) continue;
            float f;
            if constexpr (FP4) {
                f = g[col] * 128.f;
            } else {
                f = chunk_scale ? 1.f : static_cast<const float*>(s)[static_cast<long long>(col >> s_rlog2) * s_ld];
            }
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int r = 2 * cq + e;
                if (r < nt) store_y(y + static_cast<long long>(r) * y_ld + col, acc[t][2 * h + e] * f);
            }
        }
}

#define MT_GEMVQT(FMT, FP4, NW, SUF, O, MINB)                                                                \
    extern "C" __global__ void __launch_bounds__(GEMVQ_WARPS * 32, MINB) gemvq_##FMT##_t8_w##NW##SUF(         \
        const __nv_bfloat16* x, long long x_ld, const uint8_t* w, long long w_ld, const void* s,      \
        long long s_ld, int s_rlog2, int s_clog2, const float* g, O* y, long long y_ld, int nt, int n, \
        int k, int ks_log2) {                                                                        \
        gemvqt<FP4, NW, O>(x, x_ld, w, w_ld, s, s_ld, s_rlog2, s_clog2, g, y, y_ld, nt, n, k, ks_log2); \
        mt::pdl_exit();                                                                              \
    }

// MINB: CTAs per SM the register budget is set for (4: <= 128 registers; nvfp4 w2 spills there
// and gets 3: <= 168), so 12-16 warps per SM keep their next round's loads in flight
#define MT_GEMVQT_W(NW, MINB_FP4)                              \
    MT_GEMVQT(fp8, false, NW, , __nv_bfloat16, 4)              \
    MT_GEMVQT(fp8, false, NW, _f32, float, 4)                  \
    MT_GEMVQT(nvfp4, true, NW, , __nv_bfloat16, MINB_FP4)      \
    MT_GEMVQT(nvfp4, true, NW, _f32, float, MINB_FP4)

MT_GEMVQT_W(1, 4)
MT_GEMVQT_W(2, 3)

// Dequantization into bf16 (prefill: the cuBLAS bf16 GEMM reads the result): out[n, k] row
// stride k. One thread per 16-byte weight vector (16 fp8 / 32 nvfp4 elements), grid-stride.
// The product code * scale (* global) is computed in fp32 and rounded once to bf16 (exact where
// it fits in 8 significant bits: e2m1 * e4m3 alone always would; an fp32 scale or global makes it
// round); tests/test_cuda_quant_gemv.py checks the kernel bit for bit against that rounding.
// Bytes: the packed weight and scales read once, n*k*2 written. Launched plainly or under PDL:
// waits before its first load.
template <bool FP4>
__device__ __forceinline__ void dequant(const uint8_t* w, long long w_ld, const void* s, long long s_ld,
                                        int s_rlog2, int s_clog2, const float* g, __nv_bfloat16* out,
                                        int n, int k) {
    mt::pdl_wait();
    mt::pdl_after_wait();
    constexpr int EPV = FP4 ? 32 : 16;
    const int kv = k / EPV;
    const long long total = static_cast<long long>(n) * kv;
    for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < total;
         i += static_cast<long long>(gridDim.x) * blockDim.x) {
        const int row = static_cast<int>(i / kv), v = static_cast<int>(i % kv);
        const uint4 q = ldg16_w(w + row * w_ld + 16LL * v, true);
        const uint32_t words[4] = {q.x, q.y, q.z, q.w};
        uint32_t o[EPV / 2];   // bf16 pairs
        if constexpr (FP4) {
            const uint16_t b2 = *reinterpret_cast<const uint16_t*>(static_cast<const uint8_t*>(s) + row * s_ld + 2 * v);
            const float gs = g[row];
            const float sg[2] = {e4m3_f(b2) * gs, e4m3_f(b2 >> 8) * gs};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const uint32_t u = words[j], u4 = u << 4;
                const float2 a = h2f(e2m1_pair(u, u, 0x1404u)), b = h2f(e2m1_pair(u4, u4, 0x1404u));
                const float2 c = h2f(e2m1_pair(u >> 16, u, 0x3424u)), d = h2f(e2m1_pair(u >> 12, u4, 0x3424u));
                const float sj = sg[j >> 1];
                const float e[8] = {b.x, a.x, b.y, a.y, d.x, c.x, d.y, c.y};
#pragma unroll
                for (int m = 0; m < 4; ++m) {
                    const __nv_bfloat162 p = __floats2bfloat162_rn(e[2 * m] * sj, e[2 * m + 1] * sj);
                    o[4 * j + m] = *reinterpret_cast<const uint32_t*>(&p);
                }
            }
        } else {
            const float sc = static_cast<const float*>(s)[static_cast<long long>(row >> s_rlog2) * s_ld +
                                                          ((static_cast<long long>(v) * EPV) >> s_clog2)];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float2 a = h2f(e4m3x2_half2(words[j])), b = h2f(e4m3x2_half2(words[j] >> 16));
                const __nv_bfloat162 p = __floats2bfloat162_rn(a.x * sc, a.y * sc);
                const __nv_bfloat162 q2 = __floats2bfloat162_rn(b.x * sc, b.y * sc);
                o[2 * j] = *reinterpret_cast<const uint32_t*>(&p);
                o[2 * j + 1] = *reinterpret_cast<const uint32_t*>(&q2);
            }
        }
        uint4* dst = reinterpret_cast<uint4*>(out + static_cast<long long>(row) * k + static_cast<long long>(v) * EPV);
#pragma unroll
        for (int m = 0; m < EPV / 8; ++m) dst[m] = make_uint4(o[4 * m], o[4 * m + 1], o[4 * m + 2], o[4 * m + 3]);
    }
}

extern "C" __global__ void __launch_bounds__(256) dequant_fp8_bf16(
    const uint8_t* w, long long w_ld, const void* s, long long s_ld, int s_rlog2, int s_clog2,
    const float* g, __nv_bfloat16* out, int n, int k) {
    dequant<false>(w, w_ld, s, s_ld, s_rlog2, s_clog2, g, out, n, k);
    mt::pdl_exit();
}

extern "C" __global__ void __launch_bounds__(256) dequant_nvfp4_bf16(
    const uint8_t* w, long long w_ld, const void* s, long long s_ld, int s_rlog2, int s_clog2,
    const float* g, __nv_bfloat16* out, int n, int k) {
    dequant<true>(w, w_ld, s, s_ld, s_rlog2, s_clog2, g, out, n, k);
    mt::pdl_exit();
}

// Dynamic activation quantization for the W8A8 FP8 GEMM (prefill rows of block-FP8 weights):
// q[m, k] e4m3 and qs[k / 128, m] fp32 with x[r, c] ~ q[r, c] * qs[c / 128, r]: per row and
// 128 columns, qs = max|x| / 448 (1 where the block is all zeros), q = x / qs rounded to
// nearest, saturating (the DeepSeek-V3 / transformers fine-grained FP8 activation scheme).
// qs [k / 128, m] (the rows of one block adjacent) is the table cuBLASLt's VEC128_32F scale
// mode reads for the activation operand (gemm/fp8_lt.py; measured by perf/fp8_lt_probe.py).
// One warp per (row, block): lane l quantizes elements 4l .. 4l + 3. k % 128 == 0, x rows
// 16-byte aligned (x_ld % 8 == 0). Bytes: m*k*2 read, m*k + m*k/32 written.
extern "C" __global__ void __launch_bounds__(256) quant_act_fp8(const __nv_bfloat16* x, long long x_ld,
                                                                 uint8_t* q, float* qs, int m, int k) {
    mt::pdl_wait();
    mt::pdl_after_wait();
    const int lane = threadIdx.x & 31;
    const int blocks = k / 128;
    const long long item = static_cast<long long>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (item >= static_cast<long long>(m) * blocks) {
        mt::pdl_exit();
        return;
    }
    const int row = static_cast<int>(item / blocks), blk = static_cast<int>(item % blocks);
    const long long col = 128LL * blk + 4 * lane;
    const uint2 raw = *reinterpret_cast<const uint2*>(x + row * x_ld + col);
    const float v[4] = {bf_lo(raw.x), bf_hi(raw.x), bf_lo(raw.y), bf_hi(raw.y)};
    float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
    amax = mt::warp_max(amax);
    const float sc = amax > 0.f ? amax / 448.f : 1.f;
    const __nv_fp8x2_storage_t lo = __nv_cvt_float2_to_fp8x2(make_float2(v[0] / sc, v[1] / sc), __NV_SATFINITE, __NV_E4M3);
    const __nv_fp8x2_storage_t hi = __nv_cvt_float2_to_fp8x2(make_float2(v[2] / sc, v[3] / sc), __NV_SATFINITE, __NV_E4M3);
    *reinterpret_cast<uint32_t*>(q + row * static_cast<long long>(k) + col) =
        static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
    if (lane == 0) qs[static_cast<long long>(blk) * m + row] = sc;
    mt::pdl_exit();
}
