"""Every architecture against HF transformers (fp32) on tiny random checkpoints, through the
public path: Checkpoint -> build_model -> ModelCaches -> model.forward(ForwardBatch).

Tolerance: max |ours - hf| / max |hf| <= 1e-4 over the compared logits (fp32 everywhere; the
observed error is ~1e-6 for attention models and ~1e-5 for the GDN/MoE models).
Paging is exercised with shuffled, non-contiguous block ids and reused (dirty) blocks and
state slots.
"""
from __future__ import annotations

import numpy as np
import pytest

from metrale.backends.cpu import CpuOps
from metrale.cache.kv import GdnSpec, ModelCaches
from metrale.forward import contiguous_batch
from metrale.models.checkpoint import Checkpoint, CheckpointError
from metrale.models.registry import SUPPORTED_MODEL_TYPES, build_model
from tiny_models import ARCHS, VOCAB, hf_logits, load_hf, load_tiny, make_tiny

RTOL = 1e-4
PROMPT_LEN = 70          # crosses the 64-token GDN chunk in one-shot prefill
NUM_BLOCKS, STATE_SLOTS = 96, 6


def rel_err(ours, ref) -> float:
    return float(np.max(np.abs(np.asarray(ours) - ref)) / np.max(np.abs(ref)))


class Harness:
    """A built model, its caches, shuffled block ids, and the HF logits of one prompt."""

    def __init__(self, path, block_size: int = 16, seed: int = 0):
        self.ops = CpuOps()
        self.ckpt = load_tiny(path)
        self.model = build_model(self.ckpt, self.ops)
        self.block_size = block_size
        self.rng = np.random.default_rng(seed)
        self.free_blocks = [int(b) for b in self.rng.permutation(NUM_BLOCKS)]
        self.caches = ModelCaches(self.model.cache_spec(), self.ops, NUM_BLOCKS, block_size, STATE_SLOTS)
        self.hf = load_hf(path)

    def blocks_for(self, n_tokens: int) -> list[int]:
        n = -(-n_tokens // self.block_size)
        taken, self.free_blocks = self.free_blocks[:n], self.free_blocks[n:]
        return taken

    def step(self, token_lists, context_lens, tables, slots, all_logits=True) -> np.ndarray:
        batch = contiguous_batch(token_lists, context_lens, tables, slots, self.block_size, all_logits)
        return self.ops.to_numpy(self.model.forward(self.ops.upload_batch(batch), self.caches))

    def run_chunked(self, tokens, chunk: int, table, slot) -> np.ndarray:
        """All-position logits of `tokens` fed `chunk` tokens per step."""
        out = [self.step([tokens[s: s + chunk]], [s], [table], [slot]) for s in range(0, len(tokens), chunk)]
        return np.concatenate(out)


@pytest.fixture(scope="module", params=ARCHS)
def arch_path(request, tmp_path_factory):
    return request.param, make_tiny(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def prompt():
    return np.random.default_rng(1).integers(0, VOCAB, PROMPT_LEN).tolist()


@pytest.fixture(scope="module")
def reference(arch_path, prompt):
    """HF teacher-forced logits [PROMPT_LEN, V] of the prompt."""
    return hf_logits(load_hf(arch_path[1]), prompt)


def test_one_shot_prefill_matches_hf(arch_path, prompt, reference):
    h = Harness(arch_path[1])
    ours = h.step([prompt], [0], [h.blocks_for(PROMPT_LEN)], [2])
    assert ours.shape == reference.shape
    assert rel_err(ours, reference) <= RTOL


def test_prefill_then_decode_matches_hf(arch_path, prompt, reference):
    h = Harness(arch_path[1], block_size=4)
    table, prefix = h.blocks_for(PROMPT_LEN), 21
    first = h.step([prompt[:prefix]], [0], [table], [4], all_logits=False)
    decoded = [h.step([[prompt[p]]], [p], [table], [4]) for p in range(prefix, PROMPT_LEN)]
    assert rel_err(first, reference[prefix - 1: prefix]) <= RTOL
    assert rel_err(np.concatenate(decoded), reference[prefix:]) <= RTOL


@pytest.mark.parametrize("chunk", [1, 7, 16, 64])
def test_chunked_prefill_matches_hf(arch_path, prompt, reference, chunk):
    h = Harness(arch_path[1], seed=chunk)
    ours = h.run_chunked(prompt, chunk, h.blocks_for(PROMPT_LEN), slot=1)
    assert rel_err(ours, reference) <= RTOL


def test_mixed_batch_matches_each_sequence_alone(arch_path, prompt, reference):
    """One step holding a decoding sequence, a mid-prefill one and a fresh one whose state slot
    and blocks were dirtied by an earlier sequence: each matches HF on its own tokens."""
    h = Harness(arch_path[1], block_size=4, seed=3)
    other = np.random.default_rng(2).integers(0, VOCAB, 40).tolist()
    other_ref = hf_logits(h.hf, other)
    decoding, mid, fresh = prompt[:31], other[:40], prompt[:26]
    t_dec, t_mid = h.blocks_for(len(decoding)), h.blocks_for(len(mid))
    t_dirty = h.blocks_for(len(fresh))
    h.step([decoding[:30]], [0], [t_dec], [5])
    h.step([mid[:23]], [0], [t_mid], [0])
    h.step([other[:26]], [0], [t_dirty], [3])                 # leaves state in slot 3 and KV in t_dirty
    out = h.step([decoding[30:], mid[23:], fresh], [30, 23, 0], [t_dec, t_mid, t_dirty], [5, 0, 3])
    assert rel_err(out[:1], reference[30:31]) <= RTOL
    assert rel_err(out[1:18], other_ref[23:40]) <= RTOL
    assert rel_err(out[18:], reference[:26]) <= RTOL


def test_state_snapshot_continues_like_the_original(tmp_path):
    """copy_state(src, dst) then decoding from dst == decoding from src (prefix snapshots)."""
    path = make_tiny("qwen3_5", tmp_path / "m")
    h = Harness(path, block_size=4)
    ids = np.random.default_rng(5).integers(0, VOCAB, 31).tolist()
    ref = hf_logits(h.hf, ids)
    table = h.blocks_for(31)
    h.step([ids[:30]], [0], [table], [1])
    h.caches.copy_state(1, 4)
    for layer in h.model.cache_spec().gdn_layers:                    # wreck the source row
        for arr in h.caches.state(layer):
            arr[1] = 7.0
    assert rel_err(h.step([ids[30:]], [30], [table], [4]), ref[30:]) <= RTOL


def test_cache_bytes_accounting(tmp_path):
    h = Harness(make_tiny("qwen3_5_moe", tmp_path / "m", num_hidden_layers=4))
    spec, caches = h.model.cache_spec(), h.caches
    arrays = [a for i in spec.attention_layers for a in caches.kv(i)]
    arrays += [a for i in spec.gdn_layers for a in caches.state(i)]
    assert caches.total_bytes == sum(a.nbytes for a in arrays)
    assert caches.kv_bytes_per_block == sum(a.nbytes for i in spec.attention_layers
                                            for a in caches.kv(i)) // NUM_BLOCKS
    assert [type(s) is GdnSpec for s in spec.layers] == [True, False, True, False]
    assert caches.state(0)[1].dtype == np.float32


@pytest.mark.parametrize("overrides", [
    dict(tie_word_embeddings=True),
    dict(rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 32}),
    dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    dict(attention_bias=True, head_dim=32, num_attention_heads=4),
], ids=["tied", "llama3-rope", "linear-rope", "bias-head_dim"])
def test_llama_variants_match_hf(tmp_path, prompt, overrides):
    path = make_tiny("llama", tmp_path / "m", num_hidden_layers=2, **overrides)
    h = Harness(path)
    ours = h.step([prompt], [0], [h.blocks_for(PROMPT_LEN)], [0])
    assert rel_err(ours, hf_logits(h.hf, prompt)) <= RTOL


def test_fused_expert_layout_loads_like_per_expert(tmp_path, prompt):
    """transformers-5 fused experts (gate_up_proj [E, 2I, H], down_proj [E, H, I]) == per expert."""
    ckpt = load_tiny(make_tiny("qwen3_5_moe", tmp_path / "m", num_hidden_layers=2))
    fused = dict(ckpt.tensors)
    for layer in range(2):
        p = f"model.layers.{layer}.mlp.experts."
        n = ckpt.config["num_experts"]
        fused[p + "gate_up_proj"] = np.stack([np.concatenate([fused.pop(f"{p}{e}.gate_proj.weight"),
                                                              fused.pop(f"{p}{e}.up_proj.weight")])
                                              for e in range(n)])
        fused[p + "down_proj"] = np.stack([fused.pop(f"{p}{e}.down_proj.weight") for e in range(n)])
    outs = []
    for tensors in (ckpt.tensors, fused):
        ops = CpuOps()
        model = build_model(Checkpoint(ckpt.config, tensors, ckpt.path, ckpt.name), ops)
        caches = ModelCaches(model.cache_spec(), ops, 8, 16, 1)
        outs.append(model.forward(contiguous_batch([prompt[:20]], [0], [[3, 1]], [0], 16), caches))
    np.testing.assert_array_equal(outs[0], outs[1])


def test_moe_shared_expert_as_wide_as_the_experts_runs_inside_the_moe(tmp_path, prompt):
    """Qwen3.5-MoE's shared expert is as wide as the routed ones (512): it is loaded as one more
    expert (router row E its gate) and runs in ops.moe(shared=True); logits still match HF's
    separate shared-expert MLP. The CPU spec of moe(shared=True) also equals the composition
    (routed experts + sigmoid(gate) * shared MLP) it replaces."""
    path = make_tiny("qwen3_5_moe", tmp_path / "m", num_hidden_layers=2, shared_expert_intermediate_size=32)
    h = Harness(path)
    mlp = h.model.layers[0].mlp
    assert mlp.fused_shared and mlp.shared is None and mlp.router.shape[0] == h.ckpt.config["num_experts"] + 1
    ours = h.step([prompt], [0], [h.blocks_for(PROMPT_LEN)], [0])
    assert rel_err(ours, hf_logits(h.hf, prompt)) <= RTOL

    ops, rng = CpuOps(), np.random.default_rng(3)
    E, H, I, k = 6, 16, 8, 2
    x = rng.standard_normal((5, H)).astype(np.float32)
    router = rng.standard_normal((E + 1, H)).astype(np.float32)
    gate_up = rng.standard_normal((E + 1, 2 * I, H)).astype(np.float32)
    down = rng.standard_normal((E + 1, H, I)).astype(np.float32)
    fused = ops.moe(x, router, gate_up, down, k, True, shared=True)
    h_ = x @ gate_up[E].T
    mlp_out = (h_[:, :I] / (1 + np.exp(-h_[:, :I])) * h_[:, I:]) @ down[E].T
    composed = ops.moe(x, router[:E], gate_up[:E], down[:E], k, True) \
        + mlp_out / (1 + np.exp(-(x @ router[E])))[:, None]
    np.testing.assert_allclose(fused, composed, rtol=1e-5, atol=1e-5 * np.abs(composed).max())


def test_unknown_model_type_lists_supported(tmp_path):
    ckpt = Checkpoint({"model_type": "mamba9"}, {}, str(tmp_path), "x")
    with pytest.raises(CheckpointError) as err:
        build_model(ckpt, CpuOps())
    assert "mamba9" in str(err.value)
    assert all(t in str(err.value) for t in SUPPORTED_MODEL_TYPES)


def test_wrong_tensor_shape_names_the_tensor(tmp_path):
    ckpt = load_tiny(make_tiny("qwen3", tmp_path / "m", num_hidden_layers=1))
    name = "model.layers.0.self_attn.k_proj.weight"
    tensors = dict(ckpt.tensors, **{name: ckpt.tensors[name][:-1]})
    with pytest.raises(CheckpointError, match="k_proj.weight"):
        build_model(Checkpoint(ckpt.config, tensors, ckpt.path, ckpt.name), CpuOps())


@pytest.mark.parametrize("window,masks", [(None, False), (512, False), (4096, False), (256, True)])
def test_mistral_sliding_window_masks_only_below_the_context(tmp_path, window, masks):
    """max_position_embeddings is 512: a window of at least that never masks (HF's attention is
    then full attention), a shorter one does: every layer attends over it (the CPU backend's
    sliding attention; tests/test_mistral.py matches it against HF and checks the refusal of a
    backend without the op)."""
    model = build_model(load_tiny(make_tiny("mistral", tmp_path, sliding_window=window)), CpuOps())
    assert [layer.mixer.window for layer in model.layers] == [256 if masks else None] * 4
