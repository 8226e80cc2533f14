"""Gemma 4 (`gemma4`, `gemma4_text`), text part, as HF transformers' Gemma4ForCausalLM computes it.

    embed       embed_tokens[ids] * sqrt(hidden) (the scale rounded to the embedding dtype first)
    layer i     h = post_attention_norm(attn(input_norm(x))); x = x + h
                h = mlp(pre_feedforward_norm(x))                      gated GELU-tanh MLP
                  (+ MoE: post_feedforward_norm_1(h) + post_feedforward_norm_2(experts(
                     pre_feedforward_norm_2(x))), routed from x, when enable_moe_block)
                x = x + post_feedforward_norm(h)
                (+ per-layer input: x = x + post_per_layer_input_norm(per_layer_projection(
                   gelu_tanh(per_layer_input_gate(x)) * ple[:, i])), hidden_size_per_layer_input)
                x = x * layer_scalar
    logits      lm_head(norm(x)), then cap * tanh(logits / cap) when final_logit_softcapping

Attention per `layer_types` (HF forces the last layer to full_attention): sliding_attention
layers see keys in (p - sliding_window, p] with their own rope (rope_parameters per layer type:
default / proportional); full_attention layers take their head_dim / num_key_value_heads from
`per_layer_config` (or the legacy `global_head_dim` / `num_global_key_value_heads`), and with
`attention_k_eq_v` have no v_proj (v is k's projection). q and k get RMSNorm (plain weight, no
+1), v an unweighted RMSNorm, attention scale 1. The last `num_kv_shared_layers` layers own no
K/V: each attends over the cache of the last earlier layer of its type (no cache of their own).
All norms are plain RMSNorm (x * rsqrt(mean(x^2) + eps) * w).

Settings this code cannot honour are refused at load, naming the field. Backends lacking an op
the config needs (sliding windows, soft-capping, GELU, the Gemma router: the CUDA kernels
today) refuse the checkpoint at load (metrale.models.layers.require_ops).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from metrale.cache.kv import AttentionSpec, CacheSpec
from metrale.models.checkpoint import Checkpoint, CheckpointError
from metrale.models.layers import CausalLM, NormSpec, Weights, require_ops
from metrale.models.rope import Rope, rope_of_layer_type

MODEL_TYPES = ("gemma4", "gemma4_text")
LAYER_TYPES = ("sliding_attention", "full_attention")
_PER_LAYER_FIELDS = ("head_dim", "num_key_value_heads")


@dataclass(frozen=True)
class LayerPlan:
    """One decoder layer's attention: its type, shape, and whose KV cache it reads."""
    kind: str
    head_dim: int
    n_kv_heads: int
    kv_source: int         # the layer whose K/V this one attends over (itself unless shared)

    @property
    def shared(self) -> bool:
        return self.kv_source >= 0


def layer_types(config: dict) -> list[str]:
    n = int(config["num_hidden_layers"])
    types = config.get("layer_types")
    if types is None:       # HF default: every 6th layer global (5:1)
        types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)]
    if len(types) != n or any(t not in LAYER_TYPES for t in types):
        raise CheckpointError(f"config.json: layer_types {types!r} must list {n} entries from {LAYER_TYPES}")
    return list(types[:-1]) + ["full_attention"]        # HF forces the last layer global


def _overrides(config: dict, types: list[str]) -> dict[int, dict]:
    """Per-layer head_dim / num_key_value_heads overrides, as HF Gemma4TextConfig resolves them."""
    given = config.get("per_layer_config")
    if given is None:
        over = {"head_dim": int(config.get("global_head_dim", 512))}
        if config.get("attention_k_eq_v", False) and config.get("num_global_key_value_heads") is not None:
            over["num_key_value_heads"] = int(config["num_global_key_value_heads"])
        return {i: over for i, t in enumerate(types) if t == "full_attention"}
    if not isinstance(given, dict):
        raise CheckpointError(f"config.json: per_layer_config must be an object, got {given!r}")
    out = {}
    for key, fields in given.items():
        if not str(key).isdigit() or not isinstance(fields, dict):
            raise CheckpointError(f"config.json: per_layer_config entry {key!r}: {fields!r} is not a "
                                  f"layer index with an object of overrides")
        unknown = sorted(set(fields) - set(_PER_LAYER_FIELDS))
        if unknown:
            raise CheckpointError(f"config.json: per_layer_config[{key}] overrides {unknown}; only "
                                  f"{list(_PER_LAYER_FIELDS)} per layer are supported")
        out[int(key)] = {k: int(v) for k, v in fields.items()}
    return out


