"""Pure loss math for RL on LLMs: logits -> log-probs, rewards -> advantages, per-token policy losses under
Tinker's names, the off-policy corrections (truncated/masked IS, IcePop, geometric masking), KL estimators
and reductions. Imports nothing from the project.
"""

from inflight.losses.advantages import (
    ADVANTAGE_METHODS,
    AdvantageMethod,
    batch_group_advantages,
    group_advantages,
)
from inflight.losses.importance import off_policy_stats, step_gap_stats
from inflight.losses.kl import KL_ESTIMATORS, KLEstimator, kl_k1, kl_k2, kl_k3, kl_ref_to_policy_exact
from inflight.losses.logprobs import entropy_from_logits, token_logprobs, top_k_entropy_from_logits
from inflight.losses.offpolicy import (
    OFFPOLICY_CONTROLS,
    OFFPOLICY_DEFAULTS,
    OFFPOLICY_KINDS,
    Correction,
    OffPolicyKind,
    offpolicy_thresholds,
)
from inflight.losses.policy import (
    CLIP_DEFAULTS,
    DRO_DEFAULT_BETA,
    LOSSES,
    STABLE_REINFORCE_DEFAULT_KL_COEFF,
    LossFn,
    LossInputs,
    LossOutputs,
    LossParams,
    cispo,
    cross_entropy,
    dro,
    importance_sampling,
    ppo,
    stable_reinforce,
)
from inflight.losses.reductions import REDUCTIONS, Reduction, reduce_loss

__all__ = [
    "ADVANTAGE_METHODS",
    "CLIP_DEFAULTS",
    "DRO_DEFAULT_BETA",
    "KL_ESTIMATORS",
    "LOSSES",
    "OFFPOLICY_CONTROLS",
    "OFFPOLICY_DEFAULTS",
    "OFFPOLICY_KINDS",
    "REDUCTIONS",
    "STABLE_REINFORCE_DEFAULT_KL_COEFF",
    "AdvantageMethod",
    "Correction",
    "KLEstimator",
    "LossFn",
    "LossInputs",
    "LossOutputs",
    "LossParams",
    "OffPolicyKind",
    "Reduction",
    "batch_group_advantages",
    "cispo",
    "cross_entropy",
    "dro",
    "entropy_from_logits",
    "group_advantages",
    "importance_sampling",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_ref_to_policy_exact",
    "off_policy_stats",
    "offpolicy_thresholds",
    "ppo",
    "reduce_loss",
    "stable_reinforce",
    "step_gap_stats",
    "token_logprobs",
    "top_k_entropy_from_logits",
]
