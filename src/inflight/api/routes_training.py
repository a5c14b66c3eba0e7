"""Training routes: create_model, get_info, forward_backward (protobuf or JSON), forward (JSON), optim_step,
save_weights, save_weights_for_sampler, load_weights. Thin: validate, write a future, return it (§4, §7).

A model belongs to the tenant whose session created it: to any other, its id is unknown (404) on every
route, checked through `model_base`'s cache, so the check costs the hot path no database read. Loading
from a checkpoint path reads it as the caller (`CheckpointStore.source(reader=...)`): its own, or another
tenant's published one.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from inflight.api import jobs
from inflight.api.access_log import annotate_future
from inflight.api.db import ModelRow
from inflight.api.futures import FIRST_SEQ_ID, RequestType
from inflight.api.ids import checkpoint_path, model_id
from inflight.api.proto import (
    PROTO_CONTENT_TYPE,
    ProtoError,
    forward_backward_from_json,
    forward_backward_header,
    forward_backward_job,
    parse_forward_backward,
)
from inflight.api.routes_common import (
    check_session_open,
    invalid_body_detail,
    parse_body,
    reject_invalid_body,
    submit,
)
from inflight.api.schemas import (
    CreateModelRequest,
    ForwardBackwardJsonRequest,
    ForwardJsonRequest,
    GetInfoRequest,
    GetInfoResponse,
    LoadWeightsRequest,
    LoraConfig,
    ModelData,
    OptimStepRequest,
    SaveWeightsForSamplerRequest,
    SaveWeightsRequest,
    UntypedAPIFuture,
    future_response,
)
from inflight.api.service import ServiceState, StateDep, TenantDep
from inflight.errors import UserError
from inflight.trainer.types import ForwardBackwardJob

router = APIRouter(prefix="/api/v1")
LIVE_MODEL_STATES = ("creating", "ready")  # ModelRow.status of a model whose adapter is (to be) in memory
# The ordered routes whose body FastAPI validates before the route runs: app.py's 422 handler records a
# body that fails validation but names its model and seq_id as a failed future (reject_invalid_body), so
# it leaves no hole in the model's queue. forward_backward and forward validate their own bodies.
ORDERED_BODY_ROUTES: dict[str, RequestType] = {
    f"{router.prefix}/optim_step": RequestType.OPTIM_STEP,
    f"{router.prefix}/save_weights": RequestType.SAVE_WEIGHTS,
    f"{router.prefix}/save_weights_for_sampler": RequestType.SAVE_WEIGHTS_FOR_SAMPLER,
    f"{router.prefix}/load_weights": RequestType.LOAD_WEIGHTS,  # its create-via-load form takes no seq_id
}


@router.post("/create_model")
def create_model(body: CreateModelRequest, state: StateDep, tenant: TenantDep) -> UntypedAPIFuture:
    check_session_open(state, body.session_id, tenant, "the model")
    state.base_model(body.base_model)
    _check_new_model(state, body.lora_config, body.optimizer_config.type)
    new_id = model_id(body.session_id, body.model_seq_id)
    _ensure_model_row(
        state, tenant, new_id, body.session_id, body.model_seq_id, body.base_model, body.lora_config
    )
    future = state.store.submit(
        new_id, FIRST_SEQ_ID, RequestType.CREATE_MODEL, body.model_dump_json().encode(), tenant=tenant
    )
    state.wake(RequestType.CREATE_MODEL)
    annotate_future(future)
    return future_response(future)


@router.post("/get_info")
def get_info(body: GetInfoRequest, state: StateDep, tenant: TenantDep) -> GetInfoResponse:
    row = state.model(body.model_id, tenant=tenant)
    info = state.base_model(row.base_model)
    return GetInfoResponse(
        model_id=row.model_id,
        model_data=ModelData(arch=info.arch, model_name=row.base_model, tokenizer_id=info.tokenizer_dir),
        lora_rank=row.lora_rank,
        model_name=row.base_model,
    )


@router.post("/forward_backward")
async def forward_backward(request: Request, state: StateDep, tenant: TenantDep) -> UntypedAPIFuture:
    """Also TrainingClient.forward() (`forward_only` selects it). The body is protobuf from SDK 0.25 on,
    JSON before (turned into the same protobuf message, so both take one path from here)."""
    content_type = request.headers.get("content-type", "")
    if request.headers.get("content-encoding", "identity") != "identity":
        raise UserError(
            "compressed bodies are not accepted (the client config sets proto_compress_fwdbwd=false)"
        )
    body = await request.body()
    if PROTO_CONTENT_TYPE in content_type:
        return await run_in_threadpool(_submit_pass, state, tenant, body)
    if "json" not in content_type:
        raise UserError(
            f"forward_backward takes a protobuf ({PROTO_CONTENT_TYPE}) or JSON (application/json) body, "
            f"got Content-Type {content_type!r}"
        )
    return await run_in_threadpool(_submit_json_pass, state, tenant, body)


@router.post("/forward")
async def forward(request: Request, state: StateDep, tenant: TenantDep) -> UntypedAPIFuture:
    """TrainingClient.forward() of the SDKs before 0.25: a JSON body, never protobuf."""
    body = await request.body()
    return await run_in_threadpool(_submit_json_pass, state, tenant, body, forward_only=True)


def _submit_json_pass(
    state: ServiceState, tenant: str, body: bytes, *, forward_only: bool = False
) -> UntypedAPIFuture:
    wire: type[ForwardJsonRequest | ForwardBackwardJsonRequest] = (
        ForwardJsonRequest if forward_only else ForwardBackwardJsonRequest
    )
    request_type = RequestType.FORWARD if forward_only else RequestType.FORWARD_BACKWARD
    try:
        parsed = parse_body(wire, body)
    except RequestValidationError as err:  # the SDK counted its seq_id: a failed future if it can be read
        rejected = reject_invalid_body(state, tenant, request_type, body, invalid_body_detail(err.errors()))
        if rejected is None:
            raise
        return future_response(rejected)
    inputs = parsed.forward_input if isinstance(parsed, ForwardJsonRequest) else parsed.forward_backward_input
    state.model_base(parsed.model_id, tenant=tenant)
    try:
        proto_body = forward_backward_from_json(
            parsed.model_id, parsed.seq_id, inputs, forward_only=forward_only
        )
    except ProtoError as err:  # the seq_id is valid and counted by the SDK: fail its future, leave no gap
        failure = err

        def refuse() -> None:
            raise failure

        return future_response(
            submit(state, tenant, parsed.model_id, parsed.seq_id, request_type, body, check=refuse)
        )
    return _submit_pass(state, tenant, proto_body)


def _submit_pass(state: ServiceState, tenant: str, body: bytes) -> UntypedAPIFuture:
    message = parse_forward_backward(body)
    header = forward_backward_header(message)
    limits = state.base_model(state.model_base(header.model_id, tenant=tenant)).limits
    request_type = RequestType.FORWARD if header.forward_only else RequestType.FORWARD_BACKWARD

    def check() -> None:
        job = forward_backward_job(message, vocab_size=limits.vocab_size)
        _check_tokens_per_request(job, state.config.max_tokens_per_train_request)

    future = submit(state, tenant, header.model_id, header.seq_id, request_type, body, check=check)
    return future_response(future)


def _check_tokens_per_request(job: ForwardBackwardJob, limit: int) -> None:
    """A pass runs to its end while other keys' training waits: one request may hold only so much."""
    tokens = sum(len(datum.input_tokens) for datum in job.data)
    if tokens > limit:
        raise UserError(
            f"this request holds {tokens} tokens, more than this server runs in one pass "
            f"(max_tokens_per_train_request={limit}): send its datums in several requests (the tinker "
            "SDK splits a large call by itself; gradients add up until optim_step)"
        )


