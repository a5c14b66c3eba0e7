"""The acceptance walk of the Tinker-compatible service, driven by the unmodified `tinker==0.38.0` SDK against
a live uvicorn on a loopback port, computing on the real ServiceCompute over the tiny model.

Reference: /work/shared/reference/tinker-api.md §14 steps 1-12 (and §3 futures, §6 protobuf, §7 losses,
§8 sampling, §9 checkpoint paths, §10 tokenizer_id). Expected numbers come from an independent local
Hugging Face forward of the same model, or from the SDK's own outputs checked against each other.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tinker
import torch

from inflight.api.app import BackgroundServer, create_app, load_compute, serve
from inflight.api.service import ServiceConfig
from inflight.api.worker import WorkerConfig
from inflight.errors import UserError
from inflight.models.loader import resolve_dtype

pytestmark = pytest.mark.slow
types = tinker.types

BASE = "meta-llama/Llama-3.2-1B"  # any name works; this one also gets the cookbook's role_colon renderer
TEXT = "the quick brown fox jumps over the lazy dog, and then the dog sleeps in the sun all day"


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    config = ServiceConfig(
        base_models={BASE: str(tiny_model_dir)}, state_dir=tmp_path_factory.mktemp("serve")
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TINKER_API_KEY", "tml-test")
        mp.setenv("TINKER_TELEMETRY", "0")
        mp.setenv("HF_HUB_OFFLINE", "1")
        with BackgroundServer(create_app(config)) as running:
            yield running


@pytest.fixture(scope="module")
def service(server: BackgroundServer) -> Iterator[tinker.ServiceClient]:
    client = tinker.ServiceClient(base_url=server.url)
    yield client
    client.close("success").result()


@pytest.fixture(scope="module")
def tokens(tiny_model_dir: Path) -> list[int]:
    from transformers import AutoTokenizer

    ids: list[int] = AutoTokenizer.from_pretrained(tiny_model_dir).encode(TEXT)
    return ids


def sft_datum(tokens: list[int]) -> types.Datum:
    weights = [0.0] * 3 + [1.0] * (len(tokens) - 4)  # a prompt part that is not trained on
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
    )


def logprobs_of(output: types.ForwardBackwardOutput, i: int = 0) -> torch.Tensor:
    return torch.tensor(output.loss_fn_outputs[i]["logprobs"].tolist(), dtype=torch.float64)


def reference_logprobs(model_dir: Path, tokens: list[int]) -> torch.Tensor:
    """log p(tokens[i+1] | tokens[:i+1]) under the base model, with plain transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([tokens[:-1]])).logits[0].double()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]


def test_capabilities_model_id_info_and_offline_tokenizer(
    server: BackgroundServer, service, tiny_model_dir
) -> None:
    caps = tinker.RestClient(base_url=server.url).get_server_capabilities().result()
    assert [m.model_name for m in caps.supported_models] == [BASE]
    training = service.create_lora_training_client(base_model=BASE, rank=8, seed=0).result()
    session_id, _, seq = training.model_id.rpartition(":train:")
    assert session_id and seq.isdigit()
    info = training.get_info()
    assert info.lora_rank == 8 and info.model_data.model_name == BASE
    assert Path(info.model_data.tokenizer_id) == tiny_model_dir.resolve()
    assert training.get_tokenizer().decode(training.get_tokenizer().encode("hello world")) == "hello world"


