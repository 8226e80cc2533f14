// Paged causal GQA attention (bf16 storage, fp32 online softmax, no materialised score matrix).
//
// Reference: CpuOps.attention (metrale/backends/cpu.py; semantics in metrale/backends/base.py).
//
// Arguments (all int32 index arrays come from ForwardBatch, see metrale/forward.py):
//   q            bf16 [T, Hq, D], token stride qs_t, head stride qs_h (elements; both % 8 == 0,
//                base 16-byte aligned; the last dim contiguous). Views of a fused qkv are fine.
//   k_cache/v_cache  bf16 [num_blocks, block_size, Hk, D] contiguous (slot = block*bs + offset).
//   block_tables int32 [B, M] (row stride bt_stride = M), seq_lens int32 [B],
//   query_start_loc int32 [B+1]. Query row t of sequence b sits at absolute position
//   ctx_b + (t - qsl[b]) with ctx_b = seq_lens[b] - qlen_b, and sees keys 0 .. that position.
//   out          bf16 [T, Hq, D] contiguous.
//   q head h uses kv head h / G, G = Hq / Hk. scale_log2 = softmax scale * log2(e): scores are
//   kept in the log2 domain and exponentiated with exp2f.
//
// Kernels (D = 64, 128, 256 instantiated; tensor cores: mma.sync m16n8k16 bf16 -> fp32,
// ldmatrix fragments, cp.async tile loads):
//   decode_mma_d<D>_h<NH>  one token per sequence (ForwardBatch.is_decode). Flash-decoding on
//                       tensor cores: S^T = K Q^T with the q heads as the n dimension (8 * NH
//                       q heads per CTA), 4 warps each with its own cp.async pipeline over
//                       16-key tiles. Grid (B, Hk * nchunks, nparts); each CTA takes one
//                       partition of `part_tokens` keys. nparts == 1: writes `out` directly.
//                       Otherwise writes unnormalised partial outputs part_o fp32
//                       [B, Hq, nparts, D] and the running max / sum part_m, part_l fp32
//                       [B, Hq, nparts] (log2 domain), merged by decode_reduce. Partitions past
//                       a sequence's end exit at once, so a captured graph can size nparts from
//                       the block-table width. Bytes: 2 * seq_len * Hk * D * 2 (K and V read
//                       once per kv head).
//   decode_reduce       grid (B, Hq), merges the partitions of one (sequence, q head).
//   prefill_mma_d<D>    any batch (prefill chunks, mixed, qlen > 1), FA2-style: 8 warps, 128
//                       rows, Q in registers, double-buffered K/V. Work item = (sequence, first
//                       new-token index q0) from a host-built list int32 [nwork, 2]; grid
//                       (nwork, Hk). 128 rows per CTA = BQ = 128 / G tokens x G heads, keys in
//                       tiles of BN, causal tiles past the last row are never loaded. An item
//                       with q0 >= its sequence's new-token count does nothing (a fixed-size
//                       list is padded with such items: the captured step graphs).
//                       FLOPs: 4 * D * Hq * sum over rows of visible keys (~half a square).
//
// fp8 KV (`--kv-cache-dtype fp8`, the layout of metrale/cache/kv_dtypes.py): the same kernels
// with the suffix `_fp8` (decode_mma_fp8_d<D>_h<NH>, prefill_mma_fp8_d<D>) read k_cache /
// v_cache as byte pools [num_blocks, kv_block_bytes]: block blk holds the e4m3 values of its
// (token t, kv head h) vectors at blk * kv_block_bytes + (t * Hk + h) * D and their fp32 scales
// at blk * kv_block_bytes + kv_scale_off + (t * Hk + h) * 4 (written by kernels_cuda/kv_quant.cu).
// Tiles land in shared memory as bytes (cp.async, half the bf16 traffic plus 4 bytes per vector)
// and are dequantised there into the bf16 tile the mma code reads: bf16(value * scale), the
// rounding a bf16 cache applies to the same vector, so an fp8 kernel equals the bf16 kernel over
// a cache holding bf16(dequantised) bit for bit (tests/test_cuda_kv_fp8.py). Decode: each warp
// dequantises its own tile (no block barrier); prefill: the CTA dequantises each stage between
// two barriers. Bytes: 2 * seq_len * Hk * (D + 4) per decode token.
// Details above each implementation and in kernels_cuda/README.md.
#include "common.cuh"

#include <cuda_fp16.h>
#include <cuda_fp8.h>

typedef __nv_bfloat16 bf16;

