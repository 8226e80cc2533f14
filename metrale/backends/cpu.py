"""The CPU backend: numpy (fp32 math) + numba for the per-token loops. The executable spec of
every op in metrale.backends.base.Ops; the CUDA backend is tested op by op against it.

Storage dtype is fp32 by default (any numpy dtype, e.g. ml_dtypes.bfloat16, is accepted for
storage; all math runs in fp32 and results are cast back to the storage dtype). Index arrays in a
ForwardBatch stay host numpy arrays, so `upload_batch` is the identity.

Quantized weights (metrale.models.quant) stay typed objects in the model; the ops that take
weights (linear, lm_head, embedding, moe) dequantise each to fp32 the first time they see it and
keep that copy (`_dense`): the same memory and per-step cost as a bf16 checkpoint on this
backend, while `linear(x, QuantizedTensor)` stays the op a CUDA kernel is tested against.

Quantized KV (metrale.cache.kv_dtypes): write_kv encodes each new vector into its block
(QuantKvCache.write) and attention decodes the gathered slots of each sequence per op
(QuantKvCache.read), every read of the same quantized bytes, new tokens included.
"""
from __future__ import annotations

import weakref

import numba
import numpy as np

from metrale.backends.base import (Device, Ops, compose_gated_delta_rule_with_gates,
                                   compose_qk_norm_rope_write_kv)
from metrale.cache.kv_dtypes import is_quantized_kv
from metrale.forward import ForwardBatch
from metrale.models.quant import is_quantized

F32 = np.float32
GDN_CHUNK = 64          # chunk length of the WY (chunked) gated delta rule
L2_EPS = 1e-6           # eps of the q/k L2 normalisation inside gated_delta_rule


def _f32(x) -> np.ndarray:
    return np.asarray(x, dtype=F32)


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (F32(1.0) + np.exp(-x))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return F32(1.0) / (F32(1.0) + np.exp(-x))


def _rms(x: np.ndarray, eps: float) -> np.ndarray:
    x = _f32(x)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + F32(eps))


def _l2norm(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + F32(L2_EPS))


def _seq_rows(batch: ForwardBatch, i: int) -> slice:
    qsl = batch.query_start_loc
    return slice(int(qsl[i]), int(qsl[i + 1]))


def _context_len(batch: ForwardBatch, i: int) -> int:
    rows = _seq_rows(batch, i)
    return int(batch.seq_lens[i]) - (rows.stop - rows.start)


