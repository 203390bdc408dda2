"""Where files are: a location is a URL or a path, and names under a root stay under it.

A location (the snapshot root, a job's snapshot directory) that starts with
``scheme://`` is a URL, opened through fsspec; anything else is a path. The
controller and the nodes tell them apart with the one rule here (``is_url``).

Every file relaunch opens on a node or the controller lies under a root that
settings fix (the agent's work dir, the snapshot root), at a path built from
ids and names relaunch made itself. These checks are the second wall: should
a name ever come from elsewhere (a damaged manifest, a crafted id), it cannot
reach outside the root by ``..``, an absolute path, a percent-encoded or
backslash form, or a symbolic link.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote


class UnsafePath(ValueError):
    """A name that is not one plain file name, or a path that leaves its root."""


def plain_name(name: str) -> str:
    """``name`` if it is one plain file or directory name, else ``UnsafePath``."""
    decoded = unquote(name)
    if decoded in ("", ".", "..") or any(c in decoded for c in ("/", "\\", "\x00")):
        raise UnsafePath(f"{name!r} is not a plain file name")
    return name


def inside(root: Path, *names: str) -> Path:
    """``root/names...``, after checking that, with symbolic links followed, it stays
    under ``root``."""
    path = root.joinpath(*(plain_name(n) for n in names))
    if not path.resolve().is_relative_to(root.resolve()):
        raise UnsafePath(f"{path} leads outside {root}")
    return path


def is_url(location: str) -> bool:
    """True for ``scheme://...`` (``s3://``, ``file://``, ...): a location fsspec opens."""
    return re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", location) is not None
