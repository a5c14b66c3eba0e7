"""`inflight bench NAME` with a count out of range or a model path that holds no model: argparse's usage and
one error line naming the option (exit 2), or `inflight run`'s one-line model error, never a traceback from
inside the benchmark. Nothing here runs a benchmark: a parse that lets a bad value through stops the test.

Reference: the QA pass on `inflight bench` (zero and negative counts crashed with IndexError,
ZeroDivisionError, a reshape error, pydantic's; a missing --model with an OSError about a repo id).
"""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import one_line_error
from inflight.cli import BENCHMARKS, main

REPO_ROOT = Path(__file__).resolve().parents[1]
# Every count-like option of every benchmark, and the least value it takes.
LEAST = [
    *[
        ("engine", o, 1)
        for o in ("--batch-size", "--new-tokens", "--prompt-tokens", "--repeats", "--threads")
    ],
    *[("engine", o, 1) for o in ("--adapters", "--adapter-requests", "--lora-rank")],
    ("engine", "--top-k", 0),
    ("engine", "--vocab-size", 2),
    *[("grpo", o, 1) for o in ("--prompts", "--new-tokens", "--steps")],
    ("grpo", "--samples", 2),
    ("pipeline", "--steps", 1),
    *[("pipeline", o, 0) for o in ("--warmup-steps", "--max-staleness", "--rollout-workers")],
    *[("sandbox", o, 1) for o in ("--jobs", "--concurrency", "--sequential")],
    *[("serve", o, 1) for o in ("--adapters", "--datums", "--tokens", "--rank", "--samples")],
    *[("serve", o, 1) for o in ("--sample-tokens", "--max-batch-tokens", "--repeats", "--threads")],
    *[("serve", o, 0) for o in ("--api-requests", "--checkpoint-round-trips", "--queue-history")],
    *[("train", o, 1) for o in ("--samples", "--steps", "--rounds")],
    *[("trl", o, 1) for o in ("--steps", "--prompts", "--new-tokens")],
    ("trl", "--samples", 2),
]
# Below the least value by more than one, as QA found them.
FAR_BELOW = [("sandbox", "--jobs", 1, "-5"), ("engine", "--new-tokens", 1, "-1")]


class Parsed(Exception):
    """Raised where a benchmark would start its work: its options all parsed."""


@pytest.fixture
def stop_after_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A benchmark's parse_args raises Parsed once its options are accepted (the CLI's own parser, prog
    `inflight`, is left alone), so a bad value that gets through fails the test without running anything."""
    parse_args = argparse.ArgumentParser.parse_args

    def parse_then_stop(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        parsed = parse_args(self, *args, **kwargs)
        if self.prog != "inflight":
            raise Parsed(parsed)
        return parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr(sys, "path", list(sys.path))  # `inflight bench` puts the repository root first


@pytest.mark.usefixtures("stop_after_parsing")
@pytest.mark.parametrize(
    ("name", "option", "least", "value"),
    [*[(name, option, least, str(least - 1)) for name, option, least in LEAST], *FAR_BELOW],
)
def test_a_count_below_its_least_is_one_usage_error(
    name: str, option: str, least: int, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", name, option, value])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert "Traceback" not in err
    assert err.startswith(f"usage: inflight bench {name} "), err
    assert err.strip().splitlines()[-1] == (
        f"inflight bench {name}: error: argument {option}: must be at least {least}, got {value}"
    )


@pytest.mark.usefixtures("stop_after_parsing")
def test_a_count_that_is_no_number_is_one_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "sandbox", "--jobs", "many"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == "inflight bench sandbox: error: argument --jobs: expected a whole number, got 'many'"


def test_pipeline_ray_pair_needs_steps_past_the_second(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(REPO_ROOT))
    pipeline = importlib.import_module("benchmarks.pipeline")

    def no_ray_pair(*args: Any) -> None:
        raise AssertionError("the ray pair started with too few steps to time")

    monkeypatch.setattr(pipeline, "ray_pair", no_ray_pair)
    with pytest.raises(SystemExit):
        pipeline.main(["--only", "ray", "--steps", "2"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.endswith("--only ray times the steps after the second: give --steps 3 or more")


@pytest.mark.usefixtures("no_weights")
@pytest.mark.parametrize("name", ["engine", "grpo", "serve", "train"])
def test_a_model_path_without_a_model_is_inflight_runs_one_line(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))
    missing = tmp_path / "nonexistent"
    line = one_line_error(capsys, "bench", name, "--model", str(missing))
    assert line == (
        f"inflight: error: model directory {str(missing)!r} does not exist: "
        f"build one with `inflight model tiny --out {missing}`"
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    line = one_line_error(capsys, "bench", name, "--model", str(empty))
    assert "has no config.json" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_bench_engine_on_a_device_this_machine_lacks_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))
    line = one_line_error(capsys, "bench", "engine", "--device", "cuda")
    assert line == (
        "inflight: error: --device='cuda' but this machine has no CUDA device: set --device=cpu (or auto)"
    )
    line = one_line_error(capsys, "bench", "engine", "--device", "gpu")
    assert line == "inflight: error: --device='gpu' is not a device name: use auto, cpu, cuda or cuda:N"
    with pytest.raises(SystemExit) as exit_info:  # argparse's own: its usage, then the line
        main(["bench", "engine", "--device", "auto", "--backend", "vllm"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_info.value.code == 2
    assert last == "inflight bench engine: error: --backend vllm times the CPU build of vLLM: drop --device"


def test_a_zero_count_from_the_real_entry_point() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "inflight.cli", "bench", "sandbox", "--concurrency", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[0].startswith("usage: inflight bench sandbox ")
    assert lines[-1] == "inflight bench sandbox: error: argument --concurrency: must be at least 1, got 0"


def test_bench_without_a_name_names_the_benchmarks(capsys: pytest.CaptureFixture[str]) -> None:
    """`inflight bench` alone used to answer "the following arguments are required: name, args", though every
    option of a benchmark is optional: now one line naming the benchmarks there are."""
    line = one_line_error(capsys, "bench")
    assert f"NAME one of {', '.join(BENCHMARKS)}" in line and "required" not in line, line


@pytest.mark.parametrize("name", BENCHMARKS)
def test_every_option_of_a_benchmark_says_what_it_is(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`inflight bench engine --help` listed --batch-size, --new-tokens and --prompt-tokens with nothing
    after them (and grpo, serve and trl had such options too)."""
    parsers: list[argparse.ArgumentParser] = []

    def keep_and_stop(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        if self.prog == "inflight":
            return parse_args(self, *args, **kwargs)
        parsers.append(self)
        raise Parsed(None)

    parse_args = argparse.ArgumentParser.parse_args
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", keep_and_stop)
    monkeypatch.setattr(sys, "path", list(sys.path))  # `inflight bench` puts the repository root first
    with pytest.raises(Parsed):
        main(["bench", name])
    undescribed = [action.option_strings for action in parsers[0]._actions if not action.help]
    assert not undescribed, f"`inflight bench {name} --help` says nothing about {undescribed}"
