"""Reasoning split, its composition with tool parsing, and the thinking budget."""

import codecs

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metrale.api.reasoning_parser import ChatOutputParser, ReasoningDelta, ReasoningParser
from metrale.thinking_budget import ThinkingBudget
from metrale.api.tool_parsers import collect, make_tool_parser

TOOLS = [{"type": "function", "function": {"name": "ping", "parameters": {"type": "object"}}}]


def split(text, cuts, starts_in_reasoning):
    parser = ReasoningParser(starts_in_reasoning=starts_in_reasoning)
    data = text.encode()
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    decoder = codecs.getincrementaldecoder("utf-8")()
    parts = [parser.feed(decoder.decode(data[a:b])) for a, b in zip(points, points[1:])]
    parts.append(parser.finish())
    return "".join(r for r, _ in parts), "".join(c for _, c in parts)


OUTPUTS = [
    (True, "Let me think… 🤔\nstep two\n</think>\n\nThe answer is 4.", ("Let me think… 🤔\nstep two", "The answer is 4.")),
    (False, "<think>\nhmm\n</think>\n\nHi", ("hmm", "Hi")),
    (False, "\n\nHi <think> is a tag", ("", "\n\nHi <think> is a tag")),
    (True, "<think>\nduplicated tag\n</think>ok", ("duplicated tag", "ok")),
    (True, "cut off by max_tokens </thi", ("cut off by max_tokens </thi", "")),
    (False, "<thin", ("", "<thin")),
    (False, "", ("", "")),
    (True, "a</think>", ("a", "")),
]


@pytest.mark.parametrize("starts,text,expected", OUTPUTS)
def test_reasoning_split(starts, text, expected):
    assert split(text, [], starts) == expected


@settings(max_examples=150, deadline=None)
@given(case=st.sampled_from(OUTPUTS), cuts=st.lists(st.integers(0, 200), max_size=10))
def test_any_chunking_gives_the_same_split(case, cuts):
    starts, text, expected = case
    assert split(text, cuts, starts) == expected


@settings(max_examples=150, deadline=None)
@given(
    pieces=st.lists(st.sampled_from(["<think>", "</think>", "<th", "</", "\n", " ", "a", "é"]), max_size=20),
    cuts=st.lists(st.integers(0, 200), max_size=10),
    starts=st.booleans(),
)
def test_fuzzed_chunking_matches_whole_text(pieces, cuts, starts):
    text = "".join(pieces)
    assert split(text, cuts, starts) == split(text, [], starts)


def chat_parser():
    ids = iter(range(100))
    tool_parser = make_tool_parser("hermes", TOOLS, lambda: f"call_{next(ids)}")
    return ChatOutputParser(ReasoningParser(starts_in_reasoning=True), tool_parser)


CALL_IN_THINK = (
    'I could emit <tool_call>{"name": "ping", "arguments": {}}</tool_call> but first\n</think>\n\n'
    'Calling.\n<tool_call>\n{"name": "ping", "arguments": {"n": 1}}\n</tool_call>'
)


def test_tool_call_inside_think_is_not_a_call():
    thought, content, calls = chat_parser().parse_complete(CALL_IN_THINK)
    assert thought.startswith("I could emit <tool_call>")
    assert content == "Calling."
    assert [(c.name, c.arguments_json) for c in calls] == [("ping", '{"n": 1}')]


@settings(max_examples=200, deadline=None)
@given(cuts=st.lists(st.integers(0, len(CALL_IN_THINK)), max_size=12))
def test_chat_parser_streams_the_same_as_whole(cuts):
    parser = chat_parser()
    points = sorted(set(cuts) | {0, len(CALL_IN_THINK)})
    events = []
    for a, b in zip(points, points[1:]):
        events += parser.feed(CALL_IN_THINK[a:b])
    events += parser.finish()
    thought, content, calls = chat_parser().parse_complete(CALL_IN_THINK)
    assert "".join(e.text for e in events if isinstance(e, ReasoningDelta)) == thought
    assert collect(e for e in events if not isinstance(e, ReasoningDelta)) == (content, calls)
    assert not parser.malformed


def test_chat_parser_without_tools_passes_content_through():
    parser = ChatOutputParser(ReasoningParser(starts_in_reasoning=False), None)
    assert parser.parse_complete("<think>a</think>b <tool_call>") == ("a", "b <tool_call>", [])


def test_thinking_budget_forces_the_end_tag_once_spent():
    encode = lambda text: [ord(ch) for ch in text]  # a character-level tokenizer
    budget = ThinkingBudget.from_tokenizer(3, encode)
    assert budget.forced_ids == tuple(encode("\n</think>\n\n"))
    assert budget.ids_to_force(2, reasoning_ended=False) == ()
    assert budget.ids_to_force(3, reasoning_ended=False) == budget.forced_ids
    assert budget.ids_to_force(9, reasoning_ended=True) == ()
    assert ThinkingBudget.from_tokenizer(0, encode).ids_to_force(0, False) == budget.forced_ids


def test_thinking_budget_rejects_bad_input():
    with pytest.raises(ValueError, match=">= 0"):
        ThinkingBudget.from_tokenizer(-1, lambda text: [1])
    with pytest.raises(ValueError, match="no tokens"):
        ThinkingBudget.from_tokenizer(5, lambda text: [])
