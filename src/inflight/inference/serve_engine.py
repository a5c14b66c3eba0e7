"""`inflight serve-engine`: load a model into an engine of a backend and serve it (`server.py`'s app) on a
port until a signal; the first SIGTERM/SIGINT stops the engine loop too, so the generations in flight are
answered 503 within a step. Also the checks made before the weights load: the context asked for against
the model's config, and the launcher's pid to stop with.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Sequence
from types import FrameType
from typing import Literal

import uvicorn

from inflight.connections import raise_open_files_limit
from inflight.errors import UserError
from inflight.gc_tuning import freeze_long_lived
from inflight.inference.access import check_engine_listening
from inflight.inference.backends import Backend, VllmOptions, load_backend
from inflight.inference.engine_service import EngineServerConfig, EngineService
from inflight.inference.server import create_app

log = logging.getLogger(__name__)
# On a signal, once the engine loop is stopped: how long uvicorn waits for the connections still open.
_CONNECTIONS_CLOSE_S = 5


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
        freeze_long_lived()  # the `serve-engine` process lives as long as this engine (gc_tuning.py)
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

    def __init__(self, config: uvicorn.Config, service: EngineService) -> None:
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
