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


# -- Mamba-2 selective scan (SSD) ---------------------------------------------------------------

@numba.njit(cache=True, fastmath=False)
def _ssd_recurrent(x, delta, decay, B, C, state):
    """Token-by-token Mamba-2 scan of one sequence, state updated in place (mamba_ssm's
    selective_state_update). x [L, H, P], delta, decay [L, H] (decay = delta * A), B, C
    [L, H, N] (groups already expanded to heads), state [H, P, N] fp32 -> y [L, H, P] (no D)."""
    L, H, P = x.shape
    N = B.shape[2]
    y = np.zeros((L, H, P), dtype=np.float32)
    for t in range(L):
        for h in range(H):
            da = np.exp(decay[t, h])
            for p in range(P):
                xdt = x[t, h, p] * delta[t, h]
                acc = np.float32(0.0)
                for n in range(N):
                    s = state[h, p, n] * da + xdt * B[t, h, n]
                    state[h, p, n] = s
                    acc += s * C[t, h, n]
                y[t, h, p] = acc
    return y


def _ssd_chunk(x, delta, decay, B, C, state):
    """One chunk of the SSD scan (HF torch_chunk_scan / mamba_ssm ssd_combined, one chunk):
    the intra-chunk part as masked attention C_i . B_j * exp(sum decay[j+1..i]) over x_j delta_j,
    the carried-in state read through C with the decay from the chunk start, and the state
    carried out. Decay sums in fp64 (exact segment sums; HF's segsum is the stable fp32 form
    of the same). Layouts as _ssd_recurrent; returns (y [L, H, P], new state)."""
    # head-major contiguous copies: numpy's batched matmul over strided views is ~50x slower
    xdt, B, C = (np.ascontiguousarray(a.transpose(1, 0, 2)) for a in (x * delta[:, :, None], B, C))
    cum = np.cumsum(decay.astype(np.float64), axis=0).T                # [H, L]
    L = cum.shape[1]
    seg = np.where(np.tril(np.ones((L, L), dtype=bool)), cum[:, :, None] - cum[:, None, :], -np.inf)
    y = ((C @ B.transpose(0, 2, 1)) * np.exp(seg).astype(F32)) @ xdt   # [H, L, P] within the chunk
    y += (C @ state.transpose(0, 2, 1)) * np.exp(cum).astype(F32)[:, :, None]
    tail = np.exp(cum[:, -1:] - cum).astype(F32)                       # decay token -> chunk end
    state = state * np.exp(cum[:, -1]).astype(F32)[:, None, None] + (xdt * tail[:, :, None]).transpose(0, 2, 1) @ B
    return y.transpose(1, 0, 2), state


