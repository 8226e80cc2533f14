"""Quantized weights: each producer's on-disk format read into one typed object.

A `QuantizedTensor` is what the loader hands the model for a quantized weight, in place of an
array: format, packed data, scales, the block one scale covers, a per-row global scale. Model
files never look inside one; they fuse rows with np.concatenate / np.stack / row indexing as they
do arrays (NEP 18 dispatch below) and the ops dispatch on it (the CPU backend dequantises, CUDA
refuses until its kernels exist). Formats, as their producers write and read them:

    fp8    data float8_e4m3fn [..., R, C]; scale [..., ceil(R/br), ceil(C/bc)] (fp32, bf16, e8m0);
           w = data * scale of its (br, bc) block. Per-tensor is block (R, C), per-channel (1, C).
             transformers fine-grained FP8 (quant_method "fp8"): `weight_scale_inv` per
               weight_block_size block (the name notwithstanding, a multiplier: Fp8Dequantize);
             compressed-tensors float-quantized / naive-quantized: `weight_scale`, strategy
               tensor | channel | group | block;
             ModelOpt FP8 / FP8_PER_CHANNEL_PER_TOKEN: `weight_scale` per tensor / per row.
    nvfp4  data uint8 [..., R, C/2], two e2m1 codes per byte, column 2j in the low nibble and
           2j+1 in the high one (compressed-tensors pack_fp4_to_uint8, ModelOpt NVFP4QTensor);
           code bit 3 = sign, bits 0-2 index (0, .5, 1, 1.5, 2, 3, 4, 6); scale float8_e4m3fn
           [..., R, C/16]; w = e2m1 * scale * global_scale[row].
             compressed-tensors nvfp4-pack-quantized: `weight_packed`, `weight_scale`,
               `weight_global_scale` g, global multiplier 1/g (forward_helpers._dequantize);
             ModelOpt NVFP4: `weight` (uint8), `weight_scale`, `weight_scale_2` (the multiplier).

Static activation scales (`input_scale`) are kept for W8A8 kernels; the CPU spec is weight-only
(activations unquantised), which is also what transformers' dequantising loads compute.
Which tensors are quantized is read from the files (a weight stored e4m3 / packed next to its
scales): ignore / exclude lists and layers kept bf16 need no matching of module patterns. A
quantized-looking tensor the config does not explain is refused, never read as if it were bf16.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace

import ml_dtypes
import numpy as np

from metrale.models.checkpoint import CheckpointError

F32 = np.float32
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E2M1_VALUES = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], F32)
NVFP4_GROUP = 16
SUPPORTED = ('quant_method "fp8" (transformers fine-grained block FP8), "compressed-tensors" '
             '(float-quantized / naive-quantized FP8, nvfp4-pack-quantized), "modelopt" '
             '(FP8, FP8_PER_CHANNEL_PER_TOKEN, NVFP4, W4A16_NVFP4)')


# -- the typed tensors -----------------------------------------------------------------------

@dataclass(eq=False)
class QuantizedTensor:
    format: str                          # "fp8" | "nvfp4"
    data: np.ndarray                     # see the module docstring
    scale: np.ndarray
    block: tuple[int, int]               # (rows, columns) one scale covers
    global_scale: np.ndarray | None      # fp32 [..., R] multiplier per row (nvfp4), else None
    scheme: str                          # the producer's name for it (logs, errors)
    input_scale: float | None = None     # static activation scale, where the checkpoint has one

    @property
    def shape(self) -> tuple[int, ...]:
        s = self.data.shape
        return s[:-1] + (s[-1] * 2,) if self.format == "nvfp4" else tuple(s)

    @property
    def ndim(self) -> int:
        return self.data.ndim

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scale.nbytes + (0 if self.global_scale is None else self.global_scale.nbytes)

    def dequantize(self) -> np.ndarray:
        """The fp32 weights this tensor stands for."""
        rows, cols = self.shape[-2:]
        values = _e2m1(self.data) if self.format == "nvfp4" else self.data.astype(F32)
        scale = np.repeat(np.repeat(self.scale.astype(F32), self.block[0], -2)[..., :rows, :],
                          self.block[1], -1)[..., :cols]
        w = values * scale
        return w if self.global_scale is None else w * self.global_scale[..., :, None]

    def per_row(self) -> "QuantizedTensor":
        """The same tensor with one scale row per weight row (block rows 1): any rows can then
        be gathered or concatenated."""
        if self.block[0] == 1:
            return self
        rows = self.shape[-2]
        scale = np.repeat(self.scale, self.block[0], -2)[..., :rows, :]
        return replace(self, scale=scale, block=(1, self.block[1]))

    def scaled(self, factor: float) -> "QuantizedTensor":
        """This tensor times `factor` (folded into the scales; the packed data is unchanged)."""
        if self.global_scale is not None:
            return replace(self, global_scale=self.global_scale * F32(factor))
        return replace(self, scale=self.scale.astype(F32) * F32(factor))

    def __getitem__(self, index):
        if index is None:                                    # x[None]: a leading axis
            return replace(self, data=self.data[None], scale=self.scale[None],
                           global_scale=None if self.global_scale is None else self.global_scale[None])
        if isinstance(index, (int, np.integer)) and self.ndim == 3:      # one expert
            return replace(self, data=self.data[index], scale=self.scale[index],
                           global_scale=None if self.global_scale is None else self.global_scale[index])
        rows = np.asarray(index)
        if rows.ndim == 1 and rows.dtype.kind in "iu" and self.ndim == 2:  # a row gather
            t = self.per_row()
            return replace(t, data=t.data[rows], scale=t.scale[rows],
                           global_scale=None if t.global_scale is None else t.global_scale[rows])
        raise CheckpointError(f"{self.scheme} tensor of shape {self.shape}: indexing with {index!r} "
                              f"is not supported (only rows, experts or a new leading axis)")

    def __array__(self, *args, **kwargs):
        raise TypeError(f"a {self.scheme} tensor {self.shape} was read as a dense array; "
                        f"dequantize() it or pass it to an op that takes quantized weights")

    def __array_function__(self, func, types, args, kwargs):
        return _array_function(func, args, kwargs)


@dataclass(eq=False)
class StackedParts:
    """Parts of different formats (e.g. quantized q|k|v rows beside bf16 gate rows, or bf16
    rows kept in a quantized layer) concatenated along axis 0: each part keeps its own form."""
    parts: tuple

    format = "mixed"

    @property
    def shape(self) -> tuple[int, ...]:
        first = tuple(self.parts[0].shape)
        return (sum(p.shape[0] for p in self.parts),) + first[1:]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return sum(int(p.nbytes) for p in self.parts)

    @property
    def scheme(self) -> str:
        return " + ".join(sorted({_scheme_of(p) for p in self.parts}))

    def dequantize(self) -> np.ndarray:
        return np.concatenate([dense(p) for p in self.parts])

    def __getitem__(self, index):
        if index is None:
            return StackedParts(tuple(p[None] for p in self.parts))
        raise CheckpointError(f"{self.scheme} weight of shape {self.shape}: indexing with {index!r} "
                              f"is not supported")

    def __array__(self, *args, **kwargs):
        raise TypeError(f"a {self.scheme} weight {self.shape} was read as a dense array")

    def __array_function__(self, func, types, args, kwargs):
        return _array_function(func, args, kwargs)


def is_quantized(x) -> bool:
    return isinstance(x, (QuantizedTensor, StackedParts))


def dense(x) -> np.ndarray:
    """fp32 weights of a quantized tensor; an array as it is."""
    return x.dequantize() if is_quantized(x) else np.asarray(x)


def scale_weight(x, factor: float):
    """`x` times `factor`, in x's own form (an array keeps its dtype)."""
    if isinstance(x, QuantizedTensor):
        return x.scaled(factor)
    return (x.astype(F32) * factor).astype(x.dtype)     # numpy, or a device array (dummy loads)


