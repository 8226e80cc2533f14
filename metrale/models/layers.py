"""Building blocks shared by the architectures, written once against the ops interface.

Every block is built from a checkpoint at load time (weights fused where that saves launches)
and called as `block(x, batch, caches)` with x [T, H] (T = new tokens of the step). Fused
layouts (rows of an [out, in] matrix):

    Attention.qkv     [q (Hq*D) | gate (Hq*D, gated attention only) | k (Hk*D) | v (Hk*D)]
    DenseMLP.gate_up  [gate (I) | up (I)]
    SparseMoe.gate_up [E, gate (I) | up (I), H]
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from metrale.backends.base import missing_ops
from metrale.cache.kv import CacheSpec, ModelCaches
from metrale.forward import ForwardBatch
from metrale.models.checkpoint import Checkpoint, CheckpointError

# -- weights ---------------------------------------------------------------------------------

class Weights:
    """Checkpoint tensors under a name prefix, shape-checked, converted to backend arrays."""

    def __init__(self, ckpt: Checkpoint, ops, prefix: str = ""):
        self.ckpt, self.ops, self.prefix = ckpt, ops, prefix

    def sub(self, prefix: str) -> "Weights":
        return Weights(self.ckpt, self.ops, self.prefix + prefix)

    def has(self, name: str) -> bool:
        return self.ckpt.has(self.prefix + name)

    def host(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """The stored tensor as it is: a numpy array (memory-mapped), or a device array for
        checkpoints synthesised on the GPU (benchmarks); numpy functions applied to it below
        dispatch to its own library (NEP 18)."""
        return self.ckpt.tensor(self.prefix + name, shape)

    def get(self, name: str, shape: tuple[int, ...], dtype=None):
        return self.ops.asarray(self.host(name, shape), dtype)

    def rows(self, parts: list[tuple[str, tuple[int, ...]]], dtype=None):
        """Concatenate several tensors along dim 0 into one backend array."""
        return self.ops.asarray(np.concatenate([self.host(n, s) for n, s in parts]), dtype)


# -- config helpers --------------------------------------------------------------------------

def head_dim_of(config: dict) -> int:
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def require_silu(config: dict, path: str) -> None:
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"{path}: hidden_act {act!r} is not supported (only 'silu')")


@dataclass(frozen=True)
class NormSpec:
    """RMSNorm flavour of a model: offset 1.0 = zero-centred weights (Qwen3.5), 0.0 = plain."""
    eps: float
    offset: float


# -- blocks ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class AttentionShape:
    n_heads: int
    n_kv_heads: int
    head_dim: int
    gated: bool = False          # Qwen3.5: q_proj emits [q | gate] per head, output * sigmoid(gate)


class Attention:
    """Paged causal GQA attention with optional q/k head norms, (partial) rotary, output gate.

    `window`: a sliding window (the token at position p sees keys in (p - window, p]: Mistral
    v0.1, Ministral's sliding layers), or None for full attention. `temperature`: (beta, length)
    of Llama-4 attention temperature scaling (Ministral 3: queries times
    1 + beta * ln(1 + floor(p / length)) after rotary), or None."""

    def __init__(self, w: Weights, layer: int, hidden: int, shape: AttentionShape, norm: NormSpec,
                 rope: tuple[np.ndarray, int], qkv_bias: bool, o_bias: bool, qk_norm: bool,
                 window: int | None = None, temperature: tuple[float, float] | None = None):
        self.ops, self.layer, self.shape, self.norm = w.ops, layer, shape, norm
        self.window, self.temperature = window, temperature
        hq, hk, d = shape.n_heads, shape.n_kv_heads, shape.head_dim
        q_rows = hq * d * (2 if shape.gated else 1)
        q = w.host("q_proj.weight", (q_rows, hidden))
        parts = [_split_gated_q(q, hq, d)] if shape.gated else [q]
        parts += [w.host("k_proj.weight", (hk * d, hidden)), w.host("v_proj.weight", (hk * d, hidden))]
        self.qkv = self.ops.asarray(np.concatenate(parts))
        self.qkv_bias = w.rows([("q_proj.bias", (hq * d,)), ("k_proj.bias", (hk * d,)),
                                ("v_proj.bias", (hk * d,))]) if qkv_bias else None
        self.o = w.get("o_proj.weight", (hidden, hq * d))
        self.o_bias = w.get("o_proj.bias", (hidden,)) if o_bias else None
        self.q_norm = w.get("q_norm.weight", (d,)) if qk_norm else None
        self.k_norm = w.get("k_norm.weight", (d,)) if qk_norm else None
        self.inv_freq = self.ops.asarray(rope[0], np.float32)
        self.rotary_dim = rope[1]

    def __call__(self, x, batch: ForwardBatch, caches: ModelCaches):
        ops, (hq, hk, d) = self.ops, (self.shape.n_heads, self.shape.n_kv_heads, self.shape.head_dim)
        t = x.shape[0]
        qkv = ops.linear(x, self.qkv, self.qkv_bias)
        q_end = hq * d * (2 if self.shape.gated else 1)
        q = qkv[:, : hq * d].reshape(t, hq, d)
        k = qkv[:, q_end: q_end + hk * d].reshape(t, hk, d)
        v = qkv[:, q_end + hk * d:].reshape(t, hk, d)
        k_cache, v_cache = caches.kv(self.layer)
        # q/k head norms + rotary + KV write: one launch on CUDA (the unfused ops elsewhere)
        q = ops.qk_norm_rope_write_kv(q, k, v, self.q_norm, self.k_norm, self.norm.eps, self.norm.offset,
                                      batch.positions, self.inv_freq, self.rotary_dim, k_cache, v_cache,
                                      batch)
        if self.temperature is not None:
            q = ops.attn_temperature(q, batch.positions, *self.temperature)
        if self.window is None:
            o = ops.attention(q, k_cache, v_cache, batch, d ** -0.5).reshape(t, hq * d)
        else:
            o = ops.sliding_attention(q, k_cache, v_cache, batch, d ** -0.5, self.window).reshape(t, hq * d)
        if self.shape.gated:
            o = ops.sigmoid_mul(o, qkv[:, hq * d: q_end])
        return ops.linear(o, self.o, self.o_bias)


def _split_gated_q(q: np.ndarray, n_heads: int, head_dim: int) -> np.ndarray:
    """HF gated q_proj rows are per head [q (D) | gate (D)]; regroup to [all q | all gates]
    (a row gather, so quantized weights regroup the same way)."""
    rows = np.arange(n_heads * 2 * head_dim).reshape(n_heads, 2, head_dim)
    return q[np.concatenate([rows[:, 0].ravel(), rows[:, 1].ravel()])]


class DenseMLP:
    """SwiGLU MLP: down(silu(gate(x)) * up(x)) with gate|up fused. `into_norm`: the output goes
    straight into the next add_rms_norm (a decoder layer's MLP), so the down projection may come
    back in the backend's deferred form (ops.linear_parts); False where it is added elsewhere (a
    MoE's shared expert)."""

    def __init__(self, w: Weights, hidden: int, intermediate: int, into_norm: bool = False):
        self.ops = w.ops
        self.gate_up = w.rows([("gate_proj.weight", (intermediate, hidden)),
                               ("up_proj.weight", (intermediate, hidden))])
        self.down = w.get("down_proj.weight", (hidden, intermediate))
        self.into_norm = into_norm

    def __call__(self, x, batch=None, caches=None):
        ops = self.ops
        act = ops.silu_mul(ops.linear(x, self.gate_up))
        return ops.linear_parts(act, self.down) if self.into_norm else ops.linear(act, self.down)


class SparseMoe:
    """Softmax top-k router over E SwiGLU experts, plus an optional shared expert scaled by
    sigmoid(shared_expert_gate(x)). Experts load from the fused transformers-5 layout
    (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]) or per expert
    (`experts.{e}.gate_proj.weight` ...).

    A shared expert as wide as the routed ones (Qwen3.5-MoE: 512 and 512) is loaded as expert E
    of the same tensors, its gate as router row E, and runs inside ops.moe(shared=True): one
    routed-expert pipeline instead of that plus five launches (two GEMMs, SiLU-mul, gate GEMM,
    sigmoid-mul and the add) per layer. Other widths run it as a DenseMLP beside."""

    def __init__(self, w: Weights, hidden: int, n_experts: int, intermediate: int, top_k: int,
                 renormalize: bool, shared_intermediate: int = 0):
        self.ops, self.top_k, self.renormalize = w.ops, top_k, renormalize
        self.fused_shared = bool(shared_intermediate) and shared_intermediate == intermediate
        gate_up, down = expert_tensors(w.sub("experts."), hidden, n_experts, intermediate)
        if self.fused_shared:
            sw = w.sub("shared_expert.")
            self.router = w.rows([("gate.weight", (n_experts, hidden)),
                                  ("shared_expert_gate.weight", (1, hidden))])
            shared_gu = np.concatenate([sw.host("gate_proj.weight", (intermediate, hidden)),
                                        sw.host("up_proj.weight", (intermediate, hidden))])
            self.gate_up = w.ops.asarray(np.concatenate([gate_up, shared_gu[None]]))
            self.down = w.ops.asarray(np.concatenate(
                [down, sw.host("down_proj.weight", (hidden, intermediate))[None]]))
            self.shared = self.shared_gate = None
            return
        self.router = w.get("gate.weight", (n_experts, hidden))
        self.gate_up, self.down = w.ops.asarray(gate_up), w.ops.asarray(down)
        self.shared = DenseMLP(w.sub("shared_expert."), hidden, shared_intermediate) if shared_intermediate else None
        self.shared_gate = w.get("shared_expert_gate.weight", (1, hidden)) if shared_intermediate else None

    def __call__(self, x, batch=None, caches=None):
        ops = self.ops
        y = ops.moe(x, self.router, self.gate_up, self.down, self.top_k, self.renormalize,
                    shared=self.fused_shared)
        if self.shared is None:
            return y
        shared = ops.sigmoid_mul(self.shared(x), ops.linear(x, self.shared_gate))  # gate [T, 1] broadcasts
        return y + shared


def expert_tensors(w: Weights, hidden: int, n: int, inter: int):
    """(gate_up [n, 2I, H], down [n, H, I]) as stored (host arrays: memory-mapped numpy, or
    device arrays of checkpoints synthesised on the GPU)."""
    if w.has("gate_up_proj"):
        return (w.host("gate_up_proj", (n, 2 * inter, hidden)), w.host("down_proj", (n, hidden, inter)))
    gate_up = np.stack([np.concatenate([w.host(f"{e}.gate_proj.weight", (inter, hidden)),
                                        w.host(f"{e}.up_proj.weight", (inter, hidden))]) for e in range(n)])
    down = np.stack([w.host(f"{e}.down_proj.weight", (hidden, inter)) for e in range(n)])
    return gate_up, down


class DecoderLayer:
    """Pre-norm residual block: x -> mixer(norm(x)) -> mlp(norm(.)), residual adds fused into
    the norms (ops.add_rms_norm)."""

    def __init__(self, ops, mixer, mlp, input_norm, post_norm, norm: NormSpec):
        self.ops, self.mixer, self.mlp, self.norm = ops, mixer, mlp, norm
        self.input_norm, self.post_norm = input_norm, post_norm

    def __call__(self, x, residual, batch: ForwardBatch, caches: ModelCaches):
        ops, eps, off = self.ops, self.norm.eps, self.norm.offset
        h, residual = ops.add_rms_norm(x, residual, self.input_norm, eps, off)
        h = self.mixer(h, batch, caches)
        h, residual = ops.add_rms_norm(h, residual, self.post_norm, eps, off)
        return self.mlp(h, batch, caches), residual


class CausalLM:
    """Embedding -> decoder layers -> final norm -> lm_head, over one ForwardBatch.

    forward(batch, caches) -> fp32 logits [len(batch.logits_indices), vocab] (a backend array;
    numpy on the CPU backend). `batch` carries its index arrays where the backend wants them
    (ops.upload_batch).
    forward_with_hidden(batch, caches) -> (those logits, hidden [T, H]): the same pass, also
    returning every new token's hidden state after the final norm (what the lm head reads, and
    what an MTP head drafts from: metrale.models.mtp).
    `mtp`: the checkpoint's multi-token-prediction head (metrale.models.mtp.MtpHead), or None;
    set by registry.build_model."""

    def __init__(self, config: dict, ops, spec: CacheSpec, embed, layers: list[DecoderLayer],
                 final_norm, lm_head, norm: NormSpec):
        self.config, self.ops, self._spec = config, ops, spec
        self.embed, self.layers, self.final_norm, self.lm_head = embed, layers, final_norm, lm_head
        self.norm = norm
        self.vocab_size = int(lm_head.shape[0])
        self.mtp = None
        self.mtp_absent = ""        # why `mtp` is None although config.json declares one, or ""

    def cache_spec(self) -> CacheSpec:
        return self._spec

    def forward(self, batch: ForwardBatch, caches: ModelCaches):
        return self.forward_with_hidden(batch, caches)[0]

    def forward_with_hidden(self, batch: ForwardBatch, caches: ModelCaches):
        ops = self.ops
        x, residual = ops.embedding(batch.input_ids, self.embed), None
        for layer in self.layers:
            x, residual = layer(x, residual, batch, caches)
        h, _ = ops.add_rms_norm(x, residual, self.final_norm, self.norm.eps, self.norm.offset)
        return ops.lm_head(ops.embedding(batch.logits_indices, h), self.lm_head), h


def load_embeddings(w: Weights, config: dict, prefix: str) -> tuple:
    """(embed_tokens [V, H], lm_head [V, H]); the same array when embeddings are tied. A
    checkpoint that ships lm_head.weight although its config says tied gets its own lm_head, as
    transformers loads it (it ties only a missing lm_head: Mistral3ForConditionalGeneration's
    top-level tie_word_embeddings defaults to true while its releases ship a separate lm_head)."""
    shape = (config["vocab_size"], config["hidden_size"])
    embed = w.get(prefix + "embed_tokens.weight", shape)
    if config.get("tie_word_embeddings", False) and not w.has("lm_head.weight"):
        return embed, embed
    return embed, w.get("lm_head.weight", shape)


def require_ops(ops, model_type: str, needed: dict[str, str], path: str) -> None:
    """CheckpointError unless backend `ops` implements every op of `needed` (op name -> the
    feature it is): a family whose config needs an op a backend lacks is refused at load,
    naming the features, never served with the wrong math."""
    missing = missing_ops(ops, needed)
    if missing:
        raise CheckpointError(
            f"{path}: {model_type} needs {', '.join(missing)}, which the {ops.name} kernels do not "
            f"implement yet; serve this checkpoint with --device cpu")
