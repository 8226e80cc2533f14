"""--load-format dummy: a folder's config and tokenizer, random weights in the shapes the model
asks for; serves real architectures with no weight files (benchmarks)."""
import os

import numpy as np
import pytest

from tiny_models import make_tiny
from metrale.config import EngineConfig
from metrale.engine_core import EngineCore
from metrale.models.checkpoint import CheckpointError
from metrale.models.loader import load_checkpoint
from metrale.request import Request
from metrale.sampling import SamplingParams


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "qwen2"])
def test_dummy_weights_build_and_generate_without_weight_files(arch, tmp_path):
    path = make_tiny(arch, tmp_path)
    for f in os.listdir(path):
        if f.endswith(".safetensors") or f.endswith(".index.json"):
            os.remove(os.path.join(path, f))
    with pytest.raises(CheckpointError):
        load_checkpoint(path)                      # the real loader needs the weights
    ckpt = load_checkpoint(path, load_format="dummy")
    w = ckpt.tensor("model.layers.0.mlp.down_proj.weight" if arch == "qwen2"
                    else "model.layers.0.mlp.shared_expert.down_proj.weight", (64, 32))
    assert w.shape == (64, 32) and np.all(np.abs(w) >= 2**-7) and np.all(np.abs(w) < 2**-5)
    core = EngineCore(ckpt, EngineConfig(max_seq_len=128, max_batch_size=2))
    core.add_request(Request("r", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0,
                                                            ignore_eos=True)))
    tokens = []
    while core.has_unfinished():
        for out in core.step():
            tokens += out.new_token_ids
    assert len(tokens) == 4


def test_unknown_load_format_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="load format"):
        load_checkpoint(make_tiny("llama", tmp_path), load_format="bogus")