def _scheme_of(x) -> str:
    return x.scheme if is_quantized(x) else str(np.asarray(x).dtype)


def _e2m1(packed: np.ndarray) -> np.ndarray:
    codes = np.stack([packed & 0x0F, packed >> 4], axis=-1)
    return E2M1_VALUES[codes].reshape(packed.shape[:-1] + (packed.shape[-1] * 2,))


def _array_function(func, args, kwargs):
    if func is np.concatenate and kwargs.get("axis", 0) == 0 and len(args) == 1:
        return concat_rows(list(args[0]))
    if func is np.stack and kwargs.get("axis", 0) == 0 and len(args) == 1:
        return concat_rows([p[None] for p in args[0]])
    raise TypeError(f"{func.__name__} is not supported on quantized weights (only concatenate and "
                    f"stack along axis 0)")


def concat_rows(parts: list):
    """np.concatenate(parts) along axis 0 for quantized tensors and arrays: one QuantizedTensor
    where the parts share format, block columns and scale dtype, else StackedParts of runs (each
    run of adjacent parts that merge, merged: quantized q|k|v rows stay one part beside bf16
    rows)."""
    flat = [q for p in parts for q in (p.parts if isinstance(p, StackedParts) else (p,))]
    if all(isinstance(p, QuantizedTensor) for p in flat) and _same_layout(flat):
        return _merge(flat)
    runs: list[list] = []
    for p in flat:
        last = runs[-1] if runs else None
        if last is not None and isinstance(p, QuantizedTensor) == isinstance(last[0], QuantizedTensor) and (
                _same_layout(last + [p]) if isinstance(p, QuantizedTensor)
                else p.dtype == last[0].dtype and tuple(p.shape[1:]) == tuple(last[0].shape[1:])):
            last.append(p)
        else:
            runs.append([p])
    merged = tuple(_merge(r) if isinstance(r[0], QuantizedTensor) else
                   (r[0] if len(r) == 1 else np.concatenate(r)) for r in runs)
    return merged[0] if len(merged) == 1 else StackedParts(merged)


