"""GGUF files written with the gguf package's writer the way llama.cpp's converters write them,
loading to the logits HF computes from the source checkpoint: MiniMax M2 (`minimax-m2`: HF
tensor names mapped by gguf's tensor map, the experts' w1 / w3 / w2 stacked per layer,
e_score_correction_bias as exp_probs_b, rotary_dim as rope.dimension_count, the experts' width
as expert_feed_forward_length; no Q/K permutation), Nemotron-H (`nemotron_h`,
`nemotron_h_moe`: see _write_nemotron_h_gguf), Mistral v0.1 (which llama.cpp's LlamaModel
converter writes as arch `llama`: Q/K rows permuted, head_dim as key_length, the window as
llama.attention.sliding_window; served with the window, as HF's MistralForCausalLM) and
Ministral 3 (arch `mistral3`, llama.cpp's Ministral3Model converter)."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file

from metrale.backends.cpu import CpuOps
from metrale.cache.kv import ModelCaches
from metrale.forward import contiguous_batch
from metrale.models.checkpoint import CheckpointError
from metrale.models.loader import load_checkpoint
from metrale.models.registry import build_model
from test_gguf_loader import MERGES, SPECIALS, _vocab
from tiny_models import hf_logits, load_hf, make_tiny_family

_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "block_sparse_moe.gate": "ffn_gate_inp"}


def _write_gguf(src: str, dst: str, vocab: list[str]) -> str:
    import json

    config = json.load(open(f"{src}/config.json"))
    state = load_file(f"{src}/model.safetensors")
    w = gguf.GGUFWriter(dst, "minimax-m2")
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_expert_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_key_length(config["head_dim"])
    w.add_value_length(config["head_dim"])
    w.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    w.add_rope_dimension_count(int(config["head_dim"] * config["rope_parameters"]["partial_rotary_factor"]))
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_expert_count(config["num_local_experts"])
    w.add_expert_used_count(config["num_experts_per_tok"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(vocab)
    w.add_token_types([gguf.TokenType.CONTROL] * len(SPECIALS) + [gguf.TokenType.NORMAL] * (len(vocab) - len(SPECIALS)))
    w.add_token_merges(MERGES)
    w.add_eos_token_id(2)
    w.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    w.add_tensor("output.weight", state["lm_head.weight"])
    w.add_tensor("output_norm.weight", state["model.norm.weight"])
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for hf, name in _NAMES.items():
            w.add_tensor(f"blk.{i}.{name}.weight", state[f"{p}{hf}.weight"])
        w.add_tensor(f"blk.{i}.exp_probs_b.bias", state[f"{p}block_sparse_moe.e_score_correction_bias"])
        for hf, name in (("w1", "ffn_gate_exps"), ("w3", "ffn_up_exps"), ("w2", "ffn_down_exps")):
            w.add_tensor(f"blk.{i}.{name}.weight", np.stack(
                [state[f"{p}block_sparse_moe.experts.{e}.{hf}.weight"] for e in range(config["num_local_experts"])]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def _llama_permute(weights: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute (interleaved rotary pairs -> halves, per head)."""
    return weights.reshape(n_heads, 2, weights.shape[0] // n_heads // 2, *weights.shape[1:]) \
        .swapaxes(1, 2).reshape(weights.shape)


def _write_mistral_gguf(src: str, dst: str, vocab: list[str], arch: str = "llama") -> str:
    """llama.cpp's LlamaModel layout; arch `mistral3`: its Ministral3Model (YaRN keys,
    yarn_log_multiplier = mscale_all_dim, temperature_scale = llama_4_scaling_beta)."""
    import json

    config = json.load(open(f"{src}/config.json"))
    state = load_file(f"{src}/model.safetensors")
    w = gguf.GGUFWriter(dst, arch)
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_key_length(config["head_dim"])
    w.add_value_length(config["head_dim"])
    w.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    w.add_rope_dimension_count(config["head_dim"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if config.get("sliding_window"):
        w.add_sliding_window(config["sliding_window"])
    if arch == "mistral3":
        rope = config["rope_parameters"]
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        w.add_rope_scaling_yarn_log_mul(rope["mscale_all_dim"])
        w.add_attn_temperature_scale(rope["llama_4_scaling_beta"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(vocab)
    w.add_token_types([gguf.TokenType.CONTROL] * len(SPECIALS) + [gguf.TokenType.NORMAL] * (len(vocab) - len(SPECIALS)))
    w.add_token_merges(MERGES)
    w.add_eos_token_id(2)
    w.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    w.add_tensor("output.weight", state["lm_head.weight"])
    w.add_tensor("output_norm.weight", state["model.norm.weight"])
    names = dict(_NAMES, **{"mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"})
    heads = {"self_attn.q_proj": config["num_attention_heads"], "self_attn.k_proj": config["num_key_value_heads"]}
    for i in range(config["num_hidden_layers"]):
        for hf, name in names.items():
            key = f"model.layers.{i}.{hf}.weight"
            if key in state:
                t = state[key]
                w.add_tensor(f"blk.{i}.{name}.weight", _llama_permute(t, heads[hf]) if hf in heads else t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.mark.parametrize("arch, gguf_arch, expect", [
    ("mistral_swa", "llama", {"model_type": "mistral", "sliding_window": 16, "head_dim": 24}),
    ("ministral3", "mistral3", {"model_type": "ministral3", "head_dim": 24})])
def test_mistral_ggufs_serve_like_hf(tmp_path, arch, gguf_arch, expect):
    """Mistral v0.1 (arch llama, its window kept) and Ministral 3 (arch mistral3: YaRN plus the
    attention temperature, which moves positions past 16 here) against HF's logits."""
    vocab = _vocab()
    src = make_tiny_family(arch, tmp_path / "hf", vocab_size=len(vocab))
    path = _write_mistral_gguf(src, str(tmp_path / "tiny.gguf"), vocab, gguf_arch)
    ckpt = load_checkpoint(path, cache_dir=str(tmp_path))
    assert {k: ckpt.config.get(k) for k in expect} == expect
    ops = CpuOps()
    model = build_model(ckpt, ops)
    prompt = np.random.default_rng(1).integers(0, len(vocab), 50).tolist()      # past 16 positions
    caches = ModelCaches(model.cache_spec(), ops, 8, 16, 1)
    batch = contiguous_batch([prompt], [0], [[3, 1, 5, 6, 0, 2, 7]], [0], 16, True)
    ours = model.forward(batch, caches)
    ref = hf_logits(load_hf(src), prompt)
    assert float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref))) <= 1e-4


def test_minimax_m2_gguf_matches_hf(tmp_path):
    vocab = _vocab()
    src = make_tiny_family("minimax_m2", tmp_path / "hf", vocab_size=len(vocab))
    path = _write_gguf(src, str(tmp_path / "tiny.gguf"), vocab)
    ckpt = load_checkpoint(path, cache_dir=str(tmp_path))
    assert ckpt.config["model_type"] == "minimax_m2" and ckpt.config["rotary_dim"] == 8
    ops = CpuOps()
    model = build_model(ckpt, ops)
    prompt = np.random.default_rng(1).integers(0, len(vocab), 40).tolist()
    caches = ModelCaches(model.cache_spec(), ops, 8, 16, 1)
    batch = contiguous_batch([prompt], [0], [[3, 1, 5]], [0], 16, True)
    ours = model.forward(batch, caches)
    ref = hf_logits(load_hf(src), prompt)
    assert float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref))) <= 1e-4


