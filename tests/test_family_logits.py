"""The checks every family beyond Qwen / Llama passes on the CPU backend against HF fp32
(tests/family_checks.py), on each family's tiny random checkpoints: teacher-forced logits
one-shot, prefill-then-decode, chunked prefill at several chunk sizes, a mixed batch over dirty
blocks, and greedy generation through the engine with prefix-cache hits and batching. The
family-specific checks are in tests/test_gemma4.py, tests/test_minimax_m2.py,
tests/test_nemotron_h.py and tests/test_mistral.py."""
from __future__ import annotations

import numpy as np
import pytest

import family_checks as fc
from tiny_models import VOCAB, make_tiny_family

PROMPT_LEN = 70


@pytest.fixture(scope="module", params=["gemma4_dense", "gemma4_moe", "minimax_m2", "nemotron_h",
                                        "nemotron_h_moe", "mistral_swa", "ministral", "ministral3",
                                        "mistral3"])
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def ckpt(arch, tmp_path_factory):
    return make_tiny_family(arch, tmp_path_factory.mktemp(arch))


@pytest.fixture(scope="module")
def prompt():
    return np.random.default_rng(1).integers(0, VOCAB, PROMPT_LEN).tolist()


@pytest.fixture(scope="module")
def ref(ckpt, prompt):
    return fc.reference(ckpt, prompt)


def test_one_shot_prefill_matches_hf(ckpt, prompt, ref):
    fc.check_one_shot(ckpt, prompt, ref)


def test_prefill_then_decode_matches_hf(ckpt, prompt, ref):
    fc.check_prefill_then_decode(ckpt, prompt, ref)


@pytest.mark.parametrize("chunk", [1, 5, 7, 16, 64])
def test_chunked_prefill_matches_hf(ckpt, prompt, ref, chunk):
    fc.check_chunked(ckpt, prompt, ref, chunk)


def test_mixed_batch_matches_each_sequence_alone(ckpt, prompt, ref):
    fc.check_mixed_batch(ckpt, prompt, ref)


def test_engine_greedy_with_prefix_cache_and_batching(arch, ckpt, prompt):
    # a hybrid model resumes from its deepest state snapshot, taken where a prefill chunk (24
    # tokens here) ended on a checkpoint: the 38-token prompt resumes at 24
    fc.check_engine_greedy(ckpt, prompt, min_cached=24 if arch.startswith("nemotron_h") else 32)
