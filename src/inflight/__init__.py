"""inflight: asynchronous reinforcement learning for LLMs (pipeline mode and a Tinker-compatible service)."""

__version__ = "0.1.0"
