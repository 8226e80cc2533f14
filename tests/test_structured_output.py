"""Structured output (metrale/grammar.py) end to end through the official `openai` SDK against
live `met serve` processes: a tiny random-weight model sampled at temperature 1 (the grammar
alone must make its noise valid: 100 % of outputs validate with `jsonschema`), the scripted
model (reasoning left free, the grammar applied after `</think>`), and the real SmolLM2. Plus
the CPU sampler's mask (greedy and sampled rows), refusals in the API's error shape, tool
grammar (strict tools' arguments valid against their schemas) and the metrics."""
from __future__ import annotations

import json

import jsonschema
import numpy as np
import openai
import pytest
import requests

from metrale.grammar import GrammarError, apply_token_bitmask, grammar_for_response_format
from metrale.sampling import Sampler, SamplingParams, make_generator
from tests.scripted_model import SERVE_ENV, make_scripted_model
from tests.serving import Server, make_tiny_chat_model, metric

MODEL = "tiny"
UUID = "^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$"


def _obj(props: dict, required=None) -> dict:
    return {"type": "object", "properties": props,
            "required": list(props) if required is None else required,
            "additionalProperties": False}


SCHEMAS = {
    "nested": _obj({"user": _obj({"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                  "tag": {"type": "string", "maxLength": 6}}),
                    "ok": {"type": "boolean"}}),
    "array_bounds": _obj({"xs": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                            "maximum": 9},
                                 "minItems": 2, "maxItems": 4}}),
    "enum": _obj({"color": {"enum": ["red", "green", "blue"]},
                  "size": {"type": "string", "enum": ["S", "M", "L"]}}),
    "any_of": _obj({"v": {"anyOf": [{"type": "integer", "minimum": -5, "maximum": 5},
                                    {"type": "string", "maxLength": 3}, {"type": "null"}]}}),
    "number_bounds": _obj({"x": {"type": "number", "minimum": -1.5, "maximum": 2.5},
                           "n": {"type": "integer", "exclusiveMinimum": 10,
                                 "exclusiveMaximum": 20}}),
    "formats": _obj({"day": {"type": "string", "format": "date"},
                     "id": {"type": "string", "format": "uuid"},
                     "mail": {"type": "string", "format": "email", "maxLength": 24}}),
    "optional": _obj({"a": {"type": "integer", "minimum": 0, "maximum": 9},
                      "b": {"type": "string", "maxLength": 4},
                      "c": {"type": "boolean"}}, required=["a"]),
    "array_of_objects": _obj({"items": {"type": "array", "maxItems": 3, "items": _obj({
        "k": {"enum": ["p", "q"]}, "w": {"type": "integer", "minimum": 0, "maximum": 99}})}}),
}
CHECKER = jsonschema.Draft202012Validator.FORMAT_CHECKER
_UUID_RE = __import__("re").compile(UUID, __import__("re").IGNORECASE)   # RFC 4122: either case


def _validate(text: str, schema: dict) -> object:
    value = json.loads(text)
    jsonschema.validate(value, schema, format_checker=CHECKER)
    if schema is SCHEMAS["formats"]:   # jsonschema checks uuid only with an extra package
        assert _UUID_RE.match(value["id"]), value
    return value


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("structured")
    path = make_tiny_chat_model(root / "model")
    with Server(["serve", str(path), "--model-name", MODEL, "--frontends", "1",
                 "--max-seq-len", "4096", "--tool-call-parser", "hermes", "--no-event-log"],
                root / "serve.log").serving(180) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)


def _schema_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema,
                                                   "strict": True}}