def _merge(flat: list[QuantizedTensor]) -> QuantizedTensor:
    if len(flat) == 1:
        return flat[0]
    if flat[0].ndim == 2 and len({p.block[0] for p in flat}) + any(
            p.shape[0] % p.block[0] for p in flat[:-1]) > 1:
        flat = [p.per_row() for p in flat]
    return replace(flat[0], data=np.concatenate([p.data for p in flat]),
                   scale=np.concatenate([p.scale for p in flat]),
                   global_scale=None if flat[0].global_scale is None
                   else np.concatenate([p.global_scale for p in flat]),
                   input_scale=_max_or_none([p.input_scale for p in flat]))


def _same_layout(parts: list[QuantizedTensor]) -> bool:
    first = parts[0]
    same = all(p.format == first.format and p.block[1] == first.block[1] and p.ndim == first.ndim
               and p.scale.dtype == first.scale.dtype and p.shape[1:] == first.shape[1:]
               for p in parts)
    if same and first.ndim == 3:    # stacked experts: blocks must match exactly
        same = all(p.block == first.block for p in parts)
    return same


def _max_or_none(values):
    present = [v for v in values if v is not None]
    return max(present) if present else None


# -- reading a checkpoint's quantization config ----------------------------------------------

@dataclass(frozen=True)
class Fp8Rule:
    """How one producer stores FP8 weights: the scale's suffix and the blocks it may cover."""
    scale_suffix: str                              # appended to the weight's name
    strategies: tuple[str, ...]                    # tensor | channel | block | group
    block: tuple[int, int] | None = None           # for strategy block
    group: int | None = None                       # for strategy group


