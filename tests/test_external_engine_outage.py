"""A run whose external engine (`inflight serve-engine`, a real subprocess) is killed mid-run:

- once every replica stayed down past the client's outage bound the run stops in one line that names the
  engine and how to resume, with a checkpoint at the last step (whether a rollout or the step's weight
  update met the dead engine), and the same command resumes once the engine is back;
- a stop request (SIGTERM) ends the trainer's wait for a batch that cannot come;
- the batch wait's own timeout is one line with the configured seconds;
- under them, the client: calls in flight on a replica that is killed fail within the outage bound
  (ReplicasDownError naming it), none hangs.

Reference: the QA pass's repro, where a run against `serve-engine` whose server was killed at step ~10 went
quiet for 600 s, ignored SIGTERM and ended in a traceback quoting a 1-second slice of its wait.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from inflight.buffer.buffer import RolloutBuffer
from inflight.cli import main
from inflight.inference.client import BalancedClient, ClientConfig, ReplicasDownError
from inflight.trainer.checkpoint import checkpoint_step
from inflight.types import SampleRequest, SamplingParams

pytestmark = pytest.mark.slow  # each starts a `serve-engine` and kills it; most run `inflight run` too

OUTAGE_S = 3.0  # the client's outage bound in these tests (120 s by default)


class Engine:
    """`inflight serve-engine` on a loopback port, as a user starts it; `kill()` is SIGKILL."""

    def __init__(self, model_dir: Path, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "inflight.cli", "serve-engine", "--model", str(model_dir)]
        self.proc = subprocess.Popen(
            [*cmd, "--port", str(port)],
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None:
                assert self.proc.stderr is not None
                pytest.fail(f"serve-engine exited: {self.proc.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "serve-engine did not answer /health within 300 s"
            time.sleep(0.2)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(30)


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    """Engines a test starts (`engines.append(Engine(...))`), killed at its end if still running."""
    started: list[Engine] = []
    yield started
    for engine in started:
        if engine.proc.poll() is None:
            engine.kill()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def short_outage(monkeypatch: pytest.MonkeyPatch) -> None:
    """The run's engine client gives up on replicas that stay down for OUTAGE_S (not 120 s)."""
    config = ClientConfig(outage_wait_s=OUTAGE_S, health_interval_s=0.2)
    monkeypatch.setattr(
        "inflight.orchestrator.remote_engine.BalancedClient", functools.partial(BalancedClient, config=config)
    )


def kill_during_training(
    monkeypatch: pytest.MonkeyPatch,
    engine: Engine,
    at_version: int,
    *,
    after_draw: bool = False,
    then: Callable[[], None] | None = None,
) -> threading.Event:
    """Kill `engine` in the trainer's thread when it asks the buffer for the batch of `at_version`: before it
    waits (no batch can come: on-policy, the groups of that version start only now), or `after_draw` (the
    step then trains, and its weight update meets the dead engine). `then()` runs right after the kill."""
    real = RolloutBuffer.get_batch
    killed = threading.Event()

    def get_batch(buffer: RolloutBuffer, trainer_version: int, timeout_s: float) -> Any:
        due = trainer_version >= at_version and not killed.is_set()
        if due and not after_draw:
            engine.kill()
            killed.set()
            if then is not None:
                then()
        batch = real(buffer, trainer_version, timeout_s)
        if due and after_draw:
            engine.kill()
            killed.set()
        return batch

    monkeypatch.setattr(RolloutBuffer, "get_batch", get_batch)
    return killed


def argv(model_dir: Path, run_dir: Path, url: str, steps: int, *overrides: str) -> list[str]:
    return [
        "run", "blackjack", f"model.path={model_dir}", f"grpo.steps={steps}", "grpo.prompts_per_step=2",
        "grpo.group_size=4", "warmup.sft_steps=0", "eval.num_episodes=0", "checkpoint_every_steps=0",
        "progress=false", f'pipeline.engine_urls=["{url}"]', "pipeline.max_staleness_steps=0",
        "pipeline.batch_timeout_s=60", *overrides, "--run-dir", str(run_dir),
    ]  # fmt: skip


def error_line(capsys: pytest.CaptureFixture[str], command: list[str]) -> str:
    """Run the CLI; assert exit 2, no traceback and one `inflight: error:` line (after the model loading's
    progress bars: these runs fail once trained); return that line."""
    capsys.readouterr()
    code = main(command)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("inflight: error: ")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


def train_steps(run_dir: Path) -> list[int]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if r["phase"] == "train"]


