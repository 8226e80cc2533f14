"""Hot swap: the engine process changes its model in place (DESIGN.md section 8).

One code path for the three routes that reach it: the Library page and POST /v1/models/load
(frontends.library) send a `wire.LoadModel` naming a recipe or a model; `--auto-swap` sends one
with `auto` set when a request names another model. The engine's loop owns the swap:

    serving --LoadModel--> draining --no request left--> loading --> serving (the new model)
                                                                  \\-> serving (the old one, the
                                                                       load failed) or empty

* Refused before anything is released (the old model serves on): an unknown recipe, a recipe
  needing more than one rank, a device this machine lacks, engine flags that do not validate,
  and every refusal of the loader (unknown architecture, unsupported format, a missing or
  malformed file), which `engine_process.open_checkpoint` raises from headers and configs alone.
  A recipe's host, port and other process-level flags are ignored with a warning: the listening
  socket, the keys, the journal and the frontends belong to the process.
* draining: new submits get 503 `model_not_loaded` (Retry-After, as /health says while a model
  loads); the requests in flight finish on the model they started on (those still running after
  METRALE_SWAP_DRAIN_TIMEOUT_S are aborted).
* loading: `ModelReleased` is journalled, the old model's memory is given back in full (weights,
  KV and state pools, CUDA graphs and their pools, CuPy's cached blocks: `release`), the new
  model is built. While the loop's thread loads, a `LoadingResponder` thread serves the sockets:
  heartbeats are echoed, control requests answered (health says "loading"), submits refused
  with 503. A load that raises restores the previous model (loaded again); `ModelLoaded` says
  which model serves and what the failed load's error was.
* Each state change goes to every frontend as a `wire.ModelChanged`; on "serving" they fetch
  model_info again (the tokenizer, chat template, name and context length of the new model).
  A Submit tokenized for an earlier load (its load_id) is refused with 503, so no request runs
  on a model it was not tokenized for.

What the process owns survives: the journal, the rate-limit buckets, the metrics registry, the
frontends' key policy, and the engine's views of the journal (stored responses, conversations).
"""
from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import zmq

from metrale import levers, wire
from metrale.backends.base import EngineGraphs

log = logging.getLogger("metrale.swap")

SERVING, DRAINING, LOADING, EMPTY = "serving", "draining", "loading", "empty"
# `met serve` flags a swap cannot change: they belong to the process (warned, ignored)
PROCESS_FLAGS = ("host", "port", "frontends", "require_auth", "auth_token", "auth_tokens_file",
                 "metrics_public", "admin_token", "auto_swap", "engine_bind", "event_log",
                 "no_event_log")


