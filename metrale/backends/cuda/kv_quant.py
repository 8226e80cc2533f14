"""Quantized KV on CUDA (kernels_cuda/kv_quant.cu writes; attention.cu's `_fp8` kernels read).

A quantized side of a layer's KV is a metrale.cache.kv_dtypes.QuantKvCache over a device byte
pool [num_blocks, block_bytes]; the layouts and the reference numerics are kv_dtypes'. CUDA
runs fp8 (`--kv-cache-dtype fp8`, and bf16 layers beside it through
--kv-high-precision-layers); the other formats run on the CPU backend (config.check_backend
refuses them here)."""
from __future__ import annotations

from metrale.backends.cuda.kernels import declare
from metrale.backends.cuda.layout import BF16
from metrale.backends.cuda.layout import estride as _estride
from metrale.cache.kv_dtypes import is_quantized_kv

CUDA_KV_FORMATS = ("fp8",)          # quantized formats the CUDA kernels read and write
HEAD_DIMS = (64, 128, 256)          # instantiated in kv_quant.cu / attention.cu

declare("kv_quant", "kv_write_fp8_d{}", "const bf16* x, long long xs_t, long long xs_h, "
        "const int* slot_mapping, unsigned char* pool, long long block_bytes, int scale_off, "
        "int Hk, int block_size")


def fp8_pool(cache):
    """(byte pool, block bytes, scale offset) of an fp8 QuantKvCache (checked)."""
    lay = cache.layout
    if cache.format != "fp8" or cache.calibration_tokens:
        raise NotImplementedError(f"CUDA KV: format {cache.format}"
                                  f"{' with calibration' if cache.calibration_tokens else ''} is "
                                  f"not implemented (fp8 without calibration is)")
    if lay.head_dim not in HEAD_DIMS:
        raise NotImplementedError(f"CUDA fp8 KV: head_dim {lay.head_dim} not instantiated "
                                  f"(have {HEAD_DIMS})")
    return cache.data, lay.nbytes, lay.field("scale").offset


def cache_shape(cache) -> tuple[int, int, int, int]:
    """(num_blocks, block_size, n_kv_heads, head_dim) of a plain or quantized side."""
    if is_quantized_kv(cache):
        lay = cache.layout
        return cache.num_blocks, lay.block_size, lay.n_heads, lay.head_dim
    return tuple(cache.shape)


def write_kv_quant(ops, k, v, k_cache, v_cache, batch) -> None:
    """write_kv into quantized sides (kv_write_fp8_d<D>: one warp per vector)."""
    slots = ops._dev(batch.slot_mapping)
    for x, cache in ((k, k_cache), (v, v_cache)):
        if not is_quantized_kv(cache):
            raise TypeError("write_kv: one side of the layer is quantized and the other not")
        pool, block_bytes, scale_off = fp8_pool(cache)
        t, hk, d = x.shape
        lay = cache.layout
        if (hk, d) != (lay.n_heads, lay.head_dim) or x.dtype != BF16:
            raise ValueError(f"write_kv: {x.dtype} [T, {hk}, {d}] into an fp8 cache of "
                             f"[{lay.n_heads}, {lay.head_dim}] (bf16 only)")
        if t == 0:
            continue
        ops.kernel("kv_quant", f"kv_write_fp8_d{d}")(
            (t, hk), (32,), x=x, xs_t=_estride(x, 0), xs_h=_estride(x, 1), slot_mapping=slots,
            pool=pool, block_bytes=block_bytes, scale_off=scale_off, Hk=hk,
            block_size=lay.block_size)
