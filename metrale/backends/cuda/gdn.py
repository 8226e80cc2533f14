"""The Gated DeltaNet ops of the CUDA backend (semantics: metrale.backends.base.Ops).

CudaOps (ops.py) binds these functions as its methods; each takes the CudaOps instance first
(its kernel cache) and otherwise the base.Ops signature. Kernels live in kernels_cuda/gdn_conv.cu
and gdn_delta.cu; each file's header states its layouts, bytes and FLOPs. Every launch has a shape fixed by the array shapes alone (no device->host reads), so
the decode path can be captured in a CUDA graph.

Activations may be bf16 (ml_dtypes.bfloat16 cupy arrays) or fp32: the kernel suffix follows the
array's item size. Small per-channel weights (conv kernel, A_log, dt_bias, norm weight) are used
as fp32 copies made once per weight array.

A speculative verify step (`batch.state_out` given) runs the delta rule token by token through
the recurrent kernels, the decode step's own form and gate computation, so each verified token's
output and saved state are a decode step's (bit for bit with an fp32 pool); the kernels store
the state after each token t with state_out[t] >= 0 into that pool row (the conv its window).
"""
from __future__ import annotations

import numpy as np

from metrale.backends.cuda.kernels import declare

try:
    import cupy as cp
except ImportError:     # the declarations below are read without CuPy (tests/test_kernel_declarations.py)
    cp = None

GDN_CHUNK = 64                   # must match CH in gdn_delta.cu
CONV_SEG = 64                    # tokens per thread segment in gdn_conv.cu
GDN_HEAD_DIMS = {(16, 16), (32, 32), (64, 64), (128, 128), (64, 128), (128, 64)}
SMEM_LIMIT = 232448              # H100/H200 max dynamic shared memory per block

_f32_cache: dict[int, tuple[object, object]] = {}

# kernels_cuda/gdn_conv.cu and gdn_delta.cu ({} = bf16 | f32 activations; {*} = the state-pool
# suffix of _state_kernel_suffix; {}x{} = the head dims of GDN_HEAD_DIMS)
declare("gdn_conv", "gdn_conv4_{*}", "const T* x, long long sx, const float* w, S* state, T* out, const int* qsl, "
        "const int* seq_lens, const int* slots, const int* state_out, int B, int C, int seg")
declare("gdn_conv", "gated_rms_norm_{}", "const T* x, const T* z, long long zs, int zh, const float* w, T* out, "
        "int rows, int D, float eps")
declare("gdn_delta", "gdn_recurrent_{}x{}_{*}", "const T* q, const T* k, const T* v, long long sq, long long sk, "
        "long long sv, const float* g, const float* beta, S* state, T* o, const int* qsl, const int* seq_lens, "
        "const int* slots, const int* state_out, int Hk, int Hv")
declare("gdn_delta", "gdn_chunked_{}x{}_{*}", "const T* q, const T* k, const T* v, long long sq, long long sk, "
        "long long sv, const float* g, const float* beta, S* state, T* o, const int* qsl, const int* seq_lens, "
        "const int* slots, int Hk, int Hv")
declare("gdn_delta", "gdn_recurrent_gates_{}x{}_{*}", "const T* q, const T* k, const T* v, long long sq, "
        "long long sk, long long sv, const T* ga, const T* gb, long long sa, long long sb, const float* A_log, "
        "const float* dt_bias, S* state, T* o, const int* qsl, const int* seq_lens, const int* slots, "
        "const int* state_out, int Hk, int Hv")
declare("gdn_delta", "gdn_gates_{}", "const T* a, const T* b, long long sa, long long sb, const float* A_log, "
        "const float* dt_bias, float* g, float* beta, int T_, int Hv")


# -- kernel loading ---------------------------------------------------------------------------

def _kernel(ops, file: str, name: str, smem: int = 0):
    """Kernel `name` of kernels_cuda/`file`, through CudaOps.kernel (compiled once, cached; it
    raises the dynamic shared-memory limit to `smem`)."""
    return ops.kernel(file[:-3] if file.endswith(".cu") else file, name, smem)


def _empty(ops, shape, dtype):
    """Output buffer; CudaOps NaN-fills new outputs when METRALE_CUDA_POISON=1 (tests)."""
    return ops._new(shape, dtype)


def _sfx(a) -> str:
    return "bf16" if a.dtype.itemsize == 2 else "f32"


def _dev(a):
    return a if isinstance(a, cp.ndarray) else cp.asarray(a)


def _i32(a):
    a = _dev(a)
    return a if a.dtype == cp.int32 else a.astype(cp.int32)


