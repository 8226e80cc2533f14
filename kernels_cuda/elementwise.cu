// Elementwise, norm, rotary and KV-write kernels of the CUDA backend.
//
// Reference: metrale/backends/cpu.py (the op of the same name, semantics in backends/base.py).
// Every kernel exists as <name>_bf16 and <name>_f32 (T = __nv_bfloat16 or float). Strides are
// in elements; the last dimension of every tensor is contiguous (the Python side copies
// anything else). "vector" paths move 16 bytes per thread and need every row start and stride
// aligned to 16 bytes: the host checks and picks the scalar kernel otherwise.
//
// embedding        ids int32 [T], table T[V, H] -> out T[T, H]. Ids outside [0, V) give zeros.
//                  Moves T*H*2*sizeof(T) bytes.
// rms_norm         x T[R, H] (row stride xs), residual T[R, H] or null (stride rs), w T[H]
//                  -> out T[R, H], res_out T[R, H] (when residual is given: r = x + residual,
//                  rounded to T, written to res_out; the norm is taken of the rounded r, as HF
//                  does). out = r * rsqrt(mean(r^2) + eps) * (offset + w), fp32 inside.
//                  One block per row; the row stays in registers (16-byte loads). Moves
//                  (2 or 4) * R*H*sizeof(T) bytes.
// rms_norm_parts2  the same with x given as 2 fp32 partials parts[2][R][H] (part stride ps): x is
//                  their sum in order, rounded to T once (a k-split GEMM's deferred reduction);
//                  vector path only (H % 8 == 0, 16-byte aligned). Moves (8 + 2 or 4) * R*H bytes.
// head_norm_rope   x T[T, Hh, D] (strides xs_t, xs_h) -> y T[T, Hh, D] (strides ys_t, ys_h;
//                  may alias x). Optional head RMSNorm (w T[D] or null) then optional NeoX
//                  rotate-half rotary on the first `rot` dims (positions int32 [T] or null,
//                  inv_freq fp32 [rot/2]). One warp per head vector, fp32 inside, D <= 512.
// qk_norm_rope_kv  the attention prologue in one launch: q T[T, Hq, D], k, v T[T, Hk, D]
//                  (strided views, last dim contiguous) -> q_out T[T, Hq, D] contiguous (head
//                  norm qw T[D] or null, rotary), k_cache row slot_mapping[t] = norm (kw) +
//                  rotary of k, v_cache row = v (negative slot: skipped). One warp per (token,
//                  head) of the Hq + Hk heads; the same math as head_norm_rope + write_kv.
// silu_mul         x T[R, 2I] ([gate | up], row stride xs) -> y T[R, I]: silu(gate) * up.
// sigmoid_mul      x, gate T[A, B, C] (strides (xa, xb), (ga, gb, gc); gc = 0 broadcasts one gate
//                  per row, e.g. a shared-expert gate [T, 1]) -> y T[A, B, C] contiguous:
//                  x * sigmoid(gate).
// write_kv         k, v T[T, Hk, D] (strides) -> k_cache, v_cache T[slots, Hk, D] at row
//                  slot_mapping[t] (int32; negative = padding token, skipped). Moves
//                  4 * T*Hk*D*sizeof(T) bytes.
// bias_add         y T[R, N] += b T[N] (in place, after a cuBLAS GEMM).
// copy_rows        rows of several arrays in one launch (a speculative verify restoring the
//                  accepted prefix's GDN state in every layer): for array a (base address
//                  ptrs[a], rows of row_words[a] 4-byte words) and pair r, row dst[r] = row
//                  src[r]. 16-byte accesses where a row is a multiple of 4 words (the base is
//                  a CuPy allocation: 256-byte aligned). grid (x: chunks of a row, y: pairs,
//                  z: arrays). Moves 2 * sum_a row_words[a] * 4 * R bytes; no FLOPs.
#include "common.cuh"

using mt::from_f;
using mt::to_f;
using mt::Vec16;

