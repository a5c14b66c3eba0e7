"""The JSON wire models (api/schemas.py) against the real `tinker==0.38.0` SDK's own pydantic types.

Reference: /work/shared/reference/tinker-api.md §4-§5. Requests the SDK builds must parse here (plus fields a
newer SDK might add); responses built here must validate as the SDK's response models.
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from inflight.api import schemas

tinker_types = pytest.importorskip("tinker.types")


def _sent_by_sdk(request: BaseModel) -> dict[str, Any]:
    # Whatever a newer SDK adds must be ignored, not rejected.
    return {**request.model_dump(mode="json", exclude_none=True), "field_from_a_newer_sdk": 1}


def test_requests_built_by_the_sdk_parse() -> None:
    create_session = tinker_types.CreateSessionRequest(tags=["a"], user_metadata=None, sdk_version="0.38.0")
    assert schemas.CreateSessionRequest.model_validate(_sent_by_sdk(create_session)).tags == ["a"]
    heartbeat = tinker_types.SessionHeartbeatRequest(session_id="session-1")
    assert schemas.SessionHeartbeatRequest.model_validate(_sent_by_sdk(heartbeat)).session_id == "session-1"
    create_model = tinker_types.CreateModelRequest(
        session_id="session-1", model_seq_id=0, base_model="tiny", lora_config=tinker_types.LoraConfig(rank=8)
    )
    parsed = schemas.CreateModelRequest.model_validate(_sent_by_sdk(create_model))
    assert (parsed.lora_config.rank, parsed.lora_config.seed, parsed.optimizer_config.type) == (
        8,
        None,
        "adamw",
    )
    info = tinker_types.GetInfoRequest(model_id="session-1:train:0")
    assert schemas.GetInfoRequest.model_validate(_sent_by_sdk(info)).model_id == "session-1:train:0"
    retrieve = tinker_types.FutureRetrieveRequest(request_id="7", allow_metadata_only=True)
    assert schemas.FutureRetrieveRequest.model_validate(_sent_by_sdk(retrieve)).request_id == "7"
    assert schemas.ClientConfigRequest.model_validate({"sdk_version": "0.38.0"}).sdk_version == "0.38.0"
    assert (
        schemas.FinishSessionRequest.model_validate({"reason": {"type": "errored"}}).reason.type == "errored"
    )


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"session_id": "s/1", "model_seq_id": 0, "base_model": "tiny"}, "invalid session_id"),
        ({"session_id": "s1", "model_seq_id": -1, "base_model": "tiny"}, "greater than or equal to 0"),
        ({"session_id": "s1", "model_seq_id": 0, "base_model": "tiny", "lora_config": {"rank": 0}}, "rank"),
        ({"session_id": "s1", "model_seq_id": 0}, "base_model"),
    ],
)
def test_bad_create_model_requests_name_the_field(body: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        schemas.CreateModelRequest.model_validate(body)


def test_bad_model_id_is_refused_with_the_expected_shape() -> None:
    with pytest.raises(ValidationError, match=r"expected '\{session_id\}:train:\{model_seq_id\}'"):
        schemas.GetInfoRequest.model_validate({"model_id": "model_123"})


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        (schemas.ClientConfigResponse(), "ClientConfigResponse"),
        (schemas.HealthResponse(), "HealthResponse"),
        (
            schemas.GetServerCapabilitiesResponse(
                supported_models=[schemas.SupportedModel(model_name="tiny", max_context_length=512)]
            ),
            "GetServerCapabilitiesResponse",
        ),
        (schemas.CreateSessionResponse(session_id="session-1"), "CreateSessionResponse"),
        (schemas.SessionHeartbeatResponse(), "SessionHeartbeatResponse"),
        (schemas.CreateModelResponse(model_id="session-1:train:0"), "CreateModelResponse"),
        (
            schemas.GetInfoResponse(
                model_id="session-1:train:0",
                model_data=schemas.ModelData(model_name="tiny", tokenizer_id="/models/tiny"),
                lora_rank=8,
            ),
            "GetInfoResponse",
        ),
        (schemas.TryAgainResponse(request_id="7"), "TryAgainResponse"),
        (schemas.RequestFailedResponse(error="bad loss", category="user"), "RequestFailedResponse"),
    ],
)
def test_responses_validate_as_the_sdk_models(ours: BaseModel, theirs: str) -> None:
    sdk_type = getattr(tinker_types, theirs, None) or getattr(tinker_types.try_again_response, theirs)
    wire = ours.model_dump(mode="json")
    # Strict JSON validation, as the SDK validates responses (_strict_response_validation=True).
    parsed = sdk_type.model_validate_json(ours.model_dump_json(), strict=True)
    for key, value in parsed.model_dump(mode="json").items():
        if key in wire:
            assert wire[key] == value, key


def test_client_config_keeps_chunks_sequential() -> None:
    config = tinker_types.ClientConfigResponse.model_validate(schemas.ClientConfigResponse().model_dump())
    assert config.parallel_fwdbwd_chunks is False and config.pjwt_auth_enabled is False


def test_future_responses() -> None:
    untyped = tinker_types.UntypedAPIFuture.model_validate(
        schemas.UntypedAPIFuture(request_id="3", sample_sequence_ids=["a", "b"]).model_dump(mode="json")
    )
    assert untyped.request_id == "3" and untyped.sample_sequence_ids == ["a", "b"]
    failed = tinker_types.RequestFailedResponse.model_validate(
        schemas.RequestFailedResponse(error="x", category="server").model_dump(mode="json")
    )
    assert failed.category == tinker_types.RequestErrorCategory.Server
