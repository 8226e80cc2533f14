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
// Kernels (D = 64, 128, 256 instantiated; CUDA-core fp32 FMAs, cp.async tile loads):
//   decode_attn_d<D>    one token per sequence (ForwardBatch.is_decode). Flash-decoding: grid
//                       (B, Hk * ceil(G/16), nparts); each CTA takes up to 16 q heads of one kv
//                       group over one partition of `part_tokens` keys, tiles of BK keys staged
//                       in shared memory. nparts == 1: writes `out` directly. Otherwise writes
//                       unnormalised partial outputs part_o fp32 [B, Hq, nparts, D] and the
//                       running max / sum part_m, part_l fp32 [B, Hq, nparts] (log2 domain),
//                       merged by decode_reduce. Partitions past a sequence's end exit at once,
//                       so a captured graph can size nparts from the block-table width.
//                       Bytes: 2 * seq_len * Hk * D * 2 (K and V read once per kv head).
//   decode_reduce       grid (B, Hq), merges the partitions of one (sequence, q head).
//   prefill_attn_d<D>   any batch (prefill chunks, mixed, qlen > 1). Work item = (sequence,
//                       first new-token index q0) from a host-built list int32 [nwork, 2]; grid
//                       (nwork, Hk). 64 rows per CTA = BQ = 64 / G tokens x G heads, keys in
//                       tiles of BK, causal tiles past the last row are never loaded.
//                       FLOPs: 4 * D * Hq * sum over rows of visible keys (~half a square).
#include "common.cuh"

typedef __nv_bfloat16 bf16;