def test_forward_equals_base_model_and_training_lowers_the_loss(service, tokens, tiny_model_dir) -> None:
    training = service.create_lora_training_client(base_model=BASE, rank=8, seed=0).result()
    datum = sft_datum(tokens)
    weights = torch.tensor(datum.loss_fn_inputs["weights"].tolist(), dtype=torch.float64)
    first = training.forward([datum], "cross_entropy").result()
    lp = logprobs_of(first)
    assert lp.shape == (len(tokens) - 1,)
    # B = 0 at init: a fresh adapter is the base model, token for token (up to the rounding of the
    # service's default dtype, "auto": bfloat16 on a CPU with AVX512-BF16).
    atol = 1e-4 if resolve_dtype("auto", torch.device("cpu")) == torch.float32 else 0.03
    torch.testing.assert_close(lp, reference_logprobs(tiny_model_dir, tokens), atol=atol, rtol=0)
    assert first.metrics["loss:sum"] == pytest.approx(-(weights * lp).sum().item(), rel=1e-5)

    losses, before = [], first.metrics["loss:sum"]
    for _ in range(4):
        fwd_bwd = training.forward_backward([datum], "cross_entropy")
        step = training.optim_step(types.AdamParams(learning_rate=3e-3))  # submitted before waiting
        result = fwd_bwd.result()
        assert step.result().metrics is not None
        # forward_backward sees the weights of before its own step: the previous forward's loss.
        assert result.metrics["loss:sum"] == pytest.approx(before, rel=1e-5)
        before = training.forward([datum], "cross_entropy").result().metrics["loss:sum"]
        losses.append(before)
    assert losses == sorted(losses, reverse=True) and losses[-1] < 0.8 * first.metrics["loss:sum"]


def test_sampler_checkpoint_sampling_and_prompt_logprobs(service, tokens) -> None:
    training = service.create_lora_training_client(base_model=BASE, rank=8, seed=1).result()
    datum = sft_datum(tokens)
    training.forward_backward([datum], "cross_entropy")
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()

    saved = training.save_weights_for_sampler("s1").result()
    assert saved.path == f"tinker://{training.model_id}/sampler_weights/s1"
    sampler = service.create_sampling_client(model_path=saved.path).result()
    prompt = types.ModelInput.from_ints(tokens[:6])

    def sample(n: int = 2, **params: object) -> types.SampleResponse:
        return sampler.sample(prompt, n, types.SamplingParams(max_tokens=8, **params)).result()

    first, again = sample(seed=123), sample(seed=123)
    assert [s.tokens for s in first.sequences] == [s.tokens for s in again.sequences]
    assert len({s.sequence_id for s in first.sequences + again.sequences}) == 4
    for sequence in first.sequences:
        assert 1 <= len(sequence.tokens) <= 8 and sequence.stop_reason in ("stop", "length")
        assert sequence.logprobs is not None and len(sequence.logprobs) == len(sequence.tokens)

    # Greedy: each token is the top-1 of the distribution it was drawn from.
    greedy = sample(1, temperature=0.0, stop=[]).sequences[0]
    scored = sampler.sample(
        types.ModelInput.from_ints(tokens[:6] + greedy.tokens),
        1,
        types.SamplingParams(max_tokens=1),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=1,
    ).result()
    top1 = [row[0][0] for row in scored.topk_prompt_logprobs[6:]]
    assert greedy.tokens == top1 and greedy.stop_reason == "length" and len(greedy.tokens) == 8

    # Stops: [] never stops, a token id stops on it (kept in the output), a string stops once produced.
    stop_token = greedy.tokens[2]
    by_token = sample(1, temperature=0.0, stop=[stop_token]).sequences[0]
    assert by_token.tokens == greedy.tokens[: greedy.tokens.index(stop_token) + 1]
    assert by_token.stop_reason == "stop"
    tokenizer = training.get_tokenizer()
    stop_text = tokenizer.decode(greedy.tokens[3:4])
    by_text = sample(1, temperature=0.0, stop=[stop_text]).sequences[0]
    assert by_text.stop_reason == "stop" and by_text.tokens == greedy.tokens[: len(by_text.tokens)]
    assert stop_text in tokenizer.decode(by_text.tokens) and len(by_text.tokens) <= 4

    # compute_logprobs agrees with the training forward at the same weights: to float32 rounding, or in
    # bfloat16 (the default where the CPU has it) to its precision, the sampling engine's forward and the
    # trainer's being two implementations (measured max 8e-3 on an AMX Xeon).
    logprobs = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
    assert logprobs[0] is None and len(logprobs) == len(tokens)
    trained = logprobs_of(training.forward([datum], "cross_entropy").result())
    atol = 1e-4 if resolve_dtype("auto", torch.device("cpu")) == torch.float32 else 0.03
    torch.testing.assert_close(torch.tensor(logprobs[1:], dtype=torch.float64), trained, atol=atol, rtol=0)