def test_gemma4_gguf_is_refused_naming_the_architecture(tmp_path):
    path = str(tmp_path / "g.gguf")
    w = gguf.GGUFWriter(path, "gemma4")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="architecture 'gemma4' is not supported"):
        load_checkpoint(path, cache_dir=str(tmp_path))



# Nemotron-H the way llama.cpp's NemotronHModel converter writes it (a GraniteHybridModel /
# Mamba2Model): the per-layer head_count_kv / feed_forward_length arrays give the block pattern,
# A_log as A = -exp(A_log) [H, 1], D [H, 1], the conv weight squeezed, the gated norm [G, I / G],
# dt_bias as ssm_dt.bias, Q / K rows permuted as llama's, the experts stacked per layer
_NEMOTRON_H_NAMES = {"norm": "attn_norm", "mixer.q_proj": "attn_q", "mixer.k_proj": "attn_k",
                     "mixer.v_proj": "attn_v", "mixer.o_proj": "attn_output", "mixer.in_proj": "ssm_in",
                     "mixer.conv1d": "ssm_conv1d", "mixer.norm": "ssm_norm", "mixer.out_proj": "ssm_out",
                     "mixer.up_proj": "ffn_up", "mixer.down_proj": "ffn_down", "mixer.gate": "ffn_gate_inp",
                     "mixer.shared_experts.up_proj": "ffn_up_shexp",
                     "mixer.shared_experts.down_proj": "ffn_down_shexp",
                     "mixer.fc1_latent_proj": "ffn_latent_down", "mixer.fc2_latent_proj": "ffn_latent_up"}


