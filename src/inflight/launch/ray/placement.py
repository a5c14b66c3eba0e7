"""Placement groups: the bundles a run reserves (`bundles`), a group reserved within bounded waits or refused
in one line naming the fix (`reserve`), and what an actor on a bundle sees (its devices, a free port). Knows
bundle shapes, not the actors placed on them."""

from __future__ import annotations

import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from inflight.config import RayConfig, RunConfig
from inflight.errors import UserError
from inflight.launch.ray.stop import STOP_POLL_S
from inflight.orchestrator.stopping import StoppedBeforeRun

if TYPE_CHECKING:
    from inflight.orchestrator.stopping import StopRequest


def bundles(cfg: RunConfig, cluster_has_gpus: bool) -> list[dict[str, float]]:
    """The placement group's bundles: one per engine replica, then one per trainer rank (the first is the
    run's own), then one per verifier actor, then one per rollout worker (CPU only). A GPU (or the
    fraction ray.*_gpus) where the component's device is cuda ("auto": where the cluster has GPUs)."""
    r = cfg.ray
    engine = engine_bundle(r, cfg.engine.device, cluster_has_gpus)
    trainer = {"CPU": r.trainer_cpus} | (
        {"GPU": r.trainer_gpus} if wants_gpu(cfg.trainer.device, cluster_has_gpus) else {}
    )
    verifier, worker = {"CPU": r.verifier_cpus}, {"CPU": r.rollout_worker_cpus}
    return (
        [engine] * r.num_engine_replicas
        + [trainer] * r.num_trainer_ranks
        + [verifier] * r.num_verifier_actors
        + [worker] * r.num_rollout_workers
    )


def engine_bundle(r: RayConfig, device: str, cluster_has_gpus: bool) -> dict[str, float]:
    return {"CPU": r.engine_cpus} | ({"GPU": r.engine_gpus} if wants_gpu(device, cluster_has_gpus) else {})


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


def reserve(
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
        ready = ready_within(ray, [group.ready()], r.placement_timeout_s, stop, "Ray placed the actors")
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


def ready_within(ray: Any, refs: list[Any], timeout_s: float, stop: StopRequest | None, during: str) -> bool:
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


def bundle_strategy(group: Any, index: int) -> Any:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)


def wants_gpu(device: str, cluster_has_gpus: bool) -> bool:
    return device.startswith("cuda") or (device == "auto" and cluster_has_gpus)


def for_actor(cfg: RunConfig, gpus: float, engine_urls: list[str] | None = None) -> RunConfig:
    """`cfg` as an actor runs it: Ray shows an actor its GPU as cuda:0, and none to an actor without one
    (the trainer's actor also holds the in-process engine the evaluations use, on the trainer's device)."""
    out = cfg.model_copy(deep=True)
    on_gpu = gpus > 0
    out.engine.device = "cuda" if on_gpu else "cpu"
    out.trainer.device = "cuda" if on_gpu else "cpu"
    if engine_urls is not None:
        out.pipeline.engine_urls = engine_urls
    return out


def free_port() -> tuple[str, int]:
    """(this node's address, a port free on it now): run as a task on a replica's bundle."""
    import ray

    host = ray.util.get_node_ip_address()
    with socket.socket() as sock:
        sock.bind((host, 0))
        return host, int(sock.getsockname()[1])
