"""`--load-format dummy`: a checkpoint's config and tokenizer with random weights made on demand
(vLLM's dummy load format), for benchmarks and profiling of real model shapes without weight
files. Weights come out in exactly the shape the model builder asks for; on the GPU they are
generated there (no host copy), as bf16 with |w| in [2^-7, 2^-5) and random sign: small enough
to keep activations finite, never zeros (which time differently from real data).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from metrale.models.checkpoint import Checkpoint

LOAD_FORMATS = ("auto", "dummy")


class _NoTensors(dict):
    """The tensor table of a dummy checkpoint: names are not known before the builder asks."""


@dataclass
class DummyCheckpoint(Checkpoint):
    device: str = "cpu"
    seed: int = 0

    def has(self, name: str) -> bool:
        # the builders probe for the fused-expert layout and the multimodal prefix: answer with
        # the layout HF's own Qwen3.5 MoE modules use and the plain text-model prefix
        return name.endswith("mlp.experts.gate_up_proj") or name == "model.embed_tokens.weight"

    def tensor(self, name: str, shape: tuple[int, ...] | None = None):
        if shape is None:
            raise ValueError(f"dummy weights need a shape for {name!r}")
        if self.device == "cuda":
            return _cuda_random(shape)
        rng = np.random.default_rng(abs(hash((self.seed, name))) % 2**32)
        sign = rng.choice(np.array([-1.0, 1.0], np.float32), size=shape)
        return (sign * rng.uniform(2**-7, 2**-5, size=shape)).astype(np.float32)


def _cuda_random(shape):
    import cupy as cp
    import ml_dtypes

    bits = cp.random.randint(0x3C00, 0x3D00, size=shape, dtype=cp.int32).astype(cp.uint16)
    bits |= cp.random.randint(0, 2, size=shape, dtype=cp.int32).astype(cp.uint16) << 15
    return bits.view(np.dtype(ml_dtypes.bfloat16))


def dummy_from(ckpt: Checkpoint, device: str) -> DummyCheckpoint:
    """The same checkpoint with dummy weights (its config, tokenizer and template kept)."""
    return DummyCheckpoint(
        config=ckpt.config, tensors=_NoTensors(), path=ckpt.path, name=ckpt.name,
        generation_config=ckpt.generation_config, tokenizer_json=ckpt.tokenizer_json,
        tokenizer_config=ckpt.tokenizer_config, chat_template=ckpt.chat_template, device=device)
