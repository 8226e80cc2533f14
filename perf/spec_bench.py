"""Speculative decoding benchmarks (engine-only; metrale.spec). Two parts, as issue #19 asks:

  --part mechanics   controlled acceptance. A first pass without speculation records each
                     request's greedy continuation; the benchmark-only ReplayDrafter then
                     proposes it with each draft corrupted with probability 1 - p. tok/s for
                     every (p, drafts, C), against speculation off, with the verify step's time
                     over a decode step's. Synthetic weights of the real shapes on the GPU
                     (perf/ladder.py's), tiny ones on the CPU. Random weights' logits are so
                     flat that a verify row's bf16 rounding (other kernels than a decode row's)
                     flips their argmax within a few tokens, after which no recorded draft
                     matches: on the GPU (--force-acceptance, the default there) the verify's
                     acceptance test itself is replaced by "each draft kept with probability p"
                     (the emitted tokens are then the drafts, not the target's: a benchmark of
                     the mechanics' cost only); the measured natural acceptance is reported
                     beside it.
  --part real        real acceptance: the real SmolLM2-135M-Instruct (GGUF), prompt lookup and
                     n-gram against off, single stream, over a code-editing workload (the model
                     rewrites a source file of this repository with one small change) and a
                     chat workload; accepted length, speedup, and whether the greedy text is
                     identical.

Writes perf/results/spec_<part>_<shape>_<stamp>.json (commit, date, device, shape, figures).

    python perf/spec_bench.py --part mechanics --shape qwen3_5_9b --conc 1,8,64 --drafts 1,3 \
        --p 0,0.7,1
    python perf/spec_bench.py --part real --model /path/SmolLM2-135M-Instruct.Q4_1.gguf
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def _run(core, prompts: dict, params, reset_stats=True) -> dict:
    """All `prompts` at once to the end: tok/s, output tokens per request, step times (decode
    steps: every sequence decoding; verify steps: any with drafts)."""
    from metrale.request import Request

    if core.speculation is not None and reset_stats:
        from metrale.spec import SpecStats
        core.speculation.stats = SpecStats()
    t0 = time.perf_counter()
    for rid, ids in prompts.items():
        core.add_request(Request(rid, list(ids), params))
    out = {rid: [] for rid in prompts}
    steps = []
    n = len(prompts)
    while core.has_unfinished():
        s0 = time.perf_counter()
        for o in core.step():
            out[o.request_id] += o.token_ids
        st = core.last_step
        if st and st.num_seqs == n and st.num_tokens >= n and all(out.values()):
            steps.append((st.num_tokens, time.perf_counter() - s0))
    wall = time.perf_counter() - t0
    total = sum(len(v) for v in out.values())
    res = dict(tok_s=total / wall, wall_s=wall, tokens=out,
               step_p50_ms=1e3 * statistics.median([s for _, s in steps]) if steps else None,
               steps=len(steps))
    if core.speculation is not None:
        st = core.speculation.stats
        res.update(verifies=st.num_verifies, draft_tokens=st.draft_tokens,
                   accepted_tokens=st.accepted_tokens,
                   acceptance=st.accepted_tokens / st.draft_tokens if st.draft_tokens else None,
                   mean_accepted_length=st.mean_accepted_length)
    return res


def mechanics(args) -> dict:
    from metrale.config import EngineConfig
    from metrale.engine_core import EngineCore
    from metrale.sampling import SamplingParams
    from metrale import levers
    from metrale.spec.adaptive import AdaptiveDrafts
    from metrale.spec.drafters import ReplayDrafter

    import ladder

    os.environ["METRALE_SPEC_MAX_BATCH"] = str(args.spec_max_batch)
    rungs = [int(c) for c in args.conc.split(",")]
    drafts = [int(k) for k in args.drafts.split(",")]
    ps = [float(p) for p in args.p.split(",")]
    modes = [bool(int(a)) for a in args.adaptive.split(",")]
    cost = float(levers.get("METRALE_SPEC_DRAFT_COST"))
    mtp = args.drafter == "mtp"
    if args.device == "cuda":
        ckpt, _ = ladder.synthetic_checkpoint(args.shape, args.weights, mtp=mtp)
    else:
        if mtp:
            raise SystemExit("--drafter mtp: the CUDA benchmark only (CPU tests cover the head)")
        import tempfile

        from metrale.models.loader import load_checkpoint
        folder = ladder.write_model_folder(args.shape, Path(tempfile.mkdtemp(prefix="spec-")), args.weights)
        ckpt = load_checkpoint(str(folder), load_format="dummy", device="cpu")
    vocab = ckpt.config["vocab_size"]
    base = dict(device=args.device, max_seq_len=args.isl + args.osl + 64, max_batch_size=max(rungs),
                max_num_seqs=max(rungs), max_prefill_tokens=max(8192, args.isl * 8), seed=0)
    # one engine: its runs with speculation disabled are the reference (the same GEMM plans:
    # another engine's tuner may pick other algorithms, whose bf16 rounding flips the near-ties
    # of random weights' logits and so every token after them)
    # --drafter mtp: the checkpoint's (random) MTP head drafts; the forced acceptance decides
    # what is kept, so the head's own cost is in the figures (its observe runs with speculation
    # disabled too: the "off" rows of this engine carry it; compare with perf/ladder.py's)
    method = dict(speculative=True) if mtp else dict(ngram_speculative=True)
    on = EngineCore(ckpt, EngineConfig(**base, **method, num_drafts=max(drafts)))
    params = SamplingParams(max_tokens=args.osl, temperature=0, ignore_eos=True)
    rng = np.random.default_rng(0)
    rows = []
    for conc in rungs:
        prompts = {f"c{conc}-{i}": [int(t) for t in rng.integers(100, vocab - 100, args.isl)]
                   for i in range(conc)}
        on.speculation.enabled = False
        _run(on, {f"w-{k}": v for k, v in prompts.items()}, params)      # warm-up
        ref = _run(on, prompts, params)
        on.speculation.enabled = True
        print(f"C={conc:4d} off            {ref['tok_s']:10.1f} tok/s  step {ref['step_p50_ms'] or 0:7.2f} ms",
              flush=True)
        # one unmeasured run with drafts first: the verify path's one-time costs (the GEMM
        # tuner meeting new row counts, first replays) belong to warm-up, not to the first rung
        on.speculation.num_drafts = max(drafts)
        if not mtp:
            on.speculation.drafter = ReplayDrafter(ref["tokens"], 1.0, vocab, seed=1)
        if args.force_acceptance:
            on.runner.accepted = _forced_acceptance(1.0, 0)
        _run(on, prompts, params)
        on.runner.__dict__.pop("accepted", None)
        for k, p, adaptive in itertools.product(drafts, ps, modes):
            on.speculation.num_drafts = k
            on.speculation.adaptive = AdaptiveDrafts(cost) if adaptive else None
            if not mtp:
                on.speculation.drafter = ReplayDrafter(ref["tokens"], p, vocab, seed=conc * 7 + k)
            if args.force_acceptance:
                on.runner.accepted = _forced_acceptance(p, conc * 11 + k)
            res = _run(on, {rid: prompts[rid] for rid in prompts}, params)
            on.runner.__dict__.pop("accepted", None)
            same = sum(res["tokens"][r] == ref["tokens"][r] for r in prompts)
            row = dict(concurrency=conc, drafts=k, p=p, adaptive=adaptive, tok_s=res["tok_s"],
                       off_tok_s=ref["tok_s"], speedup=res["tok_s"] / ref["tok_s"],
                       step_p50_ms=res["step_p50_ms"], decode_step_p50_ms=ref["step_p50_ms"],
                       verify_over_decode=(res["step_p50_ms"] / ref["step_p50_ms"]
                                           if res["step_p50_ms"] and ref["step_p50_ms"] else None),
                       acceptance=res.get("acceptance"),
                       mean_accepted_length=res.get("mean_accepted_length"),
                       verifies=res.get("verifies"), same_greedy_output=same, requests=conc)
            rows.append(row)
            print(f"C={conc:4d} K={k + 1} p={p:4.2f} {'adapt' if adaptive else 'fixed'}  {res['tok_s']:10.1f} tok/s  x{row['speedup']:5.2f}"
                  f"  step {res['step_p50_ms'] or 0:7.2f} ms  accepted {row['acceptance'] or 0:5.2f}"
                  f"  len {row['mean_accepted_length'] or 0:4.2f}  same {same}/{conc}", flush=True)
    return dict(benchmark="spec_mechanics", drafter=args.drafter, isl=args.isl, osl=args.osl,
                weights=args.weights,
                spec_max_batch=args.spec_max_batch, forced_acceptance=args.force_acceptance,
                rungs=rows)


def _forced_acceptance(p: float, seed: int):
    """ModelRunner.accepted for --force-acceptance: each draft kept with probability p (the
    chain stops at the first one not kept), whatever the target's rows say."""
    rng = np.random.default_rng(seed)

    def accepted(drafts, num_drafts, picks):
        a = 0
        while a < num_drafts and rng.random() < p:
            a += 1
        for j in range(a):          # the emitted tokens are then the kept drafts
            picks[j].token_id = drafts[j]
        return a
    return accepted


