"""This node's GPUs: what the agent offers the controller, what it reports of their use,
and what each attempt's workers are given of them.

The agent neither imports torch nor initialises CUDA: it asks NVML, the driver's
management library (``pynvml``), which answers without a CUDA context. NVML is
initialised once when the agent starts (``GpuInventory.open``) and shut down when it
stops (``close``); each heartbeat then costs two queries per GPU (``usage``).

Indices are NVML's, which numbers GPUs in PCI bus order. CUDA numbers them fastest
first unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, which the agent sets for every attempt's
workers (``device_variables``), so that an index means the same GPU to both.

Where NVML is missing (no NVIDIA driver: ``libnvidia-ml.so`` cannot be loaded) or fails,
the node offers no GPU, unless RELAUNCH_AGENT_GPUS lists indices: those are trusted as
GPUs of unknown model. ``CUDA_VISIBLE_DEVICES`` is no security boundary: it decides
what CUDA enumerates, not which ``/dev/nvidia*`` files a job's processes may open.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Protocol, TypeVar, cast

from contract.protocol import (
    CUDA_VISIBLE_DEVICES_ENV,
    DEVICE_ENV,
    Assignment,
    Device,
    GpuInfo,
    GpuUsage,
)

logger = logging.getLogger(__name__)

CUDA_DEVICE_ORDER_ENV = "CUDA_DEVICE_ORDER"
OMP_NUM_THREADS_ENV = "OMP_NUM_THREADS"
# What the agent sets for an attempt's workers whatever the job's env asks.
AGENT_DEVICE_VARIABLES = frozenset({DEVICE_ENV, CUDA_VISIBLE_DEVICES_ENV, CUDA_DEVICE_ORDER_ENV})
_NAME_MAX = 128  # contract.protocol.GpuInfo.name and .uuid
_DRIVER_MAX = 64  # contract.protocol.NodeRegister.gpu_driver
_MAX_BYTES = 2**50  # contract.protocol.GpuInfo and GpuUsage
T = TypeVar("T")


class Nvml(Protocol):
    """The part of ``pynvml`` the agent calls; tests hand in a fake with these names."""

    @property
    def NVMLError(self) -> type[Exception]: ...  # what every failing call raises

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlDeviceGetCount(self) -> int: ...
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any: ...
    def nvmlDeviceGetName(self, handle: Any) -> str | bytes: ...
    def nvmlDeviceGetUUID(self, handle: Any) -> str | bytes: ...
    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any: ...  # .total, .used: bytes
    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any: ...  # .gpu: percent
    def nvmlSystemGetDriverVersion(self) -> str | bytes: ...
    def nvmlSystemGetCudaDriverVersion(self) -> int: ...  # 12040 for CUDA 12.4


def load_nvml() -> Nvml | None:
    """The ``pynvml`` module, or None if it is not installed. Loading it loads no
    library: ``nvmlInit`` does, and fails where there is no NVIDIA driver."""
    try:
        import pynvml
    except ImportError:
        return None
    return cast(Nvml, pynvml)


def cuda_version_text(version: int) -> str:
    """NVML's CUDA driver version as CUDA writes it: 12040 -> ``12.4``."""
    return f"{version // 1000}.{version % 1000 // 10}"


def _text(value: str | bytes, limit: int) -> str:
    """What NVML wrote, as the wire takes it: text, no NUL, at most ``limit`` characters."""
    text = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
    return text.replace("\x00", "").strip()[:limit]


def _bytes(value: int) -> int:
    return min(_MAX_BYTES, max(0, int(value)))


