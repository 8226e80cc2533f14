"""--profile: every op of the ops interface is timed; results do not change."""
import numpy as np

from tiny_models import make_tiny
from metrale.llm import LLM
from metrale.sampling import SamplingParams


def test_profile_times_every_op_and_changes_nothing(tmp_path):
    path = make_tiny("qwen3_5", tmp_path)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompt = [int(t) for t in np.random.default_rng(0).integers(1, 300, 20)]
    plain = LLM(path, max_seq_len=128, max_batch_size=2).generate(prompt, params)[0]
    llm = LLM(path, max_seq_len=128, max_batch_size=2, profile=True)
    profiled = llm.generate(prompt, params)[0]
    assert profiled.token_ids == plain.token_ids
    ops = llm.core.ops
    for op in ("linear", "attention", "gated_delta_rule_with_gates", "causal_conv1d", "add_rms_norm",
               "qk_norm_rope_write_kv"):
        assert ops.calls[op] > 0 and ops.seconds[op] > 0, op
    report = ops.report()
    assert report.splitlines()[0].split() == ["op", "calls", "total", "ms", "mean", "us", "share"]
    assert "gated_delta_rule" in report
