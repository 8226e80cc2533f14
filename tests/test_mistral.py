"""Mistral-family checks beyond the shared ones (tests/test_family_logits.py runs those on
mistral_swa, ministral, ministral3 and mistral3): the features under test are live (the window
and the attention temperature move the logits past the tolerance), Mistral Small's
Mistral3ForConditionalGeneration layout with a mistral text model, a window no shorter than
the context being full attention (and servable without the sliding op), a `mistral` config
with layer_types read as ministral (as HF does), refusals naming the field, the refusal of a backend without the ops
(CUDA today), the tool parser defaults, and the rendered Mistral v0.3 prompt through `met
serve`'s /tokenize equal to the template's expected text and to HF's apply_chat_template."""
from __future__ import annotations

import re

import numpy as np
import pytest
import requests

import family_checks as fc
from family_checks import ops_without
from metrale.api.tool_parsers import default_tool_parser
from metrale.backends.cpu import CpuOps
from metrale.models.checkpoint import CheckpointError
from metrale.models.registry import build_model
from tests.serving import Server
from tiny_models import (VOCAB, load_tiny, make_tiny_family, rewrite_config,
                         write_mistral_tokenizer)

PROMPT_LEN = 70


@pytest.fixture(scope="module")
def prompt():
    return np.random.default_rng(1).integers(0, VOCAB, PROMPT_LEN).tolist()


def test_the_window_and_the_temperature_change_the_logits(tmp_path, prompt):
    """Without the 16-key window (or without Ministral 3's temperature) HF's logits past the
    window move well beyond the tolerance, so the matches cannot pass by accident."""
    ref = fc.reference(make_tiny_family("mistral_swa", tmp_path / "swa"), prompt)
    wide = fc.reference(make_tiny_family("mistral_swa", tmp_path / "wide", sliding_window=None), prompt)
    assert fc.rel_err(wide[:16], ref[:16]) <= 1e-5 and fc.rel_err(wide[16:], ref[16:]) > 1e-2
    rope = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 32.0, "original_max_position_embeddings": 16,
            "max_position_embeddings": 512, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
            "mscale_all_dim": 1.0}
    hot = fc.reference(make_tiny_family("ministral3", tmp_path / "hot", rope_parameters=dict(
        rope, llama_4_scaling_beta=0.5)), prompt)
    cold = make_tiny_family("ministral3", tmp_path / "cold", rope_parameters=dict(rope, llama_4_scaling_beta=0.0))
    assert fc.rel_err(fc.reference(cold, prompt)[16:], hot[16:]) > 1e-2
    fc.check_one_shot(cold, prompt, fc.reference(cold, prompt))       # beta 0: no scaling, still HF


def test_mistral_small_layout_matches_hf(tmp_path, prompt):
    """Mistral Small 3.x: Mistral3ForConditionalGeneration over a `mistral` text model (here
    with a sliding window too), saved in the hub's language_model.model.* layout."""
    path = make_tiny_family("mistral3", tmp_path, model_type="mistral", sliding_window=16,
                            rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    ckpt = load_tiny(path)
    assert ckpt.config["model_type"] == "mistral" and not any("vision" in n for n in ckpt.tensors)
    fc.check_one_shot(path, prompt, fc.reference(path, prompt))


def test_a_shipped_lm_head_wins_over_a_tied_config(tmp_path, prompt):
    """Mistral3Config's top-level tie_word_embeddings defaults to true while the releases ship
    their own lm_head: transformers then loads that lm_head (it ties only a missing one), so we do."""
    path = make_tiny_family("mistral3", tmp_path)
    rewrite_config(path, tie_word_embeddings=True)
    assert "lm_head.weight" in load_tiny(path).tensors
    fc.check_one_shot(path, prompt, fc.reference(path, prompt))


def test_a_window_as_long_as_the_context_is_full_attention(tmp_path, prompt):
    """v0.2+ configs that keep a sliding_window of max_position_embeddings never mask: full
    attention, which a backend without the sliding op serves too."""
    path = make_tiny_family("mistral_swa", tmp_path, sliding_window=512)
    model = build_model(load_tiny(path), _NoFamilyOps())
    assert all(layer.mixer.window is None for layer in model.layers)
    fc.check_one_shot(path, prompt, fc.reference(path, prompt))


def test_ministral_windows_follow_layer_types(tmp_path):
    model = build_model(load_tiny(make_tiny_family("ministral", tmp_path)), CpuOps())
    assert [layer.mixer.window for layer in model.layers] == [16, None, 16, None]


def test_a_mistral_config_with_layer_types_is_ministral_as_in_hf(tmp_path, prompt):
    """Ministral-8B-Instruct-2410's config.json says model_type mistral with layer_types; HF's
    AutoConfig reads it as ministral (per-layer windows), and so do we."""
    path = make_tiny_family("mistral_swa", tmp_path)
    rewrite_config(path, layer_types=["full_attention", "sliding_attention"] * 2)
    model = build_model(load_tiny(path), CpuOps())
    assert [layer.mixer.window for layer in model.layers] == [None, 16, None, 16]
    fc.check_one_shot(path, prompt, fc.reference(path, prompt))


@pytest.mark.parametrize("arch, field, value, message", [
    ("mistral_swa", "sliding_window", 0, "sliding_window must be a positive integer"),
    ("mistral_swa", "attention_bias", True, "attention_bias / mlp_bias"),
    ("ministral", "sliding_window", None, "sliding_window is null"),
    ("ministral", "layer_types", ["sliding_attention", "chunked_attention"] * 2, "layer_types"),
    ("ministral3", "rope_parameters", {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                       "original_max_position_embeddings": 128},
     "llama_4_scaling_beta"),
])
def test_unsupported_settings_are_refused_naming_the_field(tmp_path, arch, field, value, message):
    path = make_tiny_family(arch, tmp_path)
    rewrite_config(path, **{field: value})      # None: the field removed (null in HF's reading)
    with pytest.raises(CheckpointError, match=re.escape(message)):
        build_model(load_tiny(path), CpuOps())


def _NoFamilyOps():
    """A backend with the common ops only (as the CUDA backend is today)."""
    return ops_without("sliding_attention", "attn_temperature", "softcap", "gelu_tanh_mul", "route_topk", "moe_topk")


@pytest.mark.parametrize("arch, model_type, feature", [
    ("mistral_swa", "mistral", "sliding-window attention"), ("ministral", "ministral", "sliding-window attention"),
    ("ministral3", "ministral3", "attention temperature")])
def test_backend_without_the_ops_refuses_at_load(tmp_path, arch, model_type, feature):
    with pytest.raises(CheckpointError) as err:
        build_model(load_tiny(make_tiny_family(arch, tmp_path)), _NoFamilyOps())
    text = str(err.value)
    assert f"{model_type} needs" in text and feature in text
    assert "cuda kernels do not implement yet" in text and "--device cpu" in text


def test_the_real_cuda_backend_lacks_the_ops():
    """What the refusal keys on: CudaOps (imported without a GPU) has neither op yet."""
    cuda_ops = pytest.importorskip("metrale.backends.cuda.ops")
    cls = next(c for n, c in vars(cuda_ops).items() if n.endswith("Ops") and isinstance(c, type)
               and hasattr(c, "attention"))
    assert not any(hasattr(cls, op) for op in ("sliding_attention", "attn_temperature"))


def test_tool_parser_defaults():
    assert {default_tool_parser(t) for t in ("mistral", "mistral3", "ministral", "ministral3")} == {"mistral"}


# ---- the chat template through met serve -----------------------------------------------------

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "a1B2c3D4e", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "a1B2c3D4e", "content": '{"temp": 18}'},
    {"role": "assistant", "content": "18C and sunny. "},
    {"role": "user", "content": "And tomorrow?"},
]
EXPECTED = (
    '<s>[INST] Weather in Paris?[/INST]'
    '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1B2c3D4e"}]</s>'
    '[TOOL_RESULTS] {"content": {"temp": 18}, "call_id": "a1B2c3D4e"}[/TOOL_RESULTS]'
    ' 18C and sunny.</s>'
    '[AVAILABLE_TOOLS] [{"type": "function", "function": {"name": "get_weather", "description": '
    '"current weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, '
    '"required": ["city"]}}}][/AVAILABLE_TOOLS]'
    '[INST] Be brief.\n\nAnd tomorrow?[/INST]')


