"""Gunicorn settings for the frontend workers, and the worker class.

One gunicorn arbiter forks N workers sharing one listening socket; each worker runs uvicorn
with the Falcon ASGI app (frontends.app). ASGI workers because one worker must hold hundreds of
open SSE streams: each is a coroutine parked on the engine's output, not a thread. The arbiter
replaces a worker that dies (kill -9 included); requests in flight on it are aborted by the
engine when its heartbeats stop.
"""
from __future__ import annotations

from gunicorn.glogging import Logger
from uvicorn_worker import UvicornWorker

from metrale import levers
from metrale.engine_process import LOG_FORMAT

GRACEFUL_TIMEOUT_S = 5


class MetraleWorker(UvicornWorker):
    """uvicorn on asyncio + h11 (pure Python, nothing to compile); lifespan on, because the
    app opens its engine client there. The h11 protocol is frontends.limits' guarded one: a
    deadline on request heads (slowloris) and protocol errors in our JSON error shape."""
    CONFIG_KWARGS = {
        "loop": "asyncio",
        "http": "frontends.limits:GuardedH11Protocol",
        "lifespan": "on",
        "h11_max_incomplete_event_size": levers.get("METRALE_MAX_HEADER_BYTES"),
        "timeout_graceful_shutdown": GRACEFUL_TIMEOUT_S - 2,
    }


class MetraleLogger(Logger):
    """gunicorn's (and, through UvicornWorker, uvicorn's) lines in the engine's format: one log
    format for the whole `met serve` output."""
    error_fmt = LOG_FORMAT
    datefmt = None


def options(bind: str, workers: int, log_level: str = "info") -> dict:
    return {
        "bind": bind,
        "workers": workers,
        "worker_class": "frontends.gunicorn_conf.MetraleWorker",
        "timeout": 60,                  # the arbiter kills a worker silent for this long
        "graceful_timeout": GRACEFUL_TIMEOUT_S,
        "keepalive": 5,
        "loglevel": log_level,
        "accesslog": None,
        "errorlog": "-",
        "logger_class": "frontends.gunicorn_conf.MetraleLogger",
        # gunicorn's own HTTP parser is not used by uvicorn workers: no limit_request_* here;
        # header limits are frontends.limits (h11's max_incomplete_event_size and InputLimits)
        "proc_name": "metrale-frontend",
        # gunicorn's control socket (gunicornc) defaults to one path per user
        # (~/.gunicorn/gunicorn.ctl): every instance would share it and the first to exit would
        # delete the others'. We do not use it.
        "control_socket_disable": True,
    }


def body_timeout_s() -> float:
    """Seconds a client may take to send its request body (METRALE_BODY_TIMEOUT_S)."""
    return levers.get("METRALE_BODY_TIMEOUT_S")
