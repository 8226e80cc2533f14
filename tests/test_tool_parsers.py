"""Tool-call parsers: wire formats, repairs, validation, and the streaming invariants.

The invariants are checked over arbitrary chunkings of each output (hypothesis), including
splits inside tags and inside multi-byte characters (by splitting the UTF-8 bytes and decoding
incrementally, as the detokenizer does).
"""

import codecs
import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metrale.api.tool_parsers import (
    PARSERS,
    TextDelta,
    ToolArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    collect,
    default_tool_parser,
    make_tool_parser,
    new_tool_call_id,
    parse_complete,
    validate_replayed_tool_call,
    validate_tool_choice,
    validate_tools,
)


def _tool(name, properties):
    return {
        "type": "function",
        "function": {"name": name, "parameters": {"type": "object", "properties": properties}},
    }


TOOLS = [
    _tool(
        "get_weather",
        {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "metric": {"type": "boolean"},
            "ratio": {"type": "number"},
            "opts": {"type": "object"},
            "tags": {"type": "array"},
            "when": {"type": ["string", "null"]},
        },
    ),
    _tool("write_file", {"path": {"type": "string"}, "content": {"type": "string"}}),
    _tool("ping", {}),
]


def fixed_ids():
    counter = iter(range(1000))
    return lambda: f"call_{next(counter)}"


def run_chunks(name, chunks):
    parser = make_tool_parser(name, TOOLS, fixed_ids())
    events = []
    for chunk in chunks:
        events += parser.feed(chunk)
    events += parser.finish()
    return parser, events


def byte_chunks(text, cuts):
    """Split the UTF-8 bytes at `cuts` and decode incrementally (like the detokenizer)."""
    data = text.encode()
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    decoder = codecs.getincrementaldecoder("utf-8")()
    return [decoder.decode(data[a:b]) for a, b in zip(points, points[1:])]


def assert_well_formed(events):
    """Calls never interleave, start before args, end after; args of each call form one object."""
    open_index = None
    for event in events:
        if isinstance(event, ToolCallStart):
            assert open_index is None
            open_index = event.index
        elif isinstance(event, ToolArgsDelta):
            assert event.index == open_index
        elif isinstance(event, ToolCallEnd):
            assert event.index == open_index
            open_index = None
        else:
            assert isinstance(event, TextDelta) and event.text
    assert open_index is None
    _, calls = collect(events)
    assert [c.id for c in calls] == [f"call_{i}" for i in range(len(calls))]
    for call in calls:
        assert isinstance(json.loads(call.arguments_json), dict)


def assert_chunking_invariant(name, text, chunks):
    whole_parser = make_tool_parser(name, TOOLS, fixed_ids())
    content, calls = whole_parser.parse_complete(text)
    parser, events = run_chunks(name, chunks)
    assert_well_formed(events)
    assert collect(events) == (content, calls)
    assert parser.malformed == whole_parser.malformed


