"""The Tinker-compatible service: `create_app` (FastAPI, testable in-process) and `serve` (`inflight serve`).

Wires the pieces, nothing more: routes (routes_*.py) validate and write futures; the worker (worker.py) owns
the ServiceCompute and runs them; the database (db.py) and checkpoint store hold what survives a restart.
Operations: `/metrics` (metrics.py), one log line per request (access_log.py), and a shutdown that drains
the futures in flight within a grace period and fails the rest (shutdown.py).

    SDK ──HTTP──▶ routes ──▶ futures table ◀── EngineWorker ──▶ ServiceCompute (LoRA adapters on base models)
                    ▲             │                  │
                    └─ long-poll ─┴── CompletionBoard ◀┘
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from inflight.api import (
    routes_archives,
    routes_checkpoints,
    routes_futures,
    routes_metrics,
    routes_sampling,
    routes_session,
    routes_training,
)
from inflight.api.access_log import REQUEST_LOGGER, AccessLogMiddleware
from inflight.api.archives import ArchiveLinkError, ArchiveSigner
from inflight.api.checkpoints import CheckpointExpiredError, CheckpointNotFoundError, CheckpointStore
from inflight.api.db import Database
from inflight.api.futures import FutureStore, UnknownFutureError
from inflight.api.jobs import BaseModelLimits
from inflight.api.metrics import ServiceMetrics
from inflight.api.routes_common import invalid_body_detail, reject_invalid_body
from inflight.api.schemas import future_response
from inflight.api.service import BaseModelInfo, CompletionBoard, NotFoundError, ServiceConfig, ServiceState
from inflight.api.shutdown import GracefulServer, RefuseNewWorkMiddleware, ServiceShutdown
from inflight.api.worker import EngineWorker, WorkerConfig
from inflight.auth import ApiKeyMiddleware, BodySizeLimitMiddleware, check_listening, scope_tenant
from inflight.config import RayConfig
from inflight.connections import deadline_protocol, raise_open_files_limit
from inflight.errors import UserError
from inflight.gc_tuning import long_lived_frozen
from inflight.preflight import bind_port, check_database, check_model_dir, check_port, ensure_dir, serve_on
from inflight.types import DtypeName

if TYPE_CHECKING:
    import uvicorn

    from inflight.api.compute import Compute, ServiceCompute, ServiceComputeConfig
    from inflight.api.sampler import Sampler
    from inflight.inference.backends import VllmOptions

log = logging.getLogger(__name__)
_CONNECTIONS_CLOSE_S = 10  # uvicorn's wait for open connections once the drain is over
# How often a base model's vLLM process is started again when it dies (EngineProcess); as a run's default
# engine.max_restarts. Its sampling calls meanwhile wait for it (the client's outage_wait_s).
_VLLM_MAX_RESTARTS = 3

# The routes that carry training and sampling data, the only ones `max_request_bytes` is for: every other
# body is small (`max_small_request_bytes`), and FastAPI parses those on the event loop.
_DATA_PATHS = frozenset({"/api/v1/forward_backward", "/api/v1/forward", "/api/v1/asample"})

# The user errors that are not a plain 400; every other UserError is.
_STATUS: tuple[tuple[type[Exception] | tuple[type[Exception], ...], int], ...] = (
    ((NotFoundError, UnknownFutureError, CheckpointNotFoundError), 404),
    (CheckpointExpiredError, 410),
    (ArchiveLinkError, 403),
)


def create_app(
    config: ServiceConfig, *, compute: ServiceCompute | None = None, worker_config: WorkerConfig | None = None
) -> FastAPI:
    """The app; its lifespan opens the database, loads the base models (unless `compute` is given) and runs
    the worker thread until shutdown, which drains the futures in flight (`app.state.shutdown`)."""
    metrics = ServiceMetrics()
    shutdown = ServiceShutdown(config.shutdown_grace_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state, worker, sampler, engines = _start(config, compute, worker_config, metrics)
        shutdown.attach(state.store, stop_worker=worker.request_stop, on_failed=state.board.notify)
        metrics.attach(
            state.db,
            base_models=list(state.base_models),
            worker_counts=worker.stats,
            draining=lambda: shutdown.draining,
        )
        app.state.service = state
        try:
            with long_lived_frozen():  # the models and the imports: out of the collector's way (gc_tuning.py)
                yield
        finally:
            # Under `inflight serve` a signal has drained already (GracefulServer); this returns at once then.
            await asyncio.to_thread(shutdown.drain, "the app's lifespan ended")
            worker.stop()
            sampler.stop()  # after the worker: nothing submits any more
            engines.close()  # vLLM processes or Ray actors, after the sampler that talked to them
            state.db.close()

    app = FastAPI(title="inflight: Tinker-compatible service", lifespan=lifespan)
    app.state.shutdown = shutdown
    app.state.metrics = metrics
    # What both runners (`serve`, BackgroundServer) give uvicorn as its protocol: deadlines on each request's
    # head and on an answer the client stopped reading, which no middleware can set (it runs once a head is
    # parsed, and its send cannot tell a slow client from one that reads nothing).
    app.state.http_protocol = deadline_protocol(
        config.request_header_timeout_s,
        send_timeout_s=config.send_timeout_s,
        max_connections=config.max_connections,
        on_close=metrics.count_closed,
    )
    routers = (routes_session, routes_training, routes_sampling, routes_futures, routes_checkpoints)
    for module in (*routers, routes_archives, routes_metrics):
        app.include_router(module.router)
    # The middleware added last runs first: log every request, then refuse an unauthenticated one before
    # anything else, then new work while shutting down, and only then read the body.
    app.add_middleware(
        BodySizeLimitMiddleware,
        max_bytes=config.max_request_bytes,
        small_max_bytes=min(config.max_small_request_bytes, config.max_request_bytes),
        large_paths=_DATA_PATHS,
        body_timeout_s=config.request_body_timeout_s,
    )
    app.add_middleware(RefuseNewWorkMiddleware, shutdown=shutdown)
    app.add_middleware(
        ApiKeyMiddleware, api_keys=config.api_keys, signed_prefix=routes_archives.ARCHIVES_PREFIX
    )
    app.add_middleware(AccessLogMiddleware, metrics=metrics)
    app.add_exception_handler(RequestValidationError, _invalid_request)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(UserError, _user_error)
    app.add_exception_handler(Exception, _unexpected_error)
    return app


def _start(
    config: ServiceConfig,
    compute: ServiceCompute | None,
    worker_config: WorkerConfig | None,
    metrics: ServiceMetrics,
) -> tuple[ServiceState, EngineWorker, Sampler, contextlib.ExitStack]:
    config.state_dir.mkdir(parents=True, exist_ok=True)
    from inflight.api.sampler import build_sampler  # torch: imported when the service starts

    # What computes outside this process (vLLM processes, Ray actors): released at shutdown, or here at
    # once when starting fails after they started.
    with contextlib.ExitStack() as starting:
        placed: Compute
        if compute is not None:
            placed = compute
        elif config.launcher == "ray":
            placed = _compute_on_ray(config, starting)
        else:
            placed = load_compute(config)
        if config.engine == "vllm" or config.launcher == "ray":
            sampler = _remote_sampler(config, placed, starting)
        else:
            from inflight.api.compute import ServiceCompute

            assert isinstance(placed, ServiceCompute), "in-process sampling needs the compute in-process"
            sampler = build_sampler(placed.sampling_engines())
        base_models = {name: _base_model_info(placed, name) for name in placed.base_model_names()}
        db = Database(config.database_url)
        checkpoints = CheckpointStore(db, config.state_dir / "checkpoints", config.checkpoint_limits)
        board = CompletionBoard()
        worker_config = worker_config or WorkerConfig(
            default_max_tokens=config.default_max_tokens,
            max_num_samples=config.max_num_samples,
            max_topk_logprobs=config.max_topk_logprobs,
            session_expiry_s=config.session_expiry_s,
            max_train_tokens_per_round=config.max_train_tokens_per_round,
        )
        if worker_config.max_train_tokens_per_round is None:  # a round's share of one request
            micro_batch = placed.config.max_batch_tokens or 2048  # (resolved by the compute: never None)
            worker_config = worker_config.model_copy(update={"max_train_tokens_per_round": 2 * micro_batch})
        if worker_config.max_samples_in_flight_per_tenant is None:  # a tenant's share: an engine's rows
            rows = min(placed.sampling_config(name).max_batch_size for name in base_models)
            worker_config = worker_config.model_copy(update={"max_samples_in_flight_per_tenant": rows})
        worker = EngineWorker(
            placed,
            sampler,
            db,
            checkpoints,
            limits={name: info.limits for name, info in base_models.items()},
            on_finished=board.notify,
            config=worker_config,
            metrics=metrics,
        )
        state = ServiceState(
            config=config,
            db=db,
            store=FutureStore(db),
            checkpoints=checkpoints,
            base_models=base_models,
            board=board,
            wake_worker=worker.wake,
            counters=worker.stats,
            archive_signer=ArchiveSigner(),
            cancel_sample=worker.cancel_sample,
        )
        sampler.start()
        worker.start()
        engines = starting.pop_all()
    return state, worker, sampler, engines


def _remote_sampler(config: ServiceConfig, compute: Compute, engines: contextlib.ExitStack) -> Sampler:
    """Per base model a sampling engine outside this process, and the sampler over them: with
    --launcher ray an actor on the cluster (`launch/ray/replicas.py`'s engines_on_ray), else a `serve-engine
    --backend vllm` process beside the service; each on `engines` as it starts (closing that stops them).
    vLLM reports the raw logprobs Tinker's wire carries, and each base model's adapters are limited to the
    modules vLLM can adapt."""
    import httpx

    from inflight.api.sampler import Sampler
    from inflight.config import EngineConfig
    from inflight.inference.http_engine import HttpEngine

    limits = compute.sampling_limits()
    names = compute.base_model_names()
    vllm = config.engine == "vllm"
    if config.launcher == "ray":
        from inflight.launch.ray import RayCompute, engines_on_ray

        held = [compute.bundle] if isinstance(compute, RayCompute) else []  # the training's, on the same Ray
        placed = {}
        for name in names:
            engine = EngineConfig.model_validate(compute.sampling_config(name).model_dump())
            engine.backend = config.engine
            placed[name] = (str(compute.model_info(name)["source"]), engine)
        weights_dir = str(config.state_dir / "weights")
        options = _vllm_options(config) if vllm else None
        urls = engines.enter_context(engines_on_ray(placed, config.ray, weights_dir, vllm=options, held=held))
    else:
        urls = {name: _start_vllm(config, compute, name, limits[name].max_context, engines) for name in names}
    if vllm:
        for name, url in urls.items():
            health = httpx.get(f"{url}/health", timeout=30).json()
            compute.sample_only_on(name, health["lora_modules"])
    return Sampler({name: HttpEngine([url]) for name, url in urls.items()}, limits)


def _start_vllm(
    config: ServiceConfig, compute: Compute, name: str, max_context: int, engines: contextlib.ExitStack
) -> str:
    """Base model `name`'s `serve-engine --backend vllm` process, started (closed with `engines`); its URL."""
    from inflight.launch.engine_process import EngineProcess

    engine = EngineProcess(
        compute.model_info(name)["source"],
        backend="vllm",
        max_batch_size=compute.config.max_sample_rows,
        max_seq_len_tokens=max_context,
        vllm=_vllm_options(config),
        max_restarts=_VLLM_MAX_RESTARTS,
    )
    engines.callback(engine.close)
    log.info("base model %r: starting its vLLM engine", name)
    return engine.start().url


def _vllm_options(config: ServiceConfig) -> VllmOptions:
    """vLLM reporting the raw logprobs Tinker's wire carries, with the service's adapter and top-k limits."""
    from inflight.inference.backends import VllmOptions

    return VllmOptions(
        logprobs_kind="raw",
        max_lora_rank=_vllm_rank(config.max_lora_rank),
        max_prompt_logprobs=config.max_topk_logprobs,
    )


def _vllm_rank(max_rank: int) -> int:
    """vLLM takes its max LoRA rank from a fixed set (8, 16, 32, 64, ...): the smallest holding `max_rank`."""
    rank = 8
    while rank < max_rank:
        rank *= 2
    return rank


def _base_model_info(compute: Compute, name: str) -> BaseModelInfo:
    info: dict[str, Any] = compute.model_info(name)
    return BaseModelInfo(
        name=name,
        tokenizer_dir=str(compute.tokenizer_dir(name)),
        arch=info.get("arch"),
        limits=BaseModelLimits(vocab_size=int(info["vocab_size"]), max_context=int(info["max_context"])),
    )


async def _invalid_request(request: Request, exc: Exception) -> JSONResponse:
    errors = exc.errors() if isinstance(exc, RequestValidationError) else []
    detail = invalid_body_detail(errors)
    request_type = routes_training.ORDERED_BODY_ROUTES.get(request.scope["path"])
    body = exc.body if isinstance(exc, RequestValidationError) else None
    if request_type is not None and isinstance(body, dict):
        # The SDK numbered this request: answered as a failed future when its seq_id can be read, since a
        # bare 422 would leave a hole that stalls every later request of the training client.
        state = request.app.state.service
        tenant = scope_tenant(request.scope)
        rejected = await run_in_threadpool(reject_invalid_body, state, tenant, request_type, body, detail)
        if rejected is not None:
            return JSONResponse(future_response(rejected).model_dump(mode="json"))
    return JSONResponse({"detail": detail}, status_code=422)


async def _http_error(request: Request, exc: Exception) -> Response:
    """FastAPI's own HTTP errors, except its bare "There was an error parsing the body" (400) for a JSON
    body that `json.loads` cannot read for other reasons than its syntax: said instead as the data routes,
    which parse their own bodies, say it (422, naming what is wrong)."""
    assert isinstance(exc, HTTPException)
    cause = exc.__cause__
    if isinstance(cause, UnicodeDecodeError):
        reason = (
            f"byte {cause.object[cause.start]:#04x} at offset {cause.start} is not UTF-8; send JSON as UTF-8"
        )
    elif isinstance(cause, RecursionError):
        reason = "it nests arrays or objects too deeply to parse; no field takes such a value"
    elif isinstance(cause, ValueError) and "digits" in str(cause):
        reason = f"it holds a number of more than {sys.get_int_max_str_digits()} digits; no field takes one"
    else:
        return await http_exception_handler(request, exc)
    return JSONResponse({"detail": [{"loc": ["body"], "msg": f"Invalid JSON: {reason}"}]}, status_code=422)


async def _user_error(request: Request, exc: Exception) -> JSONResponse:
    status = next((code for kinds, code in _STATUS if isinstance(exc, kinds)), 400)
    return JSONResponse({"detail": str(exc)}, status_code=status)


async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return JSONResponse({"detail": f"internal error: {type(exc).__name__}: {exc}"}, status_code=500)


def serve(
    base_models: dict[str, str],
    db_url: str | None,
    host: str,
    port: int,
    api_keys: list[str],
    state_dir: str,
    dtype: DtypeName = "auto",
    device: str = "auto",
    shutdown_grace_s: float = 20.0,
    engine: Literal["builtin", "vllm"] = "builtin",
    launcher: Literal["local", "ray"] = "local",
    ray_address: str | None = None,
    max_models_per_key: int = 64,
    max_queued_requests_per_key: int = 10_000,
    max_tokens_per_train_request: int = 2**20,
    max_train_tokens_per_round: int | None = None,
    max_checkpoint_gib_per_key: float | None = 50.0,
    request_body_timeout_s: float = 120.0,
    session_expiry_s: float = 600.0,
    request_header_timeout_s: float = 30.0,
    send_timeout_s: float = 60.0,
    max_connections: int | None = None,
) -> None:
    """`inflight serve`: refuses to listen beyond loopback without API keys.

    Everything a user gave is checked before the base models load (state dir, database, model directories,
    port), and the models load before uvicorn starts, so each mistake is one line and exit code 2.
    SIGTERM/SIGINT drain the futures in flight for up to `shutdown_grace_s` (shutdown.py); each request is
    one JSON line on stdout (access_log.py), in place of uvicorn's access log. At most `max_connections`
    are open at once (None: derived from the open-files limit, first raised to its hard limit).
    """
    api_keys = check_listening(host, api_keys)
    check_port(port)
    raise_open_files_limit()  # before the app reads it for max_connections' default
    config = ServiceConfig(
        base_models=base_models,
        db_url=db_url,
        state_dir=Path(state_dir),
        api_keys=api_keys,
        dtype=dtype,
        device=device,
        shutdown_grace_s=shutdown_grace_s,
        engine=engine,
        launcher=launcher,
        ray=RayConfig(address=ray_address),
        max_models_per_tenant=max_models_per_key,
        max_queued_requests_per_tenant=max_queued_requests_per_key,
        max_tokens_per_train_request=max_tokens_per_train_request,
        max_train_tokens_per_round=max_train_tokens_per_round,
        max_checkpoint_bytes_per_key=_gib_bytes(max_checkpoint_gib_per_key),
        request_body_timeout_s=request_body_timeout_s,
        session_expiry_s=session_expiry_s,
        request_header_timeout_s=request_header_timeout_s,
        send_timeout_s=send_timeout_s,
        max_connections=max_connections,
    )
    for path in base_models.values():  # a missing directory: a path check, answered before torch loads
        check_model_dir(path)
    from inflight.models.device import check_device_name, resolve_device

    if launcher == "local":
        resolve_device(device, "--device")  # a device this machine lacks: one line, before anything loads
    else:  # the cluster's GPUs, not this machine's: checked once connected (`_ray_connected`)
        check_device_name(device, "--device")
    # Connected first: a device the cluster lacks is refused before the state directory is written.
    with _ray_connected(config):
        ensure_dir(config.state_dir, "--state-dir")
        check_database(config.database_url, "--db" if db_url else "the database in --state-dir")
        with contextlib.closing(bind_port(host, port)) as sock:
            # Loaded before uvicorn starts, so that a model that fails to load is one line (on Ray: at start).
            app = create_app(config, compute=load_compute(config) if launcher == "local" else None)
            with _requests_logged_to_stdout():
                serve_on(
                    sock,
                    app,
                    host,
                    port,
                    make_server=lambda uvicorn_config: GracefulServer(uvicorn_config, app.state.shutdown),
                    log_level="info",
                    access_log=False,
                    http=app.state.http_protocol,
                    # After the drain every future is finished, so the long-polls still open answer at once.
                    timeout_graceful_shutdown=_CONNECTIONS_CLOSE_S,
                )


def _gib_bytes(gib: float | None) -> int | None:
    """--max-checkpoint-gib-per-key in bytes; None: no quota."""
    return None if gib is None else round(gib * 2**30)


@contextlib.contextmanager
def _requests_logged_to_stdout() -> Iterator[None]:
    """While the service runs, the request log's lines, as they are, on stdout (where uvicorn's access log
    went), unless the embedding program routed the logger already. The handler goes when the service
    stops: the logger is the process's, and a handler left behind would write later servers' lines in the
    same process (a test's, an embedding program's) to a stdout that may since be closed."""
    logger = logging.getLogger(REQUEST_LOGGER)
    if logger.handlers:
        yield
        return
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    before = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # one copy, whatever the root logger does
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(before[0])
        logger.propagate = before[1]


@contextlib.contextmanager
def _ray_connected(config: ServiceConfig) -> Iterator[None]:
    """--launcher ray: the cluster connected before uvicorn starts (the engines and the training are placed
    in the app's lifespan, on this connection), so that an address that is no Ray head, or a token it
    refuses, is one line naming --ray-address, and so that uvicorn's signal handlers are set after Ray's,
    and a SIGTERM drains the service. --device is checked here, against the cluster's GPUs (a head without
    a GPU serves on a cluster with some)."""
    if config.launcher != "ray":
        yield
        return
    from inflight.launch.ray import check_serve_device, ray_connection

    with ray_connection(config.ray, "--ray-address"):
        check_serve_device(config.device, config.ray)
        yield


def load_compute(config: ServiceConfig) -> ServiceCompute:
    """The base models of `config`, loaded in this process (torch and transformers are imported here, not
    at import time)."""
    from inflight.api.compute import ServiceCompute

    return ServiceCompute(config.base_models, max_rank=config.max_lora_rank, config=_compute_config(config))


def _compute_on_ray(config: ServiceConfig, placed: contextlib.ExitStack) -> Compute:
    """--launcher ray: the base models loaded in an actor on the cluster (`launch/ray/compute.py`'s
    compute_on_ray, released with `placed`)."""
    from inflight.launch.ray import compute_on_ray

    on_ray = compute_on_ray(config.base_models, config.max_lora_rank, _compute_config(config), config.ray)
    return placed.enter_context(on_ray)


def _compute_config(config: ServiceConfig) -> ServiceComputeConfig:
    from inflight.api.compute import ServiceComputeConfig

    in_process = config.engine == "builtin" and config.launcher == "local"
    return ServiceComputeConfig(dtype=config.dtype, device=config.device, sampling_engine=in_process)


class BackgroundServer:
    """uvicorn in a thread on a loopback socket it already holds (no port race): for tests and benchmarks.

    `with BackgroundServer(app) as server: ... server.url ...`; the app's lifespan (compute, worker) runs
    inside, and exiting stops it.
    """

    def __init__(self, app: FastAPI, *, host: str = "127.0.0.1", startup_timeout_s: float = 300.0) -> None:
        import uvicorn

        self.app = app
        self._socket = bind_port(host, 0)  # as `serve` binds (Nagle's algorithm off: see bind_port)
        self.port: int = self._socket.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self._server: uvicorn.Server = uvicorn.Server(
            uvicorn.Config(
                app,
                http=app.state.http_protocol,
                log_level="warning",
                lifespan="on",
                timeout_graceful_shutdown=5,
            )
        )
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, name="inflight-uvicorn", daemon=True
        )
        self._startup_timeout_s = startup_timeout_s

    def __enter__(self) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + self._startup_timeout_s
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"the server on {self.url} exited during startup (see its log above)")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the server on {self.url} did not start within {self._startup_timeout_s:.0f} s"
                )
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(60)
        self._socket.close()
