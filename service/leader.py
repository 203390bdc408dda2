"""The leader lease: of several controllers on one database, exactly one acts.

Every controller serves the API (its writes are compare-and-set and safe from
any of them), but only the holder of the ``reconciler`` lease runs the
reconciler's actions. The holder renews the lease at the first pass once a
quarter of it has passed (``Reconciler._lead``); a controller that finds it
expired takes it over and bumps ``term``.

What must hold: an action commits only in a transaction that has locked the
lease row and found this controller holding it, in the same term and before
expiry (``hold``). A leader that stalled past its lease (GC pause, SIGSTOP,
lost network) and wakes up can therefore decide on stale data but never commit
it: its next action fails with ``LeaseLost``. Expiry compares the controllers'
own clocks, so they must agree to well within ``lease_s`` (NTP).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.errors import StaleState
from service.models import ControllerLease

logger = logging.getLogger(__name__)

RECONCILER_LEASE = "reconciler"


class LeaseLost(StaleState):
    """This controller no longer holds the lease it acted under."""


@dataclass(frozen=True)
class Leadership:
    holder: str
    term: int
    expires_at: datetime


def _locked(session: Session, name: str) -> ControllerLease:
    lease = session.scalars(
        select(ControllerLease).where(ControllerLease.name == name).with_for_update()
    ).one_or_none()
    if lease is None:
        raise RuntimeError(f"lease {name!r} is missing: is the database at the newest migration?")
    return lease


def acquire(
    session: Session, holder: str, now: datetime, lease_s: float, name: str = RECONCILER_LEASE
) -> Leadership | None:
    """Renew the lease if ``holder`` has it, take it if it has expired; else None."""
    lease = _locked(session, name)
    if lease.holder != holder and lease.expires_at > now:
        return None
    if lease.holder != holder:
        logger.info(
            "controller %s takes the %s lease (term %d) from %s",
            holder,
            name,
            lease.term + 1,
            lease.holder or "nobody",
        )
        lease.holder, lease.term = holder, lease.term + 1
    lease.expires_at = now + timedelta(seconds=lease_s)
    lease.renewed_at = now
    return Leadership(lease.holder, lease.term, lease.expires_at)


def hold(
    session: Session, leadership: Leadership, now: datetime, name: str = RECONCILER_LEASE
) -> None:
    """Lock the lease row for this transaction; raise ``LeaseLost`` unless it is still ours."""
    _held(session, leadership, now, name)


def extend(
    session: Session,
    leadership: Leadership,
    now: datetime,
    lease_s: float,
    name: str = RECONCILER_LEASE,
) -> Leadership:
    """``hold``, and the lease lasts ``lease_s`` from ``now`` again: a leader whose pass
    takes longer than its lease keeps it while it acts. A lease that has expired is
    not extended (``LeaseLost``, as from ``hold``); the holder takes it again with
    ``acquire``."""
    lease = _held(session, leadership, now, name)
    lease.expires_at = now + timedelta(seconds=lease_s)
    lease.renewed_at = now
    return Leadership(lease.holder, lease.term, lease.expires_at)


def _held(session: Session, leadership: Leadership, now: datetime, name: str) -> ControllerLease:
    lease = _locked(session, name)
    if lease.holder != leadership.holder or lease.term != leadership.term:
        raise LeaseLost(f"the {name} lease passed to {lease.holder} (term {lease.term})")
    if lease.expires_at <= now:
        raise LeaseLost(f"the {name} lease expired at {lease.expires_at.isoformat()}")
    return lease


def release(session: Session, holder: str, now: datetime, name: str = RECONCILER_LEASE) -> bool:
    """Give the lease up at once (clean shutdown), so a standby need not wait out its expiry."""
    lease = _locked(session, name)
    if lease.holder != holder or lease.expires_at <= now:
        return False
    lease.expires_at = now
    return True


def current(session: Session, now: datetime, name: str = RECONCILER_LEASE) -> Leadership | None:
    """The live holder, if any (no lock; for status pages)."""
    lease = session.get(ControllerLease, name)
    if lease is None or not lease.holder or lease.expires_at <= now:
        return None
    return Leadership(lease.holder, lease.term, lease.expires_at)
