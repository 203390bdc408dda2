"""Routes for node agents (register, heartbeat, report) and for watching nodes."""

from __future__ import annotations

from fastapi import APIRouter

from service import nodes, reports
from service.api.deps import FactoryDep, NowDep, SessionDep, SettingsDep
from service.db import retry_on_stale
from service.schemas import NodePublic, NodesPublic
from worker.protocol import (
    AttemptReport,
    Heartbeat,
    HeartbeatReply,
    NodeLeave,
    NodeLeft,
    NodeRegister,
    NodeRegistered,
    ReportAccepted,
)

router = APIRouter(prefix="/nodes", tags=["nodes"])


@router.post("/register", response_model=NodeRegistered)
def register(
    body: NodeRegister, session: SessionDep, settings: SettingsDep, now: NowDep
) -> NodeRegistered:
    node = nodes.register_node(session, body, now)
    return NodeRegistered(node_id=node.id, heartbeat_interval_s=settings.heartbeat_interval_s)


@router.post("/{node_id}/heartbeat", response_model=HeartbeatReply)
def heartbeat(
    node_id: int, body: Heartbeat, session: SessionDep, settings: SettingsDep, now: NowDep
) -> HeartbeatReply:
    return nodes.heartbeat(session, node_id, body, settings, now)


@router.post("/{node_id}/reports", response_model=ReportAccepted)
def report(node_id: int, body: AttemptReport, factory: FactoryDep, now: NowDep) -> ReportAccepted:
    """409 means fenced (stop the attempt); 503 means retry later."""
    retry_on_stale(factory, lambda s: reports.handle_report(s, node_id, body, now))
    return ReportAccepted(accepted=True)


@router.post("/{node_id}/leave", response_model=NodeLeft)
def leave(node_id: int, body: NodeLeave, session: SessionDep, now: NowDep) -> NodeLeft:
    """The agent is stopping: drop the node from its attempts now, not at its timeout."""
    return NodeLeft(left=nodes.leave(session, node_id, body.reason, now))


@router.get("", response_model=NodesPublic)
def list_nodes(session: SessionDep) -> NodesPublic:
    items = [
        NodePublic(
            id=node.id,
            name=node.name,
            address=node.address,
            slots=node.slots,
            state=node.state,
            registered_at=node.registered_at,
            last_heartbeat_at=node.last_heartbeat_at,
            attempt_id=attempt.id if attempt else None,
            job_id=attempt.job_id if attempt else None,
        )
        for node, attempt in nodes.list_nodes(session)
    ]
    return NodesPublic(items=items)
