"""The rollout API (PipelineRL's shape) and the engine loop that serves it.

- ChatSession keeps a conversation as one token stream with the policy's tokens trained on;
- a rollout function takes at most grpo.max_turns policy turns (`ctx.max_turns`), as an Env episode does;
- play_episode (async, one episode) gives the same tokens as run_episodes (lockstep) for the same seeds;
- the engine loop serves concurrent callers from one continuous batch and swaps weights in flight.
"""

from __future__ import annotations

import asyncio
import math
import random
import threading
import time
from pathlib import Path

import pytest
import torch

from inflight.config import GRPOConfig, RolloutConfig, RunConfig
from inflight.envs.blackjack import BlackJackEnv
from inflight.inference.builtin import BuiltinEngine, BuiltinEngineConfig
from inflight.inference.engine_loop import EngineLoop, EngineLoopError
from inflight.models import load_model, load_tokenizer
from inflight.orchestrator.guard import RolloutGuard
from inflight.recipes import guess_number
from inflight.rollouts.api import RolloutContext, TurnLimitError, scripted_policy
from inflight.rollouts.chat import ChatFormat
from inflight.rollouts.episodes import play_episode, run_episodes
from inflight.types import Rollout, SampleRequest, SamplingParams, WeightUpdate


@pytest.fixture(scope="module")
def model_and_chat(tiny_model_dir: Path):
    torch.manual_seed(0)
    return load_model(str(tiny_model_dir)), ChatFormat(load_tokenizer(str(tiny_model_dir)))


def test_chat_session_masks_everything_but_the_policy(model_and_chat) -> None:
    _, chat = model_and_chat
    ctx = RolloutContext(scripted_policy(chat, lambda transcript: "42"), chat, SamplingParams(max_tokens=8))

    async def play():
        session = ctx.chat()
        session.user("first question")
        assert await session.assistant() == "42"
        session.user("second question")
        assert await session.assistant() == "42"
        return session.to_rollout(1.5, {"found": 1.0})

    rollout = asyncio.run(play())
    expected = (
        chat.first_turn("first question")
        + chat.assistant_reply("42")
        + chat.next_turn("second question")
        + chat.assistant_reply("42")
    )
    assert rollout.token_ids == expected
    trained = [t for t, m in zip(rollout.token_ids, rollout.loss_mask, strict=True) if m]
    assert trained == chat.assistant_reply("42") * 2
    assert rollout.reward == 1.5 and rollout.metrics == {"turns": 2.0, "found": 1.0}
    assert set(rollout.versions[i] for i, m in enumerate(rollout.loss_mask) if not m) == {-1}


def test_chat_session_refuses_out_of_order_turns(model_and_chat) -> None:
    _, chat = model_and_chat
    session = RolloutContext(scripted_policy(chat, lambda t: "1"), chat, SamplingParams()).chat()
    with pytest.raises(RuntimeError, match="needs a user"):
        asyncio.run(session.assistant())
    session.user("hello")
    with pytest.raises(RuntimeError, match="twice in a row"):
        session.user("again")


async def three_turns(ctx: RolloutContext, problem: dict) -> Rollout:
    """A rollout function that plays three turns whatever grpo.max_turns says."""
    chat = ctx.chat()
    for turn in range(3):
        chat.user(f"turn {turn}")
        await chat.assistant()
    return chat.to_rollout(1.0)


async def up_to_max_turns(ctx: RolloutContext, problem: dict) -> Rollout:
    """A rollout function that ends its loop by ctx.max_turns."""
    chat = ctx.chat()
    for turn in range(ctx.max_turns or 3):
        chat.user(f"turn {turn}")
        await chat.assistant()
    return chat.to_rollout(1.0)


