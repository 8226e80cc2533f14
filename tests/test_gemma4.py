"""Gemma 4 (text) on the CPU backend against HF transformers' Gemma4ForCausalLM (fp32), on tiny
random checkpoints: a dense one (per-layer inputs, K/V shared by the last two layers, double-wide
MLPs there) and an MoE one (the MoE block beside the MLP, global layers with k == v and one KV
head); both with sliding_window 8 (shorter than the 70-token prompt, so the mask matters),
proportional rope on the global layers and final logit soft-capping. Also: the legacy
global_head_dim config spelling, refusals naming the field, the refusal on a backend without the
ops (CUDA), and the family's tool parser default."""
from __future__ import annotations

import re

import numpy as np
import pytest

import family_checks as fc
from family_checks import ops_without
from metrale.api.tool_parsers import default_tool_parser
from metrale.backends.cpu import CpuOps
from metrale.models.checkpoint import CheckpointError
from metrale.models.gemma4 import plan_layers
from metrale.models.registry import build_model
from metrale.sampling import SamplingParams
from tiny_models import VOCAB, load_tiny, make_tiny_family, make_tiny_gemma4_multimodal, rewrite_config

PROMPT_LEN = 70


@pytest.fixture(scope="module", params=["gemma4_dense", "gemma4_moe"])
def ckpt(request, tmp_path_factory):
    return make_tiny_family(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def prompt():
    return np.random.default_rng(1).integers(0, VOCAB, PROMPT_LEN).tolist()


@pytest.fixture(scope="module")
def ref(ckpt, prompt):
    return fc.reference(ckpt, prompt)


def test_sliding_window_and_softcap_change_the_logits(tmp_path, prompt):
    """The features under test are live: without the window mask or without soft-capping the
    logits move well past the tolerance (so the matches above cannot pass by accident)."""
    path = make_tiny_family("gemma4_dense", tmp_path)
    ref = fc.reference(path, prompt)
    assert np.abs(ref).max() <= 3.0 + 1e-6                          # capped at final_logit_softcapping
    wide = make_tiny_family("gemma4_dense", tmp_path / "wide", sliding_window=512)
    assert fc.rel_err(fc.reference(wide, prompt)[8:], ref[8:]) > 1e-2


def test_legacy_global_head_dim_spelling_matches_hf(tmp_path, prompt):
    """Checkpoints written before per_layer_config carry global_head_dim /
    num_global_key_value_heads; HF derives the same per-layer shapes from them."""
    path = make_tiny_family("gemma4_moe", tmp_path)
    rewrite_config(path, per_layer_config=None, global_head_dim=32, num_global_key_value_heads=1)
    plans = plan_layers(load_tiny(path).config)
    assert [(p.head_dim, p.n_kv_heads) for p in plans] == [(16, 2), (16, 2), (32, 1)] * 2
    fc.check_one_shot(path, prompt, fc.reference(path, prompt))


def test_kv_shared_layers_own_no_cache(tmp_path):
    model = build_model(load_tiny(make_tiny_family("gemma4_dense", tmp_path)), CpuOps())
    assert len(model.cache_spec().layers) == 4                      # 6 layers, the last 2 shared
    assert [layer.attn.cache_layer for layer in model.layers] == [0, 1, 2, 3, 3, 2]


@pytest.mark.parametrize("field, value, message", [
    ("hidden_activation", "relu", "hidden_activation 'relu'"),
    ("use_bidirectional_attention", "all", "use_bidirectional_attention"),
    ("per_layer_config", {"2": {"head_dim": 32, "sliding_window": 4}}, "per_layer_config[2]"),
    ("num_kv_shared_layers", 6, "num_kv_shared_layers 6"),
    ("rope_parameters", {"sliding_attention": {"rope_type": "longrope", "rope_theta": 1e4},
                         "full_attention": {"rope_type": "default", "rope_theta": 1e4}}, "longrope"),
])
def test_unsupported_settings_are_refused_naming_the_field(tmp_path, field, value, message):
    path = make_tiny_family("gemma4_dense", tmp_path)
    rewrite_config(path, **{field: value})
    with pytest.raises(CheckpointError, match=re.escape(message)):
        build_model(load_tiny(path), CpuOps())


def _NoFamilyOps():
    """A backend with the common ops only (as the CUDA backend is today)."""
    return ops_without("sliding_attention", "softcap", "gelu_tanh_mul", "route_topk", "moe_topk")


def test_backend_without_the_ops_refuses_at_load(tmp_path):
    path = make_tiny_family("gemma4_moe", tmp_path)
    with pytest.raises(CheckpointError) as err:
        build_model(load_tiny(path), _NoFamilyOps())
    text = str(err.value)
    assert "gemma4 needs" in text and "sliding-window attention" in text and "soft-capping" in text
    assert "MoE" in text and "cuda kernels do not implement yet" in text and "--device cpu" in text


def test_the_real_cuda_backend_lacks_the_ops():
    """What the refusal keys on: CudaOps (imported without a GPU) has none of the new ops."""
    cuda_ops = pytest.importorskip("metrale.backends.cuda.ops")
    cls = next(c for n, c in vars(cuda_ops).items() if n.endswith("Ops") and isinstance(c, type)
               and hasattr(c, "attention"))
    assert not any(hasattr(cls, op) for op in ("sliding_attention", "softcap", "gelu_tanh_mul", "moe_topk"))


def test_tool_parser_default():
    assert default_tool_parser("gemma4") == "gemma4"
    assert default_tool_parser("gemma4_text") == "gemma4"


def test_hub_multimodal_layout_serves_its_text_model(tmp_path, prompt):
    """google/gemma-4-* ship Gemma4ForConditionalGeneration: the text model is read from under
    model.language_model (the vision tower is not), matching HF's text-only forward."""
    import torch
    import transformers as tf

    path = make_tiny_gemma4_multimodal(tmp_path)
    hf = tf.AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        ref = hf.eval()(input_ids=torch.tensor([prompt]), use_cache=False).logits[0].numpy()
    assert load_tiny(path).config["model_type"] == "gemma4"
    fc.check_one_shot(path, prompt, ref)


def test_proportional_rope_with_a_factor_matches_hf(tmp_path, prompt):
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                               "rope_theta": 10000.0, "factor": 4.0}}
    path = make_tiny_family("gemma4_moe", tmp_path, rope_parameters=rope)
    fc.check_one_shot(path, prompt, fc.reference(path, prompt))


def test_sliding_layers_read_a_quantized_kv_cache_through_its_format(ckpt, prompt):
    """--kv-cache-dtype reaches the sliding-window layers too (CpuOps.sliding_attention decodes
    the cache like attention does): turbo8 (relative MSE 4e-5) gives the unquantized greedy
    tokens' first step and close log-probabilities; a cache read as raw bytes would not."""
    from metrale.llm import LLM

    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=1)
    kw = dict(max_seq_len=256, max_batch_size=1, block_size=8, enable_prefix_caching=False)
    plain = LLM(ckpt, **kw).generate(prompt[:60], params)[0]
    quant = LLM(ckpt, kv_cache_dtype="turbo8", kv_high_precision_layers="0", **kw)
    assert quant.core.caches.kv_bytes_per_block < LLM(ckpt, **kw).core.caches.kv_bytes_per_block
    got = quant.generate(prompt[:60], params)[0]
    assert got.token_ids[0] == plain.token_ids[0]
    assert abs(got.logprobs[0].logprob - plain.logprobs[0].logprob) < 0.05
