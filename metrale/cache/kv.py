"""Per-layer cache memory: the paged KV of attention layers and the GDN state pool.

A model describes what each layer needs with a `CacheSpec` (one entry per decoder layer);
`ModelCaches` allocates it through the backend's `ops.zeros`. Layouts (see metrale.forward):

    attention layer:  k, v   [num_blocks, block_size, n_kv_heads, head_dim]        (ops.dtype)
                             or, per side in a quantized KV format, a QuantKvCache over bytes
                             [num_blocks, block_bytes] (metrale.cache.kv_dtypes: the layouts)
    MLA layer:        latent [num_blocks, block_size, kv_lora_rank + rope_dim]         (ops.dtype)
                             per token the normalised compressed latent c_kv, then the shared
                             roped key k_pe (multi-head latent attention: DeepSeek V2 / V3)
    GDN layer:        conv   [num_state_slots, conv_dim, kernel_size - 1]          (ops.dtype)
                      ssm    [num_state_slots, n_v_heads, head_k_dim, head_v_dim]  (fp32, or
                             f16 / bf16 with --ssm-h-dtype f16-pool / bf16-pool)

Block ids and state slots are handed out by the cache managers (block pool, state pool); this
module only owns the memory and its size accounting, so the engine can size the pools from a
memory budget before allocating them.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from metrale.cache.kv_dtypes import BF16, make_kv_side, raw_blocks, side_bytes_per_block


@dataclass(frozen=True)
class AttentionSpec:
    """An attention layer's paged KV: `kv_dtype` = (K format, V format) of
    metrale.cache.kv_dtypes (bf16 = unquantized, in the activation dtype)."""
    n_kv_heads: int
    head_dim: int
    kv_dtype: tuple[str, str] = (BF16, BF16)

    def bytes_per_block(self, block_size: int, dtype) -> int:
        return sum(side_bytes_per_block(fmt, block_size, self.n_kv_heads, self.head_dim, dtype)
                   for fmt in self.kv_dtype)


@dataclass(frozen=True)
class MlaSpec:
    """A multi-head latent attention layer's paged cache (metrale.models.deepseek_v3): one
    [kv_lora_rank + rope_dim] row per token, in the activation dtype. It is planned like any
    attention layer (`kv_dtype`), but only unquantized rows are implemented: a quantized plan
    is refused by bytes_per_block (ValueError, which the engine reports as a config error)."""
    kv_lora_rank: int
    rope_dim: int
    kv_dtype: tuple[str, str] = (BF16, BF16)

    def bytes_per_block(self, block_size: int, dtype) -> int:
        if tuple(self.kv_dtype) != (BF16, BF16):
            raise ValueError(f"the multi-head latent attention cache (DeepSeek) is kept in the activation "
                             f"dtype only, not {'/'.join(self.kv_dtype)}; use --kv-cache-dtype bf16")
        return block_size * (self.kv_lora_rank + self.rope_dim) * np.dtype(dtype).itemsize


@dataclass(frozen=True)
class GdnSpec:
    """A Gated DeltaNet layer's recurrent state: conv window + delta-rule state."""
    conv_dim: int
    kernel_size: int
    n_v_heads: int
    head_k_dim: int
    head_v_dim: int

    def bytes_per_slot(self, dtype, ssm_dtype=np.float32) -> int:
        conv = self.conv_dim * (self.kernel_size - 1) * np.dtype(dtype).itemsize
        ssm = self.n_v_heads * self.head_k_dim * self.head_v_dim * np.dtype(ssm_dtype).itemsize
        return conv + ssm


@dataclass(frozen=True)
class Mamba2Spec(GdnSpec):
    """A Mamba-2 (SSD) layer's recurrent state, pooled with GDN's (the same state slots,
    snapshots, verify rows and swap): the conv window over x|B|C [conv_dim, kernel_size - 1]
    and the SSM state [n_heads, head_dim, state_size] (HF's layout), held in GdnSpec's fields
    as n_v_heads = n_heads, head_k_dim = head_dim, head_v_dim = state_size."""

    @classmethod
    def of(cls, conv_dim: int, kernel_size: int, n_heads: int, head_dim: int,
           state_size: int) -> "Mamba2Spec":
        return cls(conv_dim, kernel_size, n_heads, head_dim, state_size)


