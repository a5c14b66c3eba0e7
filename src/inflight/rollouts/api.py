"""The rollout API for users' own tasks, in PipelineRL's shape.

A task is a module (or object) with two functions:

    def load_problems(split: str) -> list[dict]: ...
    async def generate_rollout(ctx: RolloutContext, problem: dict) -> Rollout: ...

The pipeline calls `generate_rollout` group_size times per problem, concurrently with every other
rollout in flight. `ctx` gives the policy at two levels:

- token level: `await ctx.generate(token_ids, params)` -> Completion (exact ids, logprobs, versions);
- chat level:  `chat = ctx.chat()`; `chat.user(text)`; `reply = await chat.assistant()`; ...;
  `chat.to_rollout(reward)`: the conversation stays one token stream (token-in/token-out), the
  policy's tokens are trained on and everything else is masked out.

Sampling seeds are derived from (ctx.sampling_seed, ctx.problem_index, ctx.sample_index, turn), so a
rollout's tokens depend only on the weights, not on what else the engine batches with it. A rollout takes
at most `ctx.max_turns` (grpo.max_turns) policy turns: asking for one more fails it (`TurnLimitError`).
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from inflight.rollouts.chat import ChatFormat
from inflight.types import Completion, FinishReason, Rollout, SampleRequest, SamplingParams

GenerateFn = Callable[[SampleRequest], Awaitable[Completion]]


class TurnLimitError(RuntimeError):
    """A rollout asked the policy for a turn past grpo.max_turns: that rollout fails (the guard counts it)."""


class RolloutTask(Protocol):
    """What `inflight run` needs from a task written with this API."""

    def load_problems(self, split: str) -> list[dict[str, Any]]: ...

    async def generate_rollout(self, ctx: RolloutContext, problem: dict[str, Any]) -> Rollout: ...


@dataclass
class RolloutContext:
    generate_fn: GenerateFn  # the policy: an engine loop, an HTTP client, or a scripted policy
    chat_format: ChatFormat
    params: SamplingParams  # one policy turn, as configured for the run
    group_id: str = ""
    problem_index: int = 0
    sample_index: int = 0
    sampling_seed: int | None = None  # None: the engine's own randomness
    config: Any = None  # the RunConfig, for tasks that read their own settings
    # When rollout.timeout_s ends this rollout, on time.monotonic()'s clock (set by the guard that bounds it;
    # None: no bound): a task may bound its own waits by it, as an Env's step gets the seconds left.
    deadline: float | None = None
    _turn: int = field(default=0, repr=False)

    @property
    def tokenizer(self) -> Any:
        return self.chat_format.tokenizer

    @property
    def max_turns(self) -> int | None:
        """`grpo.max_turns`: the most policy turns (`generate` calls, `assistant` replies) this rollout may
        take, so that a task can end its loop in time; None without a config (a context built by hand)."""
        return None if self.config is None else int(self.config.grpo.max_turns)

    def turn_params(self, params: SamplingParams | None = None) -> SamplingParams:
        """`params` (default: the run's) with this turn's seed; advances the turn counter."""
        params = params or self.params
        turn, self._turn = self._turn, self._turn + 1
        if self.sampling_seed is None:
            return params
        seed = (
            self.sampling_seed * 1_000_003
            + self.problem_index * 101
            + turn
            + self.sample_index * 1_000_000_007
        ) % (1 << 63)
        return dataclasses.replace(params, seed=seed)

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams | None = None) -> Completion:
        """Token-level policy call (seeded like every other turn of this rollout)."""
        # An Env episode past grpo.max_turns ends with the reward of its last observation; a rollout function
        # cannot be ended from outside, so the turn it asks for beyond the bound fails it, naming the key.
        limit = self.max_turns
        if limit is not None and self._turn >= limit:
            raise TurnLimitError(
                f"the rollout asked for assistant turn {self._turn + 1}; grpo.max_turns={limit}: end the "
                "rollout's loop after ctx.max_turns turns, or raise grpo.max_turns"
            )
        return await self.generate_fn(SampleRequest(list(prompt_token_ids), self.turn_params(params)))

    def chat(self, system_prompt: str | None = None) -> ChatSession:
        return ChatSession(self, system_prompt)


class ChatSession:
    """A multi-turn conversation kept as one token stream; only the policy's tokens are trained on."""

    def __init__(self, ctx: RolloutContext, system_prompt: str | None = None) -> None:
        self.ctx = ctx
        self.format = ctx.chat_format.with_system_prompt(system_prompt or ctx.chat_format.system_prompt)
        self.token_ids: list[int] = []
        self.loss_mask: list[bool] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.turns = 0
        self.finish_reason: FinishReason = "stop"
        self._awaiting_reply = False

    def user(self, text: str) -> None:
        """Append a user (environment) message and the assistant's generation prompt (masked out)."""
        if self._awaiting_reply:
            raise RuntimeError("ChatSession.user() called twice in a row: await assistant() in between")
        ids = self.format.next_turn(text) if self.token_ids else self.format.first_turn(text)
        self._extend(ids, [False] * len(ids), [0.0] * len(ids), [-1] * len(ids))
        self._awaiting_reply = True

    async def assistant(self, params: SamplingParams | None = None) -> str:
        """Sample the assistant's reply; its exact tokens join the stream. Returns the reply's text."""
        if not self._awaiting_reply:
            raise RuntimeError("ChatSession.assistant() needs a user() message first")
        params = params or self.ctx.params
        end = self.format.end_of_turn_id
        stops = tuple(dict.fromkeys((*params.stop_token_ids, *self.format.stop_token_ids)))
        if stops != params.stop_token_ids:
            params = dataclasses.replace(params, stop_token_ids=stops)
        c = await self.ctx.generate(self.token_ids, params)
        self._extend(c.token_ids, [True] * len(c.token_ids), list(c.logprobs), list(c.versions))
        if c.finish_reason == "length" and c.token_ids[-1:] != [end]:
            self.finish_reason = "length"
            # Close the turn (masked out) so that a following user() message keeps the ChatML layout.
            self._extend([end], [False], [0.0], [-1])
        self.turns += 1
        self._awaiting_reply = False
        return self.format.reply_text(c.token_ids)

    def to_rollout(self, reward: float, metrics: dict[str, float] | None = None) -> Rollout:
        return Rollout(
            token_ids=list(self.token_ids),
            loss_mask=list(self.loss_mask),
            logprobs=list(self.logprobs),
            versions=list(self.versions),
            reward=_plain_number(reward),
            group_id=self.ctx.group_id,
            finish_reason=self.finish_reason,
            metrics={"turns": float(self.turns), **(metrics or {})},
        )

    def _extend(self, ids: list[int], mask: list[bool], logprobs: list[float], versions: list[int]) -> None:
        self.token_ids += ids
        self.loss_mask += mask
        self.logprobs += logprobs
        self.versions += versions


def _plain_number(value: Any) -> Any:
    """A 0-dim tensor or array (a torch or numpy scalar) as its Python number; anything else as it is. The
    guard (`orchestrator/guard.py`) takes numbers and fails a rollout whose reward is not one (a str, None)
    with a message naming its type; a float() here would read "1.0" as a reward and turn None into an
    unclear TypeError."""
    if isinstance(value, numbers.Real):
        return value
    item = getattr(value, "item", None)
    return item() if callable(item) and getattr(value, "ndim", None) == 0 else value


def scripted_policy(chat_format: ChatFormat, reply: Callable[[str], str]) -> GenerateFn:
    """A policy whose replies come from Python (`reply(prompt_text)`): warm-up data for tasks.

    Its tokens carry logprob 0 and version -1 (never mistaken for the model's).
    """

    async def generate(request: SampleRequest) -> Completion:
        prompt_text = str(chat_format.tokenizer.decode(request.prompt_token_ids, skip_special_tokens=False))
        ids = chat_format.assistant_reply(reply(prompt_text))
        return Completion(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=ids,
            logprobs=[0.0] * len(ids),
            versions=[-1] * len(ids),
            finish_reason="stop",
        )

    return generate
