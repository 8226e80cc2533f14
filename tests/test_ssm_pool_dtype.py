"""--ssm-h-dtype: the GDN recurrent state pooled in fp16 or bf16 between steps (fp32 inside a
step). Against HF fp32 on a tiny qwen3_5: a prompt prefilled in chunks of 7 (the state crosses
the pool 10 times) then decoded token by token, with the pool in f32, f16 and bf16. The f32
pool is the model itself (<= 1e-4, as tests/test_models.py); a 16-bit pool rounds the state
once per step (measured: f16 3.0e-4, bf16 2.5e-3 of max |logit|; bounds 10x that). The pool's
memory halves, and the engine takes the flag end to end."""
import numpy as np
import pytest

from metrale.backends.cpu import CpuOps
from metrale.cache.kv import ModelCaches
from metrale.config import ConfigError, EngineConfig, ssm_pool_dtype
from metrale.forward import contiguous_batch
from metrale.models.registry import build_model
from tiny_models import VOCAB, hf_logits, load_hf, load_tiny, make_tiny

BOUND = {"f32": 1e-4, "f16-pool": 3e-3, "bf16-pool": 2.5e-2}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny("qwen3_5", tmp_path_factory.mktemp("qwen3_5"))
    tokens = np.random.default_rng(3).integers(0, VOCAB, 60).tolist()
    return path, tokens, hf_logits(load_hf(path), tokens)


@pytest.mark.parametrize("pool", ["f32", "f16-pool", "bf16-pool"])
def test_pooled_state_dtype_against_hf(tiny, pool):
    path, tokens, ref = tiny
    ops = CpuOps()
    model = build_model(load_tiny(path), ops)
    caches = ModelCaches(model.cache_spec(), ops, 16, 16, 3, ssm_dtype=ssm_pool_dtype(pool))
    for layer in model.cache_spec().gdn_layers:
        assert caches.state(layer)[1].dtype == ssm_pool_dtype(pool)
    table, slot, outs = list(range(5)), 1, []
    pos = 0
    for n in [7] * 6 + [1] * 18:          # chunked prefill, then decode steps
        batch = contiguous_batch([tokens[pos:pos + n]], [pos], [table], [slot], 16, True)
        outs.append(ops.to_numpy(model.forward(ops.upload_batch(batch), caches)))
        pos += n
    ours = np.concatenate(outs)
    err = float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))
    print(f"{pool}: max |ours - hf32| / max |hf32| = {err:.2e}")
    assert err <= BOUND[pool]


def test_pool_bytes_halve_and_the_flag_is_checked(tiny):
    path, _, _ = tiny
    spec = build_model(load_tiny(path), CpuOps()).cache_spec()
    f32 = spec.state_bytes_per_slot(np.float32, ssm_pool_dtype("f32"))
    f16 = spec.state_bytes_per_slot(np.float32, ssm_pool_dtype("f16-pool"))
    ssm = sum(spec.layers[i].n_v_heads * spec.layers[i].head_k_dim * spec.layers[i].head_v_dim
              for i in spec.gdn_layers)
    assert f32 - f16 == 2 * ssm
    with pytest.raises(ConfigError, match="ssm-h-dtype"):
        EngineConfig(ssm_h_dtype="f8").validate()


def test_engine_serves_with_a_16bit_pool(tiny):
    from metrale.llm import LLM
    from metrale.sampling import SamplingParams

    path, tokens, _ = tiny
    llm = LLM(path, max_seq_len=128, max_batch_size=2, ssm_h_dtype="f16-pool")
    layer = llm.core.caches.spec.gdn_layers[0]
    assert llm.core.caches.state(layer)[1].dtype == np.float16
    out = llm.generate(tokens[:20], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 8
