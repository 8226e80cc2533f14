"""`met doctor` (metrale/doctor.py): one run as a command on this machine (CPU CI: no GPU, nvcc
present), nvidia-smi output read from canned lines (GPUs this machine does not have), the port
check against a socket the test holds, and a check that raises reported as its line."""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from metrale import doctor

REPO = Path(__file__).resolve().parents[1]
CHECKS = ["python", "gpu", "cuda", "nvcc", "kernel-cache", "cython", "disk", "hf-cache", "port"]

H200 = "NVIDIA H200, 570.86.15, 143771 MiB, 143180 MiB, 9.0"
RTX_3090 = "NVIDIA GeForce RTX 3090, 550.54.14, 24576 MiB, 23800 MiB, 8.6"


@pytest.fixture
def listening_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.fixture(scope="module")
def busy_port_run():
    """`python -m metrale.doctor --json --port P` while the test listens on P."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        cmd = [sys.executable, "-m", "metrale.doctor", "--json", "--port", str(port)]
        out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    return port, out


def test_the_command_passes_here_with_every_check_once_in_order(busy_port_run):
    _, out = busy_port_run
    assert out.returncode == 0, out.stdout + out.stderr
    checks = json.loads(out.stdout)
    assert [c["check"] for c in checks] == CHECKS
    for c in checks:
        assert set(c) == {"check", "status", "detail", "fix"}
        assert c["status"] in ("ok", "warn"), c
        assert c["detail"] and bool(c["fix"]) == (c["status"] != "ok"), c


def test_the_cython_extension_is_found(busy_port_run):
    checks = {c["check"]: c for c in json.loads(busy_port_run[1].stdout)}
    assert checks["cython"]["status"] == "ok", checks["cython"]


def test_a_taken_port_is_a_warning_naming_the_flag(busy_port_run):
    port, out = busy_port_run
    check = {c["check"]: c for c in json.loads(out.stdout)}["port"]
    assert check["status"] == "warn"
    assert f"port {port} is in use" in check["detail"] and "--port" in check["fix"]


def test_a_free_port_is_ok(listening_port):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]           # closed again: free (a listener elsewhere is not)
    assert doctor.check_port(free, "127.0.0.1").status == "ok"
    assert doctor.check_port(listening_port, "127.0.0.1").status == "warn"


def test_no_nvidia_smi_is_a_warning_with_the_cpu_backend(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    found = doctor.check_gpu()
    assert found.status == "warn" and "no NVIDIA GPU" in found.detail
    assert "met serve --device cpu" in found.fix


def test_an_sm90_gpu_is_ok():
    gpus = doctor.parse_nvidia_smi(H200 + "\n")
    assert gpus == [doctor.Gpu(0, "NVIDIA H200", "570.86.15", 143771, 143180, (9, 0))]
    found = doctor.judge_gpus(gpus, 0.9)
    assert found.status == "ok"
    assert "NVIDIA H200" in found.detail and "compute 9.0" in found.detail
    assert "139.8 of 140.4 GiB free" in found.detail


def test_a_compute_86_gpu_warns_to_serve_on_the_cpu():
    found = doctor.judge_gpus(doctor.parse_nvidia_smi(RTX_3090), 0.9)
    assert found.status == "warn" and "compute 8.6" in found.detail
    assert "--device cpu" in found.fix


def test_mixed_gpus_name_the_usable_ones():
    found = doctor.judge_gpus(doctor.parse_nvidia_smi(f"{RTX_3090}\n{H200}\n"), 0.9)
    assert found.status == "warn" and "GPU 0 is compute 8.6" in found.detail
    assert "CUDA_VISIBLE_DEVICES=1" in found.fix


def test_nvidia_smi_oddities_are_read():
    gpus = doctor.parse_nvidia_smi("Acme, Inc. GPU, 580.1, [N/A], [N/A], 10.0\n\n")
    assert gpus == [doctor.Gpu(0, "Acme, Inc. GPU", "580.1", None, None, (10, 0))]
    assert doctor.judge_gpus(gpus, 0.9).status == "ok"
    with pytest.raises(ValueError):
        doctor.parse_nvidia_smi("garbage")


def test_no_gpu_listed_and_a_full_gpu_are_warnings():
    assert doctor.judge_gpus([], 0.9).status == "warn"
    busy = doctor.parse_nvidia_smi("NVIDIA H200, 570.86.15, 143771 MiB, 12000 MiB, 9.0")
    found = doctor.judge_gpus(busy, 0.9)
    assert found.status == "warn" and "--gpu-memory-utilization" in found.fix


def test_version_helpers():
    assert doctor.python_meets(">=3.10", (3, 11, 7))
    assert not doctor.python_meets(">=3.10", (3, 9, 1))
    assert doctor.python_meets("", (3, 8, 0))
    assert doctor.cuda_version(13000) == "13.0" and doctor.cuda_version(12040) == "12.4"
    assert "cupy-cuda12x" in doctor.cupy_hint(12040) and "cupy-cuda13x" in doctor.cupy_hint(13000)


def test_a_check_that_raises_is_reported_not_propagated(monkeypatch, listening_port):
    def boom():
        raise RuntimeError("the probe exploded")

    monkeypatch.setattr(doctor, "check_kernel_cache", boom)
    checks = doctor.run_checks(listening_port, "127.0.0.1")
    assert [c.check for c in checks] == CHECKS
    raised = checks[CHECKS.index("kernel-cache")]
    assert raised.status == "fail" and "RuntimeError: the probe exploded" in raised.detail
    assert raised.fix
    assert doctor.exit_status(checks) == 1


def test_text_lines_carry_the_fix(capsys, monkeypatch, listening_port):
    monkeypatch.setattr(doctor, "check_kernel_cache", lambda: doctor.ok("skipped here"))
    assert doctor.main(["--port", str(listening_port)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(CHECKS) + 1 and lines[-1].endswith("0 fail")
    port_line = next(ln for ln in lines if ln.split()[1] == "port")
    assert port_line.startswith("warn") and "-> pass --port N" in port_line


def test_register_adds_the_subcommand_with_met_serves_defaults():
    from metrale.cli import DEFAULT_HOST, DEFAULT_PORT

    parser = argparse.ArgumentParser(prog="met")
    doctor.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["doctor", "--json"])
    assert (args.command, args.port, args.host, args.json) == ("doctor", DEFAULT_PORT,
                                                                DEFAULT_HOST, True)
