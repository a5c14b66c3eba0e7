"""forward_backward_custom, driven by the unmodified SDK, and the dro loss and loss_fn_config checks through
a live server.

References: the SDK's `forward_backward_custom` (tinker 0.38.0: forward with cross_entropy, the custom loss
C(lp) on the client, then cross_entropy with weights = -dC/dlp, any sign); an identical second adapter
trained with the built-in cross_entropy on those weights, computed here from its own forward, must land on
the same weights. dro: Tinker's DRO page, -(lp*A - beta/2 (lp - q)^2) summed, in python floats.
"""

from __future__ import annotations

from collections.abc import Iterator
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


@pytest.mark.parametrize(
    ("loss_fn", "config", "named"),
    [
        ("ppo", {"clip_hi": 1.2}, ["clip_hi", "clip_low_threshold", "clip_high_threshold"]),
        ("dro", {"clip_low_threshold": 0.8}, ["clip_low_threshold", "beta"]),
        ("importance_sampling", {"beta": 0.1}, ["beta", "takes no config"]),
        ("dro", {"beta": -1.0}, ["beta", ">= 0"]),
        ("stable_reinforce", None, ["stable_reinforce", "not published"]),
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
