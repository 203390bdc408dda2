"""A job's ``env`` values, encrypted at rest with Fernet, and the keys that open them.

Jobs put credentials in ``env``; the database holds them only as Fernet tokens
(AES-128-CBC with HMAC-SHA256, ``cryptography``). The stored spec (``Job.spec``,
JSON) keeps the variable names in the clear and marks how its values are held::

    {"name": ..., "env": {"HF_TOKEN": "gAAAAAB..."}, "env_format": "fernet"}

A row without ``env_format`` was stored before values were encrypted: its values are
plaintext, still read as such, and ``rotate`` encrypts them.

The keys come from ``ControllerSettings`` (``load_keyring``): ``RELAUNCH_SECRETS_KEYS``
(comma-separated) and/or ``RELAUNCH_SECRETS_KEY_FILE`` (one key a line). The first
key encrypts, every key decrypts (``MultiFernet``), which is how a key is rotated.
With neither set, a SQLite controller keeps one key in ``<data_dir>/secrets.key``,
made (mode 0600) at its first start; a controller on any other database refuses to
start, since every controller sharing the database must hold the same key.

Decryption happens here only (``open_env``). No key, token or value is ever logged,
and every error names the setting to fix, never a key.
"""

from __future__ import annotations

import hmac
import logging
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.fernet import Fernet, InvalidToken, MultiFernet

from service.db import make_private_dir
from service.settings import ControllerSettings

logger = logging.getLogger(__name__)

ENV_FORMAT = "env_format"  # the key in a stored spec that says how its env values are held
FERNET = "fernet"
KEY_FILE_NAME = "secrets.key"
KEYS_SETTING = "RELAUNCH_SECRETS_KEYS"
KEY_FILE_SETTING = "RELAUNCH_SECRETS_KEY_FILE"
DIGEST_PURPOSE = b"relaunch: the digest of a submitted spec"


class SecretsKeyError(RuntimeError):
    """A key is missing, unreadable or invalid, or does not open what the database holds.

    The message names the setting to fix; it never holds a key, token or value."""


@dataclass(frozen=True)
class Keyring:
    """The keys of this controller: ``keys[0]`` encrypts, every key decrypts.

    ``keys`` are Fernet keys (url-safe base64, as ``Fernet.generate_key`` makes them),
    kept out of ``repr``; ``source`` says in words where they came from (for errors);
    ``made_file`` is the key file this start created, if any. Raises ``SecretsKeyError``
    without keys or with one that is not a Fernet key."""

    keys: tuple[bytes, ...] = field(repr=False)
    source: str
    made_file: Path | None = None
    _fernets: tuple[Fernet, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.keys:
            raise SecretsKeyError(f"no key in {self.source}")
        fernets = []
        for number, key in enumerate(self.keys, start=1):
            try:
                fernets.append(Fernet(key))
            except (ValueError, UnicodeError):  # binascii.Error is a ValueError
                raise SecretsKeyError(
                    f"key {number} of {self.source} is not a Fernet key (32 url-safe "
                    "base64-encoded bytes, as `relaunch admin new-secrets-key` prints)"
                ) from None
        object.__setattr__(self, "_fernets", tuple(fernets))

    @property
    def _fernet(self) -> MultiFernet:
        return MultiFernet(list(self._fernets))

    def digests(self, data: bytes) -> list[str]:
        """HMAC-SHA256 of ``data`` under each key, the first key's first: a fingerprint
        of something secret that only a holder of the keys can check a guess against."""
        return [
            hmac.new(hmac.digest(key, DIGEST_PURPOSE, "sha256"), data, "sha256").hexdigest()
            for key in self.keys
        ]

    def seal(self, value: str) -> str:
        return self._fernets[0].encrypt(value.encode()).decode("ascii")

    def open(self, token: str) -> str:
        """The plaintext of ``token``; raises ``SecretsKeyError`` if no key opens it."""
        try:
            return self._fernet.decrypt(token.encode("ascii")).decode()
        except (InvalidToken, UnicodeError) as exc:
            raise SecretsKeyError(
                f"a job's env value cannot be decrypted with the keys of {self.source}: it was "
                f"encrypted with another key; give that key in {KEYS_SETTING} or "
                f"{KEY_FILE_SETTING} (after the new one while rotating)"
            ) from exc

    def reseal(self, token: str) -> str:
        """``token`` encrypted again with the first key."""
        self.open(token)  # the same error as a read when no key opens it
        return self._fernet.rotate(token.encode("ascii")).decode("ascii")


# ---- the stored form ---------------------------------------------------------------


def is_sealed(stored: dict[str, Any]) -> bool:
    return stored.get(ENV_FORMAT) == FERNET


def seal_spec(keyring: Keyring, spec: dict[str, Any]) -> dict[str, Any]:
    """The JSON to store for ``spec`` (a ``JobSpec`` dump): its env values encrypted."""
    env: dict[str, str] = spec.get("env") or {}
    return {**spec, "env": {k: keyring.seal(v) for k, v in env.items()}, ENV_FORMAT: FERNET}


def public_spec(stored: dict[str, Any], placeholder: str = "") -> dict[str, Any]:
    """The stored spec as ``JobSpec`` reads it: the env's names, each value ``placeholder``.

    Plaintext and encrypted rows alike: no value leaves the row except through
    ``open_env``."""
    spec = {k: v for k, v in stored.items() if k != ENV_FORMAT}
    spec["env"] = dict.fromkeys(stored.get("env") or {}, placeholder)
    return spec


def open_env(keyring: Keyring, stored: dict[str, Any]) -> dict[str, str]:
    """The env of a stored spec (``Job.spec``) with its values in the clear: what the
    job's nodes are sent. The one place values are decrypted; raises
    ``SecretsKeyError`` if no key opens one."""
    env: dict[str, str] = stored.get("env") or {}
    if not is_sealed(stored):
        return dict(env)  # stored before values were encrypted
    return {k: keyring.open(v) for k, v in env.items()}


def resealed(keyring: Keyring, stored: dict[str, Any]) -> dict[str, Any]:
    """``stored`` with every env value encrypted with the first key (plaintext rows too)."""
    env: dict[str, str] = stored.get("env") or {}
    if is_sealed(stored):
        return {**stored, "env": {k: keyring.reseal(v) for k, v in env.items()}}
    return seal_spec(keyring, stored)


# ---- keys --------------------------------------------------------------------------


def _parse_keys(texts: list[str]) -> list[bytes]:
    return [text.strip().encode("ascii", errors="replace") for text in texts]


def _read_key_file(path: Path) -> list[bytes]:
    source = f"{KEY_FILE_SETTING} ({path})"
    try:
        mode = path.stat().st_mode
        text = path.read_text(encoding="ascii")
    except OSError as exc:
        raise SecretsKeyError(f"cannot read the key file {source}: {exc.strerror}") from None
    except UnicodeError:
        raise SecretsKeyError(f"the key file {source} is not a text file of keys") from None
    if mode & 0o077:
        logger.warning(
            "the key file %s could be read by other users (mode %o); made it 0600",
            path,
            stat.S_IMODE(mode),
        )
        try:
            path.chmod(0o600)
        except OSError as exc:
            logger.warning("could not make the key file %s 0600: %s", path, exc.strerror)
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("#")]
    if not lines:
        raise SecretsKeyError(f"the key file {source} holds no key")
    Keyring(tuple(_parse_keys(lines)), source)  # raises naming the file if one is bad
    return _parse_keys(lines)


