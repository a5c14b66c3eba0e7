"""Training runs and their checkpoints: list (per run and across runs), get, delete, publish and unpublish,
TTL, weights_info (spec §4 O routes, §9). Archive download is in routes_archives.py.

Everything is the caller's tenant's: listings list only its runs and checkpoints, another tenant's run is
unknown (404), and only the owner may delete, publish, unpublish or expire a checkpoint. weights_info (like
sampling from and loading a checkpoint) also reads another tenant's checkpoint while it is published."""

from __future__ import annotations

from fastapi import APIRouter, Query
from sqlalchemy import func, select

from inflight.api.checkpoints import StoredCheckpoint
from inflight.api.db import CREATION_FAILED, FutureRow, ModelRow
from inflight.api.ids import CheckpointKind, check_model_id, checkpoint_path, parse_checkpoint_path
from inflight.api.schemas import (
    MAX_COUNT,
    CheckpointInfo,
    CheckpointsListResponse,
    Cursor,
    LoraConfig,
    SetCheckpointTtlRequest,
    TrainingRun,
    TrainingRunsResponse,
    WeightsInfoRequest,
    WeightsInfoResponse,
)
from inflight.api.service import NotFoundError, ServiceState, StateDep, TenantDep
from inflight.errors import UserError

router = APIRouter(prefix="/api/v1")

MODEL_OWNER = "inflight"  # a run is listed only to its own tenant, so the owner is always the caller
_FOLDER_KINDS: dict[str, CheckpointKind] = {"weights": "state", "sampler_weights": "sampler"}


def folder_kind(folder: str) -> CheckpointKind:
    """The kind of checkpoint a URL's `{folder}` segment names (the SDK's checkpoint_id is folder/name)."""
    kind = _FOLDER_KINDS.get(folder)
    if kind is None:
        raise UserError(f"unknown checkpoint folder {folder!r}: expected 'weights' or 'sampler_weights'")
    return kind


@router.get("/training_runs")
def list_training_runs(
    state: StateDep,
    tenant: TenantDep,
    limit: int = Query(default=20, ge=1, le=1000),
    offset: int = Query(default=0, ge=0, le=MAX_COUNT),  # SQLite and PostgreSQL take 64-bit offsets only
) -> TrainingRunsResponse:
    # A model whose creation failed (its create_model, or a create-via-load) is no training run: the SDK
    # raised that error instead of handing out its id. Its row stays, for the error its id then gets.
    mine = (ModelRow.tenant == tenant) & (ModelRow.status != CREATION_FAILED)
    with state.db.read() as session:
        total = session.scalar(select(func.count()).select_from(ModelRow).where(mine)) or 0
        model_ids = session.scalars(
            select(ModelRow.model_id)
            .where(mine)
            .order_by(ModelRow.created_at, ModelRow.model_id)
            .offset(offset)
            .limit(limit)
        ).all()
    return TrainingRunsResponse(
        training_runs=[_training_run(state, model_id, tenant) for model_id in model_ids],
        cursor=Cursor(offset=offset, limit=limit, total_count=total),
    )


@router.get("/training_runs/{model_id}")
def get_training_run(model_id: str, state: StateDep, tenant: TenantDep) -> TrainingRun:
    return _training_run(state, check_model_id(model_id), tenant)


@router.get("/training_runs/{model_id}/checkpoints")
def list_checkpoints(model_id: str, state: StateDep, tenant: TenantDep) -> CheckpointsListResponse:
    state.model(check_model_id(model_id), tenant=tenant)
    return CheckpointsListResponse(checkpoints=[_info(c) for c in state.checkpoints.for_model(model_id)])


@router.delete("/training_runs/{model_id}/checkpoints/{folder}/{name}")
def delete_checkpoint(
    model_id: str, folder: str, name: str, state: StateDep, tenant: TenantDep
) -> dict[str, str]:
    path = checkpoint_path(model_id, folder_kind(folder), name)
    state.checkpoints.delete(path, owner=tenant)
    return {"deleted": str(path)}


