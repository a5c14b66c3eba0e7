"""Wire schemas of the engine server's own routes (/generate, /health, weight and adapter updates,
/metrics), shared by `server.py` and `client.py`. Pydantic only: importing this module starts no engine and
no HTTP stack.

Together these routes carry the whole Engine interface (`engine.py`): a request's adapter, logprob kind,
top-k logprobs and prompt outputs (logprobs, top-k, target ids, alternative draws), and adapters registered,
replaced and removed. The OpenAI-compatible routes have their own schemas in `openai_api.py`.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from inflight.types import Completion, SampleRequest, SamplingParams

VERSION_HEADER = "X-Weight-Version"  # /update_weights_raw: the version of the safetensors body
# Enough for Tinker's top-k widths and vLLM's default max_logprobs (20); it bounds the answer (tokens x k
# values, for each top-k, target and draw table), which the server builds in memory.
MAX_TOPK_PROMPT_LOGPROBS = 1000
TargetRow = Annotated[list[int], Field(max_length=MAX_TOPK_PROMPT_LOGPROBS)]
# Adapter names travel in JSON bodies, query strings and OpenAI's `model` field: one visible token.
AdapterName = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^\S+$")]
# A request's seed is an int64, vLLM's bound: a larger one would reach torch.Generator.manual_seed, which
# refuses anything outside [-2**63, 2**64), in the engine's step.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
Seed = Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)]
# Sampling settings must be finite: a NaN or infinite temperature turns every logit of the row into NaN.
Temperature = Annotated[float, Field(ge=0, allow_inf_nan=False)]  # 0 = greedy
TopP = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]
# Each stop string is matched against every new token on the engine's one thread, which all requests
# share: their number and length are bounded (as `inflight serve` bounds them).
MAX_STOP_STRINGS = 64
StopString = Annotated[str, Field(max_length=1024)]
StopStrings = Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]
TokenId = Annotated[int, Field(ge=0)]  # below the vocabulary size too: the engine checks that, knowing it


def _utf8(value: object) -> object:
    """A string UTF-8 can encode: JSON may escape a lone UTF-16 surrogate ("\\ud800"), which is no character,
    and an answer or a C++ call that carries it fails long after validation. Before pydantic's own checks,
    whose message for one (with a length bound) names no fix."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"not valid Unicode: it holds a lone surrogate ({value[exc.start]!r}); send UTF-8 text"
            ) from None
    return value


# Echoed in the answer (a surrogate failed it, 400, once the generation had run) and in the logs.
MAX_REQUEST_ID_CHARS = 256
RequestId = Annotated[str, Field(max_length=MAX_REQUEST_ID_CHARS), BeforeValidator(_utf8)]


class GenerateRequest(BaseModel):
    """Token-in/token-out: one prompt; SamplingParams' and SampleRequest's fields at the top level."""

    model_config = ConfigDict(extra="forbid")

    prompt_token_ids: list[int] = Field(min_length=1)
    max_tokens: int = Field(default=64, ge=1)
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: int = Field(default=0, ge=0)  # 0 = off
    seed: Seed | None = None
    stop: StopStrings = Field(default_factory=list)
    stop_token_ids: list[TokenId] = Field(default_factory=list)  # kept in the output when hit
    logprobs_kind: Literal["sampled", "raw"] = "sampled"  # docs/architecture.md, "Logprobs"
    request_id: RequestId | None = None  # default: a fresh id
    adapter: AdapterName | None = None  # a LoRA adapter registered with /set_adapter; None = base weights
    topk_logprobs: int = Field(default=0, ge=0, le=MAX_TOPK_PROMPT_LOGPROBS)
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = Field(default=0, ge=0, le=MAX_TOPK_PROMPT_LOGPROBS)
    target_prompt_ids: list[TargetRow] | None = None  # [P-1][K]; -1 asks nothing
    prompt_alt_tokens_k: int = Field(default=0, ge=0, le=MAX_TOPK_PROMPT_LOGPROBS)

    @classmethod
    def from_request(cls, request: SampleRequest) -> GenerateRequest:
        params = request.params
        return cls(
            prompt_token_ids=request.prompt_token_ids,
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            seed=params.seed,
            stop=list(params.stop),
            stop_token_ids=list(params.stop_token_ids),
            logprobs_kind=params.logprobs_kind,
            topk_logprobs=params.topk_logprobs,
            request_id=request.request_id,
            adapter=request.adapter,
            prompt_logprobs=request.prompt_logprobs,
            topk_prompt_logprobs=request.topk_prompt_logprobs,
            target_prompt_ids=request.target_prompt_ids,
            prompt_alt_tokens_k=request.prompt_alt_tokens_k,
        )

    def sample_request(self, request_id: str) -> SampleRequest:
        params = SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=tuple(self.stop),
            stop_token_ids=tuple(self.stop_token_ids),
            logprobs_kind=self.logprobs_kind,
            topk_logprobs=self.topk_logprobs,
        )
        return SampleRequest(
            self.prompt_token_ids,
            params,
            request_id,
            adapter=self.adapter,
            prompt_logprobs=self.prompt_logprobs,
            topk_prompt_logprobs=self.topk_prompt_logprobs,
            target_prompt_ids=self.target_prompt_ids,
            prompt_alt_tokens_k=self.prompt_alt_tokens_k,
        )


