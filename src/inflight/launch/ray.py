"""`inflight run TARGET launcher=ray`: the run of the local launcher, its pieces placed on a Ray cluster.

The only module that imports `ray`, and only once a run asks for it (a CPU install without Ray imports
inflight, and `--help` stays instant). Knows processes and machines; what a run does is
`orchestrator/run.py`'s, unchanged. What is placed where is `place()`; a replica that dies is Ray's to
restart, the pipeline's client's to route around and update, and `ReplicaWatch`'s to count.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from inflight.config import EngineConfig, ModelConfig, RayConfig, RunConfig
from inflight.envs.sandbox.pool import KILL_GRACE_S
from inflight.errors import UserError, describe
from inflight.inference.access import API_KEY_ENV
from inflight.orchestrator.stopping import StoppedBeforeRun

if TYPE_CHECKING:
    from inflight.api.compute import ServiceComputeConfig
    from inflight.api.job_types import ForwardBackwardJob, ForwardBackwardOutput, LoraSpec, OptimStep
    from inflight.api.sampler import SamplingLimits
    from inflight.envs.sandbox import Isolation, SandboxLimits, SandboxResult, VerifierPoolConfig
    from inflight.inference.backends import VllmOptions
    from inflight.inference.builtin import BuiltinEngineConfig
    from inflight.orchestrator.rollout_group import PlayedGroup
    from inflight.orchestrator.stopping import StopRequest
    from inflight.orchestrator.task import Problem
    from inflight.types import AdapterUpdate

T = TypeVar("T")
RAY_MISSING = "launcher=ray needs Ray: pip install 'inflight[ray]'"
COLLECTIVE_FAILURE_WAIT_S = 30.0  # after a collective broke here, how long the other ranks get to say why
WATCH_INTERVAL_S = 1.0  # how often the trainer's actor asks each replica which process serves it
VERIFIER_TASK_RETRIES = 2  # how often Ray runs a job again on a verifier actor it restarted
PLAY_ATTEMPTS = 4  # rollout workers one group may be sent to (a lost play is played again elsewhere)
STOP_POLL_S = 0.5  # how often the launcher forwards, and the run's actor reads, a stop (a signal)
STOP_NAMESPACE = "inflight"
PLAY_GRACE_S = 60.0  # a group's play is bounded by rollout.timeout_s (its rollouts run at once) plus this


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
    ray = _import_ray()
    from inflight.orchestrator.setup import resolve_model, run_dir_path

    with _cluster(ray, cfg.ray):
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
class ReplicaInfo:
    url: str
    pid: int
    node: str  # the node's IP address, as Ray knows it


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
        key = _stop_key(self.cfg)
        done = self.driver.run.remote(
            self.cfg, self.target, self.replicas, self.infos, self.ranks, self.verifiers, self.workers, key
        )
        forwarded = False
        try:
            while not self.ray.wait([done], timeout=STOP_POLL_S)[0]:
                if stop is not None and stop.reason is not None and not forwarded:
                    _kv()._internal_kv_put(key, stop.reason, namespace=STOP_NAMESPACE)
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
        _kv()._internal_kv_del(_stop_key(self.cfg), namespace=STOP_NAMESPACE)
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.group)


@contextmanager
def engines_on_ray(
    engines: Mapping[str, tuple[str, EngineConfig]],
    ray_config: RayConfig,
    weights_dir: str,
    vllm: VllmOptions | None = None,
    held: Sequence[Mapping[str, float]] = (),
) -> Iterator[dict[str, str]]:
    """`inflight serve --launcher ray`: the service's sampling engines placed on a Ray cluster, one
    `EngineReplica` actor per base model (name -> (model directory, engine config: the built-in engine, or
    vLLM with `vllm`'s options)) on a bundle of its own ({CPU: ray.engine_cpus} + ray.engine_gpus GPU when
    the engine's device is cuda) in one placement group (ray.strategy); yields name -> URL once every
    engine serves, and releases actors and group on exit. The service itself (its API) stays in the calling
    process and reaches them over HTTP. `held`: the bundles the service reserved already (its training's),
    which a local Ray must hold beside these."""
    ray = _import_ray()
    from ray.util.placement_group import remove_placement_group

    with _cluster(ray, ray_config):
        has_gpus = ray.cluster_resources().get("GPU", 0) > 0
        shape = [_engine_bundle(ray_config, config.device, has_gpus) for _, config in engines.values()]
        fix = Fixes(f"Serve fewer base models here, or serve on {MORE_CPUS}", *SERVE_FIXES)
        group = _reserve(ray, shape, ray_config, "serve --launcher ray", fix, held=held)
        actors: list[Any] = []
        try:
            replica_cls = ray.remote(EngineReplica)
            for i, (name, (path, config)) in enumerate(engines.items()):
                run_cfg = RunConfig(model=ModelConfig(path=path), ray=ray_config, engine=config)
                name_on_ray = f"serve-{os.getpid()}:engine-{name}"  # ray.get_actor finds it
                actors.append(
                    _start_replica(
                        ray, replica_cls, run_cfg, group, i, shape[i], name_on_ray, weights_dir, vllm
                    )
                )
            infos = _replica_infos(ray, actors, ray_config, "serve --launcher ray", None)
            for name, info in zip(engines, infos, strict=True):
                print(f"inflight: ray: base model {name!r} samples on {info.url}", file=sys.stderr)
            yield {name: info.url for name, info in zip(engines, infos, strict=True)}
        finally:
            for actor in actors:
                ray.kill(actor, no_restart=True)
            remove_placement_group(group)


@contextmanager
def compute_on_ray(
    base_models: dict[str, str], max_rank: int, config: ServiceComputeConfig, ray_config: RayConfig
) -> Iterator[RayCompute]:
    """`inflight serve --launcher ray`: the service's training (its `ServiceCompute`: base models,
    tenants' adapters, their optimizers and checkpoints) in a `ComputeActor` on a bundle of its own
    ({CPU: ray.trainer_cpus} + ray.trainer_gpus GPU when `config.device` is cuda, or auto on a cluster
    with GPUs); yields the `RayCompute` that forwards the worker's calls to it, and releases the actor and
    its placement group on exit. The service's state directory must be on storage both processes see."""
    ray = _import_ray()
    from ray.util.placement_group import remove_placement_group

    with _cluster(ray, ray_config):
        gpu = _on_gpu(config.device, ray.cluster_resources().get("GPU", 0) > 0)
        shape = [{"CPU": ray_config.trainer_cpus} | ({"GPU": ray_config.trainer_gpus} if gpu else {})]
        fix = Fixes(f"Serve on {MORE_CPUS}", *SERVE_FIXES)
        group = _reserve(ray, shape, ray_config, "serve --launcher ray (training)", fix)
        actor = None
        try:
            placed = config.model_copy(update={"device": "cuda" if gpu else "cpu", "sampling_engine": False})
            actor = (
                ray.remote(ComputeActor)
                .options(
                    name=f"serve-{os.getpid()}:trainer",
                    num_cpus=shape[0]["CPU"],
                    num_gpus=shape[0].get("GPU", 0.0),
                    scheduling_strategy=_on_bundle(group, 0),
                )
                .remote(base_models, max_rank, placed, max(1, int(ray_config.trainer_cpus)))
            )
            compute = RayCompute(actor, ray_config.trainer_collective_timeout_s, bundle=shape[0])
            print(
                f"inflight: ray: training of {', '.join(base_models)} in actor serve-{os.getpid()}:trainer",
                file=sys.stderr,
            )
            yield compute
        finally:
            if actor is not None:
                ray.kill(actor, no_restart=True)
            remove_placement_group(group)


def check_serve_device(device: str, r: RayConfig) -> None:
    """`inflight serve --launcher ray --device`: a cuda device (cuda:N too: an actor sees its GPU as cuda:0)
    checked against the GPUs of the Ray this process is connected to, not this machine's. A local Ray
    without any is one line naming the fix, before anything is placed or written; a cluster at an address
    is left to the placement's bounded wait (`_reserve`): an autoscaler may add GPU nodes."""
    if not device.startswith("cuda") or r.address is not None:
        return
    if not _import_ray().cluster_resources().get("GPU", 0):
        raise UserError(
            f"--device={device!r} but the local Ray (this machine's) has no GPUs: serve with --device cpu "
            "(or auto), or on a cluster with GPUs (--ray-address HOST:PORT)"
        )


def _engine_bundle(r: RayConfig, device: str, cluster_has_gpus: bool) -> dict[str, float]:
    return {"CPU": r.engine_cpus} | ({"GPU": r.engine_gpus} if _on_gpu(device, cluster_has_gpus) else {})


@dataclass
class Fixes:
    """What a refused placement's line suggests: for want of CPUs, on a cluster without a GPU (the devices
    to change), and on one with too few GPUs."""

    cpus: str
    no_gpus: str
    few_gpus: str


# What `inflight serve` can change when the CPUs are short: ray.*_cpus are not among its options.
MORE_CPUS = "a cluster with more CPUs (--ray-address HOST:PORT, docs/laptop-to-cluster.md)"
SERVE_FIXES = (
    "Serve with --device cpu (or auto: a GPU only where the cluster has one)",
    "Serve with --device cpu, or add GPU nodes",
)


def _reserve(
    ray: Any,
    shape: list[dict[str, float]],
    r: RayConfig,
    who: str,
    fix: Fixes,
    stop: StopRequest | None = None,
    held: Sequence[Mapping[str, float]] = (),
) -> Any:
    """A placement group of `shape` (r.strategy), ready; one line naming the shape, what the cluster has and
    the fix when it cannot hold it within r.placement_timeout_s (a local Ray, which never grows: at once,
    counting the bundles the caller `held` already, which it keeps). A stop (`stop`, set by a signal) ends
    the wait (`StoppedBeforeRun`); the group goes either way."""
    from ray.util.placement_group import placement_group, remove_placement_group

    totals = ray.cluster_resources()
    gpus = totals.get("GPU", 0.0)
    gpus_fix = fix.few_gpus if gpus else fix.no_gpus
    for resource, wanted in (("GPU", gpus_fix), ("CPU", fix.cpus)):
        needed, total = sum(b.get(resource, 0.0) for b in [*held, *shape]), totals.get(resource, 0.0)
        if r.address is None and needed > total:  # a local Ray never grows: fail now, not after the wait
            beside = f" beside the {list(held)} held already" if held else ""
            raise UserError(
                f"{who}: the placement needs {needed:g} {resource}s ({shape}{beside}) but the local Ray has "
                f"{_count(total)} {resource}s (this machine's). {wanted}"
            )
    group = placement_group(shape, strategy=r.strategy)
    try:
        ready = _ready_within(ray, [group.ready()], r.placement_timeout_s, stop, "Ray placed the actors")
    except BaseException:
        remove_placement_group(group)
        raise
    if not ready:
        remove_placement_group(group)
        # Short of GPUs (an autoscaler may add some: hence the wait), the CPU settings are not the fix.
        wanted = gpus_fix if sum(b.get("GPU", 0.0) for b in shape) > gpus else fix.cpus
        free = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
        raise UserError(
            f"{who}: the cluster could not hold {shape} ({r.strategy}) within ray.placement_timeout_s="
            f"{r.placement_timeout_s:g}; it has {_count(gpus)} GPUs, and {free} free. {wanted}"
        )
    return group


def _count(total: float) -> str:
    return f"{total:g}" if total else "no"


def _ready_within(ray: Any, refs: list[Any], timeout_s: float, stop: StopRequest | None, during: str) -> bool:
    """Whether all of `refs` are ready (done or failed) within `timeout_s`. Waited for in STOP_POLL_S slices,
    between which this (main) thread's signal handlers run: a stop they ask for (`stop`) ends the wait at
    once, as `StoppedBeforeRun` naming what was under way (`during`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if stop is not None and stop.reason is not None:
            raise StoppedBeforeRun(stop.reason, during)
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=min(left, STOP_POLL_S))
        if len(ready) == len(refs):
            return True


def _engine_key_env() -> dict[str, dict[str, str]]:
    """The runtime_env that gives an actor the replicas' API key ($INFLIGHT_ENGINE_API_KEY): a replica serves
    on its node's address, beyond loopback, so it takes requests only with the key (`inference/access.py`:
    serve-engine refuses to listen there without one), and the run's clients send it. The caller's own key
    when it set one, else one made for this process (set in its environment too, for the clients of
    `serve --launcher ray`, which run here)."""
    key = os.environ.get(API_KEY_ENV, "").strip()
    if not key:
        key = os.environ[API_KEY_ENV] = secrets.token_hex(32)
    return {"env_vars": {API_KEY_ENV: key}}


def _on_bundle(group: Any, index: int) -> Any:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)


def _start_replica(
    ray: Any,
    replica_cls: Any,
    cfg: RunConfig,
    group: Any,
    index: int,
    bundle: dict[str, float],
    name: str,
    weights_dir: str,
    vllm: VllmOptions | None = None,
) -> Any:
    """An `EngineReplica` actor on bundle `index`, serving on a port picked on that node now (so that a
    replica Ray restarts comes back at the same URL)."""
    port_task = ray.remote(_free_port).options(num_cpus=0, scheduling_strategy=_on_bundle(group, index))
    host, port = ray.get(port_task.remote())
    gpus = bundle.get("GPU", 0.0)
    return replica_cls.options(
        name=name,
        num_cpus=bundle["CPU"],
        num_gpus=gpus,
        max_restarts=cfg.ray.max_replica_restarts,
        scheduling_strategy=_on_bundle(group, index),
        runtime_env=_engine_key_env(),
    ).remote(_for_actor(cfg, gpus), host, port, weights_dir, vllm)


def _replica_infos(
    ray: Any, replicas: list[Any], r: RayConfig, who: str, stop: StopRequest | None
) -> list[ReplicaInfo]:
    """Each replica's URL once it serves; one line when they do not within r.replica_start_timeout_s. A stop
    (`stop`) ends the wait (`StoppedBeforeRun`)."""
    refs = [a.info.remote() for a in replicas]
    if not _ready_within(ray, refs, r.replica_start_timeout_s, stop, "the engine replicas started"):
        raise UserError(
            f"{who}: the engine replicas did not start within ray.replica_start_timeout_s="
            f"{r.replica_start_timeout_s:g}"
        )
    try:
        infos: list[ReplicaInfo] = ray.get(refs)
    except ray.exceptions.RayError as e:
        raise RuntimeError(f"{who}: an engine replica failed to start: {e}") from None
    return infos


def bundles(cfg: RunConfig, cluster_has_gpus: bool) -> list[dict[str, float]]:
    """The placement group's bundles: one per engine replica, then one per trainer rank (the first is the
    run's own), then one per verifier actor, then one per rollout worker (CPU only). A GPU (or the
    fraction ray.*_gpus) where the component's device is cuda ("auto": where the cluster has GPUs)."""
    r = cfg.ray
    engine = _engine_bundle(r, cfg.engine.device, cluster_has_gpus)
    trainer = {"CPU": r.trainer_cpus} | (
        {"GPU": r.trainer_gpus} if _on_gpu(cfg.trainer.device, cluster_has_gpus) else {}
    )
    verifier, worker = {"CPU": r.verifier_cpus}, {"CPU": r.rollout_worker_cpus}
    return (
        [engine] * r.num_engine_replicas
        + [trainer] * r.num_trainer_ranks
        + [verifier] * r.num_verifier_actors
        + [worker] * r.num_rollout_workers
    )


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
    group = _reserve(ray, shape, cfg.ray, "launcher=ray", fix, stop)

    def on_bundle(index: int) -> Any:
        return _on_bundle(group, index)

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
            _start_replica(ray, replica_cls, cfg, placed.group, i, shape[i], name, weights_dir)
        )
    placed.driver = driver_cls.options(
        name=f"{run_dir.name}:run",
        num_cpus=shape[n]["CPU"],
        num_gpus=shape[n].get("GPU", 0.0),
        scheduling_strategy=on_bundle(n),
        runtime_env=_engine_key_env(),  # its engine clients send the replicas' key
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
    placed.infos = _replica_infos(ray, placed.replicas, cfg.ray, who, stop)
    placed.cfg = _for_actor(cfg, shape[n].get("GPU", 0.0), engine_urls=[info.url for info in placed.infos])
    worker_cls, first = ray.remote(RolloutWorker), first + cfg.ray.num_verifier_actors
    for w in range(cfg.ray.num_rollout_workers):
        placed.workers.append(
            worker_cls.options(
                name=f"{run_dir.name}:rollouts-{w}",
                num_cpus=shape[first + w]["CPU"],
                max_restarts=-1,  # it holds nothing the run needs: always worth restarting
                scheduling_strategy=on_bundle(first + w),
                runtime_env=_engine_key_env(),  # its engine clients send the replicas' key
            ).remote(_for_actor(placed.cfg, 0.0), placed.target, placed.verifiers)
        )


class EngineReplica:
    """One engine behind HTTP in its own actor. The built-in engine: the one `setup.build_engine` makes from
    cfg.engine (as the local launcher's), served by `server.create_app` on a `ServerThread`. vLLM
    (cfg.engine.backend): `serve-engine --backend vllm` in a process of the actor's (`EngineProcess`, in
    the vLLM environment on this node), restarted on its port when it dies (engine.max_restarts), gone
    with the actor. Ray reruns this constructor when it restarts the actor; the pipeline's client then
    brings it up to date (weights, adapters). `info().pid` is the serving process's: a new one is a
    restart (`ReplicaWatch`)."""

    def __init__(
        self, cfg: RunConfig, host: str, port: int, weights_dir: str, vllm: VllmOptions | None = None
    ) -> None:
        self.node = host
        threads = max(1, int(cfg.ray.engine_cpus))
        if cfg.engine.backend == "vllm":
            from inflight.launch.engine_process import EngineProcess

            assert cfg.model.path, "run_on_ray and engines_on_ray resolve the model to a directory"
            self.process: EngineProcess | None = EngineProcess(
                cfg.model.path,
                backend="vllm",
                max_batch_size=cfg.engine.max_batch_size,
                max_seq_len_tokens=cfg.engine.max_seq_len_tokens,
                vllm=vllm,
                host=host,
                port=port,
                weights_dir=weights_dir,
                threads=threads,
                max_restarts=cfg.engine.max_restarts,
                start_timeout_s=cfg.ray.replica_start_timeout_s,
            ).start()
            self.url = self.process.url
            return
        import torch

        from inflight.inference.server import EngineServerConfig, ServerThread, create_app
        from inflight.models import load_tokenizer
        from inflight.models.chat_template import generation_stop_ids
        from inflight.orchestrator.setup import build_engine, load_policy

        torch.set_num_threads(threads)
        model, tokenizer = load_policy(cfg)
        engine = build_engine(cfg, model, tokenizer)
        # Requests may read weights only from the run's weights directory, and need the run's key: the
        # replica listens on its node's address (`_engine_key_env`).
        key = os.environ.get(API_KEY_ENV)
        server_cfg = EngineServerConfig(
            model_name=str(cfg.model.path), weights_dir=weights_dir, api_keys=[key] if key else []
        )
        app = create_app(engine, load_tokenizer(str(cfg.model.path)), server_cfg, generation_stop_ids(model))
        self.process, self.server = None, ServerThread(app, host=host, port=port).start()
        self.url = self.server.url

    def info(self) -> ReplicaInfo:
        pid = os.getpid() if self.process is None else self.process.pid
        return ReplicaInfo(self.url, pid if pid is not None else -1, self.node)


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


class TrainerRank:
    """Data-parallel trainer rank k >= 1 on a bundle of its own: a `DataParallelTrainer` (or, with
    ray.trainer_sharding=fsdp, a `ShardedDataParallelTrainer`) over the run's warmed-up weights (sent by rank
    0), stepping on every batch rank 0 steps on, over its share of it."""

    def start(
        self, cfg: RunConfig, weights: dict[str, Any], rank: int, world_size: int, init_method: str
    ) -> None:
        import torch

        from inflight.orchestrator.setup import load_policy, pad_id, run_trainer_config
        from inflight.trainer.distributed import init_data_parallel

        torch.set_num_threads(max(1, int(cfg.ray.trainer_cpus)))
        model, tokenizer = load_policy(cfg)
        model.load_state_dict(weights)
        config = run_trainer_config(cfg.trainer, cfg.grpo.steps)
        timeout_s = cfg.ray.trainer_collective_timeout_s
        group = init_data_parallel(rank, world_size, init_method, config.device, timeout_s)
        self.trainer = _rank_trainer(cfg, model, config, group, pad_id(tokenizer))

    def train_step(self, samples: list[Any]) -> int:
        self.trainer.train_step(samples)
        return self.trainer.version

    def resume_checkpoint(self, path: str) -> int:
        self.trainer.resume_checkpoint(path)
        return self.trainer.version

    def assert_in_sync(self) -> None:
        self.trainer.assert_replicas_in_sync()

    def join_weights(self) -> None:
        """This rank's side of rank 0's `weights()` under FSDP (the gathers of every shard)."""
        self.trainer.weights()

    def join_save(self, path: str) -> None:
        """This rank's side of rank 0's `save_checkpoint` under FSDP (gathers, then the barrier)."""
        self.trainer.save_checkpoint(path)


def _rank_trainer(cfg: RunConfig, model: Any, config: Any, group: Any, pad: int) -> Any:
    """One rank's trainer: a replica of the model (DataParallelTrainer), or its shards (FSDP2)."""
    if cfg.ray.trainer_sharding == "fsdp":
        from inflight.trainer.fsdp import ShardedDataParallelTrainer

        return ShardedDataParallelTrainer(model, config, group, pad)
    from inflight.trainer.distributed import DataParallelTrainer

    return DataParallelTrainer(model, config, group, pad)


class RankedTrainer:
    """Rank 0 of `ray.num_trainer_ranks` data-parallel ranks, in the run's actor: the trainer the run's loop
    drives (`StepTrainer`). A step goes to every rank at once (the others are `TrainerRank` actors, each
    training its share and summing gradients with the rest over torch.distributed); weights, adapters and
    checkpoints are rank 0's, the replicas being equal, or under FSDP (ray.trainer_sharding=fsdp) gathered
    from every rank's shards to rank 0, the other ranks joining each gather. A rank that dies stops the run
    in one line that says how to resume (from the last checkpoint, `checkpoint_every_steps`)."""

    def __init__(self, cfg: RunConfig, model: Any, tokenizer: object, ranks: list[Any]) -> None:
        import ray

        from inflight.orchestrator.setup import pad_id, run_trainer_config
        from inflight.trainer.distributed import init_data_parallel

        self._ray, self._ranks, self._run_dir = ray, ranks, cfg.run_dir
        self._sharded = cfg.ray.trainer_sharding == "fsdp"
        host, port = _free_port()
        init_method, world_size = f"tcp://{host}:{port}", len(ranks) + 1
        weights = ray.put({name: t.detach().cpu() for name, t in model.state_dict().items()})
        # The other ranks join first (asynchronously): joining the group waits for every rank.
        started = [
            rank.start.remote(cfg, weights, k, world_size, init_method) for k, rank in enumerate(ranks, 1)
        ]
        config = run_trainer_config(cfg.trainer, cfg.grpo.steps)
        group = init_data_parallel(
            0, world_size, init_method, config.device, cfg.ray.trainer_collective_timeout_s
        )
        self._local = _rank_trainer(cfg, model, config, group, pad_id(tokenizer))
        self._get(started)
        self.config = config
        self.version = self._local.version

    def train_step(self, samples: Any) -> dict[str, float]:
        others = [rank.train_step.remote(list(samples)) for rank in self._ranks]
        return self._with_others(others, lambda: self._local.train_step(samples))

    def weights(self) -> dict[str, Any]:
        if not self._sharded:
            return self._local.weights()
        # Sharded, the weights are gathered: every rank joins (rank 0, the writer, keeps them).
        others = [rank.join_weights.remote() for rank in self._ranks]
        return self._with_others(others, self._local.weights)

    def base_weights(self) -> dict[str, Any]:
        return self.weights() if self._sharded else self._local.base_weights()  # no LoRA when sharded

    def adapter_update(self) -> Any:
        return self._local.adapter_update()

    def save_checkpoint(self, path: str | Path, extra: dict | None = None) -> Path:
        """Rank 0 writes, once every rank showed it holds the same weights (a fingerprint all-reduce): the
        checkpoint then stands for every replica."""
        others = [rank.assert_in_sync.remote() for rank in self._ranks]
        self._with_others(others, self._local.assert_replicas_in_sync)
        if not self._sharded:
            return self._local.save_checkpoint(path, extra)
        # Sharded, the checkpoint's full tensors are gathered from every rank as rank 0 writes them.
        others = [rank.join_save.remote(str(path)) for rank in self._ranks]
        return self._with_others(others, lambda: self._local.save_checkpoint(path, extra))

    def resume_checkpoint(self, path: str | Path) -> dict[str, Any]:
        # Every rank reads it (the run directory is on storage every node can read, as the model is).
        others = [rank.resume_checkpoint.remote(str(path)) for rank in self._ranks]
        return self._with_others(others, lambda: self._local.resume_checkpoint(path))

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

    def _with_others(self, others: list[Any], local: Callable[[], T]) -> T:
        """`local()` here while `others` (calls already sent) run on the other ranks; then wait for them. A
        collective broken here is reported with the cause the other ranks give (their error, or death)."""
        try:
            result = local()
        except RuntimeError:
            self._get(others, timeout_s=COLLECTIVE_FAILURE_WAIT_S)
            raise
        self._get(others)
        self.version = self._local.version
        return result

    def _get(self, refs: list[Any], timeout_s: float | None = None) -> list[Any]:
        exceptions = self._ray.exceptions
        try:
            return list(self._ray.get(refs, timeout=timeout_s))
        except exceptions.GetTimeoutError:
            return []
        except exceptions.RayTaskError as e:
            raise RuntimeError(f"a data-parallel trainer rank failed: {e}") from None
        except exceptions.RayActorError as e:
            raise UserError(
                f"a data-parallel trainer rank died ({describe(e)}); the run stopped. Run the same command "
                f"with run_dir={self._run_dir} to resume from its last checkpoint (checkpoint_every_steps)"
            ) from None


def _kv() -> Any:
    """Ray's cluster-wide key-value store (the GCS's), as Ray's own libraries use it: the one channel from
    the launcher to a running plain (single-threaded) actor that needs no actor, thread or file of its own."""
    from ray.experimental import internal_kv

    return internal_kv


def _stop_key(cfg: RunConfig) -> str:
    return f"stop:{cfg.run_dir}"


class StopWatch:
    """In the run's actor: a thread that reads the launcher's stop request (`_stop_key`) every
    STOP_POLL_S and sets the run's StopRequest with it."""

    def __init__(self, key: str) -> None:
        from inflight.orchestrator.stopping import StopRequest

        self.key, self.stop = key, StopRequest()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="inflight-stop-watch", daemon=True)

    def __enter__(self) -> StopRequest:
        self._thread.start()
        return self.stop

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(5)

    def _loop(self) -> None:
        kv = _kv()
        while not self._done.wait(STOP_POLL_S):
            with contextlib.suppress(Exception):  # the GCS briefly away: ask again next time
                reason = kv._internal_kv_get(self.key, namespace=STOP_NAMESPACE)
                if reason is not None:
                    self.stop.set(reason.decode())
                    return


