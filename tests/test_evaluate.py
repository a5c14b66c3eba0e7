"""Evaluation's greedy deduplication (one generation per distinct greedy request, shared by every caller),
its bound on episodes in flight, the copy of its problem each rollout gets, how a failure names its pass,
and its progress.

Reference: a counting fake `generate` and a fake task that counts its own concurrent rollouts (pure logic:
which requests reach the engine, what each caller gets, how many episodes play at once);
docs/bring-your-own-task.md ("Each rollout gets its own deep copy of the problem dict", the progress of each
phase, the failed rollout's log line).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from inflight.config import RunConfig
from inflight.orchestrator.evaluate import episodes_in_flight, evaluate, greedy_once
from inflight.orchestrator.task import Task
from inflight.types import Completion, Rollout, SampleRequest, SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


def counting_generate(delay_s: float = 0.01) -> tuple[list[SampleRequest], object]:
    calls: list[SampleRequest] = []

    async def generate(request: SampleRequest) -> Completion:
        calls.append(request)
        await asyncio.sleep(delay_s)
        tokens = [sum(request.prompt_token_ids) % 7, 1]
        return Completion(
            request.request_id, list(request.prompt_token_ids), tokens, [-0.1, -0.2], [3, 3], "stop"
        )

    return calls, generate


def test_identical_greedy_requests_are_generated_once_and_each_caller_gets_its_own_copy() -> None:
    calls, generate = counting_generate()
    once = greedy_once(generate)  # type: ignore[arg-type]

    async def main() -> list[Completion]:
        requests = [SampleRequest([1, 2, 3], GREEDY, request_id=f"r{i}") for i in range(5)]
        requests += [SampleRequest([1, 2, 4], GREEDY, request_id="other")]
        requests += [
            SampleRequest([1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0), request_id="short")
        ]
        return await asyncio.gather(*(once(r) for r in requests))

    out = asyncio.run(main())
    assert [c.request_id for c in out] == ["r0", "r1", "r2", "r3", "r4", "other", "short"]
    assert len(calls) == 3  # [1,2,3] once, [1,2,4] once, and [1,2,3] with other parameters once
    assert all(c.token_ids == out[0].token_ids for c in out[:5]) and out[5].token_ids != out[0].token_ids
    out[0].token_ids.append(99)  # a caller that mutates its completion leaves the others theirs
    assert out[1].token_ids == [6, 1]


def test_sampled_requests_pass_through_and_a_cancelled_caller_leaves_the_others_their_result() -> None:
    calls, generate = counting_generate(delay_s=0.05)
    once = greedy_once(generate)  # type: ignore[arg-type]

    async def main() -> tuple[list[Completion], bool]:
        sampled = [
            SampleRequest([5, 5], SamplingParams(max_tokens=4, temperature=1.0, seed=i)) for i in range(3)
        ]
        first = asyncio.ensure_future(once(SampleRequest([9], GREEDY, request_id="a")))
        second = asyncio.ensure_future(once(SampleRequest([9], GREEDY, request_id="b")))
        await asyncio.sleep(0.01)
        first.cancel()  # e.g. its rollout timed out
        done = await asyncio.gather(second, *(once(r) for r in sampled))
        return list(done), first.cancelled()

    out, cancelled = asyncio.run(main())
    assert cancelled and out[0].request_id == "b" and out[0].token_ids == [2, 1]
    assert len(calls) == 1 + 3  # the shared greedy generation, and every sampled request


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({}, 128),  # the engine's rows
        ({"engine": {"max_batch_size": 16}}, 16),
        ({"engine": {"max_batch_size": 16}, "pipeline": {"engine_urls": ["http://a", "http://b"]}}, 32),
        ({"engine": {"max_batch_size": 16}, "launcher": "ray", "ray": {"num_engine_replicas": 3}}, 48),
        ({"eval": {"max_episodes_in_flight": 5}}, 5),
    ],
)
def test_episodes_in_flight_default_to_the_rows_the_engines_decode_together(overrides, expected) -> None:
    cfg = RunConfig.model_validate({"engine": {"max_batch_size": 128}} | overrides)
    assert episodes_in_flight(cfg) == expected


def test_an_evaluation_plays_at_most_the_bound_of_episodes_at_once() -> None:
    """Every problem is played (greedy and sampled), never more than `eval.max_episodes_in_flight` at a
    time: more would only queue in the engine, where a later turn loses its cached K/V."""
    playing, most = 0, 0

    async def generate_rollout(ctx, problem: dict) -> Rollout:
        nonlocal playing, most
        playing += 1
        most = max(most, playing)
        await asyncio.sleep(0.001)
        playing -= 1
        return Rollout([1], [False], [0.0], [-1], reward=float(problem["x"]))

    class Driver:
        def run(self, play):
            return asyncio.run(play(counting_generate()[1]))

    task = Task("fake", load_problems=lambda split: [], generate_rollout=generate_rollout)
    cfg = RunConfig.model_validate({"eval": {"max_episodes_in_flight": 7}})
    problems = [{"x": i} for i in range(40)]
    out = evaluate(task, problems, cfg, chat=None, driver=Driver(), num_problems=40)  # type: ignore[arg-type]
    assert most == 7
    assert out["return_greedy"] == out["return"] == sum(range(40)) / 40


class FakeDriver:
    def run(self, play):  # type: ignore[no-untyped-def]
        return asyncio.run(play(counting_generate()[1]))


def evaluate_fake(generate_rollout: Any, problems: list[dict], title: str | None = None, **cfg: Any) -> Any:
    task = Task("fake", load_problems=lambda split: [], generate_rollout=generate_rollout)
    config = RunConfig.model_validate({"recipe": "fake"} | cfg)
    return evaluate(task, problems, config, None, FakeDriver(), len(problems), title)  # type: ignore[arg-type]


def test_each_evaluation_rollout_gets_its_own_deep_copy_of_its_problem() -> None:
    """The greedy and the sampled pass, and the next evaluation, each play the problem as loaded: a rollout
    that pops its answer (before: a KeyError in every sampled rollout) or counts in a nested dict changes
    no other's."""

    async def mutates(ctx, problem: dict) -> Rollout:  # type: ignore[no-untyped-def]
        answer = problem.pop("answer")
        fresh = float(problem["tries"]["n"] == 0)
        problem["tries"]["n"] += 1
        return Rollout([1], [False], [0.0], [-1], reward=float(answer), metrics={"fresh": fresh})

    problems = [{"answer": str(i), "tries": {"n": 0}} for i in range(6)]
    for _ in range(2):
        out = evaluate_fake(mutates, problems)
        assert out["rollout_errors_greedy"] == out["rollout_errors"] == 0
        assert out["fresh_greedy"] == out["fresh"] == 1.0
        assert out["return_greedy"] == out["return"] == 2.5
    assert problems == [{"answer": str(i), "tries": {"n": 0}} for i in range(6)]


