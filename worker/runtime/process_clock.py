"""When this process was created, by the wall clock: the kernel's record, read from ``/proc``.

Standard library only, so that any script can read it first thing at no cost.
"""

from __future__ import annotations

import os
import time
from pathlib import Path


def process_started_at(proc: Path = Path("/proc/self")) -> float | None:
    """When the process was created (its fork), as a ``time.time()``; None without ``/proc``.

    The kernel counts a process's start in clock ticks since boot; the age of the
    process is the time since boot now (``CLOCK_BOOTTIME``, the same clock) less
    that, so the result is as fine as a clock tick (10 ms) and needs no boot time
    (which ``/proc/stat`` gives in whole seconds only). The kernel rounds the start
    down to a tick; the middle of that tick is returned, half a tick off at most.
    """
    try:
        stat = (proc / "stat").read_text()
        # The command name (field 2) may hold spaces; fields after it follow its ")".
        started_ticks = int(stat.rsplit(")", 1)[1].split()[19])
        ticks_per_s = os.sysconf("SC_CLK_TCK")
        since_boot = time.clock_gettime(time.CLOCK_BOOTTIME)
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    started = (started_ticks + 0.5) / ticks_per_s
    return time.time() - (since_boot - started)
