"""Whether a job's user, a uid of its own with no groups, can run this interpreter.

Shared by the node agent, which refuses to start where its jobs' users could not, and
by the demo, which then runs its one job as the person running it.
"""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
import sys
from pathlib import Path

DEFAULT_JOB_UID_BASE = 200000  # job N runs as uid and gid base + N


def interpreter_refusal(uid: int, timeout_s: float = 30.0) -> str | None:
    """Why a job's user cannot run this interpreter (``python -c pass``); None if it can.

    The message names the first directory on the way that others cannot pass."""
    try:
        result = subprocess.run(
            [sys.executable, "-c", "pass"],
            env={},
            cwd="/",
            capture_output=True,
            timeout=timeout_s,
            check=False,
            user=uid,
            group=uid,
            extra_groups=[],
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        cause = str(exc)
    else:
        if result.returncode == 0:
            return None
        cause = result.stderr.decode(errors="replace").strip()[-500:]
    blocked = first_closed_dir(Path(sys.executable))
    where = f"; {blocked} does not let others pass (chmod o+x {blocked})" if blocked else ""
    return (
        f"a job's user (uid {uid}) cannot run the interpreter {sys.executable}: {cause}{where}. "
        "Install Python where every user may run it"
    )


def first_closed_dir(path: Path) -> Path | None:
    """The first directory on the way to ``path`` (links followed) that others may not pass."""
    for candidate in (path, path.resolve()):
        for parent in reversed(candidate.parents):
            with contextlib.suppress(OSError):
                if not os.stat(parent).st_mode & stat.S_IXOTH:
                    return parent
    return None
