"""fp8 KV on the CUDA backend (kernels_cuda/kv_quant.cu writes, attention.cu's `_fp8` kernels
read) against the CPU spec of metrale/cache/kv_dtypes.py.

- The write kernel's bytes equal the spec's quantisation of the same (bf16) vectors bit for bit,
  padding tokens skipped, every other byte of the pool untouched.
- The fp8 attention kernels equal the bf16 kernels run over a cache holding bf16(dequantised)
  bit for bit at fixed decode partitions (the fp8 kernels dequantise into exactly that tile),
  and the CPU spec's attention over the quantized cache within bf16 tolerance; bytes outside the
  sequences are NaN, so any read past a sequence's end poisons the output.
- A tiny model served with --kv-cache-dtype fp8: teacher-forced logits within the bf16 bound
  plus what fp8 KV alone costs on the CPU spec; greedy decoding (graphs) agrees with bf16 KV
  until a near-tie.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from metrale.backends.cpu import CpuOps
from metrale.cache.kv_dtypes import block_layout, dequantize, make_kv_side, quantize
from tests.test_cuda_ops import BF16, check, cpu, f32, ops, paged_batch, rnd, seq_slots  # noqa: F401 (fixtures)

pytestmark = pytest.mark.gpu


def _side(ops, nb, bs, hk, d, fill=0xFF):
    """A device fp8 side [nb, block bytes] filled with `fill` (0xFF: e4m3 NaN values, NaN scales)."""
    side = make_kv_side("fp8", ops, 0, 0, nb, bs, hk, d)
    side.data[...] = fill
    return side


def _host_bytes(side):
    return np.asarray(side.data.get())


def _spec_side(nb, bs, hk, d, data):
    """The CPU spec's QuantKvCache over a copy of `data`."""
    side = make_kv_side("fp8", CpuOps(np.float32), 0, 0, nb, bs, hk, d)
    side.data[...] = data
    return side


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("hk", [1, 2, 4])
def test_write_kernel_equals_the_spec_bit_for_bit(ops, d, hk):
    rng = np.random.default_rng(d + hk)
    bs = 16
    batch, nb = paged_batch(rng, [5, 0, 31], [3, 20, 1], bs)
    batch.slot_mapping[1] = -1                      # a padding token: skipped
    t = batch.num_tokens
    kv = rnd(rng, (t, 2 * hk * d + 64), BF16, 3.0)  # k, v as strided views of one projection
    kv[2, : hk * d] = 0                             # an all-zero K vector: scale 0, values 0
    kv[3, hk * d: hk * d + d] *= 500                # a large V vector (values up to +-448)
    dkv = ops.asarray(kv)
    k, v = dkv[:, : hk * d].reshape(t, hk, d), dkv[:, hk * d: 2 * hk * d].reshape(t, hk, d)
    kc, vc = _side(ops, nb, bs, hk, d, 0xAA), _side(ops, nb, bs, hk, d, 0xAA)
    ops.write_kv(k, v, kc, vc, ops.upload_batch(batch))
    valid = batch.slot_mapping >= 0
    for side, x in ((kc, kv[:, : hk * d]), (vc, kv[:, hk * d: 2 * hk * d])):
        ref = _spec_side(nb, bs, hk, d, np.full(_host_bytes(side).shape, 0xAA, np.uint8))
        ref.write(batch.slot_mapping[valid].astype(np.int64), f32(x).reshape(t, hk, d)[valid])
        np.testing.assert_array_equal(_host_bytes(side), ref.data)


def _fill(rng, batch, nb, bs, hk, d):
    """fp8 K and V byte pools (host) holding the spec's quantisation of random vectors in every
    sequence's slots and 0xFF (NaN) elsewhere, and the bf16 caches of their dequantised values
    (NaN elsewhere)."""
    lay = block_layout("fp8", bs, hk, d)
    pools, plains = [], []
    for _ in range(2):
        side = _spec_side(nb, bs, hk, d, np.full((nb, lay.nbytes), 0xFF, np.uint8))
        plain = np.full((nb * bs, hk, d), np.nan, np.float32)
        for i in range(batch.num_seqs):
            s = seq_slots(batch, i)
            x = f32(rnd(rng, (len(s), hk, d), BF16, 2.0))
            side.write(s, x)
            fields = quantize("fp8", x.reshape(-1, d))
            plain[s] = f32(dequantize("fp8", fields).astype(ml_dtypes.bfloat16)).reshape(len(s), hk, d)
        pools.append(side)
        plains.append(plain.reshape(nb, bs, hk, d))
    return pools, plains


