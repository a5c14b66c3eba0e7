"""Every recipe end to end on the tiny model, a few steps each, through the CLI (`inflight run NAME`).

Reference: the summary contract of docs/architecture.md (recipe, steps, wall_s, return_initial/final,
return_first10/last10, run_dir), the run directory's files and the held-out evaluations logged as `test/`
metrics (issue 14). The code and tools recipes run their tests and tool calls in the real bubblewrap
sandbox.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from inflight.cli import main
from inflight.envs import BlackJackEnv, State, TextAction, TextObservation, make_env
from inflight.envs.base import Environment
from inflight.errors import UserError
from inflight.orchestrator.target import resolve_target
from inflight.orchestrator.task import load_split
from inflight.orchestrator.warmup import env_warmup_reply, random_legal_reply
from inflight.recipes import RECIPES
from inflight.recipes.code import warmup_reply as code_warmup_reply
from inflight.recipes.tools import warmup_reply as tools_warmup_reply

pytestmark = pytest.mark.slow
SUMMARY_KEYS = {
    "recipe", "steps", "wall_s", "return_initial", "return_final", "return_initial_sampled",
    "return_final_sampled", "return_first10", "return_last10", "run_dir",
}  # fmt: skip
NEW_RECIPES = ("arithmetic", "math", "code", "tools")
# A few steps of everything, small enough for seconds per recipe on the tiny model.
QUICK = [
    "progress=false",
    "warmup.sft_steps=3",
    "warmup.sft_batch_size=8",
    "grpo.steps=2",
    "grpo.prompts_per_step=2",
    "grpo.group_size=2",
    "eval.num_episodes=4",
    "eval.every_steps=1",
    "eval.num_episodes_during=2",
]


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_presets_are_valid_and_every_recipe_has_a_test_split(name: str) -> None:
    task = resolve_target(name)
    cfg = task.config()
    assert cfg.recipe == name
    if task.env is not None:
        task.make_env(cfg, "train").close()

    def head(split: str) -> list[dict]:  # the first problems, without the split's own name
        problems = load_split(task, split)
        return [{k: v for k, v in problems[i].items() if k != "split"} for i in range(20)]

    assert head("train") != head("test")


@pytest.mark.parametrize(("name", "held_out"), [("math", 12), ("code", 8)])
def test_dataset_recipes_evaluate_on_problems_they_never_train_on(name: str, held_out: int) -> None:
    task = resolve_target(name)
    cfg = task.config()
    train_env, test_env = task.make_env(cfg, "train"), task.make_env(cfg, "test")
    train_ids = {p.id for p in train_env.problems}  # type: ignore[attr-defined]
    test_ids = {p.id for p in test_env.problems}  # type: ignore[attr-defined]
    assert len(test_ids) == held_out and not train_ids & test_ids


@pytest.mark.parametrize("name", NEW_RECIPES)
def test_recipe_runs_end_to_end(
    name: str, tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / name
    overrides = [*QUICK, f"model.path={json.dumps(str(tiny_model_dir))}"]
    assert main(["run", name, *overrides, "--run-dir", str(run_dir)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    assert summary["recipe"] == name and summary["steps"] == 2
    assert summary.keys() >= SUMMARY_KEYS, SUMMARY_KEYS - summary.keys()
    assert summary["run_dir"] == str(run_dir)
    assert json.loads((run_dir / "summary.json").read_text()) == summary
    assert (run_dir / "checkpoint" / "model.safetensors").is_file()
    assert (run_dir / "curves.png").stat().st_size > 1000

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    phases = [r["phase"] for r in rows]
    assert phases.count("warmup") == 3 and phases.count("train") == 2
    # Before RL, after each of the 2 steps (eval.every_steps=1), and after RL, on the test split.
    assert phases.count("eval") == 4
    for row in (r for r in rows if r["phase"] == "eval"):
        assert {"test/return", "test/return_greedy", "test/rollout_errors"} <= row.keys()


def test_tools_rollouts_mask_tool_output(tiny_model_dir: Path) -> None:
    """A scripted tools episode (the warm-up's data): the tool's output is context, never trained on."""
    from inflight.models import load_tokenizer
    from inflight.rollouts.chat import ChatFormat
    from inflight.rollouts.episodes import run_scripted_episode

    chat = ChatFormat(load_tokenizer(str(tiny_model_dir)))
    rng = random.Random(0)
    rollout = run_scripted_episode(
        make_env("tools", max_tool_calls=1), 3, lambda obs: tools_warmup_reply(obs, rng), chat, 2
    )
    assert rollout.metrics["tool_calls"] == 1.0 and rollout.metrics["turns"] == 2.0
    pairs = list(zip(rollout.token_ids, rollout.loss_mask, strict=True))
    trained = chat.tokenizer.decode([t for t, m in pairs if m])
    context = chat.tokenizer.decode([t for t, m in pairs if not m])
    assert "<python>print(" in trained and "<answer>" in trained
    assert "<output>" in context and "<output>" not in trained


def test_warmup_replies_come_from_the_env() -> None:
    rng = random.Random(0)
    arithmetic = make_env("arithmetic")
    obs = arithmetic.reset(seed=1)
    assert env_warmup_reply(arithmetic)(obs, rng).lstrip("-").isdigit()

    blackjack = BlackJackEnv()
    hand = next(o for s in range(100) if not (o := blackjack.reset(seed=s)).done)
    assert env_warmup_reply(blackjack) is random_legal_reply
    assert {random_legal_reply(hand, rng) for _ in range(50)} == {"hit", "stand"}

    class Silent(Environment[TextAction, TextObservation, State]):
        def reset(self, seed: int | None = None, episode_id: str | None = None, **kw: Any) -> TextObservation:
            return TextObservation(prompt="?")

        def step(self, action: TextAction, timeout_s: float | None = None, **kw: Any) -> TextObservation:
            return TextObservation(prompt="", done=True, reward=0.0)

        @property
        def state(self) -> State:
            return State()

    with pytest.raises(UserError, match=r"no legal_actions.*warmup_reply"):
        env_warmup_reply(Silent())(Silent().reset(), rng)


def test_code_warmup_reply_defines_the_asked_function_with_another_train_body() -> None:
    env = make_env("code")
    held_out = {p.solution.rstrip() for p in env.problems if p.split == "test"}  # type: ignore[attr-defined]
    rng = random.Random(0)
    for seed in range(40):
        obs = env.reset(seed=seed)
        reply = code_warmup_reply(obs, rng)
        assert reply.startswith("```python\n") and f"def {obs.entry_point}(" in reply
        solution = next(p.solution for p in env.problems if p.id == obs.problem_id)  # type: ignore[attr-defined]
        body = reply.removeprefix("```python\n").removesuffix("\n```")
        assert body != solution.rstrip()
        # Never a held-out problem's solution, under any name.
        assert all(body.split("(", 1)[1] != s.split("(", 1)[1] for s in held_out)


def test_unknown_recipe_is_a_clear_error() -> None:
    with pytest.raises(UserError, match=r"unknown target 'algebra'.*arithmetic"):
        resolve_target("algebra")


@pytest.mark.parametrize("group", [1, 4])
def test_warm_up_groups_play_each_start_several_times(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, group: int
) -> None:
    """`warmup.sft_group_size`: each episode seed `group` times in a row (their own random replies), so the
    transcripts share their first turn and the trainer lays it out once; 1 leaves the draws as they were."""
    import inflight.orchestrator.warmup as warmup
    from inflight.config import apply_overrides
    from inflight.metrics.logger import MetricsLogger
    from inflight.orchestrator.setup import load_policy, pad_id
    from inflight.rollouts.chat import ChatFormat

    seeds: list[int] = []
    played = warmup.run_scripted_episode

    def recording(env: Any, seed: int, *args: Any) -> Any:
        seeds.append(seed)
        return played(env, seed, *args)

    monkeypatch.setattr(warmup, "run_scripted_episode", recording)
    task = resolve_target("blackjack")
    overrides = [f'model.path="{tiny_model_dir}"', "warmup.sft_steps=1", "warmup.sft_batch_size=8"]
    cfg = apply_overrides(task.config(), [*overrides, f"warmup.sft_group_size={group}"])
    model, tokenizer = load_policy(cfg)
    chat = ChatFormat.for_model(tokenizer, model)
    metrics = warmup.format_warmup(
        model, pad_id(tokenizer), chat, lambda: task.make_env(cfg, "train"), cfg, MetricsLogger(tmp_path)
    )
    rng = random.Random(cfg.seed + 7919)  # the warm-up's generator: a step draws its starts first
    expected_starts = [rng.getrandbits(62) for _ in range(8 // group)]
    assert seeds == [s for s in expected_starts for _ in range(group)]
    if group > 1:  # 2 starts x 4 transcripts: each start's first turn computed once
        assert metrics["forward_tokens"] < 0.7 * metrics["num_tokens"]
