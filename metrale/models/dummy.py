"""`--load-format dummy`: a checkpoint's config and tokenizer with random weights made on demand
(vLLM's dummy load format), for benchmarks and profiling of real model shapes without weight
files. Weights come out in exactly the shape the model builder asks for; on the GPU they are
generated there (no host copy), as bf16 with |w| in [2^-7, 2^-5) and random sign: small enough
to keep activations finite, never zeros (which time differently from real data).

A folder whose config.json carries a quantization_config of FP8 (quant_method "fp8", block FP8)
or NVFP4 (ModelOpt quant_algo "NVFP4") gets its projection weights in that format instead
(`random_quantized`: the same magnitudes, packed as a real checkpoint stores them), the rest bf16
as in the real releases (embedding, lm head, norms, router, gates, GDN conv): benchmarks of the
quantized kernels on real shapes.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from metrale.models.checkpoint import Checkpoint, CheckpointError

LOAD_FORMATS = ("auto", "dummy")


class _NoTensors(dict):
    """The tensor table of a dummy checkpoint: names are not known before the builder asks."""


@dataclass
class DummyCheckpoint(Checkpoint):
    device: str = "cpu"
    seed: int = 0

    def has(self, name: str) -> bool:
        # the builders probe for the fused-expert layout and the multimodal prefix: answer with
        # the layout HF's own Qwen3.5 MoE modules use and the plain text-model prefix (and
        # Nemotron-H's: stacked experts, `model.embeddings`)
        return (name.endswith(("mlp.experts.gate_up_proj", "mixer.experts.up_proj"))
                or name in ("model.embed_tokens.weight", "model.embeddings.weight"))

    def tensor(self, name: str, shape: tuple[int, ...] | None = None):
        if shape is None:
            raise ValueError(f"dummy weights need a shape for {name!r}")
        fmt = dummy_quant_format(self.config)
        if fmt and is_quantized_projection(name, shape):
            return random_quantized(shape, fmt, self.device, abs(hash((self.seed, name))) % 2**32)
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


# weights a quantized release keeps bf16: the GDN's tiny b / a projections, the router and the
# shared-expert gate (anything but a *proj* linear layer or the experts is bf16 already)
_BF16_PROJECTIONS = ("in_proj_a", "in_proj_b", "shared_expert_gate", "mlp.gate.")


def is_quantized_projection(name: str, shape) -> bool:
    """Whether a quantized release stores this weight quantized (dummy and synthetic loads)."""
    if any(k in name for k in _BF16_PROJECTIONS) or "visual" in name or "mtp" in name:
        return False
    if ".experts." in name:
        return len(shape) == 3 and name.endswith(("gate_up_proj", "down_proj")) or (
            len(shape) == 2 and name.endswith("proj.weight"))
    module = name[: -len(".weight")].rsplit(".", 1)[-1] if name.endswith(".weight") else ""
    return len(shape) == 2 and "proj" in module


def dummy_quant_format(config: dict) -> str | None:
    """"fp8" | "nvfp4" | None from a folder's quantization_config (the two dummy loads make)."""
    qc = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    algo = str(qc.get("quant_algo", "")).upper()
    if method == "fp8":
        return "fp8"
    if method == "modelopt" and algo in ("NVFP4", "W4A16_NVFP4"):
        return "nvfp4"
    raise CheckpointError(f"--load-format dummy of a {method or algo or qc!r} checkpoint: dummy weights "
                          f"are synthesised in quant_method 'fp8' (block FP8) and modelopt NVFP4 only")


def random_quantized(shape, fmt: str, device: str = "cpu", seed: int = 0):
    """A QuantizedTensor of `shape` ([.., n, k]) in `fmt` with |w| in about [2^-7, 2^-5) and
    random signs, made on `device` (CuPy arrays on "cuda": the CUDA upload takes them as they
    are). fp8: e4m3 codes of magnitude [1, 2) (exponent 7, random mantissa) under one fp32 scale
    2^-6 per 128 x 128 block; nvfp4: codes of magnitude 1 .. 6 under e4m3 group scales 2^-6 and
    a global scale 1/4."""
    from metrale.models.quant import E4M3, QuantizedTensor

    *lead, n, k = (int(d) for d in shape)
    if device == "cuda":
        import cupy as xp
        rnd = xp.random.RandomState(seed)
        bits = lambda size, hi: rnd.randint(0, hi, size=size, dtype=xp.int32).astype(xp.uint8)  # noqa: E731
    else:
        xp = np
        rng = np.random.default_rng(seed)
        bits = lambda size, hi: rng.integers(0, hi, size=size).astype(np.uint8)  # noqa: E731
    if fmt == "fp8":
        data = (bits((*lead, n, k), 8) | 0x38 | (bits((*lead, n, k), 2) << 7))
        if device != "cuda":
            data = data.view(E4M3)
        scale = xp.full((*lead, -(-n // 128), -(-k // 128)), 2.0 ** -6, dtype=xp.float32)
        return QuantizedTensor("fp8", data, scale, (128, 128), None, "fp8 block 128x128 (dummy)")
    if fmt == "nvfp4":
        lo = bits((*lead, n, k // 2), 6) + 2 | (bits((*lead, n, k // 2), 2) << 3)
        hi = bits((*lead, n, k // 2), 6) + 2 | (bits((*lead, n, k // 2), 2) << 3)
        data = (lo | (hi << 4)).astype(xp.uint8)
        scale = xp.full((*lead, n, k // 16), 0x08, dtype=xp.uint8)     # e4m3 0x08 = 2^-6
        if device != "cuda":
            scale = scale.view(E4M3)
        g = xp.full((*lead, n), 0.25, dtype=xp.float32)
        return QuantizedTensor("nvfp4", data, scale, (1, 16), g, "nvfp4 (dummy)")
    raise CheckpointError(f"unknown dummy quantization {fmt!r}")


def dummy_from(ckpt: Checkpoint, device: str) -> DummyCheckpoint:
    """The same checkpoint with dummy weights (its config, tokenizer and template kept)."""
    return DummyCheckpoint(
        config=ckpt.config, tensors=_NoTensors(), path=ckpt.path, name=ckpt.name,
        generation_config=ckpt.generation_config, tokenizer_json=ckpt.tokenizer_json,
        tokenizer_config=ckpt.tokenizer_config, chat_template=ckpt.chat_template, device=device)