def test_v03_template_renders_through_met_serve(tmp_path):
    """The prompt chat completions renders for system + user + assistant tool call + tool
    result + assistant + user, read back through /tokenize and /detokenize: the template's
    expected text, HF's apply_chat_template's, and the token count chat completions bills."""
    import transformers as tf

    path = make_tiny_family("mistral_swa", tmp_path / "model", max_position_embeddings=4096)
    write_mistral_tokenizer(path)
    hf = tf.AutoTokenizer.from_pretrained(path)
    as_hf = [dict(m, content=m["content"] or "") for m in CONVERSATION]
    as_hf[2]["tool_calls"] = [dict(c, function=dict(c["function"], arguments={"city": "Paris"}))
                              for c in CONVERSATION[2]["tool_calls"]]
    assert hf.apply_chat_template(as_hf, tools=TOOLS, tokenize=False) == EXPECTED
    args = ["serve", path, "--model-name", "m", "--frontends", "1", "--max-seq-len", "1024", "--no-event-log"]
    with Server(args, tmp_path / "serve.log").serving() as srv:
        ids = requests.post(srv.url + "/tokenize", json={"messages": CONVERSATION, "tools": TOOLS}).json()["tokens"]
        text = requests.post(srv.url + "/detokenize", json={"tokens": ids}).json()["prompt"]
        assert text == EXPECTED and ids[:2] == [1, 3] and ids.count(5) == 1       # <s> [INST], one [TOOL_CALLS]
        assert ids == hf.apply_chat_template(as_hf, tools=TOOLS, tokenize=True)["input_ids"]
        chat = requests.post(srv.url + "/v1/chat/completions", json={
            "model": "m", "messages": CONVERSATION, "tools": TOOLS, "max_tokens": 1}).json()
        assert chat["usage"]["prompt_tokens"] == len(ids)
        bad = requests.post(srv.url + "/v1/chat/completions", json={
            "model": "m", "messages": CONVERSATION[1:2] * 2, "max_tokens": 1})
        assert bad.status_code == 400 and "must alternate" in bad.json()["error"]["message"]


def test_the_detokenizer_keeps_the_markers_it_is_asked_to(tmp_path):
    """[TOOL_CALLS] is a special token in Mistral's vocabulary: skipped like </s> by default,
    kept when the chat's tool parser reads it (frontends.generate passes the parser's markers)."""
    from metrale.tokenizer import IncrementalDetokenizer, Tokenizer

    write_mistral_tokenizer(tmp_path)
    tok = Tokenizer.from_dir(str(tmp_path))
    ids = tok.encode('Ok.[TOOL_CALLS] [{"name": "f"}]</s>', add_special_tokens=False)

    def text(**kw):
        d = IncrementalDetokenizer(tok, **kw)
        return "".join(d.add(i) for i in ids) + d.flush()
    assert text() == 'Ok. [{"name": "f"}]'
    assert text(keep_special=[5]) == 'Ok.[TOOL_CALLS] [{"name": "f"}]'