# ---- the CPU sampler's mask ------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_cpu_sampler_draws_only_allowed_tokens(temperature):
    rng = np.random.default_rng(0)
    B, V = 6, 100
    logits = rng.normal(size=(B, V)).astype(np.float32) * 4
    allowed = [rng.choice(V, size=k, replace=False) for k in (1, 2, 3, 5, 8, 13)]
    bits = np.zeros((B, (V + 31) // 32), dtype=np.uint32)
    for b, ids in enumerate(allowed):
        for t in ids:
            bits[b, t >> 5] |= np.uint32(1 << (t & 31))
    rows = np.array([0, 2, 4])        # rows 1, 3, 5 are unconstrained
    masks = (rows, bits[rows].view(np.int32))
    params = [SamplingParams(temperature=temperature, logprobs=2).validate() for _ in range(B)]
    sampler = Sampler()
    seen_free = set()
    for step in range(200):
        gens = [make_generator(None, (step, b)) for b in range(B)]
        res = sampler.sample(logits, params, gens, grammar_masks=masks)
        for b in rows:
            assert res.token_ids[b] in allowed[b]
            assert all(t in allowed[b] for t, lp in res.logprobs[b].top if np.isfinite(lp))
        seen_free.update(int(res.token_ids[b]) for b in (1, 3, 5))
    if temperature:
        assert len(seen_free) > 3           # the unconstrained rows still sample freely
    x = logits.copy()
    apply_token_bitmask(x, masks)
    assert np.isfinite(x[0]).sum() == 1 and np.isfinite(x[1]).all()


# ---- the schema suite on a random model -------------------------------------------------------

@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_schema_suite_from_noise_all_outputs_validate(client, name):
    schema = SCHEMAS[name]
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "give me JSON"}], n=4,
        temperature=1.0, max_tokens=1500, response_format=_schema_format(name, schema))
    for choice in resp.choices:
        assert choice.finish_reason == "stop", choice.message.content
        _validate(choice.message.content, schema)


def test_streamed_output_is_valid_too(client):
    schema = SCHEMAS["nested"]
    chunks = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "stream"}], stream=True,
        temperature=1.0, max_tokens=1500, seed=7, response_format=_schema_format("n", schema))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    _validate(text, schema)


def test_json_object_mode_and_completions(client):
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "json please"}], n=3,
        temperature=1.0, max_tokens=2000, response_format={"type": "json_object"})
    for choice in resp.choices:
        if choice.finish_reason == "stop":      # an unbounded object may run to max_tokens
            assert isinstance(json.loads(choice.message.content), dict)
    assert any(c.finish_reason == "stop" for c in resp.choices)
    schema = SCHEMAS["enum"]
    comp = client.completions.create(model=MODEL, prompt="The answer:", n=3, temperature=1.0,
                                     max_tokens=200,
                                     extra_body={"response_format": _schema_format("e", schema)})
    for choice in comp.choices:
        assert choice.finish_reason == "stop"
        _validate(choice.text, schema)


def test_greedy_constrained_output_validates(client):
    schema = SCHEMAS["array_bounds"]
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "greedy"}], temperature=0,
        max_tokens=300, response_format=_schema_format("a", schema))
    _validate(resp.choices[0].message.content, schema)


def test_beta_parse_with_a_pydantic_model(client):
    from typing import Literal

    from pydantic import BaseModel, Field

    class Step(BaseModel):
        kind: Literal["add", "sub"]
        value: int = Field(ge=0, le=50)

    class Plan(BaseModel):
        steps: list[Step] = Field(max_length=3)
        done: bool

    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    resp = parse(model=MODEL, messages=[{"role": "user", "content": "plan"}], temperature=1.0,
                 max_tokens=1500, response_format=Plan)
    plan = resp.choices[0].message.parsed
    assert isinstance(plan, Plan) and len(plan.steps) <= 3


def test_unconstrained_requests_beside_constrained_ones_are_unchanged(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "free"}], temperature=0,
              max_tokens=12)
    before = client.chat.completions.create(**kw).choices[0].message.content
    import concurrent.futures as cf
    with cf.ThreadPoolExecutor(2) as pool:
        constrained = pool.submit(client.chat.completions.create, model=MODEL,
                                  messages=[{"role": "user", "content": "x"}], max_tokens=300,
                                  response_format=_schema_format("e", SCHEMAS["enum"]))
        free = pool.submit(client.chat.completions.create, **kw)
        assert free.result().choices[0].message.content == before
        _validate(constrained.result().choices[0].message.content, SCHEMAS["enum"])


