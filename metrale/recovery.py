"""What an engine does at start about the requests its predecessor left open.

A request the journal shows admitted (`RequestAdmitted`) with no terminal event after it
(`RequestFinished`, `RequestAborted`) was in flight when the previous engine died (kill -9, a
crash): its client was told (the frontends fail every open stream when the engine goes), and the
journal says so too, with `RequestAborted(cause="engine_restart")`, before the new engine admits
anything. Read through the Journal's public replay API only.
"""
from __future__ import annotations

import logging
from typing import Callable

log = logging.getLogger("metrale.engine")

TERMINAL_EVENTS = ("RequestFinished", "RequestAborted")


def unfinished_requests(events, open_before=()) -> list[str]:
    """The ids of admitted requests without a terminal event, in admission order (`open_before`:
    those open before the first of `events`, from a snapshot)."""
    open_ids: dict[str, None] = dict.fromkeys(open_before)
    for event in events:
        kind = event.get("type")
        if kind == "RequestAdmitted":
            open_ids[event.get("request_id")] = None
        elif kind in TERMINAL_EVENTS:
            open_ids.pop(event.get("request_id"), None)
    return list(open_ids)


def abort_unfinished(journal, emit: Callable[..., None], from_seq: int = 0,
                     open_before=()) -> list[str]:
    """Journal `RequestAborted(cause="engine_restart")` for each request the last engine left
    open (`emit(event_type, **fields)` is the engine's emit); returns their ids. With a
    snapshot (metrale.store) only the journal after it is read: `from_seq` and the requests
    open at that point."""
    ids = unfinished_requests(journal.replay(from_seq), open_before)
    for request_id in ids:
        emit("RequestAborted", request_id=request_id, reason="abort", cause="engine_restart")
    if ids:
        log.warning("the previous engine left %d requests in flight: journalled as aborted "
                    "(cause engine_restart)", len(ids))
    return ids