namespace {

constexpr int kMaxG = 16;  // q heads per decode CTA

// One 16-byte tile row chunk of the paged cache: token `tok` of sequence `b`, kv head `kvh`.
__device__ __forceinline__ const bf16* kv_row(const bf16* cache, const int* bt_row,
                                              int tok, int block_size, int Hk, int kvh, int D) {
    const long long blk = bt_row[tok / block_size];
    const long long slot = blk * block_size + tok % block_size;
    return cache + (slot * Hk + kvh) * D;
}

// =============================================================================================
// Tensor-core kernels (mma.sync m16n8k16 bf16 -> fp32, ldmatrix fragments, cp.async pipelines).
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16", g = lane / 4, tq = lane % 4):
//   A 16x16 row-major: a0 (g, 2tq..+1)  a1 (g+8, 2tq..)  a2 (g, 2tq+8..)  a3 (g+8, 2tq+8..)
//   B 16x8 (k x n):    b0 (k 2tq..+1, n g)  b1 (k 2tq+8..+9, n g)
//   C 16x8 fp32:       c0,c1 (g, 2tq..+1)   c2,c3 (g+8, 2tq..+1)
// ldmatrix.x4: lanes 8i..8i+7 give the row addresses of matrix i; register i of lane l holds
// row l/4, elements 2(l%4)..+1 of matrix i (.trans: the transposed matrix).
__device__ __forceinline__ unsigned smem_u32(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], const bf16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldsm_x4_t(unsigned (&r)[4], const bf16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)));
}
// c += a * b (16x8x16, bf16 in, fp32 accumulate)
__device__ __forceinline__ void mma16816(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                 "{%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// 8x8 b16 transpose across the warp (fragment layout in = out: lane l holds row l/4, cols 2(l%4)..+1)
__device__ __forceinline__ unsigned movmatrix_t(unsigned x) {
    unsigned y;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
    return y;
}
__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (low 16 bits) = lo
    return *reinterpret_cast<unsigned*>(&v);
}
// 4-byte cp.async (the fp8 KV scales), zero-filled when !valid
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, bool valid) {
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    const int n = valid ? 4 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(gmem), "r"(n));
}

// fp8 KV: byte offsets of token `tok`'s vector (kv head kvh) in its block: values, then scale
struct Kv8Vec {
    long long values, scale;
};
__device__ __forceinline__ Kv8Vec kv8_vec(const int* bt_row, int tok, int block_size, int Hk,
                                          int kvh, int D, long long block_bytes, int scale_off) {
    const long long blk = (long long)bt_row[tok / block_size] * block_bytes;
    const long long vec = (long long)(tok % block_size) * Hk + kvh;
    return {blk + vec * D, blk + scale_off + vec * 4};
}

// 16 e4m3 values (one 16-byte chunk) times `scale` -> 16 bf16 at dst (16-byte aligned):
// e4m3 -> f16 is exact (cvt.rn.f16x2.e4m3x2), the product is fp32, one rounding to bf16
__device__ __forceinline__ void dequant16_fp8(bf16* dst, const unsigned char* src, float scale) {
    const uint4 w = *reinterpret_cast<const uint4*>(src);
    const unsigned ws[4] = {w.x, w.y, w.z, w.w};
    unsigned o[8];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const __half2_raw hr = __nv_cvt_fp8x2_to_halfraw2(
                static_cast<__nv_fp8x2_storage_t>(ws[i] >> (16 * j)), __NV_E4M3);
            const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&hr));
            o[2 * i + j] = pack_bf16(f.x * scale, f.y * scale);
        }
    reinterpret_cast<uint4*>(dst)[0] = make_uint4(o[0], o[1], o[2], o[3]);
    reinterpret_cast<uint4*>(dst)[1] = make_uint4(o[4], o[5], o[6], o[7]);
}

