"""Every message that crosses a ZeroMQ socket, and how it is framed.

A message is a multipart ZMQ message: [kind, orjson header, *raw frames]. A prompt travels as a
raw little-endian int32 frame. A StepOutput is one orjson document with each delta as a
positional list (field order of TokenDelta; its speculative counters only on a request's last
delta): at 128 running requests a step's deltas then encode in ~0.1 ms, where per-delta
dataclass dicts and one frame each took 3.6 ms (the engine's whole decode step at that batch is
~2 ms). TokenDelta is the one type of a step's output for a request: EngineCore.step makes it,
the engine server publishes it as is, metrale.client hands the decoded one to the frontend. Messages are frozen dataclasses named for what they are:
commands imperative (Submit, Abort), replies and outputs as nouns.

Sockets (DESIGN.md section 2):
  frontend PUSH  -> engine PULL     Submit, Abort, Heartbeat
  engine   PUB   -> frontend SUB    StepOutput (topic = frontend id: each frontend gets only its own),
                                    ModelChanged (a swap's states, metrale.swap)
  frontend DEALER <-> engine ROUTER a control request (HealthCheck, ModelInfoQuery, StatsQuery,
                                    RateLimitCheck, LoadModel, LibraryQuery, StoreRequest)
                                    -> ControlReply (model_info's data is a
                                    ModelInfo: typed, validated, JSON-safe)
  engine   PUB   -> anyone SUB      events (topic = event type), see metrale.events

Liveness: a frontend sends a Heartbeat every HEARTBEAT_INTERVAL_S (from a thread of its own)
and the engine echoes it on the frontend's topic; a frontend the engine has not heard for
PEER_TIMEOUT_S is gone (its requests are aborted). The other way is metrale.client's rule: the
engine is gone when its connection closes or stops answering ZMTP heartbeats; an echo silence
counts only as a long backstop, since the engine echoes between steps and one CPU step can take
tens of seconds.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import NamedTuple

import numpy as np
import orjson

from metrale.request import as_token_ids
from metrale.sampling import GENERATION_CONFIG_FIELDS, SamplingParams
from metrale.tokenizer import NAMED_SPECIAL_TOKENS

ENCODING = "metrale/1"
log = logging.getLogger("metrale.wire")

HEARTBEAT_INTERVAL_S = 1.0   # a frontend's Heartbeat period
PEER_TIMEOUT_S = 5.0         # silent this long: the other side is gone (see the module docstring)


@dataclass(frozen=True)
class Submit:
    request_id: str
    frontend_id: str
    prompt_token_ids: np.ndarray      # int32, the one type of a prompt (request.as_token_ids)
    sampling_params: SamplingParams   # built and validated by the frontend; EngineCore.add_request
                                      # checks it again: a frontend may be another host's
    load_id: int = 0                  # ModelInfo.load_id the frontend tokenized for (0: any); a
                                      # Submit for a model since swapped out is refused (503)

    def __post_init__(self):
        object.__setattr__(self, "prompt_token_ids", as_token_ids(self.prompt_token_ids))

    def __eq__(self, other):
        if type(other) is not Submit:
            return NotImplemented
        return (self.request_id, self.frontend_id, self.sampling_params, self.load_id) == \
            (other.request_id, other.frontend_id, other.sampling_params, other.load_id) \
            and np.array_equal(self.prompt_token_ids, other.prompt_token_ids)

    __hash__ = None


@dataclass(frozen=True)
class Abort:
    request_id: str
    reason: str = "abort"


@dataclass(frozen=True)
class Heartbeat:
    frontend_id: str


class TokenLogprob(NamedTuple):
    """A generated token's logprob and its top alternatives ((token_id, logprob), ...)."""
    logprob: float
    top_logprobs: tuple = ()


