"""forward_backward_custom, driven by the unmodified SDK, the dro and stable_reinforce losses, and the
loss_fn_config checks through a live server.

References: the SDK's `forward_backward_custom` (tinker 0.38.0: forward with cross_entropy, the custom loss
C(lp) on the client, then cross_entropy with weights = -dC/dlp, any sign); an identical second adapter
trained with the built-in cross_entropy on those weights, computed here from its own forward, must land on
the same weights. dro: Tinker's DRO page, -(lp*A - beta/2 (lp - q)^2) summed, in python floats.
stable_reinforce: this server's reading (Tinker's objective is unpublished; `losses/policy.py`),
-A*lp + kl_coeff*(r - 1 - log r) summed over the sampled rows, in python floats; the datum is built as
tinker-cookbook 0.6.1's `rl_loop` builds it (a record_stability_info sampler, `Datum.with_provenance`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import tinker
import torch

from conftest import sdk_server
from inflight.api.app import BackgroundServer
from inflight.api.service import ServiceConfig

pytestmark = pytest.mark.slow
types = tinker.types
BASE = "tiny"
TOKENS = list(range(30, 46))
# Mixed signs: the weights the SDK sends back, -a * lp, are negative wherever a is.
A = torch.tensor([1.0, -2.0, 0.5, -1.0, 3.0, -0.5, 2.0, -3.0, 1.5, -1.5, 0.25, -0.25, 1.0, -1.0, 2.0])


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    config = ServiceConfig(
        base_models={BASE: str(tiny_model_dir)}, state_dir=tmp_path_factory.mktemp("serve"), dtype="float32"
    )
    with sdk_server(config) as running:
        yield running


def datum(**inputs: list[float]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS[:-1]),
        loss_fn_inputs={"target_tokens": TOKENS[1:], **inputs},  # type: ignore[dict-item]
    )


def logprobs(client: tinker.TrainingClient) -> torch.Tensor:
    out = client.forward([datum()], "cross_entropy").result()
    return torch.tensor(out.loss_fn_outputs[0]["logprobs"].data, dtype=torch.float64)


def custom_loss(data: list[types.Datum], lps: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
    # Nonlinear in lp, so the weights the SDK derives depend on the forward it ran first.
    return 0.5 * (A.to(lps[0].dtype) * lps[0] ** 2).sum(), {"custom:mean": 1.0}


def test_forward_backward_custom_trains_like_its_surrogate(server: BackgroundServer) -> None:
    service = tinker.ServiceClient(base_url=server.url)
    custom = service.create_lora_training_client(base_model=BASE, rank=4, seed=3).result()
    reference = service.create_lora_training_client(base_model=BASE, rank=4, seed=3).result()
    lp0 = logprobs(custom)
    torch.testing.assert_close(logprobs(reference), lp0)  # same seed: the same starting adapter

    result = custom.forward_backward_custom([datum()], custom_loss).result()
    expected_loss = float(0.5 * (A.double() * lp0**2).sum())
    assert result.metrics["loss:sum"] == pytest.approx(expected_loss, rel=1e-5)
    weights = (-A.double() * lp0).tolist()  # -dC/dlp at lp0: negative where A < 0 (lp < 0)
    assert min(weights) < 0 < max(weights)
    assert result.metrics["surrogate_loss:sum"] == pytest.approx(-float((torch.tensor(weights) * lp0).sum()))
    reference.forward_backward([datum(weights=weights)], "cross_entropy").result()

    adam = types.AdamParams(learning_rate=1e-2)
    custom.optim_step(adam).result()
    reference.optim_step(adam).result()
    after = logprobs(custom)
    assert (after - lp0).abs().max() > 1e-3  # the step moved the model ...
    torch.testing.assert_close(after, logprobs(reference), atol=1e-5, rtol=0)  # ... exactly as the surrogate
    service.close("success").result()


def test_dro_loss_value_and_config(server: BackgroundServer) -> None:
    service = tinker.ServiceClient(base_url=server.url)
    client = service.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
    n = len(TOKENS) - 1
    q = [-2.0 - 0.1 * i for i in range(n)]
    advantages = [0.0] * 4 + [1.0, -1.0] * ((n - 4) // 2) + [1.0] * ((n - 4) % 2)
    rl = datum(logprobs=q, advantages=advantages)
    for config, beta in (({"beta": 0.05}, 0.05), (None, 0.01)):
        out = client.forward([rl], "dro", config).result()
        lp = out.loss_fn_outputs[0]["logprobs"].data
        # Every token pays the penalty, those with A = 0 included.
        expected = -sum(lp[i] * advantages[i] - 0.5 * beta * (lp[i] - q[i]) ** 2 for i in range(n))
        assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5), config
    service.close("success").result()


def test_stable_reinforce_on_a_sampled_sequence(server: BackgroundServer) -> None:
    service = tinker.ServiceClient(base_url=server.url)
    client = service.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
    sampler = client.save_weights_and_get_sampling_client(record_stability_info=True).result()
    prompt = TOKENS[:6]
    params = types.SamplingParams(max_tokens=8, seed=1, stop=[])
    sequence = sampler.sample(types.ModelInput.from_ints(prompt), 1, params).result().sequences[0]
    sampled, q_sampled = sequence.tokens, sequence.logprobs
    assert q_sampled is not None and len(sampled) == 8
    # Stale by one step, as async RL samples are: the learner moves, the sampler's q does not.
    client.forward_backward([datum()], "cross_entropy").result()
    client.optim_step(types.AdamParams(learning_rate=5e-2)).result()

    p, s = len(prompt), len(sampled)
    advantage = 1.5
    q = [0.0] * (p - 1) + q_sampled  # as the cookbook pads the prompt rows
    advantages = [0.0] * (p - 1) + [advantage] * s
    rl = types.Datum(
        model_input=types.ModelInput.from_ints(prompt + sampled[:-1]),
        loss_fn_inputs={"target_tokens": prompt[1:] + sampled, "logprobs": q, "advantages": advantages},  # type: ignore[dict-item]
    ).with_provenance(
        model_input=[
            types.PromptProvenanceSpan(sequence_id=sequence.sequence_id, length=p),
            types.SampledProvenanceSpan(sequence_id=sequence.sequence_id, length=s - 1),
        ],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id=sequence.sequence_id, offset=1, length=p - 1),
            types.SampledProvenanceSpan(sequence_id=sequence.sequence_id, length=s),
        ],
    )
    for config, kl_coeff in (({"kl_coeff": 0.5}, 0.5), (None, 0.01)):
        out = client.forward([rl], "stable_reinforce", config).result()
        lp = out.loss_fn_outputs[0]["logprobs"].data
        rows = range(p - 1, p - 1 + s)  # the sampled rows; the prompt rows carry no loss
        log_ratios = [lp[i] - q[i] for i in rows]
        assert max(abs(x) for x in log_ratios) > 1e-2  # off policy, so the KL term is not ~0
        expected = sum(-advantages[i] * lp[i] for i in rows)
        expected += kl_coeff * sum(math.exp(x) - 1 - x for x in log_ratios)
        assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5), config
    before = out.metrics["loss:sum"]
    client.forward_backward([rl], "stable_reinforce").result()
    client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert client.forward([rl], "stable_reinforce").result().metrics["loss:sum"] < before

    # Tinker's rule: provenance on every datum, nonzero advantages only on sampled rows.
    plain = types.Datum(model_input=rl.model_input, loss_fn_inputs=rl.loss_fn_inputs)
    with pytest.raises(tinker.RequestFailedError, match="needs provenance"):
        client.forward_backward([plain], "stable_reinforce").result()
    on_prompt = replace(rl, loss_fn_inputs={**rl.loss_fn_inputs, "advantages": [1.0] * len(advantages)})
    with pytest.raises(tinker.RequestFailedError, match=r"advantages'\]\[0\].*prompt row"):
        client.forward_backward([on_prompt], "stable_reinforce").result()
    service.close("success").result()


@pytest.mark.parametrize(
    ("loss_fn", "config", "named"),
    [
        ("ppo", {"clip_hi": 1.2}, ["clip_hi", "clip_low_threshold", "clip_high_threshold"]),
        ("dro", {"clip_low_threshold": 0.8}, ["clip_low_threshold", "beta"]),
        ("importance_sampling", {"beta": 0.1}, ["beta", "takes no config"]),
        ("dro", {"beta": -1.0}, ["beta", ">= 0"]),
        ("stable_reinforce", {"beta": 0.05}, ["beta", "kl_coeff"]),
        ("stable_reinforce", {"kl_coeff": -0.5}, ["kl_coeff", ">= 0"]),
        ("gspo", None, ["gspo", "not implemented"]),
    ],
)
def test_bad_loss_config_fails_naming_the_key(
    server: BackgroundServer, loss_fn: str, config: dict[str, float] | None, named: list[str]
) -> None:
    service = tinker.ServiceClient(base_url=server.url)
    client = service.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
    n = len(TOKENS) - 1
    rl = datum(logprobs=[-1.0] * n, advantages=[1.0] * n)
    with pytest.raises(tinker.RequestFailedError) as failed:
        client.forward_backward([rl], loss_fn, config).result()  # type: ignore[arg-type]
    assert all(word in str(failed.value) for word in named), str(failed.value)
    # The client keeps working.
    assert client.forward([rl], "importance_sampling").result().metrics["loss:sum"] != 0
    service.close("success").result()
