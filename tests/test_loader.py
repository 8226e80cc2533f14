"""load_checkpoint on HF folders and the HF cache, against tiny random checkpoints that HF
transformers writes (oracle: the torch state_dict they were saved from)."""
from __future__ import annotations

import json
import os
import shutil
import struct

import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import save_file

from metrale.models.checkpoint import CheckpointError
from metrale.models.loader import SUPPORTED_MODEL_TYPES, load_checkpoint

TEXT_CONFIG = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
    max_position_embeddings=256)
VISION_CONFIG = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                     out_hidden_size=64, num_position_embeddings=16)
CHAT_TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"


def _tiny_text_model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.Qwen3_5TextConfig(**TEXT_CONFIG)
    return transformers.Qwen3_5ForCausalLM(config).to(dtype)


@pytest.fixture(scope="module")
def text_models(tmp_path_factory):
    """{dtype name: (folder, state_dict)}: bf16 sharded through an index, fp32 in one file."""
    root = tmp_path_factory.mktemp("hf")
    saved = {}
    for label, dtype, shard in (("bf16", torch.bfloat16, "40KB"), ("fp32", torch.float32, "50MB")):
        model = _tiny_text_model(dtype)
        folder = root / label
        model.save_pretrained(folder, max_shard_size=shard)
        saved[label] = (str(folder), model.state_dict())
    return saved


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _assert_same_tensors(ckpt, state_dict: dict[str, torch.Tensor]) -> None:
    assert set(ckpt.tensors) == set(state_dict)
    for name, expected in state_dict.items():
        got = ckpt.tensor(name, tuple(expected.shape))
        want = _as_numpy(expected)
        assert got.dtype == want.dtype, name
        # bitwise: bf16 compared as its raw 16-bit patterns
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), name


@pytest.mark.parametrize("label", ["bf16", "fp32"])
def test_hf_folder_tensors_equal_state_dict(text_models, label):
    folder, state_dict = text_models[label]
    ckpt = load_checkpoint(folder)
    _assert_same_tensors(ckpt, state_dict)
    expected_dtype = np.dtype(ml_dtypes.bfloat16) if label == "bf16" else np.dtype(np.float32)
    assert {ckpt.tensors[n].dtype for n in ckpt.tensors} == {expected_dtype}
    assert ckpt.model_type == "qwen3_5"  # qwen3_5_text maps to the served name
    assert ckpt.config["hidden_size"] == 64 and ckpt.config["num_hidden_layers"] == 4
    assert ckpt.name == label
    assert ckpt.generation_config == json.load(open(os.path.join(folder, "generation_config.json")))


def test_bf16_shards_are_memory_mapped_views(text_models):
    folder, _ = text_models["bf16"]
    assert os.path.isfile(os.path.join(folder, "model.safetensors.index.json"))
    ckpt = load_checkpoint(folder)
    shards = {os.path.basename(f) for f in ckpt.tensor_files.values()}
    assert len(shards) > 1, "max_shard_size should have split the checkpoint"
    weight = ckpt.tensors["model.embed_tokens.weight"]
    assert not weight.flags.owndata and not weight.flags.writeable
    assert ckpt.tensor_files["model.embed_tokens.weight"].startswith(folder)


def test_shape_mismatch_names_the_file(text_models):
    folder, _ = text_models["fp32"]
    ckpt = load_checkpoint(folder)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'model\.norm\.weight' "
                                              r"has shape \(64,\), expected \(65,\)"):
        ckpt.tensor("model.norm.weight", (65,))


def _tiny_vl_folder(path, tie: bool) -> tuple[str, dict[str, torch.Tensor]]:
    """A sharded Qwen3_5ForConditionalGeneration with an extra mtp.* tensor in its last shard."""
    torch.manual_seed(1)
    config = transformers.Qwen3_5Config(text_config=TEXT_CONFIG, vision_config=VISION_CONFIG,
                                        tie_word_embeddings=tie)
    model = transformers.Qwen3_5ForConditionalGeneration(config)
    model.save_pretrained(path, max_shard_size="60KB")
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    save_file({"mtp.fc.weight": np.ones((4, 4), np.float32)}, str(path / "mtp.safetensors"),
              metadata={"format": "pt"})
    index["weight_map"]["mtp.fc.weight"] = "mtp.safetensors"
    index_path.write_text(json.dumps(index))
    return str(path), model.state_dict()


