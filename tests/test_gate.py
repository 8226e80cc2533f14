"""`met gate` on the CPU: the matrix passes on this tree, and fails on a planted throughput
regression, a planted token leak, a planted bad tool call and a planted nondeterminism; the
baseline tool's round trip. Engines in process or `met serve` subprocesses; no GPU, no network.

Throughput on a shared CPU box swings by far more than 10 % between runs (a 2-core box running
another test suite measured C = 16 at a third of its quiet figure), so the passing run compares
against the committed CPU baseline with its figures quartered: it checks the matrix end to end,
not this box's speed. The planted regression (the same baseline tripled) must fail."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from metrale import gate

REPO = Path(__file__).resolve().parents[1]
COMMITTED = REPO / "perf" / "baselines" / "cpu" / "tiny_llama.json"


@pytest.fixture(autouse=True)
def _no_signing_key(monkeypatch):
    for name in ("METRALE_SIGNING_KEY_FILE", "METRALE_SIGNING_KEY"):
        monkeypatch.delenv(name, raising=False)


def scaled_baseline(tmp_path: Path, factor: float) -> Path:
    base = json.loads(COMMITTED.read_text())
    for r in base["rungs"]:
        r["tok_s"] *= factor
    folder = tmp_path / f"baselines_x{factor}"
    (folder / "cpu").mkdir(parents=True)
    (folder / "cpu" / "tiny_llama.json").write_text(json.dumps(base))
    return folder


def run_gate(tmp_path, *args) -> tuple[int, dict]:
    out = tmp_path / "out"
    rc = gate.main(["run", "--out", str(out), *args])
    recs = sorted(out.glob("gate_*.json"))
    assert recs, "no gate record written"
    return rc, json.loads(recs[-1].read_text())


def rows(record, status=None, check=None):
    return [r for r in record["results"] if (status is None or r["status"] == status)
            and (check is None or r["check"].startswith(check))]


def test_committed_cpu_baseline_points_at_its_record():
    base = json.loads(COMMITTED.read_text())
    for src in [base["source"], *base["rungs"]]:
        path = REPO / src["record"]
        assert path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == src["sha256"]
    assert base["shape"] == "tiny_llama" and {r["concurrency"] for r in base["rungs"]} == {1, 4, 16}


def test_gate_passes_on_this_tree(tmp_path, capsys):
    rc, rec = run_gate(tmp_path, "--reps", "1", "--baseline-dir", str(scaled_baseline(tmp_path, 0.25)))
    table = capsys.readouterr().out
    assert rc == 0, table
    assert rec["passed"] and rec["benchmark"] == "gate" and rec["harness"] == "metrale/gate.py"
    assert len(rec["harness_sha256"]) == 64 and rec["commit"]
    checks = {(r["model"], r["check"]) for r in rows(rec, "pass")}
    assert {("tiny", "boot"), ("tiny", "determinism"), ("tiny", "throughput C=16"),
            ("scripted/hermes", "tools"), ("scripted/hermes", "leakage"),
            ("scripted/qwen3_coder", "tools")} <= checks
    if gate.smollm2_path() is not None:
        assert {("smollm2", "boot"), ("smollm2", "determinism"), ("smollm2", "leakage")} <= checks
    assert "status" in table and "FAIL" not in table


def test_gate_fails_on_a_planted_regression(tmp_path, capsys):
    rc, rec = run_gate(tmp_path, "--models", "tiny", "--checks", "throughput", "--retries", "0",
                       "--reps", "1", "--baseline-dir", str(scaled_baseline(tmp_path, 3.0)))
    assert rc == 1 and not rec["passed"]
    failed = rows(rec, "FAIL", "throughput")
    assert len(failed) == 3 and all(r["figures"]["ratio"] < 0.9 for r in failed)
    assert "FAIL" in capsys.readouterr().out


def test_gate_fails_without_a_baseline(tmp_path):
    rc, rec = run_gate(tmp_path, "--models", "tiny", "--checks", "throughput",
                       "--baseline-dir", str(tmp_path / "none"))
    assert rc == 1 and "no baseline" in rows(rec, "FAIL")[0]["detail"]


def test_gate_fails_on_planted_nondeterminism(tmp_path, monkeypatch):
    real = gate.tiny_core

    def noisy_core(*a, **kw):
        core = real(*a, **kw)
        forward, rng = core.model.forward, np.random.default_rng()

        def jittered(batch, caches):      # fresh noise every call: a repeat request differs
            logits = np.asarray(forward(batch, caches))
            return logits + rng.normal(0, 1.0, logits.shape).astype(logits.dtype)
        core.model.forward = jittered
        return core

    monkeypatch.setattr(gate, "tiny_core", noisy_core)
    rc, rec = run_gate(tmp_path, "--models", "tiny", "--checks", "boot,determinism")
    assert rc == 1
    [det] = rows(rec, check="determinism")
    assert det["status"] == "FAIL" and "differs" in det["detail"]


def test_gate_fails_on_planted_leak_and_bad_call(tmp_path, monkeypatch):
    """A fixture model that emits a stray `</think>` and a special-looking token into its answer,
    and one whose tool call breaks its schema: the real met serve + hermes parser path."""
    cases = [c for c in gate.TOOL_CASES if c["parser"] == "hermes"][:1] + [
        gate._case("hermes", "gate: leak probe", "The answer is 42.</think> <|fake_special|>"),
        gate._case("hermes", "gate: bad call", gate._hermes("get_weather", {"days": "three"}),
                   "get_weather", {"days": "three"}),
    ]
    monkeypatch.setattr(gate, "TOOL_CASES", cases)
    rc, rec = run_gate(tmp_path, "--models", "scripted", "--checks", "boot,leakage,tools")
    assert rc == 1
    [leak] = rows(rec, check="leakage")
    assert leak["status"] == "FAIL" and "leak probe" in leak["detail"], leak
    assert "</think>" in leak["detail"]
    [tools] = rows(rec, check="tools")
    assert tools["status"] == "FAIL" and "missing required 'city'" in tools["detail"], tools
    assert "days: expected integer" in tools["detail"]


def test_find_leaks_and_schema():
    assert gate.find_leaks("plain text, <b>bold</b>") == []
    assert gate.find_leaks("x<|im_end|>y<think>z") == ["<think>", "<|im_end|>"]
    assert gate.find_leaks('[TOOL_CALLS] <function=f>') == ["<function=", "[TOOL_CALLS]"]
    params = gate.WEATHER["function"]["parameters"]
    assert gate.schema_errors({"city": "Paris", "days": 2, "unit": "c"}, params) == []
    assert gate.schema_errors({"city": "Paris", "days": True}, params) == [
        "arguments.days: expected integer, got bool"]
    assert gate.schema_errors({"unit": "k"}, params) == [
        "arguments: missing required 'city'", "arguments.unit: 'k' not in ['c', 'f']"]


def _ladder_record(folder: Path, name: str, date: str, rungs: dict, **extra) -> Path:
    rec = dict(benchmark="ladder_engine_only", device="NVIDIA H200", shape="qwen3_5_9b",
               weights="bf16", isl=128, osl=256, commit=name * 8, date=date,
               rungs=[dict(concurrency=c, tok_s=t, ttft_p50_ms=20.0, decode_step_p50_ms=1e3 / t * c)
                      for c, t in rungs.items()])
    rec.update(extra)
    path = folder / f"ladder_{name}.json"
    path.write_text(json.dumps(rec, indent=1))
    return path


def test_baseline_round_trip(tmp_path):
    res = tmp_path / "results"
    res.mkdir()
    old = _ladder_record(res, "a", "2026-11-30T00:00:00+00:00", {1: 200.0, 8: 1400.0, 64: 7000.0})
    new = _ladder_record(res, "b", "2026-12-01T00:00:00+00:00", {1: 210.0})
    fp8 = _ladder_record(res, "c", "2026-12-01T00:00:00+00:00", {1: 300.0}, weights="fp8")
    out = tmp_path / "baselines"
    cmd = [sys.executable, "-m", "metrale.gate", "baseline", str(old), str(new), str(fp8),
           "--baseline-dir", str(out)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*.json")) == [
        "h200/qwen3_5_9b.json", "h200/qwen3_5_9b_fp8.json"]
    base = json.loads((out / "h200" / "qwen3_5_9b.json").read_text())
    assert base["source"]["record"] == str(new) and base["source"]["commit"] == "b" * 8
    assert base["source"]["sha256"] == hashlib.sha256(new.read_bytes()).hexdigest()
    assert base["source"]["signature"] == "unsigned (legacy)" and "unsigned" in base["note"]
    assert [(r["concurrency"], r["tok_s"], Path(r["record"]).name) for r in base["rungs"]] == [
        (1, 210.0, "ladder_b.json"), (8, 1400.0, "ladder_a.json"), (64, 7000.0, "ladder_a.json")]
    # the baseline gates: a rung 5 % low passes, 15 % low fails, a missing rung fails
    fresh = {1: dict(tok_s=200.0, ttft_p50_ms=20.0), 8: dict(tok_s=1190.0, ttft_p50_ms=20.0)}
    status = {r.check: r.status for r in gate.compare(fresh, base, "9b")}
    assert status == {"throughput C=1": "pass", "throughput C=8": "FAIL",
                      "throughput C=64": "FAIL"}
    # an HTTP ladder is refused
    bad = tmp_path / "http.json"
    bad.write_text(json.dumps({"benchmark": "ladder_http", "shape": "x", "rungs": []}))
    assert gate.main(["baseline", str(bad), "--baseline-dir", str(out)]) == 1


def test_met_gate_is_a_met_command():
    from metrale import cli

    args = cli.build_parser().parse_args(["gate", "--models", "tiny", "--checks", "boot"])
    assert args.command == "gate" and args.models == "tiny" and args.retries == 2


def test_results_page_from_records(tmp_path):
    res = tmp_path / "results"
    res.mkdir()
    _ladder_record(res, "a", "2026-11-30T00:00:00+00:00", {1: 200.0, 8: 1400.0})
    _ladder_record(res, "b", "2026-11-30T06:00:00+00:00", {1: 195.0, 8: 1200.0})   # C=8 -14 %
    _ladder_record(res, "c", "2026-12-01T00:00:00+00:00", {1: 185.0})    # -5 % of b: not flagged
    _ladder_record(res, "d", "2026-12-01T00:00:00+00:00", {1: 100.0}, weights="fp8")
    (res / "gate_x.json").write_text("{}")                                # not a ladder: ignored
    out = tmp_path / "page" / "RESULTS.md"
    done = subprocess.run([sys.executable, "perf/results_page.py", "--results", str(res),
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    page = out.read_text()
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "page" / "results_charts").is_dir()
    else:
        assert "matplotlib is not installed" in done.stdout and "matplotlib is not installed" in page
    regs = page.split("## Regressions")[1].split("## Ladders")[0]
    assert regs.count("| qwen3_5_9b · bf16") == 1 and "| 8 | 1,200.0 | 1,400.0 | -14.3% |" in regs
    assert "`bbbbbbb` 2026-11-30 (ladder_b.json)" in regs
    assert "### qwen3_5_9b · fp8 · NVIDIA H200 · engine-only · ISL 128 / OSL 256" in page
    # the current ladder: C=1 from c (newest), C=8 from b, each with its commit and date
    assert "| 1 | 185.0 |" in page and "`ccccccc` 2026-12-01 | ladder_c.json |" in page
    assert "| 8 | 1,200.0 |" in page and "`bbbbbbb` 2026-11-30 | ladder_b.json |" in page
    assert "**1,200.0**" in page and "unsigned (legacy)" in page


def test_gate_record_is_signed_when_a_key_is_configured(tmp_path, monkeypatch):
    pytest.importorskip("cryptography")
    from metrale import records

    keys = tmp_path / "keys"
    monkeypatch.setattr(records, "KEYS_DIR", keys)
    kid = records.generate_key(tmp_path / "signing.pem", keys_dir=keys)
    monkeypatch.setenv("METRALE_SIGNING_KEY_FILE", str(tmp_path / "signing.pem"))
    rc, _ = run_gate(tmp_path, "--models", "tiny", "--checks", "boot")
    assert rc == 0
    [path] = (tmp_path / "out").glob("gate_*.json")
    assert json.loads(records.signature_path(path).read_text())["key_id"] == kid
    assert records.verify(path) == records.Verdict(True, [])
