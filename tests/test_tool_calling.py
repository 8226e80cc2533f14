"""Tool calling and reasoning end to end through the official `openai` SDK, against live
`met serve` processes of the scripted test model (tests.scripted_model), one with
--tool-call-parser hermes and one with qwen3_coder. Streamed and non-streamed answers must
agree exactly; tool syntax never reaches `content`; thinking never reaches the answer.
Plus unit checks of the tool_choice prefills for every parser and of the engine-side
thinking-budget rule."""
from __future__ import annotations

import json

import openai
import pytest

from frontends.generate import TOOL_PREFILLS, tool_prefill
from metrale.api.tool_parsers import PARSERS, parse_complete
from metrale.sampling import SamplingParams
from tests.scripted_model import SERVE_ENV, make_scripted_model
from metrale.thinking_budget import next_forced_id
from tests.serving import Server

MODEL = "scripted"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object",
                                       "properties": {"zone": {"type": "string"}}}}}
TOOLS = [WEATHER, TIME]


def _hermes(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


SCRIPTS = [
    {"when": "weather in Paris", "reply": _hermes("get_weather", '{"city": "Paris", "days": 3}')},
    {"when": "two cities", "reply": "Checking both.\n\n"
     + _hermes("get_weather", '{"city": "Paris"}') + "\n"
     + _hermes("get_weather", '{"city": "Tokyo"}')},
    {"when": "what time", "reply": _hermes("get_time", '{"zone": "UTC"}')},
    {"when": "ponder first", "reply": "<think>\nI could write "
     + _hermes("get_weather", '{"city": "Rome"}') + " but no.\n</think>\n\nIt is sunny."},
    {"when": "think then call", "reply": "<think>\nI should call the tool.\n</think>\n\n"
     + _hermes("get_weather", '{"city": "Oslo"}')},
    {"when": "broken call", "reply": "<tool_call>\nthis is not json\n</tool_call>"},
    {"when": "rocket call", "reply": _hermes("launch_rockets", '{"n": 3}')},
    {"when": "say hi", "reply": "Hello there!"},
    {"when": "tell a story", "reply": "Once upon a time there was a parser. THE END. More."},
    {"when": "think long", "reply": "<think>\n" + "hmm " * 30 + "\n</think>\n\nDone."},
    {"when": "xml weather", "reply": "<tool_call>\n<function=get_weather>\n<parameter=city>\n"
     "Paris\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"},
]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("tools")
    path = make_scripted_model(root / "model", SCRIPTS)
    common = ["serve", path, "--model-name", MODEL, "--frontends", "1", "--max-seq-len", "2048",
              "--no-event-log"]
    started = {name: Server(common + ["--tool-call-parser", name], root / f"{name}.log",
                           env=SERVE_ENV)
               for name in ("hermes", "qwen3_coder")}
    try:
        for srv in started.values():
            srv.wait_healthy(180)
        yield started
    finally:
        for srv in started.values():
            srv.stop()


@pytest.fixture(scope="module")
def client(servers):
    return openai.OpenAI(base_url=servers["hermes"].url + "/v1", api_key="x", max_retries=0,
                         timeout=120)


def _both(client, **kw):
    """(non-streamed message, finish_reason), (streamed pieces) for one request."""
    kw = {"model": MODEL, "temperature": 0, "max_tokens": 300, **kw}
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    return full.choices[0], chunks


def _streamed(chunks):
    content, reasoning, calls, finish = "", "", {}, None
    for c in chunks:
        if not c.choices:
            continue
        ch = c.choices[0]
        d = ch.delta
        content += d.content or ""
        reasoning += (d.model_extra or {}).get("reasoning_content") or ""
        for tc in d.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id:
                entry["id"], entry["name"] = tc.id, tc.function.name
            entry["arguments"] += tc.function.arguments or ""
        finish = ch.finish_reason or finish
    return content, reasoning, [calls[i] for i in sorted(calls)], finish


def _user(text):
    return [{"role": "user", "content": text}]


def _check_same(choice, chunks):
    content, reasoning, calls, finish = _streamed(chunks)
    msg = choice.message
    assert content == (msg.content or "")
    assert reasoning == ((msg.model_extra or {}).get("reasoning_content") or "")
    assert [(c["name"], c["arguments"]) for c in calls] == \
        [(c.function.name, c.function.arguments) for c in msg.tool_calls or []]
    assert finish == choice.finish_reason
    for c in calls:
        assert isinstance(json.loads(c["arguments"]), dict)
        assert c["id"].startswith("call_")
    return msg


def test_hermes_call_streamed_equals_non_streamed(client):
    choice, chunks = _both(client, messages=_user("weather in Paris?"), tools=TOOLS)
    msg = _check_same(choice, chunks)
    assert choice.finish_reason == "tool_calls"
    assert msg.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == \
        [("get_weather", {"city": "Paris", "days": 3})]


def test_parallel_calls_and_parallel_off(client):
    choice, chunks = _both(client, messages=_user("two cities"), tools=TOOLS)
    msg = _check_same(choice, chunks)
    assert msg.content == "Checking both."
    assert [json.loads(c.function.arguments)["city"] for c in msg.tool_calls] == ["Paris", "Tokyo"]
    assert len({c.id for c in msg.tool_calls}) == 2
    choice, chunks = _both(client, messages=_user("two cities"), tools=TOOLS,
                           parallel_tool_calls=False)
    msg = _check_same(choice, chunks)
    assert [json.loads(c.function.arguments)["city"] for c in msg.tool_calls] == ["Paris"]
    assert "tool_call" not in (msg.content or "")


def test_tool_syntax_inside_thinking_is_not_a_call(client):
    choice, chunks = _both(client, messages=_user("ponder first"), tools=TOOLS)
    msg = _check_same(choice, chunks)
    assert choice.finish_reason == "stop" and not msg.tool_calls
    assert msg.content == "It is sunny."
    assert "<tool_call>" in msg.model_extra["reasoning_content"]


def test_reasoning_then_call(client):
    choice, chunks = _both(client, messages=_user("think then call"), tools=TOOLS)
    msg = _check_same(choice, chunks)
    assert msg.model_extra["reasoning_content"] == "I should call the tool."
    assert choice.finish_reason == "tool_calls" and msg.tool_calls[0].function.name == "get_weather"


def test_malformed_and_undeclared_calls_are_text_with_stop(client):
    for prompt in ("broken call", "rocket call"):
        choice, chunks = _both(client, messages=_user(prompt), tools=TOOLS)
        msg = _check_same(choice, chunks)
        assert choice.finish_reason == "stop" and not msg.tool_calls
        assert "<tool_call>" in msg.content


def test_tool_choice_none_required_and_named(client):
    choice, chunks = _both(client, messages=_user("weather in Paris?"), tools=TOOLS,
                           tool_choice="none")
    msg = _check_same(choice, chunks)
    assert not msg.tool_calls and choice.finish_reason == "stop"
    # required: the prefill `<tool_call>\n` is part of the prompt, parsed with the output
    choice, chunks = _both(client, messages=_user("weather in Paris?"), tools=TOOLS,
                           tool_choice="required")
    msg = _check_same(choice, chunks)
    assert choice.finish_reason == "tool_calls" and msg.tool_calls[0].function.name == "get_weather"
    named = {"type": "function", "function": {"name": "get_time"}}
    choice, chunks = _both(client, messages=_user("what time is it"), tools=TOOLS,
                           tool_choice=named)
    msg = _check_same(choice, chunks)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == \
        [("get_time", {"zone": "UTC"})]


def test_qwen3_coder_format(servers):
    client = openai.OpenAI(base_url=servers["qwen3_coder"].url + "/v1", api_key="x",
                           max_retries=0, timeout=120)
    choice, chunks = _both(client, messages=_user("xml weather"), tools=TOOLS)
    msg = _check_same(choice, chunks)
    assert choice.finish_reason == "tool_calls" and msg.content is None
    assert json.loads(msg.tool_calls[0].function.arguments) == {"city": "Paris", "days": 3}


def test_stop_sequences_and_max_tokens_cut(client):
    choice, chunks = _both(client, messages=_user("tell a story"), stop=["THE END"])
    _check_same(choice, chunks)
    assert choice.message.content == "Once upon a time there was a parser. "
    assert choice.finish_reason == "stop"
    choice, chunks = _both(client, messages=_user("weather in Paris?"), tools=TOOLS,
                           max_tokens=10)
    msg = _check_same(choice, chunks)
    assert choice.finish_reason == "length"


def test_thinking_budget_forces_the_close_tag(client):
    choice, chunks = _both(client, messages=_user("think long"),
                           extra_body={"max_thinking_tokens": 8})
    msg = _check_same(choice, chunks)
    assert msg.content == "Done."
    assert msg.model_extra["reasoning_content"] == "hmm hmm"   # 8 tokens: "hmm hmm " (bytes)
    choice, _ = _both(client, messages=_user("think long"))
    assert choice.message.model_extra["reasoning_content"].count("hmm") == 30


def test_request_errors(client):
    bad = [
        dict(tools=[{"type": "function", "function": {"name": "has space"}}]),
        dict(tools=[{"type": "function", "function": {"name": "f", "parameters": []}}]),
        dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
        dict(tool_choice="required"),
        dict(messages=[{"role": "user", "content": "hi"},
                       {"role": "assistant", "content": None, "tool_calls": [
                           {"id": "call_1", "type": "function",
                            "function": {"name": "get_weather", "arguments": "{not json"}}]}]),
    ]
    for kw in bad:
        kw.setdefault("messages", _user("say hi"))
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, max_tokens=5, **kw)
        assert e.value.body["message"]


