"""Every message that crosses a ZeroMQ socket, and how it is framed.

A message is a multipart ZMQ message: [kind, orjson header, *raw frames]. A prompt travels as a
raw little-endian int32 frame. A StepOutput is one orjson document with each delta as a
positional list (field order of TokenDelta): at 128 running requests a step's deltas then encode
in ~0.1 ms, where per-delta dataclass dicts and one frame each took 3.6 ms (the engine's whole
decode step at that batch is ~2 ms). Messages are frozen dataclasses named for what they are:
commands imperative (Submit, Abort), replies and outputs as nouns.

Sockets (DESIGN.md section 2):
  frontend PUSH  -> engine PULL     Submit, Abort
  engine   PUB   -> frontend SUB    StepOutput (topic = frontend id: each frontend gets only its own)
  frontend DEALER <-> engine ROUTER Control request/reply (health, stats, model info, rate limits)
  engine   PUB   -> anyone SUB      events (topic = event type), see metrale.events
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import NamedTuple

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


class TokenDelta(NamedTuple):
    """What one engine step produced for one request. A NamedTuple, not a frozen dataclass:
    frontends build one per request per step, and a frozen dataclass's __init__ costs ~3 us
    (one object.__setattr__ per field)."""
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
        rows = [(d.request_id, d.token_ids, d.finish_reason, d.num_prompt_tokens,
                 d.num_output_tokens, d.num_cached_tokens, d.logprobs, d.error, d.error_status)
                for d in msg.deltas]
        # OPT_SERIALIZE_NUMPY: a numpy integer id or float logprob from a sampler serialises too
        return [b"step", orjson.dumps({"frontend_id": msg.frontend_id, "deltas": rows},
                                      option=orjson.OPT_SERIALIZE_NUMPY)]
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
                TokenDelta(rid, tuple(ids), finish, n_prompt, n_out, n_cached,
                           _tuplify(lps) if lps else (), error, status)
                for rid, ids, finish, n_prompt, n_out, n_cached, lps, error, status in head["deltas"])
            if not all(isinstance(d.request_id, str) for d in deltas):
                raise ValueError("a delta's request id is not a string")
            return StepOutput(frontend_id=head["frontend_id"], deltas=deltas)
        cls = _SIMPLE[kind]
    except (KeyError, IndexError, TypeError, ValueError, orjson.JSONDecodeError) as e:
        raise ValueError(f"malformed {kind!r} message: {e}") from e
    return cls(**head)


def _tuplify(x):
    """JSON lists back to the tuples the dataclasses hold (deeply)."""
    return tuple(_tuplify(i) if isinstance(i, (list, tuple)) else i for i in x)


_SIMPLE = {b"abort": Abort, b"control": Control, b"reply": ControlReply}