# ---- refusals ------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt, param, words", [
    (_schema_format("x", {"not": {"type": "string"}}), "response_format.json_schema.schema",
     ["not"]),
    (_schema_format("x", {"type": "foo"}), "response_format.json_schema.schema",
     ["not valid JSON Schema"]),
    (_schema_format("x", {"type": "integer", "minimum": 5, "maximum": 2}),
     "response_format.json_schema.schema", ["minimum"]),
    (_schema_format("x", {"type": "string", "pattern": "(a"}),
     "response_format.json_schema.schema", ["pattern"]),
    ({"type": "json_schema"}, "response_format.json_schema", ["name"]),
    ({"type": "xml"}, "response_format.type", ["json_schema"]),
])
def test_refusals_are_400_invalid_request_error(server, client, fmt, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=5, response_format=fmt)
    err = e.value.body
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    for w in words:
        assert w in err["message"], err
    r = requests.post(server.url + "/v1/completions", json={
        "model": MODEL, "prompt": "x", "max_tokens": 5, "response_format": fmt}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    r = requests.post(server.url + "/v1/completions", json={
        "model": MODEL, "prompt": "x", "max_tokens": 5, "response_format": "json"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"


def test_refusal_messages_name_the_unsupported_keyword():
    with pytest.raises(GrammarError) as e:
        grammar_for_response_format(_schema_format("x", _obj({"a": {"not": {"const": 1}}})))
    assert "not" in str(e.value) and "support" in str(e.value)
    assert grammar_for_response_format({"type": "text"}) is None
    assert grammar_for_response_format(None) is None


# ---- tool grammar ----------------------------------------------------------------------------

def _tool(name: str, params: dict, strict: bool = True) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": params,
                                             "strict": strict}}


TOOL_ARGS = {
    "book": _obj({"city": {"enum": ["Paris", "Oslo"]}, "nights": {"type": "integer",
                                                                  "minimum": 1, "maximum": 9}}),
    "note": _obj({"text": {"type": "string", "maxLength": 8},
                  "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}}),
}


@pytest.mark.parametrize("choice", ["required", "book", "note"])
def test_strict_tool_arguments_validate_on_a_random_model(client, choice):
    tools = [_tool(n, s) for n, s in TOOL_ARGS.items()]
    tool_choice = choice if choice == "required" else \
        {"type": "function", "function": {"name": choice}}
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "call"}], tools=tools,
        tool_choice=tool_choice, temperature=1.0, max_tokens=600, n=3, parallel_tool_calls=False)
    for ch in resp.choices:
        assert ch.finish_reason == "tool_calls", ch.message
        assert len(ch.message.tool_calls) == 1 and not ch.message.content
        for call in ch.message.tool_calls:
            assert choice == "required" or call.function.name == choice
            jsonschema.validate(json.loads(call.function.arguments),
                                TOOL_ARGS[call.function.name])


def test_tool_schema_with_an_unsupported_keyword_is_refused(client):
    tools = [_tool("bad", _obj({"x": {"not": {"type": "integer"}}}))]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       tools=tools, tool_choice="required", max_tokens=5)
    assert e.value.body["param"] == "tools" and "not" in e.value.body["message"]


def test_metrics_count_constrained_requests_and_mask_time(server, client):
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "m"}],
                                   max_tokens=300,
                                   response_format=_schema_format("e", SCHEMAS["enum"]))
    assert metric(server.url, "metrale_constrained_requests_total") >= 1
    assert metric(server.url, "metrale_grammar_mask_seconds_count") >= 1
    text = requests.get(server.url + "/metrics", timeout=30).text
    assert "metrale_grammar_mask_wait_seconds_total" in text


# ---- reasoning stays free: the scripted model -------------------------------------------------

ANSWER = _obj({"answer": {"type": "integer"}})
WEATHER_ARGS = _obj({"city": {"type": "string", "maxLength": 12},
                     "days": {"type": "integer", "minimum": 1, "maximum": 7}})