@pytest.mark.parametrize("tie", [True, False])
def test_multimodal_checkpoint_serves_the_text_model(tmp_path, tie):
    folder, state_dict = _tiny_vl_folder(tmp_path, tie)
    ckpt = load_checkpoint(folder)
    text = {"model." + k.removeprefix("model.language_model."): v for k, v in state_dict.items()
            if k.startswith("model.language_model.")}
    if not tie:
        text["lm_head.weight"] = state_dict["lm_head.weight"]
    # the MTP head's tensors are kept under their own names (metrale.models.mtp reads them)
    text["mtp.fc.weight"] = torch.ones((4, 4))
    _assert_same_tensors(ckpt, text)
    assert not any(n.startswith(("model.visual.", "visual.")) for n in ckpt.tensors)
    assert ckpt.model_type == "qwen3_5"
    assert ckpt.config["hidden_size"] == 64 and "text_config" not in ckpt.config
    assert "vision_config" not in ckpt.config
    assert ckpt.config["tie_word_embeddings"] is tie  # the top-level flag, which HF obeys
    # top-level keys the text config lacks are kept
    assert ckpt.config["image_token_id"] == transformers.Qwen3_5Config().image_token_id


def test_moe_multimodal_config_flattened(tmp_path):
    text = dict(TEXT_CONFIG, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                num_experts=4, num_experts_per_tok=2)
    text.pop("intermediate_size")
    config = transformers.Qwen3_5MoeConfig(text_config=text, vision_config=VISION_CONFIG)
    transformers.Qwen3_5MoeForConditionalGeneration(config).save_pretrained(tmp_path)
    ckpt = load_checkpoint(str(tmp_path))
    assert ckpt.model_type == "qwen3_5_moe"
    assert ckpt.config["num_experts"] == 4 and ckpt.config["num_experts_per_tok"] == 2
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in ckpt.tensors
    assert ckpt.tensor("model.layers.0.mlp.gate.weight", (4, 64)).dtype == np.float32


def test_tokenizer_files_and_chat_template_precedence(tmp_path, text_models):
    folder = tmp_path / "m"
    shutil.copytree(text_models["fp32"][0], folder)
    (folder / "tokenizer.json").write_text("{}")
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "chat_template": "from tokenizer_config"}))
    ckpt = load_checkpoint(str(folder))
    assert ckpt.tokenizer_json == str(folder / "tokenizer.json")
    assert ckpt.tokenizer_config["eos_token"] == "<|im_end|>"
    assert ckpt.chat_template == "from tokenizer_config"
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    assert load_checkpoint(str(folder)).chat_template == CHAT_TEMPLATE


# ---------------------------------------------------------------------------------------------
# HF cache resolution


def _fake_cache(root, source: str, revisions: list[str], main: str | None) -> None:
    repo = root / "models--tiny-org--tiny-model"
    for rev in revisions:
        shutil.copytree(source, repo / "snapshots" / rev)
        os.utime(repo / "snapshots" / rev, (revisions.index(rev) * 100.0 + 1e9,) * 2)
    if main is not None:
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(main + "\n")


def test_model_id_resolved_in_cache_dir_by_refs_main(tmp_path, text_models):
    _fake_cache(tmp_path, text_models["fp32"][0], ["aaa", "bbb"], main="aaa")
    ckpt = load_checkpoint("tiny-org/tiny-model", cache_dir=str(tmp_path))
    assert ckpt.path == str(tmp_path / "models--tiny-org--tiny-model" / "snapshots" / "aaa")
    assert ckpt.name == "tiny-org/tiny-model"
    assert load_checkpoint("tiny-org/tiny-model", cache_dir=str(tmp_path), name="x").name == "x"


def test_model_id_without_refs_uses_newest_snapshot(tmp_path, text_models):
    _fake_cache(tmp_path, text_models["fp32"][0], ["old", "new"], main=None)
    ckpt = load_checkpoint("tiny-org/tiny-model", cache_dir=str(tmp_path))
    assert os.path.basename(ckpt.path) == "new"


