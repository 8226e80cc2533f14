"""Host time per decode step of the engine, without a GPU. A benchmark, not a test.

    python perf/host_overhead.py [--vocab 49152,248320] [--batch 1,8,64,128] [--out DIR]

EngineCore runs on the CPU backend with a tiny model (llama, hidden 16, 1 layer) whose vocab is
a real one, and everything the GPU would do replaced by a null device:
  * the decode graphs: the real host side (metrale.backends.cuda.graphs.DecodeInputs: the ScheduledSeqs
    packed into the bucket's input buffer), then fixed logits instead of the H2D copy + replay;
  * the GPU sampler: the real host side (metrale._hot.sampler_rows.SamplerParamRows: the
    per-row parameters packed into the staging buffer), then a fixed token instead of the
    H2D copy, the kernels and the D2H copy;
  * the model's forward (prefill steps only): fixed logits.
So the figures are the Python/Cython work of a CUDA decode step; the CUDA API calls it makes
(2 async H2D copies, 1 graph launch, 2 sampler kernel launches at ~21 us each, 1 D2H copy:
DESIGN.md section 7) come on top.

`--prefill`: the same for prefill steps (B fresh prompts of ISL tokens in one step) replayed
from step graphs (--prefill-graphs on): the real host side (metrale.backends.cuda.graphs.StepBuckets: the
step padded into its token bucket, work lists included), then fixed logits. An eager prefill
step instead launches every kernel from Python (~9 ms for SmolLM2 1 x 128 on the H200 host).

Workload (the ladder's, perf/ladder.py): B requests of ISL 128 random tokens, greedy,
ignore_eos, OSL 256; all decode in lockstep (block boundaries crossed every 16 steps). Timed:
every decode step after a few warm-up steps, with time.perf_counter around each phase:

    schedule    Scheduler.schedule()
    execute     ModelRunner.execute() (the rest of the rows are inside it)
      pack      the forward's inputs: graph input packing (decode) or build_batch (prefill)
      sample    ModelRunner._sample_gpu: sampler inputs, begin, param packing, results
      prm_pack  of which the sampler's parameter packing (GpuSampler._pack)
    update      Scheduler.update_from_output()
    step        EngineCore.step() as a whole (also building its TokenDeltas)

Median and p90 per phase in microseconds; JSON into --out (perf/results by default).
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from metrale._hot.sampler_rows import SamplerParamRows
from metrale.config import EngineConfig
from metrale.engine_core import EngineCore
from metrale.backends.cuda.graphs import DecodeInputs, StepBuckets
from metrale.models.dummy import DummyCheckpoint, _NoTensors
from metrale.request import Request
from metrale.sampling import SamplingParams

PHASES = ("schedule", "execute", "pack", "sample", "prm_pack", "update", "step")


class Timer:
    def __init__(self):
        self.samples: dict[str, list[float]] = {}

    def wrap(self, name: str, fn):
        samples = self.samples.setdefault(name, [])

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                samples.append(time.perf_counter() - t0)
        return timed

    def clear(self) -> None:
        for v in self.samples.values():
            v.clear()


class NullGraphs:
    """DecodeGraphs without the device: the real host packing, then fixed logits."""

    def __init__(self, inputs: DecodeInputs, logits: np.ndarray, timer: Timer):
        self.inputs = inputs
        self.logits = logits
        self.max_batch = inputs.max_batch
        self._pack_decode = timer.wrap("pack", inputs.pack_decode)

    def supports(self, batch) -> bool:
        return self.inputs.supports(batch)

    def run(self, batch):
        self.inputs.pack(batch)
        return self.logits[: batch.num_seqs]

    def run_decode(self, seqs):
        if self._pack_decode(seqs) is None:
            return None
        return self.logits[: len(seqs)]


class NullStepGraphs:
    """StepGraphs without the device: the real padding into the token bucket (StepBuckets), then
    fixed logits."""

    def __init__(self, buckets: StepBuckets, logits: np.ndarray, timer: Timer):
        self.logits = logits
        self._pack = timer.wrap("pack", buckets.pack)

    def run_step(self, seqs):
        packed = self._pack(seqs)
        return None if packed is None else self.logits[: packed[1]]


class NullGpuSampler:
    """GpuSampler without the device: the real parameter packing, then a fixed token."""

    def __init__(self, vocab_size: int, max_batch: int, num_slots: int, token: int,
                 timer: Timer, seed: int = 0):
        self.rows = SamplerParamRows(vocab_size, num_slots, max_batch,
                                     np.random.default_rng(seed))
        self.token = token
        self._pack = timer.wrap("prm_pack", self.rows.pack)

    def begin(self, slot: int, prompt_ids=()) -> None:
        self.rows.begin(slot)

    def sample(self, logits, params, steps, slots=None, logprobs=False, before_wait=None):
        if logprobs:
            raise NotImplementedError("the null sampler returns tokens only")
        slots = np.arange(len(params)) if slots is None else slots
        self._pack(params, steps, slots)
        if before_wait is not None:     # where the engine publishes the previous step (GpuSampler)
            before_wait()
        return np.full(len(params), self.token, dtype=np.int32)


def make_core(vocab: int, batch: int, max_seq_len: int, timer: Timer, step_graphs: bool = False) -> EngineCore:
    cfg = dict(model_type="llama", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
               num_attention_heads=2, num_key_value_heads=1, vocab_size=vocab,
               rms_norm_eps=1e-5, rope_theta=1e4, tie_word_embeddings=True,
               max_position_embeddings=max_seq_len)
    ckpt = DummyCheckpoint(config=cfg, tensors=_NoTensors(), path="dummy:host_overhead",
                           name="host-overhead")
    core = EngineCore(ckpt, EngineConfig(device="cpu", max_seq_len=max_seq_len,
                                         max_batch_size=batch, max_num_seqs=batch,
                                         max_prefill_tokens=8192, seed=0))
    token = 7
    logits = np.zeros((max(batch, 8192), vocab), dtype=np.float32)
    logits[:, token] = 1.0
    core.model.forward = lambda b, caches: logits[: len(b.logits_indices)]
    sched, runner = core.scheduler, core.runner
    bs = core.config.block_size
    inputs = DecodeInputs(batch, -(-max_seq_len // bs), bs,
                          spare_block=sched.block_pool.num_blocks, spare_slot=batch)
    runner.graphs = NullGraphs(inputs, logits, timer)
    if step_graphs:     # SmolLM2's tile: 64 rows / 3 q heads per kv head = 21 tokens
        buckets = StepBuckets(2048, batch, -(-max_seq_len // bs), (21,), bs, sched.block_pool.num_blocks, batch)
        runner.step_graphs = NullStepGraphs(buckets, logits, timer)
    runner.gpu_sampler = NullGpuSampler(vocab, batch, batch, token, timer)
    sched.schedule = timer.wrap("schedule", sched.schedule)
    sched.update_from_output = timer.wrap("update", sched.update_from_output)
    runner.execute = timer.wrap("execute", runner.execute)
    runner.build_batch = timer.wrap("pack", runner.build_batch)
    runner._sample_gpu = timer.wrap("sample", runner._sample_gpu)
    return core


def measure(vocab: int, batch: int, isl: int, osl: int, warmup: int = 8) -> dict:
    timer = Timer()
    core = make_core(vocab, batch, isl + osl + 32, timer)
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=osl, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        ids = [int(t) for t in rng.integers(100, vocab - 100, isl)]
        core.add_request(Request(f"r{i}", ids, params))
    step = timer.wrap("step", core.step)
    for _ in range(warmup):
        step()
    per_step: dict[str, list[float]] = {name: [] for name in PHASES}
    while core.has_unfinished():
        seen = _marks(timer)
        step()
        st = core.last_step
        if st.num_seqs != batch or st.num_tokens != batch:     # decode steps of all B only
            continue
        _account(timer, seen, per_step)
    return _summary(dict(vocab=vocab, batch=batch), per_step)


def _marks(timer: Timer) -> dict[str, int]:
    """Where each phase's samples stand before a step."""
    return {name: len(v) for name, v in timer.samples.items()}