class TokenDelta(NamedTuple):
    """What one engine step produced for one request (EngineCore.step's output, published and
    read as is). A NamedTuple, not a frozen dataclass: the engine and every frontend build one
    per request per step, and a frozen dataclass's __init__ costs ~3 us (one
    object.__setattr__ per field)."""
    request_id: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()   # per token that has one: every token when asked
    error: str | None = None      # set when the engine refused the request (status in `extra`)
    error_status: int = 0
    # speculative decoding: the request's verify steps, drafts and accepted drafts so far
    # (the wire carries them on the last delta only: the request log's figures)
    num_verifies: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class StepOutput:
    frontend_id: str
    deltas: tuple[TokenDelta, ...]


# -- control requests (DEALER -> ROUTER), each answered by a ControlReply ---------------------
@dataclass(frozen=True)
class HealthCheck:
    pass


@dataclass(frozen=True)
class ModelInfoQuery:
    """Answered with ModelInfo.to_dict()."""


@dataclass(frozen=True)
class StatsQuery:
    """Answered with {"prometheus": text, "running": n, "rate_limit_keys": n}."""


@dataclass(frozen=True)
class RateLimitCheck:
    """Charge `tokens` to `key`'s buckets; answered with metrale.ratelimit's verdict."""
    key: str = ""
    tokens: int = 0


@dataclass(frozen=True)
class LoadModel:
    """Swap the served model (metrale.swap): a recipe by name, or a model (HF id or path) with the
    server's own flags. `auto`: an --auto-swap request's model name, which swaps only when it
    resolves to a known recipe of a model other than the live one. Answered at once (the swap
    runs in the engine's loop) with {"accepted": bool, ...} or an error reply."""
    recipe: str = ""
    model: str = ""
    auto: bool = False


@dataclass(frozen=True)
class LibraryQuery:
    """Answered with what the Library needs: the live model and its recipe, the swap state and
    the last swap's outcome, the recipes, the HF cache's models, memory (metrale.swap.library)."""


@dataclass(frozen=True)
class ModelChanged:
    """Engine -> every frontend (output PUB, the frontend's topic): the served model's state
    changed (draining, loading, serving, empty); on serving, fetch model_info again."""
    state: str
    model: str = ""
    load_id: int = 0


@dataclass(frozen=True)
class StoreRequest:
    """A stored-responses / conversations operation (metrale.store: `op` is one of
    Store's ops, `owner` the caller's API-key fingerprint or "" without auth). Answered once
    every change it made is journalled and fsynced; a refusal's data is {"error", "status",
    "param"}."""
    op: str
    owner: str = ""
    args: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ControlReply:
    ok: bool
    data: dict = field(default_factory=dict)


# -- model info -------------------------------------------------------------------------------
SPECIAL_TOKEN_KEYS = NAMED_SPECIAL_TOKENS
TOKENIZER_FLAG_KEYS = ("add_bos_token", "add_eos_token")
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
SAMPLING_KEYS = GENERATION_CONFIG_FIELDS
_MAX_TOKEN_ID = 2**31 - 1        # token ids travel as int32 frames


