"""Engine replicas: one engine behind HTTP in an actor (`EngineReplica`), started on its bundle at a fixed
URL, its restarts counted (`ReplicaWatch`); and the service's engines placed on their own (`engines_on_ray`).
Knows the engine's server, not the run or the service that sends it requests."""

from __future__ import annotations

import os
import secrets
import socket
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from inflight.config import EngineConfig, ModelConfig, RayConfig, RunConfig
from inflight.errors import UserError
from inflight.inference.access import API_KEY_ENV
from inflight.launch.ray.cluster import connected, import_ray
from inflight.launch.ray.placement import (
    MORE_CPUS,
    SERVE_FIXES,
    Fixes,
    bundle_strategy,
    engine_bundle,
    for_actor,
    free_port,
    ready_within,
    reserve,
)
from inflight.preflight import bind_port

if TYPE_CHECKING:
    from inflight.inference.backends import VllmOptions
    from inflight.orchestrator.stopping import StopRequest

WATCH_INTERVAL_S = 1.0  # how often the trainer's actor asks each replica which process serves it


@dataclass
class ReplicaInfo:
    url: str
    pid: int
    node: str  # the node's IP address, as Ray knows it


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
    ray = import_ray()
    from ray.util.placement_group import remove_placement_group

    with connected(ray, ray_config):
        has_gpus = ray.cluster_resources().get("GPU", 0) > 0
        shape = [engine_bundle(ray_config, config.device, has_gpus) for _, config in engines.values()]
        fix = Fixes(f"Serve fewer base models here, or serve on {MORE_CPUS}", *SERVE_FIXES)
        group = reserve(ray, shape, ray_config, "serve --launcher ray", fix, held=held)
        actors: list[Any] = []
        try:
            replica_cls = ray.remote(EngineReplica)
            for i, (name, (path, config)) in enumerate(engines.items()):
                run_cfg = RunConfig(model=ModelConfig(path=path), ray=ray_config, engine=config)
                name_on_ray = f"serve-{os.getpid()}:engine-{name}"  # ray.get_actor finds it
                actors.append(
                    start_replica(
                        ray, replica_cls, run_cfg, group, i, shape[i], name_on_ray, weights_dir, vllm
                    )
                )
            infos = replica_infos(ray, actors, ray_config, "serve --launcher ray", None)
            for name, info in zip(engines, infos, strict=True):
                print(f"inflight: ray: base model {name!r} samples on {info.url}", file=sys.stderr)
            yield {name: info.url for name, info in zip(engines, infos, strict=True)}
        finally:
            for actor in actors:
                ray.kill(actor, no_restart=True)
            remove_placement_group(group)


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
        import ray

        restarted = bool(ray.get_runtime_context().was_current_actor_reconstructed)
        sock = replica_socket(host, port, restarted)  # before the model loads: the port is held from here
        if cfg.engine.backend == "vllm":
            from inflight.launch.engine_process import EngineProcess

            assert cfg.model.path, "run_on_ray and engines_on_ray resolve the model to a directory"
            port = int(sock.getsockname()[1])
            sock.close()  # vLLM's server binds it in its own process, a moment later
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

        from inflight.gc_tuning import freeze_long_lived
        from inflight.inference.engine_service import EngineServerConfig
        from inflight.inference.server import ServerThread, create_app
        from inflight.models import load_tokenizer
        from inflight.models.chat_template import generation_stop_ids
        from inflight.orchestrator.setup import build_engine, load_policy

        torch.set_num_threads(threads)
        model, tokenizer = load_policy(cfg)
        engine = build_engine(cfg, model, tokenizer)
        # Requests may read weights only from the run's weights directory, and need the run's key: the
        # replica listens on its node's address (`engine_key_env`).
        key = os.environ.get(API_KEY_ENV)
        server_cfg = EngineServerConfig(
            model_name=str(cfg.model.path), weights_dir=weights_dir, api_keys=[key] if key else []
        )
        app = create_app(engine, load_tokenizer(str(cfg.model.path)), server_cfg, generation_stop_ids(model))
        self.process, self.server = None, ServerThread(app, host=host, sock=sock).start()
        self.url = self.server.url
        freeze_long_lived()  # the actor's process lives as long as this engine (gc_tuning.py)

    def info(self) -> ReplicaInfo:
        pid = os.getpid() if self.process is None else self.process.pid
        return ReplicaInfo(self.url, pid if pid is not None else -1, self.node)


def start_replica(
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
    replica Ray restarts comes back at the same URL; one taken before the actor binds it is replaced by
    another at its first start: `replica_socket`)."""
    port_task = ray.remote(free_port).options(num_cpus=0, scheduling_strategy=bundle_strategy(group, index))
    host, port = ray.get(port_task.remote())
    gpus = bundle.get("GPU", 0.0)
    return replica_cls.options(
        name=name,
        num_cpus=bundle["CPU"],
        num_gpus=gpus,
        max_restarts=cfg.ray.max_replica_restarts,
        scheduling_strategy=bundle_strategy(group, index),
        runtime_env=engine_key_env(),
    ).remote(for_actor(cfg, gpus), host, port, weights_dir, vllm)


def replica_socket(host: str, port: int, restarted: bool) -> socket.socket:
    """The replica's listening socket on `port`, the port picked for it on its node before the actor
    started. Something else may have taken that port meanwhile: at the actor's first start its URL is not
    out yet (`info()` gives it), so any free port will do; an actor Ray restarted must come back on its
    own port, which its clients keep (one line naming the port when it cannot)."""
    try:
        return bind_port(host, port)
    except UserError:
        if restarted:
            raise UserError(
                f"the restarted engine replica cannot listen on its port {port} on {host} again (in use "
                "now): its clients keep that URL; stop what took the port"
            ) from None
        return bind_port(host, 0)


def replica_infos(
    ray: Any, replicas: list[Any], r: RayConfig, who: str, stop: StopRequest | None
) -> list[ReplicaInfo]:
    """Each replica's URL once it serves; one line when they do not within r.replica_start_timeout_s. A stop
    (`stop`) ends the wait (`StoppedBeforeRun`)."""
    refs = [a.info.remote() for a in replicas]
    if not ready_within(ray, refs, r.replica_start_timeout_s, stop, "the engine replicas started"):
        raise UserError(
            f"{who}: the engine replicas did not start within ray.replica_start_timeout_s="
            f"{r.replica_start_timeout_s:g}"
        )
    try:
        infos: list[ReplicaInfo] = ray.get(refs)
    except ray.exceptions.RayError as e:
        raise RuntimeError(f"{who}: an engine replica failed to start: {e}") from None
    return infos


def engine_key_env() -> dict[str, dict[str, str]]:
    """The runtime_env that gives an actor the replicas' API key ($INFLIGHT_ENGINE_API_KEY): a replica serves
    on its node's address, beyond loopback, so it takes requests only with the key (`inference/access.py`:
    serve-engine refuses to listen there without one), and the run's clients send it. The caller's own key
    when it set one, else one made for this process (set in its environment too, for the clients of
    `serve --launcher ray`, which run here)."""
    key = os.environ.get(API_KEY_ENV, "").strip()
    if not key:
        key = os.environ[API_KEY_ENV] = secrets.token_hex(32)
    return {"env_vars": {API_KEY_ENV: key}}


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
        self._thread.join(5)  # a round waits at most ~0.5 s; a daemon thread stuck past that is left behind

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
