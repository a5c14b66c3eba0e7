"""Ctrl-C or SIGTERM during `inflight run`: the step in flight finishes, then the checkpoint, the final
evaluation and the summary (`stopped` names the signal, exit code 128 + its number); the same command
resumes it. During the initial evaluation, no step is trained. A second signal quits at once."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
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


def trained_steps(run_dir: Path) -> int:
    """The train steps the run has logged so far (0 before its metrics file exists)."""
    with contextlib.suppress(OSError):
        rows = (run_dir / "metrics.jsonl").read_text().splitlines()
        return sum('"phase": "train"' in row for row in rows)
    return 0


def signal_after_steps(run_dir: Path, steps: int, signum: int, run_over: threading.Event) -> threading.Thread:
    """A started thread that sends this process `signum` once the run has logged `steps` train steps, and
    never once `run_over` is set (outside the run, the signal would end the test session)."""

    def send() -> None:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not run_over.is_set():
            if trained_steps(run_dir) >= steps and not run_over.is_set():
                os.kill(os.getpid(), signum)
                return
            time.sleep(0.05)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def argv(model_dir: Path, run_dir: Path, mode: str, steps: int, *overrides: str) -> list[str]:
    return [
        "run", "blackjack", f"model.path={model_dir}", f"mode={mode}", f"grpo.steps={steps}",
        "grpo.prompts_per_step=2", "grpo.group_size=2", "warmup.sft_steps=0", "eval.num_episodes=2",
        "checkpoint_every_steps=0", "progress=false", *overrides, "--run-dir", str(run_dir),
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


def test_sigterm_to_the_whole_process_group_stops_the_run_as_it_does_sent_to_the_run_alone(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """What `timeout`, Slurm's scancel and `kill -- -PGID` send: every process of the run's group gets the
    signal, the pipeline's trainer process too, which must live on for the stop's checkpoint (a call to it)
    and then end with the run. A real `inflight run`, in a process group of its own."""
    run_dir, out, err = tmp_path / "run", tmp_path / "stdout", tmp_path / "stderr"
    command = argv(tiny_model_dir, run_dir, "async", STEPS, "pipeline.trainer_process=true")
    with out.open("wb") as stdout, err.open("wb") as stderr:
        run = subprocess.Popen(
            [sys.executable, "-m", "inflight.cli", *command],
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,  # its pid is its group's id
        )
    try:
        deadline = time.monotonic() + 240
        while trained_steps(run_dir) < 1:
            assert run.poll() is None and time.monotonic() < deadline, err.read_text()
            time.sleep(0.05)
        os.killpg(run.pid, signal.SIGTERM)
        assert run.wait(timeout=120) == 128 + signal.SIGTERM, err.read_text()
        # Nothing of the run outlives it (the trainer process, multiprocessing's resource tracker).
        deadline = time.monotonic() + 10
        while _group_alive(run.pid):
            assert time.monotonic() < deadline, "a process of the run outlived it"
            time.sleep(0.1)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.pid, signal.SIGKILL)
        run.wait()
    assert "inflight: SIGTERM: stopping after the step in flight" in err.read_text()
    assert "Traceback" not in err.read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary == json.loads(out.read_text().strip().splitlines()[-1])
    assert summary["stopped"] == "SIGTERM" and 1 <= summary["steps"] < STEPS
    assert checkpoint_step(run_dir / "checkpoint") == summary["steps"]
    assert summary["return_final"] is not None


# A stop sent to its own process group while a TrainerProcess starts (spawning an interpreter and importing
# torch takes seconds), then a step; the child is left for the exit to end.
TRAINER_PROCESS_SIGNALLED_AT_START = """
import os
import signal
import sys
import threading

from inflight.models import load_model
from inflight.orchestrator.stopping import StopRequest, stop_on_signals
from inflight.trainer import TrainerConfig
from inflight.trainer.process import TrainerProcess
from test_trainer import make_grouped_samples

if __name__ == "__main__":
    model = load_model(sys.argv[1])
    with stop_on_signals(StopRequest()) as stop:
        threading.Timer(0.2, os.killpg, (0, signal.SIGTERM)).start()
        child = TrainerProcess(model, TrainerConfig(lr=1e-3), threads=1)
        assert stop.reason == "SIGTERM"
        child.train_step(make_grouped_samples(2, 2, 2048))
        print("trained to version", child.version)
"""


def test_a_trainer_process_survives_a_group_signal_during_its_start_and_ends_at_exit_unclosed(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    script = tmp_path / "signalled_at_start.py"
    script.write_text(TRAINER_PROCESS_SIGNALLED_AT_START)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}  # test_trainer's samples
    run = subprocess.Popen(
        [sys.executable, str(script), str(tiny_model_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = run.communicate(timeout=120)  # never closed, the child must not hold the exit up
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.pid, signal.SIGKILL)
        run.wait()
    assert run.returncode == 0, err
    assert out.strip() == "trained to version 1"
    assert "inflight: SIGTERM: stopping after the step in flight" in err


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


# Sends this process SIGTERM from its first test rollout (once: it removes the marker file): a signal during
# the initial evaluation. Warmed up first, so that the run has a warm-up to keep.
TASK_SIGNALLED_IN_EVALUATION = """
import os
import signal
from pathlib import Path

MARKER = Path({marker!r})


def load_problems(split):
    return [{{"i": i, "split": split}} for i in range(8)]


async def generate_rollout(ctx, problem):
    if problem["split"] == "test" and MARKER.exists():
        MARKER.unlink()
        os.kill(os.getpid(), signal.SIGTERM)
    chat = ctx.chat()
    chat.user(f"Say something {{problem['i']}}")
    reply = await chat.assistant()
    return chat.to_rollout(float(len(reply) % 3) / 2, {{}})


def warmup_reply(transcript, rng):
    return rng.choice(["yes", "no", "maybe"])
"""


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_signal_during_the_initial_evaluation_trains_no_step(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], mode: str
) -> None:
    marker, task, run_dir = tmp_path / "send-sigterm", tmp_path / "signalled.py", tmp_path / "run"
    marker.touch()
    task.write_text(TASK_SIGNALLED_IN_EVALUATION.format(marker=str(marker)))
    command = [
        "run", str(task), f"model.path={tiny_model_dir}", f"mode={mode}", "grpo.steps=2",
        "grpo.prompts_per_step=2", "grpo.group_size=2", "warmup.sft_steps=2", "warmup.sft_batch_size=2",
        "eval.num_episodes=4", "progress=false", "--run-dir", str(run_dir),
    ]  # fmt: skip
    assert main(command) == 128 + signal.SIGTERM
    out, err = capsys.readouterr()
    assert not marker.exists()  # the signal was sent, during the evaluation
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["stopped"] == "SIGTERM" and summary["steps"] == 0
    assert summary["return_initial"] is not None and summary["return_final"] is None
    assert f"stopped before training step 0, none trained; the initial evaluation is kept in {run_dir}" in err
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in rows] == ["warmup", "warmup", "eval", "summary"]
    assert checkpoint_step(run_dir / "checkpoint") == 0 and not (run_dir / "checkpoint").exists()

    # The same command trains: the warm-up loaded and the initial evaluation taken from metrics.jsonl, each
    # done and logged once over the two commands.
    assert main(command) == 0
    resumed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert resumed["steps"] == 2 and resumed["stopped"] is None
    assert resumed["return_initial"] == summary["return_initial"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    phases = [(r["phase"], r["step"]) for r in rows if r["phase"] != "summary"]
    assert phases == [("warmup", 0), ("warmup", 1), ("eval", 0), ("train", 0), ("train", 1), ("eval", 2)]