class ReplicaWatch:
    """Counts engine replica restarts for the metrics: every WATCH_INTERVAL_S it asks each replica actor
    for its process id; a new one means Ray restarted it. Repairs nothing itself: Ray restarts the actor,
    and the pipeline's client retries elsewhere meanwhile and brings the restarted replica up to date."""

    def __init__(self, replicas: list[Any], infos: list[ReplicaInfo]) -> None:
        self._replicas, self._pids = replicas, [info.pid for info in infos]
        self._pending: list[Any] = [None] * len(replicas)
        self._up = [True] * len(replicas)
        self._restarts = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="replica-watch", daemon=True)

    def __enter__(self) -> ReplicaWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def metrics(self) -> dict[str, float]:
        return {"engine_replica_restarts": float(self._restarts), "engine_replicas_up": float(sum(self._up))}

    def _loop(self) -> None:
        import ray

        while not self._stop.wait(WATCH_INTERVAL_S):
            for i, replica in enumerate(self._replicas):
                if self._pending[i] is None:  # one question at a time: a hung replica does not pile them up
                    self._pending[i] = replica.info.remote()
            ray.wait(self._pending, num_returns=len(self._pending), timeout=0.5)
            for i, ref in enumerate(self._pending):
                if not ray.wait([ref], timeout=0)[0]:
                    continue
                self._pending[i] = None
                try:
                    pid = ray.get(ref).pid
                except ray.exceptions.RayError:  # restarting, or dead for good (restarts exhausted)
                    self._up[i] = False
                    continue
                self._up[i] = True
                if pid != self._pids[i]:
                    self._restarts += 1
                    self._pids[i] = pid


