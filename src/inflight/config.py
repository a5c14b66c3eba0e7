"""RunConfig: one Config per component composed at the root, and `key=value` overrides from the CLI.

Presets are Python functions (a target's `preset()`, e.g. in `inflight.recipes`); every default is declared
once, in its component's Config. Unknown keys are errors that list the valid ones.
"""

from __future__ import annotations

import difflib
import json
from typing import Annotated, Any, Literal

import annotated_types
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo

from inflight.errors import UserError
from inflight.inference.config import BuiltinEngineConfig
from inflight.metrics.config import MetricsConfig
from inflight.trainer.config import TrainerConfig

# A seed is what torch's and Python's generators take: a non-negative integer below 2**63 (torch refuses
# one above 2**64 - 1, after the weights loaded; the headroom leaves room for the seeds derived from it).
Seed = Annotated[int, Field(ge=0, lt=2**63)]


class _Config(BaseModel):
    # allow_inf_nan=False: `key=NaN` / `key=Infinity` parse as floats (json.loads) and pass every `>=`
    # check unnoticed (NaN compares false); no knob here means anything by them.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class ModelConfig(_Config):
    """Where the policy comes from: a Hugging Face directory or hub id, or a locally built tiny model."""

    path: str | None = None  # None = build the `tiny_preset` model into the runs directory (cached)
    tiny_preset: Literal["tiny", "small"] = "tiny"
    tiny_seed: Seed = 0


class SamplingConfig(_Config):
    # The ranges SamplingParams (types.py) enforces on every request, checked here so that a bad value
    # fails when the command line is read, not in the first rollout after the weights loaded.
    temperature: float = Field(default=1.0, ge=0)  # 0 = greedy
    # < 1 truncates the behaviour distribution; the IS ratio then corrects for it
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)  # 0 = off
    max_tokens_per_turn: int = Field(default=16, ge=1)


class GRPOConfig(_Config):
    """The on-policy loop's shape: a step samples prompts_per_step groups of group_size rollouts."""

    steps: int = Field(default=200, ge=0)
    prompts_per_step: int = Field(default=16, ge=1)
    group_size: int = 8
    advantage: Literal["mean", "mean_std", "leave_one_out", "dr_grpo"] = "mean"
    # per episode; an episode cut here ends with finish_reason "length" (below 1 it played one turn anyway)
    max_turns: int = Field(default=8, ge=1)

    @model_validator(mode="after")
    def _check(self) -> GRPOConfig:
        if self.group_size < 2:
            raise ValueError("grpo.group_size must be >= 2: a group of one has no baseline to compare with")
        return self


class EnvConfig(_Config):
    """The environment of a task written as an Env (`orchestrator/task.py`)."""

    # None = the target's own Env; a registered name or `openenv:URL` plays that environment instead.
    name: str | None = None
    kwargs: dict[str, Any] = Field(default_factory=dict)  # the Env's constructor arguments


class WarmupConfig(_Config):
    """Optional supervised warm-up on transcripts of random legal play (never on the task's solution).

    `tokens=replies` trains only the replies (the answer format); `tokens=all` is next-token
    prediction over the whole transcript, environment text included, so a tiny model from scratch
    learns to read the observations the way a pretrained LLM already can.
    """

    sft_steps: int = Field(default=0, ge=0)  # 0 = no warm-up
    tokens: Literal["replies", "all"] = "replies"
    sft_batch_size: int = Field(default=64, ge=1)
    sft_lr: float = Field(default=1e-3, gt=0)
    # Transcripts per episode seed (environment start) in a batch: > 1 plays each start several times with
    # its own random replies, so they share their first turn and the trainer lays it out once
    # (trainer.share_prefixes); 1: every transcript its own start.
    sft_group_size: int = Field(default=1, ge=1)


