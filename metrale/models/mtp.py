"""The multi-token-prediction (MTP) head of Qwen3.5 / Qwen3.6 (`qwen3_5`, `qwen3_5_moe`): one
extra decoder layer a checkpoint ships under `mtp.*`, trained to predict the token after next.
Speculative decoding runs it as the drafter; this module is the model side (weights, forward,
logits), the engine schedules it.

What the head computes (the sources agree; names as the checkpoints store them):

    e = pre_fc_norm_embedding(embed_tokens[token])          zero-centred RMSNorm (w + 1)
    h = pre_fc_norm_hidden(target_hidden)                   zero-centred RMSNorm (w + 1)
    x = fc([e | h])                                         fc.weight [H, 2H], no bias;
                                                            embedding FIRST, hidden second
                                                            (run as its two column halves,
                                                            fc[:, :H] e + fc[:, H:] h; a
                                                            quantized fc is read dequantised)
    x = decoder layer 0 (x)                                 a full (gated) attention layer with
                                                            the main model's MLP kind
    hidden = norm(x)                                        zero-centred RMSNorm
    logits = lm_head(hidden)                                the MAIN model's lm head

Tensors (top level, not under `model.`; eps is the text config's rms_norm_eps):
    mtp.fc.weight [H, 2H], mtp.pre_fc_norm_embedding.weight [H], mtp.pre_fc_norm_hidden.weight
    [H], mtp.norm.weight [H], and mtp.layers.0.{input_layernorm, post_attention_layernorm}.weight,
    mtp.layers.0.self_attn.{q_proj, k_proj, v_proj, o_proj, q_norm, k_norm}.weight (q_proj
    emitting [q | gate] per head, as the main model's full-attention layers), mtp.layers.0.mlp.*
    (dense: gate/up/down_proj; MoE: gate, experts (fused gate_up_proj / down_proj or per
    expert), shared_expert.*, shared_expert_gate). No embedding or lm head of its own: both are
    the main model's, shared (`mtp_use_dedicated_embeddings: false` in the released configs;
    vLLM and SGLang load the main model's embed_tokens / lm_head into the draft).
Config: `mtp_num_hidden_layers` in the text config (1 in every Qwen3.5 / 3.6 release);
Qwen3-Next (`qwen3_next`, not served here) names the same count `num_nextn_predict_layers` and
ships the same `mtp.*` tensor names and structure.

Which hidden state, which token, which position: row r of a draft step pairs the target model's
hidden state AFTER its final norm (the input of its lm head) at position p with the token at
position p + 1 (the token that hidden state predicted: the next prompt token, or the sampled
one), runs at rotary position p, writes its K/V at position p's slot of the MTP layer's OWN
KV cache, attends over that cache's positions 0..p of the sequence, and predicts the token at
p + 2. For a second draft token the head's own output `hidden` (after mtp.norm) stands in for
the target hidden, paired with the first draft token at position p + 1. The MTP KV of the
prompt is filled by running the head over every prompt position once the first token is
sampled; after a verify step the head is run again over the accepted positions with the
target's hidden states, which overwrites the K/V it drafted there (vLLM's EAGLE/MTP proposer:
input ids shifted left by one, the last one replaced by the sampled token, positions and slot
mapping the target's). `shift_input_ids` builds those ids.

Sources: vLLM vllm/model_executor/models/qwen3_5_mtp.py (Qwen3_5MultiTokenPredictor: norms,
cat([embeds, hidden]), fc, Qwen3_5DecoderLayer(layer_type="full_attention"), norm; weight remap
mtp. -> model., embed_tokens / lm_head from the main checkpoint), qwen3_next_mtp.py (the same for
Qwen3-Next, `num_nextn_predict_layers`), qwen3_next.py (Qwen3NextModel.forward returns the
hidden state after the final norm; compute_logits applies lm_head to it directly),
vllm/v1/spec_decode/eagle.py (propose: shifted input ids, target positions and slot mapping);
SGLang python/sglang/srt/models/qwen3_5_mtp.py (GemmaRMSNorm, cat([embeds, hidden]), the layer
built as a one-layer Qwen3_5ForCausalLM with full_attention_interval 1, embed and head set from
the target; MTP tensors kept bf16 in ModelOpt NVFP4 / Quark releases); transformers
models/qwen3_5*/modeling_*.py (`_keys_to_ignore_on_load_unexpected = [r"^mtp.*"]`: HF neither
loads nor saves them).

Cache: the head's one attention layer has its own KV pool, `cache_spec()` (one AttentionSpec).
It is indexed by the same block tables and slot mapping as the main model's KV (one entry per
position of the sequence), so allocate it with the main pool's num_blocks and block_size:
`ModelCaches(mtp.cache_spec(), ops, num_blocks, block_size, 0)`. That KV is unquantized (the
activation dtype) whatever --kv-cache-dtype says: the head's spec keeps AttentionSpec's default
bf16 formats, so its precision can change how many drafts are kept, never an emitted token.

`--mtp-vocab N` (`logits(hidden, vocab_limit=N)`): the lm head is sliced to its first N rows,
so the logits are [T, N] and column j is token j; ids >= N are never scored or proposed.
0 (or N >= vocab) is the full head.
"""
from __future__ import annotations