@dataclass(frozen=True)
class QuantConfig:
    """A checkpoint's quantization: what its producer wrote and how to read each weight."""
    producer: str                                  # fp8 | compressed-tensors | modelopt
    describe: str                                  # one line for logs and errors
    fp8: Fp8Rule | None = None
    nvfp4: str | None = None                       # global scale: "divisor" (ct) | "multiplier" (modelopt)
    source: str = ""                               # the file it was read from
    notes: tuple[str, ...] = field(default_factory=tuple)

    def claims(self, name: str, tensors) -> bool:
        """Whether `name` is stored quantized (the weight or its packed form)."""
        if name + "_packed" in tensors:
            return True
        if name not in tensors:
            return False
        dtype = _dtype(tensors, name)
        return dtype == E4M3 or (dtype == np.uint8 and name + "_scale" in tensors)

    def tensor(self, name: str, tensors, where: str) -> QuantizedTensor:
        """The QuantizedTensor stored under `name` (claims(name) is true)."""
        if name + "_packed" in tensors or _dtype(tensors, name) == np.uint8:
            return self._nvfp4(name, tensors, where)
        return self._fp8(name, tensors, where)

    # -- fp8 -----------------------------------------------------------------------------
    def _fp8(self, name: str, tensors, where: str) -> QuantizedTensor:
        rule = self._need(self.fp8, name, "FP8 (e4m3)")
        data = tensors[name]
        scale = self._companion(tensors, name, rule.scale_suffix, "FP8 (e4m3)", where)
        rows, cols = data.shape[-2:]
        lead = tuple(data.shape[:-2])
        for strategy in rule.strategies:
            block, shapes = _fp8_block(strategy, rule, rows, cols)
            if tuple(scale.shape) in [lead + s for s in shapes]:
                scale = np.asarray(scale).reshape(lead + shapes[0])
                _check_scales(scale, name + rule.scale_suffix, self.describe, where)
                return QuantizedTensor("fp8", data, scale, block, None,
                                       f"fp8 {strategy}{_block_text(block, strategy)} ({self.producer})",
                                       _input_scale(tensors, name))
        expected = " or ".join(str(lead + _fp8_block(s, rule, rows, cols)[1][0]) for s in rule.strategies)
        raise CheckpointError(
            f"{where}: tensor '{name}{rule.scale_suffix}' has shape {tuple(scale.shape)}; "
            f"{self.describe} needs {expected} for weight '{name}' {tuple(data.shape)}; the "
            f"checkpoint is corrupt or was written by a different producer")

    # -- nvfp4 ---------------------------------------------------------------------------
    def _nvfp4(self, name: str, tensors, where: str) -> QuantizedTensor:
        kind = self._need(self.nvfp4, name, "NVFP4 (packed e2m1)")
        packed = tensors[name + "_packed"] if name + "_packed" in tensors else tensors[name]
        pname = name + "_packed" if name + "_packed" in tensors else name
        if packed.dtype != np.uint8:
            raise CheckpointError(f"{where}: tensor '{pname}' is {packed.dtype}; {self.describe} "
                                  f"stores two e2m1 values per uint8")
        rows, cols = packed.shape[-2], packed.shape[-1] * 2
        lead = tuple(packed.shape[:-2])
        scale = self._companion(tensors, name, "_scale", "NVFP4", where)
        if cols % NVFP4_GROUP or tuple(scale.shape) != lead + (rows, cols // NVFP4_GROUP):
            raise CheckpointError(
                f"{where}: tensor '{name}_scale' has shape {tuple(scale.shape)}; {self.describe} "
                f"needs {lead + (rows, cols // NVFP4_GROUP)} (one e4m3 scale per {NVFP4_GROUP} "
                f"weights of '{pname}' {tuple(packed.shape)}, packed two per byte)")
        suffix = "_global_scale" if kind == "divisor" else "_scale_2"
        glob = np.asarray(self._companion(tensors, name, suffix, "NVFP4", where), F32)
        if glob.size != int(np.prod(lead)):
            raise CheckpointError(f"{where}: tensor '{name}{suffix}' has shape {glob.shape}; "
                                  f"{self.describe} needs one global scale per tensor")
        _check_scales(scale, name + "_scale", self.describe, where)
        _check_scales(glob, name + suffix, self.describe, where, positive=True)
        multiplier = (1.0 / glob if kind == "divisor" else glob).astype(F32).reshape(lead + (1,))
        return QuantizedTensor("nvfp4", packed, scale, (1, NVFP4_GROUP),
                               np.broadcast_to(multiplier, lead + (rows,)).copy(),
                               f"nvfp4 ({self.producer})", _input_scale(tensors, name))

    def _need(self, rule, name: str, what: str):
        if rule is None:
            raise CheckpointError(f"{self.source}: tensor '{name}' is stored {what} but the "
                                  f"checkpoint's quantization ({self.describe}) has no such scheme")
        return rule

    def _companion(self, tensors, name: str, suffix: str, what: str, where: str):
        if name + suffix not in tensors:
            raise CheckpointError(
                f"{where}: tensor '{name}' is stored {what} but '{name}{suffix}' is missing "
                f"({self.describe}); without it the weights cannot be read: the checkpoint is "
                f"incomplete")
        return tensors[name + suffix]


def _dtype(tensors, name: str):
    dtype_of = getattr(tensors, "dtype", None)
    return dtype_of(name) if dtype_of is not None else tensors[name].dtype


def _fp8_block(strategy: str, rule: Fp8Rule, rows: int, cols: int):
    """(block, accepted scale shapes, canonical first) of an FP8 strategy."""
    if strategy == "tensor":
        return (rows, cols), [(1, 1), (1,), ()]
    if strategy == "channel":
        return (1, cols), [(rows, 1), (rows,)]
    if strategy == "group":
        return (1, rule.group), [(rows, math.ceil(cols / rule.group))]
    br, bc = rule.block
    return (br, bc), [(math.ceil(rows / br), math.ceil(cols / bc))]


def _block_text(block, strategy: str) -> str:
    return f" {block[0]}x{block[1]}" if strategy in ("block", "group") else ""


def _check_scales(scale, name: str, describe: str, where: str, positive: bool = False) -> None:
    s = np.asarray(scale).astype(F32)
    bad = ~np.isfinite(s) | (s <= 0 if positive else s < 0)
    if bad.any():
        raise CheckpointError(f"{where}: tensor '{name}' holds {int(bad.sum())} scales that are "
                              f"not finite and {'positive' if positive else 'non-negative'} (e.g. "
                              f"{s[bad].flat[0]}); {describe}: the checkpoint is corrupt")


def _input_scale(tensors, name: str) -> float | None:
    stem = name[: -len("weight")] if name.endswith("weight") else name + "_"
    for key in (stem + "input_scale", stem + "activation_scale"):
        if key in tensors:
            return float(np.max(np.asarray(tensors[key], F32)))
    return None


def read_quant_config(config: dict, folder: str) -> QuantConfig | None:
    """The checkpoint's quantization (config.json `quantization_config`, else ModelOpt's
    hf_quant_config.json), or None for an unquantized one; CheckpointError for a scheme we do
    not read, naming it."""
    qc, source = config.get("quantization_config"), os.path.join(folder, "config.json")
    hf_quant = os.path.join(folder, "hf_quant_config.json")
    if qc is None and os.path.isfile(hf_quant):
        with open(hf_quant, encoding="utf-8") as f:
            qc, source = json.load(f), hf_quant
        qc.setdefault("quant_method", "modelopt")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise CheckpointError(f"{source}: quantization_config is a {type(qc).__name__}, expected an object")
    method = str(qc.get("quant_method", "")).lower()
    reader = _READERS.get(method)
    if reader is None:
        raise CheckpointError(f"{source}: quantization quant_method {qc.get('quant_method')!r} is not "
                              f"supported; supported: {SUPPORTED}")
    return replace(reader(qc, source), source=source)


def _fine_grained_fp8(qc: dict, source: str) -> QuantConfig:
    block = qc.get("weight_block_size")
    if block is None:
        rule = Fp8Rule("_scale_inv", ("tensor",))
        text = "per-tensor"
    elif isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block):
        rule = Fp8Rule("_scale_inv", ("block",), block=tuple(block))
        text = f"{block[0]}x{block[1]} blocks"
    else:
        raise CheckpointError(f"{source}: quantization_config.weight_block_size {block!r} must be "
                              f"two positive integers")
    return QuantConfig("fp8", f'block FP8 (quant_method "fp8", e4m3, weight_scale_inv per {text})', fp8=rule)