// ---------------------------------------------------------------------------------------------
template <typename T>
__device__ void embedding_impl(const int* ids, const T* table,
                               T* out, int H, long long V, int vec) {
    const int t = blockIdx.x;
    const long long id = ids[t];
    const bool ok = id >= 0 && id < V;
    T* dst = out + (long long)t * H;
    const T* src = table + (ok ? id : 0) * (long long)H;
    if (vec) {
        constexpr int N = Vec16<T>::N;
        const uint4* s = reinterpret_cast<const uint4*>(src);
        uint4* d = reinterpret_cast<uint4*>(dst);
        for (int i = threadIdx.x; i < H / N; i += blockDim.x)
            d[i] = ok ? s[i] : make_uint4(0, 0, 0, 0);
    } else {
        for (int i = threadIdx.x; i < H; i += blockDim.x) dst[i] = ok ? src[i] : from_f<T>(0.f);
    }
}

// ---------------------------------------------------------------------------------------------
// Vector path: each thread keeps up to MAXV 16-byte vectors of its row in registers.
// load_x(i): the row's i-th 16-byte vector of x (T), as stored or as summed partials.
template <typename T, int MAXV, typename LoadX>
__device__ __forceinline__ void rms_norm_vec_rows(LoadX load_x, const T* res, long long rs, const T* w,
                                                  T* out, T* res_out, int H, float eps, float offset) {
    constexpr int N = Vec16<T>::N;
    __shared__ float scratch[32];
    const long long row = blockIdx.x;
    const int nvec = H / N;
    const uint4* rr = res ? reinterpret_cast<const uint4*>(res + row * rs) : nullptr;
    float vals[MAXV][N];
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < MAXV; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i < nvec) {
            Vec16<T> a;
            a.u = load_x(i);
            if (rr) {
                Vec16<T> b, r;
                b.u = rr[i];
#pragma unroll
                for (int e = 0; e < N; ++e) r.v[e] = from_f<T>(to_f(a.v[e]) + to_f(b.v[e]));
                reinterpret_cast<uint4*>(res_out + row * H)[i] = r.u;
                a.u = r.u;
            }
#pragma unroll
            for (int e = 0; e < N; ++e) {
                vals[k][e] = to_f(a.v[e]);
                ss += vals[k][e] * vals[k][e];
            }
        }
    }
    // the weights are loaded before the reduction so their latency overlaps it
    const uint4* wv = reinterpret_cast<const uint4*>(w);
    uint4 wreg[MAXV];
#pragma unroll
    for (int k = 0; k < MAXV; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        wreg[k] = i < nvec ? wv[i] : make_uint4(0, 0, 0, 0);
    }
    ss = mt::block_sum(ss, scratch);
    const float inv = rsqrtf(ss / (float)H + eps);
    uint4* o = reinterpret_cast<uint4*>(out + row * H);
#pragma unroll
    for (int k = 0; k < MAXV; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i < nvec) {
            Vec16<T> wk, y;
            wk.u = wreg[k];
#pragma unroll
            for (int e = 0; e < N; ++e) y.v[e] = from_f<T>(vals[k][e] * inv * (offset + to_f(wk.v[e])));
            o[i] = y.u;
        }
    }
}

template <typename T, int MAXV>
__device__ void rms_norm_vec_impl(const T* x, long long xs, const T* res, long long rs, const T* w, T* out,
                                  T* res_out, int H, float eps, float offset) {
    const uint4* xr = reinterpret_cast<const uint4*>(x + (long long)blockIdx.x * xs);
    rms_norm_vec_rows<T, MAXV>([&](int i) { return xr[i]; }, res, rs, w, out, res_out, H, eps, offset);
}

