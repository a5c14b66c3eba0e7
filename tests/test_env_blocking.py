"""An environment's synchronous reset/step run off the event loop in the pipeline (`play_episode`).

Before, a step that blocked (a sleep, a socket, a lock) ran on the event loop: the whole run hung, and
`rollout.timeout_s` could not fire. Now such calls run in a worker thread, one at a time per environment,
so a timeout ends the episode at once and the loop serves the other episodes meanwhile; an environment
that declares its methods quick (`blocking = False`) is called on the loop, and `step_async` is awaited
there. A worker thread stuck for good never keeps the process from exiting. Each step is told the seconds
of `rollout.timeout_s` left (OpenEnv's `step(action, timeout_s)`), unless its signature has no `timeout_s`
(the older documented `step(self, action)`), which still plays.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from inflight.config import RolloutConfig, RunConfig
from inflight.envs.base import Environment, State, TextAction, TextObservation
from inflight.models.loader import load_tokenizer
from inflight.orchestrator.guard import RolloutGuard
from inflight.orchestrator.task import env_task
from inflight.rollouts.api import RolloutContext
from inflight.rollouts.chat import ChatFormat
from inflight.rollouts.episodes import play_episode
from inflight.types import Completion, Rollout, SampleRequest, SamplingParams


@pytest.fixture(scope="module")
def chat(tiny_model_dir: Path) -> ChatFormat:
    return ChatFormat(load_tokenizer(str(tiny_model_dir)))


async def reply(request: SampleRequest) -> Completion:
    """An instant policy: one token (the end-of-turn is not needed by these environments)."""
    return Completion(request.request_id, request.prompt_token_ids, [7], [0.0], [0], "stop")


class Recorder(Environment[TextAction, TextObservation, State]):
    """Records which thread ran each call, and whether two calls of it ever overlapped."""

    def __init__(self, steps: int = 3, release: threading.Event | None = None) -> None:
        self.steps, self.release = steps, release
        self.threads: list[int] = []
        self.busy = self.overlapped = False
        self.closed = threading.Event()

    def _enter(self) -> None:
        self.overlapped |= self.busy
        self.busy = True
        self.threads.append(threading.get_ident())

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kw: Any) -> TextObservation:
        self._enter()
        self.busy = False
        return TextObservation(prompt="go")

    def step(self, action: TextAction, timeout_s: float | None = None, **kw: Any) -> TextObservation:
        self._enter()
        if self.release is not None:
            self.release.wait()  # blocks its thread until the test lets it go
        time.sleep(0.001)
        self.steps -= 1
        self.busy = False
        return TextObservation(prompt="again", done=self.steps == 0, reward=1.0)

    @property
    def state(self) -> State:
        return State()

    def close(self) -> None:
        assert not self.busy, "closed while a call of it still ran"
        self.closed.set()


def play(env: Any, chat: ChatFormat) -> Any:
    return play_episode(reply, env, 0, "g", chat, SamplingParams(max_tokens=4), max_turns=8, close=True)


def test_a_blocking_step_stalls_only_its_own_episode_and_a_timeout_ends_it(chat: ChatFormat) -> None:
    release = threading.Event()
    stuck, other = Recorder(release=release), Recorder(steps=3)

    async def run() -> tuple[float, Any]:
        t0 = time.perf_counter()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await asyncio.gather(play(stuck, chat), asyncio.sleep(10))
        waited = time.perf_counter() - t0
        return waited, await play(other, chat)  # the loop still plays episodes

    waited, rollout = asyncio.run(run())
    assert waited < 2.0 and rollout.reward == 1.0 and rollout.metrics["turns"] == 3.0
    assert not stuck.closed.is_set()  # its step still runs: closing it now would race with that step
    release.set()
    assert stuck.closed.wait(5.0)  # closed by the thread that finished the step, once it returned
    assert not stuck.overlapped


def test_calls_of_one_env_run_in_order_one_at_a_time_off_the_loop(chat: ChatFormat) -> None:
    envs = [Recorder(steps=4) for _ in range(16)]

    async def run() -> int:
        await asyncio.gather(*(play(env, chat) for env in envs))
        return threading.get_ident()

    loop_thread = asyncio.run(run())
    for env in envs:
        assert len(env.threads) == 5 and not env.overlapped and env.closed.wait(5.0)
        assert loop_thread not in env.threads


def test_an_env_that_says_it_does_not_block_and_step_async_run_on_the_loop(chat: ChatFormat) -> None:
    class Quick(Recorder):
        blocking = False

    class Async(Recorder):
        async def step_async(self, action: TextAction, **kw: Any) -> TextObservation:
            self.threads.append(threading.get_ident())
            return TextObservation(prompt="x", done=True, reward=0.5)

    quick, awaited = Quick(steps=2), Async()

    async def run() -> int:
        await play(quick, chat)
        await play(awaited, chat)
        return threading.get_ident()

    loop_thread = asyncio.run(run())
    assert quick.threads == [loop_thread] * 3 and quick.closed.is_set()  # closed inline, at once
    assert awaited.threads[1:] == [loop_thread] and awaited.threads[0] != loop_thread  # reset: a thread


def test_a_step_that_returns_no_observation_says_so(chat: ChatFormat) -> None:
    class ReturnsNone(Recorder):
        def step(self, action: TextAction, timeout_s: float | None = None, **kw: Any) -> Any:
            return None

    with pytest.raises(TypeError, match=r"^ReturnsNone\.step\(\) returned a NoneType, not an observation"):
        asyncio.run(play(ReturnsNone(), chat))


def test_a_step_stuck_for_good_does_not_keep_the_process_from_exiting(tmp_path: Path) -> None:
    """Worker threads are daemons: a ThreadPoolExecutor's would be joined at exit, forever."""
    script = tmp_path / "stuck.py"
    script.write_text(
        textwrap.dedent(
            """
            import asyncio, threading
            from inflight.rollouts.episodes import EnvCalls

            class Env:
                def step(self):
                    threading.Event().wait()  # never returns
                def close(self):
                    pass

            async def main():
                calls = EnvCalls(Env())
                try:
                    async with asyncio.timeout(0.2):
                        await calls(calls.env.step)
                except TimeoutError:
                    print("timed out", flush=True)
                calls.close()

            asyncio.run(main())
            """
        )
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == "timed out\n", done.stderr


class Timed(Recorder):
    """Records the `timeout_s` each step was given (OpenEnv's signature)."""

    def __init__(self) -> None:
        super().__init__(steps=3)
        self.timeouts: list[float | None] = []

    def step(self, action: TextAction, timeout_s: float | None = None, **kw: Any) -> TextObservation:
        self.timeouts.append(timeout_s)
        return super().step(action)


class TimedAsync(Timed):
    async def step_async(
        self, action: TextAction, timeout_s: float | None = None, **kw: Any
    ) -> TextObservation:
        return self.step(action, timeout_s)


class OlderStep(Recorder):
    """Written against the older documented signature: no `timeout_s`, no **kwargs."""

    def step(self, action: TextAction) -> TextObservation:  # type: ignore[override]
        return super().step(action)


class OlderStepAsync(OlderStep):
    async def step_async(self, action: TextAction) -> TextObservation:
        return self.step(action)


def guarded_episode(env: Environment[Any, Any, Any], chat: ChatFormat, timeout_s: float) -> Rollout | None:
    """`env` played as an Env task's rollout is, under the guard that bounds it by rollout.timeout_s."""
    cfg = RunConfig(rollout=RolloutConfig(timeout_s=timeout_s))
    task = env_task("timed", lambda: env)
    ctx = RolloutContext(reply, chat, SamplingParams(max_tokens=4), "g", 0, 0, None, cfg)
    guard = RolloutGuard(cfg.rollout, min_rollouts=1)
    rollout = asyncio.run(guard.run(task.generate_rollout, ctx, {"seed": 0, "split": "train"}))
    assert guard.failed == 0, guard.errors
    return rollout


@pytest.mark.parametrize("kind", [Timed, TimedAsync])
def test_each_step_is_told_the_seconds_left_of_rollout_timeout_s(chat: ChatFormat, kind: type[Timed]) -> None:
    env = kind()
    assert guarded_episode(env, chat, timeout_s=30.0) is not None
    left = env.timeouts
    assert len(left) == 3 and all(t is not None and 29.0 < t <= 30.0 for t in left), left
    assert left == sorted(left, reverse=True)  # the same deadline, read later each step
    # Played outside the guard, the episode has no deadline: nothing is passed.
    unbounded = kind()
    asyncio.run(play(unbounded, chat))
    assert unbounded.timeouts == [None, None, None]


@pytest.mark.parametrize("kind", [OlderStep, OlderStepAsync])
def test_a_step_without_timeout_s_in_its_signature_still_plays(
    chat: ChatFormat, kind: type[Recorder]
) -> None:
    rollout = guarded_episode(kind(), chat, timeout_s=30.0)
    assert rollout is not None and rollout.reward == 1.0 and rollout.metrics["turns"] == 3.0
