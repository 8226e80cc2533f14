// The write path of quantized KV (`--kv-cache-dtype fp8`): new K or V vectors -> the byte pool of
// one side of one attention layer, in the layout of metrale/cache/kv_dtypes.py (read by the
// `_fp8` kernels of attention.cu).
//
// kv_write_fp8_d<D>(x, xs_t, xs_h, slot_mapping, pool, block_bytes, scale_off, Hk, block_size)
//   x             bf16 [ntok, Hk, D], token stride xs_t, head stride xs_h (elements; last dim
//                 contiguous): K after its norm and rope, or V.
//   slot_mapping  int32 [ntok]: the token's cache slot (block * block_size + offset); < 0 marks a
//                 padding token (nothing written).
//   pool          uint8 [num_blocks, block_bytes]: block blk holds the e4m3 values of vector
//                 (t, h) at blk * block_bytes + (t * Hk + h) * D and its fp32 scale at
//                 blk * block_bytes + scale_off + (t * Hk + h) * 4.
// Numerics (the CPU spec, kv_dtypes._fp8_quantize, bit for bit): scale = amax(|x|) / 448 in fp32
// (IEEE division), values = e4m3(clamp(x / s, +-448)) rounded to nearest even, s = scale or 1 for
// a zero vector (then every value is 0 and the scale 0).
// Grid (ntok, Hk), one warp per vector, D / 32 elements per lane (D = 64, 128, 256).
// Bytes: read ntok * Hk * D * 2, written ntok * Hk * (D + 4).
#include "common.cuh"

#include <cuda_fp8.h>

namespace {

template <int E>
__device__ __forceinline__ void write_fp8(const __nv_bfloat16* x, long long xs_t, long long xs_h,
                                          const int* slot_mapping, unsigned char* pool,
                                          long long block_bytes, int scale_off, int Hk, int block_size) {
    constexpr int D = 32 * E;
    const int t = blockIdx.x, h = blockIdx.y, lane = threadIdx.x;
    const int slot = slot_mapping[t];
    if (slot < 0) return;
    const __nv_bfloat16* src = x + t * xs_t + h * xs_h + lane * E;
    float v[E];
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < E; ++i) {
        v[i] = __bfloat162float(src[i]);
        amax = fmaxf(amax, fabsf(v[i]));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float scale = __fdiv_rn(amax, 448.f);
    const float safe = scale > 0.f ? scale : 1.f;
    const long long vec = (long long)(slot % block_size) * Hk + h;
    unsigned char* blk = pool + (long long)(slot / block_size) * block_bytes;
    unsigned char* dst = blk + vec * D + lane * E;
#pragma unroll
    for (int i = 0; i < E; ++i) {
        const float y = fminf(fmaxf(__fdiv_rn(v[i], safe), -448.f), 448.f);
        dst[i] = static_cast<unsigned char>(__nv_cvt_float_to_fp8(y, __NV_SATFINITE, __NV_E4M3));
    }
    if (lane == 0) *reinterpret_cast<float*>(blk + scale_off + vec * 4) = scale;
}

}  // namespace

#define MT_KV_WRITE_FP8(D)                                                                            \
    extern "C" __global__ void __launch_bounds__(32) kv_write_fp8_d##D(                               \
        const __nv_bfloat16* x, long long xs_t, long long xs_h, const int* slot_mapping,              \
        unsigned char* pool, long long block_bytes, int scale_off, int Hk, int block_size) {          \
        mt::pdl_enter();                                                                              \
        write_fp8<D / 32>(x, xs_t, xs_h, slot_mapping, pool, block_bytes, scale_off, Hk, block_size); \
        mt::pdl_exit();                                                                               \
    }

MT_KV_WRITE_FP8(64)
MT_KV_WRITE_FP8(128)
MT_KV_WRITE_FP8(256)