// x given as S fp32 partial products (a k-split GEMM's output, metrale/backends/cuda/gemm/cublaslt.py
// ksplit_plan): parts[s][row][H] contiguous, part stride ps. x = the partials summed in order
// s = 0..S-1 in fp32 and rounded to T once (what the GEMM would have stored), then as above.
// S is a template argument so that every load of a thread's vectors is issued before the first
// add (a runtime loop over S serialised them: this kernel runs with few rows, latency-bound).
template <typename T, int MAXV, int S>
__device__ void rms_norm_parts_impl(const float* parts, long long ps, const T* res, long long rs,
                                    const T* w, T* out, T* res_out, int H, float eps, float offset) {
    constexpr int N = Vec16<T>::N;
    const float* xr = parts + (long long)blockIdx.x * H;
    auto load_x = [&](int i) {
        float4 v[S][N / 4];
#pragma unroll
        for (int sl = 0; sl < S; ++sl)
#pragma unroll
            for (int q = 0; q < N / 4; ++q) v[sl][q] = reinterpret_cast<const float4*>(xr + sl * ps + (long long)i * N)[q];
        Vec16<T> a;
#pragma unroll
        for (int q = 0; q < N / 4; ++q) {
            float4 acc = v[0][q];
#pragma unroll
            for (int sl = 1; sl < S; ++sl) {
                acc.x += v[sl][q].x;
                acc.y += v[sl][q].y;
                acc.z += v[sl][q].z;
                acc.w += v[sl][q].w;
            }
            a.v[4 * q] = from_f<T>(acc.x);
            a.v[4 * q + 1] = from_f<T>(acc.y);
            a.v[4 * q + 2] = from_f<T>(acc.z);
            a.v[4 * q + 3] = from_f<T>(acc.w);
        }
        return a.u;
    };
    rms_norm_vec_rows<T, MAXV>(load_x, res, rs, w, out, res_out, H, eps, offset);
}

// Scalar path (any H / alignment): two passes, the second re-reads the (rounded) row.
template <typename T>
__device__ void rms_norm_scalar_impl(const T* x, long long xs, const T* res, long long rs,
                                     const T* w, T* out, T* res_out, int H,
                                     float eps, float offset) {
    __shared__ float scratch[32];
    const long long row = blockIdx.x;
    const T* xr = x + row * xs;
    float ss = 0.f;
    for (int i = threadIdx.x; i < H; i += blockDim.x) {
        float v = to_f(xr[i]);
        if (res) {
            const T r = from_f<T>(v + to_f(res[row * rs + i]));
            res_out[row * H + i] = r;
            v = to_f(r);
        }
        ss += v * v;
    }
    ss = mt::block_sum(ss, scratch);
    const float inv = rsqrtf(ss / (float)H + eps);
    for (int i = threadIdx.x; i < H; i += blockDim.x) {
        // each thread re-reads only elements it wrote itself: no barrier needed
        const float v = res ? to_f(res_out[row * H + i]) : to_f(xr[i]);
        out[row * H + i] = from_f<T>(v * inv * (offset + to_f(w[i])));
    }
}

// ---------------------------------------------------------------------------------------------
// One head vector, one warp: optional RMSNorm (w non-null) then optional rotary (has_pos).
// Shared by head_norm_rope and qk_norm_rope_kv so the fused op is bit-identical to the unfused
// ops. buf: this warp's D floats of shared memory. yp may alias xp.
template <typename T>
__device__ __forceinline__ void norm_rope_head(const T* xp, T* yp, float* buf, int lane, int D,
                                               const T* w, float eps, float offset,
                                               bool has_pos, float pos, const float* inv_freq,
                                               int rot) {
    float ss = 0.f;
    for (int i = lane; i < D; i += 32) {
        const float v = to_f(xp[i]);
        buf[i] = v;
        ss += v * v;
    }
    if (w) {
        ss = mt::warp_sum(ss);
        const float inv = rsqrtf(ss / (float)D + eps);
        for (int i = lane; i < D; i += 32) {
            float v = buf[i] * inv * (offset + to_f(w[i]));
            if (has_pos) v = to_f(from_f<T>(v));  // HF rounds the normed head before rotary
            buf[i] = v;
        }
    }
    __syncwarp();
    const int half = rot >> 1;
    for (int i = lane; i < D; i += 32) {
        float v = buf[i];
        if (has_pos && i < rot) {
            const int j = i < half ? i : i - half;
            float s, c;
            sincosf(pos * inv_freq[j], &s, &c);
            v = i < half ? buf[i] * c - buf[i + half] * s : buf[i] * c + buf[j] * s;
        }
        yp[i] = from_f<T>(v);
    }
}

template <typename T>
__device__ void head_norm_rope_impl(const T* x, long long xs_t, long long xs_h, T* y, long long ys_t,
                                    long long ys_h, int ntok, int nheads, int D,
                                    const T* w, float eps, float offset,
                                    const int* positions,
                                    const float* inv_freq, int rot) {
    extern __shared__ float hbuf[];  // [warps][D]
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const long long item = (long long)blockIdx.x * (blockDim.x >> 5) + warp;
    if (item >= (long long)ntok * nheads) return;  // whole warp leaves together
    const long long t = item / nheads;
    const int h = (int)(item % nheads);
    const float pos = positions ? (float)__ldcg(positions + t) : 0.f;   // coherent (common.cuh: PDL)
    norm_rope_head<T>(x + t * xs_t + h * xs_h, y + t * ys_t + h * ys_h, hbuf + warp * D, lane, D, w, eps,
                      offset, positions != nullptr, pos, inv_freq, rot);
}

