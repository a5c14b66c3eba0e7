"""OpenEnv interoperability both ways, against the real openenv-core 0.3.0 package (no fakes).

(a) Our BlackJack served by `inflight env serve blackjack` (a subprocess) and played by openenv-core's
    `GenericEnvClient` and a typed `EnvClient` over /ws; every observation, reward and done flag must
    equal the local BlackJackEnv's with the same seed. HTTP routes, typed /ws errors, capacity.
(b) An environment written against openenv-core's own base classes, served by openenv-core's
    `create_app`, played by our `OpenEnvClientEnv` (`make_env("openenv:URL")`), including an env that
    raises (a counted error ends the episode; the next episode works).

Reference: openenv-core 0.3.0 `env_server/http_server.py` (routes, the /ws loop and its error codes),
`env_server/types.py` (message and error types), `env_client.py` / `generic_client.py` (clients).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.sync.client import connect

from inflight.envs import (
    ENVS,
    BlackJackEnv,
    BlackJackObservation,
    TextAction,
    episode_seeds,
    make_env,
    play_episodes,
    register_env,
)
from inflight.envs.blackjack import basic_strategy, basic_strategy_policy, play_hands
from inflight.envs.openenv_client import OpenEnvClientEnv, OpenEnvError
from inflight.envs.openenv_server import OpenEnvServerConfig, create_app, environment_types
from inflight.errors import UserError

START_TIMEOUT_S = 120.0  # a cold server imports openenv-core (Gradio): seconds, more on a loaded machine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_healthy(url: str, proc: subprocess.Popen[bytes] | None = None, log: Path | None = None) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            output = log.read_text() if log else ""
            pytest.fail(f"`inflight env serve` exited with code {proc.returncode}:\n{output}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2.0, trust_env=False).status_code == 200:
                return
        time.sleep(0.2)
    pytest.fail(f"no healthy OpenEnv server at {url}/health within {START_TIMEOUT_S} s")


@pytest.fixture(scope="module")
def blackjack_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`inflight env serve blackjack` on a free loopback port, as a user would start it."""
    port, log = _free_port(), tmp_path_factory.mktemp("env-serve") / "server.log"
    cmd = [sys.executable, "-m", "inflight.cli", "env", "serve", "blackjack", "--port", str(port)]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=os.environ | {"OMP_NUM_THREADS": "1"}
        )
    url = f"http://127.0.0.1:{port}"
    try:
        import openenv.core.generic_client  # noqa: F401  (the tests' own slow import, while the server starts)

        _wait_healthy(url, proc, log)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


@contextlib.contextmanager
def serve_in_thread(app: Any) -> Iterator[str]:
    """uvicorn in a thread on a socket bound here (no port race); stopped and joined on exit."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        _wait_healthy(url)
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()


def _wire(obs: BlackJackObservation) -> dict[str, Any]:
    """What OpenEnv's server sends as `observation`: every field but done, reward and metadata."""
    return obs.model_dump(exclude={"done", "reward", "metadata"})


def _reply(hand: int, fields: dict[str, Any]) -> str:
    """Basic strategy, except every 7th hand answers out of format (a counted, penalised format error)."""
    if hand % 7 == 6:
        return "fold"
    return basic_strategy(fields["player_total"], fields["soft"], fields["dealer_value"])


# ---------------------------------------------------------------- (a) openenv-core clients, our server


def test_generic_env_client_plays_blackjack_like_the_local_env(blackjack_url: str) -> None:
    from openenv.core import GenericEnvClient

    outcomes, steps = [], []
    with GenericEnvClient(base_url=blackjack_url).sync() as client:
        for hand, seed in enumerate(episode_seeds(30, seed=11)):
            local = BlackJackEnv()
            result, expected = client.reset(seed=seed), local.reset(seed=seed)
            n = 0
            while True:
                assert result.observation == _wire(expected)
                assert (result.reward, result.done) == (expected.reward, expected.done)
                if result.done:
                    break
                reply = _reply(hand, result.observation)
                result, expected = client.step({"text": reply}), local.step(TextAction(text=reply))
                n += 1
            assert client.state() == local.state.model_dump()
            outcomes.append(result.observation["outcome"])
            steps.append(n)
    # The hands really were multi-turn and covered the format penalty (counted in the fields, not metadata).
    assert max(steps) >= 2 and "format_error" in outcomes and "win" in outcomes


