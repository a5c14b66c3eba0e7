"""`inflight bench trl`, its parts that need no TRL: arguments, the task, the headline keys, and the one-line
error (exit code 2) where TRL's environment cannot be built.

Reference: issue 16 item 6 (the keys, the shape 8 x 8 x 32, 30 steps, lr 1e-3, exit code 2); the numbers
below are worked by hand. The real comparison installs TRL and runs for minutes: `inflight bench trl`.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest

from inflight.cli import main

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    sys.path.insert(0, str(REPO_ROOT))  # benchmarks/ lives beside src/, as `inflight bench` finds it
    return importlib.import_module("benchmarks.trl")


def test_defaults_are_the_issues_shape(bench: ModuleType) -> None:
    args = bench.parse_args([])
    assert (args.prompts, args.samples, args.new_tokens, args.steps, args.lr) == (8, 8, 32, 30, 1e-3)
    assert args.sides == ["async", "sync", "trl"]
    assert args.trl_version == bench.TRL_VERSION == "1.16.0"
    assert bench.parse_args(["--sides", "sync,trl"]).sides == ["sync", "trl"]
    assert args.seed == 0 and bench.parse_args(["--seed", "2"]).seed == 2  # the weights' and every side's


def test_a_negative_seed_is_refused(bench: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(["--seed", "-1"])
    assert exit_info.value.code == 2
    assert "--seed" in capsys.readouterr().err


def test_unknown_side_is_refused(bench: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(["--sides", "async,vllm"])
    assert exit_info.value.code == 2
    assert "async,sync,trl" in capsys.readouterr().err


def test_reward_counts_digits_up_to_the_token_budget(bench: ModuleType) -> None:
    prompt, reward = bench.prompt, bench.reward  # benchmarks/trl_task.py's, which both sides import
    assert reward("") == 0.0
    assert reward("no digits here") == 0.0
    assert reward("a1b2 3") == 3 / 32
    assert reward("7" * 40) == 1.0  # capped: 32 digits earn the whole reward
    assert prompt(3) != prompt(4)


def test_reward_at_equal_wall_time_is_the_mean_of_the_last_steps_finished_by_then(bench: ModuleType) -> None:
    steps = [{"step": i, "end_s": 2.0 * (i + 1), "reward": float(i), "tokens": 64.0} for i in range(10)]
    assert bench.reward_at(steps, 1.0) is None  # no step had finished
    assert bench.reward_at(steps, 2.0) == 0.0  # step 0 ends exactly then
    assert bench.reward_at(steps, 7.9) == 1.0  # steps 0..2: mean of 0, 1, 2
    assert bench.reward_at(steps, 14.0) == 4.0  # steps 0..6, the last 5: 2..6
    assert bench.reward_at(steps, 1e9) == 7.0  # all ten, the last 5: 5..9
    assert bench.reward_at(steps, 14.0, window=1) == 6.0


def test_compare_reports_each_side_and_the_ratio_it_measured(bench: ModuleType) -> None:
    def side(step_s: float, rewards: list[float]) -> list[dict[str, float]]:
        return [
            {"step": i, "end_s": step_s * (i + 1), "reward": r, "tokens": 64 * 30.0}
            for i, r in enumerate(rewards)
        ]

    sides = {
        "async": side(1.0, [0.1] * 5 + [0.5] * 5),  # 10 steps in 10 s
        "sync": side(2.0, [0.1] * 10),  # 20 s
        "trl": side(4.0, [0.2] * 10),  # 40 s
    }
    out = bench.compare(sides, completions_per_step=64)
    assert out["completions_per_s"] == 64.0
    assert out["completions_per_s_sync"] == 32.0
    assert out["trl_completions_per_s"] == 16.0
    assert out["ratio_vs_trl"] == 4.0
    assert out["ratio_sync_vs_trl"] == 2.0
    assert out["equal_wall_s"] == 10.0  # the fastest side's 10 steps
    # By 10 s: async finished all 10 steps (last 5 at 0.5), sync 5, TRL 2.
    assert out["reward_at_equal_wall_s"] == {"async": 0.5, "sync": 0.1, "trl": 0.2}
    assert out["sides"]["trl"]["mean_completion_tokens"] == 30.0
    assert out["sides"]["async"]["reward_first5"] == 0.1
    assert out["sides"]["async"]["reward_last5"] == 0.5


def test_a_trl_release_that_cannot_be_installed_is_one_line_and_exit_code_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    env = tmp_path / "trl-env"
    run_dir = tmp_path / "run"
    code = main(["bench", "trl", "--trl-version", "0.0.0", "--trl-env", str(env), "--run-dir", str(run_dir)])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("inflight: error: cannot install trl==0.0.0 into ")
    assert str(env) in err[-1]
    # Nothing half-built is left to be mistaken for an environment, and nothing ran.
    assert not env.exists() and not list(tmp_path.glob("trl-env.building-*"))
    assert not run_dir.exists()


def test_a_run_directory_in_use_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "result.json").write_text("{}")
    assert main(["bench", "trl", "--run-dir", str(tmp_path)]) == 2
    assert "is not empty" in capsys.readouterr().err
