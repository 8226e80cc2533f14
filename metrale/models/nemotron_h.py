"""Nemotron-H (`nemotron_h`), as HF transformers' NemotronHForCausalLM computes it.

A stack of pre-norm residual blocks x + mixer(RMSNorm(x)) (one plain RMSNorm per block, eps
layer_norm_epsilon), then norm_f and the lm head (lm_head.weight; HF ties nothing even under
tie_word_embeddings, see _lm_head). Each block's mixer is given by
`layers_block_type` (transformers 5; legacy "mamba" / "attention" accepted) or the hub's
`hybrid_override_pattern` (M = Mamba-2, * = attention, - = MLP, E = MoE):

    Mamba-2   in_proj -> [gate z (I) | xBC (I + 2 G N) | dt (H)], I = H * P;
              causal depthwise conv1d (+ bias with use_conv_bias) + SiLU over xBC, the conv
              window cached; split x [H, P] | B [G, N] | C [G, N]; the SSD scan
              (ops.ssd_scan: delta = clamp(softplus(dt + dt_bias), time_step_min, inf), A =
              -exp(A_log), D skip; chunked over `chunk_size` for prefill, recurrent for decode);
              y * silu(z) then RMSNorm per group of I / G channels (norm_before_gate=False);
              out_proj. in_proj / out_proj biases with use_bias.
    attention GQA without any positional encoding (HF applies no rope), scale D^-0.5, no
              biases (HF builds q/k/v/o without bias whatever attention_bias says).
    MLP       down(relu2(up(x))) (mlp_hidden_act relu2), biases with mlp_bias.
    MoE       router logits = gate(x) in fp32; scores = sigmoid; the top-k experts by scores +
              e_score_correction_bias; weights = their scores (renormalised with
              norm_topk_prob) * routed_scaling_factor; non-gated relu2 experts, optionally in a
              latent space (fc1_latent_proj before, fc2_latent_proj after, moe_latent_size);
              plus the shared expert (a relu2 MLP of moe_shared_expert_intermediate_size).

The dt limit: HF's mixer clamps delta to (time_step_min, inf) in its chunked (prefill) form and
not at all in its recurrent (decode) form; here every form clamps the same way, so a token's
result does not depend on how the step was chunked. The Mamba-2 states live in the GDN state
pool (metrale.cache.kv.Mamba2Spec): chunked prefill, prefix-cache snapshots, preemption and
speculative verify rows work as for Qwen3.5's GDN layers.

Tensors load from `model.*` (transformers 5) or `backbone.*` (the hub release); experts stacked
(`experts.up_proj` [E, I, H']) or per expert (`experts.{e}.up_proj.weight`), or a llama.cpp
GGUF file (metrale.models.gguf_loader maps it to the transformers 5 layout). The MTP layers of
Nemotron 3 releases are not read (HF reads none either). Settings this code cannot honour are
refused at load naming the field; a backend without the Mamba-2 ops (CUDA today) refuses the
checkpoint at load.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from metrale.cache.kv import AttentionSpec, CacheSpec, Mamba2Spec
from metrale.models.checkpoint import Checkpoint, CheckpointError
from metrale.models.layers import CausalLM, NormSpec, Weights, require_ops

PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
LEGACY_TYPES = {"mamba": "linear_attention", "attention": "full_attention"}
NEEDED_OPS = {"causal_conv1d_bias": "the Mamba-2 conv1d with a bias",
              "ssd_scan": "the Mamba-2 selective scan (SSD)",
              "group_rms_norm_gated": "the Mamba-2 grouped gated RMSNorm",
              "relu2": "the squared-ReLU MLP activation"}
MOE_OPS = {"route_topk": "sigmoid MoE routing with a score-correction bias",
           "moe_topk_relu2": "non-gated squared-ReLU MoE experts"}
# transformers' config keeps accepting these older spellings (NemotronHConfig.__post_init__)
ALIASES = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_dt_min": "time_step_min",
           "mamba_conv_bias": "use_conv_bias", "mamba_chunk_size": "chunk_size"}


@dataclass(frozen=True)
class MambaShape:
    n_heads: int
    head_dim: int
    n_groups: int
    state_size: int
    conv_kernel: int
    chunk_size: int
    dt_min: float
    conv_bias: bool
    proj_bias: bool

    @property
    def inner(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.inner + 2 * self.n_groups * self.state_size

    def spec(self) -> Mamba2Spec:
        return Mamba2Spec.of(self.conv_dim, self.conv_kernel, self.n_heads, self.head_dim, self.state_size)


class Mamba2Mixer:
    """The Mamba-2 mixer (see the module docstring). in_proj rows: [z (I) | xBC (conv_dim) | dt (H)]."""

    def __init__(self, w: Weights, layer: int, hidden: int, m: MambaShape, eps: float):
        self.ops, self.layer, self.m, self.eps = w.ops, layer, m, eps
        rows = m.inner + m.conv_dim + m.n_heads
        self.in_proj = w.get("in_proj.weight", (rows, hidden))
        self.in_bias = w.get("in_proj.bias", (rows,)) if m.proj_bias else None
        self.conv = w.ops.asarray(w.host("conv1d.weight", (m.conv_dim, 1, m.conv_kernel))[:, 0, :])
        self.conv_bias = w.get("conv1d.bias", (m.conv_dim,)) if m.conv_bias else None
        self.A_log = w.get("A_log", (m.n_heads,), np.float32)
        self.D = w.get("D", (m.n_heads,), np.float32)
        self.dt_bias = w.get("dt_bias", (m.n_heads,), np.float32)
        self.norm = w.get("norm.weight", (m.inner,))
        self.out_proj = w.get("out_proj.weight", (hidden, m.inner))
        self.out_bias = w.get("out_proj.bias", (hidden,)) if m.proj_bias else None

    def __call__(self, x, batch, caches):
        ops, m = self.ops, self.m
        t, inner, gn = x.shape[0], m.inner, m.n_groups * m.state_size
        conv_state, ssm_state = caches.state(self.layer)
        proj = ops.linear(x, self.in_proj, self.in_bias)
        xbc = proj[:, inner: inner + m.conv_dim]
        if self.conv_bias is None:
            xbc = ops.causal_conv1d(xbc, self.conv, conv_state, batch)
        else:
            xbc = ops.causal_conv1d_bias(xbc, self.conv, self.conv_bias, conv_state, batch)
        y = ops.ssd_scan(xbc[:, :inner].reshape(t, m.n_heads, m.head_dim), proj[:, inner + m.conv_dim:],
                         xbc[:, inner: inner + gn].reshape(t, m.n_groups, m.state_size),
                         xbc[:, inner + gn:].reshape(t, m.n_groups, m.state_size),
                         self.A_log, self.D, self.dt_bias, (m.dt_min, math.inf), ssm_state, batch,
                         m.chunk_size)
        y = ops.group_rms_norm_gated(y.reshape(t, inner), proj[:, :inner], self.norm, self.eps,
                                     inner // m.n_groups)
        return ops.linear(y, self.out_proj, self.out_bias)


class NemotronAttention:
    """Paged causal GQA attention with no positional encoding (HF's NemotronHAttention)."""

    def __init__(self, w: Weights, layer: int, hidden: int, n_heads: int, n_kv_heads: int, head_dim: int):
        self.ops, self.layer = w.ops, layer
        self.hq, self.hk, self.d = n_heads, n_kv_heads, head_dim
        self.qkv = w.rows([("q_proj.weight", (n_heads * head_dim, hidden)),
                           ("k_proj.weight", (n_kv_heads * head_dim, hidden)),
                           ("v_proj.weight", (n_kv_heads * head_dim, hidden))])
        self.o = w.get("o_proj.weight", (hidden, n_heads * head_dim))

    def __call__(self, x, batch, caches):
        ops, (hq, hk, d), t = self.ops, (self.hq, self.hk, self.d), x.shape[0]
        qkv = ops.linear(x, self.qkv)
        k_cache, v_cache = caches.kv(self.layer)
        ops.write_kv(qkv[:, hq * d: (hq + hk) * d].reshape(t, hk, d), qkv[:, (hq + hk) * d:].reshape(t, hk, d),
                     k_cache, v_cache, batch)
        o = ops.attention(qkv[:, : hq * d].reshape(t, hq, d), k_cache, v_cache, batch, d ** -0.5)
        return ops.linear(o.reshape(t, hq * d), self.o)


class Relu2MLP:
    """down(relu2(up(x))), optional biases."""

    def __init__(self, w: Weights, hidden: int, intermediate: int, bias: bool):
        self.ops = w.ops
        self.up = w.get("up_proj.weight", (intermediate, hidden))
        self.down = w.get("down_proj.weight", (hidden, intermediate))
        self.up_bias = w.get("up_proj.bias", (intermediate,)) if bias else None
        self.down_bias = w.get("down_proj.bias", (hidden,)) if bias else None

    def __call__(self, x, batch=None, caches=None):
        ops = self.ops
        return ops.linear(ops.relu2(ops.linear(x, self.up, self.up_bias)), self.down, self.down_bias)


class NemotronMoe:
    """Sigmoid-routed relu2 experts (optionally in a latent space) plus a shared expert."""

    def __init__(self, w: Weights, config: dict, hidden: int):
        ops, n = w.ops, int(config["n_routed_experts"])
        self.ops, self.top_k = ops, int(config["num_experts_per_tok"])
        self.renormalize = bool(config.get("norm_topk_prob", True))
        bias = config.get("mlp_bias", False)
        latent = config.get("moe_latent_size")
        width, inter = int(latent or hidden), int(config["moe_intermediate_size"])
        self.router = w.get("gate.weight", (n, hidden), np.float32)
        self.score_bias = w.get("gate.e_score_correction_bias", (n,), np.float32)
        # routed_scaling_factor multiplies every chosen weight: route_topk's per-expert scale
        self.scale = ops.asarray(np.full(n, float(config.get("routed_scaling_factor", 1.0)), np.float32), np.float32)
        self.up, self.down = _experts(w.sub("experts."), n, inter, width)
        self.fc1 = self.fc2 = None
        if latent:
            self.fc1 = (w.get("fc1_latent_proj.weight", (width, hidden)),
                        w.get("fc1_latent_proj.bias", (width,)) if bias else None)
            self.fc2 = (w.get("fc2_latent_proj.weight", (hidden, width)),
                        w.get("fc2_latent_proj.bias", (hidden,)) if bias else None)
        self.shared = Relu2MLP(w.sub("shared_experts."), hidden,
                               int(config["moe_shared_expert_intermediate_size"]), bias)

    def __call__(self, x, batch=None, caches=None):
        ops = self.ops
        weights, experts = ops.route_topk(ops.lm_head(x, self.router), self.top_k, "sigmoid", self.renormalize,
                                          bias=self.score_bias, expert_scale=self.scale)
        h = x if self.fc1 is None else ops.linear(x, *self.fc1)
        h = ops.moe_topk_relu2(h, weights, experts, self.up, self.down)
        if self.fc2 is not None:
            h = ops.linear(h, *self.fc2)
        return h + self.shared(x)


def _experts(w: Weights, n: int, inter: int, width: int):
    """(up [n, I, W], down [n, W, I]) stacked (transformers 5) or per expert (the hub release)."""
    if w.has("up_proj"):
        return w.get("up_proj", (n, inter, width)), w.get("down_proj", (n, width, inter))
    up = np.stack([w.host(f"{e}.up_proj.weight", (inter, width)) for e in range(n)])
    down = np.stack([w.host(f"{e}.down_proj.weight", (width, inter)) for e in range(n)])
    return w.ops.asarray(up), w.ops.asarray(down)


class NemotronBlock:
    """x + mixer(RMSNorm(x)), the residual add fused into the next norm (ops.add_rms_norm)."""

    def __init__(self, ops, mixer, norm_w, norm: NormSpec):
        self.ops, self.mixer, self.norm_w, self.norm = ops, mixer, norm_w, norm

    def __call__(self, x, residual, batch, caches):
        h, residual = self.ops.add_rms_norm(x, residual, self.norm_w, self.norm.eps, self.norm.offset)
        return self.mixer(h, batch, caches), residual


# -- config ----------------------------------------------------------------------------------

def block_types(config: dict, path: str) -> list[str]:
    """Each layer's mixer kind: linear_attention (Mamba-2) | full_attention | mlp | moe."""
    types = config.get("layers_block_type") or config.get("layer_types")
    if types is None:
        pattern = config.get("hybrid_override_pattern")
        if not isinstance(pattern, str) or any(c not in PATTERN for c in pattern):
            raise CheckpointError(f"{path}: config.json needs layers_block_type or a hybrid_override_pattern "
                                  f"of {''.join(PATTERN)} characters; got {pattern!r}")
        return [PATTERN[c] for c in pattern]
    types = [LEGACY_TYPES.get(t, t) for t in types]
    bad = sorted(set(types) - set(PATTERN.values()))
    if bad:
        raise CheckpointError(f"{path}: layers_block_type has {bad}; each entry must be one of "
                              f"{sorted(PATTERN.values())}")
    return types


def _setting(config: dict, key: str, default):
    for old, new in ALIASES.items():
        if new == key and old in config:
            return config[old]
    return config.get(key, default)


def mamba_shape(config: dict) -> MambaShape:
    return MambaShape(n_heads=int(config.get("mamba_num_heads", 128)),
                      head_dim=int(config.get("mamba_head_dim", 64)),
                      n_groups=int(_setting(config, "n_groups", 8)),
                      state_size=int(config.get("ssm_state_size", 128)),
                      conv_kernel=int(_setting(config, "conv_kernel", 4)),
                      chunk_size=int(_setting(config, "chunk_size", 128)),
                      dt_min=float(_setting(config, "time_step_min", 0.001)),
                      conv_bias=bool(_setting(config, "use_conv_bias", True)),
                      proj_bias=bool(config.get("use_bias", False)))


def refuse_unsupported(config: dict, types: list[str], path: str) -> None:
    checks = [("mamba_hidden_act", "silu"), ("mlp_hidden_act", "relu2")]
    for field, supported in checks:
        if config.get(field, supported) != supported:
            raise CheckpointError(f"{path}: config.json sets {field} {config[field]!r}; only {supported!r} "
                                  f"is supported for Nemotron-H (what its releases use)")
    m = mamba_shape(config)
    if "linear_attention" in types and m.n_heads % m.n_groups:
        raise CheckpointError(f"{path}: mamba_num_heads {m.n_heads} must be a multiple of n_groups {m.n_groups}")
    n_group, topk_group = int(config.get("n_group", 1)), int(config.get("topk_group", 1))
    if "moe" in types and topk_group < n_group:
        raise CheckpointError(f"{path}: config.json sets n_group {n_group} with topk_group {topk_group}: "
                              f"group-limited expert routing is not supported for Nemotron-H yet")


def _prefix(ckpt: Checkpoint) -> str:
    for prefix in ("model.", "backbone."):
        if ckpt.has(prefix + "embeddings.weight"):
            return prefix
    raise CheckpointError(f"{ckpt.path}: no 'model.embeddings.weight' or 'backbone.embeddings.weight'; "
                          f"is this a Nemotron-H checkpoint?")


def _mixer(kind: str, w: Weights, i: int, config: dict, m: MambaShape, eps: float):
    """(the mixer of one block, its cache spec or None); `i`: its index in the cache spec."""
    hidden = config["hidden_size"]
    if kind == "linear_attention":
        return Mamba2Mixer(w, i, hidden, m, eps), m.spec()
    if kind == "full_attention":
        # HF NemotronHConfig's defaults where config.json leaves a key out: 8 KV heads, head_dim 128
        hq = int(config["num_attention_heads"])
        hk, d = int(config.get("num_key_value_heads", 8) or hq), int(config.get("head_dim") or 128)
        return NemotronAttention(w, i, hidden, hq, hk, d), AttentionSpec(hk, d)
    if kind == "mlp":
        return Relu2MLP(w, hidden, int(config["intermediate_size"]), bool(config.get("mlp_bias", False))), None
    return NemotronMoe(w, config, hidden), None


def build_nemotron_h(ckpt: Checkpoint, ops) -> CausalLM:
    config, path = ckpt.config, ckpt.path
    types = block_types(config, path)
    refuse_unsupported(config, types, path)
    require_ops(ops, "nemotron_h", {**NEEDED_OPS, **(MOE_OPS if "moe" in types else {})}, path)
    hidden, m = config["hidden_size"], mamba_shape(config)
    norm = NormSpec(float(config.get("layer_norm_epsilon", 1e-5)), 0.0)
    prefix, root = _prefix(ckpt), Weights(ckpt, ops)
    layers, specs = [], []
    for i, kind in enumerate(types):
        # MLP / MoE blocks cache nothing: the cache spec lists the Mamba-2 and attention
        # blocks only, and each of those mixers reads its caches by its index there
        w = root.sub(f"{prefix}layers.{i}.")
        mixer, spec = _mixer(kind, w.sub("mixer."), len(specs), config, m, norm.eps)
        layers.append(NemotronBlock(ops, mixer, w.get("norm.weight", (hidden,)), norm))
        if spec is not None:
            specs.append(spec)
    embed = root.get(prefix + "embeddings.weight", (config["vocab_size"], hidden))
    return CausalLM(config, ops, CacheSpec(tuple(specs)), embed, layers,
                    root.get(prefix + "norm_f.weight", (hidden,)), _lm_head(root, config, embed), norm)


def _lm_head(root: Weights, config: dict, embed):
    """lm_head.weight whenever the checkpoint has one: HF's NemotronHForCausalLM ties nothing
    (no _tied_weights_keys), whatever tie_word_embeddings says; the embeddings only for a tied
    checkpoint saved without it."""
    if root.has("lm_head.weight") or not config.get("tie_word_embeddings", False):
        return root.get("lm_head.weight", embed.shape)
    return embed
