"""Grammar-constrained decoding cost (engine-only; metrale/grammar.py): decode step time with
and without a JSON-schema grammar at each concurrency C, and what the masks cost (computed on
a worker thread while the forward runs; `wait` is the part the sampler still waited for after
the forward, i.e. what is on the critical path). Issue #20: within 5 % at C = 32 on the H200.

The tokenizer is a real one (the SmolLM2 GGUF's by default, or --tokenizer tokenizer.json):
a mask's cost depends on the vocabulary's tokens. The model is a ladder shape (perf/ladder.py)
with synthetic weights; its vocab_size is set to the tokenizer's (--keep-vocab keeps the
shape's: the extra ids are then never allowed). Both runs sample at temperature 1 with the same
seeds; only full-batch decode steps are timed.

Writes perf/results/grammar_<shape>_<stamp>.json.

    python perf/grammar_bench.py --device cpu --shape tiny_llama --conc 1,8,32 --osl 48
    python perf/grammar_bench.py --shape qwen3_5_9b --conc 1,8,32 --osl 256     # the H200
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["title", "items", "total"],
          "properties": {
              "title": {"type": "string"},
              "items": {"type": "array", "items": {
                  "type": "object", "additionalProperties": False,
                  "required": ["name", "qty", "kind"],
                  "properties": {"name": {"type": "string"},
                                 "qty": {"type": "integer", "minimum": 0},
                                 "kind": {"enum": ["food", "tool", "other"]}}}},
              "total": {"type": "number"}}}


def load_tokenizer(path: str | None):
    """metrale's Tokenizer: from a tokenizer.json / folder, else the SmolLM2 GGUF's own."""
    from metrale.tokenizer import Tokenizer

    if path and Path(path).is_dir():
        return Tokenizer.from_dir(path)
    if path and path.endswith(".json"):
        return Tokenizer.from_file(path)
    from metrale.models.loader import load_checkpoint

    if path is None:
        from tests.assets import smollm2_gguf_path
        path = str(smollm2_gguf_path())
    return Tokenizer.from_checkpoint(load_checkpoint(path, device="cpu"))


def build_engine(args, vocab: int):
    from metrale.config import EngineConfig
    from metrale.engine_core import EngineCore
    from metrale.models.loader import load_checkpoint

    import ladder

    ladder.SHAPES[args.shape] = dict(ladder.SHAPES[args.shape], vocab_size=vocab)
    if args.device == "cuda":
        ckpt, _ = ladder.synthetic_checkpoint(args.shape)
    else:
        folder = ladder.write_model_folder(args.shape, Path(tempfile.mkdtemp(prefix="grammar-")))
        ckpt = load_checkpoint(str(folder), load_format="dummy", device="cpu")
    conc = max(int(c) for c in args.conc.split(","))
    config = EngineConfig(device=args.device, max_seq_len=args.isl + args.osl + 64,
                          max_batch_size=conc, max_num_seqs=conc,
                          max_prefill_tokens=max(8192, args.isl * conc), seed=0)
    return EngineCore(ckpt, config)


def run(core, prompts: list[list[int]], params, repeats: int = 1, other=None) -> dict:
    """All prompts at once to the end, `repeats` times (each after a run of `other` params when
    given, so that the two interleave and share the machine's drift): the full-batch decode
    steps' times, the mask stats."""
    from metrale.grammar import GrammarStats

    core.grammars.stats = GrammarStats()
    steps, tokens = [], 0
    for _ in range(repeats):
        if other is not None:
            _steps(core, prompts, other)
        stats = core.grammars.stats
        s, t = _steps(core, prompts, params)
        core.grammars.stats = stats
        steps += s
        tokens += t
    masks = list(core.grammars.stats.mask_seconds)
    return dict(steps=len(steps), tokens=tokens,
                step_p50_ms=1e3 * statistics.median(steps) if steps else None,
                step_mean_ms=1e3 * statistics.fmean(steps) if steps else None,
                mask_p50_ms=1e3 * statistics.median(masks) if masks else None,
                mask_wait_total_ms=1e3 * core.grammars.stats.wait_seconds)


def _steps(core, prompts, params) -> tuple[list[float], int]:
    from metrale.request import Request

    for i, ids in enumerate(prompts):
        core.add_request(Request(f"r{i}-{time.perf_counter()}", list(ids), params))
    steps, n, tokens = [], len(prompts), 0
    while core.has_unfinished():
        s0 = time.perf_counter()
        outs = core.step()
        dt = time.perf_counter() - s0
        tokens += sum(len(o.token_ids) for o in outs)
        st = core.last_step
        if st and st.num_seqs == n and st.num_tokens == n:
            steps.append(dt)
    return steps, tokens


def bench(args) -> dict:
    from metrale.grammar import grammar_for_schema
    from metrale.sampling import SamplingParams

    tok = load_tokenizer(args.tokenizer)
    vocab = tok.vocab_size if not args.keep_vocab else None
    import ladder
    core = build_engine(args, vocab or ladder.SHAPES[args.shape]["vocab_size"])
    core.use_tokenizer(tok)
    grammar = grammar_for_schema(SCHEMA, "schema")
    rng = np.random.default_rng(0)
    rows = []
    for conc in (int(c) for c in args.conc.split(",")):
        prompts = [[int(t) for t in rng.integers(100, tok.vocab_size - 100, args.isl)]
                   for _ in range(conc)]
        free = SamplingParams(max_tokens=args.osl, temperature=1.0, ignore_eos=True, seed=1)
        constrained = SamplingParams(max_tokens=args.osl, temperature=1.0, ignore_eos=True,
                                     seed=1, grammar=grammar)
        run(core, prompts[:1], SamplingParams(max_tokens=4, temperature=1.0))     # warm-up
        run(core, prompts[:1], SamplingParams(max_tokens=4, temperature=1.0, grammar=grammar))
        off = run(core, prompts, free.validate(), args.repeats)
        on = run(core, prompts, constrained.validate(), args.repeats, other=free)
        ratio = on["step_p50_ms"] / off["step_p50_ms"] if on["step_p50_ms"] and \
            off["step_p50_ms"] else None
        rows.append(dict(concurrency=conc, unconstrained=off, constrained=on,
                         step_ratio=ratio))
        print(f"C={conc:4d}  step {off['step_p50_ms'] or 0:8.2f} ms free  "
              f"{on['step_p50_ms'] or 0:8.2f} ms constrained  x{ratio or 0:5.3f}  "
              f"mask p50 {on['mask_p50_ms'] or 0:7.3f} ms  waited {on['mask_wait_total_ms']:8.2f} ms "
              f"over {on['steps']} steps", flush=True)
    return dict(benchmark="grammar", shape=args.shape, isl=args.isl, osl=args.osl,
                vocab=core.model.vocab_size, tokenizer_vocab=tok.vocab_size, schema=SCHEMA,
                rungs=rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="smollm2_135m")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--conc", default="1,8,32")
    ap.add_argument("--isl", type=int, default=64)
    ap.add_argument("--osl", type=int, default=128)
    ap.add_argument("--tokenizer", default=None,
                    help="tokenizer.json, a folder with one, or a GGUF (default: SmolLM2's)")
    ap.add_argument("--keep-vocab", action="store_true",
                    help="keep the shape's vocab_size instead of the tokenizer's")
    ap.add_argument("--repeats", type=int, default=2,
                    help="constrained runs, each after an unconstrained one (interleaved)")
    ap.add_argument("--out", default="perf/results")
    args = ap.parse_args(argv)
    from metrale import records

    record = bench(args)
    device = "cpu"
    if args.device == "cuda":
        import cupy as cp
        device = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    record = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(), device=device,
                  **record)
    stamp = datetime.datetime.now().strftime("%Y%m%d_%H%M%S")
    records.write(Path(args.out) / f"grammar_{args.shape}_{stamp}.json", record,
                  harness=__file__)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
