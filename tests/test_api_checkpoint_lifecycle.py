"""The checkpoint lifecycle through the unmodified `tinker` SDK against a live server: archive download and
loading the adapter in `peft`, publish and unpublish, listing across runs, expiry, and what loading a
training checkpoint with and without its optimizer state means.

Reference: issue 15 item 3; /work/shared/reference/tinker-api.md §4 (checkpoint routes), §7.2 (AdamW as
`torch.optim.AdamW`), §9 (paths). The archive URL route and its keyless download follow the SDKs that still
have `get_checkpoint_archive_url` (up to 0.30.4: a JSON `{"url", "expires"}`, then a plain `urllib` GET);
0.38 dropped the method, so this file asks for the URL over HTTP and `test_api_sdk_range.py` runs the older
SDKs' own download. Independent references: `peft` over the exported adapter with plain `transformers`, and
`torch.optim.AdamW` stepping that model.
"""

from __future__ import annotations

import io
import tarfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
import tinker
import torch

from inflight.api.app import BackgroundServer, create_app
from inflight.api.db import utcnow
from inflight.api.ids import parse_checkpoint_path
from inflight.api.service import ServiceConfig, ServiceState

pytestmark = pytest.mark.slow
types = tinker.types

BASE = "tiny-base"
KEY = "tml-lifecycle"
TOKENS = [5, 17, 3, 42, 8, 99, 23, 7, 61, 12, 4, 30, 77, 15, 9, 50, 21, 6]
# eps well above the tiny gradients' rounding, so Adam's first step (g / (|g| + eps)) is smooth in g and
# a float32 reference reproduces it; the SDK's default 1e-12 would turn it into sign(g).
ADAM = types.AdamParams(learning_rate=2e-2, eps=1e-4)


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    config = ServiceConfig(
        base_models={BASE: str(tiny_model_dir)},
        state_dir=tmp_path_factory.mktemp("serve"),
        api_keys=[KEY],
        dtype="float32",  # compared with plain float32 transformers + peft
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TINKER_API_KEY", KEY)
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
def rest(server: BackgroundServer) -> tinker.RestClient:
    return tinker.RestClient(base_url=server.url)


def state_of(server: BackgroundServer) -> ServiceState:
    state: ServiceState = server.app.state.service
    return state


def datum() -> types.Datum:
    weights = [0.0] * 3 + [1.0] * (len(TOKENS) - 4)
    return types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS[:-1]),
        loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": weights},
    )


def logprobs(training: tinker.TrainingClient) -> torch.Tensor:
    output = training.forward([datum()], "cross_entropy").result()
    return torch.tensor(output.loss_fn_outputs[0]["logprobs"].tolist(), dtype=torch.float64)


def train(training: tinker.TrainingClient, steps: int) -> None:
    for _ in range(steps):
        training.forward_backward([datum()], "cross_entropy")
        training.optim_step(ADAM).result()


def checkpoint_route(server: BackgroundServer, tinker_path: str, suffix: str) -> str:
    parsed = types.ParsedCheckpointTinkerPath.from_tinker_path(tinker_path)
    run, checkpoint = parsed.training_run_id, parsed.checkpoint_id
    return f"{server.url}/api/v1/training_runs/{run}/checkpoints/{checkpoint}/{suffix}"


def archive_url(server: BackgroundServer, tinker_path: str) -> str:
    """What the SDKs up to 0.30.4 do in get_checkpoint_archive_url: GET .../archive with the key."""
    response = httpx.get(checkpoint_route(server, tinker_path, "archive"), headers={"X-API-Key": KEY})
    assert response.status_code == 200, response.text
    body = response.json()
    assert set(body) == {"url", "expires"}
    url: str = body["url"]
    return url


def download(url: str, into: Path) -> list[str]:
    """As `tinker checkpoint download` does: urllib, no API key; then a safe extract."""
    with urllib.request.urlopen(url, timeout=60) as response:
        data = response.read()
        assert int(response.headers["Content-Length"]) == len(data)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        names = tar.getnames()
        tar.extractall(into, filter="data")
    return names


def peft_model(base_dir: Path, adapter_dir: Path, *, trainable: bool = False) -> torch.nn.Module:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter_dir, is_trainable=trainable)
    return model.train(False)