CODE_FILE = "metrale/ratelimit.py"


def workloads(tokenizer) -> dict[str, list[list[int]]]:
    """Token ids of each workload's prompts (`tokenizer(text)`: through the chat template)."""
    source = (Path(__file__).resolve().parent.parent / CODE_FILE).read_text()
    code = [
        f"Here is a Python file:\n\n```python\n{source}\n```\n\nRewrite the whole file with the "
        "class TokenBucket renamed to Bucket. Output only the complete new file.",
        f"```python\n{source}\n```\n\nRepeat this file exactly, adding a one-line comment at the "
        "top that says '# rate limiting'.",
    ]
    chat = ["What is the capital of France? Answer in two sentences.",
            "Write a short poem about the sea.",
            "Explain what a hash table is to a beginner."]
    return {name: [tokenizer(text) for text in texts] for name, texts in (("code_edit", code),
                                                                         ("chat", chat))}


def real(args) -> dict:
    from metrale.config import EngineConfig
    from metrale.llm import LLM
    from metrale.sampling import SamplingParams

    methods = {"prompt_lookup": dict(speculative=True, prompt_lookup_decoding=True),
               "ngram": dict(ngram_speculative=True, num_drafts=args.ngram_drafts)}
    rows = []
    base = dict(max_seq_len=4096, max_batch_size=4, device=args.device)
    llms = {}
    prompts = None
    for name, extra in methods.items():
        llm = LLM(args.model, **base, **extra)
        llms[name] = llm
        if prompts is None:
            prompts = workloads(lambda text, llm=llm: llm.tokenizer.encode(
                llm.render_chat([{"role": "user", "content": text}]), add_special_tokens=False))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    for workload, items in prompts.items():
        # "off" is the first method's engine with speculation disabled (the same GEMM plans as
        # its speculative runs; each method's text is compared with its own engine's)
        for name in ("off", *methods):
            core = llms[name if name != "off" else next(iter(methods))].core
            spec = core.speculation
            _run(core, {"warm": items[0][:64]}, SamplingParams(max_tokens=8, temperature=0))
            res_all = []
            for i, ids in enumerate(items):
                rid = f"{workload}-{i}"
                spec.enabled = False
                ref = _run(core, {rid: ids}, params)
                spec.enabled = name != "off"
                res = ref if name == "off" else _run(core, {rid: ids}, params)
                spec.enabled = True
                res["same"] = res["tokens"][rid] == ref["tokens"][rid]
                if not res["same"]:     # where, and how close a call the target made there
                    res["divergence"] = _divergence(core, ids, ref["tokens"][rid], res["tokens"][rid])
                res_all.append(res)
            tok = sum(sum(len(v) for v in r["tokens"].values()) for r in res_all)
            wall = sum(r["wall_s"] for r in res_all)
            row = dict(workload=workload, method=name, tok_s=tok / wall, tokens=tok,
                       identical_greedy_text=all(r["same"] for r in res_all),
                       divergences=[r["divergence"] for r in res_all if "divergence" in r])
            if name != "off":
                d = sum(r["draft_tokens"] for r in res_all)
                a = sum(r["accepted_tokens"] for r in res_all)
                v = sum(r["verifies"] for r in res_all)
                row.update(draft_tokens=d, accepted_tokens=a, verifies=v,
                           acceptance=a / d if d else None,
                           mean_accepted_length=(a + v) / v if v else None)
            rows.append(row)
        off = next(r for r in rows if r["workload"] == workload and r["method"] == "off")
        for r in rows:
            if r["workload"] == workload:
                r["speedup"] = r["tok_s"] / off["tok_s"]
                print(f"{workload:10s} {r['method']:14s} {r['tok_s']:9.1f} tok/s  x{r['speedup']:5.2f}  "
                      f"len {r.get('mean_accepted_length') or 1:5.2f}  identical {r['identical_greedy_text']}"
                      + "".join(f"  (diverges at {d['token']}/{d['of']}, top-2 gap {d['top2_gap']:.4f})"
                                for d in r["divergences"]), flush=True)
    return dict(benchmark="spec_real", model=os.path.basename(args.model), code_file=CODE_FILE,
                max_tokens=args.max_tokens, rows=rows)


