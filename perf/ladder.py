"""The concurrency ladder: the seed's workload on real model shapes with synthetic weights made on
the GPU (bf16, or with `--weights fp8 | nvfp4` the projections in block FP8 / NVFP4 as a quantized
release stores them: metrale.models.dummy.random_quantized). A benchmark, not a test. Engine-only (no HTTP) by default; `--http` runs the
same ladder through `met serve --load-format dummy` with streaming clients, so the serving
overhead is the difference between the two records.

    python perf/ladder.py --shape qwen3_5_9b --osl 256 --conc 1,2,4,8,16,32,64,128 --out DIR
    python perf/ladder.py --http --shape qwen3_5_9b ...

Per rung: C requests of ISL random prompt tokens, OSL generated tokens each (ignore_eos,
temperature 0), 1 warm-up + REPS timed repetitions; reported: aggregate tok/s (mean of reps),
TTFT p50, ITL p50 ((last - first token time) / (OSL - 1)), and the steady decode step time
against its roofline: the bytes one decode step must move (every weight once, the lm_head once,
each sequence's KV and GDN state once) over the measured copy bandwidth.
Results: JSON in --out (perf/results by default) with commit, date, device, shape and figures.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

COPY_BW = 4.2e12   # measured H200 device-to-device copy, bytes/s (re-measured per run below)

SHAPES = {
    "smollm2_135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         vocab_size=49152, rms_norm_eps=1e-5, rope_theta=100000.0,
                         tie_word_embeddings=True, max_position_embeddings=8192),
    "qwen3_5_9b": dict(model_type="qwen3_5", vocab_size=248320, hidden_size=4096,
                       intermediate_size=12288, num_hidden_layers=32, num_attention_heads=16,
                       num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                       linear_num_value_heads=32, linear_key_head_dim=128,
                       linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4),
    "qwen3_5_27b": dict(model_type="qwen3_5", vocab_size=248320, hidden_size=5120,
                        intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24,
                        num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                        linear_num_value_heads=48, linear_key_head_dim=128,
                        linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4),
    "qwen3_5_35b_a3b": dict(model_type="qwen3_5_moe"),
    # a few-MB shape to check the harness itself on the CPU backend
    "tiny_llama": dict(model_type="llama", hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                       vocab_size=512, tie_word_embeddings=True, max_position_embeddings=4096),
}


def hf_config(shape: str):
    """The HF text config of a shape (transformers' defaults fill the rest)."""
    from transformers import AutoConfig

    kw = dict(SHAPES[shape])
    model_type = kw.pop("model_type")
    hf_type = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}.get(model_type,
                                                                                  model_type)
    return AutoConfig.for_model(hf_type, **kw), model_type


def tensor_shapes(config) -> dict[str, tuple[int, ...]]:
    """Names and shapes of every weight, from HF's model built on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


QUANT_CONFIGS = {"fp8": {"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e4m3",
                         "activation_scheme": "dynamic"},
                 "nvfp4": {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}}


class SyntheticTensors(Mapping):
    """Random bf16 weights generated on the GPU on first access (|w| in [2^-7, 2^-5), random
    sign: never zeros, which time differently); with `quant` the projections a quantized
    release stores quantized come in that format."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], quant: str | None = None):
        import cupy as cp
        import ml_dtypes

        self.cp, self.bf16 = cp, np.dtype(ml_dtypes.bfloat16)
        self.shapes = shapes
        self.quant = quant

    def __getitem__(self, name):
        from metrale.models.dummy import is_quantized_projection, random_quantized

        cp = self.cp
        shape = self.shapes[name]
        if self.quant and is_quantized_projection(name, shape):
            return random_quantized(shape, self.quant, "cuda", abs(hash(name)) % 2**32)
        bits = cp.random.randint(0x3C00, 0x3D00, size=shape, dtype=cp.int32).astype(cp.uint16)
        bits |= (cp.random.randint(0, 2, size=shape, dtype=cp.int32).astype(cp.uint16) << 15)
        return bits.view(self.bf16)

    def __iter__(self):
        return iter(self.shapes)

    def __len__(self):
        return len(self.shapes)


