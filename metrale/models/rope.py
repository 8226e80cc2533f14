"""Rotary position embeddings of a checkpoint: the inverse frequencies, the rotated width and the
attention factor, read from `rope_parameters` (transformers 5) or the legacy top-level
`rope_theta` / `rope_scaling` (transformers 4 checkpoints such as Qwen2.5 and Llama 3.1).

Kinds (`rope_type`, legacy `type`), each computed as HF transformers' modeling_rope_utils does:

    default   theta ** (-2i / d)
    linear    default / factor
    llama3    Llama 3.1 frequency-dependent scaling (low/high_freq_factor around
              original_max_position_embeddings)
    yarn      NTK-by-parts interpolation plus an attention factor that scales cos and sin
              (0.1 ln(factor) + 1 unless `attention_factor` or `mscale`/`mscale_all_dim` say)
    dynamic   dynamic NTK: HF recomputes the frequencies only once a sequence grows past
              max_position_embeddings; the engine caps sequences there, so it is `default` here
    proportional  Gemma 4's global layers: the first partial_rotary_factor * head_dim / 2
              frequencies theta ** (-2i / head_dim) (exponents over the WHOLE head), the rest
              zero, so the whole head "rotates" (rotate-half pairs i, i + head_dim / 2) and the
              zero-frequency pairs pass unchanged; all divided by `factor` (default 1)
    mrope     Qwen3.5's `mrope_section` / `mrope_interleaved` with rope_type default: for text
              all three position axes are the token position, which is plain rotary

Anything else (longrope, a typo) is refused at load with an error naming the config field,
never served with the wrong positions.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from metrale.models.checkpoint import CheckpointError

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "proportional")


@dataclass(frozen=True)
class Rope:
    inv_freq: np.ndarray          # [rotary_dim // 2] fp32
    rotary_dim: int               # leading head dims that rotate (partial rotary: fewer than D)
    attention_factor: float = 1.0  # multiplies cos and sin (YaRN), so q.k by its square

    @property
    def frequencies(self) -> tuple[np.ndarray, int]:
        """(inv_freq, rotary_dim), what metrale.models.layers.Attention takes."""
        return self.inv_freq, self.rotary_dim


def rope_from_config(config: dict, head_dim: int, default_partial: float = 1.0) -> Rope:
    """The checkpoint's rotary embedding; CheckpointError for a kind or field we cannot honour."""
    params, field = _rope_params(config)
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    partial = float(params.get("partial_rotary_factor", config.get("partial_rotary_factor", default_partial)))
    rotary_dim = int(head_dim * partial)
    inv_freq = 1.0 / theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    kind = params.get("rope_type") or params.get("type") or "default"
    attention_factor = 1.0
    if kind == "linear":
        inv_freq = inv_freq / _factor(params, field, kind)
    elif kind == "llama3":
        inv_freq = _llama3(inv_freq, params, config, field)
    elif kind == "yarn":
        inv_freq, attention_factor = _yarn(theta, rotary_dim, params, config, field)
    elif kind == "proportional":
        inv_freq, rotary_dim = _proportional(theta, head_dim, partial, params, field), head_dim
    elif kind not in ("default", "dynamic"):
        raise CheckpointError(
            f"config.json: {field}.rope_type {kind!r} is not supported (supported: "
            f"{', '.join(ROPE_TYPES)}); serving it with another kind would give wrong output")
    if attention_factor != 1.0 and rotary_dim != head_dim:
        raise CheckpointError(
            f"config.json: {field} is {kind!r} with an attention factor of {attention_factor:.4f} "
            f"and partial_rotary_factor {partial}: scaling only the rotated dims is not supported")
    return Rope(inv_freq.astype(np.float32), rotary_dim, attention_factor)


def rope_parameters(config: dict) -> dict:
    """The checkpoint's rope settings, rope_parameters merged over the legacy rope_scaling."""
    return _rope_params(config)[0]


def _rope_params(config: dict) -> tuple[dict, str]:
    """The rope settings merged (rope_parameters over rope_scaling) and the field to name in
    errors."""
    scaling, parameters = config.get("rope_scaling"), config.get("rope_parameters")
    for name, value in (("rope_scaling", scaling), ("rope_parameters", parameters)):
        if value is not None and not isinstance(value, dict):
            raise CheckpointError(f"config.json: {name} must be an object, got {value!r}")
    field = "rope_parameters" if parameters else "rope_scaling"
    return {**(scaling or {}), **(parameters or {})}, field


def _factor(params: dict, field: str, kind: str) -> float:
    factor = params.get("factor")
    if not isinstance(factor, (int, float)) or factor <= 0:
        raise CheckpointError(f"config.json: {field}.factor must be a positive number for "
                              f"rope_type {kind!r}, got {factor!r}")
    return float(factor)


def _original_len(params: dict, config: dict) -> float:
    return float(params.get("original_max_position_embeddings")
                 or config.get("original_max_position_embeddings")
                 or config["max_position_embeddings"])


def _llama3(inv_freq: np.ndarray, params: dict, config: dict, field: str) -> np.ndarray:
    """Llama 3.1 frequency-dependent scaling (HF _compute_llama3_parameters)."""
    factor = _factor(params, field, "llama3")
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    old_len = _original_len(params, config)
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return np.where(medium, smoothed, scaled)


def _yarn(theta: float, dim: int, params: dict, config: dict, field: str) -> tuple[np.ndarray, float]:
    """YaRN (HF _compute_yarn_parameters): (inv_freq, attention factor)."""
    old_len = _original_len(params, config)
    factor = params.get("factor")
    factor = config["max_position_embeddings"] / old_len if factor is None else _factor(params, field, "yarn")
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1
    low = _correction_dim(beta_fast, dim, theta, old_len)
    high = _correction_dim(beta_slow, dim, theta, old_len)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    pos_freqs = theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    inv_freq = (1 / (factor * pos_freqs)) * (1 - extrapolation) + (1 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _correction_dim(rotations: float, dim: int, theta: float, max_len: float) -> float:
    return (dim * math.log(max_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))


def _proportional(theta: float, head_dim: int, partial: float, params: dict, field: str) -> np.ndarray:
    """Proportional RoPE (HF _compute_proportional_rope_parameters): [head_dim // 2] inverse
    frequencies, the non-rotated tail zero."""
    angles = int(partial * head_dim // 2)
    rotated = 1.0 / theta ** (np.arange(0, 2 * angles, 2, dtype=np.float64) / head_dim)
    inv_freq = np.concatenate([rotated, np.zeros(head_dim // 2 - angles)])
    factor = params.get("factor", 1.0)
    return inv_freq / (_factor(params, field, "proportional") if factor != 1.0 else 1.0)


def rope_of_layer_type(config: dict, layer_type: str, head_dim: int) -> Rope:
    """The rotary embedding of one layer type where `rope_parameters` holds one entry per type
    (Gemma 4: {"sliding_attention": {...}, "full_attention": {...}})."""
    params = config.get("rope_parameters")
    if not isinstance(params, dict) or not isinstance(params.get(layer_type), dict):
        raise CheckpointError(f"config.json: rope_parameters has no entry for layer type "
                              f"{layer_type!r} (got {params!r})")
    return rope_from_config({**config, "rope_parameters": params[layer_type]}, head_dim)
