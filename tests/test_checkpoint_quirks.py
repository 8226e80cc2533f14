"""Checkpoints with the quirks real releases carry (Qwen2.5, Llama 3.1, Qwen3, Qwen3.5) load,
compute and serve like HF transformers.

Logits tolerance: max |ours - hf| / max |hf| <= 1e-4, teacher-forced, fp32 on both sides (as
tests/test_models.py). Prompts run past every rope kind's original_max_position_embeddings, so
the scaled frequencies are the ones compared. One exception, stated where it applies: a bf16
checkpoint with YaRN carries the attention factor folded into its bf16 query weights, one bf16
rounding (~2**-9 relative) that HF's fp32 upcast does not make: 1e-2 there.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import requests

from metrale.backends.cpu import CpuOps
from metrale.cache.kv import ModelCaches
from metrale.forward import contiguous_batch
from metrale.llm import LLM
from metrale.models.checkpoint import CheckpointError
from metrale.models.registry import build_model
from metrale.sampling import SamplingParams
from metrale.tokenizer import Tokenizer
from tests.serving import Server
from tests.tiny_models import (ENDOFTEXT, HUGE_MODEL_MAX_LENGTH, IM_END, QWEN2_5_CHAT_TEMPLATE, VOCAB,
                               hf_logits, load_hf, load_tiny, make_qwen2_5_instruct, make_tiny,
                               rewrite_config, write_generation_config, write_qwen_tokenizer)

RTOL = 1e-4
PROMPT = np.random.default_rng(7).integers(0, VOCAB, 80).tolist()


def our_logits(path, ids=PROMPT) -> np.ndarray:
    ops = CpuOps()
    model = build_model(load_tiny(path), ops)
    caches = ModelCaches(model.cache_spec(), ops, 16, 16, 2)
    batch = contiguous_batch([list(ids)], [0], [list(range(-(-len(ids) // 16)))], [0], 16, True)
    return ops.to_numpy(model.forward(ops.upload_batch(batch), caches))


BF16_YARN_RTOL = 1e-2


def assert_matches_hf(path, rtol: float = RTOL) -> None:
    ours, ref = our_logits(path), hf_logits(load_hf(path), PROMPT)
    err = float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))
    assert err <= rtol, f"max relative error {err:.2e}"


# ---- rope kinds ----------------------------------------------------------------------------

LLAMA3_1 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
YARN = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 32}
ROPES = {
    "llama-llama3": ("llama", LLAMA3_1),
    "llama-linear": ("llama", {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.5}),
    "llama-dynamic": ("llama", {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}),
    "llama-yarn": ("llama", YARN),
    "qwen2-yarn": ("qwen2", YARN),
    "qwen3-yarn": ("qwen3", YARN),
    "qwen3-yarn-mscale": ("qwen3", dict(YARN, mscale=0.8, mscale_all_dim=0.5, beta_fast=16)),
    "qwen3_5-mrope-partial": ("qwen3_5", {"rope_type": "default", "rope_theta": 1e4,
                                          "partial_rotary_factor": 0.5, "mrope_section": [4, 2, 2],
                                          "mrope_interleaved": True}),
}


@pytest.mark.parametrize("label", ROPES)
def test_rope_kind_matches_hf(tmp_path, label):
    arch, rope = ROPES[label]
    assert_matches_hf(make_tiny(arch, tmp_path / label, rope_parameters=rope))


@pytest.mark.parametrize("kind", ["yarn", "llama3"])
def test_legacy_rope_scaling_matches_hf(tmp_path, kind):
    """transformers-4 spelling (Qwen2.5 / Llama 3.1 config.json): top-level rope_theta and
    rope_scaling with `type` (YaRN) or `rope_type` (llama3)."""
    path = make_tiny("qwen2" if kind == "yarn" else "llama", tmp_path / kind)
    params = dict(YARN if kind == "yarn" else LLAMA3_1)
    theta = params.pop("rope_theta")
    params["type" if kind == "yarn" else "rope_type"] = params.pop("rope_type")
    rewrite_config(path, rope_parameters=None, rope_theta=theta, rope_scaling=params)
    assert_matches_hf(path)


@pytest.mark.parametrize("arch, rope, field", [
    ("llama", {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8,
               "long_factor": [1.0] * 8, "original_max_position_embeddings": 32}, "rope_type 'longrope'"),
    ("qwen3", {"rope_type": "su", "rope_theta": 1e4}, "rope_type 'su'"),
    ("qwen3_5", dict(YARN, partial_rotary_factor=0.25), "attention factor"),
])
def test_unsupported_rope_is_refused_at_load(tmp_path, arch, rope, field):
    path = make_tiny(arch, tmp_path / "m")
    rewrite_config(path, rope_parameters=rope) if arch != "qwen3_5" else _set_text_rope(path, rope)
    with pytest.raises(CheckpointError, match=field):
        build_model(load_tiny(path), CpuOps())


def _set_text_rope(path, rope) -> None:
    file = os.path.join(path, "config.json")
    with open(file) as f:
        config = json.load(f)
    config["text_config"]["rope_parameters"] = rope
    with open(file, "w") as f:
        json.dump(config, f)


# ---- settings the model code cannot honour -------------------------------------------------

def test_mlp_bias_is_refused(tmp_path):
    path = make_tiny("llama", tmp_path / "m", mlp_bias=True)
    with pytest.raises(CheckpointError, match="mlp_bias"):
        build_model(load_tiny(path), CpuOps())


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_sliding_window_attention_is_refused(tmp_path, arch):
    path = make_tiny(arch, tmp_path / "m", use_sliding_window=True, sliding_window=16, max_window_layers=2)
    with pytest.raises(CheckpointError, match="use_sliding_window"):
        build_model(load_tiny(path), CpuOps())


def test_sliding_window_set_but_unused_loads(tmp_path):
    """Qwen2.5 ships `sliding_window: 131072` with `use_sliding_window: false`."""
    path = make_tiny("qwen2", tmp_path / "m", sliding_window=64, max_window_layers=2)
    rewrite_config(path, layer_types=None)
    assert_matches_hf(path)


# ---- dtype key, embeddings -----------------------------------------------------------------

@pytest.mark.parametrize("key", ["dtype", "torch_dtype"])
def test_dtype_key_of_either_transformers_version(tmp_path, key):
    """transformers 5 writes `dtype`, 4 wrote `torch_dtype`; the weights' own dtype (bf16 here)
    is what is served either way."""
    path = make_tiny("llama", tmp_path / key, dtype="bfloat16")
    if key == "torch_dtype":
        rewrite_config(path, dtype=None, torch_dtype="bfloat16")
    ckpt = load_tiny(path)
    assert str(ckpt.tensors["model.embed_tokens.weight"].dtype) == "bfloat16"
    assert_matches_hf(path)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])  # qwen3_5: tests/test_loader.py
@pytest.mark.parametrize("tie", [True, False])
def test_tied_and_untied_embeddings_match_hf(tmp_path, arch, tie):
    path = make_tiny(arch, tmp_path / "m", tie_word_embeddings=tie)
    assert ("lm_head.weight" in load_tiny(path).tensors) is not tie
    assert_matches_hf(path)


# ---- tokenizer files, generation config, chat templates ------------------------------------

@pytest.fixture(scope="module")
def qwen2_5(tmp_path_factory):
    return make_qwen2_5_instruct(tmp_path_factory.mktemp("quirks") / "qwen2.5-instruct")


def test_qwen2_5_quirks_load_like_transformers(qwen2_5):
    import transformers

    hf = transformers.AutoTokenizer.from_pretrained(qwen2_5)
    ckpt = load_tiny(qwen2_5)
    tok = Tokenizer.from_checkpoint(ckpt)
    assert ckpt.tokenizer_config["model_max_length"] == HUGE_MODEL_MAX_LENGTH
    assert set(tok.eos_token_ids) == {IM_END, ENDOFTEXT}
    text = "<|im_start|>user\nhi <tool_call>{}</tool_call><|im_end|>\n<|endoftext|>"
    ids = hf.encode(text)
    assert tok.encode(text) == ids
    for skip in (False, True):
        assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert ckpt.chat_template == hf.chat_template == QWEN2_5_CHAT_TEMPLATE
    assert_matches_hf(qwen2_5, BF16_YARN_RTOL)  # legacy yarn rope_scaling, torch_dtype bf16, tied


def test_generation_config_defaults_surface(qwen2_5):
    params = LLM(qwen2_5).default_params()
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (0.7, 0.8, 20, 1.05)
    assert LLM(qwen2_5).default_params(temperature=0.0).temperature == 0.0


def _greedy(path, n: int = 24, **kw) -> tuple[list[int], str]:
    out = LLM(path).generate([1, 2, 3, 4], SamplingParams(max_tokens=n, temperature=0.0, **kw))[0]
    return out.token_ids, out.finish_reason


@pytest.mark.parametrize("source", ["generation_config", "config"])
def test_every_eos_id_of_a_list_stops_generation(tmp_path, source):
    """eos_token_id as a list (Llama 3.1: [128001, 128008, 128009]) in generation_config.json,
    or only in config.json when no generation_config.json ships: each id ends generation."""
    path = make_tiny("llama", tmp_path / "m")
    write_qwen_tokenizer(path, chat_template=None)
    free, _ = _greedy(path, ignore_eos=True)
    # two tokens the model emits, neither the tokenizer's own eos
    emitted = [t for t in dict.fromkeys(free) if t != IM_END][:2]
    assert len(emitted) == 2, free
    for eos in emitted:
        ids = [VOCAB - 1 if eos != VOCAB - 1 else 0, eos]  # the id that fires is second in the list
        if source == "config":
            if os.path.exists(os.path.join(path, "generation_config.json")):
                os.remove(os.path.join(path, "generation_config.json"))
            rewrite_config(path, eos_token_id=ids)
        else:
            write_generation_config(path, eos_token_id=ids)
        tokens, reason = _greedy(path)
        stop = next(i for i, t in enumerate(free) if t in set(ids) | {IM_END})
        assert reason == "stop" and tokens[-1] in set(ids) | {IM_END}
        assert tokens == free[: stop + 1]


def test_template_file_wins_over_tokenizer_config_like_transformers(tmp_path):
    import transformers

    path = tmp_path / "tok"
    write_qwen_tokenizer(path, chat_template="from tokenizer_config {{ messages }}")
    os.makedirs(path / "additional_chat_templates")
    cases = [("only tokenizer_config", None, None),
             ("jinja wins", "from the jinja file {{ messages }}", None),
             ("named templates", "default one {{ messages }}", "tool one {{ tools }}")]
    for label, jinja, tool_use in cases:
        if jinja:
            (path / "chat_template.jinja").write_text(jinja)
        if tool_use:
            (path / "additional_chat_templates" / "tool_use.jinja").write_text(tool_use)
        make_tiny("llama", path)
        hf = transformers.AutoTokenizer.from_pretrained(str(path)).chat_template
        assert load_tiny(path).chat_template == hf, label


# ---- a Qwen2.5 release with all its quirks, served -----------------------------------------

def test_qwen2_5_checkpoint_with_every_quirk_serves_chat(qwen2_5, tmp_path):
    with Server(["serve", qwen2_5, "--max-seq-len", "1024"], tmp_path / "serve.log").serving() as srv:
        r = requests.post(srv.url + "/v1/chat/completions", timeout=120, json={
            "model": "qwen2.5-instruct", "max_tokens": 8,
            "messages": [{"role": "user", "content": "hello"}]})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["finish_reason"] in ("stop", "length")
        # the Qwen2.5 template's default system prompt was rendered: >60 prompt tokens
        assert body["usage"]["prompt_tokens"] > 60
