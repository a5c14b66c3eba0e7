"""`inflight serve --engine vllm`: the unmodified `tinker` SDK trains LoRA adapters in the service's process
and samples them on vLLM (one `serve-engine --backend vllm` process per base model, vLLM's CPU build in the
environment `launch/vllm_env.py` builds).

Held to the service's own trainer, an independent stack: after a few optimizer steps the sampler's
`compute_logprobs` (vLLM's prompt logprobs over the adapter) equals the training client's forward, and
the logprobs of sampled tokens are Tinker's (the model's own distribution at temperature 1, whatever the
sampling temperature). Two families: Qwen2, whose LM head vLLM's LoRA cannot adapt (the SDK's default
`train_unembed=True` is refused at creation, naming the fix), and Qwen3, whose it can.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import tinker
import torch
import transformers

from conftest import require_vllm_env, sdk_server
from inflight.api.app import BackgroundServer
from inflight.api.service import ServiceConfig

pytestmark = pytest.mark.slow
types = tinker.types
TOKENS = [5, 17, 3, 42, 8, 99, 23, 7, 61, 12, 4, 30, 77, 15, 9, 50, 21, 6]
ATOL = 1e-4  # float32 on both sides; the two stacks differ by summation order only


@pytest.fixture(scope="module")
def qwen3_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small random Qwen3 (head_dim 32: vLLM's CPU attention has no 16) with the tiny model's tokenizer."""
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    config = transformers.Qwen3Config(
        vocab_size=vocab, hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, tie_word_embeddings=False, max_position_embeddings=512,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).eval()
    out = tmp_path_factory.mktemp("qwen3")
    model.save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def server(
    tiny_model_dir: Path, qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[BackgroundServer]:
    require_vllm_env()
    config = ServiceConfig(
        base_models={"qwen2": str(tiny_model_dir), "qwen3": str(qwen3_dir)},
        state_dir=tmp_path_factory.mktemp("serve"),
        dtype="float32",
        engine="vllm",
    )
    with sdk_server(config) as running:
        yield running


@pytest.fixture(scope="module")
def service(server: BackgroundServer) -> Iterator[tinker.ServiceClient]:
    client = tinker.ServiceClient(base_url=server.url)
    yield client
    client.close("success").result()


def datum() -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS[:-1]),
        loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [0.0] * 3 + [1.0] * (len(TOKENS) - 4)},
    )


def trained_logprobs(training: tinker.TrainingClient, tokens: list[int]) -> torch.Tensor:
    """The training client's logprobs of tokens[1:] given their prefixes (its forward, no update)."""
    example = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    output = training.forward([example], "cross_entropy").result()
    return torch.tensor(output.loss_fn_outputs[0]["logprobs"].tolist(), dtype=torch.float64)


def test_the_sdks_default_lora_is_refused_where_vllm_cannot_adapt_the_lm_head(
    service: tinker.ServiceClient,
) -> None:
    with pytest.raises(tinker.RequestFailedError, match="train_unembed=False") as refused:
        service.create_lora_training_client(base_model="qwen2", rank=8).result()
    assert "lm_head" in str(refused.value)


@pytest.mark.parametrize(
    "base,unembed", [("qwen2", False), ("qwen3", True)], ids=["qwen2-no-unembed", "qwen3-unembed"]
)
def test_adapters_trained_here_sample_on_vllm_with_the_trainers_logprobs(
    service: tinker.ServiceClient, base: str, unembed: bool
) -> None:
    training = service.create_lora_training_client(
        base_model=base, rank=8, seed=0, train_unembed=unembed
    ).result()
    untrained = trained_logprobs(training, TOKENS)
    for _ in range(3):
        training.forward_backward([datum()], "cross_entropy")
        training.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    sampler = training.save_weights_and_get_sampling_client().result()

    served = trained_logprobs(training, TOKENS)
    assert (served - untrained).abs().max() > 1e-2  # training moved it: the comparisons below mean something
    on_vllm = sampler.compute_logprobs(types.ModelInput.from_ints(TOKENS)).result()
    assert on_vllm[0] is None and len(on_vllm) == len(TOKENS)
    torch.testing.assert_close(torch.tensor(on_vllm[1:], dtype=torch.float64), served, atol=ATOL, rtol=0)

    # Sampled at temperature 0.7, each token's logprob is the model's own (temperature 1): Tinker's.
    prompt = TOKENS[:6]
    params = types.SamplingParams(max_tokens=8, temperature=0.7, seed=11, stop=[])
    first = sampler.sample(types.ModelInput.from_ints(prompt), 2, params).result()
    again = sampler.sample(types.ModelInput.from_ints(prompt), 2, params).result()
    assert [s.tokens for s in first.sequences] == [s.tokens for s in again.sequences]  # seeded
    for sequence in first.sequences:
        assert len(sequence.tokens) == 8 and sequence.stop_reason == "length"
        expected = trained_logprobs(training, prompt + sequence.tokens)[len(prompt) - 1 :]
        got = torch.tensor(sequence.logprobs, dtype=torch.float64)
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
