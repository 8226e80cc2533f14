// Gated DeltaNet elementwise stages: the causal depthwise conv1d (+ SiLU) with its rolling state,
// and the gated RMSNorm on the delta rule's output.
//
// Reference: metrale/backends/cpu.py (CpuOps.causal_conv1d / gated_rms_norm), which follows HF
// transformers' causal_conv1d_fn / causal_conv1d_update and Qwen3_5RMSNormGated. Tested in
// tests/test_cuda_gdn.py.
//
// gdn_conv4_<x>_<state>(x, sx, w, state, out, qsl, seq_lens, slots, state_out, B, C, seg)
//   x      T   [T, C]          token stride sx elements (may be a column slice of a projection)
//   w      f32 [C, K]          K = 4 (compile-time); w[:, K-1] multiplies the current token
//   state  S   [slots, C, K-1] row slots[i]: the last K-1 pre-activation inputs of sequence i,
//                              oldest first; read unless context_len == 0 (zeros), then replaced
//   out    T   [T, C]          silu(conv), contiguous
//   qsl    i32 [B+1], seq_lens i32 [B], slots i32 [B]
//   state_out i32 [T] or NULL  ForwardBatch.state_out (a speculative verify step): the window
//                              after token t (its K-1 inputs, oldest first) is also written to
//                              state[state_out[t]] when >= 0. Rows must be rows no sequence of
//                              the step works on (not in slots). NULL: no saves (decode graphs).
// Grid: x = channel blocks of 128, y = token segments of `seg` (>= K-1) tokens. Segment y belongs
// to the sequence i with the largest qsl[i]/seg + i <= y (no host-side lengths needed, so the
// same launch serves decode under a CUDA graph and varlen prefill); grid.y = T/seg + B.
// The thread of a sequence's first segment is the only one that reads the old state, and it
// also writes the new one (from x and the old state it holds), so there is no race.
// The state_out saves come from registers, never from the pool: the thread that computes token
// t holds the window after it (win[] once shifted: the inputs of positions t-K+2 .. t; those
// before the window's first token are old[], which that same thread, the first segment's, read
// at its start) and stores it right there, into a row nobody reads in this step. So a saved
// window is right whatever order the threads and the final write-back of slots[i] run in.
// Bytes: T*C*2*2 (x, out) + touched state rows*C*(K-1)*2*2 + C*K*4; FLOPs 2*K*T*C; with
// state_out + T*4 and C*(K-1)*sizeof(S) written per saved token.
//
// gated_rms_norm_<T>(x, z, zs, zh, w, out, rows, D, eps): out = x * rsqrt(mean(x^2) + eps) * w * silu(z),
//   x, out T [rows, D] contiguous; z T: row r = (token r / zh, head r % zh) at
//   z + (r / zh) * zs + (r % zh) * D (a column slice of the input projection, read in place);
//   w f32 [D]. One warp per row. Bytes rows*D*2*3.
#include "common.cuh"

namespace {

template <typename T, typename S, int K>
__device__ __forceinline__ void gdn_conv(const T* x, long long sx,
                                         const float* w, S* state,
                                         T* out, const int* qsl,
                                         const int* seq_lens, const int* slots,
                                         const int* state_out, int B, int C, int seg) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const int y = blockIdx.y;
    int lo = 0, hi = B - 1;  // largest i with qsl[i]/seg + i <= y
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (qsl[mid] / seg + mid <= y) lo = mid; else hi = mid - 1;
    }
    const int i = lo;
    const int s = y - (qsl[i] / seg + i);
    const int t0 = qsl[i], len = qsl[i + 1] - t0;
    if (s < 0 || s * seg >= len) return;
    const int ctx = seq_lens[i] - len;
    S* st = state + ((long long)slots[i] * C + c) * (K - 1);

    float wk[K];
#pragma unroll
    for (int j = 0; j < K; ++j) wk[j] = w[c * K + j];
    float old[K - 1];
