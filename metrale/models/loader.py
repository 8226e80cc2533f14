"""Load a checkpoint from an HF folder, the HF hub cache (offline) or a GGUF file.

`load_checkpoint(model)` is the one entry point. `model` may be:

- a folder holding `config.json` and `*.safetensors` (single file, or shards named by
  `model.safetensors.index.json`);
- a `.gguf` file (see metrale.models.gguf_loader);
- an HF model id `org/name`, found in the local HF hub cache without any network access:
  `<cache>/models--org--name/snapshots/<rev>/`, where `<rev>` is the one `refs/main` names, else the
  newest snapshot.

Safetensors weights are never copied: each file is memory-mapped once and `Checkpoint.tensors` is a
lazy mapping that builds a numpy view over the mapping when a tensor is asked for (bf16 as
`ml_dtypes.bfloat16`). We parse the safetensors header ourselves (8-byte little-endian length, JSON
header, data offsets relative to the end of the header) so that every malformed file gets an error
naming the file and what is wrong with it.
"""
from __future__ import annotations

import json
import logging
import mmap
import os
import re
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from metrale.models.checkpoint import Checkpoint, CheckpointError
from metrale.models.quant import describe_weight_groups, read_quant_config, weight_groups

log = logging.getLogger("metrale.models.loader")

SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3", "qwen2", "llama", "mistral",
                         "gemma4", "minimax_m2", "deepseek_v3", "nemotron_h", "ministral",
                         "ministral3")

# Multimodal wrappers save their text config as `<type>_text`; we serve the text model under the
# wrapper's name. A Mistral3ForConditionalGeneration text_config without a model_type is a
# `mistral` one (HF Mistral3Config's default).
_TEXT_MODEL_TYPES = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe", "gemma4_text": "gemma4",
                     "mistral3": "mistral"}

_SAFETENSORS_DTYPES = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16), "I16": np.dtype(np.int16),
    "U32": np.dtype(np.uint32), "I32": np.dtype(np.int32),
    "U64": np.dtype(np.uint64), "I64": np.dtype(np.int64),
    "F16": np.dtype(np.float16), "F32": np.dtype(np.float32), "F64": np.dtype(np.float64),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
}

# Prefixes of tensors that are not part of the text model (vision tower): dropped. Then
# prefixes renamed to the text model's HF names; the multi-token-prediction head's tensors are
# kept as `mtp.*` (metrale.models.mtp builds it when the checkpoint ships it).
_DROPPED_PREFIXES = ("model.visual.", "visual.",
                     # Mistral3ForConditionalGeneration's Pixtral tower and projector (both layouts)
                     "vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                     "model.multi_modal_projector.")
_RENAMED_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.mtp.", "mtp."),
)

_MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors format's own limit


def load_checkpoint(model: str, cache_dir: str | None = None, name: str | None = None,
                    load_format: str = "auto", device: str = "cpu") -> Checkpoint:
    """Load `model` (HF folder, `.gguf` file, or `org/name` in the local HF cache).

    `load_format="dummy"` reads only the folder's config and tokenizer files and makes random
    weights on `device` as the model asks for them (metrale.models.dummy): benchmarks of real
    shapes without weight files.
    `cache_dir` overrides the HF hub cache folder (default: $HF_HUB_CACHE, else $HF_HOME/hub, else
    ~/.cache/huggingface/hub); for GGUF files it is also where the generated tokenizer.json goes.
    `name` overrides what /v1/models reports (default: the model id, folder or file name).
    """
    path, model_id = resolve_model_path(model, cache_dir)
    if load_format == "dummy":
        from metrale.models.dummy import dummy_from

        return dummy_from(load_hf_folder(path, name=name or model_id or _default_folder_name(path),
                                         weights=False), device)
    if load_format != "auto":
        raise CheckpointError(f"unknown load format {load_format!r}: use auto or dummy")
    if os.path.isfile(path):
        if not _is_gguf_file(path):
            raise CheckpointError(
                f"{path}: is a file but not a GGUF file (no 'GGUF' magic); pass a .gguf file or "
                f"a folder with config.json and *.safetensors")
        from metrale.models.gguf_loader import load_gguf

        return load_gguf(path, cache_dir=cache_dir, name=name)
    return load_hf_folder(path, name=name or model_id or _default_folder_name(path))


# ---------------------------------------------------------------------------------------------
# Finding the checkpoint


