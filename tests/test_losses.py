"""Value and gradient tests of the pure loss math against naive per-token references.

References: Tinker loss docs (reference/tinker-api.md §7.3: cross_entropy, importance_sampling, ppo,
cispo; Tinker's DRO page: -(lp*A - beta/2 (lp - q)^2), default beta 0.01), this server's reading of
stable_reinforce (its objective is unpublished; `losses/policy.py`): -A*lp + kl_coeff*(r - 1 - log r),
default kl_coeff 0.01,
Schulman "Approximating KL divergence" (2020) for k1/k2/k3, Yao et al. 2025 for truncated IS.
Advantages and reductions: tests/test_advantages.py; the other off-policy controls: tests/test_offpolicy.py.
"""

import itertools
import math
from dataclasses import replace

import pytest
import torch

from inflight.losses import (
    KL_ESTIMATORS,
    LOSSES,
    LossInputs,
    LossParams,
    entropy_from_logits,
    kl_k1,
    kl_k3,
    token_logprobs,
)
from inflight.losses import logprobs as logprobs_module
from inflight.losses.offpolicy import tis_token


def random_inputs(seed: int = 0, shape: tuple[int, int] = (4, 7)) -> LossInputs:
    gen = torch.Generator().manual_seed(seed)
    logprobs = (-3 * torch.rand(shape, generator=gen, dtype=torch.float64)).requires_grad_()
    behaviour = logprobs.detach() + 0.4 * torch.randn(shape, generator=gen, dtype=torch.float64)
    mask = torch.rand(shape, generator=gen, dtype=torch.float64) * (torch.rand(shape, generator=gen) > 0.25)
    advantages = torch.randn(shape, generator=gen, dtype=torch.float64)
    return LossInputs(logprobs, mask, behaviour, advantages)


def naive_per_token(name: str, inputs: LossInputs) -> torch.Tensor:
    """Tinker §7.3 one token at a time, in python floats, at the default clip thresholds."""
    assert inputs.behaviour_logprobs is not None and inputs.advantages is not None
    out = torch.zeros(inputs.logprobs.shape, dtype=torch.float64)
    for b, t in itertools.product(*map(range, out.shape)):
        lp, q = inputs.logprobs[b, t].item(), inputs.behaviour_logprobs[b, t].item()
        a, w, r = inputs.advantages[b, t].item(), inputs.mask[b, t].item(), math.exp(lp - q)
        out[b, t] = {
            "cross_entropy": -w * lp,
            "importance_sampling": -r * a * w,
            "ppo": -min(r * a, min(max(r, 0.8), 1.2) * a) * w,
            "cispo": -min(max(r, 0.0), 4.0) * lp * a * w,
            "dro": -(lp * a - 0.5 * 0.01 * (lp - q) ** 2) * w,
            "stable_reinforce": (-a * lp + 0.01 * (r - 1 - (lp - q))) * w,
        }[name]
    return out


def naive_grad(name: str, inputs: LossInputs) -> torch.Tensor:
    """Analytic d(sum per_token)/d lp."""
    assert inputs.behaviour_logprobs is not None and inputs.advantages is not None
    lp, w, a = inputs.logprobs.detach(), inputs.mask, inputs.advantages
    r = torch.exp(lp - inputs.behaviour_logprobs)
    if name == "cross_entropy":
        return -w
    if name == "importance_sampling":
        return -r * a * w
    if name == "cispo":
        return -r.clamp(0.0, 4.0) * a * w
    if name == "dro":
        return (-a + 0.01 * (lp - inputs.behaviour_logprobs)) * w
    if name == "stable_reinforce":
        return (-a + 0.01 * (r - 1)) * w
    clipped = ((a > 0) & (r > 1.2)) | ((a < 0) & (r < 0.8))  # ppo: the min picks the flat branch
    return torch.where(clipped, 0.0, -r * a * w)


def grad_of(name: str, inputs: LossInputs, params: LossParams | None = None) -> torch.Tensor:
    loss = LOSSES[name](inputs, params or LossParams()).per_token.sum()
    return torch.autograd.grad(loss, inputs.logprobs)[0]


