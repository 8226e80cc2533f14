"""Recipes: one TOML file per servable model configuration, shipped in the package.

A recipe pins what `met serve` needs to serve one model one way: the checkpoint, the serve flags,
the runtime levers and notes. `met list`, `met show RECIPE` and `met run RECIPE [--print]` read
them; none of the three needs a GPU (`run --print` only prints the `met serve` command). A
running server swaps to one in place (metrale.swap: the Library, POST /v1/models/load,
--auto-swap). Besides the shipped folder, recipes are found in the folders of
METRALE_RECIPES_PATH (searched first).

    description = "one line"                 # required
    checkpoint = "Qwen/Qwen3.6-27B-FP8"      # required: an HF id, a path, or "embedded" (the
                                             # GGUF that ships with the package)
    family = "qwen3_5"                       # required: the model_type the engine builds
    format = "fp8"                           # required: bf16 | fp8 | nvfp4 | gguf-q4_1 | ...
    notes = "..."                            # optional

    [serve]          # any `met serve` flag by its long name, without the dashes
    max-seq-len = 32768
    enable-prefix-caching = true             # a boolean flag: `true`, or left out

    [env]            # declared METRALE_* levers only (metrale/levers.py)
    METRALE_FP8_W8A8 = "1"

Validation is the operator reference's: a boolean key is `true` or absent (`false` restates the
default and the recipe is refused); unknown keys, unknown flags, values the flag's own parser
refuses, and undeclared levers are refused with the recipe's path and line. A recipe's own
`model` / `model-from-path` serve keys are refused too: the checkpoint key is the one home of the
model.
"""
from __future__ import annotations

import functools
import os
import re
import shlex
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

RECIPE_DIR = Path(__file__).resolve().parent
TOP_KEYS = {"description": str, "checkpoint": str, "family": str, "format": str, "notes": str}
REQUIRED = ("description", "checkpoint", "family", "format")
SECTIONS = ("serve", "env")
EMBEDDED = "embedded"


class RecipeError(ValueError):
    """A recipe that is refused: `path:line: message`."""

    def __init__(self, path, line: int | None, message: str):
        self.path, self.line = str(path), line
        super().__init__(f"{path}:{line}: {message}" if line else f"{path}: {message}")


@dataclass(frozen=True)
class Recipe:
    name: str
    path: Path
    description: str
    checkpoint: str
    family: str
    format: str
    notes: str = ""
    serve: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)

    def serve_argv(self) -> list[str]:
        """The arguments of `met serve` this recipe runs (MODEL first unless embedded)."""
        argv = [] if self.checkpoint == EMBEDDED else [self.checkpoint]
        for key, value in self.serve.items():
            argv.append(f"--{key}")
            if value is not True:
                argv.append(_flag_value(value))
        return argv

    def command(self, extra: list[str] | None = None) -> str:
        """The full shell command, env levers first, as `met run` prints it."""
        env = [f"{k}={shlex.quote(str(v))}" for k, v in self.env.items()]
        return " ".join(env + ["met", "serve"] + [shlex.quote(a) for a in self.serve_argv() + (extra or [])])


def _flag_value(value) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value)) if abs(value) < 1e15 else repr(value)
    return str(value)


def recipe_dirs() -> list[Path]:
    """Where recipes are looked up: METRALE_RECIPES_PATH's folders (os.pathsep-separated; an
    operator's own recipes, tests' fixtures) first, then the shipped ones."""
    from metrale import levers

    extra = [Path(d).expanduser() for d in str(levers.get("METRALE_RECIPES_PATH")).split(os.pathsep)
             if d.strip()]
    return [*extra, RECIPE_DIR]


def names() -> list[str]:
    """Every recipe name once (a folder earlier in recipe_dirs() wins a name)."""
    return sorted({p.stem for d in recipe_dirs() for p in d.glob("*.toml")})


def all_recipes() -> list[Recipe]:
    return [load(n) for n in names()]


def find(name_or_path: str) -> Path:
    """A recipe by name (recipe_dirs()), or a recipe file by path."""
    p = Path(name_or_path)
    if p.suffix == ".toml" and p.is_file():
        return p
    for folder in recipe_dirs():
        found = folder / f"{name_or_path}.toml"
        if "/" not in name_or_path and found.is_file():
            return found
    close = [n for n in names() if name_or_path.lower() in n]
    hint = f"; did you mean {', '.join(close[:5])}?" if close else "; `met list` shows them"
    raise RecipeError(name_or_path, None, f"no recipe named {name_or_path!r}{hint}")


def load(name_or_path: str) -> Recipe:
    """Read and validate a recipe (RecipeError with path and line on anything refused)."""
    path = find(name_or_path)
    text = path.read_text(encoding="utf-8")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        m = re.search(r"line (\d+)", str(e))
        raise RecipeError(path, int(m.group(1)) if m else None, f"not valid TOML: {e}") from None
    for key, value in data.items():
        if key in SECTIONS:
            if not isinstance(value, dict):
                raise RecipeError(path, _line_of(text, None, key), f"{key} must be a [{key}] table")
            continue
        if key not in TOP_KEYS:
            raise RecipeError(path, _line_of(text, None, key),
                              f"unknown key {key!r} (known: {', '.join(sorted(TOP_KEYS))}, [serve], [env])")
        if not isinstance(value, TOP_KEYS[key]):
            raise RecipeError(path, _line_of(text, None, key), f"{key} must be a string")
    for key in REQUIRED:
        if key not in data:
            raise RecipeError(path, None, f"missing required key {key!r}")
    recipe = Recipe(name=path.stem, path=path, description=data["description"], checkpoint=data["checkpoint"],
                    family=data["family"], format=data["format"], notes=data.get("notes", ""),
                    serve=dict(data.get("serve", {})), env=dict(data.get("env", {})))
    _check_family(recipe, text)
    _check_env(recipe, text)
    _check_serve(recipe, text)
    _check_engine_config(recipe, text)
    return recipe


