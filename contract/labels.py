"""How a log line names the part of a job it is about: one vocabulary everywhere.

- ``job 3``: the job's id.
- ``attempt 2``: the job's own attempt number (1, 2, ...), as ``relaunch status``
  shows it; never the controller's database id of the attempt.
- ``node node-a``: the node's name, as it registered.
- ``rank 5``: a worker's global rank; a rank within its node is always called
  ``local rank``.

Imports no torch: the node agent and the launcher use it as well as the workers.
"""

from __future__ import annotations

from collections.abc import Mapping

from contract.protocol import ATTEMPT_NUMBER_ENV, JOB_ID_ENV, NODE_NAME_ENV

# What a node's warm zygote (``worker.zygote``) calls itself in /proc/PID/comm, so that
# it is told apart from the workers forked from it, which share its command line.
ZYGOTE_PROCESS_NAME = "relaunch-zygote"


def log_label(
    *,
    job: int | str | None = None,
    attempt: int | str | None = None,
    node: str | None = None,
    rank: int | None = None,
    local_rank: int | None = None,
) -> str:
    """``job 3 attempt 2 node node-a rank 5 local rank 1``, leaving out what is None."""
    words = [
        f"{name} {value}"
        for name, value in (
            ("job", job),
            ("attempt", attempt),
            ("node", node),
            ("rank", rank),
            ("local rank", local_rank),
        )
        if value is not None and value != ""
    ]
    return " ".join(words)


def label_from_environ(
    environ: Mapping[str, str],
    *,
    node: bool = False,
    rank: int | None = None,
    local_rank: int | None = None,
) -> str:
    """The label of a process the node agent started: job and attempt from the variables
    the agent set (left out when it set none), the node's name if ``node``."""
    return log_label(
        job=environ.get(JOB_ID_ENV),
        attempt=environ.get(ATTEMPT_NUMBER_ENV),
        node=environ.get(NODE_NAME_ENV) if node else None,
        rank=rank,
        local_rank=local_rank,
    )