def test_typed_env_client_parses_our_observation_class(blackjack_url: str) -> None:
    from openenv.core import EnvClient
    from openenv.core.client_types import StepResult

    class BlackJackClient(EnvClient[TextAction, BlackJackObservation, dict[str, Any]]):
        def _step_payload(self, action: TextAction) -> dict[str, Any]:
            return action.model_dump()

        def _parse_result(self, payload: dict[str, Any]) -> StepResult[BlackJackObservation]:
            obs = BlackJackObservation(
                **payload["observation"], reward=payload["reward"], done=payload["done"]
            )
            return StepResult(observation=obs, reward=obs.reward, done=obs.done)

        def _parse_state(self, payload: dict[str, Any]) -> dict[str, Any]:
            return payload

    async def play(seeds: list[int]) -> list[float]:
        returns = []
        async with BlackJackClient(base_url=blackjack_url) as client:
            for seed in seeds:
                local, result = BlackJackEnv(), await client.reset(seed=seed)
                expected = local.reset(seed=seed)
                while True:
                    # Everything the policy needs arrives in fields: the wire form parses back as our class.
                    assert result.observation.model_dump(exclude={"metadata"}) == expected.model_dump(
                        exclude={"metadata"}
                    )
                    if result.done:
                        break
                    action = TextAction(text=basic_strategy_policy(result.observation))
                    result, expected = await client.step(action), local.step(action)
                returns.append(result.reward or 0.0)
        return returns

    seeds = episode_seeds(12, seed=5)
    assert asyncio.run(play(seeds)) == play_hands(basic_strategy_policy, seeds)


def test_http_routes_follow_openenv(blackjack_url: str) -> None:
    http = httpx.Client(base_url=blackjack_url, timeout=10.0, trust_env=False)
    assert http.get("/health").json() == {"status": "healthy"}
    schema = http.get("/schema").json()
    assert schema["action"] == TextAction.model_json_schema()
    assert schema["observation"] == BlackJackObservation.model_json_schema()
    meta = http.get("/metadata").json()
    assert meta["name"] == "blackjack" and meta["description"]
    assert http.get("/state").json()["step_count"] == 0

    # HTTP /reset is stateless (a fresh env per request) and takes the env's own reset arguments.
    reset = http.post("/reset", json={"seed": 42})
    assert reset.status_code == 200
    expected = BlackJackEnv().reset(seed=42)
    assert reset.json() == {"observation": _wire(expected), "reward": expected.reward, "done": expected.done}
    cards = ["10", "6", "9", "7", "5"]
    assert http.post("/reset", json={"cards": cards}).json()["observation"] == _wire(
        BlackJackEnv().reset(cards=cards)
    )

    # Bad input: clear errors, and the server keeps serving.
    step = http.post("/step", json={"action": {"text": "hit"}})
    assert step.status_code == 409 and "/ws" in step.json()["detail"]  # no episode: HTTP /step is stateless
    assert http.post("/step", json={"action": {"txt": "hit"}}).status_code == 422
    bad_kwarg = http.post("/reset", json={"seed": 1, "deck": 2})  # the env's own UserError, as a 422
    assert bad_kwarg.status_code == 422 and "deck" in bad_kwarg.json()["detail"][0]["msg"]
    assert http.post("/reset", json={"seed": -1}).status_code == 422
    crash = http.post("/reset", json={"cards": ["A", "K"]})  # the env raises: four cards are dealt
    assert crash.status_code == 500 and "ran out" in crash.json()["detail"]
    assert (
        http.post("/reset", content=b"{not json", headers={"content-type": "application/json"}).status_code
        == 422
    )
    assert http.get("/health").status_code == 200


