"""`inflight run TARGET launcher=ray` on a real local Ray cluster (no mocks): BlackJack runs to completion
with the summary keys of a local run, and a SIGKILLed engine replica is restarted by Ray and brought up to
date while the run goes on (issue 13 items 4 and 5). Also: bad input to the launcher is one line; SIGTERM
stops a run (or drains a service) on a Ray of its own gracefully; a stop while Ray places the actors ends the
wait; an address that is no Ray head, a token a cluster wants (`ray start --head`), GPUs a cluster lacks:
each one line, within a bounded wait.

Reference: the local launcher's run of the same configuration (`orchestrator/run.py`); Ray 2.x actor fault
tolerance (an actor with max_restarts is re-created by rerunning its constructor).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from inflight.api.access_log import REQUEST_LOGGER
from inflight.cli import main
from inflight.config import apply_overrides
from inflight.errors import UserError
from inflight.inference.access import API_KEY_ENV
from inflight.inference.scratch import ScratchDirectory
from inflight.launch.ray import RAY_MISSING, bundles
from inflight.launch.ray.replicas import replica_socket
from inflight.orchestrator.target import resolve_target
from inflight.trainer.checkpoint import checkpoint_step

pytestmark = pytest.mark.slow
RAY_TEMP_PREFIX = "inflight-ray"  # the private Rays' temp dirs (`ray_temp_dir`)


def tiny_run(model_dir: Path, steps: int, warmup_steps: int = 0) -> list[str]:
    """A BlackJack run of a few seconds, a small evaluation. From `warm_tiny_model_dir` (conftest: the
    format warm-up trained once a session) its groups carry signal without a warm-up of its own."""
    return [
        "progress=false",
        f"model.path={model_dir}",
        f"warmup.sft_steps={warmup_steps}",
        "warmup.sft_batch_size=32",
        f"grpo.steps={steps}",
        "grpo.prompts_per_step=4",
        "grpo.group_size=4",
        "eval.num_episodes=8",
        "pipeline.active_sampling=false",
    ]


@pytest.fixture(autouse=True)
def own_engine_key() -> Iterator[None]:
    """The replicas' key a launcher makes for its process ($INFLIGHT_ENGINE_API_KEY, `engine_key_env`)
    stays this test's: later tests' serve-engine subprocesses, which inherit the environment, would
    otherwise want it from clients that never had it. (monkeypatch.delenv records nothing to undo for a
    variable that is not set yet.)"""
    before = os.environ.pop(API_KEY_ENV, None)
    try:
        yield
    finally:
        os.environ.pop(API_KEY_ENV, None)
        if before is not None:
            os.environ[API_KEY_ENV] = before


def ray_temp_dir() -> ScratchDirectory:
    """A private Ray's temp directory (its session's logs and sockets, ~225 KB): in /tmp, short (Ray's socket
    paths must stay < 108 characters), and removed however this process ends (`ScratchDirectory`'s watcher,
    else the next one's sweep). A `tempfile.mkdtemp(prefix="ray-")` stayed behind whenever pytest was
    killed, and always for SERVE_ON_A_RAY_WITH_GPUS's child, which makes its own the same way."""
    return ScratchDirectory("/tmp", prefix=RAY_TEMP_PREFIX)


def wait_gone(path: Path, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    return not path.exists()


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    """A private local Ray (two logical CPUs, its own temp dir), shut down after this module's tests."""
    import ray

    temp_dir = ray_temp_dir()
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        _temp_dir=str(temp_dir.path),
    )
    try:
        yield ray
    finally:
        ray.shutdown()
        temp_dir.close()


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str, exit_code: int = 0) -> dict[str, Any]:
    capsys.readouterr()
    assert main(list(argv)) == exit_code
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def stop_the_run_once(
    run_dir: Path, seen: Callable[[list[dict[str, Any]]], bool], run_over: threading.Event
) -> threading.Thread:
    """A started thread that sends this process SIGINT (Ctrl-C: the launcher forwards it to the run's actor,
    which stops after its step in flight) once `seen(train rows)` holds: a run sized to outlast a
    restart on a slow machine ends as soon as the test has seen what it is for. Never once `run_over` is
    set (the test sets it when the command returns): a Ctrl-C outside the run would end the test session."""

    def watch() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not run_over.is_set():
            with contextlib.suppress(OSError, json.JSONDecodeError, KeyError):
                if seen(metrics_rows(run_dir, "train")) and not run_over.is_set():
                    os.kill(os.getpid(), signal.SIGINT)
                    return
            time.sleep(0.2)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def metrics_rows(run_dir: Path, phase: str) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["phase"] == phase]


def kill_after_a_checkpoint(ray: Any, run_dir: Path, actor: str) -> threading.Thread:
    """A thread that `ray.kill`s the run's actor named RUN_NAME:`actor` once step 3 is logged (so that step
    2's checkpoint, `checkpoint_every_steps=2`, is on disk)."""

    def kill() -> None:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, json.JSONDecodeError):
                if len(metrics_rows(run_dir, "train")) >= 3:
                    break
            time.sleep(0.1)
        ray.kill(ray.get_actor(f"{run_dir.name}:{actor}"))

    killer = threading.Thread(target=kill, daemon=True)
    killer.start()
    return killer


def sigkill_after_the_first_step(
    ray: Any,
    run_dir: Path,
    actor: str,
    ask_pid: Callable[[Any], Any],
    pid_of: Callable[[Any], int],
) -> tuple[threading.Thread, dict[str, int]]:
    """A started thread that SIGKILLs a process of actor RUN_NAME:`actor` once the run has logged its first
    step: a crash, not a polite exit. `ask_pid(handle)` is the actor call whose answer `pid_of` reads the
    pid from; the pid killed lands in the returned dict."""
    killed: dict[str, int] = {}

    def kill() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not metrics_rows_or_none(run_dir):
            time.sleep(0.1)
        killed["pid"] = pid_of(ray.get(ask_pid(ray.get_actor(f"{run_dir.name}:{actor}"))))
        os.kill(killed["pid"], signal.SIGKILL)

    killer = threading.Thread(target=kill, daemon=True)
    killer.start()
    return killer, killed


def wait_until_released(ray: Any) -> None:
    """The run's actors and placement group are gone (Ray frees them asynchronously)."""
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU") != 2:
        assert time.monotonic() < deadline, ray.available_resources()
        time.sleep(0.2)


