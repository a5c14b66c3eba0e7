"""Clients of `inflight serve-engine`: `EngineClient` for one replica and `BalancedClient` across replicas
(async); `http_engine.HttpEngine` is the Engine protocol over them for synchronous callers.

BalancedClient sends each call to the healthy replica with the fewest outstanding requests and checks every
replica's /health periodically. A replica that fails (connection error, timeout, 5xx, failed health check)
is marked down and the call is retried on another replica; a replica found hung by the health check has
its calls in flight moved too. A call that finds none up waits `outage_wait_s` for one to come back, then
raises ReplicasDownError (a call in flight on a replica that died included: none outlives that bound).
Every retry, failure and recovery is counted in `metrics()`. A 4xx answer is the request's fault, not the
replica's: it raises EngineRequestError at once. Weights and adapters go to every replica, and the health
check brings a replica that was away up to date (the last weights, every adapter set and not removed
since) before it takes requests again, so all replicas serve the same model. A client that installs
nothing (`follows_others=True`: a rollout worker's, beside the run's client that publishes) instead takes
a replica that was away back only once another client has brought it up to date.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from inflight.inference.access import API_KEY_HEADER, client_api_key
from inflight.inference.openai_api import ChatCompletionResponse
from inflight.inference.wire import (
    MAX_BATCH_REQUESTS,
    VERSION_HEADER,
    AdaptersResponse,
    GenerateBatchRequest,
    GenerateBatchResponse,
    GenerateRequest,
    GenerateResponse,
    HealthResponse,
    JoinBroadcastRequest,
    JoinBroadcastResponse,
    MetricsResponse,
    RemoveAdapterRequest,
    RemoveAdapterResponse,
    SetAdapterRawParams,
    SetAdapterRequest,
    SetAdapterResponse,
    UpdateWeightsRequest,
    UpdateWeightsResponse,
)
from inflight.types import AdapterUpdate, Completion, SampleRequest, SamplingParams

T = TypeVar("T")
Model = TypeVar("Model", bound=BaseModel)


class EngineRequestError(ValueError):
    """The server rejected the request (HTTP 4xx); its message says why. Retrying elsewhere will not help."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class ReplicaError(RuntimeError):
    """One replica failed to answer: unreachable, timed out, or HTTP 5xx."""


class NoReplicaAvailableError(RuntimeError):
    """No replica could serve a call; the message names the replicas and the last error."""


class ReplicasDownError(NoReplicaAvailableError):
    """Every replica stayed down for `waited_s` (the client's outage_wait_s): the engines are gone, not busy.
    `down`: each replica's URL and its last error."""

    def __init__(self, message: str, down: dict[str, str], waited_s: float) -> None:
        super().__init__(message)
        self.down, self.waited_s = down, waited_s


class ClientConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    request_timeout_s: float = Field(default=600.0, gt=0)  # one generation, queueing on the server included
    connect_timeout_s: float = Field(default=5.0, gt=0)
    health_timeout_s: float = Field(default=5.0, gt=0)
    update_timeout_s: float = Field(default=300.0, gt=0)  # reading, copying and installing new weights
    health_interval_s: float = Field(default=2.0, gt=0)  # BalancedClient's periodic checks
    max_attempts: int = Field(default=3, ge=1)  # replicas one call may try, each at most once
    # When no replica can take a call (all down: a restart in progress), how long it waits for one to come
    # back, health-checking every health_interval_s, before ReplicasDownError.
    outage_wait_s: float = Field(default=120.0, ge=0)
    max_connections: int = Field(default=1024, ge=1)  # per replica: one per request in flight
    # Sent as X-API-Key to servers that require one (`serve-engine --api-key`). None: the key in
    # $INFLIGHT_ENGINE_API_KEY, if any; kept out of the run's config, which is saved as config.json.
    api_key: str | None = Field(default=None, repr=False)