def test_state_checkpoint_restores_weights_and_adam_state(service, tokens) -> None:
    training = service.create_lora_training_client(base_model=BASE, rank=8, seed=2).result()
    datum = sft_datum(tokens)
    adam = types.AdamParams(learning_rate=1e-2)
    for _ in range(2):
        training.forward_backward([datum], "cross_entropy")
        training.optim_step(adam).result()
    state = training.save_state("c1").result()
    assert state.path == f"tinker://{training.model_id}/weights/c1"
    at_save = logprobs_of(training.forward([datum], "cross_entropy").result())
    training.forward_backward([datum], "cross_entropy")
    training.optim_step(adam).result()
    after_step = logprobs_of(training.forward([datum], "cross_entropy").result())
    assert not torch.allclose(after_step, at_save)

    with_adam = service.create_training_client_from_state_with_optimizer(state.path).result()
    session_id = training.model_id.rpartition(":train:")[0]
    assert with_adam.model_id.startswith(f"{session_id}:train:") and with_adam.model_id != training.model_id
    torch.testing.assert_close(logprobs_of(with_adam.forward([datum], "cross_entropy").result()), at_save)
    weights_only = service.create_training_client_from_state(state.path).result()
    torch.testing.assert_close(logprobs_of(weights_only.forward([datum], "cross_entropy").result()), at_save)

    # The same step from the restored state lands where the original's did only if Adam's moments came back.
    for restored in (with_adam, weights_only):
        restored.forward_backward([datum], "cross_entropy")
        restored.optim_step(adam).result()
    torch.testing.assert_close(
        logprobs_of(with_adam.forward([datum], "cross_entropy").result()), after_step, atol=1e-5, rtol=0
    )
    assert not torch.allclose(
        logprobs_of(weights_only.forward([datum], "cross_entropy").result()), after_step
    )

    with pytest.warns(FutureWarning, match="deprecated"):  # the deprecated in-place load still works
        training.load_state(state.path).result()
    torch.testing.assert_close(logprobs_of(training.forward([datum], "cross_entropy").result()), at_save)


def test_rl_step_importance_sampling_and_ppo_losses(service, tokens) -> None:
    training = service.create_lora_training_client(base_model=BASE, rank=8, seed=3).result()
    sampler = training.save_weights_and_get_sampling_client().result()
    prompt = tokens[:5]
    result = sampler.sample(
        types.ModelInput.from_ints(prompt), 4, types.SamplingParams(max_tokens=6, seed=7, stop=[])
    ).result()
    advantages_g = [1.0, -0.5, 0.25, -0.75]
    datums = []
    for sequence, advantage in zip(result.sequences, advantages_g, strict=True):
        pad = len(prompt) - 1
        datums.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(prompt + sequence.tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": [0] * pad + sequence.tokens,
                    "logprobs": [0.0] * pad + list(sequence.logprobs),
                    "advantages": [0.0] * pad + [advantage] * len(sequence.tokens),
                },
            )
        )

    def expected(loss_fn: str, output: types.ForwardBackwardOutput) -> float:
        total = 0.0
        for i, datum in enumerate(datums):
            lp = logprobs_of(output, i)
            q = torch.tensor(datum.loss_fn_inputs["logprobs"].tolist(), dtype=torch.float64)
            a = torch.tensor(datum.loss_fn_inputs["advantages"].tolist(), dtype=torch.float64)
            ratio = torch.exp(lp - q)
            if loss_fn == "ppo":
                total -= torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a).sum().item()
            else:
                total -= (ratio * a).sum().item()
        return total

    out = training.forward_backward(datums, "importance_sampling").result()
    assert out.metrics["loss:sum"] == pytest.approx(expected("importance_sampling", out), rel=1e-4)
    # On-policy (no step since sampling) the ratio is 1 on sampled tokens: the loss is -sum(A) per token,
    # up to the sampler-trainer logprob gap (float32: ~1e-5; bfloat16: its precision, two implementations).
    on_policy = -sum(a * len(s.tokens) for a, s in zip(advantages_g, result.sequences, strict=True))
    tolerance = 1e-3 if resolve_dtype("auto", torch.device("cpu")) == torch.float32 else 0.05
    assert out.metrics["loss:sum"] == pytest.approx(on_policy, abs=tolerance)
    training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    clip = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    ppo = training.forward_backward(datums, "ppo", loss_fn_config=clip).result()
    assert ppo.metrics["loss:sum"] == pytest.approx(expected("ppo", ppo), rel=1e-4)


