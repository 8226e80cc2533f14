"""Hot swap, measured through a real `met serve`: swap between two models N times with
POST /v1/models/load and record, after each swap, the time until a completion is served again
and the engine process's memory (device memory in use and CuPy's pool on CUDA, the resident set
everywhere), as a JSON record (metrale.records: commit, device, harness hash, signature).

    # the H200: synthetic weights of two real shapes (--load-format dummy), a fixed KV pool so
    # that a leak shows as memory rather than as a smaller pool
    python perf/swap_bench.py --shapes smollm2_135m,qwen3_5_9b --swaps 10 --device cuda \\
        --out perf/results
    # the CPU: two tiny random checkpoints (a llama and a Qwen3.5), real weights
    python perf/swap_bench.py --tiny --swaps 10 --device cpu --out /tmp/swap

The record's `swaps` list holds one entry per swap (target, seconds to the POST's answer, to the
first completion served, the engine's own swap time, memory after it); `summary` gives per
model the memory after the first swap to it, after the last, and the largest drift from the
first, in %.
"""
from __future__ import annotations

import argparse
import datetime
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def tiny_models(folder: Path) -> list[tuple[str, Path, str]]:
    """Two tiny random checkpoints, (name, folder, load format): a llama and a Qwen3.5."""
    from tests.serving import make_tiny_chat_model
    from tests.tiny_models import make_tiny

    llama = make_tiny_chat_model(folder / "tiny-llama")
    qwen = folder / "tiny-qwen3_5"
    make_tiny("qwen3_5", qwen, max_position_embeddings=4096)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(llama / name, qwen / name)
    return [("tiny-llama", llama, "auto"), ("tiny-qwen3_5", qwen, "auto")]


def shape_models(folder: Path, shapes: list[str]) -> list[tuple[str, Path, str]]:
    from perf.ladder import write_model_folder

    return [(s, write_model_folder(s, folder / s), "dummy") for s in shapes]


def write_recipes(folder: Path, models, args) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, path, load_format in models:
        serve = {"device": args.device, "max-seq-len": args.max_seq_len,
                 "max-batch-size": 8, "model-name": name, "swap-space-gb": 0}
        if load_format != "auto":
            serve["load-format"] = load_format
        if args.num_kv_blocks:
            serve["num-kv-blocks"] = args.num_kv_blocks
        lines = [f'description = "swap bench: {name}"', f'checkpoint = "{path}"',
                 f'family = "{_family(path)}"', 'format = "bf16"', "", "[serve]"]
        lines += [f"{k} = {v!r}" if isinstance(v, int) else f'{k} = "{v}"'
                  for k, v in serve.items()]
        (folder / f"swap-{name}.toml").write_text("\n".join(lines) + "\n")


def _family(path: Path) -> str:
    import json

    config = json.loads((path / "config.json").read_text())
    text = config.get("text_config") or config
    return {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}.get(
        text.get("model_type"), text.get("model_type"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(recipes: Path, first: str, port: int, log_path: Path, events: Path):
    env = {**os.environ, "METRALE_RECIPES_PATH": str(recipes)}
    cmd = [sys.executable, "-m", "metrale.cli", "run", f"swap-{first}", "--port", str(port),
           "--frontends", "1", "--event-log", str(events)]
    log = open(log_path, "ab")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while not _healthy(url):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"met serve did not start: {log_path.read_text()[-3000:]}")
        time.sleep(0.5)
    return proc, url


def _healthy(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def serve_one(url: str, deadline: float) -> float:
    """Seconds until one completion is served (503s retried, as a client would)."""
    import httpx

    while time.monotonic() < deadline:
        try:
            r = httpx.post(url + "/v1/completions", timeout=120, json={
                "prompt": "hello", "max_tokens": 4, "temperature": 0})
            if r.status_code == 200:
                return time.monotonic()
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError("no completion served after the swap")


def one_swap(url: str, target: str) -> dict:
    import httpx

    t0 = time.monotonic()
    r = httpx.post(url + "/v1/models/load", json={"recipe": f"swap-{target}"}, timeout=1200)
    answered = time.monotonic()
    if r.status_code != 200:
        raise RuntimeError(f"the swap to {target} failed: {r.status_code} {r.text}")
    served = serve_one(url, answered + 300)
    lib = httpx.get(url + "/v1/library", timeout=60).json()
    last = lib["swap"]["last"]
    return {"to": target, "load_response_s": round(answered - t0, 3),
            "time_to_serve_s": round(served - t0, 3), "engine_swap_s": last["seconds"],
            "engine_load_s": last.get("load_s"), "memory": lib["memory"]}


def summary(swaps: list[dict], initial: dict) -> dict:
    """Per model: memory after the first swap to it against every later one (the server's
    first load is left out: the process's own one-off costs, kernels compiled and modules
    imported, land there and in the first swap to the other model)."""
    key = "device_used_bytes" if "device_used_bytes" in initial["memory"] else "rss_bytes"
    out = {"memory_key": key}
    for target in sorted({s["to"] for s in swaps}):
        mem = [s["memory"][key] for s in swaps if s["to"] == target]
        times = [s["time_to_serve_s"] for s in swaps if s["to"] == target]
        out[target] = {"loads": len(mem), "memory_first": mem[0], "memory_last": mem[-1],
                       "memory_max_drift_pct": round(100 * max(abs(m - mem[0]) for m in mem)
                                                     / max(1, mem[0]), 3),
                       "time_to_serve_p50_s": statistics.median(times) if times else None}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="smollm2_135m,qwen3_5_9b",
                    help="two perf/ladder.py shapes (synthetic weights)")
    ap.add_argument("--tiny", action="store_true", help="two tiny random checkpoints instead")
    ap.add_argument("--swaps", type=int, default=10)
    ap.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    ap.add_argument("--max-seq-len", type=int, default=4096)
    ap.add_argument("--num-kv-blocks", type=int, default=2048,
                    help="a fixed KV pool (0: sized from free memory)")
    ap.add_argument("--out", default=str(ROOT / "perf" / "results"))
    args = ap.parse_args(argv)
    from metrale import records

    work = Path(tempfile.mkdtemp(prefix="swap-bench-"))
    models = tiny_models(work) if args.tiny else shape_models(work, args.shapes.split(","))
    if len(models) != 2:
        ap.error("--shapes names two shapes")
    write_recipes(work / "recipes", models, args)
    names = [m[0] for m in models]
    proc, url = start_server(work / "recipes", names[0], free_port(), work / "serve.log",
                             work / "events")
    try:
        import httpx

        t0 = time.monotonic()
        initial = {"to": names[0], "time_to_serve_s": round(serve_one(url, t0 + 300) - t0, 3),
                   "memory": httpx.get(url + "/v1/library", timeout=60).json()["memory"]}
        swaps = []
        for i in range(args.swaps):
            swaps.append(one_swap(url, names[(i + 1) % 2]))
            print(f"swap {i + 1}: {swaps[-1]}", flush=True)
    finally:
        proc.terminate()
        proc.wait(60)
    stamp = datetime.datetime.now().strftime("%Y%m%d_%H%M%S")
    record = {"benchmark": "hot_swap", "models": names, "device_kind": args.device,
              "num_swaps": args.swaps, "num_kv_blocks": args.num_kv_blocks,
              "max_seq_len": args.max_seq_len, "initial": initial, "swaps": swaps,
              "summary": summary(swaps, initial)}
    tag = "tiny" if args.tiny else "_".join(names)
    records.write(Path(args.out) / f"swap_{tag}_{stamp}.json", record, harness=__file__)
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
