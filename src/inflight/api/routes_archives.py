"""Checkpoint archive download: the SDK's archive URL route, and the signed route that URL points at.

`GET .../checkpoints/{folder}/{name}/archive` (behind the API key) answers `{"url", "expires"}` with a link
to `GET /api/v1/archives/{model_id}/{folder}/{name}?expires=..&signature=..` on this server, which streams a
tar of the checkpoint's PEFT directory. That route is open without a key (the SDK downloads with plain
urllib) and answers 403 unless the link's signature verifies and has not expired (archives.py).

A link is only handed to a tenant who may read the checkpoint: its owner, or anyone while it is published
(another tenant's unpublished checkpoint answers 404, as one never saved). A link handed to a non-owner is
signed as shared and stops working once the checkpoint is unpublished.
"""

from __future__ import annotations

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from inflight.api.archives import ARCHIVE_LINK_LIFETIME, ArchiveLinkError, TarStream
from inflight.api.db import utcnow
from inflight.api.ids import checkpoint_path
from inflight.api.routes_checkpoints import folder_kind
from inflight.api.schemas import CheckpointArchiveUrlResponse
from inflight.api.service import StateDep, TenantDep

router = APIRouter(prefix="/api/v1")

ARCHIVES_PREFIX = "/api/v1/archives/"  # the auth middleware lets these through to their signature check


@router.get("/training_runs/{model_id}/checkpoints/{folder}/{name}/archive")
def get_archive_url(
    model_id: str, folder: str, name: str, request: Request, state: StateDep, tenant: TenantDep
) -> CheckpointArchiveUrlResponse:
    path = checkpoint_path(model_id, folder_kind(folder), name)
    # 404 (unknown, or another tenant's and not published), or 410 if it expired
    checkpoint = state.checkpoints.get(path, reader=tenant)
    expires = utcnow() + ARCHIVE_LINK_LIFETIME
    if checkpoint.expires_at is not None:
        expires = min(expires, checkpoint.expires_at)  # a link never outlives its checkpoint
    link = state.archive_signer.sign(path, expires, shared=checkpoint.owner != tenant)
    base = str(request.base_url).rstrip("/")
    url = (
        f"{base}{ARCHIVES_PREFIX}{model_id}/{folder}/{name}"
        f"?expires={int(link.expires.timestamp())}&signature={link.signature}"
    )
    return CheckpointArchiveUrlResponse(url=url, expires=link.expires)


@router.get(ARCHIVES_PREFIX.removeprefix("/api/v1") + "{model_id}/{folder}/{name}")
def download_archive(
    model_id: str,
    folder: str,
    name: str,
    state: StateDep,
    expires: int = Query(ge=0, le=2**40),
    signature: str = Query(min_length=1, max_length=128),
) -> StreamingResponse:
    path = checkpoint_path(model_id, folder_kind(folder), name)
    shared = state.archive_signer.verify(path, expires, signature, utcnow())  # before anything is read
    checkpoint = state.checkpoints.get(path, reader=None)  # the signature is the credential: no tenant
    if shared and not checkpoint.public:
        raise ArchiveLinkError(
            f"the download link of {path} was given out while the checkpoint was published, and it no "
            "longer is"
        )
    stream = TarStream(checkpoint.storage_dir)
    filename = f"{model_id}_{folder}_{name}.tar".replace(":", "-")
    return StreamingResponse(
        stream,
        media_type="application/x-tar",
        headers={
            "Content-Length": str(stream.size),
            "Content-Disposition": f'attachment; filename="{filename}"',
        },
    )
