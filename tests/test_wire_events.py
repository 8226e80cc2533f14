"""Wire framing round-trips and the event journal's replay / torn-tail behaviour (damage of
every other kind: tests/test_journal.py)."""
import os

import pytest

from metrale import wire
from metrale.events import FinishedRequests, Journal
from metrale.sampling import SamplingParams


def test_submit_round_trip_keeps_tokens_and_params():
    msg = wire.Submit("r1", "fe-1", (1, 2, 3, 70000), SamplingParams(temperature=0.5, max_tokens=9))
    frames = wire.encode(msg)
    assert frames[0] == b"submit" and len(frames[2]) == 16  # raw int32 frame, no JSON tokens
    assert wire.decode(frames) == msg


def test_step_output_round_trip_with_logprobs_and_finish():
    d1 = wire.TokenDelta("a", (5,), None, 3, 1, 0, ((-0.5, ((5, -0.5), (6, -1.5))),))
    d2 = wire.TokenDelta("b", (), "stop", 4, 7, 2)
    msg = wire.StepOutput("fe", (d1, d2))
    assert wire.decode(wire.encode(msg)) == msg


def test_step_output_carries_numpy_scalars_and_refuses_malformed_deltas():
    import numpy as np

    d = wire.TokenDelta("a", (np.int64(5),), None, 3, 1, 0,
                        ((np.float32(-0.5), ((np.int64(5), np.float64(-0.5)),)),))
    got = wire.decode(wire.encode(wire.StepOutput("fe", (d,)))).deltas[0]
    assert got.token_ids == (5,) and got.logprobs == ((-0.5, ((5, -0.5),)),)
    for bad in (b'{"frontend_id": "fe", "deltas": [["a", [1]]]}',          # too few fields
                b'{"frontend_id": "fe", "deltas": [[7, [1], null, 0, 0, 0, [], null, 0]]}'):
        with pytest.raises(ValueError):
            wire.decode([b"step", bad])


def test_simple_messages_and_malformed_frames():
    for m in (wire.Abort("r", "disconnect"), wire.RateLimitCheck("k", 1), wire.Heartbeat("fe"),
              wire.ControlReply(True, {"ok": 1})):
        assert wire.decode(wire.encode(m)) == m
    with pytest.raises(ValueError):
        wire.decode([b"submit", b"{not json"])
    with pytest.raises(ValueError):
        wire.decode([b"nope", b"{}"])
    with pytest.raises(ValueError):
        wire.decode([])


def test_journal_sequence_numbers_survive_reopen(tmp_path):
    j = Journal(tmp_path)
    for i in range(5):
        j.append("RequestAdmitted", request_id=f"r{i}")
    j.close()
    j2 = Journal(tmp_path)
    assert j2.next_seq == 6
    assert [e["seq"] for e in j2.replay()] == [1, 2, 3, 4, 5]
    assert [e["request_id"] for e in j2.replay(from_seq=4)] == ["r3", "r4"]


def test_torn_tail_is_truncated_not_fatal(tmp_path):
    j = Journal(tmp_path)
    j.append("RequestFinished", request_id="a", reason="stop")
    j.append("RequestFinished", request_id="b", reason="length")
    j.close()
    seg = j.segments()[-1]
    size = seg.stat().st_size
    with open(seg, "ab") as f:
        f.write(b"\x40\x00\x00\x00\x01\x02")  # a half-written record
    j2 = Journal(tmp_path)
    assert j2.num_truncated_bytes == 6 and seg.stat().st_size == size
    assert j2.next_seq == 3
    j2.append("RequestFinished", request_id="c", reason="stop")
    view = FinishedRequests.from_journal(j2)
    assert sorted(view.records) == ["a", "b", "c"]
    assert view.records["b"]["reason"] == "length"


def test_model_info_from_a_quirky_checkpoint_is_json_safe_and_round_trips():
    raw_tokenizer = {"model_max_length": 1000000000000000019884624838656,
                     "eos_token": {"content": "<|im_end|>", "lstrip": False},
                     "bos_token": None, "pad_token": "<|endoftext|>", "add_bos_token": False,
                     "chat_template": "{{ messages }}", "added_tokens_decoder": {"1": {}}}
    raw_generation = {"eos_token_id": [2, 3], "bos_token_id": 1, "temperature": 0.7,
                      "top_k": 10**30, "top_p": float("nan"), "transformers_version": "5"}
    info = wire.ModelInfo.from_checkpoint_configs(raw_tokenizer, raw_generation, name="m",
                                                  max_seq_len=128)
    assert info.tokenizer_config == {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                                     "add_bos_token": False}
    assert info.generation_config == {"eos_token_id": [2, 3], "bos_token_id": 1,
                                      "temperature": 0.7}
    reply = wire.decode(wire.encode(wire.ControlReply(True, info.to_dict())))
    assert wire.ModelInfo.from_dict(reply.data) == info
    assert wire.ModelInfo.from_dict({**info.to_dict(), "added_later": 1}) == info


def test_model_info_refuses_fields_of_the_wrong_shape():
    good = wire.ModelInfo("m").to_dict()
    for bad in ({"max_seq_len": "128"}, {"tokenizer_config": {"model_max_length": 10**30}},
                {"generation_config": {"eos_token_id": -1}}, {"name": None},
                {"rate_limit_enabled": 1}, {"frontend": {"x": object()}}):
        with pytest.raises(ValueError):
            wire.ModelInfo.from_dict({**good, **bad})


def test_submit_prompt_is_one_int32_array_from_frontend_to_request():
    import numpy as np

    from metrale.request import Request

    msg = wire.Submit("r", "fe", [1, 2, 3], SamplingParams())
    assert msg.prompt_token_ids.dtype == np.int32
    got = wire.decode(wire.encode(msg))
    assert got.prompt_token_ids.dtype == np.int32 and not got.prompt_token_ids.flags.writeable
    req = Request("r", got.prompt_token_ids, got.sampling_params)
    assert req.prompt_token_ids is got.prompt_token_ids and req.all_token_ids == [1, 2, 3]
    with pytest.raises(ValueError):
        wire.Submit("r", "fe", [2**40], SamplingParams())


def test_speculative_counts_travel_on_a_requests_last_delta_only():
    live = wire.TokenDelta("a", (5, 6), None, 3, 2, 0, num_verifies=1, num_draft_tokens=2,
                           num_accepted_tokens=1)
    last = live._replace(token_ids=(7,), finish_reason="stop", num_output_tokens=3)
    got = wire.decode(wire.encode(wire.StepOutput("fe", (live, last)))).deltas
    assert got[0] == live._replace(num_verifies=0, num_draft_tokens=0, num_accepted_tokens=0)
    assert got[1] == last and got[1].finished
    with pytest.raises(ValueError):      # neither 9 nor 12 fields
        wire.decode([b"step", b'{"frontend_id": "fe", "deltas": [["a", [1], null, 0, 0, 0, [], null, 0, 1]]}'])
