"""Sampling routes: create_sampling_session, samplers/{id}, asample (spec §4, §8).

A sampling session names frozen weights: a sampler checkpoint (model_path), the bare base model, or an
in-memory snapshot that save_weights_for_sampler made (the worker creates those sessions).

A sampling session belongs to the tenant whose session created it; to any other its id is unknown. One made
from another tenant's checkpoint (allowed while that checkpoint is published) samples only while it still
is: asample reads the checkpoint's owner and publication with the session's row, in the same query.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from inflight.api import jobs
from inflight.api.access_log import annotate
from inflight.api.checkpoints import not_found_error
from inflight.api.db import CheckpointRow, SamplingSessionRow
from inflight.api.futures import RequestType
from inflight.api.ids import new_sampling_session_id, parse_checkpoint_path
from inflight.api.routes_common import check_session_open, parse_body, submit
from inflight.api.schemas import (
    CreateSamplingSessionRequest,
    CreateSamplingSessionResponse,
    GetSamplerResponse,
    SampleRequest,
    UntypedAPIFuture,
    future_response,
)
from inflight.api.service import NotFoundError, ServiceState, StateDep, TenantDep
from inflight.errors import UserError

router = APIRouter(prefix="/api/v1")


@router.post("/create_sampling_session")
def create_sampling_session(
    body: CreateSamplingSessionRequest, state: StateDep, tenant: TenantDep
) -> CreateSamplingSessionResponse:
    annotate(session_id=body.session_id)
    check_session_open(state, body.session_id, tenant, "the sampling session")
    model_path: str | None = None
    if body.model_path is not None:
        model_path = str(parse_checkpoint_path(body.model_path))
        base_model = state.checkpoints.source(model_path, reader=tenant).base_model
        if body.base_model is not None and body.base_model != base_model:
            raise UserError(f"{model_path} was trained on {base_model!r}, not {body.base_model!r}")
    elif body.base_model is not None:
        base_model = state.base_model(body.base_model).name
    else:
        raise UserError("create_sampling_session needs a model_path (tinker://...) or a base_model")
    sampling_session_id = new_sampling_session_id(body.session_id, body.sampling_session_seq_id)
    wanted = (base_model, model_path, None)
    try:
        with state.db.write() as session:
            row = session.get(SamplingSessionRow, sampling_session_id)
            if row is None:
                session.add(
                    SamplingSessionRow(
                        sampling_session_id=sampling_session_id,
                        session_id=body.session_id,
                        sampling_session_seq_id=body.sampling_session_seq_id,
                        base_model=base_model,
                        model_path=model_path,
                        tenant=tenant,
                    )
                )
                row = None
    except IntegrityError:  # a concurrent retry inserted it first
        row = _sampling_session(state, sampling_session_id, tenant)
    if row is not None and (row.base_model, row.model_path, row.snapshot_key) != wanted:
        raise UserError(
            f"sampling_session_seq_id {body.sampling_session_seq_id} of session {body.session_id!r} already "
            "names other weights; a new sampling client needs the next sampling_session_seq_id"
        )
    annotate(sampling_session_id=sampling_session_id)
    return CreateSamplingSessionResponse(sampling_session_id=sampling_session_id)


@router.get("/samplers/{sampler_id}")
def get_sampler(sampler_id: str, state: StateDep, tenant: TenantDep) -> GetSamplerResponse:
    row = _sampling_session(state, sampler_id, tenant)
    return GetSamplerResponse(
        sampler_id=row.sampling_session_id, base_model=row.base_model, model_path=row.model_path
    )


@router.post("/asample")
async def asample(request: Request, state: StateDep, tenant: TenantDep) -> UntypedAPIFuture:
    """Samples of all sessions and adapters are batched by the worker; the promise carries one sequence id
    per requested sample, which the SDK stamps on the returned sequences in order. The body (long prompts,
    prompt logprob targets) is parsed in the thread pool, as forward_backward's is: on the event loop a
    large one would stall every other request meanwhile."""
    raw = await request.body()
    return await run_in_threadpool(_asample, state, tenant, raw)


def _asample(state: ServiceState, tenant: str, raw: bytes) -> UntypedAPIFuture:
    body = parse_body(SampleRequest, raw)
    if body.sampling_session_id is None or body.seq_id is None:
        raise UserError(
            "asample needs sampling_session_id and seq_id (create a sampling client first); sampling by "
            "base_model/model_path alone is the pre-0.18 protocol and is not served"
        )
    annotate(sampling_session_id=body.sampling_session_id)
    row = _sampling_session(state, body.sampling_session_id, tenant, sampling=True)
    limits = state.base_model(row.base_model).limits

    # Samples run in no particular order, so a refused one leaves no hole in a queue: answer 400 at once
    # (the SDK raises it), naming the field, rather than queue an already failed future.
    jobs.sample_job(
        body,
        base_model=row.base_model,
        weights=None,
        limits=limits,
        default_max_tokens=state.config.default_max_tokens,
        max_num_samples=state.config.max_num_samples,
        max_topk_logprobs=state.config.max_topk_logprobs,
    )
    payload = body.model_dump_json().encode()
    future = submit(state, tenant, body.sampling_session_id, body.seq_id, RequestType.SAMPLE, payload)
    sequence_ids = [f"{future.request_id}-{i}" for i in range(body.num_samples)]
    return future_response(future, sample_sequence_ids=sequence_ids)


def _sampling_session(
    state: ServiceState, sampling_session_id: str, tenant: str, *, sampling: bool = False
) -> SamplingSessionRow:
    """`tenant`'s sampling session (NotFoundError, as for none, if it is another's). `sampling`: also
    refuse, as a checkpoint never saved, one whose checkpoint is another tenant's and no longer published;
    its owner and publication come with the row (an outer join), not from a second read."""
    with state.db.read() as session:
        found = session.execute(
            select(SamplingSessionRow, CheckpointRow.tenant, CheckpointRow.published_at)
            .outerjoin(CheckpointRow, CheckpointRow.tinker_path == SamplingSessionRow.model_path)
            .where(SamplingSessionRow.sampling_session_id == sampling_session_id)
        ).one_or_none()
        if found is not None:
            session.expunge(found[0])  # keep its loaded values past the read's rollback
    if found is None or found[0].tenant != tenant:
        raise NotFoundError(
            f"unknown sampling session {sampling_session_id!r}: create a sampling client first"
        )
    row, owner, published_at = found
    # A checkpoint session whose checkpoint's row is gone (deleted) or is another tenant's and no longer
    # published samples no more, though the engine may still hold the weights. (An expired one keeps its
    # row: the worker, which checks the checkpoint again, says it expired.)
    if (
        sampling
        and row.model_path is not None
        and (owner is None or (owner != tenant and published_at is None))
    ):
        raise not_found_error(row.model_path)
    return row
