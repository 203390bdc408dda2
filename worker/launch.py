"""The per-attempt launcher: torch's elastic agent, run in-process, recording events.

Usage::

    python -m worker.launch --events-file F [--parent-pid P] -- <torchrun args>

It parses the torchrun arguments with torchrun's own parser and calls
``torch.distributed.run.run``. What the elastic agent decides is written to
``F`` as data (``protocol.RuntimeEvent`` JSON lines; one ``os.write`` per line
on an ``O_APPEND`` descriptor, so lines from several writers never interleave):

- RENDEZVOUS after every rendezvous round,
- WORKER_FAILED for each failed local worker when the monitor sees the group FAILED,
- LAUNCHER_EXIT once at the end (exit status 0 on success, 1 on failure,
  128 + signal when stopped by a signal, 2 on bad arguments).

The events come from two wrapped methods of torch's elastic agent, in this
process only (see ``install_event_hooks``). The launcher asks the kernel for
SIGTERM when its parent (the node agent) dies; torch's agent turns SIGTERM into
an orderly stop of its workers.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

from worker import procs
from worker.protocol import ATTEMPT_ID_ENV, JOB_ID_ENV, EventKind
from worker.runtime.events import EventWriter

logger = logging.getLogger(__name__)

_CTX = f"job={os.environ.get(JOB_ID_ENV, '-')} attempt={os.environ.get(ATTEMPT_ID_ENV, '-')}"
_NO_ERROR_FILE = "<N/A>"  # torch's ProcessFailure.error_file when the worker wrote none
# An error file can hold a whole traceback; an event line must stay under
# events.MAX_LINE_BYTES to be appended atomically.
MAX_MESSAGE_CHARS = 1000


def failure_message(failure: Any) -> str:
    """A one-line reason from a torch ``ProcessFailure``.

    ``failure.message`` is the error file's message: a string, or a dict
    ``{"message": "Type: text", "extraInfo": {...}}`` written by ``@record``.
    Without an error file torch puts a documentation link there instead.
    """
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message") or str(message)
    if failure.error_file == _NO_ERROR_FILE and failure.exitcode > 0:
        return f"exited with code {failure.exitcode}"
    return bounded(str(message))


def bounded(text: str) -> str:
    """``text`` cut to ``MAX_MESSAGE_CHARS``, marked where it was cut."""
    return text if len(text) <= MAX_MESSAGE_CHARS else text[: MAX_MESSAGE_CHARS - 3] + "..."


_HOOK_MARK = "_relaunch_event_hook"


def install_event_hooks(events: EventWriter) -> None:
    """Wrap two methods of ``LocalElasticAgent`` so that they also record events.

    Seams (torch 2.13, ``torch/distributed/elastic/agent/server/``):

    - ``SimpleElasticAgent._rendezvous(worker_group)`` (api.py) fills
      ``worker_group`` with the round's ranks; it runs for the first round and
      for every restart (``_initialize_workers`` -> ``_rendezvous``). The
      restart count is computed as torch does for TORCHELASTIC_RESTART_COUNT:
      ``spec.max_restarts - agent._remaining_restarts``.
    - ``LocalElasticAgent._monitor_workers(worker_group)`` returns a
      ``RunResult``; on FAILED, ``failures`` maps *global* rank to a
      ``ProcessFailure`` (which carries ``local_rank``). It also holds the
      siblings the agent SIGTERMed after the first failure (negative exitcode).

    The wrappers only read; they call the original first and return its result.
    Install once per process, before ``torch.distributed.run.run``.
    """
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    original_rendezvous: Callable[..., None] = LocalElasticAgent._rendezvous
    original_monitor: Callable[..., Any] = LocalElasticAgent._monitor_workers
    if getattr(original_monitor, _HOOK_MARK, False):
        raise RuntimeError("event hooks are already installed in this process")

    emit = events.emit  # logs and drops a failed write itself

    @functools.wraps(original_rendezvous)
    def _rendezvous(self: Any, worker_group: Any) -> None:
        original_rendezvous(self, worker_group)
        world_size = worker_group.workers[0].world_size if worker_group.workers else 0
        restart_count = worker_group.spec.max_restarts - self._remaining_restarts
        logger.info(
            "%s rendezvous: group_rank=%s group_world_size=%s world_size=%s restart_count=%s",
            _CTX,
            worker_group.group_rank,
            worker_group.group_world_size,
            world_size,
            restart_count,
        )
        emit(
            EventKind.RENDEZVOUS,
            world_size=world_size,
            group_rank=worker_group.group_rank,
            group_world_size=worker_group.group_world_size,
            restart_count=restart_count,
        )

    @functools.wraps(original_monitor)
    def _monitor_workers(self: Any, worker_group: Any) -> Any:
        result = original_monitor(self, worker_group)
        if result.state == WorkerState.FAILED:
            by_time = sorted(result.failures.items(), key=lambda item: item[1].timestamp)
            for global_rank, failure in by_time:
                emit(
                    EventKind.WORKER_FAILED,
                    local_rank=failure.local_rank,
                    global_rank=global_rank,
                    exitcode=failure.exitcode,
                    message=failure_message(failure),
                )
        return result

    setattr(_monitor_workers, _HOOK_MARK, True)
    LocalElasticAgent._rendezvous = _rendezvous  # type: ignore[method-assign]
    LocalElasticAgent._monitor_workers = _monitor_workers  # type: ignore[method-assign]


def run_torchrun(torchrun_args: Sequence[str]) -> tuple[str, int, str]:
    """Run torch's elastic launcher in this process; return (outcome, exit code, message)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        args = parse_args(list(torchrun_args))
    except SystemExit as exc:  # argparse reports and exits on bad arguments
        return "failed", 2, f"invalid torchrun arguments (argparse exit {exc.code})"

    def _raise_signal(signum: int, _frame: FrameType | None) -> None:
        raise SignalException(f"launcher got signal {signum}", sigval=signal.Signals(signum))

    # torch installs this kind of handler only when it starts workers; from
    # here on a SIGTERM during rendezvous also ends in an orderly LAUNCHER_EXIT.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _raise_signal)
    try:
        run(args)
    except ChildFailedError as exc:
        global_rank, failure = exc.get_first_failure()
        message = (
            f"local_rank {failure.local_rank} (rank {global_rank}) failed: "
            f"{failure_message(failure)}"
        )
        return "failed", 1, message
    except SignalException as exc:
        return "failed", 128 + int(exc.sigval), f"stopped by signal {exc.sigval.name}"
    except Exception as exc:
        logger.exception("%s elastic launcher failed", _CTX)
        return "failed", 1, f"{type(exc).__name__}: {exc}"
    return "succeeded", 0, ""


