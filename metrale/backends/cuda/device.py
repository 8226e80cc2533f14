"""CudaDevice: the GPU as the engine core sees it (metrale.backends.base.Device): the engine's
stream, synchronisation, memory figures, CuPy's out-of-memory error and its cached blocks."""
from __future__ import annotations

from metrale.backends.base import Device


class CudaDevice(Device):
    accelerator = True

    def __init__(self, cp, index: int | None = None):
        self.cp = cp
        self.gpu = cp.cuda.Device(index) if index is not None else cp.cuda.Device()
        self.gpu.use()
        self.id = self.gpu.id
        self.compute_capability = self.gpu.compute_capability
        self.out_of_memory = (cp.cuda.memory.OutOfMemoryError,)

    def use(self) -> None:
        self.gpu.use()

    def new_stream(self):
        # a blocking stream: work that callers put on the legacy stream (tests, tools) stays
        # ordered with the engine's
        return self.cp.cuda.Stream(non_blocking=False)

    def synchronize(self) -> None:
        self.cp.cuda.runtime.deviceSynchronize()

    def memory_info(self) -> tuple[int, int]:
        free, total = self.cp.cuda.runtime.memGetInfo()
        return int(free), int(total)

    def pool_bytes(self) -> int:
        return int(self.cp.get_default_memory_pool().total_bytes())

    def memory_figures(self) -> dict:
        free, total = self.memory_info()
        pool = self.cp.get_default_memory_pool()
        return dict(device_used_bytes=int(total - free), device_total_bytes=int(total),
                    pool_used_bytes=int(pool.used_bytes()), pool_total_bytes=int(pool.total_bytes()))

    def free_cached(self, pools=()) -> None:
        cp = self.cp
        for pool in pools:
            pool.free_all_blocks()
        cp.get_default_memory_pool().free_all_blocks()
        cp.get_default_pinned_memory_pool().free_all_blocks()
        plan_cache = getattr(getattr(cp, "fft", None), "config", None)
        if plan_cache is not None:
            plan_cache.get_plan_cache().clear()
