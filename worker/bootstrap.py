"""What each worker process runs first: the job's program, the way ``python`` would.

Usage (the node agent builds it; torchrun starts one per local rank)::

    python -m worker.bootstrap SCRIPT [ARGS...]
    python -m worker.bootstrap -m MODULE [ARGS...]

The program runs unchanged: as ``__main__``, with ``sys.argv`` and (for a
script) ``sys.path[0]`` as ``python SCRIPT`` / ``python -m MODULE`` set them. The
bootstrap adds these things around it:

- torch's ``@record``: an uncaught exception is written to the worker's error
  file, so the launcher learns its type (a start-up error such as an
  ``ImportError`` fails the job at once instead of restarting it);
- with ``RELAUNCH_DEVICE=cuda``, a check that every local rank has a GPU of its
  own before the program runs (``worker.runtime.devices.check_visible_devices``):
  too few raise ``DeviceShortage``, a start-up error. In a warm worker this runs
  in the forked child, never in the zygote;
- ``faulthandler`` on SIGUSR1: the launcher sends it to take a stack dump of
  every thread of a hung worker, into the worker's stderr (the job's logs);
- a count of optimizer steps (``worker.runtime.step_counter``): a script that
  reports nothing still shows its step and step time, and beats the
  hang-detection progress with every step;
- the moments of the process's start (``worker.runtime.startup``): once torch
  is imported, and the first optimizer step;
- a quick end after a collective broke because a peer went away
  (``error_says_peer_lost``): once the error is recorded, the traceback printed and
  the ``atexit`` handlers run, the process exits at once (status 1), skipping the
  interpreter's last garbage collection, in which the broken process group's
  queued work holds the exit for a second or more. Non-daemon threads are not
  waited for (one may be stuck in the broken collective), and a file the script
  left open and unflushed loses what it buffered. NCCL's async error handling
  ends such a process as abruptly; the peers' restart waits for this one.
- a mark that the program returned (or exited with status 0), written by this
  process (not a child it forked) after the interpreter has joined the program's
  threads and run its ``atexit`` handlers: ``program_returned.PID`` beside the
  worker's error file. A process that a signal ends after that (torch 2.13's gloo
  can abort one in its teardown, "terminate called without an active exception")
  has done its work: the launcher takes it as finished
  (``worker.launch.returned_before_signals``).
- a mark that the program began its teardown: ``teardown_started.PID`` beside the
  error file, written when the program destroys its default process group
  (``torch.distributed.destroy_process_group()``, wrapped), before torch does, and
  removed when it initialises one again. With it, or with the mark above, the launcher
  judges the worker by its CPU, not its beats (``worker.hang.TeardownWatch``): a
  teardown that hangs is ended as finished.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import functools
import importlib.util
import os
import runpy
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from worker.runtime.devices import check_visible_devices

STACK_DUMP_SIGNAL = signal.SIGUSR1
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
# Written beside the worker's error file once its program has returned (``main``).
PROGRAM_RETURNED = "program_returned"
# Written beside it once the program destroyed its default process group.
TEARDOWN_STARTED = "teardown_started"
# A collective that broke because a peer process or node went away (gloo on CPU, NCCL on
# GPU). The failed peer, if it still lives, reports its own failure; this one is a
# consequence, which the controller counts as a membership change, not a restart.
# - gloo: the peer's socket closed or reset.
# - NCCL: ``ncclRemoteError``, whose text is "remote process exited or there was a
#   network error"; and "NCCL communicator was aborted on rank N", which torch raises in
#   the rank's own thread when its communicator was aborted for an error it then names
#   ("Original reason for failure was: ...").
PEER_LOST_MARKERS = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "NCCL communicator was aborted",
    "ncclRemoteError",
    "remote process exited or there was a network error",
)
# What overrides the markers above: the collective failed for a reason of this rank or of
# the whole group, not because a peer went away, also where the text says so as the
# reason ("Original reason for failure was: ...") a communicator was aborted. A crash,
# charged:
# - a collective that waited out the process group's timeout (NCCL's watchdog). A peer
#   may have frozen, or the ranks called different collectives, a bug that free
#   restarts would repeat forever; gloo's timeout ("Timed out waiting") is a crash too.
# - NCCL's local errors: a system call, memory or device failure (ncclSystemError,
#   "unhandled system error"), CUDA (ncclUnhandledCudaError), NCCL's own bug
#   (ncclInternalError) and misuse (ncclInvalidUsage, ncclInvalidArgument). Since NCCL
#   2.12 a peer's closed connection is ncclRemoteError, not ncclSystemError.
CHARGED_MARKERS = (
    "Watchdog caught collective operation timeout",
    "ncclSystemError",
    "unhandled system error",
    "ncclUnhandledCudaError",
    "unhandled cuda error",
    "ncclInternalError",
    "ncclInvalidUsage",
    "ncclInvalidArgument",
)


# The exception types torch's collectives raise: gloo's errors are ``RuntimeError``s,
# NCCL's and the stores' torch.distributed's ``DistError`` family. By name: the launcher
# reads an error only as ``@record`` wrote it, "Type: text". Any other type (a script's
# own ``BrokenPipeError`` or ``ConnectionResetError``, say of a data source that went
# down) is the script's failure, whatever its text.
COLLECTIVE_ERRORS = frozenset(
    {"RuntimeError", "DistError", "DistBackendError", "DistNetworkError", "DistStoreError"}
)


def error_says_peer_lost(error: str) -> bool:
    """Whether ``error``, "Type: text" as ``@record`` writes it, is a collective's failure
    because a peer went away, and for no reason of its own: one of
    ``COLLECTIVE_ERRORS`` with a marker above. ``error`` must be whole, not cut for
    display: the reason that overrides may come last."""
    kind, _, text = error.partition(":")
    if kind.strip() not in COLLECTIVE_ERRORS:
        return False
    return any(m in text for m in PEER_LOST_MARKERS) and not any(m in text for m in CHARGED_MARKERS)


class EntrypointNotFound(ImportError):
    """The script or module to run does not exist on this node."""


def run_program(argv: Sequence[str]) -> None:
    """Run ``SCRIPT ARGS`` or ``-m MODULE ARGS`` as ``__main__``."""
    if not argv:
        raise SystemExit("usage: python -m worker.bootstrap (SCRIPT | -m MODULE) [ARGS...]")
    if argv[0] == "-m":
        if len(argv) < 2:
            raise SystemExit("-m needs a module name")
        module = argv[1]
        sys.argv = [module, *argv[2:]]
        try:
            spec_found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            spec_found = False
        if not spec_found:
            raise EntrypointNotFound(f"no module named {module!r} on this node")
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return
    script = argv[0]
    if not os.path.isfile(script):
        raise EntrypointNotFound(f"script {script!r} does not exist on this node")
    sys.argv = [script, *argv[1:]]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")


def peer_lost(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective's failure because a peer went away: the
    launcher's rule (``error_says_peer_lost``) on what ``@record`` writes of it."""
    return error_says_peer_lost(f"{type(exc).__name__}: {exc}")


