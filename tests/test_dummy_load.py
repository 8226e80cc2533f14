"""--load-format dummy: a folder's config and tokenizer, random weights in the shapes the model
asks for; serves real architectures with no weight files (benchmarks)."""
import os

import numpy as np
import pytest

from tiny_models import make_tiny
from metrale.config import EngineConfig
from metrale.engine_core import EngineCore
from metrale.models.checkpoint import CheckpointError
from metrale.models.loader import load_checkpoint
from metrale.request import Request
from metrale.sampling import SamplingParams


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "qwen2"])
def test_dummy_weights_build_and_generate_without_weight_files(arch, tmp_path):
    path = make_tiny(arch, tmp_path)
    for f in os.listdir(path):
        if f.endswith(".safetensors") or f.endswith(".index.json"):
            os.remove(os.path.join(path, f))
    with pytest.raises(CheckpointError):
        load_checkpoint(path)                      # the real loader needs the weights
    ckpt = load_checkpoint(path, load_format="dummy")
    w = ckpt.tensor("model.layers.0.mlp.down_proj.weight" if arch == "qwen2"
                    else "model.layers.0.mlp.shared_expert.down_proj.weight", (64, 32))
    assert w.shape == (64, 32) and np.all(np.abs(w) >= 2**-7) and np.all(np.abs(w) < 2**-5)
    core = EngineCore(ckpt, EngineConfig(max_seq_len=128, max_batch_size=2))
    core.add_request(Request("r", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0,
                                                            ignore_eos=True)))
    tokens = []
    while core.has_unfinished():
        for out in core.step():
            tokens += out.token_ids
    assert len(tokens) == 4


def test_unknown_load_format_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="load format"):
        load_checkpoint(make_tiny("llama", tmp_path), load_format="bogus")


@pytest.mark.parametrize("quant,fmt", [({"quant_method": "fp8", "weight_block_size": [128, 128]}, "fp8"),
                                       ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "nvfp4")])
def test_dummy_weights_of_a_quantized_folder_come_quantized(quant, fmt, tmp_path):
    import json

    from metrale.models.quant import QuantizedTensor

    path = make_tiny("qwen3_5", tmp_path)
    cfg_file = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_file))
    cfg["quantization_config"] = quant
    json.dump(cfg, open(cfg_file, "w"))
    ckpt = load_checkpoint(path, load_format="dummy")
    w = ckpt.tensor("model.layers.0.linear_attn.in_proj_qkv.weight", (64, 64))
    assert isinstance(w, QuantizedTensor) and w.format == fmt and w.shape == (64, 64)
    dense = w.dequantize()
    assert np.all(np.abs(dense) >= 2**-8) and np.all(np.abs(dense) < 2**-4)
    assert 0.3 < (dense < 0).mean() < 0.7                        # random signs
    for bf16 in ("model.layers.0.linear_attn.in_proj_a.weight", "model.embed_tokens.weight",
                 "model.layers.0.input_layernorm.weight"):
        assert not isinstance(ckpt.tensor(bf16, (4, 64)), QuantizedTensor), bf16
    core = EngineCore(ckpt, EngineConfig(max_seq_len=128, max_batch_size=2))
    core.add_request(Request("r", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)))
    tokens = []
    while core.has_unfinished():
        for out in core.step():
            tokens += out.token_ids
    assert len(tokens) == 4


def test_dummy_weights_of_other_quantizations_are_refused_clearly(tmp_path):
    import json

    path = make_tiny("llama", tmp_path)
    cfg_file = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_file))
    cfg["quantization_config"] = {"quant_method": "compressed-tensors"}
    json.dump(cfg, open(cfg_file, "w"))
    ckpt = load_checkpoint(path, load_format="dummy")
    with pytest.raises(CheckpointError, match="dummy weights are synthesised in quant_method 'fp8'"):
        ckpt.tensor("model.layers.0.self_attn.q_proj.weight", (64, 64))
