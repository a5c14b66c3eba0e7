"""The policy as the engine sees it: the trainer's full weights, or (`trainer.lora_rank > 0`) one LoRA adapter
over the engine's own frozen copy of the base model, so a weight sync ships only the adapter.

Owns that choice for both loops: what goes to the engine after a step (`publish`) and to a replica that
starts from the model on disk (`publish_initial`), and, under LoRA, that every rollout request names the
policy adapter and the in-process engine reports the adapter's version (`AdapterPolicyEngine`; remote
replicas: `RemoteEngines(policy_adapter=...)`). Knows nothing of steps, buffers or rollouts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from inflight.trainer.lora_policy import ADAPTER_NAME
from inflight.trainer.process import StepTrainer
from inflight.types import AdapterUpdate, Completion, SampleRequest, WeightUpdate

if TYPE_CHECKING:
    from inflight.inference.builtin import BuiltinEngine, EngineMetrics


class PolicyTarget(Protocol):
    """Where a policy goes: an engine, its loop, or the remote replicas."""

    def update_weights(self, update: WeightUpdate) -> None: ...

    def set_adapter(self, update: AdapterUpdate) -> None: ...


def publish(target: PolicyTarget, trainer: StepTrainer) -> None:
    """The trainer's current policy, tagged with its version: the adapter alone under LoRA (the engine's
    base weights never change then), else every weight."""
    if trainer.config.lora_rank:
        target.set_adapter(trainer.adapter_update())
    else:
        target.update_weights(WeightUpdate(trainer.version, trainer.weights()))


def publish_initial(target: PolicyTarget, trainer: StepTrainer) -> None:
    """Everything an engine built elsewhere (a replica that loaded the model from disk) needs before the
    first request: under LoRA the frozen base (the warm-up changed it) and then the adapter, else the
    weights."""
    if trainer.config.lora_rank:
        target.update_weights(WeightUpdate(trainer.version, trainer.base_weights()))
    publish(target, trainer)


def policy_engine(engine: BuiltinEngine, trainer: StepTrainer) -> BuiltinEngine | AdapterPolicyEngine:
    """The engine the loops drive: as it is for full-parameter training, else a view that samples with the
    policy adapter (published here first, so the first request finds it)."""
    if not trainer.config.lora_rank:
        return engine
    view = AdapterPolicyEngine(engine, ADAPTER_NAME)
    publish(view, trainer)
    return view


class AdapterPolicyEngine:
    """A built-in engine whose requests all sample with one LoRA adapter (the policy), and whose `version` is
    that adapter's: the policy version the pipeline's staleness bound and the rollouts' tokens refer to.
    Everything else passes through to the engine."""

    def __init__(self, engine: BuiltinEngine, adapter: str) -> None:
        self.engine = engine
        self.adapter = adapter

    @property
    def version(self) -> int:
        """The policy adapter's version new requests get; -1 before it was first published."""
        return self.engine.adapters().get(self.adapter, -1)

    def add_request(self, request: SampleRequest) -> None:
        self.engine.add_request(self._with_policy(request))

    def generate(self, requests: Sequence[SampleRequest]) -> list[Completion]:
        return self.engine.generate([self._with_policy(r) for r in requests])

    def step(self) -> list[Completion]:
        return self.engine.step()

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def has_pending_update(self) -> bool:
        return self.engine.has_pending_update()

    def metrics(self) -> EngineMetrics:
        return self.engine.metrics()

    def update_weights(self, update: WeightUpdate) -> None:
        self.engine.update_weights(update)

    def set_adapter(self, update: AdapterUpdate) -> None:
        self.engine.set_adapter(update)

    def remove_adapter(self, name: str) -> None:
        self.engine.remove_adapter(name)

    def _with_policy(self, request: SampleRequest) -> SampleRequest:
        if request.adapter is None:
            request.adapter = self.adapter
        return request
