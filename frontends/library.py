"""The Library: the page at `/` and the routes behind it (the hot swap itself: metrale.swap).

    GET  /                   a browser (Accept: text/html) gets the Library page; any other
                             client a small JSON index of the server
    GET  /library/{file}     the page's script and style (package data: frontends/static/)
    GET  /v1/library         what the page shows that /metrics and /v1/models do not: the live
                             model and its recipe, the swap state (state, target, elapsed) and
                             the last swap's outcome, the recipes, the HF cache's models, memory
    POST /v1/models/load     {"recipe": NAME} or {"model": HF_ID_OR_PATH}, optional "wait"
                             (default true: answer once the new model serves, or the swap
                             failed; false: 202 at once) and "timeout" (seconds, default 600)

The page and its two files are static and hold nothing secret, so they are served without a
key; everything they read goes through the API's own auth (the page asks for a key when one is
needed). Loading a model needs an admin key when auth is on (Worker.check_admin). The page
polls /v1/library and /metrics (Prometheus text, parsed in the page) every two seconds; it works
offline: no external asset, no build step.
"""
from __future__ import annotations

import asyncio
import math
import time
from importlib import resources

import falcon

from frontends.request_plumbing import Resource, json_response
from frontends.worker import Worker, read_json
from metrale import __version__, wire
from metrale.api import errors
from metrale.api.errors import APIError
from metrale.client import ControlError, EngineUnavailable

STATIC_FILES = {"library.js": "text/javascript; charset=utf-8",
                "library.css": "text/css; charset=utf-8"}
PAGE = "library.html"
SWAP_POLL_S = 0.25
DEFAULT_WAIT_S = 600.0
READY_WAIT_S = 30.0                     # after a swap: this worker's model_info fetched again


def static_file(name: str) -> bytes:
    return resources.files("frontends").joinpath("static", name).read_bytes()


def wants_html(req) -> bool:
    """A browser's navigation asks for text/html first; curl and SDKs send */* or JSON."""
    accept = (req.get_header("Accept") or "").lower()
    return "text/html" in accept


class Index(Resource):
    async def on_get(self, req, resp):
        if wants_html(req):
            resp.content_type = falcon.MEDIA_HTML
            resp.data = static_file(PAGE)
            resp.set_header("Cache-Control", "no-cache")
            return
        info = self.worker.ready_info
        json_response(resp, {"object": "server", "name": "metrale", "version": __version__,
                             "model": info.get("name") if info else None,
                             "library": "/v1/library", "models": "/v1/models",
                             "openapi": "/openapi.json"})


class Static(Resource):
    async def on_get(self, req, resp, name):
        if name not in STATIC_FILES:
            raise falcon.HTTPNotFound()
        resp.content_type = STATIC_FILES[name]
        resp.data = static_file(name)
        resp.set_header("Cache-Control", "no-cache")


class Library(Resource):
    async def on_get(self, req, resp):
        data = await engine_library(self.worker)
        data["frontend"] = {"auto_swap": self.worker.settings.auto_swap,
                            "auth": self.worker.settings.require_auth,
                            "admin_keys": bool(self.worker.settings.admin_tokens)}
        json_response(resp, data)


async def engine_library(worker: Worker) -> dict:
    try:
        return await worker.client.control(wire.LibraryQuery())
    except EngineUnavailable as e:
        raise errors.engine_unavailable(str(e)) from None


