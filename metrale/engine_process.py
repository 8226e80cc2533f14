"""The engine process's entry: load the checkpoint, build the core, serve it over ZeroMQ until told to stop.

    python -m metrale.engine_process '<json spec>'      (started by `met serve`, see metrale.serve)

The spec (`EngineSpec.to_json`) names the model, the EngineConfig fields, the socket addresses,
the journal folder and the settings frontends read from `model_info`. Everything a frontend needs
to serve the model travels in `model_info` (a wire.ModelInfo; the tokenizer.json CONTENT
included), so frontends on other hosts need no model files.

SIGTERM / SIGINT stop the loop after the current step; the journal is closed cleanly.
"""
from __future__ import annotations

import importlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

from metrale import levers
from metrale.config import EngineConfig

log = logging.getLogger("metrale.engine")
# the one log line format of every Metrale process (the frontends' gunicorn and uvicorn too)
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


@dataclass
class EngineSpec:
    model: str
    addresses: dict
    engine_config: dict = field(default_factory=dict)
    cache_dir: str | None = None
    model_name: str | None = None
    journal_dir: str | None = None
    disable_template_overrides: bool = False
    chat_template: str | None = None               # --chat-template: a file's path or the text
    frontend: dict = field(default_factory=dict)   # disable_thinking, tool parser, ...
    progress: bool = True
    load_format: str = "auto"                      # auto | dummy (random weights, benchmarks)
    recipe: str | None = None                      # the recipe `met run` / a swap loaded
    env: dict = field(default_factory=dict)        # that recipe's levers (metrale.swap applies them)
    resume: bool = False                           # a restart: the model swapped in, if any, again

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "EngineSpec":
        return cls(**json.loads(text))


class _ProgressTensors(Mapping):
    """The checkpoint's tensor mapping, counting reads on a tqdm bar (the model builder reads
    each tensor once, so the bar follows the load)."""

    def __init__(self, tensors: Mapping, bar):
        self.tensors, self.bar, self.seen = tensors, bar, set()

    def __getitem__(self, name):
        value = self.tensors[name]
        if name not in self.seen:
            self.seen.add(name)
            self.bar.update(1)
        return value

    def __contains__(self, name):
        return name in self.tensors

    def __iter__(self):
        return iter(self.tensors)

    def __len__(self):
        return len(self.tensors)


def build_server(spec: EngineSpec):
    """Journal -> checkpoint -> EngineCore -> EngineServer (sockets bound, not yet running).
    The journal folder is taken first: a second engine on it is refused before any load."""
    from metrale.events import Journal

    journal = Journal(spec.journal_dir) if spec.journal_dir else None
    try:
        return _build_server(spec, journal)
    except BaseException:
        if journal is not None:
            journal.close()
        raise


def _build_server(spec: EngineSpec, journal):
    from metrale.engine_server import EngineAddresses, EngineServer

    t0 = time.monotonic()
    core, model_info = load_engine(spec)
    server = EngineServer(core, model_info, EngineAddresses(**spec.addresses), journal)
    server.spec = spec          # what a failed swap restores (metrale.swap)
    log.info("engine serving %s (%s) in %.1fs on %s", model_info.name, model_info.model_type,
             time.monotonic() - t0, spec.addresses["submit"])
    return server


def open_checkpoint(spec: EngineSpec):
    """(checkpoint, tokenizer, chat template text or None) of the spec's model: headers and
    configs only (no weights read), so every refusal of the loader comes here, cheaply: a swap
    calls it before it releases anything (metrale.swap)."""
    from metrale.chat import ChatTemplateError, load_chat_template
    from metrale.models.loader import load_checkpoint
    from metrale.tokenizer import Tokenizer

    ckpt = load_checkpoint(spec.model, cache_dir=spec.cache_dir, name=spec.model_name,
                           load_format=spec.load_format, device=_weights_device(spec))
    tokenizer = Tokenizer.from_checkpoint(ckpt)
    try:
        template = load_chat_template(ckpt.model_type, ckpt.chat_template,
                                      special_tokens=tokenizer.special_tokens_map,
                                      explicit=spec.chat_template,
                                      disable_overrides=spec.disable_template_overrides)
        chat_template = template.sources.get("default") or next(iter(template.sources.values()))
    except ChatTemplateError as e:
        if spec.chat_template is not None:
            raise                  # the operator's --chat-template must work, or nothing starts
        log.warning("no chat template (%s): /v1/chat/completions will refuse requests", str(e))
        chat_template = None
    return ckpt, tokenizer, chat_template


