"""Samples run on the shared engine, beside training: a tenant's long sample never holds up another tenant's
forward_backward, and the service's sampled logprobs keep Tinker's definition (raw model, temperature 1).

Reference: issue 12 item 3 ("a forward_backward submitted after a long sample request completes before it")
and item 1 (each front end held to its logprob definition). Driven by the unmodified `tinker` SDK against a
live server on the tiny model; the reference logprobs come from a plain Hugging Face forward.
"""

from __future__ import annotations

import threading
import time
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


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    config = ServiceConfig(
        base_models={BASE: str(tiny_model_dir)}, state_dir=tmp_path_factory.mktemp("serve"), dtype="float32"
    )
    with sdk_server(config) as running:
        yield running


def test_a_forward_backward_submitted_after_a_long_sample_finishes_first(server: BackgroundServer) -> None:
    service = tinker.ServiceClient(base_url=server.url)
    sampler = service.create_sampling_client(base_model=BASE)
    training = service.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
    tokens = list(range(10, 40))
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:]}
    )
    training.forward_backward([datum], "cross_entropy").result()  # warm: the race below is not a first call
    finished: dict[str, float] = {}

    def long_sample() -> None:
        # stop=[]: never stop, not even at EOS, so it runs to max_tokens (~1,000 decode steps).
        params = types.SamplingParams(max_tokens=1000, temperature=1.0, stop=[], seed=1)
        result = sampler.sample(types.ModelInput.from_ints(tokens[:8]), num_samples=1, sampling_params=params)
        assert len(result.result().sequences[0].tokens) == 1000
        finished["sample"] = time.monotonic()

    thread = threading.Thread(target=long_sample)
    thread.start()
    time.sleep(1.0)  # the sample is running in the engine by now
    training.forward_backward([datum], "cross_entropy").result()
    finished["forward_backward"] = time.monotonic()
    thread.join(120)
    assert set(finished) == {"sample", "forward_backward"}
    assert finished["forward_backward"] < finished["sample"], finished
    service.close("success").result()


def test_sampled_logprobs_are_the_raw_models_at_any_temperature(
    server: BackgroundServer, tiny_model_dir: Path
) -> None:
    """Tinker's sampled logprobs: log_softmax of the model's logits at temperature 1, untruncated, whatever
    temperature and top-k sampled the token (the pipeline's engine default is the sampled distribution's)."""
    from transformers import AutoModelForCausalLM

    service = tinker.ServiceClient(base_url=server.url)
    sampler = service.create_sampling_client(base_model=BASE)
    prompt = list(range(50, 62))
    params = types.SamplingParams(max_tokens=12, temperature=0.7, top_k=20, stop=[], seed=3)
    sequence = sampler.sample(types.ModelInput.from_ints(prompt), 1, params).result().sequences[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    full = prompt + list(sequence.tokens)
    with torch.no_grad():
        logits = model(torch.tensor([full[:-1]])).logits[0].double()
    sampled = torch.tensor(sequence.tokens)[:, None]
    reference = torch.log_softmax(logits, -1)[len(prompt) - 1 :].gather(1, sampled).squeeze(1)
    got = torch.tensor(sequence.logprobs, dtype=torch.float64)
    torch.testing.assert_close(got, reference, atol=1e-4, rtol=0)
    # ...which the temperature-scaled distribution would not give.
    scaled = torch.log_softmax(logits / 0.7, -1)[len(prompt) - 1 :].gather(1, sampled).squeeze(1)
    assert (got - scaled).abs().max() > 1e-2
    service.close("success").result()


def test_sdk_clients_left_open_are_closed_with_the_tests_server(tiny_model_dir: Path, tmp_path: Path) -> None:
    """`conftest.sdk_server` closes the SDK clients opened against it (tests rarely close theirs): a client
    left open heartbeats its gone server for the rest of the worker's run and logs the failure into later
    tests' captured records (a CI failure)."""
    config = ServiceConfig(base_models={BASE: str(tiny_model_dir)}, state_dir=tmp_path, dtype="float32")
    with sdk_server(config) as running:
        service = tinker.ServiceClient(base_url=running.url)
        service.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()  # a session: heartbeats
        holder = service.holder
        assert not holder._closed
    assert holder._closed