class GpuInventory:
    """The GPUs this agent offers, found once; ``usage`` reads their use at each heartbeat.

    ``nvml`` is None when the GPUs were not found through NVML (none offered, or listed
    by RELAUNCH_AGENT_GPUS where NVML is missing): their use is then unknown.
    """

    def __init__(
        self,
        gpus: Sequence[GpuInfo] = (),
        *,
        driver: str | None = None,
        cuda_version: str | None = None,
        nvml: Nvml | None = None,
        handles: Mapping[int, Any] | None = None,
    ) -> None:
        self.gpus = tuple(gpus)
        self.driver = driver
        self.cuda_version = cuda_version
        self._nvml = nvml
        self._handles = dict(handles or {})
        self._failing: set[int] = set()

    @property
    def indices(self) -> tuple[int, ...]:
        return tuple(gpu.index for gpu in self.gpus)

    @classmethod
    def open(cls, selection: tuple[int, ...] | None, nvml: Nvml | None) -> GpuInventory:
        """The GPUs that ``selection`` (AgentSettings.gpus) picks of those NVML finds.

        ``selection`` None: every GPU NVML finds, none where NVML is missing or fails;
        ``()``: none, without asking NVML; indices: those, and ``ValueError`` if
        NVML works but does not find one of them. Where NVML is missing, listed indices
        are taken on trust. A GPU NVML finds but cannot open is left out (warning).
        """
        if selection == ():
            logger.info("GPUs: none offered (RELAUNCH_AGENT_GPUS=none)")
            return cls()
        if nvml is None:
            return cls._without_nvml(selection, "the pynvml module is not installed")
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            return cls._without_nvml(selection, f"NVML cannot start: {exc}")
        try:
            inventory = cls._found(nvml, selection)
        except BaseException:
            _shut_down(nvml)
            raise
        if inventory._nvml is None or not inventory.gpus:
            _shut_down(nvml)  # nothing to ask it about
            inventory._nvml = None
        return inventory

    @classmethod
    def _without_nvml(cls, selection: tuple[int, ...] | None, why: str) -> GpuInventory:
        if selection is None:
            logger.info("GPUs: none (%s)", why)
            return cls()
        logger.info(
            "GPUs: %s as RELAUNCH_AGENT_GPUS lists them, of unknown model (%s)",
            ",".join(map(str, selection)),
            why,
        )
        return cls([GpuInfo(index=index) for index in selection])

    @classmethod
    def _found(cls, nvml: Nvml, selection: tuple[int, ...] | None) -> GpuInventory:
        try:
            count = nvml.nvmlDeviceGetCount()
        except nvml.NVMLError as exc:
            return cls._without_nvml(selection, f"NVML cannot count the GPUs: {exc}")
        if selection is not None:
            missing = sorted(set(selection) - set(range(count)))
            if missing:
                raise ValueError(
                    f"RELAUNCH_AGENT_GPUS names GPU(s) {','.join(map(str, missing))}, "
                    f"but NVML finds {count} GPU(s) on this node (indices from 0)"
                )
        wanted = range(count) if selection is None else selection
        gpus: list[GpuInfo] = []
        handles: dict[int, Any] = {}
        for index in wanted:
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
            except nvml.NVMLError as exc:
                logger.warning("GPU %d left out: NVML cannot open it: %s", index, exc)
                continue
            handles[index] = handle
            gpus.append(_describe(nvml, index, handle))
        driver = _ask(
            nvml,
            "the driver version",
            lambda: _text(nvml.nvmlSystemGetDriverVersion(), _DRIVER_MAX),
        )
        cuda = _ask(
            nvml,
            "the CUDA driver version",
            lambda: cuda_version_text(nvml.nvmlSystemGetCudaDriverVersion()),
        )
        logger.info(
            "GPUs: %d of %d found by NVML (driver %s, CUDA %s): %s",
            len(gpus),
            count,
            driver,
            cuda,
            ", ".join(f"{g.index} {g.name or 'unknown model'}" for g in gpus) or "none",
        )
        return cls(gpus, driver=driver, cuda_version=cuda, nvml=nvml, handles=handles)

    def usage(self) -> list[GpuUsage]:
        """Each GPU's use now; a field NVML cannot answer is None, for that GPU only."""
        nvml = self._nvml
        if nvml is None:
            return [GpuUsage(index=index) for index in self.indices]
        found = []
        for index in self.indices:
            handle = self._handles[index]
            errors: list[str] = []
            utilization: float | None = None
            memory_used: int | None = None
            try:
                utilization = min(
                    100.0, max(0.0, float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu))
                )
            except nvml.NVMLError as exc:
                errors.append(f"utilization: {exc}")
            try:
                memory_used = _bytes(nvml.nvmlDeviceGetMemoryInfo(handle).used)
            except nvml.NVMLError as exc:
                errors.append(f"memory: {exc}")
            self._note_failures(index, errors)
            found.append(
                GpuUsage(index=index, utilization_pct=utilization, memory_used_bytes=memory_used)
            )
        return found

    def _note_failures(self, index: int, errors: list[str]) -> None:
        """Log a GPU's failing queries when they start failing and when they recover, not
        at every heartbeat."""
        if errors and index not in self._failing:
            self._failing.add(index)
            logger.warning("GPU %d: NVML cannot read its use (%s)", index, "; ".join(errors))
        elif not errors and index in self._failing:
            self._failing.discard(index)
            logger.info("GPU %d: NVML reads its use again", index)

    def close(self) -> None:
        """Shut NVML down (once; later ``usage`` reports unknown use)."""
        nvml, self._nvml = self._nvml, None
        self._handles.clear()
        if nvml is not None:
            _shut_down(nvml)


