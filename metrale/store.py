"""Stored responses and conversations: a view the engine owns, rebuilt from the journal.

Every change is an event (DESIGN.md section 3), journalled and fsynced by the engine before the
frontend that asked is answered, and applied here by `Store.apply`, the one code path of both
the live engine and a replay:

    ResponseStored          {response, input_items, owner, request_ids}   (new or replaced)
    ResponseDeleted         {id}
    ConversationCreated     {conversation, items, owner}
    ConversationAppended    {conversation_id, items}
    ConversationUpdated     {conversation_id, metadata}
    ConversationItemDeleted {conversation_id, item_id}
    ConversationDeleted     {id}
    StoreEvicted            {ids, reason}       retention: --store-max-items, --store-ttl

Frontends reach the store through one control request (`wire.StoreRequest(op, owner, args)`);
`Store.execute` answers it, committing events through the engine's `commit(type, fields)`.
An object belongs to the owner that created it (a fingerprint of the API key when auth is on,
never the key; "" without auth): another owner gets the same 404 as a missing id.

Retention: objects are kept in write order (a conversation moves to the end when it changes);
past `max_items` objects, or older than `ttl_s` seconds since their last write, the oldest go
first, as a journalled `StoreEvicted`, and answer 404 from then on.

Compaction: `SnapshotWriter` writes the whole view as JSON lines (`store-snapshot.jsonl` in the
journal folder: a header with the seq it covers, one line per object, an end line with the
count; written to a temporary file, fsynced, renamed) a chunk at a time between engine steps,
so a large store never stalls a step. At start `load` reads the snapshot and replays only the
journal segments after it (`metrale.events.read_events(from_seq)` skips the older ones).
"""
from __future__ import annotations

import gc
import logging
import mmap
import os
import time
from collections import OrderedDict
from pathlib import Path
from typing import Callable

import orjson

from metrale.events import read_events

log = logging.getLogger("metrale.store")

STORE_EVENTS = ("ResponseStored", "ResponseDeleted", "ConversationCreated",
                "ConversationAppended", "ConversationUpdated", "ConversationItemDeleted",
                "ConversationDeleted", "StoreEvicted")
SNAPSHOT_FILE = "store-snapshot.jsonl"
SNAPSHOT_VERSION = 2
SNAPSHOT_STEP_S = 0.002         # a snapshot writes this long per engine loop iteration
TTL_SWEEP_S = 1.0
MAX_PAGE = 100
TERMINAL = ("completed", "failed", "cancelled", "incomplete")

Commit = Callable[[str, dict], dict]


