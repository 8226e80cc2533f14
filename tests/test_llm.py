"""The offline API end to end on the CPU backend: the real SmolLM2-135M-Instruct (GGUF) against
HF transformers reading the same file, and batched generation against one-at-a-time."""
import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

from assets import smollm2_gguf_path
from test_gguf_loader import hf_gguf
from tiny_models import make_tiny
from metrale.forward import contiguous_batch
from metrale.llm import LLM
from metrale.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0)


@pytest.fixture(scope="module")
def smollm():
    return LLM(str(smollm2_gguf_path()), max_seq_len=1024, max_batch_size=4)


def test_smollm2_answers_paris(smollm):
    out = smollm.chat([{"role": "user", "content": "What is the capital of France?"}],
                      SamplingParams(max_tokens=24, temperature=0))[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"


def test_smollm2_logits_match_hf_on_the_same_gguf(smollm):
    """Teacher-forced logits of a real prompt: ours (fp32 numpy over the dequantized GGUF)
    against HF's LlamaForCausalLM over HF's own dequantization of the file, fp32.
    Tolerance: max |ours - hf| <= 1e-3 * max |hf| (30 layers of fp32 accumulation)."""
    config, tensors = hf_gguf(str(smollm2_gguf_path()), num_layers=30)
    hf = LlamaForCausalLM(config).eval()
    hf.load_state_dict(tensors, strict=False)
    hf.tie_weights()
    ids = smollm.tokenizer.encode("The Eiffel Tower is in the city of")
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    core = smollm.core
    batch = contiguous_batch([ids], [0], [list(range(4))], [0], core.config.block_size,
                             all_logits=True)
    ours = np.asarray(core.model.forward(batch, core.caches))
    assert np.abs(ours - ref).max() <= 1e-3 * np.abs(ref).max()
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_chat_batch_of_different_lengths_equals_one_at_a_time(smollm):
    prompts = ["The capital of France is", "Once upon a time, in a small village by the sea,",
               "def fibonacci(n):"]
    together = smollm.generate(prompts, GREEDY)
    alone = [smollm.generate(p, GREEDY)[0] for p in prompts]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert all(len(o.token_ids) == 12 and o.finish_reason == "length" for o in together)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe", "llama"])
def test_batched_generation_equals_single_and_seeds_repeat(arch, tmp_path):
    llm = LLM(make_tiny(arch, tmp_path), max_seq_len=256, max_batch_size=4,
              max_prefill_tokens=24, block_size=8)
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(1, 200, n)] for n in (3, 30, 70, 9)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    together = llm.generate(prompts, params)
    alone = [llm.generate(p, params)[0] for p in prompts]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    seeded = SamplingParams(max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)
    a = llm.generate(prompts, seeded)
    b = llm.generate(prompts[::-1], seeded)[::-1]
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
