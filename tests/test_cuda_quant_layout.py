"""The device layouts of FP8 / NVFP4 weights (metrale.backends.cuda.gemm.quant.upload), checked on
the CPU: the upload runs with numpy standing in for CuPy, and the weight the kernels of
kernels_cuda/gemv_quant.cu would read — scale of (row, col) = s[(row >> s_rlog2) * s_ld +
(col >> s_clog2)] for FP8, e2m1 * s[row, col / 16] * g[row] for NVFP4 — is rebuilt from the
uploaded arrays with that indexing and compared with QuantizedTensor.dequantize() bit for bit.
Every scale block a checkpoint can carry: 128 x 128, per channel, per tensor, non-power-of-two
rows (expanded to one scale row per weight row) and columns (expanded to one per 16 columns),
bf16 scales; mixed parts; and the clear refusals (MoE experts, blocks the kernels cannot read).
The kernels themselves run against the same spec on the H200 (tests/test_cuda_quant_gemv.py)."""
from __future__ import annotations

from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

from metrale.backends.cuda.gemm import quant as q
from metrale.models.checkpoint import CheckpointError
from metrale.models.quant import E2M1_VALUES, E4M3, QuantizedTensor, concat_rows

F32 = np.float32
OPS = SimpleNamespace(cp=np, asarray=lambda a, dtype=None: np.asarray(a))


def fp8(rng, n, k, block, scale_dtype=F32):
    data = (rng.standard_normal((n, k)) * 60).astype(E4M3)
    scale = (rng.uniform(0.5, 2.0, (-(-n // block[0]), -(-k // block[1]))) / 64).astype(scale_dtype)
    return QuantizedTensor("fp8", data, scale, block, None, "fp8 test")


def nvfp4(rng, n, k):
    return QuantizedTensor("nvfp4", rng.integers(0, 256, (n, k // 2), dtype=np.uint8),
                           rng.uniform(0.01, 400, (n, k // 16)).astype(E4M3), (1, 16),
                           rng.uniform(0.5, 2, n).astype(F32), "nvfp4 test")


def as_kernel_reads(w: q.QWeight) -> np.ndarray:
    n, k = w.shape
    if w.format == "fp8":
        codes = w.data.view(E4M3).astype(F32)
        rows = np.arange(n) >> w.s_rlog2
        cols = ((np.arange(k) // 16) * 16) >> w.s_clog2     # one scale per 16-column vector
        return codes * w.scale[rows][:, cols]
    codes = np.stack([w.data & 0x0F, w.data >> 4], -1).reshape(n, k)
    scale = np.repeat(w.scale.view(E4M3).astype(F32), 16, 1)
    return E2M1_VALUES[codes] * scale * w.global_scale[:, None]


@pytest.mark.parametrize("block", [(128, 128), (1, 384), (200, 384), (32, 64), (3, 48), (128, 16)])
@pytest.mark.parametrize("scale_dtype", [F32, np.dtype(ml_dtypes.bfloat16)])
def test_fp8_upload_reads_every_scale_block_as_the_spec(block, scale_dtype):
    qt = fp8(np.random.default_rng(block[0] * block[1]), 200, 384, block, scale_dtype)
    w = q.upload(OPS, qt)
    assert w.format == "fp8" and w.shape == (200, 384) and w.data.dtype == np.uint8
    assert w.s_clog2 >= 4, "every 16-column vector lies in one scale block"
    assert np.array_equal(as_kernel_reads(w), qt.dequantize())


def test_nvfp4_upload_reads_as_the_spec():
    qt = nvfp4(np.random.default_rng(4), 70, 96)
    w = q.upload(OPS, qt)
    assert w.data.shape == (70, 48) and w.scale.shape == (70, 6) and w.global_scale.shape == (70,)
    assert np.array_equal(as_kernel_reads(w), qt.dequantize())


def test_mixed_rows_become_parts_in_order():
    rng = np.random.default_rng(0)
    dense = rng.standard_normal((16, 64)).astype(F32)
    qt = concat_rows([nvfp4(rng, 32, 64), dense, fp8(rng, 8, 64, (1, 64))])
    w = q.upload(OPS, qt)
    assert isinstance(w, q.PartsWeight) and w.shape == (56, 64)
    got = np.concatenate([as_kernel_reads(p) if isinstance(p, q.QWeight) else p for p in w.parts])
    assert np.array_equal(got, qt.dequantize())
    assert w.nbytes == 32 * 32 + 32 * 4 + 32 * 4 + 16 * 64 * 4 + 8 * 64 + 8 * 4


def test_moe_experts_are_refused_with_the_way_out():
    rng = np.random.default_rng(0)
    experts = concat_rows([nvfp4(rng, 32, 64)[None], nvfp4(rng, 32, 64)[None]])
    with pytest.raises(CheckpointError, match="MoE expert weights .* --device cpu"):
        q.upload(OPS, experts)


@pytest.mark.parametrize("make,match", [
    (lambda rng: fp8(rng, 32, 40, (32, 40)), "k % 16"),
    (lambda rng: fp8(rng, 32, 96, (32, 24)), "not a multiple of 16"),
    (lambda rng: nvfp4(rng, 32, 48), "k % 32"),
])
def test_shapes_the_kernels_cannot_read_are_refused(make, match):
    with pytest.raises(CheckpointError, match=match):
        q.upload(OPS, make(np.random.default_rng(1)))
