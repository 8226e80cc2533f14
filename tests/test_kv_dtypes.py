"""KV cache dtypes (metrale/cache/kv_dtypes.py): the byte layouts decoded by hand, the round-trip
error bounds each format's arithmetic implies, the TurboQuant rotation and codebooks, the
--kv-high-precision-layers rules of the operator reference, the pool sized from the dtype's
bytes, and end to end on the CPU backend: logits error against unquantized KV on tiny llama /
qwen3 / qwen3_5 checkpoints, prefill-then-decode against one shot, prefix-cache hits, swap and
recompute preemption and n-gram speculation each giving the same tokens as a plain run with the
same dtype, fp8 calibration, the CUDA refusal, and the real SmolLM2's greedy agreement.

"bf16" KV is the unquantized cache in the activation dtype: fp32 on the CPU backend."""
import logging
import math
import struct

import ml_dtypes
import numpy as np
import pytest

from metrale.backends.cpu import CpuOps
from metrale.cache import kv_dtypes as K
from metrale.cache.kv import AttentionSpec, CacheSpec, ModelCaches
from metrale.config import ConfigError, EngineConfig
from metrale.engine_core import EngineCore
from metrale.forward import contiguous_batch
from metrale.models.loader import load_checkpoint
from metrale.models.registry import build_model
from metrale.request import Request
from metrale.sampling import SamplingParams
from tiny_models import VOCAB, make_tiny

QUANTIZED = K.FORMATS[1:]
E2M1_TABLE = [0, .5, 1, 1.5, 2, 3, 4, 6]