def test_malformed_ws_messages_get_typed_errors_and_the_session_lives_on(blackjack_url: str) -> None:
    from openenv.core.env_server.types import WSErrorCode, WSErrorResponse, WSObservationResponse

    ws_url = blackjack_url.replace("http://", "ws://") + "/ws"

    def ask(ws: Any, message: str | dict[str, Any]) -> Any:
        ws.send(message if isinstance(message, str) else json.dumps(message))
        raw = ws.recv(timeout=10)
        answer = json.loads(raw)
        model = WSErrorResponse if answer["type"] == "error" else WSObservationResponse
        return model.model_validate_json(raw)  # every answer is one of openenv-core's typed messages

    with connect(ws_url, proxy=None) as ws:
        assert ask(ws, "{not json").data["code"] == WSErrorCode.INVALID_JSON
        assert ask(ws, {"type": "dance"}).data["code"] == WSErrorCode.UNKNOWN_TYPE
        assert ask(ws, {"type": "reset", "data": {"seed": -1}}).data["code"] == WSErrorCode.VALIDATION_ERROR
        bad_kwarg = ask(ws, {"type": "reset", "data": {"seed": 1, "deck": 2}}).data
        assert bad_kwarg["code"] == WSErrorCode.VALIDATION_ERROR and "deck" in bad_kwarg["errors"][0]["msg"]
        no_episode = ask(ws, {"type": "step", "data": {"text": "hit"}}).data
        assert no_episode["code"] == WSErrorCode.EXECUTION_ERROR and "reset" in no_episode["message"]

        local = BlackJackEnv()
        seed = next(s for s in episode_seeds(50, seed=3) if not BlackJackEnv().reset(seed=s).done)
        assert ask(ws, {"type": "reset", "data": {"seed": seed}}).data["observation"] == _wire(
            local.reset(seed=seed)
        )
        for malformed in ({"txt": "hit"}, {"text": 3}, {"text": "hit", "extra": 1}):
            error = ask(ws, {"type": "step", "data": malformed}).data
            assert error["code"] == WSErrorCode.VALIDATION_ERROR and error["errors"]
        # The same session continues the same hand after the rejected actions.
        answer = ask(ws, {"type": "step", "data": {"text": "stand"}}).data
        expected = local.step(TextAction(text="stand"))
        assert answer == {"observation": _wire(expected), "reward": expected.reward, "done": True}
        assert ask(ws, {"type": "step", "data": {"text": "hit"}}).data["code"] == WSErrorCode.EXECUTION_ERROR
    assert httpx.get(f"{blackjack_url}/health", trust_env=False).status_code == 200


def test_our_client_plays_our_server_like_the_local_env(blackjack_url: str) -> None:
    seeds = episode_seeds(40, seed=21)
    remote = play_episodes(
        lambda: make_env(f"openenv:{blackjack_url}"),
        lambda batch: [_reply(i, obs.fields) for i, obs in enumerate(batch)],
        seeds,
        batch_size=8,  # eight /ws sessions at once
    )
    local = play_episodes(
        BlackJackEnv,
        lambda batch: [_reply(i, _wire(obs)) for i, obs in enumerate(batch)],
        seeds,
        batch_size=8,
    )
    assert remote == local
    env, expected = OpenEnvClientEnv(blackjack_url), BlackJackEnv().reset(seed=seeds[0])
    obs = env.reset(seed=seeds[0])
    assert (obs.prompt, obs.fields, obs.done) == (expected.prompt, _wire(expected), expected.done)
    with pytest.raises(UserError, match=r"VALIDATION_ERROR.*deck"):  # our bug, not the env's: raised
        env.reset(seed=1, deck=2)
    env.close()


def test_over_capacity_is_a_clear_error_and_the_server_recovers() -> None:
    with serve_in_thread(create_app("blackjack", OpenEnvServerConfig(max_sessions=1))) as url:
        first, second = OpenEnvClientEnv(url), OpenEnvClientEnv(url)
        first.reset(seed=1)
        with pytest.raises(OpenEnvError, match="CAPACITY_REACHED"):
            second.reset(seed=2)
        first.close()
        deadline = time.monotonic() + 10.0  # the server frees the slot once it sees the close
        while True:
            try:
                assert second.reset(seed=2).prompt
                break
            except OpenEnvError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        second.close()


