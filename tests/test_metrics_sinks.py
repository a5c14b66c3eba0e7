"""Metrics where researchers look: TensorBoard and W&B sinks, sample tables, console progress, plots.

References: what the backends themselves read back. TensorBoard's EventAccumulator (the reader behind
`tensorboard --logdir`); W&B's offline run directory (the `.wandb` record log, LevelDB's log format holding
protobuf `Record`s, which `wandb sync` uploads), with WANDB_MODE=offline and every W&B directory under
tmp_path, so no test touches the network or the home directory.
"""

from __future__ import annotations

import io
import json
import struct
import sys
import time
from pathlib import Path

import pytest

from inflight.config import RunConfig, apply_overrides
from inflight.errors import UserError
from inflight.metrics.config import MetricsConfig
from inflight.metrics.logger import SAMPLES_FILE, MetricsLogger
from inflight.metrics.progress import StepProgress
from inflight.metrics.samples import sample_rows
from inflight.metrics.sink import SampleRow
from inflight.types import Rollout

ROWS = [SampleRow("Total 12. hit | stand?", "hit\nbust", -1.0), SampleRow("Total 20?", "stand", 1.0)]


def log_three_steps(logger: MetricsLogger) -> None:
    for step in range(3):
        logger.log(
            step, {"reward_mean": 0.1 * step, "loss": 1.0 / (step + 1), "note": "x", "nan": float("nan")}
        )
    logger.log(3, {"return": 0.25}, phase="eval")
    logger.log_samples(2, ROWS)