def vectors(n, d, seed=0, outliers=True):
    """Gaussian vectors, half of them with a few outlier channels (the shape real keys have)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)).astype(np.float32)
    if outliers:
        x[: n // 2, :3] *= 20.0
    return x


def one_cache(fmt, block_size=4, heads=2, d=32, blocks=3, layer=5, side=1, calibration=0):
    return K.make_kv_side(fmt, CpuOps(), layer, side, blocks, block_size, heads, d, calibration)


# -- names, bytes, layouts ----------------------------------------------------------------------

def test_the_sixteen_names_and_their_formats():
    assert len(K.KV_CACHE_DTYPES) == 16 and len(K.ASYMMETRIC) == 9
    assert K.kv_formats("bf16k_turbo3v") == ("bf16", "turbo3")
    assert K.kv_formats("turbo4") == ("turbo4", "turbo4")
    rank = {"bf16": 16, "fp8": 8.5, "turbo8": 8.5, "nvfp4": 4.5, "turbo4": 4, "turbo3": 3}
    for k, v in K.ASYMMETRIC.values():      # K never less precise than V
        assert rank[k] >= rank[v]
    with pytest.raises(ValueError, match="kv-cache-dtype"):
        K.kv_formats("fp4")


@pytest.mark.parametrize("d", [64, 128])
def test_bytes_per_vector(d):
    expect = {"fp8": d + 4, "nvfp4": d // 2 + d // 16 + 4, "turbo2": d // 4 + 4,
              "turbo3": 3 * d // 8 + 4, "turbo4": d // 2 + 4, "turbo8": d + 4}
    for fmt, n in expect.items():
        assert K.bytes_per_vector(fmt, d, np.float32) == n
    assert K.bytes_per_vector("bf16", d, ml_dtypes.bfloat16) == 2 * d
    assert K.bytes_per_vector("bf16", d, np.float32) == 4 * d
    # block 16, 8 heads: fields are multiples of 16 bytes already, so no padding
    for fmt, n in expect.items():
        assert K.block_layout(fmt, 16, 8, d).nbytes == 16 * 8 * n


def test_fp8_bytes_decoded_by_hand():
    cache = one_cache("fp8")                    # block 4, 2 heads, D 32
    x = vectors(2, 32, seed=1).reshape(1, 2, 32)
    cache.write(np.array([6]), x)               # block 1, token 2
    raw = bytes(cache.data[1])
    for h in range(2):
        vec = 2 * 2 + h                         # (t * heads + h)
        values = np.frombuffer(raw[vec * 32: vec * 32 + 32], dtype=ml_dtypes.float8_e4m3fn)
        scale_at = 4 * 2 * 32 + vec * 4         # after block_size * heads * D value bytes
        (scale,) = struct.unpack("<f", raw[scale_at: scale_at + 4])
        assert scale == pytest.approx(np.abs(x[0, h]).max() / 448, rel=1e-6)
        assert np.abs(values.astype(np.float32)).max() == 448
        np.testing.assert_array_equal(values.astype(np.float32) * np.float32(scale),
                                      cache.read(np.array([6]))[0, h])
    assert not np.any(cache.data[0]) and not np.any(cache.data[2])      # other blocks untouched


def test_nvfp4_bytes_decoded_by_hand():
    cache = one_cache("nvfp4")
    x = vectors(2, 32, seed=2).reshape(1, 2, 32)
    cache.write(np.array([1]), x)               # block 0, token 1
    raw = bytes(cache.data[0])
    h, vec = 1, 1 * 2 + 1
    packed = raw[vec * 16: vec * 16 + 16]                        # D / 2 bytes
    scales_at = 4 * 2 * 16                                       # after every vector's values
    scales = np.frombuffer(raw[scales_at + vec * 2: scales_at + vec * 2 + 2],
                           dtype=ml_dtypes.float8_e4m3fn).astype(np.float32)
    global_at = scales_at + 4 * 2 * 2
    (g,) = struct.unpack("<f", raw[global_at + vec * 4: global_at + vec * 4 + 4])
    assert g == pytest.approx(np.abs(x[0, h]).max() / (448 * 6), rel=1e-6)
    out = []
    for j in range(32):
        code = packed[j // 2] & 0xF if j % 2 == 0 else packed[j // 2] >> 4    # low nibble first
        value = E2M1_TABLE[code & 7] * (-1 if code & 8 else 1)
        out.append(value * scales[j // 16] * g)
    np.testing.assert_allclose(out, cache.read(np.array([1]))[0, h], rtol=1e-6)
    np.testing.assert_allclose(out, x[0, h], atol=0.25 * np.abs(x[0, h]).max())


def hadamard(d):
    h = np.array([[1.0]])
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h


def test_turbo3_bytes_decoded_by_hand():
    cache = one_cache("turbo3", layer=5, side=1)
    x = vectors(2, 32, seed=3).reshape(1, 2, 32)
    cache.write(np.array([11]), x)              # block 2, token 3
    raw = bytes(cache.data[2])
    h, vec = 0, 3 * 2 + 0
    packed = raw[vec * 12: vec * 12 + 12]                        # 32 * 3 / 8 bytes
    norm_at = 4 * 2 * 12
    (norm,) = struct.unpack("<f", raw[norm_at + vec * 4: norm_at + vec * 4 + 4])
    assert norm == pytest.approx(np.linalg.norm(x[0, h]), rel=1e-6)
    idx = []
    for g in range(4):                          # 8 coordinates per 3 bytes, little-endian
        w = packed[3 * g] | packed[3 * g + 1] << 8 | packed[3 * g + 2] << 16
        idx += [(w >> (3 * i)) & 7 for i in range(8)]
    book = np.array([-2.1519457045, -1.3439092785, -0.7560052812, -0.2450941789,
                     0.2450941789, 0.7560052812, 1.3439092785, 2.1519457045])
    signs = K.rotation_signs(5, 1, 32)
    rot = hadamard(32) @ np.diag(signs) / math.sqrt(32)          # R
    y_hat = book[idx] / math.sqrt(32)
    np.testing.assert_allclose(norm * rot.T @ y_hat, cache.read(np.array([11]))[0, h], atol=1e-5)
    # the indices are the nearest codebook entries of the rotated unit vector
    y = rot @ (x[0, h] / np.linalg.norm(x[0, h])) * math.sqrt(32)
    np.testing.assert_array_equal(idx, np.argmin(np.abs(y[:, None] - book[None]), axis=1))


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_turbo_bit_streams(bits):
    idx = np.random.default_rng(bits).integers(0, 2 ** bits, (3, 32))
    packed = K.pack_bits(idx, bits)
    assert packed.shape == (3, 32 * bits // 8)
    np.testing.assert_array_equal(K.unpack_bits(packed, bits, 32), idx)
    if bits == 4:                               # coordinate 2j in the low nibble of byte j
        np.testing.assert_array_equal(packed & 0xF, idx[:, 0::2])
    if bits == 8:
        np.testing.assert_array_equal(packed, idx)


# -- round-trip error ---------------------------------------------------------------------------

def test_fp8_error_bound():
    """e4m3 keeps 3 mantissa bits: a value of x / scale in the normal range (>= 2^-6) is off by at
    most half an ulp, 2^-4 of its magnitude; below, the subnormal spacing 2^-9 gives 2^-10
    absolute. So |x - x^| <= max(2^-4 |x|, 2^-10 scale) with scale = amax / 448."""
    x = vectors(2000, 64)
    f = K.quantize("fp8", x)
    err = np.abs(K.dequantize("fp8", f) - x)
    scale = np.abs(x).max(-1, keepdims=True) / 448
    assert np.all(err <= np.maximum(2 ** -4 * np.abs(x), 2 ** -10 * scale) * (1 + 1e-6))
    np.testing.assert_array_equal(K.dequantize("fp8", K.quantize("fp8", np.zeros((2, 64)))), 0)


def test_nvfp4_error_bound():
    """A group's scale s = e4m3(b / (6 g)) * g (b = the group's amax) is within 2^-4 of b / 6
    (normal e4m3) or 2^-10 g of it (subnormal); e2m1's widest half-spacing is 1 (between 4 and
    6) in units of s, and saturation at 6 costs at most b - 6 s. So |x - x^| <= 1.0625 b / 6 +
    6 * 2^-10 g."""
    x = vectors(2000, 64)
    f = K.quantize("nvfp4", x)
    err = np.abs(K.dequantize("nvfp4", f) - x).reshape(2000, 4, 16)
    b = np.abs(x).reshape(2000, 4, 16).max(-1, keepdims=True)
    g = f["global"].reshape(2000, 1, 1)
    assert np.all(err <= 1.0625 * b / 6 + 6 * 2 ** -10 * g + 1e-6 * b)


@pytest.mark.parametrize("fmt", ["turbo2", "turbo3", "turbo4", "turbo8"])
@pytest.mark.parametrize("d", [16, 64, 128])
def test_turbo_relative_mse_is_the_codebook_distortion(fmt, d):
    """Gaussian vectors lose about the codebook's distortion per coordinate (measured 0.89-0.99
    of it: the exact coordinate density has lighter tails than N(0, 1/D)); vectors with outlier
    channels less (0.67-0.88); a one-hot spike is the randomized Hadamard transform's worst
    case (it becomes a flat +-1/sqrt(D) vector: 0.35-2.22 of it, by bits)."""
    bits = K.TURBO_BITS[fmt]
    dist = K.CODEBOOK_DISTORTION[bits]
    gauss = K.relative_mse(fmt, vectors(4000, d, seed=d, outliers=False), layer=3)
    heavy = K.relative_mse(fmt, vectors(4000, d, seed=d, outliers=True), layer=3)
    spike = K.relative_mse(fmt, np.eye(d, dtype=np.float32), layer=3)
    print(f"{fmt} D={d}: relative MSE / distortion: gauss {gauss / dist:.3f}, outliers "
          f"{heavy / dist:.3f}, spike {spike / dist:.2f}")
    assert 0.85 * dist <= gauss <= 1.02 * dist
    assert heavy <= 0.95 * dist and spike <= 2.3 * dist
    zero = K.quantize(fmt, np.zeros((1, d)))
    np.testing.assert_array_equal(K.dequantize(fmt, zero, head_dim=d), 0)


def test_rotation_is_orthogonal_and_reproducible():
    for d in (16, 64, 256):
        s = K.rotation_signs(7, 0, d)
        assert set(np.unique(s)) == {-1.0, 1.0}
        r = K.rotate(np.eye(d, dtype=np.float32), s)             # rows: R e_i, i.e. R^T
        np.testing.assert_allclose(r @ r.T, np.eye(d), atol=1e-5)
        np.testing.assert_allclose(K.unrotate(K.rotate(np.eye(d, dtype=np.float32), s), s),
                                   np.eye(d), atol=1e-5)
        np.testing.assert_allclose(r.T, hadamard(d) @ np.diag(s) / math.sqrt(d), atol=1e-6)
    np.testing.assert_array_equal(K.rotation_signs(7, 0, 64), K.rotation_signs(7, 0, 64))
    assert (K.rotation_signs(7, 0, 64) != K.rotation_signs(7, 1, 64)).sum() > 16
    assert (K.rotation_signs(7, 0, 64) != K.rotation_signs(8, 0, 64)).sum() > 16
    assert abs(K.rotation_signs(0, 0, 4096).sum()) < 300                   # balanced signs


def test_codebooks_are_lloyd_max_for_the_normal():
    for bits in (2, 3):
        np.testing.assert_allclose(K.lloyd_max_normal(bits, 400), K.CODEBOOKS[bits], atol=1e-7)
    for bits, book in K.CODEBOOKS.items():          # a fixed point of Lloyd's step
        np.testing.assert_allclose(K.lloyd_max_normal(bits, 1, start=book), book, atol=2e-7)
        z = np.random.default_rng(0).standard_normal(400_000)
        q = book[np.searchsorted(K.MIDPOINTS[bits], z)]
        assert np.mean((z - q) ** 2) == pytest.approx(K.CODEBOOK_DISTORTION[bits], rel=0.02)


def test_calibrated_fp8_scales_freeze_after_n_tokens():
    cache = one_cache("fp8", calibration=6)          # block 4, 2 heads
    x = vectors(20, 32, seed=4, outliers=False).reshape(10, 2, 32)
    stored = cache.layout.field("scale")

    def scales(slots):
        view = cache.data[:, stored.offset: stored.offset + 4 * 2 * 4].view(np.float32)
        return view.reshape(3, 4, 2)[slots // 4, slots % 4]

    cache.write(np.arange(4), x[:4])                  # calibrating: each vector its own scale
    own = np.abs(x).max(-1) / 448
    np.testing.assert_allclose(scales(np.arange(4)), own[:4], rtol=1e-6)
    assert cache.fixed_scale is None and cache.calibrated_tokens == 4
    cache.write(np.arange(4, 8), x[4:8])              # tokens 5, 6 calibrate; 7, 8 are fixed
    fixed = np.abs(x[:6]).max() / 448
    assert cache.fixed_scale == pytest.approx(fixed, rel=1e-6)
    np.testing.assert_allclose(scales(np.arange(4, 6)), own[4:6], rtol=1e-6)
    np.testing.assert_allclose(scales(np.arange(6, 8)), fixed, rtol=1e-6)
    big = np.full((1, 2, 32), 10 * np.abs(x).max(), np.float32)
    cache.write(np.array([8]), big)                   # beyond the calibrated range: saturates
    assert cache.fixed_scale == pytest.approx(fixed, rel=1e-6)
    np.testing.assert_allclose(cache.read(np.array([8])), 448 * cache.fixed_scale, rtol=1e-6)


# -- which layers stay bf16 ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype, setting, layers, promoted", [
    ("bf16", "0", 30, 0), ("fp8", "0", 30, 0), ("nvfp4", "0", 30, 0),
    ("turbo2", "0", 30, 24), ("bf16k_turbo3v", "0", 30, 24),     # max(4, ceil(4L/5))
    ("turbo2", "0", 4, 4), ("turbo2", "0", 2, 2), ("bf16k_turbo3v", "0", 11, 9),
    ("turbo3", "0", 30, 10), ("turbo4", "0", 30, 10), ("turbo8", "0", 16, 6),  # max(2, ceil(L/3))
    ("fp8k_nvfp4v", "0", 30, 10), ("bf16k_fp8v", "0", 4, 2), ("turbo4k_turbo3v", "0", 1, 1),
    ("fp8", "auto", 30, 2), ("turbo3", "auto", 30, 2), ("turbo2", "AUTO", 30, 2),
    ("fp8", "max", 30, 30), ("turbo3", "all", 16, 16), ("nvfp4", "3", 30, 3),
    ("turbo2", "1", 30, 1), ("fp8", "64", 30, 30), ("fp8", 5, 30, 5),
])
def test_high_precision_layers(dtype, setting, layers, promoted):
    assert K.high_precision_layers(setting, dtype, layers) == promoted


@pytest.mark.parametrize("setting", ["two", "-1", "1.5", "", "auto2"])
def test_unparseable_high_precision_layers_warn_and_mean_zero(setting, caplog):
    with caplog.at_level(logging.WARNING, logger="metrale.cache.kv_dtypes"):
        assert K.high_precision_layers(setting, "fp8", 30) == 0
        assert K.high_precision_layers(setting, "turbo3", 30) == 10     # 0: the automatic value
    assert "--kv-high-precision-layers" in caplog.text and repr(setting) in caplog.text


def test_promoted_layers_are_the_first_and_last():
    attention = [3, 7, 11, 15, 19, 23, 27]        # a hybrid model's attention layers
    plan = K.plan_kv_layers("fp8k_nvfp4v", "3", attention)
    assert [i for i, f in plan.items() if f == ("bf16", "bf16")] == [3, 7, 27]   # ceil(3/2) first
    assert all(plan[i] == ("fp8", "nvfp4") for i in (11, 15, 19, 23))
    assert set(K.plan_kv_layers("turbo3", "0", attention).values()) == {("bf16", "bf16"),
                                                                          ("turbo3", "turbo3")}


# -- the pool -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv_dtypes")
    return {arch: load_checkpoint(make_tiny(arch, root / arch, seed=11))
            for arch in ("llama", "qwen3", "qwen3_5", "mistral")}


def engine(ckpt, **overrides) -> EngineCore:
    settings = dict(device="cpu", block_size=4, max_batch_size=4, max_num_seqs=64,
                    max_prefill_tokens=64, max_seq_len=256, ssm_cache_slots=32,
                    ssm_checkpoint_interval=8, request_timeout=0, swap_space_gb=0.0)
    settings.update(overrides)
    return EngineCore(ckpt, EngineConfig(**settings))


@pytest.mark.parametrize("dtype, setting, per_block", [
    # tiny llama: 4 attention layers, 2 kv heads of 16, block 16; bf16 = fp32 on the CPU
    ("bf16", "0", 4 * 2 * 16 * 2 * 16 * 4),                     # 16,384 bytes
    ("fp8", "0", 4 * 2 * 16 * 2 * (16 + 4)),                    # 5,120
    ("nvfp4", "0", 4 * 2 * 16 * 2 * (8 + 1 + 4)),               # 3,328
    ("turbo4", "1", 1 * 4096 + 3 * 2 * 16 * 2 * (8 + 4)),       # 6,400: the first layer bf16
    ("bf16k_turbo3v", "2", 2 * 4096 + 2 * (2048 + 16 * 2 * (6 + 4) + 0)),
])
def test_pool_is_sized_from_the_dtype_bytes(tiny, dtype, setting, per_block):
    core = engine(tiny["llama"], block_size=16, max_seq_len=4096, max_batch_size=8,
                  kv_cache_memory_mb=1, kv_cache_dtype=dtype, kv_high_precision_layers=setting)
    assert core.caches.kv_bytes_per_block == per_block
    assert core.caches.num_blocks == 2 ** 20 // per_block + 1      # + the spare block


def test_log_names_the_dtype_per_layer_group(tiny, caplog):
    with caplog.at_level(logging.INFO, logger="metrale.engine_core"):
        engine(tiny["llama"], block_size=16, kv_cache_dtype="turbo3")
    assert ("KV cache turbo3: K bf16 / V bf16 on layers 0, 3; K turbo3 / V turbo3 on layers 1-2; "
            "592 bytes per token") in caplog.text


def test_head_dims_a_format_cannot_take_are_refused(tiny):
    with pytest.raises(ConfigError, match="nvfp4 needs head_dim divisible by 16.*got 24"):
        engine(tiny["mistral"], kv_cache_dtype="nvfp4")
    with pytest.raises(ConfigError, match="turbo4 needs head_dim a power of two"):
        engine(tiny["mistral"], kv_cache_dtype="turbo4", kv_high_precision_layers="1")
    assert engine(tiny["mistral"], kv_cache_dtype="fp8").caches.kv_bytes_per_block > 0


# -- the CUDA refusal and the flags -------------------------------------------------------------

def test_cuda_runs_fp8_kv_and_refuses_the_dtypes_without_kernels():
    for dtype in ("nvfp4", "turbo3", "bf16k_turbo3v", "fp8k_nvfp4v"):
        with pytest.raises(ConfigError, match=f"kv-cache-dtype {dtype} is not implemented on the "
                                              f"CUDA backend yet"):
            EngineConfig(kv_cache_dtype=dtype).validate().check_backend("cuda")
        EngineConfig(kv_cache_dtype=dtype).validate().check_backend("cpu")
    EngineConfig(kv_cache_dtype="fp8").validate().check_backend("cuda")
    with pytest.raises(ConfigError, match="--fp8-kv-calibration-tokens 64 is not implemented on "
                                          "the CUDA backend"):
        EngineConfig(kv_cache_dtype="fp8", fp8_kv_calibration_tokens=64).validate().check_backend("cuda")
    EngineConfig().validate().check_backend("cuda")
    assert EngineConfig().kv_cache_dtype == "bf16"
    with pytest.raises(ConfigError, match="--kv-cache-dtype must be one of bf16, fp8"):
        EngineConfig(kv_cache_dtype="fp4").validate()
    with pytest.raises(ConfigError, match="--fp8-kv-calibration-tokens"):
        EngineConfig(fp8_kv_calibration_tokens=-1).validate()


def test_serve_flags_reach_the_engine_config():
    from metrale.cli import build_parser, engine_config_of

    args = build_parser().parse_args(["serve", "--kv-cache-dtype", "fp8k_turbo4v",
                                      "--kv-high-precision-layers", "auto",
                                      "--fp8-kv-calibration-tokens", "512"])
    config = EngineConfig(**engine_config_of(args)).validate()
    assert (config.kv_cache_dtype, config.kv_high_precision_layers,
            config.fp8_kv_calibration_tokens) == ("fp8k_turbo4v", "auto", 512)
    defaults = EngineConfig(**engine_config_of(build_parser().parse_args(["serve"])))
    assert (defaults.kv_cache_dtype, defaults.kv_high_precision_layers) == ("bf16", "0")


# -- end to end on tiny checkpoints -------------------------------------------------------------

TINY_ARCHS = ("llama", "qwen3", "qwen3_5")
TOKENS = np.random.default_rng(3).integers(0, VOCAB, 48).tolist()
# max |logits - logits with unquantized KV| / max |those logits| with every attention layer in
# the format, a prompt prefilled in chunks of 8 then 16 tokens decoded. Measured (llama, qwen3,
# qwen3_5 at these seeds): fp8 0.073 0.072 0.080, nvfp4 0.35 0.34 0.49, turbo2 0.70 0.86 0.62,
# turbo3 0.50 0.64 0.52, turbo4 0.36 0.28 0.39, turbo8 0.023 0.027 0.052. Random tiny models
# have sharp, untrained attention (max |logit| ~4, top-2 margins down to 0.003), so these are
# far above what a trained model shows (SmolLM2 below: fp8 0.037); the bounds are ~1.5x the
# worst, and the order of the formats is asserted too.
LOGITS_BOUND = {"fp8": 0.12, "nvfp4": 0.75, "turbo2": 1.3, "turbo3": 0.95, "turbo4": 0.6,
                "turbo8": 0.08}
CHUNKED = [8] * 4 + [1] * 16


def every_layer(spec: CacheSpec, dtype: str) -> CacheSpec:
    """The dtype on every attention layer (no promotion: the op-level error of the dtype)."""
    return spec.with_kv_dtypes({i: K.kv_formats(dtype) for i in spec.attention_layers})


def logits_of(model, spec, chunks, tokens=TOKENS, block_size=8):
    """Logits of every token: `tokens` fed in chunks of the given sizes (fresh caches)."""
    ops = model.ops
    caches = ModelCaches(spec, ops, 12, block_size, 2)
    table, pos, out = list(range(12)), 0, []
    for n in chunks:
        batch = contiguous_batch([tokens[pos:pos + n]], [pos], [table], [1], block_size, True)
        out.append(ops.to_numpy(model.forward(batch, caches)))
        pos += n
    return np.concatenate(out)


@pytest.fixture(scope="module")
def models(tiny):
    return {arch: build_model(tiny[arch], CpuOps()) for arch in TINY_ARCHS}


@pytest.fixture(scope="module")
def references(models):
    return {arch: logits_of(m, m.cache_spec(), CHUNKED) for arch, m in models.items()}


def relative_error(ours, ref) -> float:
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_logits_against_unquantized_kv(models, references, arch):
    model, ref = models[arch], references[arch]
    errs = {}
    for dtype in K.KV_CACHE_DTYPES[1:]:
        ours = logits_of(model, every_layer(model.cache_spec(), dtype), CHUNKED)
        errs[dtype] = relative_error(ours, ref)
        agree = next((i for i, (a, b) in enumerate(zip(ours.argmax(-1), ref.argmax(-1)))
                      if a != b), len(ref))
        print(f"{arch} {dtype}: logits error {errs[dtype]:.3g}, argmax agrees on the first "
              f"{agree}/{len(ref)} positions")
        assert 0 < errs[dtype] <= max(LOGITS_BOUND[f] for f in K.kv_formats(dtype) if f != "bf16")
    e = errs
    assert e["turbo8"] < e["fp8"] < min(e["nvfp4"], e["turbo4"])
    assert max(e["nvfp4"], e["turbo4"]) < e["turbo3"] < e["turbo2"]
    # a precise K never hurts (on qwen3_5, whose k_norm keeps keys tame, V's error dominates)
    assert e["bf16k_turbo3v"] <= e["turbo3"] * 1.001 and e["fp8k_nvfp4v"] <= e["nvfp4"] * 1.001


@pytest.mark.parametrize("dtype", ["fp8", "nvfp4", "turbo3", "turbo8k_turbo4v"])
def test_prefill_then_decode_equals_one_shot(models, dtype):
    """The same quantized cache either way: every read decodes the stored bytes, the new
    tokens' own included, so chunking changes only fp32 rounding (measured up to 1.1e-5 of the
    max logit, where a rounding moved one value across a quantization boundary: thousands of
    times below the dtypes' own error)."""
    for arch, model in models.items():
        spec = every_layer(model.cache_spec(), dtype)
        chunked, one_shot = logits_of(model, spec, CHUNKED), logits_of(model, spec, [len(TOKENS)])
        assert relative_error(one_shot, chunked) <= 1e-4
        np.testing.assert_array_equal(one_shot.argmax(-1), chunked.argmax(-1))