namespace {

constexpr int kMaxG = 16;  // q heads per decode CTA

// One 16-byte tile row chunk of the paged cache: token `tok` of sequence `b`, kv head `kvh`.
__device__ __forceinline__ const bf16* kv_row(const bf16* cache, const int* __restrict__ bt_row,
                                              int tok, int block_size, int Hk, int kvh, int D) {
    const long long blk = bt_row[tok / block_size];
    const long long slot = blk * block_size + tok % block_size;
    return cache + (slot * Hk + kvh) * D;
}

template <int D, int BK, int NT>
__device__ __forceinline__ void load_kv_tile(bf16* Ks, bf16* Vs, const bf16* k_cache, const bf16* v_cache,
                                             const int* __restrict__ bt_row, int j0, int kv_end,
                                             int block_size, int Hk, int kvh) {
    constexpr int LDS = D + 8, CH = D / 8;
    for (int c = threadIdx.x; c < BK * CH; c += NT) {
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

// ---------------------------------------------------------------------------------------------
template <int D, int BK>
__device__ void decode_attn_impl(const bf16* __restrict__ q, long long qs_t, long long qs_h,
                                 const bf16* __restrict__ k_cache, const bf16* __restrict__ v_cache,
                                 const int* __restrict__ block_tables, int bt_stride,
                                 const int* __restrict__ seq_lens, const int* __restrict__ qsl,
                                 bf16* __restrict__ out, float* __restrict__ part_o,
                                 float* __restrict__ part_m, float* __restrict__ part_l, int Hk, int G,
                                 int gcap, int nchunks, int block_size, int part_tokens, int nparts,
                                 float scale_log2) {
    constexpr int NT = 128, LDS = D + 8, CH = D / 8;
    constexpr int NRS = NT / BK;            // row sets in the score phase
    constexpr int RPT = kMaxG / NRS;        // rows per thread in the score phase
    constexpr int HALF = D / 2;             // bf16 pairs per row
    constexpr int NI = (kMaxG * HALF + NT - 1) / NT;  // (row, pair) items per thread in PV
    static_assert(NT % BK == 0, "BK must divide the block");

    extern __shared__ __align__(16) unsigned char smem[];
    bf16* Ks = reinterpret_cast<bf16*>(smem);
    bf16* Vs = Ks + BK * LDS;
    float* Qs = reinterpret_cast<float*>(Vs + BK * LDS);  // [gcap][D], pre-scaled
    float* S = Qs + gcap * D;                              // [gcap][BK]
    float* ms = S + gcap * BK;
    float* ls = ms + gcap;
    float* as = ls + gcap;

    const int tid = threadIdx.x;
    const int b = blockIdx.x;
    const int kvh = blockIdx.y / nchunks;
    const int g0 = (blockIdx.y % nchunks) * kMaxG;
    const int gn = min(kMaxG, G - g0);
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

    for (int i = tid; i < gn * D; i += NT)
        Qs[i] = __bfloat162float(q[t * qs_t + (long long)(head0 + i / D) * qs_h + i % D]) * scale_log2;
    if (tid < gn) {
        ms[tid] = -MT_INF;
        ls[tid] = 0.f;
    }

    const int j_own = tid % BK;  // score phase: this thread's key and row set
    const int rs = tid / BK;
    float acc[NI][2];
#pragma unroll
    for (int i = 0; i < NI; ++i) acc[i][0] = acc[i][1] = 0.f;

    for (int j0 = kv_begin; j0 < kv_end; j0 += BK) {
        load_kv_tile<D, BK, NT>(Ks, Vs, k_cache, v_cache, bt_row, j0, kv_end, block_size, Hk, kvh);
        mt::cp_async_commit();
        mt::cp_async_wait_all();
        __syncthreads();

        // scores: S[g][j] = q_g . k_j (log2 domain), -inf past the end
        {
            float sc[RPT];
#pragma unroll
            for (int i = 0; i < RPT; ++i) sc[i] = 0.f;
            const bf16* krow = Ks + j_own * LDS;
#pragma unroll 4
            for (int ch = 0; ch < CH; ++ch) {
                mt::Vec16<bf16> kv;
                kv.u = *reinterpret_cast<const uint4*>(krow + ch * 8);
                float kf[8];
#pragma unroll
                for (int e = 0; e < 8; ++e) kf[e] = __bfloat162float(kv.v[e]);
#pragma unroll
                for (int i = 0; i < RPT; ++i) {
                    const int g = rs + NRS * i;
                    if (g < gn) {
                        const float4 qa = *reinterpret_cast<const float4*>(Qs + g * D + ch * 8);
                        const float4 qb = *reinterpret_cast<const float4*>(Qs + g * D + ch * 8 + 4);
                        sc[i] += qa.x * kf[0] + qa.y * kf[1] + qa.z * kf[2] + qa.w * kf[3] +
                                 qb.x * kf[4] + qb.y * kf[5] + qb.z * kf[6] + qb.w * kf[7];
                    }
                }
            }
            const bool valid = j0 + j_own < kv_end;
#pragma unroll
            for (int i = 0; i < RPT; ++i) {
                const int g = rs + NRS * i;
                if (g < gn) S[g * BK + j_own] = valid ? sc[i] : -MT_INF;
            }
        }
        __syncthreads();

        // online softmax, one warp per row (the tile has >= 1 valid key, so the max is finite)
        {
            const int lane = tid & 31, warp = tid >> 5;
            for (int g = warp; g < gn; g += NT / 32) {
                float mx = -MT_INF;
                for (int j = lane; j < BK; j += 32) mx = fmaxf(mx, S[g * BK + j]);
                mx = mt::warp_max(mx);
                const float m_old = ms[g];
                const float m_new = fmaxf(m_old, mx);
                float sum = 0.f;
                for (int j = lane; j < BK; j += 32) {
                    const float pv = exp2f(S[g * BK + j] - m_new);
                    S[g * BK + j] = pv;
                    sum += pv;
                }
                sum = mt::warp_sum(sum);
                if (lane == 0) {
                    const float alpha = exp2f(m_old - m_new);
                    as[g] = alpha;
                    ls[g] = ls[g] * alpha + sum;
                    ms[g] = m_new;
                }
            }
        }
        __syncthreads();

        // o_g = alpha_g * o_g + sum_j p_gj v_j
#pragma unroll
        for (int i = 0; i < NI; ++i) {
            const int idx = tid + NT * i;
            const int g = idx / HALF, cp = idx % HALF;
            if (g < gn) {
                const float alpha = as[g];
                float a0 = acc[i][0] * alpha, a1 = acc[i][1] * alpha;
                const float* prow = S + g * BK;
#pragma unroll 8
                for (int j = 0; j < BK; ++j) {
                    const float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(Vs + j * LDS + 2 * cp));
                    const float pj = prow[j];
                    a0 += pj * v.x;
                    a1 += pj * v.y;
                }
                acc[i][0] = a0;
                acc[i][1] = a1;
            }
        }
        __syncthreads();  // the next tile overwrites Ks, Vs, S
    }

#pragma unroll
    for (int i = 0; i < NI; ++i) {
        const int idx = tid + NT * i;
        const int g = idx / HALF, cp = idx % HALF;
        if (g < gn) {
            const int head = head0 + g;
            if (nparts == 1) {
                const float inv = 1.f / ls[g];
                *reinterpret_cast<__nv_bfloat162*>(out + (t * Hq + head) * D + 2 * cp) =
                    __floats2bfloat162_rn(acc[i][0] * inv, acc[i][1] * inv);
            } else {
                float* po = part_o + (((long long)b * Hq + head) * nparts + p) * D + 2 * cp;
                po[0] = acc[i][0];
                po[1] = acc[i][1];
            }
        }
    }
    if (nparts > 1 && tid < gn) {
        const long long pi = ((long long)b * Hq + head0 + tid) * nparts + p;
        part_m[pi] = ms[tid];
        part_l[pi] = ls[tid];
    }
}

// ---------------------------------------------------------------------------------------------
template <int D, int BK>
__device__ void prefill_attn_impl(const bf16* __restrict__ q, long long qs_t, long long qs_h,
                                  const bf16* __restrict__ k_cache, const bf16* __restrict__ v_cache,
                                  const int* __restrict__ block_tables, int bt_stride,
                                  const int* __restrict__ seq_lens, const int* __restrict__ qsl,
                                  const int* __restrict__ work, bf16* __restrict__ out, int Hk, int G,
                                  int BQ, int block_size, float scale_log2) {
    constexpr int NT = 256, R = 64, LDS = D + 8, CH = D / 8;
    constexpr int RPT = 4;                  // rows per thread: rg + 16 * i
    constexpr int KPT = BK / 16;            // keys per thread: kg + 16 * c
    constexpr int VEC = D >= 128 ? 8 : 4;   // output columns per vector
    constexpr int NV = D / 16 / VEC;        // vectors per thread: columns (kg + 16 * c) * VEC
    static_assert(R == 16 * RPT && NT == 256, "layout");

    extern __shared__ __align__(16) unsigned char smem[];
    bf16* Qs = reinterpret_cast<bf16*>(smem);  // [R][LDS]
    bf16* Ks = Qs + R * LDS;                   // [BK][LDS]
    bf16* Vs = Ks + BK * LDS;                  // [BK][LDS]
    float* P = reinterpret_cast<float*>(Vs + BK * LDS);  // [R][BK]

    const int tid = threadIdx.x;
    const int rg = tid >> 4, kg = tid & 15;
    const int b = work[2 * blockIdx.x];
    const int q0 = work[2 * blockIdx.x + 1];
    const int kvh = blockIdx.y;
    const int Hq = Hk * G;
    const int seq_len = seq_lens[b];
    const int qstart = qsl[b];
    const int qlen = qsl[b + 1] - qstart;
    const int ctx = seq_len - qlen;
    const int nq = min(BQ, qlen - q0);
    const int nrows = nq * G;
    const int kv_end = ctx + q0 + nq;  // keys [0, kv_end) are visible to some row of this tile
    const int* bt_row = block_tables + (long long)b * bt_stride;

    for (int c = tid; c < R * CH; c += NT) {
        const int row = c / CH, ch = c % CH;
        const bool valid = row < nrows;
        const bf16* src = q;
        if (valid)
            src = q + (long long)(qstart + q0 + row / G) * qs_t + (long long)(kvh * G + row % G) * qs_h + ch * 8;
        mt::cp_async16(Qs + row * LDS + ch * 8, src, valid);
    }

    int qpos[RPT];
    float m[RPT], l[RPT];
    float acc[RPT][NV][VEC];
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
        const int r = rg + 16 * i;
        qpos[i] = r < nrows ? ctx + q0 + r / G : -1;  // -1: padding row, sees nothing
        m[i] = -MT_INF;
        l[i] = 0.f;
#pragma unroll
        for (int n = 0; n < NV; ++n)
#pragma unroll
            for (int e = 0; e < VEC; ++e) acc[i][n][e] = 0.f;
    }

    for (int j0 = 0; j0 < kv_end; j0 += BK) {
        load_kv_tile<D, BK, NT>(Ks, Vs, k_cache, v_cache, bt_row, j0, kv_end, block_size, Hk, kvh);
        mt::cp_async_commit();
        mt::cp_async_wait_all();
        __syncthreads();

        float s[RPT][KPT];
#pragma unroll
        for (int i = 0; i < RPT; ++i)
#pragma unroll
            for (int c = 0; c < KPT; ++c) s[i][c] = 0.f;
#pragma unroll 2
        for (int ch = 0; ch < CH; ++ch) {
            mt::Vec16<bf16> kv[KPT], qv[RPT];
#pragma unroll
            for (int c = 0; c < KPT; ++c) kv[c].u = *reinterpret_cast<const uint4*>(Ks + (kg + 16 * c) * LDS + ch * 8);
#pragma unroll
            for (int i = 0; i < RPT; ++i) qv[i].u = *reinterpret_cast<const uint4*>(Qs + (rg + 16 * i) * LDS + ch * 8);
#pragma unroll
            for (int e = 0; e < 8; e += 2) {
                float2 qf[RPT], kf[KPT];
#pragma unroll
                for (int i = 0; i < RPT; ++i) qf[i] = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&qv[i].v[e]));
#pragma unroll
                for (int c = 0; c < KPT; ++c) kf[c] = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&kv[c].v[e]));
#pragma unroll
                for (int i = 0; i < RPT; ++i)
#pragma unroll
                    for (int c = 0; c < KPT; ++c) s[i][c] += qf[i].x * kf[c].x + qf[i].y * kf[c].y;
            }
        }

        // causal mask + online softmax; a row's 16 key-threads are lanes of one half-warp
        float alpha[RPT];