template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// ---------------------------------------------------------------------------------------------
// prefill_mma_d<D>: FA2-style. CTA = NW warps, BM = 16 * NW rows (row r = token r / G, q head
// r % G of kv head blockIdx.y), each warp owns 16 rows. Q fragments in registers (QREG) or
// re-read from shared memory per k-step (!QREG, for D = 256 when registers run out). K/V tiles of
// BN keys, double-buffered with cp.async in rows padded by 16 bytes (ldmatrix conflict-free);
// S = Q K^T and O += P V on mma.sync; online softmax in fp32 (log2 domain), P rounded to bf16 as
// the A operand of P V straight from the S accumulators. Causal mask only on tiles that cross
// the diagonal of the CTA's first token.
template <int D, int BN, int NW, bool QREG, bool FP8>
__device__ void prefill_mma_impl(const bf16* q, long long qs_t, long long qs_h,
                                 const void* k_pool, const void* v_pool, long long kv_bb, int kv_so,
                                 const int* block_tables, int bt_stride,
                                 const int* seq_lens, const int* qsl,
                                 const int* work, bf16* out, int Hk, int G,
                                 int BQ, int block_size, float scale_log2) {
    constexpr int NT = NW * 32, BM = NW * 16, LDS = D + 8, CH = D / 8;
    constexpr int KS = D / 16;   // k-steps of Q K^T
    constexpr int NB = BN / 8;   // S n-tiles
    constexpr int ND = D / 8;    // O n-tiles
    static_assert(BN % 16 == 0 && D % 16 == 0, "tile shapes");
    constexpr int CH16 = D / 16;                       // fp8: 16-byte chunks per vector
    constexpr int SSTAGE = 2 * BN * D + 2 * BN * 4;    // fp8 stage bytes: K, V values; K, V scales
    const bf16* k_cache = static_cast<const bf16*>(k_pool);
    const bf16* v_cache = static_cast<const bf16*>(v_pool);
    const unsigned char* k8 = static_cast<const unsigned char*>(k_pool);
    const unsigned char* v8 = static_cast<const unsigned char*>(v_pool);

    extern __shared__ __align__(16) unsigned char smem[];
    bf16* Qs = reinterpret_cast<bf16*>(smem);  // [BM][LDS]
    bf16* KV = Qs + BM * LDS;                   // stage s: K [BN][LDS] at KV + s*2*BN*LDS, V after
    // fp8: KV is one bf16 tile (K then V), the byte stages follow it
    unsigned char* stage8 = reinterpret_cast<unsigned char*>(KV + 2 * BN * LDS);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, tq = lane & 3;
    const int b = work[2 * blockIdx.x];
    const int q0 = work[2 * blockIdx.x + 1];
    const int kvh = blockIdx.y;
    const int Hq = Hk * G;
    const int seq_len = seq_lens[b];
    const int qstart = qsl[b];
    const int qlen = qsl[b + 1] - qstart;
    const int ctx = seq_len - qlen;
    const int nq = min(BQ, qlen - q0);
    if (nq <= 0) return;  // a padding entry of a fixed-size work list (captured step graphs)
    const int nrows = nq * G;
    const int kv_end = ctx + q0 + nq;     // keys [0, kv_end) are visible to some row
    const int diag = ctx + q0;            // keys <= diag are visible to every row
    const int ntiles = (kv_end + BN - 1) / BN;
    const int* bt_row = block_tables + (long long)b * bt_stride;

    for (int c = tid; c < BM * CH; c += NT) {
        const int row = c / CH, ch = c % CH;
        const bool valid = row < nrows;
        const bf16* src = q;
        if (valid)
            src = q + (long long)(qstart + q0 + row / G) * qs_t + (long long)(kvh * G + row % G) * qs_h + ch * 8;
        mt::cp_async16(Qs + row * LDS + ch * 8, src, valid);
    }
    mt::cp_async_commit();

    auto issue = [&](int tile) {
        bf16* Ks = KV + (tile & 1) * 2 * BN * LDS;
        bf16* Vs = Ks + BN * LDS;
        const int j0 = tile * BN;
        if constexpr (FP8) {
            unsigned char* st = stage8 + (tile & 1) * SSTAGE;
#pragma unroll
            for (int i = 0; i < (BN * CH16 + NT - 1) / NT; ++i) {
                const int c = tid + NT * i;
                if ((BN * CH16) % NT == 0 || c < BN * CH16) {
                    const int row = c / CH16, ch = c % CH16;
                    const bool valid = j0 + row < kv_end;
                    Kv8Vec a{0, 0};
                    if (valid) a = kv8_vec(bt_row, j0 + row, block_size, Hk, kvh, D, kv_bb, kv_so);
                    mt::cp_async16(st + row * D + ch * 16, k8 + a.values + ch * 16, valid);
                    mt::cp_async16(st + (BN + row) * D + ch * 16, v8 + a.values + ch * 16, valid);
                    if (ch == 0) {  // the row's scales: K's, then V's after BN of them
                        cp_async4(st + 2 * BN * D + row * 4, k8 + a.scale, valid);
                        cp_async4(st + 2 * BN * D + (BN + row) * 4, v8 + a.scale, valid);
                    }
                }
            }
            mt::cp_async_commit();
            return;
        }
#pragma unroll
        for (int i = 0; i < (BN * CH + NT - 1) / NT; ++i) {
            const int c = tid + NT * i;
            if ((BN * CH) % NT == 0 || c < BN * CH) {
                const int row = c / CH, ch = c % CH;
                const int tok = j0 + row;
                const bool valid = tok < kv_end;
                const bf16* ksrc = k_cache;
                const bf16* vsrc = v_cache;
                if (valid) {
                    ksrc = kv_row(k_cache, bt_row, tok, block_size, Hk, kvh, D) + ch * 8;
                    vsrc = kv_row(v_cache, bt_row, tok, block_size, Hk, kvh, D) + ch * 8;
                }
                mt::cp_async16(Ks + row * LDS + ch * 8, ksrc, valid);
                mt::cp_async16(Vs + row * LDS + ch * 8, vsrc, valid);
            }
        }
        mt::cp_async_commit();
    };
    issue(0);

    const int r0 = warp * 16;
    const int rowA = r0 + g, rowB = rowA + 8;
    const int qposA = rowA < nrows ? diag + rowA / G : -1;  // -1: padding row, sees nothing
    const int qposB = rowB < nrows ? diag + rowB / G : -1;

    unsigned qf[QREG ? KS : 1][4];
    const bf16* qa_base = Qs + (r0 + (lane & 15)) * LDS + (lane >> 4) * 8;
    if constexpr (QREG) {
        cp_async_wait<1>();  // Q landed (tile 0 may still be in flight)
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) ldsm_x4(qf[kk], qa_base + kk * 16);
    }

    float o[ND][4];
