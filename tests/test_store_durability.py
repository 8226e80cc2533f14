"""The store is a durable view of the journal: kill -9 of the engine while clients store
responses and append conversation items, `met serve` restarts it, and every acknowledged write
is there, complete; retention (--store-max-items, --store-ttl) evicts the oldest, which answer
404; a restart reads the snapshot and the journal after it, not the whole history."""
from __future__ import annotations

import os
import signal
import threading
import time

import openai
import pytest

from metrale import store as stored
from metrale.events import Journal, read_events, segments
from tests.serving import Server, cmdline, make_tiny_chat_model


def _client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                         timeout=30)


def _writer(client, conv_id, acked, stop, n):
    """Store responses and append items until `stop`; what was acknowledged goes in `acked`."""
    i = 0
    while not stop.is_set():
        i += 1
        try:
            r = client.responses.create(model="tiny-llama", input=f"w{n} turn {i}",
                                        max_output_tokens=3, temperature=0)
            acked["responses"][r.id] = r.model_dump()
            page = client.conversations.items.create(conv_id, items=[
                {"type": "message", "role": "user", "content": f"w{n} item {i}"}])
            acked["items"][page.data[0].id] = f"w{n} item {i}"
        except openai.APIError:
            time.sleep(0.05)      # the engine is down: 503 until it is back