# -- the engine: prefix cache, preemption, speculation move quantized blocks unchanged ----------

def prompt_set(seed=0) -> dict[str, list[int]]:
    """Prompts sharing a 29-token prefix to various depths, and an unrelated one."""
    rng = np.random.default_rng(seed)
    system = rng.integers(1, VOCAB, 29).tolist()
    out = {f"shared{n}": system[:n] + rng.integers(1, VOCAB, 5).tolist() for n in (8, 16, 24)}
    out["system"] = system
    out["system+"] = system + rng.integers(1, VOCAB, 3).tolist()
    out["other"] = rng.integers(1, VOCAB, 17).tolist()
    return out


def run(core: EngineCore, waves, max_tokens=8) -> dict[str, list[int]]:
    """Greedy tokens of every request, each wave submitted once the previous one finished."""
    tokens: dict[str, list[int]] = {}
    for wave in waves:
        for rid, prompt in wave.items():
            core.add_request(Request(rid, list(prompt), SamplingParams(
                max_tokens=max_tokens, temperature=0.0, ignore_eos=True)))
            tokens[rid] = []
        while core.has_unfinished():
            for o in core.step():
                tokens[o.request_id] += o.token_ids
            core.scheduler.check_integrity()
    return tokens


ENGINE_CASES = [("llama", "fp8"), ("llama", "turbo3"), ("qwen3_5", "nvfp4"),
                ("qwen3_5", "bf16k_turbo3v"), ("qwen3", "fp8k_turbo4v")]