class StoreError(Exception):
    """A refused store request: the HTTP status and the message the API answers with."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def to_dict(self) -> dict:
        return {"error": self.message, "status": self.status, "param": self.param}


def _missing(kind: str, oid) -> StoreError:
    return StoreError(404, f"no {kind} with id {oid!r} (never stored, deleted, expired, or "
                           "created with another API key)", "id")


class StoredResponse:
    """A stored response, kept as its JSON (a third of the memory of the dicts, and a snapshot
    loads it without parsing it) with the few fields the store reads."""
    __slots__ = ("id", "owner", "status", "background", "previous_id", "request_ids",
                 "response_json", "items_json")

    def __init__(self, owner: str, response: dict, input_items: list, request_ids=()):
        self.id, self.owner, self.request_ids = response["id"], owner, list(request_ids)
        self.status, self.background = response.get("status"), bool(response.get("background"))
        self.previous_id = response.get("previous_response_id")
        self.response_json, self.items_json = orjson.dumps(response), orjson.dumps(input_items)

    def response(self) -> dict:
        return orjson.loads(self.response_json)

    def input_items(self) -> list[dict]:
        return orjson.loads(self.items_json)

    def meta(self) -> dict:
        return {"owner": self.owner, "request_ids": self.request_ids}

    def __eq__(self, other) -> bool:
        return isinstance(other, StoredResponse) and all(
            getattr(self, k) == getattr(other, k) for k in self.__slots__)

    @classmethod
    def from_snapshot(cls, meta: dict, response_json: bytes, items_json: bytes):
        rec = cls.__new__(cls)
        rec.id, rec.owner, rec.request_ids = meta["id"], meta["owner"], meta.get("request_ids", [])
        rec.status = meta.get("status")
        rec.background = meta.get("background", False)
        rec.previous_id = meta.get("previous_id")
        rec.response_json, rec.items_json = response_json, items_json
        return rec


class Store:
    def __init__(self, max_items: int = 0, ttl_s: float = 0.0):
        self.max_items = max_items
        self.ttl_s = ttl_s
        self.responses: dict[str, StoredResponse] = {}
        self.conversations: dict[str, dict] = {}  # id -> {conversation, items: {id: JSON}, owner}
        self.order: OrderedDict[tuple[str, str], float] = OrderedDict()   # oldest write first
        self.num_items = 0                        # conversation items, all conversations
        self.num_evicted = 0
        self.seq = 0                              # the last store event applied
        self.events_since_snapshot = 0
        self.open_requests: list[str] = []        # engine requests open at the snapshot's seq
        self.running: set[str] = set()            # background responses not yet finished
        # objects of the snapshot are read from it when first used (responses[id] holds the
        # line's offset, conversations[id] (offset, number of items) until then)
        self._mm: mmap.mmap | None = None
        self._ops = {
            "response.put": self._put_response, "response.get": self._get_response,
            "response.delete": self._delete_response, "response.cancel": self._cancel,
            "response.input_items": self._input_items, "response.context": self._context,
            "conversation.create": self._create_conversation,
            "conversation.get": self._get_conversation,
            "conversation.update": self._update_conversation,
            "conversation.delete": self._delete_conversation,
            "conversation.items": self._list_items, "conversation.append": self._append_items,
            "conversation.item": self._get_item, "conversation.item.delete": self._delete_item,
        }

    # -- applying events (live and replay) --------------------------------------------------
    def apply(self, event: dict) -> None:
        kind = event["type"]
        handler = getattr(self, "_on_" + kind, None)
        if handler is None:
            return
        handler(event)
        self.seq = max(self.seq, int(event.get("seq") or 0))
        self.events_since_snapshot += 1

    def _touch(self, key: tuple[str, str], ts: float) -> None:
        self.order[key] = ts
        self.order.move_to_end(key)

    def _on_ResponseStored(self, e: dict) -> None:
        rid = e["response"]["id"]
        rec = self.responses[rid] = StoredResponse(e["owner"], e["response"], e["input_items"],
                                                   e.get("request_ids", ()))
        self._mark(rec)
        self._touch(("r", rid), e["ts"])

    def record(self, rid: str) -> StoredResponse | None:
        """The stored response `rid` (read from the snapshot on first use)."""
        rec = self.responses.get(rid)
        if type(rec) is int:
            kind, meta, *blobs = self._line(rec).split(b"\t")
            rec = self.responses[rid] = StoredResponse.from_snapshot(orjson.loads(meta), *blobs)
        return rec

    def _conv(self, cid: str) -> dict | None:
        conv = self.conversations.get(cid)
        if type(conv) is tuple:
            kind, meta, *blobs = self._line(conv[0]).split(b"\t")
            meta = orjson.loads(meta)
            conv = self.conversations[cid] = {"conversation": meta["conversation"],
                                              "items": dict(zip(meta["item_ids"], blobs)),
                                              "owner": meta["owner"]}
        return conv

    def _line(self, offset: int) -> bytes:
        return self._mm[offset:self._mm.find(b"\n", offset)]

    def _mark(self, rec: StoredResponse) -> None:
        if rec.background and rec.status not in TERMINAL:
            self.running.add(rec.id)
        else:
            self.running.discard(rec.id)

    def _on_ResponseDeleted(self, e: dict) -> None:
        self.responses.pop(e["id"], None)
        self.running.discard(e["id"])
        self.order.pop(("r", e["id"]), None)

    def _on_ConversationCreated(self, e: dict) -> None:
        cid = e["conversation"]["id"]
        items = {i["id"]: orjson.dumps(i) for i in e["items"]}
        self.conversations[cid] = {"conversation": e["conversation"], "items": items,
                                   "owner": e["owner"]}
        self.num_items += len(items)
        self._touch(("c", cid), e["ts"])

    def _on_ConversationAppended(self, e: dict) -> None:
        conv = self._conv(e["conversation_id"])
        if conv is None:
            return
        for item in e["items"]:
            self.num_items += item["id"] not in conv["items"]
            conv["items"][item["id"]] = orjson.dumps(item)
        self._touch(("c", e["conversation_id"]), e["ts"])

    def _on_ConversationUpdated(self, e: dict) -> None:
        conv = self._conv(e["conversation_id"])
        if conv is not None:
            conv["conversation"] = {**conv["conversation"], "metadata": e["metadata"]}
            self._touch(("c", e["conversation_id"]), e["ts"])

    def _on_ConversationItemDeleted(self, e: dict) -> None:
        conv = self._conv(e["conversation_id"])
        if conv is not None and conv["items"].pop(e["item_id"], None) is not None:
            self.num_items -= 1

    def _on_ConversationDeleted(self, e: dict) -> None:
        conv = self.conversations.pop(e["id"], None)
        if conv is not None:
            self.num_items -= conv[1] if type(conv) is tuple else len(conv["items"])
        self.order.pop(("c", e["id"]), None)

    def _on_StoreEvicted(self, e: dict) -> None:
        for kind, oid in e["ids"]:
            if kind == "r":
                self._on_ResponseDeleted({"id": oid})
            else:
                self._on_ConversationDeleted({"id": oid})
        self.num_evicted += len(e["ids"])

    # -- requests ---------------------------------------------------------------------------
    def execute(self, op: str, owner: str, args: dict, commit: Commit) -> dict:
        """Answer one store request; raises StoreError (its status and message) when refused.
        Changes go through `commit(event_type, fields)`, which journals the event and applies
        it here (the engine's `_store_commit`)."""
        handler = self._ops.get(op)
        if handler is None:
            raise StoreError(400, f"unknown store operation {op!r}")
        if not isinstance(args, dict) or not isinstance(owner, str):
            raise StoreError(400, "a store request needs an owner string and an args object")
        return handler(owner, args, commit)

    def _response(self, owner: str, rid) -> dict:
        rec = self.record(rid) if isinstance(rid, str) else None
        if rec is None or rec.owner != owner:
            raise _missing("response", rid)
        return rec

    def _conversation(self, owner: str, cid) -> dict:
        conv = self._conv(cid) if isinstance(cid, str) else None
        if conv is None or conv["owner"] != owner:
            raise _missing("conversation", cid)
        return conv

    def _put_response(self, owner: str, args: dict, commit: Commit) -> dict:
        """Store a response (args.store) and / or append its turn to a conversation, both
        journalled before the answer. A background response that was cancelled meanwhile
        keeps its cancelled record."""
        response = args["response"]
        cid = args.get("conversation_id")
        if cid is not None:
            self._conversation(owner, cid)
        old = self.record(response["id"])
        if old is not None and old.owner == owner and old.status == "cancelled":
            return {"response": old.response(), "kept": True}
        if args.get("store", True):
            commit("ResponseStored", {"response": response, "owner": owner,
                                      "input_items": args.get("input_items", []),
                                      "request_ids": args.get("request_ids", [])})
        if cid is not None and args.get("conversation_items"):
            commit("ConversationAppended", {"conversation_id": cid,
                                            "items": args["conversation_items"]})
        self._retain(commit)
        return {"response": response}

    def _get_response(self, owner: str, args: dict, commit: Commit) -> dict:
        return {"response": self._response(owner, args.get("id")).response()}

    def _delete_response(self, owner: str, args: dict, commit: Commit) -> dict:
        rid = args.get("id")
        self._response(owner, rid)
        commit("ResponseDeleted", {"id": rid})
        return {"id": rid, "object": "response", "deleted": True}

    def _cancel(self, owner: str, args: dict, commit: Commit) -> dict:
        """A background response that is still running becomes "cancelled" (its engine
        requests are in the answer, for the engine to abort); a finished one is answered as
        it is."""
        rec = self._response(owner, args.get("id"))
        response = rec.response()
        if not rec.background:
            raise StoreError(400, "only a background response can be cancelled (this one was "
                                  "created without background: true)", "response_id")
        if rec.status in TERMINAL:
            return {"response": response, "abort": []}
        cancelled = {**response, "status": "cancelled"}
        commit("ResponseStored", {"response": cancelled, "owner": owner,
                                  "input_items": rec.input_items(), "request_ids": []})
        return {"response": cancelled, "abort": rec.request_ids}

    def _input_items(self, owner: str, args: dict, commit: Commit) -> dict:
        rec = self._response(owner, args.get("id"))
        return page(rec.input_items(), args)

    def _context(self, owner: str, args: dict, commit: Commit) -> dict:
        """The items a follow-up of response `id` continues from: every response of the chain,
        oldest first, its input items then its output items (a chain whose older links were
        deleted or evicted starts at the oldest one still stored)."""
        chain, rid = [], args.get("id")
        rec = self._response(owner, rid)
        seen = set()
        while rec is not None and rid not in seen:
            seen.add(rid)
            chain.append(rec)
            rid = rec.previous_id
            rec = self.record(rid) if rid else None
            if rec is not None and rec.owner != owner:
                rec = None
        items = []
        for rec in reversed(chain):
            items += rec.input_items()
            items += rec.response().get("output", [])
        return {"items": items}

    def _create_conversation(self, owner: str, args: dict, commit: Commit) -> dict:
        conv = args["conversation"]
        if conv["id"] in self.conversations:
            raise StoreError(400, f"conversation id {conv['id']!r} is taken", "id")
        commit("ConversationCreated", {"conversation": conv, "items": args.get("items", []),
                                       "owner": owner})
        self._retain(commit)
        return {"conversation": conv}

    def _get_conversation(self, owner: str, args: dict, commit: Commit) -> dict:
        return {"conversation": self._conversation(owner, args.get("id"))["conversation"]}

    def _update_conversation(self, owner: str, args: dict, commit: Commit) -> dict:
        cid = args.get("id")
        self._conversation(owner, cid)
        commit("ConversationUpdated", {"conversation_id": cid, "metadata": args["metadata"]})
        return {"conversation": self.conversations[cid]["conversation"]}

    def _delete_conversation(self, owner: str, args: dict, commit: Commit) -> dict:
        cid = args.get("id")
        self._conversation(owner, cid)
        commit("ConversationDeleted", {"id": cid})
        return {"id": cid, "object": "conversation.deleted", "deleted": True}

    def _list_items(self, owner: str, args: dict, commit: Commit) -> dict:
        conv = self._conversation(owner, args.get("id"))
        if args.get("all"):
            return {"items": [orjson.loads(i) for i in conv["items"].values()]}
        return page(list(conv["items"]), args, lambda i: orjson.loads(conv["items"][i]))

    def _append_items(self, owner: str, args: dict, commit: Commit) -> dict:
        cid = args.get("id")
        conv = self._conversation(owner, cid)
        taken = [i["id"] for i in args["items"] if i["id"] in conv["items"]]
        if taken:
            raise StoreError(400, f"item id {taken[0]!r} is already in conversation {cid}",
                             "items")
        commit("ConversationAppended", {"conversation_id": cid, "items": args["items"]})
        return page([i["id"] for i in args["items"]], {"limit": len(args["items"]),
                                                       "order": "asc"},
                    {i["id"]: i for i in args["items"]}.get)

    def _get_item(self, owner: str, args: dict, commit: Commit) -> dict:
        conv = self._conversation(owner, args.get("id"))
        item = conv["items"].get(args.get("item_id"))
        if item is None:
            raise _missing("item", args.get("item_id"))
        return {"item": orjson.loads(item)}

    def _delete_item(self, owner: str, args: dict, commit: Commit) -> dict:
        cid, item_id = args.get("id"), args.get("item_id")
        if item_id not in self._conversation(owner, cid)["items"]:
            raise _missing("item", item_id)
        commit("ConversationItemDeleted", {"conversation_id": cid, "item_id": item_id})
        return {"conversation": self.conversations[cid]["conversation"]}

    def fail_running(self, commit: Commit, request_ids=None, why: str = "") -> int:
        """Background responses whose generation is gone (every one at an engine start, or
        those of `request_ids`: their frontend died) are stored as failed; how many."""
        gone = [self.record(r) for r in sorted(self.running) if request_ids is None
                or set(self.record(r).request_ids) & set(request_ids)]
        for rec in gone:
            response = {**rec.response(), "status": "failed", "error": {
                "code": "server_error", "message": why or "the response's generation ended"}}
            commit("ResponseStored", {"response": response, "owner": rec.owner,
                                      "input_items": rec.input_items(), "request_ids": []})
        return len(gone)

    # -- retention --------------------------------------------------------------------------
    def _retain(self, commit: Commit) -> None:
        if self.max_items and len(self.order) > self.max_items:
            excess = len(self.order) - self.max_items
            ids = [list(k) for k, _ in zip(self.order, range(excess))]
            commit("StoreEvicted", {"ids": ids, "reason": "max_items"})

    def expire(self, commit: Commit, now: float | None = None) -> int:
        """Evict what is past the TTL and past max_items (journalled); the number evicted."""
        before = self.num_evicted
        if self.ttl_s:
            cutoff = (time.time() if now is None else now) - self.ttl_s
            ids = []
            for key, ts in self.order.items():
                if ts >= cutoff:
                    break
                ids.append(list(key))
            if ids:
                commit("StoreEvicted", {"ids": ids, "reason": "ttl"})
        self._retain(commit)
        return self.num_evicted - before

    # -- snapshots --------------------------------------------------------------------------
    def snapshot_records(self) -> list[tuple]:
        """The view for a snapshot, frozen now, as (ts, kind, id, object, index extra): what is
        written later is this state (stored responses are replaced, never changed in place;
        conversation items are copied; an object not read from the last snapshot is its line
        there, by offset: copied when written, never all at once). The extra is 1 for a
        running background response, a conversation's item count."""
        out = []
        for (kind, oid), ts in self.order.items():
            if kind == "r":
                out.append((ts, kind, oid, self.responses[oid], int(oid in self.running)))
                continue
            conv = self.conversations[oid]
            if type(conv) is tuple:
                out.append((ts, kind, oid, conv[0], conv[1]))
            else:
                out.append((ts, kind, oid, {**conv, "items": list(conv["items"].items())},
                            len(conv["items"])))
        return out

    def load_index(self, mm: mmap.mmap, index: list) -> None:
        """A snapshot's index: every object known, none read yet (see `record`)."""
        self._mm = mm
        for kind, oid, ts, offset, extra in index:
            if kind == "r":
                self.responses[oid] = offset
                if extra:
                    self.running.add(oid)
            else:
                self.conversations[oid] = (offset, extra)
                self.num_items += extra
            self.order[(kind, oid)] = ts

    def counts(self) -> dict:
        return {"responses": len(self.responses), "conversations": len(self.conversations),
                "conversation_items": self.num_items, "evicted": self.num_evicted}


def page(items: list, args: dict, load=None) -> dict:
    """OpenAI's list shape over `items` (oldest first; item dicts, or ids that `load` turns
    into them, so only a page is parsed): order asc | desc (default desc), `after` an item id
    (exclusive), `limit` 1..100 (default 20)."""
    order = args.get("order") or "desc"
    limit = args.get("limit") or 20
    seq = items if order == "asc" else items[::-1]
    ids = seq if load is not None else [i.get("id") for i in seq]
    after = args.get("after")
    start = 0
    if after is not None:
        if after not in ids:
            raise StoreError(400, f"'after' names no item of this list: {after!r:.80}", "after")
        start = ids.index(after) + 1
    data = seq[start:start + limit]
    if load is not None:
        data = [load(i) for i in data]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(seq) > start + limit}