def _account(timer: Timer, seen: dict[str, int], per_step: dict[str, list[float]]) -> None:
    """Add one step's time per phase (its samples since `seen`) to per_step."""
    for name in PHASES:
        v = timer.samples.get(name, [])
        per_step[name].append(sum(v[seen.get(name, 0):]))


def _summary(row: dict, per_step: dict[str, list[float]]) -> dict:
    """row + steps and p50 / p90 microseconds of every phase."""
    row["steps"] = len(per_step["step"])
    for name in PHASES:
        v = per_step[name]
        row[f"{name}_p50_us"] = 1e6 * statistics.median(v)
        row[f"{name}_p90_us"] = 1e6 * float(np.percentile(v, 90))
    return row


def measure_prefill(vocab: int, batch: int, isl: int, reps: int = 30) -> dict:
    """Host time of a prefill step of `batch` fresh ISL-token prompts through null step graphs
    (each request generates one token, so the step that prefills also finishes them)."""
    timer = Timer()
    core = make_core(vocab, batch, isl + 64, timer, step_graphs=True)
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    step = timer.wrap("step", core.step)
    per_step: dict[str, list[float]] = {name: [] for name in PHASES}
    for rep in range(reps + 3):
        for i in range(batch):
            ids = [int(t) for t in rng.integers(100, vocab - 100, isl)]
            core.add_request(Request(f"p{rep}-{i}", ids, params))
        seen = _marks(timer)
        step()
        st = core.last_step
        assert st.num_tokens == batch * isl, (st.num_tokens, batch * isl)
        if rep >= 3:
            _account(timer, seen, per_step)
        while core.has_unfinished():
            core.step()
    return _summary(dict(mode="prefill_graphs", vocab=vocab, batch=batch, isl=isl), per_step)