@pytest.mark.parametrize("arch, dtype", ENGINE_CASES)
def test_prefix_cache_swap_and_recompute_give_the_same_tokens(tiny, arch, dtype):
    """Each against the same requests one at a time through a plain engine of the same dtype
    (--kv-high-precision-layers 1: the first attention layer bf16, the others quantized)."""
    kv = dict(kv_cache_dtype=dtype, kv_high_precision_layers="1")
    ps = prompt_set()
    expected = run(engine(tiny[arch], **kv), [{k: v} for k, v in ps.items()])
    unquantized = run(engine(tiny[arch]), [{k: v} for k, v in ps.items()])
    print(f"{arch} {dtype}: {sum(a == b for a, b in zip(expected.values(), unquantized.values()))}"
          f"/{len(ps)} requests as with unquantized KV")

    warm = engine(tiny[arch], enable_prefix_caching=True, **kv)
    first = ["system", "other"]
    assert run(warm, [{k: ps[k] for k in first}, {k: v for k, v in ps.items() if k not in first}]) \
        == expected
    assert warm.scheduler.prefix_cache.num_hits >= 2

    swapping = engine(tiny[arch], num_kv_blocks=14, swap_space_gb=1.0, **kv)
    assert run(swapping, [ps]) == expected
    assert swapping.swap.num_swap_outs == swapping.swap.num_swap_ins > 0

    recompute = engine(tiny[arch], num_kv_blocks=14, **kv)
    assert run(recompute, [ps]) == expected
    assert recompute.scheduler.num_preemptions > 0


