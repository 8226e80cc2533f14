"""How long an engine restart spends rebuilding the store (metrale.store) of N stored responses.

    python perf/store_replay.py [--n 1000000] [--tail 20000] [--dir DIR]

Writes N ResponseStored events (a ~0.6 KB response each: one input item, one output message)
into a fresh journal through the store's own commit path, a snapshot at the end of them, then
`tail` more after it, and times `metrale.store.load` (snapshot + tail) against a replay of the
whole journal (no snapshot). Prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from metrale import store as stored          # noqa: E402
from metrale.events import Journal          # noqa: E402


def _response(i: int) -> tuple[dict, list]:
    text = f"answer number {i}: " + "lorem ipsum dolor sit amet " * 8
    response = {"id": f"resp_{i:024d}", "object": "response", "created_at": 1764633600 + i,
                "status": "completed", "model": "m", "output": [
                    {"id": f"msg_{i:024d}", "type": "message", "role": "assistant",
                     "status": "completed", "content": [
                         {"type": "output_text", "text": text, "annotations": []}]}],
                "usage": {"input_tokens": 12, "output_tokens": 40, "total_tokens": 52}}
    items = [{"id": f"msg_in_{i:021d}", "type": "message", "role": "user",
              "status": "completed", "content": [{"type": "input_text",
                                                  "text": f"question {i}"}]}]
    return response, items


def build(directory: Path, n: int, tail: int) -> dict:
    journal = Journal(directory)
    store = stored.Store()

    def commit(kind, fields):
        event = journal.append(kind, flush=False, **fields)
        store.apply(event)
        return event

    t0 = time.monotonic()
    for i in range(n + tail):
        response, items = _response(i)
        store.execute("response.put", "", {"response": response, "input_items": items}, commit)
        if i == n - 1:
            journal.flush()
            t1 = time.monotonic()
            writer = stored.SnapshotWriter(store, directory, journal.next_seq - 1)
            while not writer.step(0.002):
                pass
            snapshot_s = time.monotonic() - t1
    journal.close()
    return {"write_s": round(time.monotonic() - t0, 1), "snapshot_write_s": round(snapshot_s, 2)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--tail", type=int, default=20_000)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    directory = Path(args.dir or tempfile.mkdtemp(prefix="metrale-store-"))
    try:
        out = {"n": args.n, "tail": args.tail, **build(directory, args.n, args.tail)}
        out["journal_mb"] = round(sum(p.stat().st_size for p in directory.glob("journal-*"))
                                  / 2**20)
        out["snapshot_mb"] = round((directory / stored.SNAPSHOT_FILE).stat().st_size / 2**20)
        store, stats = stored.load(directory)
        assert len(store.responses) == args.n + args.tail
        out["restart_s"] = stats["seconds"]          # snapshot + tail
        out["restart_replayed_events"] = stats["replayed"]
        (directory / stored.SNAPSHOT_FILE).unlink()
        _, whole = stored.load(directory)
        out["replay_whole_journal_s"] = whole["seconds"]
        print(json.dumps(out))
    finally:
        if args.dir is None:
            shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
