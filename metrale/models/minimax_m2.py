"""MiniMax M2 (`minimax_m2`), as HF transformers' MiniMaxM2ForCausalLM computes it.

    layer i   pre-norm residual block (RMSNorm, plain weight): attention, then a sparse MoE on
              every layer (no dense MLP, no shared expert)
    attention GQA; q_norm / k_norm are RMSNorms over the WHOLE projection (all heads together:
              weights [Hq * D] / [Hk * D]), before rotary; partial rotary
              (rope_parameters.partial_rotary_factor) on the first dims of each head; scale D^-0.5
    MoE       router logits = gate(x); scores = sigmoid(logits); the top-k experts by scores +
              e_score_correction_bias; weights = their scores renormalised to sum 1; SwiGLU
              experts (w1 gate, w3 up, w2 down)

Tensors load from transformers 5's in-memory layout (`mlp.gate.weight`, `mlp.experts.gate_up_proj`
[E, 2I, H], `mlp.experts.down_proj`, `mlp.e_score_correction_bias`) or the hub release's
(`block_sparse_moe.gate.weight`, `block_sparse_moe.experts.{e}.w1|w2|w3.weight`,
`block_sparse_moe.e_score_correction_bias`), or a GGUF file (metrale.models.gguf_loader: the
experts stacked as `block_sparse_moe.experts.w1|w2|w3.weight` [E, ., .]). The release's MTP
modules are not read (HF reads none either).

Settings this code cannot honour are refused at load, naming the field; a backend without the
sigmoid-routed MoE ops (the CUDA kernels today) refuses the checkpoint at load.
"""
from __future__ import annotations

import numpy as np

from metrale.cache.kv import AttentionSpec, CacheSpec
from metrale.models.checkpoint import Checkpoint, CheckpointError
from metrale.models.layers import (AttentionShape, CausalLM, DecoderLayer, NormSpec, Weights, head_dim_of,
                                   load_embeddings, require_ops, require_silu)
from metrale.models.rope import Rope, rope_from_config

DEFAULT_THETA = 5000000.0       # HF MiniMaxM2Config.default_theta, where config.json gives none
NEEDED_OPS = {"route_topk": "sigmoid MoE routing with a score-correction bias",
              "moe_topk": "MoE experts over a precomputed routing"}


class MiniMaxAttention:
    def __init__(self, w: Weights, layer: int, hidden: int, shape: AttentionShape, eps: float, rope: Rope):
        self.ops, self.layer, self.shape, self.eps = w.ops, layer, shape, eps
        hq, hk, d = shape.n_heads, shape.n_kv_heads, shape.head_dim
        self.qkv = w.rows([("q_proj.weight", (hq * d, hidden)), ("k_proj.weight", (hk * d, hidden)),
                           ("v_proj.weight", (hk * d, hidden))])
        self.q_norm = w.get("q_norm.weight", (hq * d,))
        self.k_norm = w.get("k_norm.weight", (hk * d,))
        self.o = w.get("o_proj.weight", (hidden, hq * d))
        self.inv_freq, self.rotary_dim = self.ops.asarray(rope.inv_freq, np.float32), rope.rotary_dim

    def __call__(self, x, batch, caches):
        ops, (hq, hk, d) = self.ops, (self.shape.n_heads, self.shape.n_kv_heads, self.shape.head_dim)
        t = x.shape[0]
        qkv = ops.linear(x, self.qkv)
        q = ops.rms_norm(qkv[:, : hq * d], self.q_norm, self.eps, 0.0).reshape(t, hq, d)
        k = ops.rms_norm(qkv[:, hq * d: (hq + hk) * d], self.k_norm, self.eps, 0.0).reshape(t, hk, d)
        v = qkv[:, (hq + hk) * d:].reshape(t, hk, d)
        k_cache, v_cache = caches.kv(self.layer)
        q = ops.qk_norm_rope_write_kv(q, k, v, None, None, self.eps, 0.0, batch.positions, self.inv_freq,
                                      self.rotary_dim, k_cache, v_cache, batch)
        o = ops.attention(q, k_cache, v_cache, batch, d ** -0.5)
        return ops.linear(o.reshape(t, hq * d), self.o)


