"""Routes for users and their API tokens. Only admins make, list and revoke them;
every user may ask who they are."""

from __future__ import annotations

from fastapi import APIRouter, status

from service import auth
from service.api.deps import (
    AdminDep,
    CredentialsDep,
    FactoryDep,
    IdPath,
    NowDep,
    Offset,
    PageLimit,
    ReadSessionDep,
    SessionDep,
    UserDep,
)
from service.db import transaction
from service.models import ApiToken, User
from service.schemas import (
    TokenCreate,
    TokenCreated,
    TokenPublic,
    TokensPublic,
    UserCreate,
    UserCreated,
    UserPublic,
    UsersPublic,
)

router = APIRouter(tags=["users"])


def _created(row: ApiToken, secret: str) -> TokenCreated:
    return TokenCreated(token=TokenPublic.model_validate(row), secret=secret)


@router.get("/users/me", response_model=UserPublic)
def me(user: UserDep) -> User:
    return user


@router.post("/users", response_model=UserCreated, status_code=status.HTTP_201_CREATED)
def create_user(body: UserCreate, _: AdminDep, session: SessionDep, now: NowDep) -> UserCreated:
    user, row, secret = auth.create_user(
        session,
        body.name,
        body.role,
        now,
        max_active_jobs=body.max_active_jobs,
        max_nodes=body.max_nodes,
    )
    return UserCreated(user=UserPublic.model_validate(user), token=_created(row, secret))


@router.get("/users", response_model=UsersPublic)
def list_users(
    _: AdminDep,
    session: ReadSessionDep,
    limit: PageLimit = 200,
    offset: Offset = 0,
) -> UsersPublic:
    users, total = auth.list_users(session, limit, offset)
    items = [UserPublic.model_validate(u) for u in users]
    return UsersPublic(items=items, total=total, limit=limit, offset=offset)


@router.get("/users/{user_id}/tokens", response_model=TokensPublic)
def list_tokens(user_id: IdPath, _: AdminDep, session: ReadSessionDep) -> TokensPublic:
    rows = auth.user_tokens(session, user_id)
    return TokensPublic(items=[TokenPublic.model_validate(r) for r in rows])


@router.post(
    "/users/{user_id}/tokens", response_model=TokenCreated, status_code=status.HTTP_201_CREATED
)
def create_token(
    user_id: IdPath, body: TokenCreate, _: AdminDep, session: SessionDep, now: NowDep
) -> TokenCreated:
    user = auth.get_user(session, user_id)
    return _created(*auth.create_token(session, user, body.label, now))


@router.post("/tokens/{token_id}/revoke", response_model=TokenPublic)
def revoke_token(
    token_id: IdPath, _: AdminDep, factory: FactoryDep, credentials: CredentialsDep, now: NowDep
) -> ApiToken:
    # Forgotten once the revoke is committed: a request checking the token meanwhile
    # could otherwise cache it again as live.
    with transaction(factory) as session:
        row = auth.revoke_token(session, token_id, now)
    credentials.forget(row.token_hash)
    return row
