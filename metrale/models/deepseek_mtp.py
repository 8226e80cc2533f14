"""DeepSeek V3's multi-token-prediction (MTP) layer as a drafter head (metrale.models.mtp.MtpHead):
the release's `num_nextn_predict_layers` (1) extra layer, stored as decoder layer n =
num_hidden_layers (`model.layers.61.*` in DeepSeek-V3). What it computes (DeepSeek-V3 report
section 2.2; vLLM deepseek_mtp.py DeepSeekMultiTokenPredictorLayer; SGLang deepseek_nextn.py):

    e = enorm(embed_tokens[token]), zero at rotary position 0 (vLLM masks it there)
    h = hnorm(target_hidden)                 the main model's hidden state after its final norm
    x = eh_proj([e | h])                     eh_proj.weight [H, 2H], embedding first
    x = decoder layer n (x)                  MLA + the MoE (or dense MLP) layer n would have
    hidden = shared_head.norm(x);  logits = lm_head(hidden)

Plain RMSNorms. Row r pairs the hidden state at position p with the token at p + 1, at rotary
position p, caching its latent in the head's own MLA cache (one MlaSpec): the pairing, the
cache and the drafting are metrale.models.mtp's and metrale.spec.mtp's, unchanged.
Tensors under `model.layers.{n}.`: enorm, hnorm, eh_proj, shared_head.norm (.weight), the
layer's input_layernorm / post_attention_layernorm / self_attn.* / mlp.*. The release's copies
of the embedding and lm head (`embed_tokens`, `shared_head.head`) are not read: the main
model's are used (the same values in DeepSeek's releases; SGLang and vLLM's EAGLE path share
them too), so they cost no memory twice.
"""
from __future__ import annotations

import logging

from metrale.cache.kv import MlaSpec
from metrale.forward import ForwardBatch
from metrale.models.checkpoint import Checkpoint, CheckpointError
from metrale.models.deepseek_v3 import MlaShape, decoder_layer, is_moe_layer
from metrale.models.layers import CausalLM, NormSpec, Weights
from metrale.models.mtp import MtpHead
from metrale.models.quant import dense, is_quantized

log = logging.getLogger("metrale.models.deepseek_mtp")

LAYER_COUNT_KEY = "num_nextn_predict_layers"


class DeepseekMtpHead(MtpHead):
    """MtpHead with DeepSeek's one difference: the token embedding is zeroed at position 0."""

    def forward(self, batch: ForwardBatch, target_hidden, caches, embeds=None):
        e = self.ops.embedding(batch.input_ids, self.embed) if embeds is None else embeds
        keep = (batch.positions != 0)[:, None]          # numpy or device arrays alike
        return super().forward(batch, target_hidden, caches, embeds=e * keep.astype(e.dtype))


def expected_tensors(ckpt: Checkpoint) -> list[str]:
    """The tensor names of the MTP layer the head reads (the layer's own by its kind)."""
    config, n = ckpt.config, int(ckpt.config["num_hidden_layers"])
    p = f"model.layers.{n}."
    names = [p + t for t in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                             "input_layernorm.weight", "post_attention_layernorm.weight",
                             "self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_layernorm.weight",
                             "self_attn.kv_b_proj.weight", "self_attn.o_proj.weight")]
    if config.get("q_lora_rank") is None:
        names.append(p + "self_attn.q_proj.weight")
    else:
        names += [p + "self_attn.q_a_proj.weight", p + "self_attn.q_a_layernorm.weight",
                  p + "self_attn.q_b_proj.weight"]
    names.append(p + ("mlp.gate.weight" if is_moe_layer(config, n) else "mlp.gate_proj.weight"))
    return names


def attach_deepseek_mtp(model: CausalLM, ckpt: Checkpoint, ops, mode: str) -> CausalLM:
    """metrale.models.mtp.attach_mtp for deepseek_v3 (the same modes and refusals)."""
    config, n = ckpt.config, int(ckpt.config["num_hidden_layers"])
    declared = int(config.get(LAYER_COUNT_KEY) or 0)
    prefix = f"model.layers.{n}."
    present = [name for name in ckpt.tensors if name.startswith(prefix)]
    stray = sorted({name.split(".")[2] for name in ckpt.tensors if name.startswith("model.layers.")
                    and int(name.split(".")[2]) > n})
    if declared == 0 or not present:
        what = (f"config.json declares {declared} MTP layers ({LAYER_COUNT_KEY}) and the checkpoint holds "
                f"{len(present)} {prefix}* tensors")
        if mode == "require":
            raise CheckpointError(f"{ckpt.path}: no MTP head: {what}")
        if declared:
            model.mtp_absent = what
            log.warning("%s: %s; loaded without the MTP head", ckpt.path, what)
        return model
    if declared != 1 or stray:
        raise CheckpointError(f"{ckpt.path}: config.json declares {declared} MTP layers ({LAYER_COUNT_KEY}) "
                              f"and the checkpoint holds layers {', '.join(stray) or 'none'} past {n}; only one "
                              f"MTP layer is supported (DeepSeek V3 ships 1)")
    missing = [name for name in expected_tensors(ckpt) if not ckpt.has(name)]
    if missing:
        raise CheckpointError(f"{ckpt.path}: the MTP layer is incomplete: missing {', '.join(missing[:6])}"
                              f"{' and more' if len(missing) > 6 else ''}; re-download it, or remove every "
                              f"{prefix}* tensor to serve it without MTP")
    model.mtp = build_deepseek_mtp(ckpt, ops, model)
    return model


def build_deepseek_mtp(ckpt: Checkpoint, ops, model: CausalLM) -> DeepseekMtpHead:
    config, n, hidden = ckpt.config, int(ckpt.config["num_hidden_layers"]), int(ckpt.config["hidden_size"])
    root = Weights(ckpt, ops)
    w = root.sub(f"model.layers.{n}.")
    layer = decoder_layer(root, config, n, 0)
    fc = w.host("eh_proj.weight", (hidden, 2 * hidden))
    if is_quantized(fc):        # [H, 2H]: read dequantised, then split by columns
        fc = dense(fc)
    fc_embedding, fc_hidden = (ops.asarray(fc[:, c].copy()) for c in (slice(0, hidden), slice(hidden, 2 * hidden)))
    shape = MlaShape(config)
    return DeepseekMtpHead(ops, model.embed, model.lm_head, fc_embedding, fc_hidden,
                           w.get("enorm.weight", (hidden,)), w.get("hnorm.weight", (hidden,)), layer,
                           w.get("shared_head.norm.weight", (hidden,)),
                           NormSpec(float(config.get("rms_norm_eps", 1e-6)), 0.0), MlaSpec(shape.rank, shape.rope))