class ComputeActor:
    """The service's `ServiceCompute` in an actor of its own (`compute_on_ray`); `call` runs one of its
    methods. Not restarted when it dies: its adapters and optimizer moments live only in its memory, and a
    fresh one would silently serve new weights; the worker's calls then fail, each a server error."""

    def __init__(
        self, base_models: dict[str, str], max_rank: int, config: ServiceComputeConfig, threads: int
    ) -> None:
        import torch

        from inflight.api.compute import ServiceCompute

        torch.set_num_threads(threads)
        self.compute = ServiceCompute(base_models, max_rank=max_rank, config=config)

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.compute, method)(*args)

    def settings(self) -> ServiceComputeConfig:
        return self.compute.config


class RayCompute:
    """The `Compute` protocol (`api/compute.py`) over a `ComputeActor`: each call one actor task, waited
    for at most `timeout_s`; an exception raised there is raised here as itself (a UserError stays a
    4xx), a lost actor as RuntimeError naming it. Called from the worker thread only, as ServiceCompute."""

    def __init__(self, actor: Any, timeout_s: float, bundle: Mapping[str, float]) -> None:
        import ray

        self._ray, self._actor, self._timeout_s = ray, actor, timeout_s
        self.bundle = dict(bundle)  # what the actor's placement reserved (the engines' is placed beside it)
        self._config: ServiceComputeConfig = self._get(actor.settings.remote(), "settings")

    @property
    def config(self) -> ServiceComputeConfig:
        return self._config

    def base_model_names(self) -> list[str]:
        return self._call("base_model_names")  # type: ignore[no-any-return]

    def tokenizer_dir(self, base_model: str) -> str:
        return self._call("tokenizer_dir", base_model)  # type: ignore[no-any-return]

    def model_info(self, base_model: str) -> dict[str, Any]:
        return self._call("model_info", base_model)  # type: ignore[no-any-return]

    def create_adapter(self, model_id: str, base_model: str, lora: LoraSpec) -> None:
        self._call("create_adapter", model_id, base_model, lora)

    def has_adapter(self, model_id: str) -> bool:
        return self._call("has_adapter", model_id)  # type: ignore[no-any-return]

    def delete_adapter(self, model_id: str) -> None:
        self._call("delete_adapter", model_id)

    def forward_backward(self, jobs: list[ForwardBackwardJob]) -> list[ForwardBackwardOutput | Exception]:
        return self._call("forward_backward", jobs)  # type: ignore[no-any-return]

    def optim_step(self, step: OptimStep) -> dict[str, float]:
        return self._call("optim_step", step)  # type: ignore[no-any-return]

    def sampling_limits(self) -> dict[str, SamplingLimits]:
        return self._call("sampling_limits")  # type: ignore[no-any-return]

    def sampling_config(self, base_model: str) -> BuiltinEngineConfig:
        return self._call("sampling_config", base_model)  # type: ignore[no-any-return]

    def sample_only_on(self, base_model: str, modules: Sequence[str]) -> None:
        self._call("sample_only_on", base_model, list(modules))

    def sampler_update(self, model_id: str, key: str) -> AdapterUpdate:
        return self._call("sampler_update", model_id, key)  # type: ignore[no-any-return]

    def read_sampler_update(self, key: str, path: Path) -> tuple[str, AdapterUpdate]:
        return self._call("read_sampler_update", key, path)  # type: ignore[no-any-return]

    def save_state(self, model_id: str, path: Path, include_optimizer: bool = True) -> int:
        return self._call("save_state", model_id, path, include_optimizer)  # type: ignore[no-any-return]

    def save_sampler_weights(self, model_id: str, path: Path) -> int:
        return self._call("save_sampler_weights", model_id, path)  # type: ignore[no-any-return]

    def load_state(self, model_id: str, path: Path, load_optimizer: bool) -> None:
        self._call("load_state", model_id, path, load_optimizer)

    def _call(self, method: str, *args: Any) -> Any:
        return self._get(self._actor.call.remote(method, *args), method)

    def _get(self, ref: Any, method: str) -> Any:
        exceptions = self._ray.exceptions
        try:
            return self._ray.get(ref, timeout=self._timeout_s)
        except exceptions.RayTaskError as exc:
            cause = exc.cause
            raise (cause if isinstance(cause, Exception) else RuntimeError(str(exc))) from None
        except exceptions.GetTimeoutError:
            raise RuntimeError(
                f"the service's training actor did not answer {method} within "
                f"ray.trainer_collective_timeout_s={self._timeout_s:g}"
            ) from None
        except exceptions.RayActorError as exc:
            raise RuntimeError(f"the service's training actor is gone ({describe(exc)})") from None


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