class EvalConfig(_Config):
    """Evaluation on the task's "test" split: before training, every `every_steps` and at the end."""

    num_episodes: int = Field(default=10_000, ge=0)  # first test problems evaluated before/after; 0 = no eval
    every_steps: int = Field(default=0, ge=0)  # 0 = no evaluation during training
    num_episodes_during: int = Field(default=2_000, ge=0)  # a smaller set for the periodic evaluation
    # The sampled evaluation's share of those (the first N; None: all): the greedy one is the measure of
    # the policy and costs less per problem (identical requests are generated once).
    num_episodes_sampled: int | None = Field(default=None, ge=0)
    # The initial evaluation's share of the greedy episodes (the first N; None: num_episodes; 0: none). It
    # measures the policy before training for the report, not the policy trained, which an untrained
    # policy's long episodes can make the costliest evaluation of a run.
    num_episodes_initial: int | None = Field(default=None, ge=0)
    seed: Seed = 1_000_000  # seeds the sampled evaluation's turns (the same for every evaluation)
    # Episodes played at once; the rest wait their turn. None: as many as the engines decode together
    # (engine.max_batch_size per engine replica). More only queue in the engine, where a multi-turn episode's
    # next turn waits behind thousands of first turns and finds its K/V gone from the prefix cache.
    max_episodes_in_flight: int | None = Field(default=None, ge=1)


class RolloutConfig(_Config):
    """A task's `generate_rollout` at the fault-tolerance boundary (`orchestrator/guard.py`)."""

    # One rollout, all its turns; a rollout still running then is cancelled and counted as failed.
    timeout_s: float = Field(default=600.0, gt=0)
    # The run stops once more than this fraction of its rollouts failed (raised, returned something
    # other than a Rollout, or timed out), judged after a step's worth of rollouts.
    max_failed_frac: float = Field(default=0.5, ge=0, le=1)


class PipelineConfig(_Config):
    """The asynchronous pipeline (mode=async): how far generation may run ahead of training."""

    # A token generated by weights of version v is trained on at trainer version <= v + this bound;
    # prompts are admitted only while it can hold. 0 = on-policy (the sync loop's samples). None = unbounded.
    max_staleness_steps: int | None = Field(default=1, ge=0)
    max_groups_in_flight: int = Field(default=64, ge=1)  # prompts being rolled out at once (x group_size)
    active_sampling: bool = True  # drop all-equal-reward groups and keep drawing until a batch is full
    # ...but after this many batches' worth of groups were dropped for one batch, let uninformative groups
    # through (that step trains on fewer groups, or is skipped and counted, as in the sync loop); 0 = never.
    active_sampling_max_filtered_batches: int = Field(default=4, ge=0)
    # Where finished groups go before the trainer takes them: None = a file log in the run directory
    # (what a restart resumes from); "memory://name"; "redis://host:port/db?key=name".
    stream_url: str | None = None
    # Inference replicas (`inflight serve-engine` URLs); empty = an engine in this process. With replicas,
    # weights reach them through the filesystem transport (safetensors in RUN_DIR/weights, atomic rename).
    # On the command line a JSON list, `pipeline.engine_urls='["http://h:8000", "http://h:8001"]'`, or one
    # URL as is (`_one_url`).
    engine_urls: list[str] = Field(default_factory=list)
    # How new weights reach the replicas: "filesystem" (safetensors in RUN_DIR/weights, the replica told the
    # path: needs a filesystem both see), "http" (the bytes in the request body: any network), or "auto"
    # (filesystem when every replica is on this machine: loopback or one of its addresses; else http), or
    # "torch_dist" (full weights broadcast in bucketed flat buffers over a torch.distributed group of the
    # trainer and every replica, gloo; adapters go by http; on a failure, http from then on, counted).
    weight_transport: Literal["auto", "filesystem", "http", "torch_dist"] = "auto"
    batch_timeout_s: float = Field(default=600.0, gt=0)  # the trainer's wait for a full batch
    # per stage: the engine thread and the trainer (thread or process) each get a core
    torch_threads: int = Field(default=1, ge=1)
    # The trainer in a process of its own (trainer/process.py): its own GIL and core, the weights shared in
    # memory. "auto": on the CPU with at least 2 cores (engines here or elsewhere); false: a thread here.
    trainer_process: bool | Literal["auto"] = "auto"
    # With a trainer process, pin it to the last torch_threads CPUs this process may use and the engine's
    # side (its thread, the rollouts' event loop) to the others, so neither side's threads land on the
    # other's core. "auto": when the CPUs number exactly the two stages' threads (2 x torch_threads), the
    # case where the two would otherwise share them; true: whenever there are that many; false: never.
    pin_cpus: bool | Literal["auto"] = "auto"

    @field_validator("engine_urls", mode="before")
    @classmethod
    def _one_url(cls, value: Any) -> Any:
        """One URL as typed on the command line (`pipeline.engine_urls=http://host:8000`) is a list of one;
        "" is none. Several run together (a comma or a space between them) are refused, naming the list
        syntax with the shell's quotes: pydantic's own "Input should be a valid list" shows neither."""
        if not isinstance(value, str):
            return value
        if "," in value or any(char.isspace() for char in value.strip()):
            raise ValueError(
                f"{value!r:.80} is not one URL: give several as a JSON list, quoted for the shell: "
                """pipeline.engine_urls='["http://HOST:PORT", "http://HOST2:PORT"]'"""
            )
        return [value.strip()] if value.strip() else []