SCRIPTS = [
    {"when": "bad weather call", "reply": '<tool_call>\n{"name": "get_weather", "arguments": '
     '{"city": "Paris", "days": "three"}}\n</tool_call>'},
    {"when": "bad xml call", "reply": "<tool_call>\n<function=get_weather>\n<parameter=city>\n"
     "Paris\n</parameter>\n<parameter=days>\nthree\n</parameter>\n</function>\n</tool_call>"},
    {"when": "think then json", "reply": "<think>\nMaybe {broken json here\n</think>\n\n"
     '{"answer": 42}'},
    {"when": "think then prose", "reply": "<think>\nok\n</think>\n\nthe answer is forty-two"},
]


def _scripted_server(root, *flags, parser="hermes"):
    path = make_scripted_model(root / "model", SCRIPTS)
    return Server(["serve", path, "--model-name", "scripted", "--frontends", "1",
                   "--max-seq-len", "2048", "--no-event-log", "--tool-call-parser", parser,
                   *flags], root / "serve.log", env=SERVE_ENV)


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    with _scripted_server(tmp_path_factory.mktemp("scripted")).serving(180) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)


def _weather_call(client, strict: bool, prompt: str = "bad weather call", **kw):
    tool = _tool("get_weather", WEATHER_ARGS, strict=strict)
    resp = client.chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": prompt}],
        tools=[tool], temperature=0, max_tokens=200, **kw)
    calls = resp.choices[0].message.tool_calls or []
    return resp.choices[0], [json.loads(c.function.arguments) for c in calls]


def test_tool_grammar_auto_constrains_strict_tools_only(scripted):
    choice, args = _weather_call(scripted, strict=False)     # the model's own (invalid) call
    assert args == [{"city": "Paris", "days": "three"}]
    choice, args = _weather_call(scripted, strict=True)
    assert choice.finish_reason == "tool_calls" and len(args) == 1
    assert args[0]["city"] == "Paris"
    jsonschema.validate(args[0], WEATHER_ARGS)


def test_qwen3_coder_parameters_are_constrained(tmp_path):
    with _scripted_server(tmp_path, parser="qwen3_coder").serving(180) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0,
                               timeout=120)
        _, args = _weather_call(client, strict=False, prompt="bad xml call")
        assert args == [{"city": "Paris", "days": "three"}]
        for kw in ({}, {"tool_choice": "required"},
                   {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}):
            choice, args = _weather_call(client, strict=True, prompt="bad xml call", **kw)
            assert choice.finish_reason == "tool_calls" and len(args) == 1, choice
            assert args[0]["city"] == "Paris"
            jsonschema.validate(args[0], WEATHER_ARGS)


@pytest.mark.parametrize("flags", [["--tool-grammar", "off"], ["--disable-tool-grammar", "true"]])
def test_tool_grammar_off_leaves_strict_tools_unconstrained(tmp_path, flags):
    with _scripted_server(tmp_path, *flags).serving(180) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0,
                               timeout=120)
        _, args = _weather_call(client, strict=True)
        assert args == [{"city": "Paris", "days": "three"}]
        resp = client.chat.completions.create(      # response_format is not a tool grammar
            model="scripted", messages=[{"role": "user", "content": "think then prose"}],
            temperature=0, max_tokens=200, response_format=_schema_format("a", ANSWER))
        _validate(resp.choices[0].message.content, ANSWER)


@pytest.mark.parametrize("thinking", [True, False])
def test_grammar_applies_after_the_reasoning_not_inside_it(scripted, thinking):
    resp = scripted.chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "think then json"}],
        temperature=0, max_tokens=200, response_format=_schema_format("a", ANSWER),
        extra_body={"chat_template_kwargs": {"enable_thinking": thinking}})
    msg = resp.choices[0].message
    assert "Maybe {broken json here" in (msg.model_extra or {}).get("reasoning_content", "")
    assert json.loads(msg.content) == {"answer": 42}
    assert resp.choices[0].finish_reason == "stop"


def test_grammar_is_enforced_after_the_reasoning(scripted):
    resp = scripted.chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "think then prose"}],
        temperature=0, max_tokens=200, response_format=_schema_format("a", ANSWER),
        extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    msg = resp.choices[0].message
    assert (msg.model_extra or {}).get("reasoning_content", "").strip() == "ok"
    _validate(msg.content, ANSWER)


