"""Policy parameters, optimizer, loss assembly and checkpoints."""

from __future__ import annotations

from typing import TYPE_CHECKING

from inflight.lazy import lazy_exports

if TYPE_CHECKING:
    from inflight.trainer.batch_layout import MicroBatch
    from inflight.trainer.config import LossConfig, OffPolicyConfig, TrainerConfig
    from inflight.trainer.trainer import Trainer

# Loaded on first use (lazy.py): `inflight.config` imports light modules of this package.
__getattr__ = lazy_exports(
    __name__,
    {
        "MicroBatch": ".batch_layout",
        "LossConfig": ".config",
        "OffPolicyConfig": ".config",
        "TrainerConfig": ".config",
        "Trainer": ".trainer",
    },
)

__all__ = ["LossConfig", "MicroBatch", "OffPolicyConfig", "Trainer", "TrainerConfig"]
