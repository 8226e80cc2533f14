"""Events (every change of engine state, past tense) and the append-only journal.

An event is a dict with a global sequence number `seq`, a `type` and a wall-clock `ts`, plus
the fields of its type. The journal stores them as records in segment files named
`journal-<first seq, 12 digits>.log`, rotated past `segment_bytes`. Two record formats:

    v2 (written)  magic "MJ\\xff\\xfe" | u64 seq | u32 length | u32 crc32(payload)
                  | u32 crc32(the 20 bytes before) | payload (orjson)
    v1 (read)     u32 length | u32 crc32(payload) | payload

A segment is v2 when its records carry the magic (bytes that never occur in UTF-8 JSON, and as
a v1 length would be 4 GiB); v1 segments, from before the magic, are read, never appended to.

Damage is found and named, never fatal:
- a torn tail (the last record of the last segment runs past the end of the file, or its header
  is cut short: the process died mid-write) is truncated when the journal is opened for writing;
- anything else that does not check out is corruption: that record is skipped and logged with
  its file, offset and seq, and reading resumes at the next valid record (v2: the next magic with
  a valid header CRC; v1: the next `{"seq":` that starts a record whose CRC checks).
The next seq after a restart is above every seq the journal may hold, corrupt records included
(a corrupt region whose seqs cannot be read is counted as holding as many records as fit), so a
seq is never reused. (A torn tail's seq is free again: the engine publishes an event only once
its flush returned, so nobody saw it.)

One engine writes a journal folder: `Journal` holds an exclusive `fcntl.flock` on
`<folder>/journal.lock` (with its pid inside) and a second one is refused (`JournalLocked`).
That engine writes its socket addresses to `<folder>/engine.json` once it holds the lock, so
`met events` finds it. `read_events` reads a folder without the lock and without changing it.
"""
from __future__ import annotations

import fcntl
import logging
import os
import struct
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import orjson

log = logging.getLogger("metrale.events")

EVENT_TYPES = (
    "ModelLoaded", "ModelReleased", "ModelLoadFailed",
    "RequestAdmitted", "RequestRejected", "TokensEmitted", "RequestFinished", "RequestAborted",
    "RequestPreempted", "ResponseStored", "ConversationAppended",
    # the rest of the store's (metrale.store)
    "ResponseDeleted", "ConversationCreated", "ConversationUpdated", "ConversationItemDeleted",
    "ConversationDeleted", "StoreEvicted",
)

MAGIC = b"MJ\xff\xfe"
_HEAD = struct.Struct("<4sQII")           # magic, seq, length, crc32(payload)
_HEAD_CRC = struct.Struct("<I")
HEADER_BYTES = _HEAD.size + _HEAD_CRC.size
_V1_HEAD = struct.Struct("<II")
_V1_PAYLOAD_START = b'{"seq":'
_SEGMENT_BYTES = 64 * 2**20
LOCK_FILE = "journal.lock"
ADDRESSES_FILE = "engine.json"   # the socket addresses of the engine holding the lock


class JournalError(RuntimeError):
    pass


class JournalLocked(JournalError):
    """Another live process holds the journal folder."""


@dataclass(frozen=True)
class Damage:
    """A region of a segment that holds no readable record."""
    path: Path
    offset: int
    length: int
    reason: str
    seq: int | None = None        # from an intact header; None when the header is unreadable
    after_seq: int | None = None  # the last good seq before it in the segment
    torn: bool = False            # a record cut short at the end of the file

    def describe(self) -> str:
        what = f"seq {self.seq}" if self.seq is not None else (
            f"seq unknown, after seq {self.after_seq}" if self.after_seq else "seq unknown")
        return (f"{self.path}: {self.reason} at offset {self.offset} ({self.length} bytes, "
                f"{what})")


def _segment_name(first_seq: int) -> str:
    return f"journal-{first_seq:012d}.log"


def _segment_first_seq(path: Path) -> int:
    try:
        return int(path.stem.split("-", 1)[1])
    except (IndexError, ValueError):
        return 1


def segments(directory: str | os.PathLike) -> list[Path]:
    return sorted(Path(directory).glob("journal-*.log"))


def encode_record(event: dict) -> bytes:
    payload = orjson.dumps(event)
    head = _HEAD.pack(MAGIC, event["seq"], len(payload), zlib.crc32(payload))
    return head + _HEAD_CRC.pack(zlib.crc32(head)) + payload


# -- reading ------------------------------------------------------------------------------------
def _v2_header(data: bytes, off: int) -> tuple[int, int, int] | None:
    """(seq, length, crc) of an intact v2 header at `off`, else None."""
    if off + HEADER_BYTES > len(data) or data[off:off + 4] != MAGIC:
        return None
    (head_crc,) = _HEAD_CRC.unpack_from(data, off + _HEAD.size)
    if zlib.crc32(data[off:off + _HEAD.size]) != head_crc:
        return None
    _, seq, length, crc = _HEAD.unpack_from(data, off)
    return seq, length, crc


