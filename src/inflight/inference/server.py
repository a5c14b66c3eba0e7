"""The engine behind HTTP (`inflight serve-engine`): the whole Engine interface (`engine.py`) as routes,
plus OpenAI-compatible completions and chat, `/health` and `/metrics`.

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
import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Literal, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from jinja2 import TemplateError
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from safetensors import SafetensorError

from inflight.auth import ApiKeys, BodySizeLimitMiddleware
from inflight.connections import deadline_protocol, raise_open_files_limit
from inflight.errors import UserError
from inflight.inference.access import check_engine_listening, require_api_key
from inflight.inference.adapter_files import read_adapter_dir
from inflight.inference.backends import Backend, ServedEngine, VllmOptions, load_backend
from inflight.inference.engine_loop import EngineLoop, EngineLoopError, EngineRequestError
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
from inflight.inference.weight_broadcast import BroadcastListener
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
from inflight.models.chat_template import end_of_turn, render, reply_stop_ids
from inflight.types import AdapterUpdate, Completion, SampleRequest, WeightUpdate, new_id
from inflight.weight_sync.torch_dist import TorchDistSyncConfig

log = logging.getLogger(__name__)
T = TypeVar("T")
# The routes whose body is a safetensors file (`max_update_bytes`), not JSON (`max_body_bytes`).
RAW_BODY_PATHS = frozenset({"/update_weights_raw", "/set_adapter_raw"})
# On a signal, once the engine loop is stopped: how long uvicorn waits for the connections still open.
_CONNECTIONS_CLOSE_S = 5


class EngineServerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_name: str = "inflight"  # the id /v1/models lists; requests naming another model get 404
    request_timeout_s: float = Field(default=600.0, gt=0)  # one HTTP generation request, queueing included
    update_timeout_s: float = Field(default=120.0, gt=0)  # from receiving an update to its installation
    # How often a waiting handler checks its client is still connected; a client gone has its requests
    # aborted, so their cache rows go back to the batch.
    disconnect_poll_s: float = Field(default=0.5, gt=0)
    max_update_bytes: int = Field(default=16 * 2**30, ge=1)  # /update_weights_raw and /set_adapter_raw
    # Every other route's body, refused (413) before it is parsed, announced or streamed: FastAPI parses a
    # JSON body whole, and a 100 MB one used to be read and parsed. Room for a /generate_batch of 4,096
    # requests with 8,192-token prompts (~6 bytes a token).
    max_body_bytes: int = Field(default=256 * 2**20, ge=1024)
    # From a request's head to the end of its body (408 past it): uvicorn waits for a body forever, so a
    # client trickling one held its connection for good. 16 GiB of weights then need ~28 MB/s.
    request_body_timeout_s: float = Field(default=600.0, gt=0, allow_inf_nan=False)
    # From a connection's start (or a later request's first byte) to the end of a request's head (408 past
    # it; `inflight.connections`): uvicorn bounds no head, so a client that connected and sent nothing held
    # a connection and a file descriptor for good.
    request_header_timeout_s: float = Field(default=30.0, gt=0, allow_inf_nan=False)
    # Connections open at once; one more is answered 503 and closed unread (`inflight.connections`), so that
    # a flood of them cannot take the descriptors the engine's files need. None: derived from the
    # open-files limit (`connections.default_max_connections`).
    max_connections: int | None = Field(default=None, ge=1)
    # When set, /update_weights and /set_adapter only read files under this directory.
    weights_dir: str | None = None
    # Accepted X-API-Key values; empty: every route open (serve() refuses that beyond loopback).
    api_keys: ApiKeys = Field(default_factory=list, repr=False)


class HTTPError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _ClientGoneError(Exception):
    """The HTTP client disconnected before its completions were ready (its requests were aborted)."""


@dataclass
class _ServerCounters:
    requests_total: int = 0
    requests_rejected: int = 0
    requests_failed: int = 0
    weight_load_s_total: float = 0.0
    weight_load_s_last: float = 0.0


class _EngineService:
    """What the routes call: prompt preparation, submission, waiting, and weight installation."""

    def __init__(
        self, engine: ServedEngine, tokenizer: Any, config: EngineServerConfig, stop_token_ids: Sequence[int]
    ) -> None:
        self.engine, self.tokenizer, self.config = engine, tokenizer, config
        self.loop = EngineLoop(engine)
        self.stopping: str | None = None  # why the server is shutting down (`begin_shutdown`), once it is
        self.counters = _ServerCounters()
        self._update_lock = threading.Lock()  # one update submission at a time: each gets its own ticket
        # Registered adapter -> version, kept here (not asked of the engine) so that any Engine backend
        # serves /adapters and /health alike; the lock keeps it and the engine's registry in step.
        self._adapters: dict[str, int] = {}
        self._adapter_lock = threading.Lock()
        self.broadcast = BroadcastListener(self._install_broadcast)
        # The handlers' tokenizer work (prompts, chat templates, token texts) runs on this one thread: off
        # the event loop, which a 20 MB prompt held for 17 s (no answer to anyone, /health included), and
        # never on two threads at once, which a fast tokenizer object is not meant for.
        self.tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
        # Unless a request says ignore_eos, completions stop at the model's EOS ids (its generation
        # config's, else the tokenizer's EOS), and chat also at the token its template ends a turn with
        # (Llama 3's <|eot_id|>, ChatML's <|im_end|>). A tokenizer without a template gets ChatML, the
        # layout `rollouts/chat.py` uses.
        eos = getattr(tokenizer, "eos_token_id", None)
        self.eos_ids: list[int] = list(stop_token_ids) or ([eos] if isinstance(eos, int) else [])
        self.chat_template: str | None = None
        if tokenizer is not None and not getattr(tokenizer, "chat_template", None):
            from inflight.models.tiny import CHAT_TEMPLATE  # lazy: it imports transformers' tokenizers

            self.chat_template = CHAT_TEMPLATE
        self.chat_end_ids: list[int] = list(self.eos_ids)
        if tokenizer is not None:
            try:
                end_id, _ = end_of_turn(tokenizer, chat_template=self.chat_template)
                self.chat_end_ids = list(reply_stop_ids(end_id, self.eos_ids))
            except (UserError, TemplateError):  # turns end in plain text: replies end at EOS only
                pass

    def begin_shutdown(self, reason: str) -> None:
        """A signal arrived: stop the engine loop without waiting (safe in a signal handler), so that the
        generations in flight end at its next step and their handlers answer 503 at once; uvicorn would
        otherwise wait for each to run to its max_tokens before it exits."""
        if self.stopping is None:
            self.stopping = reason
            self.loop.request_stop()

    def _shut_down(self, what: str) -> EngineLoopError:
        """A 503 for a request the shutdown stopped: a pipeline's client retries it on another replica."""
        return EngineLoopError(
            f"the engine server is shutting down ({self.stopping}): {what}; retry on another replica"
        )

    # -- generation ----------------------------------------------------------------------------------
    async def run(self, http_request: Request, requests: list[SampleRequest]) -> list[Completion]:
        """Submit all, then wait; aborts them on timeout, client disconnect or error."""
        if self.stopping is not None:
            raise self._shut_down("it takes no new requests")
        futures = []
        try:
            for request in requests:
                futures.append(self.loop.submit(request))
        except BaseException:
            for request in requests[: len(futures)]:  # only its own: another's may hold a refused id
                self.engine.abort(request.request_id)
            raise
        self.counters.requests_total += len(requests)
        waiter = asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
        timeout_s = self.config.request_timeout_s
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    m = self.engine.metrics()
                    raise TimeoutError(
                        f"waited {timeout_s:g} s for {len(requests)} request(s) to finish generating "
                        f"(engine: {m.num_running} running, {m.num_waiting} waiting)"
                    )
                done, _ = await asyncio.wait({waiter}, timeout=min(self.config.disconnect_poll_s, remaining))
                if done:
                    completions = list(waiter.result())
                    if self.stopping is not None and any(c.finish_reason == "abort" for c in completions):
                        raise self._shut_down(f"{len(requests)} request(s) were stopped unfinished")
                    return completions
                if await http_request.is_disconnected():
                    raise _ClientGoneError()
        finally:
            if not waiter.done():
                waiter.cancel()
                # Cancelled, the gather ends with CancelledError as its exception, which asyncio logged as
                # "exception was never retrieved" (3 lines) for every client that left: read, it is not.
                waiter.add_done_callback(_retrieve_exception)
                for request in requests:
                    self.engine.abort(request.request_id)

    def check_model(self, model: str | None) -> str | None:
        """The adapter an OpenAI `model` field names (vLLM's convention), None for the base model."""
        if not model or model == self.config.model_name:
            return None
        if model in self.adapters():
            return model
        raise HTTPError(
            404,
            f"model {model!r} is not served here; this server serves {self.config.model_name!r} and the "
            f"adapters {sorted(self.adapters())}",
        )

    def check_adapter(self, name: str | None) -> None:
        """404 for an adapter that is not registered (the engine checks again when the request joins)."""
        if name is not None and name not in self.adapters():
            raise HTTPError(
                404,
                f"no adapter named {name!r} is registered on this server (registered: "
                f"{sorted(self.adapters())}); register it with POST /set_adapter (Engine.set_adapter) "
                "first, or leave adapter unset for the base model",
            )

    async def tokenizing(self, work: Callable[[], T]) -> T:
        """`work` (anything that uses the tokenizer) on the tokenizer thread."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_thread, work)

    def check_count(self, prompts: int, n: int) -> None:
        """At most MAX_BATCH_REQUESTS sequences per request, as /generate_batch: 5,000 prompts x n=64 used
        to queue 320,000 sequences from one request."""
        if prompts * n > MAX_BATCH_REQUESTS:
            raise ValueError(
                f"{prompts} prompts x n={n} ask for {prompts * n} sequences, more than the "
                f"{MAX_BATCH_REQUESTS} one request may: send the prompts in several requests"
            )

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this server has no tokenizer: send prompts as token ids")
            return self._encode(_unicode(prompt, "prompt"), "prompt")
        return prompt

    def _encode(self, text: str, field: str, add_special_tokens: bool = True) -> list[int]:
        """`text`'s token ids, for at most a few contexts' worth of tokenizing: a text whose beginning alone
        holds twice the context (the cut can change only the tokens next to it) is refused from that
        beginning, not tokenized whole. Any other prompt too long is the engine's to refuse, as before."""
        context = self.engine.config.max_seq_len_tokens
        chars = 16 * context  # ~4 contexts of ordinary text: one probe, or none for a prompt that fits
        while chars < len(text):
            tokens = len(self.tokenizer.encode(text[:chars], add_special_tokens=add_special_tokens))
            if tokens > 2 * context:
                raise ValueError(
                    f"{field} is longer than this server's context of {context} tokens: its first {chars} "
                    f"characters alone are {tokens} tokens; shorten it"
                )
            chars *= 2
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def check_room(self, prompt: list[int], max_tokens: int, field: str = "max_tokens") -> None:
        """vLLM's rule for the OpenAI routes: prompt + max_tokens within the context, else 400 (not a
        completion cut short without a word). A prompt too long by itself is the engine's to refuse."""
        context = self.engine.config.max_seq_len_tokens
        if len(prompt) < context < len(prompt) + max_tokens:
            raise ValueError(
                f"{field}={max_tokens} with a prompt of {len(prompt)} tokens exceeds this server's "
                f"context of {context} tokens (prompt + completion): ask for at most "
                f"{context - len(prompt)} tokens, or shorten the prompt"
            )

    def render_chat(self, request: ChatCompletionRequest) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this server has no tokenizer: chat needs one")
        messages = [m.for_template() for m in request.messages]
        try:
            text = render(self.tokenizer, messages, request.add_generation_prompt, self.chat_template)
        except Exception as exc:  # jinja's own errors, e.g. a template that insists on role order
            raise ValueError(f"the chat template rejected the messages: {exc}") from exc
        return self._encode(_unicode(text, "messages"), "messages", add_special_tokens=False)

    # -- weights -------------------------------------------------------------------------------------
    def _install_broadcast(self, update: WeightUpdate) -> None:
        """An update from the trainer's broadcast (the listener's thread): installed at the next step."""
        if update.version < self.engine.version:
            log.warning("weight broadcast: version %d is older than the engine's; skipped", update.version)
            return
        with self._update_lock:
            self.loop.update_weights(update)

    async def install(self, update: WeightUpdate, load_s: float) -> UpdateWeightsResponse:
        """Copy off the step thread, then wait until a step has installed it (or a newer update)."""
        if update.version < self.engine.version:
            raise HTTPError(
                409, f"weight version {update.version} is older than the engine's {self.engine.version}"
            )
        self.counters.weight_load_s_total += load_s
        self.counters.weight_load_s_last = load_s

        def submit() -> tuple[int, float]:
            with self._update_lock:
                start = time.perf_counter()
                self.loop.update_weights(update)  # ValueError: wrong names or shapes
                return self.engine.metrics().updates_received, time.perf_counter() - start

        ticket, copy_s = await asyncio.to_thread(submit)
        deadline = time.monotonic() + self.config.update_timeout_s
        # Polled, not signalled: the engine installs at its next step (one decode step away) and the
        # check is a counter read.
        while self.engine.metrics().updates_consumed < ticket:
            if self.stopping is not None:
                raise self._shut_down(f"weight version {update.version} was not installed")
            if self.loop.error is not None:
                raise EngineLoopError(
                    f"the engine failed before installing weight version {update.version}: {self.loop.error}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"waited {self.config.update_timeout_s:.0f} s for the engine to install weight version "
                    f"{update.version} at a step boundary"
                )
            await asyncio.sleep(0.002)
        m = self.engine.metrics()
        record = next((r for r in reversed(m.recent_updates) if r.version == update.version), None)
        return UpdateWeightsResponse(
            version=m.version,
            requested_version=update.version,
            superseded=m.version != update.version,
            load_s=load_s,
            copy_s=copy_s,
            pause_s=record.pause_s if record is not None and m.version == update.version else None,
        )

    def resolve_weights_path(self, path_text: str, directory: bool = False) -> Path:
        """A file (or, for adapters, a directory) under weights_dir when that is set; 4xx otherwise. A path
        outside it is refused as written, before anything on disk is looked at, and again once its links
        are followed; one the filesystem cannot look up (a name too long, a link loop, an unknown ~user) is
        a 400, as a missing one is."""
        root = self.config.weights_dir
        outside = HTTPError(403, f"{path_text!r} is outside this server's weights_dir {root!r}")
        try:
            written = Path(os.path.abspath(Path(path_text).expanduser()))  # ".." folded, no link followed
            if root is not None:
                named_root = Path(os.path.abspath(Path(root).expanduser()))
                real_root = named_root.resolve()  # weights_dir may itself be a link
                if not (written.is_relative_to(named_root) or written.is_relative_to(real_root)):
                    raise outside
            path = written.resolve()
            if root is not None and not path.is_relative_to(real_root):
                raise outside
            found = path.is_dir() if directory else path.is_file()
        except (OSError, RuntimeError) as exc:  # Python 3.11 raises RuntimeError for a link loop, ~nobody
            raise ValueError(f"{path_text!r} cannot be looked up: {exc}") from None
        if not found and directory:
            raise ValueError(f"adapter directory {path_text!r} does not exist or is not a directory")
        if not found:
            raise ValueError(f"weights file {path_text!r} does not exist or is not a file")
        return path

    # -- adapters ------------------------------------------------------------------------------------
    def adapters(self) -> dict[str, int]:
        with self._adapter_lock:
            return dict(self._adapters)

    async def set_adapter(self, update: AdapterUpdate, load_s: float) -> SetAdapterResponse:
        if update.name == self.config.model_name:
            raise ValueError(
                f"adapter name {update.name!r} is the base model's name here; OpenAI's `model` field could "
                "not tell them apart: choose another name"
            )

        def register() -> int | None:
            # Checked and copied in this worker thread (ValueError naming the module at fault), not on
            # the event loop: a large adapter takes a while to copy.
            with self._adapter_lock:
                previous = self._adapters.get(update.name)
                if previous is not None and update.version < previous:
                    raise HTTPError(
                        409,
                        f"adapter {update.name!r}: version {update.version} is older than the registered "
                        f"{previous}; remove it first to start it over",
                    )
                self.engine.set_adapter(update)
                self._adapters[update.name] = update.version
                return previous

        previous = await asyncio.to_thread(register)
        return SetAdapterResponse(
            name=update.name,
            version=update.version,
            rank=update.rank,
            scale=update.scale,
            replaced=previous is not None,
            previous_version=previous,
            load_s=load_s,
        )

    async def remove_adapter(self, name: str) -> RemoveAdapterResponse:
        def unregister() -> int:
            with self._adapter_lock:
                if name not in self._adapters:
                    raise HTTPError(
                        404,
                        f"remove_adapter: no adapter named {name!r} (registered: {sorted(self._adapters)})",
                    )
                self.engine.remove_adapter(name)
                return self._adapters.pop(name)

        return RemoveAdapterResponse(name=name, version=await asyncio.to_thread(unregister))

    def metrics(self) -> MetricsResponse:
        m = self.engine.metrics()
        return MetricsResponse(
            **asdict(m),
            model=self.config.model_name,
            stale_kv_token_frac=m.stale_kv_token_frac,
            tokens_per_s=m.tokens_per_s,
            **asdict(self.counters),
            broadcast_updates_received=self.broadcast.received,
            broadcast_error=self.broadcast.error,
        )


