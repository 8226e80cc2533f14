"""Security and operations under hostile input, against one live `met serve` of a tiny model
with 2 frontend workers: auth on every gated route (keys from the flag and from a file), rate
limits shared by the workers through the engine (burst 5 at 60 RPM, x-ratelimit-* headers, a
bounded key table seen in the engine's stats), and input limits (body and header size, slow
bodies and slowloris heads, JSON depth, numbers, UTF-8, message count, max_tokens), each a 4xx
in the API's own error shape."""
from __future__ import annotations

import http.client
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import zmq

from frontends import limits
from metrale import wire
from metrale.api.errors import APIError
from tests.serving import Server, children_of, free_port, make_tiny_chat_model

FLAG_KEY = "flag-key-0123456789"
FILE_KEY = "file-key-abcdef"
RL_KEY = "rate-limit-key"
BULK_KEYS = [f"bulk-{i:05d}" for i in range(2000)]
MAX_KEYS = 500
MAX_BODY = 65536
MAX_MESSAGES = 8
TIMEOUT_S = 2
TPM_BURST = 1000
OPENAI_GATED = [("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/chat/completions"),
                ("POST", "/v1/completions"), ("POST", "/tokenize"), ("POST", "/detokenize")]
ANTHROPIC_GATED = [("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens")]
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("security")
    model = make_tiny_chat_model(tmp / "tiny")
    keys = tmp / "keys.txt"
    keys.write_text("# API keys, one a line\n\n" + FILE_KEY + "\n  # indented comment\n"
                    + "\n".join(BULK_KEYS) + "\n")
    engine_port = free_port(4)
    srv = Server(["serve", str(model), "--frontends", "2", "--max-seq-len", "64",
                  "--no-event-log", "--require-auth", "--auth-token", FLAG_KEY, "--auth-token",
                  RL_KEY, "--auth-tokens-file", str(keys),
                  "--engine-bind", f"tcp://127.0.0.1:{engine_port}"], tmp / "serve.log",
                 env={"METRALE_RATE_LIMIT_RPM": "60", "METRALE_RATE_LIMIT_BURST_RPM": "5",
                      "METRALE_RATE_LIMIT_TPM": "600000",
                      "METRALE_RATE_LIMIT_BURST_TPM": str(TPM_BURST),
                      "METRALE_RATE_LIMIT_MAX_KEYS": str(MAX_KEYS),
                      "METRALE_MAX_BODY_BYTES": str(MAX_BODY),
                      "METRALE_MAX_MESSAGES": str(MAX_MESSAGES),
                      "METRALE_BODY_TIMEOUT_S": str(TIMEOUT_S)})
    srv.engine_control = f"tcp://127.0.0.1:{engine_port + 2}"
    try:
        srv.wait_healthy()
        srv.workers = _wait_workers(srv)
        yield srv
    finally:
        srv.stop()