class VerifierActor:
    """A sandbox pool (`envs/sandbox/pool.py`'s VerifierPool, `concurrency` workers) on a CPU bundle of its
    own: the sandboxed code of the run's environments runs here, not beside the trainer. Stateless, so Ray
    restarts it whenever it dies; `RayVerifiers` is its client."""

    def __init__(self, concurrency: int) -> None:
        from inflight.envs.sandbox import VerifierPool

        self.pool = VerifierPool(concurrency=concurrency)

    def run(self, code: str, stdin: str, limits: SandboxLimits | None) -> SandboxResult:
        return self.pool.run_many([code], stdin=stdin, limits=limits)[0]

    def isolation(self) -> Isolation:
        return self.pool.isolation

    def stats(self) -> dict[str, int]:
        return self.pool.stats()


class RayVerifiers:
    """The `Verifier` protocol (`envs/sandbox/pool.py`) over `VerifierActor`s: each job to the actor with
    the fewest in flight. A job is bounded as the pool bounds it (queue, wall limit, kill grace). Ray
    restarts an actor that dies and runs its jobs again there (`VERIFIER_TASK_RETRIES`: a sandbox is
    throwaway, so a job may run twice); one that still finds no actor, or runs out of time, comes back as
    a "sandbox_error" / "timeout" result, counted, never as an exception."""

    def __init__(self, actors: list[Any], config: VerifierPoolConfig | None = None) -> None:
        import ray

        from inflight.envs.sandbox import VerifierPoolConfig

        self._ray, self._actors = ray, actors
        self.config = config or VerifierPoolConfig()
        self._in_flight = [0] * len(actors)
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(("submitted", "completed", "actor_failures", "wait_timeouts"), 0)
        self._isolation = ray.get(actors[0].isolation.remote(), timeout=self.config.queue_timeout_s)

    async def run(self, code: str, *, stdin: str = "", limits: SandboxLimits | None = None) -> SandboxResult:
        import asyncio

        index, ref = self._submit(code, stdin, limits)
        try:
            result = await asyncio.wait_for(asyncio.wrap_future(ref.future()), self._bound_s(limits))
        except BaseException as exc:
            return self._failed(index, ref, exc)
        return self._done(index, result)

    def run_many(
        self, codes: Sequence[str], *, stdin: str = "", limits: SandboxLimits | None = None
    ) -> list[SandboxResult]:
        deadline = time.monotonic() + self._bound_s(limits)
        results = []
        for index, ref in [self._submit(code, stdin, limits) for code in codes]:
            try:
                result = self._ray.get(ref, timeout=max(deadline - time.monotonic(), 0.0))
            except Exception as exc:
                results.append(self._failed(index, ref, exc))
            else:
                results.append(self._done(index, result))
        return results

    def stats(self) -> dict[str, int]:
        """This client's counters, and the actors' pools' summed (those that answer within 10 s)."""
        refs = [actor.stats.remote() for actor in self._actors]
        ready, _ = self._ray.wait(refs, num_returns=len(refs), timeout=10)
        total: dict[str, int] = {}
        for ref in ready:
            with contextlib.suppress(self._ray.exceptions.RayError):
                for key, value in self._ray.get(ref).items():
                    total[key] = total.get(key, 0) + value
        with self._lock:
            return total | {f"client_{key}": value for key, value in self._counts.items()}

    def metrics(self) -> dict[str, float]:
        """For the run's metrics, without asking the actors: jobs sent, finished, and lost."""
        with self._lock:
            return {f"verifiers/{key}": float(value) for key, value in self._counts.items()}

    def _bound_s(self, limits: SandboxLimits | None) -> float:
        wall_s = min((limits or self.config.limits).wall_s, self.config.job_timeout_s)
        return self.config.queue_timeout_s + wall_s + KILL_GRACE_S

    def _submit(self, code: str, stdin: str, limits: SandboxLimits | None) -> tuple[int, Any]:
        with self._lock:
            index = min(range(len(self._actors)), key=self._in_flight.__getitem__)
            self._in_flight[index] += 1
            self._counts["submitted"] += 1
        return index, self._actors[index].run.remote(code, stdin, limits)

    def _done(self, index: int, result: SandboxResult) -> SandboxResult:
        with self._lock:
            self._in_flight[index] -= 1
            self._counts["completed"] += 1
        return result

    def _failed(self, index: int, ref: Any, exc: BaseException) -> SandboxResult:
        from inflight.envs.sandbox import SandboxResult

        timed_out = isinstance(exc, TimeoutError | self._ray.exceptions.GetTimeoutError)
        with self._lock:
            self._in_flight[index] -= 1
            self._counts["wait_timeouts" if timed_out else "actor_failures"] += 1
        if timed_out:
            self._ray.cancel(ref, force=False)
            return SandboxResult.not_run(
                "timeout", "verifier actor: no result within the pool's bound", self._isolation
            )
        if isinstance(exc, Exception):
            return SandboxResult.not_run(
                "sandbox_error", f"verifier actor failed: {describe(exc)}", self._isolation
            )
        raise exc  # a cancellation of the caller, say: not ours to swallow


