"""Routes for node agents (register, heartbeat, report, leave) and for watching nodes.

An agent registers with an enrolment credential (the controller's shared
token or a per-node one, ``service.enrolment``) and gets a token of its own;
every later call of the node carries that token, and a node may act only as
itself. Only the holder of an ALIVE node's token registers under its name.

The agents' routes end their transaction before they return: FastAPI builds the
answer on another worker thread, and a transaction held until then keeps a
pooled connection (and on SQLite the write lock) while it waits for a thread
that may itself be waiting for that connection or lock.
"""

from __future__ import annotations

import functools
import math

import anyio
from fastapi import APIRouter, Request, Response, status
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials

from contract.events import SnapshotSaved
from contract.protocol import (
    AttemptReport,
    Heartbeat,
    HeartbeatReply,
    NodeLeave,
    NodeLeft,
    NodeRegister,
    NodeRegistered,
    ReportAccepted,
)
from service import auth, enrolment, heartbeats, nodes, reports
from service.api.deps import (
    BearerDep,
    EnrolmentDep,
    FactoryDep,
    FleetCall,
    FleetCallDep,
    IdPath,
    NodeDep,
    NowDep,
    Offset,
    PageLimit,
    ReadSessionDep,
    SettingsDep,
    UserDep,
    WakeDep,
    get_node,
)
from service.api.lane import Shed
from service.db import retry_on_stale, transaction, transaction_if_asked
from service.errors import Unauthenticated
from service.models import Node, Role, User
from service.schemas import NodeGpuPublic, NodePublic, NodesPublic

router = APIRouter(prefix="/nodes", tags=["nodes"])
# The least Retry-After of a shed heartbeat: more than an agent's client waits out within
# one call (``worker.client.RETRY_AFTER_IN_CALL_MAX_S``), so a shed heartbeat is not tried
# again at once; the agent's own schedule sends the next.
SHED_RETRY_AFTER_MIN_S = 3
# How long a registration waits for the reconciler's pass that it started.
REGISTER_WAITS_FOR_PASS_S = 1.0


@router.post("/register", response_model=NodeRegistered)
def register(
    body: NodeRegister,
    credential: EnrolmentDep,
    factory: FactoryDep,
    settings: SettingsDep,
    now: NowDep,
    wake: WakeDep,
) -> NodeRegistered:
    """401 or 403: the enrolment credential does not admit this name; 409: the name is
    an ALIVE node's and the request does not carry that node's token."""
    with transaction(factory) as session:
        enrolment.admit(
            session, credential, body.name, settings.enrolment_token, now, body.registration_key
        )
        node = nodes.register_node(session, body, now)
        node_token = auth.issue_node_token(session, node)
    # A waiting job, or a running one that may grow, gets the node in a pass that ends
    # before the reply: the agent's first heartbeat, sent at once, finds its assignment.
    wake(REGISTER_WAITS_FOR_PASS_S)
    # The base interval: an agent that follows the pace takes it from its first heartbeat's
    # reply (sent at once), and one that does not keeps this one, which its row says.
    return NodeRegistered(
        node_id=node.id, heartbeat_interval_s=settings.heartbeat_interval_s, node_token=node_token
    )


@router.post("/{node_id}/heartbeat", response_model=HeartbeatReply)
async def heartbeat(
    node_id: IdPath,
    body: Heartbeat,
    credentials: BearerDep,
    call: FleetCallDep,
    request: Request,
) -> Response:
    """Answered on the heartbeats' own threads (``heartbeat_threads``), which reports and
    reads do not take: a node whose heartbeats wait is lost. 503 with Retry-After (the
    interval this controller tells nodes, at least ``SHED_RETRY_AFTER_MIN_S``): the
    heartbeat waited longer than ``heartbeat_wait_max_s`` or its node left meanwhile, and
    was not worked on (``service.api.lane``); its node is still recorded as heard from, in
    a batch written before a later heartbeat's work (``heartbeats.Liveness``)."""
    answer = functools.partial(_heartbeat, node_id, body, credentials, call)
    if call.lane is None:
        return await anyio.to_thread.run_sync(answer)

    def flushed_then_answered() -> Response:
        call.liveness.flush(call.factory)
        return answer()

    try:
        return await call.lane.run(request, flushed_then_answered)
    except Shed as shed:
        call.liveness.note(node_id, credentials.credentials if credentials else None, call.now)
        call.metrics.shed.labels("heartbeat", shed.reason).inc()
        retry_s = max(math.ceil(call.pace.last()), SHED_RETRY_AFTER_MIN_S)
        return JSONResponse(
            status_code=status.HTTP_503_SERVICE_UNAVAILABLE,
            content={
                "detail": f"the controller is overloaded: this heartbeat was not worked on "
                f"({shed}), though its node is recorded as heard from; retry after {retry_s} s"
            },
            headers={"Retry-After": str(retry_s)},
        )


