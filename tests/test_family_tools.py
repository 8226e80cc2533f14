"""The Gemma 4, MiniMax M2, DeepSeek V3 and Mistral tool-call formats end to end through `met
serve` and the official `openai` SDK: a full round trip (the model calls get_weather, the client
sends the result back, the model answers) with --tool-call-parser gemma4, minimax_xml,
deepseek_v3 and mistral, on the scripted test model (tests.scripted_model: a tiny random model
never writes a call), streamed equal to non-streamed. The mistral one runs on Mistral v0.3's
tokenizer layout and chat template (tests.tiny_models.write_mistral_tokenizer): [TOOL_CALLS] is
a special token the output keeps, and the call id the server makes is one the template accepts
back (9 characters). And the tiny random Gemma 4, MiniMax M2, Nemotron-H and Mistral checkpoints
themselves served by `met serve` on the CPU backend (their tool parser picked by model type),
answering a chat request with tools identically streamed and not."""
from __future__ import annotations

import json

import openai
import pytest

from tests.scripted_model import SERVE_ENV, make_scripted_model, write_scripted_checkpoint
from tests.serving import Server
from tests.tiny_models import make_tiny_family, write_mistral_tokenizer, write_qwen_tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"}}}}}
CALLS = {
    "gemma4": '<|tool_call>call:get_weather{city:<|"|>Paris, FR<|"|>,days:3}<tool_call|>',
    "minimax_xml": ('<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris, FR'
                    '</parameter>\n<parameter name="days">3</parameter>\n</invoke>\n</minimax:tool_call>'),
    "deepseek_v3": ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
                    '{"city": "Paris, FR", "days": 3}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
    "mistral": '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris, FR", "days": 3}}]',
}
ANSWER = "It is 18C and sunny in Paris."


def _scripts(parser: str) -> list[dict]:
    return [{"when": "weather in Paris", "reply": "Let me check.\n" + CALLS[parser]},
            {"when": "18C, sunny", "reply": ANSWER}]


@pytest.fixture(scope="module", params=sorted(CALLS))
def scripted(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "mistral":
        write_mistral_tokenizer(root / "tokenizer")
        path = write_scripted_checkpoint(root / "model", root / "tokenizer", _scripts("mistral"),
                                         eos_token="</s>", reply_after=["[/INST]", "[/TOOL_RESULTS]"])
    else:
        path = make_scripted_model(root / "model", _scripts(request.param))
    args = ["serve", path, "--model-name", "m", "--frontends", "1", "--max-seq-len", "2048",
            "--no-event-log", "--tool-call-parser", request.param]
    with Server(args, root / "serve.log", env=SERVE_ENV).serving() as srv:
        yield request.param, openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)


def _streamed(client, **kw):
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model="m", stream=True, **kw):
        ch = chunk.choices[0]
        content += ch.delta.content or ""
        for tc in ch.delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            entry["name"] = tc.function.name or entry["name"]
            entry["arguments"] += tc.function.arguments or ""
        finish = ch.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_tool_round_trip(scripted):
    _, scripted = scripted
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = scripted.chat.completions.create(model="m", messages=messages, tools=[WEATHER])
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris, FR", "days": 3}
    content, calls, finish = _streamed(scripted, messages=messages, tools=[WEATHER])
    assert (content, finish) == ("Let me check.", "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Paris, FR", "days": 3})]
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": "18C, sunny"}'}]
    second = scripted.chat.completions.create(model="m", messages=messages, tools=[WEATHER])
    assert second.choices[0].message.content == ANSWER
    assert second.choices[0].finish_reason == "stop" and not second.choices[0].message.tool_calls


@pytest.mark.parametrize("scripted", ["mistral"], indirect=True)
def test_mistral_call_ids_fit_its_template(scripted):
    """Mistral's templates refuse tool-call ids that are not 9 characters: the server's ids
    for the mistral format are (the round trip above then renders), and a client's id of
    another shape gets the template's own refusal as a 400 invalid_request_error."""
    _, scripted = scripted
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    (call,) = scripted.chat.completions.create(model="m", messages=messages, tools=[WEATHER]).choices[0].message.tool_calls
    assert len(call.id) == 9 and call.id.isalnum()
    bad = messages + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0123456789", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_0123456789", "content": "18C"}]
    with pytest.raises(openai.BadRequestError) as err:
        scripted.chat.completions.create(model="m", messages=bad, tools=[WEATHER])
    assert "length 9" in err.value.message and err.value.body["param"] == "messages"


@pytest.mark.parametrize("arch", ["gemma4_moe", "minimax_m2", "nemotron_h_moe", "mistral_swa"])
def test_the_tiny_checkpoint_serves_chat_with_tools(arch, tmp_path):
    path = make_tiny_family(arch, tmp_path / "model", max_position_embeddings=4096)
    (write_mistral_tokenizer if arch.startswith("mistral") else write_qwen_tokenizer)(path)
    args = ["serve", path, "--model-name", "m", "--frontends", "1", "--max-seq-len", "1024",
            "--no-event-log"]
    with Server(args, tmp_path / "serve.log").serving() as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
        kw = dict(messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=[WEATHER],
                  max_tokens=12, temperature=0)
        whole = client.chat.completions.create(model="m", **kw).choices[0]
        content, calls, finish = _streamed(client, **kw)
        assert whole.finish_reason in ("length", "stop", "tool_calls")
        assert (content, finish) == (whole.message.content or "", whole.finish_reason)
        assert len(calls) == len(whole.message.tool_calls or [])
