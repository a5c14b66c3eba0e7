"""JSON wire models of the Tinker routes that need no model math (spec §4, §5), checked against tinker 0.38.

Requests ignore unknown fields (newer SDKs add some); responses match the SDK's strictly validated models.
Owns the wire layer only: routes convert to `futures.Future` and the DB rows, never pass these inward.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from inflight.api.futures import Future
from inflight.api.ids import check_model_id, check_session_id

SessionId = Annotated[str, AfterValidator(check_session_id)]
ModelId = Annotated[str, AfterValidator(check_model_id)]
WireErrorCategory = Literal["user", "server", "unknown"]
# Bounds that keep numbers inside their database columns and the engine's RNG.
MAX_SEQ_ID = 2**31 - 1  # the SDK's protobuf seq_id is an int32
MAX_MODEL_SEQ_ID = 999_999_999  # model ids allow 9 digits (ids.py)
MAX_TTL_S = 10 * 365 * 24 * 3600  # the SDK documents TTLs up to 10 years
SEED_LIMIT = 2**62
# A count or token id of a request: the protobuf wire types are int32, and nothing the engine serves
# (vocabulary, context, samples) comes near it. Tighter limits (vocabulary, context, the server's maxima)
# are checked where the model is known (jobs.py); this one keeps giant integers out of every later step.
MAX_COUNT = 2**31 - 1
# Free-form fields a client may set and the server stores (session and model rows, checkpoint metadata):
# bounded, so a request cannot make the database grow by the size of its body.
MAX_NAME_CHARS = 256  # sdk_version, project_id, display_name, a tag
MAX_TAGS = 64
MAX_BASE_MODEL_CHARS = 1024  # a name or a hub id; also echoed back in errors
MAX_METADATA_BYTES = 64 * 1024  # user_metadata, as JSON
MAX_DETAIL_CHARS = 64 * 1024  # a finished session's explanation (the SDK sends a short sentence)


def _small_metadata(value: dict[str, Any]) -> dict[str, Any]:
    """user_metadata may nest (dict[str, Any]), so no per-item bound holds it: its JSON size is bounded."""
    size = len(json.dumps(value, default=str))
    if size > MAX_METADATA_BYTES:
        raise ValueError(f"holds {size} bytes as JSON; at most {MAX_METADATA_BYTES} are accepted")
    return value


ShortText = Annotated[str, Field(max_length=MAX_NAME_CHARS)]
BaseModelName = Annotated[str, Field(max_length=MAX_BASE_MODEL_CHARS)]
UserMetadata = Annotated[dict[str, Any], AfterValidator(_small_metadata)]
StringMetadata = Annotated[dict[str, str], AfterValidator(_small_metadata)]


class WireRequest(BaseModel):
    # protected_namespaces=(): the protocol has fields named model_id, model_seq_id, model_data.
    model_config = ConfigDict(extra="ignore", protected_namespaces=())

    @model_validator(mode="after")
    def _utf8_strings(self) -> WireRequest:
        """JSON may carry lone surrogates (\\ud800), which no database or file name can store: refuse them
        here, naming the field, rather than fail later in a driver."""
        for name in type(self).model_fields:
            bad = _non_utf8(getattr(self, name))
            if bad is not None:
                raise ValueError(f"{name}{bad} is not valid UTF-8 text (it holds a lone surrogate)")
        return self


def _non_utf8(value: object, where: str = "") -> str | None:
    """The location of the first string (key or value) under `value` that UTF-8 cannot encode, else None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            bad = _non_utf8(key, f"{where}[key]") or _non_utf8(item, f"{where}[{key!r}]")
            if bad is not None:
                return bad
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            bad = _non_utf8(item, f"{where}[{i}]")
            if bad is not None:
                return bad
    return None