def _next_v2(data: bytes, start: int) -> int | None:
    off = data.find(MAGIC, start)
    while off != -1 and _v2_header(data, off) is None:
        off = data.find(MAGIC, off + 1)
    return None if off == -1 else off


def _decode(payload: bytes, seq: int | None = None) -> dict | None:
    try:
        event = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(event, dict) or not isinstance(event.get("seq"), int):
        return None
    return event if seq is None or event["seq"] == seq else None


def _scan_v2(path: Path, data: bytes) -> Iterator[dict | Damage]:
    off, last_seq = 0, None
    while off < len(data):
        head = _v2_header(data, off)
        if head is None:
            nxt = _next_v2(data, off + 1)
            torn = nxt is None and len(data) - off < HEADER_BYTES
            end = len(data) if nxt is None else nxt
            yield Damage(path, off, end - off, "record header cut short" if torn else
                         "unreadable record header", after_seq=last_seq, torn=torn)
            off = end
            continue
        seq, length, crc = head
        end = off + HEADER_BYTES + length
        if end > len(data):
            yield Damage(path, off, len(data) - off, "record cut short", seq=seq, torn=True)
            return
        payload = data[off + HEADER_BYTES:end]
        event = _decode(payload, seq) if zlib.crc32(payload) == crc else None
        if event is None:
            yield Damage(path, off, end - off, "CRC mismatch", seq=seq, after_seq=last_seq)
        else:
            last_seq = seq
            yield event
        off = end


def _v1_record(data: bytes, off: int) -> dict | None:
    if off < 0 or off + _V1_HEAD.size > len(data):
        return None
    length, crc = _V1_HEAD.unpack_from(data, off)
    payload = data[off + _V1_HEAD.size: off + _V1_HEAD.size + length]
    if len(payload) != length or zlib.crc32(payload) != crc:
        return None
    return _decode(payload)


def _next_v1(data: bytes, start: int) -> int | None:
    pos = data.find(_V1_PAYLOAD_START, start + _V1_HEAD.size)
    while pos != -1 and _v1_record(data, pos - _V1_HEAD.size) is None:
        pos = data.find(_V1_PAYLOAD_START, pos + 1)
    return None if pos == -1 else pos - _V1_HEAD.size


def _scan_v1(path: Path, data: bytes) -> Iterator[dict | Damage]:
    off, last_seq = 0, None
    while off < len(data):
        event = _v1_record(data, off)
        if event is not None:
            last_seq = event["seq"]
            yield event
            off += _V1_HEAD.size + _V1_HEAD.unpack_from(data, off)[0]
            continue
        nxt = _next_v1(data, off + 1)
        end = len(data) if nxt is None else nxt
        yield Damage(path, off, end - off, "unreadable record", after_seq=last_seq,
                     torn=nxt is None and _v1_runs_past_end(data, off))
        off = end


def _v1_runs_past_end(data: bytes, off: int) -> bool:
    if off + _V1_HEAD.size > len(data):
        return True
    return off + _V1_HEAD.size + _V1_HEAD.unpack_from(data, off)[0] > len(data)


def is_v2(data: bytes) -> bool:
    return data.startswith(MAGIC) or (bool(data) and _next_v2(data, 0) is not None)


def scan_segment(path: Path) -> Iterator[dict | Damage]:
    """The segment's events in order, with a `Damage` where a record could not be read."""
    data = path.read_bytes()
    yield from (_scan_v2 if is_v2(data) else _scan_v1)(path, data)


def read_events(directory: str | os.PathLike, from_seq: int = 0,
                on_damage: Callable[[Damage], None] | None = None) -> Iterator[dict]:
    """Every stored event with seq >= from_seq, read-only (no lock, nothing truncated). A torn
    tail of the last segment is the writer at work and passes silently; any other damage is
    skipped and handed to `on_damage`. Segments wholly before from_seq are not read (a
    segment is named by its first seq, so the next one's name bounds it)."""
    segs = segments(directory)
    for i, path in enumerate(segs):
        if from_seq and i + 1 < len(segs) and _segment_first_seq(segs[i + 1]) <= from_seq:
            continue
        for item in scan_segment(path):
            if isinstance(item, Damage):
                if on_damage and not (item.torn and i == len(segs) - 1):
                    on_damage(item)
            elif item["seq"] >= from_seq:
                yield item


