// Gated DeltaNet: the gated delta rule (chunked WY form for prefill, recurrent form for decode)
// and the fused gate computation.
//
// Reference: metrale/backends/cpu.py (CpuOps.gated_delta_rule / gdn_gates), which follows HF
// transformers' torch_chunk_gated_delta_rule / torch_recurrent_gated_delta_rule
// (models/qwen3_5/modeling_qwen3_5.py). Tested in tests/test_cuda_gdn.py.
//
// Arguments (T = tokens in the step, B = sequences, Hk/Hv = key/value heads, DK/DV head dims):
//   q, k     T  [T, Hk, DK]  token stride sq / sk elements (heads contiguous: q/k/v may be column
//                            slices of one projection), L2-normalised here (eps 1e-6), q * DK^-0.5
//   v        T  [T, Hv, DV]  token stride sv
//   g, beta  f32 [T, Hv]     log decay (<= 0) and write strength, contiguous
//   state    f32 [slots, Hv, DK, DV]  row state_slots[i]; read unless the sequence starts fresh
//                            (context_len == 0: zeros), always written back (in place); or f16 /
//                            bf16 (kernels *_bf16_sf16 / *_bf16_sbf16: --ssm-h-dtype f16-pool /
//                            bf16-pool), fp32 inside, rounded once per sequence per step (and
//                            once per state_out save)
//   o        T  [T, Hv, DV]  contiguous
//   qsl      i32 [B+1], seq_lens i32 [B], slots i32 [B]
//   state_out i32 [T] or NULL (recurrent kernels only; ForwardBatch.state_out, a speculative
//                            verify step): after token t the running fp32 state is also stored
//                            into row state_out[t] when >= 0 (through st_state4: rounded to a
//                            16-bit pool there, the running state stays fp32), as the final store
//                            does. Rows must be rows no sequence of the step works on (not in
//                            slots). NULL (decode steps, graphs): no saves, one uniform branch
//                            per token.
//   Value head h reads key head h / (Hv / Hk).
//
// gdn_recurrent_<DK>x<DV>_<T>(q, k, v, sq, sk, sv, g, beta, state, o, qsl, seq_lens, slots,
//   state_out, Hk, Hv); gdn_chunked_<DK>x<DV>_<T>(the same without state_out).
// gdn_recurrent_gates_<DK>x<DV>_<T>(q, k, v, sq, sk, sv, a, b, sa, sb, A_log, dt_bias, state, o,
//   qsl, seq_lens, slots, state_out, Hk, Hv): the recurrent kernel taking the raw gate
//   projections a, b (T [T, Hv], token strides sa / sb: columns of the input projection) and
//   A_log, dt_bias (f32 [Hv]) in place of g, beta; the gates are computed as gdn_gates does
//   (bit-identical to gdn_gates + gdn_recurrent), saving the gates launch of each GDN layer in a
//   decode step. Any number of tokens per sequence: a verify step (state_out given) runs its
//   windows through it token by token, so each token's output and saved state are those of a
//   decode step (bit for bit with an fp32 pool; a 16-bit pool rounds between decode steps).
//
// Recurrent (decode) kernel: one CTA per (value head, sequence), DK*DV/4 float4 state elements
// held in registers (16 per thread at 128x128), read once and written once with coalesced 16-byte
// accesses. Bytes: B*Hv*DK*DV*4*2 (state) + B*(2*Hk*DK + Hv*DV)*2 (q,k,v) + o; FLOPs ~ 8*DK*DV per
// (token, head). Memory-bound: at 128x128, Hv=48, B=128: 403 MB/layer -> ~95 us at 4.2 TB/s.
// With state_out: + Hv*DK*DV*sizeof(pool element) written per saved token (at 128x128, Hv=48:
// 3.1 MB fp32 / 1.6 MB 16-bit per saved token per layer) + T*4 (state_out); no extra FLOPs.
//
// Chunked (prefill) kernel: one CTA per (value head, sequence) walking the sequence's chunks of
// 64 tokens with the state in shared memory (fp32, 64 KB at 128x128; ~210 KB of dynamic shared
// memory in all: the caller raises the limit). Per chunk: A = beta*K K^T*decay (strictly lower),
// forward substitution (I + A)^-1 applied to [beta*V | beta*K*exp(G)], V_new = U - W S,
// O = exp(G) Q S + (Q K^T * decay, lower incl. diagonal) V_new, S = S exp(G_last) + K_tail^T V_new.
// FLOPs per chunk ~ 2*64*(64*DK*2 + 64*(DK+DV)/2 + DK*DV*3 + 64*DV) ~ 10 MFLOP at 128x128, i.e.
// ~160 kFLOP per (token, head); this first version runs on the fp32 FMA pipes from shared memory
// (register-tiled, 4x8 / 8x8 per thread), not the tensor cores: prefill GDN is compute-bound and
// the next step is mma.sync (tf32/bf16) for the five chunk GEMMs, plus splitting heads' chunks
// across CTAs (B*Hv CTAs only fill the 132 SMs when B*Hv >= 132).
#include "common.cuh"