class SigmoidMoe:
    """Sigmoid-scored top-k MoE with a score-correction bias (see the module docstring)."""

    def __init__(self, w: Weights, hidden: int, n_experts: int, inter: int, top_k: int):
        self.ops, self.top_k = w.ops, top_k
        self.router = w.get("gate.weight", (n_experts, hidden))
        bias = "e_score_correction_bias"
        self.bias = (w.get(bias, (n_experts,), np.float32) if w.has(bias)
                     else w.ops.asarray(np.zeros(n_experts, np.float32), np.float32))
        e = w.sub("experts.")
        if e.has("gate_up_proj"):
            self.gate_up = e.get("gate_up_proj", (n_experts, 2 * inter, hidden))
            self.down = e.get("down_proj", (n_experts, hidden, inter))
        elif e.has("w1.weight"):        # stacked per layer (llama.cpp's GGUF converter)
            self.gate_up = w.ops.asarray(np.concatenate([e.host("w1.weight", (n_experts, inter, hidden)),
                                                         e.host("w3.weight", (n_experts, inter, hidden))], axis=1))
            self.down = e.get("w2.weight", (n_experts, hidden, inter))
        else:
            self.gate_up = w.ops.asarray(np.stack([np.concatenate([e.host(f"{i}.w1.weight", (inter, hidden)),
                                                                   e.host(f"{i}.w3.weight", (inter, hidden))])
                                                   for i in range(n_experts)]))
            self.down = w.ops.asarray(np.stack([e.host(f"{i}.w2.weight", (hidden, inter))
                                                for i in range(n_experts)]))

    def __call__(self, x, batch=None, caches=None):
        ops = self.ops
        weights, experts = ops.route_topk(ops.linear(x, self.router), self.top_k, "sigmoid", True, bias=self.bias)
        return ops.moe_topk(x, weights, experts, self.gate_up, self.down, "silu")


def _rope(config: dict, head_dim: int, path: str) -> Rope:
    rope = rope_from_config({"rope_theta": DEFAULT_THETA, **config}, head_dim)
    if rope.attention_factor != 1.0:
        raise CheckpointError(f"{path}: config.json's rope settings give an attention factor of "
                              f"{rope.attention_factor:.4f}; not supported for MiniMax M2")
    given = config.get("rotary_dim")
    if given is not None and int(given) != rope.rotary_dim:
        raise CheckpointError(
            f"{path}: config.json sets rotary_dim {given} but its partial_rotary_factor gives "
            f"{rope.rotary_dim} rotated dims (what HF transformers rotates); set "
            f"rope_parameters.partial_rotary_factor to {int(given) / head_dim}")
    return rope


def refuse_unsupported(config: dict, path: str) -> None:
    require_silu(config, path)
    checks = (("use_qk_norm", True), ("qk_norm_type", "per_layer"), ("scoring_func", "sigmoid"))
    for field, supported in checks:
        if field in config and config[field] != supported:
            raise CheckpointError(f"{path}: config.json sets {field} {config[field]!r}; only "
                                  f"{supported!r} is supported for MiniMax M2 (what HF transformers computes)")
    if config.get("shared_intermediate_size"):
        raise CheckpointError(f"{path}: config.json sets shared_intermediate_size "
                              f"{config['shared_intermediate_size']}: shared experts are not supported")


def _moe_prefix(w: Weights) -> str:
    return "mlp." if w.has("mlp.gate.weight") else "block_sparse_moe."


def build_minimax_m2(ckpt: Checkpoint, ops) -> CausalLM:
    config = ckpt.config
    refuse_unsupported(config, ckpt.path)
    require_ops(ops, "minimax_m2", NEEDED_OPS, ckpt.path)
    hidden, n_layers = config["hidden_size"], config["num_hidden_layers"]
    shape = AttentionShape(config["num_attention_heads"], config["num_key_value_heads"], head_dim_of(config))
    norm = NormSpec(float(config.get("rms_norm_eps", 1e-6)), 0.0)
    rope = _rope(config, shape.head_dim, ckpt.path)
    n_experts = int(config.get("num_local_experts") or config["num_experts"])
    root, layers = Weights(ckpt, ops), []
    for i in range(n_layers):
        w = root.sub(f"model.layers.{i}.")
        attn = MiniMaxAttention(w.sub("self_attn."), i, hidden, shape, norm.eps, rope)
        moe = SigmoidMoe(w.sub(_moe_prefix(w)), hidden, n_experts, config["intermediate_size"],
                         config["num_experts_per_tok"])
        layers.append(DecoderLayer(ops, attn, moe, w.get("input_layernorm.weight", (hidden,)),
                                   w.get("post_attention_layernorm.weight", (hidden,)), norm))
    embed, lm_head = load_embeddings(root, config, "model.")
    spec = CacheSpec(tuple(AttentionSpec(shape.n_kv_heads, shape.head_dim) for _ in range(n_layers)))
    return CausalLM(config, ops, spec, embed, layers, root.get("model.norm.weight", (hidden,)), lm_head, norm)
