"""Every kernels_cuda/*.cu compiles for sm_90 with nvcc, and no kernel spills to local memory.

Runs on CI (no GPU needed; nvcc is on every machine). Prints a registers / shared memory /
stack / spills table of every kernel (`pytest -s` or the terminal summary shows it).
A kernel that has to spill goes into KNOWN_SPILLS with the reason, never silently.
"""
from __future__ import annotations

import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from metrale.backends.cuda import NVCC_OPTIONS, find_nvcc

KERNEL_DIR = Path(__file__).resolve().parents[1] / "kernels_cuda"
ARCH = "sm_90"
KNOWN_SPILLS: dict[str, str] = {}   # kernel name -> why spilling is accepted

_ENTRY = re.compile(r"Compiling entry function '([^']+)' for")
_PROPS = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def _compile(src: Path, nvcc: str, tmp: Path) -> tuple[Path, int, str]:
    cmd = [nvcc, f"-arch={ARCH}", "-cubin", *NVCC_OPTIONS, "-Xptxas", "-v", "-I", str(KERNEL_DIR),
           "-o", str(tmp / (src.stem + ".cubin")), str(src)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    return src, res.returncode, res.stdout + res.stderr


def parse_ptxas(log: str) -> dict[str, dict]:
    """ptxas -v output -> {kernel: {regs, smem, stack, spill_st, spill_ld}} (entry functions only)."""
    entries, props, current = set(), {}, None
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            entries.add(m.group(1))
        elif m := _PROPS.search(line):
            current = m.group(1)
            props.setdefault(current, {"regs": 0, "smem": 0, "stack": 0, "spill_st": 0, "spill_ld": 0})
        elif current and (m := _FRAME.search(line)):
            props[current].update(stack=int(m.group(1)), spill_st=int(m.group(2)), spill_ld=int(m.group(3)))
        elif current and (m := _USED.search(line)):
            props[current].update(regs=int(m.group(1)), smem=int(m.group(2) or 0))
    return {k: v for k, v in props.items() if not entries or k in entries}


def test_kernels_compile_for_sm90_without_spills(tmp_path, capsys):
    nvcc = find_nvcc()
    assert nvcc, ("nvcc not found: CI machines carry the CUDA 13 toolkit (nvcc on PATH or "
                  "/usr/local/cuda/bin/nvcc); install it or fix PATH")
    sources = sorted(KERNEL_DIR.glob("*.cu"))
    assert sources, f"no .cu files in {KERNEL_DIR}"
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda s: _compile(s, nvcc, tmp_path), sources))
    failed = [f"--- {src.name} (exit {rc})\n{log}" for src, rc, log in results if rc != 0]
    assert not failed, "nvcc failed:\n" + "\n".join(failed)

    rows, spills = [], []
    for src, _, log in results:
        kernels = parse_ptxas(log)
        assert kernels, f"{src.name}: no kernels found in ptxas -v output:\n{log}"
        for name, p in sorted(kernels.items()):
            rows.append((src.name, name, p))
            if (p["spill_st"] or p["spill_ld"]) and name not in KNOWN_SPILLS:
                spills.append(f"{src.name}:{name} spills {p['spill_st']} B stores / {p['spill_ld']} B loads")
    with capsys.disabled():
        print(f"\n{'file':<18} {'kernel':<34} {'regs':>5} {'smem':>6} {'stack':>6} {'spill st/ld':>12}")
        for f, name, p in rows:
            print(f"{f:<18} {name:<34} {p['regs']:>5} {p['smem']:>6} {p['stack']:>6} "
                  f"{p['spill_st']:>5}/{p['spill_ld']:<6}")
    assert not spills, "local-memory spills in hot kernels:\n" + "\n".join(spills)


@pytest.mark.parametrize("name", ["elementwise", "attention"])
def test_backend_kernel_names_exist(name, tmp_path):
    """The symbols CudaOps launches are exported (extern "C") by the compiled cubin."""
    nvcc = find_nvcc()
    assert nvcc, "nvcc not found"
    src, rc, log = _compile(KERNEL_DIR / f"{name}.cu", nvcc, tmp_path)
    assert rc == 0, log
    kernels = parse_ptxas(log)
    want = {
        "elementwise": [f"{k}_{s}" for s in ("bf16", "f32") for k in
                        ("embedding", "rms_norm_vec", "rms_norm_scalar", "head_norm_rope", "silu_mul",
                         "sigmoid_mul", "write_kv", "bias_add")],
        "attention": ["decode_reduce"] + [f"prefill_mma_d{d}" for d in (64, 128, 256)]
                     + [f"decode_mma_d{d}_h{h}" for d in (64, 128, 256) for h in (1, 2)],
    }[name]
    missing = [k for k in want if k not in kernels]
    assert not missing, f"{name}.cu does not export {missing}"


