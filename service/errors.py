"""The domain's exceptions; ``service.api.app`` maps them to HTTP in one place."""

from __future__ import annotations

from contract.protocol import StopReason


class RelaunchError(Exception):
    """Base of every error the controller raises on purpose."""


class NotFound(RelaunchError):
    """The named job, node or attempt does not exist (HTTP 404)."""


class Conflict(RelaunchError):
    """The request is valid but the current state does not allow it (HTTP 409)."""


class StaleState(Conflict):
    """A compare-and-set lost: the row changed since it was read."""


class Fenced(Conflict):
    """A node reported for an attempt it is no longer a member of; ``reason`` says why."""

    def __init__(self, message: str, reason: StopReason = StopReason.FENCED) -> None:
        super().__init__(message)
        self.reason = reason


class Unauthenticated(RelaunchError):
    """No credential, or one that is unknown or revoked (HTTP 401)."""


class Forbidden(RelaunchError):
    """A valid credential that may not do this (HTTP 403)."""


class TooLarge(RelaunchError):
    """A value, key or state over the controller's bounds, or one too many (HTTP 413)."""


class LimitReached(Conflict):
    """The user's limit on unfinished jobs or on nodes would be passed (HTTP 409)."""


class IdempotencyMismatch(RelaunchError):
    """An Idempotency-Key used before with a different body (HTTP 422)."""
