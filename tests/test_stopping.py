"""Ctrl-C or SIGTERM during `inflight run`: the step in flight finishes, then the checkpoint, the final
evaluation and the summary (`stopped` names the signal, exit code 128 + its number); the same command
resumes it. A second signal quits at once."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from inflight.cli import main
from inflight.orchestrator.stopping import StopRequest, stop_on_signals
from inflight.trainer.checkpoint import checkpoint_step

STEPS = 200  # far more than the test lets run: it stops the run after a few


def test_the_first_signal_asks_the_second_quits_and_the_handlers_come_back() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with stop_on_signals(StopRequest()) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.wait(5) and stop.reason == "SIGTERM"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler runs at the next bytecode of this (main) thread
        assert stop.reason == "SIGTERM"  # the first one's name stays
    assert signal.getsignal(signal.SIGTERM) is before


def test_off_the_main_thread_nothing_is_installed() -> None:
    seen: list[object] = []

    def other() -> None:
        with stop_on_signals(StopRequest()) as stop:
            seen.append(stop)

    before = signal.getsignal(signal.SIGINT)
    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert len(seen) == 1 and signal.getsignal(signal.SIGINT) is before


def signal_after_steps(run_dir: Path, steps: int, signum: int, run_over: threading.Event) -> threading.Thread:
    """A started thread that sends this process `signum` once the run has logged `steps` train steps, and
    never once `run_over` is set (outside the run, the signal would end the test session)."""

    def send() -> None:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not run_over.is_set():
            with contextlib.suppress(OSError):
                rows = (run_dir / "metrics.jsonl").read_text().splitlines()
                if sum('"phase": "train"' in row for row in rows) >= steps and not run_over.is_set():
                    os.kill(os.getpid(), signum)
                    return
            time.sleep(0.05)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def argv(model_dir: Path, run_dir: Path, mode: str, steps: int) -> list[str]:
    return [
        "run", "blackjack", f"model.path={model_dir}", f"mode={mode}", f"grpo.steps={steps}",
        "grpo.prompts_per_step=2", "grpo.group_size=2", "warmup.sft_steps=0", "eval.num_episodes=2",
        "checkpoint_every_steps=0", "progress=false", "--run-dir", str(run_dir),
    ]  # fmt: skip


@pytest.mark.parametrize(("mode", "signum"), [("sync", signal.SIGTERM), ("async", signal.SIGINT)])
def test_a_signal_stops_the_run_after_its_step_with_a_checkpoint_it_resumes_from(
    tiny_model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    mode: str,
    signum: signal.Signals,
) -> None:
    run_dir = tmp_path / "run"
    run_over = threading.Event()
    sender = signal_after_steps(run_dir, 3, signum, run_over)
    try:
        assert main(argv(tiny_model_dir, run_dir, mode, STEPS)) == 128 + signum
    finally:
        run_over.set()
    sender.join(5)
    out, err = capsys.readouterr()
    assert f"inflight: {signum.name}: stopping after the step in flight" in err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary == json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped"] == signum.name
    stopped_at = summary["steps"]
    assert 3 <= stopped_at < STEPS
    # No periodic checkpoints (checkpoint_every_steps=0): this one is the stop's, at the last step logged.
    assert checkpoint_step(run_dir / "checkpoint") == stopped_at
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["phase"] == "train"] == list(range(stopped_at))
    assert summary["return_final"] is not None  # evaluated, as a finished run is

    # The same command, two steps more: it continues from the stop's step and finishes normally.
    assert main(argv(tiny_model_dir, run_dir, mode, stopped_at + 2)) == 0
    resumed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert resumed["steps"] == stopped_at + 2 and resumed["stopped"] is None
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["phase"] == "train"] == list(range(stopped_at + 2))