def _for_actor(cfg: RunConfig, gpus: float, engine_urls: list[str] | None = None) -> RunConfig:
    """`cfg` as an actor runs it: Ray shows an actor its GPU as cuda:0, and none to an actor without one
    (the trainer's actor also holds the in-process engine the evaluations use, on the trainer's device)."""
    out = cfg.model_copy(deep=True)
    on_gpu = gpus > 0
    out.engine.device = "cuda" if on_gpu else "cpu"
    out.trainer.device = "cuda" if on_gpu else "cpu"
    if engine_urls is not None:
        out.pipeline.engine_urls = engine_urls
    return out


def _on_gpu(device: str, cluster_has_gpus: bool) -> bool:
    return device.startswith("cuda") or (device == "auto" and cluster_has_gpus)


def _free_port() -> tuple[str, int]:
    """(this node's address, a port free on it now): run as a task on a replica's bundle."""
    import ray

    host = ray.util.get_node_ip_address()
    with socket.socket() as sock:
        sock.bind((host, 0))
        return host, int(sock.getsockname()[1])


def _portable(target: str) -> str:
    """A file TARGET as an absolute path, which the trainer's actor resolves from any working directory."""
    where, sep, attr = target.rpartition(":")
    if not (sep and attr.isidentifier()):
        where, sep, attr = target, "", ""
    path = Path(where).expanduser()
    if (where.endswith(".py") or "/" in where) and path.is_file():
        return f"{path.resolve()}{sep}{attr}"
    return target


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise UserError(RAY_MISSING) from None
    return ray