#pragma unroll
    for (int j = 0; j < K - 1; ++j) old[j] = (s == 0 && ctx > 0) ? mt::to_f(st[j]) : 0.f;

    const int p0 = s * seg, p1 = min(len, p0 + seg);
    float win[K - 1];  // inputs at positions p0-(K-1) .. p0-1
#pragma unroll
    for (int j = 0; j < K - 1; ++j) {
        const int p = p0 - (K - 1) + j;
        win[j] = p >= 0 ? mt::to_f(x[(long long)(t0 + p) * sx + c]) : old[j];  // p < 0 only when p0 == 0
    }
    for (int p = p0; p < p1; ++p) {
        const float xv = mt::to_f(x[(long long)(t0 + p) * sx + c]);
        float acc = xv * wk[K - 1];
#pragma unroll
        for (int j = 0; j < K - 1; ++j) acc = fmaf(win[j], wk[j], acc);
        out[(long long)(t0 + p) * C + c] = mt::from_f<T>(mt::silu(acc));
#pragma unroll
        for (int j = 0; j < K - 2; ++j) win[j] = win[j + 1];
        win[K - 2] = xv;
        if (state_out != nullptr) {  // a verify step: the window after this token into its row
            const int row = state_out[t0 + p];
            if (row >= 0) {
                S* so = state + ((long long)row * C + c) * (K - 1);
#pragma unroll
                for (int j = 0; j < K - 1; ++j) so[j] = mt::from_f<S>(win[j]);
            }
        }
    }
    if (s == 0) {
#pragma unroll
        for (int j = 0; j < K - 1; ++j) {
            const int p = len - (K - 1) + j;
            float val = 0.f;  // old[K-1+p] without a run-time register index
#pragma unroll
            for (int jj = 0; jj < K - 1; ++jj) val = (jj == K - 1 + p) ? old[jj] : val;
            if (p >= 0) val = mt::to_f(x[(long long)(t0 + p) * sx + c]);
            st[j] = mt::from_f<S>(val);
        }
    }
}

template <typename T>
__device__ __forceinline__ void gated_rms_norm(const T* x, const T* z,
                                               long long zs, int zh,
                                               const float* w, T* out,
                                               int rows, int D, float eps) {
    const int row = blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const T* xr = x + (long long)row * D;
    const T* zr = z + (long long)(row / zh) * zs + (long long)(row % zh) * D;
    T* orow = out + (long long)row * D;
    float ss = 0.f;
    for (int d = lane; d < D; d += 32) {
        const float v = mt::to_f(xr[d]);
        ss += v * v;
    }
    const float r = rsqrtf(mt::warp_sum(ss) / (float)D + eps);
    for (int d = lane; d < D; d += 32)
        orow[d] = mt::from_f<T>(mt::to_f(xr[d]) * r * w[d] * mt::silu(mt::to_f(zr[d])));
}

}  // namespace

#define CONV_INST(T, S, SUF)                                                                   \
    extern "C" __global__ void __launch_bounds__(128) gdn_conv4_##SUF(                         \
        const T* x, long long sx, const float* w, S* state, T* out, const int* qsl,            \
        const int* seq_lens, const int* slots, const int* state_out, int B, int C, int seg) {  \
        mt::pdl_enter();                                                                       \
        gdn_conv<T, S, 4>(x, sx, w, state, out, qsl, seq_lens, slots, state_out, B, C, seg);   \
        mt::pdl_exit();                                                                        \
    }
CONV_INST(__nv_bfloat16, __nv_bfloat16, bf16_bf16)
CONV_INST(__nv_bfloat16, float, bf16_f32)
CONV_INST(float, float, f32_f32)

#define GRN_INST(T, SUF)                                                                       \
    extern "C" __global__ void __launch_bounds__(256) gated_rms_norm_##SUF(                    \
        const T* x, const T* z, long long zs, int zh, const float* w, T* out, int rows, int D, \
        float eps) { mt::pdl_enter();                                                          \
        gated_rms_norm<T>(x, z, zs, zh, w, out, rows, D, eps);                                 \
        mt::pdl_exit();                                                                        \
    }
GRN_INST(__nv_bfloat16, bf16)
GRN_INST(float, f32)
