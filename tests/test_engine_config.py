"""Engine settings that can never work are refused up front with the setting named, not by an
exception from deep inside the first step or graph capture."""
import pytest

from metrale import backends
from metrale.config import ConfigError, EngineConfig


def test_unknown_dtype_is_refused():
    with pytest.raises(ConfigError, match="dtype"):
        EngineConfig(dtype="float8").validate()
    for ok in ("auto", "bfloat16", "bf16", "float32"):
        EngineConfig(dtype=ok).validate()


def test_float32_on_cuda_is_refused_before_any_kernel(monkeypatch):
    # the CUDA attention kernels and KV cache are bf16: float32 there failed at graph capture
    monkeypatch.setattr(backends, "cuda_available", lambda: True)
    with pytest.raises(ConfigError, match="bfloat16 only"):
        backends.make_ops(EngineConfig(device="cuda", dtype="float32").validate())
    with pytest.raises(ConfigError, match="bfloat16 only"):
        backends.make_ops(EngineConfig(device="auto", dtype="float32").validate())


def test_float32_on_cpu_is_the_reference():
    assert backends.make_ops(EngineConfig(device="cpu", dtype="float32").validate()).name == "cpu"