def resolve_model_path(model: str, cache_dir: str | None = None) -> tuple[str, str | None]:
    """(local path, HF model id or None) for `model`; CheckpointError listing where we looked."""
    expanded = os.path.expanduser(model)
    if os.path.exists(expanded):
        return os.path.abspath(expanded), None
    searched = [os.path.abspath(expanded)]
    if _looks_like_model_id(model):
        root = hf_hub_cache(cache_dir)
        repo_dir = os.path.join(root, "models--" + model.replace("/", "--"))
        searched.append(os.path.join(repo_dir, "snapshots"))
        if os.path.isdir(repo_dir):
            return hf_cache_snapshot(repo_dir), model
    where = "\n  ".join(searched)
    raise CheckpointError(
        f"model {model!r} not found. Looked in:\n  {where}\n"
        f"Pass an existing HF checkpoint folder, a .gguf file, or an 'org/name' id that is already "
        f"in the HF cache (set cache_dir, $HF_HUB_CACHE or $HF_HOME to point at it; nothing is "
        f"downloaded).")


def hf_hub_cache(cache_dir: str | None = None) -> str:
    """The HF hub cache folder, resolved the way huggingface_hub does it."""
    if cache_dir:
        return os.path.expanduser(cache_dir)
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    return os.path.join(os.path.expanduser("~"), ".cache", "huggingface", "hub")


def hf_cache_snapshot(repo_dir: str) -> str:
    """The snapshot folder `refs/main` names, else the newest one."""
    snapshots = os.path.join(repo_dir, "snapshots")
    ref_file = os.path.join(repo_dir, "refs", "main")
    if os.path.isfile(ref_file):
        with open(ref_file, encoding="utf-8") as f:
            revision = f.read().strip()
        chosen = os.path.join(snapshots, revision)
        if not os.path.isdir(chosen):
            raise CheckpointError(
                f"{ref_file} names revision {revision!r} but {chosen} does not exist; the cache is "
                f"incomplete: download the model again or remove the stale ref")
        return chosen
    revisions = sorted(os.listdir(snapshots)) if os.path.isdir(snapshots) else []
    if not revisions:
        raise CheckpointError(
            f"{repo_dir}: the HF cache entry has no snapshots (looked in {snapshots}); download "
            f"the model again")
    return max((os.path.join(snapshots, r) for r in revisions), key=os.path.getmtime)


def _looks_like_model_id(model: str) -> bool:
    return re.fullmatch(r"[\w.\-]+/[\w.\-]+", model) is not None