def _run(ops, cpu, ctx_lens, q_lens, hq, hk, d, bs, part_tokens, seed):
    rng = np.random.default_rng(seed)
    batch, nb = paged_batch(rng, ctx_lens, q_lens, bs)
    (ks, vs), (kp, vp) = _fill(rng, batch, nb, bs, hk, d)
    q = f32(rnd(rng, (batch.num_tokens, hq, d), BF16))
    scale = d ** -0.5
    kd, vd = _side(ops, nb, bs, hk, d), _side(ops, nb, bs, hk, d)
    kd.data[...] = ops.cp.asarray(ks.data)
    vd.data[...] = ops.cp.asarray(vs.data)
    old = ops.part_tokens
    ops.part_tokens = part_tokens
    try:
        dev = ops.upload_batch(batch)
        fp8 = ops.to_numpy(ops.attention(ops.asarray(q), kd, vd, dev, scale))
        plain = ops.to_numpy(ops.attention(ops.asarray(q), ops.asarray(kp), ops.asarray(vp), dev, scale))
    finally:
        ops.part_tokens = old
    what = f"ctx={ctx_lens} q={q_lens} hq={hq} hk={hk} d={d} bs={bs} part={part_tokens}"
    np.testing.assert_array_equal(f32(fp8), f32(plain), err_msg=what)
    check(fp8, cpu.attention(q, ks, vs, batch, scale), BF16, f"fp8 attention vs the spec {what}")


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("hq,hk", [(4, 4), (24, 4), (9, 3), (40, 2)])
def test_decode_reads_fp8_as_bf16_reads_the_dequantised_cache(ops, cpu, d, hq, hk):
    ctx = [0, 1, 15, 16, 511, 512, 1500, 4100]
    for part in (64, 512, 100000):
        _run(ops, cpu, ctx, [1] * len(ctx), hq, hk, d, 16, part, seed=d + hq + part)


@pytest.mark.parametrize("bs", [1, 8, 32])
def test_decode_fp8_block_sizes(ops, cpu, bs):
    _run(ops, cpu, [3, 70, 333, 1025], [1] * 4, 24, 4, 256, bs, 128, seed=bs)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("hq,hk", [(4, 4), (24, 4), (9, 3), (32, 1)])
def test_prefill_reads_fp8_as_bf16_reads_the_dequantised_cache(ops, cpu, d, hq, hk):
    # fresh prompts, chunks continuing a context (prefix-cache hits read the same way), single
    # tokens in a mixed batch, lengths around the row and key tiles
    _run(ops, cpu, [0, 0, 37, 300, 0, 5, 64, 0], [1, 200, 64, 33, 17, 1, 65, 129], hq, hk, d, 16,
         None, seed=100 + d + hq)
    _run(ops, cpu, [0, 1531, 3], [1500, 300, 1], hq, hk, d, 32, None, seed=200 + d + hq)


# -- a model served with fp8 KV -----------------------------------------------------------------

def test_tiny_model_with_fp8_kv(tmp_path):
    from metrale.llm import LLM
    from metrale.sampling import SamplingParams
    from tests.test_gpu_models import _hf, _hf_logits, _make, _our_logits

    path = _make("qwen3_5", tmp_path)
    rng = np.random.default_rng(0)
    ids = [int(t) for t in rng.integers(1, 300, 150)]
    ref = _hf_logits(_hf(path, "float32"), ids)
    hf16 = _hf_logits(_hf(path), ids)

    def rel(x):
        return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))

    kw = dict(max_seq_len=512, max_batch_size=4)
    fp8 = LLM(path, device="cuda", kv_cache_dtype="fp8", **kw)
    bf16 = LLM(path, device="cuda", **kw)
    spec = LLM(path, device="cpu", kv_cache_dtype="fp8", **kw)
    err_fp8, err_bf16 = rel(_our_logits(fp8, ids)), rel(_our_logits(bf16, ids))
    err_spec, err_hf = rel(_our_logits(spec, ids)), rel(hf16)
    print(f"fp8 KV: rel err vs HF fp32 {err_fp8:.2e} (bf16 KV {err_bf16:.2e}, CPU spec fp8 KV "
          f"{err_spec:.2e}, HF bf16 {err_hf:.2e})")
    assert err_fp8 <= 2 * err_hf + err_spec + 5e-3

    prompt = ids[:40]
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    a = fp8.generate(prompt, params)[0].token_ids
    b = bf16.generate(prompt, params)[0].token_ids
    diverge = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    print(f"fp8 vs bf16 KV greedy: {'64/64 identical' if diverge is None else f'diverge at {diverge}'}")
    if diverge is not None:
        seq = prompt + b[:diverge]
        lb, lf = _our_logits(bf16, seq)[-1], _our_logits(fp8, seq)[-1]
        top2 = np.sort(lb)[-2:]
        assert top2[1] - top2[0] <= np.abs(lf - lb).max()
