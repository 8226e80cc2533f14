"""Events (every change of engine state, past tense) and the append-only journal.

An event is a dict with a global sequence number `seq`, a `type` and a wall-clock `ts`, plus
the fields of its type. The journal stores them as records in segment files:

    record  = u32 length | u32 crc32(payload) | payload (orjson)
    segment = journal-<first seq, 12 digits>.log, rotated past `segment_bytes`

On open the journal is replayed; a torn tail (short record or bad CRC at the end of the last
segment: the process died mid-write) is truncated, never fatal. A bad record in the middle of
an older segment is corruption and is reported with the file and offset.
"""
from __future__ import annotations

import os
import struct
import time
import zlib
from pathlib import Path
from typing import Iterator

import orjson

EVENT_TYPES = (
    "ModelLoaded", "ModelReleased",
    "RequestAdmitted", "RequestRejected", "TokensEmitted", "RequestFinished", "RequestAborted",
    "RequestPreempted", "ResponseStored", "ConversationAppended",
)

_HEADER = struct.Struct("<II")
_SEGMENT_BYTES = 64 * 2**20


class JournalError(RuntimeError):
    pass


def _segment_name(first_seq: int) -> str:
    return f"journal-{first_seq:012d}.log"


class Journal:
    def __init__(self, directory: str | os.PathLike, segment_bytes: int = _SEGMENT_BYTES,
                 fsync: bool = False):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.segment_bytes = segment_bytes
        self.fsync = fsync
        self.next_seq = 1
        self.num_truncated_bytes = 0
        for event in self.replay():
            self.next_seq = event["seq"] + 1
        self._file = None

    # -- reading ----------------------------------------------------------------------------
    def segments(self) -> list[Path]:
        return sorted(self.dir.glob("journal-*.log"))

    def replay(self, from_seq: int = 0) -> Iterator[dict]:
        """Every stored event with seq >= from_seq, in order; truncates a torn tail."""
        segs = self.segments()
        for i, path in enumerate(segs):
            yield from (e for e in self._read_segment(path, last=i == len(segs) - 1)
                        if e["seq"] >= from_seq)

    def _read_segment(self, path: Path, last: bool) -> Iterator[dict]:
        data = path.read_bytes()
        off = 0
        while off < len(data):
            bad = self._bad_record(data, off)
            if bad:
                if not last:
                    raise JournalError(f"{path}: {bad} at offset {off} (not the tail: corrupt)")
                self.num_truncated_bytes += len(data) - off
                with open(path, "r+b") as f:
                    f.truncate(off)
                return
            length, _ = _HEADER.unpack_from(data, off)
            yield orjson.loads(data[off + 8: off + 8 + length])
            off += 8 + length

    @staticmethod
    def _bad_record(data: bytes, off: int) -> str | None:
        if off + 8 > len(data):
            return "short record header"
        length, crc = _HEADER.unpack_from(data, off)
        payload = data[off + 8: off + 8 + length]
        if len(payload) != length:
            return "short record"
        if zlib.crc32(payload) != crc:
            return "CRC mismatch"
        try:
            orjson.loads(payload)
        except orjson.JSONDecodeError:
            return "undecodable record"
        return None

    # -- writing ----------------------------------------------------------------------------
    def append(self, event_type: str, flush: bool = True, **fields) -> dict:
        """Give the event the next sequence number, store it, and return it. With
        flush=False the record stays buffered until `flush()` (the engine flushes once,
        before anything it acknowledges leaves the process)."""
        event = {"seq": self.next_seq, "type": event_type, "ts": time.time(), **fields}
        payload = orjson.dumps(event)
        self._writer().write(_HEADER.pack(len(payload), zlib.crc32(payload)) + payload)
        self.next_seq += 1
        if flush:
            self.flush()
        return event

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()
            if self.fsync:
                os.fsync(self._file.fileno())

    def _writer(self):
        if self._file is not None and self._file.tell() < self.segment_bytes:
            return self._file
        if self._file is not None:
            self._file.close()
        segs = self.segments()
        if segs and segs[-1].stat().st_size < self.segment_bytes:
            path = segs[-1]
        else:
            path = self.dir / _segment_name(self.next_seq)
        self._file = open(path, "ab")
        return self._file

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class FinishedRequests:
    """A view rebuilt from the journal: the record of every finished request by id."""

    def __init__(self):
        self.records: dict[str, dict] = {}

    def apply(self, event: dict) -> None:
        if event["type"] in ("RequestFinished", "RequestAborted"):
            self.records[event["request_id"]] = event

    @classmethod
    def from_journal(cls, journal: Journal) -> "FinishedRequests":
        view = cls()
        for e in journal.replay():
            view.apply(e)
        return view
