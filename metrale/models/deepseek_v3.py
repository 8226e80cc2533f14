"""DeepSeek V3 (`deepseek_v3`), as HF transformers' DeepseekV3ForCausalLM computes it.

    layer i   pre-norm residual block (plain RMSNorm): multi-head latent attention, then a
              dense SwiGLU MLP (i < first_k_dense_replace, or i % moe_layer_freq != 0 where the
              config sets it, as DeepSeek's own modeling code reads it) or the MoE
    MLA       per head h (H heads; Dn = qk_nope_head_dim, Dr = qk_rope_head_dim, Dv =
              v_head_dim, R = kv_lora_rank):
                q  = q_b(rms_norm(q_a(x)))  or q_proj(x) when q_lora_rank is null (V2-Lite style)
                     per head [q_nope (Dn) | q_pe (Dr)]
                [c | k_pe] = kv_a_proj_with_mqa(x);  c = kv_a_layernorm(c)   (one latent, R)
                q_pe, k_pe roped (k_pe is one key shared by the heads); with rope_interleave the
                     rotated pairs are (0, 1), (2, 3) ... (HF apply_rotary_pos_emb_interleave)
                k[h] = [W_UK[h] c | k_pe],  v[h] = W_UV[h] c      (kv_b_proj rows: per head
                     [W_UK (Dn) | W_UV (Dv)], each [., R])
                scale = qk_head_dim^-0.5 * mscale(factor, mscale_all_dim)^2 for a scaled rope
                     (HF yarn_apply_mscale), and the YaRN attention factor on cos / sin
    MoE       scores = sigmoid(gate(x)) (fp32); choice = scores + e_score_correction_bias,
              limited to the topk_group best of n_group groups (each scored by its two best
              choices); weights = the chosen experts' scores, renormalised when norm_topk_prob,
              times routed_scaling_factor; plus the shared experts (one SwiGLU MLP of width
              moe_intermediate_size * n_shared_experts) for every token

The cache (metrale.cache.kv.MlaSpec) is the latent: per token [c (R) | k_pe (Dr)], paged like
any layer's KV. Decode steps attend over it directly, the absorbed form (q_nope through W_UK
into the latent space, attention over [c | k_pe], the output through W_UV); other steps
(prefill chunks, mixed batches) expand the cached latents of each sequence to per-head K and V
through kv_b_proj (the expanded form). Both compute what HF computes.

Rope layout: the rotary rows of q_b_proj / q_proj and kv_a_proj_with_mqa are permuted at load
(interleaved pairs -> rotate-half halves: a row gather, so quantized weights permute the same
way), which gives exactly HF's interleaved rotation in the ops' one rotate-half layout.

Tensors: the hub / save_pretrained names (`model.layers.{i}.self_attn.q_a_proj.weight`, ...,
`mlp.gate.weight`, `mlp.gate.e_score_correction_bias`, `mlp.experts.{e}.gate_proj.weight` or the
fused `mlp.experts.gate_up_proj` [E, 2I, H], `mlp.shared_experts.*`), block FP8 or bf16
(metrale.models.quant). kv_b_proj is also kept dequantised per head (W_UK, W_UV) for the
absorbed form, as SGLang and vLLM do. The release's MTP layer (`model.layers.{n}.*`, n =
num_hidden_layers; HF reads none) is the drafter head of metrale.models.deepseek_mtp.

Settings this code cannot honour are refused at load naming the field; a backend without the
MLA and routed-MoE ops (the CUDA kernels today) refuses the checkpoint at load.
"""
from __future__ import annotations

import math

import numpy as np

from metrale.cache.kv import CacheSpec, MlaSpec
from metrale.models.checkpoint import Checkpoint, CheckpointError
from metrale.models.layers import (CausalLM, DecoderLayer, DenseMLP, NormSpec, Weights, expert_tensors,
                                   load_embeddings, require_ops, require_silu)
from metrale.models.quant import dense
from metrale.models.rope import Rope, rope_from_config, rope_parameters

