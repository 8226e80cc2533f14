// Token sampling on the GPU: penalties, temperature, top-k, top-p, min-p, top-n-sigma, seeded
// Gumbel-max, greedy argmax, optional logprobs. Driven by metrale/backends/cuda/sampling.py
// (GpuSampler), tested in tests/test_cuda_sampling.py against numpy re-statements of the same
// rules (metrale/sampling.py SamplingParams semantics).
//
// Per-row parameters: prm i32 [B, 16] (floats stored as their bits):
//   f[0] temperature (<= 0: greedy)  f[1] top_p  f[2] min_p  f[3] presence  f[4] frequency
//   f[5] repetition  f[6] top_n_sigma  f[7] adaptive entropy threshold in nats (0 = off)
//   i[8] top_k (0 = off)  i[9] seed lo  i[10] seed hi  i[11] step  i[12] slot (row of the count
//   tables, -1 = none)  i[13] penalties on  i[14] logprobs k (-1 = off)
//
// sample_prepare_<T>(logits T [B, V] row stride ld, prm, counts i32 [slots, V], prompt u8
//   [slots, V], work f32 [B, V], V): work = penalised logits / temperature. Repetition penalty
//   on tokens seen in prompt or output (l > 0 ? l / r : l * r), then l -= frequency * count +
//   presence * (count > 0) (output tokens only). Grid (V / 1024, B). Bytes B*V*(2 + 4 [+5]).
// sample_select(work, V, prm, counts, out i32 [B, OW]): one CTA of 1024 threads per row.
//   greedy: argmax (lowest index on ties). Otherwise keep l >= max(tau_sigma, tau_k, tau_p,
//   tau_min) (metrale/sampling.py's order) where tau_sigma = max - n * std (population std of
//   the finite entries, two passes), tau_k = k-th largest value (radix select on the
//   order-preserving bits), tau_p = smallest value of the shortest prefix (by value) of the set
//   kept by top-n-sigma and top-k whose softmax mass reaches top_p (radix select on 2^40-scaled
//   fixed-point mass: deterministic), tau_min = max + log(min_p). Adaptive rows (f[7] > 0) whose
//   kept set has entropy < f[7] nats take the argmax. Otherwise Gumbel-max: argmax(l + G),
//   G = -log(E), E = -log(u), u = (top 23 bits + 0.5) / 2^23 from Philox4x32-10 keyed by
//   (seed), counter (v/4, step), so u < 1 and E > 0 (see gumbel()): the same (seed, step)
//   always gives the same token. out[r, 0] = token;
//   counts[slot, token] += 1. Reads the row 2 (greedy) to ~12 (top-k and top-p) times, from L2.
// sample_logprobs_<T>(logits, ld, V, prm, out, OW, K): log_softmax of the RAW logits (the model's
//   distribution, before penalties and temperature): out[r,1] = logprob of the token,
//   out[r, 2 .. 2+K) = top-K ids, out[r, 2+K .. 2+2K) = their logprobs (float bits),
//   ordered by (value desc, id asc).
// grammar_mask_<T>(logits T [B, V] row stride ld, rows i32 [R], bits i32 [R, W], W, V): structured
//   output (metrale/grammar.py): logits[rows[i], v] = -inf where bit v % 32 of bits[i, v / 32] is
//   0 (llguidance's packed layout), in place, before sample_prepare (so the logprobs are of the
//   masked logits too). Grid (ceil(V / 1024), R) x 256 threads, 4 tokens each. Bytes R * V *
//   (1/8 + sizeof(T) when masked). Reference: metrale.grammar.apply_token_bitmask
//   (tests/test_gpu_grammar.py).
#include "common.cuh"