def _divergence(core, prompt, ref, got) -> dict:
    """The first token where `got` leaves `ref` (greedy without speculation) and the top-1 /
    top-2 gap of the target's logits there (an eager forward of the prefix: a near-tie, where
    bf16 rounding of other kernels picks the other token, has a gap of a few 1e-2)."""
    from metrale.forward import contiguous_batch

    d = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
    ids = list(prompt) + list(ref[:d])
    bs = core.config.block_size
    batch = contiguous_batch([ids], [0], [list(range(-(-len(ids) // bs)))], [core._num_slots], bs)
    logits = np.asarray(core.ops.to_numpy(core.model.forward(core.ops.upload_batch(batch),
                                                             core.caches)))[-1].astype(np.float64)
    top2 = np.sort(logits)[-2:]
    return dict(token=d, of=len(ref), top2_gap=float(top2[1] - top2[0]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("mechanics", "real"), default="mechanics")
    ap.add_argument("--shape", default="qwen3_5_9b")
    ap.add_argument("--weights", default="bf16", choices=("bf16", "fp8", "nvfp4"))
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--isl", type=int, default=128)
    ap.add_argument("--osl", type=int, default=256)
    ap.add_argument("--conc", default="1,8,32,64,128")
    ap.add_argument("--drafts", default="1,2,3,4", help="drafts per verify (K = drafts + 1)")
    ap.add_argument("--p", default="0,0.5,0.7,0.9,1")
    ap.add_argument("--force-acceptance", type=int, default=None, choices=(0, 1),
                    help="mechanics: keep each draft with probability p whatever the target "
                         "computes (default 1 on cuda, 0 on cpu; see the module doc)")
    ap.add_argument("--spec-max-batch", type=int, default=32,
                    help="METRALE_SPEC_MAX_BATCH for the run (speculation off above it)")
    ap.add_argument("--adaptive", default="0,1",
                    help="mechanics: runs with fixed draft counts (0: the raw cost of a verify) "
                         "and / or acceptance-adaptive ones (1: metrale.spec.adaptive, the default "
                         "of the engine)")
    ap.add_argument("--drafter", default="replay", choices=("replay", "mtp"),
                    help="mechanics: the recorded greedy continuation corrupted at 1 - p "
                         "(replay), or the shape's MTP head with random weights (mtp; acceptance "
                         "forced at p)")
    ap.add_argument("--model", help="--part real: the SmolLM2 GGUF")
    ap.add_argument("--max-tokens", type=int, default=384)
    ap.add_argument("--ngram-drafts", type=int, default=4)
    ap.add_argument("--out", default="perf/results")
    ap.add_argument("--profile", action="store_true", help="cProfile the run (host time)")
    args = ap.parse_args(argv)
    if args.force_acceptance is None:
        args.force_acceptance = int(args.device == "cuda")
    import ladder
    from metrale import records

    if args.profile:        # where the host's time goes (the Python side of each step)
        import cProfile
        import pstats

        prof = cProfile.Profile()
        record = prof.runcall(mechanics if args.part == "mechanics" else real, args)
        pstats.Stats(prof).sort_stats("tottime").print_stats(40)
    else:
        record = mechanics(args) if args.part == "mechanics" else real(args)
    device = "cpu"
    if args.device == "cuda":
        import cupy as cp
        device = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    shape = args.shape if args.part == "mechanics" else "smollm2_135m_gguf"
    record = dict(commit=ladder.git_commit(),
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(), device=device,
                  shape=shape, **record)
    records.write(Path(args.out) / f"spec_{args.part}_{shape}_"
                  f"{datetime.datetime.now().strftime('%Y%m%d_%H%M%S')}.json", record, harness=__file__)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
