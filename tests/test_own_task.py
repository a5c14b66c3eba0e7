"""A user's task end to end on the tiny model: which split each phase reads, rollouts that fail, resume, and
the run directory of a run that never trained.

Reference: issue 14. Item 2: training draws `load_problems("train")` (problem k = the k-th, in order) and
evaluation runs on `load_problems("test")` before training, every `eval.every_steps` and at the end,
logged as `test/` metrics. "Bad input": a `generate_rollout` that raises, returns the wrong type or hangs is
counted, logged with the problem index and the exception's first line, bounded by `rollout.timeout_s`, and
the run goes on; past `rollout.max_failed_frac` the run stops naming the most common error. Item 6: every
target resumes in both modes, and a run that fails before its first step leaves no run directory.
"""

from __future__ import annotations

import json
import logging
import re
import textwrap
from pathlib import Path
from typing import Any

import pytest

from inflight.cli import main

pytestmark = pytest.mark.slow
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SMALL = ["progress=false", "grpo.prompts_per_step=2", "grpo.group_size=2", "eval.num_episodes=4"]
# A rollout of problem `i`: one policy turn; the reward depends on the reply so groups carry signal.
TASK = """
import asyncio

def load_problems(split):
    return [{"split": split, "i": i} for i in range(100 if split == "train" else 10)]

async def reply_reward(ctx, problem, metrics):
    chat = ctx.chat()
    chat.user(f"Problem {problem['i']}.")
    reply = await chat.assistant()
    return chat.to_rollout(float(len(reply) % 3), metrics)
"""


def write_task(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(TASK) + textwrap.dedent(body))
    return str(path)


def run(target: str, run_dir: Path, model_dir: Path, *overrides: str) -> int:
    argv = ["run", target, *SMALL, f"model.path={model_dir}", *overrides, "--run-dir", str(run_dir)]
    return main(argv)


def metrics(run_dir: Path, phase: str) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["phase"] == phase]


def test_training_reads_the_train_split_in_order_and_evaluation_the_test_split(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    target = write_task(
        tmp_path,
        "splits",
        """
        async def generate_rollout(ctx, problem):
            seen = {"from_test": float(problem["split"] == "test"), "i": float(problem["i"])}
            return await reply_reward(ctx, problem, seen)
        """,
    )
    run_dir = tmp_path / "run"
    steps = ["mode=sync", "grpo.steps=3", "eval.every_steps=2", "eval.num_episodes_during=2"]
    assert run(target, run_dir, tiny_model_dir, *steps) == 0

    train = metrics(run_dir, "train")
    assert all(r["env/from_test_mean"] == 0 for r in train)
    # Step s trains problems 2s and 2s + 1 of the train split.
    assert [r["env/i_mean"] for r in train] == [0.5, 2.5, 4.5]
    evals = metrics(run_dir, "eval")
    # Before training (4 test problems), after step 2 (eval.num_episodes_during=2), after training (4).
    assert [r["step"] for r in evals] == [0, 2, 3]
    assert all(r["test/from_test"] == r["test/from_test_greedy"] == 1 for r in evals)
    assert [r["test/i"] for r in evals] == [1.5, 0.5, 1.5]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_rollouts_that_raise_return_junk_or_hang_are_counted_and_the_run_goes_on(
    mode: str, tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    target = write_task(
        tmp_path,
        "flaky",
        """
        async def generate_rollout(ctx, problem):
            if problem["split"] == "train" and ctx.sample_index == 0:
                if problem["i"] % 4 == 1:
                    raise RuntimeError("task bug\\nwith a second line")
                if problem["i"] % 4 == 2:
                    return "not a rollout"
                if problem["i"] % 4 == 3:
                    await asyncio.sleep(3600)
            return await reply_reward(ctx, problem, {})
        """,
    )
    run_dir = tmp_path / "run"
    overrides = [f"mode={mode}", "grpo.steps=2", "grpo.prompts_per_step=4", "grpo.group_size=3"]
    overrides += ["rollout.timeout_s=1"]
    if mode == "async":  # the sync loop has no active sampling (pipeline.* is refused under mode=sync)
        overrides += ["pipeline.active_sampling=false"]
    with caplog.at_level(logging.WARNING, logger="inflight.orchestrator.guard"):
        assert run(target, run_dir, tiny_model_dir, *overrides) == 0

    last = metrics(run_dir, "train")[-1]
    # 3 of every 4 problems lose their first sample: 6 failures in 2 steps (the pipeline may have started
    # the next step's problems already), 2 of them timeouts; each group keeps 2 rollouts and trains.
    if mode == "sync":
        assert (last["rollout_errors"], last["rollout_timeouts"]) == (6, 2)
    else:
        assert last["rollout_errors"] >= 6 and last["rollout_timeouts"] >= 2
    assert last["groups_dropped_errors"] == 0
    logged = {r.getMessage() for r in caplog.records}
    assert {
        "rollout failed (training): problem 1, sample 0: RuntimeError: task bug",
        "rollout failed (training): problem 2, sample 0: TypeError: generate_rollout returned a str, not a "
        "Rollout",
        "rollout failed (training): problem 3, sample 0: TimeoutError: generate_rollout ran past "
        "rollout.timeout_s=1 s",
    } <= logged


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_too_many_failed_rollouts_stop_the_run_and_leave_no_run_directory(
    mode: str, tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = write_task(
        tmp_path,
        "broken",
        """
        async def generate_rollout(ctx, problem):
            if problem["split"] == "train":
                raise ValueError(f"cannot parse problem {problem['i'] % 2}")
            return await reply_reward(ctx, problem, {})
        """,
    )
    run_dir = tmp_path / "run"
    assert run(target, run_dir, tiny_model_dir, f"mode={mode}", "grpo.steps=3") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("inflight: error: stopped: ") and "Traceback" not in "\n".join(err)
    assert re.search(
        r"stopped: (\d+) of \1 rollouts failed, more than rollout\.max_failed_frac=0\.5; the most common "
        r"error \(\d+x\): ValueError: cannot parse problem [01]$",
        err[-1],
    ), err[-1]
    assert not run_dir.exists()  # it failed before its first step

    # A directory the run did not create is never removed, whatever happens in it.
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("mine")
    assert run(target, run_dir, tiny_model_dir, f"mode={mode}", "grpo.steps=3") == 2
    assert (run_dir / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize(("example", "mode"), [("letter_count", "sync"), ("higher_lower_env", "async")])
def test_a_file_target_resumes_in_either_mode(
    example: str, mode: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    target = str(EXAMPLES / f"{example}.py")
    common = [f"mode={mode}", "warmup.sft_steps=0", "eval.every_steps=0"]
    assert run(target, run_dir, tiny_model_dir, *common, "grpo.steps=2") == 0
    assert run(target, run_dir, tiny_model_dir, *common, "grpo.steps=4") == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4
    assert [r["step"] for r in metrics(run_dir, "train")] == [0, 1, 2, 3]  # 2 and 3 once, 0 and 1 not again
    assert json.loads((run_dir / "checkpoint" / "trainer_state.json").read_text())["step"] == 4