namespace {

constexpr int SNT = 1024;

__device__ __forceinline__ float pf(const int* prm, int i) { return __int_as_float(prm[i]); }

__device__ __forceinline__ unsigned key_of(float f) {  // order-preserving bits
    const unsigned u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float float_of(unsigned k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

__device__ __forceinline__ uint4 philox(uint4 c, uint2 key) {
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        const unsigned hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
        const unsigned hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
        c = make_uint4(hi1 ^ c.y ^ key.x, lo1, hi0 ^ c.w ^ key.y, lo0);
        key.x += 0x9E3779B9u;
        key.y += 0xBB67AE85u;
    }
    return c;
}
// Gumbel noise from the top 23 random bits: u = (b + 0.5) / 2^23, exact in fp32, in
// [2^-24, 1 - 2^-24], so E = -log(u) is never 0 (which would make G = -log(E) = +inf and pick a
// uniformly random token; 24 bits + 0.5 rounded u up to 1.0 once in 2^24 tokens). G lies in
// [-2.81, 16.6]: a token more than 19.4 below the row's top logit (p < 4e-9) is never drawn.
__device__ __forceinline__ float gumbel(unsigned bits) {
    const float u = ((float)(bits >> 9) + 0.5f) * (1.0f / 8388608.0f);
    return -logf(-logf(u));
}

struct ArgMax { float v; int i; };
__device__ __forceinline__ ArgMax better(ArgMax a, ArgMax b) {
    if (b.v > a.v || (b.v == a.v && b.i < a.i)) return b;
    return a;
}
// Block argmax (lowest index on ties); every thread gets the result.
__device__ __forceinline__ ArgMax block_argmax(ArgMax a, float* sv, int* si) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        ArgMax b{__shfl_xor_sync(0xffffffffu, a.v, o), __shfl_xor_sync(0xffffffffu, a.i, o)};
        a = better(a, b);
    }
    __syncthreads();
    if (lane == 0) { sv[warp] = a.v; si[warp] = a.i; }
    __syncthreads();
    a = ArgMax{sv[lane], si[lane]};  // SNT == 1024: 32 warps
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        ArgMax b{__shfl_xor_sync(0xffffffffu, a.v, o), __shfl_xor_sync(0xffffffffu, a.i, o)};
        a = better(a, b);
    }
    return a;
}
__device__ __forceinline__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = mt::warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    return mt::warp_max(scratch[lane]);
}

template <typename T>
__device__ __forceinline__ void sample_prepare(const T* logits, long long ld,
                                               const int* prm_all,
                                               const int* counts,
                                               const unsigned char* prompt,
                                               float* work, int V) {
    const int r = blockIdx.y;
    const int* prm = prm_all + r * 16;
    const float temp = pf(prm, 0);
    const float inv_t = temp > 0.f ? 1.f / temp : 1.f;
    const bool pen = prm[13] != 0 && prm[12] >= 0 && counts != nullptr;
    const float pres = pf(prm, 3), freq = pf(prm, 4), rep = pf(prm, 5);
    const long long srow = (long long)prm[12] * V;
    for (int v = blockIdx.x * blockDim.x + threadIdx.x; v < V; v += gridDim.x * blockDim.x) {
        float l = mt::to_f(logits[r * ld + v]);
        if (pen) {
            const int c = counts[srow + v];
            const bool seen = c > 0 || (prompt != nullptr && prompt[srow + v] != 0);
            if (rep != 1.f && seen) l = l > 0.f ? l / rep : l * rep;
            l -= freq * (float)c + (c > 0 ? pres : 0.f);
        }
        work[(long long)r * V + v] = l * inv_t;
    }
}

// Radix select over the keys of `row` that are >= lo_key: the key of the element at rank
// `target` (1-based, descending) by count (MASS = false) or the key where the descending
// cumulative fixed-point mass first reaches `target` (MASS = true).
template <bool MASS>
__device__ unsigned radix_select(const float* row, int V, unsigned lo_key, float m, float invz,
                                 unsigned long long target, unsigned long long* hist,
                                 unsigned* shared_prefix, unsigned long long* shared_target) {
    unsigned prefix = 0, pmask = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += SNT) hist[i] = 0ull;
        __syncthreads();
        for (int v = threadIdx.x; v < V; v += SNT) {
            const float l = row[v];
            const unsigned key = key_of(l);
            if (key < lo_key || (key & pmask) != prefix || l != l) continue;
            const unsigned bin = (key >> shift) & 255u;
            if (MASS) {
                const unsigned long long w =
                    (unsigned long long)(expf(l - m) * invz * 1099511627776.0f);  // 2^40
                if (w) atomicAdd(&hist[bin], w);
            } else {
                atomicAdd(&hist[bin], 1ull);
            }
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            unsigned long long acc = 0;
            int b = 255;
            for (; b > 0; --b) {
                if (acc + hist[b] >= target) break;
                acc += hist[b];
            }
            *shared_prefix = prefix | ((unsigned)b << shift);
            *shared_target = target - acc;
        }
        __syncthreads();
        prefix = *shared_prefix;
        target = *shared_target;
        pmask |= 255u << shift;
        __syncthreads();
    }
    return prefix;
}

