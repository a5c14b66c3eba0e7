"""Checkpoints survive a kill at any instant of their write, and a resumed run counts all its steps.

Reference: the hardening issue, part 5. A kill is simulated two ways: by raising at each filesystem
operation of a save (every window, found by recording the operations), and by building each window's
on-disk state by hand (readable, one test per window). The expectation is always the same: the restart
loads the newest checkpoint that was complete when the kill came, and the next save loses nothing.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import inflight.trainer.policy as policy_files
from inflight.cli import main
from inflight.errors import UserError
from inflight.models import load_model
from inflight.trainer import Trainer, TrainerConfig
from inflight.trainer.checkpoint import (
    META,
    WEIGHTS,
    checkpoint_step,
    find_checkpoint,
    resume_checkpoint,
    save_checkpoint,
)


class Killed(BaseException):
    """The process dying: a BaseException, so no `except Exception` on the way can swallow it."""


class KillSwitch:
    """Called before each disk operation; kills the save just before operation number `at` (from 0)."""

    def __init__(self, at: int) -> None:
        self.at, self.calls = at, 0

    def __call__(self, name: str) -> None:
        if self.calls == self.at:
            raise Killed(name)
        self.calls += 1


def trainer_at(model_dir: Path, step: int) -> Trainer:
    """A trainer whose weights and version say which step it checkpoints."""
    trainer = Trainer(load_model(model_dir), TrainerConfig(lr=1e-3))
    with torch.no_grad():
        next(trainer.model.parameters()).fill_(float(step))
    trainer.version = step
    return trainer


def restored_step(model_dir: Path, path: Path) -> int:
    """What a restart resumes from: its step, after checking the weights are that step's."""
    trainer = trainer_at(model_dir, -1)
    meta = resume_checkpoint(trainer, path)
    step = int(meta["step"])
    assert trainer.version == step
    assert torch.all(next(trainer.model.parameters()) == float(step))
    return step


def save(model_dir: Path, path: Path, step: int) -> None:
    save_checkpoint(trainer_at(model_dir, step), path, extra={"step": step})


# The calls through which a save touches the disk; the kill comes just before one of them.
OPERATIONS: list[tuple[Any, str]] = [
    (policy_files, "save_file"),  # the policy writes its weights; checkpoint.py orders the writes
    (torch, "save"),
    (os, "fsync"),
    (os, "replace"),
    (shutil, "rmtree"),
]


def kill_before(operation: str) -> Callable[[str], None]:
    def on_call(name: str) -> None:
        if name == operation:
            raise Killed(name)

    return on_call


