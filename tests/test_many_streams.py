"""One box holds >= 512 open streams: 512 concurrent SSE completions against `met serve` with two
frontend workers (ASGI: one event loop per worker holds hundreds of streams) all finish, each
with its own usage, none refused, and the engine ends with no request in flight."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.serving import Server, make_tiny_chat_model, metric

NUM_STREAMS = 512


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_chat_model(tmp_path_factory.mktemp("tiny") / "tiny-llama")
    logs = tmp_path_factory.mktemp("serve")
    with Server(["serve", str(model), "--frontends", "2", "--max-batch-size", "128",
                 "--max-num-seqs", str(NUM_STREAMS), "--max-seq-len", "256",
                 "--no-event-log"], logs / "serve.log").serving(workers=2) as srv:
        yield srv


async def _stream(client: httpx.AsyncClient, url: str, model: str, i: int,
                  opened: asyncio.Event, counter: list[int]) -> tuple[int, int, str]:
    body = {"model": model, "prompt": [5 + i % 200, 7, 9], "max_tokens": 2 + i % 3,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    text, usage = "", None
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        counter[0] += 1
        if counter[0] == NUM_STREAMS:
            opened.set()
        await opened.wait()          # every stream is open at the same time before any is read
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices"):
                    text += chunk["choices"][0].get("text") or ""
                if chunk.get("usage"):
                    usage = chunk["usage"]
    return i, usage["completion_tokens"], text


def test_512_concurrent_streams(server):
    async def main():
        opened, counter = asyncio.Event(), [0]
        limits = httpx.Limits(max_connections=NUM_STREAMS + 8)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            model = (await client.get(server.url + "/v1/models")).json()["data"][0]["id"]
            return await asyncio.gather(*(_stream(client, server.url, model, i, opened, counter)
                                          for i in range(NUM_STREAMS)))

    results = asyncio.run(main())
    assert len(results) == NUM_STREAMS
    assert all(n == 2 + i % 3 for i, n, _ in results)
    assert metric(server.url, "metrale_requests_active") == 0
