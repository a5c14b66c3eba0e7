"""What the engine server's routes call (`server.py`): prompt preparation and submission to the one
EngineLoop that steps the engine, the wait for completions (aborted on a timeout, a client gone or a
shutdown), weight installation between two decode steps, and the adapter registry. Knows no routes, no
uvicorn and no process: `server.py` builds the app on it, `serve_engine.py` runs it as `inflight
serve-engine`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

from fastapi import Request
from jinja2 import TemplateError
from pydantic import BaseModel, ConfigDict, Field

from inflight.auth import ApiKeys
from inflight.errors import UserError
from inflight.inference.backends import ServedEngine
from inflight.inference.engine_loop import EngineLoop, EngineLoopError
from inflight.inference.openai_api import (
    ChatCompletionRequest,
)
from inflight.inference.weight_broadcast import BroadcastListener
from inflight.inference.wire import (
    MAX_BATCH_REQUESTS,
    MetricsResponse,
    RemoveAdapterResponse,
    SetAdapterResponse,
    UpdateWeightsResponse,
)
from inflight.models.chat_template import end_of_turn, render, reply_stop_ids
from inflight.types import AdapterUpdate, Completion, SampleRequest, WeightUpdate

log = logging.getLogger(__name__)
T = TypeVar("T")


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


class ClientGoneError(Exception):
    """The HTTP client disconnected before its completions were ready (its requests were aborted)."""


@dataclass
class ServerCounters:
    requests_total: int = 0
    requests_rejected: int = 0
    requests_failed: int = 0
    weight_load_s_total: float = 0.0
    weight_load_s_last: float = 0.0


class EngineService:
    """What the routes call: prompt preparation, submission, waiting, and weight installation."""

    def __init__(
        self, engine: ServedEngine, tokenizer: Any, config: EngineServerConfig, stop_token_ids: Sequence[int]
    ) -> None:
        self.engine, self.tokenizer, self.config = engine, tokenizer, config
        self.loop = EngineLoop(engine)
        self.stopping: str | None = None  # why the server is shutting down (`begin_shutdown`), once it is
        self.counters = ServerCounters()
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
                    raise ClientGoneError()
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
