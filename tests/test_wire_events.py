"""Wire framing round-trips and the event journal's replay / torn-tail behaviour."""
import os

import pytest

from metrale import wire
from metrale.events import FinishedRequests, Journal, JournalError


def test_submit_round_trip_keeps_tokens_and_params():
    msg = wire.Submit("r1", "fe-1", (1, 2, 3, 70000), {"temperature": 0.5, "max_tokens": 9},
                      model="m", extra={"stop": ["x"]})
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
    for m in (wire.Abort("r", "disconnect"), wire.Control("stats", {"x": 1}),
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


def test_bad_crc_in_tail_truncates_and_in_old_segment_raises(tmp_path):
    j = Journal(tmp_path, segment_bytes=200)
    for i in range(8):
        j.append("TokensEmitted", counts={f"r{i}": i})
    j.close()
    segs = j.segments()
    assert len(segs) > 1
    data = bytearray(segs[-1].read_bytes())
    data[-2] ^= 0xFF
    segs[-1].write_bytes(bytes(data))
    j2 = Journal(tmp_path, segment_bytes=200)
    assert j2.num_truncated_bytes > 0
    j2.close()
    data = bytearray(segs[0].read_bytes())
    data[10] ^= 0xFF
    segs[0].write_bytes(bytes(data))
    with pytest.raises(JournalError, match="corrupt"):
        Journal(tmp_path, segment_bytes=200)