def _f32(w):
    """fp32 view/copy of a small weight, made once per weight array."""
    if w.dtype == cp.float32 and w.flags.c_contiguous:
        return w
    hit = _f32_cache.get(id(w))
    if hit is not None and hit[0] is w:
        return hit[1]
    w32 = cp.ascontiguousarray(w.astype(cp.float32))
    _f32_cache[id(w)] = (w, w32)
    return w32


def _token_stride(x, inner: tuple[int, ...]):
    """(array, token stride in elements) with everything but dim 0 contiguous."""
    isz = x.dtype.itemsize
    want = isz
    ok = True
    for dim, stride in zip(reversed(inner), reversed(x.strides[1:])):
        if dim > 1 and stride != want:
            ok = False
        want *= dim
    if not ok or x.strides[0] % isz or x.strides[0] < want:
        x = cp.ascontiguousarray(x)
    return x, np.int64(x.strides[0] // isz if x.shape[0] > 1 else int(np.prod(inner)))


def _state_kernel_suffix(x, ssm_state) -> str:
    """The delta-rule kernels' suffix for activations `x` and the state pool's dtype: fp32
    pools with either activation dtype, 16-bit pools (--ssm-h-dtype f16-pool / bf16-pool) with
    bf16 activations (the CUDA engine's)."""
    if ssm_state.dtype == cp.float32:
        return _sfx(x)
    name = "sf16" if ssm_state.dtype == np.float16 else ("sbf16" if ssm_state.dtype.name == "bfloat16" else None)
    if name is None or _sfx(x) != "bf16":
        raise ValueError(f"ssm_state {ssm_state.dtype} with {x.dtype} activations is not built (fp32 state "
                         "with either, or an f16 / bf16 state with bf16 activations)")
    return f"bf16_{name}"


def _batch_arrays(batch):
    return (_i32(batch.query_start_loc), _i32(batch.seq_lens), _i32(batch.state_slots))


def _state_out(batch, T: int):
    """batch.state_out as int32 [T] on the device, or None (NULL: no saves; every step but a
    speculative verify)."""
    if batch.state_out is None:
        return None
    if batch.state_out.shape != (T,):
        raise ValueError(f"state_out must be int32 [{T}] (one pool row or -1 per new token), "
                         f"got shape {batch.state_out.shape}")
    return _i32(batch.state_out)


# -- Gated DeltaNet ---------------------------------------------------------------------------

def causal_conv1d(ops, x, weight, conv_state, batch):
    """Depthwise causal conv (K = 4) + SiLU over each sequence's new tokens, continuing from and
    updating conv_state[state_slots[i]] (zeros when the sequence starts fresh); with
    batch.state_out, also the window after each token t into conv_state[state_out[t]] (>= 0)."""
    T, C = x.shape
    K = weight.shape[-1]
    if K != 4:
        raise ValueError(f"causal_conv1d: kernel size {K} is not supported (the CUDA kernel is "
                         "built for K = 4, Qwen3.5's linear_conv_kernel_dim)")
    if conv_state.shape[1:] != (C, K - 1) or not conv_state.flags.c_contiguous:
        raise ValueError(f"conv_state must be a contiguous [slots, {C}, {K - 1}] array, "
                         f"got {conv_state.shape}")
    out = _empty(ops, (T, C), x.dtype)
    B = batch.num_seqs
    if T == 0 or B == 0:
        return out
    x, sx = _token_stride(x, (C,))
    # the cache is keyed by the weight array itself: a reshaped view is a new object every call,
    # which missed the cache (a captured bf16 -> fp32 copy per GDN layer per step) and kept
    # every miss alive in the cache
    w = _f32(weight).reshape(C, K)
    sfx = f"{_sfx(x)}_{_sfx(conv_state)}"
    if sfx == "f32_bf16":
        raise ValueError("causal_conv1d: fp32 activations with a bf16 conv state are not built")
    qsl, seq_lens, slots = _batch_arrays(batch)
    grid = ((C + 127) // 128, T // CONV_SEG + B)
    _kernel(ops, "gdn_conv.cu", f"gdn_conv4_{sfx}")(
        grid, (128,), x=x, sx=sx, w=w, state=conv_state, out=out, qsl=qsl, seq_lens=seq_lens, slots=slots,
        state_out=_state_out(batch, T), B=B, C=C, seg=CONV_SEG)
    return out


def gdn_gates(ops, a, b, A_log, dt_bias):
    """g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b); fp32 [T, Hv]."""
    T, Hv = a.shape
    g = _empty(ops, (T, Hv), cp.float32)
    beta = _empty(ops, (T, Hv), cp.float32)
    if T == 0:
        return g, beta
    if a.dtype != b.dtype:
        b = b.astype(a.dtype)
    a, sa = _token_stride(a, (Hv,))
    b, sb = _token_stride(b, (Hv,))
    n = T * Hv
    _kernel(ops, "gdn_delta.cu", f"gdn_gates_{_sfx(a)}")(
        ((n + 255) // 256,), (256,),
        a=a, b=b, sa=sa, sb=sb, A_log=_f32(A_log), dt_bias=_f32(dt_bias), g=g, beta=beta, T_=T, Hv=Hv)
    return g, beta


def chunk_smem_bytes(dk: int, dv: int) -> int:
    """Dynamic shared memory of the chunked kernel (ChunkSmem in gdn_delta.cu)."""
    c = GDN_CHUNK
    return 4 * (dk * dv + 3 * c * (dk + 1) + c * (dv + 1) + c * (c + 1) + 2 * c)


def _check_delta_rule(q, v, ssm_state) -> None:
    _, Hk, Dk = q.shape
    _, Hv, Dv = v.shape
    if (Dk, Dv) not in GDN_HEAD_DIMS:
        raise ValueError(f"gated_delta_rule: head dims (k {Dk}, v {Dv}) are not built; "
                         f"supported: {sorted(GDN_HEAD_DIMS)} (add a GDN_INST line in gdn_delta.cu)")
    if Hv % Hk:
        raise ValueError(f"gated_delta_rule: {Hv} value heads are not a multiple of {Hk} key heads")
    if not ssm_state.flags.c_contiguous or ssm_state.shape[1:] != (Hv, Dk, Dv):
        raise ValueError(f"ssm_state must be contiguous [slots, {Hv}, {Dk}, {Dv}], got "
                         f"{ssm_state.dtype} {ssm_state.shape}")


def _qkv_operands(q, k, v):
    """(q, k, v, sq, sk, sv): k and v in q's dtype, each with its token stride (heads
    contiguous: column slices of the input projection are read in place)."""
    _, Hk, Dk = q.shape
    _, Hv, Dv = v.shape
    k = k if k.dtype == q.dtype else k.astype(q.dtype)
    v = v if v.dtype == q.dtype else v.astype(q.dtype)
    q, sq = _token_stride(q, (Hk, Dk))
    k, sk = _token_stride(k, (Hk, Dk))
    v, sv = _token_stride(v, (Hv, Dv))
    return q, k, v, sq, sk, sv


def _recurrent_block(Dk: int, Dv: int) -> tuple[int]:
    return (min(256, Dk * Dv // 4),)    # RecShape<DK, DV>::NT in gdn_delta.cu


def gated_delta_rule(ops, q, k, v, g, beta, ssm_state, batch):
    """The gated delta rule per sequence from/into ssm_state[state_slots[i]] (fp32, or a
    16-bit pool): the recurrent kernel when every sequence adds one token (decode) or in a
    verify step (batch.state_out: token by token, saving the state after each token t into
    ssm_state[state_out[t]] where >= 0), the chunked one otherwise."""
    T, Hk, Dk = q.shape
    _, Hv, Dv = v.shape
    _check_delta_rule(q, v, ssm_state)
    sfx = _state_kernel_suffix(q, ssm_state)
    o = _empty(ops, (T, Hv, Dv), q.dtype)
    B = batch.num_seqs
    if T == 0 or B == 0:
        return o
    g = cp.ascontiguousarray(g, dtype=cp.float32)
    beta = cp.ascontiguousarray(beta, dtype=cp.float32)
    q, k, v, sq, sk, sv = _qkv_operands(q, k, v)
    qsl, seq_lens, slots = _batch_arrays(batch)
    saves = _state_out(batch, T)
    if T == B or saves is not None:   # decode (one token per sequence), or a verify step
        fn = _kernel(ops, "gdn_delta.cu", f"gdn_recurrent_{Dk}x{Dv}_{sfx}")
        fn((Hv, B), _recurrent_block(Dk, Dv), q=q, k=k, v=v, sq=sq, sk=sk, sv=sv, g=g, beta=beta,
           state=ssm_state, o=o, qsl=qsl, seq_lens=seq_lens, slots=slots, state_out=saves, Hk=Hk, Hv=Hv)
    else:
        smem = chunk_smem_bytes(Dk, Dv)
        if smem > SMEM_LIMIT:
            raise ValueError(f"gated_delta_rule: {smem} B of shared memory needed")
        fn = _kernel(ops, "gdn_delta.cu", f"gdn_chunked_{Dk}x{Dv}_{sfx}", smem)
        fn((Hv, B), (256,), q=q, k=k, v=v, sq=sq, sk=sk, sv=sv, g=g, beta=beta, state=ssm_state, o=o,
           qsl=qsl, seq_lens=seq_lens, slots=slots, Hk=Hk, Hv=Hv, shared_mem=smem)
    return o


def gated_delta_rule_with_gates(ops, q, k, v, a, b, A_log, dt_bias, ssm_state, batch):
    """gdn_gates + gated_delta_rule; a decode step (one token per sequence) and a verify step
    (batch.state_out, any window lengths) run both in one launch (gdn_recurrent_gates_*: the
    gates computed inside, bit-identical; so a verified token is computed exactly as its decode
    step would be), anything else the two kernels."""
    from metrale.backends.base import compose_gated_delta_rule_with_gates

    T, Hk, Dk = q.shape
    _, Hv, Dv = v.shape
    B = batch.num_seqs
    one_launch = T == B or batch.state_out is not None
    if not (one_launch and T > 0 and a.dtype == b.dtype == q.dtype and a.shape == b.shape == (T, Hv)):
        return compose_gated_delta_rule_with_gates(ops, q, k, v, a, b, A_log, dt_bias, ssm_state, batch)
    _check_delta_rule(q, v, ssm_state)
    o = _empty(ops, (T, Hv, Dv), q.dtype)
    q, k, v, sq, sk, sv = _qkv_operands(q, k, v)
    a, sa = _token_stride(a, (Hv,))
    b, sb = _token_stride(b, (Hv,))
    qsl, seq_lens, slots = _batch_arrays(batch)
    fn = _kernel(ops, "gdn_delta.cu", f"gdn_recurrent_gates_{Dk}x{Dv}_{_state_kernel_suffix(q, ssm_state)}")
    fn((Hv, B), _recurrent_block(Dk, Dv),
       q=q, k=k, v=v, sq=sq, sk=sk, sv=sv, ga=a, gb=b, sa=sa, sb=sb, A_log=_f32(A_log), dt_bias=_f32(dt_bias),
       state=ssm_state, o=o, qsl=qsl, seq_lens=seq_lens, slots=slots, state_out=_state_out(batch, T), Hk=Hk,
       Hv=Hv)
    return o


def recurrent_gated_delta_rule(ops, q, k, v, g, beta, ssm_state, batch):
    """The recurrent kernel for any batch (token by token; honours batch.state_out); for tests
    and tiny batches."""
    T, Hk, Dk = q.shape
    _, Hv, Dv = v.shape
    o = _empty(ops, (T, Hv, Dv), q.dtype)
    q, k, v, sq, sk, sv = _qkv_operands(q, k, v)
    qsl, seq_lens, slots = _batch_arrays(batch)
    fn = _kernel(ops, "gdn_delta.cu", f"gdn_recurrent_{Dk}x{Dv}_{_state_kernel_suffix(q, ssm_state)}")
    fn((Hv, batch.num_seqs), _recurrent_block(Dk, Dv),
       q=q, k=k, v=v, sq=sq, sk=sk, sv=sv, g=cp.ascontiguousarray(g, dtype=cp.float32),
       beta=cp.ascontiguousarray(beta, dtype=cp.float32), state=ssm_state, o=o, qsl=qsl, seq_lens=seq_lens,
       slots=slots, state_out=_state_out(batch, T), Hk=Hk, Hv=Hv)
    return o


def gated_rms_norm(ops, x, z, w, eps):
    """rms_norm(x) * w * silu(z) over the last dim (w not zero-centred)."""
    D = x.shape[-1]
    x = cp.ascontiguousarray(x)
    if z.dtype != x.dtype:
        z = z.astype(x.dtype)
    out = _empty(ops, x.shape, x.dtype)
    rows = x.size // D if D else 0
    if rows == 0:
        return out
    isz = z.dtype.itemsize
    if (z.ndim == 3 and z.shape == x.shape and z.strides[2] == isz and z.strides[1] == D * isz
            and z.strides[0] % isz == 0 and z.shape[0] > 0):
        # [T, H, D] with only the token stride free (z is a column slice of the GDN input
        # projection): read in place instead of copying it out each step
        zs, zh = z.strides[0] // isz, z.shape[1]
    else:
        z, zs, zh = cp.ascontiguousarray(z), D, 1
    _kernel(ops, "gdn_conv.cu", f"gated_rms_norm_{_sfx(x)}")(
        ((rows + 7) // 8,), (256,), x=x, z=z, zs=zs, zh=zh, w=_f32(w), out=out, rows=rows, D=D, eps=eps)
    return out