#pragma unroll
    for (int n = 0; n < ND; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m0 = -MT_INF, m1 = -MT_INF, l0 = 0.f, l1 = 0.f;

    // ldmatrix lane offsets: K (non-trans, B of S) and V (trans, B of P V)
    const int k_lrow = (lane & 7) + ((lane >> 4) << 3), k_lcol = ((lane >> 3) & 1) << 3;
    const int v_lrow = (lane & 7) + (((lane >> 3) & 1) << 3), v_lcol = (lane >> 4) << 3;

    for (int it = 0; it < ntiles; ++it) {
        if (it + 1 < ntiles) {
            issue(it + 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        if constexpr (FP8) {  // this stage's bytes -> the bf16 tile, K then V
            const unsigned char* st = stage8 + (it & 1) * SSTAGE;
            const float* sc = reinterpret_cast<const float*>(st + 2 * BN * D);
            for (int c = tid; c < 2 * BN * CH16; c += NT) {
                const int row = c / CH16, ch = c % CH16;  // rows BN.. are V's
                dequant16_fp8(KV + row * LDS + ch * 16, st + row * D + ch * 16, sc[row]);
            }
            __syncthreads();
        }
        const bf16* Ks = FP8 ? KV : KV + (it & 1) * 2 * BN * LDS;
        const bf16* Vs = Ks + BN * LDS;

        float s[NB][4];
#pragma unroll
        for (int n = 0; n < NB; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) {
            unsigned qa[4];
            if constexpr (QREG) {
                qa[0] = qf[kk][0]; qa[1] = qf[kk][1]; qa[2] = qf[kk][2]; qa[3] = qf[kk][3];
            } else {
                ldsm_x4(qa, qa_base + kk * 16);
            }
#pragma unroll
            for (int n2 = 0; n2 < NB / 2; ++n2) {
                unsigned kb[4];
                ldsm_x4(kb, Ks + (n2 * 16 + k_lrow) * LDS + kk * 16 + k_lcol);
                mma16816(s[2 * n2], qa, kb[0], kb[1]);
                mma16816(s[2 * n2 + 1], qa, kb[2], kb[3]);
            }
        }

        const int j0 = it * BN;
        const bool need_mask = j0 + BN - 1 > diag;
#pragma unroll
        for (int n = 0; n < NB; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float v = s[n][e] * scale_log2;
                if (need_mask) {
                    const int key = j0 + n * 8 + 2 * tq + (e & 1);
                    if (key > (e < 2 ? qposA : qposB)) v = -MT_INF;
                }
                s[n][e] = v;
            }

        float mx0 = -MT_INF, mx1 = -MT_INF;
#pragma unroll
        for (int n = 0; n < NB; ++n) {
            mx0 = fmaxf(mx0, fmaxf(s[n][0], s[n][1]));
            mx1 = fmaxf(mx1, fmaxf(s[n][2], s[n][3]));
        }
#pragma unroll
        for (int o_ = 1; o_ <= 2; o_ <<= 1) {
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o_));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o_));
        }
        const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
        const float mu0 = mn0 == -MT_INF ? 0.f : mn0, mu1 = mn1 == -MT_INF ? 0.f : mn1;
        const float al0 = exp2f(m0 - mu0), al1 = exp2f(m1 - mu1);
        m0 = mn0;
        m1 = mn1;
        float sum0 = 0.f, sum1 = 0.f;
#pragma unroll
        for (int n = 0; n < NB; ++n) {
            s[n][0] = exp2f(s[n][0] - mu0);
            s[n][1] = exp2f(s[n][1] - mu0);
            s[n][2] = exp2f(s[n][2] - mu1);
            s[n][3] = exp2f(s[n][3] - mu1);
            sum0 += s[n][0] + s[n][1];
            sum1 += s[n][2] + s[n][3];
        }
        l0 = l0 * al0 + sum0;  // per-thread partial (this lane's columns); reduced at the end
        l1 = l1 * al1 + sum1;
#pragma unroll
        for (int n = 0; n < ND; ++n) {
            o[n][0] *= al0; o[n][1] *= al0;
            o[n][2] *= al1; o[n][3] *= al1;
        }

#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            unsigned pa[4];
            pa[0] = pack_bf16(s[2 * kk][0], s[2 * kk][1]);
            pa[1] = pack_bf16(s[2 * kk][2], s[2 * kk][3]);
            pa[2] = pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            pa[3] = pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
            for (int n2 = 0; n2 < ND / 2; ++n2) {
                unsigned vb[4];
                ldsm_x4_t(vb, Vs + (kk * 16 + v_lrow) * LDS + n2 * 16 + v_lcol);
                mma16816(o[2 * n2], pa, vb[0], vb[1]);
                mma16816(o[2 * n2 + 1], pa, vb[2], vb[3]);
            }
        }
        __syncthreads();  // the next iteration refills this stage
    }

#pragma unroll
    for (int o_ = 1; o_ <= 2; o_ <<= 1) {
        l0 += __shfl_xor_sync(0xffffffffu, l0, o_);
        l1 += __shfl_xor_sync(0xffffffffu, l1, o_);
    }
    // key 0 is visible to every real row: l > 0
    if (rowA < nrows) {
        const float inv = 1.f / l0;
        bf16* op = out + ((long long)(qstart + q0 + rowA / G) * Hq + kvh * G + rowA % G) * D + 2 * tq;
#pragma unroll
        for (int n = 0; n < ND; ++n)
            *reinterpret_cast<unsigned*>(op + n * 8) = pack_bf16(o[n][0] * inv, o[n][1] * inv);
    }
    if (rowB < nrows) {
        const float inv = 1.f / l1;
        bf16* op = out + ((long long)(qstart + q0 + rowB / G) * Hq + kvh * G + rowB % G) * D + 2 * tq;
#pragma unroll
        for (int n = 0; n < ND; ++n)
            *reinterpret_cast<unsigned*>(op + n * 8) = pack_bf16(o[n][2] * inv, o[n][3] * inv);
    }
}

