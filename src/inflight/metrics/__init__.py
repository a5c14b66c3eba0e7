"""Metrics: JSONL per run, a progress display and plots."""

from inflight.metrics.logger import MetricsLogger, read_metrics

__all__ = ["MetricsLogger", "read_metrics"]