def _auth(key: str = FLAG_KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _wait_workers(srv: Server) -> set[int]:
    """Until both workers answered a model route; -> the worker pids."""
    seen = set()
    deadline = time.monotonic() + 60
    while len(seen) < 2 and time.monotonic() < deadline:
        r = requests.get(srv.url + "/v1/models", headers={**_auth(), "Connection": "close"})
        if r.status_code == 200:
            seen.add(int(r.headers["x-metrale-worker"]))
    assert len(seen) == 2, f"only workers {seen} answered"
    assert seen == {w for c in srv.children() for w in children_of(c)}
    return seen


def _openai_error(r: requests.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert error["message"] and error["type"], error
    return error


def _anthropic_error(r: requests.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert body["type"] == "error" and body["error"]["message"], body
    return body["error"]


def _engine_stats(srv: Server) -> dict:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(srv.engine_control)
    try:
        sock.send_multipart(wire.encode(wire.StatsQuery()))
        assert sock.poll(10_000), "the engine did not answer"
        reply = wire.decode(sock.recv_multipart())
    finally:
        sock.close(0)
    assert reply.ok
    return reply.data


# ---- auth -------------------------------------------------------------------------------------

BAD_CREDENTIALS = [
    {},                                                   # missing
    {"Authorization": "Bearer wrong-key"},                # wrong
    {"Authorization": f"Bearer {FLAG_KEY[:-1]}"},          # a prefix of a valid key
    {"Authorization": f"Bearer {FLAG_KEY}x"},             # a valid key plus a suffix
    {"Authorization": f"Bearer {FILE_KEY[:4]}"},
    {"Authorization": "Bearer "},                         # empty
    {"Authorization": "Bearer"},
    {"Authorization": FLAG_KEY},                          # no scheme
    {"Authorization": f"Basic {FLAG_KEY}"},
    {"x-api-key": ""},
    {"x-api-key": "wrong-key"},
    {"x-api-key": FILE_KEY[:-1]},
    {"x-api-key": "# API keys, one a line"},              # a comment of the keys file
]


def test_gated_routes_refuse_missing_wrong_prefix_and_empty_keys(server):
    for method, path in OPENAI_GATED + ANTHROPIC_GATED:
        for headers in BAD_CREDENTIALS:
            r = requests.request(method, server.url + path, headers=headers, json=CHAT)
            if path.startswith("/v1/messages"):
                error = _anthropic_error(r, 401)
                assert error["type"] == "authentication_error"
            else:
                error = _openai_error(r, 401)
                assert error["type"] == "authentication_error"
                assert error["code"] == "invalid_api_key"
            for secret in (FLAG_KEY, FILE_KEY, RL_KEY, "bulk-"):
                assert secret not in r.text           # no hint of which keys exist


def test_valid_keys_from_the_flag_and_the_file(server):
    for headers in (_auth(FLAG_KEY), _auth(FILE_KEY), {"x-api-key": FILE_KEY},
                    {"x-api-key": FLAG_KEY}, _auth(BULK_KEYS[-1]),
                    {"authorization": f"bearer {FILE_KEY}"}):
        assert requests.get(server.url + "/v1/models", headers=headers).status_code == 200
        r = requests.post(server.url + "/tokenize", headers=headers, json={"prompt": "ab"})
        assert r.status_code == 200 and r.json()["count"] == 2
        r = requests.post(server.url + "/detokenize", headers=headers, json={"tokens": [1]})
        assert r.status_code == 200
    assert requests.get(server.url + "/metrics", headers=_auth(FILE_KEY)).status_code == 200
    r = requests.post(server.url + "/v1/chat/completions", headers=_auth(FILE_KEY), json=CHAT)
    assert r.status_code == 200, r.text
    # an Anthropic route accepts the key either way (404 while it is not served yet)
    r = requests.post(server.url + "/v1/messages", headers={"x-api-key": FILE_KEY}, json={})
    assert r.status_code != 401


def test_only_health_is_open_and_openapi_needs_a_key(server):
    """--require-auth's help: every route but /health needs a key (/openapi.json too)."""
    assert requests.get(server.url + "/health").status_code == 200
    assert requests.get(server.url + "/health", headers=_auth("wrong")).status_code == 200
    r = requests.get(server.url + "/openapi.json")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = requests.get(server.url + "/openapi.json", headers=_auth())
    assert r.status_code == 200 and r.json()["openapi"].startswith("3.1")
    schemes = r.json()["components"]["securitySchemes"]
    assert schemes["bearerAuth"]["scheme"] == "bearer"
    assert schemes["apiKeyHeader"]["name"] == "x-api-key"


def test_unauthenticated_body_is_not_read(server):
    """A client without a key gets 401 before it may send a body (Content-Length alone)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nContent-Length: 60000\r\n\r\n{")
        head = s.recv(4096)
    assert head.startswith(b"HTTP/1.1 401")


# ---- rate limits ------------------------------------------------------------------------------

def _pinned_connections(srv: Server) -> dict[int, http.client.HTTPConnection]:
    """One keep-alive connection to each worker: new connections until both pids answered."""
    conns: dict[int, http.client.HTTPConnection] = {}
    for _ in range(200):
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
        conn.request("GET", "/health")
        r = conn.getresponse()
        r.read()
        pid = int(r.getheader("x-metrale-worker"))
        if pid in conns:
            conn.close()
        else:
            conns[pid] = conn
        if len(conns) == 2:
            return conns
    raise AssertionError("connections never reached both workers")


def test_burst_of_5_at_60_rpm_across_two_workers(server):
    conns = list(_pinned_connections(server).values())
    body = json.dumps({"prompt": "a", "max_tokens": 1})
    answers = []
    start = time.monotonic()
    for i in range(6):
        conn = conns[i % 2]
        conn.request("POST", "/v1/completions", body=body,
                     headers={**_auth(RL_KEY), "Content-Type": "application/json"})
        r = conn.getresponse()
        answers.append((r.status, dict((k.lower(), v) for k, v in r.getheaders()), r.read()))
    elapsed = time.monotonic() - start
    for conn in conns:
        conn.close()
    assert elapsed < 1.0, f"6 requests took {elapsed:.2f}s: a token refilled meanwhile"
    assert [a[0] for a in answers] == [200] * 5 + [429], [a[:2] for a in answers]
    assert {int(a[1]["x-metrale-worker"]) for a in answers} == server.workers
    for i, (_, headers, _) in enumerate(answers[:5]):
        assert headers["x-ratelimit-limit-requests"] == "5"
        assert headers["x-ratelimit-remaining-requests"] == str(4 - i)
        assert headers["x-ratelimit-reset-requests"].endswith("s")     # 1s, 980ms, ...
        assert headers["x-ratelimit-limit-tokens"] == str(TPM_BURST)
        assert int(headers["x-ratelimit-remaining-tokens"]) < TPM_BURST
        assert headers["x-ratelimit-reset-tokens"].endswith("s")
    status, headers, raw = answers[5]
    assert int(headers["retry-after"]) >= 1
    assert headers["x-ratelimit-remaining-requests"] == "0"
    error = json.loads(raw)["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
    # another key has its own bucket
    r = requests.post(server.url + "/v1/completions", headers=_auth(FLAG_KEY),
                      json={"prompt": "a", "max_tokens": 1})
    assert r.status_code == 200, r.text


def test_rate_limit_key_table_stays_bounded(server):
    """2000 keys (valid ones: an invalid key never reaches the limiter) against a table of 500.
    Each request is refused by the token bucket (n x max_tokens above the burst), so nothing is
    generated and the test stays fast; the request bucket still records the key."""
    body = {"prompt": "a", "max_tokens": 40, "n": 32}

    def send(keys):
        with requests.Session() as session:
            return [session.post(server.url + "/v1/completions", headers=_auth(k),
                                 json=body).status_code for k in keys]

    with ThreadPoolExecutor(4) as pool:
        statuses = [s for chunk in pool.map(send, [BULK_KEYS[i::4] for i in range(4)])
                    for s in chunk]
    assert set(statuses) == {429}
    r = requests.post(server.url + "/v1/completions", headers=_auth(BULK_KEYS[0]), json=body)
    assert "token budget" in _openai_error(r, 429)["message"]
    assert _engine_stats(server)["rate_limit_keys"] == MAX_KEYS


# ---- input limits -----------------------------------------------------------------------------

def test_body_over_the_limit_gets_413_in_each_shape(server):
    big = {"prompt": "x" * MAX_BODY, "max_tokens": 1}
    r = requests.post(server.url + "/v1/completions", headers=_auth(), json=big)
    assert _openai_error(r, 413)["code"] == "request_too_large"
    r = requests.post(server.url + "/v1/messages", headers={"x-api-key": FLAG_KEY}, json=big)
    assert _anthropic_error(r, 413)["type"] == "request_too_large"

    def chunks():       # chunked: no Content-Length, the limit is enforced while reading
        for _ in range(MAX_BODY // 4096 + 2):
            yield b" " * 4096
    r = requests.post(server.url + "/tokenize", headers=_auth(), data=chunks())
    _openai_error(r, 413)


def test_headers_over_the_limit_get_431(server):
    r = requests.get(server.url + "/v1/models", headers={**_auth(), "x-pad": "a" * 20_000})
    assert _openai_error(r, 431)["code"] == "request_header_fields_too_large"
    # a head that arrives in pieces is cut by h11 once it outgrows the limit
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-a: " + b"a" * 10_000 + b"\r\n")
        time.sleep(0.2)
        s.sendall(b"X-b: " + b"b" * 10_000 + b"\r\n")
        answer = _recv_all(s)
    assert answer.startswith(b"HTTP/1.1 431") and b'"error"' in answer


def test_malformed_http_gets_400_json(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: zz\r\n\r\n")
        answer = _recv_all(s)
    assert answer.startswith(b"HTTP/1.1 400") and b'"invalid_request_error"' in answer


def _recv_all(s: socket.socket) -> bytes:
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def test_slow_body_gets_408_and_slowloris_head_is_cut(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        start = time.monotonic()
        s.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nx-api-key: " + FLAG_KEY.encode()
                  + b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
        answer = _recv_all(s)
        waited = time.monotonic() - start
    assert answer.startswith(b"HTTP/1.1 408") and b'"timeout_error"' in answer
    assert b'"type":"error"' in answer                    # the Anthropic shape on /v1/messages
    assert TIMEOUT_S - 0.1 <= waited < TIMEOUT_S + 3
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        start = time.monotonic()
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
        answer = b""
        try:
            for i in range(40):                           # a header line every 0.25 s
                time.sleep(0.25)
                s.sendall(b"X-%d: y\r\n" % i)
        except OSError:
            pass
        answer = _recv_all(s)
        waited = time.monotonic() - start
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert waited < TIMEOUT_S + 3


def test_json_limits_get_400(server):
    def post(raw: bytes, path: str = "/v1/completions"):
        return requests.post(server.url + path, data=raw, headers={
            **_auth(), "Content-Type": "application/json"})

    for raw in (b"[" * 60_000, b'{"a":' * 10_000, b'{"prompt": ' + b"[" * 70 + b"1" + b"]" * 70
                + b"}"):
        assert "deeper than 64" in _openai_error(post(raw), 400)["message"]
    for raw in (b'{"prompt": "a", "temperature": NaN}', b'{"prompt": "a", "top_p": Infinity}',
                b'{"prompt": "a", "temperature": -Infinity}', b'{"prompt": "a", "n": 1e400}'):
        _openai_error(post(raw), 400)
    for raw in (b'{"prompt": "a", "seed": 18446744073709551615}',
                b'{"prompt": "a", "max_tokens": 9223372036854775808}',
                b'{"prompt": [1, 18446744073709551615]}'):
        assert "64 bits" in _openai_error(post(raw), 400)["message"]
    _openai_error(post(b'{"tokens": [-9223372036854775809]}', "/detokenize"), 400)
    r = post(b'{"prompt": "a", "max_tokens": 123456789012345678901234567890}')
    assert _openai_error(r, 400)["param"] == "max_tokens"     # a float once parsed: not an int
    for raw in (b'{"prompt": "\xff\xfe"}', b'{"prompt": "\xed\xa0\x80"}', b'{"prompt": "\\ud800"}',
                b"\x80"):
        assert "not valid JSON" in _openai_error(post(raw), 400)["message"]
    messages = [{"role": "user", "content": "a"}] * (MAX_MESSAGES + 1)
    r = post(json.dumps({"messages": messages}).encode(),
             "/v1/chat/completions")
    assert _openai_error(r, 400)["param"] == "messages"
    r = post(b'{"messages": ' + json.dumps(messages).encode()
             + b', "max_tokens": 1, "model": "m"}', "/v1/messages")
    assert _anthropic_error(r, 400)["type"] == "invalid_request_error"
    for max_tokens in (64, 10**6, 2**62):
        r = post(b'{"prompt": "a", "max_tokens": %d}' % max_tokens)
        assert _openai_error(r, 400)["code"] == "context_length_exceeded"
    assert post(b'{"prompt": "a", "max_tokens": 0}').status_code == 400
    assert post(b"").status_code == 400 and post(b"  ").status_code == 400


def test_parse_json_limits_without_a_server():
    """What the body limit hides at HTTP level: strings longer than 8 Mi characters."""
    with pytest.raises(APIError) as e:
        limits.parse_json(b'{"prompt": "' + b"a" * (limits.MAX_STRING_CHARS + 1) + b'"}', 10)
    assert e.value.status == 400 and "longer than" in e.value.message
    with pytest.raises(APIError):
        limits.parse_json(b'{"' + b"k" * (limits.MAX_STRING_CHARS + 1) + b'": 1}', 10)
    nested = b"[" * 64 + b"]" * 64
    assert limits.parse_json(nested, 10) == eval(nested.decode())   # 64 levels are fine
    with pytest.raises(APIError):
        limits.parse_json(b"[" + nested + b"]", 10)


def test_server_survived_everything(server):
    assert {w for c in server.children() for w in children_of(c)} == server.workers
    r = requests.post(server.url + "/v1/chat/completions", headers=_auth(FILE_KEY), json=CHAT)
    assert r.status_code == 200, r.text
    assert server.proc.poll() is None