def _seq_slots(batch: ForwardBatch, i: int, length: int) -> np.ndarray:
    """Flat KV slots of positions [0, length) of sequence i, through its block table."""
    pos = np.arange(length)
    bs = batch.block_size
    return batch.block_tables[i, pos // bs].astype(np.int64) * bs + pos % bs


# -- numba kernels ----------------------------------------------------------------------------

@numba.njit(cache=True, fastmath=False)
def _recurrent_delta_rule(q, k, v, g, beta, state):
    """Token-by-token gated delta rule of one sequence, state updated in place.
    q, k [L, H, Dk] (normalised, q scaled, k heads already expanded), v [L, H, Dv],
    g, beta [L, H], state [H, Dk, Dv] fp32 -> o [L, H, Dv]."""
    L, H, Dk = k.shape
    Dv = v.shape[2]
    o = np.zeros((L, H, Dv), dtype=np.float32)
    kv_mem = np.empty(Dv, dtype=np.float32)
    for t in range(L):
        for h in range(H):
            decay = np.exp(g[t, h])
            for a in range(Dk):
                for b in range(Dv):
                    state[h, a, b] *= decay
            kv_mem[:] = 0.0
            for a in range(Dk):
                ka = k[t, h, a]
                for b in range(Dv):
                    kv_mem[b] += state[h, a, b] * ka
            for b in range(Dv):
                kv_mem[b] = (v[t, h, b] - kv_mem[b]) * beta[t, h]
            for a in range(Dk):
                ka = k[t, h, a]
                qa = q[t, h, a]
                for b in range(Dv):
                    state[h, a, b] += ka * kv_mem[b]
                    o[t, h, b] += state[h, a, b] * qa
    return o


@numba.njit(cache=True)
def _unit_lower_solve(a, rhs):
    """Solve (I + strictly_lower(a)) x = rhs per head by forward substitution.
    a [H, C, C], rhs [H, C, N] -> x [H, C, N] (fp32)."""
    H, C, N = rhs.shape
    x = rhs.copy()
    for h in range(H):
        for i in range(1, C):
            for j in range(i):
                aij = a[h, i, j]
                if aij != 0.0:
                    for n in range(N):
                        x[h, i, n] -= aij * x[h, j, n]
    return x


# -- gated delta rule, chunked (WY) form ------------------------------------------------------

def _delta_rule_chunk(q, k, v, g, beta, state):
    """One chunk of the WY-form gated delta rule (HF torch_chunk_gated_delta_rule, one chunk).
    q, k [H, C, Dk], v [H, C, Dv], g, beta [H, C], state [H, Dk, Dv]; returns (o [H, C, Dv],
    new state)."""
    C = k.shape[1]
    cum = np.cumsum(g, axis=1)                                   # [H, C] log decay from chunk start
    lower_incl = np.tril(np.ones((C, C), dtype=bool))
    pair = np.where(lower_incl, cum[:, :, None] - cum[:, None, :], -np.inf)
    pair = np.exp(pair).astype(F32)                              # [H, C, C] decay j -> i (i >= j)
    k_beta = k * beta[:, :, None]
    ut = (k_beta @ k.transpose(0, 2, 1)) * pair                  # unit-lower system (diag ignored)
    u = _unit_lower_solve(ut, v * beta[:, :, None])              # new values
    w = _unit_lower_solve(ut, k_beta * np.exp(cum)[:, :, None])  # decayed keys reading the state
    v_new = u - w @ state
    intra = (q @ k.transpose(0, 2, 1)) * pair
    o = (q * np.exp(cum)[:, :, None]) @ state + intra @ v_new
    tail = np.exp(cum[:, -1:] - cum)[:, :, None]                 # decay from token to chunk end
    state = state * np.exp(cum[:, -1])[:, None, None] + (k * tail).transpose(0, 2, 1) @ v_new
    return o, state


def _chunked_delta_rule(q, k, v, g, beta, state):
    """Chunked gated delta rule of one sequence. Same layouts as _recurrent_delta_rule;
    returns (o [L, H, Dv], final state)."""
    q, k, v = (x.transpose(1, 0, 2) for x in (q, k, v))          # [H, L, D]
    g, beta = g.T, beta.T                                        # [H, L]
    L = k.shape[1]
    out = np.empty((v.shape[0], L, v.shape[2]), dtype=F32)
    for s in range(0, L, GDN_CHUNK):
        c = slice(s, min(s + GDN_CHUNK, L))
        out[:, c], state = _delta_rule_chunk(q[:, c], k[:, c], v[:, c], g[:, c], beta[:, c], state)
    return out.transpose(1, 0, 2), state


class CpuOps(Ops):
    """numpy/numba implementation of metrale.backends.base.Ops."""

    name = "cpu"

    def __init__(self, dtype=np.float32):
        self.dtype = np.dtype(dtype)
        self.device = Device()      # the host: no stream, no device memory
        self._dequantised = weakref.WeakKeyDictionary()

    def _dense(self, w):
        """A weight as an array: quantized ones dequantised to fp32 once, then cached."""
        if not is_quantized(w):
            return w
        if w not in self._dequantised:
            self._dequantised[w] = w.dequantize().astype(F32)
        return self._dequantised[w]

    # -- data movement ---------------------------------------------------------------------
    def asarray(self, x, dtype=None):
        if is_quantized(x):
            return x             # stays typed; the weight ops dequantise it (_dense)
        return np.ascontiguousarray(np.asarray(x).astype(dtype or self.dtype, copy=False))

    def to_numpy(self, x):
        return np.asarray(x)

    def empty(self, shape, dtype=None):
        return np.empty(shape, dtype=dtype or self.dtype)

    def zeros(self, shape, dtype=None):
        return np.zeros(shape, dtype=dtype or self.dtype)

    def upload_batch(self, batch: ForwardBatch) -> ForwardBatch:
        return batch

    def _out(self, x):
        return x.astype(self.dtype, copy=False)

    # -- elementwise / norms ---------------------------------------------------------------
    def embedding(self, ids, table):
        return self._dense(table)[np.asarray(ids)]

    def rms_norm(self, x, w, eps, offset):
        return self._out(_rms(x, eps) * (F32(offset) + _f32(w)))

    def add_rms_norm(self, x, residual, w, eps, offset):
        r = x if residual is None else self._out(_f32(x) + _f32(residual))
        return self.rms_norm(r, w, eps, offset), r

    def silu_mul(self, x):
        x = _f32(x)
        half = x.shape[-1] // 2
        return self._out(_silu(x[..., :half]) * x[..., half:])

    def sigmoid_mul(self, x, gate):
        return self._out(_f32(x) * _sigmoid(_f32(gate)))

    # -- matrices --------------------------------------------------------------------------
    def linear(self, x, w, bias=None):
        y = _f32(x) @ _f32(self._dense(w)).T
        if bias is not None:
            y = y + _f32(bias)
        return self._out(y)

    def linear_parts(self, x, w):
        return self.linear(x, w)   # nothing to defer on the CPU

    def lm_head(self, x, w):
        return _f32(x) @ _f32(self._dense(w)).T          # fp32 logits, never rounded to the model dtype

    # -- attention -------------------------------------------------------------------------
    def head_rms_norm(self, x, w, eps, offset):
        return self.rms_norm(x, w, eps, offset)

    def rope(self, q, k, positions, inv_freq, rotary_dim):
        freqs = np.asarray(positions, dtype=F32)[:, None] * _f32(inv_freq)[None, :]
        cos = np.cos(np.concatenate([freqs, freqs], axis=-1))[:, None, :]   # [T, 1, rd]
        sin = np.sin(np.concatenate([freqs, freqs], axis=-1))[:, None, :]
        return self._rope_one(q, cos, sin, rotary_dim), self._rope_one(k, cos, sin, rotary_dim)

    def _rope_one(self, x, cos, sin, rd):
        x = _f32(x).copy()
        rot = x[..., :rd]
        half = rd // 2
        rotated = np.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
        x[..., :rd] = rot * cos + rotated * sin
        return self._out(x)

    def write_kv(self, k, v, k_cache, v_cache, batch):
        slots = np.asarray(batch.slot_mapping, dtype=np.int64)
        keep = slots >= 0        # a negative slot (padding) writes nothing, as on CUDA
        if not keep.all():
            slots, k, v = slots[keep], np.asarray(k)[keep], np.asarray(v)[keep]
        _store_kv(k_cache, slots, k)
        _store_kv(v_cache, slots, v)

    def qk_norm_rope_write_kv(self, q, k, v, q_norm_w, k_norm_w, eps, offset, positions, inv_freq,
                              rotary_dim, k_cache, v_cache, batch):
        return compose_qk_norm_rope_write_kv(self, q, k, v, q_norm_w, k_norm_w, eps, offset, positions,
                                             inv_freq, rotary_dim, k_cache, v_cache, batch)

    def attention(self, q, k_cache, v_cache, batch, scale):
        out = np.empty(q.shape, dtype=F32)
        for i in range(batch.num_seqs):
            rows = _seq_rows(batch, i)
            if rows.stop == rows.start:     # no new tokens (an empty row of a padded step)
                continue
            slots = _seq_slots(batch, i, int(batch.seq_lens[i]))
            out[rows] = _attend(_f32(q[rows]), _load_kv(k_cache, slots), _load_kv(v_cache, slots),
                                _context_len(batch, i), scale)
        return self._out(out)

    # -- Gated DeltaNet --------------------------------------------------------------------
    def causal_conv1d(self, x, weight, conv_state, batch):
        out = np.empty(x.shape, dtype=F32)
        w = _f32(weight)
        km1 = w.shape[1] - 1
        for i in range(batch.num_seqs):
            rows = _seq_rows(batch, i)
            if rows.stop == rows.start:     # no new tokens: nothing to compute or carry (as on CUDA)
                continue
            slot = int(batch.state_slots[i])
            prev = _f32(conv_state[slot]).T if _context_len(batch, i) > 0 else np.zeros((km1, w.shape[0]), F32)
            xs = np.concatenate([prev, _f32(x[rows])], axis=0)            # [K-1+L, C]
            n = rows.stop - rows.start
            acc = sum(xs[j: j + n] * w[:, j] for j in range(w.shape[1]))
            out[rows] = _silu(acc)
            if batch.state_out is not None:     # the window after each new token (verify steps)
                for j, row in enumerate(batch.state_out[rows]):
                    if row >= 0:
                        conv_state[row] = xs[j + 1: j + 1 + km1].T
            conv_state[slot] = xs[xs.shape[0] - km1:].T
        return self._out(out)

    def gdn_gates(self, a, b, A_log, dt_bias):
        g = -np.exp(_f32(A_log)) * np.logaddexp(F32(0), _f32(a) + _f32(dt_bias))
        return g.astype(F32), _sigmoid(_f32(b))

    def gated_delta_rule_with_gates(self, q, k, v, a, b, A_log, dt_bias, ssm_state, batch):
        return compose_gated_delta_rule_with_gates(self, q, k, v, a, b, A_log, dt_bias, ssm_state, batch)

    def gated_delta_rule(self, q, k, v, g, beta, ssm_state, batch):
        hv = v.shape[1]
        rep = hv // k.shape[1]
        q = np.repeat(_l2norm(_f32(q)) * F32(q.shape[-1] ** -0.5), rep, axis=1)
        k = np.repeat(_l2norm(_f32(k)), rep, axis=1)
        v, g, beta = _f32(v), _f32(g), _f32(beta)
        out = np.empty(v.shape, dtype=F32)
        for i in range(batch.num_seqs):
            rows = _seq_rows(batch, i)
            if rows.stop == rows.start:     # no new tokens: the state stays (as on CUDA)
                continue
            slot = int(batch.state_slots[i])
            state = (ssm_state[slot].astype(F32) if _context_len(batch, i) > 0
                     else np.zeros(ssm_state.shape[1:], F32))
            args = (q[rows], k[rows], v[rows], g[rows], beta[rows])
            saves = None if batch.state_out is None else batch.state_out[rows]
            if saves is not None and (saves >= 0).any():
                # a verify window: token by token (the decode step's own form), keeping the
                # state after each token whose row asks for it (rounded as the pool stores it)
                for j, row in enumerate(saves):
                    one = tuple(np.ascontiguousarray(a[j: j + 1]) for a in args)
                    out[rows.start + j] = _recurrent_delta_rule(*one, state)[0]
                    if row >= 0:
                        ssm_state[row] = state
            elif rows.stop - rows.start == 1:
                out[rows] = _recurrent_delta_rule(*(np.ascontiguousarray(a) for a in args), state)
            else:
                out[rows], state = _chunked_delta_rule(*args, state)
            ssm_state[slot] = state
        return self._out(out)

    def gated_rms_norm(self, x, z, w, eps):
        return self._out(_rms(x, eps) * _f32(w) * _silu(_f32(z)))

    # -- mixture of experts ----------------------------------------------------------------
    def moe(self, x, router_w, gate_up, down, top_k, renormalize, shared=False):
        x32 = _f32(x)
        router_w, gate_up, down = self._dense(router_w), self._dense(gate_up), self._dense(down)
        logits = x32 @ _f32(router_w).T
        n_routed = logits.shape[1] - int(bool(shared))
        weights, experts = _route(logits[:, :n_routed], top_k, renormalize)
        if shared:      # expert n_routed: every token, weight sigmoid(its gate logit)
            weights = np.concatenate([weights, _sigmoid(logits[:, n_routed:])], axis=1)
            experts = np.concatenate([experts, np.full((len(x32), 1), n_routed)], axis=1)
        out = np.zeros(x32.shape, dtype=F32)
        for e in np.unique(experts):
            tok, pick = np.nonzero(experts == e)
            h = x32[tok] @ _f32(gate_up[e]).T
            half = h.shape[-1] // 2
            y = (_silu(h[:, :half]) * h[:, half:]) @ _f32(down[e]).T
            np.add.at(out, tok, y * weights[tok, pick][:, None])
        return self._out(out)

    # -- ops of the Gemma 4 / MiniMax M2 families (base.FamilyOps) ---------------------------
    def sliding_attention(self, q, k_cache, v_cache, batch, scale, window):
        out = np.empty(q.shape, dtype=F32)
        for i in range(batch.num_seqs):
            rows = _seq_rows(batch, i)
            if rows.stop == rows.start:
                continue
            context = _context_len(batch, i)
            first = max(0, context - window + 1)      # the oldest key any new token still sees
            slots = _seq_slots(batch, i, int(batch.seq_lens[i]))[first:]
            # through the KV dtype's read path, as attention (quantized caches decode here)
            out[rows] = _attend_window(_f32(q[rows]), _load_kv(k_cache, slots),
                                       _load_kv(v_cache, slots), context, scale, window, first)
        return self._out(out)

    def softcap(self, x, cap):
        return (F32(cap) * np.tanh(_f32(x) / F32(cap))).astype(np.asarray(x).dtype, copy=False)

    def gelu_tanh_mul(self, x, up=None):
        x = _f32(x)
        if up is None:
            half = x.shape[-1] // 2
            x, up = x[..., :half], x[..., half:]
        return self._out(_gelu_tanh(x) * _f32(up))

    def route_topk(self, logits, top_k, scoring, renormalize, bias=None, expert_scale=None):
        logits = _f32(logits)
        if scoring == "softmax":
            scores = np.exp(logits - logits.max(axis=-1, keepdims=True))
            scores /= scores.sum(axis=-1, keepdims=True)
        elif scoring == "sigmoid":
            scores = _sigmoid(logits)
        else:
            raise ValueError(f"unknown router scoring {scoring!r}")
        choice = scores if bias is None else scores + _f32(bias)
        experts = np.argsort(-choice, axis=-1, kind="stable")[:, :top_k]
        weights = np.take_along_axis(scores, experts, axis=-1)
        if renormalize:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        if expert_scale is not None:
            weights = weights * _f32(expert_scale)[experts]
        return weights.astype(F32), experts.astype(np.int32)

    def moe_topk(self, x, weights, experts, gate_up, down, activation="silu"):
        act = {"silu": _silu, "gelu_tanh": _gelu_tanh}[activation]
        x32, weights, experts = _f32(x), _f32(weights), np.asarray(experts)
        gate_up, down = self._dense(gate_up), self._dense(down)
        out = np.zeros(x32.shape, dtype=F32)
        for e in np.unique(experts):
            tok, pick = np.nonzero(experts == e)
            h = x32[tok] @ _f32(gate_up[e]).T
            half = h.shape[-1] // 2
            y = (act(h[:, :half]) * h[:, half:]) @ _f32(down[e]).T
            np.add.at(out, tok, y * weights[tok, pick][:, None])
        return self._out(out)


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU, tanh approximation (torch gelu(approximate="tanh"), HF gelu_pytorch_tanh)."""
    inner = F32(np.sqrt(2.0 / np.pi)) * (x + F32(0.044715) * x * x * x)
    return F32(0.5) * x * (F32(1.0) + np.tanh(inner))


def _attend_window(q, k, v, context_len, scale, window, k_start):
    """_attend with a sliding window: k, v hold positions k_start.. of the sequence; the query
    at position p sees keys in (p - window, p]."""
    lq, hq, d = q.shape
    lk, hk, _ = k.shape
    qg = q.reshape(lq, hk, hq // hk, d)
    scores = np.einsum("qhgd,khd->hgqk", qg, k) * F32(scale)
    q_pos = (context_len + np.arange(lq))[:, None]
    k_pos = (k_start + np.arange(lk))[None, :]
    scores = np.where((k_pos <= q_pos) & (k_pos > q_pos - window), scores, -np.inf)
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs = scores / scores.sum(axis=-1, keepdims=True)
    return np.einsum("hgqk,khd->qhgd", probs, v).reshape(lq, hq, d)


def _store_kv(cache, slots, x) -> None:
    """x [n, Hk, D] into token slots `slots` of one side of a layer's KV."""
    if is_quantized_kv(cache):
        cache.write(slots, _f32(x))
        return
    hk, d = cache.shape[-2:]
    cache.reshape(-1, hk, d)[slots] = x


def _load_kv(cache, slots) -> np.ndarray:
    """fp32 [n, Hk, D] of token slots `slots` of one side of a layer's KV."""
    if is_quantized_kv(cache):
        return cache.read(slots)
    hk, d = cache.shape[-2:]
    return _f32(cache.reshape(-1, hk, d)[slots])


def _attend(q, k, v, context_len, scale):
    """Causal GQA attention of one sequence. q [Lq, Hq, D] (new tokens at positions
    context_len + j), k, v [Lk, Hk, D] (positions 0..Lk-1) -> [Lq, Hq, D]."""
    lq, hq, d = q.shape
    lk, hk, _ = k.shape
    qg = q.reshape(lq, hk, hq // hk, d)
    scores = np.einsum("qhgd,khd->hgqk", qg, k) * F32(scale)       # [Hk, G, Lq, Lk]
    q_pos = context_len + np.arange(lq)
    mask = np.arange(lk)[None, :] <= q_pos[:, None]               # [Lq, Lk]
    scores = np.where(mask, scores, -np.inf)
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs = scores / scores.sum(axis=-1, keepdims=True)
    out = np.einsum("hgqk,khd->qhgd", probs, v)
    return out.reshape(lq, hq, d)


def _route(logits, top_k, renormalize):
    """Softmax router: logits [T, E] -> (weights [T, top_k] fp32, experts [T, top_k] int)."""
    logits = logits - logits.max(axis=-1, keepdims=True)
    probs = np.exp(logits)
    probs /= probs.sum(axis=-1, keepdims=True)
    experts = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(probs, experts, axis=-1)
    if renormalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return weights.astype(F32), experts