// The attention prologue in one launch: one warp per (token, head) of the Hq + Hk heads. q head:
// norm (qw) + rotary -> q_out [T, Hq, D] contiguous. k head: norm (kw) + rotary -> k_cache row
// slot_mapping[t], and v head h copied raw to v_cache (skipped for a negative slot).
template <typename T>
__device__ void qk_norm_rope_kv_impl(const T* q, long long qs_t, long long qs_h,
                                     const T* k, long long ks_t, long long ks_h,
                                     const T* v, long long vs_t, long long vs_h,
                                     T* q_out, T* k_cache, T* v_cache,
                                     const int* slot_mapping, int ntok, int Hq, int Hk, int D,
                                     const T* qw, const T* kw, float eps,
                                     float offset, const int* positions,
                                     const float* inv_freq, int rot) {
    extern __shared__ float hbuf[];  // [warps][D]
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nh = Hq + Hk;
    const long long item = (long long)blockIdx.x * (blockDim.x >> 5) + warp;
    if (item >= (long long)ntok * nh) return;  // whole warp leaves together
    const long long t = item / nh;
    const int h = (int)(item % nh);
    float* buf = hbuf + warp * D;
    const float pos = positions ? (float)__ldcg(positions + t) : 0.f;   // coherent (common.cuh: PDL)
    if (h < Hq) {
        norm_rope_head<T>(q + t * qs_t + h * qs_h, q_out + (t * Hq + h) * D, buf, lane, D, qw, eps, offset,
                          positions != nullptr, pos, inv_freq, rot);
        return;
    }
    const int hk = h - Hq;
    const long long slot = slot_mapping[t];
    if (slot < 0) return;  // padding token
    const long long dst = (slot * Hk + hk) * D;
    norm_rope_head<T>(k + t * ks_t + hk * ks_h, k_cache + dst, buf, lane, D, kw, eps, offset,
                      positions != nullptr, pos, inv_freq, rot);
    const T* vp = v + t * vs_t + hk * vs_h;
    for (int i = lane; i < D; i += 32) v_cache[dst + i] = vp[i];
}

// ---------------------------------------------------------------------------------------------
template <typename T>
__device__ void silu_mul_impl(const T* x, long long xs, T* y, long long rows,
                              int I, int vec) {
    constexpr int N = Vec16<T>::N;
    const long long stride = (long long)gridDim.x * blockDim.x;
    if (vec) {
        const int nv = I / N;
        for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < rows * nv; idx += stride) {
            const long long r = idx / nv;
            const int c = (int)(idx % nv);
            Vec16<T> g, u, o;
            g.u = reinterpret_cast<const uint4*>(x + r * xs)[c];
            u.u = reinterpret_cast<const uint4*>(x + r * xs + I)[c];
#pragma unroll
            for (int e = 0; e < N; ++e) o.v[e] = from_f<T>(mt::silu(to_f(g.v[e])) * to_f(u.v[e]));
            reinterpret_cast<uint4*>(y + r * I)[c] = o.u;
        }
    } else {
        for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < rows * I; idx += stride) {
            const long long r = idx / I;
            const int c = (int)(idx % I);
            y[r * I + c] = from_f<T>(mt::silu(to_f(x[r * xs + c])) * to_f(x[r * xs + I + c]));
        }
    }
}