def ray_connection(cfg: RayConfig, key: str) -> contextlib.AbstractContextManager[None]:
    """`_cluster` for a caller that connects before it places anything (`inflight serve --launcher ray`,
    before its app starts); `key` names the address as the user gave it (--ray-address)."""
    return _cluster(_import_ray(), cfg, key)


@contextmanager
def _cluster(ray: Any, cfg: RayConfig, key: str = "ray.address") -> Iterator[None]:
    """Ray as ray.address says, for the run. A Ray this process had already started (a test's, a notebook's,
    `ray_connection`'s) is used as it is and left running; one started here is shut down after the run.
    Every wait is bounded: an address is first asked whether it is a Ray head that takes this process's
    token (`_check_head`, within ray.connect_timeout_s), as ray.init's own retries are long or endless."""
    if ray.is_initialized():
        yield
        return
    address = cfg.address
    if address not in (None, "auto"):
        check_address(address, key)
        _check_head(address, cfg.connect_timeout_s, key)
    auth_error = getattr(ray.exceptions, "AuthenticationError", ())  # Ray >= 2.52
    try:
        # Unset: a new local cluster for this run ("local": never one that `ray start` left running here),
        # with this machine's CPUs and no dashboard.
        with _signal_handlers_kept():
            if address is None:
                ray.init(address="local", include_dashboard=False, log_to_driver=True)
            else:
                ray.init(address=address, log_to_driver=True)
    except ConnectionError as e:
        raise UserError(
            f"{key}={address}: no Ray cluster found ({describe(e)}); start one with "
            f"`ray start --head`, or leave {key} unset for a local Ray"
        ) from None
    except auth_error:  # RAY_AUTH_MODE=token, and no token to send
        raise UserError(f"{key}={address}: {_token()[1]}") from None
    try:
        yield
    finally:
        ray.shutdown()


