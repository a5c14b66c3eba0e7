"""The command line: bad input gives one clear line and exit code 2; `--help` stays cheap.

Reference: the issue's "Bad input" contract (unknown recipe, missing model directory, misspelled key).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from inflight.cli import main
from inflight.config import RunConfig, apply_overrides
from inflight.errors import UserError


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "inflight.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_unknown_target_is_one_line_exit_2() -> None:
    proc = run_cli("run", "chess")
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "unknown target 'chess'" in proc.stderr and "blackjack" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_misspelled_key_names_the_key_and_the_fix(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "blackjack", "trainer.lrr=1e-3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "unknown config key 'trainer.lrr'" in err


def test_missing_model_directory_is_one_line_exit_2(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    proc = run_cli(
        "run", "blackjack", f"model.path={missing}", "grpo.steps=1", "--run-dir", str(tmp_path / "run")
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("inflight: error")]
    assert len(lines) == 1 and str(missing) in lines[0] and "inflight model tiny" in lines[0]
    assert "Traceback" not in proc.stderr


def test_bad_value_names_the_field() -> None:
    with pytest.raises(UserError, match=r"grpo\.group_size"):
        apply_overrides(RunConfig(), ["grpo.group_size=1"])
    with pytest.raises(UserError, match="key=value"):
        apply_overrides(RunConfig(), ["grpo.steps"])
    with pytest.raises(UserError, match=r"sampling\.temperature"):
        apply_overrides(RunConfig(), ["sampling.temperature=0.7"])  # trainer.temperature stays 1.0


def test_overrides_parse_types() -> None:
    cfg = apply_overrides(
        RunConfig(), ["trainer.lr=3e-4", "grpo.steps=7", "progress=false", "env.kwargs.x=1"]
    )
    assert cfg.trainer.lr == 3e-4 and cfg.grpo.steps == 7 and cfg.progress is False
    assert cfg.env.kwargs == {"x": 1}


def test_help_lists_commands() -> None:
    proc = run_cli("--help")
    assert proc.returncode == 0
    for command in ("run", "model", "bench", "plot"):
        assert command in proc.stdout


@pytest.mark.parametrize(
    ("command", "described"),
    [
        (
            ["serve"],
            [
                "--host HOST address to listen on (default 127.0.0.1)",
                "--port PORT port to listen on (default 8000)",
                "--state-dir STATE_DIR checkpoints and the default database (default inflight-serve,",
            ],
        ),
        (
            ["serve-engine"],
            [
                "--host HOST address to listen on (default 127.0.0.1)",
                "--port PORT port to listen on (default 8100)",
            ],
        ),
        (
            ["env", "serve"],
            ["--host HOST address to listen on (default 127.0.0.1)", "--port PORT default 8200;"],
        ),
    ],
)
def test_the_servers_help_names_where_they_listen_by_default(
    command: list[str], described: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """`inflight serve --help` and `serve-engine --help` listed --host, --port and --state-dir without their
    defaults."""
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    text = " ".join(capsys.readouterr().out.split())  # as one line: argparse wraps to the terminal
    for option in described:
        assert option in text, text


def test_model_tiny_command_writes_a_model(tmp_path: Path) -> None:
    assert main(["model", "tiny", "--out", str(tmp_path / "m"), "--seed", "3"]) == 0
    assert (tmp_path / "m" / "model.safetensors").is_file()
    assert (tmp_path / "m" / "tokenizer.json").is_file()


def test_serve_passes_its_options_to_the_service(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import inflight.api.app

    seen: dict[str, object] = {}
    monkeypatch.setattr(inflight.api.app, "serve", lambda **kwargs: seen.update(kwargs))
    model = f"tiny={tmp_path}"  # a directory that exists: a missing one is refused before the service
    assert main(["serve", "--base-model", model, "--dtype", "bfloat16", "--port", "9001"]) == 0
    assert seen["dtype"] == "bfloat16" and seen["port"] == 9001
    assert seen["base_models"] == {"tiny": str(tmp_path)}
    assert main(["serve", "--base-model", model]) == 0
    assert seen["dtype"] == "auto"


def test_what_answers_a_typo_imports_no_torch() -> None:
    """The run's config, the target lookup and the service's listening checks stay light, so a mistake on
    the command line is answered at once (it took 7.5 s, importing torch and transformers through the
    config's settings); the packages' heavy exports load on first use."""
    code = (
        "import sys, inflight.config, inflight.orchestrator.target, inflight.auth, inflight.preflight\n"
        "import inflight.models, inflight.trainer, inflight.losses, inflight.inference\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "blackjack", "model.path={missing}"],
        ["serve", "--base-model", "tiny={missing}", "--port", "0"],
    ],
    ids=["run", "serve"],
)
def test_a_missing_model_directory_is_refused_before_torch_loads(argv: list[str], tmp_path: Path) -> None:
    """The commonest mistake, a model directory that is not there, is a path check: one line and exit code
    2 with torch never imported (it took 5-8 s: the model path was resolved through the loader, and the
    devices were checked first)."""
    missing = tmp_path / "no-model"
    argv = [a.format(missing=missing) for a in argv]
    code = (
        "import sys\nfrom inflight.cli import main\n"
        f"rc = main({argv!r})\n"
        "print(rc, sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert out.stdout.strip() == "2 []", out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and str(missing) in lines[0] and "does not exist" in lines[0], out.stderr
    assert f"inflight model tiny --out {missing}" in lines[0]


@pytest.mark.parametrize(
    "package", ["inflight.inference", "inflight.losses", "inflight.models", "inflight.trainer"]
)
def test_lazy_exports_load_on_use_and_unknown_names_are_attribute_errors(package: str) -> None:
    """Every name in `__all__` resolves through the package's lazy map (a name listed but left out of the
    map would be an AttributeError at first use), to the object its defining module holds."""
    import importlib

    module = importlib.import_module(package)
    for name in module.__all__:
        value = getattr(module, name)
        defining = getattr(value, "__module__", None)
        if defining and defining.startswith(package + "."):  # classes and functions: the original object
            assert getattr(importlib.import_module(defining), name) is value, name
    with pytest.raises(AttributeError, match="has no attribute 'load_modle'"):
        _ = module.load_modle
