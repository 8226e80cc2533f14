"""The ops interface every backend implements; models are written once against it.

Arrays are the backend's own (numpy on the CPU backend, cupy on CUDA). Shapes use T = tokens in
the step, B = sequences, H = hidden size. Weights keep the HF layout ([out, in] for linears)
unless the model's load step fuses them (e.g. gate|up stacked into one [2I, H] matrix).
2-D inputs may be row-strided views (column slices of a fused projection's output); an op whose
kernel needs contiguous rows makes them contiguous itself.
All reductions (norms, softmax, attention, GDN state) accumulate in fp32 whatever the storage
dtype. The CPU backend (metrale.backends.cpu) is the executable spec; the CUDA backend is tested
op by op against it.

`Ops` is the base class both backends subclass: besides the ops it names the backend's `device`
(a `Device`: its stream, synchronisation, memory figures and out-of-memory error) and builds what
only some devices have (a device sampler, captured graphs: `device_sampler`, `capture_graphs`),
so the engine core drives every backend through the same calls.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

from metrale.forward import ForwardBatch

Array = Any
log = logging.getLogger("metrale.engine_core")


class HostStream:
    """The stream of a device without streams: entering it, using it, syncing it do nothing."""

    def use(self) -> "HostStream":
        return self

    def synchronize(self) -> None:
        pass

    def __enter__(self) -> "HostStream":
        return self

    def __exit__(self, *exc) -> bool:
        return False


class Device:
    """What the engine asks of the device its backend runs on; this base is the host (the CPU
    backend): no stream of its own, nothing to wait for, no device memory to size against.
    metrale.backends.cuda.device.CudaDevice is the GPU's."""

    accelerator = False     # a GPU: the engine warms it up by default, sampling runs on it
    # the error an allocation on the device raises when it is full (caught as a tuple)
    out_of_memory: tuple[type[BaseException], ...] = ()

    def new_stream(self):
        """A stream for the engine's work (graphs cannot be captured on a legacy default stream):
        a context manager with use() and synchronize()."""
        return HostStream()

    def synchronize(self) -> None:
        """Wait for everything queued on the device."""

    def memory_info(self) -> tuple[int, int] | None:
        """(free, total) bytes of device memory; None where there is none to size against."""
        return None

    def pool_bytes(self) -> int:
        """Bytes the backend's allocator holds from the device (its activation pool)."""
        return 0

    def memory_figures(self) -> dict:
        """What the device holds for this process (/v1/library): empty on the host."""
        return {}

    def free_cached(self, pools=()) -> None:
        """Hand cached device blocks back (the allocator's and the given graph pools'), after a
        model's arrays are collected."""


@dataclass
class EngineGraphs:
    """Captured forwards the runner replays (metrale.backends.cuda.graphs): decode steps, other
    steps by token bucket (--prefill-graphs), speculative verify steps; None = run eagerly."""
    decode: Any = None
    step: Any = None
    verify: Any = None

    def pools(self) -> list:
        """The graphs' private memory pools (handed back when the model is released)."""
        return [g.pool for g in (self.decode, self.step, self.verify)
                if g is not None and getattr(g, "pool", None) is not None]