import logging

import numpy as np

from metrale.cache.kv import AttentionSpec, CacheSpec, ModelCaches
from metrale.forward import ForwardBatch
from metrale.models.checkpoint import Checkpoint, CheckpointError
from metrale.models.layers import (Attention, AttentionShape, CausalLM, DecoderLayer, NormSpec,
                                   Weights, head_dim_of)
from metrale.models.quant import dense, is_quantized
from metrale.models.rope import rope_from_config

log = logging.getLogger("metrale.models.mtp")

PREFIX = "mtp."
MTP_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")
LAYER_COUNT_KEYS = ("mtp_num_hidden_layers", "num_nextn_predict_layers")
MTP_MODES = ("auto", "require", "off")
_TEXT_TYPES = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}


class MtpHead:
    """The MTP head over a built main model: its weights, the main model's embedding and lm
    head (the same backend arrays, not copies).

    forward(batch, target_hidden, caches, embeds=None) -> hidden [T, H] (ops.dtype), after
        mtp.norm, one row per batch row. `batch` rows are the positions drafted from: row r is
        the token batch.input_ids[r] (the one at position batch.positions[r] + 1), at rotary
        position batch.positions[r], its K/V written at batch.slot_mapping[r] of `caches` (the
        head's own ModelCaches). `target_hidden` [T, H]: the target model's hidden state after
        its final norm at each row's position (CausalLM.forward_with_hidden), or this head's
        own output for a further draft step. `embeds` [T, H], when given, replace the embedding
        lookup of batch.input_ids. batch.logits_indices is not read.
    logits(hidden, vocab_limit=0) -> fp32 [rows, vocab_width(vocab_limit)]: the main lm head
        over `hidden` rows (select the rows to score first, e.g. ops.embedding(rows, hidden)).
    cache_spec() -> CacheSpec of one AttentionSpec (the head's layer is cache layer 0).
    """

    def __init__(self, ops, embed, lm_head, fc_embedding, fc_hidden, norm_embedding, norm_hidden,
                 layer: DecoderLayer, final_norm, norm: NormSpec, spec: AttentionSpec):
        self.ops, self.embed, self.lm_head = ops, embed, lm_head
        self.fc_embedding, self.fc_hidden = fc_embedding, fc_hidden
        self.norm_embedding, self.norm_hidden, self.final_norm = norm_embedding, norm_hidden, final_norm
        self.layer, self.norm, self._spec = layer, norm, CacheSpec((spec,))
        self.hidden_size = int(fc_hidden.shape[0])
        self.vocab_size = int(lm_head.shape[0])
        self._heads: dict[int, object] = {}

    def cache_spec(self) -> CacheSpec:
        return self._spec

    def forward(self, batch: ForwardBatch, target_hidden, caches: ModelCaches, embeds=None):
        ops, eps, off, hid = self.ops, self.norm.eps, self.norm.offset, self.hidden_size
        e = ops.embedding(batch.input_ids, self.embed) if embeds is None else embeds
        t = e.shape[0]
        if tuple(target_hidden.shape) != (t, hid):
            raise ValueError(f"MTP forward: target_hidden has shape {tuple(target_hidden.shape)}, "
                             f"expected ({t}, {hid}): one hidden state per batch row")
        # fc([e | h]) = fc[:, :H] e + fc[:, H:] h: the two halves' products go into the layer's
        # first add_rms_norm as its (x, residual), which adds them (no concat copy, no extra op)
        x = ops.linear_parts(ops.rms_norm(e, self.norm_embedding, eps, off), self.fc_embedding)
        r = ops.linear(ops.rms_norm(target_hidden, self.norm_hidden, eps, off), self.fc_hidden)
        x, residual = self.layer(x, r, batch, caches)
        h, _ = ops.add_rms_norm(x, residual, self.final_norm, eps, off)
        return h

    def vocab_width(self, vocab_limit: int = 0) -> int:
        """How many ids `logits(., vocab_limit)` scores: N clamped to the vocab, 0 = all."""
        n = int(vocab_limit)
        if n < 0:
            raise ValueError(f"--mtp-vocab {n}: must be 0 (the whole vocabulary) or positive")
        return self.vocab_size if n == 0 else min(n, self.vocab_size)

    def logits(self, hidden, vocab_limit: int = 0):
        n = self.vocab_width(vocab_limit)
        head = self._head(n)
        if head is None:          # a head that cannot be row-sliced: score all, keep N columns
            return self.ops.lm_head(hidden, self.lm_head)[:, :n]
        return self.ops.lm_head(hidden, head)

    def _head(self, n: int):
        """The first n rows of the lm head as a view (numpy / cupy), made once per n; None for
        heads held in a form that has no row views (quantized)."""
        if n == self.vocab_size:
            return self.lm_head
        if n not in self._heads:
            w = self.lm_head
            sliceable = not is_quantized(w) and type(w).__module__.split(".")[0] in ("numpy", "cupy")
            self._heads[n] = w[:n] if sliceable else None
        return self._heads[n]


