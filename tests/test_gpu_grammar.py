"""Structured output on the CUDA backend (metrale/grammar.py; kernels_cuda/sampling.cu
grammar_mask_*): the packed bitmask rows uploaded and applied to the logits on the device
before sampling. Against the CPU reference (metrale.grammar.apply_token_bitmask): the chosen
tokens of greedy and sampled rows are always allowed, the logprobs of forbidden tokens are
-inf, unconstrained rows are untouched; and a tiny model served by EngineCore on the GPU
writes schema-valid JSON from noise."""
from __future__ import annotations

import json

import numpy as np
import pytest

from metrale.grammar import apply_token_bitmask
from metrale.sampling import SamplingParams

pytestmark = pytest.mark.gpu


def _bits(allowed: list[np.ndarray], V: int) -> np.ndarray:
    out = np.zeros((len(allowed), (V + 31) // 32), dtype=np.uint32)
    for b, ids in enumerate(allowed):
        for t in ids:
            out[b, t >> 5] |= np.uint32(1 << (int(t) & 31))
    return out.view(np.int32)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("V", [1000, 49152, 151936])
def test_device_mask_keeps_only_allowed_tokens(dtype, V):
    import cupy as cp
    import ml_dtypes

    from metrale.backends.cuda import BF16, CudaOps
    from metrale.backends.cuda.sampling import GpuSampler

    ops = CudaOps(dtype=BF16)
    rng = np.random.default_rng(V)
    B = 8
    host = (rng.normal(size=(B, V)) * 3).astype(np.float32)
    allowed = [rng.choice(V, size=k, replace=False) for k in (1, 2, 7, 64, 1000, 3)]
    rows = np.array([0, 1, 3, 4, 6, 7])
    masks = (rows, _bits(allowed, V))
    ref = host.copy()
    apply_token_bitmask(ref, masks)
    np_dtype = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
    sampler = GpuSampler(ops, V, B, seed=0)
    for temperature in (0.0, 1.0):
        params = [SamplingParams(temperature=temperature, logprobs=5, seed=b).validate()
                  for b in range(B)]
        for step in range(20):
            logits = cp.asarray(host.astype(np_dtype))
            res = sampler.sample(logits, params, np.full(B, step), logprobs=True,
                                 grammar_masks=masks)
            for i, r in enumerate(rows):
                assert int(res.tokens[r]) in set(allowed[i].tolist())
                shown = [t for t, lp in zip(res.top_ids[r], res.top_logprobs[r]) if t >= 0
                         and np.isfinite(lp)]
                assert set(shown) <= set(allowed[i].tolist())
            masked = cp.asnumpy(logits).astype(np.float32)
            assert np.array_equal(np.isfinite(masked), np.isfinite(ref))    # in place, exact
            if temperature == 0.0:
                assert res.tokens[2] == np.argmax(host[2].astype(np_dtype).astype(np.float32))


def test_engine_on_the_gpu_writes_schema_valid_json(tmp_path):
    import jsonschema

    from metrale.config import EngineConfig
    from metrale.engine_core import EngineCore
    from metrale.grammar import grammar_for_schema
    from metrale.models.loader import load_checkpoint
    from metrale.request import Request
    from metrale.tokenizer import Tokenizer
    from tests.serving import make_tiny_chat_model

    from test_gpu_models import GPU_SHAPES        # a head_dim the CUDA attention instantiates

    path = make_tiny_chat_model(tmp_path / "model", **GPU_SHAPES)
    core = EngineCore(load_checkpoint(str(path)), EngineConfig(device="cuda", max_seq_len=2048,
                                                               max_batch_size=16))
    tok = Tokenizer.from_dir(path)
    core.use_tokenizer(tok)
    schema = {"type": "object", "additionalProperties": False, "required": ["n", "tags"],
              "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                             "tags": {"type": "array", "maxItems": 3,
                                      "items": {"enum": ["a", "b", "c"]}}}}
    grammar = grammar_for_schema(schema, "schema")
    for i in range(12):     # beside unconstrained requests in the same steps
        params = SamplingParams(max_tokens=400, temperature=1.0 if i % 3 else 0.0,
                                grammar=grammar if i % 4 else None).validate()
        core.add_request(Request(f"r{i}", tok.encode("x"), params))
    out: dict[str, list[int]] = {}
    reasons = {}
    while core.has_unfinished():
        for o in core.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
            if o.finished:
                reasons[o.request_id] = o.finish_reason
    for i in range(12):
        if i % 4:
            assert reasons[f"r{i}"] == "stop"
            jsonschema.validate(json.loads(tok.decode(out[f"r{i}"], skip_special_tokens=True)),
                                schema)