def test_unknown_loss_is_a_user_error_and_the_client_keeps_working(service, tokens) -> None:
    training = service.create_lora_training_client(base_model=BASE, rank=4).result()
    with pytest.raises(tinker.RequestFailedError) as failed:
        training.forward_backward([sft_datum(tokens)], "gspo").result()
    assert failed.value.category == types.RequestErrorCategory.User and "cross_entropy" in str(failed.value)
    assert training.optim_step(types.AdamParams(learning_rate=1e-3)).result() is not None
    assert "loss:sum" in training.forward([sft_datum(tokens)], "cross_entropy").result().metrics


def test_checkpoints_are_listed_described_deleted(server: BackgroundServer, service, tokens) -> None:
    training = service.create_lora_training_client(base_model=BASE, rank=8, seed=4).result()
    state = training.save_state("c1").result()
    sampler = training.save_weights_for_sampler("s1").result()
    rest = tinker.RestClient(base_url=server.url)
    listed = rest.list_checkpoints(training.model_id).result().checkpoints
    assert {c.checkpoint_id for c in listed} == {"weights/c1", "sampler_weights/s1"}
    assert {c.tinker_path for c in listed} == {state.path, sampler.path}
    info = rest.get_weights_info_by_tinker_path(state.path).result()
    assert (info.base_model, info.lora_rank, info.is_lora) == (BASE, 8, True)
    run = rest.get_training_run_by_tinker_path(state.path).result()
    assert run.training_run_id == training.model_id and run.last_checkpoint.tinker_path == state.path
    with pytest.raises(tinker.RequestFailedError, match="already exists"):
        training.save_state("c1").result()
    rest.delete_checkpoint_from_tinker_path(sampler.path).result()
    assert [c.checkpoint_id for c in rest.list_checkpoints(training.model_id).result().checkpoints] == [
        "weights/c1"
    ]
    with pytest.raises(tinker.NotFoundError):
        service.create_sampling_client(model_path=sampler.path).result()


def test_api_keys_are_enforced(tiny_model_dir: Path, tmp_path: Path) -> None:
    config = ServiceConfig(
        base_models={BASE: str(tiny_model_dir)}, state_dir=tmp_path, api_keys=["tml-secret"]
    )
    with BackgroundServer(create_app(config)) as running:
        assert httpx.get(f"{running.url}/api/v1/healthz").status_code == 200  # probes need no key
        for headers in ({}, {"X-API-Key": "tml-wrong"}):
            response = httpx.post(f"{running.url}/api/v1/client/config", json={}, headers=headers)
            assert response.status_code == 401 and "X-API-Key" in response.json()["detail"]
        with pytest.raises(tinker.AuthenticationError):
            tinker.RestClient(base_url=running.url, api_key="tml-wrong").get_server_capabilities().result()
        caps = (
            tinker.RestClient(base_url=running.url, api_key="tml-secret").get_server_capabilities().result()
        )
        assert caps.supported_models[0].model_name == BASE


