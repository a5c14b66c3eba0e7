"""The sample request's outputs beyond the sampled tokens, driven by the unmodified `tinker==0.38.0` SDK
against a live server on the tiny model: `topk_sample_logprobs`, `target_prompt_logprobs` (dense and sparse
CSR), `prompt_alt_tokens_k` (with `prompt_logprobs_last_n`, which bounds only the prompt logprobs), and the
refusals (widths above the server's cap, a target tensor of the wrong shape); `record_stability_info` is
accepted (nothing to record: see test_api_custom_loss.py for the stable_reinforce loss that would read it).

Reference: a plain transformers forward of the same float32 weights, log_softmax of its logits (Tinker's raw
logprobs: temperature 1, untruncated); the SDK's docstrings for shapes and layouts (tinker-api.md §6, §8).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import tinker
import torch
from transformers import AutoModelForCausalLM

from conftest import sdk_server
from inflight.api.app import BackgroundServer
from inflight.api.service import ServiceConfig

pytestmark = pytest.mark.slow
types = tinker.types

BASE = "tiny"
CAP = 6  # max_topk_logprobs: every width above it is refused
TOL = 1e-4  # float32: the engine and the reference differ by summation order only


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    config = ServiceConfig(
        base_models={BASE: str(tiny_model_dir)},
        state_dir=tmp_path_factory.mktemp("serve"),
        dtype="float32",
        max_topk_logprobs=CAP,
    )
    with sdk_server(config) as running:
        yield running


@pytest.fixture(scope="module")
def sampler(server: BackgroundServer) -> Iterator[tinker.SamplingClient]:
    service = tinker.ServiceClient(base_url=server.url)
    yield service.create_sampling_client(base_model=BASE).result()
    service.close("success").result()


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> AutoModelForCausalLM:
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def raw_logprobs(model: AutoModelForCausalLM, ids: list[int]) -> torch.Tensor:
    """[T, V] log_softmax of the logits at every position (row t predicts ids[t + 1])."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


def prompt_of(n: int, vocab: int, seed: int = 0) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_topk_sample_logprobs_are_the_raw_top_k_at_every_generated_token(sampler, reference) -> None:
    vocab = reference.config.vocab_size
    prompt = prompt_of(7, vocab)
    params = types.SamplingParams(max_tokens=6, temperature=0.8, top_k=20, seed=4, stop=[])
    response = sampler.sample(types.ModelInput.from_ints(prompt), 2, params, topk_sample_logprobs=5).result()
    plain = sampler.sample(types.ModelInput.from_ints(prompt), 2, params).result()
    assert [s.tokens for s in response.sequences] == [s.tokens for s in plain.sequences]
    assert all(s.topk_logprobs is None for s in plain.sequences)
    for sequence in response.sequences:
        expected = raw_logprobs(reference, prompt + sequence.tokens)[len(prompt) - 1 : -1].topk(5, -1)
        assert sequence.topk_logprobs is not None and len(sequence.topk_logprobs) == len(sequence.tokens) == 6
        # Tinker's logprobs are raw whatever the sampling: top-k and temperature do not change them.
        for t, pairs in enumerate(sequence.topk_logprobs):
            assert pairs is not None and [i for i, _ in pairs] == expected.indices[t].tolist()
            torch.testing.assert_close(
                torch.tensor([v for _, v in pairs]), expected.values[t], atol=TOL, rtol=0
            )


def test_target_prompt_logprobs_dense_and_sparse(sampler, reference) -> None:
    vocab = reference.config.vocab_size
    prompt = prompt_of(9, vocab, seed=1)
    raw = raw_logprobs(reference, prompt)[:-1]  # [P-1, V]
    ids = torch.tensor([[prompt[i + 1], (31 * i) % vocab, -1] for i in range(len(prompt) - 1)])
    ids[0] = -1  # a row that asks nothing
    expected = raw.gather(1, ids.clamp_min(0)).masked_fill(ids < 0, 0.0)

    def score(target: types.TensorData) -> types.SampleResponse:
        return sampler.sample(
            types.ModelInput.from_ints(prompt),
            1,
            types.SamplingParams(max_tokens=1),
            include_prompt_logprobs=True,
            target_prompt_logprobs=target,
        ).result()

    dense = score(types.TensorData.from_torch(ids))
    assert dense.target_prompt_logprobs is not None and dense.target_prompt_logprobs.shape == [8, 3]
    torch.testing.assert_close(dense.target_prompt_logprobs.to_torch(), expected, atol=TOL, rtol=0)
    # Column 0 names each actual next token: its logprob is the prompt logprob there.
    assert dense.prompt_logprobs is not None
    assert max(abs(dense.prompt_logprobs[i + 1] - expected[i, 0].item()) for i in range(1, 8)) < TOL

    # The SDK's own example: one cell, sent sparse; the answer lists the same cell, 0.0 elsewhere.
    one = torch.full((len(prompt) - 1, 4), -1, dtype=torch.int64)
    one[5, 2] = 17
    sent = types.TensorData.from_torch_sparse(one, pad_value=-1)
    assert sent.sparse_crow_indices is not None
    sparse = score(sent).target_prompt_logprobs
    assert sparse is not None and sparse.sparse_crow_indices == sent.sparse_crow_indices
    assert sparse.sparse_col_indices == sent.sparse_col_indices
    answer = sparse.to_torch()
    assert answer.shape == (8, 4) and answer.count_nonzero() == 1
    assert abs(answer[5, 2].item() - raw[5, 17].item()) < TOL


