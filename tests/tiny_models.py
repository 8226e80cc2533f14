"""Tiny random HF checkpoints for tests: real architectures, real `save_pretrained` folders.

    make_tiny(arch, path, dtype="float32", **overrides) -> path
        arch: qwen3_5 | qwen3_5_moe | qwen3 | qwen2 | llama. Writes config.json + model.safetensors
        (+ generation_config.json) into `path`. `overrides` replace keys of the text config (e.g.
        num_hidden_layers=2, tie_word_embeddings=True, rope_parameters={...}); for Qwen3.5 a new
        depth keeps the linear/full attention alternation unless layer_types is given too.
        Qwen3.5 checkpoints are saved the way the hub ships them: the multimodal
        `*ForConditionalGeneration` class (a one-block vision tower), so config.json nests the text
        model under `text_config` and tensors are named `model.language_model.*`.
    load_hf(path) -> torch model in eval mode (the oracle), fp32.
    load_tiny(path) -> metrale Checkpoint, through the server's own loader.
    add_mtp(path) -> path: random `mtp.*` tensors (the MTP head of Qwen3.5 releases, which
        save_pretrained does not write) added to a tiny qwen3_5 / qwen3_5_moe checkpoint.

Sizes stay tiny (hidden 64, 4 layers, vocab 320) so a forward costs milliseconds.
"""
from __future__ import annotations

import os

import numpy as np

from metrale.models.checkpoint import Checkpoint

ARCHS = ("qwen3_5", "qwen3_5_moe", "qwen3", "qwen2", "llama", "mistral")

VOCAB = 320

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)

_QWEN3_5_TEXT = dict(
    _COMMON,
    head_dim=32,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=24,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [2, 1, 1], "mrope_interleaved": True},
)

