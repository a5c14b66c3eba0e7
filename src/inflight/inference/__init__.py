"""Inference engines behind one protocol: `Engine` (and `SteppedEngine`, driven step by step), and the
built-in PyTorch `BuiltinEngine`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from inflight.lazy import lazy_exports

if TYPE_CHECKING:
    from inflight.inference.builtin import BuiltinEngine
    from inflight.inference.config import BuiltinEngineConfig
    from inflight.inference.engine import Engine, SteppedEngine

# Loaded on first use (lazy.py): `inflight.config` imports light modules of this package.
__getattr__ = lazy_exports(
    __name__,
    {
        "BuiltinEngine": ".builtin",
        "BuiltinEngineConfig": ".config",
        "Engine": ".engine",
        "SteppedEngine": ".engine",
    },
)

__all__ = ["BuiltinEngine", "BuiltinEngineConfig", "Engine", "SteppedEngine"]