class EngineClient:
    """One replica. Raises EngineRequestError (4xx) or ReplicaError (anything else that went wrong).

    `generate` calls made together (in one turn of the event loop: the rollouts a batch of completions
    woke up) travel as one /generate_batch request (one per 4,096, the most a server takes): the server
    parses them at once and the engine starts them in one step. Sent one by one, 128 concurrent BlackJack
    turns took ~6x as long on the tiny model (docs/benchmarks.md, `launcher=ray`): the engine stepped on
    the few that had arrived while the rest were still being parsed. When every caller of a batch stops
    waiting (a timeout, a cancellation), its HTTP request is dropped and the server aborts the
    generations; one caller among others still waiting leaves its request to finish there."""

    def __init__(self, url: str, config: ClientConfig | None = None) -> None:
        self.url = url.rstrip("/")
        self.config = config or ClientConfig()
        limits = httpx.Limits(max_connections=self.config.max_connections, max_keepalive_connections=64)
        key = self.config.api_key or client_api_key()
        headers = {API_KEY_HEADER: key} if key else {}
        self._http = httpx.AsyncClient(base_url=self.url, limits=limits, headers=headers)
        self._pending: list[tuple[SampleRequest, asyncio.Future[Completion]]] = []
        self._batches: set[asyncio.Task[None]] = set()  # sent, not answered yet (kept from the GC)

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        for task in list(self._batches):
            task.cancel()
        await asyncio.gather(*self._batches, return_exceptions=True)
        await self._http.aclose()

    async def generate(self, request: SampleRequest) -> Completion:
        """One request, its adapter, logprob kind and prompt logprobs included: with the others issued in
        this turn of the event loop in one /generate_batch, or alone through /generate."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Completion] = loop.create_future()
        if not self._pending:  # the first of this turn: send after the others have joined
            loop.call_soon(self._send_pending)
        self._pending.append((request, future))
        return await future

    def _send_pending(self) -> None:
        pending, self._pending = self._pending, []
        # A /generate_batch holds at most MAX_BATCH_REQUESTS (its schema refuses more, here as on the server):
        # 4,097 calls in one turn used to fail together.
        for start in range(0, len(pending), MAX_BATCH_REQUESTS):
            self._send_batch(pending[start : start + MAX_BATCH_REQUESTS])

    def _send_batch(self, batch: list[tuple[SampleRequest, asyncio.Future[Completion]]]) -> None:
        task = asyncio.get_running_loop().create_task(self._generate_batch(batch))
        self._batches.add(task)
        task.add_done_callback(self._batches.discard)

        waiting = [len(batch)]

        def on_caller_done(future: asyncio.Future[Completion]) -> None:
            if future.cancelled():
                waiting[0] -= 1
            # Every caller stopped waiting: drop the HTTP request, and the server aborts its generations.
            if not waiting[0] and not task.done():
                task.cancel()

        for _, future in batch:
            future.add_done_callback(on_caller_done)

    async def _generate_batch(self, batch: list[tuple[SampleRequest, asyncio.Future[Completion]]]) -> None:
        timeout_s = self.config.request_timeout_s
        try:
            bodies = [GenerateRequest.from_request(request) for request, _ in batch]
            if len(batch) == 1:
                body = bodies[0].model_dump(mode="json")
                replies = [await self._send("POST", "/generate", GenerateResponse, timeout_s, json=body)]
            else:
                body = GenerateBatchRequest(requests=bodies).model_dump(mode="json")
                path = "/generate_batch"
                answer = await self._send("POST", path, GenerateBatchResponse, timeout_s, json=body)
                replies = answer.completions
            if len(replies) != len(batch):
                raise ReplicaError(f"{self.url} answered {len(replies)} completions to {len(batch)} requests")
        except asyncio.CancelledError:
            for _, future in batch:
                future.cancel()
            raise
        except Exception as e:  # every caller of the batch gets the error (a 4xx of one fails them all)
            for _, future in batch:
                if not future.done():
                    future.set_exception(e)
            return
        for (request, future), reply in zip(batch, replies, strict=True):
            if not future.done():  # its caller may have stopped waiting
                future.set_result(reply.to_completion(request.prompt_token_ids))

    async def chat(
        self, messages: Sequence[dict[str, Any]], params: SamplingParams, adapter: str | None = None
    ) -> Completion:
        """One assistant turn through /v1/chat/completions, with the exact prompt and generated token ids;
        `adapter` goes in OpenAI's `model` field."""
        body = {
            "model": adapter,
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

    async def join_weight_broadcast(self, body: JoinBroadcastRequest) -> JoinBroadcastResponse:
        """Ask the server to join the trainer's torch.distributed weight broadcast (answers at once)."""
        return await self._send(
            "POST", "/weight_broadcast/join", JoinBroadcastResponse, self.config.health_timeout_s,
            json=body.model_dump(),
        )  # fmt: skip

    async def adapters(self) -> dict[str, int]:
        reply = await self._send("GET", "/adapters", AdaptersResponse, self.config.health_timeout_s)
        return reply.adapters

    async def set_adapter(self, name: str, path: str, version: int) -> SetAdapterResponse:
        """Register or replace adapter `name` from a PEFT adapter directory the server can read."""
        body = SetAdapterRequest(name=name, path=path, version=version).model_dump()
        timeout_s = self.config.update_timeout_s
        return await self._send("POST", "/set_adapter", SetAdapterResponse, timeout_s, json=body)

    async def set_adapter_raw(self, data: bytes, params: SetAdapterRawParams) -> SetAdapterResponse:
        """Send adapter_model.safetensors bytes in the body (no shared filesystem needed)."""
        headers = {"content-type": "application/octet-stream"}
        query = {k: str(v) for k, v in params.model_dump().items()}
        timeout_s = self.config.update_timeout_s
        return await self._send(
            "POST",
            "/set_adapter_raw",
            SetAdapterResponse,
            timeout_s,
            content=data,
            headers=headers,
            params=query,
        )

    async def remove_adapter(self, name: str) -> RemoveAdapterResponse:
        body = RemoveAdapterRequest(name=name).model_dump()
        timeout_s = self.config.update_timeout_s
        return await self._send("POST", "/remove_adapter", RemoveAdapterResponse, timeout_s, json=body)

    async def _send(self, method: str, path: str, reply: type[Model], timeout_s: float, **kw: Any) -> Model:
        where = f"{method} {self.url}{path}"
        timeout = httpx.Timeout(timeout_s, connect=min(self.config.connect_timeout_s, timeout_s))
        try:
            response = await self._http.request(method, path, timeout=timeout, **kw)
        except httpx.TimeoutException as exc:
            raise ReplicaError(f"{where}: no answer within {timeout_s:.0f} s ({type(exc).__name__})") from exc
        except httpx.TransportError as exc:
            raise ReplicaError(f"{where}: {type(exc).__name__}: {exc}") from exc
        if response.status_code >= 500:
            raise ReplicaError(f"{where}: HTTP {response.status_code}: {_error_message(response)}")
        if response.status_code >= 400:
            message = f"{where}: HTTP {response.status_code}: {_error_message(response)}"
            raise EngineRequestError(message, response.status_code)
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


# How to bring one replica to a desired state: the call that installs it there (replayed on recovery).
_Install = Callable[[EngineClient], Awaitable[Any]]


class BalancedClient:
    """Least-outstanding-requests balancing with failover; use as `async with BalancedClient(urls) as c`."""

    def __init__(
        self, urls: Sequence[str], config: ClientConfig | None = None, follows_others: bool = False
    ) -> None:
        """`follows_others`: this client installs no weights or adapters; another one does (the run's, for a
        rollout worker's client). A replica that comes back then serves this client's calls only once it
        is not behind the newest weight version and adapter versions this client has seen on any replica
        (a restarted replica serves the model from disk until the other client syncs it), and a replica
        that answers 404 for such an adapter is out of sync, its call moved elsewhere."""
        if not urls:
            raise ValueError("BalancedClient needs at least one replica URL")
        self.config = config or ClientConfig()
        self.follows_others = follows_others
        self._seen_version = -1  # follows_others: the newest weight version a replica served
        self._seen_adapters: dict[str, int] = {}  # and the newest version of each adapter
        self._replicas = [_Replica(EngineClient(url, self.config)) for url in urls]
        self._health_task: asyncio.Task[None] | None = None
        # What every replica must serve, replayed to a replica that comes back (see _check):
        self._weights: tuple[int, _Install] | None = None  # the last weight update: version, install
        self._adapters: dict[str, tuple[int, _Install]] = {}  # set and not removed since
        self._removed: set[str] = set()  # removed since they were set: removed again where still present
        self._broadcasting = 0  # weight or adapter broadcasts in progress
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

    async def generate(self, request: SampleRequest) -> Completion:
        # A replica that does not know an adapter this client set was away (restarted unseen, say): its
        # fault, not the request's. It is marked down, so the health check syncs it, and the call moves.
        def out_of_sync(exc: EngineRequestError) -> bool:
            known = self._seen_adapters if self.follows_others else self._adapters
            return exc.status == 404 and request.adapter in known

        return await self._call(lambda c: c.generate(request), "generate", out_of_sync)

    async def chat(
        self, messages: Sequence[dict[str, Any]], params: SamplingParams, adapter: str | None = None
    ) -> Completion:
        return await self._call(lambda c: c.chat(messages, params, adapter), "chat")

    async def update_weights(self, path: str, version: int) -> dict[str, int]:
        """Install a safetensors file on every healthy replica at once; returns url -> version live there.
        A replica that is down now receives this update when it passes a health check again."""
        return await self._update_weights(lambda c: c.update_weights(path, version), version)

    async def update_weights_raw(self, data: bytes, version: int) -> dict[str, int]:
        """As update_weights, with the safetensors bytes in the body (kept here for replicas that recover)."""
        return await self._update_weights(lambda c: c.update_weights_raw(data, version), version)

    async def join_weight_broadcast(self, host: str, port: int, timeout_s: float) -> None:
        """Every replica joins the trainer's weight broadcast group at host:port as rank 1.. in order (the
        trainer is rank 0). Every replica must be up: a group has a fixed size."""
        await self.start()
        await self.check_health()
        down = [r.client.url for r in self._replicas if not r.healthy]
        if down:
            raise NoReplicaAvailableError(
                f"weight broadcast: replicas down ({', '.join(down)}); {self._describe()}"
            )
        world = len(self._replicas) + 1
        joins = [
            JoinBroadcastRequest(host=host, port=port, world_size=world, rank=k, timeout_s=timeout_s)
            for k in range(1, world)
        ]
        await asyncio.gather(
            *(r.client.join_weight_broadcast(join) for r, join in zip(self._replicas, joins, strict=True))
        )

    def weights_installed(self, version: int, install: Callable[[EngineClient], Awaitable[Any]]) -> None:
        """Weights of `version` reached every replica by another way (the broadcast): `install` is what a
        replica that comes back (or missed them) gets instead."""
        self._weights = (version, install)

    async def set_adapter(self, name: str, path: str, version: int) -> dict[str, int]:
        """Register or replace adapter `name` (a PEFT directory every replica can read) on every healthy
        replica; returns url -> the adapter's version there. A replica down now gets it on recovery."""
        return await self._set_adapter(name, version, lambda c: c.set_adapter(name, path, version))

    async def set_adapter_raw(self, update: AdapterUpdate) -> dict[str, int]:
        """As set_adapter, with the tensors in the body (kept here for replicas that recover)."""
        data = adapter_bytes(update)
        params = SetAdapterRawParams(
            name=update.name, version=update.version, rank=update.rank, scale=update.scale
        )
        return await self._set_adapter(update.name, update.version, lambda c: c.set_adapter_raw(data, params))

    async def remove_adapter(self, name: str) -> list[str]:
        """Remove adapter `name` from every healthy replica (and from a recovering one when it is back);
        returns the urls that had it. EngineRequestError when no replica had it and this client never set
        it (one it set may be gone from every replica already: restarted during an outage, say)."""

        async def remove(client: EngineClient) -> bool:
            try:
                await client.remove_adapter(name)
            except EngineRequestError as exc:
                if exc.status != 404:
                    raise
                return False  # already absent there (e.g. a replica restarted since)
            return True

        known = self._adapters.pop(name, None) is not None
        self._removed.add(name)
        removed = [
            url for url, had in (await self._broadcast(remove, f"remove_adapter({name!r})")).items() if had
        ]
        if not removed and not known:
            raise EngineRequestError(f"remove_adapter: no replica has an adapter named {name!r}", 404)
        return removed

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

    async def _update_weights(
        self, install: Callable[[EngineClient], Awaitable[UpdateWeightsResponse]], version: int
    ) -> dict[str, int]:
        self._weights = (version, install)
        live = await self._broadcast(install, f"update_weights(version {version})")
        return {url: reply.version for url, reply in live.items()}

    async def _set_adapter(
        self, name: str, version: int, install: Callable[[EngineClient], Awaitable[SetAdapterResponse]]
    ) -> dict[str, int]:
        live = await self._broadcast(install, f"set_adapter({name!r}, version {version})")
        # Recorded once accepted: an adapter every replica refused (4xx) is not replayed to anyone.
        self._adapters[name] = (version, install)
        self._removed.discard(name)
        return {url: reply.version for url, reply in live.items()}

    async def _broadcast(
        self, send: Callable[[EngineClient], Awaitable[T]], what: str, wait_for_recovery: bool = True
    ) -> dict[str, T]:
        """`send` to every healthy replica at once; url -> its answer. A 4xx raises (the input is wrong for
        every replica alike); a replica that fails otherwise is marked down, to be synced on recovery. When
        none took it (all down: a restart in progress), once more to the replicas back within
        config.outage_wait_s."""
        await self.start()
        targets = [r for r in self._replicas if r.healthy]
        self._broadcasting += 1
        try:
            results = await asyncio.gather(*(send(r.client) for r in targets), return_exceptions=True)
        finally:
            self._broadcasting -= 1
        live: dict[str, T] = {}
        for replica, result in zip(targets, results, strict=True):
            if isinstance(result, EngineRequestError):
                raise result
            if isinstance(result, BaseException):
                self._mark_down(replica, str(result), cancel_calls=False)
            else:
                live[replica.client.url] = result
        if not live and wait_for_recovery:
            if await self._await_recovery() is None:
                raise self._all_down(what)
            return await self._broadcast(send, what, wait_for_recovery=False)
        if not live:
            raise NoReplicaAvailableError(f"{what}: no replica installed it; {self._describe()}")
        return live

    async def _call(
        self,
        send: Callable[[EngineClient], Awaitable[T]],
        what: str,
        replica_fault: Callable[[EngineRequestError], bool] | None = None,
    ) -> T:
        await self.start()
        tried: set[str] = set()
        last_error = "none tried"
        probed = False
        for _ in range(self.config.max_attempts):
            replica = self._pick(tried)
            if replica is None and not probed:  # all down or tried: wait (bounded) for one to come back
                probed = True
                replica = await self._await_recovery()
                if replica is None:
                    raise self._all_down(what)
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
            except EngineRequestError as exc:
                if replica_fault is None or not replica_fault(exc):
                    raise
                last_error = str(exc)
                self._mark_down(replica, f"out of sync: {exc}", cancel_calls=False)
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

    async def _await_recovery(self) -> _Replica | None:
        """A healthy replica, tried before in this call or not (one that came back was brought up to date),
        within config.outage_wait_s; None when none recovered in time."""
        deadline = time.monotonic() + self.config.outage_wait_s
        while True:
            await self.check_health()
            replica = self._pick(set())
            if replica is not None or time.monotonic() >= deadline:
                return replica
            await asyncio.sleep(min(self.config.health_interval_s, max(0.0, deadline - time.monotonic())))

    def _pick(self, exclude: set[str]) -> _Replica | None:
        candidates = [r for r in self._replicas if r.healthy and r.client.url not in exclude]
        return min(candidates, key=lambda r: (r.outstanding, r.served), default=None)

    async def _check(self, replica: _Replica) -> None:
        try:
            health = await replica.client.health()
            if health.status != "ok":
                raise ReplicaError(f"{replica.client.url}: unhealthy: {health.error}")
            # Skipped while a broadcast is on its way to the replica anyway; never for a replica coming back
            # (broadcasts skip it), which also gets the last weights at an equal version: restarted, it
            # serves the model from disk at version 0, the version of weights published before any step.
            recovering = not replica.healthy
            if self.follows_others:
                behind = self._behind(health)
                if recovering and behind:  # stays down (not counted again) until the publisher syncs it
                    replica.last_error = f"catching up: {behind}"
                    return
                if not behind:
                    self._seen(health)
            elif recovering or not self._broadcasting:
                health.version = await self._sync(replica.client, health, force_weights=recovering)
        except (ReplicaError, EngineRequestError) as exc:
            if replica.healthy:
                self._health_failures += 1
            self._mark_down(replica, f"health check failed: {exc}", cancel_calls=True)
            return
        replica.version = health.version
        if not replica.healthy:
            replica.healthy, replica.last_error = True, None
            self._recoveries += 1

    def _behind(self, health: HealthResponse) -> str | None:
        """follows_others: what a replica lacks of the newest weights and adapters seen, or None."""
        if health.version < self._seen_version:
            return f"weights version {health.version} < {self._seen_version}"
        for name, version in self._seen_adapters.items():
            if health.adapters.get(name, -1) < version:
                return f"adapter {name!r} version {health.adapters.get(name)} < {version}"
        return None

    def _seen(self, health: HealthResponse) -> None:
        self._seen_version = max(self._seen_version, health.version)
        for name, version in health.adapters.items():
            self._seen_adapters[name] = max(self._seen_adapters.get(name, -1), version)

    async def _sync(self, client: EngineClient, health: HealthResponse, force_weights: bool = False) -> int:
        """Bring a replica back from an outage (or restarted unseen) up to date before it takes requests:
        the last weights if it has older ones (or `force_weights`), every adapter it lacks or has older, no
        adapter removed since. Returns its weight version now."""
        version = health.version
        if self._weights is not None and (force_weights or version < self._weights[0]):
            version = (await self._weights[1](client)).version
        for name, (adapter_version, install) in list(self._adapters.items()):
            if health.adapters.get(name, -1) < adapter_version:
                await install(client)
        for name in self._removed & set(health.adapters):
            await client.remove_adapter(name)
        return version

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

    def _all_down(self, what: str) -> ReplicasDownError:
        return ReplicasDownError(
            f"{what}: every replica stayed down for outage_wait_s={self.config.outage_wait_s:g} s; "
            f"{self._describe()}",
            {r.client.url: r.last_error or "down" for r in self._replicas},
            self.config.outage_wait_s,
        )

    def _describe(self) -> str:
        states = [
            f"{r.client.url} ({'up' if r.healthy else f'down: {r.last_error}'})" for r in self._replicas
        ]
        return "replicas: " + ", ".join(states)


def weights_bytes(state_dict: dict[str, Any]) -> bytes:
    """A state dict as safetensors bytes. Every tensor is copied: safetensors refuses tensors that share
    storage (tied embeddings) and non-contiguous ones."""
    from safetensors.torch import save

    return save({name: t.detach().to("cpu").contiguous().clone() for name, t in state_dict.items()})


def adapter_bytes(update: AdapterUpdate) -> bytes:
    """An adapter's tensors (PEFT names) as the bytes of an adapter_model.safetensors."""
    return weights_bytes(update.tensors)
