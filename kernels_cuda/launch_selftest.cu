// launch_selftest(out, a, b, c, d, p, e, f, g): writes its arguments back, as 64-bit integers
// (floats as their bit patterns), to out[0..7]. Run once per process by
// metrale/backends/cuda/kernels.py to prove the packed-argument launch path (cuLaunchKernel with a
// buffer laid out per the parameter ABI: natural alignment, padding between 4- and 8-byte
// values) before any model kernel uses it. Reference: the arguments themselves.
// One thread; 64 bytes written.
#include "common.cuh"

extern "C" __global__ void launch_selftest(long long* out, int a, long long b, float c, int d,
                                           const void* p, unsigned long long e, float f, int g) {
    out[0] = a;
    out[1] = b;
    out[2] = __float_as_int(c);
    out[3] = d;
    out[4] = reinterpret_cast<long long>(p);
    out[5] = static_cast<long long>(e);
    out[6] = __float_as_int(f);
    out[7] = g;
}