@pytest.mark.parametrize("arch, dtype", [("llama", "fp8"), ("qwen3_5", "turbo4"), ("qwen3", "nvfp4")])
def test_ngram_speculation_gives_the_same_tokens(tiny, arch, dtype):
    """Draft rows are written through the same write path (and rejected ones overwritten)."""
    kv = dict(kv_cache_dtype=dtype, kv_high_precision_layers="1")
    rng = np.random.default_rng(5)
    loop = rng.integers(1, VOCAB, 6).tolist()
    ps = {"loop": loop * 5, "mixed": rng.integers(1, VOCAB, 9).tolist() + loop * 3}
    plain = run(engine(tiny[arch], **kv), [ps], max_tokens=16)
    core = engine(tiny[arch], ngram_speculative=True, num_drafts=3, **kv)
    assert run(core, [ps], max_tokens=16) == plain
    stats = core.speculation.stats
    print(f"{arch} {dtype}: {stats.num_verifies} verifies, {stats.draft_tokens} drafts, "
          f"{stats.accepted_tokens} kept")
    if arch != "qwen3_5":       # the random hybrid does not loop: its matches rarely come
        assert stats.num_verifies > 0 and stats.draft_tokens > 0


def test_fp8_calibration_through_the_engine(tiny):
    core = engine(tiny["llama"], kv_cache_dtype="fp8", fp8_kv_calibration_tokens=20)
    sides = [s for layer in core.caches.spec.attention_layers for s in core.caches.kv(layer)]
    run(core, [{"a": TOKENS[:12]}], max_tokens=4)            # 15 tokens written: calibrating
    assert all(s.fixed_scale is None and s.calibrated_tokens == 15 for s in sides)
    run(core, [{"b": TOKENS[12:30]}], max_tokens=4)          # crosses 20: scales fixed
    fixed = [s.fixed_scale for s in sides]
    assert all(f is not None and f == pytest.approx(s.calibration_amax / 448, rel=1e-6)
               for f, s in zip(fixed, sides))
    assert len(set(fixed)) == len(fixed)                     # per layer, K and V apart
    run(core, [{"c": TOKENS[30:]}], max_tokens=4)
    assert [s.fixed_scale for s in sides] == fixed           # then kept