template <typename T>
__device__ void sigmoid_mul_impl(const T* x, long long xa, long long xb,
                                 const T* g, long long ga, long long gb, long long gc,
                                 T* y, long long A, int B, int C, int vec) {
    constexpr int N = Vec16<T>::N;
    const long long stride = (long long)gridDim.x * blockDim.x;
    const int nc = vec ? C / N : C;
    const long long total = A * B * nc;
    for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += stride) {
        const int c = (int)(idx % nc);
        const long long ab = idx / nc;
        const int b = (int)(ab % B);
        const long long a = ab / B;
        const T* xp = x + a * xa + b * xb;
        const T* gp = g + a * ga + b * gb;
        T* yp = y + ab * C;
        if (vec) {
            Vec16<T> xv, gv, o;
            xv.u = reinterpret_cast<const uint4*>(xp)[c];
            gv.u = reinterpret_cast<const uint4*>(gp)[c];
#pragma unroll
            for (int e = 0; e < N; ++e) o.v[e] = from_f<T>(to_f(xv.v[e]) * mt::sigmoid(to_f(gv.v[e])));
            reinterpret_cast<uint4*>(yp)[c] = o.u;
        } else {
            yp[c] = from_f<T>(to_f(xp[c]) * mt::sigmoid(to_f(gp[c * gc])));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// One thread per 16-byte chunk (vec) or element of k and v. D * sizeof(T) % 16 == 0 for vec.
template <typename T>
__device__ void write_kv_impl(const T* k, long long ks_t, long long ks_h,
                              const T* v, long long vs_t, long long vs_h,
                              T* k_cache, T* v_cache,
                              const int* slot_mapping, long long ntok, int Hk, int D, int vec) {
    constexpr int N = Vec16<T>::N;
    const int nc = vec ? D / N : D;
    const long long total = ntok * Hk * nc;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += stride) {
        const int c = (int)(idx % nc);
        const long long th = idx / nc;
        const int h = (int)(th % Hk);
        const long long t = th / Hk;
        const long long slot = slot_mapping[t];
        if (slot < 0) continue;
        const long long dst = (slot * Hk + h) * D;
        if (vec) {
            reinterpret_cast<uint4*>(k_cache + dst)[c] = reinterpret_cast<const uint4*>(k + t * ks_t + h * ks_h)[c];
            reinterpret_cast<uint4*>(v_cache + dst)[c] = reinterpret_cast<const uint4*>(v + t * vs_t + h * vs_h)[c];
        } else {
            k_cache[dst + c] = k[t * ks_t + h * ks_h + c];
            v_cache[dst + c] = v[t * vs_t + h * vs_h + c];
        }
    }
}

template <typename T>
__device__ void bias_add_impl(T* y, const T* b, long long rows, int n) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < rows * n; idx += stride)
        y[idx] = from_f<T>(to_f(y[idx]) + to_f(b[idx % n]));
}