class Ops:
    name: str = ""     # "cpu" | "cuda"
    dtype: Any         # storage / activation dtype (np.float32 on cpu, bfloat16 on cuda)
    device: Device     # the device the arrays live on

    # -- the device and what only some devices have ------------------------------------------
    def device_sampler(self, vocab_size: int, max_batch: int, num_slots: int, seed: int):
        """A sampler that runs on the device (metrale.backends.cuda.sampling.GpuSampler), or
        None: the runner samples on the host (metrale.sampling.Sampler)."""
        return None

    def capture_graphs(self, model, caches, config, spare_block: int, spare_slot: int,
                       speculation=None) -> EngineGraphs:
        """The forwards this backend replays as captured graphs (logged); none by default."""
        if config.prefill_graphs == "on":     # the default: not news on the CPU
            log.debug("--prefill-graphs: CUDA graphs need the CUDA backend; ignored on %s", self.name)
        return EngineGraphs()

    def close(self) -> None:
        """Release what the backend holds outside its arrays (library handles)."""

    # -- data movement -------------------------------------------------------------------------
    def asarray(self, x, dtype=None) -> Array:
        """Host numpy array -> backend array (weights are converted to `self.dtype` unless
        `dtype` says otherwise)."""

    def to_numpy(self, x: Array):
        """Backend array -> host numpy array (a sync point on GPU)."""

    def empty(self, shape, dtype=None) -> Array: ...

    def zeros(self, shape, dtype=None) -> Array: ...

    def upload_batch(self, batch: ForwardBatch) -> ForwardBatch:
        """The same batch with its index arrays on the device."""

    # -- elementwise / norms -------------------------------------------------------------------
    def embedding(self, ids: Array, table: Array) -> Array:
        """table[ids]: [T] int32, [V, H] -> [T, H]."""

    def rms_norm(self, x: Array, w: Array, eps: float, offset: float) -> Array:
        """x * rsqrt(mean(x^2) + eps) * (offset + w) over the last dim. offset = 1.0 is the
        zero-centred RMSNorm of Qwen3.5, 0.0 the plain one (Llama, Qwen3)."""

    def add_rms_norm(self, x: Array, residual: Array, w: Array, eps: float, offset: float):
        """r = x + residual; returns (rms_norm(r), r). `residual` may be None (first layer):
        then r = x."""

    def silu_mul(self, x: Array) -> Array:
        """[T, 2I] laid out as [gate | up] -> silu(gate) * up, [T, I]."""

    def sigmoid_mul(self, x: Array, gate: Array) -> Array:
        """x * sigmoid(gate); gate is x's shape or [T, 1] (broadcast along the last dim)."""

    # -- matrices ------------------------------------------------------------------------------
    def linear(self, x: Array, w: Array, bias: Array | None = None) -> Array:
        """x @ w.T (+ bias): [T, in] x [out, in] -> [T, out], fp32 accumulation."""

    def lm_head(self, x: Array, w: Array) -> Array:
        """The logits: x @ w.T -> fp32 [T, V] whatever x's dtype (fp32 accumulation, no rounding
        to bf16 on the way out: bf16 logits tie exactly between two tokens often enough that a
        greedy answer then depended on the rest of the batch; ties left break to the lowest id)."""

    def linear_parts(self, x: Array, w: Array):
        """x @ w.T where the result goes straight into add_rms_norm (as its x): a backend may
        return it in a form only add_rms_norm reads (CudaOps: fp32 partials of a k-split GEMM);
        otherwise it is linear(x, w)."""

    # -- attention -----------------------------------------------------------------------------
    def head_rms_norm(self, x: Array, w: Array, eps: float, offset: float) -> Array:
        """RMSNorm of each head vector: x [T, heads, D], w [D]."""

    def rope(self, q: Array, k: Array, positions: Array, inv_freq: Array, rotary_dim: int):
        """Rotary embedding (rotate-half / NeoX layout) on the first `rotary_dim` dims of every
        head, in place or returned as (q, k): q [T, Hq, D], k [T, Hk, D], inv_freq
        [rotary_dim // 2] fp32 (already scaled by whatever rope scaling the model uses)."""

    def write_kv(self, k: Array, v: Array, k_cache: Array, v_cache: Array, batch: ForwardBatch):
        """k_cache.reshape(-1, Hk, D)[batch.slot_mapping] = k (same for v)."""

    def qk_norm_rope_write_kv(self, q: Array, k: Array, v: Array, q_norm_w: Array | None,
                              k_norm_w: Array | None, eps: float, offset: float, positions: Array,
                              inv_freq: Array, rotary_dim: int, k_cache: Array, v_cache: Array,
                              batch: ForwardBatch) -> Array:
        """The attention prologue: head_rms_norm of q and k (each only when its weight is given;
        None = no norm, as Llama), rope on the first `rotary_dim` dims, write_kv of the roped k
        and the raw v at batch.slot_mapping (negative slot = skipped). q [T, Hq, D], k, v
        [T, Hk, D] may be strided views of one projection; returns the new q [T, Hq, D].
        Backends without a fused kernel use `compose_qk_norm_rope_write_kv` (the definition)."""
        return compose_qk_norm_rope_write_kv(self, q, k, v, q_norm_w, k_norm_w, eps, offset, positions,
                                             inv_freq, rotary_dim, k_cache, v_cache, batch)

    def attention(self, q: Array, k_cache: Array, v_cache: Array, batch: ForwardBatch,
                  scale: float) -> Array:
        """Causal GQA attention of each new token over its sequence's paged KV (the context
        plus the new tokens, already written with write_kv): q [T, Hq, D] -> [T, Hq, D]."""

    # -- Gated DeltaNet ------------------------------------------------------------------------
    def causal_conv1d(self, x: Array, weight: Array, conv_state: Array,
                      batch: ForwardBatch) -> Array:
        """Depthwise causal conv (kernel K) + SiLU over each sequence's new tokens, continuing
        from conv_state[state_slots[i]] (the last K-1 inputs; zeros when the sequence starts
        fresh), which is updated in place. x [T, C], weight [C, K] -> [T, C]."""

    def gdn_gates(self, a: Array, b: Array, A_log: Array, dt_bias: Array):
        """g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b); all fp32 [T, Hv]."""

    def gated_delta_rule(self, q: Array, k: Array, v: Array, g: Array, beta: Array,
                         ssm_state: Array, batch: ForwardBatch) -> Array:
        """The gated delta rule per sequence, continuing from ssm_state[state_slots[i]]
        (zeros when the sequence starts fresh), updated in place. q, k [T, Hk, Dk] are
        L2-normalised inside (eps 1e-6) and q scaled by Dk^-0.5; k heads are repeated to the
        Hv value heads (head h uses k head h // (Hv // Hk)). v [T, Hv, Dv] -> o [T, Hv, Dv].
        Multi-token runs use the chunked (WY) form, single tokens the recurrent form."""

    def gated_delta_rule_with_gates(self, q: Array, k: Array, v: Array, a: Array, b: Array,
                                    A_log: Array, dt_bias: Array, ssm_state: Array,
                                    batch: ForwardBatch) -> Array:
        """gdn_gates(a, b, A_log, dt_bias) then gated_delta_rule with them, as one op (a, b
        [T, Hv] may be column slices of the input projection). Backends without a fused kernel
        use `compose_gated_delta_rule_with_gates` (the definition)."""
        return compose_gated_delta_rule_with_gates(self, q, k, v, a, b, A_log, dt_bias, ssm_state, batch)

    def gated_rms_norm(self, x: Array, z: Array, w: Array, eps: float) -> Array:
        """rms_norm(x) * w * silu(z) over the last dim (w not zero-centred)."""

    # -- mixture of experts --------------------------------------------------------------------
    def moe(self, x: Array, router_w: Array, gate_up: Array, down: Array, top_k: int,
            renormalize: bool, shared: bool = False) -> Array:
        """softmax router over experts, top-k (renormalised), sum of weighted expert MLPs:
        router_w [E, H], gate_up [E, 2I, H] ([gate | up]), down [E, H, I]; x [T, H] -> [T, H].
        `shared`: the last of the E + 1 experts (router_w, gate_up, down all have E + 1 rows) is
        a shared expert every token also takes, with weight sigmoid(x . router_w[E]) (Qwen's
        shared_expert_gate), outside the softmax and the renormalisation."""


