"""Inference engines behind one protocol: `Engine`, and the built-in PyTorch `BuiltinEngine`."""

from inflight.inference.builtin import BuiltinEngine, BuiltinEngineConfig
from inflight.inference.engine import Engine

__all__ = ["BuiltinEngine", "BuiltinEngineConfig", "Engine"]