def _is_gguf_file(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _default_folder_name(folder: str) -> str:
    """`org/name` for a folder inside the HF cache, else the folder's own name."""
    match = re.search(r"models--([^/]+?)--([^/]+)/snapshots/[^/]+/?$", folder)
    if match:
        return f"{match.group(1)}/{match.group(2)}"
    return os.path.basename(os.path.normpath(folder))


# ---------------------------------------------------------------------------------------------
# HF folders


def load_hf_folder(folder: str, name: str, weights: bool = True) -> Checkpoint:
    """A Checkpoint over an HF checkpoint folder (config.json + safetensors + tokenizer files);
    `weights=False` skips the safetensors (the dummy load format needs none)."""
    config = read_text_config(folder)
    tensors = SafetensorsTensors(_safetensors_files(folder) if weights else [])
    quant = read_quant_config(config, folder) if weights else None
    if weights:
        log.info("%s: %s%s", folder, f"{quant.describe}; " if quant else "",
                 describe_weight_groups(weight_groups(tensors, quant)))
    tokenizer_config = _read_json_if_present(os.path.join(folder, "tokenizer_config.json")) or {}
    tokenizer_json = os.path.join(folder, "tokenizer.json")
    return Checkpoint(
        config=config,
        tensors=tensors,
        path=folder,
        name=name,
        generation_config=read_generation_config(folder, config),
        tokenizer_json=tokenizer_json if os.path.isfile(tokenizer_json) else None,
        tokenizer_config=tokenizer_config,
        chat_template=read_chat_template(folder, tokenizer_config),
        tensor_files=tensors.files,
        quant=quant,
    )


def read_text_config(folder: str) -> dict:
    """config.json with a multimodal `text_config` flattened in, model_type checked."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise CheckpointError(
            f"{folder}: no config.json; an HF checkpoint folder needs config.json next to its "
            f"*.safetensors (or pass a .gguf file)")
    config = flatten_text_config(_read_json(path))
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"{path}: model_type {model_type!r} (architectures {config.get('architectures')}) is "
            f"not supported; supported model_types: {', '.join(SUPPORTED_MODEL_TYPES)}")
    return config


def flatten_text_config(config: dict) -> dict:
    """The text model's config: `text_config` (when present) over the top-level keys.

    Top-level keys fill in what the text config lacks. `tie_word_embeddings` is taken from the top
    level when it is there, because the top-level model (e.g. Qwen3_5ForConditionalGeneration) is
    the one that owns lm_head and HF transformers ties it by the top-level flag.
    """
    text = config.get("text_config")
    if not isinstance(text, dict):
        flat = dict(config)
    else:
        outer = {k: v for k, v in config.items() if k not in ("text_config", "vision_config")}
        flat = {**outer, **text}
        if "tie_word_embeddings" in config:
            flat["tie_word_embeddings"] = config["tie_word_embeddings"]
    model_type = flat.get("model_type")
    flat["model_type"] = _TEXT_MODEL_TYPES.get(model_type, model_type)
    return flat


# What transformers' GenerationConfig.from_model_config takes from config.json when a key is unset.
_GENERATION_IDS_FROM_CONFIG = ("bos_token_id", "eos_token_id", "pad_token_id")


def read_generation_config(folder: str, config: dict) -> dict:
    """generation_config.json, its unset token ids (eos_token_id: an int or a list) filled in
    from config.json, as transformers does for a checkpoint that ships none."""
    generation = _read_json_if_present(os.path.join(folder, "generation_config.json")) or {}
    for key in _GENERATION_IDS_FROM_CONFIG:
        if generation.get(key) is None and config.get(key) is not None:
            generation[key] = config[key]
    return generation


CHAT_TEMPLATE_DIR = "additional_chat_templates"


def read_chat_template(folder: str, tokenizer_config: dict) -> str | dict[str, str] | None:
    """The checkpoint's chat template(s), chosen as transformers' tokenizer loading does:
    template files (`chat_template.jinja` as "default", `additional_chat_templates/<name>.jinja`
    by name) win over tokenizer_config.json's `chat_template` (a string, or a list of named
    ones); a processor's `chat_template.json` is the last resort. One template is a string,
    several a name -> template dict."""
    files = _template_files(folder)
    if files:
        return files["default"] if list(files) == ["default"] else files
    template = tokenizer_config.get("chat_template")
    if template is None:
        template = (_read_json_if_present(os.path.join(folder, "chat_template.json")) or {}).get(
            "chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}, ...]
        return {t["name"]: t["template"] for t in template
                if isinstance(t, dict) and isinstance(t.get("template"), str)}
    return template


def _template_files(folder: str) -> dict[str, str]:
    paths = {}
    if os.path.isfile(os.path.join(folder, "chat_template.jinja")):
        paths["default"] = os.path.join(folder, "chat_template.jinja")
    extra = os.path.join(folder, CHAT_TEMPLATE_DIR)
    if os.path.isdir(extra):
        paths.update((n[: -len(".jinja")], os.path.join(extra, n))
                     for n in sorted(os.listdir(extra)) if n.endswith(".jinja"))
    templates = {}
    for name, path in paths.items():
        with open(path, encoding="utf-8") as f:
            templates[name] = f.read()
    return templates


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e}); re-download or re-save the checkpoint") from e
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object, found {type(value).__name__}")
    return value


def _read_json_if_present(path: str) -> dict | None:
    return _read_json(path) if os.path.isfile(path) else None


# ---------------------------------------------------------------------------------------------
# Safetensors


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives: its file, dtype, shape and absolute byte offset."""
    file: "SafetensorsFile"
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int


