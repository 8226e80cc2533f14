"""Recipes (metrale/recipes/*.toml) and `met list` / `met show` / `met run`: every shipped
recipe validates and its command parses with `met serve`'s own parser; the validation rules of
the operator reference, each refusal naming the recipe's path and line; `met run --print` only
prints; `met run` of the CPU recipe serves a chat answer from the embedded model (no GPU)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import requests

from metrale import recipes
from metrale.cli import build_parser
from tests.serving import REPO, Server

GOOD = '''description = "a test recipe"
checkpoint = "embedded"
family = "llama"
format = "gguf-q4_1"

[serve]
device = "cpu"
max-seq-len = 2048
enable-prefix-caching = true

[env]
METRALE_GEMM_TUNE = "0"
'''


def met(*args, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "metrale.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def write(tmp_path, text: str, name="r.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


@pytest.mark.parametrize("name", recipes.names())
def test_every_shipped_recipe_validates_and_its_command_parses(name):
    recipe = recipes.load(name)
    args, extras = build_parser().parse_known_args(["serve", *recipe.serve_argv()])
    assert not extras and args.command == "serve"
    assert (args.model is None) == (recipe.checkpoint == "embedded")
    for key, value in recipe.serve.items():
        assert getattr(args, key.replace("-", "_"), None) is not None or key == "tool-call-parser"


def test_the_registry_covers_every_architecture_and_supported_format():
    shipped = recipes.all_recipes()
    from metrale.models.loader import SUPPORTED_MODEL_TYPES

    assert {r.family for r in shipped} == set(SUPPORTED_MODEL_TYPES)
    assert {"bf16", "fp8", "nvfp4", "gguf-q4_1"} <= {r.format for r in shipped}


def test_list_show_and_run_print():
    out = met("list")
    assert out.returncode == 0, out.stderr
    for name in recipes.names():
        assert name in out.stdout
    show = met("show", "qwen3.6-27b-fp8")
    assert show.returncode == 0 and "qwen3.6-27b-fp8.toml" in show.stdout
    assert "met serve Qwen/Qwen3.6-27B-FP8 --device cuda" in show.stdout
    run = met("run", "qwen3.6-27b-fp8", "--print", "--port", "9001")
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == ("met serve Qwen/Qwen3.6-27B-FP8 --device cuda --max-seq-len 32768 "
                                  "--max-num-seqs 64 --enable-prefix-caching --tool-call-parser qwen3_coder "
                                  "--port 9001")


def test_run_print_of_a_recipe_file_puts_its_levers_first(tmp_path):
    run = met("run", str(write(tmp_path, GOOD)), "--print")
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == ("METRALE_GEMM_TUNE=0 met serve --device cpu --max-seq-len 2048 "
                                  "--enable-prefix-caching")


REFUSALS = [
    (GOOD.replace("enable-prefix-caching = true", "enable-prefix-caching = false"), 9,
     "a boolean key is written `true` or left out (false restates the default)"),
    (GOOD.replace("enable-prefix-caching = true", 'enable-prefix-caching = "yes"'), 9,
     "a boolean key is written `true` or left out"),
    (GOOD.replace('format = "gguf-q4_1"', 'format = "gguf-q4_1"\ncolour = "red"'), 5, "unknown key 'colour'"),
    (GOOD.replace("max-seq-len = 2048", "max-seq-lenn = 2048"), 8, "`met serve` has no flag --max-seq-lenn"),
    (GOOD.replace("max-seq-len = 2048", 'max-seq-len = "long"'), 8, "not a valid value of --max-seq-len"),
    (GOOD.replace('device = "cpu"', 'device = "tpu"'), 7, "tpu"),
    (GOOD.replace('METRALE_GEMM_TUNE = "0"', 'METRALE_GEM_TUNE = "0"'), 12, "METRALE_GEM_TUNE is not a declared lever"),
    (GOOD.replace('METRALE_GEMM_TUNE = "0"', 'METRALE_MAX_BODY_BYTES = "lots"'), 12, "METRALE_MAX_BODY_BYTES"),
    (GOOD.replace('device = "cpu"', 'model = "x/y"'), 7, "the checkpoint key names the model"),
    (GOOD.replace('family = "llama"', 'family = "gpt2"'), 3, "family 'gpt2' is not a model_type"),
    (GOOD.replace('checkpoint = "embedded"\n', ""), None, "missing required key 'checkpoint'"),
    (GOOD.replace("max-seq-len = 2048", "max-seq-len = = 2048"), 8, "not valid TOML"),
]


@pytest.mark.parametrize("text,line,message", REFUSALS)
def test_refusals_name_the_path_and_line(tmp_path, text, line, message):
    path = write(tmp_path, text)
    with pytest.raises(recipes.RecipeError) as e:
        recipes.load(str(path))
    assert e.value.line == line and message in str(e.value), str(e.value)
    out = met("run", str(path), "--print")
    assert out.returncode == 2 and f"{path}:{line}:" in out.stderr if line else str(path) in out.stderr


def test_an_unknown_recipe_suggests_close_names():
    out = met("run", "qwen3.5", "--print")
    assert out.returncode == 2 and "no recipe named 'qwen3.5'" in out.stderr and "qwen3.5-9b" in out.stderr


def test_run_serves_the_cpu_recipe(tmp_path):
    srv = Server(["run", "smollm2-135m-cpu", "--frontends", "1", "--event-log", str(tmp_path / "events")],
                 tmp_path / "run.log")
    with srv.serving(workers=1):
        r = requests.post(srv.url + "/v1/chat/completions", timeout=120, json={
            "model": "SmolLM2-135M-Instruct", "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]
    head = srv.log_path.read_text(errors="replace").splitlines()[0]
    assert head.startswith("met serve --device cpu --max-seq-len 4096 --max-batch-size 8 --frontends 1")
