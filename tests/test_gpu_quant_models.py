"""Quantized checkpoints served on the CUDA backend (issue #18): FP8 / NVFP4 projections read
packed by kernels_cuda/gemv_quant.cu, against HF transformers in fp32 on the same GPU reading the
same checkpoint dequantised (tests.tiny_models.quantize_tiny writes both, the dequantisation the
producer's own: transformers' Fp8Dequantize, ModelOpt's NVFP4QTensor / FP8QTensor).

Tiny random checkpoints of the real architectures (GPU head dims), every linear layer quantized
(the block FP8 ones in 32 x 32 blocks: scale blocks smaller than a CTA's columns), the rest bf16.
- teacher-forced logits over 150 tokens (prefill: the dequantise + bf16 GEMM path):
  ||ours - hf32|| / ||hf32|| <= 2 x HF-bf16's own error on the dequantised checkpoint + 5e-3,
  the bound tests/test_gpu_models.py holds bf16 checkpoints to;
- 48 greedy tokens (decode: the packed GEMVs, from CUDA graphs) agree with HF fp32 greedy until
  the first near-tie: where they diverge, HF's top-1/top-2 gap is within our max logit error.
"""
import numpy as np
import pytest

from tiny_models import make_tiny, quantize_tiny
from test_gpu_models import (GDN_SHAPES, GPU_SHAPES, _hf, _hf_logits, _llm, _our_logits,
                             assert_greedy_agrees_until_a_near_tie)

pytestmark = pytest.mark.gpu

FORMATS = ["fp8-block", "modelopt-fp8", "modelopt-nvfp4"]


def _make(arch, fmt, tmp_path):
    extra = dict(GPU_SHAPES)
    if arch == "qwen3_5":
        extra.update(GDN_SHAPES)
    src = make_tiny(arch, tmp_path / "src", dtype="bfloat16", **extra)
    return quantize_tiny(src, tmp_path / fmt, fmt)


def _packed_weights(model) -> int:
    """QWeight / PartsWeight objects reachable from the model's blocks (what the GPU holds packed)."""
    from metrale.backends.cuda.gemm.quant import is_device_quantized

    seen, count, todo = set(), 0, [model]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if is_device_quantized(obj):
            count += 1
        elif isinstance(obj, (list, tuple)):
            todo.extend(obj)
        elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("metrale.models"):
            todo.extend(vars(obj).values())
    return count


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("arch", ["qwen3_5", "llama"])
def test_teacher_forced_logits_match_hf_on_the_dequantised_checkpoint(arch, fmt, tmp_path):
    path = _make(arch, fmt, tmp_path)
    llm = _llm(path)
    packed = _packed_weights(llm.core.model)
    assert packed, "no weight of the model is held packed"
    ids = [int(t) for t in np.random.default_rng(0).integers(1, 300, 150)]
    ours = _our_logits(llm, ids)
    ref = _hf_logits(_hf(f"{path}-dequantised", "float32"), ids)
    hf16 = _hf_logits(_hf(f"{path}-dequantised"), ids)
    err = np.linalg.norm(ours - ref) / np.linalg.norm(ref)
    err_hf = np.linalg.norm(hf16 - ref) / np.linalg.norm(ref)
    print(f"{arch} {fmt}: rel err vs HF fp32 (dequantised): ours {err:.2e}, HF bf16 {err_hf:.2e}; {packed} packed weights")
    assert err <= 2 * err_hf + 5e-3


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("arch", ["qwen3_5", "llama"])
def test_greedy_decode_agrees_until_a_near_tie(arch, fmt, tmp_path):
    path = _make(arch, fmt, tmp_path)
    prompt = [int(t) for t in np.random.default_rng(1).integers(1, 300, 40)]
    assert_greedy_agrees_until_a_near_tie(_llm(path), _hf(f"{path}-dequantised", "float32"), prompt, 48,
                                          f"{arch} {fmt}")
