"""Resume after SIGKILL, in both modes: a run killed mid-run and restarted with the same run directory goes
on from its last checkpoint with trainer, optimizer and step intact (and, in the pipeline, the stream offset
and buffered groups, the stream trimmed to that offset at every checkpoint)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from inflight.buffer import TrimmedError, open_stream
from inflight.metrics.logger import read_metrics

pytestmark = pytest.mark.slow


def stream_url(run_dir: Path) -> str:
    # The default place, one record a segment: a trim drops exactly the records before its offset.
    return f"file://{run_dir / 'streams' / 'results'}?segment_bytes=1"


def run_command(model_dir: Path, run_dir: Path, mode: str) -> list[str]:
    return [
        sys.executable, "-m", "inflight.cli", "run", "blackjack",
        f"mode={mode}", "grpo.steps=8", "grpo.prompts_per_step=4", "grpo.group_size=4",
        "warmup.sft_steps=20", "eval.num_episodes=16", "eval.every_steps=0",
        "checkpoint_every_steps=2", "progress=false", f"model.path={model_dir}", "--run-dir", str(run_dir),
        # pipeline.* is the asynchronous pipeline's, refused under mode=sync.
        *(["pipeline.max_staleness_steps=1", f"pipeline.stream_url={stream_url(run_dir)}"]
          if mode == "async" else []),
    ]  # fmt: skip


def checkpoint_step(run_dir: Path) -> int:
    try:
        return int(json.loads((run_dir / "checkpoint" / "trainer_state.json").read_text())["step"])
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        return -1


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_sigkill_and_resume(tmp_path: Path, tiny_model_dir: Path, mode: str) -> None:
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen(
        run_command(tiny_model_dir, run_dir, mode), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    deadline = time.monotonic() + 600
    while checkpoint_step(run_dir) < 4:
        assert first.poll() is None, first.stdout.read().decode()[-3000:] if first.stdout else ""
        assert time.monotonic() < deadline, "no checkpoint at step 4 within 600 s"
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    first.wait(30)
    killed_at = checkpoint_step(run_dir)
    state = json.loads((run_dir / "checkpoint" / "trainer_state.json").read_text())
    before = [r for r in read_metrics(run_dir) if r["phase"] == "train"]

    second = subprocess.run(
        run_command(tiny_model_dir, run_dir, mode), env=env, capture_output=True, text=True, timeout=900
    )
    assert second.returncode == 0, second.stderr[-3000:]
    summary = json.loads(second.stdout.strip().splitlines()[-1])
    after = [r for r in read_metrics(run_dir) if r["phase"] == "train"][len(before) :]

    # The restart trained exactly the steps after the checkpoint, in order.
    assert [r["step"] for r in after] == list(range(killed_at, 8))
    assert summary["steps"] == 8  # the whole run's, the steps before the kill included
    assert after[0]["version"] >= state["version"]
    # The optimizer came back too: Adam's step count runs on from the checkpoint's, not from zero.
    final = json.loads((run_dir / "checkpoint" / "trainer_state.json").read_text())
    assert final["step"] == 8
    optimizer = torch.load(run_dir / "checkpoint" / "optimizer.pt", weights_only=True)
    adam_steps = {int(s["step"]) for s in optimizer["state"].values()}
    assert adam_steps == {final["version"]}
    if mode == "async":
        # Counters (and the groups buffered at the checkpoint) came back with the buffer's state.
        assert after[0]["buffer/consumed"] == (killed_at + 1) * 4
        assert final["pipeline"]["read_offset"] >= state["pipeline"]["read_offset"]
        # The stream keeps nothing a resume from the final checkpoint would not read.
        with open_stream(stream_url(run_dir)) as stream, pytest.raises(TrimmedError):
            stream.read(final["pipeline"]["read_offset"] - 1, 1, 0.0)
