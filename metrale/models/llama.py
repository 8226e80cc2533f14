"""Llama, Mistral, Qwen2 and Qwen3: the plain-attention family (one code path, four flavours).

    llama    RMSNorm, GQA attention, full rotary (any kind metrale.models.rope supports), SwiGLU;
             biases on q/k/v/o only when `attention_bias` is set.
    mistral  llama (HF MistralForCausalLM: no biases, an explicit head_dim where set), with a
             `sliding_window` that is null, or no shorter than max_position_embeddings (then it
             never masks anything); a window that masks is refused.
    qwen2    llama + biases on q/k/v (never on o).
    qwen3    llama + per-head RMSNorm of q and k before rotary (`attention_bias` as llama).

Tensor names follow HF `*ForCausalLM`: model.embed_tokens, model.layers.{i}.self_attn.*,
model.layers.{i}.mlp.*, model.norm, lm_head (absent when tie_word_embeddings).

Settings this code cannot honour are refused at load, naming the field: `mlp_bias`, sliding
window attention (`use_sliding_window`, `layer_types` with sliding_attention), rope kinds
metrale.models.rope does not know.
"""
from __future__ import annotations

from metrale.cache.kv import AttentionSpec, CacheSpec
from metrale.models.checkpoint import Checkpoint, CheckpointError
from metrale.models.layers import (Attention, AttentionShape, CausalLM, DecoderLayer, DenseMLP,
                                   NormSpec, Weights, head_dim_of, load_embeddings, require_silu)
from metrale.models.quant import scale_weight
from metrale.models.rope import rope_from_config


def _biases(model_type: str, config: dict) -> tuple[bool, bool]:
    """(q/k/v bias, o bias) of a model type."""
    if model_type == "qwen2":
        return True, False
    flag = bool(config.get("attention_bias", False))
    return flag, flag


def refuse_unsupported(config: dict, path: str, model_type: str = "") -> None:
    """CheckpointError for settings the model code would otherwise silently ignore."""
    if model_type == "mistral":
        window, longest = config.get("sliding_window"), config.get("max_position_embeddings")
        if window is not None and (longest is None or int(window) < int(longest)):
            raise CheckpointError(
                f"{path}: config.json sets sliding_window {window} (below max_position_embeddings "
                f"{longest}): sliding window attention is not supported; only Mistral checkpoints "
                f"with sliding_window null (v0.2 and later) are")
        if config.get("attention_bias") or config.get("mlp_bias"):
            raise CheckpointError(f"{path}: Mistral with attention_bias / mlp_bias is not a "
                                  f"checkpoint HF's MistralForCausalLM reads; refusing it")
    if config.get("mlp_bias"):
        raise CheckpointError(f"{path}: config.json sets mlp_bias: true; MLP biases are not "
                              f"supported (only attention_bias)")
    sliding = [i for i, t in enumerate(config.get("layer_types") or []) if t != "full_attention"]
    if sliding or (config.get("use_sliding_window") and "layer_types" not in config):
        raise CheckpointError(
            f"{path}: config.json asks for sliding window attention (use_sliding_window "
            f"{config.get('use_sliding_window')!r}, layer_types not full_attention at layers "
            f"{sliding}); only full attention is supported: set use_sliding_window to false")


class _ScaledQuery(Weights):
    """Attention weights whose queries come out multiplied by `scale`: the YaRN attention factor
    f multiplies cos and sin, so q.k by f**2 when the whole head rotates. Folded into q_proj
    (weight and bias), or into q_norm's weight where a head norm follows the projection."""

    def __init__(self, w: Weights, scale: float, names: tuple[str, ...]):
        super().__init__(w.ckpt, w.ops, w.prefix)
        self.scale, self.names = scale, names

    def host(self, name: str, shape: tuple[int, ...]):
        value = super().host(name, shape)
        if name not in self.names:
            return value
        return scale_weight(value, self.scale)


def _attention_weights(w: Weights, attention_factor: float, qk_norm: bool) -> Weights:
    if attention_factor == 1.0:
        return w
    names = ("q_norm.weight",) if qk_norm else ("q_proj.weight", "q_proj.bias")
    return _ScaledQuery(w, attention_factor ** 2, names)


def build_llama_family(ckpt: Checkpoint, ops) -> CausalLM:
    config, model_type = ckpt.config, ckpt.model_type
    require_silu(config, ckpt.path)
    refuse_unsupported(config, ckpt.path, model_type)
    hidden, n_layers = config["hidden_size"], config["num_hidden_layers"]
    shape = AttentionShape(config["num_attention_heads"],
                           config.get("num_key_value_heads") or config["num_attention_heads"],
                           head_dim_of(config))
    norm = NormSpec(float(config.get("rms_norm_eps", 1e-6)), 0.0)
    rope = rope_from_config(config, shape.head_dim)
    qk_norm = model_type == "qwen3"
    qkv_bias, o_bias = _biases(model_type, config)
    root = Weights(ckpt, ops)
    layers = []
    for i in range(n_layers):
        w = root.sub(f"model.layers.{i}.")
        attn = Attention(_attention_weights(w.sub("self_attn."), rope.attention_factor, qk_norm),
                         i, hidden, shape, norm, rope.frequencies, qkv_bias, o_bias, qk_norm=qk_norm)
        mlp = DenseMLP(w.sub("mlp."), hidden, config["intermediate_size"], into_norm=True)
        layers.append(DecoderLayer(ops, attn, mlp, w.get("input_layernorm.weight", (hidden,)),
                                   w.get("post_attention_layernorm.weight", (hidden,)), norm))
    embed, lm_head = load_embeddings(root, config, "model.")
    spec = CacheSpec(tuple(AttentionSpec(shape.n_kv_heads, shape.head_dim) for _ in range(n_layers)))
    return CausalLM(config, ops, spec, embed, layers, root.get("model.norm.weight", (hidden,)),
                    lm_head, norm)
