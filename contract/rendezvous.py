"""The wire contract of the rendezvous the controller serves, and of the snapshot fence.

A node's launcher (``worker.rendezvous``) keeps torch's rendezvous state and its
key/value store at the controller, under ``/api/v1/rendezvous/{rdzv_id}``, with
the node's token; workers take and check their snapshot-writer token under
``/api/v1/workers/jobs/{job_id}/snapshot-writer`` with the attempt's worker token.
Every byte string travels as standard base64 text; the controller never reads it.
"""

from __future__ import annotations

import base64
import binascii
from typing import Annotated

from pydantic import AfterValidator, BaseModel, Field

RENDEZVOUS_PATH = "/api/v1/rendezvous"
# The launcher's membership (``Assignment.member_id``), sent with the node's token: a
# launcher of a membership that has ended (a node fenced out and placed again, whose old
# launcher has not stopped yet) is refused, so it cannot close or rewrite the rendezvous
# the node's new launcher and the others use.
MEMBER_HEADER = "x-relaunch-member"
MAX_WAIT_S = 5.0  # the longest one call waits for keys; a client waits longer by calling again


def encode(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def decode(text: str) -> bytes:
    """The bytes of standard base64 ``text``; ``ValueError`` if it is not such text."""
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"not base64: {exc}") from None


def _base64(text: str) -> str:
    decode(text)
    return text


Base64 = Annotated[str, AfterValidator(_base64)]
# Any text but NUL, which some databases cannot hold.
Key = Annotated[str, Field(min_length=1, max_length=512, pattern=r"^[^\x00]+$")]
Keys = Annotated[list[Key], Field(min_length=1, max_length=1024)]
Counter = Annotated[int, Field(ge=-(2**62), le=2**62)]


class RendezvousState(BaseModel):
    """The stored state (None: there is none yet), its version (the fencing token) and,
    in the answer to a write, whether that write was done."""

    state: Base64 | None = None
    version: int = 0
    written: bool = False
    # The attempt's ACTIVE members, as the controller counts them: a round that all of
    # them have joined has no one else to wait for (None from an older controller).
    members: int | None = None


class SetRendezvousState(BaseModel):
    """Write ``state`` if the stored version is ``version``; ``None``: only if none exists."""

    state: Base64
    version: Annotated[int, Field(ge=1, le=2**62)] | None = None


class StoreItem(BaseModel):
    key: Key
    value: Base64


class StoreSet(BaseModel):
    items: Annotated[list[StoreItem], Field(min_length=1, max_length=1024)]


class StoreGet(BaseModel):
    """Ask for ``keys``; wait up to ``wait_s`` (at most ``MAX_WAIT_S``) until all exist."""

    keys: Keys
    wait_s: Annotated[float, Field(ge=0, le=3600)] = 0.0
    with_values: bool = True


class StoreValues(BaseModel):
    """The values found (all of them only if ``complete``)."""

    values: dict[str, Base64] = Field(default_factory=dict)
    complete: bool


class StoreAdd(BaseModel):
    key: Key
    amount: Counter


class StoreCount(BaseModel):
    value: int


class StoreCompareSet(BaseModel):
    key: Key
    expected: Base64
    desired: Base64


class StoreValue(BaseModel):
    value: Base64


class StoreKey(BaseModel):
    key: Key


class StoreDeleted(BaseModel):
    deleted: bool


class SnapshotWriter(BaseModel):
    """A job's newest snapshot-writer token (0: none was taken)."""

    token: int