@pytest.mark.parametrize("name", list(LOSSES))
@pytest.mark.parametrize("seed", [0, 1])
def test_value_and_gradient_match_the_naive_reference(name: str, seed: int) -> None:
    inputs = random_inputs(seed)
    per_token = LOSSES[name](inputs, LossParams()).per_token
    torch.testing.assert_close(per_token, naive_per_token(name, inputs))
    torch.testing.assert_close(grad_of(name, inputs), naive_grad(name, inputs))


# cispo is left out on purpose: its stop-gradient makes the gradient differ from the value's derivative.
@pytest.mark.parametrize("name", ["cross_entropy", "importance_sampling", "ppo", "dro", "stable_reinforce"])
def test_gradcheck_float64(name: str) -> None:
    inputs = random_inputs(2, shape=(2, 3))

    def loss(logprobs: torch.Tensor) -> torch.Tensor:
        replaced = LossInputs(logprobs, inputs.mask, inputs.behaviour_logprobs, inputs.advantages)
        return LOSSES[name](replaced, LossParams()).per_token

    assert torch.autograd.gradcheck(loss, (inputs.logprobs,))


@pytest.mark.parametrize("name", list(LOSSES))
@pytest.mark.parametrize(
    "params", [LossParams(), LossParams(offpolicy="tis_token", offpolicy_ratio_high=2.0)]
)
def test_masked_tokens_contribute_nothing_even_when_garbage(name: str, params: LossParams) -> None:
    clean = random_inputs(3)
    assert clean.behaviour_logprobs is not None and clean.advantages is not None
    masked = clean.mask == 0
    assert masked.any()
    behaviour = clean.behaviour_logprobs.masked_fill(masked, -math.inf)  # ratio exp(+inf)
    garbage = replace(
        clean, behaviour_logprobs=behaviour, advantages=clean.advantages.masked_fill(masked, math.nan)
    )
    out, grad = LOSSES[name](garbage, params), grad_of(name, garbage, params)
    assert not out.per_token[masked].any() and not grad[masked].any()
    assert all(math.isfinite(value) for value in out.metrics.values())
    clean_out = LOSSES[name](clean, params)
    torch.testing.assert_close(out.per_token, clean_out.per_token)
    assert out.metrics == pytest.approx(clean_out.metrics)


def test_on_policy_ppo_equals_importance_sampling() -> None:
    inputs = random_inputs(4)
    on_policy = replace(inputs, behaviour_logprobs=inputs.logprobs.detach())
    ppo, is_ = LOSSES["ppo"](on_policy, LossParams()), LOSSES["importance_sampling"](on_policy, LossParams())
    torch.testing.assert_close(ppo.per_token, is_.per_token)
    torch.testing.assert_close(grad_of("ppo", on_policy), grad_of("importance_sampling", on_policy))
    torch.testing.assert_close(grad_of("cispo", on_policy), grad_of("importance_sampling", on_policy))
    assert ppo.metrics["clip_fraction"] == 0.0 and ppo.metrics["ess"] == pytest.approx(1.0)


@pytest.mark.parametrize("name", ["importance_sampling", "ppo", "cispo", "dro", "stable_reinforce"])
@pytest.mark.parametrize("missing", ["behaviour_logprobs", "advantages"])
def test_missing_rl_inputs_raise_naming_the_input(name: str, missing: str) -> None:
    with pytest.raises(ValueError, match=missing):
        LOSSES[name](replace(random_inputs(), **{missing: None}), LossParams())  # type: ignore[arg-type]


