"""Signed benchmark records: canonical JSON, provenance stamps, ed25519 signatures and what
verification reports for each way a record can go wrong. CPU only, no GPU, no network."""
from __future__ import annotations

import base64
import json
import math
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("cryptography")

from metrale import levers, records  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """A stand-in checkout (a harness, perf/keys, perf/results) and a key file outside it."""
    root = tmp_path / "repo"
    (root / "perf" / "results").mkdir(parents=True)
    (root / "perf" / "bench.py").write_text("print('benchmark')\n")
    monkeypatch.setattr(records, "ROOT", root)
    monkeypatch.setattr(records, "KEYS_DIR", root / "perf" / "keys")
    monkeypatch.setattr(records, "RESULTS_DIR", root / "perf" / "results")
    for name in ("METRALE_SIGNING_KEY_FILE", "METRALE_SIGNING_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GIT_COMMIT", "0123456789abcdef0123456789abcdef01234567")
    secret = tmp_path / "secret"
    secret.mkdir()
    key_file = secret / "signing.pem"
    kid = records.generate_key(key_file)
    monkeypatch.setenv("METRALE_SIGNING_KEY_FILE", str(key_file))
    return root, kid


def write_record(root: Path, name="ladder_x.json", **fields) -> Path:
    """A record as a harness writes it, then finished (stamped and signed)."""
    path = root / "perf" / "results" / name
    record = dict(benchmark="ladder", device="NVIDIA H200", rungs=[{"conc": 1, "tok_s": 123.25}],
                  **fields)
    path.write_text(json.dumps(record, indent=1))
    return records.finish(path, harness=root / "perf" / "bench.py")


def run_module(*args, cwd=REPO):
    env = {k: v for k, v in os.environ.items() if not k.startswith("METRALE_")}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-m", "metrale.records", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_canonical_is_stable_and_refuses_nan():
    a = {"b": 1, "a": [1.5, {"z": "é", "y": None}], "c": 0.1}
    b = {"c": 0.1, "a": [1.5, {"y": None, "z": "é"}], "b": 1}
    assert records.canonical(a) == records.canonical(b)
    assert records.canonical(a) == '{"a":[1.5,{"y":null,"z":"é"}],"b":1,"c":0.1}'.encode()
    with pytest.raises(ValueError, match=r"NaN or infinity.*\['rungs'\]\[0\]\['tok_s'\] is nan"):
        records.canonical({"rungs": [{"tok_s": math.nan}]})
    with pytest.raises(ValueError, match="inf"):
        records.canonical({"x": math.inf})


def test_finish_stamps_provenance_and_signs(tree):
    root, kid = tree
    path = write_record(root)
    rec = json.loads(path.read_text())
    assert rec["commit"] == os.environ["GIT_COMMIT"] and rec["device"] == "NVIDIA H200"
    assert rec["harness"] == "perf/bench.py" and len(rec["harness_sha256"]) == 64
    assert rec["driver"] and rec["date"].endswith("+00:00")
    assert path.read_text().startswith("{\n \"benchmark\"")        # human-readable, indent=1
    sig = json.loads(records.signature_path(path).read_text())
    assert sig["alg"] == "ed25519" and sig["key_id"] == kid and len(base64.b64decode(sig["signature"])) == 64
    assert records.verify(path) == records.Verdict(True, [])


def test_one_changed_digit_fails_and_whitespace_does_not(tree):
    root, _ = tree
    path = write_record(root)
    text = path.read_text()
    path.write_text(json.dumps(json.loads(text), indent=4, sort_keys=True) + "\n\n")
    assert records.verify(path).ok
    path.write_text(text.replace("123.25", "123.26"))
    verdict = records.verify(path)
    assert not verdict.ok and verdict.signed
    assert verdict.reasons == ["signature does not match: the record was changed after signing"]
    assert verdict.line.startswith("FAILED: signature does not match")


def test_unsigned_record_is_legacy_and_exits_zero(tree):
    root, _ = tree
    path = write_record(root)
    records.signature_path(path).unlink()
    verdict = records.verify(path)
    assert not verdict.signed and verdict.reasons == ["unsigned (legacy record)"]
    out = run_module("verify", str(path))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith(": unsigned (legacy)")


def test_unknown_key_fails(tree):
    root, kid = tree
    path = write_record(root)
    (root / "perf" / "keys" / f"{kid}.pub").unlink()
    verdict = records.verify(path)
    assert not verdict.ok and verdict.reasons[0].startswith(f"unknown key {kid}")


def test_harness_edited_or_missing_fails(tree):
    root, _ = tree
    path = write_record(root)
    harness = root / "perf" / "bench.py"
    harness.write_text("print('benchmark, tuned')\n")
    assert records.verify(path).reasons == ["harness changed since the record: perf/bench.py"]
    harness.unlink()
    assert records.verify(path).reasons == ["harness missing from the tree: perf/bench.py"]


def test_failed_verify_exits_one_and_says_which_check(tree, capsys):
    root, _ = tree
    good, bad = write_record(root, "a.json"), write_record(root, "b.json")
    bad.write_text(bad.read_text().replace("123.25", "223.25"))
    assert records.run_verify(_args(records=[], all=True)) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("a.json: ok")
    assert lines[1].endswith("b.json: FAILED: signature does not match: the record was changed "
                             "after signing")
    assert records.run_verify(_args(records=[str(good)], all=False)) == 0