// ---------------------------------------------------------------------------------------------
// decode_mma_d<D>_h<8*NH>: flash-decoding on tensor cores, transposed so the few q heads are the
// mma's n dimension (8 per n-tile, NH n-tiles): S^T = K Q^T (K tile = A via ldmatrix, Q^T = B
// fragments loaded once into registers), O^T += V^T P^T (V tile = A via ldmatrix.trans, P^T = B
// from the S^T accumulators through movmatrix). Grid (B, Hk * nchunks, nparts), 4 warps; the
// partition's 16-key tiles are dealt round-robin to the warps, and every warp runs its own
// STAGES-deep cp.async pipeline in its own shared memory (no block barrier in the loop), so up
// to 4 * (STAGES - 1) tiles of K and V are in flight per CTA. The warps' partial (m, l, O) are
// merged through shared memory at the end. Per-thread softmax sums are kept partial (this lane's
// keys) and reduced once.
template <int D, int NH, int STAGES, bool FP8>
__device__ void decode_mma_impl(const bf16* q, long long qs_t, long long qs_h,
                                const void* k_pool, const void* v_pool, long long kv_bb, int kv_so,
                                const int* block_tables, int bt_stride,
                                const int* seq_lens, const int* qsl,
                                bf16* out, float* part_o,
                                float* part_m, float* part_l, int Hk, int G,
                                int nchunks, int block_size, int part_tokens, int nparts, float scale_log2) {
    constexpr int NW = 4, NT = NW * 32, TK = 16, LDS = D + 8, CH = D / 8, KS = D / 16;
    constexpr int HPC = 8 * NH;                    // q heads per CTA
    constexpr int STAGE = 2 * TK * LDS;            // K then V, elements
    constexpr int NACC = KS < 4 ? KS : (NH == 1 ? 4 : 2);  // independent accumulator chains for S^T
    constexpr int CPL = TK * CH / 32;              // 16-byte chunks per lane per tile (K or V)
    static_assert((TK * CH) % 32 == 0, "tile chunks");
    constexpr int CH16 = D / 16, CPL8 = TK * CH16 / 32;   // fp8: 16-byte chunks per vector, per lane
    constexpr int SSTAGE = 2 * TK * D + 2 * TK * 4;       // fp8 stage bytes: K, V values; K, V scales
    const bf16* k_cache = static_cast<const bf16*>(k_pool);
    const bf16* v_cache = static_cast<const bf16*>(v_pool);
    const unsigned char* k8 = static_cast<const unsigned char*>(k_pool);
    const unsigned char* v8 = static_cast<const unsigned char*>(v_pool);

    extern __shared__ __align__(16) unsigned char smem[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, tq = lane & 3;
    bf16* wbuf = reinterpret_cast<bf16*>(smem) + warp * STAGES * STAGE;
    // fp8: per warp STAGES byte stages, then its bf16 tile (K [TK][LDS], V after)
    unsigned char* sbuf = smem + warp * (STAGES * SSTAGE + 2 * TK * LDS * 2);
    bf16* tile8 = reinterpret_cast<bf16*>(sbuf + STAGES * SSTAGE);

    const int b = blockIdx.x;
    const int kvh = blockIdx.y / nchunks;
    const int g0 = (blockIdx.y % nchunks) * HPC;
    const int gn = min(HPC, G - g0);
    const int p = blockIdx.z;
    const int Hq = Hk * G;
    const int seq_len = seq_lens[b];
    const int kv_begin = p * part_tokens;
    const int kv_end = min(seq_len, kv_begin + part_tokens);
    const long long t = qsl[b];
    const int head0 = kvh * G + g0;

    if (kv_begin >= kv_end) {  // past this sequence's end (or an empty padding sequence)
        if (nparts == 1)
            for (int i = tid; i < gn * D; i += NT)
                out[(t * Hq + head0 + i / D) * D + i % D] = __float2bfloat16_rn(0.f);
        return;
    }
    const int* bt_row = block_tables + (long long)b * bt_stride;
    const int ntiles = (kv_end - kv_begin + TK - 1) / TK;
    const int nmine = ntiles > warp ? (ntiles - warp + NW - 1) / NW : 0;

    // issue tile k of this warp (tile index warp + NW * k) into its stage; always commits a group
    auto issue = [&](int k) {
        if (FP8 && k < nmine) {
            const int j0 = kv_begin + (warp + NW * k) * TK;
            unsigned char* st = sbuf + (k % STAGES) * SSTAGE;
            long long my_val = 0, my_sc = 0;
            if (lane < TK && j0 + lane < kv_end) {
                const Kv8Vec a = kv8_vec(bt_row, j0 + lane, block_size, Hk, kvh, D, kv_bb, kv_so);
                my_val = a.values;
                my_sc = a.scale;
            }
            {   // scales: lanes 0-15 K's rows, 16-31 V's
                const int row = lane & 15;
                const long long off = __shfl_sync(0xffffffffu, my_sc, row);
                const bool valid = j0 + row < kv_end;
                cp_async4(st + 2 * TK * D + lane * 4, (lane < TK ? k8 : v8) + off, valid);
            }
#pragma unroll
            for (int i = 0; i < CPL8; ++i) {
                const int c = lane + 32 * i;
                const int row = c / CH16, ch = c % CH16;
                const long long off = __shfl_sync(0xffffffffu, my_val, row) + ch * 16;
                const bool valid = j0 + row < kv_end;
                mt::cp_async16(st + row * D + ch * 16, valid ? k8 + off : k8, valid);
                mt::cp_async16(st + (TK + row) * D + ch * 16, valid ? v8 + off : v8, valid);
            }
        } else if (!FP8 && k < nmine) {
            const int j0 = kv_begin + (warp + NW * k) * TK;
            bf16* Ks = wbuf + (k % STAGES) * STAGE;
            bf16* Vs = Ks + TK * LDS;
            int my_slot = 0;
            if (lane < TK && j0 + lane < kv_end) {
                const int tok = j0 + lane;
                my_slot = bt_row[tok / block_size] * block_size + tok % block_size;
            }
#pragma unroll
            for (int i = 0; i < CPL; ++i) {
                const int c = lane + 32 * i;
                const int row = c / CH, ch = c % CH;
                const int slot = __shfl_sync(0xffffffffu, my_slot, row);
                const bool valid = j0 + row < kv_end;
                const long long off = ((long long)slot * Hk + kvh) * D + ch * 8;
                mt::cp_async16(Ks + row * LDS + ch * 8, valid ? k_cache + off : k_cache, valid);
                mt::cp_async16(Vs + row * LDS + ch * 8, valid ? v_cache + off : v_cache, valid);
            }
        }
        mt::cp_async_commit();
    };
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) issue(s);

    // Q^T as B fragments: b0 = q[head g][16kk + 2tq ..+1], b1 = q[head g][16kk + 8 + 2tq ..+1]
    unsigned qb[NH][KS][2];
#pragma unroll
    for (int h = 0; h < NH; ++h) {
        const int hh = h * 8 + g;
        const bool ok = hh < gn;
        const bf16* qp = q + t * qs_t + (long long)(head0 + (ok ? hh : 0)) * qs_h + 2 * tq;
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) {
            qb[h][kk][0] = ok ? *reinterpret_cast<const unsigned*>(qp + kk * 16) : 0u;
            qb[h][kk][1] = ok ? *reinterpret_cast<const unsigned*>(qp + kk * 16 + 8) : 0u;
        }
    }

    // O^T accumulators: m-tile mt covers d 16mt..16mt+15; c0,c1 (d 16mt+g, heads 2tq, 2tq+1),
    // c2,c3 (d 16mt+g+8, same heads). Softmax state for heads 8h + 2tq + c, c = 0, 1.
    float o[NH][KS][4];
    float m[NH][2], l[NH][2];
