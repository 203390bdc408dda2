"""Routes of the rendezvous the controller serves to node launchers, and of the
snapshot fence it serves to workers.

The rendezvous routes take the node's token, as every node route does, and
answer only a node that is an ACTIVE member of the RUNNING attempt whose
rendezvous id the path names (``service.rendezvous.member_attempt``); with the
``MEMBER_HEADER``, only the launcher of that membership. Reading
keys may wait (long poll) up to ``MAX_WAIT_S``; a client that must wait longer
calls again. The fence routes take a worker token and answer only for its job.
Every route ends its transaction before it returns (see ``service.api.nodes``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, TypeVar

from fastapi import APIRouter, Depends, Header, Path, Query, Response
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel
from sqlalchemy.orm import Session, sessionmaker

from contract.rendezvous import (
    MAX_WAIT_S,
    MEMBER_HEADER,
    RendezvousState,
    SetRendezvousState,
    SnapshotWriter,
    StoreAdd,
    StoreCompareSet,
    StoreCount,
    StoreDeleted,
    StoreGet,
    StoreKey,
    StoreSet,
    StoreValue,
    StoreValues,
    decode,
    encode,
)
from service import fence, rendezvous
from service.api.deps import (
    FactoryDep,
    IdPath,
    NodeTokenDep,
    ReadFactoryDep,
    WorkerTokenDep,
)
from service.db import retry_on_stale, transaction

router = APIRouter(prefix="/rendezvous", tags=["rendezvous"])
workers = APIRouter(prefix="/workers", tags=["workers"])

RdzvId = Annotated[str, Path(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")]
POLL_S = 0.05  # how often a waiting read looks again
STATE_POLL_S = 0.1  # how often a launcher's wait for a new rendezvous state looks again
T = TypeVar("T")


@dataclass(frozen=True)
class Caller:
    """The calling node's token, and the membership its launcher says it runs for (if it
    says). The token is checked where the route reads the attempt, in the same statement
    (``rendezvous.member_attempt``): a store call is one trip to a worker thread and one
    transaction, not two of each."""

    token: str
    member_id: int | None

    def attempt(self, session: Session, rdzv_id: str, *, lock: bool = False) -> int:
        return rendezvous.member_attempt(
            session, rdzv_id, self.token, member_id=self.member_id, lock=lock
        )


async def _caller(
    token: NodeTokenDep,
    member: Annotated[
        int | None,
        Header(
            alias=MEMBER_HEADER,
            ge=1,
            le=2**63 - 1,
            description="The membership the calling launcher runs for (Assignment.member_id)",
        ),
    ] = None,
) -> Caller:
    return Caller(token, member)


CallerDep = Annotated[Caller, Depends(_caller)]


def _answer(model: BaseModel) -> Response:
    """``model``'s JSON, as a sync route returns it: returned as the model, FastAPI would
    validate and serialize it on a second trip to a worker thread after the route's own
    (a report answers the same way, ``service.api.nodes``)."""
    return Response(model.model_dump_json(), media_type="application/json")


def _write(
    factory: sessionmaker[Session], rdzv_id: str, caller: Caller, work: Callable[[Session, int], T]
) -> T:
    """``work(session, attempt_id)`` in one transaction, if the caller may write there."""

    def run(session: Session) -> T:
        return work(session, caller.attempt(session, rdzv_id, lock=True))

    return retry_on_stale(factory, run)


@router.get("/{rdzv_id}/state", response_model=RendezvousState)
async def get_state(
    rdzv_id: RdzvId,
    caller: CallerDep,
    factory: ReadFactoryDep,
    changed_from: Annotated[
        int | None,
        Query(
            ge=0,
            le=2**62,
            description="answer once the version is no longer this one, or after wait_s",
        ),
    ] = None,
    wait_s: Annotated[float, Query(ge=0, le=3600)] = 0.0,
) -> RendezvousState:
    """The attempt's rendezvous state and its version; none (version 0) before the first
    write. With ``changed_from``, waits (at most ``wait_s``, at most ``MAX_WAIT_S``) for
    another version: a launcher that waits for the others learns at once that they came."""

    def version() -> int:
        with transaction(factory) as session:
            return rendezvous.state_version(session, caller.attempt(session, rdzv_id))

    def read() -> tuple[tuple[bytes, int] | None, int]:
        with transaction(factory) as session:
            attempt_id = caller.attempt(session, rdzv_id)
            found = rendezvous.get_state(session, attempt_id)
            return found, rendezvous.member_count(session, attempt_id)

    if changed_from is not None:
        deadline = time.monotonic() + min(wait_s, MAX_WAIT_S)
        while await run_in_threadpool(version) == changed_from:
            if time.monotonic() >= deadline:
                break
            await asyncio.sleep(STATE_POLL_S)
    found, members = await run_in_threadpool(read)
    if found is None:
        return RendezvousState(members=members)
    return RendezvousState(state=encode(found[0]), version=found[1], members=members)


@router.post("/{rdzv_id}/state", response_model=RendezvousState)
def set_state(
    rdzv_id: RdzvId, body: SetRendezvousState, caller: CallerDep, factory: FactoryDep
) -> Response:
    """Write the state if ``version`` is the stored one (compare-and-set); answer with
    the state stored now, and whether this call wrote it."""
    blob = decode(body.state)

    def write(session: Session, attempt_id: int) -> tuple[rendezvous.StateReply, int]:
        reply = rendezvous.set_state(session, attempt_id, blob, body.version)
        return reply, rendezvous.member_count(session, attempt_id)

    reply, members = _write(factory, rdzv_id, caller, write)
    return _answer(
        RendezvousState(
            state=None if reply.state is None else encode(reply.state),
            version=reply.version,
            written=reply.written,
            members=members,
        )
    )


@router.post("/{rdzv_id}/store/set", response_model=StoreCount)
def store_set(rdzv_id: RdzvId, body: StoreSet, caller: CallerDep, factory: FactoryDep) -> Response:
    """Set each key; answers how many were set."""
    items = {item.key: decode(item.value) for item in body.items}
    _write(factory, rdzv_id, caller, lambda s, a: rendezvous.set_values(s, a, items))
    return _answer(StoreCount(value=len(items)))


@router.post("/{rdzv_id}/store/get", response_model=StoreValues)
async def store_get(
    rdzv_id: RdzvId, body: StoreGet, caller: CallerDep, factory: ReadFactoryDep
) -> StoreValues:
    """The values of ``keys``, once all exist or after ``wait_s`` (at most ``MAX_WAIT_S``)
    with those that do; ``complete`` says which."""
    wanted = set(body.keys)

    def read() -> dict[str, bytes]:
        with transaction(factory) as session:
            attempt_id = caller.attempt(session, rdzv_id)
            return rendezvous.values_of(session, attempt_id, body.keys)

    deadline = time.monotonic() + min(body.wait_s, MAX_WAIT_S)
    while True:
        found = await run_in_threadpool(read)
        complete = len(found) == len(wanted)
        if complete or time.monotonic() >= deadline:
            values = {k: encode(v) for k, v in found.items()} if body.with_values else {}
            return StoreValues(values=values, complete=complete)
        await asyncio.sleep(POLL_S)


@router.post("/{rdzv_id}/store/add", response_model=StoreCount)
def store_add(rdzv_id: RdzvId, body: StoreAdd, caller: CallerDep, factory: FactoryDep) -> Response:
    count = _write(
        factory, rdzv_id, caller, lambda s, a: rendezvous.add(s, a, body.key, body.amount)
    )
    return _answer(StoreCount(value=count))


@router.post("/{rdzv_id}/store/compare_set", response_model=StoreValue)
def store_compare_set(
    rdzv_id: RdzvId, body: StoreCompareSet, caller: CallerDep, factory: FactoryDep
) -> Response:
    expected, desired = decode(body.expected), decode(body.desired)
    value = _write(
        factory,
        rdzv_id,
        caller,
        lambda s, a: rendezvous.compare_set(s, a, body.key, expected, desired),
    )
    return _answer(StoreValue(value=encode(value)))


@router.post("/{rdzv_id}/store/delete_key", response_model=StoreDeleted)
def store_delete_key(
    rdzv_id: RdzvId, body: StoreKey, caller: CallerDep, factory: FactoryDep
) -> Response:
    deleted = _write(factory, rdzv_id, caller, lambda s, a: rendezvous.delete_key(s, a, body.key))
    return _answer(StoreDeleted(deleted=deleted))


@router.get("/{rdzv_id}/store/num_keys", response_model=StoreCount)
def store_num_keys(rdzv_id: RdzvId, caller: CallerDep, factory: ReadFactoryDep) -> Response:
    with transaction(factory) as session:
        count = rendezvous.num_keys(session, caller.attempt(session, rdzv_id))
    return _answer(StoreCount(value=count))


@workers.post("/jobs/{job_id}/snapshot-writer", response_model=SnapshotWriter)
def take_writer(job_id: IdPath, token: WorkerTokenDep, factory: FactoryDep) -> SnapshotWriter:
    """Take the job's next snapshot-writer token (rank 0, as it starts)."""

    def take(session: Session) -> int:
        fence.check_worker(session, token, job_id)
        return fence.take(session, job_id)

    return SnapshotWriter(token=retry_on_stale(factory, take))


@workers.get("/jobs/{job_id}/snapshot-writer", response_model=SnapshotWriter)
def current_writer(
    job_id: IdPath, token: WorkerTokenDep, factory: ReadFactoryDep
) -> SnapshotWriter:
    """The job's newest snapshot-writer token (rank 0, before each commit)."""
    with transaction(factory) as session:
        fence.check_worker(session, token, job_id)
        writer = fence.current(session, job_id)
    return SnapshotWriter(token=writer)