_CT_FORMATS = ("float-quantized", "naive-quantized", "nvfp4-pack-quantized", "mixed-precision")


def _compressed_tensors(qc: dict, source: str) -> QuantConfig:
    top_format = qc.get("format")
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise CheckpointError(f"{source}: compressed-tensors quantization_config has no config_groups")
    strategies, block, group, nvfp4 = [], None, None, False
    for gname, g in groups.items():
        fmt = g.get("format") or top_format
        w = g.get("weights") or {}
        scheme = (f"config group {gname!r}: format {fmt!r}, weights {w.get('type')} "
                  f"{w.get('num_bits')}-bit {w.get('strategy')}")
        if fmt not in _CT_FORMATS:
            raise CheckpointError(f"{source}: compressed-tensors {scheme} is not supported; "
                                  f"supported formats: float-quantized / naive-quantized (FP8), "
                                  f"nvfp4-pack-quantized")
        if w.get("type") != "float" or not w.get("symmetric", True) or w.get("dynamic") not in (False, None):
            raise CheckpointError(f"{source}: compressed-tensors {scheme} (symmetric "
                                  f"{w.get('symmetric')}, dynamic {w.get('dynamic')}) is not "
                                  f"supported: only static symmetric float weights")
        if w.get("num_bits") == 4 and w.get("group_size") == NVFP4_GROUP:
            nvfp4 = True
        elif w.get("num_bits") == 8 and w.get("strategy") in ("tensor", "channel", "block", "group"):
            strategies.append(w["strategy"])
            if w["strategy"] == "block":
                block = tuple(w.get("block_structure") or ())
                if len(block) != 2:
                    raise CheckpointError(f"{source}: compressed-tensors {scheme} lacks block_structure")
            group = w.get("group_size") if w["strategy"] == "group" else group
        else:
            raise CheckpointError(f"{source}: compressed-tensors {scheme} (group_size "
                                  f"{w.get('group_size')}) is not supported: FP8 per tensor, "
                                  f"channel, group or block, or NVFP4 (4-bit float, groups of 16)")
    fp8 = Fp8Rule("_scale", tuple(dict.fromkeys(strategies)), block, group) if strategies else None
    kinds = sorted({"fp8 " + s for s in strategies} | ({"nvfp4"} if nvfp4 else set()))
    return QuantConfig("compressed-tensors", f"compressed-tensors {top_format} ({', '.join(kinds)})",
                       fp8=fp8, nvfp4="divisor" if nvfp4 else None)