@pytest.mark.parametrize("name", sorted(ENVS))
def test_every_registered_env_is_served_as_it_plays_locally(name: str) -> None:
    from fastapi.testclient import TestClient

    def wire(obs: Any) -> dict[str, Any]:
        return {
            "observation": obs.model_dump(exclude={"done", "reward", "metadata"}),
            **obs.model_dump(include={"reward", "done"}),
        }

    local = make_env(name)
    action_cls, observation_cls, _ = environment_types(type(local))
    with TestClient(create_app(name)) as http, http.websocket_connect("/ws") as ws:
        schema = http.get("/schema").json()
        assert (schema["action"], schema["observation"]) == (
            action_cls.model_json_schema(),
            observation_cls.model_json_schema(),
        )
        ws.send_json({"type": "reset", "data": {"seed": 3}})
        expected = local.reset(seed=3)
        assert ws.receive_json() == {"type": "observation", "data": wire(expected)}
        if not expected.done:
            ws.send_json({"type": "step", "data": {"text": "42"}})
            assert ws.receive_json() == {
                "type": "observation",
                "data": wire(local.step(TextAction(text="42"))),
            }
    local.close()


def test_an_env_with_the_older_step_signature_is_served() -> None:
    """`step(self, action)`, as inflight documented it before OpenEnv's `timeout_s`: stepped without it."""
    from fastapi.testclient import TestClient

    class OlderStep(BlackJackEnv):
        def step(self, action: TextAction) -> BlackJackObservation:  # type: ignore[override]
            return super().step(action)

    seed = next(s for s in range(100) if not BlackJackEnv().reset(seed=s).done)
    register_env("older-step", OlderStep)
    try:
        with TestClient(create_app("older-step")) as http, http.websocket_connect("/ws") as ws:
            ws.send_json({"type": "reset", "data": {"seed": seed}})
            assert ws.receive_json()["type"] == "observation"
            ws.send_json({"type": "step", "data": {"text": "stand"}})
            answer = ws.receive_json()
            assert answer["type"] == "observation" and answer["data"]["done"], answer
    finally:
        ENVS.pop("older-step")


def test_environment_types_follow_generic_subclasses() -> None:
    from typing import Generic, TypeVar

    from inflight.envs import Environment, State, TextObservation

    obs_t, state_t = TypeVar("obs_t", bound=TextObservation), TypeVar("state_t", bound=State)

    class TextGame(Environment[TextAction, obs_t, state_t], Generic[obs_t, state_t]):
        pass

    class Leaf(TextGame[BlackJackObservation, State]):
        pass

    class Subclass(BlackJackEnv):
        pass

    assert environment_types(Leaf) == (TextAction, BlackJackObservation, State)
    assert environment_types(Subclass) == environment_types(BlackJackEnv)
    with pytest.raises(UserError, match="must declare its types"):
        environment_types(TextGame)


def test_create_app_rejects_unknown_names_and_arguments() -> None:
    with pytest.raises(UserError, match="unknown environment"):
        create_app("no-such-env")
    with pytest.raises(TypeError):
        create_app("blackjack", no_such_argument=1)


# ---------------------------------------------------------------- (b) our client, openenv-core's server