def test_tensorboard_event_files_hold_the_logged_scalars_and_samples(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = MetricsLogger(tmp_path, MetricsConfig(tensorboard=True))
    log_three_steps(logger)
    logger.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalars = events.Tags()["scalars"]
    assert {"train/reward_mean", "train/loss", "eval/return"} <= set(scalars)
    assert not any(tag.endswith(("/note", "/nan")) for tag in scalars)  # strings and NaN stay in the JSONL
    loss = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert loss == [(0, pytest.approx(1.0)), (1, pytest.approx(0.5)), (2, pytest.approx(1 / 3))]
    assert [(e.step, e.value) for e in events.Scalars("eval/return")] == [(3, 0.25)]
    (text,) = events.Tensors("samples/text_summary")
    table = text.tensor_proto.string_val[0].decode()
    assert text.step == 2 and table.count("\n") == 3  # header, rule, two rows: one row per sample
    assert "hit \\| stand?" in table and "hit<br>bust" in table


def read_wandb_records(offline_run: Path) -> list:
    """The records of an offline run's `.wandb` file: a 7-byte header, then LevelDB log blocks of 32 KiB
    whose chunks (crc32 u32, length u16, type u8: 1 full, 2 first, 3 middle, 4 last) carry Records."""
    from wandb.proto import wandb_internal_pb2

    (path,) = offline_run.glob("run-*.wandb")
    data, block, pos = path.read_bytes(), 32768, 7
    assert data[:4] == b":W&B"
    records, partial = [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if pos + 7 + length > len(data):  # a chunk still being written
            break
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:  # zero padding to the end of the block
            pos += (block - pos % block) % block
            continue
        partial = chunk if kind in (1, 2) else partial + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(partial)
            records.append(record)
    return records


def record_key(item) -> str:
    return item.key or "/".join(item.nested_key)  # W&B's core writes keys as nested_key


@pytest.fixture
def wandb_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    wandb_dir = tmp_path / "wandb-files"
    wandb_dir.mkdir()
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(wandb_dir))
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return wandb_dir


def test_wandb_offline_run_holds_the_logged_history_and_table(tmp_path: Path, wandb_offline: Path) -> None:
    run_dir = tmp_path / "run"
    logger = MetricsLogger(run_dir, MetricsConfig(wandb_project="inflight-test"), run_config={"seed": 3})
    log_three_steps(logger)
    logger.close()
    (offline,) = (wandb_offline / "wandb").glob("offline-run-*")
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    assert offline.name.endswith(run_id)
    # finish() returns before W&B's service process has written everything: wait for the exit record.
    deadline = time.monotonic() + 60
    records = read_wandb_records(offline)
    while not any(r.WhichOneof("record_type") == "exit" for r in records):
        assert time.monotonic() < deadline, "the offline run never recorded its exit"
        time.sleep(0.1)
        records = read_wandb_records(offline)
    history = [
        {record_key(item): json.loads(item.value_json) for item in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    train = [(h["step"], h["train/loss"]) for h in history if "train/loss" in h]
    assert train == [(0, 1.0), (1, 0.5), (2, pytest.approx(1 / 3))]
    assert [(h["step"], h["eval/return"]) for h in history if "eval/return" in h] == [(3, 0.25)]
    assert not any("train/note" in h or "train/nan" in h for h in history)
    config = next(r.run.config for r in records if r.WhichOneof("record_type") == "run")
    assert any(record_key(item) == "seed" and json.loads(item.value_json) == 3 for item in config.update)
    (table_file,) = offline.glob("files/media/table/samples_*.table.json")
    table = json.loads(table_file.read_text())
    assert table["columns"] == ["step", "prompt", "completion", "reward"]
    assert table["data"] == [[2, r.prompt, r.completion, r.reward] for r in ROWS]
    # A resumed run directory continues the same W&B run.
    MetricsLogger(run_dir, MetricsConfig(wandb_project="inflight-test")).close()
    assert (run_dir / "wandb_run_id").read_text().strip() == run_id


def test_a_missing_backend_package_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(
        UserError, match=r"wandb_project=p needs the wandb package: pip install 'inflight\[metrics\]'"
    ):
        MetricsLogger(tmp_path, MetricsConfig(wandb_project="p"))
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(UserError, match="tensorboard=true needs the tensorboard package"):
        MetricsLogger(tmp_path, MetricsConfig(tensorboard=True))


def test_config_keys_and_their_errors() -> None:
    cfg = apply_overrides(RunConfig(), ["metrics.tensorboard=true", "metrics.wandb_project=my-runs"])
    assert cfg.metrics.tensorboard and cfg.metrics.wandb_project == "my-runs"
    assert RunConfig().metrics == MetricsConfig()  # off by default: JSONL only
    with pytest.raises(UserError, match="wandb_project must be a W&B project name"):
        apply_overrides(RunConfig(), ["metrics.wandb_project= "])
    with pytest.raises(UserError, match=r"metrics\.print_every_steps"):
        apply_overrides(RunConfig(), ["metrics.print_every_steps=0"])


def rollout(prompt: list[int], reply: list[int], reward: float) -> Rollout:
    mask = [False] * len(prompt) + [True] * len(reply)
    return Rollout(prompt + reply, mask, [-0.5 * m for m in mask], [0 if m else -1 for m in mask], reward)


def test_sample_tables_every_n_steps_in_samples_jsonl(tmp_path: Path) -> None:
    rollouts = [rollout([1, 2], [10 + i, 20 + i], float(i)) for i in range(8)]
    decode = lambda ids: " ".join(map(str, ids))  # noqa: E731
    rows = sample_rows(rollouts, decode, 3)
    assert rows == [
        SampleRow("1 2", "10 20", 0.0),
        SampleRow("1 2", "12 22", 2.0),
        SampleRow("1 2", "15 25", 5.0),
    ]
    logger = MetricsLogger(tmp_path, MetricsConfig(samples_every_steps=2, samples_per_table=2))
    for step in range(5):
        logger.log_rollout_samples(step, rollouts, decode)
    logger.close()
    lines = [json.loads(line) for line in (tmp_path / SAMPLES_FILE).read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 1, 3, 3]  # after steps 2 and 4 (0-based 1 and 3)
    assert lines[1] == {"step": 1, "prompt": "1 2", "completion": "14 24", "reward": 4.0}


def test_without_a_terminal_a_plain_line_every_n_steps() -> None:
    out = io.StringIO()
    with StepProgress(7, "toy (sync GRPO)", every_steps=3, stream=out) as progress:  # StringIO: no terminal
        for step in range(1, 8):
            progress.update(step, 0.5 * step)
    lines = out.getvalue().splitlines()
    # The first step (the run is alive), every third, and the last.
    assert [line.split("step ")[1].split()[0] for line in lines] == ["1/7", "3/7", "6/7", "7/7"]
    assert lines[1].startswith("toy (sync GRPO): step 3/7  reward +1.500  ") and "s/step" in lines[1]
    resumed = io.StringIO()
    with StepProgress(10, "toy", every_steps=4, stream=resumed) as progress:
        for step in range(6, 11):  # a resumed run: its first step is 6
            progress.update(step, None)
    assert [line.split("step ")[1].split()[0] for line in resumed.getvalue().splitlines()] == [
        "6/10",
        "8/10",
        "10/10",
    ]
    for kwargs in ({"enabled": False}, {"terminal": True}):  # off, or a terminal: the bar, no lines
        quiet = io.StringIO()
        with StepProgress(3, "toy", every_steps=1, stream=quiet, **kwargs) as progress:  # type: ignore[arg-type]
            progress.update(1, 0.0)
        assert "step 1/3" not in quiet.getvalue()


def test_plot_any_run(tmp_path: Path) -> None:
    from inflight.metrics.plot import plot_run

    warmup_only = tmp_path / "warmup"
    logger = MetricsLogger(warmup_only)
    logger.log(0, {"loss": 2.0}, phase="warmup")
    logger.close()
    assert plot_run(warmup_only).is_file()
    task = tmp_path / "task"
    logger = MetricsLogger(task)
    for step in range(4):
        logger.log(step, {"reward_mean": step, "loss": 1.0, "ess": 0.9, "offpolicy_masked_frac": 0.1})
    logger.log(4, {"test/reward_mean": 0.5}, phase="eval")
    logger.close()
    assert plot_run(task, tmp_path / "out.png").stat().st_size > 0


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_both_loops_log_sample_tables_and_plain_progress(
    mode: str,
    tiny_model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`inflight run` without a terminal (pytest captures stderr): each loop's call sites write a sample table
    every step and a progress line every step, and its metrics reach TensorBoard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from inflight.cli import main

    metrics = ["samples_every_steps=1", "samples_per_table=3", "print_every_steps=1", "tensorboard=true"]
    run_dir = tmp_path / "run"
    overrides = [
        f"model.path={tiny_model_dir}",
        f"mode={mode}",
        "grpo.steps=2",
        "grpo.prompts_per_step=2",
        "grpo.group_size=2",
        "warmup.sft_steps=0",
        "eval.num_episodes=2",
        *(f"metrics.{m}" for m in metrics),
    ]
    assert main(["run", "blackjack", *overrides, "--run-dir", str(run_dir)]) == 0
    lines = [json.loads(line) for line in (run_dir / SAMPLES_FILE).read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 0, 0, 1, 1, 1]
    # A natural blackjack ends the episode before the policy acts: an empty completion, and that is right.
    assert all(line["prompt"] for line in lines) and any(line["completion"] for line in lines)
    assert all(isinstance(line["reward"], float) for line in lines)
    stderr = capsys.readouterr().err
    assert f"blackjack ({mode} GRPO): step 1/2" in stderr and "step 2/2" in stderr
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/reward_mean")] == [0, 1]
    assert [e.step for e in events.Tensors("samples/text_summary")] == [0, 1]
