"""Backends behind one ops interface (base.Ops): `cpu` (numpy + numba, the reference) and
`cuda` (cupy RawKernels + cuBLAS)."""
from __future__ import annotations


def cuda_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def make_ops(config):
    """The ops for `config.device` (auto picks cuda when a GPU is present)."""
    device = config.device
    if device == "auto":
        device = "cuda" if cuda_available() else "cpu"
    if device == "cuda":
        if not cuda_available():
            raise RuntimeError("--device cuda: no CUDA GPU is visible (or cupy is not installed: "
                               "pip install -e '.[cuda]')")
        dtype = {"auto": "bfloat16", "bf16": "bfloat16"}.get(config.dtype, config.dtype)
        if dtype != "bfloat16":
            from metrale.config import ConfigError

            # the attention kernels (and the paged KV cache) are bf16: refuse here, not with a
            # TypeError from the first graph capture
            raise ConfigError(f"dtype {config.dtype!r} is not supported on CUDA (bfloat16 only); "
                              "use dtype auto/bfloat16, or device cpu for float32")
        from metrale.backends.cuda import CudaOps

        if dtype == "bfloat16":
            import ml_dtypes

            dtype = ml_dtypes.bfloat16
        return CudaOps(dtype=dtype)
    from metrale.backends.cpu import CpuOps

    return CpuOps()
