"""Several base models on one server, proven with the SDK: one session trains an adapter on one base model
while it samples from another and computes that model's logprobs for a KL penalty, as tinker-cookbook's KL
reference does; each base model's weights are loaded once.

Reference: issue 15 item 2. Expected logprobs come from a plain Hugging Face forward of each model; the two
tiny models differ only in their weights' seed, so a mix-up between them shows as a large difference.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import tinker
import torch

from conftest import sdk_server
from inflight.api import compute
from inflight.api.app import BackgroundServer
from inflight.api.service import ServiceConfig
from inflight.models import build_tiny

pytestmark = pytest.mark.slow
types = tinker.types


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {"policy": tiny_model_dir, "reference": build_tiny(tmp_path_factory.mktemp("ref"), seed=7)}


@pytest.fixture(scope="module")
def served(
    model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[BackgroundServer, list[str]]]:
    loads: list[str] = []
    real_load = compute.load_model

    def counting_load(source: str, **kwargs: object) -> torch.nn.Module:
        loads.append(str(source))
        return real_load(source, **kwargs)  # type: ignore[arg-type]

    config = ServiceConfig(
        base_models={name: str(path) for name, path in model_dirs.items()},
        state_dir=tmp_path_factory.mktemp("serve"),
        dtype="float32",
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(compute, "load_model", counting_load)
        with sdk_server(config) as running:
            yield running, loads


def hf_logprobs(model_dir: Path, tokens: list[int]) -> torch.Tensor:
    """log p(tokens[i+1] | tokens[:i+1]) under the model, with plain transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([tokens[:-1]])).logits[0].double()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens[1:])[:, None]).squeeze(1)


def test_train_on_one_base_while_sampling_and_scoring_another(
    served: tuple[BackgroundServer, list[str]], model_dirs: dict[str, Path]
) -> None:
    server, loads = served
    service = tinker.ServiceClient(base_url=server.url)
    capabilities = tinker.RestClient(base_url=server.url).get_server_capabilities().result()
    assert {m.model_name for m in capabilities.supported_models} >= {"policy", "reference"}
    training = service.create_lora_training_client(base_model="policy", rank=8, seed=0).result()
    reference = service.create_sampling_client(base_model="reference").result()
    prompt = list(range(30, 42))
    for step in range(3):
        # Sample from the reference base, score the samples under it (the KL reference's logprobs), and
        # train the policy's adapter on the same tokens: three calls on two base models in one session.
        params = types.SamplingParams(max_tokens=8, temperature=1.0, stop=[], seed=step)
        sequence = reference.sample(types.ModelInput.from_ints(prompt), 1, params).result().sequences[0]
        tokens = prompt + list(sequence.tokens)
        ref_lps = reference.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
        expected_ref = hf_logprobs(model_dirs["reference"], tokens)
        torch.testing.assert_close(
            torch.tensor(ref_lps[1:], dtype=torch.float64), expected_ref, atol=1e-4, rtol=0
        )
        # The sampled tokens are the reference model's own: their sampled logprobs match its forward too.
        sampled = torch.tensor(sequence.logprobs, dtype=torch.float64)
        torch.testing.assert_close(sampled, expected_ref[len(prompt) - 1 :], atol=1e-4, rtol=0)
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:]}
        )
        out = training.forward_backward([datum], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        policy_lps = torch.tensor(out.loss_fn_outputs[0]["logprobs"].tolist(), dtype=torch.float64)
        if step == 0:  # before any update, the adapter (B = 0) is the policy base itself
            torch.testing.assert_close(
                policy_lps, hf_logprobs(model_dirs["policy"], tokens), atol=1e-4, rtol=0
            )
        # The two bases really differ: scoring with the wrong one would show here.
        assert (policy_lps - torch.tensor(ref_lps[1:], dtype=torch.float64)).abs().max() > 0.05
    assert sorted(loads) == sorted(str(p) for p in model_dirs.values())  # each base loaded exactly once
    service.close("success").result()
