"""Each task in examples/ runs a few steps on the tiny model through `inflight run examples/X.py`.

Reference: issue 14 item 3 (a single-turn task with a programmatic reward, a multi-turn tool-using task, an
Env-class task), the summary contract of docs/architecture.md and the held-out evaluations logged as `test/`
metrics before training, every `eval.every_steps` and at the end (item 2). The rollout-function task runs
once in each mode; the warm-up runs where the example has one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inflight.cli import main

pytestmark = pytest.mark.slow
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SUMMARY_KEYS = {
    "recipe", "mode", "steps", "wall_s", "eval_problems", "eval_problems_sampled", "return_initial",
    "return_final", "return_initial_sampled", "return_final_sampled", "return_first10", "return_last10",
    "run_dir",
}  # fmt: skip
QUICK = [
    "progress=false",
    "grpo.steps=2",
    "grpo.prompts_per_step=2",
    "grpo.group_size=2",
    "eval.num_episodes=4",
    "eval.every_steps=1",
    "eval.num_episodes_during=2",
]


@pytest.mark.parametrize(
    ("example", "mode", "warmup_steps"),
    [
        ("letter_count", "async", 0),  # single turn, programmatic reward (no warm-up replies)
        ("calculator_tool", "sync", 2),  # multi-turn with a tool, scripted warm-up replies
        ("higher_lower_env", "async", 2),  # an Env class; the warm-up plays its legal actions
    ],
)
def test_example_runs_a_few_steps(
    example: str,
    mode: str,
    warmup_steps: int,
    tiny_model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    run_dir = tmp_path / example
    argv = ["run", str(EXAMPLES / f"{example}.py"), f"mode={mode}", *QUICK]
    argv += [f"warmup.sft_steps={warmup_steps}", "warmup.sft_batch_size=4", f"model.path={tiny_model_dir}"]
    assert main([*argv, "--run-dir", str(run_dir)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    assert summary.keys() >= SUMMARY_KEYS, SUMMARY_KEYS - summary.keys()
    assert (summary["recipe"], summary["mode"], summary["steps"]) == (example, mode, 2)
    assert summary["eval_problems"] == 4 and summary["return_final"] is not None
    assert (run_dir / "checkpoint" / "model.safetensors").is_file()
    assert json.loads((run_dir / "summary.json").read_text()) == summary

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["phase"] == "warmup" for r in rows) == warmup_steps
    assert [r["step"] for r in rows if r["phase"] == "train"] == [0, 1]
    # On the test split: before training, after each step (eval.every_steps=1) and at the end.
    evals = [r for r in rows if r["phase"] == "eval"]
    assert [r["step"] for r in evals] == [0, 1, 2, 2]
    for row in evals:
        assert {"test/return", "test/return_greedy", "test/rollout_errors"} <= row.keys()
        assert row["test/rollout_errors"] == 0
