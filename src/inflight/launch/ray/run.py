"""`inflight run TARGET launcher=ray`: the run of the local launcher, its pieces placed on a Ray cluster
(`place()` says what goes where) and driven in the run's actor (`RunDriver`). What a run does is
`orchestrator/run.py`'s, unchanged; the pieces are this package's other modules."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from inflight.config import RunConfig
from inflight.errors import UserError, describe
from inflight.launch.ray.cluster import connected, import_ray
from inflight.launch.ray.placement import Fixes, bundle_strategy, bundles, for_actor, reserve
from inflight.launch.ray.replicas import (
    EngineReplica,
    ReplicaInfo,
    ReplicaWatch,
    engine_key_env,
    replica_infos,
    start_replica,
)
from inflight.launch.ray.rollout_workers import RayRolloutWorkers, RolloutWorker
from inflight.launch.ray.stop import STOP_NAMESPACE, STOP_POLL_S, StopWatch, kv_store, stop_key_for
from inflight.launch.ray.trainers import RankedTrainer, TrainerRank
from inflight.launch.ray.verifiers import VERIFIER_TASK_RETRIES, RayVerifiers, VerifierActor

if TYPE_CHECKING:
    from inflight.orchestrator.stopping import StopRequest


def run_on_ray(cfg: RunConfig, target: str, stop: StopRequest | None = None) -> dict[str, Any]:
    """Train `target` as `cfg` says, on the cluster `cfg.ray` names; returns the summary (also in
    RUN_DIR/summary.json), with the same keys as a local run's. `stop`, once set here (a signal), is
    forwarded to the run's actor, whose training then ends after the step in flight; set while Ray still
    places the actors, it ends that wait (`StoppedBeforeRun`), the actors and their reservation released."""
    if cfg.pipeline.engine_urls:
        raise UserError(
            "launcher=ray starts its own engine replicas (ray.num_engine_replicas): "
            "unset pipeline.engine_urls"
        )
    ray = import_ray()
    from inflight.orchestrator.setup import resolve_model, run_dir_path

    with connected(ray, cfg.ray):
        # Every actor must find these from its own working directory: absolute paths, the model built once.
        cfg = cfg.model_copy(deep=True)
        cfg.run_dir, cfg.model.path = str(run_dir_path(cfg).resolve()), resolve_model(cfg)
        if cfg.engine.backend == "vllm":
            from inflight.launch.engine_process import check_vllm_model_dir

            check_vllm_model_dir(cfg.model.path)
        placement = place(ray, cfg, _portable(target), stop)
        try:
            return placement.run(stop)
        finally:
            placement.release()


@dataclass
class Placement:
    """The placed run: its placement group, the engine replicas (already serving) and the run's actor."""

    ray: Any
    group: Any
    replicas: list[Any]
    infos: list[ReplicaInfo]
    driver: Any  # None until started
    cfg: RunConfig
    target: str
    ranks: list[Any]  # the trainer ranks after the run's own (rank 0): ray.num_trainer_ranks - 1 actors
    verifiers: list[Any]  # ray.num_verifier_actors VerifierActor actors
    workers: list[Any]  # ray.num_rollout_workers RolloutWorker actors

    def run(self, stop: StopRequest | None = None) -> dict[str, Any]:
        """The run's summary; waits in slices, so that this (main) thread's signal handlers run and a stop
        they ask for reaches the actor (through Ray's key-value store, read by its `StopWatch`)."""
        exceptions = self.ray.exceptions
        key = stop_key_for(self.cfg)
        done = self.driver.run.remote(
            self.cfg, self.target, self.replicas, self.infos, self.ranks, self.verifiers, self.workers, key
        )
        forwarded = False
        try:
            while not self.ray.wait([done], timeout=STOP_POLL_S)[0]:
                if stop is not None and stop.reason is not None and not forwarded:
                    kv_store()._internal_kv_put(key, stop.reason, namespace=STOP_NAMESPACE)
                    forwarded = True
            return self.ray.get(done)
        except exceptions.RayTaskError as e:
            if isinstance(e.cause, UserError):  # bad input found inside the actor: still one line
                raise UserError(str(e.cause)) from None
            raise
        except exceptions.RayActorError as e:
            raise UserError(
                f"the trainer's actor died ({describe(e)}); the run stopped. Run the same command with "
                f"run_dir={self.cfg.run_dir} to resume from its last checkpoint (checkpoint_every_steps)"
            ) from None

    def release(self) -> None:
        """The run's actors and its reservation go; the cluster stays (unless this launcher started it)."""
        for actor in [self.driver, *self.workers, *self.ranks, *self.replicas, *self.verifiers]:
            if actor is not None:
                self.ray.kill(actor, no_restart=True)
        kv_store()._internal_kv_del(stop_key_for(self.cfg), namespace=STOP_NAMESPACE)
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.group)