def test_prompt_alt_tokens_are_draws_with_their_raw_logprobs(sampler, reference) -> None:
    vocab = reference.config.vocab_size
    prompt = prompt_of(10, vocab, seed=2)
    raw = raw_logprobs(reference, prompt)[:-1]

    def draw(k: int, temperature: float, **options: object) -> types.SampleResponse:
        params = types.SamplingParams(max_tokens=2, temperature=temperature, seed=9)
        return sampler.sample(
            types.ModelInput.from_ints(prompt), 1, params, prompt_alt_tokens_k=k, **options
        ).result()

    greedy = draw(3, 0.0).prompt_alt_tokens
    assert greedy is not None and greedy.tokens.shape == [9, 3]
    assert greedy.tokens.to_torch().tolist() == raw.argmax(-1)[:, None].expand(-1, 3).tolist()

    # prompt_logprobs_last_n bounds the prompt logprobs (the SDK checks that) and never the draws.
    first = draw(CAP, 1.0, include_prompt_logprobs=True, prompt_logprobs_last_n=2)
    again = draw(CAP, 1.0)
    assert first.prompt_logprobs is not None and first.prompt_logprobs[:-2] == [None] * 8
    drawn = first.prompt_alt_tokens
    assert drawn is not None and again.prompt_alt_tokens is not None
    assert drawn.tokens.shape == drawn.logprobs.shape == [9, CAP] and drawn.tokens.dtype == "int64"
    tokens = drawn.tokens.to_torch()
    assert tokens.tolist() == again.prompt_alt_tokens.tokens.to_torch().tolist()  # seeded
    torch.testing.assert_close(drawn.logprobs.to_torch(), raw.gather(1, tokens), atol=TOL, rtol=0)
    # Draws from p at temperature 1: the mean of log p over them estimates -entropy, to a few std errors.
    p = raw.exp()
    mean, var = (p * raw).sum(-1), (p * raw**2).sum(-1) - (p * raw).sum(-1) ** 2
    observed = raw.gather(1, tokens).mean(-1)
    assert abs((observed - mean).sum().item()) < 5 * math.sqrt(var.sum().item() / CAP)


def test_bad_values_are_refused_with_one_line_naming_the_field(server, sampler, reference) -> None:
    vocab = reference.config.vocab_size
    prompt = types.ModelInput.from_ints(prompt_of(5, vocab, seed=3))
    params = types.SamplingParams(max_tokens=1)
    refusals = {
        "topk_sample_logprobs=7 is above this server's limit of 6": {"topk_sample_logprobs": CAP + 1},
        "prompt_alt_tokens_k=7 is above this server's limit of 6": {"prompt_alt_tokens_k": CAP + 1},
        r"target_prompt_logprobs has 3 rows; .* needs len\(prompt\) - 1 = 4": {
            "target_prompt_logprobs": types.TensorData.from_torch(torch.zeros(3, 1, dtype=torch.int64))
        },
        "target_prompt_logprobs names no token id": {
            "target_prompt_logprobs": types.TensorData.from_torch(torch.full((4, 2), -1, dtype=torch.int64))
        },
        f"target_prompt_logprobs holds {vocab}; ids must lie in the vocabulary": {
            "target_prompt_logprobs": types.TensorData.from_torch(
                torch.full((4, 1), vocab, dtype=torch.int64)
            )
        },
        "target_prompt_logprobs has 7 columns; this server takes 1 to 6": {
            "target_prompt_logprobs": types.TensorData.from_torch(torch.zeros(4, 7, dtype=torch.int64))
        },
    }
    for message, options in refusals.items():
        with pytest.raises(tinker.BadRequestError, match=message) as refused:
            sampler.sample(prompt, 1, params, **options).result()
        assert "\n" not in str(refused.value.body)

    service = tinker.ServiceClient(base_url=server.url)
    recording = service.create_sampling_client(base_model=BASE, record_stability_info=True).result()
    sequences = recording.sample(prompt, 2, params).result().sequences
    assert len({sequence.sequence_id for sequence in sequences}) == 2
    service.close("success").result()