def test_dro_beta_and_zero_advantage_penalty() -> None:
    # One token, hand-computed: lp = -1, q = -2, A = 0.5, w = 2, beta = 0.3:
    # loss = -(lp*A - beta/2 (lp-q)^2) * w = -(-0.5 - 0.15) * 2 = 1.3; d/dlp = (-A + beta (lp-q)) w = -0.4.
    lp = torch.tensor([[-1.0]], dtype=torch.float64, requires_grad=True)
    one = torch.ones((1, 1), dtype=torch.float64)
    inputs = LossInputs(lp, 2 * one, -2 * one, 0.5 * one)
    loss = LOSSES["dro"](inputs, LossParams(beta=0.3)).per_token.sum()
    assert loss.item() == pytest.approx(1.3)
    assert torch.autograd.grad(loss, lp)[0].item() == pytest.approx(-0.4)
    # Unlike importance_sampling, a token with A = 0 still pays the penalty (and gets its gradient).
    still = LOSSES["dro"](replace(inputs, advantages=0 * one), LossParams(beta=0.3)).per_token
    assert still.item() == pytest.approx(0.3)
    with pytest.raises(ValueError, match="beta"):
        LOSSES["dro"](inputs, LossParams(beta=-1.0))


def test_stable_reinforce_kl_coeff_and_zero_advantage_penalty() -> None:
    # One token, hand-computed: lp = -1, q = -2 (r = e), A = 0.5, w = 2, kl_coeff = 0.3:
    # loss = (-A*lp + c*(r - 1 - log r)) * w = (0.5 + 0.3*(e - 2)) * 2; d/dlp = (-A + c*(r - 1)) * w.
    lp = torch.tensor([[-1.0]], dtype=torch.float64, requires_grad=True)
    one = torch.ones((1, 1), dtype=torch.float64)
    inputs = LossInputs(lp, 2 * one, -2 * one, 0.5 * one)
    out = LOSSES["stable_reinforce"](inputs, LossParams(kl_coeff=0.3))
    loss = out.per_token.sum()
    assert loss.item() == pytest.approx((0.5 + 0.3 * (math.e - 2)) * 2)
    assert torch.autograd.grad(loss, lp)[0].item() == pytest.approx((-0.5 + 0.3 * (math.e - 1)) * 2)
    assert out.metrics["kl_sampler_k3"] == pytest.approx(math.e - 2)
    # The KL term acts where A = 0 too, and vanishes on policy (r = 1) whatever kl_coeff is.
    still = LOSSES["stable_reinforce"](replace(inputs, advantages=0 * one), LossParams(kl_coeff=0.3))
    assert still.per_token.item() == pytest.approx(0.3 * (math.e - 2) * 2)
    on_policy = replace(inputs, behaviour_logprobs=-1 * one)
    assert LOSSES["stable_reinforce"](on_policy, LossParams(kl_coeff=5.0)).per_token.item() == pytest.approx(
        1.0
    )
    # kl_coeff = 0 is plain REINFORCE, -A * lp.
    plain = LOSSES["stable_reinforce"](inputs, LossParams(kl_coeff=0.0)).per_token
    assert plain.item() == pytest.approx(1.0)
    for bad in (-1.0, math.inf):
        with pytest.raises(ValueError, match="kl_coeff"):
            LOSSES["stable_reinforce"](inputs, LossParams(kl_coeff=bad))


def test_stable_reinforce_on_policy_gradient_is_importance_samplings() -> None:
    inputs = random_inputs(5)
    on_policy = replace(inputs, behaviour_logprobs=inputs.logprobs.detach())
    torch.testing.assert_close(
        grad_of("stable_reinforce", on_policy), grad_of("importance_sampling", on_policy)
    )


