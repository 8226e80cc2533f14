"""Run the frontend workers: a gunicorn arbiter with N uvicorn workers serving frontends.app.

    python -m frontends.server '<json spec>'    (what `met serve` starts)
    run_frontends(spec)                         (what `met frontend` calls, in-process)

The spec: {"bind": "127.0.0.1:8888", "workers": N, "settings": FrontendSettings fields}.
"""
from __future__ import annotations

import json
import logging
import sys

from gunicorn.app.base import BaseApplication

from frontends import gunicorn_conf
from frontends.app import FrontendSettings, create_app


class FrontendServer(BaseApplication):
    def __init__(self, settings: FrontendSettings, options: dict):
        self.settings = settings
        self.options = options
        super().__init__()

    def load_config(self):
        for key, value in self.options.items():
            self.cfg.set(key, value)

    def load(self):
        # called in each worker after the fork: the engine client is opened in the lifespan
        return create_app(self.settings)


def run_frontends(spec: dict) -> None:
    settings = FrontendSettings.from_dict(spec["settings"])
    level = logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()
    FrontendServer(settings, gunicorn_conf.options(spec["bind"], spec["workers"],
                                                   level)).run()


def main(argv=None) -> int:
    from metrale.engine_process import setup_logging

    setup_logging()
    run_frontends(json.loads((sys.argv[1:] if argv is None else argv)[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
