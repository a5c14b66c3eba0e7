"""A run's life across processes (`orchestrator/run.py`): a resume neither warms up nor evaluates the initial
policy again and says where it starts; its summary covers the whole run; a finished run run again has
nothing to do; another task's run directory, a checkpoint past grpo.steps or one of another model is
refused in one line, the run directory left byte for byte as it was; a signal stops the warm-up after its
step in flight, and the same command continues it, each warm-up step trained and logged once."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from inflight.cli import main
from inflight.config import apply_overrides
from inflight.errors import UserError
from inflight.metrics.logger import MetricsLogger
from inflight.models.tiny import PRESETS, model_config
from inflight.orchestrator.setup import load_policy, pad_id
from inflight.orchestrator.stopping import StopRequest
from inflight.orchestrator.target import resolve_target
from inflight.orchestrator.warmup import WARMUP_DIR, format_warmup, warmup_steps_done
from inflight.rollouts.chat import ChatFormat
from inflight.trainer import Trainer, TrainerConfig
from inflight.trainer.checkpoint import checkpoint_step

pytestmark = pytest.mark.slow

TASK = """
def load_problems(split):
    return [{"i": i} for i in range(40)]

async def generate_rollout(ctx, problem):
    chat = ctx.chat()
    chat.user(f"Say something {problem['i']}")
    reply = await chat.assistant()
    return chat.to_rollout(float(len(reply) % 3) / 2, {"len": float(len(reply))})

def warmup_reply(transcript, rng):
    return rng.choice(["yes", "no", "maybe"])
