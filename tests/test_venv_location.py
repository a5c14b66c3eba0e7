"""A cached environment's place that cannot hold it (`launch/venv_cache.py`): refused before anything is
built, and one line naming what set the place (INFLIGHT_VLLM_ENV, `--trl-env`) and how to name another.
No test here builds an environment: every build is a fake that fails the test if it is reached.

Reference: the QA pass (INFLIGHT_VLLM_ENV under a regular file gave a FileExistsError traceback). Unusable
places are paths under a regular file, or under /proc: the tests run as root, for whom chmod makes nothing
unwritable.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from conftest import one_line_error
from inflight.cli import main
from inflight.errors import UserError
from inflight.launch import vllm_env
from inflight.launch.venv_cache import VenvLocationError, cached_venv

REPO_ROOT = Path(__file__).resolve().parents[1]


def no_build(directory: Path) -> None:
    raise AssertionError(f"a build started in {directory}")


@pytest.fixture
def a_file(tmp_path: Path) -> Path:
    path = tmp_path / "a-file"
    path.write_text("not a directory")
    return path


@pytest.fixture(autouse=True)
def never_build_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_env, "_build", lambda env, log: no_build(env))


@pytest.mark.parametrize(
    ("place", "why"),
    [
        ("a-file/venv", "{tmp}/a-file is not a directory"),
        ("a-file/deeper/venv", "{tmp}/a-file is not a directory"),
        ("a-file", "{tmp}/a-file is not a directory"),
        ("full/venv", "{tmp}/full/venv is a directory that holds other files (no bin/python)"),
        (
            "/proc/inflight-no-such-dir/venv",
            "cannot create /proc/inflight-no-such-dir: No such file or directory",
        ),
    ],
)
def test_a_place_that_cannot_hold_an_environment_is_refused_before_building(
    place: str, why: str, tmp_path: Path, a_file: Path
) -> None:
    (tmp_path / "full" / "venv").mkdir(parents=True)
    (tmp_path / "full" / "venv" / "notes.txt").write_text("someone else's")
    with pytest.raises(VenvLocationError) as error:
        cached_venv(tmp_path / place, no_build)
    assert str(error.value) == why.format(tmp=tmp_path)
    assert not list(tmp_path.rglob("*.building-*"))


def test_an_empty_directory_becomes_the_environment(tmp_path: Path) -> None:
    env = tmp_path / "venv"
    env.mkdir()

    def build(directory: Path) -> None:
        (directory / "bin").mkdir(parents=True)
        (directory / "bin" / "python").write_text("")

    assert cached_venv(env, build) == env / "bin" / "python"
    assert (env / "bin" / "python").is_file() and not list(tmp_path.glob("venv.building-*"))
    assert cached_venv(env, no_build) == env / "bin" / "python"  # cached: not built again


def test_vllm_env_under_a_file_names_the_variable_and_the_fix(
    a_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("INFLIGHT_VLLM_ENV", str(a_file / "venv"))
    with pytest.raises(UserError) as error:
        vllm_env.vllm_python()
    assert str(error.value) == (
        f"INFLIGHT_VLLM_ENV={a_file / 'venv'} cannot hold the vLLM environment ({a_file} is not a "
        "directory): set INFLIGHT_VLLM_ENV to a new or empty directory you can write"
    )


def test_run_with_vllm_env_under_a_file_is_one_line_and_exit_code_2(
    a_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("INFLIGHT_VLLM_ENV", str(a_file / "venv"))
    capsys.readouterr()
    code = main(["run", "blackjack", "engine.backend=vllm", f"run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    # Before it, only run_local's progress line ("starting the vLLM engine ...").
    assert err.strip().splitlines()[-1].startswith(f"inflight: error: INFLIGHT_VLLM_ENV={a_file / 'venv'} ")


def test_trl_env_under_a_file_names_the_option(
    a_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))  # `inflight bench` puts the repository root first
    line = one_line_error(
        capsys, "bench", "trl", "--trl-env", str(a_file / "env"), "--run-dir", str(tmp_path / "run")
    )
    assert line == (
        f"inflight: error: {a_file / 'env'} cannot hold TRL's environment ({a_file} is not a directory): "
        "name a new or empty directory you can write with --trl-env"
    )
    assert not (tmp_path / "run").exists()
