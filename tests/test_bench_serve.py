"""`inflight bench serve` at its smallest settings on the tiny model: every headline key is reported and
positive, the checkpoint round trip's included (save with the SDK, download through the archive URL, load
into `peft`), and the round trip is the sum of its phases; the API part also against `inflight serve` in its
own process.

Reference: issue 15's Benchmark section (the bench keeps its keys and adds the cost of a checkpoint round
trip); the numbers themselves are measured alone and recorded in docs/benchmarks.md, not here.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.slow
REPO_ROOT = Path(__file__).resolve().parents[1]
SMALLEST = ["--adapters", "1", "--datums", "1", "--tokens", "8", "--rank", "4", "--samples", "1"]
SMALLEST += ["--sample-tokens", "2", "--repeats", "1", "--api-requests", "1", "--checkpoint-round-trips", "1"]


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(REPO_ROOT))  # benchmarks/ lives beside src/, as `inflight bench` finds it
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return importlib.import_module("benchmarks.serve")


def test_smallest_run_reports_every_key(tiny_model_dir: Path, bench: ModuleType) -> None:
    result = bench.main([*SMALLEST, "--threads", "1", "--model", str(tiny_model_dir)])
    assert "api_error" not in result, result["api_error"]
    positive = [
        "ratio_batched_vs_serial",
        "sample_ratio_batched_vs_serial",
        "api_ms_per_request",
        "direct_ms_per_request",
        "api_floor_ms",
        "checkpoint_save_ms",
        "checkpoint_download_ms",
        "checkpoint_peft_load_ms",
        "checkpoint_round_trip_ms",
        "checkpoint_archive_bytes",
    ]
    assert all(result[key] > 0 for key in positive), {key: result[key] for key in positive}
    assert "api_overhead_ms" in result  # a difference of two timings: its sign is the measurement's
    phases = sum(result[f"checkpoint_{name}_ms"] for name in ("save", "download", "peft_load"))
    assert result["checkpoint_round_trip_ms"] == pytest.approx(phases, abs=0.02)


def test_the_api_part_against_inflight_serve_in_its_own_process(
    tiny_model_dir: Path, bench: ModuleType
) -> None:
    smallest = [*SMALLEST, "--checkpoint-round-trips", "0", "--api-server", "process"]
    result = bench.main([*smallest, "--threads", "1", "--model", str(tiny_model_dir)])
    assert "api_error" not in result, result["api_error"]
    assert result["api_server"] == "process" and result["api_ms_per_request"] > 0
    assert "api_floor_ms" not in result  # the stub sits in front of an app in this process only


def test_the_queue_part_reports_every_key(bench: ModuleType) -> None:
    result = bench.measure_queue_claims(20, samples=3)
    keys = [
        "claim_ms_fresh",
        "claim_ms_after_history",
        "sample_look_ms_fresh",
        "sample_look_ms_behind_backlog",
    ]
    assert result["queue_history"] == 20 and all(result[key] > 0 for key in keys), result


def test_the_wait_behind_a_large_request_reports_every_key(tiny_model_dir: Path, bench: ModuleType) -> None:
    args = [*SMALLEST, "--api-requests", "0", "--checkpoint-round-trips", "0", "--max-batch-tokens", "256"]
    result = bench.main([*args, "--behind-tokens", "1024", "--threads", "1", "--model", str(tiny_model_dir)])
    assert (result["behind_tokens"], result["behind_slice_tokens"]) == (1024, 512)
    keys = ["wait_behind_large_s", "wait_behind_large_unsliced_s", "large_request_s"]
    assert all(result[key] > 0 for key in keys), result
