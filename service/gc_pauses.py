"""Python's cyclic garbage collector in the controller's processes: timing its pauses,
and leaving what the process made at start out of its scans."""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from prometheus_client import CollectorRegistry, Histogram

logger = logging.getLogger(__name__)


def freeze_what_started() -> None:
    """Collect, then leave every object this process holds now out of later collections
    (``gc.freeze``), so that a full collection scans only what came since. What a process
    makes at start (modules, classes, tables) lives as long as it does; one of those let go
    later, if in a cycle, is never freed. ``gc.unfreeze`` undoes it."""
    gc.collect()
    gc.freeze()
    logger.info("%d objects of the start left out of garbage collection", gc.get_freeze_count())


def collect_young_after(objects: int) -> tuple[int, int, int]:
    """Scan the youngest generation once ``objects`` more objects are alive than at the
    last scan (``gc.set_threshold``'s first number; the older generations' stay). Returns
    the thresholds before, for ``gc.set_threshold`` to restore."""
    before = gc.get_threshold()
    gc.set_threshold(objects, before[1], before[2])
    return before


class CollectionTimer:
    """Times each run of Python's cyclic garbage collector, by generation, and hands the
    time to ``observe``. A ``gc.callbacks`` entry while it is ``installed``."""

    def __init__(self) -> None:
        self._started = 0.0

    def observe(self, generation: int, seconds: float) -> None:
        raise NotImplementedError

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.observe(info["generation"], time.perf_counter() - self._started)

    @contextmanager
    def installed(self) -> Iterator[None]:
        gc.callbacks.append(self)
        try:
            yield
        finally:
            gc.callbacks.remove(self)


class GcPauses(CollectionTimer):
    """Times each run of Python's cyclic garbage collector into ``histogram``, by
    generation: while one runs, no thread of the process runs Python, so a heartbeat
    being answered waits it out."""

    def __init__(self, registry: CollectorRegistry, buckets: Sequence[float]) -> None:
        super().__init__()
        self.histogram = Histogram(
            "relaunch_gc_pause_seconds",
            "Time of one collection of Python's cyclic garbage collector in the API's "
            "process, by generation (2: every tracked object); no request runs meanwhile",
            ["generation"],
            buckets=buckets,
            registry=registry,
        )

    def observe(self, generation: int, seconds: float) -> None:
        self.histogram.labels(str(generation)).observe(seconds)
