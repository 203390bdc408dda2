"""A stand-in for ``pynvml`` with the calls ``worker.gpus`` makes: no NVIDIA driver here."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace


class NVMLError(Exception):
    """As pynvml's: every failing call raises a subclass of it."""


@dataclass
class FakeGpu:
    name: str | bytes = "NVIDIA H100 80GB HBM3"
    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    memory_total: int = 80 * 2**30
    memory_used: int = 2**30
    utilization: int = 40
    broken: set[str] = field(default_factory=set)  # the calls that fail for this GPU


class FakeNvml:
    """NVML on a node with ``gpus``; ``missing`` as on a host without the driver."""

    NVMLError = NVMLError

    def __init__(self, gpus: list[FakeGpu], *, missing: bool = False) -> None:
        self.gpus = gpus
        self.missing = missing
        self.inits = 0
        self.shutdowns = 0
        self.count_fails = False

    def nvmlInit(self) -> None:
        if self.missing:
            raise NVMLError("NVML Shared Library Not Found")
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def _live(self) -> None:
        if self.inits <= self.shutdowns:
            raise NVMLError("Uninitialized")

    def nvmlDeviceGetCount(self) -> int:
        self._live()
        if self.count_fails:
            raise NVMLError("Unknown Error")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        self._live()
        gpu = self.gpus[index]
        if "handle" in gpu.broken:
            raise NVMLError("GPU is lost")
        return gpu

    def _ask(self, gpu: FakeGpu, call: str) -> None:
        self._live()
        if call in gpu.broken:
            raise NVMLError("Not Supported")

    def nvmlDeviceGetName(self, handle: FakeGpu) -> str | bytes:
        self._ask(handle, "name")
        return handle.name

    def nvmlDeviceGetUUID(self, handle: FakeGpu) -> str:
        self._ask(handle, "uuid")
        return handle.uuid

    def nvmlDeviceGetMemoryInfo(self, handle: FakeGpu) -> SimpleNamespace:
        self._ask(handle, "memory")
        return SimpleNamespace(total=handle.memory_total, used=handle.memory_used)

    def nvmlDeviceGetUtilizationRates(self, handle: FakeGpu) -> SimpleNamespace:
        self._ask(handle, "utilization")
        return SimpleNamespace(gpu=handle.utilization, memory=0)

    def nvmlSystemGetDriverVersion(self) -> str:
        self._live()
        return "550.54.15"

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._live()
        return 12040


def four_gpus() -> list[FakeGpu]:
    return [
        FakeGpu(uuid=f"GPU-{i}", memory_used=(i + 1) * 2**30, utilization=10 * i) for i in range(4)
    ]