def test_a_refused_training_client_leaves_no_training_run(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A create_lora_training_client that the worker refuses used to stay listed: with `serve --engine vllm`,
    list_training_runs counted 2 runs after one refused LoRA (train_unembed=True, where vLLM cannot adapt
    the LM head) and one created. The SDK raised instead of handing out the model's id, so it is no training
    run: not listed, not counted, and its id answers 404. The compute here is told what `--engine vllm`
    tells it (`app.py`: the modules vLLM's LoRA adapts), so the refusal is that one, without vLLM."""
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    config = ServiceConfig(base_models={BASE: str(tiny_model_dir)}, state_dir=tmp_path)
    compute = load_compute(config)
    compute.sample_only_on(
        BASE, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    with BackgroundServer(create_app(config, compute=compute)) as running:
        service = tinker.ServiceClient(base_url=running.url, api_key="tml-test")
        with pytest.raises(tinker.TinkerError, match="create the LoRA with train_unembed=False"):
            service.create_lora_training_client(base_model=BASE, rank=4).result()
        training = service.create_lora_training_client(base_model=BASE, rank=4, train_unembed=False).result()
        created = training.model_id
        rest = tinker.RestClient(base_url=running.url, api_key="tml-test")
        runs = rest.list_training_runs().result()
        assert [run.training_run_id for run in runs.training_runs] == [created]
        assert runs.cursor.total_count == 1
        refused = created.rpartition(":")[0] + ":0"  # the session's first model id: the refused one
        assert created != refused
        with pytest.raises(tinker.NotFoundError, match="its creation failed"):
            rest.get_training_run(refused).result()
        assert rest.get_training_run(created).result().training_run_id == created


def test_non_loopback_without_keys_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="--api-key"):
        serve({"tiny": "unused"}, None, "0.0.0.0", 0, [], str(tmp_path))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "inflight.cli",
            "serve",
            "--base-model",
            "tiny=/nowhere",
            "--host",
            "10.1.2.3",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "refusing to serve on '10.1.2.3'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_old_in_memory_snapshots_are_freed_with_a_clear_error(service, tokens) -> None:
    training = service.create_lora_training_client(base_model=BASE, rank=4, seed=5).result()
    oldest = training.save_weights_and_get_sampling_client().result()
    newest = oldest
    for _ in range(WorkerConfig().max_snapshots_per_model):  # each RL step makes one; memory must not grow
        newest = training.save_weights_and_get_sampling_client().result()
    prompt, params = types.ModelInput.from_ints(tokens[:4]), types.SamplingParams(max_tokens=2)
    with pytest.raises(tinker.RequestFailedError, match="freed") as failed:
        oldest.sample(prompt, 1, params).result()
    assert failed.value.category == types.RequestErrorCategory.User
    assert len(newest.sample(prompt, 1, params).result().sequences) == 1


def test_a_bfloat16_service_trains_and_samples(tiny_model_dir: Path, tmp_path: Path, tokens) -> None:
    """`inflight serve --dtype bfloat16` end to end: the base weights in bfloat16 reach the engine, the SDK's
    loop lowers the loss, and a seeded sample repeats; log-probs stay within bfloat16's rounding of the
    float32 model's."""
    config = ServiceConfig(base_models={BASE: str(tiny_model_dir)}, state_dir=tmp_path, dtype="bfloat16")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TINKER_API_KEY", "tml-test")
        mp.setenv("TINKER_TELEMETRY", "0")
        with BackgroundServer(create_app(config)) as running:
            client = tinker.ServiceClient(base_url=running.url)
            training = client.create_lora_training_client(base_model=BASE, rank=8, seed=0).result()
            datum = sft_datum(tokens)
            first = training.forward([datum], "cross_entropy").result()
            error = (logprobs_of(first) - reference_logprobs(tiny_model_dir, tokens)).abs().max()
            assert 1e-4 < float(error) < 0.03  # bfloat16's rounding, not float32's (< 1e-5 here)
            for _ in range(4):
                training.forward_backward([datum], "cross_entropy")
                training.optim_step(types.AdamParams(learning_rate=3e-3))
            last = training.forward([datum], "cross_entropy").result()
            assert last.metrics["loss:sum"] < 0.8 * first.metrics["loss:sum"]
            sampler = training.save_weights_and_get_sampling_client().result()
            prompt = types.ModelInput.from_ints(tokens[:6])
            params = types.SamplingParams(max_tokens=6, seed=5)
            once, again = (sampler.sample(prompt, 2, params).result() for _ in range(2))
            assert [s.tokens for s in once.sequences] == [s.tokens for s in again.sequences]
            client.close("success").result()