__device__ void sample_select(const float* work, int V, const int* prm_all,
                              int* counts, int* out, int OW) {
    __shared__ float sv[32];
    __shared__ int si[32];
    __shared__ unsigned long long hist[256];
    __shared__ unsigned sp;
    __shared__ unsigned long long st;
    const int r = blockIdx.x, tid = threadIdx.x;
    const int* prm = prm_all + r * 16;
    const float* row = work + (long long)r * V;
    int token;
    if (pf(prm, 0) <= 0.f) {
        ArgMax a{-MT_INF, V};
        for (int v = tid; v < V; v += SNT) a = better(a, ArgMax{row[v], v});
        token = block_argmax(a, sv, si).i;
    } else {
        float m = -MT_INF;
        for (int v = tid; v < V; v += SNT) m = fmaxf(m, row[v]);
        m = block_max(m, sv);
        float thr = -MT_INF;
        const float min_p = pf(prm, 2), top_p = pf(prm, 1), nsig = pf(prm, 6);
        const int top_k = prm[8];
        if (min_p > 0.f) thr = fmaxf(thr, m + logf(min_p));
        unsigned lo_key = 0;
        if (nsig > 0.f) {  // first, as on the CPU: top-k and top-p see its survivors only
            float s1 = 0.f, n = 0.f;
            for (int v = tid; v < V; v += SNT) {
                const float l = row[v];
                if (isfinite(l)) { s1 += l; n += 1.f; }
            }
            s1 = mt::block_sum(s1, sv);
            n = mt::block_sum(n, sv);
            const float mean = s1 / n;
            float s2 = 0.f;
            for (int v = tid; v < V; v += SNT) {
                const float d = row[v] - mean;
                if (isfinite(row[v])) s2 += d * d;
            }
            s2 = mt::block_sum(s2, sv);
            const float tau = m - nsig * sqrtf(s2 / n);
            thr = fmaxf(thr, tau);
            lo_key = key_of(tau == 0.f ? -0.f : tau);  // keys: -0 sorts below +0
        }
        if (top_k > 0 && top_k < V) {
            lo_key = max(lo_key, radix_select<false>(row, V, lo_key, m, 1.f,
                                                      (unsigned long long)top_k, hist, &sp, &st));
        }
        if (top_p < 1.f) {
            float z = 0.f;
            for (int v = tid; v < V; v += SNT) {
                const float l = row[v];
                if (key_of(l) >= lo_key) z += expf(l - m);
            }
            z = mt::block_sum(z, sv);
            unsigned long long target =
                (unsigned long long)(fmaxf(top_p, 0.f) * 1099511627776.0f);
            if (target == 0) target = 1;
            const unsigned kp = radix_select<true>(row, V, lo_key, m, 1.f / z, target, hist, &sp, &st);
            lo_key = max(lo_key, kp);
        }
        if (lo_key) thr = fmaxf(thr, float_of(lo_key));
        const float gate = pf(prm, 7);
        bool greedy = false;
        if (gate > 0.f) {  // adaptive: entropy of the kept set, H = log Z - sum(e * (l - m)) / Z
            float z = 0.f, zl = 0.f;
            for (int v = tid; v < V; v += SNT) {
                const float l = row[v];
                if (l >= thr && l > -MT_INF) {
                    const float e = expf(l - m);
                    z += e;
                    zl += e * (l - m);
                }
            }
            z = mt::block_sum(z, sv);
            zl = mt::block_sum(zl, sv);
            greedy = logf(z) - zl / z < gate;
        }
        // Gumbel-max over the kept set.
        const uint2 key = make_uint2((unsigned)prm[9], (unsigned)prm[10]);
        const unsigned step = (unsigned)prm[11];
        ArgMax a{-MT_INF, V};
        for (int base = greedy ? V : tid * 4; base < V; base += SNT * 4) {
            const uint4 rnd = philox(make_uint4((unsigned)(base >> 2), step, 0u, 0u), key);
            const unsigned rr[4] = {rnd.x, rnd.y, rnd.z, rnd.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int v = base + j;
                if (v < V) {
                    const float l = row[v];
                    if (l >= thr && l > -MT_INF) a = better(a, ArgMax{l + gumbel(rr[j]), v});
                }
            }
        }
        a = block_argmax(a, sv, si);
        token = a.i < V ? a.i : 0;
        if (a.i >= V) {  // adaptive greedy, or nothing finite survived: the argmax
            ArgMax b{-MT_INF, V};
            for (int v = tid; v < V; v += SNT) b = better(b, ArgMax{row[v], v});
            b = block_argmax(b, sv, si);
            token = b.i < V ? b.i : 0;
        }
    }
    if (tid == 0) {
        out[r * OW] = token;
        if (counts != nullptr && prm[12] >= 0) counts[(long long)prm[12] * V + token] += 1;
    }
}