def place(ray: Any, cfg: RunConfig, target: str, stop: StopRequest | None = None) -> Placement:
    """What runs where, all in one placement group (ray.strategy: PACK by default):

        bundle i < N   engine replica i: an actor serving the engine over HTTP (`inference/server.py`'s app,
                       as `inflight serve-engine` does), on a port fixed at placement so that a replica Ray
                       restarts (ray.max_replica_restarts) comes back at the same URL
        bundle N       the run: the trainer, the rollout loop and the result stream (`orchestrator/run.py`,
                       one process as in a local run) reaching the replicas through `pipeline.engine_urls`;
                       weights go to them as files in RUN_DIR/weights (`/update_weights`, `/set_adapter`)
                       or in the request bodies (`pipeline.weight_transport`)
        bundle N+k     data-parallel trainer rank k (k < ray.num_trainer_ranks): an actor holding a replica of
                       the trainer (`TrainerRank`); the run's actor is rank 0 and drives every step
        bundle N+R+j   verifier actor j (j < ray.num_verifier_actors = V): a sandbox pool (`VerifierActor`)
                       the run's environments send their sandboxed code to (`RayVerifiers`, the default pool)
        bundle N+R+V+w rollout worker w (w < ray.num_rollout_workers): an actor playing the groups the run
                       admits (`RolloutWorker`; `RayRolloutWorkers` is the pipeline's `GroupPlayer`); 0 of
                       them: the rollouts run on the run's own event loop

    The result stream stays in the run's process (a group comes back through Ray's object store) unless
    pipeline.stream_url names one every worker reaches (redis://), so the default file stream in the run
    directory serves any cluster; only the weight files and the model need storage every node can read.
    A stop (`stop`, a signal) before the run's actor starts ends the placement (`StoppedBeforeRun`).
    """
    has_gpus = ray.cluster_resources().get("GPU", 0) > 0
    shape = bundles(cfg, has_gpus)
    # On a cluster without GPUs only a device set to cuda asks for one ("auto" then means the CPU).
    devices = {"engine.device": cfg.engine.device, "trainer.device": cfg.trainer.device}
    on_cpu = [f"{key}=cpu" for key, device in devices.items() if device.startswith("cuda")]
    fix = Fixes(
        cpus="Lower ray.num_engine_replicas, ray.engine_cpus (e.g. ray.engine_cpus=0.5), ray.trainer_cpus, "
        "ray.num_verifier_actors or ray.num_rollout_workers (or their *_cpus: a rollout worker needs little, "
        "e.g. ray.rollout_worker_cpus=0.25), or add nodes",
        no_gpus=f"Set {' '.join(on_cpu)} (or auto: a GPU only where the cluster has one)",
        few_gpus="Lower ray.engine_gpus or ray.trainer_gpus (a fraction shares a GPU), "
        "ray.num_engine_replicas or ray.num_trainer_ranks, or add GPU nodes",
    )
    group = reserve(ray, shape, cfg.ray, "launcher=ray", fix, stop)

    def on_bundle(index: int) -> Any:
        return bundle_strategy(group, index)

    placed = Placement(ray, group, [], [], None, cfg, target, [], [], [])
    try:
        _start_actors(ray, placed, shape, on_bundle, stop)
    except BaseException:
        placed.release()
        raise
    for i, info in enumerate(placed.infos):
        print(f"inflight: ray: engine replica {i} serves {info.url} (pid {info.pid})", file=sys.stderr)
    return placed


