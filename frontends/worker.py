"""A frontend worker's per-process state and the request plumbing every route shares.

    Worker          the engine client, the model's tokenizer and chat template (from the
                    engine's `model_info`, so a frontend on another host needs no model files,
                    fetched again after a hot swap: metrale.swap), the auth check (and the
                    admin check of model loading), --auto-swap and the engine-kept rate limits
    FrontendSettings
    read_json       a request body as checked JSON (frontends.limits)
    write_error     an APIError as the response (the OpenAI shape; Anthropic's on /v1/messages*)

frontends.app builds the ASGI app around it; see its docstring for auth, rate limits, engine
loss and the access log.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import math
from dataclasses import dataclass, field

import falcon
import tokenizers

from frontends import limits
from metrale import levers, wire
from metrale.api import errors
from metrale.api.errors import APIError
from metrale.chat import ChatTemplate
from metrale.client import AsyncEngineClient, ControlError, EngineUnavailable
from metrale.tokenizer import Tokenizer

log = logging.getLogger("metrale.frontend")

MODEL_INFO_RETRY_S = 0.5
MODEL_INFO_TIMEOUT_S = 1.0     # per model_info attempt while the engine loads or restarts
FIRST_READY_WAIT_S = 15.0      # a request waits this long for a starting worker's first model_info
PROBE_TIMEOUT_S = 2.0
SWAP_WATCH_S = 1.0             # how often a worker asks the engine's health during a hot swap


@dataclass
class FrontendSettings:
    engine: dict                                  # EngineAddresses.to_dict()
    auth_tokens: list[str] = field(default_factory=list)
    require_auth: bool = False
    metrics_public: bool = False
    admin_tokens: list[str] = field(default_factory=list)   # may load models (also in auth_tokens)
    auto_swap: bool = False
    max_body_bytes: int = 32 * 2**20
    body_timeout_s: float = 30.0
    control_timeout_s: float = 5.0
    max_header_bytes: int = field(
        default_factory=lambda: levers.get("METRALE_MAX_HEADER_BYTES"))
    max_messages: int = field(default_factory=lambda: levers.get("METRALE_MAX_MESSAGES"))

    def __post_init__(self):
        if any(not t.strip() for t in self.auth_tokens):
            raise ValueError("an API key is empty: every --auth-token and every line of "
                             "--auth-tokens-file must hold a key")
        if self.require_auth and not self.auth_tokens:
            raise ValueError("--require-auth needs at least one key: pass --auth-token KEY or "
                             "--auth-tokens-file PATH")

    @classmethod
    def from_dict(cls, d: dict) -> "FrontendSettings":
        return cls(**d)


class Worker:
    """Per-process state: the engine client and the model's tokenizer and template."""

    def __init__(self, settings: FrontendSettings):
        self.settings = settings
        self.client: AsyncEngineClient | None = None
        self.info: dict | None = None
        self.ready_info: dict | None = None
        self.tokenizer: Tokenizer | None = None
        self.template: ChatTemplate | None = None
        self.max_prompt_bytes = 0        # more UTF-8 than this cannot fit the context (_use)
        self._loader: asyncio.Task | None = None
        self._ever_ready = False
        self._key_digests = [_digest(t) for t in settings.auth_tokens]
        self._admin_digests = [_digest(t) for t in settings.admin_tokens]
        self.swapping: wire.ModelChanged | None = None   # a swap under way (not serving)

    async def startup(self) -> None:
        self.client = AsyncEngineClient(self.settings.engine,
                                        control_timeout_s=self.settings.control_timeout_s,
                                        on_lost=self.engine_lost,
                                        on_model_changed=self.model_changed)
        self.client.start()
        self._loader = asyncio.get_running_loop().create_task(self._load_model_info())

    async def shutdown(self) -> None:
        if self._loader:
            self._loader.cancel()
        if self.client:
            await self.client.close()

    async def _load_model_info(self) -> None:
        while True:
            try:
                info = wire.ModelInfo.from_dict(await self.client.control(
                    wire.ModelInfoQuery(), timeout_s=MODEL_INFO_TIMEOUT_S)).to_dict()
            except EngineUnavailable:
                await asyncio.sleep(MODEL_INFO_RETRY_S)
                continue
            except ControlError as e:
                if e.data.get("code") != "model_not_loaded":
                    log.error("the engine's model_info is unusable (%s); asking again", e)
                await asyncio.sleep(MODEL_INFO_RETRY_S)
                continue
            except ValueError as e:     # a model_info that does not validate
                log.error("the engine's model_info is unusable (%s); asking again", e)
                await asyncio.sleep(MODEL_INFO_RETRY_S)
                continue
            self._use(info)
            while not await self._probe():
                pass
            self.ready_info = info
            self._ever_ready = True
            log.info("frontend ready for %s", info.get("name"))
            return

    async def _probe(self) -> bool:
        """Proves the engine's output reaches this worker: no client request is sent before the
        output subscription is connected (see AsyncEngineClient.wait_subscribed)."""
        return await self.client.wait_subscribed(PROBE_TIMEOUT_S)

    def _use(self, info: dict) -> None:
        backend = tokenizers.Tokenizer.from_str(info["tokenizer_json"])
        tok = Tokenizer(backend, info.get("tokenizer_config"), info.get("generation_config"))
        template = None
        if info.get("chat_template"):
            template = ChatTemplate(info["chat_template"], special_tokens=tok.special_tokens_map,
                                    origin=f"the chat template of {info.get('name')}")
        self.tokenizer, self.template, self.info = tok, template, info
        self.max_prompt_bytes = max_prompt_bytes(backend, info["max_seq_len"])
        self.client.load_id = info.get("load_id", 0)

    def engine_lost(self) -> None:
        """The engine stopped answering: serve 503 until it is back and a probe went through
        (after a restart the output subscription must be proven again)."""
        if self._loader is None or self._loader.done():
            self.ready_info = None
            self._loader = asyncio.get_running_loop().create_task(self._load_model_info())

    def model_changed(self, msg: wire.ModelChanged) -> None:
        """A hot swap's state (metrale.swap): 503 while it drains and loads; once the engine
        serves again, model_info is fetched again (the new model's tokenizer, template, name,
        context length) before the next request is served."""
        if msg.state != "serving":
            if self.swapping is None:
                asyncio.get_running_loop().create_task(self._watch_swap())
            self.swapping = msg
            return
        if self.ready_info is not None and self.ready_info.get("load_id") == msg.load_id:
            self.swapping = None
            return
        self.ready_info = None
        self.swapping = None
        if self._loader is not None and not self._loader.done():
            self._loader.cancel()
        self._loader = asyncio.get_running_loop().create_task(self._load_model_info())

    async def _watch_swap(self) -> None:
        """While a swap is under way, ask the engine's health now and then: the end of a swap
        is noticed even if its ModelChanged never reached this worker."""
        while self.swapping is not None:
            await asyncio.sleep(SWAP_WATCH_S)
            try:
                health = await self.client.control(wire.HealthCheck(), timeout_s=PROBE_TIMEOUT_S)
            except (EngineUnavailable, ControlError):
                continue
            if health.get("status") == "ok" and self.swapping is not None:
                self.model_changed(wire.ModelChanged("serving", health.get("model", ""),
                                                     health.get("load_id", 0)))

    def ready(self) -> dict:
        """The model info; 503 while the engine has not answered yet or a swap is under way."""
        if self.swapping is not None:
            if self.swapping.state == "empty":
                raise errors.engine_unavailable("no model is loaded: the last swap failed and "
                                                "the previous model could not be restored")
            target = f" to {self.swapping.model}" if self.swapping.model else ""
            raise errors.engine_unavailable(f"the server is swapping models{target}: "
                                            f"{self.swapping.state}")
        if self.ready_info is None:
            raise errors.engine_unavailable("the model is still loading")
        return self.ready_info

    async def ready_soon(self) -> dict:
        """ready() for a client request: a worker that has never been ready yet, while its
        first model_info is on the way, lets the request wait for it (up to FIRST_READY_WAIT_S)
        instead of answering 503. The workers of a server become ready one at a time, a second
        or so apart, so a client that saw /health answer 200 from one worker would otherwise
        get 503 from the next. After an engine restart the 503 + Retry-After is immediate."""
        loader = self._loader
        if self.ready_info is None and not self._ever_ready and loader is not None \
                and not loader.done():
            try:
                await asyncio.wait_for(asyncio.shield(loader), FIRST_READY_WAIT_S)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                pass
        return self.ready()

    # -- auth and rate limits -------------------------------------------------------------------
    def api_key(self, req) -> str | None:
        return _presented_key(req.get_header("Authorization"), req.get_header("x-api-key"))

    def is_open(self, path: str) -> bool:
        """Routes served without a key: /health, the Library page's static files, and /metrics
        with --metrics-public."""
        path = path.rstrip("/") or "/"
        return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES) \
            or (path == "/metrics" and self.settings.metrics_public)

    def gate(self, scope) -> None:
        """The auth check at the ASGI layer (frontends.limits.InputLimits), before the body is
        read: a client without a key cannot make a worker buffer a body."""
        if not self.settings.require_auth or self.is_open(scope.get("path", "")):
            return
        headers = dict(scope["headers"])        # a repeated header: the last one counts
        auth, x_key = headers.get(b"authorization"), headers.get(b"x-api-key")
        self.check_key(_presented_key(auth and auth.decode("latin-1"),
                                      x_key and x_key.decode("latin-1")))

    def check_auth(self, req) -> None:
        if self.settings.require_auth:
            self.check_key(self.api_key(req))

    def check_key(self, key: str | None) -> None:
        presented = _digest(key or "")
        ok = False
        for digest in self._key_digests:   # every key, no early exit: timing says nothing
            ok |= hmac.compare_digest(presented, digest)
        if not ok or not key:
            raise APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>' "
                           "or 'x-api-key: <key>'", code="invalid_api_key")

    def check_admin(self, req) -> None:
        """Changing the model (POST /v1/models/load) with auth on needs an admin key
        (--admin-token): 401 without a valid key, 403 with a key that is not an admin's."""
        if not self.settings.require_auth:
            return
        key = self.api_key(req)
        self.check_key(key)
        presented, ok = _digest(key or ""), False
        for digest in self._admin_digests:
            ok |= hmac.compare_digest(presented, digest)
        if not ok:
            raise APIError(403, "changing the served model needs an admin key (--admin-token)",
                           code="admin_key_required")

    async def auto_swap(self, body, served: str) -> None:
        """--auto-swap: a request naming a different model that the engine resolves to a known
        recipe starts a swap to it and is answered 503 model_not_loaded + Retry-After (a retry
        is served by the new model); a name no recipe knows is served by the live model, as
        Ollama's auto-swap does (the body's `model` becomes the live one's, which the answer
        then names). Without the flag nothing changes (an unknown name gets 404)."""
        if not isinstance(body, dict):
            return
        requested = body.get("model")
        if not self.settings.auto_swap or not isinstance(requested, str) or not requested \
                or requested == served:
            return
        try:
            reply = await self.client.control(wire.LoadModel(model=requested, auto=True))
        except ControlError as e:
            if e.data.get("code") != "swap_in_progress":
                raise APIError(e.data.get("status", 400), str(e), param="model",
                               code=e.data.get("code")) from None
            reply = {"accepted": True, "target": requested}
        except EngineUnavailable as e:
            raise errors.engine_unavailable(str(e)) from None
        if reply.get("accepted"):
            raise errors.engine_unavailable(f"loading {reply.get('target', requested)} "
                                            "(--auto-swap)")
        body["model"] = served

    def rate_limit_key(self, req) -> str:
        """Whose bucket a request is charged to: the API key (as a digest: the engine never
        holds secrets) when auth is on, else the client address."""
        if self.settings.require_auth:
            return "key:" + _digest(self.api_key(req) or "").hex()[:32]
        return f"addr:{req.remote_addr or ''}"

    async def rate_limit(self, req, resp, num_tokens: int) -> None:
        if not self.info.get("rate_limit_enabled"):
            return
        answer = await self.client.control(wire.RateLimitCheck(self.rate_limit_key(req),
                                                               num_tokens))
        headers = {}
        for name in ("requests", "tokens"):
            if f"limit_{name}" in answer:
                headers[f"x-ratelimit-limit-{name}"] = str(answer[f"limit_{name}"])
                headers[f"x-ratelimit-remaining-{name}"] = str(answer[f"remaining_{name}"])
                if f"reset_{name}" in answer:
                    headers[f"x-ratelimit-reset-{name}"] = duration(answer[f"reset_{name}"])
        if not answer.get("allowed", True):
            wait = answer.get("retry_after", 1.0)
            headers["Retry-After"] = str(max(1, math.ceil(wait)) if math.isfinite(wait) else 60)
            limit = answer.get("limit_tokens")
            if limit is not None and num_tokens > limit:
                message = (f"this request needs {num_tokens} tokens (prompt + max_tokens) but "
                           f"the token budget of this key is {limit}; lower max_tokens")
            else:
                message = ("rate limit exceeded for this key; retry after "
                           f"{headers['Retry-After']}s")
            raise APIError(429, message, code="rate_limit_exceeded", headers=headers)
        resp.set_headers(headers)