class LoadModel(Resource):
    async def on_post(self, req, resp):
        self.worker.check_admin(req)
        body = await read_json(req, self.worker.settings)
        msg, wait, timeout = parse_load_request(body)
        try:
            accepted = await self.worker.client.control(msg)
        except ControlError as e:
            raise APIError(e.data.get("status", 400), str(e), code=e.data.get("code"),
                           param="recipe" if msg.recipe else "model") from None
        except EngineUnavailable as e:
            raise errors.engine_unavailable(str(e)) from None
        result = {"object": "model_load", "swap_id": accepted["swap_id"],
                  "target": accepted["target"], "warnings": accepted.get("warnings", [])}
        if not wait:
            json_response(resp, {**result, "status": accepted["state"],
                                 "in_flight": accepted.get("in_flight", 0)}, 202)
            return
        last = await wait_for_swap(self.worker, accepted["swap_id"], timeout)
        if last is None:
            json_response(resp, {**result, "status": "loading",
                                 "detail": f"still loading after {timeout:g}s; GET /v1/library "
                                           "follows it"}, 202)
            return
        if last.get("served"):
            await self.worker_ready(last)
        json_response(resp, *load_outcome(result, last))

    async def worker_ready(self, last: dict) -> None:
        """Until this worker has the served model's info (so the client's next request to it
        is tokenized for the new model), at most READY_WAIT_S."""
        deadline = time.monotonic() + READY_WAIT_S
        while time.monotonic() < deadline:
            info = self.worker.ready_info
            if info is not None and info.get("name") == last.get("served"):
                return
            await asyncio.sleep(SWAP_POLL_S)


def parse_load_request(body) -> tuple[wire.LoadModel, bool, float]:
    if not isinstance(body, dict):
        raise errors.invalid("the request body must be a JSON object")
    unknown = sorted(set(body) - {"recipe", "model", "wait", "timeout"})
    if unknown:
        raise errors.invalid(f"unknown field {unknown[0]!r} (known: recipe, model, wait, "
                             "timeout)", unknown[0])
    recipe, model = body.get("recipe"), body.get("model")
    for name, value in (("recipe", recipe), ("model", model)):
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise errors.invalid(f"'{name}' must be a non-empty string", name)
    if (recipe is None) == (model is None):
        raise errors.invalid("send exactly one of 'recipe' (a recipe name: GET /v1/library "
                             "lists them) or 'model' (an HF id or a path)", "recipe")
    wait = body.get("wait", True)
    if not isinstance(wait, bool):
        raise errors.invalid("'wait' must be true or false", "wait")
    timeout = body.get("timeout", DEFAULT_WAIT_S)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) \
            or not math.isfinite(timeout) or not 0 < timeout <= 3600:
        raise errors.invalid("'timeout' must be a number of seconds in (0, 3600]", "timeout")
    return wire.LoadModel(recipe=recipe or "", model=model or ""), wait, float(timeout)


async def wait_for_swap(worker: Worker, swap_id: int, timeout: float) -> dict | None:
    """The engine's record of swap `swap_id` once it is over (None: still running at the
    timeout), with "served": the model serving after it (None when none is)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        await asyncio.sleep(SWAP_POLL_S)
        try:
            lib = await worker.client.control(wire.LibraryQuery())
        except EngineUnavailable:
            continue
        last = lib["swap"].get("last")
        if lib["swap"]["state"] not in ("draining", "loading") and last \
                and last.get("swap_id") == swap_id:
            return {**last, "served": (lib.get("live") or {}).get("model")}
    return None


def load_outcome(result: dict, last: dict) -> tuple[dict, int]:
    """The response of a swap that ended: 200 loaded; 422 the load failed (the previous model
    restored, or 503 when none could be)."""
    out = {**result, "model": last.get("served"), "seconds": last.get("seconds")}
    if last.get("ok"):
        return {**out, "status": "loaded"}, 200
    error = {"message": f"loading {last['target']} failed: {last['error']}", "type":
             "invalid_request_error", "param": None, "code": "model_load_failed"}
    if last.get("restored"):
        error["message"] += f"; the previous model {last.get('served')} was restored"
        return {**out, "status": "restored", "error": error}, 422
    error["message"] += f"; restoring the previous model failed too ({last.get('restore_error')})"
    return {**out, "status": "empty", "error": error}, 503


def add_routes(app, worker: Worker) -> None:
    app.add_route("/", Index(worker))
    app.add_route("/library/{name}", Static(worker))
    app.add_route("/v1/library", Library(worker))
    app.add_route("/v1/models/load", LoadModel(worker))