def _spell_app() -> Any:
    """An env written against openenv-core's base classes, served by openenv-core's own create_app."""
    from openenv.core.env_server import create_app as openenv_create_app
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action, Observation, State

    class SpellAction(Action):
        word: str

    class SpellObservation(Observation):
        instruction: str
        tries_left: int

    class SpellEnv(Environment):
        """Type the word of the seed within three tries. `boom` makes step raise, seed 13 makes reset raise,
        `slow` makes step take 2 s."""

        SUPPORTS_CONCURRENT_SESSIONS = True
        WORDS = ("apple", "river", "stone")

        def reset(
            self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
        ) -> SpellObservation:
            if seed == 13:
                raise ValueError("seed 13 is cursed")
            self.word, self.tries = self.WORDS[(seed or 0) % 3], 3
            self._state = State(episode_id=episode_id)
            return SpellObservation(instruction=f"Type the word {self.word}.", tries_left=3)

        def step(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> SpellObservation:
            if action.word == "boom":
                raise RuntimeError("the env blew up")
            if action.word == "slow":
                time.sleep(2.0)
            self._state.step_count += 1
            self.tries -= 1
            if action.word.strip() == self.word:
                return SpellObservation(instruction="Correct.", tries_left=self.tries, done=True, reward=1.0)
            done = self.tries == 0
            return SpellObservation(
                instruction=f"No. Type the word {self.word}.",
                tries_left=self.tries,
                done=done,
                reward=0.0 if done else None,
            )

        @property
        def state(self) -> State:
            return self._state

    return openenv_create_app(SpellEnv, SpellAction, SpellObservation, max_concurrent_envs=8)


@pytest.fixture(scope="module")
def spell_url() -> Iterator[str]:
    if os.environ.get("ENABLE_WEB_INTERFACE", "").lower() in ("1", "true", "yes"):
        pytest.fail("unset ENABLE_WEB_INTERFACE: these tests serve openenv-core's plain API app")
    with serve_in_thread(_spell_app()) as url:
        yield url


def test_our_client_plays_an_openenv_core_env(spell_url: str) -> None:
    env = make_env(f"openenv:{spell_url}", prompt_field="instruction")  # action field `word` from /schema
    obs = env.reset(seed=1)
    assert (obs.prompt, obs.fields, obs.done) == (
        "Type the word river.",
        {"instruction": obs.prompt, "tries_left": 3},
        False,
    )
    obs = env.step(TextAction(text="rover"))
    assert (obs.prompt, obs.fields["tries_left"], obs.done, obs.reward) == (
        "No. Type the word river.",
        2,
        False,
        None,
    )
    obs = env.step(TextAction(text="river"))
    assert (obs.done, obs.reward) == (True, 1.0)
    assert env.state.step_count == 2

    obs = env.reset(seed=2)  # the same session, a new episode that runs out of tries
    for _ in range(3):
        obs = env.step(TextAction(text="pebble"))
    assert (obs.done, obs.reward, obs.fields["tries_left"]) == (True, 0.0, 0)
    with pytest.raises(RuntimeError, match="before reset"):
        env.step(TextAction(text="stone"))
    env.close()

    # Without prompt_field the policy reads every field the server sent, as JSON.
    plain = OpenEnvClientEnv(spell_url)
    obs = plain.reset(seed=0)
    assert json.loads(obs.prompt) == obs.fields == {"instruction": "Type the word apple.", "tries_left": 3}
    plain.close()


def test_an_env_that_raises_ends_the_episode_counted_and_the_next_one_works(spell_url: str) -> None:
    env = OpenEnvClientEnv(spell_url, prompt_field="instruction", error_reward=-0.5)
    env.reset(seed=0)
    obs = env.step(TextAction(text="boom"))
    assert (obs.done, obs.reward, obs.metadata) == (True, -0.5, {"env_error": 1})
    assert "the env blew up" in obs.prompt
    with pytest.raises(RuntimeError, match="before reset"):
        env.step(TextAction(text="apple"))
    broken_reset = env.reset(seed=13)
    assert broken_reset.done and "cursed" in broken_reset.prompt
    obs = env.reset(seed=0)
    assert not obs.done and env.step(TextAction(text="apple")).reward == 1.0
    assert env.counters == {"episodes": 3, "steps": 2, "env_errors": 2}
    env.close()

    # In a batch of episodes, the failed ones count with the error reward and the others play on.
    def policy(batch: list[Any]) -> list[str]:
        return [
            "boom" if obs.fields["instruction"].endswith("river.") else obs.prompt.split()[-1][:-1]
            for obs in batch
        ]

    make = lambda: OpenEnvClientEnv(spell_url, prompt_field="instruction", error_reward=-0.5)  # noqa: E731
    assert play_episodes(make, policy, [0, 1, 2, 4], batch_size=4) == [1.0, -0.5, 1.0, -0.5]


def test_client_errors_are_clear_and_name_the_server(spell_url: str) -> None:
    with pytest.raises(UserError, match="must look like http://host:port"):
        OpenEnvClientEnv("localhost:8200")
    dead = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(OpenEnvError, match=dead.replace("http", "ws")):
        OpenEnvClientEnv(dead, connect_timeout_s=5).reset(seed=0)
    with pytest.raises(UserError, match="VALIDATION_ERROR"):
        env = OpenEnvClientEnv(spell_url, action_field="text")
        env.reset(seed=0)
        env.step(TextAction(text="apple"))
    with pytest.raises(UserError, match="no field 'prompt'"):
        OpenEnvClientEnv(spell_url, prompt_field="prompt").reset(seed=0)

    env = OpenEnvClientEnv(spell_url, prompt_field="instruction", message_timeout_s=0.5)
    env.reset(seed=0)
    with pytest.raises(OpenEnvError, match=r"no answer .* to step within 0.5 s"):
        env.step(TextAction(text="slow"))
    assert env.reset(seed=1).prompt == "Type the word river."  # a fresh session after the lost one

    env._ws.close()  # the connection ends between episodes (as when the server restarts)
    assert env.reset(seed=2).prompt == "Type the word stone."
    env._ws.close()  # ... or within one: that episode cannot go on
    with pytest.raises(OpenEnvError, match="closed the session during step"):
        env.step(TextAction(text="stone"))
    env.close()


def test_a_steps_timeout_bounds_the_wait_and_never_lengthens_message_timeout_s(spell_url: str) -> None:
    env = OpenEnvClientEnv(spell_url, prompt_field="instruction", message_timeout_s=0.5)
    env.reset(seed=0)
    with pytest.raises(OpenEnvError, match=r"to step within 0\.5 s \(message_timeout_s\)"):
        env.step(TextAction(text="slow"), timeout_s=30.0)  # the episode has longer: the client's bound holds
    env.close()
    env = OpenEnvClientEnv(spell_url, prompt_field="instruction")  # message_timeout_s: 60 s
    env.reset(seed=0)
    with pytest.raises(OpenEnvError, match=r"to step within 0\.5 s \(the step's timeout_s\)"):
        env.step(TextAction(text="slow"), timeout_s=0.5)  # the episode has 0.5 s left
    env.close()


def test_inflight_run_trains_on_a_remote_openenv_server(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`inflight run openenv:URL` (issue 14): a remote server is a task like any other, a few steps of it."""
    from inflight.cli import main

    with serve_in_thread(create_app("blackjack", OpenEnvServerConfig(max_sessions=32))) as url:
        argv = ["run", f"openenv:{url}", f"model.path={tiny_model_dir}", "progress=false", "grpo.steps=2"]
        argv += ["grpo.prompts_per_step=2", "grpo.group_size=2", "pipeline.max_groups_in_flight=4"]
        argv += ["sampling.max_tokens_per_turn=4", "eval.num_episodes=4", "--run-dir", str(tmp_path / "run")]
        assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (summary["recipe"], summary["steps"], summary["eval_problems"]) == ("openenv", 2, 4)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["phase"] == "train"] == [0, 1]
    assert all(r["rollout_errors"] == 0 for r in rows if r["phase"] == "train")


def test_remote_observations_read_their_fields_as_attributes() -> None:
    """Task code reads `obs.legal_actions` of a local observation: a remote one reads the same way, its own
    attributes first, and a field it lacks is an AttributeError as it would be locally."""
    from inflight.envs.openenv_client import RemoteObservation

    fields = {"legal_actions": ["hit", "stand"], "player_total": 13, "prompt": "sent", "done": True}
    obs = RemoteObservation(prompt="Your total is 13.", fields=fields)
    assert (obs.legal_actions, obs.player_total) == (["hit", "stand"], 13)
    assert (obs.prompt, obs.done) == ("Your total is 13.", False)  # the client's, not the fields'
    assert getattr(obs, "outcome", None) is None and not hasattr(obs, "outcome")
    with pytest.raises(AttributeError, match="outcome"):
        _ = obs.outcome
    assert obs.model_copy().legal_actions == ["hit", "stand"]


def test_the_documented_run_on_a_served_recipe_env_warms_up_and_trains(
    blackjack_url: str, tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/environments.md: `inflight env serve blackjack` then `inflight run blackjack
    env.name=openenv:URL`, a few steps. The recipe's warm-up plays the remote env with its legal actions
    (`obs.legal_actions`, sent among the observation's fields), as it does the local one."""
    from inflight.cli import main

    argv = ["run", "blackjack", f"env.name=openenv:{blackjack_url}", f"model.path={tiny_model_dir}"]
    argv += ["progress=false", "warmup.sft_steps=2", "grpo.steps=2", "grpo.prompts_per_step=2"]
    argv += [
        "grpo.group_size=2",
        "eval.num_episodes=4",
        "eval.num_episodes_sampled=0",
        "--run-dir",
        str(tmp_path),
    ]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (summary["recipe"], summary["steps"], summary["stopped"]) == ("blackjack", 2, None)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["phase"] == "warmup"] == [0, 1]
    assert [r["step"] for r in rows if r["phase"] == "train"] == [0, 1]
    assert all(r["rollout_errors"] == 0 for r in rows if r["phase"] == "train")
