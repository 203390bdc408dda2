"""Typed dependencies shared by the routers."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session, sessionmaker

from service.settings import ControllerSettings


def get_session(request: Request) -> Iterator[Session]:
    """One transaction per request: committed if the route returns, rolled back if it raises."""
    factory: sessionmaker[Session] = request.app.state.session_factory
    with factory() as session, session.begin():
        yield session


def get_settings(request: Request) -> ControllerSettings:
    settings: ControllerSettings = request.app.state.settings
    return settings


def get_now(request: Request) -> datetime:
    clock: Callable[[], datetime] = request.app.state.clock
    return clock()


# scope="function": commit before the response is sent, so a client that got 201
# can read what it created at once (the default scope commits after sending).
def get_session_factory(request: Request) -> sessionmaker[Session]:
    factory: sessionmaker[Session] = request.app.state.session_factory
    return factory


SessionDep = Annotated[Session, Depends(get_session, scope="function")]
SettingsDep = Annotated[ControllerSettings, Depends(get_settings)]
NowDep = Annotated[datetime, Depends(get_now)]
FactoryDep = Annotated[sessionmaker[Session], Depends(get_session_factory)]