# -- programmatic dependent launch: the rule of kernels_cuda/common.cuh -------------------------
# metrale/backends/cuda/kernels.py launches every kernel but the self-test with the PDL attribute, so a
# kernel may start while the previous one still writes. Each entry point therefore has to wait
# (griddepcontrol.wait) before it touches memory; the only accesses allowed ahead of the wait are
# read-only-path loads of weights, and only in the kernels listed here (their header says why).
_PDL_EXEMPT = {"launch_selftest"}                      # launched plainly (metrale/backends/cuda/kernels.py)
# gemv.cu, gemv_quant.cu: their first round of weight loads
_PRE_WAIT_WEIGHT_LOADS = re.compile(r"^(gemv_t\d+_r\d+_(bf16|f16|bf16_f32)|gem[vm]q_(fp8|nvfp4)_[tm]\d+_[rw]\d+(_f32)?)$")
_MEM = re.compile(r"\b(ld\.global|st\.global|atom\.|red\.|cp\.async|cp\.reduce|ld\.volatile|st\.volatile|"
                  r"ld\.relaxed|ld\.acquire|st\.release|tex\.|suld|sust|ld\.(?!param|shared|local|const)\w*)")


def _ptx_entries(ptx: str) -> dict[str, str]:
    """{entry name: its body text} of a PTX module."""
    heads = list(re.finditer(r"\.entry\s+(\w+)\s*\(", ptx))
    return {m.group(1): ptx[m.end(): heads[i + 1].start() if i + 1 < len(heads) else len(ptx)]
            for i, m in enumerate(heads)}


@pytest.fixture(scope="module")
def kernel_ptx(tmp_path_factory) -> list[tuple[Path, str]]:
    """[(source, its PTX for sm_90)] of every .cu in kernels_cuda/, built once for this module."""
    nvcc = find_nvcc()
    assert nvcc, "nvcc not found"
    tmp = tmp_path_factory.mktemp("ptx")

    def ptx_of(src: Path) -> tuple[Path, int, str]:
        out = tmp / (src.stem + ".ptx")
        res = subprocess.run([nvcc, f"-arch={ARCH}", "-ptx", *NVCC_OPTIONS, "-I", str(KERNEL_DIR), "-o",
                              str(out), str(src)], capture_output=True, text=True)
        return src, res.returncode, out.read_text() if res.returncode == 0 else res.stderr

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(ptx_of, sorted(KERNEL_DIR.glob("*.cu"))))
    for src, rc, text in results:
        assert rc == 0, f"{src.name}: {text}"
    return [(src, text) for src, _rc, text in results]


def test_every_kernel_waits_for_its_predecessor_before_touching_memory(kernel_ptx):
    bad, checked = [], 0
    for src, text in kernel_ptx:
        for name, body in _ptx_entries(text).items():
            if name in _PDL_EXEMPT:
                continue
            checked += 1
            wait = body.find("griddepcontrol.wait")
            if wait < 0:
                bad.append(f"{src.name}:{name}: no griddepcontrol.wait")
                continue
            for line in body[:wait].splitlines():
                line = line.strip()
                if not _MEM.search(line) or line.startswith("//"):
                    continue
                if _PRE_WAIT_WEIGHT_LOADS.match(name) and "ld.global.nc" in line:
                    continue
                bad.append(f"{src.name}:{name}: memory access before griddepcontrol.wait: {line}")
                break
    assert checked > 30, f"only {checked} entry points found"
    assert not bad, "kernels that break the PDL rule (kernels_cuda/common.cuh):\n" + "\n".join(bad)


# The non-coherent read-only path (ld.global.nc) is undefined for data that changes while the
# kernel runs, and under PDL the previous kernel may still be writing a kernel's inputs: on the
# H200 that read stale activations (kernels_cuda/common.cuh). The one allowed form is the weight
# loader mt::ldg16_if<true> (ld.global.nc.L1::no_allocate); nvcc emits plain ld.global.nc for a
# `const T* __restrict__` parameter, which is how one would come back.
_NC_WEIGHT_LOAD = "ld.global.nc.L1::no_allocate."
# sincosf's slow path (|x| large) reads the math library's constant table __cudart_i2opi_f with one
# 32-bit ld.global.nc in its reduction loop: constant data, allowed once per inlined copy (each
# takes the table's address with one mov)
_MATH_TABLE, _MATH_TABLE_LOAD = "__cudart_i2opi_f", "ld.global.nc.u32"


def test_no_kernel_reads_activations_through_the_non_coherent_path(kernel_ptx):
    bad, weight_loads = [], 0
    for src, text in kernel_ptx:
        for name, body in _ptx_entries(text).items():
            table_loads = body.count(f", {_MATH_TABLE};")
            for line in body.splitlines():
                line = line.strip()
                if "ld.global.nc" not in line or line.startswith("//"):
                    continue
                if _NC_WEIGHT_LOAD in line:
                    weight_loads += 1
                    continue
                if table_loads and line.startswith(_MATH_TABLE_LOAD):
                    table_loads -= 1
                    continue
                bad.append(f"{src.name}:{name}: {line}")
                break
    assert weight_loads > 0, "the weight loader's ld.global.nc.L1::no_allocate is gone: is the check still valid?"
    assert not bad, "non-coherent loads outside the weight loader (kernels_cuda/common.cuh):\n" + "\n".join(bad)
