"""Policy parameters, optimizer, loss assembly and checkpoints."""

from inflight.trainer.batch_layout import MicroBatch
from inflight.trainer.config import LossConfig, OffPolicyConfig, TrainerConfig
from inflight.trainer.trainer import Trainer

__all__ = ["LossConfig", "MicroBatch", "OffPolicyConfig", "Trainer", "TrainerConfig"]
