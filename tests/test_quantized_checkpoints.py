"""Quantized checkpoints (issue #18, CPU part): every on-disk format loads on the CPU backend and
computes what the same checkpoint dequantised computes; anything else is refused at load.

Checkpoints are written in each producer's exact format by tests.tiny_models.quantize_tiny:
compressed-tensors' own compressors (FP8 per channel / per tensor, NVFP4), transcriptions of
ModelOpt's NVFP4QTensor / FP8QTensor and of transformers' fine-grained FP8 (block FP8, which
transformers itself reads on the CPU: that load is the oracle there too).
Tolerance: max |ours - hf| / max |hf| <= 1e-4, teacher-forced, fp32 on both sides; the only
difference left is the order of fp32 sums.
"""
from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from metrale.backends.cpu import CpuOps
from metrale.cache.kv import ModelCaches
from metrale.forward import contiguous_batch
from metrale.models.checkpoint import CheckpointError
from metrale.models.quant import QuantizedTensor
from metrale.models.registry import build_model
from tests.tiny_models import (QUANT_FORMATS, VOCAB, hf_logits, load_hf, load_tiny, make_tiny,
                               quantize_tiny, rewrite_config)

RTOL = 1e-4
PROMPT = np.random.default_rng(18).integers(0, VOCAB, 40).tolist()
# blocks dividing every tiny dimension (transformers' Fp8Dequantize derives the block from the
# grid, so a ragged last block would read differently there)
BLOCKS = {"qwen3": (32, 32), "qwen3_5_moe": (16, 16)}


def our_logits(path) -> np.ndarray:
    ops = CpuOps()
    model = build_model(load_tiny(path), ops)
    caches = ModelCaches(model.cache_spec(), ops, 16, 16, 2)
    batch = contiguous_batch([PROMPT], [0], [list(range(-(-len(PROMPT) // 16)))], [0], 16, True)
    return ops.to_numpy(model.forward(ops.upload_batch(batch), caches))


def rel_err(ours, ref) -> float:
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("src")
    return {arch: make_tiny(arch, root / arch, num_hidden_layers=2) for arch in BLOCKS}


@pytest.mark.parametrize("arch", sorted(BLOCKS))
@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_format_matches_its_dequantised_checkpoint(sources, tmp_path, fmt, arch):
    path = quantize_tiny(sources[arch], tmp_path / fmt, fmt, block=BLOCKS[arch])
    ours = our_logits(path)
    assert rel_err(ours, hf_logits(load_hf(f"{path}-dequantised"), PROMPT)) <= RTOL
    # and the quantization is real: the dequantised weights differ from the source's
    assert rel_err(ours, hf_logits(load_hf(sources[arch]), PROMPT)) > 10 * RTOL


@pytest.mark.parametrize("arch", sorted(BLOCKS))
def test_block_fp8_matches_transformers_reading_it(sources, tmp_path, arch):
    """transformers' fine-grained FP8 loader dequantises on a machine without a GPU: the
    checkpoint itself, read by the producer, is the oracle."""
    path = quantize_tiny(sources[arch], tmp_path / "fp8", "fp8-block", block=BLOCKS[arch])
    assert rel_err(our_logits(path), hf_logits(load_hf(path), PROMPT)) <= RTOL


def test_mixed_checkpoint_keeps_ignored_layers_and_logs_each_group(sources, tmp_path, caplog):
    """Router, shared-expert gate, GDN a/b projections and all of layer 1 kept in the source
    dtype (the ignore list names them), NVFP4 experts and attention around them."""
    keep = ("mlp.gate.", "shared_expert_gate", "in_proj_a", "in_proj_b", "layers.1.")
    path = quantize_tiny(sources["qwen3_5_moe"], tmp_path / "mixed", "ct-nvfp4", keep=keep)
    config = json.load(open(os.path.join(path, "config.json")))
    assert "model.language_model.layers.0.mlp.gate" in config["quantization_config"]["ignore"]
    with caplog.at_level(logging.INFO, logger="metrale.models.loader"):
        ours = our_logits(path)
    assert rel_err(ours, hf_logits(load_hf(f"{path}-dequantised"), PROMPT)) <= RTOL
    line = next(r.getMessage() for r in caplog.records if "compressed-tensors" in r.getMessage())
    for group in ("experts nvfp4", "experts float32", "router float32", "shared-expert gate float32",
                  "GDN nvfp4", "lm head float32"):
        assert group in line, line


# ---- refusals at load --------------------------------------------------------------------------

def _edit_tensors(path, edit) -> None:
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


def _load_error(path) -> str:
    with pytest.raises(CheckpointError) as e:
        build_model(load_tiny(path), CpuOps())
    return str(e.value)


Q = "model.layers.0.self_attn.q_proj.weight"


@pytest.mark.parametrize("method", ["awq", "gptq", "bitsandbytes", "mxfp4"])
def test_unknown_quant_method_is_refused(sources, tmp_path, method):
    path = quantize_tiny(sources["qwen3"], tmp_path / "q", "fp8-block")
    rewrite_config(path, quantization_config={"quant_method": method, "bits": 4})
    assert f"quant_method {method!r} is not supported" in _load_error(path)


def test_int4_compressed_tensors_scheme_is_refused(sources, tmp_path):
    path = quantize_tiny(sources["qwen3"], tmp_path / "q", "ct-fp8-channel")
    config = json.load(open(os.path.join(path, "config.json")))
    qc = config["quantization_config"]
    qc["format"] = "pack-quantized"
    qc["config_groups"]["group_0"]["weights"].update(type="int", num_bits=4, strategy="group", group_size=128)
    rewrite_config(path, quantization_config=qc)
    message = _load_error(path)
    assert "group 'group_0'" in message and "'pack-quantized'" in message and "int 4-bit" in message


def test_missing_weight_scale_inv_is_refused(sources, tmp_path):
    path = quantize_tiny(sources["qwen3"], tmp_path / "q", "fp8-block")
    _edit_tensors(path, lambda t: t.pop(Q + "_scale_inv"))
    message = _load_error(path)
    assert f"'{Q}_scale_inv' is missing" in message and "block FP8" in message


@pytest.mark.parametrize("fmt,scale", [("fp8-block", "_scale_inv"), ("ct-nvfp4", "_scale"),
                                       ("ct-fp8-channel", "_scale")])
def test_scale_of_the_wrong_shape_is_refused(sources, tmp_path, fmt, scale):
    path = quantize_tiny(sources["qwen3"], tmp_path / "q", fmt)
    _edit_tensors(path, lambda t: t.update({Q + scale: t[Q + scale][:-1]}))
    message = _load_error(path)
    assert f"tensor '{Q}{scale}' has shape" in message and "needs" in message


def test_non_finite_scale_is_refused(sources, tmp_path):
    path = quantize_tiny(sources["qwen3"], tmp_path / "q", "modelopt-nvfp4")
    _edit_tensors(path, lambda t: t.update({Q + "_scale_2": torch.tensor(float("nan"))}))
    message = _load_error(path)
    assert f"'{Q}_scale_2'" in message and "not finite" in message and "ModelOpt NVFP4" in message


def test_fp8_weights_without_a_quantization_config_are_refused(sources, tmp_path):
    """The case that used to load and answer garbage: e4m3 weights read, their scales ignored."""
    path = quantize_tiny(sources["qwen3"], tmp_path / "q", "fp8-block")
    rewrite_config(path, quantization_config=None)
    message = _load_error(path)
    assert "float8_e4m3fn" in message and "no quantization_config" in message