class WireResponse(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class ClientConfigRequest(WireRequest):
    sdk_version: ShortText | None = None


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
    tags: list[ShortText] = Field(default_factory=list, max_length=MAX_TAGS)
    user_metadata: UserMetadata | None = None
    sdk_version: ShortText | None = None
    project_id: ShortText | None = None
    display_name: ShortText | None = None
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
    detail: str | None = Field(default=None, max_length=MAX_DETAIL_CHARS)


class LoraConfig(WireRequest):
    rank: int = Field(default=32, ge=1, le=1024)
    seed: int | None = Field(default=None, ge=-SEED_LIMIT, le=SEED_LIMIT)
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class OptimizerConfig(WireRequest):
    type: str = "adamw"  # only "adamw" is served; the route rejects others with a clear 400


class CreateModelRequest(WireRequest):
    session_id: SessionId
    model_seq_id: int = Field(ge=0, le=MAX_MODEL_SEQ_ID)
    base_model: BaseModelName = Field(min_length=1)
    lora_config: LoraConfig = Field(default_factory=LoraConfig)
    optimizer_config: OptimizerConfig = Field(default_factory=OptimizerConfig)
    user_metadata: UserMetadata | None = None
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


class CancelFutureRequest(WireRequest):
    """The SDK's cancel of an abandoned sample (sent only while dynamic config's sample_cancel_enabled)."""

    request_id: str = Field(min_length=1)


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


# --- Training, sampling and checkpoint routes (spec §4, §8, §9) -----------------------------------------


class AdamParams(WireRequest):
    learning_rate: float = Field(default=1e-4, ge=0, allow_inf_nan=False)
    beta1: float = Field(default=0.9, ge=0, lt=1)
    beta2: float = Field(default=0.95, ge=0, lt=1)
    eps: float = Field(default=1e-12, gt=0, allow_inf_nan=False)
    weight_decay: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    grad_clip_norm: float = Field(default=0.0, ge=0, allow_inf_nan=False)


class OrderedRequestHeader(WireRequest):
    """What places a training client's request in its model's queue, read alone from a body that fails
    validation (routes_common.reject_invalid_body): enough to record the request as failed under its
    seq_id. A create-via-load (`session_id` set) is its model's first request and takes no seq_id."""

    model_id: ModelId
    seq_id: int = Field(ge=1, le=MAX_SEQ_ID)
    session_id: None = None


class OptimStepRequest(WireRequest):
    """The SDK names the parameters adam_params (AdamW) or optimizer_params (other families)."""

    model_id: ModelId
    seq_id: int = Field(ge=1, le=MAX_SEQ_ID)
    adam_params: AdamParams | None = None
    optim_params: AdamParams | None = None
    optimizer_params: dict[str, Any] | None = None
    type: Literal["optim_step"] = "optim_step"


class OptimStepResponse(WireResponse):
    metrics: dict[str, float] | None = None


class SaveWeightsRequest(WireRequest):
    model_id: ModelId
    path: str | None = None  # the checkpoint's name
    seq_id: int = Field(ge=1, le=MAX_SEQ_ID)
    ttl_seconds: int | None = Field(default=None, ge=1, le=MAX_TTL_S)
    overwrite: bool = False
    user_metadata: StringMetadata | None = None
    type: Literal["save_weights"] = "save_weights"


class SaveWeightsResponse(WireResponse):
    path: str
    type: Literal["save_weights"] = "save_weights"


class SaveWeightsForSamplerRequest(WireRequest):
    """Named (`path` set): a sampler checkpoint on disk. Ephemeral (`sampling_session_seq_id` set): a
    sampling session bound to the adapter's weights at this point of the model's seq_id order."""

    model_id: ModelId
    path: str | None = None
    sampling_session_seq_id: int | None = Field(default=None, ge=0, le=MAX_SEQ_ID)
    kind: Literal["snapshot", "inflight"] = "snapshot"
    seq_id: int = Field(ge=1, le=MAX_SEQ_ID)
    ttl_seconds: int | None = Field(default=None, ge=1, le=MAX_TTL_S)
    user_metadata: StringMetadata | None = None
    type: Literal["save_weights_for_sampler"] = "save_weights_for_sampler"


class SaveWeightsForSamplerResponse(WireResponse):
    path: str | None = None
    sampling_session_id: str | None = None
    type: Literal["save_weights_for_sampler"] = "save_weights_for_sampler"


class LoadWeightsRequest(WireRequest):
    """Create-via-load (`session_id` + `model_seq_id`) or legacy load_state (`model_id` + `seq_id`)."""

    model_id: ModelId | None = None
    seq_id: int | None = Field(default=None, ge=1, le=MAX_SEQ_ID)
    session_id: SessionId | None = None
    model_seq_id: int | None = Field(default=None, ge=0, le=MAX_MODEL_SEQ_ID)
    base_model: BaseModelName | None = None
    user_metadata: UserMetadata | None = None
    path: str = Field(min_length=1)
    optimizer: bool = False
    optimizer_config: OptimizerConfig | None = None
    type: Literal["load_weights"] = "load_weights"


class LoadWeightsResponse(WireResponse):
    path: str | None = None
    model_id: str | None = None
    type: Literal["load_weights"] = "load_weights"


class CreateSamplingSessionRequest(WireRequest):
    session_id: SessionId
    sampling_session_seq_id: int = Field(ge=0, le=MAX_SEQ_ID)
    base_model: BaseModelName | None = None
    model_path: str | None = None
    type: Literal["create_sampling_session"] = "create_sampling_session"


class CreateSamplingSessionResponse(WireResponse):
    sampling_session_id: str
    type: Literal["create_sampling_session"] = "create_sampling_session"


class GetSamplerResponse(WireResponse):
    sampler_id: str
    base_model: str
    model_path: str | None = None


class EncodedTextChunk(WireRequest):
    type: Literal["encoded_text"] = "encoded_text"
    tokens: list[Annotated[int, Field(ge=0, le=MAX_COUNT)]]


class ModelInput(WireRequest):
    # Only token chunks: images and audio need models this server does not load (a clear 422 names it).
    chunks: list[EncodedTextChunk]

    def tokens(self) -> list[int]:
        return [token for chunk in self.chunks for token in chunk.tokens]


class SamplingParams(WireRequest):
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_COUNT)
    seed: int | None = Field(default=None, ge=-SEED_LIMIT, le=SEED_LIMIT)
    stop: str | list[str] | list[Annotated[int, Field(ge=0, le=MAX_COUNT)]] | None = None
    temperature: float = Field(default=1.0, ge=0, allow_inf_nan=False)
    # -1: no limit; k >= the vocabulary keeps every token, exactly as -1 (jobs.py)
    top_k: int = Field(default=-1, ge=-1, le=MAX_COUNT)
    top_p: float = Field(default=1.0, gt=0, le=1)


