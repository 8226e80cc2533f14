"""Gated DeltaNet ops of the CPU backend against HF's torch reference (fp32).

The chunked (WY) form runs for multi-token runs, the recurrent form for single tokens; both must
agree with HF's torch_chunk_gated_delta_rule / torch_recurrent_gated_delta_rule and with each
other, continuing from (and writing back) the state pool row. Tolerance: max |ours - ref| <=
1e-4 * max |ref| (fp32 rounding of ~130-step recurrences).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from metrale.backends.cpu import CpuOps
from metrale.forward import contiguous_batch

HK, HV, DK, DV = 2, 4, 16, 24
RTOL = 1e-4


def rel_err(ours, ref) -> float:
    return float(np.max(np.abs(np.asarray(ours) - np.asarray(ref))) / np.max(np.abs(ref)))


def random_inputs(rng, length):
    q = rng.standard_normal((length, HK, DK)).astype(np.float32)
    k = rng.standard_normal((length, HK, DK)).astype(np.float32)
    v = rng.standard_normal((length, HV, DV)).astype(np.float32)
    a = rng.standard_normal((length, HV)).astype(np.float32)
    b = rng.standard_normal((length, HV)).astype(np.float32)
    return q, k, v, a, b


def gates(ops, a, b, rng_seed=1):
    rng = np.random.default_rng(rng_seed)
    a_log = np.log(rng.uniform(0.5, 8.0, HV)).astype(np.float32)
    dt_bias = rng.standard_normal(HV).astype(np.float32)
    return ops.gdn_gates(a, b, a_log, dt_bias)


def one_seq_batch(length, context_len, slot):
    blocks = list(range((context_len + length) // 16 + 1))
    return contiguous_batch([[0] * length], [context_len], [blocks], [slot], block_size=16)


def hf_delta_rule(q, k, v, g, beta, init, chunked=True):
    rep = HV // HK
    t = [torch.from_numpy(x)[None] for x in (q, k, v, g, beta)]
    t[0] = t[0].repeat_interleave(rep, dim=2)
    t[1] = t[1].repeat_interleave(rep, dim=2)
    fn = hf.torch_chunk_gated_delta_rule if chunked else hf.torch_recurrent_gated_delta_rule
    o, s = fn(*t, initial_state=None if init is None else torch.from_numpy(init)[None],
              output_final_state=True, use_qk_l2norm_in_kernel=True)
    return o[0].numpy(), s[0].numpy()


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("length", [1, 63, 64, 65, 130])
def test_delta_rule_matches_hf(length, with_state):
    ops = CpuOps()
    rng = np.random.default_rng(length)
    q, k, v, a, b = random_inputs(rng, length)
    g, beta = gates(ops, a, b)
    init = rng.standard_normal((HV, DK, DV)).astype(np.float32) if with_state else None
    pool = rng.standard_normal((3, HV, DK, DV)).astype(np.float32)  # garbage in every row
    if with_state:
        pool[2] = init
    out = ops.gated_delta_rule(q, k, v, g, beta, pool, one_seq_batch(length, 5 if with_state else 0, 2))
    ref_o, ref_s = hf_delta_rule(q, k, v, g, beta, init, chunked=length > 1)
    assert rel_err(out, ref_o) <= RTOL
    assert rel_err(pool[2], ref_s) <= RTOL


@pytest.mark.parametrize("length", [63, 64, 65, 130])
def test_chunked_equals_token_by_token(length):
    ops = CpuOps()
    rng = np.random.default_rng(100 + length)
    q, k, v, a, b = random_inputs(rng, length)
    g, beta = gates(ops, a, b)
    init = rng.standard_normal((HV, DK, DV)).astype(np.float32)
    chunked_pool = np.stack([init, init])
    stepped_pool = np.stack([init, init])
    chunked = ops.gated_delta_rule(q, k, v, g, beta, chunked_pool, one_seq_batch(length, 3, 1))
    stepped = [ops.gated_delta_rule(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1],
                                    stepped_pool, one_seq_batch(1, 3 + t, 1)) for t in range(length)]
    assert rel_err(chunked, np.concatenate(stepped)) <= RTOL
    assert rel_err(chunked_pool[1], stepped_pool[1]) <= RTOL
    assert np.array_equal(chunked_pool[0], init)  # other rows untouched


def test_batched_sequences_keep_their_own_state():
    """Three sequences in one call (decode, continuing run, fresh run) == each alone."""
    ops = CpuOps()
    rng = np.random.default_rng(7)
    lens, ctx, slots = [1, 70, 9], [12, 40, 0], [3, 0, 1]
    inputs = [random_inputs(rng, n) for n in lens]
    pool = rng.standard_normal((4, HV, DK, DV)).astype(np.float32)
    alone_pool = pool.copy()
    cat = [np.concatenate(x) for x in zip(*inputs)]
    g, beta = gates(ops, cat[3], cat[4])
    blocks = [[9, 2, 5, 7, 1], [3, 8, 0, 4, 6, 11, 10], [12]]
    batch = contiguous_batch([[0] * n for n in lens], ctx, blocks, slots, block_size=16)
    together = ops.gated_delta_rule(cat[0], cat[1], cat[2], g, beta, pool, batch)
    start = 0
    for n, c, s in zip(lens, ctx, slots):
        rows = slice(start, start + n)
        alone = ops.gated_delta_rule(cat[0][rows], cat[1][rows], cat[2][rows], g[rows], beta[rows],
                                     alone_pool, one_seq_batch(n, c, s))
        assert rel_err(together[rows], alone) <= 1e-6
        start += n
    np.testing.assert_allclose(pool, alone_pool, rtol=1e-6, atol=1e-6)


def test_gdn_gates_match_hf():
    ops = CpuOps()
    rng = np.random.default_rng(3)
    a = (rng.standard_normal((20, HV)) * 10).astype(np.float32)
    b = rng.standard_normal((20, HV)).astype(np.float32)
    a_log = rng.standard_normal(HV).astype(np.float32)
    dt_bias = rng.standard_normal(HV).astype(np.float32)
    g, beta = ops.gdn_gates(a, b, a_log, dt_bias)
    ta = torch.from_numpy(a)
    ref_g = -torch.from_numpy(a_log).exp() * torch.nn.functional.softplus(ta + torch.from_numpy(dt_bias))
    assert rel_err(g, ref_g.numpy()) <= 1e-6
    assert rel_err(beta, torch.from_numpy(b).sigmoid().numpy()) <= 1e-6


@pytest.mark.parametrize("length", [1, 2, 3, 9])
def test_causal_conv1d_matches_hf_and_carries_state(length):
    """Whole run through HF causal_conv1d_fn == our conv split into a prefix and `length` tokens
    continuing from the state (which holds the last K-1 pre-activation inputs)."""
    ops = CpuOps()
    rng = np.random.default_rng(length)
    channels, kernel, prefix = 12, 4, 5
    x = rng.standard_normal((prefix + length, channels)).astype(np.float32)
    w = rng.standard_normal((channels, kernel)).astype(np.float32)
    ref = hf.causal_conv1d_fn(torch.from_numpy(x.T.copy())[None], torch.from_numpy(w),
                              activation="silu")[0].numpy().T
    state = rng.standard_normal((2, channels, kernel - 1)).astype(np.float32)  # garbage: fresh start
    first = ops.causal_conv1d(x[:prefix], w, state, one_seq_batch(prefix, 0, 1))
    second = ops.causal_conv1d(x[prefix:], w, state, one_seq_batch(length, prefix, 1))
    assert rel_err(np.concatenate([first, second]), ref) <= 1e-6
    np.testing.assert_array_equal(state[1], x[-(kernel - 1):].T)


@pytest.mark.parametrize("context_len", [0, 9])
def test_verify_window_keeps_the_state_after_every_token(context_len):
    """`batch.state_out` (a speculative verify step): the state after new token j lands in row
    state_out[j] and equals what j + 1 single-token decode steps leave; the outputs and the
    working row are the decode steps' too (exactly: the same token-by-token form)."""
    ops = CpuOps()
    rng = np.random.default_rng(7 + context_len)
    L, C = 5, 12
    q, k, v, a, b = random_inputs(rng, L)
    g, beta = gates(ops, a, b)
    x = rng.standard_normal((L, C)).astype(np.float32)
    w = rng.standard_normal((C, 4)).astype(np.float32)
    ssm0 = rng.standard_normal((HV, DK, DV)).astype(np.float32)
    conv0 = rng.standard_normal((C, 3)).astype(np.float32)

    def pools():
        ssm = rng.standard_normal((12, HV, DK, DV)).astype(np.float32)   # garbage rows
        conv = rng.standard_normal((12, C, 3)).astype(np.float32)
        ssm[1], conv[1] = ssm0, conv0
        return ssm, conv

    ssm, conv = pools()      # reference: one token per step, snapshot after each
    ref_o, ref_x, ref_ssm, ref_conv = [], [], [], []
    for j in range(L):
        batch = one_seq_batch(1, context_len + j, 1)
        ref_x.append(ops.causal_conv1d(x[j: j + 1], w, conv, batch))
        ref_o.append(ops.gated_delta_rule(q[j: j + 1], k[j: j + 1], v[j: j + 1], g[j: j + 1],
                                          beta[j: j + 1], ssm, batch))
        ref_ssm.append(ssm[1].copy())
        ref_conv.append(conv[1].copy())

    ssm, conv = pools()
    batch = one_seq_batch(L, context_len, 1)
    batch.state_out = np.array([4, -1, 6, 7, 8], np.int32)
    out_x = ops.causal_conv1d(x, w, conv, batch)
    out_o = ops.gated_delta_rule(q, k, v, g, beta, ssm, batch)
    np.testing.assert_array_equal(out_o, np.concatenate(ref_o))
    np.testing.assert_allclose(out_x, np.concatenate(ref_x), rtol=1e-6, atol=1e-6)
    for j, row in enumerate(batch.state_out):
        if row >= 0:
            np.testing.assert_array_equal(ssm[row], ref_ssm[j])
            np.testing.assert_array_equal(conv[row], ref_conv[j])
    np.testing.assert_array_equal(ssm[1], ref_ssm[-1])
    np.testing.assert_array_equal(conv[1], ref_conv[-1])
    assert not np.array_equal(ssm[5], ref_ssm[1])     # row -1: nothing written
