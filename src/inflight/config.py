"""RunConfig: one Config per component composed at the root, and `key=value` overrides from the CLI.

Presets are Python functions in `inflight.recipes`; every default is declared once, in its component's
Config. Unknown keys are errors that list the valid ones.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from inflight.errors import UserError
from inflight.inference.builtin import BuiltinEngineConfig
from inflight.trainer.config import TrainerConfig


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Config):
    """Where the policy comes from: a Hugging Face directory or hub id, or a locally built tiny model."""

    path: str | None = None  # None = build the `tiny_preset` model into the runs directory (cached)
    tiny_preset: Literal["tiny", "small"] = "tiny"
    tiny_seed: int = 0


class SamplingConfig(_Config):
    temperature: float = 1.0
    top_p: float = 1.0  # < 1 truncates the behaviour distribution; the IS ratio then corrects for it
    top_k: int = 0
    max_tokens_per_turn: int = 16


class GRPOConfig(_Config):
    """The on-policy loop's shape: a step samples prompts_per_step groups of group_size rollouts."""

    steps: int = 200
    prompts_per_step: int = 16
    group_size: int = 8
    advantage: Literal["mean", "mean_std", "leave_one_out", "dr_grpo"] = "mean"
    max_turns: int = 8  # per episode; an episode cut here ends with finish_reason "length"

    @model_validator(mode="after")
    def _check(self) -> GRPOConfig:
        if self.group_size < 2:
            raise ValueError("grpo.group_size must be >= 2: a group of one has no baseline to compare with")
        if self.steps < 0 or self.prompts_per_step < 1:
            raise ValueError("grpo.steps must be >= 0 and grpo.prompts_per_step >= 1")
        return self


class EnvConfig(_Config):
    name: str = "blackjack"
    kwargs: dict[str, Any] = Field(default_factory=dict)


class WarmupConfig(_Config):
    """Optional supervised warm-up on transcripts of random legal play (never on the task's solution).

    `tokens=replies` trains only the replies (the answer format); `tokens=all` is next-token
    prediction over the whole transcript, environment text included, so a tiny model from scratch
    learns to read the observations the way a pretrained LLM already can.
    """

    sft_steps: int = 0
    tokens: Literal["replies", "all"] = "replies"
    sft_batch_size: int = 64
    sft_lr: float = 1e-3


class EvalConfig(_Config):
    num_episodes: int = 10_000  # the final (and initial) evaluation
    every_steps: int = 0  # 0 = no evaluation during training
    num_episodes_during: int = 2_000  # a smaller set for the periodic evaluation
    seed: int = 1_000_000  # evaluation hands/problems are disjoint from training seeds


class RunConfig(_Config):
    recipe: str = "blackjack"
    mode: Literal["sync"] = "sync"
    run_dir: str | None = None  # None = runs/<recipe>-<timestamp>
    seed: int = 0
    checkpoint_every_steps: int = 0  # 0 = only at the end
    progress: bool = True
    model: ModelConfig = Field(default_factory=ModelConfig)
    engine: BuiltinEngineConfig = Field(default_factory=BuiltinEngineConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    warmup: WarmupConfig = Field(default_factory=WarmupConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        if self.sampling.temperature > 0 and abs(self.sampling.temperature - self.trainer.temperature) > 1e-9:
            raise ValueError(
                f"sampling.temperature={self.sampling.temperature} but trainer.temperature="
                f"{self.trainer.temperature}: set both to one value so trainer and sampler logprobs agree"
            )
        return self


def _parse_value(text: str) -> Any:
    """`3` -> int, `1e-4` -> float, `true` -> bool, `null` -> None, JSON lists/dicts, else the string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _valid_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys += _valid_keys(ann, f"{prefix}{name}.")
        else:
            keys.append(prefix + name)
    return keys


def apply_overrides(config: RunConfig, overrides: list[str]) -> RunConfig:
    """Return a new RunConfig with `a.b=value` overrides applied and everything re-validated."""
    data = config.model_dump()
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise UserError(f"override {item!r} is not of the form key=value (e.g. trainer.lr=3e-4)")
        node: Any = data
        parts = key.split(".")
        for i, part in enumerate(parts):
            if not isinstance(node, dict) or part not in node:
                # env.kwargs is free-form: its keys belong to the environment.
                if isinstance(node, dict) and parts[:i] == ["env", "kwargs"]:
                    node[part] = {} if i < len(parts) - 1 else None
                else:
                    near = [k for k in _valid_keys(RunConfig) if k.split(".")[-1] == parts[-1]]
                    hint = f"did you mean {', '.join(near)}?" if near else "run `inflight run --list-keys`"
                    raise UserError(f"unknown config key {key!r}; {hint}")
            if i < len(parts) - 1:
                node = node[part]
        node[parts[-1]] = _parse_value(raw)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise UserError(f"invalid config{' at ' + where if where else ''}: {err['msg']}") from None


def list_keys() -> list[str]:
    return _valid_keys(RunConfig)
