import pytest


def _have_gpu() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


HAVE_GPU = _have_gpu()


def pytest_collection_modifyitems(config, items):
    if HAVE_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (runs in perf/gpu_run.sh on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
