"""Progress beats for hang detection.

A worker calls ``beat()`` whenever it makes progress (the ``Trainer`` does so
every batch). Each call touches ``<RELAUNCH_PROGRESS_DIR>/local-<LOCAL_RANK>``;
the launcher on the node reads the file's age, and a worker that has beaten
once and then not for ``hang_timeout_s`` is declared hung (see
``worker.launch``). Outside relaunch, or in a script that never calls it,
``beat`` does nothing and no hang is ever declared.

``beating()`` beats from a thread while a block runs: for a pause that is progress
although no step is made (an evaluation, a long save, a wait for rank 0's save).
Inside it a hang of this worker goes unseen; a collective that waits for a frozen
peer still ends at the process group's timeout.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

from contract.protocol import PROGRESS_DIR_ENV

_path: Path | None = None
_disabled = False


def progress_file(directory: str | os.PathLike[str], local_rank: int) -> Path:
    return Path(directory) / f"local-{local_rank}"


def beat() -> None:
    """Record that this worker is making progress (one ``utime``; cheap)."""
    global _path, _disabled
    if _disabled:
        return
    if _path is None:
        directory = os.environ.get(PROGRESS_DIR_ENV)
        if not directory:
            _disabled = True
            return
        _path = progress_file(directory, int(os.environ.get("LOCAL_RANK", "0")))
        _path.parent.mkdir(parents=True, exist_ok=True)
        _path.touch()
        return
    try:
        os.utime(_path)
    except FileNotFoundError:  # the launcher cleared it for a new round
        _path.touch()


@contextlib.contextmanager
def beating(interval_s: float = 1.0) -> Iterator[None]:
    """Beat every ``interval_s`` seconds from a daemon thread until the block ends."""
    done = threading.Event()

    def _beat_until_done() -> None:
        while not done.wait(interval_s):
            beat()

    beat()
    thread = threading.Thread(target=_beat_until_done, name="progress-beat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        beat()
