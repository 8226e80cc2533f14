"""Every METRALE_* environment variable, declared once: type, default, the flag that shadows it
(if any), the module that reads it, and what it does.

`met` refuses to start when the environment carries a METRALE_* name that is not declared here:
it is a typo or a lever that no longer exists, and running as if it applied would mislabel
whatever was measured. `met dump-serve-options` prints this table.
"""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Lever:
    name: str
    type: type
    default: object
    reader: str
    doc: str
    flag: str | None = None


LEVERS: dict[str, Lever] = {lv.name: lv for lv in (
    Lever("METRALE_MAX_BODY_BYTES", int, 32 * 2**20, "frontends/app.py",
          "largest accepted request body in bytes; larger bodies get 413"),
    Lever("METRALE_MAX_HEADER_BYTES", int, 16 * 1024, "frontends/limits.py",
          "largest accepted total size of request headers; larger get 431"),
    Lever("METRALE_BODY_TIMEOUT_S", float, 30.0, "frontends/limits.py",
          "seconds a client may take to send its request head, and then its body, before it "
          "is cut off with 408"),
    Lever("METRALE_MAX_MESSAGES", int, 2048, "frontends/limits.py",
          "most entries accepted in a request's 'messages' array; more get 400"),
    Lever("METRALE_STORE_SNAPSHOT_EVERY", int, 20000, "metrale/engine_server.py",
          "store events (stored responses, conversation changes) after which the engine writes "
          "a new store snapshot; a restart reads it and the journal after it"),
    Lever("METRALE_RATE_LIMIT_RPM", int, 0, "metrale/ratelimit.py",
          "requests per minute per key (per client address when auth is off); 0 = off"),
    Lever("METRALE_RATE_LIMIT_TPM", int, 0, "metrale/ratelimit.py",
          "tokens (prompt + max_tokens) per minute per key; 0 = off"),
    Lever("METRALE_RATE_LIMIT_BURST_RPM", int, 0, "metrale/ratelimit.py",
          "request bucket capacity; 0 = the RPM cap"),
    Lever("METRALE_RATE_LIMIT_BURST_TPM", int, 0, "metrale/ratelimit.py",
          "token bucket capacity; 0 = the TPM cap"),
    Lever("METRALE_RATE_LIMIT_MAX_KEYS", int, 10_000, "metrale/ratelimit.py",
          "most keys the rate limiter tracks; the least recently seen is dropped beyond it"),
    Lever("METRALE_LOG_LEVEL", str, "info", "metrale/cli.py", "debug | info | warning | error"),
    Lever("METRALE_KERNEL_CACHE", str, "", "metrale/backends/cuda/kernels.py",
          "directory of compiled CUDA kernels; empty = ~/.cache/metrale/kernels"),
    Lever("METRALE_KERNELS_DIR", str, "", "metrale/backends/cuda/kernels.py",
          "directory of the .cu sources; empty = kernels_cuda/ of this checkout"),
    Lever("METRALE_CUBLAS", str, "", "metrale/backends/cuda/gemm/cublas.py",
          "path of libcublas to load; empty = the nvidia pip package, cupy's or the toolkit's"),
    Lever("METRALE_FP8_W8A8", str, "1", "metrale/backends/cuda/gemm/quant.py",
          "1: block-FP8 weights (128 x 128 scales) multiply prefill rows (> 64) as W8A8 on FP8 "
          "tensor cores, activations quantized per row and 128 columns; 0: they dequantise into "
          "bf16 for those rows (weight-only, the CPU backend's numerics)"),
    Lever("METRALE_QUANT_GEMV", str, "v1", "metrale/backends/cuda/gemm/quant.py",
          "decode kernels for 1-8 rows of FP8 / NVFP4 weights: v1 = the CUDA-core GEMVs and the "
          "x-as-A tensor-core GEMMs; v2 = the autotuner also times the tensor-core GEMVs with the "
          "weights as the mma's A operand (gemvq_*_t8_w*). H200 bcb35a5: v2 passes every GPU test "
          "and lifts NVFP4 M=1 on the wide shapes (0.41 -> 0.58 of copy bandwidth) but loses on "
          "4096 x 4096 (0.47 -> 0.33 FP8): v1 stays the default until the tuner picks right"),
    Lever("METRALE_GEMM_TUNE", str, "1", "metrale/backends/cuda/gemm/__init__.py",
          "1 = linear GEMMs through cuBLASLt, each decode-sized shape autotuned once (outside "
          "graph capture) over the heuristic's algorithms and cublasGemmEx; 0 = plain "
          "cublasGemmEx (CUBLAS_GEMM_DEFAULT) everywhere"),
    Lever("METRALE_FAST_LAUNCH", str, "1", "metrale/backends/cuda/kernels.py",
          "1 = eager CUDA kernels launched through cuLaunchKernel with packed arguments (after a "
          "self-test); 0 = CuPy's RawKernel launch"),
    Lever("METRALE_PDL", str, "1", "metrale/backends/cuda/kernels.py",
          "1 = in captured CUDA graphs on sm_90+, each of our kernels that follows another of "
          "ours gets a programmatic edge (it launches while that one drains and waits for its "
          "inputs in-kernel: kernels_cuda/README.md); 0 = plain stream order"),
    Lever("METRALE_MODEL_PLUGINS", str, "", "metrale/engine_process.py",
          "tests only: comma-separated modules the engine process imports before it loads the "
          "model; they add fixture models with metrale.models.registry.register (e.g. "
          "tests.scripted_model); empty = none"),
    Lever("METRALE_SIGNING_KEY_FILE", str, "", "metrale/records.py",
          "path of the ed25519 private key (PEM PKCS#8, or the raw 32 bytes) that signs benchmark "
          "records (perf/results/*.json.sig); refused inside the repository; empty = see "
          "METRALE_SIGNING_KEY, else records are written unsigned"),
    Lever("METRALE_SIGNING_KEY", str, "", "metrale/records.py",
          "base64 of the raw 32-byte ed25519 private key that signs benchmark records (for a "
          "machine without a key file); set this or METRALE_SIGNING_KEY_FILE, not both"),
    Lever("METRALE_SPEC_MAX_BATCH", int, 32, "metrale/spec/__init__.py",
          "speculative decoding turns itself off while more than this many sequences decode (a "
          "verify's extra rows cost more than they gain in wide batches); also sizes the GDN "
          "verify rows of the state pool"),
    Lever("METRALE_SPEC_ADAPTIVE", int, 1, "metrale/spec/adaptive.py",
          "speculative decoding: each request drafts the count its own acceptance pays for, and "
          "none (with probes every 1, 2, 4 ... 32 steps) while drafts cost more than they gain; "
          "0 = always the configured count (benchmarks of the raw mechanics)"),
    Lever("METRALE_SPEC_DRAFT_COST", float, 0.08, "metrale/spec/adaptive.py",
          "a verify row's cost in decode steps, for METRALE_SPEC_ADAPTIVE (H200, Qwen3.5-9B, "
          "C=1: a verify of 3 drafts is 1.23x a decode step)"),
    Lever("METRALE_MTP_K_LADDER", str, "", "metrale/spec/__init__.py",
          "drafts per verify by batch size, BATCH:DRAFTS pairs (e.g. 1:3,2:1,4:2,8:2,16:1): a "
          "step of B decoding sequences takes the entry of the largest BATCH <= B; empty = "
          "--num-drafts at every batch size"),
    Lever("METRALE_SELF_SPEC_SKIP", str, "auto", "metrale/spec/self_spec.py",
          "--self-speculative: the layers its drafts skip, comma-separated indices, auto "
          "(every other layer of the middle half) or none (tests: the whole model drafts)"),
    Lever("METRALE_RECIPES_PATH", str, "", "metrale/recipes/__init__.py",
          "more recipe folders (os.pathsep-separated), searched before the shipped recipes by "
          "`met list/show/run`, the Library and hot swap; empty = the shipped ones only"),
    Lever("METRALE_SWAP_DRAIN_TIMEOUT_S", float, 300.0, "metrale/swap.py",
          "a hot swap waits this long for the requests in flight to finish on the old model; "
          "those still running then are aborted (finish reason abort) and the swap goes on"),
    Lever("METRALE_CUDA_POISON", str, "", "metrale/backends/cuda/ops.py",
          "1 = fill every new CUDA op output with NaN first (tests: catches unwritten outputs)"),
)}


class UndeclaredLeverError(RuntimeError):
    pass


def check_environment(environ=None) -> None:
    """Refuse METRALE_* names that are not declared."""
    environ = os.environ if environ is None else environ
    unknown = sorted(k for k in environ if k.startswith("METRALE_") and k not in LEVERS)
    if unknown:
        raise UndeclaredLeverError(
            f"unknown environment lever(s) {', '.join(unknown)}: not declared in metrale/levers.py "
            f"(a typo, or a lever that no longer exists). Declared: {', '.join(sorted(LEVERS))}")


def get(name: str, environ=None):
    """The lever's value from the environment, parsed to its type, else its default."""
    lever = LEVERS[name]
    raw = (os.environ if environ is None else environ).get(name)
    if raw is None or raw == "":
        return lever.default
    try:
        return lever.type(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a valid {lever.type.__name__}") from None


def table() -> list[dict]:
    return [{"name": lv.name, "type": lv.type.__name__, "default": lv.default, "flag": lv.flag,
             "reader": lv.reader, "doc": lv.doc} for lv in LEVERS.values()]
