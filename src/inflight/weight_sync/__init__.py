"""Trainer -> inference weight transports behind one interface (`base`): in-process, filesystem
(safetensors + version, atomic rename) and torch.distributed broadcast (gloo, bucketed). Heavy modules
are imported by their own files only, so choosing one never imports another."""

from inflight.weight_sync.base import PublishStats, WeightPublisher, WeightReceiver
from inflight.weight_sync.inprocess import InProcessChannel, InProcessPublisher, InProcessReceiver

__all__ = [
    "InProcessChannel",
    "InProcessPublisher",
    "InProcessReceiver",
    "PublishStats",
    "WeightPublisher",
    "WeightReceiver",
]
