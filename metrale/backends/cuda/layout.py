"""Dtypes and array-layout helpers shared by the CUDA backend's op families."""
from __future__ import annotations

import ml_dtypes
import numpy as np

from metrale.forward import ForwardBatch

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
I32 = np.dtype(np.int32)
SUFFIX = {BF16: "bf16", F32: "f32"}     # kernel-name suffix of each storage dtype


def estride(a, dim: int) -> int:
    """a's stride along `dim` in elements."""
    return a.strides[dim] // a.itemsize


def aligned(*arrays) -> bool:
    return all(a is None or a.data.ptr % 16 == 0 for a in arrays)


def block_for(per_row: int) -> int:
    """Threads for one-block-per-row kernels: `per_row` rounded up to whole warps, 32..1024."""
    return min(1024, max(32, -(-per_row // 32) * 32))


def host_of(batch: ForwardBatch) -> ForwardBatch | None:
    """The host copy of an uploaded batch (CudaOps.upload_batch keeps it as `.host`)."""
    if isinstance(batch.query_start_loc, np.ndarray):
        return batch
    return getattr(batch, "host", None)


class SplitK:
    """A GEMM's output left as fp32 partial products over slices of k ([S, T, N], summed by the
    consumer): what CudaOps.linear_parts returns when the k-split plan wins (gemm/cublaslt.py
    ksplit_plan). add_rms_norm takes it as its x; `materialize` gives the plain [.., N] array."""
    __slots__ = ("parts", "shape", "dtype", "launch")

    def __init__(self, parts, shape: tuple, dtype, launch=None):
        self.parts, self.shape, self.dtype, self.launch = parts, tuple(shape), dtype, launch

    def materialize(self):
        if self.launch is not None:
            self.launch.foreign()   # CuPy kernels: the next kernel of ours is launched plainly
        return self.parts.sum(axis=0).astype(self.dtype).reshape(self.shape)
