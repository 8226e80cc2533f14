"""The chat templates of the Gemma 4 and MiniMax M2 formats through `met serve`: for a system +
user + assistant tool call + tool result + user conversation with tools, the prompt chat
completions renders (read back through the public /tokenize and /detokenize, and billed as
usage.prompt_tokens by /v1/chat/completions) equals the format's expected text and HF's
apply_chat_template on the same template. The templates are written here from each release's
template logic (Gemma 4: <|turn> turns, <|tool>declaration blocks in the system turn with
sorted, upper-cased schema fields, <|tool_call>call: / <|tool_response>response: blocks with
<|"|> strings inside the model turn; MiniMax M2: ]~b] role headers, [e~[ ends, a # Tools
system section with <tools> JSON, <minimax:tool_call> XML invokes, tool results grouped in
one tool turn, a generation prompt opening <think>), exercising macros, namespaces, dictsort,
filters and lookups of the call a result answers. Mistral's is in tests/test_mistral.py."""
from __future__ import annotations

import pytest
import requests

from tests.serving import Server
from tests.tiny_models import make_tiny_family, write_qwen_tokenizer

GEMMA4_TEMPLATE = """{%- macro value(v) -%}
    {%- if v is string -%}<|"|>{{ v }}<|"|>
    {%- elif v is mapping -%}{{ '{' }}{%- for k, x in v | dictsort -%}{{ k }}:{{ value(x) }}{{ ',' if not loop.last }}{%- endfor -%}{{ '}' }}
    {%- elif v is iterable -%}[{%- for x in v -%}{{ value(x) }}{{ ',' if not loop.last }}{%- endfor -%}]
    {%- else -%}{{ v | tojson }}
    {%- endif -%}
{%- endmacro -%}
{%- macro schema(s) -%}
    {%- for k, x in s | dictsort -%}
        {%- if k == 'type' -%}type:<|"|>{{ x | upper }}<|"|>
        {%- elif k == 'properties' -%}properties:{{ '{' }}{%- for name, p in x | dictsort -%}{{ name }}:{{ '{' }}{{ schema(p) }}{{ '}' }}{{ ',' if not loop.last }}{%- endfor -%}{{ '}' }}
        {%- else -%}{{ k }}:{{ value(x) }}
        {%- endif -%}{{ ',' if not loop.last }}
    {%- endfor -%}
{%- endmacro -%}
{{- bos_token -}}
{%- set ns = namespace(open=false, calls=[]) -%}
{%- if messages[0].role == 'system' or tools -%}
    {{- '<|turn>system\\n' -}}
    {%- if messages[0].role == 'system' %}{{ messages[0].content | trim }}{% endif -%}
    {%- for t in tools or [] -%}
        {{- '<|tool>declaration:' + t.function.name + '{description:<|"|>' + t.function.description + '<|"|>,parameters:{' -}}
        {{- schema(t.function.parameters) -}}{{- '}}<tool|>' -}}
    {%- endfor -%}
    {{- '<turn|>\\n' -}}
{%- endif -%}
{%- for m in messages -%}
    {%- if m.role == 'system' -%}
    {%- elif m.role == 'tool' -%}
        {%- for id, name in ns.calls if id == m.tool_call_id -%}
            {{- '<|tool_response>response:' + name + '{value:' + value(m.content) + '}<tool_response|>' -}}
        {%- endfor -%}
    {%- else -%}
        {%- set role = 'model' if m.role == 'assistant' else m.role -%}
        {%- if ns.open and role != 'model' %}{{ '<turn|>\\n' }}{% set ns.open = false %}{% endif -%}
        {%- if not ns.open %}{{ '<|turn>' + role + '\\n' }}{% endif -%}
        {{- m.content | trim if m.content is string else '' -}}
        {%- for call in m.tool_calls or [] -%}
            {%- set ns.calls = ns.calls + [[call.id, call.function.name]] -%}
            {{- '<|tool_call>call:' + call.function.name + value(call.function.arguments) + '<tool_call|>' -}}
        {%- endfor -%}
        {%- if m.tool_calls %}{% set ns.open = true %}{% else %}{{ '<turn|>\\n' }}{% set ns.open = false %}{% endif -%}
    {%- endif -%}
{%- endfor -%}
{%- if ns.open %}{{ '<turn|>\\n' }}{% endif -%}
{%- if add_generation_prompt %}{{ '<|turn>model\\n' }}{% endif -%}
"""

