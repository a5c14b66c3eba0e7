"""JSON wire models of the Tinker routes that need no model math (spec §4, §5), checked against tinker 0.38.

Requests ignore unknown fields (newer SDKs add some); responses match the SDK's strictly validated models.
Owns the wire layer only: routes convert to `futures.Future` and the DB rows, never pass these inward.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from inflight.api.futures import Future
from inflight.api.ids import check_model_id, check_session_id

SessionId = Annotated[str, AfterValidator(check_session_id)]
ModelId = Annotated[str, AfterValidator(check_model_id)]
WireErrorCategory = Literal["user", "server", "unknown"]


class WireRequest(BaseModel):
    # protected_namespaces=(): the protocol has fields named model_id, model_seq_id, model_data.
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class WireResponse(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class ClientConfigRequest(WireRequest):
    sdk_version: str | None = None


class ClientConfigResponse(WireResponse):
    """Feature flags for the SDK. Every flag that would make it call a route we do not serve stays off."""

    pjwt_auth_enabled: bool = False
    # Sequential chunk submission: a big forward_backward's chunks then arrive in seq_id order (§7.1).
    parallel_fwdbwd_chunks: bool = False
    proto_compress_fwdbwd: bool = False
    sample_use_retrieve_futures: bool = False
    custom_loss_server_side: bool = False
    sample_join_sampling_session: bool = False


class HealthResponse(WireResponse):
    status: Literal["ok"] = "ok"


class SupportedModel(WireResponse):
    model_name: str
    max_context_length: int | None = None
    trainable: bool = True
    sampleable: bool = True


class GetServerCapabilitiesResponse(WireResponse):
    supported_models: list[SupportedModel]


class CreateSessionRequest(WireRequest):
    tags: list[str] = Field(default_factory=list)
    user_metadata: dict[str, Any] | None = None
    sdk_version: str | None = None
    project_id: str | None = None
    display_name: str | None = None
    type: Literal["create_session"] = "create_session"


class CreateSessionResponse(WireResponse):
    type: Literal["create_session"] = "create_session"
    session_id: str
    info_message: str | None = None
    warning_message: str | None = None
    error_message: str | None = None


class SessionHeartbeatRequest(WireRequest):
    session_id: SessionId
    type: Literal["session_heartbeat"] = "session_heartbeat"


class SessionHeartbeatResponse(WireResponse):
    type: Literal["session_heartbeat"] = "session_heartbeat"


class SessionEndReason(WireRequest):
    type: Literal["success", "errored", "interrupted"] = "success"


class FinishSessionRequest(WireRequest):
    """Body of POST /sessions/{session_id}/finish (the id is in the path)."""

    reason: SessionEndReason = Field(default_factory=SessionEndReason)
    detail: str | None = None


class LoraConfig(WireRequest):
    rank: int = Field(default=32, ge=1, le=1024)
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class OptimizerConfig(WireRequest):
    type: str = "adamw"  # only "adamw" is served; the route rejects others with a clear 400


class CreateModelRequest(WireRequest):
    session_id: SessionId
    model_seq_id: int = Field(ge=0)
    base_model: str = Field(min_length=1)
    lora_config: LoraConfig = Field(default_factory=LoraConfig)
    optimizer_config: OptimizerConfig = Field(default_factory=OptimizerConfig)
    user_metadata: dict[str, Any] | None = None
    type: Literal["create_model"] = "create_model"


class CreateModelResponse(WireResponse):
    """The result of a create_model future."""

    model_id: str
    type: Literal["create_model"] = "create_model"


class GetInfoRequest(WireRequest):
    model_id: ModelId
    type: Literal["get_info"] = "get_info"


class ModelData(WireResponse):
    arch: str | None = None
    model_name: str  # the SDK derives the tokenizer and the sampler's base_model from it
    tokenizer_id: str | None = None  # may be an absolute local dir, so the SDK works offline (§10)


class GetInfoResponse(WireResponse):
    type: Literal["get_info"] = "get_info"
    model_id: str
    model_data: ModelData
    is_lora: bool = True
    lora_rank: int
    model_name: str | None = None
    optimizer_config: OptimizerConfig = Field(default_factory=OptimizerConfig)


class UntypedAPIFuture(WireResponse):
    """What every asynchronous route answers at once."""

    request_id: str
    model_id: str | None = None
    sample_sequence_ids: list[str] | None = None  # asample only, one per requested sample


class FutureRetrieveRequest(WireRequest):
    request_id: str = Field(min_length=1)
    allow_metadata_only: bool = False


class TryAgainResponse(WireResponse):
    type: Literal["try_again"] = "try_again"
    request_id: str
    queue_state: Literal["active", "paused_capacity", "paused_rate_limit"] = "active"
    queue_state_reason: str | None = None


class RequestFailedResponse(WireResponse):
    error: str
    category: WireErrorCategory


def future_response(future: Future, sample_sequence_ids: list[str] | None = None) -> UntypedAPIFuture:
    # A sample's future.model_id is its sampling session, which is not a model id on the wire.
    model_id = future.model_id if future.request_type.ordered else None
    return UntypedAPIFuture(
        request_id=future.request_id, model_id=model_id, sample_sequence_ids=sample_sequence_ids
    )


def unfinished_or_failed(future: Future) -> TryAgainResponse | RequestFailedResponse | None:
    """retrieve_future's answer for a future that has no result to serve; None when it is done.

    A done future's stored result is served as is, protobuf or JSON by its request type (spec §3).
    """
    if future.status in ("pending", "running"):
        return TryAgainResponse(request_id=future.request_id)
    if future.status == "failed":
        return RequestFailedResponse(
            error=future.error or "request failed", category=future.error_category or "unknown"
        )
    return None