@router.post("/optim_step")
def optim_step(body: OptimStepRequest, state: StateDep, tenant: TenantDep) -> UntypedAPIFuture:
    state.model_base(body.model_id, tenant=tenant)
    payload = body.model_dump_json().encode()
    future = submit(
        state,
        tenant,
        body.model_id,
        body.seq_id,
        RequestType.OPTIM_STEP,
        payload,
        check=lambda: jobs.optim_step(body),
    )
    return future_response(future)


@router.post("/save_weights")
def save_weights(body: SaveWeightsRequest, state: StateDep, tenant: TenantDep) -> UntypedAPIFuture:
    state.model_base(body.model_id, tenant=tenant)
    payload = body.model_dump_json().encode()

    def check() -> None:
        named = None if body.path is None else checkpoint_path(body.model_id, "state", body.path)
        # A key out of room learns it now; the worker checks again, exactly, once the size is known.
        state.checkpoints.check_room(tenant, named, overwrite=body.overwrite)

    future = submit(state, tenant, body.model_id, body.seq_id, RequestType.SAVE_WEIGHTS, payload, check=check)
    return future_response(future)


@router.post("/save_weights_for_sampler")
def save_weights_for_sampler(
    body: SaveWeightsForSamplerRequest, state: StateDep, tenant: TenantDep
) -> UntypedAPIFuture:
    state.model_base(body.model_id, tenant=tenant)
    payload = body.model_dump_json().encode()

    def check() -> None:
        if body.path is not None:  # a named save writes files; a sampling session's snapshot stays in memory
            named = checkpoint_path(body.model_id, "sampler", body.path)
            state.checkpoints.check_room(tenant, named, overwrite=False)
        elif body.sampling_session_seq_id is None:
            raise UserError("save_weights_for_sampler needs a name (path) or a sampling_session_seq_id")

    future = submit(
        state, tenant, body.model_id, body.seq_id, RequestType.SAVE_WEIGHTS_FOR_SAMPLER, payload, check=check
    )
    return future_response(future)


