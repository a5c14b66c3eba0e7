"""`inflight run TARGET`: every kind of target resolves to a Task, and every wrong one is one line.

Reference: issue 14 items 1 and "Bad input". A TARGET is a recipe name, a .py file, package.module[:attr] or
openenv:URL; a wrong target (no such file, nothing usable in it, a function with the wrong signature) exits
with code 2 and one `inflight: error:` line saying what was expected, before any weights load and before a
run directory exists.
"""

from __future__ import annotations

import functools
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from inflight.cli import main
from inflight.envs.blackjack import BlackJackEnv
from inflight.envs.openenv_client import OpenEnvClientEnv
from inflight.orchestrator.target import resolve_target

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
ROLLOUT_PAIR = """
from inflight.config import RunConfig

def load_problems(split):
    return [{"x": 1}]

async def generate_rollout(ctx, problem):
    raise NotImplementedError

def preset():
    return RunConfig(seed=7)
"""
ENV_CLASS = """
from typing import Any
from inflight.envs import Environment, State, TextAction, TextObservation

class Echo(Environment[TextAction, TextObservation, State]):
    def __init__(self, size: int = 1) -> None:
        self.size = size

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kw: Any) -> TextObservation:
        return TextObservation(prompt="say something")

    def step(self, action: TextAction, timeout_s: float | None = None, **kw: Any) -> TextObservation:
        return TextObservation(prompt="", done=True, reward=float(len(action.text)))

    @property
    def state(self) -> State:
        return State()
"""