# -- the real SmolLM2-135M (the embedded GGUF) ----------------------------------------------------

SMOL_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden screw press into a system that could "
    "produce books far faster than scribes. Within fifty years presses were running in more than "
    "two hundred European cities, and the price of books fell sharply. Scholars argue about how "
    "much the press changed the world: some credit it with the Reformation, the scientific "
    "revolution and mass literacy, while others point out that reading spread slowly and that "
    "manuscripts remained common for a long time. What is certain is that ")
# Greedy agreement over 64 tokens with unquantized KV, the default --kv-high-precision-layers
# (0: the per-dtype automatic value; of 30 attention layers, quantized in brackets). Measured
# (numpy on x86, 2026-12-02): fp8 49 (30), nvfp4 2 (30), turbo2 1 (6), turbo3 1 (20), turbo4 3
# (20), turbo8 32 (20), bf16k_turbo3v 32 (6), bf16k_turbo4v 26 (20), bf16k_fp8v 32 (20),
# bf16k_nvfp4v 47 (20), fp8k_turbo3v 3 (20), fp8k_turbo4v 1 (20), fp8k_nvfp4v 26 (20),
# turbo8k_turbo4v 56 (20), turbo4k_turbo3v 1 (20). Logits error up to the divergence: fp8
# 0.037, turbo8 0.005, the 4-bit formats 0.03-0.09, turbo3 / turbo2 0.14. The unquantized
# continuation has close calls (top-2 margins 0.15, 0.78, 0.26 logit at tokens 1-3, 0.01 at
# tokens 26 and 32): 4-bit and lower K flips the first of them, 8-bit K (fp8, turbo8) and the
# bf16-K pairs pass those and break at the 0.01 ties. The floors sit under the measurements.
SMOL_FLOOR = {"fp8": 32, "turbo8": 26, "bf16k_turbo3v": 26, "bf16k_fp8v": 26,
              "bf16k_nvfp4v": 26, "bf16k_turbo4v": 20, "fp8k_nvfp4v": 20, "turbo8k_turbo4v": 26,
              "nvfp4": 2, "turbo4": 2, "fp8k_turbo3v": 2}