#pragma unroll
        for (int i = 0; i < RPT; ++i) {
            float mx = -MT_INF;
#pragma unroll
            for (int c = 0; c < KPT; ++c) {
                const int j = j0 + kg + 16 * c;
                s[i][c] = j <= qpos[i] ? s[i][c] * scale_log2 : -MT_INF;
                mx = fmaxf(mx, s[i][c]);
            }
#pragma unroll
            for (int o = 8; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            const float m_new = fmaxf(m[i], mx);
            const float m_use = m_new == -MT_INF ? 0.f : m_new;  // row sees no key yet
            float sum = 0.f;
#pragma unroll
            for (int c = 0; c < KPT; ++c) {
                const float pv = exp2f(s[i][c] - m_use);
                P[(rg + 16 * i) * BK + kg + 16 * c] = pv;
                sum += pv;
            }
#pragma unroll
            for (int o = 8; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
            alpha[i] = exp2f(m[i] - m_use);
            l[i] = l[i] * alpha[i] + sum;
            m[i] = m_new;
        }
        __syncthreads();

#pragma unroll
        for (int i = 0; i < RPT; ++i)
#pragma unroll
            for (int n = 0; n < NV; ++n)
#pragma unroll
                for (int e = 0; e < VEC; ++e) acc[i][n][e] *= alpha[i];
#pragma unroll 2
        for (int j = 0; j < BK; ++j) {
            float vf[NV][VEC];
#pragma unroll
            for (int n = 0; n < NV; ++n) {
                const bf16* vp = Vs + j * LDS + (kg + 16 * n) * VEC;
                if constexpr (VEC == 8) {
                    mt::Vec16<bf16> vv;
                    vv.u = *reinterpret_cast<const uint4*>(vp);
#pragma unroll
                    for (int e = 0; e < 8; ++e) vf[n][e] = __bfloat162float(vv.v[e]);
                } else {
                    const uint2 raw = *reinterpret_cast<const uint2*>(vp);
                    const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
                    const float2 c = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
                    vf[n][0] = a.x; vf[n][1] = a.y; vf[n][2] = c.x; vf[n][3] = c.y;
                }
            }
#pragma unroll
            for (int i = 0; i < RPT; ++i) {
                const float pj = P[(rg + 16 * i) * BK + j];
#pragma unroll
                for (int n = 0; n < NV; ++n)
#pragma unroll
                    for (int e = 0; e < VEC; ++e) acc[i][n][e] += pj * vf[n][e];
            }
        }
        __syncthreads();  // the next tile overwrites Ks, Vs, P
    }

#pragma unroll
    for (int i = 0; i < RPT; ++i) {
        const int r = rg + 16 * i;
        if (r < nrows) {
            const float inv = 1.f / l[i];  // key 0 is visible to every row: l > 0
            const long long tok = qstart + q0 + r / G;
            bf16* op = out + (tok * Hq + kvh * G + r % G) * D;
#pragma unroll
            for (int n = 0; n < NV; ++n) {
                mt::Vec16<bf16> o;
#pragma unroll
                for (int e = 0; e < VEC; ++e) o.v[e] = __float2bfloat16_rn(acc[i][n][e] * inv);
                bf16* dst = op + (kg + 16 * n) * VEC;
                if constexpr (VEC == 8) *reinterpret_cast<uint4*>(dst) = o.u;
                else *reinterpret_cast<uint2*>(dst) = make_uint2(o.u.x, o.u.y);
            }
        }
    }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
extern "C" __global__ void decode_reduce(const float* __restrict__ part_o, const float* __restrict__ part_m,
                                         const float* __restrict__ part_l, const int* __restrict__ seq_lens,
                                         const int* __restrict__ qsl, bf16* __restrict__ out, int Hq, int D,
                                         int part_tokens, int nparts) {
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
}

#define MT_ATTN(D, BK)                                                                               \
    extern "C" __global__ void __launch_bounds__(128) decode_attn_d##D(                              \
        const bf16* q, long long qs_t, long long qs_h, const bf16* k_cache, const bf16* v_cache,    \
        const int* block_tables, int bt_stride, const int* seq_lens, const int* qsl, bf16* out,      \
        float* part_o, float* part_m, float* part_l, int Hk, int G, int gcap, int nchunks,           \
        int block_size, int part_tokens, int nparts, float scale_log2) {                            \
        decode_attn_impl<D, BK>(q, qs_t, qs_h, k_cache, v_cache, block_tables, bt_stride, seq_lens, \
                                qsl, out, part_o, part_m, part_l, Hk, G, gcap, nchunks, block_size,  \
                                part_tokens, nparts, scale_log2);                                    \
    }                                                                                                \
    extern "C" __global__ void __launch_bounds__(256) prefill_attn_d##D(                             \
        const bf16* q, long long qs_t, long long qs_h, const bf16* k_cache, const bf16* v_cache,    \
        const int* block_tables, int bt_stride, const int* seq_lens, const int* qsl,                 \
        const int* work, bf16* out, int Hk, int G, int BQ, int block_size, float scale_log2) {       \
        prefill_attn_impl<D, BK>(q, qs_t, qs_h, k_cache, v_cache, block_tables, bt_stride, seq_lens, \
                                 qsl, work, out, Hk, G, BQ, block_size, scale_log2);                 \
    }

MT_ATTN(64, 64)
MT_ATTN(128, 64)
MT_ATTN(256, 32)