class SwapRefused(ValueError):
    """A swap refused before anything was released: the HTTP status and code to answer with."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code = status, code


@dataclass
class SwapTarget:
    spec: object                   # engine_process.EngineSpec of the model to load
    label: str                     # what the logs and the Library call it
    warnings: list = field(default_factory=list)


# ---- what to load ------------------------------------------------------------------------------

def target_for(msg: wire.LoadModel, base) -> SwapTarget:
    """The spec a LoadModel asks for (SwapRefused when it names nothing loadable)."""
    if bool(msg.recipe) == bool(msg.model):
        raise SwapRefused(400, "invalid_request", "name exactly one of 'recipe' (a recipe name, "
                          "GET /v1/library lists them) or 'model' (an HF id or a path)")
    if msg.recipe:
        return recipe_target(load_recipe(msg.recipe), base)
    spec = dataclasses.replace(base, model=msg.model, model_name=None, chat_template=None,
                               recipe=None, env={})
    return SwapTarget(spec, msg.model)


def load_recipe(name: str):
    from metrale import recipes

    try:
        return recipes.load(name)
    except recipes.RecipeError as e:
        status, code = (404, "recipe_not_found") if "no recipe named" in str(e) \
            else (400, "recipe_invalid")
        raise SwapRefused(status, code, str(e)) from None


def recipe_target(recipe, base) -> SwapTarget:
    """The spec of a recipe: its flags over `met serve`'s defaults; the process's sockets and
    journal kept. More than one rank is refused; process-level flags are warned and ignored."""
    from metrale import recipes
    from metrale.cli import CLIError, default_model_path, model_spec_fields

    args = recipes.serve_args(recipe)
    if args.tensor_parallel_size != 1:
        raise SwapRefused(400, "multi_rank_recipe", f"recipe {recipe.name} needs "
                          f"{args.tensor_parallel_size} ranks: hot swap is single-node, so it is "
                          "refused (start it with `met run`)")
    warnings = [f"recipe {recipe.name}: --{k.replace('_', '-')} is ignored by a hot swap (the "
                "process keeps its own: the socket is bound once)"
                for k in PROCESS_FLAGS if k.replace("_", "-") in recipe.serve]
    warnings += [f"recipe {recipe.name}: {k} is read by the frontends, which a hot swap does "
                 "not restart: it is ignored" for k in recipe.env
                 if levers.LEVERS[k].reader.startswith("frontends/")]
    try:
        model = default_model_path() if recipe.checkpoint == recipes.EMBEDDED else recipe.checkpoint
        fields = model_spec_fields(args, model)
    except CLIError as e:
        raise SwapRefused(400, "recipe_invalid", f"recipe {recipe.name}: {e}") from None
    fields.update(recipe=recipe.name, env={k: str(v) for k, v in recipe.env.items()})
    return SwapTarget(dataclasses.replace(base, **fields), recipe.name, warnings)


class RecipeIndex:
    """Every recipe that loads and the refusals of those that do not, read again only when a
    recipe file changed: --auto-swap asks on every request that names another model, and the
    Library every two seconds."""

    def __init__(self):
        self.key, self.recipes, self.errors = None, [], []

    def get(self) -> tuple[list, list]:
        from metrale import recipes

        files = sorted((str(p), p.stat().st_mtime_ns) for d in recipes.recipe_dirs()
                       for p in d.glob("*.toml"))
        if self.key != files:
            self.recipes, self.errors = [], []
            for name in recipes.names():
                try:
                    self.recipes.append(recipes.load(name))
                except recipes.RecipeError as e:
                    self.errors.append(str(e))
            self.key = files
        return self.recipes, self.errors


def auto_target(name: str, live_info: wire.ModelInfo, live_spec, known: list):
    """--auto-swap: the recipe a request's model name resolves to, or None (unrecognised, or the
    model already live): the request is then answered as without --auto-swap."""
    if name in (live_info.name, live_spec.model, live_spec.recipe):
        return None
    for recipe in known:
        served = recipe.serve.get("model-name") or recipe.serve.get("served-model-name")
        if name in (recipe.name, recipe.checkpoint, served):
            if recipe.name == live_spec.recipe or recipe.checkpoint == live_spec.model \
                    or served == live_info.name:
                return None
            return recipe
    return None


def precheck(spec) -> None:
    """Everything that can refuse `spec` without releasing the live model (SwapRefused)."""
    from metrale.backends import cuda_available
    from metrale.config import ConfigError, EngineConfig
    from metrale.engine_process import open_checkpoint

    try:
        EngineConfig(**spec.engine_config).validate()
    except ConfigError as e:
        raise SwapRefused(400, "invalid_engine_flags", str(e)) from None
    if spec.engine_config.get("device") == "cuda" and not cuda_available():
        raise SwapRefused(400, "device_unavailable", f"{spec.model} asks for --device cuda and "
                          "this machine has no usable GPU")
    try:
        with applied_env(spec.env):
            open_checkpoint(spec)
    except (OSError, ValueError) as e:     # CheckpointError, ChatTemplateError, a bad file
        found = "not found" not in str(e)
        raise SwapRefused(400 if found else 404,
                          "model_not_supported" if found else "model_not_found", str(e)) from None


class applied_env:
    """A recipe's levers in os.environ while it loads (the previous values put back after)."""

    def __init__(self, env: dict):
        self.env, self.saved = env, {}

    def __enter__(self):
        for k, v in self.env.items():
            self.saved[k] = os.environ.get(k)
            os.environ[k] = v

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ---- releasing a model -------------------------------------------------------------------------

