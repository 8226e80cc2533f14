"""KV cache dtypes: what a quantized KV block holds, byte for byte, and the reference numerics.

`--kv-cache-dtype` names a format for K and one for V. Seven symmetric names (the same format for
both) and nine asymmetric pairs `<K>k_<V>v` (K errors move the softmax, V errors only the mix,
so every pair keeps K at least as precise as V):

    bf16  fp8  nvfp4  turbo2  turbo3  turbo4  turbo8
    bf16k_turbo3v (the operator reference's)  bf16k_turbo4v  bf16k_fp8v  bf16k_nvfp4v
    fp8k_turbo3v  fp8k_turbo4v  fp8k_nvfp4v  turbo8k_turbo4v  turbo4k_turbo3v

Layers: `--kv-high-precision-layers N | auto | max | all` keeps the first ceil(N/2) and the last
floor(N/2) attention layers in bf16 (N = 1: the first only). `auto` is 2, `max` / `all` every
attention layer, anything else unparseable warns and means 0, and 0 means the per-dtype
automatic value (`auto_high_precision_layers`): none for bf16 / fp8 / nvfp4, max(4, ceil(4L/5))
for turbo2 and bf16k_turbo3v, max(2, ceil(L/3)) for every other turbo and asymmetric dtype
(L = attention layers; N > L promotes all of them). `plan_kv_layers` gives each attention
layer its (K format, V format).

"bf16" is the unquantized cache in the activation dtype: bf16 on CUDA, fp32 on the CPU backend
(the spec, where the test suite compares against HF at 1e-4); its blocks keep the plain layout
[num_blocks, block_size, n_kv_heads, head_dim] of that dtype. The MTP head's own KV
(metrale.models.mtp) is always this unquantized cache: a drafter's precision changes only how
many drafts are kept, never an emitted token.

Quantized blocks. One side (K or V) of one attention layer is a byte array [num_blocks,
block_bytes] (uint8). A block is a structure of arrays: the format's fields one after another,
each field an array [block_size, n_kv_heads, count] of its element type, C order, starting at a
16-byte aligned offset (`block_layout` computes the offsets; field f of the vector of token t
(t = slot % block_size) and head h starts at byte offset_f + (t * n_kv_heads + h) * count_f *
itemsize_f of block slot // block_size). D = head_dim. Bytes per (token, kv head), unpadded:

    fp8     values  float8_e4m3fn [D]      x / scale, rounded to nearest even, clamped to +-448
            scale   fp32 [1]               amax(|x|) / 448 of the vector (0 for a zero vector)
            -> D + 4 bytes. Read: x = values * scale.
            --fp8-kv-calibration-tokens N > 0: the first N tokens a layer writes use their own
            scale as above while max|x| over every vector of the layer (K and V apart)
            accumulates; from token N + 1 on every vector uses the layer's fixed scale amax / 448
            (values saturate at +-448). The read path is the same (the scale is stored per
            vector either way).
    nvfp4   values  uint8 [D / 2]          e2m1 codes, element 2j in the LOW nibble of byte j,
                                           2j + 1 in the high nibble; code bit 3 = sign, bits
                                           0-2 index (0, .5, 1, 1.5, 2, 3, 4, 6) as NVFP4 weights
                                           (metrale.models.quant.E2M1_VALUES)
            scales  float8_e4m3fn [D / 16] per 16 consecutive elements: e4m3(min(amax16 / (6 g),
                                           448)), g the global scale
            global  fp32 [1]               g = amax(|x|) / (448 * 6) of the vector
            -> D / 2 + D / 16 + 4 bytes. Write: code = e2m1(x / (scale * g)) (nearest even,
            saturating at +-6; 0 where scale * g is 0). Read: x = E2M1[code] * scale * g.
    turboB  indices uint8 [D * B / 8]      B-bit codebook indices as one little-endian bit
    (B = 2,                                stream: coordinate j is bits [jB, jB + B) of the
     3, 4, 8)                              field, bit i being bit i % 8 of byte i // 8 (B = 4:
                                           coordinate 2j in the low nibble; B = 3: 8 coordinates
                                           in 3 bytes, w = b0 | b1 << 8 | b2 << 16, coordinate i
                                           = (w >> 3i) & 7)
            norm    fp32 [1]               ||x||_2
            -> D * B / 8 + 4 bytes. Needs D a power of two (Hadamard; 16 .. 256 in practice).

TurboQuant (Zandieh, Daliri, Hadian, Mirrokni, arXiv 2504.19874, the MSE variant): a random
rotation makes every coordinate of a unit vector follow one known distribution (Beta, ~N(0, 1/D)),
so one fixed scalar codebook serves every vector and no per-block scale is needed.
    Write: n = ||x||; u = x / n (0 for n = 0); y = R u with R = H_D diag(s) / sqrt(D), H_D the
    Sylvester Walsh-Hadamard matrix (H_1 = [1], H_2m = [[H, H], [H, -H]]: entry (i, j) =
    (-1)^popcount(i & j)) and s in {+1, -1}^D the layer's signs; index_j = #{i : M_i < y_j sqrt(D)}
    over the 2^B - 1 midpoints M of the codebook C (ascending).
    Read: x^ = n R^T (C[index] / sqrt(D)) = n diag(s) H_D C[index] / D.
    C: the Lloyd-Max quantizer of N(0, 1) at B bits (`CODEBOOKS`, the positive half shipped; the
    whole book is [-C+ reversed, C+]), scaled by 1 / sqrt(D) for every D (the exact coordinate
    density, prop. to (1 - t^2)^((D - 3) / 2), tends to N(0, 1/D); the measured error below is
    with this codebook). Its distortion per coordinate of N(0, 1): B = 2 0.1175, 3 0.03454,
    4 0.009497, 8 4.13e-5 (`CODEBOOK_DISTORTION`), which is the expected relative MSE
    ||x - x^||^2 / ||x||^2 of a rotated vector.
    Signs: s_j = +1 if bit 63 of splitmix64(((2 * layer + side) << 32) + j) is 0, else -1
    (layer = the decoder layer index, side 0 = K, 1 = V; splitmix64(x): z = x + 0x9E3779B97F4A7C15,
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9, z = (z ^ (z >> 27)) * 0x94D049BB133111EB,
    z ^ (z >> 31), all mod 2^64): nothing extra is stored.
    Attention without dequantising (what a CUDA kernel does): R is orthogonal, so
    q . k^ = n_k (R q) . C[index_k] / sqrt(D): rotate the query once per head (a Hadamard
    transform), dot it against codebook entries; for V accumulate sum_i p_i n_i C[index_i] /
    sqrt(D) in the rotated domain and apply R^T once to the output. The CPU backend (the spec)
    dequantises the gathered blocks instead.

Measured error (tests/test_kv_dtypes.py prints these): relative MSE sum ||x - x^||^2 /
sum ||x||^2, D = 64; "gauss": 20,000 i.i.d. N(0, 1) vectors; "SmolLM2": the real K (after rope)
and V of SmolLM2-135M's 30 layers over a 112-token English prompt. Bytes per (token, kv head)
against bf16's 128 (D = 64) / 256 (D = 128):

    format   gauss      SmolLM2 K  SmolLM2 V  bytes D=64  D=128
    fp8      6.27e-4    4.44e-4    5.88e-4    68          132
    nvfp4    8.97e-3    8.26e-3    8.60e-3    40          76
    turbo2   0.114      0.107      0.114      20          36
    turbo3   0.0335     0.0317     0.0332     28          52
    turbo4   9.16e-3    8.81e-3    9.13e-3    36          68
    turbo8   3.98e-5    3.83e-5    3.97e-5    68          132

turbo's error is 0.89-0.99 of the codebook distortion on Gaussian vectors at D = 16 .. 128 and
lower with outlier channels; its worst case is a one-hot spike (the randomized Hadamard
transform turns it into a flat +-1/sqrt(D) vector): up to 2.2x for turbo2 / turbo8. At the
same bytes turbo8 is 16x more precise than fp8, and turbo4 matches nvfp4 in 10 % fewer bytes.
End to end (SmolLM2, greedy over 64 tokens against unquantized KV, default promotion): fp8
keeps 49 tokens, turbo8 32, the bf16-K pairs 26-47, fp8k_nvfp4v 26, turbo8k_turbo4v 56; the
others (4-bit or lower K, and fp8k_turbo3v / fp8k_turbo4v) break at the continuation's first
close calls, after 1-3 tokens; tests/test_kv_dtypes.py has every dtype.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from metrale.models.quant import E2M1_VALUES, E4M3, NVFP4_GROUP

log = logging.getLogger("metrale.cache.kv_dtypes")

F32 = np.float32
E2M1 = np.dtype(ml_dtypes.float4_e2m1fn)
E4M3_MAX = 448.0
E2M1_MAX = 6.0
ALIGN = 16                       # bytes: every field of a block starts at a multiple of this

BF16 = "bf16"
TURBO_BITS = {"turbo2": 2, "turbo3": 3, "turbo4": 4, "turbo8": 8}
FORMATS = (BF16, "fp8", "nvfp4") + tuple(TURBO_BITS)
ASYMMETRIC = {
    "bf16k_turbo3v": (BF16, "turbo3"), "bf16k_turbo4v": (BF16, "turbo4"),
    "bf16k_fp8v": (BF16, "fp8"), "bf16k_nvfp4v": (BF16, "nvfp4"),
    "fp8k_turbo3v": ("fp8", "turbo3"), "fp8k_turbo4v": ("fp8", "turbo4"),
    "fp8k_nvfp4v": ("fp8", "nvfp4"), "turbo8k_turbo4v": ("turbo8", "turbo4"),
    "turbo4k_turbo3v": ("turbo4", "turbo3"),
}
KV_CACHE_DTYPES = FORMATS + tuple(ASYMMETRIC)
HIGH_PRECISION_WORDS = {"auto": 2}          # max / all: every attention layer
_NO_AUTO_PROMOTION = (BF16, "fp8", "nvfp4")

# Lloyd-Max quantizers of N(0, 1), positive half (the book is symmetric), from `lloyd_max_normal`
# (converged to 1e-11); a kernel multiplies them by rsqrt(head_dim).
_CODEBOOK_POSITIVE = {
    2: (
        0.4527800346, 1.5104176085,
    ),
    3: (
        0.2450941789, 0.7560052812, 1.3439092785, 2.1519457045,
    ),
    4: (
        0.1283950299, 0.3880482995, 0.6567591185, 0.9423404565, 1.2562311973, 1.6180463860,
        2.0690172265, 2.7325895710,
    ),
    8: (
        0.0084461932, 0.0253393831, 0.0422349838, 0.0591346043, 0.0760398564, 0.0929523554,
        0.1098737217, 0.1268055814, 0.1437495678, 0.1607073224, 0.1776804958, 0.1946707493,
        0.2116797555, 0.2287091999, 0.2457607821, 0.2628362168, 0.2799372353, 0.2970655865,
        0.3142230386, 0.3314113801, 0.3486324215, 0.3658879965, 0.3831799637, 0.4005102078,
        0.4178806415, 0.4352932072, 0.4527498783, 0.4702526612, 0.4878035973, 0.5054047644,
        0.5230582793, 0.5407662992, 0.5585310246, 0.5763547006, 0.5942396202, 0.6121881261,
        0.6302026133, 0.6482855322, 0.6664393910, 0.6846667587, 0.7029702684, 0.7213526204,
        0.7398165857, 0.7583650094, 0.7770008149, 0.7957270074, 0.8145466788, 0.8334630114,
        0.8524792833, 0.8715988732, 0.8908252655, 0.9101620563, 0.9296129591, 0.9491818112,
        0.9688725810, 0.9886893743, 1.0086364427, 1.0287181916, 1.0489391890, 1.0693041744,
        1.0898180699, 1.1104859896, 1.1313132522, 1.1523053928, 1.1734681764, 1.1948076120,
        1.2163299682, 1.2380417897, 1.2599499153, 1.2820614972, 1.3043840223, 1.3269253346,
        1.3496936599, 1.3726976334, 1.3959463280, 1.4194492870, 1.4432165588, 1.4672587348,
        1.4915869919, 1.5162131377, 1.5411496620, 1.5664097918, 1.5920075535, 1.6179578407,
        1.6442764901, 1.6709803659, 1.6980874530, 1.7256169623, 1.7535894479, 1.7820269389,
        1.8109530884, 1.8403933408, 1.8703751224, 1.9009280581, 1.9320842177, 1.9638783994,
        1.9963484549, 2.0295356654, 2.0634851771, 2.0982465091, 2.1338741482, 2.1704282494,
        2.2079754643, 2.2465899297, 2.2863544514, 2.3273619347, 2.3697171253, 2.4135387444,
        2.4589621336, 2.5061425604, 2.5552593974, 2.6065214665, 2.6601739657, 2.7165075786,
        2.7758706527, 2.8386857868, 2.9054729037, 2.9768821337, 3.0537420162, 3.1371325317,
        3.2285002106, 3.3298484700, 3.4440716782, 3.5755879724, 3.7316662622, 3.9256377839,
        4.1865954428, 4.6035356124,
    ),
}
CODEBOOKS = {b: np.concatenate([-np.asarray(c[::-1]), np.asarray(c)]).astype(F32)
             for b, c in _CODEBOOK_POSITIVE.items()}
MIDPOINTS = {b: ((c[1:] + c[:-1]) / 2).astype(F32) for b, c in CODEBOOKS.items()}
CODEBOOK_DISTORTION = {2: 0.1175, 3: 0.03454, 4: 0.009497, 8: 4.13e-5}


def lloyd_max_normal(bits: int, iterations: int, start=None) -> np.ndarray:
    """How CODEBOOKS were made: Lloyd's iteration for N(0, 1) at `bits` bits (cells bounded by
    midpoints, each centroid moved to its cell's conditional mean, closed form for the normal),
    in float64 from `start` (default: uniform on +-(1 + bits / 2); 400,000 iterations for 8
    bits). Returns the ascending codebook."""
    n = 2 ** bits
    c = np.linspace(-1.0, 1.0, n) * (1.0 + 0.5 * bits) if start is None else np.asarray(start, np.float64)
    erf = np.vectorize(math.erf)
    for _ in range(iterations):
        edges = np.concatenate([[-np.inf], (c[1:] + c[:-1]) / 2, [np.inf]])
        cdf = 0.5 * (1.0 + erf(edges / math.sqrt(2.0)))
        pdf = np.exp(-edges * edges / 2) / math.sqrt(2 * math.pi)
        c = (pdf[:-1] - pdf[1:]) / (cdf[1:] - cdf[:-1])
        c = (c - c[::-1]) / 2
    return c


# -- names and layers -------------------------------------------------------------------------

def kv_formats(kv_dtype: str) -> tuple[str, str]:
    """(K format, V format) of a --kv-cache-dtype name."""
    if kv_dtype in ASYMMETRIC:
        return ASYMMETRIC[kv_dtype]
    if kv_dtype in FORMATS:
        return kv_dtype, kv_dtype
    raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_dtype!r}")


def auto_high_precision_layers(kv_dtype: str, num_attention_layers: int) -> int:
    """The layers --kv-high-precision-layers 0 promotes to bf16 under `kv_dtype`."""
    n = num_attention_layers
    if kv_dtype in _NO_AUTO_PROMOTION:
        return 0
    if kv_dtype in ("turbo2", "bf16k_turbo3v"):
        return max(4, -(-4 * n // 5))
    return max(2, -(-n // 3))


def high_precision_layers(setting, kv_dtype: str, num_attention_layers: int) -> int:
    """How many attention layers --kv-high-precision-layers `setting` keeps in bf16 (at most
    all of them); an unparseable setting warns and counts as 0."""
    word = str(setting).strip().lower()
    if word in ("max", "all"):
        return num_attention_layers
    n = HIGH_PRECISION_WORDS.get(word)
    if n is None:
        n = int(word) if word.isdigit() else None
    if n is None:
        log.warning("--kv-high-precision-layers %r is not a number, auto, max or all: using 0 "
                    "(the per-dtype automatic value)", setting)
        n = 0
    if n == 0:
        n = auto_high_precision_layers(kv_dtype, num_attention_layers)
    return min(n, num_attention_layers)


def plan_kv_layers(kv_dtype: str, setting, attention_layers) -> dict[int, tuple[str, str]]:
    """(K format, V format) of every attention layer (decoder layer index -> formats): the
    first ceil(N/2) and last floor(N/2) of the N promoted layers in bf16, the rest in
    `kv_dtype`'s formats."""
    layers = list(attention_layers)
    n = high_precision_layers(setting, kv_dtype, len(layers))
    first, last = -(-n // 2), n // 2
    promoted = set(layers[:first]) | set(layers[len(layers) - last:])
    formats = kv_formats(kv_dtype)
    return {layer: (BF16, BF16) if layer in promoted else formats for layer in layers}


# -- block layouts ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Field:
    name: str
    dtype: np.dtype
    count: int           # elements per (token, kv head) vector
    offset: int          # bytes from the start of the block


@dataclass(frozen=True)
class BlockLayout:
    """One quantized side (K or V) of a block: `fields` in order, `nbytes` in all."""
    format: str
    block_size: int
    n_heads: int
    head_dim: int
    fields: tuple[Field, ...]
    nbytes: int

    def field(self, name: str) -> Field:
        return next(f for f in self.fields if f.name == name)


def vector_fields(fmt: str, head_dim: int) -> list[tuple[str, np.dtype, int]]:
    """(name, element dtype, count) of the fields one (token, kv head) vector stores."""
    d = head_dim
    if fmt == "fp8":
        return [("values", E4M3, d), ("scale", np.dtype(F32), 1)]
    if fmt == "nvfp4":
        return [("values", np.dtype(np.uint8), d // 2), ("scales", E4M3, d // NVFP4_GROUP),
                ("global", np.dtype(F32), 1)]
    bits = TURBO_BITS[fmt]
    return [("indices", np.dtype(np.uint8), d * bits // 8), ("norm", np.dtype(F32), 1)]


def check_head_dim(fmt: str, head_dim: int) -> None:
    """Refuse a format the head size cannot take (which format, which size, what it needs)."""
    if fmt == "nvfp4" and head_dim % NVFP4_GROUP:
        raise ValueError(f"KV format nvfp4 needs head_dim divisible by {NVFP4_GROUP} (a scale per "
                         f"16 elements), got {head_dim}: use fp8 or bf16 KV for this model")
    if fmt in TURBO_BITS and (head_dim < 8 or head_dim & (head_dim - 1)):
        raise ValueError(f"KV format {fmt} needs head_dim a power of two >= 8 (a Walsh-Hadamard "
                         f"rotation), got {head_dim}: use fp8 or bf16 KV for this model")


def block_layout(fmt: str, block_size: int, n_heads: int, head_dim: int) -> BlockLayout:
    check_head_dim(fmt, head_dim)
    fields, offset = [], 0
    for name, dtype, count in vector_fields(fmt, head_dim):
        offset = -(-offset // ALIGN) * ALIGN
        fields.append(Field(name, np.dtype(dtype), count, offset))
        offset += block_size * n_heads * count * np.dtype(dtype).itemsize
    return BlockLayout(fmt, block_size, n_heads, head_dim, tuple(fields), -(-offset // ALIGN) * ALIGN)


def bytes_per_vector(fmt: str, head_dim: int, act_dtype) -> int:
    """Bytes one (token, kv head) vector takes in `fmt` (bf16: the activation dtype's)."""
    if fmt == BF16:
        return head_dim * np.dtype(act_dtype).itemsize
    return sum(np.dtype(t).itemsize * n for _, t, n in vector_fields(fmt, head_dim))


def side_bytes_per_block(fmt: str, block_size: int, n_heads: int, head_dim: int, act_dtype) -> int:
    """Bytes one block of one side (K or V) of one layer takes in `fmt`, padding included."""
    if fmt == BF16:
        return block_size * n_heads * head_dim * np.dtype(act_dtype).itemsize
    return block_layout(fmt, block_size, n_heads, head_dim).nbytes


# -- reference numerics (what the CUDA kernels are checked against) ----------------------------
# quantize(fmt, x [n, D] fp32, ...) -> {field name: [n, count]}; dequantize is its read path.

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def rotation_signs(layer: int, side: int, head_dim: int) -> np.ndarray:
    """The random signs s of layer `layer`'s side (0 = K, 1 = V) rotation, fp32 [head_dim]."""
    z = (np.uint64((2 * layer + side) << 32) + np.arange(head_dim, dtype=np.uint64)) + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    z = z ^ (z >> np.uint64(31))
    return np.where(z >> np.uint64(63), F32(-1), F32(1)).astype(F32)


def walsh_hadamard(x: np.ndarray) -> np.ndarray:
    """H_D x over the last axis (Sylvester order, unnormalised), fp32."""
    x = np.array(x, dtype=F32)
    d = x.shape[-1]
    lead = x.shape[:-1]
    h = 1
    while h < d:
        x = x.reshape(*lead, d // (2 * h), 2, h)
        a, b = x[..., 0, :], x[..., 1, :]
        x = np.stack([a + b, a - b], axis=-2).reshape(*lead, d)
        h *= 2
    return x


def rotate(x: np.ndarray, signs: np.ndarray) -> np.ndarray:
    """R x = H_D diag(s) x / sqrt(D) over the last axis."""
    return walsh_hadamard(x * signs) / F32(math.sqrt(x.shape[-1]))


def unrotate(y: np.ndarray, signs: np.ndarray) -> np.ndarray:
    """R^T y = diag(s) H_D y / sqrt(D)."""
    return walsh_hadamard(y) * signs / F32(math.sqrt(y.shape[-1]))


def pack_bits(idx: np.ndarray, bits: int) -> np.ndarray:
    """[n, D] indices < 2^bits -> [n, D * bits / 8] uint8, one little-endian bit stream a row."""
    planes = (idx[..., None].astype(np.uint8) >> np.arange(bits, dtype=np.uint8)) & 1
    return np.packbits(planes.reshape(idx.shape[0], -1), axis=-1, bitorder="little")


def unpack_bits(packed: np.ndarray, bits: int, d: int) -> np.ndarray:
    planes = np.unpackbits(packed, axis=-1, bitorder="little")[:, : d * bits]
    weights = (1 << np.arange(bits)).astype(np.int64)
    return (planes.reshape(packed.shape[0], d, bits).astype(np.int64) * weights).sum(-1)


def _safe(s: np.ndarray) -> np.ndarray:
    return np.where(s > 0, s, F32(1))


def _amax(x: np.ndarray) -> np.ndarray:
    return np.max(np.abs(x), axis=-1, keepdims=True)


def _fp8_quantize(x, scale=None):
    scale = _amax(x) / F32(E4M3_MAX) if scale is None else np.asarray(scale, F32).reshape(-1, 1)
    values = np.clip(x / _safe(scale), -E4M3_MAX, E4M3_MAX).astype(E4M3)
    return {"values": values, "scale": scale.astype(F32)}


def _fp8_dequantize(f):
    return f["values"].astype(F32) * f["scale"].astype(F32)


def _nvfp4_quantize(x):
    n, d = x.shape
    g = (_amax(x) / F32(E4M3_MAX * E2M1_MAX)).astype(F32)                 # [n, 1]
    groups = x.reshape(n, d // NVFP4_GROUP, NVFP4_GROUP)
    scales = np.clip(_amax(groups)[..., 0] / (F32(E2M1_MAX) * _safe(g)), 0, E4M3_MAX).astype(E4M3)
    s = (scales.astype(F32) * g)[..., None]                               # [n, D/16, 1]
    codes = (groups / _safe(s)).astype(E2M1).view(np.uint8) & 0xF
    codes = np.where(s > 0, codes, 0).reshape(n, d).astype(np.uint8)
    return {"values": (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8), "scales": scales,
            "global": g}


def _nvfp4_dequantize(f):
    packed = f["values"]
    n = packed.shape[0]
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(n, -1)
    s = f["scales"].astype(F32) * f["global"].astype(F32)
    return (E2M1_VALUES[codes].reshape(n, s.shape[1], NVFP4_GROUP) * s[..., None]).reshape(n, -1)


def _turbo_quantize(x, bits, signs):
    d = x.shape[1]
    norm = np.sqrt(np.sum(x * x, axis=-1, keepdims=True, dtype=F32)).astype(F32)
    y = rotate(x / _safe(norm), signs) * F32(math.sqrt(d))
    idx = np.searchsorted(MIDPOINTS[bits], y, side="left")
    return {"indices": pack_bits(idx, bits), "norm": norm}


def _turbo_dequantize(f, bits, signs):
    d = signs.shape[0]
    y = CODEBOOKS[bits][unpack_bits(f["indices"], bits, d)] / F32(math.sqrt(d))
    return unrotate(y, signs) * f["norm"].astype(F32)


def quantize(fmt: str, x: np.ndarray, layer: int = 0, side: int = 0, scale=None) -> dict:
    """Encode vectors x [n, D] (fp32) in `fmt`: {field: [n, count]}. `layer` and `side` pick the
    turbo rotation; `scale` ([n] fp32) replaces fp8's per-vector scales (calibrated layers)."""
    x = np.asarray(x, dtype=F32)
    if fmt == "fp8":
        return _fp8_quantize(x, scale)
    if fmt == "nvfp4":
        return _nvfp4_quantize(x)
    return _turbo_quantize(x, TURBO_BITS[fmt], rotation_signs(layer, side, x.shape[1]))


def dequantize(fmt: str, fields: dict, layer: int = 0, side: int = 0, head_dim: int = 0) -> np.ndarray:
    """Decode `quantize`'s fields back to fp32 vectors [n, D]."""
    if fmt == "fp8":
        return _fp8_dequantize(fields)
    if fmt == "nvfp4":
        return _nvfp4_dequantize(fields)
    bits = TURBO_BITS[fmt]
    d = head_dim or fields["indices"].shape[1] * 8 // bits
    return _turbo_dequantize(fields, bits, rotation_signs(layer, side, d))


# -- the paged cache of one quantized side -------------------------------------------------------

class QuantKvCache:
    """K or V of one attention layer in a quantized format: `data` [num_blocks, layout.nbytes]
    uint8 (a backend array; the module docstring's block layout). Block movers (swap, prefix
    copies) move `data` rows unchanged; `write` / `read` are the op-level write and read paths
    (the CPU backend calls them from write_kv and attention).

    fp8 with `calibration_tokens` N > 0: the first N tokens written calibrate (own scales,
    running max|x| in `calibration_amax`); then `fixed_scale` = that max / 448 for every later
    vector."""

    def __init__(self, layout: BlockLayout, data, layer: int, side: int, calibration_tokens: int = 0):
        self.layout, self.data, self.layer, self.side = layout, data, layer, side
        self.format = layout.format
        self.calibration_tokens = calibration_tokens if self.format == "fp8" else 0
        self.calibrated_tokens = 0
        self.calibration_amax = 0.0
        self.fixed_scale: float | None = None

    @property
    def num_blocks(self) -> int:
        return int(self.data.shape[0])

    def _view(self, f: Field) -> np.ndarray:
        lay = self.layout
        size = lay.block_size * lay.n_heads * f.count * f.dtype.itemsize
        raw = self.data[:, f.offset: f.offset + size]
        return raw.view(f.dtype).reshape(self.num_blocks, lay.block_size, lay.n_heads, f.count)

    def write(self, slots: np.ndarray, x: np.ndarray) -> None:
        """Encode x [n, n_heads, D] into token slots `slots` [n] (all >= 0)."""
        lay = self.layout
        n = len(slots)
        if n == 0:
            return
        flat = np.asarray(x, dtype=F32).reshape(n * lay.n_heads, lay.head_dim)
        fields = quantize(self.format, flat, self.layer, self.side, self._scales(flat, n))
        blocks, t = slots // lay.block_size, slots % lay.block_size
        for f in lay.fields:
            self._view(f)[blocks, t] = fields[f.name].reshape(n, lay.n_heads, f.count)

    def read(self, slots: np.ndarray) -> np.ndarray:
        """Decode the vectors of token slots `slots` [n] -> fp32 [n, n_heads, D]."""
        lay = self.layout
        n = len(slots)
        blocks, t = slots // lay.block_size, slots % lay.block_size
        fields = {f.name: self._view(f)[blocks, t].reshape(n * lay.n_heads, f.count) for f in lay.fields}
        out = dequantize(self.format, fields, self.layer, self.side, lay.head_dim)
        return out.reshape(n, lay.n_heads, lay.head_dim)

    def _scales(self, flat: np.ndarray, n: int):
        """fp8 calibration: per-vector scales for this write, or None (every vector its own)."""
        if not self.calibration_tokens:
            return None
        heads = self.layout.n_heads
        if self.fixed_scale is None:
            todo = min(n, self.calibration_tokens - self.calibrated_tokens)
            own = _amax(flat)[:, 0] / F32(E4M3_MAX)
            self.calibration_amax = max(self.calibration_amax, float(np.max(own[: todo * heads]) * E4M3_MAX))
            self.calibrated_tokens += todo
            if self.calibrated_tokens < self.calibration_tokens:
                return None
            # a layer that wrote only zeros keeps scale 1 / 448 (max 1) rather than 0
            self.fixed_scale = float(F32(self.calibration_amax or 1.0) / F32(E4M3_MAX))
            own[todo * heads:] = self.fixed_scale
            return own
        return np.full(n * heads, self.fixed_scale, F32)


def is_quantized_kv(cache) -> bool:
    return isinstance(cache, QuantKvCache)


def make_kv_side(fmt: str, ops, layer: int, side: int, num_blocks: int, block_size: int,
                 n_heads: int, head_dim: int, calibration_tokens: int = 0):
    """One side of one layer's KV pool: the plain [num_blocks, block_size, n_heads, head_dim]
    array of the activation dtype for bf16, else a QuantKvCache over zeroed bytes."""
    if fmt == BF16:
        return ops.zeros((num_blocks, block_size, n_heads, head_dim))
    layout = block_layout(fmt, block_size, n_heads, head_dim)
    return QuantKvCache(layout, ops.zeros((num_blocks, layout.nbytes), dtype=np.uint8), layer, side,
                        calibration_tokens)


def raw_blocks(cache):
    """The array block movers copy rows of: a quantized side's bytes, or the plain array."""
    return cache.data if is_quantized_kv(cache) else cache


def relative_mse(fmt: str, x: np.ndarray, layer: int = 0, side: int = 0) -> float:
    """sum ||x - x^||^2 / sum ||x||^2 of vectors x [n, D] through `fmt`'s write and read path."""
    x = np.asarray(x, dtype=F32)
    err = dequantize(fmt, quantize(fmt, x, layer, side), layer, side, x.shape[1]) - x
    return float(np.sum(err.astype(np.float64) ** 2) / np.sum(x.astype(np.float64) ** 2))