def compose_qk_norm_rope_write_kv(ops, q, k, v, q_norm_w, k_norm_w, eps, offset, positions, inv_freq,
                                  rotary_dim, k_cache, v_cache, batch):
    """Ops.qk_norm_rope_write_kv from the unfused ops (head_rms_norm, rope, write_kv): the
    reference semantics, and the fallback of backends without (or outside) a fused kernel."""
    if q_norm_w is not None:
        q = ops.head_rms_norm(q, q_norm_w, eps, offset)
    if k_norm_w is not None:
        k = ops.head_rms_norm(k, k_norm_w, eps, offset)
    q, k = ops.rope(q, k, positions, inv_freq, rotary_dim)
    ops.write_kv(k, v, k_cache, v_cache, batch)
    return q


def compose_gated_delta_rule_with_gates(ops, q, k, v, a, b, A_log, dt_bias, ssm_state, batch):
    """Ops.gated_delta_rule_with_gates from gdn_gates and gated_delta_rule: the reference
    semantics, and the fallback outside a fused kernel."""
    g, beta = ops.gdn_gates(a, b, A_log, dt_bias)
    return ops.gated_delta_rule(q, k, v, g, beta, ssm_state, batch)


class FamilyOps(Protocol):
    """Ops the Gemma 4, MiniMax M2 and Mistral families add (metrale.models.gemma4 /
    minimax_m2 / llama: Mistral's sliding window, Ministral 3's attention temperature). A
    backend without one of them cannot serve a model whose config needs it: the model's builder
    refuses it at load (`missing_ops`), naming the feature, never serving it wrong."""

    def sliding_attention(self, q: Array, k_cache: Array, v_cache: Array, batch: ForwardBatch,
                          scale: float, window: int) -> Array:
        """`attention` with a sliding window: the new token at position p attends to the keys at
        positions (p - window, p] of its sequence's paged KV. The blocks outside the window stay
        in the cache (prefix caching and chunked prefill see the same blocks); only the mask
        changes."""

    def attn_temperature(self, q: Array, positions: Array, beta: float, length: float) -> Array:
        """Llama-4 attention temperature scaling (Ministral 3): q [T, Hq, D] times
        1 + beta * ln(1 + floor(positions[t] / length)) per token, in fp32; q's dtype out."""

    def softcap(self, x: Array, cap: float) -> Array:
        """cap * tanh(x / cap), in fp32 (logit soft-capping); x's dtype out."""

    def gelu_tanh_mul(self, x: Array, up: Array | None = None) -> Array:
        """gelu_tanh(gate) * up (GELU, tanh approximation: HF gelu_pytorch_tanh): x [T, 2I] laid
        out as [gate | up] -> [T, I], or, with `up` given, gelu_tanh(x) * up of two [T, N]."""

    def route_topk(self, logits: Array, top_k: int, scoring: str, renormalize: bool,
                   bias: Array | None = None, expert_scale: Array | None = None,
                   groups: tuple[int, int] | None = None, scale: float = 1.0):
        """An MoE router's choice from its logits [T, E] (fp32): scores = softmax(logits) or
        sigmoid(logits) (`scoring` "softmax" | "sigmoid"); the top_k experts by scores + bias
        (`bias` [E], the score-correction bias of sigmoid routers, used for the choice only);
        weights = their scores, divided by their sum when `renormalize`, then multiplied by
        expert_scale[expert] when given ([E], Gemma 4's per_expert_scale) and by `scale`
        (DeepSeek's routed_scaling_factor). `groups` = (n_group, topk_group): DeepSeek V3's
        group-limited choice: the E experts split into n_group contiguous groups, each scored
        by the sum of its two best scores + bias, and the top_k taken only from the topk_group
        best groups. Returns (weights [T, top_k] fp32, experts [T, top_k] int32)."""

    def moe_topk(self, x: Array, weights: Array, experts: Array, gate_up: Array, down: Array,
                 activation: str = "silu") -> Array:
        """sum_j weights[t, j] * expert_{experts[t, j]}(x[t]) with each expert a gated MLP
        down(act(gate(x)) * up(x)), act "silu" | "gelu_tanh": gate_up [E, 2I, H] ([gate | up]),
        down [E, H, I]; x [T, H] -> [T, H]."""


