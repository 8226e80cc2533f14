"""The real default model (SmolLM2-135M-Instruct, GGUF Q4_1) served by `met serve --device cuda`
on the GPU: it answers the Paris question, streamed equals non-streamed, concurrent greedy
requests all answer it, and the GPU's greedy completion starts like the CPU backend's (fp32, the
spec) on the same weights. Plain httpx (the GPU image has no openai SDK).

Precision note, measured: for "What is the capital of France?" the fp32 model's first answer
token is a near-tie ("The" 25.325 vs "L" 25.243 logits, a 0.08 gap, 0.3 % of the logit scale).
Any bf16 engine may flip it: HF transformers in bf16 moves that position's logits by 2.9e-2 of
the max logit, ours (H200) by 1.3e-2, and ours picks "L'Étoile, ...". So the served question is
phrased "Name the capital of France." (smallest top-1/top-2 gap over the first 8 answer tokens in
fp32: 1.02), and the original phrasing is checked with the near-tie rule of test_gpu_models.py:
GPU and CPU agree token for token until a position where the CPU's own top-2 gap is within bf16's
error there."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.assets import smollm2_gguf_path
from tests.serving import Server

pytestmark = pytest.mark.gpu

MODEL = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "Name the capital of France."}]
NEAR_TIE = [{"role": "user", "content": "What is the capital of France?"}]
BF16_LOGIT_ERR = 0.4   # max |logit error| of bf16 at these positions: 1.3e-2 x ~25 (measured), rounded up


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    logs = tmp_path_factory.mktemp("gpu_serve")
    srv = Server(["serve", str(smollm2_gguf_path()), "--model-name", MODEL, "--device", "cuda",
                  "--frontends", "2", "--max-seq-len", "1024", "--max-batch-size", "16",
                  "--no-event-log"], logs / "serve.log")
    with srv.serving(600, workers=2):
        try:
            yield srv
        finally:
            print(srv.tail(3000))   # the engine's startup log (sizes, graphs) in the GPU run's log


def _chat(url, **kw):
    r = httpx.post(url + "/v1/chat/completions", timeout=300,
                   json={"model": MODEL, "messages": CHAT, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_gpu_answers_paris(server):
    text = _chat(server.url, max_tokens=24)
    print("GPU answer:", repr(text))
    assert "Paris" in text


def test_gpu_streamed_equals_non_streamed_and_concurrent_all_answer(server):
    alone = _chat(server.url, max_tokens=16)
    parts = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=300,
                      json={"model": MODEL, "messages": CHAT, "temperature": 0,
                            "max_tokens": 16, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk["choices"]:
                    parts.append(chunk["choices"][0]["delta"].get("content") or "")
    assert "".join(parts) == alone
    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(lambda _: _chat(server.url, max_tokens=16), range(12)))
    # bf16 batches of other sizes may round differently; the answer to this question must not
    assert all("Paris" in a for a in answers), answers


def test_gpu_completion_starts_like_the_cpu_backend(server):
    from metrale.llm import LLM
    from metrale.sampling import SamplingParams

    prompt = "The capital of France is"
    r = httpx.post(server.url + "/v1/completions", timeout=300,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    gpu = r.json()["choices"][0]["text"]
    cpu = LLM(str(smollm2_gguf_path()), device="cpu", max_seq_len=256).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=4))[0].text
    print("GPU:", repr(gpu), "CPU:", repr(cpu))
    assert gpu.startswith(" Paris") and cpu.startswith(" Paris")


def test_gpu_near_tie_question_agrees_with_cpu_until_a_near_tie():
    from metrale.llm import LLM
    from metrale.sampling import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=16, logprobs=2)
    outs = {}
    for device in ("cpu", "cuda"):
        llm = LLM(str(smollm2_gguf_path()), device=device, max_seq_len=256)
        outs[device] = llm.chat(NEAR_TIE, params)[0]
        del llm
    cpu, gpu = outs["cpu"], outs["cuda"]
    print("CPU:", repr(cpu.text), "GPU:", repr(gpu.text))
    assert "Paris" in cpu.text
    diverge = next((i for i, (a, b) in enumerate(zip(cpu.token_ids, gpu.token_ids)) if a != b), None)
    if diverge is None:
        return
    top = cpu.logprobs[diverge].top_logprobs
    gap = top[0][1] - top[1][1]
    print(f"diverges at answer token {diverge}: CPU (fp32) top-1/top-2 gap {gap:.3f}, "
          f"GPU took the CPU's #{[t for t, _ in top].index(gpu.token_ids[diverge]) + 1 if gpu.token_ids[diverge] in [t for t, _ in top] else '>2'}")
    assert gap <= BF16_LOGIT_ERR
    assert gpu.token_ids[diverge] == top[1][0]   # the runner-up, not some other token