NEEDED_OPS = {"mla_prologue": "multi-head latent attention (norm, rope and the latent cache write)",
              "latent_attention": "absorbed multi-head latent attention (decode)",
              "gather_latents": "reading a sequence's cached latents (expanded MLA prefill)",
              "mla_expanded_attention": "expanded multi-head latent attention (prefill)",
              "head_linear": "per-head linears (the MLA absorption)",
              "route_topk": "grouped sigmoid MoE routing with a score-correction bias",
              "moe_topk": "MoE experts over a precomputed routing"}


class MlaShape:
    """The head dimensions of one MLA layer, from config.json."""

    def __init__(self, config: dict):
        self.n_heads = int(config["num_attention_heads"])
        self.nope, self.rope = int(config["qk_nope_head_dim"]), int(config["qk_rope_head_dim"])
        self.v, self.rank = int(config["v_head_dim"]), int(config["kv_lora_rank"])
        self.q_rank = config.get("q_lora_rank")
        self.qk = self.nope + self.rope


def _rope_rows(shape: MlaShape, interleave: bool) -> tuple[np.ndarray, np.ndarray]:
    """(q rows, kv_a rows): the row order of q_b_proj / q_proj and kv_a_proj_with_mqa that puts
    each rotary part in rotate-half order (evens then odds when interleaved)."""
    r = np.arange(shape.rope)
    perm = np.concatenate([r[0::2], r[1::2]]) if interleave else r
    head = np.concatenate([np.arange(shape.nope), shape.nope + perm])
    q_rows = (np.arange(shape.n_heads)[:, None] * shape.qk + head[None, :]).ravel()
    return q_rows, np.concatenate([np.arange(shape.rank), shape.rank + perm])


