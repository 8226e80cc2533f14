"""Qwen3.5 (`qwen3_5`, `qwen3_5_moe`), text part: hybrid Gated DeltaNet + gated attention.

Per `layer_types` (default: every `full_attention_interval`-th layer is full attention, the rest
linear_attention) each decoder layer mixes tokens with either
  - GatedDeltaNet: in_proj_qkv|z|b|a (fused) -> causal conv1d + SiLU on qkv -> split q|k|v ->
    gated delta rule (g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)) ->
    RMSNormGated(o, z) (weight not zero-centred) -> out_proj, or
  - gated attention: q_proj emits per head [q | gate]; zero-centred q/k head norms, partial
    rotary (`partial_rotary_factor`, default 0.25), output * sigmoid(gate) -> o_proj;
then a SwiGLU MLP (dense) or a sparse MoE with a sigmoid-gated shared expert (moe).
All other RMSNorms are zero-centred (weight + 1).

Tensors are read under `model.language_model.` (hub / *ForConditionalGeneration layout) or
`model.` (*ForCausalLM); the vision tower is ignored; the MTP head (`mtp.*`) is built beside
the model by metrale.models.mtp (registry.build_model).
"""
from __future__ import annotations

import numpy as np

from metrale.cache.kv import AttentionSpec, CacheSpec, GdnSpec
from metrale.models.checkpoint import Checkpoint, CheckpointError
from metrale.models.layers import (Attention, AttentionShape, CausalLM, DecoderLayer, DenseMLP,
                                   NormSpec, SparseMoe, Weights, head_dim_of, load_embeddings,
                                   require_silu)
from metrale.models.rope import rope_from_config

LAYER_TYPES = ("linear_attention", "full_attention")
MOE_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")


class GatedDeltaNet:
    """The linear-attention mixer. Fused input projection rows:
    [q (Hk*Dk) | k (Hk*Dk) | v (Hv*Dv) | z (Hv*Dv) | b (Hv) | a (Hv)]."""

    def __init__(self, w: Weights, layer: int, hidden: int, spec: GdnSpec, eps: float, n_k_heads: int):
        self.ops, self.layer, self.spec, self.eps = w.ops, layer, spec, eps
        hv, dk, dv = spec.n_v_heads, spec.head_k_dim, spec.head_v_dim
        self.key_dim, self.value_dim = n_k_heads * dk, hv * dv
        self.in_proj = w.rows([("in_proj_qkv.weight", (spec.conv_dim, hidden)),
                               ("in_proj_z.weight", (self.value_dim, hidden)),
                               ("in_proj_b.weight", (hv, hidden)),
                               ("in_proj_a.weight", (hv, hidden))])
        conv = w.host("conv1d.weight", (spec.conv_dim, 1, spec.kernel_size))
        self.conv = w.ops.asarray(conv[:, 0, :])
        self.A_log = w.get("A_log", (hv,), np.float32)
        self.dt_bias = w.get("dt_bias", (hv,), np.float32)
        self.norm = w.get("norm.weight", (dv,))
        self.out_proj = w.get("out_proj.weight", (hidden, self.value_dim))

    def __call__(self, x, batch, caches):
        ops, s = self.ops, self.spec
        t, kd, vd, hv = x.shape[0], self.key_dim, self.value_dim, s.n_v_heads
        conv_state, ssm_state = caches.state(self.layer)
        proj = ops.linear(x, self.in_proj)
        qkv = ops.causal_conv1d(proj[:, : s.conv_dim], self.conv, conv_state, batch)
        z = proj[:, s.conv_dim: s.conv_dim + vd]
        b = proj[:, s.conv_dim + vd: s.conv_dim + vd + hv]
        a = proj[:, s.conv_dim + vd + hv:]
        q = qkv[:, :kd].reshape(t, -1, s.head_k_dim)
        k = qkv[:, kd: 2 * kd].reshape(t, -1, s.head_k_dim)
        v = qkv[:, 2 * kd:].reshape(t, hv, s.head_v_dim)
        o = ops.gated_delta_rule_with_gates(q, k, v, a, b, self.A_log, self.dt_bias, ssm_state, batch)
        o = ops.gated_rms_norm(o, z.reshape(t, hv, s.head_v_dim), self.norm, self.eps)
        return ops.linear(o.reshape(t, vd), self.out_proj)