class RayConfig(_Config):
    """`launcher=ray` (`launch/ray/`): which cluster, and what its placement group reserves."""

    # None = start a private local Ray with this machine's CPUs for the run; "auto" = the cluster this machine
    # joined (`ray start`); "HOST:PORT" = a cluster's head (its GCS port, 6379 by default).
    address: str | None = None
    num_engine_replicas: int = Field(default=1, ge=1)  # engine actors, each serving HTTP; a GPU each on cuda
    engine_cpus: float = Field(default=1.0, gt=0)  # per replica's bundle
    trainer_cpus: float = Field(default=1.0, gt=0)  # the bundle of the trainer and the rollout loop
    # Data-parallel trainer ranks (trainer/distributed.py over gloo, or NCCL on GPUs): rank 0 is the run's
    # own actor, each other rank an actor on a bundle of its own (trainer_cpus, trainer_gpus).
    num_trainer_ranks: int = Field(default=1, ge=1)
    # replicated: each rank holds the whole model (trainer/distributed.py); fsdp: each holds 1/R of every
    # weight, gradient and AdamW moment (FSDP2, trainer/fsdp.py), for a model whose training state does not
    # fit one device. fsdp: full-parameter training, no KL penalty, ray.num_trainer_ranks >= 2.
    trainer_sharding: Literal["replicated", "fsdp"] = "replicated"
    # Verifier actors: each a sandbox pool (envs/sandbox/pool.py) on a CPU bundle of its own, running the
    # sandboxed code of the run's environments (code tests, tool calls) instead of the run's own actor;
    # each runs max(1, round(verifier_cpus)) sandboxes at once. 0: the sandboxes run in the run's actor.
    num_verifier_actors: int = Field(default=0, ge=0)
    verifier_cpus: float = Field(default=1.0, gt=0)
    # Rollout workers: actors on CPU bundles of their own that play the pipeline's groups (the task's
    # generate_rollout, its environments) against the replicas, instead of the run's own event loop; the
    # run's actor keeps admission, the buffer and the trainer. Results come back through Ray's object store,
    # or go straight to pipeline.stream_url when it is redis://. Ray restarts a worker that dies, and its
    # groups are played again. mode=async only. 0: the rollouts run in the run's actor.
    num_rollout_workers: int = Field(default=0, ge=0)
    rollout_worker_cpus: float = Field(default=1.0, gt=0)
    # GPUs per bundle where engine.device / trainer.device is cuda (or auto on a cluster with GPUs); a
    # fraction lets replicas or the trainer share one GPU.
    engine_gpus: float = Field(default=1.0, gt=0)
    trainer_gpus: float = Field(default=1.0, gt=0)
    # PACK: as few nodes as possible; SPREAD: across nodes; STRICT_*: must (Ray's placement strategies).
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    max_replica_restarts: int = Field(default=3, ge=-1)  # Ray restarts a replica that died; -1 = always
    connect_timeout_s: float = Field(default=30.0, gt=0)  # reaching ray.address
    # The placement group's bundles, then each replica's model load and first /health answer.
    placement_timeout_s: float = Field(default=120.0, gt=0)
    replica_start_timeout_s: float = Field(default=600.0, gt=0)
    # Data-parallel ranks: joining the group, and each collective (a rank waits at most this long for the
    # others in a step: a dead or hung rank fails the run instead of stalling it).
    trainer_collective_timeout_s: float = Field(default=600.0, gt=0)


