"""Shared fixtures: one tiny model per test session, built locally (no hub) into a private temp dir."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

import inflight  # noqa: F401  (sets OpenMP's spin count before any test module loads torch)

if TYPE_CHECKING:
    from collections.abc import Sequence

    from inflight.api.app import BackgroundServer
    from inflight.api.compute import ServiceCompute
    from inflight.api.db import Database
    from inflight.api.futures import FutureStore
    from inflight.api.service import ServiceConfig
    from inflight.api.worker import EngineWorker, WorkerConfig
    from inflight.envs.sandbox import SandboxLimits, SandboxResult


def one_line_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run the CLI; assert exit 2 and a single `inflight: error:` line; return that line. Import it from a
    test module: `from conftest import one_line_error`."""
    from inflight.cli import main

    capsys.readouterr()  # what the test's own setup printed
    code = main(list(argv))
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("inflight: error: "), err
    return lines[0]


class NoWeights:
    @staticmethod
    def from_pretrained(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("weights were read before the bad input was reported")


@pytest.fixture
def no_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every model load goes through the loader's AutoModelForCausalLM: make reaching it fail the test (bad
    input must be reported before any weight is read)."""
    monkeypatch.setattr("inflight.models.loader.AutoModelForCausalLM", NoWeights)


class LimitsSeen:
    """A sandbox Verifier that runs nothing: it records the limits each execution was asked to run under
    and answers it "timeout". Import it from a test module: `from conftest import LimitsSeen`."""

    def __init__(self) -> None:
        self.limits: list[SandboxLimits | None] = []

    async def run(self, code: str, *, stdin: str = "", limits: SandboxLimits | None = None) -> SandboxResult:
        return self.run_many([code], stdin=stdin, limits=limits)[0]

    def run_many(
        self, codes: Sequence[str], *, stdin: str = "", limits: SandboxLimits | None = None
    ) -> list[SandboxResult]:
        from inflight.envs.sandbox import SandboxResult

        self.limits += [limits] * len(codes)
        return [SandboxResult.not_run("timeout", "not run", "rlimit") for _ in codes]

    def stats(self) -> dict[str, int]:
        return {}


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from inflight.models import build_tiny

    return build_tiny(tmp_path_factory.mktemp("tiny-model"), preset="tiny", seed=0)


@pytest.fixture(scope="session")
def warm_tiny_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model after BlackJack's format warm-up, shortened to 20 steps of 32 scripted episodes (what
    the Ray tests' runs each trained): a run from it with warmup.sft_steps=0 has groups that carry signal
    from its first step, without the warm-up each such run would otherwise train again (5-10 s each on 2
    cores, ~16 runs a session)."""
    from inflight.config import apply_overrides
    from inflight.envs.blackjack import BlackJackEnv
    from inflight.models import load_model, load_tokenizer
    from inflight.orchestrator.setup import pad_id
    from inflight.orchestrator.target import resolve_target
    from inflight.orchestrator.warmup import format_warmup
    from inflight.rollouts.chat import ChatFormat

    warm = tmp_path_factory.mktemp("warm-tiny-model")
    shutil.copytree(tiny_model_dir, warm, dirs_exist_ok=True)  # the tokenizer and its chat template
    model, tokenizer = load_model(tiny_model_dir, progress=False), load_tokenizer(tiny_model_dir)
    cfg = apply_overrides(
        resolve_target("blackjack").config(), ["warmup.sft_steps=20", "warmup.sft_batch_size=32"]
    )
    chat = ChatFormat.for_model(tokenizer, model)
    format_warmup(model, pad_id(tokenizer), chat, BlackJackEnv, cfg, logger=None)
    model.save_pretrained(warm)  # the weights, config and generation config, over the copied ones
    return warm


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    # Runs that build the tiny model cache it under INFLIGHT_CACHE: never the user's ~/.cache in tests.
    monkeypatch.setenv("INFLIGHT_CACHE", str(tmp_path_factory.getbasetemp() / "inflight-cache"))


@contextlib.contextmanager
def closing_sdk_clients() -> Iterator[None]:
    """Close the `tinker` SDK clients opened inside and left open, at its end. Left open, a client's session
    heartbeats fail once its server is gone, for the rest of the process: logged into later tests' captured
    records (a CI failure under xdist) and after pytest's summary. Found by their type: tests and the
    cookbook's recipes rarely keep a handle to them."""
    before = {id(holder) for holder in open_sdk_clients()}
    try:
        yield
    finally:
        for holder in open_sdk_clients():
            if id(holder) not in before:
                holder.close()  # idempotent, no request: stops the heartbeats and the connection pools


@pytest.fixture
def close_sdk_sessions() -> Iterator[None]:
    """`closing_sdk_clients` around a test, for servers not made by `sdk_server` (which does it itself):
    the cookbook's recipes (run unmodified, in-process) never close their ServiceClient, as a script that
    exits right after need not."""
    with closing_sdk_clients():
        yield


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Close every `tinker` SDK client still open when the tests end. One left open by a test (CI saw one,
    from a test outside `close_sdk_sessions`) heartbeats a server long gone for the rest of the run and
    logs its failure after pytest's summary, into a closed stream (a "Logging error" traceback)."""
    for holder in open_sdk_clients():
        holder.close()  # idempotent, no request: stops the heartbeats and the connection pools


def open_sdk_clients() -> list[Any]:
    """The `tinker` SDK's client holders alive in this process (none if no test imported the SDK)."""
    import gc
    import sys

    module = sys.modules.get("tinker.lib.internal_client_holder")
    if module is None:
        return []
    # type(), not isinstance: isinstance reads `__class__`, which a lazy proxy among all objects may raise on.
    cls = module.InternalClientHolder
    return [o for o in gc.get_objects() if issubclass(type(o), cls)]