def release(core) -> Callable[[], None]:
    """Close `core` (swap files, cuBLAS handles) and return what hands its memory back, to be
    called once the caller's last reference is gone:

        reclaim = release(core); del core; reclaim()

    A model on CUDA is a graph of reference cycles, so its arrays are freed by the collector,
    which cannot free what a caller still holds: collecting inside this call, while the caller's
    `core` was alive, freed nothing, and each swap kept the previous model's memory (measured on
    the H200: +24 GB per 9B swap). `reclaim()` collects, then on CUDA gives the graphs' memory
    pools and CuPy's cached blocks back, so the next model starts from the memory the process
    had before."""
    device = core.device
    pools = EngineGraphs(core.runner.graphs, core.runner.step_graphs,
                         core.runner.verify_graphs).pools()
    core.close()
    device.synchronize()
    del core
    return functools.partial(collect, device, pools)


def collect(device=None, pools=()) -> None:
    """Collect unreachable objects (a model is a graph of cycles), then hand the device's cached
    blocks back (`device`: the released engine's, metrale.backends.base.Device; None: none)."""
    gc.collect()
    if device is not None:
        device.free_cached(pools)


def memory_figures(core) -> dict:
    """What the engine process holds: the device's used bytes and CuPy's pool on CUDA, the
    resident set on every backend."""
    out = {"rss_bytes": _rss_bytes()}
    if core is not None:
        out.update(core.device.memory_figures())
    return out


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


# ---- the state machine -------------------------------------------------------------------------