@router.post("/training_runs/{model_id}/checkpoints/{folder}/{name}/publish")
def publish_checkpoint(
    model_id: str, folder: str, name: str, state: StateDep, tenant: TenantDep
) -> CheckpointInfo:
    """Idempotent, unlike the SDK's documented 409 for "already public": the SDK retries a 409 for minutes.
    Published, other tenants may read the checkpoint through its tinker:// path (sample, load, download)."""
    path = checkpoint_path(model_id, folder_kind(folder), name)
    return _info(state.checkpoints.set_public(path, True, owner=tenant))


@router.delete("/training_runs/{model_id}/checkpoints/{folder}/{name}/publish")
def unpublish_checkpoint(
    model_id: str, folder: str, name: str, state: StateDep, tenant: TenantDep
) -> CheckpointInfo:
    path = checkpoint_path(model_id, folder_kind(folder), name)
    return _info(state.checkpoints.set_public(path, False, owner=tenant))


@router.put("/training_runs/{model_id}/checkpoints/{folder}/{name}/ttl")
def set_checkpoint_ttl(
    model_id: str, folder: str, name: str, body: SetCheckpointTtlRequest, state: StateDep, tenant: TenantDep
) -> CheckpointInfo:
    path = checkpoint_path(model_id, folder_kind(folder), name)
    return _info(state.checkpoints.set_ttl(path, body.ttl_seconds, owner=tenant))


@router.get("/checkpoints")
def list_user_checkpoints(
    state: StateDep,
    tenant: TenantDep,
    limit: int = Query(default=100, ge=1, le=1000),
    offset: int = Query(default=0, ge=0, le=MAX_COUNT),
) -> CheckpointsListResponse:
    """The caller's checkpoints across its runs, newest first (not other tenants' published ones)."""
    total, checkpoints = state.checkpoints.list_all(tenant=tenant, limit=limit, offset=offset)
    return CheckpointsListResponse(
        checkpoints=[_info(c) for c in checkpoints],
        cursor=Cursor(offset=offset, limit=limit, total_count=total),
    )


@router.post("/weights_info")
def weights_info(body: WeightsInfoRequest, state: StateDep, tenant: TenantDep) -> WeightsInfoResponse:
    source = state.checkpoints.source(str(parse_checkpoint_path(body.tinker_path)), reader=tenant)
    lora = LoraConfig.model_validate(source.lora_config)
    return WeightsInfoResponse(
        base_model=source.base_model,
        lora_rank=lora.rank,
        train_unembed=lora.train_unembed,
        train_mlp=lora.train_mlp,
        train_attn=lora.train_attn,
    )


def _training_run(state: ServiceState, model_id: str, tenant: str) -> TrainingRun:
    row = state.model(model_id, tenant=tenant)
    if row.status == CREATION_FAILED:
        raise NotFoundError(
            f"{model_id!r} is no training run: its creation failed (see its create_model or load_weights "
            "error); create a new training client"
        )
    with state.db.read() as session:
        last_request = session.scalar(
            select(func.max(FutureRow.created_at)).where(FutureRow.model_id == model_id)
        )
    checkpoints = state.checkpoints.for_model(model_id)
    last = {c.path.kind: c for c in checkpoints}  # oldest first, so the last one of each kind wins
    return TrainingRun(
        training_run_id=model_id,
        base_model=row.base_model,
        model_owner=MODEL_OWNER,
        lora_rank=row.lora_rank,
        last_request_time=last_request or row.created_at,
        last_checkpoint=_info(last["state"]) if "state" in last else None,
        last_sampler_checkpoint=_info(last["sampler"]) if "sampler" in last else None,
    )


def _info(checkpoint: StoredCheckpoint) -> CheckpointInfo:
    path = checkpoint.path
    folder = "weights" if path.kind == "state" else "sampler_weights"
    return CheckpointInfo(
        checkpoint_id=f"{folder}/{path.name}",
        checkpoint_type="training" if path.kind == "state" else "sampler",
        time=checkpoint.created_at,
        tinker_path=str(path),
        size_bytes=checkpoint.size_bytes,
        public=checkpoint.public,
        expires_at=checkpoint.expires_at,
    )
