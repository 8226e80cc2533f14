"""The startup warm-up (EngineConfig.warmup / `--warmup`) leaves no trace: an engine that ran it
serves the same requests exactly as one that did not. Greedy, seeded and unseeded random
sampling, with the prefix cache on (warm-up prompts must not be served from it) and penalties
and logprobs (the warm-up samples with every option, which must not move the unseeded seed
stream). Tiny random checkpoints; on the CPU backend here, and on the GPU (where the warm-up is
on by default) through perf/gpu_run.sh."""
import pytest

from metrale.config import ConfigError, EngineConfig
from metrale.engine_core import EngineCore
from metrale.models.loader import load_checkpoint
from metrale.request import Request
from metrale.sampling import SamplingParams
from tiny_models import VOCAB, make_tiny

ARCHS = ("qwen3_5", "llama")
DEVICES = ("cpu", pytest.param("cuda", marks=pytest.mark.gpu))
# head dims the CUDA kernels are built for (attention 64; GDN 32 x 32), on both backends
SHAPES = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
              head_dim=64)
GDN_SHAPES = dict(linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=2,
                  linear_num_value_heads=4)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("warmup")
    return {arch: make_tiny(arch, root / arch, dtype="bfloat16", seed=3,
                            **SHAPES, **(GDN_SHAPES if arch == "qwen3_5" else {}))
            for arch in ARCHS}


def engine(path, device, warmup) -> EngineCore:
    return EngineCore(load_checkpoint(path), EngineConfig(
        device=device, warmup=warmup, block_size=4, max_batch_size=4, max_num_seqs=16,
        max_prefill_tokens=48, max_seq_len=128, enable_prefix_caching=True,
        ssm_checkpoint_interval=8, request_timeout=0, swap_space_gb=0.0, seed=5))


def workload() -> list[Request]:
    shared = [(3 + 7 * j) % VOCAB for j in range(21)]
    params = [
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True),            # unseeded
        SamplingParams(max_tokens=8, temperature=0.9, top_k=5, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=1.0, top_p=0.8, repetition_penalty=1.3,
                       logprobs=2, ignore_eos=True),                                # unseeded
    ]
    reqs = [Request(f"r{i}", shared + [(i * 13 + j) % VOCAB for j in range(5 + i)], p.validate())
            for i, p in enumerate(params)]
    # the warm-up's prompt shape ((7 + 31 j + i) mod vocab): it must not be served from the cache
    reqs.append(Request("like-warmup", [(7 + 31 * j) % VOCAB for j in range(30)],
                        SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)))
    return reqs


def run(core: EngineCore) -> dict:
    """The first request alone (its prefix gets cached), then the rest together."""
    out = {}
    reqs = workload()
    for batch in (reqs[:1], reqs[1:]):
        for req in batch:
            core.add_request(req)
        while core.has_unfinished():
            for o in core.step():
                rec = out.setdefault(o.request_id, dict(tokens=[], cached=0, logprobs=[]))
                rec["tokens"] += o.token_ids
                rec["logprobs"] += [round(t.logprob, 4) for t in o.logprobs]
                rec["cached"] = o.num_cached_tokens
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ARCHS)
def test_warmup_leaves_no_trace(checkpoints, arch, device):
    warm = engine(checkpoints[arch], device, "on")
    assert not warm.has_unfinished() and warm.num_steps == 0 and warm.last_step is None
    cold = engine(checkpoints[arch], device, "off")
    got, want = run(warm), run(cold)
    assert got == want
    assert got["like-warmup"]["cached"] == 0
    if arch == "llama":    # the cache works (hybrid models snapshot a prefix on its second use)
        assert got["r1"]["cached"] > 0


def test_warmup_setting_is_checked():
    with pytest.raises(ConfigError, match="--warmup"):
        EngineConfig(warmup="sometimes").validate()
