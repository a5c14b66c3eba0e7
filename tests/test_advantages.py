"""Group advantages and loss reductions, where GRPO variants differ, against hand-computed values.

References: GRPO (Shao et al. 2024, arXiv:2402.03300), RLOO (Ahmadian et al. 2024, arXiv:2402.14740),
Dr.GRPO (Liu et al. 2025, arXiv:2503.20783), the Tinker cookbook's mean-centred advantages and sums.
"""

import random

import pytest
import torch

from inflight.losses import ADVANTAGE_METHODS, batch_group_advantages, group_advantages, reduce_loss
from inflight.orchestrator.sync_loop import to_train_samples
from inflight.types import Rollout, RolloutGroup


def test_mean_centres_the_group() -> None:
    advantages_G = group_advantages(torch.tensor([1.0, 0.0, 0.0, 3.0]), "mean")
    torch.testing.assert_close(advantages_G, torch.tensor([0.0, -1.0, -1.0, 2.0]))


def test_mean_std_uses_the_sample_std() -> None:
    advantages_G = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), "mean_std")
    std = (4 * 0.25 / 3) ** 0.5  # Bessel-corrected
    torch.testing.assert_close(advantages_G, torch.tensor([0.5, -0.5, -0.5, 0.5]) / std)


@pytest.mark.parametrize("method", ADVANTAGE_METHODS)
def test_equal_rewards_give_zero_advantages_not_nan(method: str) -> None:
    rewards_N_G = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.3, 0.3 + 1e-9, 0.3]])
    advantages_N_G = batch_group_advantages(rewards_N_G, method)  # type: ignore[arg-type]
    assert torch.equal(advantages_N_G, torch.zeros(3, 3))


def test_mean_std_of_a_single_rollout_is_zero() -> None:
    assert torch.equal(group_advantages(torch.tensor([0.7]), "mean_std"), torch.zeros(1))


def test_leave_one_out_hand_computed() -> None:
    advantages_G = group_advantages(torch.tensor([1.0, 2.0, 3.0, 6.0]), "leave_one_out")
    # r_i - mean of the others: 1 - 11/3, 2 - 10/3, 3 - 9/3, 6 - 6/3
    torch.testing.assert_close(advantages_G, torch.tensor([-8 / 3, -4 / 3, 0.0, 4.0]))


def test_leave_one_out_needs_two_rollouts() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        group_advantages(torch.tensor([1.0]), "leave_one_out")


def test_dr_grpo_is_mean_centering_without_std() -> None:
    rewards_G = torch.tensor([0.0, 1.0, 1.0, 1.0, 5.0])
    torch.testing.assert_close(group_advantages(rewards_G, "dr_grpo"), rewards_G - rewards_G.mean())


@pytest.mark.parametrize("method", ADVANTAGE_METHODS)
def test_batch_matches_group_by_group(method: str) -> None:
    rewards_N_G = torch.randn(5, 6, generator=torch.Generator().manual_seed(0))
    rewards_N_G[2] = 1.0  # one uninformative group
    batched_N_G = batch_group_advantages(rewards_N_G, method)  # type: ignore[arg-type]
    for rewards_G, advantages_G in zip(rewards_N_G, batched_N_G, strict=True):
        torch.testing.assert_close(advantages_G, group_advantages(rewards_G, method))  # type: ignore[arg-type]
    assert not batched_N_G.isnan().any()


def test_integer_rewards_give_float_advantages() -> None:
    assert group_advantages(torch.tensor([0, 1]), "mean").dtype == torch.float32


def test_bad_shapes_and_methods_raise() -> None:
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="2-D"):
        batch_group_advantages(torch.zeros(3))
    with pytest.raises(ValueError, match="unknown advantage method"):
        group_advantages(torch.zeros(3), "median")  # type: ignore[arg-type]


def test_reductions_hand_computed() -> None:
    per_token = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert reduce_loss(per_token, mask, "token_sum").item() == 6.0
    assert reduce_loss(per_token, mask, "token_mean").item() == 2.0
    assert reduce_loss(per_token, mask, "token_mean", num_tokens=12).item() == 0.5
    assert reduce_loss(per_token, mask, "seq_mean").item() == (1.5 + 3.0) / 2  # empty 3rd sequence left out
    assert reduce_loss(per_token, mask, "seq_mean", num_sequences=3).item() == 1.5
    assert reduce_loss(per_token, mask, "constant", constant_normalizer=4.0).item() == 1.5
    empty = torch.zeros(2, 3)
    for how in ("token_mean", "seq_mean"):
        assert reduce_loss(empty, empty, how).item() == 0.0  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="constant_normalizer"):
        reduce_loss(per_token, mask, "constant")
    with pytest.raises(ValueError, match="unknown reduction"):
        reduce_loss(per_token, mask, "median")  # type: ignore[arg-type]


@pytest.mark.parametrize("method", ["mean", "mean_std", "leave_one_out", "dr_grpo"])
def test_train_samples_of_groups_of_several_sizes_get_each_groups_own_advantages(method: str) -> None:
    rng = random.Random(0)

    def rollout(reward: float) -> Rollout:
        return Rollout([1, 2, 3], [False, True, True], [0.0, -0.5, -0.7], [-1, 0, 0], reward)

    # Groups of several sizes (failed rollouts are left out of a group), interleaved, and an all-equal one.
    sizes = [8, 3, 8, 2]
    groups = [
        RolloutGroup(str(k), [rollout(rng.choice([0.0, 0.5, 1.0])) for _ in range(n)])
        for k, n in enumerate(sizes)
    ]
    groups.append(RolloutGroup("equal", [rollout(1.0) for _ in range(4)]))
    samples = to_train_samples(groups, method)
    assert len(samples) == sum(len(g.rollouts) for g in groups)
    expected = [float(a) for g in groups for a in group_advantages(torch.tensor(g.rewards), method)]
    got = [s.advantages[1] for s in samples]  # every generated token carries its rollout's advantage
    assert got == pytest.approx(expected, rel=1e-6, abs=1e-7)
    assert all(s.advantages[0] == 0.0 for s in samples)  # the prompt token is not trained