class _NoWeights:
    @staticmethod
    def from_pretrained(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("weights were read before the bad target was reported")


@pytest.fixture(autouse=True)
def no_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("inflight.models.loader.AutoModelForCausalLM", _NoWeights)


def write(tmp_path: Path, name: str, source: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return str(path)


def one_line_error(capsys: pytest.CaptureFixture[str], tmp_path: Path, *argv: str) -> str:
    """`inflight run ARGV --run-dir RUN`: exit 2, a single error line, and no run directory left."""
    capsys.readouterr()
    run_dir = tmp_path / "run"
    code = main(["run", *argv, "--run-dir", str(run_dir)])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("inflight: error: "), err
    assert not run_dir.exists(), "a run that never started left its directory behind"
    return lines[0]


# -- each kind of target ---------------------------------------------------------------------------------


def test_a_recipe_name_is_a_task_like_any_other() -> None:
    blackjack, guess = resolve_target("blackjack"), resolve_target("guess_number")
    assert blackjack.env is BlackJackEnv and blackjack.summarize is not None
    assert guess.env is None and guess.warmup_reply is not None
    assert blackjack.config().recipe == "blackjack" and guess.config().recipe == "guess_number"


def test_a_file_with_the_rollout_pair(tmp_path: Path) -> None:
    task = resolve_target(write(tmp_path, "my_task.py", ROLLOUT_PAIR))
    assert task.name == "my_task" and task.env is None
    assert task.load_problems("train") == [{"x": 1}]
    assert task.config().seed == 7 and task.config().recipe == "my_task"  # its preset, under its name


def test_a_file_with_an_env_class_and_one_attr_of_a_file(tmp_path: Path) -> None:
    path = write(tmp_path, "echo_env.py", ENV_CLASS)
    task = resolve_target(path)
    assert task.name == "echo_env" and task.env is not None and task.env.__name__ == "Echo"
    assert task.load_problems("train")[3] == {"seed": 3, "split": "train"}
    by_attr = resolve_target(f"{path}:Echo").env
    assert by_attr is not None and by_attr.__name__ == "Echo"


def test_several_env_classes_need_an_attr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, "two.py", ENV_CLASS + "\n\nclass Other(Echo):\n    pass\n")
    line = one_line_error(capsys, tmp_path, path)
    assert "several Environment classes (Echo, Other)" in line and f"{path}:Echo" in line
    assert resolve_target(f"{path}:Other").env.__name__ == "Other"  # type: ignore[union-attr]


def test_a_make_env_factory(tmp_path: Path) -> None:
    source = (
        ENV_CLASS.replace("class Echo", "class _Echo")
        + "\n\ndef make_env(size: int = 2):\n    return _Echo(size)\n"
    )
    task = resolve_target(write(tmp_path, "factory.py", source))
    assert task.env is not None and task.env.__name__ == "make_env"


def test_package_module_and_module_attr() -> None:
    by_module = resolve_target("inflight.recipes.guess_number")
    assert by_module.name == "guess_number" and by_module.env is None
    by_attr = resolve_target("inflight.envs.blackjack:BlackJackEnv")
    assert by_attr.name == "blackjack" and by_attr.env is BlackJackEnv


def test_a_package_in_the_current_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`inflight run mytasks.add` from the directory holding `mytasks/`, as `python -m` would find it (the
    console script does not put the directory on sys.path)."""
    (tmp_path / "mytasks").mkdir()
    write(tmp_path / "mytasks", "__init__.py", "")
    write(tmp_path / "mytasks", "add.py", ROLLOUT_PAIR)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    task = resolve_target("mytasks.add")
    assert task.name == "add" and task.load_problems("train") == [{"x": 1}]


def test_openenv_url() -> None:
    task = resolve_target("openenv:http://127.0.0.1:1")
    assert task.name == "openenv" and isinstance(task.env, functools.partial)
    assert task.env.func is OpenEnvClientEnv and task.env.args == ("http://127.0.0.1:1",)


def test_list_keys_shows_a_targets_preset_with_overrides(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, "my_task.py", ROLLOUT_PAIR)
    assert main(["run", path, "grpo.steps=3", "--list-keys"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert {"seed=7", "grpo.steps=3", 'recipe="my_task"'} <= set(lines)


# -- wrong targets: one line each -------------------------------------------------------------------------


def test_missing_target(capsys, tmp_path: Path) -> None:
    line = one_line_error(capsys, tmp_path)
    assert "missing TARGET" in line and "a path to a .py file" in line


def test_no_such_file(capsys, tmp_path: Path) -> None:
    line = one_line_error(capsys, tmp_path, "examples/no_such_task.py")
    assert "no such file: examples/no_such_task.py" in line and "package.module[:attr]" in line


def test_unknown_module(capsys, tmp_path: Path) -> None:
    line = one_line_error(capsys, tmp_path, "no_such_package_xyz.tasks")
    assert "unknown target 'no_such_package_xyz.tasks'" in line and "recipe name (arithmetic" in line


def test_nothing_usable_in_a_file(capsys, tmp_path: Path) -> None:
    line = one_line_error(capsys, tmp_path, write(tmp_path, "empty.py", "X = 1\n"))
    assert "provides no task" in line and "async def generate_rollout(ctx, problem)" in line
    assert "Environment subclass" in line


def test_load_problems_without_generate_rollout_names_the_missing_function(capsys, tmp_path: Path) -> None:
    half = ROLLOUT_PAIR.replace("async def generate_rollout(ctx, problem):", "async def play(ctx, problem):")
    line = one_line_error(capsys, tmp_path, write(tmp_path, "half.py", half))
    assert "half.py has load_problems but no `async def generate_rollout(ctx, problem) -> Rollout`" in line


def test_generate_rollout_not_async(capsys, tmp_path: Path) -> None:
    source = ROLLOUT_PAIR.replace("async def generate_rollout(ctx, problem)", "def generate_rollout(problem)")
    line = one_line_error(capsys, tmp_path, write(tmp_path, "sync_fn.py", source))
    assert "generate_rollout must be `async def generate_rollout(ctx, problem) -> Rollout`" in line
    assert "not `def generate_rollout(problem)`" in line


def test_load_problems_missing_or_wrong(capsys, tmp_path: Path) -> None:
    no_load = ROLLOUT_PAIR.replace("def load_problems(split):", "def problems(split):")
    line = one_line_error(capsys, tmp_path, write(tmp_path, "no_load.py", no_load))
    assert "has generate_rollout but no `def load_problems(split) -> list[dict]`" in line
    no_split = ROLLOUT_PAIR.replace("def load_problems(split):", "def load_problems():")
    line = one_line_error(capsys, tmp_path, write(tmp_path, "no_split.py", no_split))
    assert "load_problems must be `def load_problems(split) -> list[dict]`, not `def load_problems()`" in line


def test_preset_wrong(capsys, tmp_path: Path) -> None:
    takes_args = ROLLOUT_PAIR.replace("def preset():", "def preset(steps):")
    line = one_line_error(capsys, tmp_path, write(tmp_path, "p1.py", takes_args))
    assert "preset must be `def preset() -> RunConfig`, not `def preset(steps)`" in line
    returns_dict = ROLLOUT_PAIR.replace("return RunConfig(seed=7)", "return {'seed': 7}")
    line = one_line_error(capsys, tmp_path, write(tmp_path, "p2.py", returns_dict))
    assert "p2: preset() must return a RunConfig, not dict" in line
    raises = ROLLOUT_PAIR.replace("return RunConfig(seed=7)", "raise RuntimeError('preset broke')")
    line = one_line_error(capsys, tmp_path, write(tmp_path, "p3.py", raises))
    assert line == "inflight: error: p3: preset() raised RuntimeError: preset broke"


def test_a_file_that_fails_to_import(capsys, tmp_path: Path) -> None:
    line = one_line_error(
        capsys, tmp_path, write(tmp_path, "broken.py", "import os\nraise ValueError('no')\n")
    )
    assert "broken.py failed (line 2): ValueError: no" in line
    line = one_line_error(capsys, tmp_path, write(tmp_path, "deps.py", "import no_such_dependency_xyz\n"))
    assert "ModuleNotFoundError: No module named 'no_such_dependency_xyz'" in line


def test_a_missing_attr(capsys, tmp_path: Path) -> None:
    path = write(tmp_path, "echo_env.py", ENV_CLASS)
    line = one_line_error(capsys, tmp_path, f"{path}:Nope")
    assert f"{path} has no 'Nope'" in line


def test_bad_problems(capsys, tmp_path: Path) -> None:
    no_test = ROLLOUT_PAIR.replace('return [{"x": 1}]', 'return [{"x": 1}] if split == "train" else []')
    line = one_line_error(capsys, tmp_path, write(tmp_path, "no_test.py", no_test))
    assert "load_problems('test') returned no problems; set eval.num_episodes=0" in line
    a_dict = ROLLOUT_PAIR.replace('return [{"x": 1}]', 'return {"x": 1}')
    line = one_line_error(capsys, tmp_path, write(tmp_path, "a_dict.py", a_dict))
    assert "load_problems('train') must return a list of dicts, not a dict" in line
    strings = ROLLOUT_PAIR.replace('return [{"x": 1}]', 'return ["x"]')
    line = one_line_error(capsys, tmp_path, write(tmp_path, "strings.py", strings))
    assert "must return a list of dicts; one is a str: 'x'" in line
    raises = ROLLOUT_PAIR.replace('return [{"x": 1}]', "raise KeyError('split')")
    line = one_line_error(capsys, tmp_path, write(tmp_path, "raises.py", raises))
    assert "load_problems('train') raised KeyError: 'split'" in line


def test_env_problems(capsys, tmp_path: Path) -> None:
    path = write(tmp_path, "echo_env.py", ENV_CLASS)
    line = one_line_error(capsys, tmp_path, path, "env.kwargs.colour=1")
    assert "environment 'echo_env' takes no colour; it takes: size" in line
    bad_factory = "def make_env():\n    return 42\n"
    line = one_line_error(capsys, tmp_path, write(tmp_path, "bad_factory.py", bad_factory))
    assert "its Env factory returned a int, not an environment with reset() and step()" in line
    rollout_task = write(tmp_path, "pair.py", ROLLOUT_PAIR)
    line = one_line_error(capsys, tmp_path, rollout_task, "env.name=blackjack")
    assert "pair is written with generate_rollout and plays no Env; unset env.name" in line


def test_openenv_without_url_and_bad_client_kwargs(capsys, tmp_path: Path) -> None:
    line = one_line_error(capsys, tmp_path, "openenv:")
    assert "openenv: needs the server's URL" in line
    line = one_line_error(capsys, tmp_path, "openenv:http://127.0.0.1:1", "env.kwargs.colour=1")
    assert "environment 'openenv' takes no colour; it takes: prompt_field, action_field" in line


def test_a_warm_up_without_replies(capsys, tmp_path: Path) -> None:
    path = write(tmp_path, "pair.py", ROLLOUT_PAIR)
    line = one_line_error(capsys, tmp_path, path, "warmup.sft_steps=5")
    assert "warmup.sft_steps=5 needs a `warmup_reply(transcript, rng) -> str` in pair" in line


def test_the_examples_resolve() -> None:
    kinds = {p.stem: resolve_target(str(p)).env is None for p in sorted(EXAMPLES.glob("*.py"))}
    assert kinds == {"calculator_tool": True, "higher_lower_env": False, "letter_count": True}