def plan_layers(config: dict) -> list[LayerPlan]:
    types = layer_types(config)
    over = _overrides(config, types)
    n = len(types)
    shared = int(config.get("num_kv_shared_layers") or 0)
    if not 0 <= shared < n:
        raise CheckpointError(f"config.json: num_kv_shared_layers {shared} must be in [0, {n})")
    first_shared = n - shared
    plans = []
    for i, kind in enumerate(types):
        o = over.get(i, {})
        default_d = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
        d = o.get("head_dim", default_d)
        hk = o.get("num_key_value_heads", int(config["num_key_value_heads"]))
        source = -1
        if i >= first_shared:
            owners = [j for j in range(first_shared) if types[j] == kind]
            if not owners:
                raise CheckpointError(f"config.json: num_kv_shared_layers {shared}: layer {i} "
                                      f"({kind}) has no earlier {kind} layer to share K/V with")
            source = owners[-1]
            if (plans[source].head_dim, plans[source].n_kv_heads) != (d, hk):
                raise CheckpointError(f"config.json: layer {i} shares the K/V of layer {source} "
                                      f"but their head_dim / num_key_value_heads differ")
        plans.append(LayerPlan(kind, d, hk, source))
    return plans


def refuse_unsupported(config: dict, path: str) -> None:
    act = config.get("hidden_activation", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise CheckpointError(f"{path}: hidden_activation {act!r} is not supported for Gemma 4 "
                              f"(only 'gelu_pytorch_tanh')")
    if config.get("use_bidirectional_attention") == "all":
        raise CheckpointError(f"{path}: use_bidirectional_attention 'all' (non-causal attention) is "
                              f"not supported; only causal text attention is")
    if config.get("attention_bias"):
        raise CheckpointError(f"{path}: attention_bias true is not supported for Gemma 4")
    if config.get("enable_moe_block") and not (config.get("num_experts") and config.get("top_k_experts")
                                               and config.get("moe_intermediate_size")):
        raise CheckpointError(f"{path}: enable_moe_block needs num_experts, top_k_experts and "
                              f"moe_intermediate_size")


def needed_ops(config: dict, plans: list[LayerPlan]) -> dict[str, str]:
    """The ops (name -> feature) a Gemma 4 config needs beyond the common ones."""
    needed = {"gelu_tanh_mul": "the GELU-tanh gated MLP"}
    if any(p.kind == "sliding_attention" for p in plans):
        needed["sliding_attention"] = "sliding-window attention"
    if config.get("final_logit_softcapping"):
        needed["softcap"] = "final logit soft-capping"
    if config.get("enable_moe_block"):
        needed["route_topk"] = "the Gemma 4 MoE router (per-expert scales)"
        needed["moe_topk"] = "MoE experts with a GELU-tanh MLP"
    return needed


class Gemma4Attention:
    """Paged GQA attention of one Gemma 4 layer (see the module docstring)."""

    def __init__(self, w: Weights, plan: LayerPlan, cache_layer: int, config: dict, rope: Rope, k_eq_v: bool):
        self.ops, self.plan, self.cache_layer = w.ops, plan, cache_layer
        hidden, hq, d, hk = config["hidden_size"], config["num_attention_heads"], plan.head_dim, plan.n_kv_heads
        self.eps = float(config.get("rms_norm_eps", 1e-6))
        self.window = int(config["sliding_window"]) if plan.kind == "sliding_attention" else None
        self.k_eq_v = k_eq_v
        parts = [w.host("q_proj.weight", (hq * d, hidden))]
        if not plan.shared:
            parts.append(w.host("k_proj.weight", (hk * d, hidden)))
            if not k_eq_v:
                parts.append(w.host("v_proj.weight", (hk * d, hidden)))
        self.qkv = self.ops.asarray(np.concatenate(parts))
        self.q_norm = w.get("q_norm.weight", (d,))
        self.k_norm = None if plan.shared else w.get("k_norm.weight", (d,))
        self.v_norm = self.ops.asarray(np.ones(d, np.float32))     # v_norm has no weight
        self.o = w.get("o_proj.weight", (hidden, hq * d))
        self.inv_freq, self.rotary_dim = self.ops.asarray(rope.inv_freq, np.float32), rope.rotary_dim

    def __call__(self, x, batch, caches):
        ops, p = self.ops, self.plan
        t, d = x.shape[0], p.head_dim
        qkv = ops.linear(x, self.qkv)
        q_width = qkv.shape[1] - (0 if p.shared else p.n_kv_heads * d * (1 if self.k_eq_v else 2))
        q = qkv[:, :q_width].reshape(t, -1, d)
        k_cache, v_cache = caches.kv(self.cache_layer)
        if p.shared:
            q = ops.head_rms_norm(q, self.q_norm, self.eps, 0.0)
            q, _ = ops.rope(q, ops.zeros((t, 1, d)), batch.positions, self.inv_freq, self.rotary_dim)
        else:
            k = qkv[:, q_width: q_width + p.n_kv_heads * d].reshape(t, p.n_kv_heads, d)
            v = k if self.k_eq_v else qkv[:, q_width + p.n_kv_heads * d:].reshape(t, p.n_kv_heads, d)
            v = ops.head_rms_norm(v, self.v_norm, self.eps, 0.0)
            q = ops.qk_norm_rope_write_kv(q, k, v, self.q_norm, self.k_norm, self.eps, 0.0, batch.positions,
                                          self.inv_freq, self.rotary_dim, k_cache, v_cache, batch)
        if self.window is not None:
            o = ops.sliding_attention(q, k_cache, v_cache, batch, 1.0, self.window)
        else:
            o = ops.attention(q, k_cache, v_cache, batch, 1.0)
        return ops.linear(o.reshape(t, -1), self.o)


class GeluMLP:
    """down(gelu_tanh(gate(x)) * up(x)), gate|up fused."""

    def __init__(self, w: Weights, hidden: int, intermediate: int):
        self.ops = w.ops
        self.gate_up = w.rows([("gate_proj.weight", (intermediate, hidden)),
                               ("up_proj.weight", (intermediate, hidden))])
        self.down = w.get("down_proj.weight", (hidden, intermediate))

    def __call__(self, x):
        return self.ops.linear(self.ops.gelu_tanh_mul(self.ops.linear(x, self.gate_up)), self.down)


class Gemma4Moe:
    """The MoE beside the dense MLP: router RMSNorm(x) * scale / sqrt(hidden) -> proj -> softmax
    top-k, renormalised, times per_expert_scale; GELU-tanh experts."""

    def __init__(self, w: Weights, config: dict):
        self.ops = w.ops
        hidden, e = config["hidden_size"], int(config["num_experts"])
        inter, self.top_k = int(config["moe_intermediate_size"]), int(config["top_k_experts"])
        self.eps = float(config.get("rms_norm_eps", 1e-6))
        scale = np.asarray(w.host("router.scale", (hidden,)), np.float32) * np.float32(hidden ** -0.5)
        self.router_norm = self.ops.asarray(scale, np.float32)
        self.router = w.get("router.proj.weight", (e, hidden))
        self.expert_scale = w.get("router.per_expert_scale", (e,), np.float32)
        self.gate_up = w.get("experts.gate_up_proj", (e, 2 * inter, hidden))
        self.down = w.get("experts.down_proj", (e, hidden, inter))

    def __call__(self, x_route, x_in):
        ops = self.ops
        logits = ops.linear(ops.rms_norm(x_route, self.router_norm, self.eps, 0.0), self.router)
        weights, experts = ops.route_topk(logits, self.top_k, "softmax", True, expert_scale=self.expert_scale)
        return ops.moe_topk(x_in, weights, experts, self.gate_up, self.down, "gelu_tanh")


class Gemma4Layer:
    def __init__(self, w: Weights, index: int, attn: Gemma4Attention, config: dict, double_wide: bool):
        self.ops, self.index, self.attn = w.ops, index, attn
        hidden = config["hidden_size"]
        self.eps = float(config.get("rms_norm_eps", 1e-6))
        norm = lambda name: w.get(f"{name}.weight", (hidden,))  # noqa: E731
        self.input_norm, self.post_attn_norm = norm("input_layernorm"), norm("post_attention_layernorm")
        self.pre_ff_norm, self.post_ff_norm = norm("pre_feedforward_layernorm"), norm("post_feedforward_layernorm")
        self.mlp = GeluMLP(w.sub("mlp."), hidden, int(config["intermediate_size"]) * (2 if double_wide else 1))
        self.moe = Gemma4Moe(w, config) if config.get("enable_moe_block") else None
        if self.moe is not None:
            self.post_ff_norm_1 = norm("post_feedforward_layernorm_1")
            self.post_ff_norm_2 = norm("post_feedforward_layernorm_2")
            self.pre_ff_norm_2 = norm("pre_feedforward_layernorm_2")
        ple = int(config.get("hidden_size_per_layer_input") or 0)
        if ple:
            self.ple_gate = w.get("per_layer_input_gate.weight", (ple, hidden))
            self.ple_proj = w.get("per_layer_projection.weight", (hidden, ple))
            self.ple_norm = norm("post_per_layer_input_norm")
        self.scalar = float(np.asarray(w.host("layer_scalar", (1,)))[0]) if w.has("layer_scalar") else 1.0

    def __call__(self, x, batch, caches, per_layer_input):
        ops, eps = self.ops, self.eps
        h = self.attn(ops.rms_norm(x, self.input_norm, eps, 0.0), batch, caches)
        x = x + ops.rms_norm(h, self.post_attn_norm, eps, 0.0)
        h = self.mlp(ops.rms_norm(x, self.pre_ff_norm, eps, 0.0))
        if self.moe is not None:
            routed = self.moe(x, ops.rms_norm(x, self.pre_ff_norm_2, eps, 0.0))
            h = (ops.rms_norm(h, self.post_ff_norm_1, eps, 0.0)
                 + ops.rms_norm(routed, self.post_ff_norm_2, eps, 0.0))
        x = x + ops.rms_norm(h, self.post_ff_norm, eps, 0.0)
        if per_layer_input is not None:
            g = ops.gelu_tanh_mul(ops.linear(x, self.ple_gate), per_layer_input)
            x = x + ops.rms_norm(ops.linear(g, self.ple_proj), self.ple_norm, eps, 0.0)
        return x * self.scalar if self.scalar != 1.0 else x


class Gemma4LM(CausalLM):
    """CausalLM with Gemma 4's scaled embeddings, per-layer inputs, sandwich-norm layers and
    final soft-capping (forward_with_hidden below; the rest as CausalLM)."""

    def __init__(self, config, ops, spec, embed, layers, final_norm, lm_head, norm, ple):
        super().__init__(config, ops, spec, embed, layers, final_norm, lm_head, norm)
        self.embed_scale = _in_dtype(math.sqrt(config["hidden_size"]), embed.dtype)
        self.softcap = config.get("final_logit_softcapping")
        self.ple = ple          # (table, table scale, projection, norm, P) or None

    def per_layer_inputs(self, ids, x):
        """[T, L, P]: (RMSNorm(proj(x) / sqrt(H)) + table[ids] * sqrt(P)) / sqrt(2)."""
        ops, (table, table_scale, proj, norm, p) = self.ops, self.ple
        t, n = x.shape[0], len(self.layers)
        tok = (ops.embedding(ids, table) * table_scale).reshape(t, n, p)
        ctx = (ops.linear(x, proj) * (self.config["hidden_size"] ** -0.5)).reshape(t, n, p)
        ctx = ops.head_rms_norm(ctx, norm, self.norm.eps, 0.0)
        return (ctx + tok) * (2.0 ** -0.5)

    def forward_with_hidden(self, batch, caches):
        ops = self.ops
        x = ops.embedding(batch.input_ids, self.embed) * self.embed_scale
        ple = self.per_layer_inputs(batch.input_ids, x) if self.ple is not None else None
        for i, layer in enumerate(self.layers):
            x = layer(x, batch, caches, None if ple is None else ple[:, i])
        h = ops.rms_norm(x, self.final_norm, self.norm.eps, 0.0)
        logits = ops.lm_head(ops.embedding(batch.logits_indices, h), self.lm_head)
        if self.softcap:
            logits = ops.softcap(logits, float(self.softcap))
        return logits, h


def _in_dtype(value: float, dtype) -> float:
    """`value` rounded to `dtype` (HF multiplies by its scale buffer cast to the weight dtype)."""
    try:
        return float(np.asarray(value, np.float32).astype(np.dtype(dtype)))
    except TypeError:       # a device dtype numpy does not know: keep fp32
        return float(np.float32(value))


def _text_prefix(ckpt: Checkpoint) -> str:
    for prefix in ("model.language_model.", "model."):
        if ckpt.has(prefix + "embed_tokens.weight"):
            return prefix
    raise CheckpointError(f"{ckpt.path}: no 'model.embed_tokens.weight'; is this a Gemma 4 checkpoint?")


def _per_layer_embeddings(root: Weights, config: dict, prefix: str, n_layers: int):
    p = int(config.get("hidden_size_per_layer_input") or 0)
    if not p:
        return None
    hidden = config["hidden_size"]
    table = root.get(prefix + "embed_tokens_per_layer.weight",
                     (int(config.get("vocab_size_per_layer_input", config["vocab_size"])), n_layers * p))
    return (table, _in_dtype(math.sqrt(p), table.dtype),
            root.get(prefix + "per_layer_model_projection.weight", (n_layers * p, hidden)),
            root.get(prefix + "per_layer_projection_norm.weight", (p,)), p)


def build_gemma4(ckpt: Checkpoint, ops) -> Gemma4LM:
    config = dict(ckpt.config)
    config.setdefault("tie_word_embeddings", True)
    refuse_unsupported(config, ckpt.path)
    plans = plan_layers(config)
    require_ops(ops, "gemma4", needed_ops(config, plans), ckpt.path)
    ropes = {kind: rope_of_layer_type(config, kind, d) for kind, d in {(p.kind, p.head_dim) for p in plans}}
    prefix, root = _text_prefix(ckpt), Weights(ckpt, ops)
    hidden, n = config["hidden_size"], len(plans)
    k_eq_v = bool(config.get("attention_k_eq_v", False))
    cache_of, specs, layers = {}, [], []
    first_shared = n - int(config.get("num_kv_shared_layers") or 0)
    for i, plan in enumerate(plans):
        if not plan.shared:
            cache_of[i] = len(specs)
            specs.append(AttentionSpec(plan.n_kv_heads, plan.head_dim))
        w = root.sub(f"{prefix}layers.{i}.")
        attn = Gemma4Attention(w.sub("self_attn."), plan, cache_of[plan.kv_source if plan.shared else i],
                               config, ropes[plan.kind], k_eq_v and plan.kind == "full_attention")
        double_wide = bool(config.get("use_double_wide_mlp")) and i >= first_shared > 0
        layers.append(Gemma4Layer(w, i, attn, config, double_wide))
    shape = (config["vocab_size"], hidden)
    embed = root.get(prefix + "embed_tokens.weight", shape)
    lm_head = embed if config["tie_word_embeddings"] else root.get("lm_head.weight", shape)
    norm = NormSpec(float(config.get("rms_norm_eps", 1e-6)), 0.0)
    final_norm = root.get(prefix + "norm.weight", (hidden,))
    return Gemma4LM(config, ops, CacheSpec(tuple(specs)), embed, layers, final_norm, lm_head, norm,
                    _per_layer_embeddings(root, config, prefix, n))