_TEXT_CONFIGS = {
    "qwen3_5": _QWEN3_5_TEXT,
    "qwen3_5_moe": dict(_QWEN3_5_TEXT, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                        num_experts=6, num_experts_per_tok=2),
    "qwen3": dict(_COMMON, head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "qwen2": dict(_COMMON, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "llama": dict(_COMMON, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
    # Mistral v0.2+ (no sliding window), with an explicit head_dim unlike hidden / heads
    # (Mistral-Small's 5120 / 32 heads of 128)
    "mistral": dict(_COMMON, head_dim=24, sliding_window=None,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
}

_TINY_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                    temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=64)


def _hf_model(arch: str, text: dict):
    import transformers as tf

    if arch == "qwen3_5":
        cfg = tf.Qwen3_5Config(text_config=text, vision_config=dict(_TINY_VISION, out_hidden_size=text["hidden_size"]))
        return tf.Qwen3_5ForConditionalGeneration(cfg)
    if arch == "qwen3_5_moe":
        cfg = tf.Qwen3_5MoeConfig(text_config=text, vision_config=dict(_TINY_VISION, out_hidden_size=text["hidden_size"]))
        return tf.Qwen3_5MoeForConditionalGeneration(cfg)
    classes = {"qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
               "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
               "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
               "mistral": (tf.MistralConfig, tf.MistralForCausalLM)}
    config_cls, model_cls = classes[arch]
    return model_cls(config_cls(**text))


def _randomise(model, seed: int) -> None:
    """HF inits norms to constants (zeros / ones) and some biases to zero: perturb every parameter
    so a wrong offset, a missing bias or a swapped norm weight changes the logits."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=gen) * 8 + 0.5))
            elif p.ndim == 1:
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


def make_tiny(arch: str, path, dtype: str = "float32", seed: int = 0, **overrides) -> str:
    """Write a tiny random checkpoint of `arch` into folder `path`; returns `path` as str."""
    import torch

    if arch not in _TEXT_CONFIGS:
        raise ValueError(f"unknown tiny arch {arch!r}; choose from {ARCHS}")
    text = dict(_TEXT_CONFIGS[arch], **overrides)
    if arch == "qwen2":
        text.setdefault("use_sliding_window", False)
    if "layer_types" in text and "layer_types" not in overrides:
        # keep the linear/full alternation when only the depth is overridden
        text["layer_types"] = [_QWEN3_5_TEXT["layer_types"][i % 2] for i in range(text["num_hidden_layers"])]
    torch.manual_seed(seed)
    model = _hf_model(arch, text)
    _randomise(model, seed)
    model = model.to(getattr(torch, dtype)).eval()
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(str(path))
    return str(path)


def load_hf(path):
    """The HF oracle for a tiny checkpoint, fp32, eval mode, eager attention."""
    import torch
    import transformers as tf

    config = tf.AutoConfig.from_pretrained(str(path))
    if config.model_type in ("qwen3_5", "qwen3_5_moe", "mistral3"):
        cls = tf.AutoModelForImageTextToText
    else:
        cls = tf.AutoModelForCausalLM
    model = cls.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def hf_logits(model, ids) -> np.ndarray:
    """Teacher-forced logits [len(ids), V] of one sequence, fp32 numpy."""
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.tensor([list(ids)], dtype=torch.long), use_cache=False)
    return out.logits[0].float().numpy()


def load_tiny(path) -> Checkpoint:
    """The checkpoint as the server loads it (metrale.models.loader.load_checkpoint: text_config
    flattened in, `model.language_model.*` renamed to `model.*`, vision tensors dropped)."""
    from metrale.models.loader import load_checkpoint

    return load_checkpoint(str(path))


def add_mtp(path, seed: int = 1, layers: int = 1) -> str:
    """Add the MTP head a Qwen3.5 / 3.6 release ships (HF neither saves nor loads it) to the
    tiny qwen3_5 / qwen3_5_moe checkpoint at `path`: random top-level `mtp.*` tensors in the
    checkpoint's dtype, named and shaped as the releases store them (see metrale.models.mtp):
    mtp.fc.weight [H, 2H], mtp.pre_fc_norm_embedding / pre_fc_norm_hidden / norm.weight [H],
    and mtp.layers.0.* laid out as the checkpoint's own first full-attention layer (gated
    q_proj, q/k norms, the same dense MLP or MoE tensors), plus `mtp_num_hidden_layers: layers`
    and `mtp_use_dedicated_embeddings: false` in the text config. Norm weights are small
    random offsets (zero-centred norms), matrices N(0, 1 / fan_in). Returns `path`."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    state = load_file(file)
    config_file = os.path.join(path, "config.json")
    with open(config_file, encoding="utf-8") as f:
        config = json.load(f)
    text = config["text_config"]
    hidden = text["hidden_size"]
    full = text["layer_types"].index("full_attention")
    src = f"model.language_model.layers.{full}."
    dtype = state["lm_head.weight"].dtype
    gen = torch.Generator().manual_seed(seed)

    def rand(shape):
        if len(shape) == 1:
            return (torch.randn(shape, generator=gen) * 0.1).to(dtype)
        return (torch.randn(shape, generator=gen) / shape[-1] ** 0.5).to(dtype)

    mtp = {"mtp.fc.weight": rand((hidden, 2 * hidden))}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{name}.weight"] = rand((hidden,))
    for layer in range(layers):
        mtp.update({f"mtp.layers.{layer}." + n[len(src):]: rand(tuple(t.shape))
                    for n, t in sorted(state.items()) if n.startswith(src)})
    save_file({**state, **mtp}, file, metadata={"format": "pt"})
    text.update(mtp_num_hidden_layers=layers, mtp_use_dedicated_embeddings=False)
    with open(config_file, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return str(path)


# ---------------------------------------------------------------------------------------------
# Checkpoints with the files real releases carry

# Qwen2.5-Instruct's chat template (tools, tool calls, tool results, the default system prompt).
QWEN2_5_CHAT_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# What transformers writes for a tokenizer saved without a length limit (VERY_LARGE_INTEGER):
# more than 64 bits.
HUGE_MODEL_MAX_LENGTH = int(1e30)
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN_PLAIN_ADDED = ("<tool_call>", "</tool_call>")                 # added, not special
# Ids as in Qwen's vocabulary layout: byte tokens, then ordinary merges (fillers here), then the
# added tokens at the end.
QWEN_IDS = {t: VOCAB - 5 + i for i, t in enumerate(QWEN_SPECIALS + QWEN_PLAIN_ADDED)}
ENDOFTEXT, IM_START, IM_END = (QWEN_IDS[t] for t in QWEN_SPECIALS)


def write_qwen_tokenizer(path, chat_template: str | None = QWEN2_5_CHAT_TEMPLATE) -> dict:
    """A byte-level BPE tokenizer.json (256 byte tokens, filler words, then Qwen's added tokens
    at QWEN_IDS: VOCAB ids in all) and the tokenizer_config.json of a Qwen2.5-Instruct release
    re-saved by transformers: `added_tokens_decoder`, `additional_special_tokens`,
    `bos_token: null`, the chat template, and `model_max_length` 1e30. Returns that dict."""
    import json

    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update((f"w{i}", len(vocab)) for i in range(VOCAB - 5 - len(vocab)))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in QWEN_SPECIALS])
    tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in QWEN_PLAIN_ADDED])
    assert all(tok.token_to_id(t) == i for t, i in QWEN_IDS.items())
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    decoder = {str(i): dict(content=t, lstrip=False, normalized=False, rstrip=False,
                            single_word=False, special=t in QWEN_SPECIALS) for t, i in QWEN_IDS.items()}
    config = {"add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": decoder,
              "additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "bos_token": None,
              "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>", "errors": "replace",
              "model_max_length": HUGE_MODEL_MAX_LENGTH, "pad_token": "<|endoftext|>",
              "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer", "unk_token": None}
    if chat_template is not None:
        config["chat_template"] = chat_template
    with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return config