def snapshot_line(ts: float, obj, line_of=None) -> bytes:
    """R meta \t response JSON \t input items JSON, or C meta \t item JSON ... (orjson never
    writes a raw tab: the JSON documents are kept whole, unparsed, by a load)."""
    if type(obj) is int:
        return line_of(obj)              # as the last snapshot had it
    if isinstance(obj, StoredResponse):
        meta = {"id": obj.id, "ts": ts,
                "status": obj.status, "background": obj.background,
                "previous_id": obj.previous_id, **obj.meta()}
        return b"\t".join((b"R", orjson.dumps(meta), obj.response_json, obj.items_json))
    meta = {"id": obj["conversation"]["id"], "ts": ts, "conversation": obj["conversation"],
            "owner": obj["owner"], "item_ids": [i for i, _ in obj["items"]]}
    return b"\t".join((b"C", orjson.dumps(meta), *(blob for _, blob in obj["items"])))


# -- snapshots on disk --------------------------------------------------------------------------
class SnapshotWriter:
    """Writes one snapshot a chunk at a time (`step`), then fsyncs and renames it into place."""

    def __init__(self, store: Store, directory: Path, seq: int | None = None,
                 open_requests=()):
        """`seq`: the last journalled event the store has applied (default: its last store
        event); a restart replays the journal after it. `open_requests`: the engine requests
        in flight at `seq` (the restart's metrale.recovery then reads only the journal after
        it too)."""
        self.path = Path(directory) / SNAPSHOT_FILE
        self.tmp = self.path.with_name(f".{SNAPSHOT_FILE}.{os.getpid()}")
        self.seq = store.seq if seq is None else seq
        store.events_since_snapshot = 0
        self.records = store.snapshot_records()
        self.line_of = store._line
        self.next = 0
        self.index: list[list] = []
        self.file = open(self.tmp, "wb")
        head = orjson.dumps({"version": SNAPSHOT_VERSION, "seq": self.seq,
                             "count": len(self.records),
                             "open_requests": list(open_requests)}) + b"\n"
        self.file.write(head)
        self.offset = len(head)

    def step(self, budget_s: float = SNAPSHOT_STEP_S) -> bool:
        """Write for about `budget_s`; True once the snapshot is complete and in place."""
        deadline = time.monotonic() + budget_s
        while self.next < len(self.records):
            lines = []
            for ts, kind, oid, obj, extra in self.records[self.next:self.next + 256]:
                lines.append(snapshot_line(ts, obj, self.line_of) + b"\n")
                self.index.append([kind, oid, ts, self.offset, extra])
                self.offset += len(lines[-1])
            self.file.write(b"".join(lines))
            self.next += len(lines)
            if time.monotonic() > deadline:
                return False
        self.file.write(b"I" + orjson.dumps(self.index) + b"\n")
        self.file.write(orjson.dumps({"end": True, "count": len(self.records),
                                      "index_offset": self.offset}) + b"\n")
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.tmp, self.path)
        _fsync_dir(self.path.parent)
        log.info("store snapshot at seq %d: %d objects", self.seq, len(self.records))
        return True

    def abandon(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_snapshot(directory: Path, store: Store) -> int:
    """Load the folder's snapshot into `store` (empty); the seq it covers (0: none, or one
    that does not check out, which is logged and ignored: the journal is replayed whole)."""
    path = Path(directory) / SNAPSHOT_FILE
    if not path.is_file():
        return 0
    try:
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        head = orjson.loads(mm[:mm.find(b"\n")])
        last = mm.rfind(b"\n", 0, len(mm) - 1)
        end = orjson.loads(mm[last + 1:])
        start = end.get("index_offset", 0) if isinstance(end, dict) else 0
        if head.get("version") != SNAPSHOT_VERSION or end.get("end") is not True \
                or mm[start:start + 1] != b"I":
            raise ValueError("not a complete snapshot of this version")
        index = orjson.loads(mm[start + 1:last])
        if len(index) != head["count"] or end["count"] != head["count"]:
            raise ValueError("header, index and end line disagree on the count")
        store.load_index(mm, index)
    except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
        log.error("store: ignoring the snapshot %s (%s); replaying the whole journal", path, e)
        store.__init__(store.max_items, store.ttl_s)
        return 0
    store.seq = int(head["seq"])
    store.open_requests = list(head.get("open_requests") or ())
    return store.seq


def load(directory: str | os.PathLike | None, max_items: int = 0,
         ttl_s: float = 0.0) -> tuple[Store, dict]:
    """The store of a journal folder: the snapshot, then the journal after it. Returns the
    store and what the load read (snapshot seq, events replayed, seconds)."""
    t0 = time.monotonic()
    store = Store(max_items, ttl_s)
    if directory is None:
        return store, {"snapshot_seq": 0, "replayed": 0, "seconds": 0.0}
    # millions of new dicts: the cyclic GC would rescan the growing heap again and again (it
    # took most of a load's time); afterwards they are frozen out of later collections too
    gc.disable()
    try:
        start = read_snapshot(Path(directory), store)
        replayed = 0
        for event in read_events(directory, start + 1):
            if event["type"] in STORE_EVENTS:
                store.apply(event)
                replayed += 1
    finally:
        gc.enable()
    gc.freeze()
    store.events_since_snapshot = replayed
    store.seq = max(store.seq, start)
    stats = {"snapshot_seq": start, "replayed": replayed, "objects": len(store.order),
             "seconds": round(time.monotonic() - t0, 3)}
    if start or replayed:
        log.info("store: %d responses, %d conversations from the snapshot at seq %d + %d "
                 "journalled events (%.2fs)", len(store.responses), len(store.conversations),
                 start, replayed, stats["seconds"])
    return store, stats