def layer_types(config: dict) -> list[str]:
    n = config["num_hidden_layers"]
    types = config.get("layer_types")
    if types is None:
        interval = int(config.get("full_attention_interval", 4))
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
    if len(types) != n or any(t not in LAYER_TYPES for t in types):
        raise CheckpointError(f"layer_types {types!r} must list {n} entries from {LAYER_TYPES}")
    return list(types)


def _gdn_spec(config: dict) -> GdnSpec:
    hk, hv = config["linear_num_key_heads"], config["linear_num_value_heads"]
    dk, dv = config["linear_key_head_dim"], config["linear_value_head_dim"]
    if hv % hk:
        raise CheckpointError(f"linear_num_value_heads {hv} must be a multiple of linear_num_key_heads {hk}")
    return GdnSpec(conv_dim=2 * hk * dk + hv * dv, kernel_size=config.get("linear_conv_kernel_dim", 4),
                   n_v_heads=hv, head_k_dim=dk, head_v_dim=dv)


def _mlp(w: Weights, config: dict, moe: bool):
    """Dense SwiGLU (qwen3_5) or sparse MoE on every layer (qwen3_5_moe: HF's Qwen3.5 MoE has
    no mlp_only_layers / decoder_sparse_step, so neither is read here)."""
    hidden = config["hidden_size"]
    if not moe:
        return DenseMLP(w, hidden, config["intermediate_size"], into_norm=True)
    return SparseMoe(w, hidden, config["num_experts"], config["moe_intermediate_size"],
                     config["num_experts_per_tok"], bool(config.get("norm_topk_prob", True)),
                     config.get("shared_expert_intermediate_size", 0))


def _text_prefix(ckpt: Checkpoint) -> str:
    for prefix in ("model.language_model.", "model."):
        if ckpt.has(prefix + "embed_tokens.weight"):
            return prefix
    raise CheckpointError(f"{ckpt.path}: no 'model.language_model.embed_tokens.weight' or "
                          f"'model.embed_tokens.weight'; is this a Qwen3.5 checkpoint?")


def build_qwen3_5(ckpt: Checkpoint, ops) -> CausalLM:
    config = ckpt.config
    require_silu(config, ckpt.path)
    hidden = config["hidden_size"]
    norm = NormSpec(float(config.get("rms_norm_eps", 1e-6)), 1.0)
    attn_shape = AttentionShape(config["num_attention_heads"], config["num_key_value_heads"],
                                head_dim_of(config), gated=True)
    rope = rope_from_config(config, attn_shape.head_dim, default_partial=0.25)
    if rope.attention_factor != 1.0:
        raise CheckpointError(f"{ckpt.path}: config.json's rope settings give an attention factor "
                              f"of {rope.attention_factor:.4f} (YaRN); not supported for Qwen3.5")
    gdn = _gdn_spec(config)
    prefix = _text_prefix(ckpt)
    moe = ckpt.model_type in MOE_MODEL_TYPES
    root = Weights(ckpt, ops)
    layers, specs = [], []
    for i, kind in enumerate(layer_types(config)):
        w = root.sub(f"{prefix}layers.{i}.")
        if kind == "linear_attention":
            mixer = GatedDeltaNet(w.sub("linear_attn."), i, hidden, gdn, norm.eps, config["linear_num_key_heads"])
            specs.append(gdn)
        else:
            mixer = Attention(w.sub("self_attn."), i, hidden, attn_shape, norm, rope.frequencies,
                              qkv_bias=False, o_bias=False, qk_norm=True)
            specs.append(AttentionSpec(attn_shape.n_kv_heads, attn_shape.head_dim))
        layers.append(DecoderLayer(ops, mixer, _mlp(w.sub("mlp."), config, moe),
                                   w.get("input_layernorm.weight", (hidden,)),
                                   w.get("post_attention_layernorm.weight", (hidden,)), norm))
    embed, lm_head = load_embeddings(root, config, prefix)
    return CausalLM(config, ops, CacheSpec(tuple(specs)), embed, layers,
                    root.get(prefix + "norm.weight", (hidden,)), lm_head, norm)