# Mistral-7B-Instruct-v0.3's chat format, written here from that template's logic: BOS; the
# system message goes in front of the LAST user message; [AVAILABLE_TOOLS] [...][/AVAILABLE_TOOLS]
# right before the last user message when tools are given; user turns "[INST] ...[/INST]";
# assistant text " " + trimmed content + EOS; tool calls "[TOOL_CALLS] [{name, arguments, id}]"
# + EOS and tool results '[TOOL_RESULTS] {"content": ..., "call_id": ...}[/TOOL_RESULTS]', both
# with Mistral's 9-character ids (anything else is refused, as the original does); user and
# assistant turns must alternate.
MISTRAL_V03_CHAT_TEMPLATE = """{%- set ns = namespace(system=none, tools_at=-1, turn=0) %}
{%- if messages[0].role == 'system' %}
    {%- set ns.system = messages[0].content %}
    {%- set turns = messages[1:] %}
{%- else %}
    {%- set turns = messages %}
{%- endif %}
{%- for m in turns %}
    {%- if m.role == 'user' %}{% set ns.tools_at = loop.index0 %}{% endif %}
    {%- if m.role == 'user' or (m.role == 'assistant' and not m.tool_calls) %}
        {%- if (m.role == 'user') != (ns.turn % 2 == 0) %}
            {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}
        {%- endif %}
        {%- set ns.turn = ns.turn + 1 %}
    {%- endif %}
{%- endfor %}
{{- bos_token }}
{%- for m in turns %}
    {%- if m.role == 'user' %}
        {%- if tools and loop.index0 == ns.tools_at %}
            {{- '[AVAILABLE_TOOLS] [' }}
            {%- for t in tools %}
                {{- '{"type": "function", "function": ' + t.function | tojson + '}' }}
                {{- ', ' if not loop.last }}
            {%- endfor %}
            {{- ']' + '[/AVAILABLE_TOOLS]' }}
        {%- endif %}
        {%- if loop.index0 == ns.tools_at and ns.system is not none %}
            {{- '[INST] ' + ns.system + '\n\n' + m.content + '[/INST]' }}
        {%- else %}
            {{- '[INST] ' + m.content + '[/INST]' }}
        {%- endif %}
    {%- elif m.role == 'assistant' and m.tool_calls %}
        {{- '[TOOL_CALLS] [' }}
        {%- for call in m.tool_calls %}
            {%- if call.id is not defined or call.id | length != 9 %}
                {{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}
            {%- endif %}
            {{- (call.function | tojson)[:-1] + ', "id": "' + call.id + '"}' }}
            {{- ', ' if not loop.last else ']' + eos_token }}
        {%- endfor %}
    {%- elif m.role == 'assistant' %}
        {{- ' ' + m.content | trim + eos_token }}
    {%- elif m.role == 'tool' %}
        {%- if m.tool_call_id is not defined or m.tool_call_id | length != 9 %}
            {{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}
        {%- endif %}
        {{- '[TOOL_RESULTS] {"content": ' + m.content | string + ', "call_id": "' + m.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}
    {%- endif %}
{%- endfor %}
"""

# Mistral v0.3's control tokens at their ids (0..9), then byte-level pieces
MISTRAL_SPECIALS = ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                    "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]")
MISTRAL_BOS, MISTRAL_EOS = 1, 2