def _max_possible_seq(item: Damage, path: Path) -> int:
    """The highest seq an unreadable region may hold (as many records as fit in it)."""
    base = item.after_seq if item.after_seq is not None else _segment_first_seq(path) - 1
    return base + -(-item.length // min(HEADER_BYTES, _V1_HEAD.size + len(b'{"seq":0}')))


# -- the writer ---------------------------------------------------------------------------------
class _FolderLock:
    """An exclusive flock on <folder>/journal.lock, held until close (or the process ends)."""

    def __init__(self, directory: Path):
        self.path = directory / LOCK_FILE
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise JournalLocked(
                f"the event journal {directory} is in use by another engine (pid {other}); "
                "stop that server, or give this one its own --event-log PATH "
                "(or --no-event-log)") from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self.fd = fd

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def holder_pid(directory: str | os.PathLike) -> int | None:
    """The pid of the live process holding the journal folder, else None (read-only probe: the
    lock itself is not taken, so a starting engine is never refused because of a reader)."""
    try:
        pid = int((Path(directory) / LOCK_FILE).read_text().strip())
    except (OSError, ValueError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return pid


class Journal:
    """The journal folder, open for appending by this process alone (see `_FolderLock`).

    Opening it checks every segment: damage is logged, a torn tail truncated (and logged), and
    `next_seq` is set above every seq it may hold."""

    def __init__(self, directory: str | os.PathLike, segment_bytes: int = _SEGMENT_BYTES,
                 fsync: bool = False):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.segment_bytes = segment_bytes
        self.fsync = fsync
        self.next_seq = 1
        self.num_truncated_bytes = 0
        self.damage: list[Damage] = []
        self._file = None
        self._lock = _FolderLock(self.dir)
        try:
            self._recover()
        except BaseException:
            self._lock.close()
            raise

    def _recover(self) -> None:
        segs = self.segments()
        top = unknown = 0   # the highest seq read; the highest an unreadable region may hold
        for i, path in enumerate(segs):
            for item in scan_segment(path):
                if isinstance(item, Damage) and self._repair(item, last=i == len(segs) - 1):
                    continue          # a torn tail: never acknowledged nor published, its seq free
                if isinstance(item, Damage) and item.seq is None:
                    unknown = max(unknown, _max_possible_seq(item, path))
                else:                 # seqs only grow: a region before a known seq is below it
                    top, unknown = max(top, item.seq if isinstance(item, Damage)
                                       else item["seq"]), 0
        self.next_seq = max(top, unknown) + 1

    def _repair(self, damage: Damage, last: bool) -> bool:
        """Truncate a torn tail (True) or log corruption and keep it (False)."""
        if damage.torn and last:
            log.warning("journal: truncating a torn tail (the last write was cut short): %s",
                        damage.describe())
            with open(damage.path, "r+b") as f:
                f.truncate(damage.offset)
            self.num_truncated_bytes += damage.length
            return True
        log.error("journal: skipping a corrupt record (the records around it are kept): %s",
                  damage.describe())
        self.damage.append(damage)
        return False

    # -- reading ----------------------------------------------------------------------------
    def segments(self) -> list[Path]:
        return segments(self.dir)

    def replay(self, from_seq: int = 0) -> Iterator[dict]:
        """Every stored event with seq >= from_seq, in order (damage was logged on open)."""
        self.flush()
        return read_events(self.dir, from_seq)

    # -- writing ----------------------------------------------------------------------------
    def append(self, event_type: str, flush: bool = True, **fields) -> dict:
        """Give the event the next sequence number, store it, and return it. With
        flush=False the record stays buffered until `flush()` (the engine flushes once,
        before anything it acknowledges leaves the process)."""
        event = {"seq": self.next_seq, "type": event_type, "ts": time.time(), **fields}
        record = encode_record(event)
        self._writer().write(record)
        self.next_seq += 1
        if flush:
            self.flush()
        return event

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()
            if self.fsync:
                os.fsync(self._file.fileno())

    def sync(self) -> None:
        """Flush and fsync whatever the fsync setting: what follows survives a power loss
        (the store's writes are acknowledged only after this)."""
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())

    def _writer(self):
        if self._file is not None and self._file.tell() < self.segment_bytes:
            return self._file
        if self._file is not None:
            self._file.close()
        self._file = open(self._segment_to_append(), "ab")
        return self._file

    def _segment_to_append(self) -> Path:
        """The last segment while it is v2 and not full; else a new one (v1 segments are
        only read)."""
        segs = self.segments()
        if segs:
            size = segs[-1].stat().st_size
            with open(segs[-1], "rb") as f:
                v2 = f.read(len(MAGIC)) == MAGIC
            if size == 0 or (size < self.segment_bytes and v2):
                return segs[-1]
        return self.dir / _segment_name(self.next_seq)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self._lock.close()


class FinishedRequests:
    """A view rebuilt from the journal: the record of every finished request by id."""

    def __init__(self):
        self.records: dict[str, dict] = {}

    def apply(self, event: dict) -> None:
        if event["type"] in ("RequestFinished", "RequestAborted"):
            self.records[event["request_id"]] = event

    @classmethod
    def from_journal(cls, journal: "Journal | str | os.PathLike") -> "FinishedRequests":
        view = cls()
        events = journal.replay() if isinstance(journal, Journal) else read_events(journal)
        for e in events:
            view.apply(e)
        return view