@dataclass(frozen=True)
class CacheSpec:
    """What every decoder layer of a model caches, in layer order."""
    layers: tuple[AttentionSpec | MlaSpec | GdnSpec, ...]

    @property
    def attention_layers(self) -> list[int]:
        """The layers whose cache is paged KV blocks (AttentionSpec and MlaSpec)."""
        return [i for i, s in enumerate(self.layers) if isinstance(s, (AttentionSpec, MlaSpec))]

    @property
    def gdn_layers(self) -> list[int]:
        return [i for i, s in enumerate(self.layers) if isinstance(s, GdnSpec)]

    def kv_bytes_per_block(self, block_size: int, dtype) -> int:
        """Bytes one KV block costs across all attention layers (K and V)."""
        return sum(self.layers[i].bytes_per_block(block_size, dtype) for i in self.attention_layers)

    def with_kv_dtypes(self, plan: dict[int, tuple[str, str]]) -> "CacheSpec":
        """This spec with attention layer i's KV in formats plan[i] (kv_dtypes.plan_kv_layers)."""
        return CacheSpec(tuple(replace(s, kv_dtype=tuple(plan[i])) if i in plan else s
                               for i, s in enumerate(self.layers)))

    def describe_kv(self, block_size: int, dtype) -> str:
        """The KV dtype of each group of attention layers and the bytes a token costs (the
        startup log)."""
        groups: dict[tuple[str, str], list[int]] = {}
        for i in self.attention_layers:
            groups.setdefault(self.layers[i].kv_dtype, []).append(i)
        parts = [f"K {k} / V {v} on layers {_ranges(ids)}" for (k, v), ids in groups.items()]
        per_token = self.kv_bytes_per_block(block_size, dtype) / block_size
        return f"{'; '.join(parts) or 'no attention layers'}; {per_token:,.0f} bytes per token"

    def state_bytes_per_slot(self, dtype, ssm_dtype=np.float32) -> int:
        """Bytes one state slot costs across all GDN layers (conv in `dtype`, ssm in
        `ssm_dtype`)."""
        return sum(self.layers[i].bytes_per_slot(dtype, ssm_dtype) for i in self.gdn_layers)