def load_engine(spec: EngineSpec, load_id: int = 1):
    """(EngineCore, wire.ModelInfo) of the spec's model: the checkpoint loaded and built."""
    from metrale import wire
    from metrale.engine_core import EngineCore
    from metrale.ratelimit import RateLimiter
    from metrale.sampling import engine_sampling_defaults

    ckpt, tokenizer, chat_template = open_checkpoint(spec)
    config = EngineConfig(**spec.engine_config)
    model_len = ckpt.config.get("max_position_embeddings")
    if model_len and config.max_seq_len > model_len:
        log.info("--max-seq-len %d is above the model's %d positions: using %d",
                 config.max_seq_len, model_len, model_len)
        config.max_seq_len = int(model_len)
    bar = _progress_bar(spec, ckpt)
    if bar is not None:
        ckpt.tensors = _ProgressTensors(ckpt.tensors, bar)
    try:
        core = EngineCore(ckpt, config)
    finally:
        if bar is not None:
            bar.close()
    core.use_tokenizer(tokenizer)      # EOS ids, and the grammars of structured output
    with open(ckpt.tokenizer_json, encoding="utf-8") as f:
        tokenizer_json = f.read()
    vocab_size = ckpt.config.get("vocab_size")
    model_info = wire.ModelInfo.from_checkpoint_configs(
        ckpt.tokenizer_config, ckpt.generation_config,
        name=ckpt.name, model_type=ckpt.model_type, max_seq_len=core.config.max_seq_len,
        max_num_seqs=core.config.max_num_seqs,
        vocab_size=vocab_size if isinstance(vocab_size, int) else None,
        tokenizer_json=tokenizer_json, chat_template=chat_template, created=int(time.time()),
        sampling_defaults=engine_sampling_defaults(core.config),
        rate_limit_enabled=RateLimiter.from_levers().enabled, frontend=spec.frontend,
        load_id=load_id, recipe=spec.recipe)
    return core, model_info


def _weights_device(spec: EngineSpec) -> str:
    """Where dummy weights are made: the engine's device."""
    from metrale.backends import cuda_available

    device = spec.engine_config.get("device", "auto")
    return ("cuda" if cuda_available() else "cpu") if device == "auto" else device


def _progress_bar(spec: EngineSpec, ckpt):
    if not spec.progress:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=len(ckpt.tensors), desc=f"loading {ckpt.name}", unit="tensor",
                file=sys.stderr, leave=False)


def setup_logging() -> None:
    level = str(levers.get("METRALE_LOG_LEVEL")).upper()
    logging.basicConfig(stream=sys.stderr, level=getattr(logging, level, logging.INFO),
                        format=LOG_FORMAT)


def import_model_plugins() -> None:
    """The modules METRALE_MODEL_PLUGINS names (tests' fixture models register themselves)."""
    for name in str(levers.get("METRALE_MODEL_PLUGINS")).split(","):
        if name.strip():
            importlib.import_module(name.strip())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    setup_logging()
    spec = EngineSpec.from_json(argv[0])
    stop = {"requested": False}

    def on_signal(signum, frame):
        stop["requested"] = True
        if server is not None:
            server.running = False
        else:  # still loading: nothing to save, leave now
            raise SystemExit(0)

    server = None
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        import_model_plugins()
        if spec.resume and spec.journal_dir:
            from metrale.swap import resumed_spec

            spec = resumed_spec(spec)
            os.environ.update(spec.env)          # a resumed recipe's levers
        server = build_server(spec)
    except Exception as e:  # noqa: BLE001 - reported, then a non-zero exit
        log.error("the engine could not start: %s", e, exc_info=log.isEnabledFor(logging.DEBUG))
        return 1
    if stop["requested"]:
        server.running = False
    try:
        server.run()
    finally:
        server.close()
    log.info("engine stopped (pid %d)", os.getpid())
    return 0


if __name__ == "__main__":
    sys.exit(main())