# ---- speculative decoding: constrained requests take no drafts --------------------------------

def test_constrained_requests_take_no_drafts(tmp_path):
    from metrale.config import EngineConfig
    from metrale.engine_core import EngineCore
    from metrale.grammar import grammar_for_schema
    from metrale.models.loader import load_checkpoint
    from metrale.request import Request
    from metrale.tokenizer import Tokenizer

    path = make_tiny_chat_model(tmp_path / "model")
    tok = Tokenizer.from_dir(path)
    core = EngineCore(load_checkpoint(str(path)), EngineConfig(
        device="cpu", max_seq_len=2048, ngram_speculative=True, num_drafts=3, seed=0))
    core.use_tokenizer(tok)
    schema = SCHEMAS["array_of_objects"]
    grammar = grammar_for_schema(schema, "schema")
    prompt = tok.encode("abc abc abc abc abc abc abc abc", add_special_tokens=False)
    for i in range(4):
        core.add_request(Request(f"g{i}", prompt, SamplingParams(
            max_tokens=600, temperature=0.0 if i % 2 else 1.0, grammar=grammar).validate()))
        core.add_request(Request(f"f{i}", prompt, SamplingParams(
            max_tokens=64, temperature=0.0, ignore_eos=True).validate()))
    out, last = {}, {}
    while core.has_unfinished():
        for o in core.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
            last[o.request_id] = o
    for i in range(4):
        assert last[f"g{i}"].num_draft_tokens == 0 and last[f"g{i}"].finish_reason == "stop"
        _validate(tok.decode(out[f"g{i}"], skip_special_tokens=True), schema)
    assert sum(last[f"f{i}"].num_draft_tokens for i in range(4)) > 0   # drafting was on


# ---- the real SmolLM2 ------------------------------------------------------------------------

