"""`inflight serve --launcher ray`'s training: the service's `ServiceCompute` in an actor of its own
(`ComputeActor`, placed by `compute_on_ray`), driven through the `Compute` protocol (`RayCompute`), and its
device checked against the cluster's GPUs. Knows nothing of the API, its futures or its engines."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from inflight.config import RayConfig
from inflight.errors import UserError, describe
from inflight.launch.ray.cluster import connected, import_ray
from inflight.launch.ray.placement import MORE_CPUS, SERVE_FIXES, Fixes, bundle_strategy, reserve, wants_gpu

if TYPE_CHECKING:
    from inflight.api.compute import ServiceComputeConfig
    from inflight.api.job_types import ForwardBackwardJob, ForwardBackwardOutput, LoraSpec, OptimStep
    from inflight.api.sampler import SamplingLimits
    from inflight.inference.builtin import BuiltinEngineConfig
    from inflight.types import AdapterUpdate


@contextmanager
def compute_on_ray(
    base_models: dict[str, str], max_rank: int, config: ServiceComputeConfig, ray_config: RayConfig
) -> Iterator[RayCompute]:
    """`inflight serve --launcher ray`: the service's training (its `ServiceCompute`: base models,
    tenants' adapters, their optimizers and checkpoints) in a `ComputeActor` on a bundle of its own
    ({CPU: ray.trainer_cpus} + ray.trainer_gpus GPU when `config.device` is cuda, or auto on a cluster
    with GPUs); yields the `RayCompute` that forwards the worker's calls to it, and releases the actor and
    its placement group on exit. The service's state directory must be on storage both processes see."""
    ray = import_ray()
    from ray.util.placement_group import remove_placement_group

    with connected(ray, ray_config):
        gpu = wants_gpu(config.device, ray.cluster_resources().get("GPU", 0) > 0)
        shape = [{"CPU": ray_config.trainer_cpus} | ({"GPU": ray_config.trainer_gpus} if gpu else {})]
        fix = Fixes(f"Serve on {MORE_CPUS}", *SERVE_FIXES)
        group = reserve(ray, shape, ray_config, "serve --launcher ray (training)", fix)
        actor = None
        try:
            placed = config.model_copy(update={"device": "cuda" if gpu else "cpu", "sampling_engine": False})
            actor = (
                ray.remote(ComputeActor)
                .options(
                    name=f"serve-{os.getpid()}:trainer",
                    num_cpus=shape[0]["CPU"],
                    num_gpus=shape[0].get("GPU", 0.0),
                    scheduling_strategy=bundle_strategy(group, 0),
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
    is left to the placement's bounded wait (`reserve`): an autoscaler may add GPU nodes."""
    if not device.startswith("cuda") or r.address is not None:
        return
    if not import_ray().cluster_resources().get("GPU", 0):
        raise UserError(
            f"--device={device!r} but the local Ray (this machine's) has no GPUs: serve with --device cpu "
            "(or auto), or on a cluster with GPUs (--ray-address HOST:PORT)"
        )


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