def _permute(w, n_head):
    """llama.cpp's LlamaModel.permute (the converter's Q / K row order)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _nemotron_h_tensor(config, name, value):
    """(GGUF name, tensor) of one HF tensor of layer-local name `name`, as the converter writes it."""
    heads, groups = config["num_attention_heads"], config["n_groups"]
    if name == "mixer.A_log":
        return "ssm_a", -np.exp(value).reshape(-1, 1)
    if name == "mixer.D":
        return "ssm_d", value.reshape(-1, 1)
    if name == "mixer.dt_bias":
        return "ssm_dt.bias", value
    if name == "mixer.gate.e_score_correction_bias":
        return "exp_probs_b.bias", value
    base, kind = name.rsplit(".", 1)
    if name == "mixer.conv1d.weight":
        value = value.squeeze(1)
    elif name == "mixer.norm.weight":
        value = value.reshape(groups, -1)
    elif name == "mixer.q_proj.weight":
        value = _permute(value, heads)
    elif name == "mixer.k_proj.weight":
        value = _permute(value, config["num_key_value_heads"])
    return f"{_NEMOTRON_H_NAMES[base]}.{kind}", value


def _write_nemotron_h_gguf(src: str, dst: str, vocab: list[str]) -> str:
    import json

    config = json.load(open(f"{src}/config.json"))
    state = load_file(f"{src}/model.safetensors")
    types, moe = config["layers_block_type"], "moe" in config["layers_block_type"]
    arch = "nemotron_h_moe" if moe else "nemotron_h"
    ffn = config["moe_intermediate_size"] if moe else config["intermediate_size"]
    w = gguf.GGUFWriter(dst, arch)
    w.add_context_length(2 ** 20)
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(len(types))
    w.add_feed_forward_length([ffn if t in ("mlp", "moe") else 0 for t in types])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv([config["num_key_value_heads"] if t == "full_attention" else 0 for t in types])
    w.add_key_length(config["head_dim"])
    w.add_value_length(config["head_dim"])
    w.add_layer_norm_rms_eps(config["layer_norm_epsilon"])
    w.add_ssm_conv_kernel(config["conv_kernel"])
    w.add_ssm_state_size(config["ssm_state_size"])
    w.add_ssm_group_count(config["n_groups"])
    w.add_ssm_inner_size(config["mamba_num_heads"] * config["mamba_head_dim"])
    w.add_ssm_time_step_rank(config["mamba_num_heads"])
    if moe:
        w.add_expert_used_count(config["num_experts_per_tok"])
        w.add_expert_feed_forward_length(config["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(config["moe_shared_expert_intermediate_size"])
        w.add_expert_count(config["n_routed_experts"])
        w.add_expert_shared_count(config["n_shared_experts"])
        w.add_expert_weights_norm(config["norm_topk_prob"])
        w.add_expert_weights_scale(config["routed_scaling_factor"])
        w.add_expert_group_count(config["n_group"])
        w.add_moe_latent_size(config["moe_latent_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(vocab)
    w.add_token_types([gguf.TokenType.CONTROL] * len(SPECIALS) + [gguf.TokenType.NORMAL] * (len(vocab) - len(SPECIALS)))
    w.add_token_merges(MERGES)
    w.add_eos_token_id(2)
    w.add_tensor("token_embd.weight", state["backbone.embeddings.weight"])
    w.add_tensor("output.weight", state["lm_head.weight"])
    w.add_tensor("output_norm.weight", state["backbone.norm_f.weight"])
    for i in range(len(types)):
        p = f"backbone.layers.{i}."
        layer = {k[len(p):]: v for k, v in state.items() if k.startswith(p)}
        for proj in ("up_proj", "down_proj"):
            per = [layer.pop(f"mixer.experts.{e}.{proj}.weight") for e in range(config.get("n_routed_experts", 0))
                   if f"mixer.experts.{e}.{proj}.weight" in layer]
            if per:
                w.add_tensor(f"blk.{i}.ffn_{proj.split('_')[0]}_exps.weight", np.stack(per))
        for name, value in layer.items():
            gguf_name, tensor = _nemotron_h_tensor(config, name, value)
            w.add_tensor(f"blk.{i}.{gguf_name}", np.ascontiguousarray(tensor))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.mark.parametrize("arch", ["nemotron_h", "nemotron_h_moe"])
def test_nemotron_h_gguf_matches_hf(tmp_path, arch):
    vocab = _vocab()
    src = make_tiny_family(arch, tmp_path / "hf", vocab_size=len(vocab))
    path = _write_nemotron_h_gguf(src, str(tmp_path / "tiny.gguf"), vocab)
    ckpt = load_checkpoint(path, cache_dir=str(tmp_path))
    assert ckpt.config["model_type"] == "nemotron_h"
    assert ckpt.config["layers_block_type"] == load_hf(src).config.layers_block_type
    ops = CpuOps()
    model = build_model(ckpt, ops)
    ids = list(np.random.default_rng(0).integers(0, len(vocab), 40))
    caches = ModelCaches(model.cache_spec(), ops, 8, 16, 2)
    batch = contiguous_batch([ids], [0], [[0, 1, 2]], [1], 16, all_logits=True)
    ours = ops.to_numpy(model.forward(batch, caches))
    ref = hf_logits(load_hf(src), ids)
    assert float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref))) <= 1e-4
