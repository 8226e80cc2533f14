"""Hostile input against a live `met serve` (tiny model, 2 workers, auth on): schemathesis fuzzes
every operation of our own GET /openapi.json (valid and invalid requests), hypothesis sends raw
bodies no schema would produce (invalid UTF-8, huge numbers, deep nesting, wrong types, NaN).
Nothing may answer 5xx, no worker may die, and the server answers a normal request afterwards.

Example counts are bounded so the module runs in about two minutes on 2 cores; the server's
--max-seq-len 64 bounds every generation (the schema says so: max_tokens <= 64)."""
from __future__ import annotations

import json

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from tests.serving import Server, children_of, make_tiny_chat_model

KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
EXAMPLES_PER_OPERATION = 10       # per generation mode
RAW_EXAMPLES = 300
POST_ROUTES = ["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize",
               "/v1/messages", "/v1/messages/count_tokens", "/v1/responses",
               "/v1/conversations"]
FIELDS = ["model", "messages", "prompt", "max_tokens", "n", "stop", "stream", "temperature",
          "input", "items", "max_output_tokens", "previous_response_id", "conversation",
          "tokens", "system", "tools", "logprobs", "seed", "stream_options", "top_k"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    model = make_tiny_chat_model(tmp / "tiny")
    srv = Server(["serve", str(model), "--frontends", "2", "--max-seq-len", "64",
                  "--max-batch-size", "64", "--no-event-log", "--require-auth", "--auth-token",
                  KEY, "--request-timeout", "30"], tmp / "serve.log",
                 env={"METRALE_MAX_BODY_BYTES": str(1 << 20)})
    try:
        srv.wait_healthy()
        _wait_workers(srv, 2)
        srv.workers = _workers(srv)
        yield srv
    finally:
        srv.stop()


def _wait_workers(srv: Server, n: int) -> None:
    seen = set()
    for _ in range(400):
        r = requests.get(srv.url + "/v1/models", headers={**AUTH, "Connection": "close"})
        if r.status_code == 200:
            seen.add(r.headers["x-metrale-worker"])
        if len(seen) >= n:
            return
    raise AssertionError(f"only workers {seen} became ready")


def _workers(srv: Server) -> set[int]:
    return {w for child in srv.children() for w in children_of(child)}


def _check(r: requests.Response) -> None:
    assert r.status_code < 500, f"{r.request.method} {r.request.url}: {r.status_code} {r.text}"


def _served_fine(srv: Server) -> None:
    """No worker died (the arbiter would have replaced it under a new pid), and both serve."""
    assert _workers(srv) == srv.workers, srv.tail()
    r = requests.post(srv.url + "/v1/chat/completions", headers=AUTH, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200, r.text
    _wait_workers(srv, 2)


# ---- the OpenAPI description, fuzzed ----------------------------------------------------------

def test_openapi_is_valid_3_1_and_open(server):
    r = requests.get(server.url + "/openapi.json", headers=AUTH)   # gated, like every route
    assert r.status_code == 200
    spec = r.json()
    assert spec["openapi"].startswith("3.1")
    schema = schemathesis.openapi.from_dict(spec)
    schema.validate()                                        # against the OpenAPI 3.1 schema
    labels = {op.ok().label for op in schema.get_all_operations()}
    assert {"POST /v1/chat/completions", "POST /v1/completions", "POST /tokenize",
            "POST /detokenize", "GET /v1/models", "GET /health", "GET /metrics",
            "POST /v1/messages", "POST /v1/messages/count_tokens"} <= labels
    body = spec["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert body["max_tokens"]["anyOf"][0]["maximum"] == 64  # the served max_seq_len


def _bounded(spec: dict) -> dict:
    """The served description with cheaper generations: at most 4 choices of at most 16 tokens
    (the spec allows n <= 64 and max_tokens <= 64; 64 x 64 tokens per example is slow on CI)."""
    schemas = spec["components"]["schemas"]
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        props = schemas[name]["properties"]
        props["n"]["anyOf"][0]["maximum"] = 4
        for field in ("max_tokens", "max_completion_tokens"):
            props[field]["anyOf"][0]["maximum"] = 16
    schemas["AnthropicMessagesRequest"]["properties"]["max_tokens"]["maximum"] = 16
    return spec


def test_schemathesis_finds_no_server_error(server):
    spec = _bounded(requests.get(server.url + "/openapi.json", headers=AUTH).json())
    schema = schemathesis.openapi.from_dict(spec)
    session = requests.Session()
    calls = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        modes = [GenerationMode.POSITIVE]
        if operation.method.upper() == "POST":      # a GET without parameters has no negative
            modes.append(GenerationMode.NEGATIVE)
        for mode in modes:
            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            def fuzz(case):
                nonlocal calls
                headers = {**(case.headers or {}), **AUTH}
                response = case.call(base_url=server.url, session=session, headers=headers,
                                     timeout=60)
                calls += 1
                assert response.status_code < 500, (
                    f"{operation.label} ({mode}): {response.status_code} {response.text}\n"
                    f"{case.as_curl_command()}")
            fuzz()
    assert calls >= 8 * EXAMPLES_PER_OPERATION
    _served_fine(server)


# ---- raw bodies no schema produces -------------------------------------------------------------

_json_leaf = (st.none() | st.booleans() | st.integers(-2**70, 2**70)
              | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20))
_json_value = st.recursive(_json_leaf, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                           max_leaves=12)


def _dumps(obj) -> bytes:
    return json.dumps(obj).encode()


_bad_utf8 = st.binary(min_size=1, max_size=40).filter(lambda b: not _decodes(b))


def _decodes(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


_raw_bodies = st.one_of(
    # invalid UTF-8, bare and inside a string
    _bad_utf8,
    _bad_utf8.map(lambda b: b'{"prompt": "' + b + b'", "max_tokens": 1}'),
    _bad_utf8.map(lambda b: b'{"messages": [{"role": "user", "content": "' + b + b'"}]}'),
    # lone surrogates
    st.sampled_from([b'{"prompt": "\\ud800"}', b'{"messages": [{"role": "user", "content": '
                     b'"\\udfff x"}], "max_tokens": 1}']),
    # huge numbers
    st.integers(2**63, 10**400).map(lambda n: b'{"prompt": "a", "max_tokens": %d}' % n),
    st.integers(2**63, 10**60).map(lambda n: b'{"prompt": "a", "max_tokens": 1, "seed": %d}' % n),
    st.integers(2**63, 10**60).map(lambda n: b'{"tokens": [%d]}' % n),
    st.sampled_from([b'{"prompt": "a", "temperature": 1e999}', b'{"prompt": [1e400]}',
                     b'{"prompt": "a", "max_tokens": -1e308}',
                     b'{"tokens": [-9223372036854775809]}']),
    # NaN / Infinity
    st.sampled_from([b"NaN", b"Infinity", b"-Infinity"]).map(
        lambda v: b'{"prompt": "a", "max_tokens": 1, "temperature": ' + v + b'}'),
    # deep nesting, closed or not
    st.integers(60, 200_000).map(lambda d: b"[" * d),
    st.integers(60, 5_000).map(lambda d: b'{"prompt": ' + b"[" * d + b"1" + b"]" * d + b"}"),
    st.integers(60, 5_000).map(lambda d: b'{"messages": ' + b'{"a": ' * d + b"1" + b"}" * d
                               + b"}"),
    # wrong types in every field we read
    st.dictionaries(st.sampled_from(FIELDS), _json_value, max_size=5).map(_dumps),
    _json_value.map(_dumps),
    # not JSON at all
    st.binary(max_size=64),
)


def test_raw_bodies_find_no_server_error(server):
    session = requests.Session()

    @given(route=st.sampled_from(POST_ROUTES), body=_raw_bodies)
    @settings(max_examples=RAW_EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    def fuzz(route, body):
        r = session.post(server.url + route, data=body, timeout=60,
                         headers={**AUTH, "Content-Type": "application/json"})
        _check(r)
        if r.status_code >= 400 and r.status_code != 404:
            error = r.json()["error"]
            assert error["message"] and error["type"]

    fuzz()
    r = session.post(server.url + "/v1/chat/completions", data=b"[" * 100_000, headers=AUTH)
    assert r.status_code == 400 and "deeper than 64" in r.json()["error"]["message"]
    _served_fine(server)