@pytest.mark.slow
def test_smollm2_outputs_validate(tmp_path):
    from tests.assets import smollm2_gguf_path

    schemas = [_obj({"name": {"type": "string", "maxLength": 20},
                     "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
               _obj({"capital": {"enum": ["Paris", "Berlin", "Rome"]},
                     "population_millions": {"type": "number", "minimum": 0, "maximum": 50}}),
               _obj({"colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                "minItems": 1, "maxItems": 3}})]
    with Server(["serve", str(smollm2_gguf_path()), "--model-name", "smol", "--frontends", "1",
                 "--max-seq-len", "1024", "--no-event-log"],
                tmp_path / "serve.log").serving(300) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0,
                               timeout=300)
        for i, schema in enumerate(schemas):
            resp = client.chat.completions.create(
                model="smol", messages=[{"role": "user", "content": "Describe a person, the "
                                         "capital of France, or your favourite colours as JSON."}],
                temperature=0.7, seed=i, n=2, max_tokens=200,
                response_format=_schema_format(f"s{i}", schema))
            for choice in resp.choices:
                assert choice.finish_reason == "stop", choice.message.content
                _validate(choice.message.content, schema)


# ---- Anthropic Messages ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def claude(server):
    import anthropic

    return anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=300)


def test_anthropic_output_format_text_validates(claude):
    schema = SCHEMAS["nested"]
    for i in range(3):
        msg = claude.messages.create(
            model=MODEL, max_tokens=1500, extra_body={"temperature": 1.0},
            messages=[{"role": "user", "content": "json"}],
            output_config={"format": {"type": "json_schema", "schema": schema}})
        assert msg.stop_reason == "end_turn"
        _validate(msg.content[0].text, schema)


@pytest.mark.parametrize("choice, strict", [({"type": "tool", "name": "book"}, False),
                                             ({"type": "any"}, False),
                                             ({"type": "any"}, True)])
def test_anthropic_tool_inputs_follow_their_input_schema(claude, choice, strict):
    tools = [{"name": n, "input_schema": s, **({"strict": True} if strict else {})}
             for n, s in TOOL_ARGS.items()]
    for _ in range(3):
        msg = claude.messages.create(
            model=MODEL, max_tokens=600, extra_body={"temperature": 1.0}, tools=tools,
            tool_choice={**choice, "disable_parallel_tool_use": True},
            messages=[{"role": "user", "content": "book it"}])
        assert msg.stop_reason == "tool_use", msg
        uses = [b for b in msg.content if b.type == "tool_use"]
        assert len(uses) == 1
        assert choice["type"] == "any" or uses[0].name == "book"
        jsonschema.validate(uses[0].input, TOOL_ARGS[uses[0].name])


def test_anthropic_refusals_are_in_its_error_shape(server):
    body = {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
            "output_config": {"format": {"type": "json_schema",
                                         "schema": {"not": {"type": "string"}}}}}
    r = requests.post(server.url + "/v1/messages", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert "not" in err["error"]["message"]
    body["output_config"]["format"]["schema"] = {"type": "object", "properties": 5}
    r = requests.post(server.url + "/v1/messages", json=body, timeout=30)
    assert r.status_code == 400 and "not valid JSON Schema" in r.json()["error"]["message"]


def test_min_tokens_yields_to_a_grammar_that_allows_only_eos():
    V, eos = 16, 3
    logits = np.zeros((1, V), np.float32)
    bits = np.zeros((1, 1), np.uint32)
    bits[0, 0] = 1 << eos
    params = [SamplingParams(min_tokens=5, temperature=1.0).validate()]
    res = Sampler(eos_token_ids=[eos]).sample(logits, params, [make_generator(0, 0)],
                                              [((1,), ())], (np.array([0]), bits.view(np.int32)))
    assert res.token_ids[0] == eos


def test_a_tokenizer_the_grammar_library_cannot_read_serves_all_but_structured_output(tmp_path):
    """A checkpoint whose tokenizer llguidance refuses (the ladder's synthetic folders: a
    WordPiece decoder) loads and generates; a constrained request is refused naming why
    (the engine failed to load at all before: found on the H200 by the hot-swap memory test)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "perf"))
    import ladder
    from metrale.config import EngineConfig
    from metrale.engine_core import EngineCore
    from metrale.models.loader import load_checkpoint
    from metrale.request import Request
    from metrale.tokenizer import Tokenizer

    folder = ladder.write_model_folder("tiny_llama", tmp_path / "m")
    core = EngineCore(load_checkpoint(str(folder), load_format="dummy", device="cpu"),
                      EngineConfig(device="cpu", max_seq_len=256))
    core.use_tokenizer(Tokenizer.from_dir(folder))          # what the engine process does
    assert core.grammars is None
    core.add_request(Request("free", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0,
                                                               ignore_eos=True)))
    out = []
    while core.has_unfinished():
        out += [t for o in core.step() for t in o.token_ids]
    assert len(out) == 3
    grammar = grammar_for_response_format({"type": "json_object"})
    with pytest.raises(ValueError, match="structured output is not available for this model"):
        core.add_request(Request("json", [5, 6, 7], SamplingParams(max_tokens=3, grammar=grammar)))


# ---- /v1/responses: text.format goes down the same path -----------------------------------------

@pytest.mark.parametrize("name", ["nested", "array_of_objects"])
def test_responses_text_format_constrains_the_output(client, name):
    """The Responses API's `text.format` is chat's response_format on the chat path: outputs
    from noise validate; a schema the grammar refuses is a 400 naming text.format."""
    schema = SCHEMAS[name]
    fmt = {"type": "json_schema", "name": name, "schema": schema, "strict": True}
    for _ in range(2):
        resp = client.responses.create(model=MODEL, input="give me JSON", store=False,
                                       temperature=1.0, max_output_tokens=1500,
                                       text={"format": fmt})
        assert resp.status == "completed", resp
        _validate(resp.output_text, schema)
    bad = {"type": "json_schema", "name": "bad", "strict": True,
           "schema": {"type": "object", "not": {"required": ["a"]}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="x", store=False, text={"format": bad})
    assert (e.value.body or {}).get("param", "").startswith("text.format"), e.value.body
