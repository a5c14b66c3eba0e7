"""`inflight run`'s settings and model path: a bad one is one line naming the key (or path) and the fix,
exit code 2, before any weight is read.

Reference: the pipeline QA pass's bad-input defects (values accepted until a rollout crashed, meaningless
values accepted silently, typos without a suggestion, causes misnamed, settings after options refused).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from pydantic import BaseModel

from conftest import one_line_error
from inflight.cli import main
from inflight.config import RunConfig, apply_overrides
from inflight.errors import UserError


@pytest.fixture
def task(tmp_path: Path) -> Path:
    path = tmp_path / "single.py"
    path.write_text(
        "from inflight.rollouts.api import RolloutContext\n"
        "from inflight.types import Rollout\n\n\n"
        "def load_problems(split: str) -> list[dict]:\n"
        "    return [{'a': i} for i in range(4)]\n\n\n"
        "async def generate_rollout(ctx: RolloutContext, problem: dict) -> Rollout:\n"
        "    chat = ctx.chat()\n"
        "    chat.user(f\"Say {problem['a']}\")\n"
        "    reply = await chat.assistant()\n"
        "    return chat.to_rollout(float(reply.strip() == str(problem['a'])), {})\n"
    )
    return path


def refusal(override: str) -> str:
    with pytest.raises(UserError) as info:
        apply_overrides(RunConfig(), [override])
    message = str(info.value)
    assert "\n" not in message
    return message


# -- values out of range: refused at parse time, naming the key and its range ---------------------------


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("sampling.temperature=-1", "sampling.temperature: must be >= 0, got -1"),
        ("sampling.top_p=2", "sampling.top_p: must be > 0 and <= 1, got 2"),
        ("sampling.top_p=0", "sampling.top_p: must be > 0 and <= 1, got 0"),
        ("sampling.top_k=-5", "sampling.top_k: must be >= 0, got -5"),
        ("sampling.max_tokens_per_turn=0", "sampling.max_tokens_per_turn: must be >= 1, got 0"),
        ("pipeline.max_staleness_steps=-1", "pipeline.max_staleness_steps: must be >= 0, got -1"),
        ("warmup.sft_steps=-1", "warmup.sft_steps: must be >= 0, got -1"),
        ("warmup.sft_batch_size=0", "warmup.sft_batch_size: must be >= 1, got 0"),
        ("grpo.max_turns=0", "grpo.max_turns: must be >= 1, got 0"),
        ("grpo.max_turns=-3", "grpo.max_turns: must be >= 1, got -3"),
        ("grpo.steps=-1", "grpo.steps: must be >= 0, got -1"),
        ("checkpoint_every_steps=-1", "checkpoint_every_steps: must be >= 0, got -1"),
        ("trainer.max_grad_norm=-1", "trainer.max_grad_norm: must be >= 0, got -1"),
        ("trainer.adam_beta2=1", "trainer.adam_beta2: must be >= 0 and < 1, got 1"),
        ("seed=-1", "seed: must be >= 0 and < 2**63, got -1"),
        ("trainer.lr=NaN", "trainer.lr: must be a finite number, got NaN"),
        ("rollout.timeout_s=Infinity", "rollout.timeout_s: must be a finite number > 0, got Infinity"),
    ],
)
def test_out_of_range_value_names_key_and_range(override: str, expected: str) -> None:
    assert refusal(override) == f"invalid config at {expected}"


def test_in_range_values_still_pass() -> None:
    cfg = apply_overrides(
        RunConfig(),
        [
            "sampling.top_p=1",
            "sampling.top_k=0",
            "pipeline.max_staleness_steps=null",
            "grpo.max_turns=1",
            "sampling.temperature=0",
            "warmup.sft_steps=0",
            "engine.max_restarts=-1",
        ],
    )
    assert cfg.pipeline.max_staleness_steps is None and cfg.grpo.max_turns == 1


def _numeric_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys += _numeric_keys(ann, f"{prefix}{name}.")
        elif ann is not bool and any(t in str(ann) for t in ("int", "float")):
            keys.append(prefix + name)
    return keys


@pytest.mark.parametrize("key", _numeric_keys(RunConfig))
def test_every_numeric_key_refuses_what_means_nothing(key: str) -> None:
    """-2 is below every key's range (-1 means "always" for the restart counts) and NaN is no number."""
    for value in ("-2", "NaN"):
        message = refusal(f"{key}={value}")
        assert key.rsplit(".", 1)[-1] in message, message


def test_a_reply_limit_that_leaves_no_room_for_a_prompt_is_refused(
    capsys, task: Path, tiny_model_dir: Path, tmp_path: Path, no_weights
) -> None:
    message = refusal("sampling.max_tokens_per_turn=1024")  # engine.max_seq_len_tokens: 1024
    assert message == (
        "invalid config: sampling.max_tokens_per_turn=1024 leaves no room for a prompt in "
        "engine.max_seq_len_tokens=1024 (prompt and reply together): set sampling.max_tokens_per_turn "
        "below 1024, or engine.max_seq_len_tokens above 1024"
    )
    fits = apply_overrides(RunConfig(), ["engine.max_seq_len_tokens=64", "sampling.max_tokens_per_turn=63"])
    assert fits.sampling.max_tokens_per_turn == 63
    line = one_line_error(
        capsys, "run", str(task), f"model.path={tiny_model_dir}", "engine.max_seq_len_tokens=32",
        "sampling.max_tokens_per_turn=48", "--run-dir", str(tmp_path / "run"),
    )  # fmt: skip
    assert "max_tokens_per_turn=48 leaves no room for a prompt in engine.max_seq_len_tokens=32" in line
    assert not (tmp_path / "run").exists()