def test_tool_max_tokens_and_replayed_calls(client):
    history = [{"role": "user", "content": "weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "21C"},
               {"role": "user", "content": "say hi"}]
    out = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS,
                                         temperature=0, max_tokens=50)
    assert out.choices[0].message.content == "Hello there!"


# ---- unit level -----------------------------------------------------------------------------

_CONTINUATIONS = {
    "hermes": ('{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>',
               '{"zone": "UTC"}}\n</tool_call>'),
    "qwen3_coder": ("<function=get_time>\n<parameter=zone>\nUTC\n</parameter>\n</function>\n"
                    "</tool_call>", "<parameter=zone>\nUTC\n</parameter>\n</function>\n"
                    "</tool_call>"),
    "mistral": ('[{"name": "get_time", "arguments": {"zone": "UTC"}}]', '{"zone": "UTC"}}]'),
    "minimax_xml": ('<invoke name="get_time">\n<parameter name="zone">UTC</parameter>\n'
                    "</invoke>\n</minimax:tool_call>",
                    '<parameter name="zone">UTC</parameter>\n</invoke>\n</minimax:tool_call>'),
    "bare_json": ('get_time", "arguments": {"zone": "UTC"}}', '{"zone": "UTC"}}'),
    "gemma4": ('get_time{zone:<|"|>UTC<|"|>}<tool_call|>', 'zone:<|"|>UTC<|"|>}<tool_call|>'),
}
_CONTINUATIONS["deepseek_v3"] = (
    'get_time\n```json\n{"zone": "UTC"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    '{"zone": "UTC"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
_CONTINUATIONS["poolside_v1"] = _CONTINUATIONS["hermes"]
_CONTINUATIONS["qwen3_xml"] = _CONTINUATIONS["qwen3_coder"]


@pytest.mark.parametrize("parser", sorted(PARSERS))
def test_every_parser_reads_its_forced_prefills(parser):
    assert parser in TOOL_PREFILLS
    any_call, named = _CONTINUATIONS[parser]
    for prefill, rest in ((tool_prefill(parser, None), any_call),
                          (tool_prefill(parser, "get_time"), named)):
        content, calls = parse_complete(parser, TOOLS, prefill + rest)
        assert content == "" and [(c.name, json.loads(c.arguments_json)) for c in calls] == \
            [("get_time", {"zone": "UTC"})], (parser, prefill + rest)


def test_thinking_budget_rule():
    p = SamplingParams(thinking_budget=2, think_start_id=1, think_end_id=2,
                       forced_close_ids=[9, 2, 9], starts_in_thinking=False)
    assert next_forced_id(p, [5, 5, 5]) is None              # not thinking yet
    assert next_forced_id(p, [1, 5]) is None                 # under budget
    assert next_forced_id(p, [1, 5, 5]) == 9
    assert next_forced_id(p, [1, 5, 5, 9]) == 2
    assert next_forced_id(p, [1, 5, 5, 9, 2]) == 9
    assert next_forced_id(p, [1, 5, 5, 9, 2, 9]) is None     # forced sequence done
    assert next_forced_id(p, [1, 2, 5, 5]) is None           # the model closed it itself
    p.starts_in_thinking = True
    assert next_forced_id(p, [5, 5]) == 9
