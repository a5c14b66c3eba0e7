"""ArithmeticEnv: problem generation, answer parsing, rewards, counters and warm-up replies.

Reference: Python's own evaluation of the problem text (standard operator precedence) is the ground
truth for every generated answer; OpenEnv's reset/step contract as in tests/test_env_base.py.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inflight.envs import TextAction, make_env
from inflight.envs.arithmetic import (
    LEVELS,
    ArithmeticEnv,
    Difficulty,
    evaluate_expression,
    make_problem,
    parse_answer,
    shaped_reward,
)
from inflight.errors import UserError


def _python_value(text: str) -> int:
    # The problem text holds only digits, spaces and + - *: Python evaluates it with the same precedence.
    assert set(text) <= set("0123456789 +-*"), text
    return int(eval(text))


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**63 - 1), level=st.sampled_from(sorted(LEVELS)))
def test_answers_match_python_evaluation(seed: int, level: int) -> None:
    problem = make_problem(random.Random(seed), LEVELS[level])
    assert problem.answer == _python_value(problem.text)


@pytest.mark.parametrize("level", sorted(LEVELS))
def test_problems_stay_within_their_difficulty(level: int) -> None:
    difficulty = LEVELS[level]
    rng = random.Random(level)
    seen_ops: set[str] = set()
    for _ in range(500):
        tokens = make_problem(rng, difficulty).text.split()
        numbers, ops = [int(t) for t in tokens[::2]], tokens[1::2]
        assert len(numbers) == difficulty.num_operands
        seen_ops |= set(ops)
        assert 0 <= numbers[0] <= difficulty.max_operand
        for op, n in zip(ops, numbers[1:], strict=True):
            assert 0 <= n <= (difficulty.max_multiplier if op == "*" else difficulty.max_operand)
    assert seen_ops == set(difficulty.ops)


def test_precedence_without_eval() -> None:
    assert evaluate_expression([2, 3, 4], ["+", "*"]) == 14
    assert evaluate_expression([2, 3, 4], ["*", "-"]) == 2
    assert evaluate_expression([10, 2, 3, 4], ["-", "*", "*"]) == -14


def test_same_seed_same_problem_and_levels_differ() -> None:
    env = ArithmeticEnv(level=3)
    first = env.reset(seed=42).prompt
    assert env.reset(seed=42).prompt == first
    assert first.startswith("What is ") and first.endswith("?")
    # Different seeds give different problems often enough to be a task.
    prompts = {env.reset(seed=s).prompt for s in range(200)}
    assert len(prompts) > 150


@pytest.mark.parametrize(
    ("text", "value"),
    [("7", 7), (" 17\n", 17), ("-3", -3), ("42.", 42), ("007", 7)],
)
def test_parse_answer_accepts_the_number_alone(text: str, value: int) -> None:
    assert parse_answer(text) == value


@pytest.mark.parametrize("text", ["", "seven", "7 8", "7+1", "Answer: 7", "3.5", "--3", "1" * 100, "٣"])
def test_parse_answer_rejects_anything_else(text: str) -> None:
    assert parse_answer(text) is None


def test_rewards_outcomes_and_counters() -> None:
    env = ArithmeticEnv(level=1, partial_credit=0.5, format_penalty=-0.5)
    answers = []
    for seed in range(3):
        env.reset(seed=seed)
        answers.append(env.state.answer)
    assert all(a is not None for a in answers)

    env.reset(seed=0)
    right = env.step(TextAction(text=str(answers[0])))
    assert right.done and right.reward == 1.0 and right.outcome == "correct"
    assert right.metadata == {"correct": 1, "format_error": 0}
    assert right.answer == answers[0] and str(answers[0]) in right.prompt

    env.reset(seed=1)
    wrong = env.step(TextAction(text=str(answers[1] + 3)))
    assert wrong.outcome == "wrong" and wrong.reward == pytest.approx(0.5 / 4)

    env.reset(seed=2)
    bad = env.step(TextAction(text="banana"))
    assert bad.outcome == "format_error" and bad.reward == -0.5 and bad.metadata["format_error"] == 1
    assert env.counters == {"problems": 6, "correct": 1, "wrong": 1, "format_errors": 1}


def test_answer_is_hidden_until_done() -> None:
    env = ArithmeticEnv()
    obs = env.reset(seed=5)
    assert obs.answer is None and not obs.done and obs.reward is None
    assert "answer" not in obs.prompt.lower()


def test_shaped_reward_ranks_nearer_answers_higher_and_below_correct() -> None:
    rewards = [shaped_reward(guess, 10, 0.5) for guess in (10, 11, 9, 13, 100)]
    assert rewards[0] == 1.0
    assert rewards[1] == rewards[2] > rewards[3] > rewards[4] > 0
    assert max(rewards[1:]) < 1.0
    assert shaped_reward(11, 10, 0.0) == 0.0


def test_step_outside_an_episode_raises() -> None:
    env = ArithmeticEnv()
    with pytest.raises(RuntimeError, match="before reset"):
        env.step(TextAction(text="1"))
    env.reset(seed=0)
    env.step(TextAction(text="1"))
    with pytest.raises(RuntimeError, match="after the problem was answered"):
        env.step(TextAction(text="1"))


def test_bad_configuration_is_a_clear_error() -> None:
    with pytest.raises(UserError, match="unknown arithmetic level 9"):
        ArithmeticEnv(level=9)
    with pytest.raises(UserError, match="invalid arithmetic difficulty"):
        ArithmeticEnv(ops="+ /")
    with pytest.raises(UserError, match="partial_credit"):
        ArithmeticEnv(partial_credit=1.5)
    with pytest.raises(UserError, match="unknown arguments"):
        ArithmeticEnv().reset(seed=0, cards=["A"])
    with pytest.raises(ValueError, match="duplicates"):
        Difficulty(max_operand=9, ops=("+", "+"))


def test_overrides_change_the_level() -> None:
    env = ArithmeticEnv(level=1, ops="*", max_operand=3, max_multiplier=2, num_operands=3)
    text = env.reset(seed=0).problem
    assert text.count("*") == 2
    assert env.difficulty == Difficulty(max_operand=3, ops=("*",), num_operands=3, max_multiplier=2)


def test_registered_and_unseeded_reset_is_reproducible() -> None:
    a, b = make_env("arithmetic", level=2, seed=7), make_env("arithmetic", level=2, seed=7)
    assert isinstance(a, ArithmeticEnv)
    assert [a.reset().prompt for _ in range(5)] == [b.reset().prompt for _ in range(5)]


def test_warmup_replies_have_the_format_and_ignore_the_problem() -> None:
    env = ArithmeticEnv(level=1)
    replies, hits = [], 0
    for seed in range(400):
        obs = env.reset(seed=seed)
        reply = env.warmup_reply(obs, random.Random(f"warmup-{seed}"))
        assert parse_answer(reply) is not None
        replies.append(reply)
        hits += int(reply) == env.state.answer
    # The reply is a function of the rng alone: the same rng gives the same reply for another problem.
    other = env.reset(seed=10_000)
    assert [env.warmup_reply(other, random.Random(f"warmup-{s}")) for s in range(400)] == replies
    # ...so it is right only by chance (19 possible sums, the likeliest 10% of problems).
    assert hits / 400 < 0.2
