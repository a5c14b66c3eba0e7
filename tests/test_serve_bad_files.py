"""Damaged files given to `inflight serve` / `inflight run`, and the line that says where a server listens.

A database file that is not SQLite (given with --db, or the one in --state-dir) and a model whose
model.safetensors is truncated are each one line on stderr naming the file and the fix, exit code 2, before
any weight is read. `inflight serve --port 0` logs the port it got, once it serves, as one line.

Reference: the QA pass on `inflight serve` (hardening defects 1, 2 and 3).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from conftest import one_line_error
from inflight.errors import UserError


def serve(model_dir: Path, state_dir: Path, *extra: str) -> list[str]:
    return [
        "serve",
        "--base-model",
        f"tiny={model_dir}",
        "--port",
        "0",
        "--state-dir",
        str(state_dir),
        *extra,
    ]


def run(model_dir: Path, run_dir: Path) -> list[str]:
    small = ["grpo.steps=1", "grpo.prompts_per_step=2", "grpo.group_size=2", "warmup.sft_steps=0"]
    return ["run", "blackjack", f"model.path={model_dir}", *small, "--run-dir", str(run_dir)]


# -- a file that is not a SQLite database -------------------------------------------------------------------


def test_serve_db_file_that_is_not_a_database(
    capsys, tiny_model_dir: Path, tmp_path: Path, no_weights
) -> None:
    garbage = tmp_path / "x" / "garbage.db"
    garbage.parent.mkdir()
    garbage.write_text("garbage")
    line = one_line_error(capsys, *serve(tiny_model_dir, tmp_path / "state", "--db", f"sqlite:///{garbage}"))
    assert f"--db 'sqlite:///{garbage}'" in line
    assert f"{garbage} is not a SQLite database, or is damaged (file is not a database)" in line
    assert "move it away" in line and "name another database file" in line
    assert garbage.read_text() == "garbage"  # left as it was


def test_serve_corrupt_database_in_the_state_dir(
    capsys, tiny_model_dir: Path, tmp_path: Path, no_weights
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / "service.db").write_bytes(os.urandom(4096))
    line = one_line_error(capsys, *serve(tiny_model_dir, state))
    assert (
        "the database in --state-dir" in line and f"{state / 'service.db'} is not a SQLite database" in line
    )
    assert "move it away" in line


def test_serve_an_empty_or_valid_database_file_is_accepted(tmp_path: Path) -> None:
    from inflight.api.db import Database, sqlite_url
    from inflight.preflight import check_database

    empty = tmp_path / "empty.db"
    empty.touch()  # SQLite's empty database
    check_database(sqlite_url(empty))
    Database(sqlite_url(tmp_path / "service.db")).close()
    check_database(sqlite_url(tmp_path / "service.db"))


# -- a truncated model.safetensors --------------------------------------------------------------------------


@pytest.fixture(params=["header", "body", "text"])
def damaged_model_dir(request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path: Path) -> Path:
    """The tiny model with model.safetensors cut inside its header, cut inside its tensors, or replaced."""
    model = tmp_path / "damaged-model"
    shutil.copytree(tiny_model_dir, model)
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    damaged = {"header": data[:5], "body": data[: len(data) // 2], "text": b"garbage"}[request.param]
    weights.write_bytes(damaged)
    return model


def test_serve_truncated_weights(capsys, damaged_model_dir: Path, tmp_path: Path, no_weights) -> None:
    line = one_line_error(capsys, *serve(damaged_model_dir, tmp_path / "state"))
    weights = damaged_model_dir / "model.safetensors"
    assert f"model weights {str(weights)!r} are incomplete or corrupt" in line
    assert f"inflight model tiny --out {damaged_model_dir}" in line


def test_run_truncated_weights(capsys, damaged_model_dir: Path, tmp_path: Path, no_weights) -> None:
    line = one_line_error(capsys, *run(damaged_model_dir, tmp_path / "run"))
    assert f"model weights {str(damaged_model_dir / 'model.safetensors')!r} are incomplete or corrupt" in line


def test_the_loader_names_the_damaged_file_too(damaged_model_dir: Path) -> None:
    """What the commands' preflight does not see (a file damaged after it looked) still fails in one line."""
    from inflight.models import load_model

    with pytest.raises(UserError, match="are incomplete or corrupt") as refused:
        load_model(damaged_model_dir)
    assert str(damaged_model_dir / "model.safetensors") in str(refused.value)


# -- the line that says where the server listens ------------------------------------------------------------

LISTENING = re.compile(r"listening on (http://127\.0\.0\.1:(\d+))")


@pytest.mark.slow
def test_serve_port_0_logs_the_port_it_got(tiny_model_dir: Path, tmp_path: Path) -> None:
    command = [sys.executable, "-m", "inflight.cli", *serve(tiny_model_dir, tmp_path / "state")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    found = threading.Event()

    def read_stderr() -> None:  # a reader thread: readline alone cannot time out
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if LISTENING.search(line):
                found.set()

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 180
        while not found.wait(0.2):
            assert proc.poll() is None, f"inflight serve exited with {proc.returncode}:\n{''.join(lines)}"
            assert time.monotonic() < deadline, f"no 'listening on' line:\n{''.join(lines)}"
        announced = [m for line in lines if (m := LISTENING.search(line))]
        assert len(announced) == 1, lines
        url, port = announced[0].group(1), int(announced[0].group(2))
        assert port != 0
        # Logged once the app has started: the first request is answered at once.
        assert httpx.get(f"{url}/api/v1/healthz", timeout=10).status_code == 200
        assert any(
            "Application startup complete" in line for line in lines[: lines.index(announced[0].string)]
        )
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        reader.join(10)
    assert sum(bool(LISTENING.search(line)) for line in lines) == 1
