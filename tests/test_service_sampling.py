"""The service's sampling path (`inflight.api.sampler` over each base model's shared built-in engine, as the
worker drives it) on the tiny model, against naive references: the bare Hugging Face model for greedy
decoding and log-probs, the service's own training forward for sampled and prompt log-probs, and the same
jobs alone for batch independence. Tinker's semantics: raw (temperature-1, untruncated) log-probs, stop=None
means EOS, sample i seeded seed + i.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from inflight.api.compute import ServiceCompute
from inflight.api.job_types import ForwardBackwardJob, LoraSpec, OptimStep, SampleJob, SampleOutput
from inflight.api.sampler import Sampler, build_sampler
from inflight.errors import UserError
from inflight.models import load_model

# The compute tests' helpers: one engine configuration and one way to train, for both files.
from test_service_compute import EOS, VOCAB, _datum, _engine, _forward_logprobs, _ok, _tokens, _train


@pytest.fixture
def engine(tiny_model_dir: Path) -> ServiceCompute:
    return _engine(tiny_model_dir)


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir: Path):
    return load_model(tiny_model_dir).eval()


@contextlib.contextmanager
def _sampler(engine: ServiceCompute) -> Iterator[Sampler]:
    sampler = build_sampler(engine.sampling_engines()).start()
    try:
        yield sampler
    finally:
        sampler.stop()


def _sample(engine: ServiceCompute, *jobs: SampleJob) -> list[SampleOutput]:
    """The jobs submitted together, as the worker hands a round's samples to the sampler; a model's live
    adapter is registered under its own name first, as save_weights_for_sampler registers a snapshot."""
    with _sampler(engine) as sampler:
        for weights in {job.weights for job in jobs} - {None}:
            if engine.has_adapter(weights):
                sampler.set_adapter("tiny", engine.sampler_update(weights, weights))
        futures = [sampler.submit(job) for job in jobs]
        return [future.result(timeout=120) for future in futures]


def _greedy_reference(model, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    tokens, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            logp = torch.log_softmax(model(input_ids=torch.tensor([tokens])).logits[0, -1], -1)
            tokens.append(int(logp.argmax()))
            logprobs.append(float(logp.max()))
    return tokens[len(prompt) :], logprobs


def test_greedy_sampling_equals_the_naive_argmax_loop(engine, hf_model):
    prompt = _tokens(6, 3)
    expected, expected_lps = _greedy_reference(hf_model, prompt, steps=12)
    out = _sample(
        engine,
        SampleJob(None, "tiny", prompt, num_samples=2, max_tokens=12, temperature=0.0, stop=[]),
        SampleJob(None, "tiny", prompt, max_tokens=12, temperature=1.0, top_k=1, seed=3, stop=[]),
    )
    for seq in [*out[0].sequences, *out[1].sequences]:  # top-k 1 leaves the argmax alone
        assert seq.tokens == expected and seq.stop_reason == "length"
        # Reported logprobs are the raw model distribution's, whatever the temperature or truncation.
        torch.testing.assert_close(torch.tensor(seq.logprobs), torch.tensor(expected_lps), rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_seeded_sampling_does_not_depend_on_the_rest_of_the_batch(tiny_model_dir, dtype, tmp_path):
    engine = _engine(tiny_model_dir, dtype=dtype)
    engine.create_adapter("m", "tiny", LoraSpec(rank=8, seed=1))
    engine.create_adapter("n", "tiny", LoraSpec(rank=4, seed=2))
    _train(engine, "m", steps=2)
    _train(engine, "n", steps=2, seed=1)
    job = SampleJob("m", "tiny", _tokens(5, 0), num_samples=3, max_tokens=10, seed=7, stop=[])
    alone = _sample(engine, job)[0]
    again = _sample(engine, job)[0]
    crowd = _sample(
        engine,
        SampleJob("n", "tiny", _tokens(11, 1), num_samples=4, max_tokens=6),
        job,
        SampleJob(None, "tiny", _tokens(2, 2), num_samples=2, max_tokens=14, temperature=0.7, top_k=50),
    )[1]
    tokens = [s.tokens for s in alone.sequences]
    assert tokens == [s.tokens for s in again.sequences] == [s.tokens for s in crowd.sequences]
    assert len({tuple(t) for t in tokens}) == 3  # seed + i: the samples differ from each other
    for i in range(3):  # sample i is the single sample of seed + i
        single = SampleJob("m", "tiny", job.prompt_tokens, max_tokens=10, seed=7 + i, stop=[])
        assert _sample(engine, single)[0].sequences[0].tokens == tokens[i]
    # An engine of 2 rows (the others wait, then join the running batch) changes nothing either.
    narrow = _engine(tiny_model_dir, dtype=dtype, max_sample_rows=2)
    narrow.load_state("m", _saved(engine, "m", tmp_path), load_optimizer=False)
    chunked = _sample(narrow, SampleJob(None, "tiny", [5], max_tokens=3), job)[1]
    assert [s.tokens for s in chunked.sequences] == tokens


def _saved(engine: ServiceCompute, model_id: str, tmp_path: Path) -> Path:
    engine.save_state(model_id, tmp_path / model_id, include_optimizer=False)
    return tmp_path / model_id


@pytest.mark.parametrize(("dtype", "atol"), [("float32", 1e-4), ("bfloat16", 1e-2)])
def test_sampled_and_prompt_logprobs_equal_the_training_forward(tiny_model_dir, dtype, atol):
    """Up to rounding: the sampling engine's forward (its own fused kernels) and the trainer's Hugging Face
    forward are two implementations, which round differently in bfloat16 (measured max 4e-3 on an AMX Xeon,
    logprobs near -8, i.e. bfloat16's relative precision); in float32 they agree to 1e-4."""
    engine = _engine(tiny_model_dir, dtype=dtype)
    engine.create_adapter("m", "tiny", LoraSpec(rank=8, seed=1, train_unembed=True))
    _train(engine, "m", steps=2)
    prompt = _tokens(7, 4)
    out = _sample(
        engine,
        SampleJob(
            "m", "tiny", prompt, max_tokens=9, seed=1, stop=[], prompt_logprobs=True, topk_prompt_logprobs=3
        ),
    )[0]
    seq = out.sequences[0]
    forward = _forward_logprobs(engine, "m", prompt + seq.tokens)  # forward[i] scores token i + 1
    torch.testing.assert_close(
        torch.tensor(seq.logprobs), torch.tensor(forward[len(prompt) - 1 :]), rtol=0, atol=atol
    )
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    torch.testing.assert_close(
        torch.tensor(out.prompt_logprobs[1:]), torch.tensor(forward[: len(prompt) - 1]), rtol=0, atol=atol
    )
    assert out.topk_prompt_logprobs is not None and out.topk_prompt_logprobs[0] is None
    for top, token, lp in zip(out.topk_prompt_logprobs[1:], prompt[1:], out.prompt_logprobs[1:], strict=True):
        assert len(top) == 3 and top[0][1] >= top[1][1] >= top[2][1] and top[0][1] >= lp - 1e-6
        assert all(value == pytest.approx(lp, abs=1e-6) for i, value in top if i == token)


def test_stop_tokens_stop_strings_and_never_stop(engine, hf_model, tiny_model_dir):
    prompt = _tokens(4, 8)
    greedy, _ = _greedy_reference(hf_model, prompt, steps=16)
    cut = next(i for i in range(3, 16) if greedy[i] not in greedy[:i])
    by_token = _sample(
        engine, SampleJob(None, "tiny", prompt, max_tokens=16, temperature=0, stop=[greedy[cut]])
    )
    assert by_token[0].sequences[0].tokens == greedy[: cut + 1]  # the stop token is kept
    assert by_token[0].sequences[0].stop_reason == "stop"

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = tokenizer.decode(greedy)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    first = next(j for j in range(len(greedy)) if stop in tokenizer.decode(greedy[: j + 1]))
    by_string = _sample(engine, SampleJob(None, "tiny", prompt, max_tokens=16, temperature=0, stop=[stop]))
    seq = by_string[0].sequences[0]
    assert (seq.tokens, seq.stop_reason) == (greedy[: first + 1], "stop")
    assert stop in tokenizer.decode(seq.tokens) and stop not in tokenizer.decode(seq.tokens[:-1])

    never = _sample(engine, SampleJob(None, "tiny", prompt, max_tokens=16, temperature=0, stop=[]))
    assert (never[0].sequences[0].tokens, never[0].sequences[0].stop_reason) == (greedy, "length")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_trained_adapter_learns_to_stop_at_eos(tiny_model_dir, dtype):
    """Training through the engine works end to end: cross_entropy on "prompt -> EOS" makes greedy sampling
    end at EOS when stop is None, and run on past it when stop is []."""
    engine = _engine(tiny_model_dir, dtype=dtype)
    engine.create_adapter("m", "tiny", LoraSpec(rank=8, seed=0))
    prompt = _tokens(5, 9)
    datum = _datum([*prompt, EOS], weights=[0.0] * (len(prompt) - 1) + [1.0])
    for _ in range(30):
        _ok(engine.forward_backward([ForwardBackwardJob("m", [datum], "cross_entropy")])[0])
        engine.optim_step(OptimStep("m", learning_rate=0.02))
    stops = _sample(engine, SampleJob("m", "tiny", prompt, max_tokens=8, temperature=0))[0].sequences[0]
    assert (stops.tokens, stops.stop_reason) == ([EOS], "stop")
    never = _sample(engine, SampleJob("m", "tiny", prompt, max_tokens=8, temperature=0, stop=[]))[0]
    assert len(never.sequences[0].tokens) == 8 and never.sequences[0].tokens[0] == EOS
    base = _sample(engine, SampleJob(None, "tiny", prompt, max_tokens=1, temperature=0))[0]
    assert base.sequences[0].tokens != [EOS]  # the base model does not: the adapter made the difference


def test_sampler_checkpoints_and_snapshots_are_frozen(engine, tiny_model_dir, tmp_path):
    engine.create_adapter("m", "tiny", LoraSpec(rank=8, seed=1))
    _train(engine, "m", steps=2)
    prompt = _tokens(9, 6)

    def prompt_lps(sampler: Sampler, weights: str) -> list:
        job = SampleJob(weights, "tiny", prompt, max_tokens=1, prompt_logprobs=True)
        return sampler.submit(job).result(timeout=60).prompt_logprobs

    engine.save_sampler_weights("m", tmp_path / "sampler")
    other = _engine(tiny_model_dir)
    with _sampler(engine) as sampler, _sampler(other) as other_sampler:
        sampler.set_adapter("tiny", engine.sampler_update("m", "snap"))
        before = prompt_lps(sampler, "snap")
        _train(engine, "m", steps=1, seed=5)
        assert prompt_lps(sampler, "snap") == before  # a snapshot: training moved on without it
        sampler.set_adapter("tiny", engine.sampler_update("m", "now"))
        assert prompt_lps(sampler, "now") != before
        other_sampler.set_adapter(*other.read_sampler_update("disk", tmp_path / "sampler"))
        torch.testing.assert_close(
            torch.tensor(prompt_lps(other_sampler, "disk")[1:]), torch.tensor(before[1:]), rtol=0, atol=1e-6
        )
        engine.delete_adapter("m")
        assert not engine.has_adapter("m") and prompt_lps(sampler, "snap") == before
        sampler.remove_adapter("snap")
        with pytest.raises(UserError, match="unknown sampling weights"):
            sampler.submit(SampleJob("snap", "tiny", prompt))


def test_bad_sampling_jobs_fail_alone(engine):
    engine.create_adapter("m", "tiny", LoraSpec(rank=4, seed=0))
    good = SampleJob("m", "tiny", [5, 6, 7], max_tokens=3)
    jobs = [
        good,
        SampleJob("m", "tiny", [5, VOCAB], max_tokens=3),
        SampleJob("nope", "tiny", [5], max_tokens=3),
        SampleJob("m", "other", [5], max_tokens=3),
        SampleJob("m", "tiny", [], max_tokens=3),
        SampleJob("m", "tiny", [5], max_tokens=0),
        SampleJob("m", "tiny", [5], temperature=-1.0),
        SampleJob("m", "tiny", [5], stop=[1, "x"]),  # type: ignore[list-item]
        SampleJob("m", "tiny", [5], stop=[VOCAB + 1]),
        SampleJob("m", "tiny", [5] * 2048),
    ]
    results: list[SampleOutput | Exception] = []
    with _sampler(engine) as sampler:
        sampler.set_adapter("tiny", engine.sampler_update("m", "m"))
        for job in jobs:
            try:
                results.append(sampler.submit(job).result(timeout=60))
            except UserError as exc:  # refused before anything ran
                results.append(exc)
    messages = [
        None,
        "not a token id",
        "unknown sampling weights",
        "unknown base model",
        "no tokens",
        "max_tokens",
        "temperature",
        "list of strings or a list of token ids",
        "stop token ids",
        "context",
    ]
    for result, message in zip(results, messages, strict=True):
        if message is None:
            assert isinstance(result, SampleOutput) and len(result.sequences[0].tokens) == 3
        else:
            assert isinstance(result, UserError) and message in str(result), (message, result)
