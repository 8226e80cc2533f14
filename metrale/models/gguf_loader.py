"""Load a llama.cpp GGUF file as a Checkpoint in HF Llama form.

- Tensors are renamed to HF Llama names (`blk.N.attn_q.weight` -> `model.layers.N.self_attn.q_proj.weight`,
  ...) and dequantized to float32 with `gguf.quants.dequantize` when they are accessed (the mapping
  is lazy, so only one dequantized tensor need be in memory at a time; each access dequantizes
  afresh, so read each tensor once). Q and K rows get llama.cpp's converter permutation undone, as
  HF transformers' GGUF loader does, so they match the HF checkpoint the GGUF was made from.
- The config is synthesized in HF Llama form from the `llama.*` metadata; a
  `llama.attention.sliding_window` below the context length (Mistral v0.1, which llama.cpp's
  converter writes as `llama`) makes it HF Mistral form with that window on every layer.
  `mistral3` files (llama.cpp's Ministral3Model converter: the llama layout plus YaRN and the
  attention temperature) load in HF Ministral3 form (`ministral3_config`).
- `minimax-m2` files load the same way in HF MiniMax M2 form (`minimax_m2_config`,
  `minimax_m2_tensor_name`; no Q/K permutation to undo). Gemma 4 (`gemma4`) is not mapped yet.
- `nemotron_h` / `nemotron_h_moe` files load in HF Nemotron-H form (`nemotron_h_config`,
  `nemotron_h_tensor_name`, `nemotron_h_tensor`: the block pattern read back from the per-layer
  head_count_kv / feed_forward_length arrays, llama.cpp's Mamba-2 rewrites undone, Q/K
  un-permuted). The file does not carry time_step_min: HF's default 0.001 (every release's).
- The tokenizer is rebuilt in HF `tokenizers` JSON form from the `tokenizer.ggml.*` metadata and
  written to a content-addressed cache file, whose path becomes `Checkpoint.tokenizer_json`.
"""
from __future__ import annotations

import hashlib
import os
import re
import tempfile
from collections.abc import Iterator, Mapping

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor, TokenType
from gguf.quants import dequantize
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from metrale.models.checkpoint import Checkpoint, CheckpointError

