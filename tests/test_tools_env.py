"""The `tools` environment: tasks, the <python>/<answer> protocol, tool runs in the sandbox, and tool
output masked out of the loss in the rollout's token stream.

References: every task kind is solved end to end by Python written here (independently of the task
generator) and run through the environment's own tool, so the generator's answers are checked against
separate code; ChatML multi-turn layout from rollouts/chat.py.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import LimitsSeen
from inflight.envs import TextAction, make_env
from inflight.envs.sandbox import SandboxLimits, VerifierPool, bwrap_problem
from inflight.envs.tools import TASK_KINDS, ToolsEnv, ToolsObservation, normalize_answer, parse_reply
from inflight.errors import UserError


@pytest.fixture(scope="module")
def pool() -> Iterator[VerifierPool]:
    if os.environ.get("CI") and (problem := bwrap_problem()):
        pytest.fail(f"bubblewrap must work in CI: {problem}")
    if os.geteuid() != 0 and bwrap_problem():
        pytest.skip("no bwrap and not root: rlimit mode would run code as the test runner")
    with VerifierPool(concurrency=2) as pool:
        yield pool


def make(pool: VerifierPool, **kwargs: object) -> ToolsEnv:
    return ToolsEnv(pool=pool, limits=SandboxLimits(wall_s=3, cpu_s=3), **kwargs)  # type: ignore[arg-type]


def solver_code(question: str) -> str:
    """Python that answers `question`, written from its text alone."""
    numbers = [int(n) for n in re.findall(r"\d+", question)]
    quoted = re.findall(r"'([^']*)'", question)
    if "greatest common divisor" in question:
        return f"import math\nprint(math.gcd({numbers[0]}, {numbers[1]}))"
    if "digits of" in question:
        return f"print(sum(int(d) for d in str({numbers[0]} ** {numbers[1]})))"
    if " mod " in question:
        return f"print(pow({numbers[0]}, {numbers[1]}, {numbers[2]}))"
    if "prime number" in question:
        return (
            f"n, k, found = {numbers[0]}, 1, 0\nwhile found < n:\n    k += 1\n"
            "    found += all(k % d for d in range(2, int(k ** 0.5) + 1))\nprint(k)"
        )
    if " * " in question:
        return f"print({numbers[0]} * {numbers[1]})"
    if "reversed" in question:
        return f"print({quoted[0]!r}[::-1])"
    if "How many times" in question:
        return f"print({quoted[1]!r}.count({quoted[0]!r}))"
    if "Sort these words" in question:
        return f"print(' '.join(sorted({question.split(': ', 1)[1]!r}.split())))"
    raise AssertionError(f"no solver for {question!r}")


def tool_stdout(obs: ToolsObservation) -> str:
    assert obs.tool_output is not None
    return obs.tool_output.split("<output>\n", 1)[1].split("\n</output>", 1)[0]


def test_every_task_kind_is_solvable_with_the_tool(pool: VerifierPool) -> None:
    env = make(pool)
    kinds_seen = set()
    for seed in range(40):
        obs = env.reset(seed=seed)
        kinds_seen.add(env.state.task.kind)  # type: ignore[union-attr]
        obs = env.step(TextAction(text=f"Let me compute.\n<python>\n{solver_code(obs.task)}\n</python>"))
        assert not obs.done and obs.tool_calls_left == 2 and "(exit 0)" in (obs.tool_output or "")
        obs = env.step(TextAction(text=f"<answer>{tool_stdout(obs)}</answer>"))
        assert (obs.done, obs.reward, obs.outcome) == (True, 1.0, "correct"), (obs.task, obs.prompt)
    assert kinds_seen == set(TASK_KINDS)
    assert env.counters["correct"] == 40 and env.counters["tool_calls"] == 40


def test_reset_is_deterministic_and_the_observation_is_complete(pool: VerifierPool) -> None:
    env = make(pool, max_tool_calls=2)
    first, again = env.reset(seed=11), env.reset(seed=11)
    assert first == again and env.reset(seed=12).task != first.task
    assert first.task in first.prompt and "<python>" in first.prompt and "<answer>" in first.prompt
    assert (first.tool_calls_left, first.legal_actions, first.tool_output, first.answer) == (
        2,
        ["python", "answer"],
        None,
        None,
    )


def test_a_wrong_answer_ends_the_episode_with_zero(pool: VerifierPool) -> None:
    env = make(pool)
    env.reset(seed=5)
    obs = env.step(TextAction(text="<answer>definitely not it</answer>"))
    assert (obs.done, obs.reward, obs.outcome, obs.legal_actions) == (True, 0.0, "wrong", [])
    assert obs.answer == env.state.task.answer  # type: ignore[union-attr]  # revealed once done
    assert obs.metadata == {"correct": 0, "format_error": 0, "tool_calls": 0, "tool_errors": 0}


def test_tool_errors_come_back_as_output_and_the_episode_goes_on(pool: VerifierPool) -> None:
    env = make(pool)
    env.reset(seed=1)
    obs = env.step(TextAction(text="<python>1 / 0</python>"))
    assert not obs.done and "ZeroDivisionError" in obs.prompt and "(failed: error)" in obs.prompt
    obs = env.step(TextAction(text="<python>while True:\n    pass</python>"))
    assert not obs.done and "(failed: timeout)" in obs.prompt
    assert env.counters["tool_errors"] == 2 and env.state.tool_errors == 2


def test_long_tool_output_is_cut_to_head_and_tail(pool: VerifierPool) -> None:
    env = make(pool)
    env.reset(seed=1)
    obs = env.step(TextAction(text="<python>print('H' * 5000 + 'T' * 5000)</python>"))
    assert "characters cut" in obs.prompt and len(obs.prompt) < 1500
    assert "HHH" in obs.prompt and "TTT" in obs.prompt


def test_tool_calls_are_limited(pool: VerifierPool) -> None:
    env = make(pool, max_tool_calls=1, format_penalty=-0.5)
    env.reset(seed=2)
    obs = env.step(TextAction(text="<python>print(1)</python>"))
    assert (obs.tool_calls_left, obs.legal_actions) == (0, ["answer"]) and "No tool calls left" in obs.prompt
    obs = env.step(TextAction(text="<python>print(2)</python>"))
    assert (obs.done, obs.reward, obs.outcome) == (True, -0.5, "tool_limit")
    assert obs.metadata["format_error"] == 1 and env.counters["tool_limits"] == 1


def test_a_reply_with_neither_tag_is_a_format_error(pool: VerifierPool) -> None:
    env = make(pool, format_penalty=-1.0)
    env.reset(seed=3)
    obs = env.step(TextAction(text="The answer is 42"))
    assert (obs.done, obs.reward, obs.outcome) == (True, -1.0, "format_error")
    assert env.counters["format_errors"] == 1


def test_step_async_runs_the_tool_like_step(pool: VerifierPool) -> None:
    env = make(pool)
    obs = env.reset(seed=4)
    obs = asyncio.run(env.step_async(TextAction(text=f"<python>{solver_code(obs.task)}</python>")))
    obs = asyncio.run(env.step_async(TextAction(text=f"<answer>{tool_stdout(obs)}</answer>")))
    assert obs.reward == 1.0


@pytest.mark.parametrize(
    ("reply", "parsed"),
    [
        ("<python>print(1)</python>", ("python", "print(1)")),
        ("think... <answer> 42 </answer> <python>x</python>", ("answer", " 42 ")),  # the first tag wins
        ("<python>\n```python\nprint(2)\n```\n</python>", ("python", "print(2)")),  # fenced inside the tag
        ("<python>print(1)", None),  # unterminated: the reply ran out of tokens
        ("just text", None),
    ],
)
def test_parse_reply(reply: str, parsed: tuple[str, str] | None) -> None:
    assert parse_reply(reply) == parsed


def test_answers_are_compared_after_normalising() -> None:
    assert normalize_answer(" 1,234,567. ", numeric=True) == "1234567"
    assert normalize_answer("'apple  banana'", numeric=False) == "apple banana"
    assert normalize_answer("a,b", numeric=False) == "a,b"


def test_registry_and_bad_arguments() -> None:
    assert isinstance(make_env("tools", max_tool_calls=2), ToolsEnv)
    with pytest.raises(UserError, match="unknown tool task kinds"):
        ToolsEnv(kinds=["multiply", "chess"])
    assert {ToolsEnv(kinds="reverse").reset(seed=s).task.split()[0] for s in range(5)} == {"What"}


def test_tool_output_is_masked_out_of_the_loss(pool: VerifierPool, tiny_model_dir: Path) -> None:
    """The tool's output is an environment turn: in the rollout, only the policy's replies are trained."""
    from inflight.models import load_tokenizer
    from inflight.rollouts.chat import ChatFormat
    from inflight.rollouts.episodes import run_scripted_episode

    chat = ChatFormat(load_tokenizer(tiny_model_dir))
    env = make(pool)
    replies: list[str] = []

    def policy(obs: ToolsObservation) -> str:
        reply = (
            f"<answer>{tool_stdout(obs).splitlines()[0]}</answer>"
            if obs.tool_output
            else f"<python>{solver_code(obs.task)}\nprint('marker-from-the-tool')</python>"
        )
        replies.append(reply)
        return reply

    rollout = run_scripted_episode(env, 7, policy, chat, max_turns=4)
    assert rollout.reward == 1.0 and len(replies) == 2
    trained = [t for t, m in zip(rollout.token_ids, rollout.loss_mask, strict=True) if m]
    assert trained == chat.assistant_reply(replies[0]) + chat.assistant_reply(replies[1])
    masked_text = chat.tokenizer.decode(
        [t for t, m in zip(rollout.token_ids, rollout.loss_mask, strict=True) if not m]
    )
    assert "marker-from-the-tool" in masked_text and "<output>" in masked_text


@pytest.mark.parametrize("asynchronous", [False, True])
def test_no_tool_call_runs_past_the_time_its_episode_has_left(asynchronous: bool) -> None:
    pool = LimitsSeen()
    env = ToolsEnv(pool=pool, limits=SandboxLimits(wall_s=3, cpu_s=3), max_tool_calls=3)
    env.reset(seed=1)
    call = TextAction(text="<python>print(1)</python>")
    for timeout_s in (None, 0.5, 60.0):  # none given, less than wall_s, more
        if asynchronous:
            asyncio.run(env.step_async(call, timeout_s=timeout_s))
        else:
            env.step(call, timeout_s=timeout_s)
    assert [limits.wall_s if limits else None for limits in pool.limits] == [3.0, 0.5, 3.0]