@contextmanager
def _signal_handlers_kept() -> Iterator[None]:
    """The SIGINT and SIGTERM handlers of before, again after the block (ray.init's). ray.init installs its
    own SIGTERM handler, an exit with status 1, and under it Ray's C++ failure handler, which aborts: the
    caller's own (`stop_on_signals`' graceful stop, uvicorn's drain, or the default) must stay in force.
    The Ray processes a local ray.init starts die with this one anyway (Ray ties them to it), and
    `_cluster` shuts them down on its way out."""
    if threading.current_thread() is not threading.main_thread():  # Python's rule: no handlers to set
        yield
        return
    kept = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in kept.items():
            if handler is not None:  # None: a handler not set from Python, which Python cannot set again
                signal.signal(signum, handler)


def check_address(address: str, key: str) -> None:
    """One line when `address` (ray.address, or --ray-address as `key` says) is not HOST:PORT, "auto", or a
    Ray Client URL (ray://HOST:PORT, which Ray reaches through the head's client server)."""
    scheme, sep, rest = address.partition("://")
    if sep and scheme != "ray":
        raise UserError(
            f"{key}={address}: expected HOST:PORT (the head's GCS port, e.g. 10.0.0.5:6379) or auto, not a "
            "URL (the one URL Ray takes is ray://HOST:PORT, its client server's)"
        )
    host, sep, port = (rest if sep else address).rpartition(":")
    if address != "auto" and (not host or not sep or not port.isdigit()):
        raise UserError(
            f"{key}={address}: expected HOST:PORT (the head's GCS port, e.g. 10.0.0.5:6379), auto (the "
            f"cluster this machine joined with `ray start`), or {key} unset for a local Ray"
        )


