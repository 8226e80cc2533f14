"""Tiny random HF checkpoints for tests: real architectures, real `save_pretrained` folders.

    make_tiny(arch, path, dtype="float32", **overrides) -> path
        arch: qwen3_5 | qwen3_5_moe | qwen3 | qwen2 | llama. Writes config.json + model.safetensors
        (+ generation_config.json) into `path`. `overrides` replace keys of the text config (e.g.
        num_hidden_layers=2, tie_word_embeddings=True, rope_parameters={...}); for Qwen3.5 a new
        depth keeps the linear/full attention alternation unless layer_types is given too.
        Qwen3.5 checkpoints are saved the way the hub ships them: the multimodal
        `*ForConditionalGeneration` class (a one-block vision tower), so config.json nests the text
        model under `text_config` and tensors are named `model.language_model.*`.
    load_hf(path) -> torch model in eval mode (the oracle), fp32.
    load_tiny(path) -> metrale Checkpoint, through the server's own loader.

Sizes stay tiny (hidden 64, 4 layers, vocab 320) so a forward costs milliseconds.
"""
from __future__ import annotations

import os

import numpy as np

from metrale.models.checkpoint import Checkpoint

ARCHS = ("qwen3_5", "qwen3_5_moe", "qwen3", "qwen2", "llama")

VOCAB = 320

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)

_QWEN3_5_TEXT = dict(
    _COMMON,
    head_dim=32,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=24,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [2, 1, 1], "mrope_interleaved": True},
)

_TEXT_CONFIGS = {
    "qwen3_5": _QWEN3_5_TEXT,
    "qwen3_5_moe": dict(_QWEN3_5_TEXT, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                        num_experts=6, num_experts_per_tok=2),
    "qwen3": dict(_COMMON, head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "qwen2": dict(_COMMON, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "llama": dict(_COMMON, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
}

_TINY_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                    temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=64)


def _hf_model(arch: str, text: dict):
    import transformers as tf

    if arch == "qwen3_5":
        cfg = tf.Qwen3_5Config(text_config=text, vision_config=dict(_TINY_VISION, out_hidden_size=text["hidden_size"]))
        return tf.Qwen3_5ForConditionalGeneration(cfg)
    if arch == "qwen3_5_moe":
        cfg = tf.Qwen3_5MoeConfig(text_config=text, vision_config=dict(_TINY_VISION, out_hidden_size=text["hidden_size"]))
        return tf.Qwen3_5MoeForConditionalGeneration(cfg)
    classes = {"qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
               "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
               "llama": (tf.LlamaConfig, tf.LlamaForCausalLM)}
    config_cls, model_cls = classes[arch]
    return model_cls(config_cls(**text))


def _randomise(model, seed: int) -> None:
    """HF inits norms to constants (zeros / ones) and some biases to zero: perturb every parameter
    so a wrong offset, a missing bias or a swapped norm weight changes the logits."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=gen) * 8 + 0.5))
            elif p.ndim == 1:
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


def make_tiny(arch: str, path, dtype: str = "float32", seed: int = 0, **overrides) -> str:
    """Write a tiny random checkpoint of `arch` into folder `path`; returns `path` as str."""
    import torch

    if arch not in _TEXT_CONFIGS:
        raise ValueError(f"unknown tiny arch {arch!r}; choose from {ARCHS}")
    text = dict(_TEXT_CONFIGS[arch], **overrides)
    if arch == "qwen2":
        text.setdefault("use_sliding_window", False)
    if "layer_types" in text and "layer_types" not in overrides:
        # keep the linear/full alternation when only the depth is overridden
        text["layer_types"] = [_QWEN3_5_TEXT["layer_types"][i % 2] for i in range(text["num_hidden_layers"])]
    torch.manual_seed(seed)
    model = _hf_model(arch, text)
    _randomise(model, seed)
    model = model.to(getattr(torch, dtype)).eval()
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(str(path))
    return str(path)


def load_hf(path):
    """The HF oracle for a tiny checkpoint, fp32, eval mode, eager attention."""
    import torch
    import transformers as tf

    config = tf.AutoConfig.from_pretrained(str(path))
    if config.model_type in ("qwen3_5", "qwen3_5_moe"):
        cls = tf.AutoModelForImageTextToText
    else:
        cls = tf.AutoModelForCausalLM
    model = cls.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def hf_logits(model, ids) -> np.ndarray:
    """Teacher-forced logits [len(ids), V] of one sequence, fp32 numpy."""
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.tensor([list(ids)], dtype=torch.long), use_cache=False)
    return out.logits[0].float().numpy()


def load_tiny(path) -> Checkpoint:
    """The checkpoint as the server loads it (metrale.models.loader.load_checkpoint: text_config
    flattened in, `model.language_model.*` renamed to `model.*`, vision/MTP tensors dropped)."""
    from metrale.models.loader import load_checkpoint

    return load_checkpoint(str(path))