#pragma unroll
    for (int h = 0; h < NH; ++h) {
        m[h][0] = m[h][1] = -MT_INF;
        l[h][0] = l[h][1] = 0.f;
#pragma unroll
        for (int i = 0; i < KS; ++i) o[h][i][0] = o[h][i][1] = o[h][i][2] = o[h][i][3] = 0.f;
    }
    const int a_lrow = lane & 15, a_lcol = (lane >> 4) << 3;                       // K: A, non-trans
    const int v_lrow = (lane & 7) + ((lane >> 4) << 3), v_lcol = ((lane >> 3) & 1) << 3;  // V^T: A, trans

    for (int k = 0; k < nmine; ++k) {
        cp_async_wait<STAGES - 2>();
        __syncwarp();
        issue(k + STAGES - 1);  // into the stage this warp finished reading last iteration
        if constexpr (FP8) {      // this stage's bytes -> the warp's bf16 tile, K then V
            const unsigned char* st = sbuf + (k % STAGES) * SSTAGE;
            const float* sc = reinterpret_cast<const float*>(st + 2 * TK * D);
#pragma unroll
            for (int i = 0; i < 2 * CPL8; ++i) {
                const int c = lane + 32 * i;
                const int row = c / CH16, ch = c % CH16;  // rows TK.. are V's
                dequant16_fp8(tile8 + row * LDS + ch * 16, st + row * D + ch * 16, sc[row]);
            }
            __syncwarp();
        }
        const bf16* Ks = FP8 ? tile8 : wbuf + (k % STAGES) * STAGE;
        const bf16* Vs = Ks + TK * LDS;
        const int j0 = kv_begin + (warp + NW * k) * TK;

        float sa[NACC][NH][4];
#pragma unroll
        for (int a = 0; a < NACC; ++a)
#pragma unroll
            for (int h = 0; h < NH; ++h) sa[a][h][0] = sa[a][h][1] = sa[a][h][2] = sa[a][h][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < KS; ++kk) {
            unsigned ka[4];
            ldsm_x4(ka, Ks + a_lrow * LDS + kk * 16 + a_lcol);
#pragma unroll
            for (int h = 0; h < NH; ++h) mma16816(sa[kk % NACC][h], ka, qb[h][kk][0], qb[h][kk][1]);
        }
        // s[h][e]: e = 0, 1 key j0 + g; e = 2, 3 key j0 + g + 8; head 8h + 2tq + (e & 1)
        const bool vA = j0 + g < kv_end, vB = j0 + g + 8 < kv_end;
        unsigned pb[NH][2];
#pragma unroll
        for (int h = 0; h < NH; ++h) {
            float s[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float acc = sa[0][h][e];
#pragma unroll
                for (int a = 1; a < NACC; ++a) acc += sa[a][h][e];
                s[e] = (e < 2 ? vA : vB) ? acc * scale_log2 : -MT_INF;
            }
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                float mx = fmaxf(s[c], s[c + 2]);
#pragma unroll
                for (int o_ = 4; o_ <= 16; o_ <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o_));
                const float mn = fmaxf(m[h][c], mx);  // finite: key j0 is valid
                const float al = exp2f(m[h][c] - mn);
                m[h][c] = mn;
                s[c] = exp2f(s[c] - mn);
                s[c + 2] = exp2f(s[c + 2] - mn);
                l[h][c] = l[h][c] * al + s[c] + s[c + 2];
#pragma unroll
                for (int i = 0; i < KS; ++i) {
                    o[h][i][c] *= al;
                    o[h][i][c + 2] *= al;
                }
            }
            pb[h][0] = movmatrix_t(pack_bf16(s[0], s[1]));  // P^T keys 0-7: (key 2tq..+1, head g)
            pb[h][1] = movmatrix_t(pack_bf16(s[2], s[3]));  // keys 8-15
        }