def shift_input_ids(input_ids: np.ndarray, query_start_loc: np.ndarray,
                    next_token_ids: np.ndarray) -> np.ndarray:
    """The MTP input ids of a step whose rows are the target step's rows: each sequence's new
    tokens shifted left by one, its last one replaced by the token sampled after it
    (next_token_ids[i] for sequence i). [a0 a1 a2 | b0 b1], next [a3, b2] -> [a1 a2 a3 | b1 b2].
    Host int32 arrays."""
    ids = np.asarray(input_ids, np.int32)
    qsl = np.asarray(query_start_loc, np.int64)
    out = np.empty_like(ids)
    out[:-1] = ids[1:]
    ends = qsl[1:] - 1
    keep = qsl[1:] > qsl[:-1]
    out[ends[keep]] = np.asarray(next_token_ids, np.int32)[keep]
    return out


# -- building ----------------------------------------------------------------------------------

def declared_layers(config: dict) -> int | None:
    """The MTP layer count config.json declares, or None when it declares none."""
    for key in LAYER_COUNT_KEYS:
        if config.get(key) is not None:
            return int(config[key])
    return None


def attach_mtp(model: CausalLM, ckpt: Checkpoint, ops, mode: str = "auto") -> CausalLM:
    """Set `model.mtp` from the checkpoint's `mtp.*` tensors (see the module docstring).

    mode "auto": build it when the checkpoint holds any `mtp.*` tensor (all of them then, else
    refused naming the missing ones); when config.json declares MTP layers but the checkpoint
    has no `mtp.*` tensor at all (re-exports often drop them) the main model still loads,
    `mtp` is None and `model.mtp_absent` says what is missing. "require": no head is refused
    too (speculative decoding asked for one), naming what is missing. "off": never built,
    nothing read. Checkpoints of other architectures keep `mtp` None ("require" refuses)."""
    if mode not in MTP_MODES:
        raise ValueError(f"mtp mode {mode!r}: choose from {MTP_MODES}")
    model.mtp, model.mtp_absent = None, ""
    if mode == "off":
        return model
    if ckpt.model_type == "deepseek_v3":     # its MTP layer is stored as one more decoder layer
        from metrale.models.deepseek_mtp import attach_deepseek_mtp
        return attach_deepseek_mtp(model, ckpt, ops, mode)
    model_type = _TEXT_TYPES.get(ckpt.model_type, ckpt.model_type)
    if model_type not in MTP_MODEL_TYPES:
        if mode == "require":
            raise CheckpointError(f"{ckpt.path}: model_type {ckpt.model_type!r} has no MTP head we "
                                  f"can run (only {', '.join(MTP_MODEL_TYPES)})")
        return model
    declared = declared_layers(ckpt.config)
    present = [n for n in ckpt.tensors if n.startswith(PREFIX)]
    if declared == 0 or (declared is None and not present):
        if mode == "require":
            raise CheckpointError(
                f"{ckpt.path}: no MTP head: config.json declares "
                f"{'0 MTP layers (' + _key(ckpt.config) + ')' if declared == 0 else 'no MTP layers'}"
                f" and the checkpoint holds {len(present)} mtp.* tensors")
        if present:
            log.warning("%s: config.json declares 0 MTP layers; its %d mtp.* tensors are not "
                        "loaded", ckpt.path, len(present))
        return model
    count = 1 if declared is None else declared
    if count != 1:
        raise CheckpointError(
            f"{ckpt.path}: config.json declares {count} MTP layers ({_key(ckpt.config)}); only "
            f"1 is supported (every Qwen3.5 / Qwen3.6 release ships 1)")
    if ckpt.config.get("mtp_use_dedicated_embeddings"):
        raise CheckpointError(
            f"{ckpt.path}: config.json sets mtp_use_dedicated_embeddings true; only an MTP head "
            f"sharing the main model's embedding and lm head is supported")
    expected = expected_tensors(ckpt)
    missing = [n for n in expected if not ckpt.has(n)]
    if not present:
        what = (f"config.json declares 1 MTP layer ({_key(ckpt.config)}) but the checkpoint has "
                f"none of its {len(expected)} mtp.* tensors ({_listing(missing)})")
        if mode == "require":
            raise CheckpointError(f"{ckpt.path}: {what}; the MTP head cannot be built")
        model.mtp_absent = what
        log.warning("%s: %s; loaded without the MTP head", ckpt.path, what)
        return model
    if missing:
        raise CheckpointError(
            f"{ckpt.path}: the MTP head is incomplete: {len(missing)} of its {len(expected)} "
            f"tensors are missing: {_listing(missing)} (the checkpoint holds {len(present)} "
            f"mtp.* tensors); re-download it, or remove every mtp.* tensor to serve it without MTP")
    stray = sorted({n.split(".")[2] for n in present
                    if n.startswith(PREFIX + "layers.") and n.split(".")[2] != "0"})
    if stray:
        raise CheckpointError(
            f"{ckpt.path}: the checkpoint holds MTP layer(s) {', '.join(stray)} beside layer 0 "
            f"(e.g. mtp.layers.{stray[0]}.*) but config.json declares 1 ({_key(ckpt.config)})")
    model.mtp = build_mtp(ckpt, ops, model)
    return model