class TensorData(WireRequest):
    """A tensor as JSON: a flat list of numbers with its dtype and shape; sparse CSR when the two index lists
    are set (loss inputs refuse those in proto.py; a sample's target_prompt_logprobs takes them, jobs.py)."""

    data: list[float] = Field(max_length=MAX_COUNT)
    dtype: Literal["int64", "float32"]
    shape: list[Annotated[int, Field(ge=0, le=MAX_COUNT)]] | None = None
    sparse_crow_indices: list[int] | None = None
    sparse_col_indices: list[int] | None = None


class SampleRequest(WireRequest):
    num_samples: int = Field(default=1, ge=1, le=MAX_COUNT)
    prompt: ModelInput
    sampling_params: SamplingParams
    sampling_session_id: str | None = None
    # Sampling clones number from 1e9 * k (k < 1e9), so these reach 1e18: 64-bit.
    seq_id: int | None = Field(default=None, ge=0, le=2**63 - 1)
    base_model: BaseModelName | None = None
    model_path: str | None = None
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = Field(default=0, ge=0, le=MAX_COUNT)
    topk_sample_logprobs: int = Field(default=0, ge=0, le=MAX_COUNT)
    target_prompt_logprobs: TensorData | None = None  # int64 [len(prompt) - 1, K], dense or CSR
    prompt_alt_tokens_k: int = Field(default=0, ge=0, le=MAX_COUNT)
    prompt_logprobs_last_n: int | None = Field(default=None, ge=-MAX_COUNT, le=MAX_COUNT)
    record_stability_info: bool | None = None
    type: Literal["sample"] = "sample"


# --- forward_backward / forward as JSON (the SDKs before 0.25; 0.25+ send protobuf, proto.py) --------------


class JsonDatum(WireRequest):
    model_input: ModelInput
    loss_fn_inputs: dict[str, TensorData]


class ForwardBackwardInput(WireRequest):
    data: list[JsonDatum]
    loss_fn: str
    loss_fn_config: dict[str, float] | None = None


class ForwardBackwardJsonRequest(WireRequest):
    """POST /forward_backward with a JSON body (proto.forward_backward_from_json makes it protobuf)."""

    forward_backward_input: ForwardBackwardInput
    model_id: ModelId
    seq_id: int = Field(ge=1, le=MAX_SEQ_ID)


class ForwardJsonRequest(WireRequest):
    """POST /forward: the JSON-era SDKs' TrainingClient.forward()."""

    forward_input: ForwardBackwardInput
    model_id: ModelId
    seq_id: int = Field(ge=1, le=MAX_SEQ_ID)


class TelemetryResponse(WireResponse):
    status: Literal["accepted"] = "accepted"


class CheckpointInfo(WireResponse):
    checkpoint_id: str  # "weights/<name>" or "sampler_weights/<name>"
    checkpoint_type: Literal["training", "sampler"]
    time: datetime
    tinker_path: str
    size_bytes: int | None = None
    public: bool = False
    user_metadata: dict[str, str] | None = None
    expires_at: datetime | None = None


class CheckpointArchiveUrlResponse(WireResponse):
    url: str  # a signed link on this server, usable without the API key until `expires`
    expires: datetime


class SetCheckpointTtlRequest(WireRequest):
    ttl_seconds: int | None = Field(ge=1, le=MAX_TTL_S)  # None: never expire


class Cursor(WireResponse):
    offset: int
    limit: int
    total_count: int


class CheckpointsListResponse(WireResponse):
    checkpoints: list[CheckpointInfo]
    cursor: Cursor | None = None


class TrainingRun(WireResponse):
    training_run_id: str
    base_model: str
    model_owner: str
    is_lora: bool = True
    corrupted: bool = False
    lora_rank: int | None = None
    last_request_time: datetime
    last_checkpoint: CheckpointInfo | None = None
    last_sampler_checkpoint: CheckpointInfo | None = None
    user_metadata: dict[str, str] | None = None


class TrainingRunsResponse(WireResponse):
    training_runs: list[TrainingRun]
    cursor: Cursor


class WeightsInfoRequest(WireRequest):
    tinker_path: str = Field(min_length=1)


class WeightsInfoResponse(WireResponse):
    base_model: str
    optimizer_config: OptimizerConfig = Field(default_factory=OptimizerConfig)
    is_lora: bool = True
    lora_rank: int | None = None
    train_unembed: bool | None = None
    train_mlp: bool | None = None
    train_attn: bool | None = None
