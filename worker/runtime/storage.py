"""Where snapshot files live: a local (or shared) directory, or any fsspec URL.

A ``Storage`` holds flat, named files and offers what the snapshot layer needs:
``write`` a file so that readers see it whole or not at all, ``read`` it back,
list, remove. ``open_storage`` picks the kind from the location: a plain path
is a ``LocalStorage``; ``scheme://...`` (``s3://``, ``gs://``, ``memory://``,
``file://``...) goes through fsspec, whose filesystems for remote object stores
install as separate packages (``s3fs``, ``gcsfs``...).

Local writes go to a temporary name in the same directory, are flushed and
fsynced, renamed into place, and the directory is fsynced. An object store's
PUT is atomic by itself, so fsspec writes go straight to the final name; on
either kind the snapshot layer writes its manifest last, and a data file
without a manifest does not count.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import secrets
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from contract.paths import inside, is_url, plain_name

logger = logging.getLogger(__name__)

TMP_SUFFIX = ".tmp"
# A temporary file this old is left over by a crash even if its writer's pid is
# unknown here (another host on a shared file system).
STALE_TMP_AGE_S = 600.0
_TMP_TOKEN = re.compile(r"[0-9a-f]{8}")  # secrets.token_hex(4)

Writer = Callable[[IO[bytes]], None]
Hook = Callable[[], None]


def _host_tag() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "_", socket.gethostname()) or "host"


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Storage:
    """Flat named files under one location; see the module docstring."""

    location: str

    def write(
        self,
        name: str,
        writer: Writer,
        before_commit: Hook | None = None,
        before_rename: Hook | None = None,
    ) -> None:
        """Create ``name`` with what ``writer`` writes to the handle it is given.

        ``before_rename`` runs once the bytes are durable and ``before_commit``
        right before they become visible under ``name``; either may raise to
        abandon the write, which then leaves nothing visible behind.
        """
        raise NotImplementedError

    def read(self, name: str) -> bytes:
        raise NotImplementedError

    def names(self) -> list[str]:
        """Every file name here; ``[]`` if the location does not exist yet."""
        raise NotImplementedError

    def remove(self, name: str) -> None:
        """Remove ``name``; a file that is already gone is no error."""
        raise NotImplementedError

    def size(self, name: str) -> int:
        raise NotImplementedError

    def remove_stale_temporaries(self) -> None:
        """Remove temporary files that crashed writers left (local storage only)."""

    def path_of(self, name: str) -> str:
        """How ``name`` is shown to people and recorded by the controller."""
        return f"{self.location.rstrip('/')}/{name}"


class LocalStorage(Storage):
    """A directory: local, or shared by every node of a job (NFS, a mounted volume)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.root = Path(directory)
        self.location = str(self.root)

    def path_of(self, name: str) -> str:
        return str(self.root / name)

    def _file(self, name: str) -> Path:
        return inside(self.root, name)

    def write(
        self,
        name: str,
        writer: Writer,
        before_commit: Hook | None = None,
        before_rename: Hook | None = None,
    ) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        target = self._file(name)
        tmp = self.root / (
            f".{name}.{_host_tag()}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}"
        )
        try:
            with open(tmp, "wb") as handle:
                writer(handle)
                handle.flush()
                os.fsync(handle.fileno())
            if before_rename is not None:
                before_rename()
            if before_commit is not None:
                before_commit()
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            raise
        _fsync_directory(self.root)

    def read(self, name: str) -> bytes:
        return self._file(name).read_bytes()

    def names(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return [entry.name for entry in self.root.iterdir() if entry.is_file()]

    def remove(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._file(name).unlink()

    def size(self, name: str) -> int:
        return self._file(name).stat().st_size

    def remove_stale_temporaries(self) -> None:
        if not self.root.is_dir():
            return
        now = time.time()
        for entry in self.root.glob(f".*{TMP_SUFFIX}"):
            if _is_stale_tmp(entry, now):
                logger.info("removing temporary file left by a crash: %s", entry)
                with contextlib.suppress(FileNotFoundError):
                    entry.unlink()


def _is_stale_tmp(entry: Path, now: float) -> bool:
    """One of our temporary files whose writer is gone: a dead pid on this host, or too
    old. Other files are never ours: a job's own files may share the directory."""
    # ".{name}.{host}.{pid}.{token}.tmp": host, pid and token are the last three fields
    parts = entry.name[: -len(TMP_SUFFIX)].rsplit(".", 3)
    if len(parts) != 4 or not parts[2].isdigit() or not _TMP_TOKEN.fullmatch(parts[3]):
        return False
    if parts[1] == _host_tag():
        pid = int(parts[2])
        if pid != os.getpid() and not _pid_alive(pid):
            return True
    try:
        return now - entry.stat().st_mtime > STALE_TMP_AGE_S
    except FileNotFoundError:
        return False


class FsspecStorage(Storage):
    """Any fsspec URL. Object stores make a finished upload visible atomically."""

    def __init__(self, url: str, **options: Any) -> None:
        import fsspec

        self.location = url
        self.fs, root = fsspec.core.url_to_fs(url, **options)
        self.root = root.rstrip("/")

    def _full(self, name: str) -> str:
        return f"{self.root}/{plain_name(name)}"

    def write(
        self,
        name: str,
        writer: Writer,
        before_commit: Hook | None = None,
        before_rename: Hook | None = None,
    ) -> None:
        # Built in memory, uploaded in one PUT once the checks pass: a failed
        # write leaves no partial object behind.
        buffer = io.BytesIO()
        writer(buffer)
        if before_rename is not None:
            before_rename()
        if before_commit is not None:
            before_commit()
        self.fs.makedirs(self.root, exist_ok=True)
        self.fs.pipe_file(self._full(name), buffer.getvalue())

    def read(self, name: str) -> bytes:
        data: bytes = self.fs.cat_file(self._full(name))
        return data

    def names(self) -> list[str]:
        if not self.fs.exists(self.root):
            return []
        found: list[str] = self.fs.ls(self.root, detail=False)
        return [path.rstrip("/").rsplit("/", 1)[-1] for path in found]

    def remove(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._full(name))

    def size(self, name: str) -> int:
        return int(self.fs.size(self._full(name)))


def open_storage(location: str | os.PathLike[str] | Storage) -> Storage:
    """The storage for a directory path or an fsspec URL."""
    if isinstance(location, Storage):
        return location
    text = os.fspath(location)
    return FsspecStorage(text) if is_url(text) else LocalStorage(text)