_MODELOPT_ALGOS = {"FP8": ("tensor",), "FP8_PER_CHANNEL_PER_TOKEN": ("channel",),
                   "NVFP4": None, "W4A16_NVFP4": None}


def _modelopt(qc: dict, source: str) -> QuantConfig:
    inner = qc.get("quantization") if isinstance(qc.get("quantization"), dict) else qc
    algo = str(inner.get("quant_algo") or "").upper()
    if algo not in _MODELOPT_ALGOS:
        raise CheckpointError(f"{source}: ModelOpt quant_algo {inner.get('quant_algo')!r} is not "
                              f"supported; supported: {', '.join(_MODELOPT_ALGOS)}")
    group = inner.get("group_size")
    if _MODELOPT_ALGOS[algo] is None:
        if group not in (None, NVFP4_GROUP):
            raise CheckpointError(f"{source}: ModelOpt {algo} with group_size {group} is not "
                                  f"supported (NVFP4 groups are {NVFP4_GROUP})")
        return QuantConfig("modelopt", f"ModelOpt {algo} (e2m1, e4m3 weight_scale per 16, "
                                       f"weight_scale_2)", nvfp4="multiplier")
    return QuantConfig("modelopt", f"ModelOpt {algo} (e4m3, weight_scale)",
                       fp8=Fp8Rule("_scale", _MODELOPT_ALGOS[algo]))


_READERS = {"fp8": _fine_grained_fp8, "compressed-tensors": _compressed_tensors,
            "modelopt": _modelopt}


# -- the startup summary ---------------------------------------------------------------------

_COMPANIONS = ("_scale_inv", "_scale_2", "_global_scale", "_scale", "_packed")
_ROLES = (("mtp.", "MTP head"), ("embed_tokens", "embeddings"), ("lm_head", "lm head"), ("shared_expert_gate", "shared-expert gate"),
          ("shared_expert.", "shared expert"), ("experts", "experts"), ("mlp.gate.", "router"),
          ("linear_attn.conv1d", "GDN conv"), ("linear_attn.norm", "norms"), ("linear_attn", "GDN"),
          ("q_norm", "norms"), ("k_norm", "norms"), ("self_attn", "attention"), ("norm", "norms"), ("mlp", "MLP"))


def _role(name: str) -> str:
    for key, role in _ROLES:
        if key in name:
            return role
    return "other"


def _base_of(name: str, names) -> str:
    """The weight a scale / packed tensor belongs to (the name itself for anything else)."""
    if name.endswith(("input_scale", "activation_scale")) and "." in name:
        return name.rsplit(".", 1)[0] + ".weight"
    for suffix in _COMPANIONS:
        base = name[: -len(suffix)]
        if name.endswith(suffix) and (base in names or base + "_packed" in names):
            return base
    return name


def weight_groups(tensors, quant: QuantConfig | None) -> dict[tuple[str, str], list[int]]:
    """(role, format) -> [weights, bytes] over a checkpoint, scales counted with their weight;
    from the headers only (nothing is read)."""
    names = set(tensors)
    groups: dict[tuple[str, str], list[int]] = {}
    for name in names:
        base = _base_of(name, names)
        if quant is not None and quant.claims(base, tensors):
            fmt = "nvfp4" if base + "_packed" in names or _dtype(tensors, base) == np.uint8 else "fp8"
        else:
            fmt = str(_dtype(tensors, name))
        entry = groups.setdefault((_role(base), fmt), [0, 0])
        entry[0] += name in (base, base + "_packed")
        entry[1] += tensors.nbytes(name) if hasattr(tensors, "nbytes") else int(tensors[name].nbytes)
    return groups


def describe_weight_groups(groups: dict[tuple[str, str], list[int]]) -> str:
    total = sum(b for _, b in groups.values())
    parts = [f"{role} {fmt} {n} tensors {_mib(b)}" for (role, fmt), (n, b) in sorted(groups.items())]
    return f"weights {_mib(total)}: " + "; ".join(parts)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"