class MlaOps(Protocol):
    """Ops of multi-head latent attention (metrale.models.deepseek_v3). Per head h:
    q = [q_nope (Dn) | q_pe (Dr)], the key [W_UK[h] c (Dn) | k_pe (Dr)], the value W_UV[h] c (Dv),
    where c [R] (the normalised compressed latent) and k_pe [Dr] (one roped key shared by every
    head) are what the paged latent cache [num_blocks, block_size, R + Dr] holds per token
    (metrale.cache.kv.MlaSpec). Decode attends over the latents directly (the absorbed form);
    prefill expands them to per-head keys and values (the expanded form). A backend without
    these refuses DeepSeek checkpoints at load."""

    def mla_prologue(self, q: Array, kv: Array, kv_norm_w: Array, eps: float, positions: Array,
                     inv_freq: Array, attention_factor: float, latent_cache: Array,
                     batch: ForwardBatch) -> Array:
        """q [T, H, Dn + Dr], kv [T, R + Dr] (the kv_a projection: [c | k_pe], not yet normed
        nor roped; both may be strided views of one projection). Writes [rms_norm(c) * kv_norm_w
        | rope(k_pe) * attention_factor] at batch.slot_mapping (negative slot = skipped);
        returns q with its last Dr dims of every head roped and times attention_factor (the
        YaRN factor on cos and sin). Rope is rotate-half over the Dr dims, inv_freq [Dr / 2]."""

    def latent_attention(self, q_latent: Array, q_pe: Array, latent_cache: Array,
                         batch: ForwardBatch, scale: float) -> Array:
        """The absorbed form: causal attention of each new token over its sequence's latent
        rows (context + new tokens, already written): score = scale * (q_latent . c + q_pe .
        k_pe), output sum_k p_k c_k. q_latent [T, H, R] (q_nope through W_UK), q_pe [T, H, Dr]
        -> [T, H, R] (the caller applies W_UV)."""

    def gather_latents(self, latent_cache: Array, batch: ForwardBatch) -> Array:
        """Every latent row of each sequence (positions 0 .. seq_lens[i] - 1), sequence after
        sequence: [sum(seq_lens), R + Dr]."""

    def mla_expanded_attention(self, q: Array, kv: Array, k_pe: Array, batch: ForwardBatch,
                               scale: float) -> Array:
        """The expanded form: causal attention with per-head keys [kv[..., :Dn] | k_pe] and
        values kv[..., Dn:] over rows laid out as gather_latents gives them: q [T, H, Dn + Dr],
        kv [S, H, Dn + Dv] (kv_b of the gathered latents), k_pe [S, Dr] -> [T, H, Dv]."""

    def head_linear(self, x: Array, w: Array) -> Array:
        """A linear per head: out[t, h] = w[h] @ x[t, h]: x [T, H, in], w [H, out, in] ->
        [T, H, out] (fp32 accumulation)."""