SMOL_NEW = 64
SMOL_BLOCK = 16


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """(model, prompt ids, the unquantized greedy continuation, its caches)."""
    from metrale.tokenizer import Tokenizer
    from tests.assets import smollm2_gguf_path

    ckpt = load_checkpoint(str(smollm2_gguf_path()), cache_dir=str(tmp_path_factory.mktemp("smol")))
    model = build_model(ckpt, CpuOps())
    ids = Tokenizer.from_checkpoint(ckpt).encode(SMOL_TEXT)
    ops, table = model.ops, list(range(16))
    caches = ModelCaches(model.cache_spec(), ops, 16, SMOL_BLOCK, 1)
    logits = ops.to_numpy(model.forward(contiguous_batch([ids], [0], [table], [0], SMOL_BLOCK), caches))
    out = [int(np.argmax(logits[-1]))]
    for pos in range(len(ids), len(ids) + SMOL_NEW - 1):
        batch = contiguous_batch([[out[-1]]], [pos], [table], [0], SMOL_BLOCK)
        out.append(int(np.argmax(ops.to_numpy(model.forward(batch, caches))[-1])))
    return model, ids, out, caches


def forced_logits(model, spec, ids, continuation):
    """Logits at the prompt's last token and at every continuation token but the last, in one
    prefill: the greedy run under `spec` agrees with `continuation` up to the first position
    whose argmax differs (until then it is fed the same tokens)."""
    caches = ModelCaches(spec, model.ops, 16, SMOL_BLOCK, 1)
    batch = contiguous_batch([ids + continuation[:-1]], [0], [list(range(16))], [0], SMOL_BLOCK, True)
    return model.ops.to_numpy(model.forward(batch, caches))[len(ids) - 1:]


