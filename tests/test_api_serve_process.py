"""`inflight serve` as a process: bad input is one line on stderr and exit code 2, before any weight is read;
SIGTERM during an in-flight future drains while the server still listens (new work answered 503, polls
answered), finishes what the grace period allows, fails the rest with an error naming the signal, and exits
as uvicorn does on that signal; every request was one JSON line on stdout.

Reference: issue 15 item 5 ("Operations": bad input, graceful shutdown, one structured log line per request).
`tests/test_api_operations.py` holds the same behaviour in-process.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest import sample_body
from inflight.api.db import Database, sqlite_url
from inflight.api.futures import FutureStore

pytestmark = pytest.mark.slow
BASE = "tiny"
STARTUP_TIMEOUT_S = 180.0
RESULT_TIMEOUT_S = 120.0


def serve_command(model_dir: Path | str, state_dir: Path, *extra: str) -> list[str]:
    command = [sys.executable, "-m", "inflight.cli", "serve", "--base-model", f"{BASE}={model_dir}"]
    return [*command, "--state-dir", str(state_dir), *extra]


def child_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


# -- bad input ---------------------------------------------------------------------------------------------


def test_bad_input_is_one_line_naming_the_fix_and_exit_code_2(
    tiny_model_dir: Path, tmp_path: Path, busy_port: int
) -> None:
    missing = tmp_path / "no-model"
    cases = {
        "missing model directory": (
            serve_command(missing, tmp_path / "s1", "--port", "0"),
            ["model directory", str(missing), "does not exist", f"inflight model tiny --out {missing}"],
        ),
        "malformed --db": (
            serve_command(tiny_model_dir, tmp_path / "s2", "--port", "0", "--db", "not a url"),
            ["--db 'not a url' is not a database URL", "sqlite:///PATH"],
        ),
        "unreachable --db": (
            serve_command(
                tiny_model_dir,
                tmp_path / "s3",
                "--port",
                "0",
                "--db",
                "postgresql+psycopg://nope:pw@127.0.0.1:1/x",
            ),
            ["--db", "cannot connect", "start the database, or fix the URL"],
        ),
        "port in use": (
            serve_command(tiny_model_dir, tmp_path / "s4", "--port", str(busy_port)),
            [f"port {busy_port} on 127.0.0.1 is in use", "pass another --port"],
        ),
    }
    # Concurrently: each pays the interpreter's start and torch's import.
    procs = {
        name: subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env()
        )
        for name, (command, _) in cases.items()
    }
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 2, (name, stderr)
        assert stdout == "" and "Traceback" not in stderr, (name, stderr)
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("inflight: error: "), (name, stderr)
        for part in cases[name][1]:
            assert part in lines[0], (name, part, lines[0])
        assert ":pw@" not in lines[0]


def test_a_bad_grace_period_is_refused_by_the_parser(tmp_path: Path) -> None:
    command = serve_command(tmp_path / "no-model", tmp_path / "state", "--shutdown-grace-s", "-1")
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120, env=child_env())
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--shutdown-grace-s: expected a finite number of seconds >= 0, got '-1'" in proc.stderr


@pytest.mark.parametrize(
    ("flag", "value", "said"),
    [
        ("--max-models-per-key", "0", "expected a number >= 1, got 0"),
        ("--max-models-per-key", "many", "expected a whole number, got 'many'"),
        ("--request-body-timeout-s", "0", "expected a finite number of seconds > 0, got '0'"),
        ("--request-body-timeout-s", "inf", "expected a finite number of seconds > 0, got 'inf'"),
        ("--session-expiry-s", "0", "expected a finite number of seconds > 0, got '0'"),
        ("--request-header-timeout-s", "0", "expected a finite number of seconds > 0, got '0'"),
        ("--request-header-timeout-s", "nan", "expected a finite number of seconds > 0, got 'nan'"),
        ("--max-checkpoint-gib-per-key", "0", "expected a finite number of GiB > 0, got '0'"),
        ("--max-checkpoint-gib-per-key", "lots", "expected a number of GiB, got 'lots'"),
    ],
)
def test_the_per_key_limits_are_checked_by_the_parser(
    tmp_path: Path, flag: str, value: str, said: str
) -> None:
    command = serve_command(tmp_path / "no-model", tmp_path / "state", flag, value)
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120, env=child_env())
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"{flag}: {said}" in proc.stderr


def test_the_per_key_limits_reach_the_service(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The limits a QA pass added to ServiceConfig (models, checkpoint GiB and queued requests per API key,
    tokens per training request, the head's, the body's and the answer's deadlines, a silent session's
    expiry) are the operator's to set: without flags they were fixed for every `inflight serve`."""
    import inflight.api.app
    from inflight.cli import main

    seen: dict[str, object] = {}
    monkeypatch.setattr(inflight.api.app, "serve", lambda **kwargs: seen.update(kwargs))
    argv = serve_command(tiny_model_dir, tmp_path / "state", "--port", str(free_port()))[3:]
    limits = ["--max-models-per-key", "3", "--request-body-timeout-s", "7.5", "--session-expiry-s", "30"]
    limits += ["--request-header-timeout-s", "2.5"]
    keys = ("max_models_per_key", "request_body_timeout_s", "session_expiry_s", "request_header_timeout_s")
    assert main([*argv, *limits]) == 0
    assert [seen[key] for key in keys] == [3, 7.5, 30, 2.5]
    assert main(argv) == 0
    assert [seen[key] for key in keys] == [64, 120, 600, 30]
    assert seen["max_checkpoint_gib_per_key"] == 50
    assert main([*argv, "--max-checkpoint-gib-per-key", "0.5"]) == 0
    assert seen["max_checkpoint_gib_per_key"] == 0.5
    queue_keys = ("max_queued_requests_per_key", "max_tokens_per_train_request")
    assert [seen[key] for key in queue_keys] == [10_000, 2**20]
    assert main([*argv, "--max-queued-requests-per-key", "5", "--max-tokens-per-train-request", "4096"]) == 0
    assert [seen[key] for key in queue_keys] == [5, 4096]
    assert seen["send_timeout_s"] == 60
    assert main([*argv, "--send-timeout-s", "9"]) == 0
    assert seen["send_timeout_s"] == 9