def test_kill_9_under_load_loses_no_acknowledged_write(tmp_path):
    model = make_tiny_chat_model(tmp_path / "tiny-llama")
    srv = Server(["serve", str(model), "--frontends", "2", "--max-seq-len", "512",
                  "--event-log", str(tmp_path / "events")], tmp_path / "serve.log",
                 env={"METRALE_STORE_SNAPSHOT_EVERY": "10"})   # snapshots during the load
    with srv.serving(180, workers=2):
        client = _client(srv)
        conv = client.conversations.create(metadata={"k": "v"})
        acked = {"responses": {}, "items": {}}
        stop = threading.Event()
        threads = [threading.Thread(target=_writer, args=(client, conv.id, acked, stop, n))
                   for n in range(4)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while len(acked["responses"]) < 8 and time.monotonic() < deadline:
            time.sleep(0.1)
        running = client.responses.create(model="tiny-llama", input="long", background=True,
                                          max_output_tokens=400,
                                          extra_body={"ignore_eos": True})
        engine = next(p for p in srv.children() if "metrale.engine_process" in cmdline(p))
        os.kill(engine, signal.SIGKILL)
        killed_with = len(acked["responses"])
        time.sleep(0.5)
        srv.wait_healthy(120)
        while len(acked["responses"]) < killed_with + 4 and time.monotonic() < deadline + 60:
            time.sleep(0.1)       # the writers go on against the restarted engine
        stop.set()
        for t in threads:
            t.join(60)
        assert killed_with >= 8 and len(acked["responses"]) > killed_with
        for rid, body in acked["responses"].items():
            assert client.responses.retrieve(rid).model_dump() == body
        items = {}
        after = None
        while True:
            page = client.conversations.items.list(conv.id, order="asc", limit=100, after=after)
            items.update({i.id: i.content[0].text for i in page.data})
            if not page.has_more:
                break
            after = page.last_id
        assert acked["items"].items() <= items.items()
        # nothing half-written: each item listed is whole (an append in flight at the kill is
        # either all there or absent)
        assert all(t.startswith("w") and " item " in t for t in items.values())
        assert client.conversations.retrieve(conv.id).metadata == {"k": "v"}
        # a background response the killed engine was making ends as failed, not queued forever
        assert client.responses.retrieve(running.id).status == "failed"
    assert (tmp_path / "events" / stored.SNAPSHOT_FILE).is_file()
    # the restarted engine journalled the requests the killed one left open, once each
    aborted = [e["request_id"] for e in read_events(tmp_path / "events")
               if e.get("cause") == "engine_restart"]
    assert len(aborted) == len(set(aborted))


def test_retention_evicts_the_oldest_and_ttl_expires(tmp_path):
    model = make_tiny_chat_model(tmp_path / "tiny-llama")
    with Server(["serve", str(model), "--frontends", "1", "--max-seq-len", "512",
                 "--store-max-items", "3", "--store-ttl", "8"],
                tmp_path / "serve.log").serving(180) as srv:
        client = _client(srv)
        ids = [client.responses.create(model="tiny-llama", input=f"r{i}",
                                       max_output_tokens=2).id for i in range(3)]
        conv = client.conversations.create()
        with pytest.raises(openai.NotFoundError):       # the oldest went first
            client.responses.retrieve(ids[0])
        for rid in ids[1:]:
            assert client.responses.retrieve(rid).id == rid
        assert client.conversations.retrieve(conv.id).id == conv.id
        time.sleep(10)                                    # past --store-ttl
        for rid in ids[1:]:
            with pytest.raises(openai.NotFoundError):
                client.responses.retrieve(rid)
        with pytest.raises(openai.NotFoundError):
            client.conversations.retrieve(conv.id)
    evicted = [e for e in read_events(tmp_path / "events") if e["type"] == "StoreEvicted"]
    assert {e["reason"] for e in evicted} == {"max_items", "ttl"}


def _commit(journal, store):
    def commit(kind, fields):
        event = journal.append(kind, flush=False, **fields)
        store.apply(event)
        return event
    return commit


def _put(store, commit, i):
    response = {"id": f"resp_{i}", "object": "response", "status": "completed",
                "output": [{"id": f"msg_{i}", "type": "message", "role": "assistant",
                            "content": [{"type": "output_text", "text": f"answer {i}"}]}]}
    store.execute("response.put", "", {"response": response, "input_items": []}, commit)


def test_a_restart_reads_the_snapshot_and_the_tail_only(tmp_path):
    journal = Journal(tmp_path, segment_bytes=4096)
    live = stored.Store()
    commit = _commit(journal, live)
    for i in range(300):
        _put(live, commit, i)
        journal.append("TokensEmitted", flush=False, counts={"x": 1})   # other history
    live.execute("conversation.create", "", {"conversation": {"id": "conv_0"}, "items": [
        {"id": f"msg_c{i}", "type": "message", "role": "user", "content": [
            {"type": "input_text", "text": f"c{i}"}]} for i in range(3)]}, commit)
    live.execute("response.put", "", {"response": {"id": "resp_bg", "status": "queued",
                                                   "background": True, "output": []},
                                      "input_items": []}, commit)
    journal.flush()
    writer = stored.SnapshotWriter(live, tmp_path, journal.next_seq - 1)
    while not writer.step(0.0001):
        pass
    for i in range(300, 310):
        _put(live, commit, i)
    live.execute("conversation.create", "", {"conversation": {"id": "conv_1"}, "items": []},
                 commit)
    live.execute("response.delete", "", {"id": "resp_5"}, commit)
    journal.close()
    # the history the snapshot covers is damaged: a replay that read it would say so
    first = segments(tmp_path)[0]
    first.write_bytes(b"\0" * first.stat().st_size)
    loaded, stats = stored.load(tmp_path)
    assert stats["snapshot_seq"] == writer.seq and stats["replayed"] == 12
    assert loaded.order == live.order and set(loaded.responses) == set(live.responses)
    assert all(loaded.record(r) == live.responses[r] for r in live.responses)
    assert set(loaded.conversations) == {"conv_0", "conv_1"} and "resp_5" not in loaded.responses
    listed = loaded.execute("conversation.items", "", {"id": "conv_0", "order": "asc"}, None)
    assert [i["content"][0]["text"] for i in listed["data"]] == ["c0", "c1", "c2"]
    assert loaded.counts()["conversation_items"] == 3 and loaded.running == {"resp_bg"}
    # a later snapshot copies the objects never read since the load, unchanged
    again = stored.SnapshotWriter(loaded, tmp_path)
    assert again.step(10)
    reloaded, _ = stored.load(tmp_path)
    assert all(reloaded.record(r) == live.responses[r] for r in live.responses)


def test_a_torn_or_foreign_snapshot_falls_back_to_the_whole_journal(tmp_path):
    journal = Journal(tmp_path)
    live = stored.Store()
    commit = _commit(journal, live)
    for i in range(20):
        _put(live, commit, i)
    journal.flush()
    writer = stored.SnapshotWriter(live, tmp_path)
    assert writer.step()
    journal.close()
    path = tmp_path / stored.SNAPSHOT_FILE
    path.write_bytes(path.read_bytes()[:-30])           # cut short: no end line
    loaded, stats = stored.load(tmp_path)
    assert stats["snapshot_seq"] == 0 and stats["replayed"] == 20
    assert loaded.responses == live.responses       # all replayed: none left to read lazily


def test_recovery_after_a_snapshot_reads_the_tail_only(tmp_path):
    from metrale.recovery import abort_unfinished

    journal = Journal(tmp_path)
    for rid in ("a", "b"):
        journal.append("RequestAdmitted", request_id=rid)
    journal.append("RequestFinished", request_id="a")
    seq = journal.next_seq - 1                  # a snapshot here: "b" open
    journal.append("RequestAdmitted", request_id="c")
    journal.append("RequestAdmitted", request_id="d")
    journal.append("RequestAborted", request_id="c")
    emitted = []
    ids = abort_unfinished(journal, lambda kind, **f: emitted.append(f["request_id"]),
                           seq + 1, ["b"])
    assert ids == emitted == ["b", "d"]
    journal.close()
