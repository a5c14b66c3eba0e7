"""Each task in examples/ runs a few steps on the tiny model through `inflight run examples/X.py`, and trains.

Reference: issue 14 item 3 (a single-turn task with a programmatic reward, a multi-turn tool-using task, an
Env-class task), the summary contract of docs/architecture.md and the held-out evaluations logged as `test/`
metrics before training, every `eval.every_steps` and at the end (item 2). The rollout-function tasks run
once in each mode. Each runs with its own preset's warm-up and reply budget, only fewer steps and episodes:
an example whose every step is skipped (replies cut short of the answer format, a model that never produces
it) trains nothing, and fails here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inflight.cli import main
from inflight.orchestrator.target import resolve_target

pytestmark = pytest.mark.slow
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SUMMARY_KEYS = {
    "recipe", "mode", "steps", "wall_s", "eval_problems", "eval_problems_sampled", "return_initial",
    "return_final", "return_initial_sampled", "return_final_sampled", "return_first10", "return_last10",
    "run_dir",
}  # fmt: skip
# The preset's group size, warm-up and sampling stay: they decide whether the groups carry any signal.
QUICK = [
    "progress=false",
    "grpo.steps=2",
    "grpo.prompts_per_step=4",
    "eval.num_episodes=4",
    "eval.every_steps=1",
    "eval.num_episodes_during=2",
]


@pytest.mark.parametrize(
    ("example", "mode"),
    [
        ("letter_count", "async"),  # single turn, programmatic reward, scripted warm-up replies
        ("calculator_tool", "sync"),  # multi-turn with a tool, scripted warm-up replies
        ("higher_lower_env", "async"),  # an Env class; the warm-up plays its legal actions
    ],
)
def test_example_trains_a_few_steps(
    example: str,
    mode: str,
    tiny_model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    run_dir, target = tmp_path / example, str(EXAMPLES / f"{example}.py")
    warmup_steps = resolve_target(target).config().warmup.sft_steps
    argv = ["run", target, f"mode={mode}", *QUICK, f"model.path={tiny_model_dir}"]
    assert main([*argv, "--run-dir", str(run_dir)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    assert summary.keys() >= SUMMARY_KEYS, SUMMARY_KEYS - summary.keys()
    assert (summary["recipe"], summary["mode"], summary["steps"]) == (example, mode, 2)
    assert summary["eval_problems"] == 4 and summary["return_final"] is not None
    assert (run_dir / "checkpoint" / "model.safetensors").is_file()
    assert json.loads((run_dir / "summary.json").read_text()) == summary

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["phase"] == "train"]
    assert [r["step"] for r in train] == [0, 1]
    # It learns from them: some group's rewards differed, and the policy moved.
    assert summary["steps_skipped"] < summary["steps"], "every step was skipped: no group carried signal"
    assert train[-1]["version"] >= 1
    assert sum(r["phase"] == "warmup" for r in rows) == warmup_steps
    # On the test split: before training, after each step (eval.every_steps=1) and at the end.
    evals = [r for r in rows if r["phase"] == "eval"]
    assert [r["step"] for r in evals] == [0, 1, 2, 2]
    for row in evals:
        assert {"test/return", "test/return_greedy", "test/rollout_errors"} <= row.keys()
        assert row["test/rollout_errors"] == 0
