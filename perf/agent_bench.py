"""Agent-workload benchmark of the prefix cache (a benchmark, not a test).

Workload: several conversations share one long system prompt (~4k tokens: instructions + tool
schemas). Each turn of every conversation is submitted together (an agent loop: the model
answers, a tool result and a short user turn are appended, the whole history is sent again).
Token ids are synthetic (no tokenizer needed); sampling is greedy.

The same workload runs twice, with `enable_prefix_caching` off and on, and reports for each:
prefill tokens computed vs saved by the cache, TTFT p50/p90 (submit -> first token, wall
clock), decode steps, and the total time. Writes perf/results/agent_<date>_<commit>.json with
the commit, date, device and model shape.

    python perf/agent_bench.py                        # tiny generated qwen3_5, CPU
    python perf/agent_bench.py --model PATH --device cuda [--system-tokens 4096 ...]
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from metrale.config import EngineConfig  # noqa: E402
from metrale.engine_core import EngineCore  # noqa: E402
from metrale.models.loader import load_checkpoint  # noqa: E402
from metrale.request import Request  # noqa: E402
from metrale.sampling import SamplingParams  # noqa: E402


def commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                       text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def dirty() -> bool:
    """Uncommitted changes in the tree the figures were measured on."""
    try:
        return bool(subprocess.check_output(["git", "status", "--porcelain", "--untracked-files=no"],
                                            cwd=ROOT, text=True).strip())
    except (OSError, subprocess.CalledProcessError):
        return False


def tiny_model(folder: str) -> str:
    from tiny_models import make_tiny

    return make_tiny("qwen3_5", folder, max_position_embeddings=32768)


def model_shape(config: dict) -> dict:
    keys = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
            "linear_num_key_heads", "linear_num_value_heads", "num_experts")
    shape = {k: config[k] for k in keys if k in config}
    if "layer_types" in config:
        types = config["layer_types"]
        shape["layers"] = {t: types.count(t) for t in sorted(set(types))}
    return shape


class Conversation:
    def __init__(self, system: list[int], rng: random.Random, vocab: int, user_tokens: int):
        self.rng, self.vocab, self.user_tokens = rng, vocab, user_tokens
        self.history = list(system)

    def next_prompt(self) -> list[int]:
        """History + a tool result / user turn of `user_tokens` tokens."""
        self.history += [self.rng.randrange(1, self.vocab) for _ in range(self.user_tokens)]
        return list(self.history)

    def answer(self, tokens: list[int]) -> None:
        self.history += tokens


def run_workload(ckpt, args, prefix: bool) -> dict:
    config = EngineConfig(device=args.device, enable_prefix_caching=prefix,
                          max_seq_len=args.max_seq_len, max_batch_size=args.conversations,
                          max_prefill_tokens=args.max_prefill_tokens, request_timeout=0,
                          swap_space_gb=0.0)
    core = EngineCore(ckpt, config)
    vocab = ckpt.config["vocab_size"]
    rng = random.Random(args.seed)
    system = [rng.randrange(1, vocab) for _ in range(args.system_tokens)]
    convs = [Conversation(system, random.Random(args.seed + 1 + i), vocab, args.user_tokens)
             for i in range(args.conversations)]
    ttft, prompt_tokens, cached, computed, decode_tokens = [], 0, 0, 0, 0
    t_start = time.perf_counter()
    for turn in range(args.turns):
        submitted, first, outputs = {}, {}, {}
        for i, conv in enumerate(convs):
            rid = f"c{i}t{turn}"
            prompt = conv.next_prompt()
            prompt_tokens += len(prompt)
            submitted[rid] = time.perf_counter()
            core.add_request(Request(rid, prompt, SamplingParams(
                max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)))
            outputs[rid] = []
        while core.has_unfinished():
            step_outputs = core.step()
            now = time.perf_counter()
            computed += core.last_step.num_tokens if core.last_step else 0
            for o in step_outputs:
                if o.token_ids and o.request_id not in first:
                    first[o.request_id] = now
                    cached += o.num_cached_tokens
                outputs[o.request_id] += o.token_ids
        for i, conv in enumerate(convs):
            rid = f"c{i}t{turn}"
            ttft.append(first[rid] - submitted[rid])
            decode_tokens += len(outputs[rid]) - 1
            conv.answer(outputs[rid])
    total = time.perf_counter() - t_start
    ttft.sort()
    cache = core.scheduler.prefix_cache
    return {
        "prefix_caching": prefix,
        "requests": len(ttft),
        "prompt_tokens": prompt_tokens,
        "prefill_tokens_computed": computed - decode_tokens,
        "prefill_tokens_saved": cached,
        "saved_fraction": round(cached / prompt_tokens, 4),
        "cache_hits": cache.num_hits if cache else 0,
        "cache_misses": cache.num_misses if cache else 0,
        "ttft_p50_ms": round(1e3 * ttft[len(ttft) // 2], 3),
        "ttft_p90_ms": round(1e3 * ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))], 3),
        "total_s": round(total, 3),
        "device": core.ops.name,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint folder (default: a tiny generated qwen3_5)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--system-tokens", type=int, default=4096)
    ap.add_argument("--user-tokens", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-seq-len", type=int, default=16384)
    ap.add_argument("--max-prefill-tokens", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="metrale-agent-bench-") as tmp:
        path = args.model or tiny_model(str(Path(tmp) / "tiny_qwen3_5"))
        ckpt = load_checkpoint(path)
        runs = [run_workload(ckpt, args, prefix) for prefix in (False, True)]
    device = runs[0]["device"]
    if device == "cuda":
        import cupy

        device_name = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    else:
        device_name = f"cpu ({platform.processor() or platform.machine()})"
    result = {
        "benchmark": "agent_prefix_cache",
        "commit": commit(),
        "dirty": dirty(),
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "device": device_name,
        "model": args.model or "tiny qwen3_5 (tests/tiny_models.make_tiny)",
        "model_shape": model_shape(ckpt.config),
        "workload": {k: getattr(args, k) for k in ("conversations", "turns", "system_tokens",
                                                   "user_tokens", "max_tokens", "seed")},
        "runs": {"cache_off": runs[0], "cache_on": runs[1]},
    }
    out_dir = ROOT / "perf" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    name = f"agent_{_dt.date.today():%Y%m%d}_{result['commit']}.json"
    text = json.dumps(result, indent=2)
    (out_dir / name).write_text(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / name).write_text(text)
    print(f"{'':10} {'computed':>10} {'saved':>10} {'TTFT p50':>10} {'TTFT p90':>10} {'total':>8}")
    for label, r in result["runs"].items():
        print(f"{label:10} {r['prefill_tokens_computed']:>10} {r['prefill_tokens_saved']:>10} "
              f"{r['ttft_p50_ms']:>8.1f}ms {r['ttft_p90_ms']:>8.1f}ms {r['total_s']:>7.2f}s")
    print(f"wrote {out_dir / name}")


if __name__ == "__main__":
    main()