def _parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m worker.launch")
    parser.add_argument("--events-file", required=True)
    parser.add_argument(
        "--parent-pid",
        type=int,
        default=None,
        help="exit at once if the parent is no longer this pid (it died before we armed "
        "PR_SET_PDEATHSIG)",
    )
    argv = list(argv)
    if "--" not in argv:
        parser.error("torchrun arguments must follow '--'")
    split = argv.index("--")
    return parser.parse_args(argv[:split]), argv[split + 1 :]


def main(argv: Sequence[str] | None = None) -> int:
    ns, torchrun_args = _parse(sys.argv[1:] if argv is None else argv)
    procs.set_parent_death_signal(signal.SIGTERM)
    if ns.parent_pid is not None and os.getppid() != ns.parent_pid:
        logger.error("%s parent %s is gone before start; exiting", _CTX, ns.parent_pid)
        return 1
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    events = EventWriter(ns.events_file)
    install_event_hooks(events)
    try:
        outcome, exitcode, message = run_torchrun(torchrun_args)
        events.emit(
            EventKind.LAUNCHER_EXIT, outcome=outcome, exitcode=exitcode, message=bounded(message)
        )
        logger.info("%s launcher exit: %s (%s) %s", _CTX, outcome, exitcode, message)
    finally:
        events.close()
    return exitcode


if __name__ == "__main__":
    sys.exit(main())