def write_mistral_tokenizer(path, chat_template: str | None = MISTRAL_V03_CHAT_TEMPLATE) -> dict:
    """A tokenizer.json laid out as Mistral v0.3's: its ten control tokens special at ids 0..9
    (<unk> <s> </s> [INST] [/INST] [TOOL_CALLS] [AVAILABLE_TOOLS] [/AVAILABLE_TOOLS]
    [TOOL_RESULTS] [/TOOL_RESULTS]), then byte-level BPE pieces (256 bytes and fillers: VOCAB
    ids in all; the real one is SentencePiece, which only the text tokens' split changes),
    and a tokenizer_config.json with <s> / </s>, add_bos_token and the chat template.
    Returns that config."""
    import json

    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(MISTRAL_SPECIALS)}
    vocab.update((ch, len(vocab)) for ch in sorted(pre_tokenizers.ByteLevel.alphabet()))
    vocab.update((f"w{i}", len(vocab)) for i in range(VOCAB - len(vocab)))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in MISTRAL_SPECIALS])
    assert [tok.token_to_id(t) for t in MISTRAL_SPECIALS] == list(range(len(MISTRAL_SPECIALS)))
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    decoder = {str(i): dict(content=t, lstrip=False, normalized=False, rstrip=False, single_word=False,
                            special=True) for i, t in enumerate(MISTRAL_SPECIALS)}
    config = {"add_bos_token": True, "add_eos_token": False, "added_tokens_decoder": decoder,
              "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": None,
              "clean_up_tokenization_spaces": False, "legacy": False, "model_max_length": 32768,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return config


def rewrite_config(path, **changes) -> dict:
    """Edit config.json in place: keys set to a value replace, keys set to None are removed
    (to write the transformers-4 spellings real releases carry)."""
    import json

    file = os.path.join(path, "config.json")
    with open(file, encoding="utf-8") as f:
        config = json.load(f)
    for key, value in changes.items():
        config.pop(key, None) if value is None else config.__setitem__(key, value)
    with open(file, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return config


def write_generation_config(path, **values) -> None:
    import json

    with open(os.path.join(path, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump({**values, "transformers_version": "4.37.0"}, f, indent=2)


def make_qwen2_5_instruct(path, max_position_embeddings: int = 4096) -> str:
    """A tiny Qwen2.5-Instruct-shaped checkpoint with every quirk the real release carries, as
    transformers 4 wrote it: `torch_dtype` bfloat16, top-level `rope_theta` and a legacy
    `rope_scaling` (YaRN, as Qwen's long-context instructions add it), `sliding_window` set
    with `use_sliding_window: false`, tied embeddings (the 0.5B-3B sizes), config.json's
    `eos_token_id` an int while generation_config.json's is a list, generation_config.json
    sampling defaults, and the tokenizer files of write_qwen_tokenizer (plus a
    chat_template.jinja, as a transformers-5 re-save adds)."""
    make_tiny("qwen2", path, dtype="bfloat16", tie_word_embeddings=True,
              max_position_embeddings=max_position_embeddings, sliding_window=max_position_embeddings,
              max_window_layers=2)
    rewrite_config(path, dtype=None, torch_dtype="bfloat16", rope_parameters=None, layer_types=None,
                   rope_theta=1000000.0, bos_token_id=ENDOFTEXT, eos_token_id=IM_END,
                   rope_scaling={"factor": 4.0, "original_max_position_embeddings": max_position_embeddings // 4,
                                 "type": "yarn"},
                   transformers_version="4.43.1")
    write_generation_config(path, bos_token_id=ENDOFTEXT, pad_token_id=ENDOFTEXT, do_sample=True,
                            eos_token_id=[IM_END, ENDOFTEXT], repetition_penalty=1.05, temperature=0.7,
                            top_p=0.8, top_k=20)
    write_qwen_tokenizer(path)
    with open(os.path.join(path, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(QWEN2_5_CHAT_TEMPLATE)
    return str(path)


# ---------------------------------------------------------------------------------------------
# Quantized checkpoints, in each producer's exact on-disk format

QUANT_FORMATS = ("fp8-block", "ct-fp8-channel", "ct-fp8-tensor", "ct-nvfp4", "modelopt-fp8",
                 "modelopt-nvfp4")
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
            "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "mlp.gate.",
            "shared_expert_gate", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
E2M1_BOUNDS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, 0, -.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def _is_linear(name: str) -> bool:
    return (name.endswith(".weight") and ".layers." in name and "visual" not in name
            and any(k in name for k in _LINEARS))


def quantize_tiny(src, dst, fmt: str, keep: tuple[str, ...] = (), block=(32, 32)) -> str:
    """Copy the tiny checkpoint `src` to `dst` with its linear layers' weights in `fmt` (one of
    QUANT_FORMATS); weights whose name contains one of `keep` stay in the source dtype and are
    named in the format's ignore list (mixed checkpoints). Writes `dst`-dequantised too: the
    same checkpoint with every quantized weight replaced by its dequantisation, computed by the
    producer's own decompressor where it runs on the CPU (compressed-tensors), else by a
    transcription of the producer's dequantize (ModelOpt NVFP4QTensor / FP8QTensor,
    transformers' Fp8Dequantize). Returns `dst`."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    state = load_file(os.path.join(src, "model.safetensors"))
    quantized, dequantised = {}, {}
    kept = sorted({n.rsplit(".", 1)[0] for n in state if _is_linear(n) and any(k in n for k in keep)})
    for name, w in state.items():
        if not _is_linear(name) or any(k in name for k in keep):
            quantized[name] = dequantised[name] = w
            continue
        stored, deq = _QUANTIZERS[fmt](w.float(), block)
        quantized.update({name[: -len("weight")] + k: v for k, v in stored.items()})
        dequantised[name] = deq.to(w.dtype)
    for folder, tensors in ((dst, quantized), (f"{dst}-dequantised", dequantised)):
        shutil.copytree(src, folder, dirs_exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(folder, "model.safetensors"),
                  metadata={"format": "pt"})
    config = json.load(open(os.path.join(dst, "config.json")))
    _QUANT_CONFIGS[fmt](config, dst, kept, block)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return str(dst)


def _fp8_block(w, block):
    """transformers fine-grained FP8 (what its FP8Linear holds): e4m3 weight, fp32
    weight_scale_inv = amax / 448 per (br, bc) block (ceil-divided grid); the dequantisation is
    Fp8Dequantize's: weight * scale per block."""
    import torch

    br, bc = block
    rows, cols = w.shape
    sr, sc = -(-rows // br), -(-cols // bc)
    padded = torch.zeros(sr * br, sc * bc)
    padded[:rows, :cols] = w
    blocks = padded.reshape(sr, br, sc, bc)
    scale = blocks.abs().amax(dim=(1, 3)) / 448.0
    scale[scale == 0] = 1.0
    q = (blocks / scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    deq = (q.float() * scale[:, None, :, None]).reshape(sr * br, sc * bc)[:rows, :cols]
    return {"weight": q.reshape(sr * br, sc * bc)[:rows, :cols].contiguous(), "weight_scale_inv": scale}, deq


def _ct_fp8(strategy):
    def quantize(w, block):
        """compressed-tensors' own FloatQuantizationCompressor, scales from its calculate_qparams."""
        from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
        from compressed_tensors.quantization.utils import calculate_qparams

        scheme = _ct_scheme(f"ct-fp8-{strategy}")
        lo, hi = (w.amin(), w.amax()) if strategy == "tensor" else (w.amin(1, keepdim=True), w.amax(1, keepdim=True))
        scale, zp = calculate_qparams(lo.reshape(-1), hi.reshape(-1), scheme.weights)
        scale = scale.reshape(-1, 1) if strategy == "channel" else scale.reshape(1)   # as ct stores them
        state = FloatQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
        state = {k: v for k, v in state.items() if k in ("weight", "weight_scale")}
        if strategy == "tensor":          # the FP8 preset is W8A8 with a static input scale
            import torch
            state["input_scale"] = torch.tensor([0.02])
        deq = FloatQuantizationCompressor.decompress(dict(state), scheme)["weight"]
        return state, deq.float()
    return quantize


def _ct_nvfp4(w, block):
    """compressed-tensors' own NVFP4PackedCompressor; global scale from its generate_gparam,
    per-16 scales from calculate_qparams, rounded to e4m3 first (as stored)."""
    import torch
    from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    scheme = _ct_scheme("ct-nvfp4")
    rows, cols = w.shape
    g = generate_gparam(w.min(), w.max())
    groups = w.reshape(rows, cols // 16, 16)
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights, global_scale=g)
    scale = scale.to(torch.float8_e4m3fn).float()
    state = NVFP4PackedCompressor.compress({"weight": w, "weight_scale": scale, "weight_global_scale": g}, scheme)
    # the compressor's own decompress, in fp32 (its default unpacks to bf16)
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    values = unpack_fp4_from_uint8(state["weight_packed"], rows, cols, dtype=torch.float32)
    deq = dequantize(x_q=values, scale=state["weight_scale"].float(), args=scheme.weights,
                     dtype=torch.float32, global_scale=state["weight_global_scale"])
    return dict(state), deq


def _ct_scheme(fmt):
    from compressed_tensors.quantization import preset_name_to_scheme

    return preset_name_to_scheme({"ct-fp8-channel": "FP8_DYNAMIC", "ct-fp8-tensor": "FP8",
                                  "ct-nvfp4": "NVFP4A16"}[fmt], ["Linear"])


def _modelopt_fp8(w, block):
    """ModelOpt FP8 (FP8QTensor): per-tensor weight_scale = amax / 448, e4m3 weight, a static
    input_scale; dequantised as weight * weight_scale."""
    import torch

    scale = (w.abs().amax() / 448.0).reshape(())
    q = (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale": scale, "input_scale": torch.tensor(0.02)}, q.float() * scale


def _modelopt_nvfp4(w, block):
    """ModelOpt NVFP4 (NVFP4QTensor.quantize, transcribed): weight_scale_2 = amax / (6 * 448),
    weight_scale = block amax / (6 * weight_scale_2) in e4m3 (zeros -> 1), e2m1 codes by
    searchsorted over the bounds with ties at 0.75 / 1.75 / 2.5 rounded up, packed
    (q[1::2] << 4) | q[0::2]; dequantised e2m1 * weight_scale * weight_scale_2."""
    import torch

    rows, cols = w.shape
    scale_2 = w.abs().amax().float() / (6.0 * 448.0)
    groups = w.reshape(rows, cols // 16, 16)
    scale = groups.abs().amax(-1) / (6.0 * scale_2)
    scale[scale == 0] = 1.0
    scale = scale.to(torch.float8_e4m3fn)
    scaled = (groups / (scale.float() * scale_2)[..., None]).reshape(rows, cols)
    bounds = torch.from_numpy(E2M1_BOUNDS)
    sign = (scaled < 0).to(torch.uint8)
    mag = scaled.abs()
    code = torch.searchsorted(bounds, mag, out_int32=True).to(torch.uint8)
    code = code + torch.any(mag.unsqueeze(-1) == bounds[[1, 3, 5]], dim=-1).to(torch.uint8)
    code = (sign << 3) + code
    packed = (code[:, 1::2] << 4) | code[:, 0::2]
    values = torch.from_numpy(E2M1)[code.long()].reshape(rows, cols // 16, 16)
    deq = (values * (scale.float() * scale_2)[..., None]).reshape(rows, cols)
    return {"weight": packed, "weight_scale": scale, "weight_scale_2": scale_2.reshape(()),
            "input_scale": torch.tensor(0.01)}, deq


_QUANTIZERS = {"fp8-block": _fp8_block, "ct-fp8-channel": _ct_fp8("channel"),
               "ct-fp8-tensor": _ct_fp8("tensor"), "ct-nvfp4": _ct_nvfp4,
               "modelopt-fp8": _modelopt_fp8, "modelopt-nvfp4": _modelopt_nvfp4}


def _config_fp8_block(config, dst, kept, block):
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block), "modules_to_not_convert": kept or None}


def _config_ct(fmt):
    def write(config, dst, kept, block):
        from compressed_tensors.quantization import QuantizationConfig

        ct_format = "nvfp4-pack-quantized" if fmt == "ct-nvfp4" else "float-quantized"
        qc = QuantizationConfig(config_groups={"group_0": _ct_scheme(fmt)}, format=ct_format,
                                ignore=["lm_head", *kept], quantization_status="compressed")
        config["quantization_config"] = qc.model_dump(mode="json")
    return write


def _config_modelopt_fp8(config, dst, kept, block):
    config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "FP8",
                                     "ignore": ["lm_head", *kept]}


def _config_modelopt_nvfp4(config, dst, kept, block):
    import json

    with open(os.path.join(dst, "hf_quant_config.json"), "w") as f:
        json.dump({"producer": {"name": "modelopt", "version": "0.37.0"},
                   "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None,
                                    "group_size": 16, "exclude_modules": ["lm_head", *kept]}}, f, indent=2)


_QUANT_CONFIGS = {"fp8-block": _config_fp8_block, "ct-fp8-channel": _config_ct("ct-fp8-channel"),
                  "ct-fp8-tensor": _config_ct("ct-fp8-tensor"), "ct-nvfp4": _config_ct("ct-nvfp4"),
                  "modelopt-fp8": _config_modelopt_fp8, "modelopt-nvfp4": _config_modelopt_nvfp4}


# ---------------------------------------------------------------------------------------------
# Gemma 4 (text), MiniMax M2, Nemotron-H: *ForCausalLM checkpoints (metrale.models.gemma4 /
# minimax_m2 / nemotron_h)

FAMILY_ARCHS = ("gemma4_dense", "gemma4_moe", "minimax_m2", "nemotron_h", "nemotron_h_moe", "mistral_swa",
                "ministral", "ministral3", "mistral3")

_GEMMA4_TEXT = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
    max_position_embeddings=512, rms_norm_eps=1e-6, sliding_window=8,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
    final_logit_softcapping=3.0, tie_word_embeddings=True, pad_token_id=0,
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                     "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                        "rope_theta": 1000000.0}},
)

# Nemotron-H: Mamba-2 heads of 8 in 2 groups with a 16-token SSD chunk (a 70-token prompt spans
# five chunks), attention without rope, relu2 MLPs
_NEMOTRON_H = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=512, layer_norm_epsilon=1e-5,
    mamba_num_heads=8, mamba_head_dim=8, n_groups=2, ssm_state_size=16, conv_kernel=4,
    chunk_size=16, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    layers_block_type=["linear_attention", "mlp", "full_attention", "linear_attention", "mlp",
                       "linear_attention"],
)
_MINISTRAL3_ROPE = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 32.0,
                    "original_max_position_embeddings": 16, "max_position_embeddings": 512,
                    "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                    "llama_4_scaling_beta": 0.1}

_FAMILY_CONFIGS = {
    # per-layer inputs, the last two layers sharing K/V (one sliding, one global) with double-wide MLPs
    "gemma4_dense": dict(_GEMMA4_TEXT, hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
                         num_kv_shared_layers=2, use_double_wide_mlp=True),
    # the MoE block beside the dense MLP; global layers with k == v and their own KV head count
    "gemma4_moe": dict(_GEMMA4_TEXT, hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=5,
                       top_k_experts=2, moe_intermediate_size=32, attention_k_eq_v=True,
                       num_global_key_value_heads=1, tie_word_embeddings=False),
    # Mistral v0.1: every layer over a 16-key sliding window (shorter than the 70-token prompts)
    "mistral_swa": dict(_COMMON, head_dim=24, sliding_window=16,
                        rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
    # Ministral-8B-2410: sliding and full layers interleaved
    "ministral": dict(_COMMON, head_dim=24, sliding_window=16,
                      layer_types=["sliding_attention", "full_attention"] * 2,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    # Ministral 3: YaRN plus Llama-4 attention temperature (original length 16, so positions past
    # 16 are scaled); no sliding window, as the releases
    "ministral3": dict(_COMMON, head_dim=24, sliding_window=None, rope_parameters=_MINISTRAL3_ROPE),
    "minimax_m2": dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       max_position_embeddings=512, rms_norm_eps=1e-6, num_local_experts=6,
                       num_experts_per_tok=2, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                       rope_parameters={"rope_type": "default", "rope_theta": 5e6,
                                        "partial_rotary_factor": 0.5}),
    "nemotron_h": _NEMOTRON_H,
    # MoE blocks (latent experts, a shared expert, scaled sigmoid routing), biases on every
    # projection that can have one, tie_word_embeddings set (HF's NemotronHForCausalLM still
    # keeps its own lm_head), one attention block
    "nemotron_h_moe": dict(_NEMOTRON_H, layers_block_type=["linear_attention", "moe", "full_attention",
                                                           "linear_attention", "moe"],
                           n_routed_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                           moe_shared_expert_intermediate_size=48, moe_latent_size=32,
                           routed_scaling_factor=2.5, norm_topk_prob=True, use_bias=True,
                           mlp_bias=True, tie_word_embeddings=True),
}


def make_tiny_family(arch: str, path, dtype: str = "float32", seed: int = 0, **overrides) -> str:
    """A tiny random Gemma4ForCausalLM / MiniMaxM2ForCausalLM / NemotronHForCausalLM /
    MistralForCausalLM (v0.1 sliding window) / MinistralForCausalLM / Ministral3ForCausalLM
    checkpoint, or a Mistral3ForConditionalGeneration one (a one-layer Pixtral tower beside a
    ministral3 text model; `model_type="mistral"` in overrides for Mistral Small's text model),
    in `path` (FAMILY_ARCHS). Parameters are perturbed as make_tiny does, and so are the buffers
    that change the math (Gemma 4's layer_scalar, MiniMax's e_score_correction_bias), which HF
    inits to constants. Returns `path` as str."""
    import torch
    import transformers as tf

    text = dict(_FAMILY_CONFIGS["ministral3" if arch == "mistral3" else arch], **overrides)
    torch.manual_seed(seed)
    model = _family_model(tf, arch, text)
    _randomise(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(torch.rand(b.shape, generator=gen) + 0.5)
            elif name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.3)
    model = model.to(getattr(torch, dtype)).eval()
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(str(path))
    return str(path)


def _family_model(tf, arch: str, text: dict):
    if arch.startswith("gemma4"):
        return tf.Gemma4ForCausalLM(tf.Gemma4TextConfig(**text))
    if arch.startswith("nemotron_h"):
        return tf.NemotronHForCausalLM(tf.NemotronHConfig(**text))
    if arch == "mistral3":      # the Ministral 3 / Mistral Small 3.x layout: a Pixtral tower beside
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      head_dim=16, patch_size=4, image_size=32)
        text = dict(text, model_type=text.get("model_type", "ministral3"))
        return tf.Mistral3ForConditionalGeneration(tf.Mistral3Config(
            text_config=text, vision_config=vision, tie_word_embeddings=text["tie_word_embeddings"]))
    classes = {"mistral_swa": (tf.MistralConfig, tf.MistralForCausalLM),
               "ministral": (tf.MinistralConfig, tf.MinistralForCausalLM),
               "ministral3": (tf.Ministral3Config, tf.Ministral3ForCausalLM),
               "minimax_m2": (tf.MiniMaxM2Config, tf.MiniMaxM2ForCausalLM)}
    config_cls, model_cls = classes[arch]
    return model_cls(config_cls(**text))


def make_tiny_gemma4_multimodal(path, seed: int = 0, **overrides) -> str:
    """The gemma4_dense checkpoint in the hub's layout: Gemma4ForConditionalGeneration with a
    one-layer vision tower, config.json nesting the text model under `text_config`, tensors
    named `model.language_model.*`. Returns `path` as str."""
    import torch
    import transformers as tf

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16, patch_size=4, position_embedding_size=64)
    config = tf.Gemma4Config(text_config=dict(_FAMILY_CONFIGS["gemma4_dense"], **overrides),
                             vision_config=vision, audio_config=None)
    torch.manual_seed(seed)
    model = tf.Gemma4ForConditionalGeneration(config)
    _randomise(model, seed)
    os.makedirs(path, exist_ok=True)
    model.eval().save_pretrained(str(path))
    return str(path)


# ---------------------------------------------------------------------------------------------
# DeepSeek V3: DeepseekV3ForCausalLM checkpoints (metrale.models.deepseek_v3)

DEEPSEEK_ARCHS = ("deepseek_v3", "deepseek_v3_lite")

_DEEPSEEK_V3 = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
    routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, v_head_dim=16,
    qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=3, first_k_dense_replace=1,
    norm_topk_prob=True, max_position_embeddings=512, rms_norm_eps=1e-6, rope_interleave=True,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    # YaRN with DeepSeek V3's mscale settings (mscale == mscale_all_dim: attention factor 1, the
    # softmax scale times mscale(factor)^2)
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "rope_theta": 10000.0},
)

_DEEPSEEK_CONFIGS = {
    "deepseek_v3": _DEEPSEEK_V3,
    # V2-Lite style: no q LoRA (q_proj), not interleaved, plain rope, softmax routing groups of 1,
    # the shared experts twice as wide, no renormalisation
    "deepseek_v3_lite": dict(_DEEPSEEK_V3, q_lora_rank=None, rope_interleave=False, n_group=1, topk_group=1,
                             n_shared_experts=2, norm_topk_prob=False, routed_scaling_factor=1.0,
                             first_k_dense_replace=2, num_hidden_layers=4,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}


def make_tiny_deepseek(arch: str, path, dtype: str = "float32", seed: int = 0, **overrides) -> str:
    """A tiny random DeepseekV3ForCausalLM checkpoint (DEEPSEEK_ARCHS) in `path`, parameters
    perturbed as make_tiny does and the routers' e_score_correction_bias randomised (HF inits
    it to zeros). Returns `path` as str."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(**dict(_DEEPSEEK_CONFIGS[arch], **overrides)))
    _randomise(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.3)
    model = model.to(getattr(torch, dtype)).eval()
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(str(path))
    return str(path)


def add_deepseek_mtp(path, seed: int = 1) -> str:
    """Add the MTP layer a DeepSeek V3 release ships (HF neither saves nor loads it) to the tiny
    DeepSeek checkpoint at `path`, as the release stores it: decoder layer n = num_hidden_layers
    (`model.layers.{n}.*`: the self_attn / mlp / norm tensors of a random HF layer n) plus
    enorm, hnorm, eh_proj [H, 2H], shared_head.norm, and the release's copies of the embedding
    and lm head (embed_tokens, shared_head.head); num_nextn_predict_layers 1. Returns `path`."""
    import json

    import torch
    import transformers as tf
    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    state = load_file(file)
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    n, hidden = config["num_hidden_layers"], config["hidden_size"]
    bigger_config = tf.DeepseekV3Config.from_pretrained(str(path))
    bigger_config.num_hidden_layers = n + 1
    torch.manual_seed(seed)
    bigger = tf.DeepseekV3ForCausalLM(bigger_config)
    _randomise(bigger, seed)
    dtype = state["lm_head.weight"].dtype
    prefix = f"model.layers.{n}."
    extra = {k: v.detach().to(dtype).clone() for k, v in bigger.state_dict().items() if k.startswith(prefix)}
    gen = torch.Generator().manual_seed(seed + 1)
    if prefix + "mlp.gate.e_score_correction_bias" in extra:
        extra[prefix + "mlp.gate.e_score_correction_bias"] = torch.randn(config["n_routed_experts"], generator=gen) * 0.3
    for name in ("enorm", "hnorm", "shared_head.norm"):
        extra[f"{prefix}{name}.weight"] = (1 + torch.randn(hidden, generator=gen) * 0.1).to(dtype)
    extra[prefix + "eh_proj.weight"] = (torch.randn(hidden, 2 * hidden, generator=gen) / (2 * hidden) ** 0.5).to(dtype)
    extra[prefix + "embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    extra[prefix + "shared_head.head.weight"] = state["lm_head.weight"].clone()
    save_file({**state, **extra}, file, metadata={"format": "pt"})
    rewrite_config(path, num_nextn_predict_layers=1)
    return str(path)
