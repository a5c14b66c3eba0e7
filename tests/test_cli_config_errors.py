"""`inflight run`'s settings and model path: a bad one is one line naming the key (or path) and the fix,
exit code 2, before any weight is read.

Reference: the pipeline QA pass's bad-input defects (values accepted until a rollout crashed, meaningless
values accepted silently, typos without a suggestion, causes misnamed, settings after options refused), and
the bring-your-own-task QA pass's settings ignored in silence (pipeline.* under mode=sync, ray.* under
launcher=local, env.kwargs for a rollout function, an env.kwargs.split the run overwrites, a sequence longer
than the model's context).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from pydantic import BaseModel

from conftest import one_line_error
from inflight.cli import main
from inflight.config import RunConfig, apply_overrides, check_overrides_apply
from inflight.errors import UserError
from inflight.preflight import check_context_length, context_tokens


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


def test_one_engine_url_as_typed_is_a_list_of_one_and_a_list_error_shows_the_syntax() -> None:
    """A QA pass: `pipeline.engine_urls=http://host:port` got pydantic's "Input should be a valid list", which
    shows no list. One URL is now a list of one; what cannot be one is refused naming the list syntax, the
    shell's quotes included."""
    one = apply_overrides(RunConfig(), ["pipeline.engine_urls=http://127.0.0.1:8000"])
    assert one.pipeline.engine_urls == ["http://127.0.0.1:8000"]
    listed = apply_overrides(RunConfig(), ['pipeline.engine_urls=["http://a:1", "http://b:2"]'])
    assert listed.pipeline.engine_urls == ["http://a:1", "http://b:2"]
    assert apply_overrides(RunConfig(), ["pipeline.engine_urls="]).pipeline.engine_urls == []

    syntax = """pipeline.engine_urls='["http://HOST:PORT", "http://HOST2:PORT"]'"""
    assert refusal("pipeline.engine_urls=http://a:1,http://b:2") == (
        "invalid config at pipeline.engine_urls: 'http://a:1,http://b:2' is not one URL: give several as a "
        f"JSON list, quoted for the shell: {syntax}"
    )
    assert refusal("pipeline.engine_urls=8000") == (
        """invalid config at pipeline.engine_urls: must be a JSON list, quoted for the shell: """
        """pipeline.engine_urls='["..."]'; got 8000"""
    )


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


# -- settings the run would ignore: refused when the user sets them, never when a preset does -----------

ENV_TASK = """
from typing import Any
from inflight.envs import Environment, State, TextAction, TextObservation

class Held(Environment[TextAction, TextObservation, State]):
    def __init__(self, split: str = "train") -> None:
        self.split = split

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kw: Any) -> TextObservation:
        return TextObservation(prompt="say something")

    def step(self, action: TextAction, timeout_s: float | None = None, **kw: Any) -> TextObservation:
        return TextObservation(prompt="", done=True, reward=1.0)

    @property
    def state(self) -> State:
        return State()
"""


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["env.kwargs.foo=1"],
            "env.kwargs.foo=1: single is written with generate_rollout and builds no environment, so nothing "
            "reads env.kwargs: drop the setting",
        ),
        (
            ["mode=sync", "pipeline.max_staleness_steps=3"],
            "pipeline.max_staleness_steps=3: pipeline.* configures the asynchronous pipeline, and mode=sync "
            "runs the on-policy loop, which reads none of it: drop the setting, or set mode=async",
        ),
        (
            ["ray.num_engine_replicas=2"],
            "ray.num_engine_replicas=2: ray.* configures launcher=ray, and this run's launcher is local, "
            "which reads none of it: drop the setting, or set launcher=ray",
        ),
    ],
)
def test_a_setting_the_run_would_ignore_is_refused(
    capsys, task: Path, tiny_model_dir: Path, tmp_path: Path, no_weights, overrides: list[str], expected: str
) -> None:
    line = one_line_error(
        capsys,
        "run",
        str(task),
        f"model.path={tiny_model_dir}",
        *overrides,
        "--run-dir",
        str(tmp_path / "run"),
    )
    assert line == f"inflight: error: {expected}"
    assert not (tmp_path / "run").exists()