# Each format: well-formed outputs, then outputs needing repair or rejection.
CASES = {
    "hermes": [
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich 🌧"}}\n</tool_call>',
        '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": "{\\"days\\": 2}"}\n</tool_call>',
        '<tool_call>{"name": "get_weather", "arguments": {"city": "a", "days": 3,}}</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"',
        "<tool_call>{'name': 'ping', 'arguments': {'x': 'y'}}</tool_call>",
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call> after',
        "a < b and <tool is fine, <tool_call> never closes",
        "2 <tool",
    ],
    "qwen3_coder": [
        "I'll write it.\n<tool_call>\n<function=write_file>\n<parameter=path>\n/tmp/a.py\n</parameter>\n<parameter=content>\ndef f():\n    return \"</param\" + '<'\n\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\n東京\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n<parameter=opts>\n{\"a\": [1, 2]}\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n<parameter=when>\nnull\n</parameter>\n<parameter=extra>\n7\n</parameter>\n</function>\n</tool_call>",
        "<function=ping>\n</function>\n<tool_call>\n<function=ping>\n</function>\n</tool_call>",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
        "<tool_call>\n<function=write_file>\n<parameter=content>\nhalf a fi",
        "<tool_call>\n<function=nope>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\nnot a call\n</tool_call> bye",
    ],
    "minimax_xml": [
        '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Lima</parameter>\n<parameter name="days">4</parameter>\n</invoke>\n<invoke name="ping">\n</invoke>\n</minimax:tool_call>',
        'Hi <minimax:tool_call>\n<invoke name="ping">\n</invoke>\n<invoke name="nope">\n</invoke>\n</minimax:tool_call>',
        '<minimax:tool_call><invoke name="write_file"><parameter name="content">x',
    ],
    "mistral": [
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Nice"}}, {"name": "ping", "arguments": {}}]',
        'Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Lyon", "days": 2}[TOOL_CALLS]ping[ARGS]{}',
        '[TOOL_CALLS]ping[CALL_ID]a1b2c3d4e[ARGS]{"x": "]}"}',
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Nice"}',
        "[TOOL_CALLS] oops, nothing here",
        '[TOOL_CALLS][{"name": "nope", "arguments": {}}]',
    ],
    "gemma4": [
        '<|tool_call>call:get_weather{city:<|"|>Paris, {FR}<|"|>,days:3,metric:true,opts:{a:[1,<|"|>b<|"|>]}}<tool_call|>',
        'Checking <|tool_call>call:ping{}<tool_call|><|tool_call>call:write_file{path:<|"|>/x<|"|>,}<tool_call|> done',
        "<start_function_call>call:get_weather{city:<escape>Bonn<escape>}<end_function_call>",
        '<|tool_call>call:get_weather{city:<|"|>Oslo<|"|>',
        "<|tool_call>not a call<tool_call|>",
    ],
    "bare_json": [
        '{"name": "get_weather", "arguments": {"city": "Kyiv"}}',
        '  ```json\n[{"name": "ping", "parameters": {}}, {"name": "get_weather", "arguments": {}}]\n```',
        '<|python_tag|>{"name": "ping", "parameters": {}}',
        '{"answer": 42}',
        "Plain answer with {braces} later.",
        '{"name": "nope", "arguments": {}}',
        "```python\nprint(1)\n```",
    ],
    "poolside_v1": [
        'Ok.\n<tool_call>{"name": "ping", "arguments": {}}</tool_call>',
    ],
    "deepseek_v3": [
        'Let me check.\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "Oslo", "days": 2}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>ping\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Rome"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>write_file\n```json\n{"path": "/x"',
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>nope<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "<｜tool▁calls▁begin｜>not a call<｜tool▁calls▁end｜> bye",
    ],
}
CASES["qwen3_xml"] = CASES["qwen3_coder"]
ALL_CASES = [(name, text) for name, texts in CASES.items() for text in texts]


def test_every_registered_parser_has_cases():
    assert set(CASES) == set(PARSERS)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=st.sampled_from(ALL_CASES), cuts=st.lists(st.integers(0, 400), max_size=12))
def test_any_chunking_gives_the_non_streamed_result(case, cuts):
    name, text = case
    assert_chunking_invariant(name, text, byte_chunks(text, cuts))


@pytest.mark.parametrize("name,text", ALL_CASES)
def test_one_character_at_a_time_gives_the_non_streamed_result(name, text):
    assert_chunking_invariant(name, text, list(text))


