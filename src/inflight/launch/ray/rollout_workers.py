"""Rollout workers: actors that play the groups the run admits (`RolloutWorker`), and the pipeline's
`GroupPlayer` over them (`RayRolloutWorkers`), which plays a group lost with its worker again. Knows how a
group is sent and awaited, not how it is played (`orchestrator/rollout_group.py`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from inflight.config import RunConfig
from inflight.errors import describe
from inflight.launch.ray.verifiers import RayVerifiers

if TYPE_CHECKING:
    from inflight.orchestrator.rollout_group import PlayedGroup
    from inflight.orchestrator.task import Problem

PLAY_ATTEMPTS = 4  # rollout workers one group may be sent to (a lost play is played again elsewhere)
PLAY_GRACE_S = 60.0  # a group's play is bounded by rollout.timeout_s (its rollouts run at once) plus this


class RolloutWorker:
    """A rollout worker on a CPU bundle of its own (`ray.num_rollout_workers`): plays the groups the run's
    actor admits (`play_group`, the pipeline's own code: the task's generate_rollout, its environments,
    its sandboxes on the verifier actors) against the engine replicas, with a client that follows the run's
    (which publishes the weights). A played group goes back through Ray's object store, or straight into
    pipeline.stream_url when one is set (redis://: the run's reader takes it from there). An async actor:
    its groups run concurrently on its event loop. Holds nothing the run needs, so Ray restarts it when it
    dies and the run plays its lost groups again (`RayRolloutWorkers`)."""

    def __init__(self, cfg: RunConfig, target: str, verifiers: list[Any]) -> None:
        import torch

        from inflight.buffer.streams import open_stream
        from inflight.envs.sandbox import set_default_pool
        from inflight.models import load_tokenizer
        from inflight.models.chat_template import generation_stop_ids_of
        from inflight.orchestrator.guard import RolloutGuard
        from inflight.orchestrator.remote_engine import RemoteEngines
        from inflight.orchestrator.target import resolve_target
        from inflight.rollouts.chat import ChatFormat
        from inflight.trainer.lora_policy import ADAPTER_NAME

        torch.set_num_threads(1)  # rollouts are Python and HTTP: the replicas compute
        assert cfg.model.path and cfg.run_dir, "run_on_ray resolves the model and the run directory"
        self.cfg = cfg
        self.task = resolve_target(target)
        # The run's chat format (ChatFormat.for_model), from the model's files without its weights.
        self.chat = ChatFormat(load_tokenizer(cfg.model.path), None, generation_stop_ids_of(cfg.model.path))
        self.guard = RolloutGuard(cfg.rollout, 1)  # logs here; the run's guard judges the counts
        self.stream = open_stream(cfg.pipeline.stream_url) if cfg.pipeline.stream_url else None
        # Generation only (the run's actor publishes): no transport to choose, nothing written here.
        self.engines = RemoteEngines(
            cfg.pipeline.engine_urls,
            Path(cfg.run_dir) / "weights",
            policy_adapter=ADAPTER_NAME if cfg.trainer.lora_rank else None,
            follows_others=True,
        )
        self._started = False
        # This process's environments send their sandboxed code to the verifier actors.
        self.verifiers = RayVerifiers(verifiers) if verifiers else None
        if self.verifiers is not None:
            set_default_pool(self.verifiers)

    def pid(self) -> int:
        return os.getpid()

    async def play(self, problem_index: int, problem: Problem) -> tuple[PlayedGroup, int, dict[str, float]]:
        """The group, this process's id (a new one: Ray restarted the worker) and its counters: its replica
        client's (replicas/*) and its verifier client's (verifiers/*)."""
        import asyncio

        from inflight.orchestrator.rollout_group import PlayedGroup, group_record, is_playable, play_group
        from inflight.types import Completion, SampleRequest

        if not self._started:  # the client lives on this actor's event loop
            self._started = True
            await self.engines.astart()
        timeout_s = self.cfg.rollout.timeout_s

        async def generate(request: SampleRequest) -> Completion:
            return await self.engines.generate(request, timeout_s)

        cfg, chat = self.cfg, self.chat
        group = await play_group(self.task, problem, problem_index, cfg, chat, generate, self.guard)
        appended = self.stream is not None and is_playable(group)
        if appended:
            assert self.stream is not None
            await asyncio.to_thread(self.stream.append, group_record(problem_index, group))
        rollouts = [] if appended else group.rollouts
        played = PlayedGroup(problem_index, rollouts, appended, self.guard.take_counts())
        counters = self.engines.metrics() | ({} if self.verifiers is None else self.verifiers.metrics())
        return played, os.getpid(), counters


class RayRolloutWorkers:
    """The pipeline's `GroupPlayer` over `RolloutWorker` actors: each group to the worker with the fewest in
    flight, awaited on the pipeline's event loop. A group lost with its worker (the actor died, or gave no
    answer within rollout.timeout_s + PLAY_GRACE_S) is played again, on another worker when there is one,
    up to PLAY_ATTEMPTS tries: its problem stays admitted meanwhile, so the staleness bound holds, and the
    seeds make the replay draw the same samples at the same weights. Counted in `metrics()`: groups played,
    lost (and played again), workers restarted (seen as a new process id)."""

    def __init__(self, actors: list[Any], rollout_timeout_s: float) -> None:
        import ray

        self._ray, self._actors = ray, actors
        self._bound_s = rollout_timeout_s + PLAY_GRACE_S
        self._in_flight = [0] * len(actors)
        self._pids: list[int | None] = [None] * len(actors)
        self._clients: list[dict[str, float]] = [{} for _ in actors]
        self._counts = dict.fromkeys(("played", "lost", "restarts"), 0)

    async def play(self, problem_index: int, problem: Problem) -> PlayedGroup:
        import asyncio

        failed: set[int] = set()
        last = "none tried"
        for _ in range(PLAY_ATTEMPTS):
            index = self._pick(failed)
            self._in_flight[index] += 1
            ref = self._actors[index].play.remote(problem_index, problem)
            try:
                played, pid, client = await asyncio.wait_for(asyncio.wrap_future(ref.future()), self._bound_s)
            except (self._ray.exceptions.RayActorError, TimeoutError) as exc:
                if isinstance(exc, TimeoutError):
                    self._ray.cancel(ref, force=False)
                last = f"rollout worker {index}: {describe(exc)}"
                failed.add(index)
                self._counts["lost"] += 1
                print(f"inflight: ray: group of problem {problem_index} lost ({last}); playing it again",
                      file=sys.stderr)  # fmt: skip
                continue
            finally:
                self._in_flight[index] -= 1
            if self._pids[index] is not None and pid != self._pids[index]:
                self._counts["restarts"] += 1
            self._pids[index], self._clients[index] = pid, client
            self._counts["played"] += 1
            return played
        raise RuntimeError(
            f"problem {problem_index}: no rollout worker could play its group in {PLAY_ATTEMPTS} tries; "
            f"last: {last}"
        )

    def metrics(self) -> dict[str, float]:
        """Groups played, lost, workers restarted; the workers' replica clients' counters summed
        (`replica_calls`, `replica_retries`, `replica_failures`, `replica_recoveries`) and, with verifier
        actors, their sandbox jobs (`verifiers_submitted`, `verifiers_completed`, ...), as of each
        worker's last group."""
        out = {f"rollout_workers/{key}": float(value) for key, value in self._counts.items()}
        for key in ("calls", "retries", "replica_failures", "recoveries"):
            out[f"rollout_workers/replica_{key.removeprefix('replica_')}"] = sum(
                client.get(f"replicas/{key}", 0.0) for client in self._clients
            )
        verifier_keys = sorted({k for client in self._clients for k in client if k.startswith("verifiers/")})
        for key in verifier_keys:
            out[f"rollout_workers/verifiers_{key.removeprefix('verifiers/')}"] = sum(
                client.get(key, 0.0) for client in self._clients
            )
        return out

    def _pick(self, failed: set[int]) -> int:
        """The worker with the fewest groups in flight, those that just lost this group last (one of them
        may be the only worker: Ray queues the call until it is back)."""
        return min(range(len(self._actors)), key=lambda i: (i in failed, self._in_flight[i]))