class MlaAttention:
    """Multi-head latent attention over the paged latent cache (see the module docstring).
    Fused projection of x: [q (q_lora_rank, or H * (Dn + Dr) without q LoRA) | c (R) | k_pe (Dr)]."""

    def __init__(self, w: Weights, layer: int, hidden: int, shape: MlaShape, eps: float, rope: Rope,
                 scale: float, interleave: bool, bias: bool):
        self.ops, self.layer, self.shape, self.eps, self.scale = w.ops, layer, shape, eps, scale
        h, s = shape.n_heads, shape
        q_rows, kv_rows = _rope_rows(shape, interleave)
        kv_a = w.host("kv_a_proj_with_mqa.weight", (s.rank + s.rope, hidden))[kv_rows]
        if s.q_rank is None:
            q = w.host("q_proj.weight", (h * s.qk, hidden))[q_rows]
            self.q_width, self.q_a_norm, self.q_b = h * s.qk, None, None
            q_bias = np.zeros(h * s.qk, np.float32)
        else:
            q = w.host("q_a_proj.weight", (s.q_rank, hidden))
            self.q_width = s.q_rank
            self.q_a_norm = w.get("q_a_layernorm.weight", (s.q_rank,))
            self.q_b = self.ops.asarray(w.host("q_b_proj.weight", (h * s.qk, s.q_rank))[q_rows])
            q_bias = w.host("q_a_proj.bias", (s.q_rank,)) if bias else None
        self.a = self.ops.asarray(np.concatenate([q, kv_a]))
        self.a_bias = (self.ops.asarray(np.concatenate(
            [np.asarray(q_bias, np.float32), np.asarray(w.host("kv_a_proj_with_mqa.bias", (s.rank + s.rope,)),
                                                        np.float32)[kv_rows]])) if bias else None)
        self.kv_norm = w.get("kv_a_layernorm.weight", (s.rank,))
        kv_b = w.host("kv_b_proj.weight", (h * (s.nope + s.v), s.rank))
        self.kv_b = self.ops.asarray(kv_b)                                    # expanded form
        per_head = dense(kv_b).reshape(h, s.nope + s.v, s.rank)
        self.w_uk = self.ops.asarray(np.ascontiguousarray(per_head[:, : s.nope].transpose(0, 2, 1)))  # [H, R, Dn]
        self.w_uv = self.ops.asarray(np.ascontiguousarray(per_head[:, s.nope:]))                     # [H, Dv, R]
        self.o = w.get("o_proj.weight", (hidden, h * s.v))
        self.o_bias = w.get("o_proj.bias", (hidden,)) if bias else None
        self.inv_freq = self.ops.asarray(rope.inv_freq, np.float32)
        self.attention_factor = rope.attention_factor

    def __call__(self, x, batch, caches):
        ops, s = self.ops, self.shape
        t = x.shape[0]
        a = ops.linear(x, self.a, self.a_bias)
        q = a[:, : self.q_width]
        if self.q_b is not None:
            q = ops.linear(ops.rms_norm(q, self.q_a_norm, self.eps, 0.0), self.q_b)
        latent = caches.latent(self.layer)
        q = ops.mla_prologue(q.reshape(t, s.n_heads, s.qk), a[:, self.q_width:], self.kv_norm, self.eps,
                             batch.positions, self.inv_freq, self.attention_factor, latent, batch)
        o = self.absorbed(q, latent, batch) if batch.is_decode else self.expanded(q, latent, batch)
        return ops.linear(o.reshape(t, s.n_heads * s.v), self.o, self.o_bias)

    def absorbed(self, q, latent, batch):
        """Attention in the latent space: [T, H, Dv]."""
        ops, s = self.ops, self.shape
        q_latent = ops.head_linear(q[..., : s.nope], self.w_uk)                     # [T, H, R]
        o = ops.latent_attention(q_latent, q[..., s.nope:], latent, batch, self.scale)
        return ops.head_linear(o, self.w_uv)

    def expanded(self, q, latent, batch):
        """Attention over per-head keys and values decompressed from the cached latents:
        [T, H, Dv]."""
        ops, s = self.ops, self.shape
        rows = ops.gather_latents(latent, batch)                                      # [S, R + Dr]
        kv = ops.linear(rows[:, : s.rank], self.kv_b).reshape(-1, s.n_heads, s.nope + s.v)
        return ops.mla_expanded_attention(q, kv, rows[:, s.rank:], batch, self.scale)


class DeepseekMoe:
    """Grouped sigmoid top-k routed experts plus the shared experts (module docstring)."""

    def __init__(self, w: Weights, config: dict, hidden: int):
        self.ops = w.ops
        n, inter = int(config["n_routed_experts"]), int(config["moe_intermediate_size"])
        self.top_k, self.renormalize = int(config["num_experts_per_tok"]), bool(config.get("norm_topk_prob", True))
        self.groups = (int(config.get("n_group") or 1), int(config.get("topk_group") or 1))
        self.scale = float(config.get("routed_scaling_factor", 1.0))
        self.router = w.get("gate.weight", (n, hidden), np.float32)
        bias = "gate.e_score_correction_bias"
        self.bias = w.get(bias, (n,), np.float32) if w.has(bias) else self.ops.asarray(np.zeros(n, np.float32))
        gate_up, down = expert_tensors(w.sub("experts."), hidden, n, inter)
        self.gate_up, self.down = self.ops.asarray(gate_up), self.ops.asarray(down)
        shared = inter * int(config.get("n_shared_experts") or 0)
        self.shared = DenseMLP(w.sub("shared_experts."), hidden, shared) if shared else None

    def __call__(self, x, batch=None, caches=None):
        ops = self.ops
        logits = ops.lm_head(x, self.router)          # fp32 router logits, as HF computes them
        weights, experts = ops.route_topk(logits, self.top_k, "sigmoid", self.renormalize,
                                          bias=self.bias, groups=self.groups, scale=self.scale)
        y = ops.moe_topk(x, weights, experts, self.gate_up, self.down, "silu")
        return y if self.shared is None else y + self.shared(x)