SUPPORTED_ARCHITECTURES = ("llama", "mistral3", "minimax-m2", "nemotron_h", "nemotron_h_moe")
SUPPORTED_QUANT_TYPES = tuple(
    GGMLQuantizationType[t] for t in ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"))
# Architectures llama.cpp writes that have a model here but no GGUF mapping yet: what to do instead.
UNMAPPED_ARCHITECTURES = {
    "deepseek2": ("DeepSeek V2 / V3 GGUF files (llama.cpp splits kv_b_proj into attn_k_b / attn_v_b and "
                  "renames the router, the MLA norms and the MTP layer) are not mapped yet; serve the HF "
                  "checkpoint (bf16, or DeepSeek's block-FP8 release) instead"),
}
SUPPORTED_TOKENIZER_MODELS = ("gpt2",)
# llama.cpp pre-tokenizer names whose split is GPT-2's byte-level regex.
SUPPORTED_PRE_TOKENIZERS = ("default", "gpt2", "gpt-2", "smollm")

_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL_NAME = re.compile(r"(\w+)\.(weight|bias)")


def load_gguf(path: str, cache_dir: str | None = None, name: str | None = None) -> Checkpoint:
    """A Checkpoint over the GGUF file at `path` (see the module docstring)."""
    reader = open_reader(path)
    meta = GGUFMetadata(reader, path)
    architecture = meta.get("general.architecture")
    if architecture not in SUPPORTED_ARCHITECTURES:
        hint = UNMAPPED_ARCHITECTURES.get(architecture)
        raise CheckpointError(
            f"{path}: GGUF architecture {architecture!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}" + (f". {hint}" if hint else ""))
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    if architecture.startswith("nemotron_h"):
        config = nemotron_h_config(meta, architecture, {t.name for t in reader.tensors})
    else:
        config = {"minimax-m2": minimax_m2_config, "mistral3": ministral3_config}.get(
            architecture, llama_config)(meta, has_output)
    tensors = GGUFTensors(reader, path, config)
    tokenizer = build_tokenizer(meta)
    return Checkpoint(
        config=config,
        tensors=tensors,
        path=path,
        name=name or os.path.basename(path).removesuffix(".gguf"),
        generation_config=_generation_config(meta),
        tokenizer_json=write_tokenizer_json(tokenizer, path, cache_dir),
        tokenizer_config=_tokenizer_config(meta),
        chat_template=meta.get("tokenizer.chat_template"),
        tensor_files={n: path for n in tensors},
    )


def open_reader(path: str) -> GGUFReader:
    """GGUFReader over `path`, with every way a truncated or corrupt file fails as CheckpointError."""
    try:
        reader = GGUFReader(path)
    except Exception as e:  # the reader fails with whatever numpy/struct raises on short reads
        raise CheckpointError(
            f"{path}: truncated or corrupt GGUF file ({type(e).__name__}: {e}); re-download it") from e
    size = os.path.getsize(path)
    for tensor in reader.tensors:
        if tensor.data_offset + tensor.n_bytes > size:
            raise CheckpointError(
                f"{path}: truncated GGUF file: tensor '{tensor.name}' ends at byte "
                f"{tensor.data_offset + tensor.n_bytes}, the file has {size}; re-download it")
    return reader


class GGUFMetadata:
    """Typed access to a GGUF file's key/value metadata."""

    def __init__(self, reader: GGUFReader, path: str):
        self._fields = reader.fields
        self.path = path

    def get(self, key: str, default=None):
        field = self._fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str):
        value = self.get(key)
        if value is None:
            raise CheckpointError(f"{self.path}: GGUF metadata key '{key}' is missing; the file "
                                  f"was not written by a llama.cpp converter we understand")
        return value


# ---------------------------------------------------------------------------------------------
# Config


