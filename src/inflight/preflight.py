"""Checks a command makes before it reads any weights, so bad input fails in a second and in one line.

Owns the listening socket (bound here, then handed to uvicorn: no window for another process to take the
port), writable directories and output files, database URLs (by connecting, with a bounded timeout), model
directories and the context their model addresses, engine URLs and environment kwargs. Each failure is a
UserError naming the input and the fix. Knows nothing of what the commands do next; heavy imports stay
inside the functions.
"""

from __future__ import annotations

import contextlib
import errno
import inspect
import json
import logging
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from inflight.errors import UserError, describe

if TYPE_CHECKING:
    import uvicorn

    from inflight.config import RunConfig

CONNECT_TIMEOUT_S = 10  # a database or engine that has not answered by then is reported as unreachable
_BACKLOG = 2048  # uvicorn's default
_DB_HINT = "use sqlite:///PATH or postgresql+psycopg://USER:PASSWORD@HOST:PORT/DB"
# The driver argument that bounds a connection attempt, in whole seconds (libpq's and MySQL's).
_CONNECT_TIMEOUT_ARG = {"postgresql": "connect_timeout", "mysql": "connect_timeout"}


def _reason(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def check_port(port: int) -> None:
    """A port a socket can bind (0: any free one)."""
    if not 0 <= port <= 65535:
        raise UserError(f"--port {port} is out of range: use 1-65535")


def bind_port(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port) and listening; serve on it with `serve_on`.

    It listens at once: on Linux, SO_REUSEADDR lets a second socket bind the same port until one listens.
    Connections made while the weights load wait in the backlog rather than being refused.
    """
    check_port(port)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    # The protocol must be named: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on connections of
    # a socket whose proto is IPPROTO_TCP, and a response written as headers then body otherwise waits for
    # the client's delayed ACK, ~40 ms on Linux, on every request.
    # As uvicorn does: a restarted server rebinds at once over its old connections in TIME_WAIT.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(_BACKLOG)
    except OSError as e:  # socket.gaierror (an unknown host) included
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise UserError(
                f"port {port} on {host} is in use: stop what listens there, or pass another --port"
            ) from None
        raise UserError(f"cannot listen on {host}:{port} ({_reason(e)}): check --host and --port") from None
    return sock


def serve_on(
    sock: socket.socket,
    app: Any,
    host: str,
    port: int,
    *,
    make_server: Callable[[uvicorn.Config], uvicorn.Server] | None = None,
    **uvicorn_config: Any,
) -> None:
    """Run `app` with uvicorn on the socket from `bind_port` until interrupted, as `uvicorn.run` would.

    `make_server` builds the uvicorn server from its config (default `uvicorn.Server`), e.g. one that drains
    the app on a signal before it stops."""
    import uvicorn

    startup = _StartupWatch(app)
    config = uvicorn.Config(startup, host=host, port=port, **uvicorn_config)
    server = (make_server or uvicorn.Server)(config)
    _announce_when_serving(server, _url(host, sock.getsockname()[1]))
    try:
        with contextlib.suppress(KeyboardInterrupt):  # uvicorn.run's behaviour: Ctrl-C is a clean stop
            server.run(sockets=[sock])
    except SystemExit:  # uvicorn's exit (status 3) when the app's startup failed
        if startup.failed:
            raise startup.failure() from None
        raise
    if not server.started:
        raise startup.failure()


class _StartupWatch:
    """`app` as uvicorn sees it, except that a failed lifespan startup (a placement Ray refused, an engine
    that would not start: any exception) is kept for `serve_on` to raise as one line, where uvicorn would
    log its traceback and exit with status 3. Every other message and scope passes through untouched."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.failed = False
        self.error: Exception | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return

        async def send_quietly(message: Any) -> None:
            if message["type"] == "lifespan.startup.failed":
                self.failed = True
                message = {"type": message["type"], "message": ""}  # the traceback uvicorn would log
            await send(message)

        try:
            await self.app(scope, receive, send_quietly)
        except Exception as e:
            if not self.failed:  # at shutdown: uvicorn reports it, as before
                raise
            self.error = e

    def failure(self) -> UserError:
        """One line for the failed startup: a UserError as it is (it names the fix), anything else as its
        type, its message's first line and where in inflight it was raised."""
        if isinstance(self.error, UserError):
            return self.error
        if self.error is None:  # no exception to show: uvicorn's log above says what happened
            return UserError("the server did not start (its log above says why); nothing is served")
        return UserError(
            f"the server did not start: {describe(self.error)} (raised at {_raised_at(self.error)}); "
            "nothing is served: fix that and start it again"
        )


def _raised_at(exc: BaseException) -> str:
    """FILE:LINE of the innermost frame of inflight's own code in `exc`'s traceback (else the innermost
    frame), so that a failure without a fix of its own can still be found without its traceback."""
    import traceback

    import inflight

    package = Path(inflight.__file__).parent
    frames = [frame for frame in traceback.extract_tb(exc.__traceback__) if frame.filename != __file__]
    if not frames:
        return "an unknown place"
    ours = [frame for frame in frames if Path(frame.filename).is_relative_to(package)]
    frame = (ours or frames)[-1]
    shown = Path(frame.filename).relative_to(package.parent) if ours else frame.filename
    return f"{shown}:{frame.lineno}"


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _announce_when_serving(server: uvicorn.Server, url: str) -> None:
    """Log "listening on URL" once `server` has started serving (the app's startup done).

    uvicorn logs its own "running on" line only for a socket it binds itself: given sockets, it assumes a
    parent process announced them. Without this line a `--port 0` server never says which port it got.
    `url` carries the bound port, not the one asked for."""
    startup = server.startup

    async def startup_then_announce(sockets: list[socket.socket] | None = None) -> None:
        await startup(sockets=sockets)
        if server.started:  # not when the app's startup failed (uvicorn then exits)
            logging.getLogger("uvicorn.error").info("listening on %s (Ctrl-C to stop)", url)

    # The server may be a subclass (make_server): wrapping this instance's method keeps whatever it adds.
    server.startup = startup_then_announce  # type: ignore[method-assign]


def ensure_dir(path: str | Path, what: str) -> Path:
    """`path` as a directory this process can write in, created if missing."""
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise UserError(f"{what}: {path} is a file, not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()  # creatable is not writable: a read-only mount, /proc
    except OSError as e:
        raise UserError(f"{what}: {path} is not a writable directory ({e.strerror or _reason(e)})") from None
    return path


def check_output_file(path: str | Path, what: str) -> Path:
    """`path` as a file that can be written: not a directory, in a writable directory (created if missing)."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise UserError(f"{what}: {path} is a directory; name a file")
    ensure_dir(path.parent, what)
    return path


def check_database(url: str, what: str = "--db", timeout_s: int = CONNECT_TIMEOUT_S) -> None:
    """Open the database at `url` and run one query: an unknown backend, a missing driver, an unwritable
    SQLite path, a SQLite file that is not a database (or is corrupt) and an unreachable server all fail
    here. The password never appears in a message."""
    from sqlalchemy import create_engine, make_url, text
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError, SQLAlchemyError
    from sqlalchemy.pool import NullPool

    try:
        parsed = make_url(url)
    except ArgumentError:
        raise UserError(f"{what} {url!r} is not a database URL: {_DB_HINT}") from None
    shown = parsed.render_as_string(hide_password=True)
    backend = parsed.get_backend_name()
    connect_args: dict[str, Any] = {}
    if backend == "sqlite":
        if parsed.database in (None, "", ":memory:"):
            raise UserError(f"{what} {url!r} is in memory, which a restart loses: use sqlite:///PATH")
        ensure_dir(Path(parsed.database).parent, f"{what} {shown!r}")
    elif backend in _CONNECT_TIMEOUT_ARG:
        connect_args[_CONNECT_TIMEOUT_ARG[backend]] = timeout_s
    try:
        engine = create_engine(parsed, connect_args=connect_args, poolclass=NullPool)
    except NoSuchModuleError:
        raise UserError(
            f"{what} {shown!r}: unknown database backend {parsed.drivername!r}; {_DB_HINT}"
        ) from None
    except ImportError as e:
        raise UserError(
            f"{what} {shown!r}: the driver for {parsed.drivername!r} is not installed ({_reason(e)}); "
            + _DB_HINT
        ) from None
    # SQLite opens a file lazily: `SELECT 1` succeeds on any file, even one holding text. Reading the
    # schema reads the file's header and first page, so a file that is not a database fails here.
    probe = "SELECT count(*) FROM sqlite_master" if backend == "sqlite" else "SELECT 1"
    try:
        with engine.connect() as connection:
            connection.execute(text(probe))
    except SQLAlchemyError as e:
        original = getattr(e, "orig", None)
        reason = _reason(original or e)
        if backend == "sqlite" and _damaged_sqlite(original):
            raise UserError(
                f"{what} {shown!r}: {parsed.database} is not a SQLite database, or is damaged ({reason}): "
                "move it away (a new, empty database is then created in its place), or name another "
                "database file"
            ) from None
        fix = (
            "name a SQLite database file this user can read and write"
            if backend == "sqlite"
            else "start the database, or fix the URL's host, port, user, password or database name"
        )
        raise UserError(f"{what} {shown!r}: cannot connect ({reason}): {fix}") from None
    finally:
        engine.dispose()


def _damaged_sqlite(exc: BaseException | None) -> bool:
    """Whether SQLite refused a file for its contents (not a database, or corrupt), not for access."""
    import sqlite3

    code = getattr(exc, "sqlite_errorcode", None)
    return isinstance(exc, sqlite3.DatabaseError) and code in (sqlite3.SQLITE_NOTADB, sqlite3.SQLITE_CORRUPT)


def check_model_dir(name_or_path: str) -> None:
    """A local model path must be a Hugging Face model directory; a hub id must be downloadable (or cached):
    the rest of it is left to the loader."""
    from inflight.models.paths import resolve

    local = Path(resolve(name_or_path))  # UserError for a path that does not exist or is a file
    if not local.is_dir():
        check_hub_reachable(str(name_or_path))
        return
    if not (local / "config.json").is_file():
        raise UserError(
            f"model directory {str(local)!r} has no config.json, so it holds no Hugging Face model: "
            f"build one with `inflight model tiny --out {local}`"
        )
    check_causal_lm(local)
    check_weight_files(local)


def check_hub_reachable(repo_id: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """A hub id that is not in the Hugging Face cache is downloaded, so the hub must answer: asked once here,
    because the download itself retries an unreachable hub for about a minute before it fails.

    Any HTTP answer counts (a missing or gated repository is the loader's to report, in its words). Offline
    mode (HF_HUB_OFFLINE=1) and a cached model need no network: transformers then reads the cache at once.
    The request goes through httpx, like huggingface_hub's own, so the same proxy settings apply."""
    import httpx
    from huggingface_hub import constants

    from inflight.models.paths import in_hub_cache

    if constants.HF_HUB_OFFLINE or in_hub_cache(repo_id):
        return
    try:
        httpx.head(constants.ENDPOINT, timeout=timeout_s)
    except (httpx.HTTPError, httpx.InvalidURL) as e:
        raise UserError(
            f"model {repo_id!r} is not a local directory, so it is a Hugging Face hub id, but it is not in "
            f"the cache ({constants.HF_HUB_CACHE}) and {constants.ENDPOINT} cannot be reached "
            f"({type(e).__name__}: {_reason(e)}): name a local model directory, or download it once with "
            "network access (it is then read from the cache)"
        ) from None


def check_causal_lm(local: Path) -> None:
    """The directory's model type is one transformers loads as a causal LM (what inflight trains and samples);
    an encoder such as BERT is refused here, before any weight is read."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    try:
        config = json.loads((local / "config.json").read_text())
        model_type = config.get("model_type")
    except (OSError, ValueError, AttributeError) as exc:
        raise UserError(
            f"model directory {str(local)!r}: config.json is unreadable: {_reason(exc)}"
        ) from None
    # Encoder families (BERT, RoBERTa, ...) have a causal-LM class too, but it is their decoder variant: a
    # checkpoint not saved as a decoder (is_decoder) is an encoder, which transformers would load with a
    # warning and which then fails later for want of a tokenizer or chat template, naming neither cause.
    encoder = model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not config.get("is_decoder")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or encoder:
        kind = " (an encoder: its config.json does not set is_decoder)" if encoder else ""
        raise UserError(
            f"model directory {str(local)!r} holds a {model_type!r} model{kind}, which is not a causal "
            "language model: inflight trains and samples decoder LMs (Qwen2/2.5/3, Llama, Mistral, GPT-NeoX, "
            "any AutoModelForCausalLM type)"
        )


def check_weight_files(local: Path) -> None:
    """Every *.safetensors file of a local model directory has a whole, readable header that covers the
    file: a truncated download or an interrupted save is named here, in one line, instead of failing as a
    traceback from inside transformers once the weights load. Reads headers only (milliseconds)."""
    from safetensors import SafetensorError, safe_open

    for file in sorted(local.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="numpy"):
                pass
        except SafetensorError as exc:
            raise UserError(
                f"model weights {str(file)!r} are incomplete or corrupt ({_reason(exc)}): download or "
                f"build the model again (a tiny model: `inflight model tiny --out {local}`)"
            ) from None
        except OSError as exc:
            raise UserError(
                f"model weights {str(file)!r} cannot be read ({exc.strerror or _reason(exc)}): check the "
                "file and its permissions"
            ) from None


def check_chat_template(name_or_path: str) -> None:
    """Runs format turns with the tokenizer's own chat template: one that has none is refused before the
    weights load (reading a tokenizer is cheap)."""
    from inflight.models.loader import load_tokenizer

    tokenizer = load_tokenizer(name_or_path)
    if getattr(tokenizer, "chat_template", None) is None:
        raise UserError(
            f"the tokenizer of {name_or_path!r} has no chat template, and runs format every turn with the "
            "model's own: use a chat/instruct model's tokenizer, or add `chat_template` to its "
            "tokenizer_config.json"
        )


def check_context_length(cfg: RunConfig) -> None:
    """engine.max_seq_len_tokens within the positions the model addresses, read from its config (no weight):
    past them a model with learned positions fails mid-run, and a rotary one trains on positions it never
    saw, with only a warning from transformers."""
    config = _model_config(cfg)
    context = None if config is None else context_tokens(config)
    tokens = cfg.engine.max_seq_len_tokens
    if context is not None and tokens > context[0]:
        limit, basis = context
        model = repr(cfg.model.path) if cfg.model.path else f"the {cfg.model.tiny_preset} model"
        raise UserError(
            f"engine.max_seq_len_tokens={tokens} is more than the {limit} positions {model} addresses "
            f"({basis} in its config): set engine.max_seq_len_tokens={limit} or less"
        )


def _model_config(cfg: RunConfig) -> Any:
    """The run's model config (the tiny model's, built from its preset, when no model.path); None when it
    cannot be read, which the loader then reports in its own words."""
    if not cfg.model.path:
        from inflight.models.tiny import PRESETS, model_config

        return model_config(PRESETS[cfg.model.tiny_preset])
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(cfg.model.path)
    except (OSError, ValueError, KeyError):
        return None


def context_tokens(config: Any) -> tuple[int, str] | None:
    """The most positions `config`'s model addresses, and what in its config says so; None where it does not
    say (no max_position_embeddings, a rope scaling without one factor such as longrope's lists, a rope per
    layer type): nothing is refused then."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    positions = getattr(text, "max_position_embeddings", None)
    if not isinstance(positions, int) or positions <= 0:
        return None
    # transformers 5 names it rope_parameters (rope_type "default": no scaling), older configs rope_scaling.
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    if not isinstance(rope, dict) or any(isinstance(value, dict) for value in rope.values()):
        return None
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return positions, f"max_position_embeddings={positions}"
    factor = rope.get("factor")
    if isinstance(factor, bool) or not isinstance(factor, int | float):
        return None
    # Linear, dynamic and YaRN scaling stretch the original context by the factor; Llama 3's
    # max_position_embeddings already counts its own (8 x 8192 = 65536, below its 131072).
    original = int(rope.get("original_max_position_embeddings") or positions)
    scaled = int(factor * original)
    if scaled <= positions:
        return positions, f"max_position_embeddings={positions}"
    return scaled, f"max_position_embeddings={positions}, {kind} rope scaling x{factor:g} of {original}"


def check_env(name: str, kwargs: dict[str, Any], factory: Any = None) -> None:
    """The environment exists and its constructor takes every key of `kwargs` (their values it checks).

    `factory`: the environment's class or factory itself (a task's own Env), named `name` in messages.
    """
    from inflight.envs import ENVS

    if factory is not None:
        env_class: Any = factory
    elif name.startswith("openenv:"):
        from inflight.envs.openenv_client import OpenEnvClientEnv

        env_class = OpenEnvClientEnv
    elif name in ENVS:
        env_class = ENVS[name]
    else:
        known = ", ".join(sorted(ENVS)) or "(none registered)"
        raise UserError(f"unknown environment {name!r}; known environments: {known}")
    accepted = _keyword_arguments(env_class)
    if accepted is None:
        return
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise UserError(
            f"env.kwargs: environment {name!r} takes no {', '.join(unknown)}; "
            f"it takes: {', '.join(accepted) or 'nothing'}"
        )


def _keyword_arguments(factory: Any) -> list[str] | None:
    """The keyword arguments `factory` takes, or None when it takes any (or has no signature to read)."""
    from inflight.envs.openenv_client import OpenEnvClientConfig, OpenEnvClientEnv

    if getattr(factory, "func", None) is OpenEnvClientEnv or factory is OpenEnvClientEnv:
        return [name for name in OpenEnvClientConfig.model_fields if name != "url"]  # its **kwargs
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # building it will tell
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def check_engine_urls(urls: list[str], timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Every inference replica answers /health."""
    import httpx

    for url in urls:
        try:
            status = httpx.get(f"{url.rstrip('/')}/health", timeout=timeout_s).status_code
        except (httpx.HTTPError, httpx.InvalidURL) as e:
            raise UserError(
                f"pipeline.engine_urls: {url} does not answer ({type(e).__name__}: {_reason(e)}): start it "
                "with `inflight serve-engine --model DIR --port N`, or fix the URL"
            ) from None
        if status != 200:
            raise UserError(
                f"pipeline.engine_urls: {url}/health answered HTTP {status}: is it an inflight engine?"
            )


def check_run(cfg: RunConfig, env_name: str = "", env_factory: Any = None) -> None:
    """What `inflight run` can check before it builds anything (the task, the run directory and its
    checkpoint are checked where they are opened, also before the weights load). `env_factory`: the task's
    own Env (named `env_name`), which `cfg.env.name` replaces when set."""
    # The model path first: a missing directory is a path check, answered before torch is imported.
    if cfg.model.path:
        check_model_dir(cfg.model.path)
        check_chat_template(cfg.model.path)
    from inflight.models.device import resolve_device  # torch: only once a run is really starting

    if cfg.launcher == "local":  # under Ray the devices are the placed actors', not this machine's
        resolve_device(cfg.engine.device, "engine.device")
        resolve_device(cfg.trainer.device, "trainer.device")
    check_context_length(cfg)
    if cfg.env.name:
        check_env(cfg.env.name, cfg.env.kwargs)
    elif env_factory is not None:
        check_env(env_name, cfg.env.kwargs, env_factory)
    if cfg.engine.backend == "vllm" and cfg.pipeline.engine_urls:
        raise UserError(
            "engine.backend=vllm starts its own vLLM engine, but pipeline.engine_urls names engines too: "
            "unset one (engines you started yourself: leave engine.backend at builtin)"
        )
    check_engine_urls(cfg.pipeline.engine_urls)
