"""An Env-based task (BlackJack, arithmetic, ...) seen through the rollout API.

Problem k is the k-th training prompt of the sync loop (step k // prompts_per_step), and each rollout
plays one episode with the same per-turn seeds as `run_episodes`: at equal weights the pipeline and
the sync loop produce the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from inflight.envs.base import Environment
from inflight.rollouts.api import RolloutContext
from inflight.rollouts.episodes import play_episode
from inflight.types import Rollout


class EnvTask:
    def __init__(
        self,
        make_env: Callable[[], Environment],
        prompts_per_step: int,
        prompt_seeds: Callable[[int], list[int]],
        max_turns: int,
    ) -> None:
        self.make_env = make_env
        self.prompts_per_step = prompts_per_step
        self.prompt_seeds = prompt_seeds  # step -> that step's episode seeds
        self.max_turns = max_turns

    def problem(self, k: int) -> dict[str, Any]:
        step, i = divmod(k, self.prompts_per_step)
        seed = self.prompt_seeds(step)[i]
        return {"seed": seed, "group_id": f"{step}-{seed}"}

    async def generate_rollout(self, ctx: RolloutContext, problem: dict[str, Any]) -> Rollout:
        return await play_episode(
            ctx.generate_fn,
            self.make_env(),
            int(problem["seed"]),
            ctx.group_id,
            ctx.chat_format,
            ctx.params,
            self.max_turns,
            sampling_seed=ctx.sampling_seed,
            sample_index=ctx.sample_index,
        )