def git_commit() -> str:
    try:
        commit = subprocess.check_output(["git", "rev-parse", "HEAD"], text=True,
                                         stderr=subprocess.DEVNULL).strip()
        dirty = subprocess.call(["git", "diff", "--quiet", "HEAD"],
                                stderr=subprocess.DEVNULL) != 0
        return commit + ("+dirty" if dirty else "")
    except Exception:
        return "unknown"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", default="49152,248320")
    ap.add_argument("--batch", default="1,8,64,128")
    ap.add_argument("--isl", type=int, default=128)
    ap.add_argument("--osl", type=int, default=256)
    ap.add_argument("--out", default="perf/results")
    ap.add_argument("--no-save", action="store_true")
    ap.add_argument("--prefill", action="store_true",
                    help="prefill steps through null step graphs (--prefill-graphs on) instead of decode")
    args = ap.parse_args(argv)
    rows = []
    print(f"{'vocab':>7} {'B':>4} " + " ".join(f"{p:>15}" for p in PHASES)
          + "   (us, p50/p90)")
    for vocab in (int(v) for v in args.vocab.split(",")):
        for batch in (int(b) for b in args.batch.split(",")):
            row = (measure_prefill(vocab, batch, args.isl) if args.prefill
                   else measure(vocab, batch, args.isl, args.osl))
            rows.append(row)
            print(f"{vocab:7d} {batch:4d} " + " ".join(
                f"{row[f'{p}_p50_us']:7.1f}/{row[f'{p}_p90_us']:<7.1f}" for p in PHASES),
                flush=True)
    if args.no_save:
        return 0
    record = dict(benchmark="host_overhead", commit=git_commit(),
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                  host=platform.processor() or platform.machine(), python=platform.python_version(),
                  isl=args.isl, osl=args.osl, note="CPU only: null device, host work of the CUDA "
                  + ("prefill path with step graphs" if args.prefill else "decode path")
                  + " (cupy calls excluded)", rows=rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"host_overhead_{datetime.datetime.now().strftime('%Y%m%d_%H%M%S')}.json"
    path.write_text(json.dumps(record, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