def test_a_rollout_function_takes_at_most_grpo_max_turns(model_and_chat) -> None:
    """Only Env episodes were bounded: a 3-turn rollout function under grpo.max_turns=1 played 3 turns."""
    _, chat = model_and_chat
    cfg = RunConfig(grpo=GRPOConfig(max_turns=1))

    def context(config: RunConfig | None = cfg) -> RolloutContext:
        return RolloutContext(
            scripted_policy(chat, lambda t: "1"), chat, SamplingParams(max_tokens=4), config=config
        )

    guard = RolloutGuard(RolloutConfig(), min_rollouts=1)
    assert asyncio.run(guard.run(three_turns, context(), {})) is None
    assert dict(guard.errors) == {
        "TurnLimitError: the rollout asked for assistant turn 2; grpo.max_turns=1: end the rollout's loop "
        "after ctx.max_turns turns, or raise grpo.max_turns": 1
    }
    assert context().max_turns == 1
    played = asyncio.run(guard.run(up_to_max_turns, context(), {}))
    assert played is not None and played.metrics["turns"] == 1.0
    # The token level counts the same turns.
    ctx = context(RunConfig(grpo=GRPOConfig(max_turns=2)))
    prompt = chat.first_turn("hi")
    asyncio.run(ctx.generate(prompt))
    asyncio.run(ctx.generate(prompt))
    with pytest.raises(TurnLimitError, match=r"assistant turn 3; grpo.max_turns=2"):
        asyncio.run(ctx.generate(prompt))
    # A context built by hand, without a config, has no bound.
    assert context(None).max_turns is None
    assert asyncio.run(three_turns(context(None), {})).metrics["turns"] == 3.0


def test_turn_seeds_differ_by_sample_and_turn(model_and_chat) -> None:
    _, chat = model_and_chat
    a = RolloutContext(
        scripted_policy(chat, str), chat, SamplingParams(), problem_index=3, sample_index=0, sampling_seed=0
    )
    b = RolloutContext(
        scripted_policy(chat, str), chat, SamplingParams(), problem_index=3, sample_index=1, sampling_seed=0
    )
    seeds_a = [a.turn_params().seed for _ in range(3)]
    seeds_b = [b.turn_params().seed for _ in range(3)]
    assert len(set(seeds_a + seeds_b)) == 6
    unseeded = RolloutContext(scripted_policy(chat, str), chat, SamplingParams())
    assert unseeded.turn_params().seed is None


def test_play_episode_matches_run_episodes(model_and_chat) -> None:
    model, chat = model_and_chat
    config = BuiltinEngineConfig(max_batch_size=16)
    params = SamplingParams(max_tokens=4, temperature=1.0)
    seeds = [11, 12, 13, 14]
    indices = [0, 1, 0, 1]
    lockstep = run_episodes(
        BuiltinEngine(model, config=config),
        [BlackJackEnv() for _ in seeds],
        seeds,
        ["g"] * 4,
        chat,
        params,
        max_turns=6,
        sampling_seed=5,
        sample_indices=indices,
    )
    loop = EngineLoop(BuiltinEngine(model, config=config)).start()

    async def play():
        async def gen(request: SampleRequest):
            return await loop.generate(request, 60.0)

        return await asyncio.gather(
            *(
                play_episode(gen, BlackJackEnv(), s, "g", chat, params, 6, sampling_seed=5, sample_index=j)
                for s, j in zip(seeds, indices, strict=True)
            )
        )

    try:
        concurrent = asyncio.run(play())
    finally:
        loop.stop()
    for a, b in zip(lockstep, concurrent, strict=True):
        assert a.token_ids == b.token_ids
        assert a.loss_mask == b.loss_mask
        assert a.reward == b.reward
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_engine_loop_swaps_weights_in_flight(model_and_chat) -> None:
    model, _ = model_and_chat
    engine = BuiltinEngine(model, config=BuiltinEngineConfig(max_batch_size=4))
    loop = EngineLoop(engine).start()
    try:
        long = loop.submit(SampleRequest([1, 5, 6], SamplingParams(max_tokens=300, temperature=1.0, seed=1)))
        while loop.steps < 3:  # the request is decoding
            time.sleep(0.001)
        loop.update_weights(WeightUpdate(1, {k: v + 0.01 for k, v in model.state_dict().items()}))
        completion = long.result(timeout=60)
        assert completion.finish_reason == "length"
        assert completion.versions[0] == 0 and completion.versions[-1] == 1  # swapped while it ran
        assert completion.versions == sorted(completion.versions)
    finally:
        loop.stop()
    with pytest.raises(EngineLoopError, match="stopped"):
        loop.submit(SampleRequest([1, 2], SamplingParams(max_tokens=2)))