def synthetic_checkpoint(shape: str, weights: str = "bf16", mtp: bool = False):
    """`mtp`: with the MTP head a Qwen3.5 release ships (mtp.*: fc, its norms and one layer
    shaped as the model's first full-attention layer; bf16 like a release's)."""
    from metrale.models.checkpoint import Checkpoint

    config, model_type = hf_config(shape)
    shapes = tensor_shapes(config)
    cfg = config.to_dict()
    cfg["model_type"] = model_type
    if mtp:
        shapes.update(mtp_shapes(cfg, shapes))
        cfg.update(mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False)
    quant = None if weights == "bf16" else weights
    if quant:
        cfg["quantization_config"] = QUANT_CONFIGS[quant]
    return Checkpoint(config=cfg, tensors=SyntheticTensors(shapes, quant), path=f"synthetic:{shape}",
                      name=shape), shapes


def mtp_shapes(cfg: dict, shapes: dict) -> dict[str, tuple[int, ...]]:
    hidden = cfg["hidden_size"]
    full = cfg["layer_types"].index("full_attention")
    src = next(n for n in shapes if f"layers.{full}." in n).split(f"layers.{full}.")[0] + \
        f"layers.{full}."
    out = {"mtp.fc.weight": (hidden, 2 * hidden)}
    out.update({f"mtp.{n}.weight": (hidden,) for n in ("pre_fc_norm_embedding",
                                                       "pre_fc_norm_hidden", "norm")})
    out.update({"mtp.layers.0." + n[len(src):]: s for n, s in shapes.items() if n.startswith(src)})
    return out


def weight_bytes(name: str, shape, weights: str = "bf16") -> float:
    """Bytes of one stored weight: bf16, or packed codes + scales where a quantized release
    quantizes it (fp8: 1 byte + a fp32 scale per 128 x 128; nvfp4: 1/2 byte + an e4m3 scale per
    16 + a fp32 global per row)."""
    from metrale.models.dummy import is_quantized_projection

    count = int(np.prod(shape))
    if weights == "bf16" or not is_quantized_projection(name, shape):
        return count * 2
    if weights == "fp8":
        return count + 4 * count / (128 * 128)
    return count / 2 + count / 16 + 4 * count / shape[-1]


def decode_step_bytes(shapes, cfg, batch: int, context: int, weights: str = "bf16") -> int:
    """Fewest bytes one decode step moves: weights once (the embedding table only B rows; of the
    routed experts only the min(E, B * top_k) that B tokens can reach), each sequence's KV and
    GDN state once."""
    experts = cfg.get("num_experts") or 0
    reach = min(experts, batch * (cfg.get("num_experts_per_tok") or 0)) / experts if experts else 1

    def moved(name, shape):
        routed = ".mlp.experts." in name
        return weight_bytes(name, shape, weights) * (reach if routed else 1)

    weights = int(sum(moved(n, s) for n, s in shapes.items() if "embed_tokens" not in n))
    if "lm_head.weight" not in shapes:
        weights += cfg["vocab_size"] * cfg["hidden_size"] * 2
    layer_types = cfg.get("layer_types") or ["full_attention"] * cfg["num_hidden_layers"]
    n_attn = sum(t == "full_attention" for t in layer_types)
    n_gdn = len(layer_types) - n_attn
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv = batch * context * n_attn * cfg["num_key_value_heads"] * hd * 2 * 2
    state = 0
    if n_gdn:
        state = batch * n_gdn * cfg["linear_num_value_heads"] * cfg["linear_key_head_dim"] \
            * cfg["linear_value_head_dim"] * 4 * 2
    return weights + kv + state


def measure_copy_bw() -> float:
    import cupy as cp

    a = cp.empty(2**30, dtype=cp.uint8)
    b = cp.empty_like(a)
    for _ in range(3):
        b[...] = a
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(10):
        b[...] = a
    end.record()
    end.synchronize()
    seconds = cp.cuda.get_elapsed_time(start, end) / 1000 / 10
    del a, b
    return 2 * 2**30 / seconds


