"""The real default model (SmolLM2-135M-Instruct, GGUF Q4_1) served by `met serve --device cuda`
on the GPU: it answers the Paris question, streamed equals non-streamed, concurrent greedy
requests get the answer a lone request gets, and the GPU's greedy completion starts like the CPU
backend's (fp32, the spec) on the same weights."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.assets import smollm2_gguf_path
from tests.serving import Server

pytestmark = pytest.mark.gpu

MODEL = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    logs = tmp_path_factory.mktemp("gpu_serve")
    srv = Server(["serve", str(smollm2_gguf_path()), "--model-name", MODEL, "--device", "cuda",
                  "--frontends", "2", "--max-seq-len", "1024", "--max-batch-size", "16",
                  "--no-event-log"], logs / "serve.log")
    try:
        srv.wait_healthy(600)
        yield srv
    finally:
        print(srv.tail(3000))
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=300)


def test_gpu_answers_paris(client):
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24,
                                         temperature=0)
    text = out.choices[0].message.content
    print("GPU answer:", repr(text))
    assert "Paris" in text


def test_gpu_streamed_equals_non_streamed_and_concurrent_equals_alone(client):
    alone = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16,
                                           temperature=0).choices[0].message.content
    chunks = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16,
                                            temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == alone

    def one(_):
        return client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16,
                                              temperature=0).choices[0].message.content

    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(one, range(12)))
    # bf16 batches of other sizes may round differently; the answer to this question must not
    assert all("Paris" in a for a in answers), answers


def test_gpu_completion_starts_like_the_cpu_backend(client):
    from metrale.llm import LLM
    from metrale.sampling import SamplingParams

    prompt = "The capital of France is"
    gpu = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4,
                                    temperature=0).choices[0].text
    cpu = LLM(str(smollm2_gguf_path()), device="cpu", max_seq_len=256).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=4))[0].text
    print("GPU:", repr(gpu), "CPU:", repr(cpu))
    assert gpu.startswith(" Paris") and cpu.startswith(" Paris")