def test_engine_loop_settles_each_event_loops_callers_and_outlives_a_closed_one(model_and_chat) -> None:
    """asyncio callers are settled on their own event loop, a step's completions in one hand-over: two
    loops in two threads each get exactly their requests' completions, and a caller whose loop closed
    before its request finished (it timed out) leaves the step thread serving."""
    model, _ = model_and_chat
    loop = EngineLoop(BuiltinEngine(model, config=BuiltinEngineConfig(max_batch_size=8))).start()
    try:
        slow = SampleRequest([1, 5, 6], SamplingParams(max_tokens=200, temperature=1.0, seed=3))
        with pytest.raises(TimeoutError):
            asyncio.run(loop.generate(slow, timeout_s=0.001))
        results: dict[str, list[tuple[str, str, int]]] = {}

        def caller(name: str, seed0: int) -> None:
            async def many() -> list[tuple[str, str, int]]:
                requests = [
                    SampleRequest([1, 5 + i], SamplingParams(max_tokens=8, temperature=1.0, seed=seed0 + i))
                    for i in range(6)
                ]
                done = await asyncio.gather(*(loop.generate(r, 60.0) for r in requests))
                return [
                    (r.request_id, c.request_id, len(c.token_ids))
                    for r, c in zip(requests, done, strict=True)
                ]

            results[name] = asyncio.run(many())

        threads = [threading.Thread(target=caller, args=args) for args in (("a", 0), ("b", 100))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert sorted(results) == ["a", "b"]
        for name in "ab":
            assert len(results[name]) == 6
            assert all(sent == got and tokens >= 1 for sent, got, tokens in results[name]), results[name]
        assert loop.running and loop.error is None
        after = asyncio.run(loop.generate(SampleRequest([1, 2], SamplingParams(max_tokens=2)), 60.0))
        assert after.finish_reason in ("length", "stop")
    finally:
        loop.stop()


def test_a_cancelled_generate_stops_its_row_decoding(model_and_chat) -> None:
    """A caller cancelled mid-decode (a rollout's timeout, a shutdown) aborts its request: the row stops
    at the next step instead of decoding to max_tokens for nobody."""
    model, _ = model_and_chat
    loop = EngineLoop(BuiltinEngine(model, config=BuiltinEngineConfig(max_batch_size=2))).start()
    try:
        request = SampleRequest([1, 5, 6], SamplingParams(max_tokens=300, temperature=1.0, seed=1))

        async def cancel_mid_decode() -> int:
            task = asyncio.ensure_future(loop.generate(request, 60.0))
            while loop.steps < 3:  # decoding
                await asyncio.sleep(0.001)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return loop.steps

        steps_at_cancel = asyncio.run(cancel_mid_decode())
        deadline = time.monotonic() + 30
        while loop.engine.has_unfinished():
            assert time.monotonic() < deadline
            time.sleep(0.001)
        assert loop.steps <= steps_at_cancel + 2, (steps_at_cancel, loop.steps)  # not 300 tokens' worth
        assert loop.running and loop.error is None
    finally:
        loop.stop()


def test_engine_loop_times_out_with_a_message(model_and_chat) -> None:
    model, _ = model_and_chat
    loop = EngineLoop(BuiltinEngine(model, config=BuiltinEngineConfig(max_batch_size=2)))  # never started
    with pytest.raises(TimeoutError, match=r"did not finish within 0\.05 s"):
        asyncio.run(loop.generate(SampleRequest([1, 2], SamplingParams(max_tokens=2)), timeout_s=0.05))


def test_guess_number_rewards_and_format_errors(model_and_chat) -> None:
    _, chat = model_and_chat
    params = SamplingParams(max_tokens=6)

    def run(reply, target: int):
        ctx = RolloutContext(scripted_policy(chat, reply), chat, params)
        return asyncio.run(guess_number.generate_rollout(ctx, {"target": target}))

    guesses = iter(["512", "256", "300"])
    found = run(lambda t: next(guesses), 300)
    assert found.metrics["found"] == 1.0 and found.metrics["turns"] == 3
    assert found.reward == pytest.approx(2.0)
    bad = run(lambda t: "hit me", 300)
    assert bad.reward == guess_number.FORMAT_PENALTY and bad.metrics["format_errors"] == 1.0
    # Feedback narrows the range: 12 wrong guesses of 1 against 1024 leave 1023 numbers possible.
    stuck = run(lambda t: "1", 1024)
    assert stuck.metrics["found"] == 0.0
    assert stuck.reward == pytest.approx(1 - math.log2(1023) / 10)
    # The warm-up's scripted guesser stays consistent with the feedback it has seen.
    rng = random.Random(0)
    transcript = "500 is too low. Higher. 520 is too high. Lower."
    assert all(501 <= int(guess_number.warmup_reply(transcript, rng)) <= 519 for _ in range(50))
