"""Llama, Qwen2 and Qwen3: the plain-attention family (one code path, three flavours).

    llama  RMSNorm, GQA attention, full rotary (default / linear / llama3 scaling), SwiGLU;
           biases on q/k/v/o only when `attention_bias` is set.
    qwen2  llama + biases on q/k/v (never on o).
    qwen3  llama + per-head RMSNorm of q and k before rotary (`attention_bias` as llama).

Tensor names follow HF `*ForCausalLM`: model.embed_tokens, model.layers.{i}.self_attn.*,
model.layers.{i}.mlp.*, model.norm, lm_head (absent when tie_word_embeddings).
"""
from __future__ import annotations

from metrale.cache.kv import AttentionSpec, CacheSpec
from metrale.models.checkpoint import Checkpoint
from metrale.models.layers import (Attention, AttentionShape, CausalLM, DecoderLayer, DenseMLP,
                                   NormSpec, Weights, head_dim_of, load_embeddings, require_silu,
                                   rope_inv_freq)


def _biases(model_type: str, config: dict) -> tuple[bool, bool]:
    """(q/k/v bias, o bias) of a model type."""
    if model_type == "qwen2":
        return True, False
    flag = bool(config.get("attention_bias", False))
    return flag, flag


def build_llama_family(ckpt: Checkpoint, ops) -> CausalLM:
    config, model_type = ckpt.config, ckpt.model_type
    require_silu(config, ckpt.path)
    hidden, n_layers = config["hidden_size"], config["num_hidden_layers"]
    shape = AttentionShape(config["num_attention_heads"],
                           config.get("num_key_value_heads") or config["num_attention_heads"],
                           head_dim_of(config))
    norm = NormSpec(float(config.get("rms_norm_eps", 1e-6)), 0.0)
    rope = rope_inv_freq(config, shape.head_dim)
    qkv_bias, o_bias = _biases(model_type, config)
    root = Weights(ckpt, ops)
    layers = []
    for i in range(n_layers):
        w = root.sub(f"model.layers.{i}.")
        attn = Attention(w.sub("self_attn."), i, hidden, shape, norm, rope, qkv_bias, o_bias,
                         qk_norm=model_type == "qwen3")
        mlp = DenseMLP(w.sub("mlp."), hidden, config["intermediate_size"], into_norm=True)
        layers.append(DecoderLayer(ops, attn, mlp, w.get("input_layernorm.weight", (hidden,)),
                                   w.get("post_attention_layernorm.weight", (hidden,)), norm))
    embed, lm_head = load_embeddings(root, config, "model.")
    spec = CacheSpec(tuple(AttentionSpec(shape.n_kv_heads, shape.head_dim) for _ in range(n_layers)))
    return CausalLM(config, ops, spec, embed, layers, root.get("model.norm.weight", (hidden,)),
                    lm_head, norm)