def softmax_scale(config: dict, qk_head_dim: int) -> float:
    """HF yarn_apply_mscale: qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 when the
    rope is scaled and mscale_all_dim is set."""
    scale = qk_head_dim ** -0.5
    params = rope_parameters(config)
    if (params.get("rope_type") or params.get("type") or "default") != "default":
        all_dim = params.get("mscale_all_dim") or 0
        factor = float(params.get("factor") or 1.0)
        if all_dim and factor > 1:
            m = 0.1 * float(all_dim) * math.log(factor) + 1.0
            scale *= m * m
    return scale


def refuse_unsupported(config: dict, path: str) -> None:
    require_silu(config, path)
    checks = (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"))
    for field, supported in checks:
        if field in config and config[field] != supported:
            raise CheckpointError(f"{path}: config.json sets {field} {config[field]!r}; only {supported!r} is "
                                  f"supported for DeepSeek V3 (what HF transformers computes)")
    n, groups = int(config["n_routed_experts"]), int(config.get("n_group") or 1)
    if n % groups or n // groups < 2 or int(config.get("topk_group") or 1) > groups:
        raise CheckpointError(f"{path}: config.json sets n_routed_experts {n}, n_group {groups}, topk_group "
                              f"{config.get('topk_group')}: the experts must split into n_group groups of at least "
                              f"2, and topk_group must not exceed n_group")
    if int(config.get("num_key_value_heads") or config["num_attention_heads"]) != int(config["num_attention_heads"]):
        raise CheckpointError(f"{path}: config.json sets num_key_value_heads {config['num_key_value_heads']} != "
                              f"num_attention_heads {config['num_attention_heads']}; MLA has one latent per token")


def is_moe_layer(config: dict, i: int) -> bool:
    freq = int(config.get("moe_layer_freq") or 1)
    return i >= int(config.get("first_k_dense_replace") or 0) and i % freq == 0


def _norm(config: dict) -> NormSpec:
    return NormSpec(float(config.get("rms_norm_eps", 1e-6)), 0.0)


def decoder_layer(root: Weights, config: dict, i: int, cache_layer: int) -> DecoderLayer:
    """Decoder layer `model.layers.{i}` (its MLP kind by i), caching in cache layer
    `cache_layer` (i for the main model, 0 for the MTP head's own cache)."""
    ops, hidden, shape, norm = root.ops, config["hidden_size"], MlaShape(config), _norm(config)
    w = root.sub(f"model.layers.{i}.")
    attn = MlaAttention(w.sub("self_attn."), cache_layer, hidden, shape, norm.eps,
                        rope_from_config(config, shape.rope), softmax_scale(config, shape.qk),
                        bool(config.get("rope_interleave", True)), bool(config.get("attention_bias", False)))
    mlp = (DeepseekMoe(w.sub("mlp."), config, hidden) if is_moe_layer(config, i)
           else DenseMLP(w.sub("mlp."), hidden, config["intermediate_size"], into_norm=True))
    return DecoderLayer(ops, attn, mlp, w.get("input_layernorm.weight", (hidden,)),
                        w.get("post_attention_layernorm.weight", (hidden,)), norm)


def build_deepseek_v3(ckpt: Checkpoint, ops) -> CausalLM:
    config = ckpt.config
    refuse_unsupported(config, ckpt.path)
    require_ops(ops, "deepseek_v3", NEEDED_OPS, ckpt.path)
    hidden, n_layers, shape = config["hidden_size"], config["num_hidden_layers"], MlaShape(config)
    root = Weights(ckpt, ops)
    layers = [decoder_layer(root, config, i, i) for i in range(n_layers)]
    embed, lm_head = load_embeddings(root, config, "model.")
    spec = CacheSpec(tuple(MlaSpec(shape.rank, shape.rope) for _ in range(n_layers)))
    return CausalLM(config, ops, spec, embed, layers, root.get("model.norm.weight", (hidden,)), lm_head,
                    _norm(config))