MINIMAX_M2_TEMPLATE = """{%- set ns = namespace(last='') -%}
{{- ']~!b[' + ']~b]system\\n' -}}
{{- messages[0].content if messages[0].role == 'system' else 'You are a helpful assistant.' -}}
{%- if tools -%}
    {{- '\\n\\n# Tools\\nYou may call one or more tools to assist with the user query.\\nHere are the tools available in JSONSchema format:\\n\\n<tools>\\n' -}}
    {%- for t in tools %}{{ '<tool>' + t.function | tojson + '</tool>\\n' }}{% endfor -%}
    {{- '</tools>\\n\\nWhen making tool calls, use XML format to invoke tools and pass parameters:\\n\\n<minimax:tool_call>\\n<invoke name="tool-name-1">\\n<parameter name="param-key-1">param-value-1</parameter>\\n</invoke>\\n</minimax:tool_call>' -}}
{%- endif -%}
{{- '[e~[\\n' -}}
{%- for m in messages -%}
    {%- if m.role == 'system' -%}
    {%- elif m.role == 'tool' -%}
        {%- if ns.last != 'tool' %}{{ ']~b]tool' }}{% endif -%}
        {{- '\\n<response>' + m.content + '</response>' -}}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '[e~[\\n' }}{% endif -%}
    {%- elif m.role == 'assistant' -%}
        {{- ']~b]ai\\n' + (m.content or '') -}}
        {%- if m.tool_calls -%}
            {{- '\\n<minimax:tool_call>\\n' -}}
            {%- for call in m.tool_calls -%}
                {{- '<invoke name="' + call.function.name + '">\\n' -}}
                {%- for k, v in call.function.arguments.items() -%}
                    {{- '<parameter name="' + k + '">' + (v if v is string else v | tojson) + '</parameter>\\n' -}}
                {%- endfor -%}
                {{- '</invoke>\\n' -}}
            {%- endfor -%}
            {{- '</minimax:tool_call>' -}}
        {%- endif -%}
        {{- '[e~[\\n' -}}
    {%- else -%}
        {{- ']~b]' + m.role + '\\n' + m.content + '[e~[\\n' -}}
    {%- endif -%}
    {%- set ns.last = m.role -%}
{%- endfor -%}
{%- if add_generation_prompt %}{{ ']~b]ai\\n<think>\\n' }}{% endif -%}
"""

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "current weather",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "city name"}, "days": {"type": "integer"}}}}}]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"days": 2, "city": "Paris, FR"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"},
    {"role": "user", "content": "And in Lyon?"},
]
EXPECTED = {
    "gemma4_moe": (
        '<|turn>system\nBe brief.'
        '<|tool>declaration:get_weather{description:<|"|>current weather<|"|>,parameters:{'
        'properties:{city:{description:<|"|>city name<|"|>,type:<|"|>STRING<|"|>},days:{type:<|"|>INTEGER<|"|>}},'
        'required:[<|"|>city<|"|>],type:<|"|>OBJECT<|"|>}}<tool|><turn|>\n'
        '<|turn>user\nWeather in Paris?<turn|>\n'
        '<|turn>model\n<|tool_call>call:get_weather{city:<|"|>Paris, FR<|"|>,days:2}<tool_call|>'
        '<|tool_response>response:get_weather{value:<|"|>18C, sunny<|"|>}<tool_response|><turn|>\n'
        '<|turn>user\nAnd in Lyon?<turn|>\n'
        '<|turn>model\n'),
    "minimax_m2": (
        ']~!b[]~b]system\nBe brief.\n\n# Tools\nYou may call one or more tools to assist with the user '
        'query.\nHere are the tools available in JSONSchema format:\n\n<tools>\n'
        '<tool>{"name": "get_weather", "description": "current weather", "parameters": {"type": "object", '
        '"required": ["city"], "properties": {"city": {"type": "string", "description": "city name"}, '
        '"days": {"type": "integer"}}}}</tool>\n</tools>\n\n'
        'When making tool calls, use XML format to invoke tools and pass parameters:\n\n<minimax:tool_call>\n'
        '<invoke name="tool-name-1">\n<parameter name="param-key-1">param-value-1</parameter>\n</invoke>\n'
        '</minimax:tool_call>[e~[\n'
        ']~b]user\nWeather in Paris?[e~[\n'
        ']~b]ai\n\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="days">2</parameter>\n'
        '<parameter name="city">Paris, FR</parameter>\n</invoke>\n</minimax:tool_call>[e~[\n'
        ']~b]tool\n<response>18C, sunny</response>[e~[\n'
        ']~b]user\nAnd in Lyon?[e~[\n'
        ']~b]ai\n<think>\n'),
}
TEMPLATES = {"gemma4_moe": GEMMA4_TEMPLATE, "minimax_m2": MINIMAX_M2_TEMPLATE}


def _as_hf_sees_it():
    import copy
    import json

    messages = copy.deepcopy(CONVERSATION)
    messages[2]["content"] = ""
    call = messages[2]["tool_calls"][0]["function"]
    call["arguments"] = json.loads(call["arguments"])
    return messages


@pytest.mark.parametrize("arch", sorted(TEMPLATES))
def test_the_rendered_prompt_through_met_serve(arch, tmp_path):
    import transformers as tf

    path = make_tiny_family(arch, tmp_path / "model", max_position_embeddings=4096)
    write_qwen_tokenizer(path, chat_template=TEMPLATES[arch])
    hf = tf.AutoTokenizer.from_pretrained(path)
    assert hf.apply_chat_template(_as_hf_sees_it(), tools=TOOLS, tokenize=False,
                                  add_generation_prompt=True) == EXPECTED[arch]
    args = ["serve", path, "--model-name", "m", "--frontends", "1", "--max-seq-len", "1024", "--no-event-log"]
    with Server(args, tmp_path / "serve.log").serving() as srv:
        ids = requests.post(srv.url + "/tokenize", json={"messages": CONVERSATION, "tools": TOOLS}).json()["tokens"]
        assert requests.post(srv.url + "/detokenize", json={"tokens": ids}).json()["prompt"] == EXPECTED[arch]
        chat = requests.post(srv.url + "/v1/chat/completions", json={
            "model": "m", "messages": CONVERSATION, "tools": TOOLS, "max_tokens": 1}).json()
        assert chat["usage"]["prompt_tokens"] == len(ids)