@pytest.mark.parametrize("env", ["HF_HUB_CACHE", "HF_HOME"])
def test_model_id_resolved_through_environment(tmp_path, text_models, monkeypatch, env):
    hub = tmp_path / "hub"
    _fake_cache(hub, text_models["fp32"][0], ["r1"], main="r1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv(env, str(hub if env == "HF_HUB_CACHE" else tmp_path))
    ckpt = load_checkpoint("tiny-org/tiny-model")
    _assert_same_tensors(ckpt, text_models["fp32"][1])


def test_snapshot_folder_given_directly_is_named_after_the_repo(tmp_path, text_models):
    _fake_cache(tmp_path, text_models["fp32"][0], ["abc"], main="abc")
    ckpt = load_checkpoint(str(tmp_path / "models--tiny-org--tiny-model" / "snapshots" / "abc"))
    assert ckpt.name == "tiny-org/tiny-model"


# ---------------------------------------------------------------------------------------------
# Errors


def test_missing_path_lists_places_searched(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(str(missing))
    assert "not found" in str(err.value) and str(missing) in str(err.value)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint("no-org/no-model", cache_dir=str(tmp_path))
    message = str(err.value)
    assert str(tmp_path / "models--no-org--no-model" / "snapshots") in message
    assert "HF_HUB_CACHE" in message


def test_stale_refs_main_is_reported(tmp_path, text_models):
    _fake_cache(tmp_path, text_models["fp32"][0], ["aaa"], main="zzz")
    with pytest.raises(CheckpointError, match="names revision 'zzz'"):
        load_checkpoint("tiny-org/tiny-model", cache_dir=str(tmp_path))


def _copy(text_models, tmp_path, label="fp32"):
    folder = tmp_path / label
    shutil.copytree(text_models[label][0], folder)
    return folder


def test_missing_config_json(tmp_path, text_models):
    folder = _copy(text_models, tmp_path)
    (folder / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_checkpoint(str(folder))


def test_unknown_architecture_lists_supported(tmp_path, text_models):
    folder = _copy(text_models, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(str(folder))
    message = str(err.value)
    assert "'gpt2'" in message and "GPT2LMHeadModel" in message
    assert all(t in message for t in SUPPORTED_MODEL_TYPES)


def _rewrite_header(path, header_bytes: bytes, length: int | None = None) -> None:
    """Replace the safetensors header of `path`, keeping its data bytes."""
    raw = path.read_bytes()
    (old_len,) = struct.unpack("<Q", raw[:8])
    data = raw[8 + old_len:]
    n = len(header_bytes) if length is None else length
    path.write_bytes(struct.pack("<Q", n) + header_bytes + data)


def test_safetensors_header_length_past_end(tmp_path, text_models):
    folder = _copy(text_models, tmp_path)
    st = folder / "model.safetensors"
    raw = st.read_bytes()
    st.write_bytes(struct.pack("<Q", len(raw) * 2) + raw[8:])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupt safetensors file: "
                                              r"header length \d+ is past the end"):
        load_checkpoint(str(folder))


def test_safetensors_header_bad_json(tmp_path, text_models):
    folder = _copy(text_models, tmp_path)
    _rewrite_header(folder / "model.safetensors", b'{"model.norm.weight": {"dtype": ')
    with pytest.raises(CheckpointError, match="header is not valid JSON"):
        load_checkpoint(str(folder))


def test_safetensors_offsets_past_end_of_file(tmp_path, text_models):
    folder = _copy(text_models, tmp_path)
    st = folder / "model.safetensors"
    st.write_bytes(st.read_bytes()[:-100])  # truncated download
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(str(folder))
    assert "past the end of the file" in str(err.value) and "truncated" in str(err.value)
    assert str(st) in str(err.value)


def test_safetensors_offsets_not_matching_shape(tmp_path, text_models):
    folder = _copy(text_models, tmp_path)
    st = folder / "model.safetensors"
    (n,) = struct.unpack("<Q", st.read_bytes()[:8])
    header = json.loads(st.read_bytes()[8:8 + n])
    header["model.norm.weight"]["shape"] = [65]
    _rewrite_header(st, json.dumps(header).encode())
    with pytest.raises(CheckpointError, match=r"tensor 'model\.norm\.weight': data_offsets .* do not "
                                              r"hold F32\[65\]"):
        load_checkpoint(str(folder))


def test_index_naming_missing_shard(tmp_path, text_models):
    folder = _copy(text_models, tmp_path, "bf16")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (folder / shard).unlink()
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(str(folder))
    assert f"names shard '{shard}'" in str(err.value) and "does not exist" in str(err.value)


def test_plain_file_that_is_not_gguf(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 64)
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        load_checkpoint(str(path))