def _describe(nvml: Nvml, index: int, handle: Any) -> GpuInfo:
    name = _ask(
        nvml, f"GPU {index}'s name", lambda: _text(nvml.nvmlDeviceGetName(handle), _NAME_MAX)
    )
    uuid = _ask(
        nvml, f"GPU {index}'s UUID", lambda: _text(nvml.nvmlDeviceGetUUID(handle), _NAME_MAX)
    )
    memory = _ask(
        nvml, f"GPU {index}'s memory", lambda: _bytes(nvml.nvmlDeviceGetMemoryInfo(handle).total)
    )
    return GpuInfo(index=index, name=name or "", uuid=uuid or None, memory_total_bytes=memory)


def _ask(nvml: Nvml, what: str, query: Callable[[], T]) -> T | None:
    """``query()``, or None (with a warning) if NVML cannot answer it."""
    try:
        return query()
    except nvml.NVMLError as exc:
        logger.warning("NVML cannot tell %s: %s", what, exc)
        return None


def _shut_down(nvml: Nvml) -> None:
    try:
        nvml.nvmlShutdown()
    except nvml.NVMLError as exc:
        logger.warning("NVML did not shut down cleanly: %s", exc)


def threads_per_worker(
    *, cpus: int, nproc_per_node: int, device: Device, attempt_gpus: int, node_gpus: int
) -> int:
    """OMP_NUM_THREADS for each worker of an attempt on a node of ``cpus`` cores.

    A CPU attempt has the node to itself: its workers share every core. A GPU attempt
    has the cores of its GPUs' share of the node (``cpus * attempt_gpus / node_gpus``),
    so that attempts on the node's other GPUs keep theirs; its workers share those.
    Never less than one.
    """
    nproc = max(1, nproc_per_node)
    if device == "cuda" and node_gpus > 0:
        cores = cpus * min(attempt_gpus, node_gpus) // node_gpus
    else:
        cores = cpus
    return max(1, cores // nproc)


def device_variables(assignment: Assignment, *, cpus: int, node_gpus: int) -> dict[str, str]:
    """What the agent sets for an attempt's workers to use their device.

    ``RELAUNCH_DEVICE``; for a GPU attempt ``CUDA_VISIBLE_DEVICES`` = its GPUs (local rank
    n uses visible device n) numbered as NVML does (``CUDA_DEVICE_ORDER=PCI_BUS_ID``),
    for a CPU attempt none at all (empty), so that it cannot take GPUs that other
    attempts hold; and
    ``OMP_NUM_THREADS`` by ``threads_per_worker``. The first three win over the job's
    env (``AGENT_DEVICE_VARIABLES``); OMP_NUM_THREADS is the job's to choose, so the
    caller sets it only where the job's env (or the agent's own environment) does not.
    """
    visible = ",".join(map(str, assignment.gpus)) if assignment.device == "cuda" else ""
    variables = {
        DEVICE_ENV: assignment.device,
        CUDA_VISIBLE_DEVICES_ENV: visible,
        CUDA_DEVICE_ORDER_ENV: "PCI_BUS_ID",
    }
    threads = threads_per_worker(
        cpus=cpus,
        nproc_per_node=assignment.nproc_per_node,
        device=assignment.device,
        attempt_gpus=len(assignment.gpus),
        node_gpus=node_gpus,
    )
    variables[OMP_NUM_THREADS_ENV] = str(threads)
    return variables


def device_refusal(assignment: Assignment, node_gpus: Collection[int]) -> str | None:
    """Why this node cannot run the attempt on the device it was placed for; None if it
    can. A GPU attempt must hold one of this node's GPUs per local rank, each once."""
    gpus = assignment.gpus
    if assignment.device == "cpu":
        if gpus:
            return f"a CPU attempt was given GPUs {gpus}"
        return None
    if len(gpus) != assignment.nproc_per_node:
        return (
            f"a GPU attempt of {assignment.nproc_per_node} process(es) per node was given "
            f"{len(gpus)} GPU(s) {gpus}"
        )
    if len(set(gpus)) != len(gpus):
        return f"a GPU attempt was given one GPU twice: {gpus}"
    unknown = sorted(set(gpus) - set(node_gpus))
    if unknown:
        offered = ",".join(map(str, sorted(node_gpus))) or "none"
        return f"GPU(s) {unknown} are not among this node's GPUs ({offered})"
    return None