def test_clip_thresholds_are_checked_against_the_losss_defaults() -> None:
    message = refusal("trainer.loss.clip_low_threshold=1.5")  # ppo's high is 1.2
    assert "ppo needs 0 <= clip_low_threshold <= clip_high_threshold, got 1.5 and 1.2" in message


def test_bad_value_fails_before_the_model_loads(
    capsys, task: Path, tiny_model_dir: Path, tmp_path: Path, no_weights
) -> None:
    line = one_line_error(
        capsys,
        "run",
        str(task),
        f"model.path={tiny_model_dir}",
        "sampling.top_p=2",
        "--run-dir",
        str(tmp_path / "run"),
    )
    assert line == "inflight: error: invalid config at sampling.top_p: must be > 0 and <= 1, got 2"
    assert not (tmp_path / "run").exists()


# -- typos get the close match ---------------------------------------------------------------------------


def test_misspelt_key_suggests_the_close_one() -> None:
    assert refusal("grpo.step=2") == "unknown config key 'grpo.step'; did you mean grpo.steps?"
    assert refusal("traner.lr=1") == "unknown config key 'traner.lr'; did you mean trainer.lr?"
    assert "--list-keys" in refusal("nothing.like.this=1")


def test_misspelt_recipe_suggests_the_recipe(capsys) -> None:
    line = one_line_error(capsys, "run", "blackjak")
    assert "unknown target 'blackjak': did you mean the recipe blackjack?" in line


def test_setting_in_place_of_the_target(capsys) -> None:
    line = one_line_error(capsys, "run", "grpo.steps=3")
    assert (
        "missing TARGET: 'grpo.steps=3' is a setting" in line and "inflight run TARGET grpo.steps=3" in line
    )


# -- settings after options ------------------------------------------------------------------------------


def test_settings_may_follow_the_options(capsys, task: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    argv = ["run", str(task), "seed=3", "--run-dir", str(run_dir), "grpo.steps=5", "--list-keys", "seed=4"]
    assert main(argv) == 0
    values = dict(line.split("=", 1) for line in capsys.readouterr().out.splitlines())
    assert values["grpo.steps"] == "5" and values["seed"] == "4"  # in order: the last one wins
    assert values["run_dir"] == json.dumps(str(run_dir))


def test_unknown_option_is_still_argparses_error(capsys, task: Path) -> None:
    with pytest.raises(SystemExit) as info:
        main(["run", str(task), "--run-dir", "x", "--bogus", "grpo.steps=5"])
    assert info.value.code == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


# -- model paths: the real cause, a fix that makes sense, no minute of hub retries ----------------------


def test_relative_path_typo_beside_a_local_directory(
    capsys, task: Path, tiny_model_dir: Path, tmp_path: Path, monkeypatch, no_weights
) -> None:
    (tmp_path / "models").mkdir()
    shutil.copytree(tiny_model_dir, tmp_path / "models" / "tiny")
    monkeypatch.chdir(tmp_path)
    line = one_line_error(capsys, "run", str(task), "model.path=models/tinyy")
    assert "model directory 'models/tinyy' does not exist (did you mean 'models/tiny'?)" in line


def test_a_file_of_the_model_names_its_directory(
    capsys, task: Path, tiny_model_dir: Path, no_weights
) -> None:
    line = one_line_error(capsys, "run", str(task), f"model.path={tiny_model_dir / 'config.json'}")
    assert f"is a file, not a directory: name its directory, {tiny_model_dir}" in line
    assert "inflight model tiny" not in line


def test_hub_id_with_the_hub_unreachable_fails_at_once(capsys, task: Path, monkeypatch, no_weights) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:1")  # nothing listens: refused at once
    line = one_line_error(capsys, "run", str(task), "model.path=no-such-org/no-such-model")
    assert "'no-such-org/no-such-model' is not a local directory" in line
    assert "http://127.0.0.1:1 cannot be reached" in line


def test_hub_ids_stay_hub_ids() -> None:
    from inflight.models.paths import resolve

    assert resolve("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    assert resolve("gpt2") == "gpt2"
    with pytest.raises(UserError, match="does not exist"):
        resolve("not a/hub id")  # a space: only a path can be spelled so


def test_directory_without_tokenizer_files(
    capsys, task: Path, tiny_model_dir: Path, tmp_path: Path, no_weights
) -> None:
    bare = tmp_path / "notok"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_model_dir / name, bare / name)
    line = one_line_error(capsys, "run", str(task), f"model.path={bare}")
    assert f"model directory {str(bare)!r} has no tokenizer files" in line and "chat template" not in line


def test_bert_encoder_is_not_a_causal_lm(capsys, task: Path, tmp_path: Path, no_weights) -> None:
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert", "is_decoder": False}))
    line = one_line_error(capsys, "run", str(task), f"model.path={bert}")
    assert "holds a 'bert' model (an encoder" in line and "not a causal language model" in line


def test_sequence_length_error_names_the_users_keys(tiny_model_dir: Path) -> None:
    from inflight.inference import BuiltinEngine, BuiltinEngineConfig
    from inflight.models import load_model
    from inflight.types import SampleRequest

    engine = BuiltinEngine(load_model(tiny_model_dir), config=BuiltinEngineConfig(max_seq_len_tokens=8))
    with pytest.raises(ValueError) as info:
        engine.add_request(SampleRequest(list(range(8))))
    message = str(info.value)
    assert "engine.max_seq_len_tokens=N" in message and "--max-seq-len-tokens N" in message
    assert "BuiltinEngineConfig" not in message