@pytest.mark.parametrize("after_draw", [False, True], ids=["met-by-rollouts", "met-by-the-weight-update"])
def test_a_run_whose_engines_are_gone_stops_in_one_line_with_a_checkpoint_it_resumes_from(
    tiny_model_dir: Path,
    warm_tiny_model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    engines: list[Engine],
    short_outage: None,
    after_draw: bool,
) -> None:
    port = free_port()
    engines.append(engine := Engine(tiny_model_dir, port))
    run_dir = tmp_path / "run"
    killed = kill_during_training(monkeypatch, engine, at_version=2, after_draw=after_draw)
    started = time.monotonic()
    line = error_line(capsys, argv(warm_tiny_model_dir, run_dir, engine.url, 50))
    assert killed.is_set()
    # The outage bound, the health checks and a step; never the 60 s batch timeout.
    assert time.monotonic() - started < 55
    done = 3 if after_draw else 2  # the step whose update failed was trained: it counts, and is saved
    assert f"every engine replica stayed down for {OUTAGE_S:g} s" in line and engine.url in line, line
    assert f"stopped after step {done} and saved its checkpoint" in line, line
    assert f"run the same command with run_dir={run_dir} to resume" in line, line
    assert checkpoint_step(run_dir / "checkpoint") == done
    assert train_steps(run_dir) == list(range(done))
    if not after_draw:
        return
    # Back on the same port, the replica first gets the checkpoint's weights (the step its update missed).
    engines.append(Engine(tiny_model_dir, port))
    assert main(argv(warm_tiny_model_dir, run_dir, engine.url, done + 2)) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == done + 2 and summary["stopped"] is None
    assert train_steps(run_dir) == list(range(done + 2))


def test_sigterm_ends_the_wait_for_a_batch_that_cannot_come(
    tiny_model_dir: Path,
    warm_tiny_model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    engines: list[Engine],
) -> None:
    """The engine is gone and the client would wait 120 s for it: the stop does not wait for that."""
    engines.append(engine := Engine(tiny_model_dir, free_port()))
    run_dir = tmp_path / "run"
    signalled: list[float] = []

    def sigterm() -> None:
        signalled.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGTERM)

    kill_during_training(monkeypatch, engine, at_version=2, then=sigterm)
    assert main(argv(warm_tiny_model_dir, run_dir, engine.url, 50)) == 128 + signal.SIGTERM
    assert time.monotonic() - signalled[0] < 20  # the trainer looks every second; then checkpoint, summary
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["stopped"] == "SIGTERM" and summary["steps"] == 2
    assert checkpoint_step(run_dir / "checkpoint") == 2


def test_the_batch_timeout_is_one_line_with_its_seconds(
    tiny_model_dir: Path,
    warm_tiny_model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    engines: list[Engine],
) -> None:
    engines.append(engine := Engine(tiny_model_dir, free_port()))
    kill_during_training(monkeypatch, engine, at_version=2)
    command = argv(warm_tiny_model_dir, tmp_path / "run", engine.url, 50, "pipeline.batch_timeout_s=4")
    line = error_line(capsys, command)
    assert "no full batch within pipeline.batch_timeout_s=4 s: the trainer waited for 2 informative" in line
    assert "0 buffered, 2 in flight" in line and "waited 0." not in line and "waited 1." not in line, line


def test_calls_in_flight_on_a_killed_replica_fail_within_the_outage_bound(
    tiny_model_dir: Path, engines: list[Engine]
) -> None:
    engines.append(engine := Engine(tiny_model_dir, free_port()))
    params = SamplingParams(max_tokens=1000)  # long: still generating when the server dies

    async def play() -> tuple[list[BaseException | Any], float]:
        config = ClientConfig(outage_wait_s=OUTAGE_S, health_interval_s=0.2)
        async with BalancedClient([engine.url], config) as client:
            calls = [
                asyncio.ensure_future(client.generate(SampleRequest([5, 6, 7], params))) for _ in range(4)
            ]
            await asyncio.sleep(0.5)
            engine.kill()
            killed = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 60)
            return results, time.monotonic() - killed

    results, waited_s = asyncio.run(play())
    assert all(isinstance(r, ReplicasDownError) for r in results), results
    assert OUTAGE_S <= waited_s < OUTAGE_S + 10
    error = results[0]
    assert isinstance(error, ReplicasDownError) and list(error.down) == [engine.url]
    assert error.waited_s == OUTAGE_S and f"stayed down for outage_wait_s={OUTAGE_S:g} s" in str(error)
