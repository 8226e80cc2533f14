"""A test fixture: a llama checkpoint whose config.json says `"metrale_test_load_delay_s": S`
takes S seconds longer to build (any other checkpoint builds as before), so a test can watch a
hot swap's loading phase (metrale.swap.LoadingResponder answering while the engine's loop
loads). A served engine imports it with METRALE_MODEL_PLUGINS=tests.slow_load_model (after
tests.scripted_model when both are wanted: this wraps whatever llama builder is registered).
"""
from __future__ import annotations

import time

from metrale.models import registry

DELAY_KEY = "metrale_test_load_delay_s"


def slow_or(builder):
    def build(ckpt, ops):
        delay = ckpt.config.get(DELAY_KEY)
        if isinstance(delay, (int, float)) and delay > 0:
            time.sleep(delay)
        return builder(ckpt, ops)
    return build


registry.register("llama", slow_or(registry.builder("llama")))