def test_settings_a_preset_gives_for_another_mode_are_not_refused() -> None:
    preset = apply_overrides(
        RunConfig(),
        ["pipeline.max_staleness_steps=2", "ray.num_engine_replicas=2", "env.kwargs.level=1"],
    )
    cfg = apply_overrides(preset, ["mode=sync"])
    check_overrides_apply(cfg, ["mode=sync"], "single", plays_env=False)
    # Where they apply, the user's own are fine too; an empty env.kwargs sets nothing to ignore.
    check_overrides_apply(preset, ["pipeline.max_staleness_steps=3"], "single", plays_env=False)
    check_overrides_apply(preset, ["env.kwargs.level=2"], "arithmetic", plays_env=True)
    check_overrides_apply(RunConfig(), ["env.kwargs={}"], "single", plays_env=False)
    ray = apply_overrides(RunConfig(), ["launcher=ray", "ray.num_engine_replicas=2"])
    check_overrides_apply(ray, ["launcher=ray", "ray.num_engine_replicas=2"], "single", plays_env=False)
    with pytest.raises(UserError, match=r"^pipeline=\{\}: pipeline\.\* configures"):  # a whole section too
        check_overrides_apply(cfg, ["pipeline={}"], "single", plays_env=False)


def test_an_env_kwargs_split_is_refused_before_the_model_loads(
    capsys, tiny_model_dir: Path, tmp_path: Path, no_weights
) -> None:
    path = tmp_path / "held.py"
    path.write_text(ENV_TASK)
    line = one_line_error(
        capsys, "run", str(path), f"model.path={tiny_model_dir}", "env.kwargs.split=test",
        "--run-dir", str(tmp_path / "run"),
    )  # fmt: skip
    assert "env.kwargs.split='test': Held gets its split from the run" in line
    assert line.endswith("which would overwrite this one: drop env.kwargs.split")
    assert not (tmp_path / "run").exists()


# -- the engine's sequence against the model's context ---------------------------------------------------


def test_a_sequence_longer_than_the_models_context_is_refused_before_the_weights_load(
    capsys, task: Path, tiny_model_dir: Path, tmp_path: Path, no_weights
) -> None:
    """The tiny model addresses 2048 positions; 3010-token prompts trained with only transformers' warning."""
    line = one_line_error(
        capsys, "run", str(task), f"model.path={tiny_model_dir}", "engine.max_seq_len_tokens=8192",
        "--run-dir", str(tmp_path / "run"),
    )  # fmt: skip
    assert line == (
        "inflight: error: engine.max_seq_len_tokens=8192 is more than the 2048 positions "
        f"{str(tiny_model_dir)!r} addresses (max_position_embeddings=2048 in its config): set "
        "engine.max_seq_len_tokens=2048 or less"
    )
    assert not (tmp_path / "run").exists()
    # The tiny model built on first use (no model.path) is known before it is built.
    with pytest.raises(
        UserError, match=r"^engine.max_seq_len_tokens=4096 is more than the 2048 positions the tiny"
    ):
        check_context_length(apply_overrides(RunConfig(), ["engine.max_seq_len_tokens=4096"]))
    check_context_length(apply_overrides(RunConfig(), ["engine.max_seq_len_tokens=2048"]))


def test_a_rope_scaling_factor_extends_the_context() -> None:
    import transformers

    assert context_tokens(transformers.Qwen2Config(max_position_embeddings=4096)) == (
        4096,
        "max_position_embeddings=4096",
    )
    linear = transformers.LlamaConfig(rope_parameters={"rope_type": "linear", "factor": 2.0})
    assert context_tokens(linear) == (4096, "max_position_embeddings=2048, linear rope scaling x2 of 2048")
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert context_tokens(transformers.Qwen2Config(max_position_embeddings=32768, rope_parameters=yarn)) == (
        131072,
        "max_position_embeddings=32768, yarn rope scaling x4 of 32768",
    )
    # Llama 3.1's max_position_embeddings already counts its scaling (8 x 8192 is less).
    llama3 = {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }  # fmt: skip
    config = transformers.LlamaConfig(max_position_embeddings=131072, rope_parameters=llama3)
    assert context_tokens(config) == (131072, "max_position_embeddings=131072")
    gpt2 = transformers.GPT2Config(n_positions=256)  # named otherwise: transformers maps the name
    assert context_tokens(gpt2) == (256, "max_position_embeddings=256")
    # A scaling without one factor (longrope's lists) or a rope per layer type: not judged.
    longrope = {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [4.0]}
    assert context_tokens(SimpleNamespace(max_position_embeddings=4096, rope_parameters=longrope)) is None
    per_layer = {"full_attention": {"rope_type": "linear", "factor": 8.0}, "sliding_attention": {}}
    assert context_tokens(SimpleNamespace(max_position_embeddings=4096, rope_parameters=per_layer)) is None