class Swap:
    """The swap state of one EngineServer (its loop calls `tick` every iteration)."""

    def __init__(self, server):
        self.server = server
        self.state = SERVING
        self.target: SwapTarget | None = None
        self.started = 0.0
        self.swap_id = 0
        self.last: dict | None = None          # the outcome of the last swap
        self.loaded_at = time.time()
        self.recipes = RecipeIndex()

    # -- requests ---------------------------------------------------------------------------
    def request(self, msg: wire.LoadModel) -> dict:
        """A LoadModel: refused (SwapRefused), ignored (auto, nothing to swap to) or accepted."""
        if self.state not in (SERVING, EMPTY):
            raise SwapRefused(409, "swap_in_progress", f"a swap to {self._target_label()} is "
                              f"{self.state}; wait for it (GET /v1/library)")
        base = self.server.spec
        if base is None:
            raise SwapRefused(400, "swap_unsupported", "this engine was not started by `met "
                              "serve` (no spec to swap from)")
        if msg.auto:
            recipe = auto_target(msg.model, self.server.model_info, base,
                                 self.recipes.get()[0])
            if recipe is None:
                return {"accepted": False, "reason": "not a different model with a known recipe"}
            target = recipe_target(recipe, base)
        else:
            target = target_for(msg, base)
        precheck(target.spec)
        for w in target.warnings:
            log.warning("%s", w)
        self.swap_id += 1
        self.state, self.target, self.started = DRAINING, target, time.monotonic()
        log.info("swap %d: to %s; draining %d requests in flight", self.swap_id, target.label,
                 len(self.server.live))
        self.server.notify_frontends(wire.ModelChanged(DRAINING, target.label))
        return {"accepted": True, "swap_id": self.swap_id, "state": DRAINING,
                "target": target.label, "warnings": target.warnings,
                "in_flight": len(self.server.live)}

    def accepting(self) -> bool:
        return self.state == SERVING

    def why_not(self) -> str:
        if self.state == EMPTY:
            return "no model is loaded (the last load failed: see GET /v1/library); load one"
        return f"the server is swapping to {self._target_label()} ({self.state}); retry shortly"

    def _target_label(self) -> str:
        return self.target.label if self.target else "?"

    # -- the loop's part --------------------------------------------------------------------
    def tick(self) -> None:
        if self.state != DRAINING:
            return
        server = self.server
        if server.live:
            if time.monotonic() - self.started < levers.get("METRALE_SWAP_DRAIN_TIMEOUT_S"):
                return
            log.warning("swap %d: %d requests still running after the drain timeout: aborted",
                        self.swap_id, len(server.live))
            for rid in list(server.live):
                server.abort_request(rid, "swap")
            if server.live:
                return
        self._load()

    def _load(self) -> None:
        server = self.server
        old_spec, old_info = server.spec, server.model_info
        if server.core is not None:
            server.emit("ModelReleased", model=old_info.name, reason="swap",
                        to=self.target.label, swap_id=self.swap_id)
            server.commit_events()
        self.state = LOADING
        server.notify_frontends(wire.ModelChanged(LOADING, self.target.label))
        responder = LoadingResponder(server)
        responder.start()
        try:
            outcome = self._replace(old_spec, old_info.load_id + 1)
        finally:
            responder.stop()
        self._finish(outcome, old_info)

    def _replace(self, old_spec, load_id: int) -> dict:
        """Release the live model, build the target; on failure build the old one again."""
        server = self.server
        device = server.core.device if server.core is not None else None
        if server.core is not None:
            core, server.core = server.core, None
            reclaim = release(core)
            del core
            reclaim()
        t0 = time.monotonic()
        error = self._build(self.target.spec, load_id)
        if error is None:
            server.spec = self.target.spec
            return {"ok": True, "load_s": round(time.monotonic() - t0, 3)}
        log.error("swap %d: loading %s failed (%s); restoring %s", self.swap_id,
                  self.target.label, error, old_spec.model)
        collect(device)                 # what the failed build had made
        restore_error = self._build(old_spec, load_id)
        if restore_error is None:
            return {"ok": False, "error": error, "restored": True}
        log.error("swap %d: restoring %s failed too (%s): no model loaded", self.swap_id,
                  old_spec.model, restore_error)
        collect(device)
        return {"ok": False, "error": error, "restored": False, "restore_error": restore_error}

    def _build(self, spec, load_id: int) -> str | None:
        """Load `spec` into the server; None, or what went wrong (logged with its traceback)."""
        from metrale.engine_process import load_engine

        try:
            with applied_env(spec.env):
                self.server.core, self.server.model_info = load_engine(spec, load_id)
            return None
        except Exception as e:    # noqa: BLE001 - reported in the reply, the log and the journal
            log.debug("loading %s failed", spec.model, exc_info=True)
            return f"{type(e).__name__}: {e}"

    def _finish(self, outcome: dict, old_info: wire.ModelInfo) -> None:
        server = self.server
        seconds = time.monotonic() - self.started
        self.last = {"swap_id": self.swap_id, "target": self.target.label, "from": old_info.name,
                     "seconds": round(seconds, 3), "finished_at": time.time(), **outcome}
        if server.core is None:
            self.state = EMPTY
            server.emit("ModelLoadFailed", model=self.target.label, error=outcome["error"],
                        swap_id=self.swap_id)
            server.notify_frontends(wire.ModelChanged(EMPTY, ""))
        else:
            self.state, self.loaded_at = SERVING, time.time()
            info = server.model_info
            server.metrics.model = info.name
            server.emit("ModelLoaded", model=info.name, model_type=info.model_type,
                        recipe=info.recipe, load_id=info.load_id, swap_id=self.swap_id,
                        seconds=round(seconds, 3), error=outcome.get("error"),
                        spec=spec_record(server.spec))
            server.notify_frontends(wire.ModelChanged(SERVING, info.name, info.load_id))
            log.info("swap %d: serving %s after %.2fs%s", self.swap_id, info.name, seconds,
                     "" if outcome["ok"] else f" (restored: {outcome['error']})")
        server.commit_events()
        self.target = None

    def status(self) -> dict:
        out = {"state": self.state, "swap_id": self.swap_id, "last": self.last}
        if self.state in (DRAINING, LOADING):
            out.update(target=self._target_label(),
                       elapsed_s=round(time.monotonic() - self.started, 3),
                       in_flight=len(self.server.live))
        return out