def _ssd_chunked(x, delta, decay, B, C, state, chunk_size: int):
    """The chunked SSD scan of one sequence over chunks of `chunk_size` tokens; returns
    (y [L, H, P], final state)."""
    L = x.shape[0]
    y = np.empty(x.shape, dtype=F32)
    for s in range(0, L, chunk_size):
        c = slice(s, min(s + chunk_size, L))
        y[c], state = _ssd_chunk(x[c], delta[c], decay[c], B[c], C[c], state)
    return y, state.astype(F32)


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
        return self._conv1d(x, weight, None, conv_state, batch)

    def _conv1d(self, x, weight, bias, conv_state, batch):
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
            out[rows] = _silu(acc if bias is None else acc + _f32(bias))
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

    # -- ops of the Nemotron-H family (base.Mamba2Ops) ----------------------------------------
    def causal_conv1d_bias(self, x, weight, bias, conv_state, batch):
        return self._conv1d(x, weight, bias, conv_state, batch)

    def ssd_scan(self, x, dt, B, C, A_log, D, dt_bias, dt_limit, ssm_state, batch, chunk_size):
        rep = x.shape[1] // B.shape[1]
        x32 = _f32(x)
        B, C = (np.repeat(_f32(m), rep, axis=1) for m in (B, C))          # groups -> heads
        delta = np.clip(np.logaddexp(F32(0), _f32(dt) + _f32(dt_bias)), dt_limit[0], dt_limit[1]).astype(F32)
        decay = delta * -np.exp(_f32(A_log))                               # log decay per step [T, H]
        out = np.empty(x32.shape, dtype=F32)
        for i in range(batch.num_seqs):
            rows = _seq_rows(batch, i)
            if rows.stop == rows.start:     # no new tokens: the state stays
                continue
            slot = int(batch.state_slots[i])
            state = (ssm_state[slot].astype(F32) if _context_len(batch, i) > 0
                     else np.zeros(ssm_state.shape[1:], F32))
            args = tuple(np.ascontiguousarray(a[rows]) for a in (x32, delta, decay, B, C))
            saves = None if batch.state_out is None else batch.state_out[rows]
            if saves is not None and (saves >= 0).any():
                # a verify window: token by token (the decode step's form), keeping the state
                # after each token whose row asks for it
                for j, row in enumerate(saves):
                    out[rows.start + j] = _ssd_recurrent(*(a[j: j + 1] for a in args), state)[0]
                    if row >= 0:
                        ssm_state[row] = state
            elif rows.stop - rows.start == 1:
                out[rows] = _ssd_recurrent(*args, state)
            else:
                out[rows], state = _ssd_chunked(*args, state, chunk_size)
            ssm_state[slot] = state
        return self._out(out + x32 * _f32(D)[:, None])

    def group_rms_norm_gated(self, x, z, w, eps, group_size):
        y = _f32(x) * _silu(_f32(z))
        grouped = _rms(y.reshape(*y.shape[:-1], -1, group_size), eps).reshape(y.shape)
        return self._out(grouped * _f32(w))

    def relu2(self, x):
        r = np.maximum(_f32(x), F32(0))
        return self._out(r * r)

    def moe_topk_relu2(self, x, weights, experts, up, down):
        x32, weights, experts = _f32(x), _f32(weights), np.asarray(experts)
        up, down = self._dense(up), self._dense(down)
        out = np.zeros(x32.shape, dtype=F32)
        for e in np.unique(experts):
            tok, pick = np.nonzero(experts == e)
            h = np.maximum(x32[tok] @ _f32(up[e]).T, F32(0))
            np.add.at(out, tok, ((h * h) @ _f32(down[e]).T) * weights[tok, pick][:, None])
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

    def attn_temperature(self, q, positions, beta, length):
        pos = np.asarray(positions).astype(F32)
        scale = F32(1.0) + F32(beta) * np.log1p(np.floor(pos / F32(length)))
        return self._out(_f32(q) * scale[:, None, None])

    def softcap(self, x, cap):
        return (F32(cap) * np.tanh(_f32(x) / F32(cap))).astype(np.asarray(x).dtype, copy=False)

    def gelu_tanh_mul(self, x, up=None):
        x = _f32(x)
        if up is None:
            half = x.shape[-1] // 2
            x, up = x[..., :half], x[..., half:]
        return self._out(_gelu_tanh(x) * _f32(up))

    def route_topk(self, logits, top_k, scoring, renormalize, bias=None, expert_scale=None,
                   groups=None, scale=1.0):
        logits = _f32(logits)
        if scoring == "softmax":
            scores = np.exp(logits - logits.max(axis=-1, keepdims=True))
            scores /= scores.sum(axis=-1, keepdims=True)
        elif scoring == "sigmoid":
            scores = _sigmoid(logits)
        else:
            raise ValueError(f"unknown router scoring {scoring!r}")
        choice = scores if bias is None else scores + _f32(bias)
        if groups is not None:
            choice = _limit_to_groups(choice, *groups)
        experts = np.argsort(-choice, axis=-1, kind="stable")[:, :top_k]
        weights = np.take_along_axis(scores, experts, axis=-1)
        if renormalize:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        if expert_scale is not None:
            weights = weights * _f32(expert_scale)[experts]
        if scale != 1.0:
            weights = weights * F32(scale)
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

    # -- ops of multi-head latent attention (base.MlaOps) ------------------------------------
    def mla_prologue(self, q, kv, kv_norm_w, eps, positions, inv_freq, attention_factor, latent_cache, batch):
        rope_dim = 2 * int(np.asarray(inv_freq).shape[0])
        rank = kv.shape[-1] - rope_dim
        q, kv = _f32(q).copy(), _f32(kv)
        q_pe, k_pe = self.rope(q[..., -rope_dim:], kv[:, None, rank:], positions, inv_freq, rope_dim)
        q[..., -rope_dim:] = _f32(q_pe) * F32(attention_factor)
        rows = np.concatenate([self.rms_norm(kv[:, :rank], kv_norm_w, eps, 0.0),
                               self._out(_f32(k_pe[:, 0]) * F32(attention_factor))], axis=-1)
        slots = np.asarray(batch.slot_mapping, dtype=np.int64)
        keep = slots >= 0
        latent_cache.reshape(-1, latent_cache.shape[-1])[slots[keep]] = rows[keep]
        return self._out(q)

    def latent_attention(self, q_latent, q_pe, latent_cache, batch, scale):
        rank = q_latent.shape[-1]
        out = np.zeros(q_latent.shape, dtype=F32)
        rows_of = latent_cache.reshape(-1, latent_cache.shape[-1])
        for i in range(batch.num_seqs):
            rows = _seq_rows(batch, i)
            if rows.stop == rows.start:
                continue
            lat = _f32(rows_of[_seq_slots(batch, i, int(batch.seq_lens[i]))])
            scores = (np.einsum("qhr,kr->hqk", _f32(q_latent[rows]), lat[:, :rank])
                      + np.einsum("qhp,kp->hqk", _f32(q_pe[rows]), lat[:, rank:])) * F32(scale)
            probs = _causal_softmax(scores, _context_len(batch, i))
            out[rows] = np.einsum("hqk,kr->qhr", probs, lat[:, :rank])
        return self._out(out)

    def gather_latents(self, latent_cache, batch):
        rows_of = latent_cache.reshape(-1, latent_cache.shape[-1])
        slots = [_seq_slots(batch, i, int(batch.seq_lens[i])) for i in range(batch.num_seqs)]
        return rows_of[np.concatenate(slots) if slots else np.zeros(0, np.int64)]

    def mla_expanded_attention(self, q, kv, k_pe, batch, scale):
        rope_dim = k_pe.shape[-1]
        nope = q.shape[-1] - rope_dim
        out = np.zeros(q.shape[:2] + (kv.shape[-1] - nope,), dtype=F32)
        start = 0
        for i in range(batch.num_seqs):
            rows, length = _seq_rows(batch, i), int(batch.seq_lens[i])
            keys = slice(start, start + length)
            start += length
            if rows.stop == rows.start:
                continue
            qi, kvi = _f32(q[rows]), _f32(kv[keys])
            scores = (np.einsum("qhn,khn->hqk", qi[..., :nope], kvi[..., :nope])
                      + np.einsum("qhp,kp->hqk", qi[..., nope:], _f32(k_pe[keys]))) * F32(scale)
            probs = _causal_softmax(scores, _context_len(batch, i))
            out[rows] = np.einsum("hqk,khv->qhv", probs, kvi[..., nope:])
        return self._out(out)

    def head_linear(self, x, w):
        return self._out(np.einsum("thi,hoi->tho", _f32(x), _f32(self._dense(w))))


def _causal_softmax(scores: np.ndarray, context_len: int) -> np.ndarray:
    """Softmax over the last axis of scores [..., Lq, Lk] where query j sits at position
    context_len + j and key k at position k (later keys masked)."""
    lq, lk = scores.shape[-2:]
    mask = np.arange(lk)[None, :] <= (context_len + np.arange(lq))[:, None]
    scores = np.where(mask, scores, -np.inf)
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return scores / scores.sum(axis=-1, keepdims=True)


def _limit_to_groups(choice: np.ndarray, n_group: int, topk_group: int) -> np.ndarray:
    """choice [T, E] with every expert outside the topk_group best of n_group contiguous groups
    (each scored by the sum of its two best choices) set to -inf."""
    t, e = choice.shape
    grouped = choice.reshape(t, n_group, e // n_group)
    group_scores = -np.sort(-grouped, axis=-1)[..., :2].sum(axis=-1)            # [T, n_group]
    keep = np.argsort(-group_scores, axis=-1, kind="stable")[:, :topk_group]
    mask = np.zeros((t, n_group), dtype=bool)
    np.put_along_axis(mask, keep, True, axis=-1)
    return np.where(np.repeat(mask, e // n_group, axis=-1), choice, -np.inf).astype(F32)


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