def _line_of(text: str, section: str | None, key: str) -> int | None:
    """1-based line of `key = ...` in [section] (None: the top level)."""
    current = None
    pattern = re.compile(r'^\s*(?:"%s"|%s)\s*=' % (re.escape(key), re.escape(key)))
    for i, line in enumerate(text.splitlines(), 1):
        head = re.match(r"^\s*\[([^\]]+)\]\s*(#.*)?$", line)
        if head:
            current = head.group(1).strip()
            if section is None and current == key:
                return i
            continue
        if current == section and pattern.match(line):
            return i
    return None


def _check_family(recipe: Recipe, text: str) -> None:
    from metrale.models.loader import SUPPORTED_MODEL_TYPES

    if recipe.family not in SUPPORTED_MODEL_TYPES:
        raise RecipeError(recipe.path, _line_of(text, None, "family"),
                          f"family {recipe.family!r} is not a model_type this build serves "
                          f"({', '.join(SUPPORTED_MODEL_TYPES)})")


def _check_env(recipe: Recipe, text: str) -> None:
    from metrale import levers

    for key, value in recipe.env.items():
        line = _line_of(text, "env", key)
        if key not in levers.LEVERS:
            raise RecipeError(recipe.path, line, f"{key} is not a declared lever (metrale/levers.py; "
                                                 f"`met dump-serve-options` lists them)")
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise RecipeError(recipe.path, line, f"{key}: a lever's value is a string or a number")
        try:
            levers.get(key, {key: str(value)})
        except ValueError as e:
            raise RecipeError(recipe.path, line, str(e)) from None


@functools.lru_cache(maxsize=1)
def _serve_parser():
    """`met serve`'s own parser (the one definition of the flags), built once per process."""
    import argparse

    from metrale.cli import build_parser

    parser = build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]


@functools.lru_cache(maxsize=1)
def _serve_actions() -> dict:
    """{--flag: its argparse action} of `met serve`."""
    from metrale.cli import _all_actions

    return {opt: action for action in _all_actions(_serve_parser()) for opt in action.option_strings}


def serve_args(recipe: Recipe):
    """The recipe's `met serve` command line as `met serve` parses it (an argparse Namespace):
    what a hot swap builds its engine spec from (metrale.swap)."""
    args, _ = _serve_parser().parse_known_args(recipe.serve_argv())
    return args


def _check_serve(recipe: Recipe, text: str) -> None:
    import argparse

    by_flag = _serve_actions()
    for key, value in recipe.serve.items():
        line = _line_of(text, "serve", key)
        if key in ("model", "model-from-path", "recipe"):
            raise RecipeError(recipe.path, line, "the checkpoint key names the model; leave it out of [serve]")
        action = by_flag.get(f"--{key}")
        if action is None or not key.replace("-", "").isalnum():
            raise RecipeError(recipe.path, line, f"[serve] {key}: `met serve` has no flag --{key}")
        if isinstance(action, argparse._StoreTrueAction):
            if value is not True:
                raise RecipeError(recipe.path, line,
                                  f"[serve] {key} = {value!r}: a boolean key is written `true` or left out"
                                  + (" (false restates the default)" if value is False else ""))
            continue
        if isinstance(value, (bool, dict, list)):
            raise RecipeError(recipe.path, line, f"[serve] {key}: --{key} takes a value, got {value!r}")
        if action.nargs not in (None, "?"):
            raise RecipeError(recipe.path, line, f"[serve] {key}: --{key} takes several values; not in a recipe")
        raw = _flag_value(value)
        try:
            parsed = action.type(raw) if action.type is not None else raw
        except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
            raise RecipeError(recipe.path, line, f"[serve] {key} = {value!r}: not a valid value of --{key} ({e})") from None
        if action.choices is not None and parsed not in action.choices:
            raise RecipeError(recipe.path, line, f"[serve] {key} = {value!r}: --{key} takes one of "
                                                 f"{', '.join(map(str, action.choices))}")


def _check_engine_config(recipe: Recipe, text: str) -> None:
    """The engine settings together, as `met serve` checks them before it starts anything."""
    from metrale.cli import engine_config_of
    from metrale.config import ConfigError, EngineConfig

    args, _ = _serve_parser().parse_known_args(recipe.serve_argv())
    try:
        EngineConfig(**engine_config_of(args)).validate()
    except ConfigError as e:
        message = str(e)
        key = next((k for k in recipe.serve if f"--{k}" in message or k.replace("-", "_") in message), None)
        raise RecipeError(recipe.path, _line_of(text, "serve", key) if key else None,
                          f"[serve] {message}") from None