def _make_key_file(path: Path) -> None:
    """Write a new key to ``path``, readable by this user only; never over an existing file."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(Fernet.generate_key().decode("ascii") + "\n")
        f.flush()
        os.fsync(f.fileno())
    logger.info("made a new secrets key file %s (mode 0600)", path)


def uses_default_key_file(settings: ControllerSettings) -> bool:
    return settings.secrets_keys is None and settings.secrets_key_file is None


def load_keyring(settings: ControllerSettings, *, may_create: bool = True) -> Keyring:
    """The keys ``settings`` name: ``secrets_keys`` first, then the key file's.

    With neither set, the SQLite controller's ``<data_dir>/secrets.key``, made if
    absent (when ``may_create``); any other database refuses, since a key made here
    would differ from the other controllers'. Raises ``SecretsKeyError``."""
    keys: list[bytes] = []
    sources = []
    if settings.secrets_keys is not None:
        texts = [t for t in settings.secrets_keys.get_secret_value().split(",") if t.strip()]
        if not texts:
            raise SecretsKeyError(f"{KEYS_SETTING} is set but holds no key")
        keys += _parse_keys(texts)
        sources.append(KEYS_SETTING)
    if settings.secrets_key_file is not None:
        keys += _read_key_file(settings.secrets_key_file)
        sources.append(f"{KEY_FILE_SETTING} ({settings.secrets_key_file})")
    if sources:
        return Keyring(tuple(keys), " and ".join(sources))

    if not settings.database_is_sqlite:
        raise SecretsKeyError(
            f"set {KEY_FILE_SETTING} (or {KEYS_SETTING}) to the same key on every controller of "
            "this database; only a controller with its own SQLite file makes a key for itself "
            "(`relaunch admin new-secrets-key` prints a new key)"
        )
    path = settings.data_dir / KEY_FILE_NAME
    made = None
    if may_create and not path.exists():
        make_private_dir(settings.data_dir)
        try:
            _make_key_file(path)
            made = path
        except FileExistsError:
            pass  # another controller of this data dir made it first: use that one
    source = f"{KEY_FILE_SETTING} (default {path})"
    return Keyring(tuple(_read_key_file(path)), source, made_file=made)