def build_mtp(ckpt: Checkpoint, ops, model: CausalLM) -> MtpHead:
    """The MtpHead of a Qwen3.5 checkpoint over its built main model `model` (whose embedding
    and lm head it shares)."""
    from metrale.models.qwen3_5 import MOE_MODEL_TYPES, _mlp

    config = ckpt.config
    hidden = config["hidden_size"]
    norm = NormSpec(float(config.get("rms_norm_eps", 1e-6)), 1.0)
    shape = AttentionShape(config["num_attention_heads"], config["num_key_value_heads"],
                           head_dim_of(config), gated=True)
    rope = rope_from_config(config, shape.head_dim, default_partial=0.25)
    w = Weights(ckpt, ops, PREFIX)
    lw = w.sub("layers.0.")
    attn = Attention(lw.sub("self_attn."), 0, hidden, shape, norm, rope.frequencies,
                     qkv_bias=False, o_bias=False, qk_norm=True)
    layer = DecoderLayer(ops, attn, _mlp(lw.sub("mlp."), config, ckpt.model_type in MOE_MODEL_TYPES),
                         lw.get("input_layernorm.weight", (hidden,)),
                         lw.get("post_attention_layernorm.weight", (hidden,)), norm)
    fc = w.host("fc.weight", (hidden, 2 * hidden))
    if is_quantized(fc):        # small ([H, 2H]): read dequantised, then split by columns
        fc = dense(fc)
    # .copy(): a contiguous half in the array's own library (numpy, or CuPy for checkpoints
    # synthesised on the GPU: Weights.host)
    fc_embedding, fc_hidden = (ops.asarray(fc[:, c].copy()) for c in
                               (slice(0, hidden), slice(hidden, 2 * hidden)))
    return MtpHead(ops, model.embed, model.lm_head, fc_embedding, fc_hidden,
                   w.get("pre_fc_norm_embedding.weight", (hidden,)),
                   w.get("pre_fc_norm_hidden.weight", (hidden,)), layer,
                   w.get("norm.weight", (hidden,)), norm,
                   AttentionSpec(shape.n_kv_heads, shape.head_dim))


def expected_tensors(ckpt: Checkpoint) -> list[str]:
    """Every tensor name a one-layer MTP head of this checkpoint reads (quantized weights count
    as present through their packed form: Checkpoint.has)."""
    config = ckpt.config
    names = ["fc.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight",
             "layers.0.input_layernorm.weight", "layers.0.post_attention_layernorm.weight"]
    names += [f"layers.0.self_attn.{p}.weight" for p in
              ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")]
    mlp = "layers.0.mlp."
    if _TEXT_TYPES.get(ckpt.model_type, ckpt.model_type) != "qwen3_5_moe":
        names += [f"{mlp}{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
    else:
        names.append(mlp + "gate.weight")
        if ckpt.has(PREFIX + mlp + "experts.gate_up_proj"):
            names += [mlp + "experts.gate_up_proj", mlp + "experts.down_proj"]
        else:
            names += [f"{mlp}experts.{e}.{p}.weight" for e in range(config["num_experts"])
                      for p in ("gate_proj", "up_proj", "down_proj")]
        if config.get("shared_expert_intermediate_size", 0):
            names += [f"{mlp}shared_expert.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
            names.append(mlp + "shared_expert_gate.weight")
    return [PREFIX + n for n in names]


def _key(config: dict) -> str:
    key = next((k for k in LAYER_COUNT_KEYS if config.get(k) is not None), None)
    return f"{key}: {config[key]}" if key else f"{LAYER_COUNT_KEYS[0]} not set: 1 assumed"


def _listing(names: list[str], most: int = 6) -> str:
    shown = ", ".join(f"'{n}'" for n in names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")
