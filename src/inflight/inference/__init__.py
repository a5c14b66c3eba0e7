"""Inference engines behind one protocol: `Engine` (and `SteppedEngine`, driven step by step), and the
built-in PyTorch `BuiltinEngine`."""

from inflight.inference.builtin import BuiltinEngine, BuiltinEngineConfig
from inflight.inference.engine import Engine, SteppedEngine

__all__ = ["BuiltinEngine", "BuiltinEngineConfig", "Engine", "SteppedEngine"]