#pragma unroll
        for (int i = 0; i < KS; ++i) {
            unsigned va[4];
            ldsm_x4_t(va, Vs + v_lrow * LDS + i * 16 + v_lcol);
#pragma unroll
            for (int h = 0; h < NH; ++h) mma16816(o[h][i], va, pb[h][0], pb[h][1]);
        }
    }
    cp_async_wait<0>();

    // merge the warps: partial sums over this lane's keys -> per head, then through shared memory
#pragma unroll
    for (int h = 0; h < NH; ++h)
#pragma unroll
        for (int c = 0; c < 2; ++c)
#pragma unroll
            for (int o_ = 4; o_ <= 16; o_ <<= 1) l[h][c] += __shfl_xor_sync(0xffffffffu, l[h][c], o_);
    __syncthreads();  // every warp is done with its stages: reuse them as scratch
    float* red_o = reinterpret_cast<float*>(smem);  // [NW][HPC][D]
    float* red_m = red_o + NW * HPC * D;             // [NW][HPC]
    float* red_l = red_m + NW * HPC;
#pragma unroll
    for (int h = 0; h < NH; ++h) {
#pragma unroll
        for (int i = 0; i < KS; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int head = h * 8 + 2 * tq + (e & 1);
                const int d = i * 16 + g + (e >> 1) * 8;
                red_o[(warp * HPC + head) * D + d] = o[h][i][e];
            }
        if (g == 0) {
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                red_m[warp * HPC + h * 8 + 2 * tq + c] = m[h][c];
                red_l[warp * HPC + h * 8 + 2 * tq + c] = l[h][c];
            }
        }
    }
    __syncthreads();
    for (int i = tid; i < gn * D; i += NT) {
        const int head = i / D, d = i % D;
        float M = -MT_INF;
#pragma unroll
        for (int w = 0; w < NW; ++w) M = fmaxf(M, red_m[w * HPC + head]);  // finite: warp 0 ran
        float L = 0.f, O = 0.f;
#pragma unroll
        for (int w = 0; w < NW; ++w) {
            const float sc = exp2f(red_m[w * HPC + head] - M);  // 0 for a warp with no tile
            L += red_l[w * HPC + head] * sc;
            O += red_o[(w * HPC + head) * D + d] * sc;
        }
        if (nparts == 1) {
            out[(t * Hq + head0 + head) * D + d] = __float2bfloat16_rn(O / L);
        } else {
            const long long pi = ((long long)b * Hq + head0 + head) * nparts + p;
            part_o[pi * D + d] = O;
            if (d == 0) {
                part_m[pi] = M;
                part_l[pi] = L;
            }
        }
    }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
