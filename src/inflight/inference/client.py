"""Async clients of `inflight serve-engine`: `EngineClient` for one replica, `BalancedClient` across replicas.

BalancedClient sends each call to the healthy replica with the fewest outstanding requests and checks every
replica's /health periodically. A replica that fails (connection error, timeout, 5xx, failed health check)
is marked down and the call is retried on another replica; a replica found hung by the health check has
its calls in flight moved too. Every retry, failure and recovery is counted in `metrics()`. A 4xx answer
is the request's fault, not the replica's: it raises EngineRequestError at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from inflight.inference.openai_api import ChatCompletionResponse
from inflight.inference.wire import (
    VERSION_HEADER,
    GenerateRequest,
    GenerateResponse,
    HealthResponse,
    MetricsResponse,
    UpdateWeightsRequest,
    UpdateWeightsResponse,
)
from inflight.types import Completion, SamplingParams

T = TypeVar("T")
Model = TypeVar("Model", bound=BaseModel)


class EngineRequestError(ValueError):
    """The server rejected the request (HTTP 4xx); its message says why. Retrying elsewhere will not help."""


class ReplicaError(RuntimeError):
    """One replica failed to answer: unreachable, timed out, or HTTP 5xx."""


class NoReplicaAvailableError(RuntimeError):
    """No replica could serve a call; the message names the replicas and the last error."""


class ClientConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    request_timeout_s: float = Field(default=600.0, gt=0)  # one generation, queueing on the server included
    connect_timeout_s: float = Field(default=5.0, gt=0)
    health_timeout_s: float = Field(default=5.0, gt=0)
    update_timeout_s: float = Field(default=300.0, gt=0)  # reading, copying and installing new weights
    health_interval_s: float = Field(default=2.0, gt=0)  # BalancedClient's periodic checks
    max_attempts: int = Field(default=3, ge=1)  # replicas one call may try, each at most once
    max_connections: int = Field(default=1024, ge=1)  # per replica: one per request in flight


class EngineClient:
    """One replica. Raises EngineRequestError (4xx) or ReplicaError (anything else that went wrong)."""

    def __init__(self, url: str, config: ClientConfig | None = None) -> None:
        self.url = url.rstrip("/")
        self.config = config or ClientConfig()
        limits = httpx.Limits(max_connections=self.config.max_connections, max_keepalive_connections=64)
        self._http = httpx.AsyncClient(base_url=self.url, limits=limits)

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> Completion:
        body = GenerateRequest.from_params(prompt_token_ids, params, request_id).model_dump(mode="json")
        reply = await self._send(
            "POST", "/generate", GenerateResponse, self.config.request_timeout_s, json=body
        )
        return reply.to_completion(prompt_token_ids)

    async def chat(self, messages: Sequence[dict[str, Any]], params: SamplingParams) -> Completion:
        """One assistant turn through /v1/chat/completions, with the exact prompt and generated token ids."""
        body = {
            "messages": list(messages),
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
            "seed": params.seed,
            "stop": list(params.stop),
            "stop_token_ids": list(params.stop_token_ids),
            "logprobs": True,
        }
        path, timeout_s = "/v1/chat/completions", self.config.request_timeout_s
        reply = await self._send("POST", path, ChatCompletionResponse, timeout_s, json=body)
        choice = reply.choices[0]
        return Completion(
            request_id=reply.id,
            prompt_token_ids=reply.prompt_token_ids,
            token_ids=choice.token_ids,
            logprobs=[t.logprob for t in choice.logprobs.content] if choice.logprobs else [],
            versions=choice.versions,
            finish_reason=choice.finish_reason,  # type: ignore[arg-type]
            text=choice.message.content,
        )

    async def health(self) -> HealthResponse:
        return await self._send("GET", "/health", HealthResponse, self.config.health_timeout_s)

    async def metrics(self) -> MetricsResponse:
        return await self._send("GET", "/metrics", MetricsResponse, self.config.health_timeout_s)

    async def update_weights(self, path: str, version: int) -> UpdateWeightsResponse:
        """Install a safetensors file the server can read; returns once the version generates."""
        body = UpdateWeightsRequest(path=path, version=version).model_dump()
        timeout_s = self.config.update_timeout_s
        return await self._send("POST", "/update_weights", UpdateWeightsResponse, timeout_s, json=body)

    async def update_weights_raw(self, data: bytes, version: int) -> UpdateWeightsResponse:
        """Send safetensors bytes in the body (no shared filesystem needed)."""
        headers = {VERSION_HEADER: str(version), "content-type": "application/octet-stream"}
        timeout_s = self.config.update_timeout_s
        return await self._send(
            "POST", "/update_weights_raw", UpdateWeightsResponse, timeout_s, content=data, headers=headers
        )

    async def _send(self, method: str, path: str, reply: type[Model], timeout_s: float, **kw: Any) -> Model:
        where = f"{method} {self.url}{path}"
        timeout = httpx.Timeout(timeout_s, connect=min(self.config.connect_timeout_s, timeout_s))
        try:
            response = await self._http.request(method, path, timeout=timeout, **kw)
        except httpx.TimeoutException as exc:
            raise ReplicaError(f"{where}: no answer within {timeout_s:.0f} s ({type(exc).__name__})") from exc
        except httpx.TransportError as exc:
            raise ReplicaError(f"{where}: {type(exc).__name__}: {exc}") from exc
        if response.status_code >= 400:
            error = ReplicaError if response.status_code >= 500 else EngineRequestError
            raise error(f"{where}: HTTP {response.status_code}: {_error_message(response)}")
        try:
            return reply.model_validate_json(response.content)
        except ValidationError as exc:
            raise ReplicaError(f"{where}: unexpected answer: {exc}") from exc


def _error_message(response: httpx.Response) -> str:
    try:
        body = response.json()
        if isinstance(body.get("error"), dict):  # OpenAI's error shape (ours)
            return str(body["error"].get("message"))
        return str(body.get("error") or body.get("detail") or body)
    except (ValueError, AttributeError):
        return response.text[:500]


@dataclass
class _Replica:
    client: EngineClient
    healthy: bool = True  # until a check or a call says otherwise
    outstanding: int = 0  # this client's calls in flight there
    served: int = 0
    version: int | None = None  # from the last health check
    last_error: str | None = None
    calls: set[asyncio.Task[Any]] = field(default_factory=set)


@dataclass(frozen=True)
class ReplicaState:
    url: str
    healthy: bool
    outstanding: int
    served: int
    version: int | None
    last_error: str | None


@dataclass(frozen=True)
class BalancedClientMetrics:
    calls: int  # calls that reached a replica
    retries: int  # calls sent again to another replica after one failed them
    replica_failures: int  # times a replica was marked down (by a call or a health check)
    health_check_failures: int
    recoveries: int  # times a down replica passed a health check again
    replicas: tuple[ReplicaState, ...]


class BalancedClient:
    """Least-outstanding-requests balancing with failover; use as `async with BalancedClient(urls) as c`."""

    def __init__(self, urls: Sequence[str], config: ClientConfig | None = None) -> None:
        if not urls:
            raise ValueError("BalancedClient needs at least one replica URL")
        self.config = config or ClientConfig()
        self._replicas = [_Replica(EngineClient(url, self.config)) for url in urls]
        self._health_task: asyncio.Task[None] | None = None
        self._last_update: tuple[str, int] | None = None  # (path, version) replayed to recovering replicas
        self._broadcasting = 0  # update_weights calls in progress
        self._calls = self._retries = self._failures = self._health_failures = self._recoveries = 0

    async def __aenter__(self) -> BalancedClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Check every replica once, then keep checking every health_interval_s in the background."""
        if self._health_task is None:
            self._health_task = asyncio.create_task(self._health_loop())
            await self.check_health()

    async def aclose(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        for replica in self._replicas:
            await replica.client.aclose()

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> Completion:
        return await self._call(lambda c: c.generate(prompt_token_ids, params, request_id), "generate")

    async def chat(self, messages: Sequence[dict[str, Any]], params: SamplingParams) -> Completion:
        return await self._call(lambda c: c.chat(messages, params), "chat")

    async def update_weights(self, path: str, version: int) -> dict[str, int]:
        """Install on every healthy replica at once; returns url -> version live there. A replica that is
        down now receives this update when it passes a health check again."""
        await self.start()
        self._last_update = (path, version)
        targets = [r for r in self._replicas if r.healthy]
        self._broadcasting += 1
        try:
            results = await asyncio.gather(
                *(r.client.update_weights(path, version) for r in targets), return_exceptions=True
            )
        finally:
            self._broadcasting -= 1
        live: dict[str, int] = {}
        for replica, result in zip(targets, results, strict=True):
            if isinstance(result, EngineRequestError):
                raise result  # the file or version is wrong for every replica alike
            if isinstance(result, BaseException):
                self._mark_down(replica, str(result), cancel_calls=False)
            else:
                live[replica.client.url] = result.version
        if not live:
            raise NoReplicaAvailableError(
                f"update_weights(version {version}): no replica installed it; {self._describe()}"
            )
        return live

    async def versions(self) -> dict[str, int | None]:
        """url -> policy version from a fresh health check (None where the replica is down)."""
        await self.start()
        await self.check_health()
        return {r.client.url: r.version if r.healthy else None for r in self._replicas}

    def metrics(self) -> BalancedClientMetrics:
        states = tuple(
            ReplicaState(r.client.url, r.healthy, r.outstanding, r.served, r.version, r.last_error)
            for r in self._replicas
        )
        return BalancedClientMetrics(
            self._calls, self._retries, self._failures, self._health_failures, self._recoveries, states
        )

    async def check_health(self) -> None:
        await asyncio.gather(*(self._check(r) for r in self._replicas))

    async def _call(self, send: Callable[[EngineClient], Awaitable[T]], what: str) -> T:
        await self.start()
        tried: set[str] = set()
        last_error = "none tried"
        probed = False
        for _ in range(self.config.max_attempts):
            replica = self._pick(tried)
            if replica is None and not probed:  # all down or tried: look again before giving up
                probed = True
                await self.check_health()
                replica = self._pick(tried)
            if replica is None:
                break
            if tried:
                self._retries += 1
            tried.add(replica.client.url)
            self._calls += 1
            task = asyncio.ensure_future(send(replica.client))
            replica.outstanding += 1
            replica.calls.add(task)
            try:
                result = await task
            except ReplicaError as exc:
                last_error = str(exc)
                self._mark_down(replica, last_error, cancel_calls=False)
                continue
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise  # our caller cancelled us
                last_error = f"{replica.client.url}: {replica.last_error}"  # the health check gave up on it
                continue
            finally:
                replica.outstanding -= 1
                replica.calls.discard(task)
            replica.served += 1
            return result
        raise NoReplicaAvailableError(
            f"{what}: no replica could serve it; last error: {last_error}; {self._describe()}"
        )

    def _pick(self, exclude: set[str]) -> _Replica | None:
        candidates = [r for r in self._replicas if r.healthy and r.client.url not in exclude]
        return min(candidates, key=lambda r: (r.outstanding, r.served), default=None)

    async def _check(self, replica: _Replica) -> None:
        try:
            health = await replica.client.health()
            if health.status != "ok":
                raise ReplicaError(f"{replica.client.url}: unhealthy: {health.error}")
            update = self._last_update
            if update is not None and health.version < update[1] and not self._broadcasting:
                # Back from an outage (or restarted unseen) with older weights: bring it up to date before
                # it takes requests. Skipped while a broadcast is on its way to it anyway.
                health.version = (await replica.client.update_weights(*update)).version
        except (ReplicaError, EngineRequestError) as exc:
            if replica.healthy:
                self._health_failures += 1
            self._mark_down(replica, f"health check failed: {exc}", cancel_calls=True)
            return
        replica.version = health.version
        if not replica.healthy:
            replica.healthy, replica.last_error = True, None
            self._recoveries += 1

    def _mark_down(self, replica: _Replica, reason: str, cancel_calls: bool) -> None:
        replica.last_error = reason
        if replica.healthy:
            replica.healthy = False
            self._failures += 1
        if cancel_calls:
            # A replica that fails its health check may hang rather than refuse: move its calls elsewhere.
            for task in list(replica.calls):
                task.cancel()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            await self.check_health()

    def _describe(self) -> str:
        states = [
            f"{r.client.url} ({'up' if r.healthy else f'down: {r.last_error}'})" for r in self._replicas
        ]
        return "replicas: " + ", ".join(states)