def test_metrics_hand_computed() -> None:
    # ratios 1.5 (A>0: clipped high), 0.5 (A<0: clipped low), 0.5 (A>0: not), 1.5 (A<0: not); last masked.
    ratios = torch.tensor([[1.5, 0.5, 0.5, 1.5, 9.0]], dtype=torch.float64)
    logprobs = torch.full((1, 5), -1.0, dtype=torch.float64)
    inputs = LossInputs(
        logprobs,
        mask=torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]], dtype=torch.float64),
        behaviour_logprobs=logprobs - ratios.log(),
        advantages=torch.tensor([[1.0, -1.0, 1.0, -1.0, 1.0]], dtype=torch.float64),
    )
    metrics = LOSSES["ppo"](inputs, LossParams()).metrics
    assert metrics["clip_fraction"] == pytest.approx(0.5)
    assert metrics["clip_low_fraction"] == pytest.approx(0.25)
    assert metrics["clip_high_fraction"] == pytest.approx(0.25)
    assert metrics["is_weight_mean"] == pytest.approx(1.0)
    assert (metrics["is_weight_min"], metrics["is_weight_max"]) == pytest.approx((0.5, 1.5))
    assert metrics["ess"] == pytest.approx(4.0**2 / (4 * (2 * 1.5**2 + 2 * 0.5**2)))
    assert metrics["logprob_diff_mean_abs"] == pytest.approx((2 * math.log(1.5) + 2 * math.log(2.0)) / 4)
    assert metrics["num_tokens"] == 4.0
    cispo = LOSSES["cispo"](inputs, LossParams(clip_low_threshold=0.6, clip_high_threshold=1.4)).metrics
    assert (cispo["clip_low_fraction"], cispo["clip_high_fraction"]) == pytest.approx((0.5, 0.5))


def test_clip_thresholds_and_shapes_are_validated() -> None:
    assert LossParams().clip_thresholds("ppo") == (0.8, 1.2)
    assert LossParams().clip_thresholds("cispo") == (0.0, 4.0)
    assert LossParams(clip_high_threshold=1.28).clip_thresholds("ppo") == (0.8, 1.28)
    with pytest.raises(ValueError, match="clip_low_threshold"):
        LossParams(clip_low_threshold=1.5).clip_thresholds("ppo")
    with pytest.raises(ValueError, match="advantages"):
        LOSSES["ppo"](replace(random_inputs(), advantages=torch.zeros(3)), LossParams())


def test_truncated_is_without_proximal_is_the_truncated_policy_gradient() -> None:
    inputs = random_inputs(5)
    assert inputs.behaviour_logprobs is not None and inputs.advantages is not None
    params = LossParams(offpolicy="tis_token", offpolicy_ratio_high=1.1)
    active = inputs.mask != 0
    log_ratio = inputs.logprobs - inputs.behaviour_logprobs
    weights = tis_token(log_ratio, active, None, 1.1).weights
    assert not weights.requires_grad and weights.max() <= 1.1 + 1e-12
    torch.testing.assert_close(weights[active], log_ratio.detach().exp().clamp(max=1.1)[active])
    expected = -weights * inputs.advantages * inputs.mask
    for name in ("importance_sampling", "ppo"):  # ppo's ratio is 1 against stopgrad(lp): clip inactive
        torch.testing.assert_close(LOSSES[name](inputs, params).per_token, expected)
        torch.testing.assert_close(grad_of(name, inputs, params), expected)
    tis_clip = (torch.exp(inputs.logprobs - inputs.behaviour_logprobs) > 1.1)[active].double().mean()
    assert LOSSES["ppo"](inputs, params).metrics["offpolicy_truncated_frac"] == pytest.approx(tis_clip.item())