extern "C" __global__ void decode_reduce(const float* part_o, const float* part_m,
                                         const float* part_l, const int* seq_lens,
                                         const int* qsl, bf16* out, int Hq, int D,
                                         int part_tokens, int nparts) { mt::pdl_enter();
    const int b = blockIdx.x, h = blockIdx.y;
    const int seq_len = seq_lens[b];
    const int np = min(nparts, (seq_len + part_tokens - 1) / part_tokens);
    const long long t = qsl[b];
    const long long base = ((long long)b * Hq + h) * nparts;
    float M = -MT_INF;
    for (int p = 0; p < np; ++p) M = fmaxf(M, part_m[base + p]);
    float L = 0.f;
    for (int p = 0; p < np; ++p) L += part_l[base + p] * exp2f(part_m[base + p] - M);
    const float inv = np > 0 ? 1.f / L : 0.f;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float o = 0.f;
        for (int p = 0; p < np; ++p) o += part_o[(base + p) * D + d] * exp2f(part_m[base + p] - M);
        out[(t * Hq + h) * D + d] = __float2bfloat16_rn(o * inv);
    }
    mt::pdl_exit();
}

// Entry points (bf16 KV, then fp8 KV). Tiling must match metrale/backends/cuda/attention.py
// (ATTN_MMA_PREFILL, ATTN_MMA_DECODE_STAGES): prefill 8 warps / 128 rows, BN keys per tile;
// decode 4 warps, 16-key tiles, STAGES-deep per-warp pipelines, 8 * NH q heads per CTA.
#define MT_PREFILL_MMA(D, BN, QREG)                                                                   \
    extern "C" __global__ void __launch_bounds__(256, 1) prefill_mma_d##D(                           \
        const bf16* q, long long qs_t, long long qs_h, const bf16* k_cache, const bf16* v_cache,    \
        const int* block_tables, int bt_stride, const int* seq_lens, const int* qsl,                 \
        const int* work, bf16* out, int Hk, int G, int BQ, int block_size, float scale_log2) { mt::pdl_enter(); \
        prefill_mma_impl<D, BN, 8, QREG, false>(q, qs_t, qs_h, k_cache, v_cache, 0, 0, block_tables, \
                                                bt_stride, seq_lens, qsl, work, out, Hk, G, BQ,      \
                                                block_size, scale_log2);                             \
        mt::pdl_exit();                                                                                \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(256, 1) prefill_mma_fp8_d##D(                       \
        const bf16* q, long long qs_t, long long qs_h, const unsigned char* k_cache,                 \
        const unsigned char* v_cache, long long kv_block_bytes, int kv_scale_off,                    \
        const int* block_tables, int bt_stride, const int* seq_lens, const int* qsl,                 \
        const int* work, bf16* out, int Hk, int G, int BQ, int block_size, float scale_log2) { mt::pdl_enter(); \
        prefill_mma_impl<D, BN, 8, QREG, true>(q, qs_t, qs_h, k_cache, v_cache, kv_block_bytes,     \
                                               kv_scale_off, block_tables, bt_stride, seq_lens, qsl, \
                                               work, out, Hk, G, BQ, block_size, scale_log2);        \
        mt::pdl_exit();                                                                                \
    }
#define MT_DECODE_MMA(D, NH, STAGES)                                                                  \
    extern "C" __global__ void __launch_bounds__(128) decode_mma_d##D##_h##NH(                       \
        const bf16* q, long long qs_t, long long qs_h, const bf16* k_cache, const bf16* v_cache,    \
        const int* block_tables, int bt_stride, const int* seq_lens, const int* qsl, bf16* out,      \
        float* part_o, float* part_m, float* part_l, int Hk, int G, int nchunks, int block_size,     \
        int part_tokens, int nparts, float scale_log2) { mt::pdl_enter();                            \
        decode_mma_impl<D, NH, STAGES, false>(q, qs_t, qs_h, k_cache, v_cache, 0, 0, block_tables,  \
                                              bt_stride, seq_lens, qsl, out, part_o, part_m, part_l, \
                                              Hk, G, nchunks, block_size, part_tokens, nparts,       \
                                              scale_log2);                                           \
        mt::pdl_exit();                                                                              \
    }                                                                                                \
    extern "C" __global__ void __launch_bounds__(128) decode_mma_fp8_d##D##_h##NH(                   \
        const bf16* q, long long qs_t, long long qs_h, const unsigned char* k_cache,                 \
        const unsigned char* v_cache, long long kv_block_bytes, int kv_scale_off,                    \
        const int* block_tables, int bt_stride, const int* seq_lens, const int* qsl, bf16* out,      \
        float* part_o, float* part_m, float* part_l, int Hk, int G, int nchunks, int block_size,     \
        int part_tokens, int nparts, float scale_log2) { mt::pdl_enter();                            \
        decode_mma_impl<D, NH, STAGES, true>(q, qs_t, qs_h, k_cache, v_cache, kv_block_bytes,       \
                                             kv_scale_off, block_tables, bt_stride, seq_lens, qsl,   \
                                             out, part_o, part_m, part_l, Hk, G, nchunks,            \
                                             block_size, part_tokens, nparts, scale_log2);           \
        mt::pdl_exit();                                                                              \
    }

MT_PREFILL_MMA(64, 64, true)
MT_PREFILL_MMA(128, 64, true)
MT_PREFILL_MMA(256, 32, true)
MT_DECODE_MMA(64, 1, 4)
MT_DECODE_MMA(64, 2, 4)
MT_DECODE_MMA(128, 1, 3)
MT_DECODE_MMA(128, 2, 3)
MT_DECODE_MMA(256, 1, 3)
MT_DECODE_MMA(256, 2, 3)