template <typename T>
__device__ void sample_logprobs(const T* logits, long long ld, int V,
                                const int* prm_all, int* out, int OW,
                                int K) {
    __shared__ float sv[32];
    __shared__ int si[32];
    const int r = blockIdx.x, tid = threadIdx.x;
    const int* prm = prm_all + r * 16;
    if (prm[14] < 0) return;
    const T* row = logits + r * ld;
    float m = -MT_INF;
    for (int v = tid; v < V; v += SNT) m = fmaxf(m, mt::to_f(row[v]));
    m = block_max(m, sv);
    float z = 0.f;
    for (int v = tid; v < V; v += SNT) z += expf(mt::to_f(row[v]) - m);
    z = mt::block_sum(z, sv);
    const float lse = m + logf(z);
    const int token = out[r * OW];
    if (tid == 0) out[r * OW + 1] = __float_as_int(mt::to_f(row[token]) - lse);
    const int kr = min(prm[14], K);
    ArgMax prev{MT_INF, -1};
    for (int j = 0; j < K; ++j) {
        ArgMax a{-MT_INF, V};
        if (j < kr) {
            for (int v = tid; v < V; v += SNT) {
                const float l = mt::to_f(row[v]);
                const bool after = l < prev.v || (l == prev.v && v > prev.i);
                if (after) a = better(a, ArgMax{l, v});
            }
        }
        a = block_argmax(a, sv, si);
        if (tid == 0) {
            out[r * OW + 2 + j] = j < kr ? a.i : -1;
            out[r * OW + 2 + K + j] = __float_as_int(j < kr ? a.v - lse : -MT_INF);
        }
        prev = a;
    }
}

}  // namespace

// (SNT, 1): one 1024-thread CTA per SM (a row each; B <= 132 fills the H200 once) gives ptxas 64
// registers; without the 1 it held 32 and spilled the kept-set thresholds.
extern "C" __global__ void __launch_bounds__(SNT, 1) sample_select_f32(const float* work, int V,
                                                                    const int* prm, int* counts,
                                                                    int* out, int OW) { mt::pdl_enter();
    sample_select(work, V, prm, counts, out, OW);
    mt::pdl_exit();
}

template <typename T>
__device__ __forceinline__ void grammar_mask(T* logits, long long ld, const int* rows,
                                             const int* bits, int W, int V) {
    const unsigned* b = reinterpret_cast<const unsigned*>(bits) + (long long)blockIdx.y * W;
    T* row = logits + (long long)rows[blockIdx.y] * ld;
    const int stride = gridDim.x * blockDim.x;
    for (int v = blockIdx.x * blockDim.x + threadIdx.x; v < V; v += stride) {
        if (!((b[v >> 5] >> (v & 31)) & 1u)) row[v] = mt::from_f<T>(-INFINITY);
    }
}

#define SAMPLE_INST(T, SUF)                                                                     \
    extern "C" __global__ void __launch_bounds__(256) sample_prepare_##SUF(                     \
        const T* logits, long long ld, const int* prm, const int* counts,                       \
        const unsigned char* prompt, float* work, int V) { mt::pdl_enter();                     \
        sample_prepare<T>(logits, ld, prm, counts, prompt, work, V);                            \
        mt::pdl_exit();                                                                         \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(SNT) sample_logprobs_##SUF(                    \
        const T* logits, long long ld, int V, const int* prm, int* out, int OW, int K) { mt::pdl_enter(); \
        sample_logprobs<T>(logits, ld, V, prm, out, OW, K);                                     \
        mt::pdl_exit();                                                                         \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(256) grammar_mask_##SUF(                       \
        T* logits, long long ld, const int* rows, const int* bits, int W, int V) { mt::pdl_enter(); \
        grammar_mask<T>(logits, ld, rows, bits, W, V);                                          \
        mt::pdl_exit();                                                                         \
    }
SAMPLE_INST(__nv_bfloat16, bf16)
SAMPLE_INST(float, f32)