def max_prompt_bytes(backend: tokenizers.Tokenizer, max_seq_len: int) -> int:
    """The most UTF-8 bytes a prompt of max_seq_len tokens can hold: the longest token's bytes
    (as its vocabulary string, which is never shorter than the text it decodes to), x2 for
    normalizers that shorten text."""
    longest = max((len(t.encode("utf-8", "surrogatepass")) for t in backend.get_vocab()),
                  default=16)
    return 2 * max(16, longest) * max_seq_len


def _presented_key(authorization: str | None, x_api_key: str | None) -> str | None:
    """`Authorization: Bearer KEY` if sent, else `x-api-key: KEY`."""
    auth = authorization or ""
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return x_api_key


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def duration(seconds: float) -> str:
    """OpenAI's spelling of x-ratelimit-reset-*: 20ms, 1.5s, 6m0s."""
    if not math.isfinite(seconds) or seconds < 0:
        seconds = 0.0
    ms = math.ceil(seconds * 1000)
    if ms < 1000:
        return f"{ms}ms"
    minutes, rest = divmod(ms / 1000, 60)
    secs = f"{round(rest, 3):g}s"
    return f"{int(minutes)}m{secs}" if minutes else secs



OPEN_PATHS = ("/health", "/")          # "/": the Library page (frontends.library), static
OPEN_PREFIXES = ("/library/",)         # the page's script and style


def write_error(req, resp, e: APIError) -> None:
    resp.status = e.status
    resp.content_type = falcon.MEDIA_JSON
    resp.data = e.json_for(req.path)      # the Anthropic shape on /v1/messages*
    resp.set_headers(e.headers)
    resp.stream = None



async def read_json(req, settings: FrontendSettings):
    """The request body as JSON, checked by frontends.limits.parse_json (400 naming what is
    wrong). Size (413) and deadline (408) were enforced by limits.InputLimits, which has read
    the body already; they are checked again here for an app run without it."""
    limit = settings.max_body_bytes
    if req.content_length is not None and req.content_length > limit:
        raise limits.too_large(limit)
    try:
        raw = await asyncio.wait_for(_read_limited(req.stream, limit), settings.body_timeout_s)
    except asyncio.TimeoutError:
        raise APIError(408, "the request body did not arrive within "
                       f"{settings.body_timeout_s:g}s (METRALE_BODY_TIMEOUT_S)",
                       code="request_timeout") from None
    if not raw.strip():
        raise errors.invalid("the request body is empty; send a JSON object")
    return limits.parse_json(raw, settings.max_messages)


async def _read_limited(stream, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in stream:
        size += len(chunk)
        if size > limit:
            raise limits.too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)

