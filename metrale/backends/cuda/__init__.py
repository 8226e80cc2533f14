"""The CUDA backend, one module per op family mirroring kernels_cuda/:

    ops.py          CudaOps: the facade (device, allocation, batch upload) binding the families
    kernels.py      the compile cache, the kernel declarations, the packed launcher, PDL state
    layout.py       dtypes, strides, SplitK
    elementwise.py  kernels_cuda/elementwise.cu   (norms, rope, KV writes, SiLU / sigmoid gates)
    attention.py    kernels_cuda/attention.cu     (paged decode / prefill attention)
    gdn.py          kernels_cuda/gdn_conv.cu, gdn_delta.cu  (Gated DeltaNet)
    moe.py          kernels_cuda/moe.cu           (mixture of experts)
    sampling.py     kernels_cuda/sampling.cu      (GpuSampler)
    gemm/           cuBLAS / cuBLASLt bindings and tuner, kernels_cuda/gemv.cu; gemm/quant.py:
                    FP8 / NVFP4 weights, kernels_cuda/gemv_quant.cu
    graphs.py       decode and step CUDA graphs
    capture.py      the engine's graphs captured at load (CudaOps.capture_graphs)
    device.py       CudaDevice: the engine's stream, syncs, memory figures, CuPy's OOM error

The package imports without CuPy (the kernel declarations are checked on CPU-only machines);
CudaOps needs it.
"""
from metrale.backends.cuda.kernels import NVCC_OPTIONS, KernelCache, find_nvcc
from metrale.backends.cuda.layout import BF16, F32, I32, SplitK
from metrale.backends.cuda.ops import CudaOps

__all__ = ["BF16", "F32", "I32", "NVCC_OPTIONS", "CudaOps", "KernelCache", "SplitK", "find_nvcc"]