def run_worker(argv: Sequence[str]) -> None:
    """Check this worker's devices, then run its program (``run_program``)."""
    check_visible_devices(os.environ)
    run_program(argv)


def _exit_now(exc: BaseException) -> None:
    """End the process as an uncaught ``exc`` would, less the final garbage collection."""
    sys.excepthook(type(exc), exc, exc.__traceback__)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(1)


def returned_mark(error_file: str, pid: int) -> Path:
    """Where worker ``pid``, whose error file is ``error_file``, marks that its program
    returned."""
    return Path(error_file).with_name(f"{PROGRAM_RETURNED}.{pid}")


_returned = False  # set once the program has returned (or exited with status 0)


def _mark_if_returned(pid: int) -> None:
    """``atexit``, registered before the program runs, so run after the program's own
    handlers (and after the interpreter joined its threads): mark that the program
    returned, if it did, in the process that started it. Best effort: a mark not
    written leaves the worker's exit status as it is."""
    error_file = os.environ.get(ERROR_FILE_ENV)
    if not _returned or os.getpid() != pid or not error_file or error_file == os.devnull:
        return
    _write_mark(returned_mark(error_file, pid))


def _write_mark(path: Path) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    with contextlib.suppress(OSError):
        os.close(os.open(path, flags, 0o644))


def teardown_mark(error_file: str, pid: int) -> Path:
    """Where worker ``pid``, whose error file is ``error_file``, marks that its program
    destroyed its default process group."""
    return Path(error_file).with_name(f"{TEARDOWN_STARTED}.{pid}")


def watch_teardown(pid: int) -> None:
    """Wrap ``torch.distributed``'s ``destroy_process_group`` and ``init_process_group``
    (in both modules a script may call them from) to mark, in process ``pid`` only, that
    the default group was destroyed, and to take the mark back when one is initialised
    again. Best effort: a mark not written leaves the worker judged by its beats."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    error_file = os.environ.get(ERROR_FILE_ENV)
    if not error_file or error_file == os.devnull:
        return
    mark = teardown_mark(error_file, pid)
    destroy, init = c10d.destroy_process_group, c10d.init_process_group

    @functools.wraps(destroy)
    def destroy_process_group(group: Any = None) -> None:
        if os.getpid() == pid and (group is None or group is c10d.GroupMember.WORLD):
            _write_mark(mark)
        destroy(group)

    @functools.wraps(init)
    def init_process_group(*args: Any, **kwargs: Any) -> None:
        init(*args, **kwargs)
        if os.getpid() == pid:
            with contextlib.suppress(OSError):
                mark.unlink(missing_ok=True)

    for module in (dist, c10d):
        setattr(module, "destroy_process_group", destroy_process_group)  # noqa: B010
        setattr(module, "init_process_group", init_process_group)  # noqa: B010


def main() -> None:
    faulthandler.register(STACK_DUMP_SIGNAL, all_threads=True, chain=False)
    from torch.distributed.elastic.multiprocessing.errors import record

    from worker.runtime import startup, step_counter

    global _returned
    startup.mark(startup.Moment.IMPORTED)
    step_counter.install()
    watch_teardown(os.getpid())
    atexit.register(_mark_if_returned, os.getpid())
    try:
        record(run_worker)(sys.argv[1:])
    except SystemExit as exc:
        _returned = exc.code is None or exc.code == 0
        raise
    except Exception as exc:
        if not peer_lost(exc):
            raise
        _exit_now(exc)
    else:
        _returned = True


if __name__ == "__main__":
    main()
