"""The checks every model family passes on the CPU backend against HF fp32 (tests/test_gemma4.py,
tests/test_minimax_m2.py): teacher-forced logits one-shot, prefill-then-decode, chunked prefill,
a mixed batch over dirty blocks, and greedy generation through the engine (metrale.llm.LLM) with
prefix-cache hits and batching giving the same tokens as one request alone without the cache.
Each takes a tiny checkpoint folder and a prompt (token ids) and asserts."""
from __future__ import annotations

import numpy as np

from metrale.backends.cpu import CpuOps
from metrale.llm import LLM
from metrale.sampling import SamplingParams
from test_models import Harness, rel_err
from tiny_models import VOCAB, hf_logits, load_hf

RTOL = 1e-4


def reference(path, prompt) -> np.ndarray:
    return hf_logits(load_hf(path), prompt)


def check_one_shot(path, prompt, ref) -> None:
    h = Harness(path)
    ours = h.step([prompt], [0], [h.blocks_for(len(prompt))], [2])
    assert ours.shape == ref.shape
    assert rel_err(ours, ref) <= RTOL


def check_prefill_then_decode(path, prompt, ref, prefix: int = 21) -> None:
    h = Harness(path, block_size=4)
    table = h.blocks_for(len(prompt))
    first = h.step([prompt[:prefix]], [0], [table], [4], all_logits=False)
    decoded = [h.step([[prompt[p]]], [p], [table], [4]) for p in range(prefix, len(prompt))]
    assert rel_err(first, ref[prefix - 1: prefix]) <= RTOL
    assert rel_err(np.concatenate(decoded), ref[prefix:]) <= RTOL


def check_chunked(path, prompt, ref, chunk: int) -> None:
    h = Harness(path, seed=chunk)
    assert rel_err(h.run_chunked(prompt, chunk, h.blocks_for(len(prompt)), slot=1), ref) <= RTOL


def check_mixed_batch(path, prompt, ref) -> None:
    """A decoding sequence, a mid-prefill one and a fresh one on blocks an earlier sequence
    dirtied, in one step: each matches HF on its own tokens."""
    h = Harness(path, block_size=4, seed=3)
    other = np.random.default_rng(2).integers(0, VOCAB, 40).tolist()
    other_ref = hf_logits(h.hf, other)
    decoding, fresh = prompt[:31], prompt[:26]
    t_dec, t_mid, t_dirty = h.blocks_for(31), h.blocks_for(40), h.blocks_for(26)
    h.step([decoding[:30]], [0], [t_dec], [5])
    h.step([other[:23]], [0], [t_mid], [0])
    h.step([other[:26]], [0], [t_dirty], [3])
    out = h.step([decoding[30:], other[23:], fresh], [30, 23, 0], [t_dec, t_mid, t_dirty], [5, 0, 3])
    assert rel_err(out[:1], ref[30:31]) <= RTOL
    assert rel_err(out[1:18], other_ref[23:40]) <= RTOL
    assert rel_err(out[18:], ref[:26]) <= RTOL


def check_engine_greedy(path, prompt, min_cached: int = 32) -> None:
    """Greedy tokens through the engine: prompts sharing a prefix, with the prefix cache (hits
    on full blocks, some off the block boundary; each later prompt resumes from at least
    `min_cached` cached tokens) and batched, equal each prompt alone with no cache; the HF
    argmax of the first token agrees."""
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = [prompt[:50], prompt[:50] + [5, 6, 7], prompt[:37] + [9], prompt[:64]]
    plain = LLM(path, max_seq_len=256, max_batch_size=1, block_size=8, enable_prefix_caching=False)
    alone = [plain.generate(p, greedy)[0].token_ids for p in prompts]
    # hybrid models (Nemotron-H) snapshot their recurrent state every 8 tokens; attention-only
    # models ignore the interval
    cached = LLM(path, max_seq_len=256, max_batch_size=4, block_size=8, max_prefill_tokens=24,
                 enable_prefix_caching=True, ssm_checkpoint_interval=8)
    first = cached.generate(prompts[0], greedy)[0]
    rest = cached.generate(prompts[1:], greedy)
    assert [first.token_ids] + [r.token_ids for r in rest] == alone
    assert all(r.num_cached_tokens >= min_cached for r in rest)
    assert int(np.argmax(reference(path, prompts[0])[-1])) == alone[0][0]


def ops_without(*missing: str):
    """A stand-in backend named "cuda" with every CpuOps op but `missing` (the ops the CUDA
    backend lacks today): a family needing one of them must refuse to load on it."""
    class _Ops:
        name = "cuda"

        def __getattr__(self, attr):
            if attr in missing:
                raise AttributeError(attr)
            return getattr(CpuOps(), attr)

    return _Ops()