def _check_head(address: str, timeout_s: float, key: str) -> None:
    """A bounded TCP connect to HOST:PORT, then (but for a ray:// URL) one gRPC call to the GCS there,
    GetClusterId, Ray's own first question, with this process's token: whether a Ray head answers, and takes
    the token. ray.init itself retries for ~20 s at a step, a line of log a try, and on a port that speaks
    something else (an HTTP server, say) never gives up."""
    client = address.startswith("ray://")
    host, _, port = address.removeprefix("ray://").rpartition(":")
    deadline = time.monotonic() + timeout_s
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise UserError(
            f"{key}={address}: nothing answers there within {timeout_s:g} s ({describe(e)}); start the "
            f"cluster with `ray start --head`, or leave {key} unset for a local Ray"
        ) from None
    if client:
        return
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    messages: Any = gcs_service_pb2  # generated code, which the type checker does not see into
    metadata, unauthenticated = _token()
    with grpc.insecure_channel(address) as channel:
        ask = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId
        try:
            left_s = max(deadline - time.monotonic(), 0.1)
            ask(messages.GetClusterIdRequest(), timeout=left_s, metadata=metadata)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise UserError(f"{key}={address}: {unauthenticated}") from None
            raise UserError(
                f"{key}={address}: something answers there, but not as a Ray head within {timeout_s:g} s "
                f"({e.code().name}: {e.details()}); name the port of the head's GCS, the one `ray start "
                "--head --port=PORT` opened (6379 by default)"
            ) from None


def _token() -> tuple[tuple[tuple[str, str], ...], str]:
    """The gRPC metadata carrying this process's Ray token (none unless RAY_AUTH_MODE=token and a token is
    found, as for Ray's own calls), and what to say when a cluster wants another."""
    how = (
        "the head's token (`ray get-auth-token` there prints it) in RAY_AUTH_TOKEN, in the file "
        "RAY_AUTH_TOKEN_PATH names, or in ~/.ray/auth_token (docs/laptop-to-cluster.md)"
    )
    import ray._raylet

    raylet: Any = ray._raylet  # its stubs predate token authentication
    if not hasattr(raylet, "AuthenticationTokenLoader"):  # a Ray before token authentication (2.52)
        return (), f"the cluster wants a token this Ray ({ray.__version__}) cannot send: install ray>=2.52"
    loader = raylet.AuthenticationTokenLoader.instance()
    if raylet.get_authentication_mode() != raylet.AuthenticationMode.TOKEN:
        return (), (
            "the cluster wants a token (Ray's token authentication, which `ray start --head` turns on) and "
            f"this process sends none: set RAY_AUTH_MODE=token, with {how}"
        )
    try:
        found = loader.has_token()
    except Exception as e:  # none, or RAY_AUTH_TOKEN_PATH names a file it cannot read: Ray's first sentence
        why = str(getattr(e, "message", e)).split(". ")[0]
        return (), f"RAY_AUTH_MODE=token, but no token was found ({why}): give {how}"
    if not found:
        return (), f"RAY_AUTH_MODE=token, but no token was found: give {how}"
    metadata = tuple(loader.get_token_for_http_header().items())
    return metadata, f"the cluster refused this process's token (RAY_AUTH_MODE=token): give {how}"