@router.post("/load_weights")
def load_weights(body: LoadWeightsRequest, state: StateDep, tenant: TenantDep) -> UntypedAPIFuture:
    """Create-via-load (session_id + model_seq_id: a new model from a checkpoint, its LoRA config taken from
    the model that wrote it) or the legacy load_state onto an existing model (model_id + seq_id). The
    checkpoint must be the caller's or published (checked here, and again by the worker as it loads)."""
    payload = body.model_dump_json().encode()
    if body.session_id is not None:
        if body.model_seq_id is None:
            raise UserError("load_weights with session_id also needs model_seq_id")
        check_session_open(state, body.session_id, tenant, "the model")
        source = state.checkpoints.source(body.path, reader=tenant)
        if body.base_model is not None and body.base_model != source.base_model:
            raise UserError(f"{body.path} was trained on {source.base_model!r}, not {body.base_model!r}")
        if body.optimizer and source.checkpoint.path.kind != "state":
            raise UserError(f"{body.path} is a sampler checkpoint: it holds no optimizer state")
        lora = LoraConfig.model_validate(source.lora_config)
        new_id = model_id(body.session_id, body.model_seq_id)
        _ensure_model_row(state, tenant, new_id, body.session_id, body.model_seq_id, source.base_model, lora)
        future = state.store.submit(new_id, FIRST_SEQ_ID, RequestType.LOAD_WEIGHTS, payload, tenant=tenant)
        state.wake(RequestType.LOAD_WEIGHTS)
        annotate_future(future)
        return future_response(future)
    if body.model_id is None or body.seq_id is None:
        raise UserError("load_weights needs either session_id + model_seq_id, or model_id + seq_id")
    row = state.model(body.model_id, tenant=tenant)

    def check() -> None:
        source = state.checkpoints.source(body.path, reader=tenant)
        if (source.base_model, LoraConfig.model_validate(source.lora_config).rank) != (
            row.base_model,
            row.lora_rank,
        ):
            raise UserError(
                f"{body.path} holds a rank-{source.lora_config.get('rank')} adapter of "
                f"{source.base_model!r}; "
                f"{body.model_id} is rank {row.lora_rank} on {row.base_model!r}"
            )

    future = submit(state, tenant, body.model_id, body.seq_id, RequestType.LOAD_WEIGHTS, payload, check=check)
    return future_response(future)


def _check_new_model(state: ServiceState, lora: LoraConfig, optimizer: str) -> None:
    if optimizer != "adamw":
        raise UserError(f"optimizer {optimizer!r} is not supported; this server trains with 'adamw'")
    if lora.rank > state.config.max_lora_rank:
        raise UserError(f"LoRA rank {lora.rank} is above this server's limit of {state.config.max_lora_rank}")


def _ensure_model_row(
    state: ServiceState,
    tenant: str,
    new_id: str,
    session_id: str,
    model_seq_id: int,
    base_model: str,
    lora: LoraConfig,
) -> None:
    """Insert `tenant`'s model's row unless a retry of the same request already did. (The session is the
    tenant's, checked by the caller, and a model id names its session: an existing row is the tenant's.)"""
    wanted = (base_model, lora.model_dump())
    try:
        with state.db.write() as session:
            row = session.get(ModelRow, new_id)
            if row is None:
                _check_room_for_a_model(session, state.config.max_models_per_tenant, tenant)
                session.add(
                    ModelRow(
                        model_id=new_id,
                        session_id=session_id,
                        model_seq_id=model_seq_id,
                        base_model=base_model,
                        lora_rank=lora.rank,
                        lora_config=lora.model_dump(),
                        tenant=tenant,
                    )
                )
                return
    except IntegrityError:  # a concurrent retry inserted it first
        row = state.model(new_id, tenant=tenant)
    if (row.base_model, row.lora_config) != wanted:
        raise UserError(
            f"model_seq_id {model_seq_id} of session {session_id!r} is already model {new_id} "
            f"({row.base_model!r}, rank {row.lora_rank}); a new model needs the next model_seq_id"
        )


def _check_room_for_a_model(session: Session, limit: int, tenant: str) -> None:
    """Each live model holds an adapter and its optimizer state in memory until its session finishes: a
    key that kept creating them would exhaust the server's memory under every other tenant.

    One key's creates take turns: under PostgreSQL's READ COMMITTED, creates at once each counted the
    others' uncommitted models as absent and all inserted (16 at once against a cap of 4 left 13). The lock
    is the transaction's, released at its commit; SQLite's BEGIN IMMEDIATE serialises every writer already.
    """
    if session.get_bind().dialect.name == "postgresql":
        session.execute(select(func.pg_advisory_xact_lock(func.hashtext(f"inflight.models:{tenant}"))))
    live = session.scalar(
        select(func.count())
        .select_from(ModelRow)
        .where(ModelRow.tenant == tenant, ModelRow.status.in_(LIVE_MODEL_STATES))
    )
    if live is not None and live >= limit:
        raise UserError(
            f"this API key already has {live} models loaded, the most this server holds for one key "
            f"(max_models_per_tenant={limit}): finish the sessions you no longer need (close their "
            "ServiceClient, or POST /api/v1/sessions/{session_id}/finish; GET /api/v1/training_runs lists "
            "your models, each id starting with its session's), whose models are unloaded within seconds "
            "once their queued requests are done, then create this one again"
        )
