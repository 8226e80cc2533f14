// Shared helpers for Metrale's CUDA kernels (included by every .cu in kernels_cuda/).
//
// Storage conventions (see kernels_cuda/README.md):
//   * activations, weights and the KV cache are bf16 (__nv_bfloat16) unless a kernel says fp32;
//     on the Python side they are cupy arrays of dtype ml_dtypes.bfloat16 (2 bytes, same bits).
//   * every reduction accumulates in fp32; results are rounded to the storage type once.
//   * index arrays (ids, positions, slot maps, block tables, query_start_loc, seq_lens) are int32.
//   * every kernel is `extern "C"` with an explicit type suffix (_bf16 / _f32) so the cubin's
//     symbol names are stable whether it is built by nvcc or NVRTC.
//   * no fast-math: expf / rsqrtf / sincosf are the accurate versions.
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

#define MT_INF __int_as_float(0x7f800000)

namespace mt {

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

// 16 bytes of T: 8 bf16 or 4 fp32.
template <typename T> struct Vec16 {
    static constexpr int N = 16 / sizeof(T);
    union { uint4 u; T v[N]; };
};

// --- Programmatic dependent launch (sm_90+; no-ops before it and when a grid was launched
// without the attribute) ------------------------------------------------------------------
// A kernel that metrale/backends/cuda/kernels.py launches with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_
// STREAM_SERIALIZATION (inside graph captures; METRALE_PDL=0 turns it off) may start while the kernel
// before it in the stream still runs. The rule every kernel here keeps
// (tests/test_kernels_compile.py checks each entry point's PTX):
//   * pdl_wait() before the first access to memory another kernel writes or reads (inputs,
//     outputs, caches, scratch): it returns once the preceding grid has completed and its writes
//     are visible. Completion is transitive: the preceding grid itself waited in every CTA.
//   * only data no kernel writes (weights) may be read before it: gemv.cu issues its first
//     round of weight loads, then waits, so the weight stream starts during the previous
//     kernel's tail.
// Launched plainly (eager launches; METRALE_PDL=0), pdl_wait() returns at once.
//
// pdl_trigger() lets the next kernel launch before this one ends. MT_PDL_TRIGGER picks where the
// kernels issue it: 0 never (the next kernel may start as this one's last CTA exits), 1 at entry
// before the wait (the default: the successor's CTAs are resident and waiting as soon as the
// last of ours has started), 2 right after the wait, 3 at the end of the entry point
// (pdl_exit()). Correctness does not depend on the placement: every kernel waits before it
// reads (the rules above and below).
//
// The read-only (non-coherent) path and PDL: a load through ld.global.nc (`const T* __restrict__`
// lets nvcc emit it, and the old ldg16_if did) promises that the data does not change while the
// kernel runs. Under PDL a kernel runs while the one before it still writes, and on the H200
// (2026-11-30, perf/pdl_race.sh) graph replays then read stale inputs now and then: trigger at
// entry failed 3 of 6 chain tests and 2 of 2 step-graph serving tests; the same build with every
// activation load coherent passed 6 of 6 and 2 of 2. So the kernels here take no `__restrict__`
// and read activations with coherent loads (ldg16_if<false>); only weights, which no kernel writes, go
// through the non-coherent path (ldg16_if<true>). tests/test_kernels_compile.py fails on any other
// ld.global.nc in the PTX.
#ifndef MT_PDL_TRIGGER
#define MT_PDL_TRIGGER 1
#endif
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
// right after a kernel's wait (gemv.cu, whose wait follows its first weight loads)
__device__ __forceinline__ void pdl_after_wait() {
#if MT_PDL_TRIGGER == 1 || MT_PDL_TRIGGER == 2
    pdl_trigger();
#endif
}
// the entry of every kernel with nothing to do before its inputs are ready
__device__ __forceinline__ void pdl_enter() {
#if MT_PDL_TRIGGER == 1
    pdl_trigger();
#endif
    pdl_wait();
#if MT_PDL_TRIGGER == 2
    pdl_trigger();
#endif
}
// the last statement of every entry point
__device__ __forceinline__ void pdl_exit() {
#if MT_PDL_TRIGGER == 3
    pdl_trigger();
#endif
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over a whole block (blockDim.x a multiple of 32, <= 1024). `scratch` holds >= 32 floats.
// Every thread gets the result.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    const int nwarps = blockDim.x >> 5;
    v = lane < nwarps ? scratch[lane] : 0.f;
    return warp_sum(v);
}

// --- cp.async (sm_80+): 16-byte global -> shared copies, zero-filled when !valid ------------
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    const int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::); }

__device__ __forceinline__ float silu(float x) { return x / (1.f + expf(-x)); }
__device__ __forceinline__ float sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

// 16 bytes, zeros when !pred (predicated, so nothing out of bounds is touched). Volatile: NVVM
// keeps these loads in program order, ahead of the FMAs that use them (a kernel's
// __launch_bounds__(.., 1) keeps ptxas from sinking them: see gemv.cu).
//   ldg16_if<true>:  weights only (data no kernel writes): the non-coherent read-only path, kept
//                    out of L1 (read once: L1::no_allocate);
//   ldg16_if<false>: anything a kernel writes (activations): a coherent load (L1-cached), safe
//                    when the writer still runs under programmatic dependent launch (above).
#define MT_LDG16_IF(INSTR)                                                    \
    asm volatile(                                                             \
        "{\n"                                                                 \
        "  .reg .pred p;\n"                                                   \
        "  setp.ne.b32 p, %5, 0;\n"                                           \
        "  mov.b32 %0, 0;\n"                                                  \
        "  mov.b32 %1, 0;\n"                                                  \
        "  mov.b32 %2, 0;\n"                                                  \
        "  mov.b32 %3, 0;\n"                                                  \
        "  @p " INSTR " {%0, %1, %2, %3}, [%4];\n"                            \
        "}\n"                                                                 \
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)                          \
        : "l"(p), "r"(static_cast<int>(pred)))
template <bool WEIGHTS = false>
__device__ __forceinline__ uint4 ldg16_if(const void* p, bool pred) {
    uint4 v;
    if (WEIGHTS)
        MT_LDG16_IF("ld.global.nc.L1::no_allocate.v4.u32");
    else
        MT_LDG16_IF("ld.global.v4.u32");
    return v;
}
#undef MT_LDG16_IF

}  // namespace mt
