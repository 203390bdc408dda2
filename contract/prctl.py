"""Linux ``prctl`` calls that both the controller and the node agent make."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
PR_SET_CHILD_SUBREAPER = 36


def prctl(option: int, value: int | bytes) -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    argument = ctypes.c_char_p(value) if isinstance(value, bytes) else ctypes.c_ulong(value)
    if libc.prctl(option, argument, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({option}): {os.strerror(err)}")


def set_process_name(name: str) -> None:
    """This process's name in /proc/PID/comm and ``ps`` (the kernel keeps 15 bytes)."""
    prctl(PR_SET_NAME, name.encode()[:15])


def set_parent_death_signal(sig: signal.Signals) -> None:
    """Have the kernel send ``sig`` to this process when its parent *thread* exits."""
    prctl(PR_SET_PDEATHSIG, int(sig))
