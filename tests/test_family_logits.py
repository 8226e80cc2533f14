"""The checks every family beyond Qwen / Llama passes on the CPU backend against HF fp32
(tests/family_checks.py), on each family's tiny random checkpoints: teacher-forced logits
one-shot, prefill-then-decode, chunked prefill at several chunk sizes, a mixed batch over dirty
blocks, and greedy generation through the engine with prefix-cache hits and batching. The
family-specific checks are in tests/test_gemma4.py, tests/test_minimax_m2.py and tests/test_mistral.py."""
from __future__ import annotations

import numpy as np
import pytest

import family_checks as fc
from tiny_models import VOCAB, make_tiny_family

PROMPT_LEN = 70


@pytest.fixture(scope="module", params=["gemma4_dense", "gemma4_moe", "minimax_m2", "mistral_swa", "ministral",
                                        "ministral3", "mistral3"])
def ckpt(request, tmp_path_factory):
    return make_tiny_family(request.param, tmp_path_factory.mktemp(request.param))


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


def test_engine_greedy_with_prefix_cache_and_batching(ckpt, prompt):
    fc.check_engine_greedy(ckpt, prompt)