class EngineConfig(BuiltinEngineConfig):
    """The run's inference engine: the built-in one (every field), or vLLM (`backend=vllm`): an `inflight
    serve-engine --backend vllm` process in the environment `launch/vllm_env.py` builds (vLLM's CPU build;
    on first use ~3.5 GB and minutes), started and stopped by the run (with launcher=ray, one in each
    engine replica's actor), which reaches it over HTTP like `pipeline.engine_urls`. With vLLM only
    max_batch_size, max_seq_len_tokens and max_restarts apply; the built-in engine still runs the
    evaluations before and after training."""

    backend: Literal["builtin", "vllm"] = "builtin"
    # vLLM: how often its process is started again on the same port when it dies (-1: always); the
    # pipeline's client routes around the outage and brings it up to date; counted as
    # engine_replica_restarts in the metrics.
    max_restarts: int = Field(default=3, ge=-1)


class RunConfig(_Config):
    recipe: str = "blackjack"  # the run's name: the TARGET's (a recipe name, a file's stem, a module's)
    # async: the pipeline (orchestrator/pipeline.py); sync: the on-policy reference loop (sync_loop.py).
    mode: Literal["sync", "async"] = "async"
    # local: this process (engine and trainer threads); ray: engine replicas and the trainer placed on a Ray
    # cluster by `launch/ray/`, configured by `ray.*` (needs `pip install 'inflight[ray]'`).
    launcher: Literal["local", "ray"] = "local"
    run_dir: str | None = None  # None = runs/<recipe>-<timestamp>
    seed: Seed = 0
    checkpoint_every_steps: int = Field(default=0, ge=0)  # 0 = only at the end
    progress: bool = True
    model: ModelConfig = Field(default_factory=ModelConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    warmup: WarmupConfig = Field(default_factory=WarmupConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)  # TensorBoard, W&B, samples, console
    ray: RayConfig = Field(default_factory=RayConfig)  # read only with launcher=ray

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        if self.sampling.temperature > 0 and abs(self.sampling.temperature - self.trainer.temperature) > 1e-9:
            raise ValueError(
                f"sampling.temperature={self.sampling.temperature} but trainer.temperature="
                f"{self.trainer.temperature}: set both to one value so trainer and sampler logprobs agree"
            )
        # Prompt and reply share the engine's sequence and a prompt has at least one token, so a reply limit
        # this high is never reached: a mistake, not a setting. Only that: a long prompt that leaves a reply
        # less room is the engine's to cut (finish "length").
        reply, sequence = self.sampling.max_tokens_per_turn, self.engine.max_seq_len_tokens
        if reply >= sequence:
            raise ValueError(
                f"sampling.max_tokens_per_turn={reply} leaves no room for a prompt in "
                f"engine.max_seq_len_tokens={sequence} (prompt and reply together): set "
                f"sampling.max_tokens_per_turn below {sequence}, or engine.max_seq_len_tokens above {reply}"
            )
        if self.engine.backend == "vllm" and self.mode != "async":
            raise ValueError(
                "engine.backend=vllm serves the asynchronous pipeline from vLLM processes this run starts: "
                "set mode=async"
            )
        if self.ray.num_rollout_workers and self.launcher == "ray" and self.mode != "async":
            raise ValueError(
                f"ray.num_rollout_workers={self.ray.num_rollout_workers}: rollout workers of their own play "
                "the pipeline's groups; the sync loop plays its own: set mode=async, or "
                "ray.num_rollout_workers=0"
            )
        sharded = self.ray.trainer_sharding == "fsdp" and self.launcher == "ray"
        unshardable = self.ray.num_trainer_ranks < 2 or self.trainer.lora_rank or self.trainer.loss.kl_coef
        if sharded and unshardable:
            raise ValueError(
                "ray.trainer_sharding=fsdp shards full-parameter training over ray.num_trainer_ranks >= 2 "
                "ranks, without a KL penalty: set num_trainer_ranks, trainer.lora_rank=0 and "
                "trainer.loss.kl_coef=0 (a LoRA adapter trains replicated: trainer_sharding=replicated)"
            )
        if self.launcher == "ray" and self.mode != "async":
            raise ValueError(
                "launcher=ray runs the asynchronous pipeline: set mode=async (or launcher=local)"
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


def _suggest(key: str) -> str:
    """The hint for an unknown key: keys with the same last part (`traner.lr` -> trainer.lr), else keys
    spelled closely (`grpo.step` -> grpo.steps), else where the list of keys is."""
    valid = _valid_keys(RunConfig)
    near = [k for k in valid if k.split(".")[-1] == key.split(".")[-1]]
    near = near or difflib.get_close_matches(key, valid, n=3, cutoff=0.8)
    return f"did you mean {', '.join(near)}?" if near else "run `inflight run --list-keys`"


# Pydantic's error types for a number outside a Field's bounds (or not finite): the message then states the
# field's whole valid range, which pydantic's own ("Input should be less than or equal to 1") half says.
_RANGE_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal", "finite_number"}
_BOUNDS = (
    (annotated_types.Gt, "gt", ">"),
    (annotated_types.Ge, "ge", ">="),
    (annotated_types.Lt, "lt", "<"),
    (annotated_types.Le, "le", "<="),
)


def _field_at(loc: tuple[int | str, ...]) -> FieldInfo | None:
    """The RunConfig field at an error's location (`("sampling", "top_p")`), if it is one."""
    model: Any = RunConfig
    field = None
    for part in loc:
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            return None
        field = model.model_fields[str(part)]
        model = field.annotation
    return field


def _bound(value: Any) -> str:
    # 2**63 reads better than 9223372036854775808.
    if isinstance(value, int) and value >= 2**32 and value & (value - 1) == 0:
        return f"2**{value.bit_length() - 1}"
    return str(value)


def _valid_range(field: FieldInfo) -> str:
    """`> 0 and <= 1`: the bounds a field declares (Field(gt=..., le=...)), in the CLI's notation."""
    return " and ".join(
        f"{sign} {_bound(getattr(m, attr))}"
        for m in field.metadata
        for kind, attr, sign in _BOUNDS
        if isinstance(m, kind)
    )


def _describe(err: Any) -> str:
    """One pydantic error as `at KEY: PROBLEM`, the problem naming the valid values."""
    loc = tuple(err["loc"])
    where = ".".join(str(p) for p in loc)
    at = f" at {where}" if where else ""
    if err["type"] in _RANGE_ERRORS:
        field = _field_at(loc)
        valid = _valid_range(field) if field is not None else ""
        finite = "a finite number" if err["type"] == "finite_number" else ""
        if valid or finite:
            must = " ".join(part for part in (finite, valid) if part)
            return f"{at}: must be {must}, got {json.dumps(err['input'])}"
    if err["type"] == "list_type":  # pydantic's "Input should be a valid list" shows no list
        example = f"""{where}='["..."]'""" if where else """'["..."]'"""
        return f"{at}: must be a JSON list, quoted for the shell: {example}; got {json.dumps(err['input'])}"
    # A model validator's ValueError names its keys itself; pydantic prefixes it with "Value error, ".
    return f"{at}: {str(err['msg']).removeprefix('Value error, ')}"


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
                    raise UserError(f"unknown config key {key!r}; {_suggest(key)}")
            if i < len(parts) - 1:
                node = node[part]
        node[parts[-1]] = _parse_value(raw)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise UserError(f"invalid config{_describe(e.errors()[0])}") from None


def list_keys() -> list[str]:
    return _valid_keys(RunConfig)


def check_overrides_apply(config: RunConfig, overrides: list[str], task: str, plays_env: bool) -> None:
    """Refuse an override that `config`'s run would ignore: pipeline.* under mode=sync, ray.* under
    launcher=local, env.kwargs for a task `task` written without an environment (`plays_env` False).

    Only the user's own `overrides` (applied to `config`): a preset may set keys for a mode or a launcher
    that a run of it does not use, as defaults for the runs that do."""
    for item in overrides:
        key = item.partition("=")[0]
        if config.mode == "sync" and _sets(key, "pipeline"):
            raise UserError(
                f"{item}: pipeline.* configures the asynchronous pipeline, and mode=sync runs the on-policy "
                "loop, which reads none of it: drop the setting, or set mode=async"
            )
        if config.launcher == "local" and _sets(key, "ray"):
            raise UserError(
                f"{item}: ray.* configures launcher=ray, and this run's launcher is local, which reads none "
                "of it: drop the setting, or set launcher=ray"
            )
        if not plays_env and config.env.kwargs and _sets(key, "env.kwargs"):
            raise UserError(
                f"{item}: {task} is written with generate_rollout and builds no environment, so nothing "
                "reads env.kwargs: drop the setting"
            )


def _sets(key: str, section: str) -> bool:
    """Whether an override of `key` sets (part of) `section`: `pipeline.x` and `pipeline` set pipeline;
    `env` sets env.kwargs too (a whole dict)."""
    return key == section or key.startswith(f"{section}.") or section.startswith(f"{key}.")
