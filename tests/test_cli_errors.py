"""Bad input to any command: exit code 2, one line on stderr naming the problem, no traceback, and no
weights read first where the check can come before them.

Reference: the hardening issue, part 4 (one test per case found). Unwritable paths are paths under a
regular file: the tests run as root, for whom chmod makes nothing unwritable.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import NoWeights, one_line_error
from inflight.trainer import Trainer, TrainerConfig
from inflight.trainer.checkpoint import WEIGHTS, save_checkpoint


@pytest.fixture
def a_file(tmp_path: Path) -> Path:
    path = tmp_path / "a-file"
    path.write_text("not a directory")
    return path


def serve(tiny_model_dir: Path, tmp_path: Path, *extra: str) -> list[str]:
    state = ["--state-dir", str(tmp_path / "state")] if "--state-dir" not in extra else []
    return ["serve", "--base-model", f"tiny={tiny_model_dir}", "--port", "0", *state, *extra]


def run(tiny_model_dir: Path | str, run_dir: Path, *overrides: str) -> list[str]:
    small = ["grpo.steps=1", "grpo.prompts_per_step=2", "grpo.group_size=2", "warmup.sft_steps=0"]
    return ["run", "blackjack", f"model.path={tiny_model_dir}", *small, *overrides, "--run-dir", str(run_dir)]


# -- inflight serve ---------------------------------------------------------------------------------------


def test_serve_missing_model_directory(capsys, tmp_path: Path, no_weights) -> None:
    missing = tmp_path / "no-model"
    line = one_line_error(capsys, *serve(missing, tmp_path))
    assert str(missing) in line and "does not exist" in line


def test_serve_one_base_model_name_given_twice(
    capsys, tiny_model_dir: Path, tmp_path: Path, no_weights
) -> None:
    line = one_line_error(capsys, *serve(tiny_model_dir, tmp_path, "--base-model", f"tiny={tmp_path}"))
    assert f"--base-model tiny= is given twice ({tiny_model_dir} and {tmp_path})" in line, line


def test_serve_unknown_database_backend(capsys, tiny_model_dir: Path, tmp_path: Path, no_weights) -> None:
    line = one_line_error(capsys, *serve(tiny_model_dir, tmp_path, "--db", "foo://x"))
    assert "--db 'foo://x'" in line and "unknown database backend 'foo'" in line


def test_serve_malformed_database_url(capsys, tiny_model_dir: Path, tmp_path: Path, no_weights) -> None:
    line = one_line_error(capsys, *serve(tiny_model_dir, tmp_path, "--db", "not a url"))
    assert "is not a database URL" in line and "sqlite:///PATH" in line


def test_serve_unreachable_database(capsys, tiny_model_dir: Path, tmp_path: Path, no_weights) -> None:
    url = "postgresql://nope@127.0.0.1:1/x"
    line = one_line_error(capsys, *serve(tiny_model_dir, tmp_path, "--db", url))
    assert f"--db '{url}'" in line


def test_serve_database_password_stays_out_of_the_message(
    capsys, tiny_model_dir: Path, tmp_path: Path, no_weights
) -> None:
    url = "postgresql+psycopg://nope:hunter2@127.0.0.1:1/x"
    line = one_line_error(capsys, *serve(tiny_model_dir, tmp_path, "--db", url))
    assert "cannot connect" in line and "hunter2" not in line


def test_serve_unwritable_sqlite_path(
    capsys, tiny_model_dir: Path, tmp_path: Path, a_file, no_weights
) -> None:
    line = one_line_error(capsys, *serve(tiny_model_dir, tmp_path, "--db", f"sqlite:///{a_file}/x.db"))
    assert str(a_file) in line and "not a directory" in line


def test_serve_state_dir_is_a_file(capsys, tiny_model_dir: Path, tmp_path: Path, a_file, no_weights) -> None:
    line = one_line_error(capsys, *serve(tiny_model_dir, tmp_path, "--state-dir", str(a_file)))
    assert line.endswith(f"--state-dir: {a_file} is a file, not a directory")


def test_serve_port_in_use(capsys, tiny_model_dir: Path, tmp_path: Path, busy_port: int, no_weights) -> None:
    argv = serve(tiny_model_dir, tmp_path)
    argv[argv.index("--port") + 1] = str(busy_port)
    line = one_line_error(capsys, *argv)
    assert f"port {busy_port} on 127.0.0.1 is in use" in line


def test_serve_port_out_of_range_from_the_real_entry_point(tiny_model_dir: Path, tmp_path: Path) -> None:
    argv = serve(tiny_model_dir, tmp_path)
    argv[argv.index("--port") + 1] = "70000"
    proc = subprocess.run(
        [sys.executable, "-m", "inflight.cli", *argv], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == "inflight: error: --port 70000 is out of range: use 1-65535"


# -- inflight serve-engine --------------------------------------------------------------------------------


def test_serve_engine_port_in_use(capsys, tiny_model_dir: Path, busy_port: int, no_weights) -> None:
    line = one_line_error(capsys, "serve-engine", "--model", str(tiny_model_dir), "--port", str(busy_port))
    assert f"port {busy_port} on 127.0.0.1 is in use" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_serve_engine_on_a_device_that_is_not_there(capsys, tiny_model_dir: Path, no_weights) -> None:
    line = one_line_error(capsys, "serve-engine", "--model", str(tiny_model_dir), "--device", "cuda")
    assert "--device='cuda' but this machine has no CUDA device" in line
    line = one_line_error(capsys, "serve-engine", "--model", str(tiny_model_dir), "--device", "gpu")
    assert "--device='gpu' is not a device name: use auto, cpu, cuda or cuda:N" in line


# -- inflight run -----------------------------------------------------------------------------------------


def test_run_empty_model_directory(capsys, tmp_path: Path, no_weights) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    line = one_line_error(capsys, *run(empty, tmp_path / "run"))
    assert str(empty) in line and "config.json" in line and "inflight model tiny" in line


def test_run_model_that_is_not_a_causal_lm(capsys, tmp_path: Path, no_weights) -> None:
    t5 = tmp_path / "t5"
    t5.mkdir()
    (t5 / "config.json").write_text(json.dumps({"model_type": "t5", "architectures": ["T5Model"]}))
    line = one_line_error(capsys, *run(t5, tmp_path / "run"))
    assert "holds a 't5' model, which is not a causal language model" in line


def test_run_tokenizer_without_chat_template(
    capsys, tiny_model_dir: Path, tmp_path: Path, no_weights
) -> None:
    bare = tmp_path / "bare"
    shutil.copytree(tiny_model_dir, bare)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    for extra in bare.glob("chat_template*"):
        extra.unlink()
    line = one_line_error(capsys, *run(bare, tmp_path / "run"))
    assert "has no chat template" in line and "chat_template" in line


def test_run_directory_is_a_file(capsys, tiny_model_dir: Path, a_file: Path, no_weights) -> None:
    line = one_line_error(capsys, *run(tiny_model_dir, a_file))
    assert line.endswith(f"--run-dir: {a_file} is a file, not a directory")


def test_run_directory_unwritable(capsys, tiny_model_dir: Path, a_file: Path, no_weights) -> None:
    line = one_line_error(capsys, *run(tiny_model_dir, a_file / "run"))
    assert f"--run-dir: {a_file / 'run'} is not a writable directory" in line


def test_run_corrupt_checkpoint(capsys, tiny_model_dir: Path, tmp_path: Path) -> None:
    from inflight.models import load_model

    checkpoint = tmp_path / "run" / "checkpoint"
    save_checkpoint(Trainer(load_model(tiny_model_dir), TrainerConfig()), checkpoint, extra={"step": 1})
    (checkpoint / WEIGHTS).write_bytes(b"\0" * 64)  # damaged after it was written
    with pytest.MonkeyPatch.context() as m:
        m.setattr("inflight.models.loader.AutoModelForCausalLM", NoWeights)
        line = one_line_error(capsys, *run(tiny_model_dir, tmp_path / "run"))
    assert f"checkpoint {checkpoint} is incomplete or corrupt" in line and "move it away" in line


def test_run_unknown_env_kwarg(capsys, tiny_model_dir: Path, tmp_path: Path, no_weights) -> None:
    line = one_line_error(capsys, *run(tiny_model_dir, tmp_path / "run", "env.kwargs.dealer_seed=1"))
    assert "env.kwargs" in line and "'blackjack' takes no dealer_seed" in line and "seed" in line


def test_run_unreachable_engine_url(capsys, tiny_model_dir: Path, tmp_path: Path, no_weights) -> None:
    urls = json.dumps(["http://127.0.0.1:1"])
    line = one_line_error(capsys, *run(tiny_model_dir, tmp_path / "run", f"pipeline.engine_urls={urls}"))
    assert "pipeline.engine_urls: http://127.0.0.1:1 does not answer" in line and "serve-engine" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("key", ["engine.device", "trainer.device"])
def test_run_on_a_device_that_is_not_there(
    capsys, tiny_model_dir: Path, tmp_path: Path, key: str, no_weights
) -> None:
    line = one_line_error(capsys, *run(tiny_model_dir, tmp_path / "run", f"{key}=cuda"))
    assert f"{key}='cuda' but this machine has no CUDA device: set {key}=cpu (or auto)" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_serve_on_a_device_that_is_not_there(
    capsys, tiny_model_dir: Path, tmp_path: Path, no_weights
) -> None:
    line = one_line_error(capsys, *serve(tiny_model_dir, tmp_path, "--device", "cuda:1"))
    assert "--device='cuda:1' but this machine has no CUDA device" in line


# -- inflight plot, inflight model tiny -------------------------------------------------------------------


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    path = tmp_path / "run"
    path.mkdir()
    (path / "metrics.jsonl").write_text('{"step": 0, "phase": "train", "reward_mean": 0.5, "loss": 0.1}\n')
    return path


def test_plot_corrupt_metrics(capsys, run_dir: Path) -> None:
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write('{"step": 1, "pha\n')  # a line cut short
    line = one_line_error(capsys, "plot", str(run_dir))
    assert f"{run_dir / 'metrics.jsonl'} line 2 is not JSON" in line


def test_plot_unwritable_out(capsys, run_dir: Path, a_file: Path) -> None:
    line = one_line_error(capsys, "plot", str(run_dir), "--out", str(a_file / "curves.png"))
    assert line.endswith(f"--out: {a_file} is a file, not a directory")


def test_model_tiny_unwritable_out(capsys, a_file: Path) -> None:
    line = one_line_error(capsys, "model", "tiny", "--out", str(a_file / "model"))
    assert f"--out: {a_file / 'model'} is not a writable directory" in line