def test_sign_command_signs_existing_records_without_stamping(tree, capsys):
    root, _ = tree
    path = root / "perf" / "results" / "old.json"
    path.write_text(json.dumps({"benchmark": "old", "tok_s": 1.0}, indent=1))
    assert records.run_sign(_args(records=[str(path)])) == 0
    assert json.loads(path.read_text()) == {"benchmark": "old", "tok_s": 1.0}
    assert records.verify(path).ok


def test_sign_without_a_key_is_refused(tree, monkeypatch, capsys):
    root, _ = tree
    path = write_record(root)
    monkeypatch.delenv("METRALE_SIGNING_KEY_FILE")
    assert records.run_sign(_args(records=[str(path)])) == 1
    assert "no signing key: set METRALE_SIGNING_KEY_FILE" in capsys.readouterr().err


def test_finish_without_a_key_writes_unsigned(tree, monkeypatch, caplog):
    root, _ = tree
    monkeypatch.delenv("METRALE_SIGNING_KEY_FILE")
    path = write_record(root)
    assert records.NO_KEY in caplog.text
    assert "harness_sha256" in json.loads(path.read_text())
    assert not records.verify(path).signed


def test_base64_key_lever_signs_too(tree, monkeypatch):
    root, kid = tree
    key = records.load_signing_key()
    from cryptography.hazmat.primitives import serialization
    raw = key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                            serialization.NoEncryption())
    monkeypatch.delenv("METRALE_SIGNING_KEY_FILE")
    monkeypatch.setenv("METRALE_SIGNING_KEY", base64.b64encode(raw).decode())
    assert records.verify(write_record(root)).ok
    monkeypatch.setenv("METRALE_SIGNING_KEY_FILE", "/elsewhere/key.pem")
    with pytest.raises(records.RecordError, match="set one"):
        records.load_signing_key()


def test_key_file_inside_the_repo_is_refused(tree, monkeypatch):
    root, _ = tree
    inside = root / "perf" / "signing.pem"
    with pytest.raises(records.RecordError, match="inside the repository"):
        records.generate_key(inside)
    assert not inside.exists()
    monkeypatch.setenv("METRALE_SIGNING_KEY_FILE", str(inside))
    with pytest.raises(records.RecordError, match="METRALE_SIGNING_KEY_FILE .* is inside the repository"):
        records.load_signing_key()


def test_key_file_inside_the_real_checkout_is_refused(monkeypatch):
    """The check is by path, before the file is read: nothing is written into this checkout."""
    monkeypatch.setenv("METRALE_SIGNING_KEY_FILE", str(REPO / "perf" / "keys" / "mine.pem"))
    monkeypatch.delenv("METRALE_SIGNING_KEY", raising=False)
    with pytest.raises(records.RecordError, match="inside the repository"):
        records.load_signing_key()


def test_generated_private_key_is_private(tree):
    key_file = Path(os.environ["METRALE_SIGNING_KEY_FILE"])
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    with pytest.raises(records.RecordError, match="exists"):
        records.generate_key(key_file)


def test_a_record_that_parses_two_ways_is_refused(tree):
    root, _ = tree
    path = write_record(root)
    text = path.read_text()
    path.write_text(text.replace('"benchmark": "ladder",', '"benchmark": "ladder", "benchmark": "x",'))
    assert "duplicate key(s) ['benchmark']" in records.verify(path).line
    path.write_text(text.replace("123.25", "NaN"))
    assert "NaN is not JSON" in records.verify(path).line


def test_cryptography_is_imported_only_to_sign_or_verify(tree, monkeypatch):
    out = subprocess.run([sys.executable, "-c", "import sys, metrale.records, metrale.cli; "
                          "print('cryptography' in sys.modules)"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr
    root, _ = tree
    path = write_record(root)
    for name in [m for m in sys.modules if m == "cryptography" or m.startswith("cryptography.")]:
        monkeypatch.setitem(sys.modules, name, None)
    assert "needs the cryptography package: pip install 'cryptography>=42'" in records.verify(path).line


def test_signing_levers_are_declared():
    for name in ("METRALE_SIGNING_KEY_FILE", "METRALE_SIGNING_KEY"):
        lever = levers.LEVERS[name]
        assert (lever.type, lever.default, lever.reader) == (str, "", "metrale/records.py")


def test_the_ladder_stamps_and_signs_what_it_writes(tmp_path, monkeypatch):
    """perf/ladder.py's write_record, as a run calls it, into a temporary --out."""
    import argparse
    import importlib.util
    monkeypatch.setattr(records, "KEYS_DIR", tmp_path / "keys")
    monkeypatch.delenv("METRALE_SIGNING_KEY", raising=False)
    monkeypatch.setenv("METRALE_SIGNING_KEY_FILE", str(tmp_path / "signing.pem"))
    records.generate_key(tmp_path / "signing.pem")
    spec = importlib.util.spec_from_file_location("ladder", REPO / "perf" / "ladder.py")
    ladder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ladder)
    args = argparse.Namespace(shape="tiny_llama", weights="bf16", isl=16, osl=8, reps=1,
                              prefill_graphs="on", out=str(tmp_path / "results"))
    path = ladder.write_record(args, "ladder", dict(benchmark="ladder_engine_only", device="cpu",
                                                    rungs=[]))
    rec = json.loads(path.read_text())
    assert rec["harness"] == "perf/ladder.py" and rec["device"] == "cpu"
    assert records.verify(path).ok


def test_real_results_verify_as_legacy():
    """This checkout's perf/results: every record unsigned (legacy) or ok; none FAILED."""
    out = run_module("verify", "--all")
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == len(list((REPO / "perf" / "results").glob("*.json")))
    assert not [ln for ln in lines if "FAILED" in ln]


def _args(**kw):
    import argparse
    return argparse.Namespace(**kw)
