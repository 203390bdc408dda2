"""How relaunch's launcher processes (a launcher, a spare launcher) end.

Once ``main`` has returned, and the launcher's exit event is written, nothing is left to
do. The interpreter's own exit would still wait for every non-daemon thread. Torch's
launcher can leave one running: a log tail of a process context that a signal
interrupted before it was kept, which nothing then stops. Such a launcher outlived its
killed agent by minutes. Here those threads are named in the log and not waited for.
Standard library only: a spare launcher ends this way before it has imported anything
else.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import traceback
from collections.abc import Callable
from typing import NoReturn

logger = logging.getLogger(__name__)


def exit_now(code: int) -> NoReturn:
    """Flush the logs and the standard streams, then end the process with ``code``."""
    left = sorted(
        t.name
        for t in threading.enumerate()
        if t is not threading.main_thread() and not t.daemon and t.is_alive()
    )
    if left:
        logger.warning("exiting without waiting for threads: %s", ", ".join(left))
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def run_then_exit(main: Callable[[], int]) -> NoReturn:
    """``exit_now`` with what ``main`` returns. An exception it raises is printed and ends
    the process with status 1, and ``SystemExit`` with its own status, as the interpreter
    would end it."""
    try:
        code = main()
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    exit_now(code)