def test_help_names_the_operations() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "inflight.cli", "serve", "--help"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    for part in ("--shutdown-grace-s SECONDS", "/metrics", "one JSON line per request", "exit code 2"):
        assert part in text, part


# -- SIGTERM during an in-flight future --------------------------------------------------------------------


def result(http: httpx.Client, request_id: str) -> httpx.Response:
    deadline = time.monotonic() + RESULT_TIMEOUT_S
    while time.monotonic() < deadline:
        response = http.post("/api/v1/retrieve_future", json={"request_id": request_id})
        assert response.status_code == 200, response.text
        if "json" not in response.headers["content-type"] or response.json().get("type") != "try_again":
            return response
    pytest.fail(f"future {request_id} did not finish within {RESULT_TIMEOUT_S} s")


def test_sigterm_finishes_what_the_grace_period_allows_and_fails_the_rest(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    state_dir, port = tmp_path / "state", free_port()
    out, err = tmp_path / "stdout.log", tmp_path / "stderr.log"
    command = serve_command(tiny_model_dir, state_dir, "--port", str(port), "--shutdown-grace-s", "2")
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.Popen(command, stdout=stdout, stderr=stderr, env=child_env())
    try:
        http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            assert proc.poll() is None, f"inflight serve exited with {proc.returncode}:\n{err.read_text()}"
            assert time.monotonic() < deadline, f"inflight serve did not start:\n{err.read_text()}"
            try:
                if http.get("/api/v1/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        store = FutureStore(Database(sqlite_url(state_dir / "service.db")))
        session = http.post("/api/v1/create_session", json={}).json()["session_id"]
        body = {"session_id": session, "sampling_session_seq_id": 0, "base_model": BASE}
        sampling_session = http.post("/api/v1/create_sampling_session", json=body).json()[
            "sampling_session_id"
        ]
        short = http.post("/api/v1/asample", json=sample_body(sampling_session, 1, 30)).json()["request_id"]
        # ~2,000 decode steps of 4 sequences: seconds on any CPU, well past the 2 s grace period.
        long = http.post("/api/v1/asample", json=sample_body(sampling_session, 2, 2000, 4)).json()[
            "request_id"
        ]
        while store.get(long).status == "pending":
            time.sleep(0.05)

        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        while http.get("/api/v1/healthz").status_code == 200:  # the handler runs within uvicorn's 0.1 s tick
            assert time.monotonic() - signalled < 10, "the server never began to drain"
            time.sleep(0.02)
        refused = http.post("/api/v1/asample", json=sample_body(sampling_session, 3, 4))
        assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
        assert "json" not in result(http, short).headers["content-type"]  # done: its protobuf result
        failed = result(http, long).json()
        assert failed["category"] == "server"
        assert failed["error"].startswith("the server shut down (SIGTERM) while this request was running")
        proc.wait(60)
        assert time.monotonic() - signalled < 40
        assert proc.returncode == -signal.SIGTERM, err.read_text()  # uvicorn re-raises the signal it handled
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert store.get(short).status == "done"
    assert store.get(long).status == "failed" and store.unfinished_count() == 0
    assert "shutting down (SIGTERM)" in err.read_text()
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert {"method": "POST", "path": "/api/v1/asample", "status": 503} in [
        {key: line[key] for key in ("method", "path", "status")} for line in lines
    ]
    submitted = [line for line in lines if line["path"] == "/api/v1/asample" and line["status"] == 200]
    assert {line["request_id"] for line in submitted} == {short, long}