class GenerateResponse(BaseModel):
    request_id: str
    token_ids: list[int]  # [T] generated tokens (a stop token included)
    logprobs: list[float]  # [T] of the kind the request asked for
    versions: list[int]  # [T] policy version of the weights (or adapter) that produced each token
    finish_reason: Literal["stop", "length", "abort"]
    text: str | None = None
    # [P] when asked; JSON has no NaN, so position 0 (no prefix) is null on the wire.
    prompt_logprobs: list[float | None] | None = None
    topk_prompt_logprobs: list[list[tuple[int, float]]] | None = None  # [P] (id, logprob) pairs; [0] is []
    topk_logprobs: list[list[tuple[int, float]]] | None = None  # [T] up to k (id, logprob) pairs
    target_prompt_logprobs: list[list[float]] | None = None  # [P-1][K]; 0.0 where the id was -1
    prompt_alt_tokens: list[list[tuple[int, float]]] | None = None  # [P-1][k] (id, logprob) draws

    @classmethod
    def from_completion(cls, completion: Completion) -> GenerateResponse:
        prompt = completion.prompt_logprobs
        return cls(
            request_id=completion.request_id,
            token_ids=completion.token_ids,
            logprobs=completion.logprobs,
            versions=completion.versions,
            finish_reason=completion.finish_reason,
            text=completion.text,
            prompt_logprobs=None if prompt is None else [None if math.isnan(x) else x for x in prompt],
            topk_prompt_logprobs=completion.topk_prompt_logprobs,
            topk_logprobs=completion.topk_logprobs,
            target_prompt_logprobs=completion.target_prompt_logprobs,
            prompt_alt_tokens=completion.prompt_alt_tokens,
        )

    def to_completion(self, prompt_token_ids: list[int]) -> Completion:
        prompt = self.prompt_logprobs
        return Completion(
            request_id=self.request_id,
            prompt_token_ids=prompt_token_ids,
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            versions=self.versions,
            finish_reason=self.finish_reason,
            text=self.text,
            prompt_logprobs=None if prompt is None else [math.nan if x is None else x for x in prompt],
            topk_prompt_logprobs=self.topk_prompt_logprobs,
            topk_logprobs=self.topk_logprobs,
            target_prompt_logprobs=self.target_prompt_logprobs,
            prompt_alt_tokens=self.prompt_alt_tokens,
        )


MAX_BATCH_REQUESTS = 4096  # /generate_batch: more is a client's mistake (or an attack), not a batch


class GenerateBatchRequest(BaseModel):
    """Several /generate requests in one body: what `EngineClient` sends for the requests its callers issued
    together, so that the server parses them at once and the engine starts them in one step."""

    model_config = ConfigDict(extra="forbid")

    requests: list[GenerateRequest] = Field(min_length=1, max_length=MAX_BATCH_REQUESTS)


class GenerateBatchResponse(BaseModel):
    completions: list[GenerateResponse]  # in the order of the requests


class HealthResponse(BaseModel):
    status: Literal["ok", "error"]
    model: str
    version: int  # policy version generating now
    num_running: int
    num_waiting: int
    # Registered adapter -> the version new requests get: what a balanced client compares to bring a
    # replica that was away up to date.
    adapters: dict[str, int] = Field(default_factory=dict)
    error: str | None = None  # why the engine stopped, when status is "error"
    # The modules (last name part) an adapter may adapt; None: any linear layer (the built-in engine).
    lora_modules: list[str] | None = None


class UpdateWeightsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str = Field(min_length=1)  # a safetensors file readable by the server
    version: int = Field(ge=0)  # optimizer steps that produced these weights


# The join answers at once and the group forms in the background, so these are checked here: beyond them
# (1e300 s or inf overflowed torch's timeout, 2**31 ranks its store's count) the join failed only later, in
# /metrics' broadcast_error. The trainer sends 60 s (`remote_engine.BROADCAST_TIMEOUT_S`) and one rank per
# replica.
MAX_BROADCAST_WORLD_SIZE = 1024  # the trainer and 1,023 replicas
MAX_BROADCAST_TIMEOUT_S = 3600.0


class JoinBroadcastRequest(BaseModel):
    """Join the trainer's torch.distributed weight broadcast as `rank` (`inference/weight_broadcast.py`)."""

    model_config = ConfigDict(extra="forbid")

    # Where the trainer's TCP store listens: a host name (at most 253 characters) or an address.
    host: Annotated[str, Field(min_length=1, max_length=253), BeforeValidator(_utf8)]
    port: int = Field(ge=1, le=65535)
    world_size: int = Field(ge=2, le=MAX_BROADCAST_WORLD_SIZE)  # the trainer and every replica
    rank: int = Field(ge=1)  # the bucket layout comes from the trainer, through its store
    # Joining, and each transfer's collectives.
    timeout_s: float = Field(default=60.0, gt=0, le=MAX_BROADCAST_TIMEOUT_S, allow_inf_nan=False)


class JoinBroadcastResponse(BaseModel):
    rank: int
    version: int  # the version live now; updates from the broadcast follow


class UpdateWeightsResponse(BaseModel):
    """Sent once the engine generates with the update (or a newer one that superseded it)."""

    version: int  # the version live on the engine now
    requested_version: int
    superseded: bool  # a newer update was installed instead of this one
    load_s: float  # reading the file or receiving + parsing the body
    copy_s: float  # copying into engine tensors (off the step loop)
    pause_s: float | None  # step-loop pause to install it (recompute included); None if superseded


class SetAdapterRequest(BaseModel):
    """Register adapter `name`, or replace its weights, from a PEFT adapter directory the server can read
    (`adapter_model.safetensors` + `adapter_config.json` with r and lora_alpha)."""

    model_config = ConfigDict(extra="forbid")

    name: AdapterName
    path: str = Field(min_length=1)
    version: int = Field(ge=0)  # the adapter's optimizer steps; its tokens are stamped with it


class SetAdapterResponse(BaseModel):
    """Sent once the engine accepted it: every request submitted afterwards runs on these weights (a
    replacement lands between two decode steps, so requests already running switch to it too)."""

    name: str
    version: int
    rank: int
    scale: float  # the adapter adds scale * B @ A
    replaced: bool  # the name was registered before (at `previous_version`)
    previous_version: int | None
    load_s: float  # reading the directory or parsing the body


class SetAdapterRawParams(BaseModel):
    """/set_adapter_raw's query string; the body is the adapter_model.safetensors bytes (PEFT names)."""

    model_config = ConfigDict(extra="forbid")

    name: AdapterName
    version: int = Field(ge=0)
    rank: int = Field(ge=1)
    scale: float = Field(allow_inf_nan=False)  # alpha / rank: the adapter adds scale * B @ A


class RemoveAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: AdapterName


class RemoveAdapterResponse(BaseModel):
    name: str
    version: int  # the version it had; requests already running on it finish on those weights


class AdaptersResponse(BaseModel):
    adapters: dict[str, int]  # registered name -> the version new requests get


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
    adapter_updates_received: int  # set_adapter calls accepted (registrations and replacements)
    adapter_updates_applied: int  # replacements installed at a step boundary
    adapters_registered: int
    recent_updates: list[UpdateRecordWire]
    weight_load_s_total: float  # server: file reads and raw bodies, before the engine copy
    weight_load_s_last: float
    broadcast_updates_received: int = 0  # whole updates from the trainer's torch.distributed broadcast
    broadcast_error: str | None = None  # why the last broadcast membership ended, if it failed
    requests_total: int  # generation requests accepted (a completion with n=4 counts 4)
    requests_rejected: int  # 4xx answers
    requests_failed: int  # 5xx answers
