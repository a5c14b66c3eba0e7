"""Pure loss math for RL on LLMs: logits -> log-probs, rewards -> advantages, per-token policy losses under
Tinker's names, the off-policy corrections (truncated/masked IS, IcePop, geometric masking), KL estimators
and reductions. Imports nothing from the project.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from inflight.lazy import lazy_exports

if TYPE_CHECKING:
    from inflight.losses.advantages import (
        ADVANTAGE_METHODS,
        AdvantageMethod,
        batch_group_advantages,
        group_advantages,
    )
    from inflight.losses.clip_settings import CLIP_DEFAULTS
    from inflight.losses.importance import off_policy_stats, step_gap_stats
    from inflight.losses.kl import KL_ESTIMATORS, KLEstimator, kl_k1, kl_k2, kl_k3, kl_ref_to_policy_exact
    from inflight.losses.logprobs import entropy_from_logits, token_logprobs, top_k_entropy_from_logits
    from inflight.losses.offpolicy import OFFPOLICY_CONTROLS, Correction
    from inflight.losses.offpolicy_settings import (
        OFFPOLICY_DEFAULTS,
        OFFPOLICY_KINDS,
        OffPolicyKind,
        offpolicy_thresholds,
    )
    from inflight.losses.policy import (
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

# Loaded on first use (lazy.py): `inflight.config` imports light modules of this package.
__getattr__ = lazy_exports(
    __name__,
    {
        "ADVANTAGE_METHODS": ".advantages",
        "AdvantageMethod": ".advantages",
        "batch_group_advantages": ".advantages",
        "group_advantages": ".advantages",
        "off_policy_stats": ".importance",
        "step_gap_stats": ".importance",
        "KL_ESTIMATORS": ".kl",
        "KLEstimator": ".kl",
        "kl_k1": ".kl",
        "kl_k2": ".kl",
        "kl_k3": ".kl",
        "kl_ref_to_policy_exact": ".kl",
        "entropy_from_logits": ".logprobs",
        "token_logprobs": ".logprobs",
        "top_k_entropy_from_logits": ".logprobs",
        "OFFPOLICY_CONTROLS": ".offpolicy",
        "OFFPOLICY_DEFAULTS": ".offpolicy_settings",
        "OFFPOLICY_KINDS": ".offpolicy_settings",
        "Correction": ".offpolicy",
        "OffPolicyKind": ".offpolicy_settings",
        "offpolicy_thresholds": ".offpolicy_settings",
        "CLIP_DEFAULTS": ".clip_settings",
        "DRO_DEFAULT_BETA": ".policy",
        "LOSSES": ".policy",
        "STABLE_REINFORCE_DEFAULT_KL_COEFF": ".policy",
        "LossFn": ".policy",
        "LossInputs": ".policy",
        "LossOutputs": ".policy",
        "LossParams": ".policy",
        "cispo": ".policy",
        "cross_entropy": ".policy",
        "dro": ".policy",
        "importance_sampling": ".policy",
        "ppo": ".policy",
        "stable_reinforce": ".policy",
        "REDUCTIONS": ".reductions",
        "Reduction": ".reductions",
        "reduce_loss": ".reductions",
    },
)

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