class SafetensorsFile:
    """One memory-mapped .safetensors file, its header parsed and checked against the file size."""

    def __init__(self, path: str):
        self.path = path
        self.size = os.path.getsize(path)
        header, data_start = self._read_header()
        self.metadata = header.pop("__metadata__", None) or {}
        self.entries = {name: self._entry(name, info, data_start) for name, info in header.items()}
        self._mmap: mmap.mmap | None = None

    def view(self, entry: TensorEntry) -> np.ndarray:
        """A read-only numpy view of `entry` over the file mapping (no copy)."""
        if self._mmap is None:
            with open(self.path, "rb") as f:
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return np.ndarray(entry.shape, dtype=entry.dtype, buffer=self._mmap, offset=entry.offset)

    def _read_header(self) -> tuple[dict, int]:
        if self.size < 8:
            raise self._error(f"file is {self.size} bytes, shorter than the 8-byte header length")
        with open(self.path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > min(self.size - 8, _MAX_HEADER_BYTES):
                raise self._error(f"header length {length} is past the end of the file "
                                  f"({self.size} bytes) or over the 100 MB limit")
            raw = f.read(length)
        try:
            header = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise self._error(f"header is not valid JSON ({e})") from e
        if not isinstance(header, dict):
            raise self._error(f"header is a JSON {type(header).__name__}, expected an object")
        return header, 8 + length

    def _entry(self, name: str, info: object, data_start: int) -> TensorEntry:
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
            raise self._error(f"tensor '{name}': header entry {info!r} lacks dtype/shape/data_offsets")
        dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
        if dtype is None:
            raise self._error(f"tensor '{name}': dtype {info['dtype']!r} is not supported; "
                              f"supported: {', '.join(_SAFETENSORS_DTYPES)}")
        shape = tuple(int(d) for d in info["shape"])
        begin, end = (int(o) for o in info["data_offsets"])
        expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if not 0 <= begin <= end or end - begin != expected:
            raise self._error(f"tensor '{name}': data_offsets [{begin}, {end}] do not hold "
                              f"{info['dtype']}{list(shape)} ({expected} bytes)")
        if data_start + end > self.size:
            raise self._error(f"tensor '{name}': data_offsets end at byte {data_start + end}, past "
                              f"the end of the file ({self.size} bytes); the file is truncated")
        return TensorEntry(self, dtype, shape, data_start + begin)

    def _error(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: corrupt safetensors file: {what}; re-download or "
                               f"re-save it")


class SafetensorsTensors(Mapping):
    """HF text-model tensor names -> views over memory-mapped safetensors files, made on access."""

    def __init__(self, files: list[SafetensorsFile]):
        self._entries: dict[str, TensorEntry] = {}
        for file in files:
            for raw_name, entry in file.entries.items():
                name = normalise_tensor_name(raw_name)
                if name is None:
                    continue
                if name in self._entries:
                    raise CheckpointError(
                        f"tensor '{name}' is in both {self._entries[name].file.path} and "
                        f"{file.path}; remove the stale shard")
                self._entries[name] = entry
        self.files = {name: entry.file.path for name, entry in self._entries.items()}

    def __getitem__(self, name: str) -> np.ndarray:
        entry = self._entries[name]
        return entry.file.view(entry)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def dtype(self, name: str) -> np.dtype:
        """The stored dtype of `name`, from the header (nothing is read)."""
        return self._entries[name].dtype

    def nbytes(self, name: str) -> int:
        entry = self._entries[name]
        return int(np.prod(entry.shape, dtype=np.int64)) * entry.dtype.itemsize

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


def normalise_tensor_name(name: str) -> str | None:
    """The text model's HF name for a checkpoint tensor, or None for tensors we do not serve."""
    if name.startswith(_DROPPED_PREFIXES):
        return None
    for old, new in _RENAMED_PREFIXES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def _safetensors_files(folder: str) -> list[SafetensorsFile]:
    """The folder's safetensors files: those the index names, else every *.safetensors."""
    index_path = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        return _indexed_files(folder, index_path)
    names = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    if not names:
        raise CheckpointError(
            f"{folder}: no *.safetensors files (and no model.safetensors.index.json); only "
            f"safetensors weights are supported for HF folders")
    return [SafetensorsFile(os.path.join(folder, n)) for n in names]


def _indexed_files(folder: str, index_path: str) -> list[SafetensorsFile]:
    """Open every shard the index names; check each holds the tensors the index says it does."""
    weight_map = _read_json(index_path).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index_path}: no 'weight_map' object naming the shards")
    by_shard: dict[str, list[str]] = {}
    for tensor_name, shard in weight_map.items():
        by_shard.setdefault(shard, []).append(tensor_name)
    files = []
    for shard, tensor_names in sorted(by_shard.items()):
        path = os.path.join(folder, shard)
        if not os.path.isfile(path):
            raise CheckpointError(
                f"{index_path} names shard {shard!r} (holding '{tensor_names[0]}' and "
                f"{len(tensor_names) - 1} more tensors) but {path} does not exist; the download "
                f"is incomplete")
        file = SafetensorsFile(path)
        missing = [t for t in tensor_names if t not in file.entries]
        if missing:
            raise CheckpointError(
                f"{index_path} says tensor '{missing[0]}' is in {shard!r} but that file does not "
                f"hold it ({len(missing)} such tensors); the index and shards do not match")
        files.append(file)
    return files
