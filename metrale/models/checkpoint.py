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

    @property
    def model_type(self) -> str:
        return self.config.get("model_type", "")

    def has(self, name: str) -> bool:
        return name in self.tensors

    def tensor(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """The tensor `name`, checked against `shape` when given."""
        if name not in self.tensors:
            raise CheckpointError(
                f"{self.path}: tensor '{name}' is missing (the {self.model_type!r} architecture "
                f"needs it; the checkpoint has {len(self.tensors)} tensors)")
        t = self.tensors[name]
        if shape is not None and tuple(t.shape) != tuple(shape):
            where = self.tensor_files.get(name, self.path)
            raise CheckpointError(
                f"{where}: tensor '{name}' has shape {tuple(t.shape)}, expected {tuple(shape)} "
                f"from config.json")
        return t