class ModelCaches:
    """The cache arrays of one model: `kv(layer)` for attention layers, `state(layer)` for GDN
    layers. `num_blocks` KV blocks of `block_size` tokens; `num_state_slots` GDN state rows."""

    def __init__(self, spec: CacheSpec, ops, num_blocks: int, block_size: int,
                 num_state_slots: int, ssm_dtype=np.float32, kv_calibration_tokens: int = 0):
        self.spec = spec
        self.ops = ops
        self.ssm_dtype = np.dtype(ssm_dtype)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_state_slots = num_state_slots
        self.kv_calibration_tokens = kv_calibration_tokens     # fp8 KV: --fp8-kv-calibration-tokens
        self._arrays: list[tuple] = [self._allocate(i, s) for i, s in enumerate(spec.layers)]

    def _allocate(self, layer: int, layer_spec) -> tuple:
        if isinstance(layer_spec, MlaSpec):
            layer_spec.bytes_per_block(self.block_size, self.ops.dtype)       # refuses a quantized plan
            width = layer_spec.kv_lora_rank + layer_spec.rope_dim
            return (self.ops.zeros((self.num_blocks, self.block_size, width)),)
        if isinstance(layer_spec, AttentionSpec):
            return tuple(make_kv_side(fmt, self.ops, layer, side, self.num_blocks, self.block_size,
                                      layer_spec.n_kv_heads, layer_spec.head_dim,
                                      self.kv_calibration_tokens)
                         for side, fmt in enumerate(layer_spec.kv_dtype))
        conv = (self.num_state_slots, layer_spec.conv_dim, layer_spec.kernel_size - 1)
        ssm = (self.num_state_slots, layer_spec.n_v_heads, layer_spec.head_k_dim, layer_spec.head_v_dim)
        return self.ops.zeros(conv), self.ops.zeros(ssm, dtype=self.ssm_dtype)

    def kv(self, layer: int) -> tuple:
        """(k_cache, v_cache) of attention layer `layer`."""
        self._expect(layer, AttentionSpec)
        return self._arrays[layer]

    def latent(self, layer: int):
        """The latent cache [num_blocks, block_size, kv_lora_rank + rope_dim] of MLA layer
        `layer`."""
        self._expect(layer, MlaSpec)
        return self._arrays[layer][0]

    def state(self, layer: int) -> tuple:
        """(conv_state, ssm_state) of GDN layer `layer`."""
        self._expect(layer, GdnSpec)
        return self._arrays[layer]

    def _expect(self, layer: int, kind: type) -> None:
        if not isinstance(self.spec.layers[layer], kind):
            raise TypeError(f"layer {layer} caches {type(self.spec.layers[layer]).__name__}, "
                            f"not {kind.__name__}")

    def copy_state(self, src_slot: int, dst_slot: int) -> None:
        """Copy GDN state row `src_slot` to `dst_slot` in every GDN layer (prefix snapshots)."""
        for layer in self.spec.gdn_layers:
            conv, ssm = self._arrays[layer]
            conv[dst_slot] = conv[src_slot]
            ssm[dst_slot] = ssm[src_slot]

    def copy_states(self, pairs) -> None:
        """copy_state for every (src, dst) of `pairs` (a speculative verify restoring each
        sequence's accepted prefix): one launch for every layer and pair where the backend has
        a row-copy op (CudaOps.copy_rows), else one copy per row."""
        if not pairs:
            return
        copy_rows = getattr(self.ops, "copy_rows", None)
        if copy_rows is None:
            for src, dst in pairs:
                self.copy_state(src, dst)
            return
        arrays = [a for layer in self.spec.gdn_layers for a in self._arrays[layer]]
        copy_rows(arrays, [s for s, _ in pairs], [d for _, d in pairs])

    def copy_block(self, src: int, dst: int) -> None:
        """Copy KV block `src` to block `dst` in every attention layer (each side, or the MLA
        latent; quantized sides as their bytes)."""
        for layer in self.spec.attention_layers:
            for a in self._arrays[layer]:
                rows = raw_blocks(a)
                rows[dst] = rows[src]

    # -- swapping (metrale.cache.swap): host copies of blocks and state rows ------------------
    def read_blocks(self, block_ids) -> list[np.ndarray]:
        """Host copies of K and V of `block_ids` in every attention layer, in layer order:
        [k, v, k, v, ...], each [len(block_ids), block_size, n_kv_heads, head_dim], or the raw
        bytes [len(block_ids), block_bytes] of a quantized side (moved unchanged); an MLA layer
        adds its one latent array [len(block_ids), block_size, kv_lora_rank + rope_dim]."""
        idx = self.ops.asarray(np.asarray(block_ids, dtype=np.int64), dtype=np.int64)
        return [self.ops.to_numpy(raw_blocks(a)[idx]) for layer in self.spec.attention_layers
                for a in self._arrays[layer]]

    def write_blocks(self, block_ids, arrays) -> None:
        """Inverse of `read_blocks`: copy host arrays into blocks `block_ids`."""
        idx = self.ops.asarray(np.asarray(block_ids, dtype=np.int64), dtype=np.int64)
        dst = [raw_blocks(a) for layer in self.spec.attention_layers for a in self._arrays[layer]]
        for a, host in zip(dst, arrays, strict=True):
            a[idx] = self.ops.asarray(host, dtype=a.dtype)

    def read_state(self, slot: int) -> list[np.ndarray]:
        """Host copies of GDN state row `slot` in every GDN layer: [conv, ssm, conv, ssm, ...]."""
        return [self.ops.to_numpy(a[slot]) for layer in self.spec.gdn_layers
                for a in self._arrays[layer]]

    def write_state(self, slot: int, arrays) -> None:
        """Inverse of `read_state`: copy host arrays into GDN state row `slot`."""
        dst = [a for layer in self.spec.gdn_layers for a in self._arrays[layer]]
        for a, host in zip(dst, arrays, strict=True):
            a[slot] = self.ops.asarray(host, dtype=a.dtype)

    @property
    def kv_bytes_per_block(self) -> int:
        return self.spec.kv_bytes_per_block(self.block_size, self.ops.dtype)

    @property
    def state_bytes_per_slot(self) -> int:
        return self.spec.state_bytes_per_slot(self.ops.dtype, self.ssm_dtype)

    @property
    def total_bytes(self) -> int:
        return (self.num_blocks * self.kv_bytes_per_block
                + self.num_state_slots * self.state_bytes_per_slot)


def _ranges(ids: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    out, start = [], None
    for j, i in enumerate(ids):
        if start is None:
            start = i
        if j + 1 == len(ids) or ids[j + 1] != i + 1:
            out.append(f"{start}-{i}" if i != start else f"{i}")
            start = None
    return ", ".join(out)