def test_a_failed_evaluation_rollout_names_its_pass(caplog: pytest.LogCaptureFixture) -> None:
    async def fails_on_2(ctx, problem: dict) -> Rollout:  # type: ignore[no-untyped-def]
        if problem["i"] == 2:
            raise KeyError("answer")
        return Rollout([1], [False], [0.0], [-1], reward=1.0)

    with caplog.at_level(logging.WARNING, logger="inflight.orchestrator.guard"):
        out = evaluate_fake(fails_on_2, [{"i": i} for i in range(4)])
    assert out["rollout_errors_greedy"] == out["rollout_errors"] == 1
    logged = [r.getMessage() for r in caplog.records if r.name == "inflight.orchestrator.guard"]
    assert logged == [
        "rollout failed (greedy evaluation): problem 2, sample 0: KeyError: 'answer'",
        "rollout failed (sampled evaluation): problem 2, sample 0: KeyError: 'answer'",
    ]


def test_an_evaluation_with_a_title_shows_its_episodes_progress(capsys: pytest.CaptureFixture[str]) -> None:
    """Without a terminal (here: captured), a line at its first episode, every tenth and its last, with the
    mean reward so far; none with progress=false, nor for an evaluation without a title (one during
    training, under the training's own progress)."""

    async def reward_i(ctx, problem: dict) -> Rollout:  # type: ignore[no-untyped-def]
        return Rollout([1], [False], [0.0], [-1], reward=1.0)

    problems = [{"i": i} for i in range(40)]
    evaluate_fake(reward_i, problems, "initial evaluation", metrics={"print_every_steps": 2})
    lines = capsys.readouterr().err.strip().splitlines()
    greedy = [line for line in lines if line.startswith("fake (initial evaluation, greedy): episode ")]
    sampled = [line for line in lines if line.startswith("fake (initial evaluation, sampled): episode ")]
    assert len(lines) == len(greedy) + len(sampled) and len(greedy) == len(sampled)
    # Every tenth of 40 episodes (4), not every print_every_steps=2: at most ~10 lines, whatever the size.
    assert [line.split(": episode ")[1].split()[0] for line in greedy] == [f"{n}/40" for n in (1, 4, 8, 12,
        16, 20, 24, 28, 32, 36, 40)]  # fmt: skip
    assert "reward +1.000" in greedy[-1] and "s/episode" in greedy[-1]

    evaluate_fake(reward_i, problems, "initial evaluation", progress=False)
    evaluate_fake(reward_i, problems)
    assert capsys.readouterr().err == ""