def peft_logprobs(model: torch.nn.Module, *, grad: bool = False) -> torch.Tensor:
    with torch.set_grad_enabled(grad):
        logits = model(input_ids=torch.tensor([TOKENS[:-1]])).logits[0]
    lp = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(TOKENS[1:])[:, None])[:, 0]
    return lp if grad else lp.double()


def test_an_exported_adapter_loads_in_peft_and_gives_the_services_logprobs(
    server: BackgroundServer, service: tinker.ServiceClient, tiny_model_dir: Path, tmp_path: Path
) -> None:
    training = service.create_lora_training_client(base_model=BASE, rank=8, seed=0).result()
    train(training, 3)
    sampler = training.save_weights_for_sampler("export").result()
    state = training.save_state("export").result()
    served = logprobs(training)

    names = download(archive_url(server, sampler.path), tmp_path / "sampler")
    assert {"adapter_model.safetensors", "adapter_config.json", "checkpoint_complete"} <= set(names)
    model = peft_model(tiny_model_dir, tmp_path / "sampler")
    exported = peft_logprobs(model)
    with model.disable_adapter():
        base_only = peft_logprobs(model)
    assert (served - base_only).abs().max() > 1e-2  # training moved it: the comparison below means something
    torch.testing.assert_close(exported, served, atol=1e-4, rtol=0)

    # A training checkpoint's archive holds the same PEFT adapter, plus its optimizer state.
    names = download(archive_url(server, state.path), tmp_path / "state")
    assert "optimizer.safetensors" in names
    torch.testing.assert_close(
        peft_logprobs(peft_model(tiny_model_dir, tmp_path / "state")), served, atol=1e-4, rtol=0
    )


def test_archive_links_are_signed_expiring_and_name_only_checkpoints(
    server: BackgroundServer, service: tinker.ServiceClient
) -> None:
    training = service.create_lora_training_client(base_model=BASE, rank=4, seed=1).result()
    one = training.save_weights_for_sampler("one").result().path
    two = training.save_weights_for_sampler("two").result().path
    url = archive_url(server, one)
    split = urlsplit(url)
    query = {k: v[0] for k, v in parse_qs(split.query).items()}
    assert split.path.startswith("/api/v1/archives/") and set(query) == {"expires", "signature"}

    def get(path: str, **params: str) -> httpx.Response:
        return httpx.get(f"{server.url}{path}", params=params)  # no API key, as urllib sends it

    assert get(split.path, **query).status_code == 200
    # The key alone does not open a download, and the URL route itself still needs the key.
    assert httpx.get(f"{server.url}{split.path}", headers={"X-API-Key": KEY}).status_code == 422
    assert httpx.get(checkpoint_route(server, one, "archive")).status_code == 401
    forged = {**query, "signature": "0" * 64}
    later = {**query, "expires": str(int(query["expires"]) + 3600)}
    other_path = split.path.replace("/one", "/two")  # a signature is for one checkpoint only
    for path, params in ((split.path, forged), (split.path, later), (other_path, query)):
        response = get(path, **params)
        assert response.status_code == 403 and "not valid" in response.json()["detail"], response.text

    signer = state_of(server).archive_signer
    stale = signer.sign(parse_checkpoint_path(two), utcnow() - timedelta(seconds=1))
    response = get(other_path, expires=str(int(stale.expires.timestamp())), signature=stale.signature)
    assert response.status_code == 403 and "expired" in response.json()["detail"]

    # Every name is checked before the signature, and nothing outside the checkpoints is ever served.
    model_id = parse_checkpoint_path(one).model_id
    hostile = [
        f"/api/v1/archives/{model_id}/sampler_weights/..",
        f"/api/v1/archives/{model_id}/sampler_weights/%2e%2e",
        f"/api/v1/archives/{model_id}/../../../etc/passwd",
        f"/api/v1/archives/{model_id}/sampler_weights/..%2f..%2f..%2fservice.db",
        "/api/v1/archives/..%2f..%2fetc/sampler_weights/one",
        f"/api/v1/archives/{model_id}/other/one",
        "/api/v1/archives/%2e%2e/%2e%2e/checkpoints",  # the keyless prefix leads to no other route
        "/api/v1/archives/..%2f..%2fcheckpoints",
    ]
    for path in hostile:
        response = get(path, **query)
        assert 400 <= response.status_code < 500 and response.status_code != 200, (path, response.text)
    for bad in ("..", "a%2fb", "%2e%2e"):
        response = httpx.get(
            f"{server.url}/api/v1/training_runs/{model_id}/checkpoints/sampler_weights/{bad}/archive",
            headers={"X-API-Key": KEY},
        )
        assert 400 <= response.status_code < 500, (bad, response.text)