"""


def write_task(directory: Path, name: str) -> Path:
    path = directory / f"{name}.py"
    path.write_text(TASK)
    return path


def argv(task: Path, model_dir: Path, run_dir: Path, steps: int, *more: str) -> list[str]:
    return [
        "run", str(task), f"model.path={model_dir}", "mode=sync", f"grpo.steps={steps}",
        "grpo.prompts_per_step=2", "grpo.group_size=4", "eval.num_episodes=4", "eval.num_episodes_during=4",
        "warmup.sft_steps=2", "warmup.sft_batch_size=4", "progress=false", *more, "--run-dir", str(run_dir),
    ]  # fmt: skip


def rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def last_json(out: str) -> dict[str, Any]:
    return json.loads(out.strip().splitlines()[-1])


def test_a_resume_continues_the_run_once_and_summarizes_all_of_it(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    task, run_dir = write_task(tmp_path, "varied"), tmp_path / "run"
    assert main(argv(task, tiny_model_dir, run_dir, 3)) == 0
    first = last_json(capsys.readouterr().out)
    assert (run_dir / WARMUP_DIR).is_dir() and warmup_steps_done(run_dir / WARMUP_DIR) == (2, 2)

    assert main(argv(task, tiny_model_dir, run_dir, 6)) == 0
    out, err = capsys.readouterr()
    assert f"inflight: resuming from the checkpoint at step 3 ({run_dir / 'checkpoint'})" in err
    summary = last_json(out)
    logged = rows(run_dir)
    # The warm-up and the initial evaluation once; the training steps once each, in order.
    assert [r["step"] for r in logged if r["phase"] == "warmup"] == [0, 1]
    assert [r["step"] for r in logged if r["phase"] == "eval"] == [0, 3, 6]
    train = [r for r in logged if r["phase"] == "train"]
    assert [r["step"] for r in train] == list(range(6))
    # The whole run's summary: its first step's reward, its initial evaluation, the seconds of both parts.
    assert summary["steps"] == 6
    assert summary["return_first10"] == round(train[0]["reward_mean"], 4) == first["return_first10"]
    assert summary["return_last10"] == round(train[-1]["reward_mean"], 4)
    assert summary["return_initial"] == first["return_initial"]
    assert summary["wall_s_total"] == pytest.approx(first["wall_s"] + summary["wall_s"], abs=0.11)

    # The same command again: nothing to do, the summary it wrote, nothing logged.
    before = (run_dir / "metrics.jsonl").read_text()
    assert main(argv(task, tiny_model_dir, run_dir, 6)) == 0
    out, err = capsys.readouterr()
    assert "already trained to grpo.steps=6" in err and "nothing to do" in err
    assert last_json(out) == summary and (run_dir / "metrics.jsonl").read_text() == before

    # Fewer steps than the checkpoint's: one line, exit 2, the run directory untouched.
    config = (run_dir / "config.json").read_text()
    assert main(argv(task, tiny_model_dir, run_dir, 2)) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "at step 6, past grpo.steps=2" in err and "--run-dir" in err

    # Another task in this run directory: refused, naming both.
    assert main(argv(write_task(tmp_path, "single"), tiny_model_dir, run_dir, 8)) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "'varied', not 'single'" in err and "--run-dir" in err
    assert (run_dir / "config.json").read_text() == config
    assert checkpoint_step(run_dir / "checkpoint") == 6


def test_a_checkpoint_of_another_model_is_one_line(tiny_model_dir: Path, tmp_path: Path) -> None:
    model, _ = load_policy(
        apply_overrides(resolve_target("blackjack").config(), [f"model.path={tiny_model_dir}"])
    )
    Trainer(model, TrainerConfig(), pad_id=0).save_checkpoint(tmp_path / "checkpoint", extra={"step": 3})
    preset = PRESETS["tiny"]
    other = AutoModelForCausalLM.from_config(model_config(dataclasses.replace(preset, hidden_size=64)))
    with pytest.raises(UserError) as caught:
        Trainer(other, TrainerConfig(), pad_id=0).resume_checkpoint(tmp_path / "checkpoint")
    message = str(caught.value)
    assert "was trained from a different model" in message and "model.path" in message
    assert "\n" not in message and len(message) < 400


def test_a_checkpoint_of_another_tiny_preset_names_model_tiny_preset(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The run built the tiny model (no model.path); this command asks for model.tiny_preset=small. The key
    to set back is model.tiny_preset: before, the line said `resume with the run's own model.path`."""
    task, run_dir = write_task(tmp_path, "varied"), tmp_path / "run"
    tiny = [a for a in argv(task, Path(), run_dir, 1) if not a.startswith("model.path=")]
    assert main([*tiny, "warmup.sft_steps=0"]) == 0
    capsys.readouterr()
    assert main([*tiny, "warmup.sft_steps=0", "grpo.steps=2", "model.tiny_preset=small"]) == 2
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("inflight: ")]
    assert said == [
        f"inflight: error: {run_dir} holds a run of model.tiny_preset=tiny (its config.json), and this "
        "command has model.tiny_preset=small: its weights do not fit this model; resume with "
        "model.tiny_preset=tiny, or give this run another --run-dir"
    ]


def stopping_logger(run_dir: Path, stop: StopRequest, after: int) -> MetricsLogger:
    """A logger that asks `stop` once it has logged `after` warm-up steps: a signal during the next one."""

    class Stopping(MetricsLogger):
        def log(self, step: int, metrics: dict[str, Any], phase: str = "train") -> None:
            super().log(step, metrics, phase)
            if step + 1 == after:
                stop.set("SIGTERM")

    return Stopping(run_dir)