def instrument(monkeypatch: pytest.MonkeyPatch, on_call: Callable[[str], None]) -> None:
    for owner, name in OPERATIONS:
        real = getattr(owner, name)

        def wrapped(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            on_call(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapped)


def test_a_kill_before_any_operation_of_a_save_resumes_from_the_newest_complete_checkpoint(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Record the operations of one save over an existing checkpoint, and from which one on the new
    # checkpoint's metadata (the proof it is complete) is on disk.
    record = tmp_path / "record" / "checkpoint"
    save(tiny_model_dir, record, 1)
    names: list[str] = []
    written_at: list[int] = []

    def note(name: str) -> None:
        if not written_at and (record.with_name("checkpoint.tmp") / META).is_file():
            written_at.append(len(names))
        names.append(name)

    with monkeypatch.context() as m:
        instrument(m, note)
        save(tiny_model_dir, record, 2)
    assert names.count("replace") == 2 and written_at, names

    for kill_at in range(len(names)):
        path = tmp_path / f"kill-{kill_at}" / "checkpoint"
        save(tiny_model_dir, path, 1)
        with monkeypatch.context() as m, pytest.raises(Killed):
            instrument(m, KillSwitch(kill_at))
            save(tiny_model_dir, path, 2)

        window = f"killed before operation {kill_at} ({names[kill_at]}) of {names}"
        expected = 2 if kill_at >= written_at[0] else 1
        assert restored_step(tiny_model_dir, path) == expected, window
        assert checkpoint_step(path) == expected, window
        # The restart's next save keeps it until the newer one is whole (a second kill, while that one's
        # weights are written, still finds it), and leaves one directory.
        with monkeypatch.context() as m, pytest.raises(Killed):
            instrument(m, kill_before("save_file"))
            save(tiny_model_dir, path, 3)
        assert restored_step(tiny_model_dir, path) == expected, window
        save(tiny_model_dir, path, 3)
        assert restored_step(tiny_model_dir, path) == 3, window
        assert sorted(p.name for p in path.parent.iterdir()) == ["checkpoint"], window


def two_checkpoints(model_dir: Path, tmp_path: Path) -> Path:
    """Step 1 at `checkpoint`, step 2 complete at `checkpoint.tmp`: a save killed just before its renames."""
    path = tmp_path / "checkpoint"
    save(model_dir, path, 1)
    save(model_dir, tmp_path / "newer", 2)
    os.replace(tmp_path / "newer", tmp_path / "checkpoint.tmp")
    return path


def test_window_writing_the_new_files(tiny_model_dir: Path, tmp_path: Path) -> None:
    path = two_checkpoints(tiny_model_dir, tmp_path)
    (tmp_path / "checkpoint.tmp" / META).unlink()  # the metadata, written last, is not there yet
    assert find_checkpoint(path) == path and restored_step(tiny_model_dir, path) == 1


def test_window_writing_the_metadata(tiny_model_dir: Path, tmp_path: Path) -> None:
    path = two_checkpoints(tiny_model_dir, tmp_path)
    meta = tmp_path / "checkpoint.tmp" / META
    meta.write_text(meta.read_text()[:-20])  # cut off mid-write
    assert restored_step(tiny_model_dir, path) == 1


def test_window_a_file_cut_short_under_complete_looking_metadata(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    path = two_checkpoints(tiny_model_dir, tmp_path)
    weights = tmp_path / "checkpoint.tmp" / WEIGHTS
    weights.write_bytes(weights.read_bytes()[:1000])  # the recorded size catches it
    assert restored_step(tiny_model_dir, path) == 1


def test_window_before_the_renames(tiny_model_dir: Path, tmp_path: Path) -> None:
    path = two_checkpoints(tiny_model_dir, tmp_path)
    assert find_checkpoint(path) == tmp_path / "checkpoint.tmp"
    assert restored_step(tiny_model_dir, path) == 2


def test_window_between_the_renames(tiny_model_dir: Path, tmp_path: Path) -> None:
    path = two_checkpoints(tiny_model_dir, tmp_path)
    os.replace(path, tmp_path / "checkpoint.old")  # the first rename done, the second not
    assert not path.exists()
    assert restored_step(tiny_model_dir, path) == 2
    save(tiny_model_dir, path, 3)  # the next save first puts step 2 back in place, then replaces it
    assert restored_step(tiny_model_dir, path) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"]


def test_window_deleting_the_old_checkpoint(tiny_model_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "checkpoint"
    save(tiny_model_dir, tmp_path / "older", 1)
    save(tiny_model_dir, path, 2)
    os.replace(tmp_path / "older", tmp_path / "checkpoint.old")
    (tmp_path / "checkpoint.old" / WEIGHTS).unlink()  # half deleted
    assert restored_step(tiny_model_dir, path) == 2


def test_a_damaged_checkpoint_is_a_user_error_not_a_silent_restart(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    path = tmp_path / "checkpoint"
    save(tiny_model_dir, path, 1)
    (path / WEIGHTS).write_bytes(b"\0" * 8)  # no save leaves this: something else did
    with pytest.raises(UserError, match="incomplete or corrupt"):
        find_checkpoint(path)
    assert find_checkpoint(tmp_path / "none") is None and checkpoint_step(tmp_path / "none") == 0


def run_blackjack(model_dir: Path, run_dir: Path, steps: int, mode: str) -> dict[str, Any]:
    argv = ["run", "blackjack", f"model.path={model_dir}", f"mode={mode}", f"grpo.steps={steps}"]
    argv += ["grpo.prompts_per_step=2", "grpo.group_size=2", "warmup.sft_steps=0", "eval.num_episodes=2"]
    argv += ["progress=false", "--run-dir", str(run_dir)]
    assert main(argv) == 0
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_resumed_run_counts_all_its_steps(tiny_model_dir: Path, tmp_path: Path, mode: str) -> None:
    run_dir = tmp_path / "run"
    assert run_blackjack(tiny_model_dir, run_dir, 2, mode)["steps"] == 2
    # Killed between the renames of its last save: no checkpoint/ directory, the complete one in .tmp.
    os.replace(run_dir / "checkpoint", run_dir / "checkpoint.tmp")

    summary = run_blackjack(tiny_model_dir, run_dir, 4, mode)
    assert summary["steps"] == 4
    trained = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in trained if r["phase"] == "train"] == [0, 1, 2, 3]  # 2 and 3 only once
    assert checkpoint_step(run_dir / "checkpoint") == 4