def test_publish_unpublish_and_listing_across_runs(
    server: BackgroundServer, service: tinker.ServiceClient, rest: tinker.RestClient
) -> None:
    first = service.create_lora_training_client(base_model=BASE, rank=4, seed=2).result()
    second = service.create_lora_training_client(base_model=BASE, rank=4, seed=3).result()
    a = first.save_state("a").result().path
    b = second.save_weights_for_sampler("b").result().path
    c = second.save_state("c").result().path

    listed = rest.list_user_checkpoints(limit=1000).result()
    paths = [ckpt.tinker_path for ckpt in listed.checkpoints]
    assert {a, b, c} <= set(paths)
    assert paths.index(c) < paths.index(b) < paths.index(a)  # newest first, across both runs
    assert listed.cursor is not None and listed.cursor.total_count == len(paths)
    page = rest.list_user_checkpoints(limit=1, offset=1).result()
    assert [ckpt.tinker_path for ckpt in page.checkpoints] == paths[1:2]

    def public(path: str) -> bool:
        run = types.ParsedCheckpointTinkerPath.from_tinker_path(path).training_run_id
        (mine,) = [x for x in rest.list_checkpoints(run).result().checkpoints if x.tinker_path == path]
        (everyone,) = [
            x for x in rest.list_user_checkpoints(limit=1000).result().checkpoints if x.tinker_path == path
        ]
        assert mine.public == everyone.public
        return mine.public

    assert not public(b)
    rest.publish_checkpoint_from_tinker_path(b).result()
    rest.publish_checkpoint_from_tinker_path(b).result()  # idempotent: a retried publish is no error
    assert public(b) and not public(c)
    rest.unpublish_checkpoint_from_tinker_path(b).result()
    assert not public(b)
    with pytest.raises(tinker.NotFoundError):
        rest.publish_checkpoint_from_tinker_path(f"tinker://{second.model_id}/weights/never-saved").result()


def test_an_expired_checkpoint_answers_clearly_naming_its_expiry(
    server: BackgroundServer, service: tinker.ServiceClient, rest: tinker.RestClient
) -> None:
    training = service.create_lora_training_client(base_model=BASE, rank=4, seed=4).result()
    state = training.save_state("short", ttl_seconds=1).result().path
    sampler = training.save_weights_for_sampler("short", ttl_seconds=1).result().path
    kept = training.save_state("kept").result().path
    listed = {x.tinker_path: x for x in rest.list_checkpoints(training.model_id).result().checkpoints}
    assert listed[state].expires_at is not None and listed[kept].expires_at is None
    time.sleep(1.2)

    def refused(call: object) -> str:
        with pytest.raises(tinker.APIStatusError) as raised:
            call()  # type: ignore[operator]
        assert raised.value.status_code == 410, raised.value
        return str(raised.value)

    assert "expired" in refused(lambda: service.create_training_client_from_state(state).result())
    assert "expired" in refused(lambda: service.create_sampling_client(model_path=sampler).result())
    assert "expired" in refused(lambda: rest.get_weights_info_by_tinker_path(state).result())
    response = httpx.get(checkpoint_route(server, state, "archive"), headers={"X-API-Key": KEY})
    assert response.status_code == 410 and "expired at" in response.json()["detail"]
    assert "ttl_seconds" in response.json()["detail"]

    # The sweep deletes the files but keeps the answer; listings drop the checkpoint; the name is free again.
    store = state_of(server).checkpoints
    storage = store.final_dir(parse_checkpoint_path(state))
    store.delete_expired()
    assert not storage.exists()
    assert "expired" in refused(lambda: rest.get_weights_info_by_tinker_path(state).result())
    listed_after = [x.tinker_path for x in rest.list_checkpoints(training.model_id).result().checkpoints]
    assert listed_after == [kept]
    assert state not in [x.tinker_path for x in rest.list_user_checkpoints(limit=1000).result().checkpoints]
    assert training.save_state("short").result().path == state
    assert service.create_training_client_from_state(state).result() is not None

    # A TTL can be set and removed later; a TTL out of range is refused naming the field.
    def expires_at(path: str) -> object:
        (found,) = [
            x for x in rest.list_checkpoints(training.model_id).result().checkpoints if x.tinker_path == path
        ]
        return found.expires_at

    rest.set_checkpoint_ttl_from_tinker_path(kept, 3600).result()
    assert expires_at(kept) is not None
    rest.set_checkpoint_ttl_from_tinker_path(kept, None).result()
    assert expires_at(kept) is None
    with pytest.raises(tinker.UnprocessableEntityError, match="ttl_seconds"):
        rest.set_checkpoint_ttl_from_tinker_path(kept, 0).result()


