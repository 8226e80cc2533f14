"""Llama, Mistral, Qwen2 and Qwen3: the plain-attention family (one code path, several flavours).

    llama      RMSNorm, GQA attention, full rotary (any kind metrale.models.rope supports), SwiGLU;
               biases on q/k/v/o only when `attention_bias` is set.
    mistral    llama (HF MistralForCausalLM: no biases, an explicit head_dim where set); every
               layer attends over a sliding window of `sliding_window` keys when that is set
               (v0.1: 4096) below max_position_embeddings; null (v0.2 and later) or no shorter
               than the context: full attention. A mistral config with `layer_types` is read as
               ministral (HF's AutoConfig does the same: Ministral-8B-2410 ships that way).
    ministral  mistral with the window per layer: `layer_types` sliding_attention / full_attention
               (default: all sliding when sliding_window is set).
    ministral3 mistral plus Llama-4 attention temperature scaling (rope_parameters'
               llama_4_scaling_beta over original_max_position_embeddings): queries times
               1 + beta * ln(1 + floor(p / original_max_position_embeddings)) after rotary.
               Mistral3ForConditionalGeneration checkpoints (Mistral Small 3.x, Ministral 3)
               serve their text model: config.json's text_config is a mistral or ministral3
               config (the loader flattens it), tensors under language_model.model.* /
               model.language_model.* (the loader renames them; the vision tower is dropped).
    qwen2      llama + biases on q/k/v (never on o).
    qwen3      llama + per-head RMSNorm of q and k before rotary (`attention_bias` as llama).

Tensor names follow HF `*ForCausalLM`: model.embed_tokens, model.layers.{i}.self_attn.*,
model.layers.{i}.mlp.*, model.norm, lm_head (absent when tie_word_embeddings).

Sliding windows and the paged KV: every token's K/V stays in its block even once it has slid
out of the window (ops.sliding_attention masks; nothing is freed early), so chunked prefill,
prefix-cache hits and preemption see the same blocks as full attention does. A backend without
the sliding-window op (CUDA today) refuses a checkpoint whose window masks, at load.

Settings this code cannot honour are refused at load, naming the field: `mlp_bias`, sliding
window attention outside the Mistral types (`use_sliding_window`, `layer_types` with
sliding_attention), rope kinds metrale.models.rope does not know.
"""
from __future__ import annotations

from metrale.cache.kv import AttentionSpec, CacheSpec
from metrale.models.checkpoint import Checkpoint, CheckpointError
from metrale.models.layers import (Attention, AttentionShape, CausalLM, DecoderLayer, DenseMLP,
                                   NormSpec, Weights, head_dim_of, load_embeddings, require_ops,
                                   require_silu)
from metrale.models.quant import scale_weight
from metrale.models.rope import rope_from_config


def _biases(model_type: str, config: dict) -> tuple[bool, bool]:
    """(q/k/v bias, o bias) of a model type."""
    if model_type == "qwen2":
        return True, False
    flag = bool(config.get("attention_bias", False))
    return flag, flag


MISTRAL_TYPES = ("mistral", "ministral", "ministral3")


def refuse_unsupported(config: dict, path: str, model_type: str = "") -> None:
    """CheckpointError for settings the model code would otherwise silently ignore."""
    if model_type in MISTRAL_TYPES and (config.get("attention_bias") or config.get("mlp_bias")):
        raise CheckpointError(f"{path}: {model_type} with attention_bias / mlp_bias is not a "
                              f"checkpoint HF's Mistral classes read; refusing it")
    if config.get("mlp_bias"):
        raise CheckpointError(f"{path}: config.json sets mlp_bias: true; MLP biases are not "
                              f"supported (only attention_bias)")
    if model_type in MISTRAL_TYPES:
        return          # their windows: sliding_windows below
    sliding = [i for i, t in enumerate(config.get("layer_types") or []) if t != "full_attention"]
    if sliding or (config.get("use_sliding_window") and "layer_types" not in config):
        raise CheckpointError(
            f"{path}: config.json asks for sliding window attention (use_sliding_window "
            f"{config.get('use_sliding_window')!r}, layer_types not full_attention at layers "
            f"{sliding}); only full attention is supported: set use_sliding_window to false")


def sliding_windows(config: dict, path: str, model_type: str) -> list[int | None]:
    """Each layer's sliding window (None: full attention), as HF's Mistral classes mask (the other
    types have none: refuse_unsupported refused theirs). A window no shorter than
    max_position_embeddings never masks anything: full attention."""
    n, window = int(config["num_hidden_layers"]), config.get("sliding_window")
    if model_type not in MISTRAL_TYPES:
        return [None] * n
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise CheckpointError(f"{path}: sliding_window must be a positive integer or null, got {window!r}")
    longest = config.get("max_position_embeddings")
    masks = window is not None and (longest is None or window < int(longest))
    if model_type != "ministral" and not (model_type == "mistral" and "layer_types" in config):
        return [window if masks else None] * n
    types = config.get("layer_types") or ["sliding_attention" if window is not None else "full_attention"] * n
    if len(types) != n or any(t not in ("sliding_attention", "full_attention") for t in types):
        raise CheckpointError(f"{path}: layer_types {types!r} must list {n} entries of "
                              f"sliding_attention / full_attention")
    if window is None and "sliding_attention" in types:
        raise CheckpointError(f"{path}: layer_types has sliding_attention layers but sliding_window is null")
    return [window if masks and t == "sliding_attention" else None for t in types]


def attn_temperature(config: dict, path: str, model_type: str) -> tuple[float, float] | None:
    """Ministral 3's (llama_4_scaling_beta, original_max_position_embeddings), or None."""
    if model_type != "ministral3":
        return None
    params = config.get("rope_parameters") or {}
    beta, length = params.get("llama_4_scaling_beta"), params.get("original_max_position_embeddings")
    if not isinstance(beta, (int, float)) or not isinstance(length, (int, float)) or length <= 0:
        raise CheckpointError(
            f"{path}: ministral3 needs rope_parameters.llama_4_scaling_beta and "
            f"original_max_position_embeddings (HF's Ministral3Attention scales queries by them); "
            f"got {beta!r} and {length!r}")
    return (float(beta), float(length)) if beta else None


def _needed_ops(windows: list, temperature) -> dict[str, str]:
    needed = {}
    if any(w is not None for w in windows):
        needed["sliding_attention"] = "sliding-window attention"
    if temperature is not None:
        needed["attn_temperature"] = "Llama-4 attention temperature scaling (llama_4_scaling_beta)"
    return needed


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
    windows = sliding_windows(config, ckpt.path, model_type)
    temperature = attn_temperature(config, ckpt.path, model_type)
    require_ops(ops, model_type, _needed_ops(windows, temperature), ckpt.path)
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
                         i, hidden, shape, norm, rope.frequencies, qkv_bias, o_bias, qk_norm=qk_norm,
                         window=windows[i], temperature=temperature)
        mlp = DenseMLP(w.sub("mlp."), hidden, config["intermediate_size"], into_norm=True)
        layers.append(DecoderLayer(ops, attn, mlp, w.get("input_layernorm.weight", (hidden,)),
                                   w.get("post_attention_layernorm.weight", (hidden,)), norm))
    embed, lm_head = load_embeddings(root, config, "model.")
    spec = CacheSpec(tuple(AttentionSpec(shape.n_kv_heads, shape.head_dim) for _ in range(n_layers)))
    return CausalLM(config, ops, spec, embed, layers, root.get("model.norm.weight", (hidden,)),
                    lm_head, norm)