def _start_actors(
    ray: Any, placed: Placement, shape: list[dict[str, float]], on_bundle: Any, stop: StopRequest | None
) -> None:
    """The replicas on bundles 0..N-1 (waiting until each serves), the run's actor on bundle N, the other
    trainer ranks on the bundles after it."""
    cfg, n = placed.cfg, placed.cfg.ray.num_engine_replicas
    run_dir = Path(cfg.run_dir or ".")
    # Named RUN_NAME:engine-i, RUN_NAME:run and RUN_NAME:rank-k, so that `ray.get_actor` finds them (to
    # inspect or kill).
    replica_cls, driver_cls, rank_cls = (
        ray.remote(EngineReplica),
        ray.remote(RunDriver),
        ray.remote(TrainerRank),
    )
    for i in range(n):
        name, weights_dir = f"{run_dir.name}:engine-{i}", str(run_dir / "weights")
        placed.replicas.append(
            start_replica(ray, replica_cls, cfg, placed.group, i, shape[i], name, weights_dir)
        )
    placed.driver = driver_cls.options(
        name=f"{run_dir.name}:run",
        num_cpus=shape[n]["CPU"],
        num_gpus=shape[n].get("GPU", 0.0),
        scheduling_strategy=on_bundle(n),
        runtime_env=engine_key_env(),  # its engine clients send the replicas' key
    ).remote()
    for k in range(1, cfg.ray.num_trainer_ranks):
        placed.ranks.append(
            rank_cls.options(
                name=f"{run_dir.name}:rank-{k}",
                num_cpus=shape[n + k]["CPU"],
                num_gpus=shape[n + k].get("GPU", 0.0),
                scheduling_strategy=on_bundle(n + k),
            ).remote()
        )
    verifier_cls, first = ray.remote(VerifierActor), n + cfg.ray.num_trainer_ranks
    for j in range(cfg.ray.num_verifier_actors):
        concurrency = max(1, round(cfg.ray.verifier_cpus))
        placed.verifiers.append(
            verifier_cls.options(
                name=f"{run_dir.name}:verifier-{j}",
                num_cpus=shape[first + j]["CPU"],
                max_concurrency=concurrency + 1,  # its sandboxes, and a stats() call beside them
                max_restarts=-1,  # stateless: always worth restarting
                max_task_retries=VERIFIER_TASK_RETRIES,
                scheduling_strategy=on_bundle(first + j),
            ).remote(concurrency)
        )
    who = f"launcher=ray (loading {cfg.model.path})"
    placed.infos = replica_infos(ray, placed.replicas, cfg.ray, who, stop)
    placed.cfg = for_actor(cfg, shape[n].get("GPU", 0.0), engine_urls=[info.url for info in placed.infos])
    worker_cls, first = ray.remote(RolloutWorker), first + cfg.ray.num_verifier_actors
    for w in range(cfg.ray.num_rollout_workers):
        placed.workers.append(
            worker_cls.options(
                name=f"{run_dir.name}:rollouts-{w}",
                num_cpus=shape[first + w]["CPU"],
                max_restarts=-1,  # it holds nothing the run needs: always worth restarting
                scheduling_strategy=on_bundle(first + w),
                runtime_env=engine_key_env(),  # its engine clients send the replicas' key
            ).remote(for_actor(placed.cfg, 0.0), placed.target, placed.verifiers)
        )


class RunDriver:
    """The run itself, on the trainer's bundle: `orchestrator.run.run` with the replicas as its engine.
    A plain (single-threaded) actor, so the run has the main thread as it has locally; a stop asked of the
    launcher arrives through Ray's key-value store under `stop_key` (`StopWatch`)."""

    def run(
        self,
        cfg: RunConfig,
        target: str,
        replicas: list[Any],
        infos: list[ReplicaInfo],
        ranks: list[Any],
        verifiers: list[Any],
        workers: list[Any],
        stop_key: str,
    ) -> dict[str, Any]:
        from inflight.envs.sandbox import set_default_pool
        from inflight.orchestrator.run import run
        from inflight.orchestrator.target import resolve_target

        made: list[RankedTrainer] = []

        def ranked(cfg: RunConfig, model: Any, tokenizer: object) -> RankedTrainer:
            made.append(RankedTrainer(cfg, model, tokenizer, ranks))
            return made[-1]

        remote = RayVerifiers(verifiers) if verifiers else None
        # Every environment's sandboxes (default_pool) go to the verifier actors, for this run only.
        previous = set_default_pool(remote) if remote is not None else None
        try:
            with ReplicaWatch(replicas, infos) as watch, StopWatch(stop_key) as stop:

                def metrics() -> dict[str, float]:
                    return watch.metrics() | ({} if remote is None else remote.metrics())

                return run(
                    cfg,
                    resolve_target(target),
                    launcher_metrics=metrics,
                    make_trainer=ranked if ranks else None,
                    players=RayRolloutWorkers(workers, cfg.rollout.timeout_s) if workers else None,
                    stop=stop,
                )
        finally:
            if remote is not None:
                set_default_pool(previous)
            for trainer in made:
                trainer.close()


def _portable(target: str) -> str:
    """A file TARGET as an absolute path, which the trainer's actor resolves from any working directory."""
    where, sep, attr = target.rpartition(":")
    if not (sep and attr.isidentifier()):
        where, sep, attr = target, "", ""
    path = Path(where).expanduser()
    if (where.endswith(".py") or "/" in where) and path.is_file():
        return f"{path.resolve()}{sep}{attr}"
    return target