namespace {

constexpr int CH = 64;        // chunk length
constexpr int CNT = 256;      // threads of the chunked kernel
constexpr float L2_EPS = 1e-6f;

// The pooled state between steps: fp32 (default) or 16-bit (--ssm-h-dtype f16-pool /
// bf16-pool: half the bytes per slot). Inside a step it is always fp32; a 16-bit pool rounds it
// once per sequence per step and per state_out save (round to nearest), exactly where the CPU
// backend stores it.
__device__ __forceinline__ float4 ld_state4(const float* p, long long i) {
    return reinterpret_cast<const float4*>(p)[i];
}
__device__ __forceinline__ void st_state4(float* p, long long i, float4 v) {
    reinterpret_cast<float4*>(p)[i] = v;
}
// 16-bit pools: four values as two packed pairs (8 bytes), through the pair type's conversions
template <typename S> struct StatePair;
template <> struct StatePair<__half> {
    using P = __half2;
    static __device__ __forceinline__ P pack(float a, float b) { return __floats2half2_rn(a, b); }
};
template <> struct StatePair<__nv_bfloat16> {
    using P = __nv_bfloat162;
    static __device__ __forceinline__ P pack(float a, float b) { return __floats2bfloat162_rn(a, b); }
};
template <typename S>
__device__ __forceinline__ float4 ld_state4(const S* p, long long i) {
    using P = typename StatePair<S>::P;
    const uint2 u = reinterpret_cast<const uint2*>(p)[i];
    const P a = *reinterpret_cast<const P*>(&u.x), b = *reinterpret_cast<const P*>(&u.y);
    return make_float4(__low2float(a), __high2float(a), __low2float(b), __high2float(b));
}
template <typename S>
__device__ __forceinline__ void st_state4(S* p, long long i, float4 v) {
    const auto a = StatePair<S>::pack(v.x, v.y), b = StatePair<S>::pack(v.z, v.w);
    uint2 u;
    u.x = *reinterpret_cast<const unsigned*>(&a);
    u.y = *reinterpret_cast<const unsigned*>(&b);
    reinterpret_cast<uint2*>(p)[i] = u;
}

// g = -exp(A_log) * softplus(a + dt_bias), torch's softplus (threshold 20)
template <typename T>
__device__ __forceinline__ float gate_g(T a, float A_log, float dt_bias) {
    const float x = mt::to_f(a) + dt_bias;
    const float sp = x > 20.f ? x : log1pf(expf(x));
    return -expf(A_log) * sp;
}

template <int DK, int DV> struct RecShape {
    static constexpr int NT = (DK * DV / 4) < 256 ? (DK * DV / 4) : 256;  // threads
    static constexpr int CG = DV / 4;                                    // float4 column groups
    static constexpr int RG = NT / CG;                                   // row groups
    static constexpr int RPT = DK / RG;                                  // rows per thread
    static_assert(NT % 32 == 0 && RPT >= 1 && DK % RG == 0, "unsupported head dims");
};

// GATES: the decay and beta of each token come from the raw gate projections a, b [T, Hv]
// (token strides sa, sb) with A_log, dt_bias, computed exactly as gdn_gates below does (so the
// result is bit-identical to gdn_gates + this kernel), instead of from precomputed g, beta:
// one launch less per GDN layer per decode step.
template <typename T, int DK, int DV, bool GATES = false, typename SS = float>
__device__ __forceinline__ void gdn_recurrent(
    const T* q, const T* k, const T* v,
    long long sq, long long sk, long long sv,
    const float* g, const float* beta, SS* state,
    T* o, const int* qsl, const int* seq_lens,
    const int* slots, const int* state_out, int Hk, int Hv,
    const T* ga = nullptr, const T* gb = nullptr, long long sa = 0,
    long long sb = 0, const float* A_log = nullptr,
    const float* dt_bias = nullptr) {
    using Sh = RecShape<DK, DV>;
    constexpr int NT = Sh::NT, CG = Sh::CG, RG = Sh::RG, RPT = Sh::RPT, NW = NT / 32;
    __shared__ float qs[DK], ks[DK], vs[DV], dl[DV];
    __shared__ __align__(16) float red_k[RG][DV];
    __shared__ __align__(16) float red_q[RG][DV];
    __shared__ float red3[NW][3];

    const int h = blockIdx.x, seq = blockIdx.y, tid = threadIdx.x;
    const int hk = h / (Hv / Hk);
    const int t0 = qsl[seq], t1 = qsl[seq + 1];
    const int ctx = seq_lens[seq] - (t1 - t0);
    if (t1 <= t0) return;
    SS* S = state + ((long long)slots[seq] * Hv + h) * DK * DV;
    const int cg = tid % CG, rg = tid / CG;

    float4 s[RPT];
#pragma unroll
    for (int r = 0; r < RPT; ++r)
        s[r] = ctx > 0 ? ld_state4(S, (rg + r * RG) * CG + cg) : make_float4(0.f, 0.f, 0.f, 0.f);

    const float scale = rsqrtf((float)DK);
    float A_h = 0.f, dt_h = 0.f;  // GATES: this head's A_log, dt_bias (weights), read once
    if constexpr (GATES) { A_h = A_log[h]; dt_h = dt_bias[h]; }
    for (int t = t0; t < t1; ++t) {
        // q, k, v of this token; norms and q.k through one block reduction.
        float qv = 0.f, kv = 0.f;
        if (tid < DK) {
            qv = mt::to_f(q[t * sq + (long long)hk * DK + tid]);
            kv = mt::to_f(k[t * sk + (long long)hk * DK + tid]);
        }
        float sqq = mt::warp_sum(qv * qv), skk = mt::warp_sum(kv * kv), sqk = mt::warp_sum(qv * kv);
        __syncthreads();  // previous token's readers of qs/ks/dl are done
        if ((tid & 31) == 0) { red3[tid >> 5][0] = sqq; red3[tid >> 5][1] = skk; red3[tid >> 5][2] = sqk; }
        if (tid < DV) vs[tid] = mt::to_f(v[t * sv + (long long)h * DV + tid]);
        __syncthreads();
        sqq = 0.f; skk = 0.f; sqk = 0.f;
#pragma unroll
        for (int w = 0; w < NW; ++w) { sqq += red3[w][0]; skk += red3[w][1]; sqk += red3[w][2]; }
        const float rq = rsqrtf(sqq + L2_EPS) * scale, rk = rsqrtf(skk + L2_EPS);
        if (tid < DK) { qs[tid] = qv * rq; ks[tid] = kv * rk; }
        const float kq = sqk * rq * rk;
        float decay, b;
        if constexpr (GATES) {
            decay = expf(gate_g(ga[t * sa + h], A_h, dt_h));
            b = mt::sigmoid(mt::to_f(gb[t * sb + h]));
        } else {
            decay = expf(g[(long long)t * Hv + h]);
            b = beta[(long long)t * Hv + h];
        }
        __syncthreads();

        float4 pk = make_float4(0.f, 0.f, 0.f, 0.f), pq = pk;
#pragma unroll
        for (int r = 0; r < RPT; ++r) {
            const int i = rg + r * RG;
            const float ki = ks[i], qi = qs[i];
            s[r].x *= decay; s[r].y *= decay; s[r].z *= decay; s[r].w *= decay;
            pk.x += s[r].x * ki; pk.y += s[r].y * ki; pk.z += s[r].z * ki; pk.w += s[r].w * ki;
            pq.x += s[r].x * qi; pq.y += s[r].y * qi; pq.z += s[r].z * qi; pq.w += s[r].w * qi;
        }
        *reinterpret_cast<float4*>(&red_k[rg][cg * 4]) = pk;
        *reinterpret_cast<float4*>(&red_q[rg][cg * 4]) = pq;
        __syncthreads();
        if (tid < DV) {
            float mk = 0.f, mq = 0.f;
#pragma unroll 8
            for (int w = 0; w < RG; ++w) { mk += red_k[w][tid]; mq += red_q[w][tid]; }
            const float d = b * (vs[tid] - mk);
            dl[tid] = d;
            // o = q^T (S_decayed + k d^T) = q^T S_decayed + (q.k) d
            o[((long long)t * Hv + h) * DV + tid] = mt::from_f<T>(mq + kq * d);
        }
        __syncthreads();
        const float4 d4 = *reinterpret_cast<const float4*>(&dl[cg * 4]);
#pragma unroll
        for (int r = 0; r < RPT; ++r) {
            const float ki = ks[rg + r * RG];
            s[r].x += ki * d4.x; s[r].y += ki * d4.y; s[r].z += ki * d4.z; s[r].w += ki * d4.w;
        }
        if (state_out != nullptr) {  // a verify step: the state after token t into its own row
            const int row = state_out[t];
            if (row >= 0) {
                SS* R = state + ((long long)row * Hv + h) * DK * DV;
#pragma unroll
                for (int r = 0; r < RPT; ++r) st_state4(R, (rg + r * RG) * CG + cg, s[r]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < RPT; ++r) st_state4(S, (rg + r * RG) * CG + cg, s[r]);
}

// ---------------------------------------------------------------------------------------------
// Chunked (WY) form.
// ---------------------------------------------------------------------------------------------
template <int M, int N> struct Tile {
    static constexpr int NX = N < 16 ? N : 16;  // threads along N
    static constexpr int TN = N / NX;
    static constexpr int NY = CNT / NX;         // threads along M
    static constexpr int TM = M / NY;
    static_assert(TM >= 1 && M % NY == 0 && N % NX == 0, "tile does not fit");
};

// acc[i][j] += sum_k opA(m_i, k) * opB(k, n_j), m_i = ty + i*NY, n_j = tx + j*NX (shared memory).
// opA(m, k) = TA ? A[k*lda + m] : A[m*lda + k];  opB(k, n) = TB ? B[n*ldb + k] : B[k*ldb + n].
template <int M, int N, bool TA, bool TB>
__device__ __forceinline__ void mm(float (&acc)[Tile<M, N>::TM][Tile<M, N>::TN],
                                   const float* A, int lda, const float* B, int ldb, int K) {
    using Tl = Tile<M, N>;
    const int tx = threadIdx.x % Tl::NX, ty = threadIdx.x / Tl::NX;
#pragma unroll 4
    for (int kk = 0; kk < K; ++kk) {
        float a[Tl::TM], b[Tl::TN];
#pragma unroll
        for (int i = 0; i < Tl::TM; ++i) {
            const int m = ty + i * Tl::NY;
            a[i] = TA ? A[kk * lda + m] : A[m * lda + kk];
        }
#pragma unroll
        for (int j = 0; j < Tl::TN; ++j) {
            const int n = tx + j * Tl::NX;
            b[j] = TB ? B[n * ldb + kk] : B[kk * ldb + n];
        }
#pragma unroll
        for (int i = 0; i < Tl::TM; ++i)
#pragma unroll
            for (int j = 0; j < Tl::TN; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
}

template <int M, int N>
__device__ __forceinline__ void zero(float (&acc)[Tile<M, N>::TM][Tile<M, N>::TN]) {
#pragma unroll
    for (int i = 0; i < Tile<M, N>::TM; ++i)
#pragma unroll
        for (int j = 0; j < Tile<M, N>::TN; ++j) acc[i][j] = 0.f;
}

template <int DK, int DV> struct ChunkSmem {
    static constexpr int LDK = DK + 1, LDV = DV + 1, LDA = CH + 1;
    static constexpr int S = 0;
    static constexpr int Q = S + DK * DV;
    static constexpr int K = Q + CH * LDK;
    static constexpr int W = K + CH * LDK;
    static constexpr int U = W + CH * LDK;
    static constexpr int A = U + CH * LDV;
    static constexpr int G = A + CH * LDA;
    static constexpr int BT = G + CH;
    static constexpr int TOTAL = BT + CH;  // floats
    static_assert(TOTAL * 4 <= 232448, "chunk state does not fit in shared memory");
};

template <typename T, int DK, int DV, typename SS = float>
__device__ __forceinline__ void gdn_chunked(
    const T* q, const T* k, const T* v,
    long long sq, long long sk, long long sv,
    const float* g, const float* beta, SS* state,
    T* o, const int* qsl, const int* seq_lens,
    const int* slots, int Hk, int Hv) {
    using L = ChunkSmem<DK, DV>;
    constexpr int LDK = L::LDK, LDV = L::LDV, LDA = L::LDA;
    extern __shared__ __align__(16) float sm[];
    float* S = sm + L::S;
    float* Qs = sm + L::Q;
    float* Ks = sm + L::K;
    float* Ws = sm + L::W;
    float* Us = sm + L::U;
    float* As = sm + L::A;
    float* Gs = sm + L::G;
    float* Bs = sm + L::BT;

    const int h = blockIdx.x, seq = blockIdx.y, tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5;
    const int hk = h / (Hv / Hk);
    const int t0 = qsl[seq], len = qsl[seq + 1] - t0;
    if (len <= 0) return;
    const int ctx = seq_lens[seq] - len;
    SS* Sg = state + ((long long)slots[seq] * Hv + h) * DK * DV;
    for (int i = tid; i < DK * DV / 4; i += CNT)
        reinterpret_cast<float4*>(S)[i] = ctx > 0 ? ld_state4(Sg, i) : make_float4(0.f, 0.f, 0.f, 0.f);
    const float scale = rsqrtf((float)DK);

    for (int c0 = 0; c0 < len; c0 += CH) {
        const int n = min(CH, len - c0);
        // -- load: gates, cumulative log decay, normalised q/k, beta*v, beta*k*exp(G) ---------
        if (tid < CH) {
            const long long t = t0 + c0 + tid;
            Gs[tid] = tid < n ? g[t * Hv + h] : 0.f;
            Bs[tid] = tid < n ? beta[t * Hv + h] : 0.f;
        }
        __syncthreads();
        if (tid == 0) {
            float acc = 0.f;
            for (int i = 0; i < CH; ++i) { acc += Gs[i]; Gs[i] = acc; }
        }
        __syncthreads();
        for (int r = warp; r < CH; r += CNT / 32) {
            const long long t = t0 + c0 + r;
            float qv[(DK + 31) / 32], kv[(DK + 31) / 32];
            float sqq = 0.f, skk = 0.f;
#pragma unroll
            for (int e = 0; e < (DK + 31) / 32; ++e) {
                const int d = lane + e * 32;
                qv[e] = (r < n && d < DK) ? mt::to_f(q[t * sq + (long long)hk * DK + d]) : 0.f;
                kv[e] = (r < n && d < DK) ? mt::to_f(k[t * sk + (long long)hk * DK + d]) : 0.f;
                sqq += qv[e] * qv[e];
                skk += kv[e] * kv[e];
            }
            sqq = mt::warp_sum(sqq);
            skk = mt::warp_sum(skk);
            const float rq = rsqrtf(sqq + L2_EPS) * scale, rk = rsqrtf(skk + L2_EPS);
            const float bw = Bs[r] * expf(Gs[r]);
#pragma unroll
            for (int e = 0; e < (DK + 31) / 32; ++e) {
                const int d = lane + e * 32;
                if (d < DK) {
                    Qs[r * LDK + d] = qv[e] * rq;
                    Ks[r * LDK + d] = kv[e] * rk;
                    Ws[r * LDK + d] = kv[e] * rk * bw;
                }
            }
            for (int d = lane; d < DV; d += 32)
                Us[r * LDV + d] = r < n ? mt::to_f(v[t * sv + (long long)h * DV + d]) * Bs[r] : 0.f;
        }
        __syncthreads();
        // -- A = beta_i k_i.k_j exp(G_i - G_j), strictly lower ------------------------------
        {
            using Tl = Tile<CH, CH>;
            float acc[Tl::TM][Tl::TN];
            zero<CH, CH>(acc);
            mm<CH, CH, false, true>(acc, Ks, LDK, Ks, LDK, DK);
            const int tx = tid % Tl::NX, ty = tid / Tl::NX;
#pragma unroll
            for (int i = 0; i < Tl::TM; ++i)
#pragma unroll
                for (int j = 0; j < Tl::TN; ++j) {
                    const int m = ty + i * Tl::NY, nn = tx + j * Tl::NX;
                    As[m * LDA + nn] = m > nn ? acc[i][j] * Bs[m] * expf(Gs[m] - Gs[nn]) : 0.f;
                }
        }
        __syncthreads();
        // -- forward substitution: [U | W] <- (I + A)^-1 [U | W], one column per thread ------
        if (tid < DV + DK) {
            float* X = tid < DV ? Us + tid : Ws + (tid - DV);
            const int ld = tid < DV ? LDV : LDK;
            for (int i = 1; i < n; ++i) {
                float x = X[i * ld];
                const float* Ai = As + i * LDA;
                for (int j = 0; j < i; ++j) x = fmaf(-Ai[j], X[j * ld], x);
                X[i * ld] = x;
            }
        }
        __syncthreads();
        // -- V_new = U - W S;   A <- (q_i.k_j) exp(G_i - G_j), lower incl. diagonal ----------
        {
            using Tl = Tile<CH, DV>;
            float acc[Tl::TM][Tl::TN];
            zero<CH, DV>(acc);
            mm<CH, DV, false, false>(acc, Ws, LDK, S, DV, DK);
            const int tx = tid % Tl::NX, ty = tid / Tl::NX;
#pragma unroll
            for (int i = 0; i < Tl::TM; ++i)
#pragma unroll
                for (int j = 0; j < Tl::TN; ++j) {
                    const int m = ty + i * Tl::NY, nn = tx + j * Tl::NX;
                    Us[m * LDV + nn] -= acc[i][j];
                }
        }
        {
            using Tl = Tile<CH, CH>;
            float acc[Tl::TM][Tl::TN];
            zero<CH, CH>(acc);
            mm<CH, CH, false, true>(acc, Qs, LDK, Ks, LDK, DK);
            const int tx = tid % Tl::NX, ty = tid / Tl::NX;
#pragma unroll
            for (int i = 0; i < Tl::TM; ++i)
#pragma unroll
                for (int j = 0; j < Tl::TN; ++j) {
                    const int m = ty + i * Tl::NY, nn = tx + j * Tl::NX;
                    As[m * LDA + nn] = m >= nn ? acc[i][j] * expf(Gs[m] - Gs[nn]) : 0.f;
                }
        }
        __syncthreads();
        // -- O = exp(G) (Q S) + A V_new;  K rows scaled by exp(G_last - G_i) for the update --
        {
            using Tl = Tile<CH, DV>;
            float acc[Tl::TM][Tl::TN];
            zero<CH, DV>(acc);
            mm<CH, DV, false, false>(acc, Qs, LDK, S, DV, DK);
            const int tx = tid % Tl::NX, ty = tid / Tl::NX;
#pragma unroll
            for (int i = 0; i < Tl::TM; ++i) {
                const float e = expf(Gs[ty + i * Tl::NY]);
#pragma unroll
                for (int j = 0; j < Tl::TN; ++j) acc[i][j] *= e;
            }
            mm<CH, DV, false, false>(acc, As, LDA, Us, LDV, n);
#pragma unroll
            for (int i = 0; i < Tl::TM; ++i) {
                const int m = ty + i * Tl::NY;
                if (m < n) {
#pragma unroll
                    for (int j = 0; j < Tl::TN; ++j) {
                        const int nn = tx + j * Tl::NX;
                        o[((long long)(t0 + c0 + m) * Hv + h) * DV + nn] = mt::from_f<T>(acc[i][j]);
                    }
                }
            }
            const float glast = Gs[CH - 1];
            for (int i = tid; i < CH * DK; i += CNT) {
                const int r = i / DK, d = i % DK;
                Ks[r * LDK + d] *= expf(glast - Gs[r]);
            }
        }
        __syncthreads();
        // -- S = S exp(G_last) + K_tail^T V_new -------------------------------------------------
        {
            using Tl = Tile<DK, DV>;
            float acc[Tl::TM][Tl::TN];
            zero<DK, DV>(acc);
            mm<DK, DV, true, false>(acc, Ks, LDK, Us, LDV, n);
            const float eg = expf(Gs[CH - 1]);
            const int tx = tid % Tl::NX, ty = tid / Tl::NX;
#pragma unroll
            for (int i = 0; i < Tl::TM; ++i)
#pragma unroll
                for (int j = 0; j < Tl::TN; ++j) {
                    const int m = ty + i * Tl::NY, nn = tx + j * Tl::NX;
                    S[m * DV + nn] = fmaf(S[m * DV + nn], eg, acc[i][j]);
                }
        }
        __syncthreads();
    }
    for (int i = tid; i < DK * DV / 4; i += CNT) st_state4(Sg, i, reinterpret_cast<float4*>(S)[i]);
}

// ---------------------------------------------------------------------------------------------
// gates: g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)   (a, b [T, Hv] of T)
// Bytes: T*Hv*(2+2+4+4); FLOPs negligible.
// ---------------------------------------------------------------------------------------------
template <typename T>
__device__ __forceinline__ void gdn_gates(const T* a, const T* b,
                                          long long sa, long long sb,
                                          const float* A_log,
                                          const float* dt_bias,
                                          float* g, float* beta,
                                          int T_, int Hv) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)T_ * Hv) return;
    const int t = (int)(i / Hv), h = (int)(i % Hv);
    g[i] = gate_g(a[t * sa + h], A_log[h], dt_bias[h]);
    beta[i] = mt::sigmoid(mt::to_f(b[t * sb + h]));
}

}  // namespace

#define GDN_ARGS(T, S)                                                                             \
    const T *q, const T *k, const T *v, long long sq, long long sk, long long sv, const float *g, \
        const float *beta, S *state, T *o, const int *qsl, const int *seq_lens,                    \
        const int *slots, int Hk, int Hv
#define GDN_PASS q, k, v, sq, sk, sv, g, beta, state, o, qsl, seq_lens, slots, Hk, Hv
// the recurrent kernels: GDN_ARGS with the state_out rows after slots
#define REC_ARGS(T, S)                                                                             \
    const T *q, const T *k, const T *v, long long sq, long long sk, long long sv, const float *g, \
        const float *beta, S *state, T *o, const int *qsl, const int *seq_lens,                    \
        const int *slots, const int *state_out, int Hk, int Hv
#define REC_PASS q, k, v, sq, sk, sv, g, beta, state, o, qsl, seq_lens, slots, state_out, Hk, Hv

// NAME: the kernels' suffix: <activations> for an fp32 state pool, <activations>_s<state> for a
// 16-bit one (gdn_recurrent_128x128_bf16_sf16)
#define GDN_INST(T, S, NAME, DK, DV)                                                             \
    extern "C" __global__ void __launch_bounds__(RecShape<DK, DV>::NT)                            \
        gdn_recurrent_##DK##x##DV##_##NAME(REC_ARGS(T, S)) { mt::pdl_enter();                    \
        gdn_recurrent<T, DK, DV, false, S>(REC_PASS);                                            \
        mt::pdl_exit();                                                                          \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(RecShape<DK, DV>::NT)                            \
        gdn_recurrent_gates_##DK##x##DV##_##NAME(                                                \
            const T* q, const T* k, const T* v, long long sq, long long sk, long long sv,        \
            const T* ga, const T* gb, long long sa, long long sb, const float* A_log,            \
            const float* dt_bias, S* state, T* o, const int* qsl, const int* seq_lens,           \
            const int* slots, const int* state_out, int Hk, int Hv) { mt::pdl_enter();           \
        gdn_recurrent<T, DK, DV, true, S>(q, k, v, sq, sk, sv, nullptr, nullptr, state, o, qsl,  \
                                          seq_lens, slots, state_out, Hk, Hv, ga, gb, sa, sb,    \
                                          A_log, dt_bias);                                       \
        mt::pdl_exit();                                                                          \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(CNT, 1)                                          \
        gdn_chunked_##DK##x##DV##_##NAME(GDN_ARGS(T, S)) { mt::pdl_enter();                      \
        gdn_chunked<T, DK, DV, S>(GDN_PASS);                                                     \
        mt::pdl_exit();                                                                          \
    }

#define GDN_INST_ALL(T, S, NAME)   \
    GDN_INST(T, S, NAME, 16, 16)   \
    GDN_INST(T, S, NAME, 32, 32)   \
    GDN_INST(T, S, NAME, 64, 64)   \
    GDN_INST(T, S, NAME, 128, 128) \
    GDN_INST(T, S, NAME, 64, 128)  \
    GDN_INST(T, S, NAME, 128, 64)

GDN_INST_ALL(__nv_bfloat16, float, bf16)
GDN_INST_ALL(float, float, f32)
// 16-bit state pools serve the bf16 engine (the CUDA backend's activation dtype)
GDN_INST_ALL(__nv_bfloat16, __half, bf16_sf16)
GDN_INST_ALL(__nv_bfloat16, __nv_bfloat16, bf16_sbf16)

#define GATES_INST(T, SUF)                                                                        \
    extern "C" __global__ void gdn_gates_##SUF(const T* a, const T* b, long long sa, long long sb, \
                                               const float* A_log, const float* dt_bias,          \
                                               float* g, float* beta, int T_, int Hv) { mt::pdl_enter(); \
        gdn_gates<T>(a, b, sa, sb, A_log, dt_bias, g, beta, T_, Hv);                              \
        mt::pdl_exit();                                                                           \
    }
GATES_INST(__nv_bfloat16, bf16)
GATES_INST(float, f32)