def run_rung(core, conc: int, isl: int, osl: int, vocab: int, rng) -> dict:
    from metrale.request import Request
    from metrale.sampling import SamplingParams

    params = SamplingParams(max_tokens=osl, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    first, last = {}, {}
    for i in range(conc):
        ids = [int(t) for t in rng.integers(100, vocab - 100, isl)]
        core.add_request(Request(f"c{conc}-{i}-{t0}", ids, params))
    decode_steps = []
    while core.has_unfinished():
        s0 = time.perf_counter()
        outs = core.step()
        now = time.perf_counter()
        st = core.last_step
        if st and st.num_seqs == conc and st.num_tokens == conc:
            decode_steps.append(now - s0)
        for o in outs:
            if o.token_ids:
                first.setdefault(o.request_id, now)
                last[o.request_id] = now
    wall = time.perf_counter() - t0
    ttft = [first[r] - t0 for r in first]
    itl = [(last[r] - first[r]) / max(1, osl - 1) for r in first]
    return dict(tok_s=conc * osl / wall, wall_s=wall, ttft_p50_ms=1e3 * statistics.median(ttft),
                itl_p50_ms=1e3 * statistics.median(itl),
                decode_step_p50_ms=1e3 * statistics.median(decode_steps) if decode_steps else None)


def write_model_folder(shape: str, folder: Path, weights: str = "bf16") -> Path:
    """An HF folder for `met serve --load-format dummy`: config.json plus a word-level tokenizer
    over the whole vocab ('<id>' tokens), since synthetic weights come with no real tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    config, model_type = hf_config(shape)
    cfg = config.to_dict()
    if weights != "bf16":
        cfg["quantization_config"] = QUANT_CONFIGS[weights]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    vocab = {f"<{i}>": i for i in range(cfg["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<0>"}))
    return folder


def ttft_split(log_path: Path | None, res: list[tuple]) -> dict:
    """Where a rung's TTFT went, from the engine's request log (its `arrival` Unix time and
    `ttft_ms` per request) against the clients' send and first-token times: p50 of inbound
    (client send -> engine admits it: HTTP, frontend, ZeroMQ, and waiting for the engine's
    current step), engine (admitted -> first token sampled) and outbound (sampled -> the
    client reads it), and of the response head's arrival. Requests are paired in arrival order."""
    if log_path is None or not log_path.exists():
        return {}
    offset = time.time() - time.perf_counter()   # Unix time - CLOCK_MONOTONIC, this machine
    lo, hi = min(r[0] for r in res) - 0.5, max(r[2] for r in res) + 0.5
    engine = []
    for line in log_path.read_text(errors="replace").splitlines():
        at = line.find('{"model"')
        if "metrale.requests" not in line or at < 0:
            continue
        try:
            rec = json.loads(line[at:])
        except ValueError:
            continue
        if rec.get("arrival") is None or rec.get("ttft_ms") is None:
            continue
        arrival = rec["arrival"] - offset
        if lo <= arrival <= hi:
            engine.append((arrival, arrival + rec["ttft_ms"] / 1e3))
    if len(engine) != len(res):
        return {}
    engine.sort()
    clients = sorted(res)
    med = lambda xs: round(1e3 * statistics.median(xs), 3)  # noqa: E731
    return dict(inbound_ms=med([e[0] - c[0] for e, c in zip(engine, clients)]),
                engine_ms=med([e[1] - e[0] for e in engine]),
                outbound_ms=med([c[1] - e[1] for e, c in zip(engine, clients)]),
                head_ms=med([c[4] - c[0] for c in clients]))


def run_http_rung(base: str, model: str, conc: int, isl: int, osl: int, vocab: int, rng,
                  procs: int = 4, log_path: Path | None = None) -> dict:
    """One rung through the server: C streamed completions from `procs` client processes
    (perf/http_load.py), all started together; figures as run_rung's, and the TTFT's split
    between the frontend and the engine when the server's log is at `log_path`."""
    from urllib.parse import urlsplit

    from perf.http_load import run_load

    url = urlsplit(base)
    bodies = [json.dumps({"model": model, "prompt": [int(t) for t in rng.integers(100, vocab - 100, isl)],
                          "max_tokens": osl, "temperature": 0, "ignore_eos": True, "stream": True,
                          "stream_options": {"include_usage": True}}).encode() for _ in range(conc)]
    res = run_load(url.hostname, url.port, "/v1/completions", bodies, procs)
    t0 = min(r[0] for r in res)
    missing = [r for r in res if r[1] is None]
    if missing:
        raise RuntimeError(f"{len(missing)} of {conc} streams returned no text")
    wall = max(r[2] for r in res) - t0
    tokens = sum(r[3] for r in res)
    ttft = [r[1] - r[0] for r in res]
    itl = [(r[2] - r[1]) / max(1, osl - 1) for r in res]
    return dict(tok_s=tokens / wall, wall_s=wall, ttft_p50_ms=1e3 * statistics.median(ttft),
                itl_p50_ms=1e3 * statistics.median(itl), decode_step_p50_ms=None,
                completion_tokens=tokens, ttft_split=ttft_split(log_path, res))


def start_server(folder: Path, args, max_conc: int, port: int):
    """`met serve --load-format dummy` on the shape's folder; returns the process once healthy."""
    import httpx

    cmd = [sys.executable, "-m", "metrale.cli", "serve", str(folder), "--load-format", "dummy",
           "--device", args.device, "--port", str(port), "--max-batch-size", str(max_conc),
           "--max-num-seqs", str(max_conc), "--max-seq-len", str(args.isl + args.osl + 32),
           "--frontends", str(args.frontends), "--no-event-log", "--swap-space-gb", "0",
           "--prefill-graphs", args.prefill_graphs]
    # the server's output goes to a file: a pipe nobody reads fills up (64 KiB) and then blocks
    # the engine's next log line, which is how the first GPU HTTP ladder stalled at C = 128
    log_path = Path(args.out) / f"serve_{args.shape}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "ab")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    proc.log_path = log_path
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"met serve exited {proc.returncode}: {_tail(log_path)}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError("met serve did not become healthy in 900 s")


def model_id(base: str, timeout_s: float = 120) -> str:
    """The served model's id from /v1/models, retried while a frontend worker that answered is
    still starting (503: /health may have come from a worker that was already up)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        r = httpx.get(base + "/v1/models", timeout=10)
        if r.status_code == 200:
            return r.json()["data"][0]["id"]
        if time.monotonic() > deadline:
            raise RuntimeError(f"/v1/models: HTTP {r.status_code}: {r.text[:300]}")
        time.sleep(0.5)


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_bytes()[-n:].decode(errors="replace")
    except OSError:
        return ""


def git_commit() -> str:
    env = os.environ.get("GIT_COMMIT")
    if env:
        return env
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3_5_9b", choices=sorted(SHAPES))
    ap.add_argument("--isl", type=int, default=128)
    ap.add_argument("--osl", type=int, default=256)
    ap.add_argument("--conc", default="1,2,4,8,16,32,64,128")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="perf/results")
    ap.add_argument("--http", action="store_true", help="through met serve and HTTP clients")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--frontends", type=int, default=4)
    ap.add_argument("--port", type=int, default=8899)
    ap.add_argument("--client-procs", type=int, default=4,
                    help="HTTP client processes the C streams are spread over")
    ap.add_argument("--weights", default="bf16", choices=("bf16", "fp8", "nvfp4"),
                    help="the projections' format (synthetic block FP8 / NVFP4 of the real shapes)")
    ap.add_argument("--prefill-graphs", default="on", choices=("on", "off"),
                    help="the engine's --prefill-graphs (prefill / mixed steps from CUDA graphs)")
    args = ap.parse_args(argv)
    if args.http:
        return main_http(args)
    from metrale.config import EngineConfig
    from metrale.engine_core import EngineCore

    rungs = [int(c) for c in args.conc.split(",")]
    t0 = time.perf_counter()
    if args.device == "cuda":
        bw = measure_copy_bw()
        ckpt, shapes = synthetic_checkpoint(args.shape, args.weights)
    else:
        # the CPU backend (small shapes): what the harness and the serving overhead look like
        # without a GPU; the same dummy weights `met serve --load-format dummy` makes
        import tempfile

        from metrale.models.loader import load_checkpoint

        bw = None
        folder = write_model_folder(args.shape, Path(tempfile.mkdtemp(prefix="metrale-ladder-")), args.weights)
        ckpt = load_checkpoint(str(folder), load_format="dummy", device="cpu")
        shapes = tensor_shapes(hf_config(args.shape)[0])
    core = EngineCore(ckpt, EngineConfig(
        device=args.device, max_seq_len=args.isl + args.osl + 32, max_batch_size=max(rungs),
        max_num_seqs=max(rungs), max_prefill_tokens=max(8192, args.isl * 8), seed=0,
        prefill_graphs=args.prefill_graphs))
    load_s = time.perf_counter() - t0
    cfg = ckpt.config
    rng = np.random.default_rng(0)
    results = []
    for conc in rungs:
        run_rung(core, conc, args.isl, args.osl, cfg["vocab_size"], rng)   # warm-up
        reps = [run_rung(core, conc, args.isl, args.osl, cfg["vocab_size"], rng)
                for _ in range(args.reps)]
        step = [r["decode_step_p50_ms"] for r in reps if r["decode_step_p50_ms"]]
        ctx = args.isl + args.osl // 2
        # no roofline without a measured copy bandwidth (the CPU backend): null, not NaN
        # (records are canonical JSON: metrale/records.py refuses NaN)
        roof_ms = 1e3 * decode_step_bytes(shapes, cfg, conc, ctx, args.weights) / bw if bw else None
        row = dict(concurrency=conc, tok_s=statistics.mean(r["tok_s"] for r in reps),
                   tok_s_reps=[r["tok_s"] for r in reps],
                   ttft_p50_ms=statistics.median(r["ttft_p50_ms"] for r in reps),
                   itl_p50_ms=statistics.median(r["itl_p50_ms"] for r in reps),
                   decode_step_p50_ms=statistics.median(step) if step else None,
                   decode_roofline_ms=roof_ms)
        row["step_over_roofline"] = (row["decode_step_p50_ms"] / roof_ms
                                     if row["decode_step_p50_ms"] and roof_ms else None)
        results.append(row)
        print(f"{args.shape} C={conc:4d}  {row['tok_s']:10.1f} tok/s  TTFT p50 "
              f"{row['ttft_p50_ms']:8.1f} ms  ITL p50 {row['itl_p50_ms']:7.2f} ms  step "
              f"{row['decode_step_p50_ms'] or 0:7.2f} ms  roofline {roof_ms or float('nan'):6.2f} ms", flush=True)
    params = sum(int(np.prod(s)) for s in shapes.values())
    device = "cpu"
    if args.device == "cuda":
        import cupy as cp

        device = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    write_record(args, "ladder", dict(
        benchmark="ladder_engine_only", device=device, copy_bandwidth_Bps=bw,
        params=params, load_seconds=load_s, rungs=results))
    return 0


def write_record(args, prefix: str, record: dict) -> Path:
    """perf results JSON: commit, date, shape and workload first, then the figures; stamped and
    signed by metrale.records.finish."""
    from metrale import levers, records
    record = dict(commit=git_commit(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                  shape=args.shape, model_config=SHAPES[args.shape], dtype="bfloat16",
                  weights=args.weights,
                  isl=args.isl, osl=args.osl, reps=args.reps, prefill_graphs=args.prefill_graphs,
                  pdl=levers.get("METRALE_PDL"), **record)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d_%H%M%S")
    tag = "" if args.weights == "bf16" else f"_{args.weights}"
    return records.write(out / f"{prefix}_{args.shape}{tag}_osl{args.osl}_{stamp}.json", record,
                         harness=__file__)


def main_http(args) -> int:
    import tempfile

    rungs = [int(c) for c in args.conc.split(",")]
    folder = write_model_folder(args.shape, Path(tempfile.mkdtemp(prefix="metrale-ladder-")), args.weights)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    t0 = time.perf_counter()
    proc = start_server(folder, args, max(rungs), args.port)
    load_s = time.perf_counter() - t0
    base = f"http://127.0.0.1:{args.port}"
    rng = np.random.default_rng(0)
    results = []
    try:
        model = model_id(base)
        for conc in rungs:
            run_http_rung(base, model, conc, args.isl, args.osl, vocab, rng,
                          args.client_procs)   # warm-up
            reps = [run_http_rung(base, model, conc, args.isl, args.osl, vocab, rng,
                                  args.client_procs, proc.log_path) for _ in range(args.reps)]
            row = dict(concurrency=conc, tok_s=statistics.mean(r["tok_s"] for r in reps),
                       tok_s_reps=[r["tok_s"] for r in reps],
                       ttft_p50_ms=statistics.median(r["ttft_p50_ms"] for r in reps),
                       itl_p50_ms=statistics.median(r["itl_p50_ms"] for r in reps),
                       completion_tokens=[r["completion_tokens"] for r in reps],
                       ttft_split_reps=[r["ttft_split"] for r in reps])
            results.append(row)
            split = "  ".join(f"{k[:-3]} {v:.1f}" for k, v in reps[-1]["ttft_split"].items())
            print(f"http {args.shape} C={conc:4d}  {row['tok_s']:10.1f} tok/s  TTFT p50 "
                  f"{row['ttft_p50_ms']:8.1f} ms  ITL p50 {row['itl_p50_ms']:7.2f} ms"
                  f"{'  TTFT ms: ' + split if split else ''}", flush=True)
    except BaseException:
        print(f"--- met serve log ({proc.log_path}), last lines:\n{_tail(proc.log_path)}", flush=True)
        raise
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)   # its own session: the engine and frontends go with it
            proc.wait()
    device = args.device
    if device == "cuda":
        import cupy as cp

        device = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    write_record(args, "ladder_http", dict(benchmark="ladder_http", device=device,
                                            frontends=args.frontends, load_seconds=load_s,
                                            rungs=results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