class Mamba2Ops(Protocol):
    """Ops the Nemotron-H family adds (metrale.models.nemotron_h): the Mamba-2 mixer's biased
    conv and SSD scan, its grouped gated norm, and the squared-ReLU MLPs and experts. A backend
    without one of them refuses the model at load (`missing_ops`), naming the feature.

    The scan's state lives in the GDN state pool (metrale.cache.kv.Mamba2Spec): per Mamba-2
    layer conv [slots, conv_dim, K - 1] and ssm [slots, H, P, N] (fp32, or the pool's
    --ssm-h-dtype), so chunked prefill, prefix snapshots, preemption and verify rows
    (`ForwardBatch.state_out`) work as for GDN."""

    def causal_conv1d_bias(self, x: Array, weight: Array, bias: Array, conv_state: Array,
                           batch: ForwardBatch) -> Array:
        """`causal_conv1d` with a per-channel bias [C] added before the SiLU (Mamba's conv1d
        with use_conv_bias); the same conv-state contract, state_out rows included."""

    def ssd_scan(self, x: Array, dt: Array, B: Array, C: Array, A_log: Array, D: Array,
                 dt_bias: Array, dt_limit: tuple[float, float], ssm_state: Array,
                 batch: ForwardBatch, chunk_size: int) -> Array:
        """The Mamba-2 selective scan (SSD) per sequence, continuing from
        ssm_state[state_slots[i]] ([H, P, N]; zeros when the sequence starts fresh), updated
        in place. x [T, H, P]; dt [T, H] raw (before dt_bias); B, C [T, G, N], head h reading
        group h // (H // G). With A = -exp(A_log) [H] and
        delta = clamp(softplus(dt + dt_bias), *dt_limit) (fp32):
            state <- state * exp(delta * A) + delta * x (outer) B;   y = state . C + D * x.
        Multi-token runs use the chunked SSD form over chunks of `chunk_size` tokens from the
        run's start (HF's torch_chunk_scan, mamba_ssm's ssd_combined), single tokens and the
        rows of a verify window (`batch.state_out`: the state after each such token also goes
        to its row) the recurrent form. Returns y [T, H, P]."""

    def group_rms_norm_gated(self, x: Array, z: Array, w: Array, eps: float,
                             group_size: int) -> Array:
        """Mamba-2's gated norm, gate first (norm_before_gate=False): y = x * silu(z), then an
        RMSNorm over each group of `group_size` channels of the last dim, times w (not
        zero-centred). x, z [T, I], w [I] -> [T, I]."""

    def relu2(self, x: Array) -> Array:
        """relu(x)^2 (Nemotron's squared-ReLU MLP activation), elementwise."""

    def moe_topk_relu2(self, x: Array, weights: Array, experts: Array, up: Array,
                       down: Array) -> Array:
        """`moe_topk` with non-gated squared-ReLU experts down(relu2(up(x))) (Nemotron-H's MoE):
        up [E, I, H], down [E, H, I]; weights, experts [T, top_k]; x [T, H] -> [T, H]."""


def missing_ops(ops, needed: dict[str, str]) -> list[str]:
    """The features of `needed` (op name -> what it is) that backend `ops` lacks."""
    return [f"{what} (ops.{name})" for name, what in needed.items() if not callable(getattr(ops, name, None))]