// ---------------------------------------------------------------------------------------------
// extern "C" entry points, one per storage type.
#define MT_ELEMENTWISE(SUF, T)                                                                        \
    extern "C" __global__ void embedding_##SUF(const int* ids, const T* table, T* out, int H,          \
                                               long long V, int vec) { mt::pdl_enter();                \
        embedding_impl<T>(ids, table, out, H, V, vec);                                                 \
        mt::pdl_exit();                                                                                \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(1024) rms_norm_vec_##SUF(                            \
        const T* x, long long xs, const T* res, long long rs, const T* w, T* out, T* res_out, int H,   \
        float eps, float offset) { mt::pdl_enter();                                                    \
        rms_norm_vec_impl<T, 4>(x, xs, res, rs, w, out, res_out, H, eps, offset);                      \
        mt::pdl_exit();                                                                                \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(1024) rms_norm_parts2_##SUF(                         \
        const float* parts, long long ps, const T* res, long long rs, const T* w, T* out, T* res_out,   \
        int H, float eps, float offset) { mt::pdl_enter();                                             \
        rms_norm_parts_impl<T, 4, 2>(parts, ps, res, rs, w, out, res_out, H, eps, offset);             \
        mt::pdl_exit();                                                                                \
    }                                                                                                  \
    extern "C" __global__ void rms_norm_scalar_##SUF(const T* x, long long xs, const T* res,           \
                                                     long long rs, const T* w, T* out, T* res_out,     \
                                                     int H, float eps, float offset) { mt::pdl_enter(); \
        rms_norm_scalar_impl<T>(x, xs, res, rs, w, out, res_out, H, eps, offset);                      \
        mt::pdl_exit();                                                                                \
    }                                                                                                  \
    extern "C" __global__ void head_norm_rope_##SUF(                                                  \
        const T* x, long long xs_t, long long xs_h, T* y, long long ys_t, long long ys_h, int ntok,    \
        int nheads, int D, const T* w, float eps, float offset, const int* positions,                  \
        const float* inv_freq, int rot) { mt::pdl_enter();                                             \
        head_norm_rope_impl<T>(x, xs_t, xs_h, y, ys_t, ys_h, ntok, nheads, D, w, eps, offset,          \
                               positions, inv_freq, rot);                                              \
        mt::pdl_exit();                                                                                \
    }                                                                                                  \
    extern "C" __global__ void qk_norm_rope_kv_##SUF(                                                 \
        const T* q, long long qs_t, long long qs_h, const T* k, long long ks_t, long long ks_h,        \
        const T* v, long long vs_t, long long vs_h, T* q_out, T* k_cache, T* v_cache,                  \
        const int* slot_mapping, int ntok, int Hq, int Hk, int D, const T* qw, const T* kw, float eps, \
        float offset, const int* positions, const float* inv_freq, int rot) { mt::pdl_enter();         \
        qk_norm_rope_kv_impl<T>(q, qs_t, qs_h, k, ks_t, ks_h, v, vs_t, vs_h, q_out, k_cache, v_cache,  \
                                slot_mapping, ntok, Hq, Hk, D, qw, kw, eps, offset, positions,         \
                                inv_freq, rot);                                                        \
        mt::pdl_exit();                                                                                \
    }                                                                                                  \
    extern "C" __global__ void silu_mul_##SUF(const T* x, long long xs, T* y, long long rows, int I,   \
                                              int vec) { mt::pdl_enter();                              \
        silu_mul_impl<T>(x, xs, y, rows, I, vec);                                                      \
        mt::pdl_exit();                                                                                \
    }                                                                                                  \
    extern "C" __global__ void sigmoid_mul_##SUF(const T* x, long long xa, long long xb, const T* g,   \
                                                 long long ga, long long gb, long long gc, T* y,       \
                                                 long long A, int B, int C, int vec) { mt::pdl_enter(); \
        sigmoid_mul_impl<T>(x, xa, xb, g, ga, gb, gc, y, A, B, C, vec);                                \
        mt::pdl_exit();                                                                                \
    }                                                                                                  \
    extern "C" __global__ void write_kv_##SUF(const T* k, long long ks_t, long long ks_h, const T* v,  \
                                              long long vs_t, long long vs_h, T* k_cache, T* v_cache,  \
                                              const int* slot_mapping, long long ntok, int Hk, int D,  \
                                              int vec) { mt::pdl_enter();                              \
        write_kv_impl<T>(k, ks_t, ks_h, v, vs_t, vs_h, k_cache, v_cache, slot_mapping, ntok, Hk, D,    \
                         vec);                                                                         \
        mt::pdl_exit();                                                                                \
    }                                                                                                  \
    extern "C" __global__ void bias_add_##SUF(T* y, const T* b, long long rows, int n) { mt::pdl_enter(); \
        bias_add_impl<T>(y, b, rows, n);                                                               \
        mt::pdl_exit();                                                                                \
    }

MT_ELEMENTWISE(bf16, __nv_bfloat16)
MT_ELEMENTWISE(f32, float)

// ---------------------------------------------------------------------------------------------
extern "C" __global__ void copy_rows(const unsigned long long* ptrs, const long long* row_words,
                                     const int* src, const int* dst, int A, int R) {
    mt::pdl_enter();
    const int r = blockIdx.y, a = blockIdx.z;
    if (r < R && a < A) {
        const long long n = row_words[a];
        unsigned* base = reinterpret_cast<unsigned*>(ptrs[a]);
        const unsigned* from = base + (long long)src[r] * n;
        unsigned* to = base + (long long)dst[r] * n;
        const long long stride = (long long)gridDim.x * blockDim.x;
        const long long i0 = (long long)blockIdx.x * blockDim.x + threadIdx.x;
        if (n % 4 == 0) {
            const uint4* f4 = reinterpret_cast<const uint4*>(from);
            uint4* t4 = reinterpret_cast<uint4*>(to);
            for (long long i = i0; i < n / 4; i += stride) t4[i] = f4[i];
        } else {
            for (long long i = i0; i < n; i += stride) to[i] = from[i];
        }
    }
    mt::pdl_exit();
}
