"""What a loaded checkpoint is, whatever it was loaded from (HF folder, HF cache, GGUF).

Loaders (metrale.models.loader) produce a `Checkpoint`; model builders consume it through
`tensor(name, shape)`, which names the file, the tensor and both shapes when something is off.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import numpy as np


class CheckpointError(ValueError):
    """A checkpoint that cannot be served: the message says which file, which tensor, what was
    expected and what was found, and what is supported."""


@dataclass
class Checkpoint:
    config: dict                      # the text model's HF config (text_config flattened in)
    tensors: Mapping[str, np.ndarray]  # HF tensor names -> arrays (memory-mapped where possible)
    path: str                         # folder or file it came from
    name: str                         # what /v1/models reports by default
    generation_config: dict = field(default_factory=dict)
    tokenizer_json: str | None = None    # path to a tokenizer.json (HF `tokenizers` format)
    tokenizer_config: dict = field(default_factory=dict)
    chat_template: str | dict[str, str] | None = None  # several: name -> template
    tensor_files: Mapping[str, str] = field(default_factory=dict)  # tensor name -> file, for errors
    quant: object | None = None       # metrale.models.quant.QuantConfig; None: nothing quantized

    @property
    def model_type(self) -> str:
        return self.config.get("model_type", "")

    def has(self, name: str) -> bool:
        return name in self.tensors or (self.quant is not None and name + "_packed" in self.tensors)

    def tensor(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """The tensor `name`, checked against `shape` when given: an array, or a
        metrale.models.quant.QuantizedTensor where the checkpoint stores it quantized."""
        where = self.tensor_files.get(name, self.path)
        if self.quant is not None and self.quant.claims(name, self.tensors):
            t = self.quant.tensor(name, self.tensors, where)
        elif name not in self.tensors:
            raise CheckpointError(
                f"{self.path}: tensor '{name}' is missing (the {self.model_type!r} architecture "
                f"needs it; the checkpoint has {len(self.tensors)} tensors)")
        else:
            t = _refuse_unread_quantized(self.tensors[name], name, where, self.quant)
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise CheckpointError(
                f"{where}: tensor '{name}' has shape {tuple(t.shape)}, expected {tuple(shape)} "
                f"from config.json")
        return t


_QUANTIZED_DTYPES = ("float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu", "uint8", "int8")


def _refuse_unread_quantized(t, name: str, where: str, quant) -> object:
    """`t` unless it is stored in a quantized dtype nothing explains (e.g. FP8 weights without a
    quantization_config): such a tensor is refused, never read as if it were bf16."""
    if str(getattr(t, "dtype", "")) not in _QUANTIZED_DTYPES:
        return t
    scheme = quant.describe if quant is not None else "no quantization_config"
    raise CheckpointError(
        f"{where}: tensor '{name}' is stored as {t.dtype} but the checkpoint's quantization "
        f"({scheme}) does not say how to read it (no scales beside it); refusing to read it as "
        f"plain weights")