@pytest.mark.parametrize("cap", [1.5, None])
def test_proximal_logprobs_decouple_ratio_and_behaviour_correction(cap: float | None) -> None:
    inputs = random_inputs(6)
    assert inputs.behaviour_logprobs is not None and inputs.advantages is not None
    proximal = inputs.logprobs.detach() + 0.1
    ratio = torch.exp(inputs.logprobs.detach() - proximal)
    weights = torch.exp(proximal - inputs.behaviour_logprobs).clamp(max=cap or math.inf)
    params = LossParams(offpolicy="tis_token", offpolicy_ratio_high=cap) if cap else LossParams()
    out = LOSSES["importance_sampling"](replace(inputs, proximal_logprobs=proximal), params)
    torch.testing.assert_close(out.per_token, -ratio * weights * inputs.advantages * inputs.mask)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_token_logprobs_and_entropy_match_naive(temperature: float, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logprobs_module, "_CHUNK_ELEMENTS", 2 * 11)  # 2 rows per chunk: exercise chunking
    gen = torch.Generator().manual_seed(7)
    logits = (3 * torch.randn(3, 5, 11, generator=gen)).requires_grad_()
    targets = torch.randint(0, 11, (3, 5), generator=gen)
    naive_logp = torch.log_softmax(logits / temperature, dim=-1)
    naive_lp = naive_logp.gather(-1, targets[..., None]).squeeze(-1)
    naive_entropy = -(naive_logp.exp() * naive_logp).sum(-1)
    lp, entropy = token_logprobs(logits, targets, temperature), entropy_from_logits(logits, temperature)
    assert lp.dtype == torch.float32 and lp.shape == (3, 5)
    torch.testing.assert_close(lp, naive_lp)
    torch.testing.assert_close(entropy, naive_entropy)
    upstream = torch.randn(3, 5, generator=gen)
    for ours, naive in ((lp, naive_lp), (entropy, naive_entropy)):
        (grad,) = torch.autograd.grad((ours * upstream).sum(), logits)
        (naive_grad_,) = torch.autograd.grad((naive * upstream).sum(), logits, retain_graph=True)
        torch.testing.assert_close(grad, naive_grad_)
    logits64 = logits.detach().double()[:2, :2].requires_grad_()
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, targets[:2, :2], temperature), (logits64,))
    assert torch.autograd.gradcheck(lambda x: entropy_from_logits(x, temperature), (logits64,))


def test_bfloat16_logits_give_float32_logprobs_and_no_float32_copy_is_saved() -> None:
    logits = torch.randn(4, 8, 64).bfloat16().requires_grad_()
    targets = torch.randint(0, 64, (4, 8))
    saved: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        lp = token_logprobs(logits, targets)
        entropy_from_logits(logits)
    # Saved for backward: the caller's bf16 logits (twice, one per function) and a few floats per row.
    assert (
        saved and sum(tensor.numel() * tensor.element_size() for tensor in saved) < logits.numel() * 4 + 1024
    )
    naive = torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None]).squeeze(-1)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, naive)


def test_kl_estimators() -> None:
    gen = torch.Generator().manual_seed(8)
    lp, ref = -3 * torch.rand(4, 9, generator=gen), -3 * torch.rand(4, 9, generator=gen)
    assert (kl_k3(lp, ref) >= 0).all()
    assert not kl_k1(lp, lp).any() and not kl_k3(lp, lp).any()
    # Unbiased for KL(pi || ref) under samples from pi.
    pi, ref_probs = torch.tensor([0.5, 0.3, 0.15, 0.05]), torch.tensor([0.25, 0.25, 0.25, 0.25])
    samples = torch.multinomial(pi, 200_000, replacement=True, generator=gen)
    exact = (pi * (pi / ref_probs).log()).sum()
    for name in ("k1", "k3"):
        estimate = KL_ESTIMATORS[name](pi.log()[samples], ref_probs.log()[samples]).mean()
        torch.testing.assert_close(estimate, exact, atol=5e-3, rtol=0.0)


def test_importance_weight_histogram_matches_a_naive_count() -> None:
    from inflight.losses.importance import IS_HISTOGRAM_EDGES, off_policy_stats

    torch.manual_seed(3)
    lp = torch.randn(4, 9) * 0.6
    q = torch.randn(4, 9) * 0.6
    active = torch.rand(4, 9) > 0.3
    stats = off_policy_stats(lp, q, active)
    ratios = [
        math.exp(a - b)
        for a, b, m in zip(lp.flatten().tolist(), q.flatten().tolist(), active.flatten(), strict=True)
        if m
    ]
    edges = (0.0, *IS_HISTOGRAM_EDGES, math.inf)
    hist = [float(v) for k, v in stats.items() if k.startswith("is_hist_")]
    expected = [sum(lo <= r < hi for r in ratios) / len(ratios) for lo, hi in itertools.pairwise(edges)]
    assert hist == pytest.approx(expected)
    assert sum(hist) == pytest.approx(1.0)
