"""What several recipes share: the loss that keeps a tiny model from scratch exploring, and summary keys
for an evaluated rate. Knows nothing of any one task."""

from __future__ import annotations

from inflight.trainer import LossConfig


def tiny_model_loss(entropy_coef: float) -> LossConfig:
    """PPO (token mean) with the two terms that let a tiny model from scratch keep exploring under RL.

    A bonus on the entropy of the choice among the 3 likeliest tokens keeps several answers alive
    without pushing mass into tokens that break the answer format, and an exact KL(ref || pi) to the
    warmed-up model puts a floor under every answer the reference finds plausible (it restores an
    answer even after it stops being sampled). Without them BlackJack collapsed to always-stand and
    arithmetic to one answer per question (docs/benchmarks.md).
    """
    return LossConfig(
        name="ppo",
        reduction="token_mean",
        entropy_coef=entropy_coef,
        entropy_top_k=3,
        kl_coef=0.1,
        kl_estimator="exact_ref",
    )


def rate_summary(initial: dict[str, float], final: dict[str, float], key: str, name: str) -> dict[str, float]:
    """Summary entries for the evaluated rate of rollout metric `key` (e.g. `correct`) under `name` (e.g.
    `accuracy`): greedy before/after RL, then sampled before/after."""
    return {
        f"{name}_initial": round(initial.get(f"{key}_greedy", 0.0), 4),
        f"{name}_final": round(final.get(f"{key}_greedy", 0.0), 4),
        f"{name}_initial_sampled": round(initial.get(key, 0.0), 4),
        f"{name}_final_sampled": round(final.get(key, 0.0), 4),
    }
