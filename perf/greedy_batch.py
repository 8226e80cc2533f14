"""Greedy stability: the same prompt's greedy tokens alone and inside a batch of 64.

    python perf/greedy_batch.py --model SmolLM2.gguf --device cuda --out DIR [--label after]

Eight chat prompts run greedy (temperature 0) one at a time, then together with 56 other
prompts in one batch of 64 (--max-batch-size 64). For each of the eight: whether the two token
sequences agree, and where they first differ. On the GPU the batch changes the GEMM shapes (and
so the fp32 summation order) the logits come from; with bf16 logits two tokens then tie exactly
often enough that greedy output depended on the batch (DESIGN.md section 9). With fp32 logits
the rounding that made exact ties common is gone; what is left are real near-ties.

Writes greedy_batch_<label>_<commit>.json: commit, date, device, model, settings, per prompt
agreement and the first divergence.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from pathlib import Path

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers greater than 100.",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue?",
    "Give me a Python function that reverses a string.",
    "What is 17 times 23?",
]
FILLERS = [f"Tell me a short fact about the number {i}." for i in range(56)]


def device_name() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.strip() or platform.node()
    except (OSError, subprocess.SubprocessError):
        return platform.node()


def _top2(tok) -> dict:
    top = sorted(tok.top_logprobs or [], key=lambda p: -p[1])[:2]
    return {"ids": [int(i) for i, _ in top], "logprobs": [float(lp) for _, lp in top],
            "gap": float(top[0][1] - top[1][1]) if len(top) == 2 else None}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default="perf/results")
    ap.add_argument("--label", default="")
    args = ap.parse_args()

    from metrale.llm import LLM
    from metrale.sampling import SamplingParams

    llm = LLM(args.model, device=args.device, max_batch_size=64, max_num_seqs=128, max_seq_len=1024)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=2)
    chats = [[{"role": "user", "content": p}] for p in PROMPTS + FILLERS]
    prompts = [llm.tokenizer.encode(llm.render_chat(c), add_special_tokens=False) for c in chats]
    t0 = time.monotonic()
    alone = [llm.generate([p], params)[0] for p in prompts[:len(PROMPTS)]]
    batched = llm.generate(prompts, params)[:len(PROMPTS)]
    rows = []
    for prompt, ra, rb in zip(PROMPTS, alone, batched):
        a, b = ra.token_ids, rb.token_ids
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        row = {"prompt": prompt, "agree": a == b, "first_divergence": first,
               "alone_text": llm.tokenizer.decode(a), "batched_text": llm.tokenizer.decode(b)}
        if first is not None:      # how close the two best tokens were where the runs split
            row["top2_alone"] = _top2(ra.logprobs[first])
            row["top2_batched"] = _top2(rb.logprobs[first])
        rows.append(row)
    commit = os.environ.get("GIT_COMMIT", "unknown")
    record = {
        "benchmark": "greedy_batch", "commit": commit, "label": args.label,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "device": device_name(),
        "model": Path(args.model).name, "backend": args.device, "max_tokens": args.max_tokens,
        "batch": len(prompts), "agree": sum(r["agree"] for r in rows), "of": len(rows),
        "seconds": round(time.monotonic() - t0, 2), "prompts": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"greedy_batch_{args.label + '_' if args.label else ''}{commit[:7]}.json"
    (out / name).write_text(json.dumps(record, indent=2, ensure_ascii=False))
    print(f"greedy alone vs batch of {len(prompts)}: {record['agree']} of {len(rows)} agree "
          f"({[r['first_divergence'] for r in rows]}) -> {out / name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
