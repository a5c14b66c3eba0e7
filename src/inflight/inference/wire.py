"""Wire schemas of the engine server's own routes (/generate, /health, /update_weights, /metrics), shared by
`server.py` and `client.py`. Pydantic only: importing this module starts no engine and no HTTP stack.

The OpenAI-compatible routes have their own schemas in `openai_api.py`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from inflight.types import Completion, SamplingParams

VERSION_HEADER = "X-Weight-Version"  # /update_weights_raw: the version of the safetensors body


class GenerateRequest(BaseModel):
    """Token-in/token-out: one prompt, SamplingParams' fields at the top level."""

    model_config = ConfigDict(extra="forbid")

    prompt_token_ids: list[int] = Field(min_length=1)
    max_tokens: int = Field(default=64, ge=1)
    temperature: float = Field(default=1.0, ge=0)  # 0 = greedy
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)  # 0 = off
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)  # kept in the output when hit
    request_id: str | None = None  # default: a fresh id

    @classmethod
    def from_params(
        cls, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> GenerateRequest:
        return cls(
            prompt_token_ids=prompt_token_ids,
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            seed=params.seed,
            stop=list(params.stop),
            stop_token_ids=list(params.stop_token_ids),
            request_id=request_id,
        )

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=tuple(self.stop),
            stop_token_ids=tuple(self.stop_token_ids),
        )


class GenerateResponse(BaseModel):
    request_id: str
    token_ids: list[int]  # [T] generated tokens (a stop token included)
    logprobs: list[float]  # [T] under the distribution each token was sampled from
    versions: list[int]  # [T] policy version of the weights that produced each token
    finish_reason: Literal["stop", "length", "abort"]
    text: str | None = None

    @classmethod
    def from_completion(cls, completion: Completion) -> GenerateResponse:
        return cls(
            request_id=completion.request_id,
            token_ids=completion.token_ids,
            logprobs=completion.logprobs,
            versions=completion.versions,
            finish_reason=completion.finish_reason,
            text=completion.text,
        )

    def to_completion(self, prompt_token_ids: list[int]) -> Completion:
        return Completion(
            request_id=self.request_id,
            prompt_token_ids=prompt_token_ids,
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            versions=self.versions,
            finish_reason=self.finish_reason,
            text=self.text,
        )


class HealthResponse(BaseModel):
    status: Literal["ok", "error"]
    model: str
    version: int  # policy version generating now
    num_running: int
    num_waiting: int
    error: str | None = None  # why the engine stopped, when status is "error"


class UpdateWeightsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str = Field(min_length=1)  # a safetensors file readable by the server
    version: int = Field(ge=0)  # optimizer steps that produced these weights


class UpdateWeightsResponse(BaseModel):
    """Sent once the engine generates with the update (or a newer one that superseded it)."""

    version: int  # the version live on the engine now
    requested_version: int
    superseded: bool  # a newer update was installed instead of this one
    load_s: float  # reading the file or receiving + parsing the body
    copy_s: float  # copying into engine tensors (off the step loop)
    pause_s: float | None  # step-loop pause to install it (recompute included); None if superseded


class UpdateRecordWire(BaseModel):
    version: int
    pause_s: float
    copy_s: float
    sequences_recomputed: int
    tokens_recomputed: int


class MetricsResponse(BaseModel):
    """Engine counters (see BuiltinEngine.metrics) plus the server's own; times in seconds."""

    model: str
    version: int
    kv_policy: str
    num_running: int
    num_waiting: int
    tokens_generated: int
    tokens_on_stale_kv: int
    stale_kv_token_frac: float
    busy_s: float
    tokens_per_s: float  # tokens_generated / busy_s
    updates_received: int
    updates_applied: int
    updates_superseded: int
    update_pause_s_total: float
    update_pause_s_max: float
    update_copy_s_total: float
    sequences_recomputed: int
    tokens_recomputed: int
    recent_updates: list[UpdateRecordWire]
    weight_load_s_total: float  # server: file reads and raw bodies, before the engine copy
    weight_load_s_last: float
    requests_total: int  # generation requests accepted (a completion with n=4 counts 4)
    requests_rejected: int  # 4xx answers
    requests_failed: int  # 5xx answers