@pytest.mark.slow
def test_smollm2_real_kv_error_per_format(smollm2):
    """Relative MSE of SmolLM2's own K (after rope) and V of every layer over the prompt: close
    to the Gaussian figures (module docstring), turbo below its codebook's distortion."""
    model, ids, _, caches = smollm2
    bound = {"fp8": 8e-4, "nvfp4": 1.1e-2, **{f: 1.02 * K.CODEBOOK_DISTORTION[b]
                                               for f, b in K.TURBO_BITS.items()}}
    for fmt in QUANTIZED:
        errs = []
        for layer in model.cache_spec().attention_layers:
            for side, a in enumerate(caches.kv(layer)):
                x = a.reshape(-1, a.shape[-1])[: len(ids) * a.shape[-2]]
                errs.append(K.relative_mse(fmt, x, layer, side))
        k, v = np.mean(errs[0::2]), np.mean(errs[1::2])
        print(f"SmolLM2 {fmt}: relative MSE K {k:.3g}, V {v:.3g}")
        assert k <= bound[fmt] and v <= bound[fmt]


@pytest.mark.slow
def test_smollm2_greedy_agreement_per_dtype(smollm2):
    model, ids, ref, _ = smollm2
    spec = model.cache_spec()
    base = forced_logits(model, spec, ids, ref)
    np.testing.assert_array_equal(base.argmax(-1), ref)     # forced = free-running, unquantized
    margins = np.diff(np.sort(base, -1)[:, -2:], axis=-1)[:, 0]
    for dtype in K.KV_CACHE_DTYPES[1:]:
        plan = K.plan_kv_layers(dtype, "0", spec.attention_layers)
        logits = forced_logits(model, spec.with_kv_dtypes(plan), ids, ref)
        picks = logits.argmax(-1)
        agree = next((i for i in range(SMOL_NEW) if picks[i] != ref[i]), SMOL_NEW)
        err = relative_error(logits[:agree + 1], base[:agree + 1])
        quantized = sum(f != ("bf16", "bf16") for f in plan.values())
        where = f", diverged at a bf16 top-2 margin of {margins[agree]:.2f}" if agree < SMOL_NEW else ""
        print(f"SmolLM2 {dtype} ({quantized}/30 layers quantized): greedy agrees on {agree}/"
              f"{SMOL_NEW} tokens, logits error {err:.3g} up to there{where}")
        assert agree >= SMOL_FLOOR.get(dtype, 1)
