"""Liveness and readiness, and which controller acts."""

from __future__ import annotations

from fastapi import APIRouter
from sqlalchemy import text

from service.api.deps import NowDep, ReadSessionDep, SettingsDep
from service.leader import current
from service.schemas import Health

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health)
def healthz(session: ReadSessionDep, settings: SettingsDep, now: NowDep) -> Health:
    """200 while the database answers, on the leader and on a standby alike."""
    session.execute(text("SELECT 1"))
    leader = current(session, now)
    me = settings.controller_id
    return Health(
        status="ok",
        database="ok",
        controller=me,
        role="leader" if leader is not None and leader.holder == me else "standby",
        leader=leader.holder if leader else None,
    )