class LoadingResponder(threading.Thread):
    """Serves the engine's sockets while the loop's thread loads a model: the server's own
    handlers, which answer for a server without a core (health "loading", submits 503). The
    loop's thread touches no socket until `stop` has joined this thread."""

    def __init__(self, server):
        super().__init__(name="metrale-swap-responder", daemon=True)
        self.server = server
        self.stopped = threading.Event()

    def run(self) -> None:
        server = self.server
        poller = zmq.Poller()
        poller.register(server.pull, zmq.POLLIN)
        poller.register(server.control, zmq.POLLIN)
        while not self.stopped.is_set():
            ready = dict(poller.poll(50))
            try:
                if server.pull in ready:
                    server.drain_submits()
                if server.control in ready:
                    server.drain_control()
                server.commit_events()
            except Exception:     # noqa: BLE001 - the load goes on; the next poll serves on
                log.exception("the swap responder failed to answer a message")

    def stop(self) -> None:
        self.stopped.set()
        self.join()


# ---- a restarted engine serves the model swapped in ------------------------------------------

SPEC_FIELDS = ("model", "engine_config", "cache_dir", "model_name", "disable_template_overrides",
               "chat_template", "frontend", "load_format", "recipe", "env")


def spec_record(spec) -> dict:
    """What of an EngineSpec a ModelLoaded event carries: the model's fields (not the process's
    sockets and journal), so an engine restarted after a crash loads what was live."""
    return {k: getattr(spec, k) for k in SPEC_FIELDS}


def resumed_spec(spec):
    """`spec` with the model of the journal's last ModelLoaded (each carries the spec of the
    model it loaded): the supervisor restarts a crashed engine from its command line's spec,
    and it must come back with the model that was live, a hot swap's, not the one `met serve`
    started with."""
    from metrale.events import scan_segment, segments

    for path in reversed(segments(spec.journal_dir)):
        loaded = [e for e in scan_segment(path) if isinstance(e, dict)
                  and e.get("type") == "ModelLoaded"]
        if loaded:
            fields = loaded[-1].get("spec")
            if not isinstance(fields, dict):
                return spec
            log.info("resuming %s, the model live before the restart (swap %s)",
                     fields.get("model"), loaded[-1].get("swap_id"))
            return dataclasses.replace(spec, **{k: v for k, v in fields.items()
                                                if k in SPEC_FIELDS})
    return spec


# ---- the Library's data ------------------------------------------------------------------------

def library(server) -> dict:
    """The live model, the swap, the recipes, the HF cache's models, memory."""
    info, spec = server.model_info, server.spec
    live = None
    if server.core is not None and spec is not None:
        live = {"model": info.name, "model_type": info.model_type, "recipe": info.recipe,
                "checkpoint": spec.model, "max_seq_len": info.max_seq_len,
                "load_id": info.load_id, "device": server.core.ops.name,
                "loaded_at": server.swap.loaded_at}
    return {"live": live, "swap": server.swap.status(),
            "recipes": recipe_list(server.swap.recipes),
            "hf_cache": hf_cache_models(spec.cache_dir if spec else None),
            "memory": memory_figures(server.core)}


def recipe_list(index: RecipeIndex) -> dict:
    loaded, errors = index.get()
    out = []
    for r in loaded:
        out.append({"name": r.name, "description": r.description, "checkpoint": r.checkpoint,
                    "family": r.family, "format": r.format, "notes": r.notes,
                    "command": r.command(), "device": r.serve.get("device", "auto")})
    return {"recipes": out, "errors": errors}


def hf_cache_models(cache_dir: str | None) -> dict:
    """The `models--org--name` entries of the HF hub cache, with their size on disk."""
    from pathlib import Path

    from metrale.models.loader import hf_hub_cache

    hub = Path(hf_hub_cache(cache_dir))
    models = []
    if hub.is_dir():
        for entry in sorted(hub.glob("models--*")):
            if entry.is_dir():
                size = sum(p.stat().st_size for p in (entry / "blobs").glob("*") if p.is_file()) \
                    if (entry / "blobs").is_dir() else 0
                models.append({"id": entry.name.removeprefix("models--").replace("--", "/"),
                               "size_bytes": size})
    return {"path": str(hub), "models": models}