def _heartbeat(
    node_id: int,
    body: Heartbeat,
    credentials: HTTPAuthorizationCredentials | None,
    call: FleetCall,
) -> Response:
    """An ALIVE node's heartbeat with its own token is recorded and its memberships read
    in one statement on PostgreSQL (``heartbeats.OneStatement``), in one transaction of
    two on SQLite; on PostgreSQL a transaction follows only to render a job's assignment
    for the first time, and an answer that starts something is made the SQLite way,
    which holds the node's row until its worker tokens are written (every few seconds,
    a short read counts the ALIVE nodes for the pace). Any other call is checked as every node
    route's is (401, 403) and then recorded the long way (a LOST or LEFT node is ALIVE
    again). The answer's JSON is made of assignments kept as JSON."""
    token = credentials.credentials if credentials is not None else None
    interval_s = call.pace.interval()  # before the transaction: it may read on its own
    short_way = token is not None
    if token is not None and call.one_statement is not None:
        found = call.one_statement(node_id, token, body, call.now, interval_s)
        if found is not None and not heartbeats.starts_something(found, body):
            with transaction_if_asked(call.factory) as session:  # to render a new assignment
                reply = heartbeats.reply(
                    node_id,
                    found,
                    body,
                    call.settings,
                    call.keyring,
                    call.answers,
                    interval_s,
                    session,
                )
            return Response(reply, media_type="application/json")
        short_way = found is not None  # recorded; its answer starts something
    if token is not None and short_way:
        with transaction(call.factory) as session:
            if heartbeats.record(session, node_id, token, body, call.now, interval_s):
                reply = heartbeats.answer(
                    session,
                    node_id,
                    body,
                    call.settings,
                    call.keyring,
                    call.answers,
                    interval_s,
                    call.now,
                )
                return Response(reply, media_type="application/json")
    node = get_node(node_id, call.read_factory, credentials)
    with transaction(call.factory) as session:
        nodes.record_heartbeat(session, node.id, body, call.now, interval_s, token=token)
        reply = heartbeats.answer(
            session, node.id, body, call.settings, call.keyring, call.answers, interval_s, call.now
        )
    return Response(reply, media_type="application/json")


# A report's answer, made once: returned as a model, FastAPI would validate and serialize it
# on a second trip to a worker thread after the route's own (a sync route's answer is
# validated there): a twentieth of a report's CPU in the API's process (bench.request_cost).
_ACCEPTED = ReportAccepted(accepted=True).model_dump_json().encode()


@router.post("/{node_id}/reports", response_model=ReportAccepted)
def report(
    node_id: IdPath, body: AttemptReport, credentials: BearerDep, call: FleetCallDep
) -> Response:
    """409 means fenced (stop the attempt); 503 means retry later. The node's token is
    checked in the report's own transaction; a call without it is checked as every node
    route's is (401, 403), and nothing is written."""
    token = credentials.credentials if credentials is not None else None
    try:
        applied = retry_on_stale(
            call.factory, lambda s: reports.handle_report(s, node_id, body, call.now, token)
        )
    except reports.NotTheNodesToken:
        get_node(node_id, call.read_factory, credentials)  # 401 or 403, with the reason
        raise Unauthenticated("the node token is unknown; register again") from None
    if applied:  # committed: a retried report is counted once
        snapshots = (e.data for e in body.events if isinstance(e.data, SnapshotSaved))
        call.metrics.observe_snapshots(snapshots)
    return Response(_ACCEPTED, media_type="application/json")


@router.post("/{node_id}/leave", response_model=NodeLeft)
def leave(node: NodeDep, body: NodeLeave, factory: FactoryDep, now: NowDep) -> NodeLeft:
    """The agent is stopping: the node is LEFT (not LOST) and drops out of its attempts
    now, not at its heartbeat timeout."""
    with transaction(factory) as session:
        return NodeLeft(left=nodes.leave(session, node.id, body.reason, now))


@router.get("", response_model=NodesPublic)
def list_nodes(
    session: ReadSessionDep,
    user: UserDep,
    limit: PageLimit = 200,
    offset: Offset = 0,
) -> NodesPublic:
    """Every node with its GPUs and their use; the job a node (or a GPU) serves is shown
    only to that job's owner and to admins."""
    page, total = nodes.list_nodes(session, limit, offset)
    visible = [(node, serving, [s for s in serving if may_see(user, s)]) for node, serving in page]
    zygotes = nodes.zygote_memory(
        session, [(node.id, mine[0].attempt.id) for node, _, mine in visible if mine]
    )
    items = []
    for node, serving, mine in visible:
        shown = mine[0].attempt if mine else None
        holder = {g: s.attempt.job_id for s in mine for g in s.gpus}
        held = {g for s in serving for g in s.gpus}
        items.append(
            NodePublic(
                id=node.id,
                name=node.name,
                address=node.address,
                slots=node.slots,
                state=node.state,
                registered_at=node.registered_at,
                last_heartbeat_at=node.last_heartbeat_at,
                busy=bool(serving),
                attempt_id=shown.id if shown else None,
                job_id=shown.job_id if shown else None,
                zygote_rss_bytes=zygotes.get((node.id, shown.id)) if shown else None,
                cpus=node.cpus,
                gpu_driver=node.gpu_driver,
                cuda_version=node.cuda_version,
                gpus=gpus_public(node, held, holder),
            )
        )
    return NodesPublic(items=items, total=total, limit=limit, offset=offset)


def may_see(user: User, serving: nodes.Serving) -> bool:
    """Whether ``user`` may see which job ``serving`` is: its owner's, or an admin."""
    return user.role is Role.ADMIN or serving.attempt.job.owner_id == user.id


def gpus_public(node: Node, held: set[int], holder: dict[int, int]) -> list[NodeGpuPublic]:
    """``node``'s GPUs with their use at its last heartbeat; ``held``: the indices running
    attempts hold, ``holder``: of those, the job of each the caller may see."""
    usage = {int(u["index"]): u for u in node.gpu_usage}
    return [
        NodeGpuPublic(
            index=g["index"],
            name=g.get("name") or "",
            uuid=g.get("uuid"),
            memory_total_bytes=g.get("memory_total_bytes"),
            utilization_pct=usage.get(g["index"], {}).get("utilization_pct"),
            memory_used_bytes=usage.get(g["index"], {}).get("memory_used_bytes"),
            held=g["index"] in held,
            job_id=holder.get(g["index"]),
        )
        for g in node.gpus
    ]