@dataclass(frozen=True)
class ModelInfo:
    """What a frontend needs to serve the model (the control reply to `model_info`), so a
    frontend on another host needs no model files. Built from validated fields only: the raw
    tokenizer_config.json / generation_config.json of a checkpoint go through
    `ModelInfo.from_checkpoint_configs`, which keeps the keys frontends read, with JSON-safe
    values (a real checkpoint's `model_max_length` of 1e30 never reaches the wire)."""
    name: str
    model_type: str = ""
    max_seq_len: int = 0
    max_num_seqs: int = 0
    vocab_size: int | None = None
    tokenizer_json: str = ""
    tokenizer_config: dict = field(default_factory=dict)   # SPECIAL_TOKEN_KEYS, TOKENIZER_FLAG_KEYS
    generation_config: dict = field(default_factory=dict)  # TOKEN_ID_KEYS, SAMPLING_KEYS
    chat_template: str | None = None
    created: int = 0
    sampling_defaults: dict = field(default_factory=dict)
    rate_limit_enabled: bool = False
    frontend: dict = field(default_factory=dict)   # disable_thinking, tool parser, ...
    load_id: int = 0                               # which load of this engine (a swap adds one)
    recipe: str | None = None                      # the recipe it was loaded from, if any

    def __post_init__(self):
        for name, kinds in (("name", str), ("model_type", str), ("max_seq_len", int),
                            ("max_num_seqs", int), ("vocab_size", (int, type(None))),
                            ("tokenizer_json", str),
                            ("chat_template", (str, type(None))), ("created", int),
                            ("rate_limit_enabled", bool), ("tokenizer_config", dict),
                            ("generation_config", dict), ("sampling_defaults", dict),
                            ("frontend", dict), ("load_id", int),
                            ("recipe", (str, type(None)))):
            value = getattr(self, name)
            if not isinstance(value, kinds) or (kinds is int and isinstance(value, bool)):
                raise ValueError(f"model_info.{name}: wrong type {type(value).__name__}")
        if self.tokenizer_config != _tokenizer_settings(self.tokenizer_config, strict=True):
            raise ValueError("model_info.tokenizer_config: only special tokens (strings) and "
                             f"add_bos/eos_token flags, got {self.tokenizer_config!r}")
        if self.generation_config != _generation_settings(self.generation_config, strict=True):
            raise ValueError("model_info.generation_config: only token ids and finite sampling "
                             f"numbers, got {self.generation_config!r}")
        for name in ("sampling_defaults", "frontend"):
            try:
                orjson.dumps(getattr(self, name))
            except TypeError as e:
                raise ValueError(f"model_info.{name} is not JSON-safe: {e}") from None

    @classmethod
    def from_checkpoint_configs(cls, tokenizer_config: Mapping | None,
                                generation_config: Mapping | None, **fields_) -> "ModelInfo":
        """From a checkpoint's raw config dicts: the keys frontends read, the rest dropped
        (what is dropped for being malformed is logged)."""
        return cls(tokenizer_config=_tokenizer_settings(tokenizer_config or {}),
                   generation_config=_generation_settings(generation_config or {}), **fields_)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> "ModelInfo":
        """ValueError on a malformed one; keys this side does not know are ignored (an engine
        newer than its frontend)."""
        if not isinstance(d, Mapping) or not isinstance(d.get("name"), str):
            raise ValueError(f"model_info without a name: {d!r:.200}")
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


def _tokenizer_settings(raw: Mapping, strict: bool = False) -> dict:
    out = {}
    for key in SPECIAL_TOKEN_KEYS:
        value = raw.get(key)
        if isinstance(value, Mapping) and not strict:
            value = value.get("content")      # an AddedToken dict
        if isinstance(value, str):
            out[key] = value
        elif value is not None:
            _dropped("tokenizer_config", key, value, strict)
    for key in TOKENIZER_FLAG_KEYS:
        if isinstance(raw.get(key), bool):
            out[key] = raw[key]
        elif raw.get(key) is not None:
            _dropped("tokenizer_config", key, raw[key], strict)
    return out


def _generation_settings(raw: Mapping, strict: bool = False) -> dict:
    out = {}
    for key in TOKEN_ID_KEYS:
        value = raw.get(key)
        if _is_token_id(value) or (isinstance(value, list) and value
                                   and all(_is_token_id(v) for v in value)):
            out[key] = value
        elif value is not None:
            _dropped("generation_config", key, value, strict)
    for key in SAMPLING_KEYS:
        value = raw.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) \
                and math.isfinite(value) and abs(value) < 2**53:
            out[key] = value
        elif value is not None:
            _dropped("generation_config", key, value, strict)
    return out


def _is_token_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _MAX_TOKEN_ID


def _dropped(where: str, key: str, value, strict: bool) -> None:
    if not strict:
        log.warning("%s.json: ignoring %s = %.100r (not a value the server can use)",
                    where, key, value)


def _ids_frame(ids: np.ndarray) -> bytes:
    return ids.astype("<i4", copy=False).tobytes()


def _ids(frame) -> np.ndarray:
    """The int32 frame as a read-only array over the frame's bytes (no copy)."""
    return np.frombuffer(frame, dtype="<i4").astype(np.int32, copy=False)