FUZZ_PIECES = {
    "hermes": ["<tool_call>", "</tool_call>", "<tool", '{"name": "ping"', '"arguments": ', "{", "}", "[", ",", '"', "\n", " ", "x", "é"],
    "qwen3_coder": ["<tool_call>", "</tool_call>", "<function=", "ping", "get_weather", ">", "</function>", "<parameter=", "days", "city", "</parameter>", "\n", "3", "<", "x", '"'],
    "minimax_xml": ["<minimax:tool_call>", "</minimax:tool_call>", '<invoke name="ping">', '<invoke name="', "ping", '">', "</invoke>", '<parameter name="', "city", "</parameter>", "\n", "<"],
    "mistral": ["[TOOL_CALLS]", "ping", "[ARGS]", "[CALL_ID]", "[", "]", "{", "}", '{"name": "ping", "arguments": {}}', ",", '"', " ", "x"],
    "gemma4": ["<|tool_call>", "<tool_call|>", "call:ping{}", "call:", "ping", "get_weather", "{", "}", "days:", "3", '<|"|>', ",", "[", "]", "x"],
    "bare_json": ['{"name": "ping", "arguments": {}}', "{", "}", "[", "]", '"name": ', '"ping"', ", ", '"arguments": {}', "```json\n", "```", " ", "x"],
    "deepseek_v3": ["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "function", "ping", "\n", "```json\n", "```", "{}", '{"city": "x"}', "<｜", " "],
}


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzzed_outputs_never_break_the_invariants(data):
    name = data.draw(st.sampled_from(sorted(FUZZ_PIECES)))
    text = "".join(data.draw(st.lists(st.sampled_from(FUZZ_PIECES[name]), max_size=25)))
    cuts = data.draw(st.lists(st.integers(0, len(text.encode())), max_size=10))
    assert_chunking_invariant(name, text, byte_chunks(text, cuts))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_corrupted_real_outputs_never_break_the_invariants(data):
    """Delete or repeat one slice of a real output (truncation, a lost or doubled tag)."""
    name, text = data.draw(st.sampled_from(ALL_CASES))
    a = data.draw(st.integers(0, len(text)))
    b = data.draw(st.integers(a, len(text)))
    text = text[:a] + (text[a:b] * 2 if data.draw(st.booleans()) else "") + text[b:]
    cuts = data.draw(st.lists(st.integers(0, len(text.encode())), max_size=10))
    assert_chunking_invariant(name, text, byte_chunks(text, cuts))


def parse(name, text):
    parser = make_tool_parser(name, TOOLS, fixed_ids())
    content, calls = parser.parse_complete(text)
    return content, [(c.name, json.loads(c.arguments_json)) for c in calls], parser.malformed


def test_hermes_reads_calls_and_keeps_surrounding_text():
    content, calls, malformed = parse("hermes", CASES["hermes"][0])
    assert content == "Let me check."
    assert calls == [("get_weather", {"city": "Zürich 🌧"})]
    assert not malformed


def test_hermes_repairs_trailing_comma_missing_brace_and_single_quotes():
    assert parse("hermes", CASES["hermes"][2])[1] == [("get_weather", {"city": "a", "days": 3})]
    assert parse("hermes", CASES["hermes"][3])[1] == [("get_weather", {"city": "Oslo"})]
    assert parse("hermes", CASES["hermes"][4])[1] == [("get_weather", {"city": "Oslo"})]
    assert parse("hermes", CASES["hermes"][5])[1] == [("ping", {"x": "y"})]


def test_a_truncated_string_value_is_not_invented():
    text = '<tool_call>{"name": "write_file", "arguments": {"content": "hal'
    assert parse("hermes", text) == (text, [], True)


def test_unknown_tool_is_content_and_flags_malformed():
    text = CASES["hermes"][6]
    assert parse("hermes", text) == (text, [], True)


def test_partial_tag_is_held_back_then_released_at_finish():
    parser = make_tool_parser("hermes", TOOLS, fixed_ids())
    assert collect(parser.feed("2 <tool"))[0] == "2"
    assert collect(parser.feed("_ca"))[0] == ""
    assert collect(parser.finish())[0] == " <tool_ca"
    assert not parser.malformed


def test_unclosed_block_is_released_as_content_with_malformed():
    text = CASES["hermes"][7]
    assert parse("hermes", text) == (text, [], True)


def test_qwen3_xml_converts_values_by_schema():
    _, calls, malformed = parse("qwen3_coder", CASES["qwen3_coder"][1])
    assert calls == [(
        "get_weather",
        {"city": "東京", "days": 3, "metric": True, "opts": {"a": [1, 2]}, "ratio": 0.5, "when": None, "extra": "7"},
    )]
    assert not malformed


def test_qwen3_xml_keeps_code_verbatim_and_strips_only_template_padding():
    content, calls, _ = parse("qwen3_coder", CASES["qwen3_coder"][0])
    assert content == "I'll write it."
    assert calls == [("write_file", {"path": "/tmp/a.py", "content": "def f():\n    return \"</param\" + '<'\n"})]


def test_qwen3_xml_streams_text_arguments_progressively():
    parser = make_tool_parser("qwen3_coder", TOOLS, fixed_ids())
    events = parser.feed("<tool_call>\n<function=write_file>\n<parameter=content>\nline one\nline")
    assert events[0] == ToolCallStart(0, "call_0", "write_file")
    assert "".join(e.json_fragment for e in events[1:]) == '{"content": "line one\\nline'
    events += parser.feed(" two\n</parameter>\n</function>\n</tool_call>") + parser.finish()
    assert collect(events)[1][0].arguments_json == '{"content": "line one\\nline two"}'


def test_qwen3_xml_accepts_bare_functions_and_json_bodies():
    assert parse("qwen3_coder", CASES["qwen3_coder"][2])[1] == [("ping", {}), ("ping", {})]
    assert parse("qwen3_xml", CASES["qwen3_coder"][3])[1] == [("get_weather", {"city": "Rome"})]


def test_qwen3_xml_call_cut_by_end_of_stream_is_closed():
    assert parse("qwen3_coder", CASES["qwen3_coder"][4]) == ("", [("write_file", {"content": "half a fi"})], False)


@pytest.mark.parametrize("text", CASES["qwen3_coder"][5:])
def test_qwen3_xml_unreadable_block_is_content(text):
    assert parse("qwen3_coder", text) == (text, [], True)


def test_minimax_reads_several_invokes_per_block():
    _, calls, malformed = parse("minimax_xml", CASES["minimax_xml"][0])
    assert calls == [("get_weather", {"city": "Lima", "days": 4}), ("ping", {})]
    assert not malformed


def test_minimax_undeclared_invoke_after_good_one_is_content():
    content, calls, malformed = parse("minimax_xml", CASES["minimax_xml"][1])
    assert (content, calls, malformed) == ('Hi<invoke name="nope">\n</invoke>', [("ping", {})], True)


def test_mistral_list_and_named_forms():
    assert parse("mistral", CASES["mistral"][0])[1] == [("get_weather", {"city": "Nice"}), ("ping", {})]
    content, calls, _ = parse("mistral", CASES["mistral"][1])
    assert content == "Sure."
    assert calls == [("get_weather", {"city": "Lyon", "days": 2}), ("ping", {})]
    assert parse("mistral", CASES["mistral"][2])[1] == [("ping", {"x": "]}"})]
    assert parse("mistral", CASES["mistral"][3])[1] == [("get_weather", {"city": "Nice"})]


@pytest.mark.parametrize("text", CASES["mistral"][4:])
def test_mistral_unreadable_is_content(text):
    assert parse("mistral", text) == (text, [], True)


def test_gemma4_grammar():
    assert parse("gemma4", CASES["gemma4"][0])[1] == [(
        "get_weather", {"city": "Paris, {FR}", "days": 3, "metric": True, "opts": {"a": [1, "b"]}},
    )]
    content, calls, _ = parse("gemma4", CASES["gemma4"][1])
    assert content == "Checkingdone"
    assert calls == [("ping", {}), ("write_file", {"path": "/x"})]
    assert parse("gemma4", CASES["gemma4"][2])[1] == [("get_weather", {"city": "Bonn"})]
    assert parse("gemma4", CASES["gemma4"][3])[1] == [("get_weather", {"city": "Oslo"})]
    assert parse("gemma4", CASES["gemma4"][4]) == (CASES["gemma4"][4], [], True)


def test_bare_json_whole_output_is_the_call():
    assert parse("bare_json", CASES["bare_json"][0])[1] == [("get_weather", {"city": "Kyiv"})]
    assert parse("bare_json", CASES["bare_json"][1])[1] == [("ping", {}), ("get_weather", {})]
    assert parse("bare_json", CASES["bare_json"][2])[1] == [("ping", {})]


@pytest.mark.parametrize("text,malformed", [(CASES["bare_json"][3], False), (CASES["bare_json"][4], False), (CASES["bare_json"][5], True), (CASES["bare_json"][6], False)])
def test_bare_json_non_calls_are_content(text, malformed):
    assert parse("bare_json", text) == (text, [], malformed)


def test_deepseek_v3_reads_both_generations_of_its_format():
    content, calls, malformed = parse("deepseek_v3", CASES["deepseek_v3"][0])
    assert (content, calls, malformed) == ("Let me check.", [("get_weather", {"city": "Oslo", "days": 2}), ("ping", {})], False)
    assert parse("deepseek_v3", CASES["deepseek_v3"][1]) == ("", [("get_weather", {"city": "Rome"})], False)
    assert parse("deepseek_v3", CASES["deepseek_v3"][2])[1] == [("write_file", {"path": "/x"})]   # cut: repaired
    for text in CASES["deepseek_v3"][3:]:
        content, calls, malformed = parse("deepseek_v3", text)
        assert (content, calls, malformed) == (text, [], True)


def test_bare_json_plain_text_streams_immediately():
    parser = make_tool_parser("bare_json", TOOLS)
    assert parser.feed("Hello") == [TextDelta("Hello")]


@pytest.mark.parametrize("name,text", ALL_CASES)
def test_well_formed_calls_leave_no_tool_syntax_in_content(name, text):
    content, calls, malformed = parse(name, text)
    if not malformed and calls:
        for marker in ("<tool_call>", "</tool_call>", "<function=", "[TOOL_CALLS]", "<|tool_call>", "<invoke", '"arguments"',
                       "<｜tool▁call"):
            assert marker not in content


def test_tool_call_ids_are_openai_style_and_injectable():
    assert re.fullmatch(r"call_[A-Za-z0-9]{24}", new_tool_call_id())
    _, calls = parse_complete("hermes", TOOLS, CASES["hermes"][1], new_id=fixed_ids())
    assert [c.id for c in calls] == ["call_0", "call_1"]


def test_unknown_parser_name_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown tool-call parser 'nope'"):
        make_tool_parser("nope", TOOLS)


@pytest.mark.parametrize("model_type,expected", [
    ("qwen3_5", "qwen3_coder"), ("qwen3_5_moe", "qwen3_coder"), ("qwen3", "hermes"), ("qwen2", "hermes"),
    ("llama", "bare_json"), ("mistral", "mistral"), ("gemma3", "gemma4"), ("gemma4_text", "gemma4"),
    ("minimax_m2", "minimax_xml"), ("deepseek_v3", "deepseek_v3"), ("gpt2", None),
])
def test_default_tool_parser_by_model_type(model_type, expected):
    assert default_tool_parser(model_type) == expected


def test_validate_tools():
    validate_tools(TOOLS)
    with pytest.raises(ValueError, match="must match"):
        validate_tools([_tool("bad name!", {})])
    with pytest.raises(ValueError, match="declared twice"):
        validate_tools([_tool("a", {}), _tool("a", {})])
    with pytest.raises(ValueError, match="JSON schema object"):
        validate_tools([{"type": "function", "function": {"name": "a", "parameters": {"type": "array"}}}])
    with pytest.raises(ValueError, match="must be a list"):
        validate_tools({"name": "a"})


def test_validate_tool_choice():
    assert validate_tool_choice(None, TOOLS).mode == "auto"
    assert validate_tool_choice(None, []).mode == "none"
    assert validate_tool_choice("required", TOOLS).mode == "required"
    named = validate_tool_choice({"type": "function", "function": {"name": "ping"}}, TOOLS)
    assert (named.mode, named.name) == ("required", "ping")
    with pytest.raises(ValueError, match="'rm'.*not in `tools`"):
        validate_tool_choice({"type": "function", "function": {"name": "rm"}}, TOOLS)
    with pytest.raises(ValueError, match="needs at least one tool"):
        validate_tool_choice("required", [])
    with pytest.raises(ValueError, match="tool_choice must be"):
        validate_tool_choice("sometimes", TOOLS)


def test_validate_replayed_tool_call():
    assert validate_replayed_tool_call('{"a": 1}') == {"a": 1}
    assert validate_replayed_tool_call({"a": 1}) == {"a": 1}
    with pytest.raises(ValueError, match="not valid JSON"):
        validate_replayed_tool_call("{a: 1")
    with pytest.raises(ValueError, match="must be a JSON object"):
        validate_replayed_tool_call("[1, 2]")
