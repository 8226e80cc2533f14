"""Every extern "C" entry point of kernels_cuda/*.cu is declared once in Python (metrale/backends/
cuda/, `declare`) with the names and ABI types of its parameters in the order of its signature;
a declared kernel packs its named arguments at the C ABI's offsets.

The .cu files are run through nvcc's preprocessor (their entry points are macro instantiations),
then every `extern "C" __global__` signature is read. CPU only: no GPU, no CuPy."""
import ctypes
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from metrale.backends.cuda.kernels import (KernelDecl, LaunchContext, declarations, find_nvcc, parse_params,
                                           typed_kernel)

KERNEL_DIR = Path(__file__).resolve().parents[1] / "kernels_cuda"
_ENTRY = re.compile(r'extern "C" __attribute__\(\(global\)\) void\s+(?:__attribute__\(\(launch_bounds\([^)]*\)\)\)\s+)?'
                    r'(\w+)\s*\(([^)]*)\)')


def _entry_points(src: Path) -> dict[str, tuple]:
    nvcc = find_nvcc()
    assert nvcc, "nvcc not found: CI machines carry the CUDA 13 toolkit"
    res = subprocess.run([nvcc, "-E", "-x", "cu", "-arch=sm_90", "-I", str(KERNEL_DIR), str(src)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    return {m.group(1): parse_params(m.group(2)) for m in _ENTRY.finditer(res.stdout)}


@pytest.fixture(scope="module")
def entry_points() -> dict[str, dict[str, tuple]]:
    return {src.stem: _entry_points(src) for src in sorted(KERNEL_DIR.glob("*.cu"))}


def test_every_entry_point_is_declared_with_its_signature(entry_points):
    decls = declarations()
    assert sum(map(len, entry_points.values())) > 100, "the preprocessor output was not read"
    problems = []
    for module, kernels in entry_points.items():
        for fn, params in sorted(kernels.items()):
            found = [d for d in decls.get(module, ()) if d.pattern.match(fn)]
            if len(found) != 1:
                problems.append(f"{module}.cu:{fn}: {len(found)} declarations {[d.name for d in found]}")
            elif found[0].params != params:
                problems.append(f"{module}.cu:{fn}: declared {found[0].params}\n    the .cu has {params}")
    assert not problems, "kernel declarations differ from kernels_cuda/:\n" + "\n".join(problems)


def test_every_declaration_names_an_entry_point(entry_points):
    stale = [f"{d.module}:{d.name}" for module, ds in declarations().items() for d in ds
             if not any(d.pattern.match(fn) for fn in entry_points.get(module, {}))]
    assert not stale, f"declarations without a kernel: {stale}"


def test_params_read_as_their_abi_types():
    assert parse_params("const T *q, long long* out, unsigned long long e, S* state, int n, float eps") == (
        ("q", "ptr"), ("out", "ptr"), ("e", "unsigned long long"), ("state", "ptr"), ("n", "int"),
        ("eps", "float"))
    with pytest.raises(ValueError):
        parse_params("double x")


def test_declared_kernel_packs_named_arguments_at_their_abi_offsets():
    """A declared kernel on the packed path, up to the driver call (stand-in driver): each
    named value lands at its parameter pointer with the declared C type, whatever order the
    call names them in; None is NULL; a missing or unknown name is refused by the call."""
    decl = KernelDecl("t", "k", parse_params("const T* x, int a, long long b, float c, const int* p, int d"))
    seen = {}

    class Driver:
        def launch(self, func, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
            types = [ctypes.c_uint64, ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_uint64,
                     ctypes.c_int32]
            seen["values"] = [ctypes.cast(params[i], ctypes.POINTER(t)).contents.value
                              for i, t in enumerate(types)]
            seen["launch"] = (func, gx, gy, gz, bx, by, bz, smem, stream)
            return 0

    raw = SimpleNamespace(kernel=SimpleNamespace(ptr=0xABC), name="k")
    k = typed_kernel(raw, decl, LaunchContext(), Driver())
    k((3, 2), (128,), d=9, c=2.5, b=1 << 40, a=-7, p=None, x=0x1000, shared_mem=64, stream=SimpleNamespace(ptr=5))
    assert seen["values"] == [0x1000, -7, 1 << 40, 2.5, 0, 9]
    assert seen["launch"] == (0xABC, 3, 2, 1, 128, 1, 1, 64, 5)
    with pytest.raises(TypeError):
        k((1,), (1,), x=None, a=1, b=2, c=3.0, p=None, stream=SimpleNamespace(ptr=5))          # no d
    with pytest.raises(TypeError):
        k((1,), (1,), x=None, a=1, b=2, c=3.0, p=None, d=1, e=2, stream=SimpleNamespace(ptr=5))
