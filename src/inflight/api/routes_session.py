"""Routes that need no model: client config, health, capabilities, sessions, heartbeats, telemetry.

Thin: validate, read or write one row, answer (spec §4, §5.1). A session belongs to the tenant that created
it; to any other its id is unknown.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from inflight.api.access_log import annotate
from inflight.api.db import SessionRow, utcnow
from inflight.api.ids import check_session_id, new_session_id
from inflight.api.schemas import (
    ClientConfigResponse,
    CreateSessionRequest,
    CreateSessionResponse,
    FinishSessionRequest,
    GetServerCapabilitiesResponse,
    HealthResponse,
    SessionHeartbeatRequest,
    SessionHeartbeatResponse,
    SupportedModel,
    TelemetryResponse,
)
from inflight.api.service import StateDep, TenantDep

router = APIRouter(prefix="/api/v1")


@router.post("/client/config")
def client_config() -> ClientConfigResponse:
    return ClientConfigResponse()


@router.post("/client/dynamic_config")
def dynamic_config() -> dict[str, Any]:
    # The SDK sends /cancel_future for a sampling future it abandons (routes_futures.py).
    return {"refresh_interval_sec": 300, "sample_cancel_enabled": True}


@router.get("/healthz")
def healthz() -> HealthResponse:
    return HealthResponse()


@router.get("/server_stats")
def server_stats(state: StateDep) -> dict[str, int]:
    """The worker's counters (settled futures by outcome, batches formed, errors caught)."""
    return dict(state.counters())


@router.get("/get_server_capabilities")
def get_server_capabilities(state: StateDep) -> GetServerCapabilitiesResponse:
    return GetServerCapabilitiesResponse(
        supported_models=[
            SupportedModel(model_name=info.name, max_context_length=info.limits.max_context)
            for info in state.base_models.values()
        ]
    )


@router.post("/create_session")
def create_session(body: CreateSessionRequest, state: StateDep, tenant: TenantDep) -> CreateSessionResponse:
    session_id = new_session_id()
    with state.db.write() as session:
        session.add(
            SessionRow(
                session_id=session_id,
                tags=body.tags,
                user_metadata=body.user_metadata,
                sdk_version=body.sdk_version,
                tenant=tenant,
            )
        )
    annotate(session_id=session_id)
    return CreateSessionResponse(session_id=session_id)


@router.post("/session_heartbeat")
def session_heartbeat(
    body: SessionHeartbeatRequest, state: StateDep, tenant: TenantDep
) -> SessionHeartbeatResponse:
    annotate(session_id=body.session_id)
    state.session(body.session_id, tenant=tenant)
    with state.db.write() as session:
        row = session.get(SessionRow, body.session_id)
        if row is not None:
            row.last_heartbeat_at = utcnow()
            row.heartbeat_count += 1
    return SessionHeartbeatResponse()


@router.post("/sessions/{session_id}/finish")
def finish_session(
    session_id: str, body: FinishSessionRequest, state: StateDep, tenant: TenantDep
) -> dict[str, str]:
    """Marks the session finished; the worker unloads its adapters once their queues drain. Checkpoints
    stay. The first reason wins, as in the SDK's contract."""
    state.session(check_session_id(session_id), tenant=tenant)
    with state.db.write() as session:
        row = session.get(SessionRow, session_id)
        if row is not None and row.status != "finished":
            row.status = "finished"
    state.wake()
    return {"session_id": session_id, "status": "finished", "reason": body.reason.type}


@router.post("/telemetry")
async def telemetry() -> TelemetryResponse:
    # Accepted and dropped: the SDK's events are for the hosted service's dashboards.
    return TelemetryResponse()
