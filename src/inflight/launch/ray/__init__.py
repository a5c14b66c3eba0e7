"""`launcher=ray`: the local launcher's run (`inflight run TARGET launcher=ray`), and the service's engines
and training (`inflight serve --launcher ray`), placed on a Ray cluster.

The only package that imports `ray`, and only once a run asks for it (a CPU install without Ray imports
inflight, and `--help` stays instant). Knows processes and machines; what a run does is
`orchestrator/run.py`'s, unchanged. One module per piece: `cluster` (the connection), `placement` (placement
groups and bundles), `run` (`run_on_ray`; what is placed where is `place()`), `replicas`, `trainers`,
`rollout_workers` and `verifiers` (the actors and their clients), `stop` (a stop carried to the run's actor),
`compute` (the service's training). A replica that dies is Ray's to restart, the pipeline's client's to
route around and update, and `ReplicaWatch`'s to count.
"""

from inflight.launch.ray.cluster import RAY_MISSING, check_address, ray_connection
from inflight.launch.ray.compute import ComputeActor, RayCompute, check_serve_device, compute_on_ray
from inflight.launch.ray.placement import MORE_CPUS, SERVE_FIXES, Fixes, bundles
from inflight.launch.ray.replicas import (
    WATCH_INTERVAL_S,
    EngineReplica,
    ReplicaInfo,
    ReplicaWatch,
    engines_on_ray,
)
from inflight.launch.ray.rollout_workers import PLAY_ATTEMPTS, PLAY_GRACE_S, RayRolloutWorkers, RolloutWorker
from inflight.launch.ray.run import Placement, RunDriver, place, run_on_ray
from inflight.launch.ray.stop import STOP_NAMESPACE, STOP_POLL_S, StopWatch
from inflight.launch.ray.trainers import COLLECTIVE_FAILURE_WAIT_S, RankedTrainer, TrainerRank
from inflight.launch.ray.verifiers import VERIFIER_TASK_RETRIES, RayVerifiers, VerifierActor

__all__ = [
    "COLLECTIVE_FAILURE_WAIT_S",
    "MORE_CPUS",
    "PLAY_ATTEMPTS",
    "PLAY_GRACE_S",
    "RAY_MISSING",
    "SERVE_FIXES",
    "STOP_NAMESPACE",
    "STOP_POLL_S",
    "VERIFIER_TASK_RETRIES",
    "WATCH_INTERVAL_S",
    "ComputeActor",
    "EngineReplica",
    "Fixes",
    "Placement",
    "RankedTrainer",
    "RayCompute",
    "RayRolloutWorkers",
    "RayVerifiers",
    "ReplicaInfo",
    "ReplicaWatch",
    "RolloutWorker",
    "RunDriver",
    "StopWatch",
    "TrainerRank",
    "VerifierActor",
    "bundles",
    "check_address",
    "check_serve_device",
    "compute_on_ray",
    "engines_on_ray",
    "place",
    "ray_connection",
    "run_on_ray",
]