def test_blackjack_through_ray_has_the_summary_of_a_local_run(
    ray_cluster: Any, warm_tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    overrides = tiny_run(warm_tiny_model_dir, steps=4)
    local = run_cli(capsys, "run", "blackjack", *overrides, "--run-dir", str(tmp_path / "local"))
    on_ray = run_cli(
        capsys, "run", "blackjack", *overrides, "launcher=ray", "--run-dir", str(tmp_path / "ray")
    )

    assert list(on_ray) == list(local)  # the same keys, in the same order
    assert on_ray["steps"] == 4 and on_ray["eval_problems"] == 8
    train = metrics_rows(tmp_path / "ray", "train")
    assert len(train) == 4
    assert any("loss" in r for r in train), "at least one step must have trained"
    # The replica sampled every rollout, with weights the trainer published (lag within the bound).
    assert train[-1]["replicas/calls"] > 0 and train[-1]["version"] >= 1
    assert all(r["lag_steps_max"] <= 1 for r in train)
    assert train[-1]["engine_replica_restarts"] == 0 and train[-1]["engine_replicas_up"] == 1
    assert list((tmp_path / "ray" / "weights").glob("weights-*.safetensors")), "weights went by file"
    assert (tmp_path / "ray" / "checkpoint" / "model.safetensors").is_file()
    wait_until_released(ray_cluster)


def test_a_killed_engine_replica_is_restarted_and_the_run_goes_on(
    ray_cluster: Any, warm_tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    # Steps of ~0.1-0.15 s (replicas' requests batched): the run lasts ~30-45 s after the kill, of which
    # Ray's restart of the replica took 11-17 s here (load 4-8 on 2 cores), and the client sees it back
    # within its health_interval_s (2 s). 100 steps ended before the recovery once requests were batched.
    steps = 300
    killed: dict[str, float] = {}
    run_over = threading.Event()

    def kill_replica_0_after_the_first_step() -> None:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            try:
                if metrics_rows(run_dir, "train"):
                    break
            except (OSError, json.JSONDecodeError):  # not written yet, or a line half written
                pass
            time.sleep(0.1)
        replica = ray_cluster.get_actor(f"{run_dir.name}:engine-0")
        pid = ray_cluster.get(replica.info.remote()).pid
        os.kill(pid, signal.SIGKILL)  # a crash, not a polite exit: Ray must restart it
        killed["pid"], killed["at"] = pid, time.monotonic()
        while not run_over.is_set():  # for the failure message: how long the restart took
            try:
                if ray_cluster.get(replica.info.remote(), timeout=5).pid != pid:
                    killed["restart_s"] = time.monotonic() - killed["at"]
                    return
            except ray_cluster.exceptions.RayError:
                time.sleep(0.2)

    killer = threading.Thread(target=kill_replica_0_after_the_first_step, daemon=True)
    killer.start()

    def recovered_and_trained_on(train: list[dict[str, Any]]) -> bool:  # 10 steps after the recovery
        # Both counts: the client's recovery and the launcher's restart come from two watchers that poll
        # on their own clocks; once, in a full `make test`, the run stopped between the two.
        return any(
            r["replicas/recoveries"] >= 1 and r.get("engine_replica_restarts", 0) >= 1 for r in train[:-10]
        )

    stopper = stop_the_run_once(run_dir, recovered_and_trained_on, run_over)
    try:
        summary = run_cli(
            capsys,
            "run",
            "blackjack",
            *tiny_run(warm_tiny_model_dir, steps),
            "launcher=ray",
            "ray.num_engine_replicas=2",
            "ray.engine_cpus=0.5",
            "--run-dir",
            str(run_dir),
            exit_code=128 + signal.SIGINT,
        )
    finally:
        run_over.set()
    killer.join(30)
    stopper.join(5)
    assert killed, "the replica was never killed"

    assert summary["stopped"] == "SIGINT" and summary["steps"] < steps, summary  # Ctrl-C reached the actor
    steps = summary["steps"]
    train = metrics_rows(run_dir, "train")
    assert len(train) == steps
    assert checkpoint_step(run_dir / "checkpoint") == steps  # the stop's checkpoint, a resume's start
    last = train[-1]
    # Calls in flight on the dead replica failed over to the other one; it was marked down, and back up.
    assert last["replicas/replica_failures"] >= 1, last
    assert last["replicas/recoveries"] >= 1, (killed, last)  # the run must outlast the restart
    # Ray restarted it (a new process at the same URL), counted by the launcher; both serve at the end.
    assert last["engine_replica_restarts"] == 1, last
    assert last["engine_replicas_up"] == 2, last
    assert sum(1 for r in train if "loss" in r) >= steps // 2, "training went on"
    # Brought up to date before it served again: tokens sampled by the trainer's current weights agree
    # with the trainer on every step after the recovery (a replica left on the model from disk would not).
    recovered_at = next(r["step"] for r in train if r["replicas/recoveries"] >= 1)
    parity = [r["logprob_parity_max_abs"] for r in train[recovered_at:] if r.get("logprob_parity_token_frac")]
    assert parity and max(parity) < 1e-3, parity
    # Nothing was lost to the crash: every step had a full batch (a failed rollout would be counted).
    assert last["rollout_errors"] == 0, last


def test_vllm_replicas_on_ray_sample_the_trainers_weights_and_a_killed_vllm_process_is_restarted(
    ray_cluster: Any, warm_tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`launcher=ray engine.backend=vllm`: the replica actor runs vLLM's serve-engine (in the vLLM
    environment) on its bundle's port and reads weights only from the run's weights directory. Its vLLM
    process SIGKILLed after the first step: the actor starts it again on the same port
    (engine.max_restarts), the pipeline's client waits out the outage (its only replica) and brings the new
    process up to date, and the run ends with every step trained on sampler logprobs equal to the
    trainer's."""
    from conftest import require_vllm_env

    require_vllm_env()
    run_dir = tmp_path / "run"
    steps = 12
    # The replica actor's info() names its vLLM process.
    killer, killed = sigkill_after_the_first_step(
        ray_cluster, run_dir, "engine-0", lambda replica: replica.info.remote(), lambda info: info.pid
    )
    summary = run_cli(
        capsys, "run", "blackjack", *tiny_run(warm_tiny_model_dir, steps), "launcher=ray",
        "engine.backend=vllm", "pipeline.max_staleness_steps=0", "--run-dir", str(run_dir),
    )  # fmt: skip
    killer.join(30)
    assert killed, "the vLLM process was never killed"
    assert summary["steps"] == steps
    train = metrics_rows(run_dir, "train")
    last = train[-1]
    assert last["engine_replica_restarts"] == 1 and last["engine_replicas_up"] == 1, last
    assert last["replicas/recoveries"] >= 1 and last["rollout_errors"] == 0, last
    # On-policy: vLLM's logprobs equal the trainer's on every step, after the restart too (a process left
    # on the model from disk would differ by ~1e-1).
    diffs = [r["logprob_diff_max_abs"] for r in train if "logprob_diff_max_abs" in r]
    assert len(diffs) >= steps // 2 and max(diffs) < 1e-4, diffs
    assert list((run_dir / "weights").glob("weights-*.safetensors")), "weights went by file"
    wait_until_released(ray_cluster)


def metrics_rows_or_none(run_dir: Path) -> list[dict[str, Any]] | None:
    try:
        return metrics_rows(run_dir, "train")
    except (OSError, json.JSONDecodeError):  # not written yet, or a line half written
        return None


def test_the_code_recipes_sandboxes_run_in_a_verifier_actor(
    ray_cluster: Any, tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`ray.num_verifier_actors=1`: every sandboxed execution of the code recipe (the warm-up's, the
    rollouts', the evaluations') runs in the verifier actor's pool, none beside the trainer."""
    run_dir = tmp_path / "run"
    summary = run_cli(
        capsys, "run", "code", "progress=false", f"model.path={tiny_model_dir}", "warmup.sft_steps=2",
        "warmup.sft_batch_size=4", "grpo.steps=2", "grpo.prompts_per_step=2", "grpo.group_size=2",
        "eval.num_episodes=2", "launcher=ray", "ray.num_verifier_actors=1", "ray.verifier_cpus=0.5",
        "ray.engine_cpus=0.5", "--run-dir", str(run_dir),
    )  # fmt: skip
    assert summary["steps"] == 2
    last = metrics_rows(run_dir, "train")[-1]
    # 2 prompts x 2 samples a step, each reply's tests in the sandbox (a reply without code runs none).
    assert last["verifiers/completed"] == last["verifiers/submitted"] > 0, last
    assert last["verifiers/actor_failures"] == last["verifiers/wait_timeouts"] == 0, last
    wait_until_released(ray_cluster)


def test_a_verifier_actors_job_outlives_a_restart_and_a_dead_actor_is_a_counted_result(
    ray_cluster: Any,
) -> None:
    """Killed while a job runs, the actor is restarted by Ray and the job runs again there (a sandbox is
    throwaway); killed for good, a job is one "sandbox_error" result, counted, not an exception."""
    from inflight.launch.ray import VERIFIER_TASK_RETRIES, RayVerifiers, VerifierActor

    actor = (
        ray_cluster.remote(VerifierActor)
        .options(max_restarts=-1, max_task_retries=VERIFIER_TASK_RETRIES, max_concurrency=2)
        .remote(1)
    )
    verifiers = RayVerifiers([actor])
    try:
        assert verifiers.run_many(["print(6 * 7)"])[0].stdout == "42\n"
        killer = threading.Timer(1.5, ray_cluster.kill, (actor,), {"no_restart": False})
        killer.start()
        slow = verifiers.run_many(["import time; time.sleep(4); print('slow')"])[0]
        killer.join()
        assert slow.ok and slow.stdout == "slow\n", slow
        counts = verifiers.metrics()
        assert counts["verifiers/completed"] == 2 and counts["verifiers/actor_failures"] == 0, counts
        ray_cluster.kill(actor, no_restart=True)
        lost = asyncio.run(verifiers.run("print('never')"))
        assert not lost.ok and lost.reason == "sandbox_error" and "verifier actor failed" in lost.stderr
        assert verifiers.metrics()["verifiers/actor_failures"] == 1
    finally:
        ray_cluster.kill(actor, no_restart=True)


def test_a_job_sigkilled_from_outside_its_sandbox_is_held_back_before_its_answer() -> None:
    """A Ray worker being killed SIGKILLs its children first and exits after: a job killed so is answered
    only after EXTERNAL_KILL_GRACE_S, long enough for the actor to die with the answer (Ray then runs the
    job again). The answer itself is kept, and other failures are answered at once."""
    from inflight.launch.ray.verifiers import VerifierActor

    held = VerifierActor(1, external_kill_grace_s=1.0)
    started = time.monotonic()
    killed = held.run("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", "", None)
    assert killed.reason == "killed" and killed.exit_code == -signal.SIGKILL, killed
    assert time.monotonic() - started >= 1.0
    not_held = VerifierActor(1, external_kill_grace_s=60.0)
    started = time.monotonic()
    failed = not_held.run("raise SystemExit(3)", "", None)
    assert failed.reason == "error" and failed.exit_code == 3, failed
    assert time.monotonic() - started < 60.0


def test_rollout_workers_play_the_groups_and_a_killed_worker_is_restarted_its_groups_played_again(
    ray_cluster: Any, warm_tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`ray.num_rollout_workers=2`: the groups are played in two actors of their own and come back through
    Ray's object store. Worker 0's process SIGKILLed after the first step: the groups it was playing are
    played again (on worker 1), Ray restarts it, it plays again, and no rollout is lost or stale."""
    run_dir = tmp_path / "run"
    steps = 200  # ~0.05-0.1 s each: the run outlasts the worker's restart (a new process loading inflight)
    killer, killed = sigkill_after_the_first_step(
        ray_cluster, run_dir, "rollouts-0", lambda worker: worker.pid.remote(), lambda pid: pid
    )

    def restarted_and_played_on(train: list[dict[str, Any]]) -> bool:  # 10 steps after the restart
        return any(r["rollout_workers/restarts"] >= 1 for r in train[:-10])

    run_over = threading.Event()
    stopper = stop_the_run_once(run_dir, restarted_and_played_on, run_over)
    try:
        summary = run_cli(
            capsys, "run", "blackjack", *tiny_run(warm_tiny_model_dir, steps), "launcher=ray",
            "ray.num_rollout_workers=2", "ray.rollout_worker_cpus=0.25", "ray.engine_cpus=0.5",
            "--run-dir", str(run_dir), exit_code=128 + signal.SIGINT,
        )  # fmt: skip
    finally:
        run_over.set()
    killer.join(30)
    stopper.join(5)
    assert killed, "the worker was never killed"

    assert summary["stopped"] == "SIGINT" and summary["steps"] < steps, summary
    steps = summary["steps"]
    train = metrics_rows(run_dir, "train")
    assert len(train) == steps
    last = train[-1]
    assert last["rollout_workers/lost"] >= 1, last  # it was playing groups when it died
    assert last["rollout_workers/restarts"] == 1, last  # Ray restarted it, and it played again
    assert last["rollout_workers/played"] >= steps * 4, last
    assert (
        last["rollout_workers/replica_calls"] > 0
        and last["replicas/calls"] < last["rollout_workers/replica_calls"]
    )
    assert last["rollout_errors"] == 0 and last["groups_dropped_errors"] == 0, last
    assert last["stream_duplicates"] == 0, last  # the object store hands a group back once
    assert all(r["lag_steps_max"] <= 1 for r in train)  # the replayed groups kept the staleness bound
    parity = [r["logprob_parity_max_abs"] for r in train if r.get("logprob_parity_token_frac")]
    assert parity and max(parity) < 1e-3, parity  # the workers sampled the trainer's weights
    wait_until_released(ray_cluster)


def test_rollout_workers_write_their_groups_to_a_redis_stream(
    ray_cluster: Any,
    warm_tiny_model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    redis_port: int,
) -> None:
    """`pipeline.stream_url=redis://...`: each worker appends its groups to the Redis stream itself and the
    run's actor reads them from there; every trained group went through Redis. Under LoRA: the workers
    sample with the policy adapter the run's actor publishes."""
    import redis

    key = f"run-{uuid.uuid4().hex[:8]}"
    run_dir = tmp_path / "run"
    summary = run_cli(
        capsys, "run", "blackjack", *tiny_run(warm_tiny_model_dir, 4), "launcher=ray",
        "ray.num_rollout_workers=1", "ray.rollout_worker_cpus=0.5", "ray.engine_cpus=0.5",
        f"pipeline.stream_url=redis://127.0.0.1:{redis_port}/0?key={key}", "trainer.lora_rank=8",
        "trainer.lr=1e-2", "--run-dir", str(run_dir),
    )  # fmt: skip
    assert summary["steps"] == 4
    train = metrics_rows(run_dir, "train")
    last = train[-1]
    parity = [r["logprob_parity_max_abs"] for r in train if r.get("logprob_parity_token_frac")]
    assert parity and max(parity) < 1e-3, parity  # sampled with the adapter the trainer holds
    assert last["version"] >= 1, last
    # Every group written, counted by Redis (the final checkpoint trimmed the stream to its read offset).
    info = redis.Redis(port=redis_port).xinfo_stream(key)
    written = info["entries-added"]
    assert last["buffer/consumed"] == 4 * 4 and written >= last["buffer/consumed"], (written, last)
    assert info["length"] < written, info  # trimmed: what a resume can no longer need is gone
    # Played groups are counted as their calls return, after the append (the run may train on a group
    # before its call returns): counted, but not comparable with the groups consumed.
    assert last["rollout_workers/played"] > 0 and last["stream_duplicates"] == 0, last
    assert not (run_dir / "streams").exists()  # no file log beside it
    wait_until_released(ray_cluster)


SANDBOXED_TASK = """
from inflight.envs.sandbox import default_pool


def load_problems(split):
    return [{"k": k} for k in range(1000 if split == "train" else 4)]


async def generate_rollout(ctx, problem):
    chat = ctx.chat()
    chat.user(f"Problem {problem['k']}")
    reply = await chat.assistant()
    result = await default_pool().run(f"print({problem['k']} + 1)")  # wherever the default pool runs it
    correct = result.ok and result.stdout.strip() == str(problem["k"] + 1)
    return chat.to_rollout(float(correct) * (0.5 + 0.5 * (len(reply) % 2)))
"""


def test_a_rollout_workers_sandboxes_run_in_the_verifier_actors(
    ray_cluster: Any, tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rollout workers and verifier actors together: the sandboxed code of the rollouts a worker plays goes
    to the verifier actors (the worker installs them as its default pool), counted in the run's metrics."""
    task = tmp_path / "sandboxed.py"
    task.write_text(SANDBOXED_TASK)
    run_dir = tmp_path / "run"
    summary = run_cli(
        capsys, "run", str(task), "progress=false", f"model.path={tiny_model_dir}", "warmup.sft_steps=0",
        "grpo.steps=3", "grpo.prompts_per_step=2", "grpo.group_size=4", "eval.num_episodes=2",
        "pipeline.active_sampling=false", "launcher=ray", "ray.num_rollout_workers=1",
        "ray.rollout_worker_cpus=0.25", "ray.num_verifier_actors=1", "ray.verifier_cpus=0.25",
        "ray.engine_cpus=0.5", "--run-dir", str(run_dir),
    )  # fmt: skip
    assert summary["steps"] == 3
    train = metrics_rows(run_dir, "train")
    last = train[-1]
    # One sandbox job per rollout the worker played, answered by the verifier actor: at least the trained
    # rollouts' jobs by the last step (groups still in flight then may have submitted theirs unanswered).
    submitted = last["rollout_workers/verifiers_submitted"]
    completed = last["rollout_workers/verifiers_completed"]
    assert 3 * 2 * 4 <= completed <= submitted, last
    assert last["rollout_workers/verifiers_actor_failures"] == 0, last
    assert min(r["reward_mean"] for r in train) > 0, [r["reward_mean"] for r in train]
    wait_until_released(ray_cluster)


def test_a_lost_trainer_stops_the_run_in_one_line_leaving_a_checkpoint(
    ray_cluster: Any, tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The run's actor is not restarted (its state is the run's): the command stops, says what happened and
    where the checkpoint is, and releases the replicas. Resuming from a checkpoint is the pipeline's own
    (tests/test_pipeline_resume.py)."""
    run_dir = tmp_path / "run"
    killer = kill_after_a_checkpoint(ray_cluster, run_dir, "run")
    capsys.readouterr()
    # No warm-up: whether its steps train or are skipped (no signal), each is logged and checkpointed.
    argv = [
        *tiny_run(tiny_model_dir, 100),
        "checkpoint_every_steps=2",
        "launcher=ray",
        "--run-dir",
        str(run_dir),
    ]
    code = main(["run", "blackjack", *argv])
    killer.join(10)
    err = capsys.readouterr().err
    assert code == 2, err
    errors = [line for line in err.splitlines() if line.startswith("inflight: error:")]
    assert len(errors) == 1 and "the trainer's actor died" in errors[0], err
    assert f"run_dir={run_dir}" in errors[0] and "resume" in errors[0]
    assert "Traceback" not in err
    assert checkpoint_step(run_dir / "checkpoint") >= 2
    wait_until_released(ray_cluster)


def test_two_data_parallel_trainer_ranks_train_through_ray_and_a_lost_rank_stops_the_run_in_one_line(
    ray_cluster: Any, warm_tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """ray.num_trainer_ranks=2: the run's actor is rank 0, a TrainerRank actor rank 1; every step is split
    across the two (gloo), and every checkpoint is written once both showed the same weights (a check that
    raises otherwise, `DataParallelTrainer.assert_replicas_in_sync`). Then the same run with rank 1 killed
    after a checkpoint: one line that names the lost rank and how to resume."""
    small = ["ray.num_trainer_ranks=2", "ray.engine_cpus=0.5", "ray.trainer_cpus=0.5", "launcher=ray"]
    run_dir = tmp_path / "ranks"
    summary = run_cli(
        capsys, "run", "blackjack", *tiny_run(warm_tiny_model_dir, 3), *small, "--run-dir", str(run_dir)
    )
    assert summary["steps"] == 3
    trained = [r for r in metrics_rows(run_dir, "train") if "loss" in r]
    assert trained, "at least one step must have trained"
    # Metrics merged over the two ranks' shares: the split is reported (1.0 = equal token counts).
    assert all(r["dp_token_imbalance"] >= 1.0 for r in trained), trained
    assert (run_dir / "checkpoint" / "model.safetensors").is_file()
    wait_until_released(ray_cluster)

    lost_dir = tmp_path / "lost"
    killer = kill_after_a_checkpoint(ray_cluster, lost_dir, "rank-1")
    capsys.readouterr()
    argv = [
        *tiny_run(warm_tiny_model_dir, 100),
        *small,
        "checkpoint_every_steps=2",
        "--run-dir",
        str(lost_dir),
    ]
    code = main(["run", "blackjack", *argv])
    killer.join(10)
    err = capsys.readouterr().err
    assert code == 2, err
    errors = [line for line in err.splitlines() if line.startswith("inflight: error:")]
    assert len(errors) == 1 and "a data-parallel trainer rank died" in errors[0], err
    assert f"run_dir={lost_dir}" in errors[0] and "resume" in errors[0]
    assert "Traceback" not in err
    assert checkpoint_step(lost_dir / "checkpoint") >= 2
    wait_until_released(ray_cluster)


def test_fsdp_trainer_ranks_train_through_ray_and_publish_the_gathered_weights(
    ray_cluster: Any, warm_tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """ray.trainer_sharding=fsdp: two ranks each hold half of every weight and AdamW moment (FSDP2, gloo);
    every step's weights are gathered from both to rank 0 and sent to the engine replica, and the checkpoint
    is written from both ranks' shards. On-policy steps (max_staleness_steps=0) make the proof: the
    replica's logprobs equal the sharded trainer's to float32 rounding only if the gathered weights were
    whole and current."""
    small = ["ray.num_trainer_ranks=2", "ray.engine_cpus=0.5", "ray.trainer_cpus=0.5", "launcher=ray"]
    run_dir = tmp_path / "fsdp"
    argv = [  # 60 warm-up steps, as the vLLM runs: 20 in the model, 40 here
        *tiny_run(warm_tiny_model_dir, 4, warmup_steps=40), "grpo.prompts_per_step=8", *small,
        "ray.trainer_sharding=fsdp", "trainer.loss.kl_coef=0", "pipeline.max_staleness_steps=0",
        "--run-dir", str(run_dir),
    ]  # fmt: skip
    summary = run_cli(capsys, "run", "blackjack", *argv)
    assert summary["steps"] == 4
    trained = [r for r in metrics_rows(run_dir, "train") if "loss" in r]
    assert len(trained) >= 2, "most steps must have trained"
    assert max(r["logprob_diff_max_abs"] for r in trained) < 1e-4, trained
    assert checkpoint_step(run_dir / "checkpoint") == 4
    assert (run_dir / "checkpoint" / "model.safetensors").is_file()
    wait_until_released(ray_cluster)


def test_fsdp_on_ray_refuses_what_it_cannot_shard(tiny_model_dir: Path) -> None:
    cfg = apply_overrides(resolve_target("blackjack").config(), ["trainer.loss.kl_coef=0"])
    sharded = ["launcher=ray", "ray.trainer_sharding=fsdp"]
    assert apply_overrides(cfg, [*sharded, "ray.num_trainer_ranks=2"]).ray.trainer_sharding == "fsdp"
    for extra in (
        ["ray.num_trainer_ranks=1"],
        ["ray.num_trainer_ranks=2", "trainer.lora_rank=8"],
        ["ray.num_trainer_ranks=2", "trainer.loss.kl_coef=0.1"],
    ):
        with pytest.raises(UserError, match="trainer_sharding=fsdp shards full-parameter training"):
            apply_overrides(cfg, [*sharded, *extra])


def test_rollout_workers_need_the_pipeline() -> None:
    cfg = resolve_target("blackjack").config()
    workers = ["launcher=ray", "ray.num_rollout_workers=2"]
    assert apply_overrides(cfg, [*workers, "mode=async"]).ray.num_rollout_workers == 2
    with pytest.raises(UserError, match=r"ray.num_rollout_workers=2: .* set mode=async"):
        apply_overrides(cfg, [*workers, "mode=sync"])


@pytest.mark.parametrize("engine", ["builtin", "vllm"])
def test_serve_places_its_sampling_engine_on_ray(
    engine: str, ray_cluster: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """`inflight serve --launcher ray [--engine vllm]`: the base model's sampling engine (built-in, or a vLLM
    process) is in an actor on the cluster, and so is the training (the service's compute: adapters,
    optimizers, checkpoints); the API and the futures database stay here. Driven by the tinker SDK: an
    adapter trained on the trainer's actor, saved, then sampled and scored on the engine's actor, equal to
    the trainer's logprobs (float32). vLLM cannot adapt this model's LM head (Qwen2), so its adapter trains
    the projections only."""
    import tinker

    from conftest import require_vllm_env, sdk_server
    from inflight.api.service import ServiceConfig
    from inflight.config import RayConfig

    if engine == "vllm":
        require_vllm_env()
    types = tinker.types
    config = ServiceConfig(
        base_models={"tiny": str(tiny_model_dir)},
        state_dir=tmp_path / "serve",
        dtype="float32",
        engine=engine,  # type: ignore[arg-type]
        launcher="ray",
        ray=RayConfig(engine_cpus=0.5),
    )
    tokens = [5, 17, 3, 42, 8, 99, 23, 7, 61, 12, 4, 30]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    with sdk_server(config) as server:
        actors = ray_cluster.util.list_named_actors()
        assert sum(n.endswith(":engine-tiny") for n in actors) == 1, actors
        assert sum(n.endswith(":trainer") for n in actors) == 1, actors
        service = tinker.ServiceClient(base_url=server.url)
        training = service.create_lora_training_client(
            base_model="tiny", rank=8, seed=0, train_unembed=engine != "vllm"
        ).result()
        for _ in range(2):
            training.forward_backward([datum], "cross_entropy")
            training.optim_step(types.AdamParams(learning_rate=2e-2)).result()
        sampler = training.save_weights_and_get_sampling_client().result()
        on_ray = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
        output = training.forward([datum], "cross_entropy").result()
        trained = output.loss_fn_outputs[0]["logprobs"].tolist()
        sampled = sampler.sample(
            types.ModelInput.from_ints(tokens[:4]), 2, types.SamplingParams(max_tokens=6, seed=3)
        ).result()
        service.close("success").result()
    assert on_ray[0] is None and max(abs(a - b) for a, b in zip(on_ray[1:], trained, strict=True)) < 1e-4
    for sequence in sampled.sequences:  # no stop given: Tinker's EOS stop, else max_tokens
        assert 1 <= len(sequence.tokens) <= 6 and len(sequence.logprobs or []) == len(sequence.tokens)
    left = ray_cluster.util.list_named_actors()
    assert not [n for n in left if n.endswith((":engine-tiny", ":trainer"))], left
    assert not progress_bars_in_actor_logs(), progress_bars_in_actor_logs()
    wait_until_released(ray_cluster)


def progress_bars_in_actor_logs() -> list[str]:
    """The lines of this process's private Rays' worker logs that redraw a progress bar ("\r"): Ray
    forwards each to the driver, where it read as an empty coloured "(EngineReplica pid=...)" line followed
    by transformers' "Loading weights" bars. An actor's stderr is no terminal, so it shows none
    (`models/loader.py`'s hf_progress_bars)."""
    logs = Path("/tmp").glob(f"{RAY_TEMP_PREFIX}-{os.getpid()}-*/session_*/logs/worker-*")
    return [line for log in logs for line in log.read_text(errors="replace").split("\n") if "\r" in line]


def test_the_services_training_actor_raises_its_errors_as_they_are(
    ray_cluster: Any, tiny_model_dir: Path
) -> None:
    """RayCompute: a UserError in the actor (a 4xx for the client) is a UserError here; a lost actor is one
    RuntimeError naming it, not a hang."""
    from inflight.api.compute import ServiceComputeConfig
    from inflight.api.job_types import LoraSpec
    from inflight.config import RayConfig
    from inflight.launch.ray import compute_on_ray

    settings = ServiceComputeConfig(dtype="float32", sampling_engine=False)
    with compute_on_ray({"tiny": str(tiny_model_dir)}, 16, settings, RayConfig()) as compute:
        assert compute.base_model_names() == ["tiny"] and compute.config.dtype == "float32"
        compute.create_adapter("m", "tiny", LoraSpec(rank=8, seed=0))
        assert compute.has_adapter("m")
        with pytest.raises(UserError, match="already exists"):
            compute.create_adapter("m", "tiny", LoraSpec(rank=8, seed=0))
        [name] = [n for n in ray_cluster.util.list_named_actors() if n.endswith(":trainer")]
        ray_cluster.kill(ray_cluster.get_actor(name))
        # ray.kill returns before the actor is gone: a call made at once may still be served by it.
        deadline = time.monotonic() + 30
        with contextlib.suppress(ValueError):  # get_actor: no such actor any more
            while time.monotonic() < deadline:
                ray_cluster.get_actor(name)
                time.sleep(0.1)
        with pytest.raises(RuntimeError, match="the service's training actor is gone"):
            compute.has_adapter("m")
    wait_until_released(ray_cluster)


def test_a_placement_larger_than_the_local_ray_is_one_line_at_once(
    ray_cluster: Any, tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    start = time.monotonic()
    argv = ["run", "blackjack", f"model.path={tiny_model_dir}", "launcher=ray", "ray.num_engine_replicas=3"]
    assert main([*argv, "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs 4 CPUs" in err[0] and "the local Ray has 2" in err[0], err
    assert "ray.engine_cpus=0.5" in err[0]
    assert time.monotonic() - start < 60  # not after ray.placement_timeout_s (120 s)
    # Rollout workers at their default CPU each: the line says what a worker needs.
    argv = ["run", "blackjack", f"model.path={tiny_model_dir}", "launcher=ray", "ray.num_rollout_workers=2"]
    assert main([*argv, "--run-dir", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs 4 CPUs" in err[0] and "ray.rollout_worker_cpus=0.25" in err[0], err


def test_serve_whose_engines_do_not_fit_beside_its_training_is_one_line_at_once(
    ray_cluster: Any, tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`inflight serve --launcher ray` places its training, then its engines, in the app's lifespan: two base
    models' engines (a CPU each) beside the training's CPU on the module's 2-CPU Ray is one line naming what
    `serve` can change and exit 2, at once (not uvicorn's traceback and status 3, nor after
    ray.placement_timeout_s, 120 s); what was placed is released."""
    capsys.readouterr()
    started = time.monotonic()
    models = [arg for name in ("a", "b") for arg in ("--base-model", f"{name}={tiny_model_dir}")]
    argv = ["serve", *models, "--launcher", "ray", "--state-dir", str(tmp_path), "--port", "0"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("inflight: error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert "the placement needs 3 CPUs" in errors[0] and "the local Ray has 2 CPUs" in errors[0], errors
    assert "Serve fewer base models here, or serve on a cluster with more CPUs (--ray-address" in errors[0]
    assert time.monotonic() - started < 60
    # The request log's stdout handler went with the service: it would write later in-process servers'
    # lines to this test's captured stdout, closed by then (a "Logging error" in a later test).
    assert not logging.getLogger(REQUEST_LOGGER).handlers
    wait_until_released(ray_cluster)


def test_placement_bundles_follow_the_devices() -> None:
    cfg = resolve_target("blackjack").config()
    cpu = apply_overrides(cfg, ["ray.num_engine_replicas=2", "ray.engine_cpus=2"])
    assert bundles(cpu, cluster_has_gpus=True) == [{"CPU": 2.0}, {"CPU": 2.0}, {"CPU": 1.0}]
    gpu = apply_overrides(cfg, ["engine.device=cuda:1", "trainer.device=auto", "ray.trainer_gpus=0.5"])
    assert bundles(gpu, cluster_has_gpus=True) == [{"CPU": 1.0, "GPU": 1.0}, {"CPU": 1.0, "GPU": 0.5}]
    assert bundles(gpu, cluster_has_gpus=False) == [{"CPU": 1.0, "GPU": 1.0}, {"CPU": 1.0}]
    ranks = apply_overrides(gpu, ["ray.num_trainer_ranks=3"])  # a bundle per trainer rank, the run's first
    assert bundles(ranks, cluster_has_gpus=True) == [
        {"CPU": 1.0, "GPU": 1.0},
        *[{"CPU": 1.0, "GPU": 0.5}] * 3,
    ]
    # Verifier actors, then rollout workers: CPU bundles of their own, never a GPU.
    cpus = ["ray.num_verifier_actors=1", "ray.num_rollout_workers=2", "ray.rollout_worker_cpus=0.25"]
    around = apply_overrides(gpu, cpus)
    assert bundles(around, cluster_has_gpus=True) == [
        {"CPU": 1.0, "GPU": 1.0},
        {"CPU": 1.0, "GPU": 0.5},
        {"CPU": 1.0},
        {"CPU": 0.25},
        {"CPU": 0.25},
    ]


def test_a_replica_whose_picked_port_was_taken_listens_elsewhere_unless_it_was_restarted() -> None:
    """The port is picked on the replica's node before its actor starts: taken meanwhile, a first start
    listens on another one (its URL is not out yet); a restarted replica must come back on its own, which
    its clients keep, and says so in one line when it cannot."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with replica_socket("127.0.0.1", port, restarted=False) as sock:
            assert sock.getsockname()[1] not in (0, port)
        with pytest.raises(UserError, match=rf"cannot listen on its port {port} on 127\.0\.0\.1 again"):
            replica_socket("127.0.0.1", port, restarted=True)
    with replica_socket("127.0.0.1", port, restarted=True) as sock:  # released: the same port again
        assert sock.getsockname()[1] == port


def test_without_ray_installed_the_launcher_says_how_to_get_it(
    monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    argv = ["run", "blackjack", f"model.path={tiny_model_dir}", "launcher=ray", "--run-dir", str(tmp_path)]
    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == f"inflight: error: {RAY_MISSING}"


def test_an_unreachable_ray_address_is_one_line(tiny_model_dir: Path, tmp_path: Path) -> None:
    # Its own process: the module's cluster, once started, would be used whatever the address says.
    argv = ["run", "blackjack", f"model.path={tiny_model_dir}", "launcher=ray", "ray.address=127.0.0.1:1"]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "inflight.cli",
            *argv,
            "ray.connect_timeout_s=5",
            "--run-dir",
            str(tmp_path / "r"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "ray.address=127.0.0.1:1: nothing answers there" in lines[0], done.stderr
    assert "ray start --head" in lines[0]
    assert not (tmp_path / "r").exists()


# -- signals, connecting, and placements refused (the scale QA pass) ----------------------------------------


def child_env(**extra: str) -> dict[str, str]:
    """The environment of an `inflight` child process: none of Ray's address or token settings of this one
    (the module's local Ray sets RAY_AUTH_MODE here), and `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH_", "RAY_ADDRESS"))}
    return env | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"} | extra


def free_ports(count: int) -> list[int]:
    """`count` different loopback ports, free now."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]


def inflight_process(argv: list[str], logs: Path) -> subprocess.Popen[bytes]:
    """`python -m inflight.cli ARGV` started with stdout and stderr in LOGS/stdout.log and LOGS/stderr.log."""
    logs.mkdir(parents=True, exist_ok=True)
    with (logs / "stdout.log").open("w") as out, (logs / "stderr.log").open("w") as err:
        command = [sys.executable, "-m", "inflight.cli", *argv]
        return subprocess.Popen(command, stdout=out, stderr=err, env=child_env())


def end(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(30)


def test_sigterm_stops_a_run_on_its_own_ray_after_the_step_in_flight(
    warm_tiny_model_dir: Path, tmp_path: Path
) -> None:
    """SIGTERM (a scheduler's preemption) as Ctrl-C above: the run stops after its step in flight, with its
    checkpoint and summary, exit 143. ray.init replaces the SIGTERM handler (an exit, and under it Ray's C++
    handler, which aborts); the launcher puts the command's own back. Its own process, with a local Ray of
    its own: the module's Ray, already started, would spare it the ray.init."""
    run_dir, logs = tmp_path / "run", tmp_path / "logs"
    argv = [
        "run", "blackjack", *tiny_run(warm_tiny_model_dir, 400), "launcher=ray", "ray.engine_cpus=0.5",
        "ray.trainer_cpus=0.5", "--run-dir", str(run_dir),
    ]  # fmt: skip
    proc = inflight_process(argv, logs)
    try:
        deadline = time.monotonic() + 300
        while len(metrics_rows_or_none(run_dir) or []) < 2:
            assert proc.poll() is None, (logs / "stderr.log").read_text()
            assert time.monotonic() < deadline, (logs / "stderr.log").read_text()
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(120)
    finally:
        end(proc)
    err = (logs / "stderr.log").read_text()
    assert code == 128 + signal.SIGTERM, err
    assert "SIGTERM received" not in err  # Ray's C++ handler's dump
    summary = json.loads((logs / "stdout.log").read_text().strip().splitlines()[-1])
    assert summary["stopped"] == "SIGTERM" and 2 <= summary["steps"] < 400, summary
    assert checkpoint_step(run_dir / "checkpoint") == summary["steps"]  # what the same command resumes from
    assert json.loads((run_dir / "summary.json").read_text())["stopped"] == "SIGTERM"


def test_sigterm_drains_a_service_on_its_own_ray(tiny_model_dir: Path, tmp_path: Path) -> None:
    """`inflight serve --launcher ray` connects to Ray before uvicorn starts, so that uvicorn's handlers, set
    after Ray's, take the SIGTERM: the service drains and exits on the signal, as without Ray
    (tests/test_api_serve_process.py), its actors released on the way."""
    import httpx

    logs, [port] = tmp_path / "logs", free_ports(1)
    argv = [
        "serve", "--base-model", f"tiny={tiny_model_dir}", "--state-dir", str(tmp_path / "state"),
        "--port", str(port), "--launcher", "ray",
    ]  # fmt: skip
    proc = inflight_process(argv, logs)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (logs / "stderr.log").read_text()
            assert time.monotonic() < deadline, (logs / "stderr.log").read_text()
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"http://127.0.0.1:{port}/api/v1/healthz", timeout=5).status_code == 200:
                    break
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    finally:
        end(proc)
    err = (logs / "stderr.log").read_text()
    assert code == -signal.SIGTERM, err  # uvicorn re-raises the signal it handled
    assert "shutting down (SIGTERM)" in err and "Application shutdown complete" in err, err
    assert "SIGTERM received" not in err and "Traceback" not in err, err


def test_a_stop_while_ray_places_the_actors_ends_the_wait_in_one_line(
    ray_cluster: Any, tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C while the placement group waits for room (the module's 2 CPUs held by another group): the wait
    ends at once, not after ray.placement_timeout_s; the group is removed; the command says so in one line
    and exits as the signal says. Nothing ran, so nothing is written."""
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    blocker = placement_group([{"CPU": 2}])
    ray_cluster.get(blocker.ready(), timeout=60)
    run_over = threading.Event()

    def ctrl_c_once_it_waits() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not run_over.is_set():
            if any(group["state"] == "PENDING" for group in placement_group_table().values()):
                if not run_over.is_set():
                    os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.2)

    stopper = threading.Thread(target=ctrl_c_once_it_waits, daemon=True)
    stopper.start()
    capsys.readouterr()
    started = time.monotonic()
    argv = [
        "run", "blackjack", f"model.path={tiny_model_dir}", "launcher=ray", "ray.engine_cpus=0.5",
        "ray.trainer_cpus=0.5", "ray.placement_timeout_s=60", "--run-dir", str(tmp_path / "r"),
    ]  # fmt: skip
    try:
        code = main(argv)
    finally:
        run_over.set()
        remove_placement_group(blocker)
    stopper.join(5)
    err = capsys.readouterr().err
    assert code == 128 + signal.SIGINT, err
    assert time.monotonic() - started < 30, err
    stopped = [line for line in err.splitlines() if line.startswith("inflight: SIGINT: stopped")]
    assert len(stopped) == 1 and "while Ray placed the actors" in stopped[0], err
    assert "Traceback" not in err and "inflight: error" not in err, err
    assert not (tmp_path / "r").exists()
    assert {group["state"] for group in placement_group_table().values()} == {"REMOVED"}
    wait_until_released(ray_cluster)


def test_gpus_asked_of_a_ray_without_any_are_one_line_naming_the_devices(
    ray_cluster: Any, tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """engine.device=cuda on a CPU-only Ray: the line says the cluster has no GPUs and which devices to set to
    cpu; on the local Ray at once (it never grows), on a cluster at an address (an autoscaler may add GPU
    nodes) after ray.placement_timeout_s."""
    from conftest import one_line_error

    if ray_cluster.cluster_resources().get("GPU"):
        pytest.skip("this machine has GPUs")
    argv = ["run", "blackjack", f"model.path={tiny_model_dir}", "launcher=ray", "--run-dir", str(tmp_path)]
    started = time.monotonic()
    line = one_line_error(capsys, *argv, "engine.device=cuda", "trainer.device=cuda")
    assert "needs 2 GPUs" in line and "the local Ray has no GPUs" in line, line
    assert "Set engine.device=cpu trainer.device=cpu" in line and "ray.engine_cpus" not in line, line
    assert time.monotonic() - started < 60  # not after ray.placement_timeout_s (120 s)
    # "auto": the module's Ray, as a cluster this machine joined.
    at_an_address = ["engine.device=cuda", "ray.address=auto", "ray.placement_timeout_s=2"]
    line = one_line_error(capsys, *argv, *at_an_address)
    assert "it has no GPUs" in line and "Set engine.device=cpu (" in line, line
    assert "ray.engine_cpus" not in line, line
    wait_until_released(ray_cluster)


# A Ray of two logical GPUs on this machine (Ray gives a GPU bundle whatever CUDA says), serving: a child
# process, since the module's Ray has none and one process holds one Ray. Its temp dir as `ray_temp_dir`'s,
# named on its first line.
SERVE_ON_A_RAY_WITH_GPUS = f"""
import sys, ray
from inflight.cli import main
from inflight.inference.scratch import ScratchDirectory
temp_dir = ScratchDirectory("/tmp", prefix="{RAY_TEMP_PREFIX}").path
print(temp_dir, flush=True)
ray.init(address="local", num_cpus=2, num_gpus=2, include_dashboard=False, _temp_dir=str(temp_dir))
sys.exit(main(sys.argv[1:]))
"""


def test_serve_checks_a_cuda_device_against_the_clusters_gpus_not_this_machines(
    ray_cluster: Any, tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`inflight serve --launcher ray --device cuda[:N]` on a head without a GPU was refused for this
    machine's lack of CUDA, whatever the cluster had. On the module's Ray, which has no GPUs: one line
    saying so and naming the fix, at once, and no state directory written. On a Ray with GPUs: the head
    lets it through, and the service's training is placed in its actor on a GPU bundle (whose torch, on a
    machine without CUDA, then refuses to start it: the line is the actor's, not the head's check)."""
    import torch

    from conftest import one_line_error

    if ray_cluster.cluster_resources().get("GPU") or torch.cuda.is_available():
        pytest.skip("this machine has GPUs")
    serve = ["serve", "--base-model", f"tiny={tiny_model_dir}", "--launcher", "ray", "--port", "0"]
    for device in ("cuda", "cuda:1"):
        started = time.monotonic()
        line = one_line_error(capsys, *serve, "--device", device, "--state-dir", str(tmp_path / "state"))
        assert f"--device={device!r} but the local Ray (this machine's) has no GPUs" in line, line
        assert "serve with --device cpu (or auto), or on a cluster with GPUs (--ray-address" in line, line
        assert time.monotonic() - started < 30 and not (tmp_path / "state").exists()
    argv = [*serve, "--device", "cuda:1", "--state-dir", str(tmp_path / "on-gpus")]
    done = subprocess.run(
        [sys.executable, "-c", SERVE_ON_A_RAY_WITH_GPUS, *argv], capture_output=True, text=True, timeout=240,
        env=child_env(),
    )  # fmt: skip
    errors = [line for line in done.stderr.splitlines() if line.startswith("inflight: error:")]
    assert done.returncode == 2 and len(errors) == 1, done.stderr
    assert "the service's training actor is gone" in errors[0] and "ComputeActor" in errors[0], errors
    ray_dir = Path(done.stdout.splitlines()[0])
    assert ray_dir.parent == Path("/tmp") and wait_gone(ray_dir), f"{ray_dir} outlived its process"
    wait_until_released(ray_cluster)


def test_ray_addresses_take_host_and_port_auto_or_a_ray_client_url() -> None:
    from inflight.launch.ray import check_address

    for address in ("10.0.0.5:6379", "head.cluster:6379", "auto", "ray://10.0.0.5:10001"):
        check_address(address, "ray.address")
    for address, problem in [
        (
            "http://127.0.0.1:6379",
            "expected HOST:PORT (the head's GCS port, e.g. 10.0.0.5:6379) or auto, not a URL",
        ),
        ("127.0.0.1", "expected HOST:PORT"),
        ("127.0.0.1:port", "expected HOST:PORT"),
        (":6379", "expected HOST:PORT"),
    ]:
        with pytest.raises(UserError, match=re.escape(f"ray.address={address}: {problem}")):
            check_address(address, "ray.address")


def test_serve_refuses_a_ray_address_it_would_not_use(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--ray-address without --launcher ray, or not HOST:PORT: refused first, before any other check (the
    base model's directory is missing here: had the address passed, that would be the line)."""
    from conftest import one_line_error

    missing = tmp_path / "no-model"
    serve = ["serve", "--base-model", f"tiny={missing}", "--state-dir", str(tmp_path), "--port", "0"]
    line = one_line_error(capsys, *serve, "--ray-address", "127.0.0.1:6379")
    assert "--ray-address=127.0.0.1:6379: names the Ray cluster of --launcher ray" in line, line
    assert "add --launcher ray, or drop --ray-address" in line
    line = one_line_error(capsys, *serve, "--launcher", "ray", "--ray-address", "http://127.0.0.1:6379")
    assert "--ray-address=http://127.0.0.1:6379: expected HOST:PORT" in line and "not a URL" in line, line


@pytest.fixture
def http_server() -> Iterator[str]:
    """HOST:PORT of a loopback HTTP server: a live port that is not Ray."""
    import http.server

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_an_address_that_is_not_a_ray_head_is_one_line_within_the_connect_timeout(
    http_server: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A live port that speaks something else: ray.init alone would retry without end. `inflight run` names
    ray.address; `inflight serve` names --ray-address, before uvicorn starts (no traceback, exit 2)."""
    commands = {
        "ray.address": [
            "run", "blackjack", f"model.path={tiny_model_dir}", "launcher=ray", f"ray.address={http_server}",
            "ray.connect_timeout_s=10", "--run-dir", str(tmp_path / "r"),
        ],
        "--ray-address": [
            "serve", "--base-model", f"tiny={tiny_model_dir}", "--state-dir", str(tmp_path / "s"),
            "--port", "0", "--launcher", "ray", "--ray-address", http_server,
        ],
    }  # fmt: skip
    for key, argv in commands.items():
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "inflight.cli", *argv], capture_output=True, text=True, timeout=90,
            env=child_env(),
        )  # fmt: skip
        assert done.returncode == 2, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1, done.stderr
        assert f"{key}={http_server}: something answers there, but not as a Ray head" in lines[0], lines
        assert "ray start --head --port=PORT" in lines[0]
        assert time.monotonic() - started < 60  # ray.connect_timeout_s, and the command's start
    assert not (tmp_path / "r").exists()


@pytest.fixture
def ray_head(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """A cluster started as docs/laptop-to-cluster.md says, `ray start --head`, which turns Ray's token
    authentication on: in a temp dir of its own, on free ports, with a token of its own in RAY_AUTH_TOKEN
    (never the user's ~/.ray/auth_token). Yields (its address, its token); stopped after (SIGTERM to
    `ray start --block`, which stops what it started)."""
    token, temp_dir = uuid.uuid4().hex, ray_temp_dir()
    gcs, client, node_manager, objects, agent, agent_grpc, runtime_env, metrics = free_ports(8)
    command = [
        str(Path(sys.executable).with_name("ray")), "start", "--head", "--block", f"--port={gcs}",
        f"--ray-client-server-port={client}", f"--node-manager-port={node_manager}",
        f"--object-manager-port={objects}", f"--dashboard-agent-listen-port={agent}",
        f"--dashboard-agent-grpc-port={agent_grpc}", f"--runtime-env-agent-port={runtime_env}",
        f"--metrics-export-port={metrics}", "--num-cpus=2", "--include-dashboard=false",
        "--disable-usage-stats", f"--temp-dir={temp_dir.path}",
    ]  # fmt: skip
    log = tmp_path / "ray-head.log"
    with log.open("w") as out:
        head = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=child_env(RAY_AUTH_TOKEN=token),
            start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in log.read_text():
            assert head.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        yield f"127.0.0.1:{gcs}", token
    finally:
        head.terminate()
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)  # its session: the processes this fixture started
            head.wait(30)
        temp_dir.close()


def test_a_cluster_with_token_authentication_takes_the_token_and_says_when_it_is_missing(
    ray_head: tuple[str, str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    """`ray start --head` turns token authentication on. Without RAY_AUTH_MODE=token: one line that says so,
    not Ray's 20 s of InvalidAuthToken logs and "no Ray cluster found". With it and the head's token (in
    RAY_AUTH_TOKEN here; ~/.ray/auth_token or RAY_AUTH_TOKEN_PATH also do): the run trains there."""
    address, token = ray_head
    argv = [
        "run", "blackjack", *tiny_run(tiny_model_dir, 2, warmup_steps=2), "launcher=ray",
        f"ray.address={address}", "ray.engine_cpus=0.5", "ray.trainer_cpus=0.5",
    ]  # fmt: skip
    command = [sys.executable, "-m", "inflight.cli", *argv]
    started = time.monotonic()
    refused = subprocess.run(
        [*command, "--run-dir", str(tmp_path / "refused")], capture_output=True, text=True, timeout=120,
        env=child_env(),
    )  # fmt: skip
    assert refused.returncode == 2, refused.stderr
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and f"ray.address={address}: the cluster wants a token" in lines[0], refused.stderr
    assert "set RAY_AUTH_MODE=token" in lines[0] and "docs/laptop-to-cluster.md" in lines[0]
    assert time.monotonic() - started < 60
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [*command, "--run-dir", str(run_dir)], capture_output=True, text=True, timeout=300,
        env=child_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["steps"] == 2
    assert checkpoint_step(run_dir / "checkpoint") == 2