def test_a_stopped_warmup_continues_to_the_weights_of_an_uninterrupted_one(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    task = resolve_target("blackjack")
    overrides = [f"model.path={tiny_model_dir}", "warmup.sft_steps=4", "warmup.sft_batch_size=4"]
    cfg = apply_overrides(task.config(), overrides)

    def warm_up(run_dir: Path, stop: StopRequest | None, logger: MetricsLogger) -> dict[str, torch.Tensor]:
        model, tokenizer = load_policy(cfg)
        chat = ChatFormat.for_model(tokenizer, model)
        format_warmup(
            model, pad_id(tokenizer), chat, lambda: task.make_env(cfg, "train"), cfg, logger,
            state_dir=run_dir / WARMUP_DIR, stop=stop,
        )  # fmt: skip
        return model.state_dict()

    whole = warm_up(tmp_path / "whole", None, MetricsLogger(tmp_path / "whole"))
    stop = StopRequest()
    parts = tmp_path / "parts"
    warm_up(parts, stop, stopping_logger(parts, stop, after=2))
    assert warmup_steps_done(parts / WARMUP_DIR) == (2, 4)
    continued = warm_up(parts, None, MetricsLogger(parts))
    assert warmup_steps_done(parts / WARMUP_DIR) == (4, 4)
    assert [r["step"] for r in rows(parts) if r["phase"] == "warmup"] == [0, 1, 2, 3]
    for name, tensor in whole.items():
        torch.testing.assert_close(continued[name], tensor, rtol=0, atol=0, msg=name)
    # Done: saved without the optimizer (its state is twice the model's), and loaded, not trained again.
    assert not (parts / WARMUP_DIR / "optimizer.pt").exists()
    warm_up(parts, None, MetricsLogger(parts))
    assert len([r for r in rows(parts) if r["phase"] == "warmup"]) == 4


def test_a_signal_during_the_warmup_stops_it_after_its_step(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    task, run_dir = write_task(tmp_path, "varied"), tmp_path / "run"
    steps = 200  # far more than the test lets run
    run_over = threading.Event()

    def send() -> None:  # SIGTERM once a warm-up step is logged; never once the run is over
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not run_over.is_set():
            with contextlib.suppress(OSError):
                if '"phase": "warmup"' in (run_dir / "metrics.jsonl").read_text() and not run_over.is_set():
                    os.kill(os.getpid(), signal.SIGTERM)
                    return
            time.sleep(0.02)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        code = main(argv(task, tiny_model_dir, run_dir, 2, f"warmup.sft_steps={steps}"))
    finally:
        run_over.set()
    sender.join(5)
    assert code == 128 + signal.SIGTERM
    out, err = capsys.readouterr()
    summary = last_json(out)
    assert summary["stopped"] == "SIGTERM" and summary["steps"] == 0
    done, asked = warmup_steps_done(run_dir / WARMUP_DIR) or (0, 0)
    assert asked == steps and 1 <= done <= 3, done  # after the step in flight, not the whole warm-up
    assert f"the warm-up stopped after its step {done} of {steps}" in err
    assert not (run_dir / "checkpoint").exists()
    assert [r["phase"] for r in rows(run_dir)] == ["warmup"] * done + ["summary"]

    # The same command with fewer warm-up steps left: it continues the warm-up to them (and says so, not
    # the stopped command's number), then trains.
    more = done + 1
    assert main(argv(task, tiny_model_dir, run_dir, 2, f"warmup.sft_steps={more}")) == 0
    out, err = capsys.readouterr()
    assert f"continuing the warm-up after its step {done} of {more} " in err
    assert last_json(out)["steps"] == 2
    assert [r["step"] for r in rows(run_dir) if r["phase"] == "warmup"] == list(range(more))


def snapshot(run_dir: Path) -> dict[str, tuple[int, bytes | None]]:
    """Every path under `run_dir` (itself included): its mtime and, for a file, its bytes."""
    seen: dict[str, tuple[int, bytes | None]] = {}
    for path in [run_dir, *sorted(run_dir.rglob("*"))]:
        content = path.read_bytes() if path.is_file() else None
        seen[str(path.relative_to(run_dir))] = (path.stat().st_mtime_ns, content)
    return seen


def other_model(tiny_model_dir: Path, directory: Path) -> Path:
    """The tiny model's tokenizer with weights of another shape (hidden_size 64, not 128)."""
    shutil.copytree(tiny_model_dir, directory)
    preset = dataclasses.replace(PRESETS["tiny"], hidden_size=64)
    AutoModelForCausalLM.from_config(model_config(preset)).save_pretrained(directory)
    return directory


def test_a_refused_resume_leaves_the_run_directory_untouched(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    task, run_dir = write_task(tmp_path, "varied"), tmp_path / "run"
    assert main(argv(task, tiny_model_dir, run_dir, 1, "mode=async")) == 0
    # A saved warm-up and no checkpoint yet (as a run stopped before its first step leaves it).
    warmed_up = tmp_path / "warmed-up"
    shutil.copytree(run_dir, warmed_up)
    shutil.rmtree(warmed_up / "checkpoint")
    other = other_model(tiny_model_dir, tmp_path / "other-model")
    lora = "trainer.lora_rank=4"
    refused = [
        (run_dir, argv(task, other, run_dir, 2, "mode=async"), "was trained from a different model"),
        (run_dir, argv(task, tiny_model_dir, run_dir, 2, "mode=async", lora), "holds a full model"),
        (warmed_up, argv(task, other, warmed_up, 2, "mode=async"), "was trained from a different model"),
        (run_dir, argv(write_task(tmp_path, "single"), tiny_model_dir, run_dir, 2), "'varied', not 'single'"),
        (run_dir, argv(task, tiny_model_dir, run_dir, 0), "past grpo.steps=0"),
    ]
    for directory, command, expected in refused:
        before = snapshot(directory)
        capsys.readouterr()
        assert main(command) == 2
        err = capsys.readouterr().err
        assert snapshot(directory) == before, err
        # One line of its own (beside transformers' progress bar when the model loaded): no "resuming" first.
        said = [line for line in err.splitlines() if line.startswith("inflight: ")]
        assert len(said) == 1 and said[0].startswith("inflight: error: ") and expected in said[0], err
        assert "Traceback" not in err


def test_a_refused_resume_on_the_vllm_engine_starts_no_engine_and_writes_nothing(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """engine.backend=vllm: the launcher started its vLLM process, which creates RUN_DIR/weights, before the
    run checked its directory, so a refused resume left weights/ behind. It starts once the run is accepted
    now (`run`'s `engines`): refused by the checkpoint's step or by the model, nothing is written and no
    engine starts (so vLLM need not be installed for this test)."""
    task, run_dir = write_task(tmp_path, "varied"), tmp_path / "run"
    assert main(argv(task, tiny_model_dir, run_dir, 1, "mode=async")) == 0
    other = other_model(tiny_model_dir, tmp_path / "other-model")
    on_vllm = ("mode=async", "engine.backend=vllm")
    for command, expected in [
        (argv(task, tiny_model_dir, run_dir, 0, *on_vllm), "past grpo.steps=0"),
        (argv(task, other, run_dir, 2, *on_vllm), "was trained from a different model"),
    ]:
        before = snapshot(run_dir)
        capsys.readouterr()
        assert main(command) == 2
        err = capsys.readouterr().err
        assert snapshot(run_dir) == before, err
        said = [line for line in err.splitlines() if line.startswith(("inflight: ", "engine.backend=vllm: "))]
        assert len(said) == 1 and said[0].startswith("inflight: error: ") and expected in said[0], err


def test_a_lora_checkpoint_of_another_base_model_or_rank_is_refused_before_anything_is_written(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A LoRA run without a warm-up (no saved full model to compare): its adapter's tensors, read from the
    safetensors header, must fit the model's layers and trainer.lora_rank. Before, only the full-model
    checkpoint was checked up front; the adapter was refused as it loaded, after config.json was rewritten
    and "resuming" said, in a line naming no fix."""
    task, run_dir = write_task(tmp_path, "varied"), tmp_path / "run"
    lora = ("trainer.lora_rank=4", "warmup.sft_steps=0")
    assert main(argv(task, tiny_model_dir, run_dir, 1, *lora)) == 0
    other = other_model(tiny_model_dir, tmp_path / "other-model")
    for command, expected in [
        (
            argv(task, other, run_dir, 2, *lora),
            ["holds a LoRA adapter of a different base model", "resume with the run's own model.path"],
        ),
        (
            argv(task, tiny_model_dir, run_dir, 2, *lora, "trainer.lora_rank=8"),
            ["holds a rank-4 LoRA adapter, but trainer.lora_rank=8: resume with trainer.lora_rank=4"],
        ),
    ]:
        before = snapshot(run_dir)
        capsys.readouterr()
        assert main(command) == 2
        err = capsys.readouterr().err
        assert snapshot(run_dir) == before, err
        said = [line for line in err.splitlines() if line.startswith("inflight: ")]
        assert len(said) == 1 and said[0].startswith("inflight: error: "), err
        assert all(fragment in said[0] for fragment in expected), said
