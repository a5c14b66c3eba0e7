"""The engine behind HTTP (`inflight serve-engine`): the whole Engine interface (`engine.py`) as routes,
plus OpenAI-compatible completions and chat, `/health` and `/metrics`.

The routes and the app; what they call is `engine_service.py`'s, and `serve_engine.py` runs the app as
`inflight serve-engine` (`ServerThread`, here, runs it on a thread of another process).

One EngineLoop thread steps the engine; handlers only validate, submit and await, so the requests of all
clients join one running batch. Weight updates are read and copied off that thread and installed by it
between two decode steps; `/update_weights` answers once the new version generates (not when queued).
Adapters are read and checked off the step thread too; `/set_adapter` answers once every later request
runs on them. Routes (bodies in `wire.py` and `openai_api.py`):

    GET  /health                 ok + version + load + adapters (503 once the step loop has failed)
    GET  /metrics                engine counters: update pauses, load/copy seconds, stale-KV tokens, tokens/s
    GET  /v1/models              the base model, and each adapter as a model (vLLM's convention)
    POST /v1/completions         OpenAI shapes; choices add token_ids / versions / prompt_token_ids;
    POST /v1/chat/completions    `model` may name an adapter; chat uses the tokenizer's template
    POST /generate               a SampleRequest's fields -> token_ids, logprobs, versions, prompt logprobs
    POST /update_weights         {"path": file.safetensors, "version": N}
    POST /update_weights_raw     safetensors bytes as the body, version in the X-Weight-Version header
    GET  /adapters               registered adapter -> version
    POST /set_adapter            {"name", "path": PEFT adapter directory, "version"}: register or replace
    POST /set_adapter_raw        adapter_model.safetensors bytes; ?name=&version=&rank=&scale=
    POST /remove_adapter         {"name"}

With API keys (`access.py`: `--api-key` or $INFLIGHT_ENGINE_API_KEY, required beyond loopback) every route
but /health answers 401 without one, in X-API-Key (or as a bearer token on the OpenAI routes and /metrics).
Every request's head and body have a deadline and a size bound (`inflight.connections`, 408/431; the body's
in `BodySizeLimitMiddleware`, 408/413), and the handlers tokenize on a thread of their own, never the loop.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from safetensors import SafetensorError

from inflight.auth import BodySizeLimitMiddleware
from inflight.connections import deadline_protocol
from inflight.inference.access import require_api_key
from inflight.inference.adapter_files import read_adapter_dir
from inflight.inference.backends import ServedEngine
from inflight.inference.engine_loop import EngineLoopError, EngineRequestError
from inflight.inference.engine_service import (
    ClientGoneError,
    EngineServerConfig,
    EngineService,
    HTTPError,
)
from inflight.inference.openai_api import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    Usage,
    chat_choice,
    completion_choice,
    error_body,
)
from inflight.inference.wire import (
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
from inflight.types import AdapterUpdate, SampleRequest, WeightUpdate, new_id
from inflight.weight_sync.torch_dist import TorchDistSyncConfig

# The routes whose body is a safetensors file (`max_update_bytes`), not JSON (`max_body_bytes`).
RAW_BODY_PATHS = frozenset({"/update_weights_raw", "/set_adapter_raw"})


def _load_safetensors_bytes(body: bytes) -> dict[str, Any]:
    from safetensors.torch import load

    return load(body)


def _load_safetensors_file(path: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(path))


async def _read_body(request: Request) -> bytes:
    """The safetensors body, within max_update_bytes (`BodySizeLimitMiddleware`: announced or streamed)."""
    body = await request.body()
    if not body:
        raise ValueError("the body must be a safetensors file; it is empty")
    return body


def create_app(
    engine: ServedEngine,
    tokenizer: Any = None,
    config: EngineServerConfig | None = None,
    stop_token_ids: Sequence[int] = (),
) -> FastAPI:
    """An app serving `engine`; its step loop starts and stops with the app (lifespan).

    `tokenizer` is used by the handlers (prompts, chat templates, token texts): give the engine its own
    instance, since a fast tokenizer object is not meant to be shared by two threads. `stop_token_ids`:
    the model's own EOS ids (`generation_stop_ids(model)`); default: the tokenizer's EOS.
    """
    service = EngineService(engine, tokenizer, config or EngineServerConfig(), stop_token_ids)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service.loop.start()
        try:
            yield
        finally:
            await asyncio.to_thread(service.broadcast.close)
            await asyncio.to_thread(service.loop.stop)
            service.tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="inflight engine", lifespan=lifespan)
    app.state.service = service
    # What both runners (`serve`, ServerThread) give uvicorn as its protocol: a deadline on each request's
    # head and a cap on open connections, which no middleware can set.
    app.state.http_protocol = deadline_protocol(
        service.config.request_header_timeout_s, max_connections=service.config.max_connections
    )
    app.add_middleware(
        BodySizeLimitMiddleware,
        max_bytes=service.config.max_update_bytes,
        small_max_bytes=service.config.max_body_bytes,
        large_paths=RAW_BODY_PATHS,
        body_timeout_s=service.config.request_body_timeout_s,
    )
    require_api_key(app, service.config.api_keys)  # added last, so it runs first: no keyless body is read
    _add_error_handlers(app, service)
    _add_openai_routes(app, service)
    _add_engine_routes(app, service)
    return app


def _add_error_handlers(app: FastAPI, service: EngineService) -> None:
    def reply(status: int, message: str, kind: str) -> JSONResponse:
        if status >= 500:
            service.counters.requests_failed += 1
        else:
            service.counters.requests_rejected += 1
        return JSONResponse(error_body(message, kind), status_code=status)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = []
        for e in exc.errors():
            if e.get("type") == "json_invalid":
                problems.append(f"the body is not valid JSON ({e.get('ctx', {}).get('error', e['msg'])})")
            else:
                where = ".".join(str(x) for x in e["loc"] if x != "body") or "body"
                problems.append(f"{where}: {e['msg']}")
        return reply(400, "invalid request: " + "; ".join(problems), "invalid_request_error")

    @app.exception_handler(ValueError)
    async def bad_value(request: Request, exc: ValueError) -> JSONResponse:
        return reply(400, str(exc), "invalid_request_error")

    @app.exception_handler(HTTPError)
    async def http_error(request: Request, exc: HTTPError) -> JSONResponse:
        return reply(exc.status, str(exc), "invalid_request_error" if exc.status < 500 else "server_error")

    @app.exception_handler(EngineLoopError)
    async def engine_down(request: Request, exc: EngineLoopError) -> JSONResponse:
        return reply(503, str(exc), "server_error")

    @app.exception_handler(EngineRequestError)
    async def request_failed(request: Request, exc: EngineRequestError) -> JSONResponse:
        # This request's own prefill failed (e.g. out of memory); the engine serves the others. Not a 5xx:
        # another replica would fail it the same way, and this one is healthy.
        return reply(422, f"the engine could not run this request: {exc}", "invalid_request_error")

    @app.exception_handler(TimeoutError)
    async def timed_out(request: Request, exc: TimeoutError) -> JSONResponse:
        return reply(504, str(exc), "timeout")

    @app.exception_handler(ClientGoneError)
    async def client_gone(request: Request, exc: ClientGoneError) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's code for "client closed request"

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception) -> JSONResponse:
        return reply(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")


def _add_openai_routes(app: FastAPI, service: EngineService) -> None:
    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        base = service.config.model_name
        card = {
            "id": base,
            "object": "model",
            "created": 0,
            "owned_by": "inflight",
            "max_model_len": service.engine.config.max_seq_len_tokens,
        }
        # vLLM lists each LoRA adapter as a model whose parent is the base; clients pick one by `model`.
        loras = [{**card, "id": name, "parent": base} for name in sorted(service.adapters())]
        return {"object": "list", "data": [card, *loras]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> CompletionResponse:
        adapter = service.check_model(body.model)
        texts = body.prompts()
        service.check_count(len(texts), body.n)
        prompts = await service.tokenizing(lambda: [service.encode_prompt(p) for p in texts])
        for ids in prompts:
            service.check_room(ids, body.max_tokens)
        requests = [
            SampleRequest(ids, body.sampling_params(body.max_tokens, service.eos_ids, i), adapter=adapter)
            for ids in prompts
            for i in range(body.n)
        ]
        done = await service.run(request, requests)
        choices = await service.tokenizing(
            lambda: [completion_choice(j, c, body.logprobs, service.tokenizer) for j, c in enumerate(done)]
        )
        return CompletionResponse(
            model=adapter or service.config.model_name, choices=choices, usage=Usage.of(done)
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> ChatCompletionResponse:
        adapter = service.check_model(body.model)
        prompt = await service.tokenizing(lambda: service.render_chat(body))
        room = service.engine.config.max_seq_len_tokens - len(prompt)
        max_tokens = body.max_new_tokens or max(room, 1)
        service.check_room(
            prompt, max_tokens, "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        )
        requests = [
            SampleRequest(prompt, body.sampling_params(max_tokens, service.chat_end_ids, i), adapter=adapter)
            for i in range(body.n)
        ]
        done = await service.run(request, requests)
        choices = await service.tokenizing(
            lambda: [chat_choice(j, c, body, service.tokenizer) for j, c in enumerate(done)]
        )
        return ChatCompletionResponse(
            model=adapter or service.config.model_name,
            choices=choices,
            usage=Usage.of(done),
            prompt_token_ids=prompt,
        )


def _add_engine_routes(app: FastAPI, service: EngineService) -> None:
    @app.get("/health", response_model=HealthResponse)
    async def health() -> JSONResponse:
        m, error = service.engine.metrics(), service.loop.error
        if error is None and not service.loop.running:
            error = "the engine step loop is not running"
        body = HealthResponse(
            status="ok" if error is None else "error",
            model=service.config.model_name,
            version=m.version,
            num_running=m.num_running,
            num_waiting=m.num_waiting,
            adapters=service.adapters(),
            error=error,
            lora_modules=service.engine.lora_modules(),
        )
        return JSONResponse(body.model_dump(), status_code=200 if error is None else 503)

    @app.get("/metrics")
    async def metrics() -> MetricsResponse:
        return service.metrics()

    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request) -> GenerateResponse:
        service.check_adapter(body.adapter)
        sample = body.sample_request(body.request_id or new_id())
        [completion] = await service.run(request, [sample])
        return GenerateResponse.from_completion(completion)

    @app.post("/generate_batch")
    async def generate_batch(body: GenerateBatchRequest, request: Request) -> GenerateBatchResponse:
        """Several /generate requests at once (each one's fields, validated as there); the completions in
        their order. One adapter unknown here fails the batch, as it would fail that request."""
        for item in body.requests:
            service.check_adapter(item.adapter)
        samples = [item.sample_request(item.request_id or new_id()) for item in body.requests]
        done = await service.run(request, samples)
        return GenerateBatchResponse(completions=[GenerateResponse.from_completion(c) for c in done])

    @app.post("/update_weights")
    async def update_weights(body: UpdateWeightsRequest) -> UpdateWeightsResponse:
        path = service.resolve_weights_path(body.path)
        start = time.perf_counter()
        try:
            state_dict = await asyncio.to_thread(_load_safetensors_file, path)
        except (SafetensorError, OSError) as exc:
            raise ValueError(f"cannot read {body.path!r} as a safetensors file: {exc}") from exc
        load_s = time.perf_counter() - start
        return await service.install(WeightUpdate(body.version, state_dict), load_s)

    @app.post("/update_weights_raw")
    async def update_weights_raw(request: Request) -> UpdateWeightsResponse:
        header = request.headers.get(VERSION_HEADER)
        if header is None or not header.strip().isdigit():
            raise ValueError(f"header {VERSION_HEADER} must carry the weight version (an integer >= 0)")
        start = time.perf_counter()
        body = await _read_body(request)
        try:
            state_dict = await asyncio.to_thread(_load_safetensors_bytes, body)
        except SafetensorError as exc:
            raise ValueError(f"the body is not a safetensors file: {exc}") from exc
        load_s = time.perf_counter() - start
        return await service.install(WeightUpdate(int(header), state_dict), load_s)

    @app.post("/weight_broadcast/join")
    async def join_weight_broadcast(body: JoinBroadcastRequest) -> JoinBroadcastResponse:
        """Join the trainer's torch.distributed weight broadcast (answers at once; the group forms once
        every rank joined). Each whole update received is installed like /update_weights'."""
        config = TorchDistSyncConfig(
            host=body.host,
            port=body.port,
            world_size=body.world_size,
            timeout_s=body.timeout_s,
        )
        await asyncio.to_thread(service.broadcast.join, config, body.rank)
        return JoinBroadcastResponse(rank=body.rank, version=service.engine.version)

    @app.get("/adapters")
    async def adapters() -> AdaptersResponse:
        return AdaptersResponse(adapters=service.adapters())

    @app.post("/set_adapter")
    async def set_adapter(body: SetAdapterRequest) -> SetAdapterResponse:
        path = service.resolve_weights_path(body.path, directory=True)
        start = time.perf_counter()
        update = await asyncio.to_thread(read_adapter_dir, path, body.name, body.version)
        return await service.set_adapter(update, time.perf_counter() - start)

    @app.post("/set_adapter_raw")
    async def set_adapter_raw(request: Request) -> SetAdapterResponse:
        try:
            params = SetAdapterRawParams.model_validate(dict(request.query_params))
        except ValidationError as exc:  # reported like a bad body: field, then what is wrong
            raise RequestValidationError(exc.errors()) from exc
        start = time.perf_counter()
        body = await _read_body(request)
        try:
            tensors = await asyncio.to_thread(_load_safetensors_bytes, body)
        except SafetensorError as exc:
            raise ValueError(f"the body is not a safetensors file: {exc}") from exc
        update = AdapterUpdate(params.name, params.version, params.rank, params.scale, tensors)
        return await service.set_adapter(update, time.perf_counter() - start)

    @app.post("/remove_adapter")
    async def remove_adapter(body: RemoveAdapterRequest) -> RemoveAdapterResponse:
        return await service.remove_adapter(body.name)


class ServerThread:
    """`app` (from `create_app`) served by uvicorn from a thread of this process, on a socket bound before it
    starts (port 0: a free one; or `sock`, bound and listening already), with its head deadline: the
    engine's HTTP face inside a process that has other work, e.g. a Ray replica or the tests that hold it
    to the Engine contract. `stop()` ends it, and the app's lifespan stops its engine loop."""

    def __init__(
        self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, sock: socket.socket | None = None
    ) -> None:
        import uvicorn

        from inflight.preflight import bind_port

        self._socket = bind_port(host, port) if sock is None else sock
        self.port = int(self._socket.getsockname()[1])
        self.url = f"http://{host}:{self.port}"
        config = uvicorn.Config(
            app,
            host=host,
            port=self.port,
            http=app.state.http_protocol,
            log_level="warning",
            access_log=False,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, name=f"http-{self.port}", daemon=True
        )

    def start(self, timeout_s: float = 60.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the engine server on {self.url} did not start within {timeout_s:g} s")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = 60.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout_s)
        self._socket.close()
        if self._thread.is_alive():
            raise RuntimeError(f"the engine server on {self.url} did not stop within {timeout_s:g} s")