def test_loading_weights_only_starts_a_fresh_adamw_and_with_the_optimizer_continues(
    server: BackgroundServer, service: tinker.ServiceClient, tiny_model_dir: Path, tmp_path: Path
) -> None:
    original = service.create_lora_training_client(base_model=BASE, rank=8, seed=5).result()
    train(original, 2)
    saved = original.save_state("mid").result().path
    at_save = logprobs(original)
    train(original, 1)
    continued = logprobs(original)  # the reference run: the same step with Adam's moments

    # Independent reference for a fresh AdamW: the exported adapter in peft, one torch.optim.AdamW step.
    download(archive_url(server, saved), tmp_path)
    model = peft_model(tiny_model_dir, tmp_path, trainable=True)
    params = [p for p in model.parameters() if p.requires_grad]
    weights = torch.tensor(datum().loss_fn_inputs["weights"].tolist())
    (-(weights * peft_logprobs(model, grad=True)).sum()).backward()
    torch.optim.AdamW(
        params, lr=ADAM.learning_rate, betas=(ADAM.beta1, ADAM.beta2), eps=ADAM.eps, weight_decay=0.0
    ).step()
    fresh_adam = peft_logprobs(model)
    assert (fresh_adam - continued).abs().max() > 0.1  # the two semantics are far apart

    clients = {
        "load_state": service.create_lora_training_client(base_model=BASE, rank=8, seed=6).result(),
        "load_state_with_optimizer": service.create_lora_training_client(
            base_model=BASE, rank=8, seed=7
        ).result(),
        "from_state": service.create_training_client_from_state(saved).result(),
        "from_state_with_optimizer": service.create_training_client_from_state_with_optimizer(saved).result(),
    }
    with pytest.warns(FutureWarning, match="deprecated"):
        clients["load_state"].load_state(saved).result()
    with pytest.warns(FutureWarning, match="deprecated"):
        clients["load_state_with_optimizer"].load_state_with_optimizer(saved).result()
    for how, client in clients.items():
        torch.testing.assert_close(logprobs(client), at_save, atol=1e-6, rtol=0, msg=how)
        train(client, 1)
        if how.endswith("with_optimizer"):  # the same computation as the original's: exact
            torch.testing.assert_close(logprobs(client), continued, atol=1e-5, rtol=0, msg=how)
        else:  # float32 peft vs the service: rounding of a step that moves logprobs by ~3
            torch.testing.assert_close(logprobs(client), fresh_adam, atol=5e-4, rtol=0, msg=how)


def test_a_sampler_checkpoint_saved_again_under_its_name_samples_its_new_weights(
    service: tinker.ServiceClient, rest: tinker.RestClient
) -> None:
    """The engine keeps a sampled checkpoint's weights under its path. Deleted and saved again under the
    same name (new weights), the path used to go on sampling the old ones."""
    training = service.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
    prompt = types.ModelInput.from_ints(TOKENS[:6])
    params = types.SamplingParams(max_tokens=4, seed=3, temperature=1.0)

    def sampled(path: str) -> tuple[list[int], list[float] | None]:
        sampler = service.create_sampling_client(model_path=path).result()
        sequence = sampler.sample(prompt, 1, params).result().sequences[0]
        return list(sequence.tokens), sequence.logprobs

    path = training.save_weights_for_sampler("saved-twice").result().path
    before = sampled(path)
    train(training, 3)
    rest.delete_checkpoint_from_tinker_path(path).result()
    assert training.save_weights_for_sampler("saved-twice").result().path == path
    fresh = training.save_weights_for_sampler("saved-once").result().path
    assert sampled(path) == sampled(fresh) != before
