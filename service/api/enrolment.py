"""Routes for per-node enrolment tokens: only admins make, list and revoke them."""

from __future__ import annotations

from datetime import timedelta

from fastapi import APIRouter, status

from service import enrolment
from service.api.deps import AdminDep, IdPath, NowDep, ReadSessionDep, SessionDep
from service.models import EnrolmentToken
from service.schemas import (
    EnrolmentTokenCreate,
    EnrolmentTokenCreated,
    EnrolmentTokenPublic,
    EnrolmentTokensPublic,
)

router = APIRouter(prefix="/enrolment-tokens", tags=["nodes"])


@router.post("", response_model=EnrolmentTokenCreated, status_code=status.HTTP_201_CREATED)
def create_token(
    body: EnrolmentTokenCreate, admin: AdminDep, session: SessionDep, now: NowDep
) -> EnrolmentTokenCreated:
    """A token for a node's agent to register with; its text is in this answer only."""
    row, secret = enrolment.create(
        session,
        admin,
        now,
        expires_in=timedelta(seconds=body.expires_in_s),
        node_name=body.node_name,
        single_use=body.single_use,
    )
    return EnrolmentTokenCreated(token=EnrolmentTokenPublic.model_validate(row), secret=secret)


@router.get("", response_model=EnrolmentTokensPublic)
def list_tokens(_: AdminDep, session: ReadSessionDep) -> EnrolmentTokensPublic:
    rows = enrolment.list_tokens(session)
    return EnrolmentTokensPublic(items=[EnrolmentTokenPublic.model_validate(r) for r in rows])


@router.post("/{token_id}/revoke", response_model=EnrolmentTokenPublic)
def revoke_token(token_id: IdPath, _: AdminDep, session: SessionDep, now: NowDep) -> EnrolmentToken:
    """It admits no registration from now on; nodes it admitted keep their node tokens."""
    return enrolment.revoke(session, token_id, now)
