"""Every message that crosses a ZeroMQ socket, and how it is framed.

A message is a multipart ZMQ message: [kind, orjson header, *raw frames]. Token arrays travel
as raw little-endian int32 frames (no per-token JSON). Messages are frozen dataclasses named
for what they are: commands imperative (Submit, Abort), replies and outputs as nouns.

Sockets (DESIGN.md section 2):
  frontend PUSH  -> engine PULL     Submit, Abort
  engine   PUB   -> frontend SUB    StepOutput (topic = frontend id: each frontend gets only its own)
  frontend DEALER <-> engine ROUTER Control request/reply (health, stats, model info, rate limits)
  engine   PUB   -> anyone SUB      events (topic = event type), see metrale.events
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
import orjson

ENCODING = "metrale/1"


@dataclass(frozen=True)
class Submit:
    request_id: str
    frontend_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: dict
    model: str = ""
    extra: dict = field(default_factory=dict)  # stop strings etc. never reach the engine


@dataclass(frozen=True)
class Abort:
    request_id: str
    reason: str = "abort"


@dataclass(frozen=True)
class TokenDelta:
    """What one engine step produced for one request."""
    request_id: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: tuple = ()          # per token: (logprob, [(token_id, logprob), ...]) or ()
    error: str | None = None      # set when the engine refused the request (status in `extra`)
    error_status: int = 0


@dataclass(frozen=True)
class StepOutput:
    frontend_id: str
    deltas: tuple[TokenDelta, ...]


@dataclass(frozen=True)
class Control:
    op: str                       # health | stats | model_info | rate_limit
    args: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ControlReply:
    ok: bool
    data: dict = field(default_factory=dict)


def _ids_frame(ids) -> bytes:
    return np.asarray(ids, dtype="<i4").tobytes()


def _ids(frame) -> tuple[int, ...]:
    return tuple(np.frombuffer(frame, dtype="<i4").tolist())


def encode(msg) -> list[bytes]:
    """Message -> multipart frames."""
    if isinstance(msg, Submit):
        head = {"request_id": msg.request_id, "frontend_id": msg.frontend_id,
                "sampling_params": msg.sampling_params, "model": msg.model, "extra": msg.extra}
        return [b"submit", orjson.dumps(head), _ids_frame(msg.prompt_token_ids)]
    if isinstance(msg, StepOutput):
        heads, frames = [], []
        for d in msg.deltas:
            h = asdict(d)
            del h["token_ids"]
            heads.append(h)
            frames.append(_ids_frame(d.token_ids))
        return [b"step", orjson.dumps({"frontend_id": msg.frontend_id, "deltas": heads}), *frames]
    for kind, cls in _SIMPLE.items():
        if isinstance(msg, cls):
            return [kind, orjson.dumps(asdict(msg))]
    raise TypeError(f"not a wire message: {type(msg).__name__}")


def decode(frames: list[bytes]):
    """Multipart frames -> message; ValueError on anything malformed."""
    if not frames:
        raise ValueError("empty message")
    kind = bytes(frames[0])
    try:
        head = orjson.loads(frames[1])
        if kind == b"submit":
            return Submit(prompt_token_ids=_ids(frames[2]), **head)
        if kind == b"step":
            deltas = tuple(
                TokenDelta(token_ids=_ids(f), **{**h, "logprobs": _tuplify(h.get("logprobs", ()))})
                for h, f in zip(head["deltas"], frames[2:]))
            return StepOutput(frontend_id=head["frontend_id"], deltas=deltas)
        cls = _SIMPLE[kind]
    except (KeyError, IndexError, TypeError, orjson.JSONDecodeError) as e:
        raise ValueError(f"malformed {kind!r} message: {e}") from e
    return cls(**head)


def _tuplify(x):
    """JSON lists back to the tuples the dataclasses hold (deeply)."""
    return tuple(_tuplify(i) if isinstance(i, (list, tuple)) else i for i in x)


_SIMPLE = {b"abort": Abort, b"control": Control, b"reply": ControlReply}