def _retrieve_exception(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def _unicode(text: str, field: str) -> str:
    """`text`, which a tokenizer can encode: JSON may escape a lone UTF-16 surrogate ("\\ud800"), which is no
    character and no tokenizer takes (a TypeError deep in it, otherwise)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{field} is not valid Unicode: it holds a lone surrogate ({text[exc.start]!r}); send UTF-8 text"
        ) from None
    return text


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
    service = _EngineService(engine, tokenizer, config or EngineServerConfig(), stop_token_ids)

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


def _add_error_handlers(app: FastAPI, service: _EngineService) -> None:
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

    @app.exception_handler(_ClientGoneError)
    async def client_gone(request: Request, exc: _ClientGoneError) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's code for "client closed request"

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception) -> JSONResponse:
        return reply(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")


def _add_openai_routes(app: FastAPI, service: _EngineService) -> None:
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


def _add_engine_routes(app: FastAPI, service: _EngineService) -> None:
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


def serve(
    model: str,
    host: str = "127.0.0.1",
    port: int = 8100,
    max_batch_size: int = 64,
    *,
    backend: Backend = "builtin",
    kv_policy: str = "keep",
    max_seq_len_tokens: int | None = None,
    dtype: str = "float32",
    log_level: str = "info",
    device: str = "cpu",
    logprobs_kind: Literal["sampled", "raw"] = "sampled",
    max_lora_rank: int = 16,
    max_logprobs: int = 20,
    weights_dir: str | None = None,
    parent_pid: int | None = None,
    api_keys: Sequence[str] = (),
    request_header_timeout_s: float = 30.0,
    request_body_timeout_s: float = 600.0,
    max_body_bytes: int = 256 * 2**20,
    max_connections: int | None = None,
) -> None:
    """Load `model` (a directory or hub id) into an engine of `backend` and serve it until interrupted.
    "vllm" needs the environment `launch/vllm_env.py` builds (vLLM's CPU build pins its own torch and
    transformers) and a model directory in safetensors; `kv_policy` and `device` (cpu, cuda, cuda:N or
    auto) are the built-in engine's only, `logprobs_kind` (the kind it reports under any sampling),
    `max_lora_rank` and `max_logprobs` vLLM's. With `weights_dir`, weight and adapter updates by path read
    only files under it; with `parent_pid`, the server stops when that process (its parent: a launcher)
    is gone, so that a crashed run leaves no engine holding its memory. With `api_keys`, every route but
    /health needs one; beyond loopback a key and `weights_dir` are required (`access.py`). A request's head
    must be whole within `request_header_timeout_s` and its body within `request_body_timeout_s` of it (408
    past either), and a JSON body at most `max_body_bytes` (413); at most `max_connections` are open at once
    (None: derived from the open-files limit, first raised to its hard limit). SIGTERM/SIGINT stop it
    within seconds: the generations in flight are stopped and answered 503 (`_StoppingServer`)."""
    from inflight.preflight import bind_port, check_model_dir, serve_on

    check_engine_listening(host, api_keys, weights_dir)
    check_model_dir(model)
    raise_open_files_limit()  # before the app reads it for max_connections' default
    if max_seq_len_tokens is not None:
        check_context(model, max_seq_len_tokens)
    if parent_pid is not None:
        stop_with_parent(parent_pid)
    if backend == "builtin":
        from inflight.models.device import resolve_device

        resolve_device(device, "--device")  # a device this machine lacks fails before the weights load
    # The port is taken before the weights load: a port in use fails at once, and stays ours meanwhile.
    with contextlib.closing(bind_port(host, port)) as sock:
        engine, stop_ids = load_backend(
            backend,
            model,
            max_batch_size,
            max_seq_len_tokens,
            dtype,
            kv_policy,
            device,
            vllm=VllmOptions(logprobs_kind, max_lora_rank, max_prompt_logprobs=max_logprobs),
        )
        from inflight.models import load_tokenizer

        config = EngineServerConfig(
            model_name=model,
            weights_dir=weights_dir,
            api_keys=list(api_keys),
            request_header_timeout_s=request_header_timeout_s,
            request_body_timeout_s=request_body_timeout_s,
            max_body_bytes=max_body_bytes,
            max_connections=max_connections,
        )
        app = create_app(engine, load_tokenizer(model), config, stop_ids)
        # No access log: a pipeline sends thousands of requests a minute; /metrics counts them instead.
        serve_on(
            sock,
            app,
            host,
            port,
            make_server=lambda uvicorn_config: _StoppingServer(uvicorn_config, app.state.service),
            log_level=log_level,
            access_log=False,
            http=app.state.http_protocol,
            # A bound on what stopping the engine loop does not end (a body still arriving, say).
            timeout_graceful_shutdown=_CONNECTIONS_CLOSE_S,
        )


class _StoppingServer(uvicorn.Server):
    """uvicorn whose first SIGTERM/SIGINT also stops the engine loop (`begin_shutdown`), then stops as
    uvicorn does: it stops listening, the handlers in flight answer 503 within an engine step, and the
    process exits on the signal, within seconds whatever was generating."""

    def __init__(self, config: uvicorn.Config, service: _EngineService) -> None:
        super().__init__(config)
        self._service = service

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._service.begin_shutdown(signal.Signals(sig).name)
        super().handle_exit(sig, frame)


def check_context(model: str, max_seq_len_tokens: int) -> None:
    """--max-seq-len-tokens within the positions the model addresses (its config, read without the weights):
    past them a model with learned positions fails mid-request, and a rotary one generates from positions it
    never saw. A config that cannot be read, or does not say, is left to the loader."""
    from transformers import AutoConfig

    from inflight.preflight import context_tokens

    try:
        context = context_tokens(AutoConfig.from_pretrained(model))
    except (OSError, ValueError, KeyError):
        return
    if context is not None and max_seq_len_tokens > context[0]:
        limit, basis = context
        raise UserError(
            f"--max-seq-len-tokens {max_seq_len_tokens} is more than the {limit} positions {model!r} "
            f"addresses ({basis} in its config): pass --max-seq-len-tokens {limit} or less"
        )


def stop_with_parent(parent_pid: int, poll_s: float = 0.5, grace_s: float = 10.0) -> None:
    """From a daemon thread: once this process's parent is no longer `parent_pid` (it died, and the process
    was handed to init), SIGTERM to this process (uvicorn stops cleanly, the lifespan closes the engine),
    and after `grace_s` an exit regardless."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        log.warning("the launcher (pid %d) is gone: stopping", parent_pid)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os._exit(1)

    if os.getppid() != parent_pid:
        raise UserError(
            f"--parent-pid {parent_pid} is not this process's parent ({os.getppid()}): the flag is for the "
            "launcher that starts serve-engine, which passes its own live pid so that the server stops when "
            "it exits; pass the pid of the process that starts this one, or drop --parent-pid"
        )
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


class ServerThread:
    """`app` (from `create_app`) served by uvicorn from a thread of this process, on a socket bound before it
    starts (port 0: a free one), with its head deadline: the engine's HTTP face inside a process that has
    other work, e.g. a Ray replica or the tests that hold it to the Engine contract. `stop()` ends it, and
    the app's lifespan stops its engine loop."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        import uvicorn

        from inflight.preflight import bind_port

        self._socket = bind_port(host, port)
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