def encode(msg) -> list[bytes]:
    """Message -> multipart frames."""
    if type(msg) is StepOutput:
        # a delta's first 9 fields; all 12 on a speculating request's last one
        rows = [d[:9] if d[2] is None or not d[9] else d[:] for d in msg.deltas]
        # OPT_SERIALIZE_NUMPY: a numpy integer id or float logprob from a sampler serialises
        # too; default=tuple: a TokenLogprob (a NamedTuple, which orjson does not take) as a list
        return [b"step", orjson.dumps({"frontend_id": msg.frontend_id, "deltas": rows},
                                      default=tuple, option=orjson.OPT_SERIALIZE_NUMPY)]
    if type(msg) is Submit:
        head = {"request_id": msg.request_id, "frontend_id": msg.frontend_id,
                "sampling_params": msg.sampling_params.to_dict(), "load_id": msg.load_id}
        return [b"submit", orjson.dumps(head), _ids_frame(msg.prompt_token_ids)]
    kind = _KIND_OF.get(type(msg))
    if kind is None:
        raise TypeError(f"not a wire message: {type(msg).__name__}")
    return [kind, orjson.dumps(asdict(msg))]


def decode(frames: list[bytes]):
    """Multipart frames -> message; ValueError on anything malformed."""
    if not frames:
        raise ValueError("empty message")
    kind = bytes(frames[0])
    try:
        head = orjson.loads(frames[1])
        if kind == b"submit":
            params = SamplingParams.from_dict(head.pop("sampling_params"))
            return Submit(prompt_token_ids=_ids(frames[2]), sampling_params=params, **head)
        if kind == b"step":
            deltas = _deltas(head["deltas"])
            if not all(isinstance(d.request_id, str) for d in deltas):
                raise ValueError("a delta's request id is not a string")
            return StepOutput(frontend_id=head["frontend_id"], deltas=deltas)
        cls = _SIMPLE[kind]
    except (AttributeError, KeyError, IndexError, TypeError, ValueError,
            orjson.JSONDecodeError) as e:
        raise ValueError(f"malformed {kind!r} message: {e}") from e
    return cls(**head)


def _tuplify(x):
    """JSON lists back to the tuples the dataclasses hold (deeply)."""
    return tuple(_tuplify(i) if isinstance(i, (list, tuple)) else i for i in x)


def _deltas(rows) -> tuple[TokenDelta, ...]:
    """A StepOutput's positional rows (9 fields, or 12 on a speculating request's last delta)
    back to TokenDeltas, each row turned into its delta in place: twice as fast as unpacking
    every row into the constructor's arguments."""
    out = []
    for row in rows:
        n = len(row)
        if n != 9 and n != 12:
            raise ValueError(f"a delta has {n} fields, not 9 or 12")
        row[1] = tuple(row[1])
        row[6] = _logprobs(row[6]) if row[6] else ()
        if n == 9:
            row += _NO_SPEC
        out.append(_new_tuple(TokenDelta, row))
    return tuple(out)


_NO_SPEC = (0, 0, 0)
_new_tuple = tuple.__new__


def _logprobs(rows) -> tuple[TokenLogprob, ...]:
    return tuple(TokenLogprob(lp, _tuplify(top)) for lp, top in rows)


_SIMPLE = {b"abort": Abort, b"heartbeat": Heartbeat, b"health": HealthCheck,
           b"model_info": ModelInfoQuery, b"stats": StatsQuery, b"rate_limit": RateLimitCheck,
           b"reply": ControlReply, b"load_model": LoadModel, b"library": LibraryQuery,
           b"model_changed": ModelChanged, b"store": StoreRequest}
_KIND_OF = {cls: kind for kind, cls in _SIMPLE.items()}
CONTROL_REQUESTS = (HealthCheck, ModelInfoQuery, StatsQuery, RateLimitCheck, LoadModel,
                    LibraryQuery, StoreRequest)


def kind(msg) -> str:
    """A message's kind as it travels (its first frame): "health", "rate_limit", ..."""
    return _KIND_OF[type(msg)].decode()
