"""Diagnose SmolLM2 (GGUF) on the GPU against the CPU backend: the chat prompt's first greedy
tokens and the prefill logits of its last position, under variants that each switch one thing
off (small KV pool, eager steps without graphs, the whole
engine vs a bare model forward). Prints one line per variant.

    SMOLLM2_GGUF=/path/SmolLM2-135M-Instruct.Q4_1.gguf python perf/gpu_diag_smollm.py
"""
from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from metrale.forward import contiguous_batch  # noqa: E402
from metrale.llm import LLM  # noqa: E402
from metrale.sampling import SamplingParams  # noqa: E402

GGUF = os.environ["SMOLLM2_GGUF"]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def bare_logits(llm, ids):
    core = llm.core
    bs = core.config.block_size
    batch = contiguous_batch([ids], [0], [list(range(len(ids) // bs + 1))], [0], bs, all_logits=True)
    with getattr(core, "stream", None) or contextlib.nullcontext():
        out = core.model.forward(core.ops.upload_batch(batch), core.caches)
    return np.asarray(core.ops.to_numpy(out), np.float32)


def run(name, ref_logits, **kw):
    try:
        llm = LLM(GGUF, max_seq_len=1024, max_batch_size=4, **kw)
        prompt = llm.render_chat(CHAT)
        ids = llm.tokenizer.encode(prompt, add_special_tokens=False)
        out = llm.generate(ids, SamplingParams(max_tokens=12, temperature=0))[0]
        logits = bare_logits(llm, ids)
        line = f"{name:28s} greedy {out.text!r:50s}"
        if ref_logits is not None:
            err = np.abs(logits - ref_logits).max(-1) / np.abs(ref_logits).max(-1)
            worst = int(err.argmax())
            line += (f" rel max|d| per pos: first {err[0]:.2e} worst {err.max():.2e} at {worst}/{len(ids)}"
                     f" last {err[-1]:.2e}; argmax agree {(logits.argmax(-1) == ref_logits.argmax(-1)).mean():.2f}")
        print(line, flush=True)
        del llm
        return logits
    except Exception as e:  # noqa: BLE001 - a diagnostic: report and go on
        import traceback
        traceback.print_exc()
        print(f"{name:28s} FAILED {e!r}", flush=True)
        return None


def main():
    ref = run("cpu fp32", None, device="cpu")
    run("cuda default", ref, device="cuda")
    run("cuda 64 kv blocks", ref, device="cuda", num_kv_blocks=64)
    run("cuda profile (no graphs)", ref, device="cuda", profile=True)
    # short prompt vs long: completion prompt
    for text in ("The capital of France is", "<|im_start|>user\nThe capital of France is"):
        for dev in ("cpu", "cuda"):
            llm = LLM(GGUF, device=dev, max_seq_len=1024, max_batch_size=4)
            o = llm.generate(text, SamplingParams(max_tokens=8, temperature=0))[0]
            print(f"{dev:5s} {text!r:50s} -> {o.text!r}", flush=True)
            del llm


if __name__ == "__main__":
    main()