@contextlib.contextmanager
def sdk_server(config: ServiceConfig, **app_options: Any) -> Iterator[BackgroundServer]:
    """`inflight serve`'s app in-process on a free loopback port, with the environment the `tinker` SDK
    reads (any API key, no telemetry, the hub offline); the SDK clients opened against it are closed when it
    stops (`closing_sdk_clients`). Import it from a test module: `from conftest import sdk_server`."""
    from inflight.api.app import BackgroundServer, create_app

    with closing_sdk_clients(), pytest.MonkeyPatch.context() as mp:
        mp.setenv("TINKER_API_KEY", "tml-test")
        mp.setenv("TINKER_TELEMETRY", "0")
        mp.setenv("HF_HUB_OFFLINE", "1")  # a base model named like a hub id is never looked up
        with BackgroundServer(create_app(config, **app_options)) as running:
            yield running


def ready_models(db: Database, base_model: str, count: int, rank: int = 4) -> FutureStore:
    """Session "s" and its `count` LoRA models "s:train:0".. of `base_model`, each as the worker finds it
    after create_model: a ready row whose seq_id 0 (the creation) is done. Rows only: no adapter is
    made. Returns the futures store over `db`."""
    from inflight.api.db import ModelRow, SessionRow
    from inflight.api.futures import FutureStore, RequestType

    with db.write() as session:
        session.add(SessionRow(session_id="s"))
        session.flush()  # the models' foreign key needs the session row first
        for i in range(count):
            session.add(
                ModelRow(
                    model_id=f"s:train:{i}",
                    session_id="s",
                    model_seq_id=i,
                    base_model=base_model,
                    lora_rank=rank,
                    lora_config={"rank": rank},
                    status="ready",
                )
            )
    store = FutureStore(db)
    for i in range(count):
        created = store.submit(f"s:train:{i}", 0, RequestType.CREATE_MODEL, b"{}")
        assert store.claim_next(created.model_id) is not None
        store.complete(created.request_id, b"{}")
    return store


@contextlib.contextmanager
def live_worker(
    compute: ServiceCompute, db: Database, state_dir: Path, config: WorkerConfig
) -> Iterator[EngineWorker]:
    """The service's worker over a real compute (its sampling engines started) and futures database, not
    started: a test drives it round by round (`run_once`) or starts it. Stopped on the way out."""
    from inflight.api.checkpoints import CheckpointStore
    from inflight.api.jobs import BaseModelLimits
    from inflight.api.sampler import build_sampler
    from inflight.api.worker import EngineWorker

    limits = {}
    for name in compute.base_model_names():
        info = compute.model_info(name)
        limits[name] = BaseModelLimits(
            vocab_size=int(info["vocab_size"]), max_context=int(info["max_context"])
        )
    sampler = build_sampler(compute.sampling_engines()).start()
    worker = EngineWorker(
        compute, sampler, db, CheckpointStore(db, state_dir / "checkpoints"), limits=limits, config=config
    )
    try:
        yield worker
    finally:
        worker.stop()
        sampler.stop()


def require_vllm_env() -> None:
    """The vLLM environment (`launch/vllm_env.py`), built on first use and cached: a test that needs it
    fails under CI when it cannot be built (CI must run it) and is skipped elsewhere (say, no network).
    Import it from a test module: `from conftest import require_vllm_env`."""
    import os

    from inflight.launch.vllm_env import VllmEnvError, vllm_python

    try:
        vllm_python()
    except VllmEnvError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"the vLLM environment must build in CI: {exc}")
        pytest.skip(f"the vLLM environment cannot be built here: {exc}")


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port something already listens on (for the port-in-use errors)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def read_until_closed(sock: socket.socket, within_s: float = 10.0) -> bytes:
    """Everything a server sends on `sock` until it closes the connection; TimeoutError if it has not within
    `within_s`. Import it from a test module: `from conftest import read_until_closed`."""
    deadline = time.monotonic() + within_s
    answer = b""
    while True:
        sock.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:  # a byte sent after its close: what it wrote was read first
            return answer
        if not chunk:
            return answer
        answer += chunk


def assert_refused_at_once(refused: socket.socket, within_s: float, head_timeout_s: float) -> None:
    """A connection past a server's --max-connections (closed here): a 503 naming the option, with
    Retry-After (the tinker SDK waits that long, then retries), and closed before the client sends a byte,
    well before the head's deadline of `head_timeout_s`."""
    with refused:
        started = time.monotonic()
        answer = read_until_closed(refused, within_s=within_s)
        seconds = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 503 Service Unavailable\r\n"), answer
    assert b"retry-after: 5\r\n" in answer and b"connection: close\r\n" in answer, answer
    assert b"--max-connections" in answer, answer
    assert seconds < head_timeout_s / 2, seconds


def sample_body(sampling_session: str, seq_id: int, max_tokens: int, num_samples: int = 1) -> dict[str, Any]:
    """A raw /asample body that runs to `max_tokens` (stop=[]: not even EOS stops it). Import it from a test
    module: `from conftest import sample_body`."""
    return {
        "sampling_session_id": sampling_session,
        "seq_id": seq_id,
        "num_samples": num_samples,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7, 8]}]},
        "sampling_params": {"max_tokens": max_tokens, "seed": 1, "stop": []},
    }


@pytest.fixture(scope="module")
def redis_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A real `redis-server` on a free loopback port, no persistence, for this module's tests."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail(
            "redis-server is not installed (Debian: apt-get install redis-server); "
            "the Redis stream tests need it"
        )
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    workdir = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(
                    f"redis-server on port {port} did not answer PING within 10 s (exit code {proc.poll()})"
                )
            time.sleep(0.05)
        yield port
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