def llama_config(meta: GGUFMetadata, has_output: bool, arch: str = "llama") -> dict:
    """HF LlamaConfig-style dict from the `llama.*` metadata (`arch`: another prefix the
    converter writes in the same layout)."""
    hidden = int(meta.require(f"{arch}.embedding_length"))
    heads = int(meta.require(f"{arch}.attention.head_count"))
    rope_theta = _float32_value(meta.get(f"{arch}.rope.freq_base", 10000.0))
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.require("tokenizer.ggml.tokens"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(meta.require(f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(meta.require(f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(meta.get(f"{arch}.attention.key_length", hidden // heads)),
        "rms_norm_eps": _float32_value(meta.require(f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "max_position_embeddings": int(meta.require(f"{arch}.context_length")),
        "vocab_size": int(vocab),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": not has_output,
    }
    for key in ("bos", "eos", "pad"):
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            config[f"{key}_token_id"] = int(token_id)
    window = meta.get(f"{arch}.attention.sliding_window")
    if arch == "llama" and window and int(window) < config["max_position_embeddings"]:
        # a Mistral v0.1-style checkpoint (llama.cpp writes Mistral as `llama`): served as HF's
        # MistralForCausalLM computes it, every layer over that window
        config.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=int(window))
    return config


def ministral3_config(meta: GGUFMetadata, has_output: bool) -> dict:
    """HF Ministral3Config-style dict from the `mistral3.*` metadata: llama.cpp's Ministral3Model
    converter writes the llama layout (Q/K rows permuted) plus its YaRN rope (scaling type,
    factor, original context, betas; yarn_log_multiplier = mscale_all_dim) and
    attention.temperature_scale = llama_4_scaling_beta (over the original context)."""
    config = llama_config(meta, has_output, "mistral3")
    rope = config["rope_parameters"]
    if meta.get("mistral3.rope.scaling.type", "none") != "yarn":
        raise CheckpointError(f"{meta.path}: a mistral3 GGUF without YaRN rope scaling is not one "
                              f"llama.cpp's Ministral 3 converter writes; refusing it")
    key = "mistral3.rope.scaling."
    rope.update(rope_type="yarn", factor=_float32_value(meta.require(key + "factor")),
                original_max_position_embeddings=int(meta.require(key + "original_context_length")),
                beta_fast=_float32_value(meta.get(key + "yarn_beta_fast", 32.0)),
                beta_slow=_float32_value(meta.get(key + "yarn_beta_slow", 1.0)), mscale=1.0,
                mscale_all_dim=_float32_value(meta.get(key + "yarn_log_multiplier", 1.0)),
                llama_4_scaling_beta=_float32_value(meta.get("mistral3.attention.temperature_scale", 0.0)))
    config.update(architectures=["Ministral3ForCausalLM"], model_type="ministral3")
    return config


def _float32_value(value: float) -> float:
    """The value a float32 metadata field was written from (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(value)))


def _generation_config(meta: GGUFMetadata) -> dict:
    """Stop on eos (and end-of-turn when the file names a different one), like llama.cpp does."""
    config = {}
    bos, eos, eot = (meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "eot"))
    if bos is not None:
        config["bos_token_id"] = int(bos)
    if eos is not None:
        config["eos_token_id"] = int(eos) if eot in (None, eos) else [int(eos), int(eot)]
    return config


# ---------------------------------------------------------------------------------------------
# Tensors


class GGUFTensors(Mapping):
    """HF Llama tensor names -> float32 arrays, dequantized (and un-permuted) on access."""

    def __init__(self, reader: GGUFReader, path: str, config: dict):
        self.path = path
        self._heads = config["num_attention_heads"]
        self._kv_heads = config["num_key_value_heads"]
        # only llama's converter permutes Q/K rows (it writes Mistral as `llama` too) ...
        self._llama = config["model_type"] in ("llama", "mistral", "ministral3")
        self._nemotron_h = config["model_type"] == "nemotron_h"     # ... and Nemotron-H's
        rename = (hf_tensor_name if self._llama else
                  {"minimax_m2": minimax_m2_tensor_name, "nemotron_h": nemotron_h_tensor_name}[config["model_type"]])
        self._rename = lambda n: rename(n, path)
        self._tensors: dict[str, ReaderTensor] = {}
        for tensor in reader.tensors:
            self._check_type(tensor)
            self._tensors[self._rename(tensor.name)] = tensor

    def __getitem__(self, name: str) -> np.ndarray:
        tensor = self._tensors[name]
        weights = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        if self._nemotron_h:
            return nemotron_h_tensor(name, weights, self._heads, self._kv_heads)
        if not self._llama:
            return weights
        if name.endswith("self_attn.q_proj.weight"):
            return unpermute_rows(weights, self._heads)
        if name.endswith("self_attn.k_proj.weight"):
            return unpermute_rows(weights, self._kv_heads)
        return weights

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def _check_type(self, tensor: ReaderTensor) -> None:
        if tensor.tensor_type not in SUPPORTED_QUANT_TYPES:
            raise CheckpointError(
                f"{self.path}: tensor '{tensor.name}' is {tensor.tensor_type.name}, which is not "
                f"supported; supported GGUF types: "
                f"{', '.join(t.name for t in SUPPORTED_QUANT_TYPES)} (re-quantize the model to one of them)")


def hf_tensor_name(gguf_name: str, path: str) -> str:
    """HF Llama name of a GGUF tensor; CheckpointError for tensors Llama has no place for."""
    layer = _LAYER_NAME.fullmatch(gguf_name)
    if layer and layer.group(2) in _LAYER_TENSORS:
        return f"model.layers.{layer.group(1)}.{_LAYER_TENSORS[layer.group(2)]}.{layer.group(3)}"
    top = _GLOBAL_NAME.fullmatch(gguf_name)
    if top and top.group(1) in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[top.group(1)]}.{top.group(2)}"
    raise CheckpointError(
        f"{path}: GGUF tensor '{gguf_name}' has no HF Llama counterpart (llama.cpp variants with "
        f"extra tensors, e.g. MoE experts or rope_freqs for Llama 3 rope scaling, are not supported)")


# MiniMax M2 (llama.cpp's MiniMaxM2Model converter: no Q/K permutation; the experts' w1 / w3 / w2
# stacked per layer into one [E, ., .] tensor each, named here as the converter names them before
# mapping; e_score_correction_bias -> exp_probs_b)
_MINIMAX_M2_LAYER_TENSORS = {
    **{k: v for k, v in _LAYER_TENSORS.items() if k.startswith("attn_")},
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate_inp": "block_sparse_moe.gate",
    "ffn_gate_exps": "block_sparse_moe.experts.w1",
    "ffn_up_exps": "block_sparse_moe.experts.w3",
    "ffn_down_exps": "block_sparse_moe.experts.w2",
}
_EXP_PROBS_B = re.compile(r"blk\.(\d+)\.exp_probs_b(\.bias)?")


def minimax_m2_tensor_name(gguf_name: str, path: str) -> str:
    """HF MiniMax M2 name of a GGUF tensor (metrale.models.minimax_m2 reads the stacked experts)."""
    bias = _EXP_PROBS_B.fullmatch(gguf_name)
    if bias:
        return f"model.layers.{bias.group(1)}.block_sparse_moe.e_score_correction_bias"
    layer = _LAYER_NAME.fullmatch(gguf_name)
    if layer and layer.group(2) in _MINIMAX_M2_LAYER_TENSORS:
        return f"model.layers.{layer.group(1)}.{_MINIMAX_M2_LAYER_TENSORS[layer.group(2)]}.{layer.group(3)}"
    top = _GLOBAL_NAME.fullmatch(gguf_name)
    if top and top.group(1) in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[top.group(1)]}.{top.group(2)}"
    raise CheckpointError(f"{path}: GGUF tensor '{gguf_name}' has no HF MiniMax M2 counterpart")


def minimax_m2_config(meta: GGUFMetadata, has_output: bool) -> dict:
    """HF MiniMaxM2Config-style dict from the `minimax-m2.*` metadata (llama.cpp writes the
    experts' width as expert_feed_forward_length and the rotated dims as rope.dimension_count)."""
    a = "minimax-m2"
    hidden, heads = int(meta.require(f"{a}.embedding_length")), int(meta.require(f"{a}.attention.head_count"))
    head_dim = int(meta.get(f"{a}.attention.key_length", hidden // heads))
    rotary = int(meta.get(f"{a}.rope.dimension_count", head_dim))
    theta = _float32_value(meta.get(f"{a}.rope.freq_base", 5000000.0))
    vocab = meta.get(f"{a}.vocab_size") or len(meta.require("tokenizer.ggml.tokens"))
    config = {
        "architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2",
        "hidden_size": hidden, "num_attention_heads": heads, "head_dim": head_dim,
        "num_key_value_heads": int(meta.get(f"{a}.attention.head_count_kv", heads)),
        "intermediate_size": int(meta.require(f"{a}.expert_feed_forward_length")),
        "num_hidden_layers": int(meta.require(f"{a}.block_count")),
        "num_local_experts": int(meta.require(f"{a}.expert_count")),
        "num_experts_per_tok": int(meta.require(f"{a}.expert_used_count")),
        "rms_norm_eps": _float32_value(meta.require(f"{a}.attention.layer_norm_rms_epsilon")),
        "rope_parameters": {"rope_type": "default", "rope_theta": theta,
                            "partial_rotary_factor": rotary / head_dim},
        "rotary_dim": rotary, "max_position_embeddings": int(meta.require(f"{a}.context_length")),
        "vocab_size": int(vocab), "hidden_act": "silu", "tie_word_embeddings": not has_output,
    }
    for key in ("bos", "eos", "pad"):
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            config[f"{key}_token_id"] = int(token_id)
    return config


# Nemotron-H (llama.cpp's NemotronHModel converter, a GraniteHybridModel / Mamba2Model):
# every block's norm is attn_norm; the Mamba-2 tensors ssm_*; A_log written as A = -exp(A_log)
# [H, 1], D as [H, 1], the conv weight squeezed to [C, K], the gated norm as [G, I / G]; Q / K
# rows permuted as llama's (undo_permute); the MoE experts stacked per layer
_NEMOTRON_H_LAYER_TENSORS = {
    "attn_norm": "norm", "attn_q": "mixer.q_proj", "attn_k": "mixer.k_proj", "attn_v": "mixer.v_proj",
    "attn_output": "mixer.o_proj", "ssm_in": "mixer.in_proj", "ssm_conv1d": "mixer.conv1d",
    "ssm_norm": "mixer.norm", "ssm_out": "mixer.out_proj", "ffn_up": "mixer.up_proj",
    "ffn_down": "mixer.down_proj", "ffn_gate_inp": "mixer.gate", "ffn_up_exps": "mixer.experts.up_proj",
    "ffn_down_exps": "mixer.experts.down_proj", "ffn_up_shexp": "mixer.shared_experts.up_proj",
    "ffn_down_shexp": "mixer.shared_experts.down_proj", "ffn_latent_down": "mixer.fc1_latent_proj",
    "ffn_latent_up": "mixer.fc2_latent_proj",
}
_NEMOTRON_H_PARAMS = {"ssm_a": "mixer.A_log", "ssm_d": "mixer.D", "ssm_dt.bias": "mixer.dt_bias",
                      "exp_probs_b": "mixer.gate.e_score_correction_bias",
                      "exp_probs_b.bias": "mixer.gate.e_score_correction_bias"}
_PARAM_NAME = re.compile(r"blk\.(\d+)\.(\w+(?:\.bias)?)")
_NEMOTRON_H_GLOBAL = {"token_embd": "model.embeddings", "output_norm": "model.norm_f", "output": "lm_head"}


def nemotron_h_tensor_name(gguf_name: str, path: str) -> str:
    """HF Nemotron-H name (transformers 5's `model.` layout, stacked experts) of a GGUF tensor."""
    param = _PARAM_NAME.fullmatch(gguf_name)
    if param and param.group(2) in _NEMOTRON_H_PARAMS:
        return f"model.layers.{param.group(1)}.{_NEMOTRON_H_PARAMS[param.group(2)]}"
    layer = _LAYER_NAME.fullmatch(gguf_name)
    if layer and layer.group(2) in _NEMOTRON_H_LAYER_TENSORS:
        name = f"model.layers.{layer.group(1)}.{_NEMOTRON_H_LAYER_TENSORS[layer.group(2)]}"
        return name if layer.group(2).endswith("_exps") else f"{name}.{layer.group(3)}"
    top = _GLOBAL_NAME.fullmatch(gguf_name)
    if top and top.group(1) in _NEMOTRON_H_GLOBAL:
        return f"{_NEMOTRON_H_GLOBAL[top.group(1)]}.{top.group(2)}"
    raise CheckpointError(f"{path}: GGUF tensor '{gguf_name}' has no HF Nemotron-H counterpart")


def nemotron_h_tensor(name: str, weights: np.ndarray, heads: int, kv_heads: int) -> np.ndarray:
    """The HF tensor back from the converter's rewrite of it."""
    if name.endswith("mixer.A_log"):
        return np.log(-weights.reshape(-1))
    if name.endswith(("mixer.D", "mixer.norm.weight")):
        return weights.reshape(-1)
    if name.endswith("mixer.conv1d.weight"):
        return weights[:, None, :]
    if name.endswith("mixer.q_proj.weight"):
        return unpermute_rows(weights, heads)
    if name.endswith("mixer.k_proj.weight"):
        return unpermute_rows(weights, kv_heads)
    return weights


def nemotron_h_config(meta: GGUFMetadata, arch: str, tensor_names: set[str]) -> dict:
    """HF NemotronHConfig-style dict from the `nemotron_h[_moe].*` metadata: a block is
    attention where head_count_kv is set, MLP / MoE where feed_forward_length is, else Mamba-2;
    biases where the file holds them."""
    kv, ff = _per_layer(meta, f"{arch}.attention.head_count_kv"), _per_layer(meta, f"{arch}.feed_forward_length")
    moe = arch == "nemotron_h_moe"
    types = ["full_attention" if k else ("moe" if moe else "mlp") if f else "linear_attention"
             for k, f in zip(kv, ff, strict=True)]
    heads, inner = int(meta.require(f"{arch}.ssm.time_step_rank")), int(meta.require(f"{arch}.ssm.inner_size"))
    hidden = int(meta.require(f"{arch}.embedding_length"))
    config = {
        "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "layers_block_type": types,
        "hidden_size": hidden, "vocab_size": int(meta.get(f"{arch}.vocab_size") or len(meta.require("tokenizer.ggml.tokens"))),
        "num_attention_heads": int(meta.require(f"{arch}.attention.head_count")),
        "num_key_value_heads": max(kv), "head_dim": int(meta.require(f"{arch}.attention.key_length")),
        "intermediate_size": max(ff), "max_position_embeddings": int(meta.require(f"{arch}.context_length")),
        "layer_norm_epsilon": _float32_value(meta.require(f"{arch}.attention.layer_norm_rms_epsilon")),
        "mamba_num_heads": heads, "mamba_head_dim": inner // heads,
        "n_groups": int(meta.require(f"{arch}.ssm.group_count")),
        "ssm_state_size": int(meta.require(f"{arch}.ssm.state_size")),
        "conv_kernel": int(meta.require(f"{arch}.ssm.conv_kernel")),
        "use_conv_bias": any(n.endswith("ssm_conv1d.bias") for n in tensor_names),
        "use_bias": any(n.endswith("ssm_in.bias") for n in tensor_names),
        "mlp_bias": any(n.endswith(("ffn_up.bias", "ffn_up_shexp.bias")) for n in tensor_names),
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }
    if moe:
        config.update(_nemotron_h_moe_config(meta, arch))
    for key in ("bos", "eos", "pad"):
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            config[f"{key}_token_id"] = int(token_id)
    return config


def _nemotron_h_moe_config(meta: GGUFMetadata, arch: str) -> dict:
    config = {"n_routed_experts": int(meta.require(f"{arch}.expert_count")),
              "num_experts_per_tok": int(meta.require(f"{arch}.expert_used_count")),
              "moe_intermediate_size": int(meta.require(f"{arch}.expert_feed_forward_length")),
              "moe_shared_expert_intermediate_size": int(meta.require(f"{arch}.expert_shared_feed_forward_length")),
              "norm_topk_prob": bool(meta.get(f"{arch}.expert_weights_norm", True)),
              "routed_scaling_factor": _float32_value(meta.get(f"{arch}.expert_weights_scale", 1.0)),
              "n_group": int(meta.get(f"{arch}.expert_group_count", 1)),
              "topk_group": int(meta.get(f"{arch}.expert_group_used_count", meta.get(f"{arch}.expert_group_count", 1)))}
    latent = meta.get(f"{arch}.moe_latent_size")
    if latent:
        config["moe_latent_size"] = int(latent)
    return config


def _per_layer(meta: GGUFMetadata, key: str) -> list[int]:
    values = meta.require(key)
    return [int(v) for v in values] if isinstance(values, (list, tuple)) else [int(values)] * int(
        meta.require(key.split(".")[0] + ".block_count"))


def unpermute_rows(weights: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's convert_hf_to_gguf Q/K permutation (rotary halves -> interleaved pairs).

    The converter reshaped each head's rows as (2, head_dim/2) and swapped them to (head_dim/2, 2);
    this is the inverse, as in transformers' LlamaTensorProcessor.
    """
    half = weights.shape[0] // n_heads // 2
    return (weights.reshape(n_heads, half, 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


# ---------------------------------------------------------------------------------------------
# Tokenizer


def build_tokenizer(meta: GGUFMetadata) -> Tokenizer:
    """A byte-level BPE `tokenizers.Tokenizer` from the `tokenizer.ggml.*` metadata."""
    model = meta.require("tokenizer.ggml.model")
    if model not in SUPPORTED_TOKENIZER_MODELS:
        raise CheckpointError(
            f"{meta.path}: tokenizer.ggml.model {model!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_TOKENIZER_MODELS)} (byte-level BPE)")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in SUPPORTED_PRE_TOKENIZERS:
        raise CheckpointError(
            f"{meta.path}: tokenizer.ggml.pre {pre!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_PRE_TOKENIZERS)}")
    tokens = list(meta.require("tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ", 1)) for m in meta.require("tokenizer.ggml.merges")]
    tokenizer = Tokenizer(models.BPE(
        vocab={token: i for i, token in enumerate(tokens)}, merges=merges,
        continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = _post_processor(meta, tokens)
    tokenizer.add_tokens(_added_tokens(tokens, meta.get("tokenizer.ggml.token_type")))
    return tokenizer


def _added_tokens(tokens: list[str], token_types) -> list[AddedToken]:
    """Control tokens as special added tokens, user-defined ones as plain added tokens."""
    if token_types is None:
        return []
    kinds = {TokenType.CONTROL: True, TokenType.USER_DEFINED: False}
    return [AddedToken(tokens[i], special=kinds[kind], normalized=False)
            for i, kind in enumerate(token_types) if kind in kinds]


def _post_processor(meta: GGUFMetadata, tokens: list[str]):
    """Prepend BOS when the file says so (tokenizer.ggml.add_bos_token), else add nothing."""
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    if not meta.get("tokenizer.ggml.add_bos_token", False) or bos_id is None:
        return processors.ByteLevel(trim_offsets=False)
    bos = tokens[int(bos_id)]
    return processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 $B:1", special_tokens=[(bos, int(bos_id))])


def _tokenizer_config(meta: GGUFMetadata) -> dict:
    """tokenizer_config.json-style fields: special token strings and whether BOS is added."""
    tokens = meta.require("tokenizer.ggml.tokens")
    config = {"add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False))}
    for key, field in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"),
                       ("pad_token", "padding")):
        token_id = meta.get(f"tokenizer.ggml.{field}_token_id")
        if token_id is not None:
            config[key] = tokens[int(token_id)]
    return config


def write_tokenizer_json(tokenizer: Tokenizer, gguf_path: str, cache_dir: str | None) -> str:
    """Write the tokenizer to `<cache>/gguf/<content hash>/tokenizer.json` once; return its path.

    The cache is `<cache_dir>/metrale` when `cache_dir` is given, else $XDG_CACHE_HOME/metrale,
    else ~/.cache/metrale.
    """
    text = tokenizer.to_str()
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
    folder = os.path.join(_metrale_cache(cache_dir), "gguf", digest)
    target = os.path.join(folder, "tokenizer.json")
    if os.path.isfile(target):
        return target
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=folder, delete=False,
                                         suffix=".tmp") as f:
            f.write(text)
        os.replace(f.name, target)
    except OSError as e:
        raise CheckpointError(
            f"{gguf_path}: cannot write the tokenizer built from its metadata to {target} ({e}); "
            f"pass a writable cache_dir") from e
    return target


def _metrale_cache(cache_dir: str | None) -> str:
    if cache_dir:
        return os.path.join(os.path.expanduser(cache_dir), "metrale")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "metrale")
