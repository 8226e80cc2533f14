"""Architecture registry: `build_model(ckpt, ops)` picks the builder by the config's model_type.

A model (metrale.models.layers.CausalLM) offers:
    cache_spec() -> metrale.cache.kv.CacheSpec     what each layer caches (size pools from it)
    forward(batch, caches) -> logits [len(batch.logits_indices), vocab_size]
    forward_with_hidden(batch, caches) -> (those logits, final-norm hidden states [T, H])
    vocab_size, config
    mtp: metrale.models.mtp.MtpHead or None (Qwen3.5 / 3.6 checkpoints that ship `mtp.*`)
"""
from __future__ import annotations

from typing import Callable

from metrale.models.checkpoint import Checkpoint, CheckpointError
from metrale.models.deepseek_v3 import build_deepseek_v3
from metrale.models.gemma4 import build_gemma4
from metrale.models.layers import CausalLM
from metrale.models.llama import build_llama_family
from metrale.models.minimax_m2 import build_minimax_m2
from metrale.models.mtp import attach_mtp
from metrale.models.nemotron_h import build_nemotron_h
from metrale.models.qwen3_5 import build_qwen3_5

_BUILDERS: dict[str, Callable[[Checkpoint, object], CausalLM]] = {
    "qwen3_5": build_qwen3_5,
    "qwen3_5_moe": build_qwen3_5,
    "qwen3": build_llama_family,
    "qwen2": build_llama_family,
    "llama": build_llama_family,
    "mistral": build_llama_family,
    "ministral": build_llama_family,
    "ministral3": build_llama_family,
    "gemma4": build_gemma4,
    "minimax_m2": build_minimax_m2,
    "deepseek_v3": build_deepseek_v3,
    "nemotron_h": build_nemotron_h,
}

# text-config spellings of the same architectures (a loader that flattens text_config may keep them)
_ALIASES = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe", "gemma4_text": "gemma4"}

SUPPORTED_MODEL_TYPES = tuple(_BUILDERS)


def builder(model_type: str) -> Callable[[Checkpoint, object], CausalLM]:
    """The builder registered for `model_type` (KeyError if none)."""
    return _BUILDERS[model_type]


def register(model_type: str, build: Callable[[Checkpoint, object], CausalLM]) -> None:
    """Add or replace the builder of `model_type`. Production has none to add: this is how tests
    put a fixture model in (tests/scripted_model.py, loaded in a served engine by the
    METRALE_MODEL_PLUGINS lever)."""
    _BUILDERS[model_type] = build


def build_model(ckpt: Checkpoint, ops, mtp: str = "auto") -> CausalLM:
    """Build the model of `ckpt` on backend `ops`, loading (and fusing) its weights.

    `mtp` (metrale.models.mtp.attach_mtp): "auto" builds `model.mtp`, the checkpoint's
    multi-token-prediction head, when the checkpoint ships one (None otherwise); "require"
    refuses a checkpoint without one; "off" leaves it unread (no memory spent on it)."""
    model_type = _ALIASES.get(ckpt.model_type, ckpt.model_type)
    builder = _BUILDERS.get(model_type)
    if builder is None:
        raise CheckpointError(
            f"{ckpt.path}: model_type {ckpt.model_type!r} is not supported; supported types: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    model = builder(ckpt, ops)
    if isinstance(model, CausalLM):
        attach_mtp(model, ckpt, ops, mtp)
    elif mtp == "require":
        raise CheckpointError(f"{ckpt.path}: the {type(model).__name__} model has no MTP head")
    return model
