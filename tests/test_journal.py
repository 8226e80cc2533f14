"""The event journal under damage: a torn tail is truncated (and logged), anything else is
corruption that costs only the damaged record (skipped, logged with offset and seq), a seq is
never reused, old-format (v1) journals are still read, and one process holds a folder."""
import json
import logging
import struct
import subprocess
import sys
import zlib

import orjson
import pytest

from metrale.events import (HEADER_BYTES, FinishedRequests, Journal, JournalLocked,
                            read_events)
from tests.serving import REPO


def _write(tmp_path, n, **kw):
    j = Journal(tmp_path, **kw)
    offsets = []
    for i in range(1, n + 1):
        j.flush()
        seg = j.segments()[-1] if j.segments() else None
        offsets.append((seg, seg.stat().st_size if seg else 0))
        j.append("TokensEmitted", counts={f"r{i}": i})
    j.close()
    return offsets      # (segment, offset) of each record, seq i at index i - 1


def _flip(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def _seqs(tmp_path):
    return [e["seq"] for e in read_events(tmp_path)]


def test_a_flipped_bit_in_record_50_costs_only_record_50(tmp_path, caplog):
    offsets = _write(tmp_path, 155)
    seg, off = offsets[49]
    _flip(seg, off + HEADER_BYTES + 5)                 # inside seq 50's payload
    size = seg.stat().st_size
    with caplog.at_level(logging.WARNING, logger="metrale.events"):
        j = Journal(tmp_path)
    assert seg.stat().st_size == size and j.num_truncated_bytes == 0
    assert [e["seq"] for e in j.replay()] == [s for s in range(1, 156) if s != 50]
    assert j.next_seq == 156
    assert f"CRC mismatch at offset {off}" in caplog.text and "seq 50" in caplog.text
    assert j.append("RequestAdmitted", request_id="x")["seq"] == 156
    j.close()
    assert _seqs(tmp_path)[-2:] == [155, 156]


def test_a_corrupt_length_resyncs_at_the_next_record_and_reserves_seqs(tmp_path, caplog):
    offsets = _write(tmp_path, 155)
    seg, off = offsets[49]
    _flip(seg, off + 12)                               # seq 50's length field
    with caplog.at_level(logging.WARNING, logger="metrale.events"):
        j = Journal(tmp_path)
    assert [e["seq"] for e in j.replay()] == [s for s in range(1, 156) if s != 50]
    assert j.next_seq == 156
    assert f"unreadable record header at offset {off}" in caplog.text
    assert "after seq 49" in caplog.text
    j.close()


def test_a_corrupt_last_record_is_kept_and_its_seq_never_reused(tmp_path, caplog):
    offsets = _write(tmp_path, 20)
    seg, off = offsets[19]
    size = seg.stat().st_size
    _flip(seg, size - 3)                               # seq 20's payload, the file's last bytes
    with caplog.at_level(logging.WARNING, logger="metrale.events"):
        j = Journal(tmp_path)
    assert seg.stat().st_size == size                  # not a torn tail: nothing truncated
    assert j.next_seq == 21 and "seq 20" in caplog.text
    j.append("RequestAdmitted", request_id="after")
    j.close()
    assert _seqs(tmp_path) == [*range(1, 20), 21]


def test_an_unreadable_last_header_reserves_every_seq_it_may_hold(tmp_path):
    offsets = _write(tmp_path, 20)
    seg, off = offsets[19]
    _flip(seg, off)                                    # seq 20's magic: no seq readable
    j = Journal(tmp_path)
    assert j.next_seq > 20                             # whatever it held stays unused
    j.close()


def test_a_torn_tail_is_truncated_and_logged(tmp_path, caplog):
    offsets = _write(tmp_path, 10)
    seg, off = offsets[9]
    with open(seg, "r+b") as f:
        f.truncate(off + HEADER_BYTES + 3)             # seq 10 cut short mid-payload
    with caplog.at_level(logging.WARNING, logger="metrale.events"):
        j = Journal(tmp_path)
    assert seg.stat().st_size == off and j.num_truncated_bytes == HEADER_BYTES + 3
    assert "torn tail" in caplog.text and f"offset {off}" in caplog.text
    assert j.next_seq == 10            # the torn seq 10 was never published (nor acknowledged)
    j.close()
    with open(seg, "ab") as f:
        f.write(b"MJ\xff")                             # a header cut short
    j = Journal(tmp_path)
    assert seg.stat().st_size == off and j.next_seq == 10
    j.close()


def test_damage_in_an_older_segment_is_skipped_not_fatal(tmp_path, caplog):
    offsets = _write(tmp_path, 30, segment_bytes=600)
    segs = Journal(tmp_path, segment_bytes=600)
    assert len(segs.segments()) > 2
    segs.close()
    seg, off = offsets[1]
    assert seg == segs.segments()[0]
    _flip(seg, off + HEADER_BYTES + 2)
    with caplog.at_level(logging.WARNING, logger="metrale.events"):
        j = Journal(tmp_path, segment_bytes=600)
    assert [e["seq"] for e in j.replay()] == [s for s in range(1, 31) if s != 2]
    assert j.next_seq == 31 and "seq 2" in caplog.text
    j.close()


def _v1_record(event: dict) -> bytes:
    payload = orjson.dumps(event)
    return struct.pack("<II", len(payload), zlib.crc32(payload)) + payload


def test_a_v1_journal_is_read_resynced_and_never_appended_to(tmp_path):
    records = [_v1_record({"seq": s, "type": "RequestFinished", "ts": 0.0,
                           "request_id": f"r{s}", "reason": "stop"}) for s in range(1, 8)]
    data = bytearray(b"".join(records))
    data[len(b"".join(records[:3])) + 20] ^= 0x10      # seq 4's payload
    old = tmp_path / "journal-000000000001.log"
    old.write_bytes(bytes(data))
    j = Journal(tmp_path)
    assert j.next_seq == 8
    j.append("RequestFinished", request_id="new", reason="length")
    j.close()
    assert old.read_bytes() == bytes(data)             # the v1 segment is left as it was
    assert len(j.segments()) == 2
    assert _seqs(tmp_path) == [1, 2, 3, 5, 6, 7, 8]
    assert sorted(FinishedRequests.from_journal(tmp_path).records) == [
        "new", "r1", "r2", "r3", "r5", "r6", "r7"]


def test_a_v1_torn_tail_is_truncated(tmp_path):
    records = b"".join(_v1_record({"seq": s, "type": "ModelLoaded", "ts": 0.0})
                       for s in range(1, 4))
    old = tmp_path / "journal-000000000001.log"
    old.write_bytes(records + b"\x40\x00\x00\x00\x01\x02")
    j = Journal(tmp_path)
    assert old.read_bytes() == records and j.next_seq == 4
    j.close()


def test_a_second_writer_is_refused_naming_the_folder_and_the_pid(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from metrale.events import Journal; "
         f"j = Journal({str(tmp_path)!r}); print('held', flush=True); sys.stdin.read()"],
        cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(JournalLocked) as err:
            Journal(tmp_path)
        assert str(tmp_path) in str(err.value) and f"pid {holder.pid}" in str(err.value)
    finally:
        holder.stdin.close()
        holder.wait(10)
    Journal(tmp_path).close()          # the holder is gone: the folder is free again


def _met_events(folder, *args):
    return subprocess.run([sys.executable, "-m", "metrale.cli", "events", "--event-log",
                           str(folder), *args], cwd=REPO, capture_output=True, text=True,
                          timeout=60)


def test_met_events_says_when_it_skips_a_corrupt_record(tmp_path):
    offsets = _write(tmp_path, 12)
    seg, off = offsets[4]
    _flip(seg, off + HEADER_BYTES + 4)
    out = _met_events(tmp_path, "--no-follow", "--from-seq", "1")
    assert out.returncode == 0, out.stderr
    assert [json.loads(ln)["seq"] for ln in out.stdout.splitlines()] == [
        s for s in range(1, 13) if s != 5]
    assert "skipped a corrupt record" in out.stderr
    assert f"offset {off}" in out.stderr and "seq 5" in out.stderr


def test_met_events_without_a_live_engine_says_so(tmp_path):
    _write(tmp_path, 2)
    out = _met_events(tmp_path)                        # no engine.json: nothing to follow
    assert out.returncode != 0 and "no engine to follow" in out.stderr
    (tmp_path / "engine.json").write_text(json.dumps(
        {n: f"ipc://{tmp_path}/{n}" for n in ("submit", "output", "control", "events")}
        | {"pid": 1}))                                 # left by an engine that is gone
    out = _met_events(tmp_path)
    assert out.returncode != 0 and "no engine answers" in out.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    out = _met_events(empty, "--no-follow", "--from-seq", "1")
    assert out.returncode == 0 and "holds no events" in out.stderr
