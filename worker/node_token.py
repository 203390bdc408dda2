"""The node token an agent keeps in its work dir, to take its node's place back.

The controller lets a registration take the name of a node that is ALIVE only
if it carries that node's current token. An agent that restarts (a crash, an
upgrade) presents the token its previous life saved, so it gets its name back
at once instead of waiting for the controller to declare the old node lost.

The file holds a credential: it is written only by the agent, readable only by
its user (mode 0600), and replaced atomically, so a crash leaves either the old
token or the new one.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

FILE_NAME = "node-token"
MAX_TOKEN_CHARS = 128


def token_file(work_dir: Path) -> Path:
    return work_dir / FILE_NAME


def load(path: Path) -> str | None:
    """The saved token, or None if there is none or the file does not hold one."""
    try:
        text = path.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        logger.warning("cannot read the node token in %s (registering without it): %s", path, exc)
        return None
    if not text or len(text) > MAX_TOKEN_CHARS or not text.isprintable():
        logger.warning("%s does not hold a node token; registering without it", path)
        return None
    return text


def save(path: Path, token: str) -> None:
    """Write ``token`` to ``path`` (mode 0600), replacing the old one atomically."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, token.encode("ascii"))
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
