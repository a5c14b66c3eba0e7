"""Per-API-key tenants: every row a request creates belongs to its key's tenant, and to any other key it
does not exist.

The QA pass that found keys did not partition: with two keys, B listed A's runs and checkpoints, read
weights_info of A's checkpoint, downloaded it, loaded it, stepped A's model, retrieved and cancelled A's
futures, and published, expired and deleted A's checkpoint. Here the same moves, through the unmodified
`tinker` SDK where it can name them and raw HTTP where it cannot (another tenant's ids), each answered
exactly as an id that names nothing (same status, same words but the id), while A's own flow goes on. A
published checkpoint is the one exception, read-only (sample, load, weights_info, archive), as in Tinker:
publishing exists to share; unpublished, it is gone again for B, even through a sampling client or a
download link B got before. A server without keys keeps one shared namespace, and rows written before
tenants existed belong to it. Nor can one key starve the other: its backlog of samples, its models and the
checkpoints it samples are bounded, each limit answered naming it.
"""

from __future__ import annotations

import contextlib
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker
from sqlalchemy import inspect, select

from conftest import sample_body
from inflight.api.app import BackgroundServer, create_app, load_compute
from inflight.api.compute import ServiceCompute, ServiceComputeConfig
from inflight.api.db import Database, FutureRow, ModelRow, SessionRow, sqlite_url
from inflight.api.service import ServiceConfig, ServiceState
from inflight.api.worker import WorkerConfig
from inflight.auth import tenant_of

pytestmark = pytest.mark.slow
types = tinker.types

BASE = "tiny-base"
KEY_A, KEY_B = "tml-tenant-a", "tml-tenant-b"
TOKENS = list(range(5, 30))
ADAM = types.AdamParams(learning_rate=1e-2)
PROMPT = types.ModelInput.from_ints(TOKENS[:5])
PARAMS = types.SamplingParams(max_tokens=4, seed=1)
FAKE_SESSION = "session-0000000000000000"  # the shape of a real session id, naming nothing
FAKE_MODEL = f"{FAKE_SESSION}:train:0"
FAKE_REQUEST = "999999999"
# A request to a route that takes an id, given the id: (method, route, JSON body).
Build = Callable[[str], tuple[str, str, Any]]


def service_config(state_dir: Path, tiny_model_dir: Path, api_keys: list[str]) -> ServiceConfig:
    return ServiceConfig(base_models={BASE: str(tiny_model_dir)}, state_dir=state_dir, api_keys=api_keys)


@contextlib.contextmanager
def running(config: ServiceConfig) -> Iterator[BackgroundServer]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TINKER_TELEMETRY", "0")
        mp.setenv("HF_HUB_OFFLINE", "1")
        with BackgroundServer(create_app(config)) as server:
            yield server


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    with running(service_config(tmp_path_factory.mktemp("tenants"), tiny_model_dir, [KEY_A, KEY_B])) as s:
        yield s


def state_of(server: BackgroundServer) -> ServiceState:
    state: ServiceState = server.app.state.service
    return state


def datum() -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS[:-1]), loss_fn_inputs={"target_tokens": TOKENS[1:]}
    )


def http(server: BackgroundServer, key: str) -> httpx.Client:
    return httpx.Client(base_url=f"{server.url}/api/v1", headers={"X-API-Key": key}, timeout=60)


def checkpoint_route(tinker_path: str, suffix: str = "") -> str:
    parsed = types.ParsedCheckpointTinkerPath.from_tinker_path(tinker_path)
    route = f"/training_runs/{parsed.training_run_id}/checkpoints/{parsed.checkpoint_id}"
    return f"{route}/{suffix}" if suffix else route


def result(client: httpx.Client, request_id: str) -> httpx.Response:
    """Long-poll a future until it is finished."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        response = client.post("/retrieve_future", json={"request_id": request_id})
        assert response.status_code == 200, response.text
        if "json" not in response.headers["content-type"] or response.json().get("type") != "try_again":
            return response
    pytest.fail(f"future {request_id} did not finish")


@dataclass
class World:
    """What tenant A made: a trained model, a training and a sampler checkpoint, a sampling session."""

    service: tinker.ServiceClient
    rest: tinker.RestClient
    training: tinker.TrainingClient
    state_path: str
    sampler_path: str
    session_id: str
    sampling_session_id: str


@pytest.fixture(scope="module")
def world(server: BackgroundServer) -> Iterator[World]:
    service = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
    training = service.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
    training.forward_backward([datum()], "cross_entropy")
    training.optim_step(ADAM).result()
    state_path = training.save_state("a-state").result().path
    sampler_path = training.save_weights_for_sampler("a-sampler").result().path
    session_id = training.model_id.rpartition(":train:")[0]
    with http(server, KEY_A) as a:
        body = {"session_id": session_id, "sampling_session_seq_id": 900, "base_model": BASE}
        response = a.post("/create_sampling_session", json=body)
        assert response.status_code == 200, response.text
    yield World(
        service,
        tinker.RestClient(base_url=server.url, api_key=KEY_A),
        training,
        state_path,
        sampler_path,
        session_id,
        response.json()["sampling_session_id"],
    )
    service.close("success").result()


@pytest.fixture(scope="module")
def b_service(server: BackgroundServer) -> Iterator[tinker.ServiceClient]:
    service = tinker.ServiceClient(base_url=server.url, api_key=KEY_B)
    yield service
    service.close("success").result()


def same_as_unknown(theirs: httpx.Response, unknown: httpx.Response, their_id: str, fake_id: str) -> None:
    """`theirs` (a request naming another tenant's id) answers exactly as `unknown` (the same request
    naming an id that exists nowhere): same status, same words once each id is blanked out."""
    assert theirs.status_code == unknown.status_code == 404, (theirs.text, unknown.text)
    detail, expected = theirs.json()["detail"], unknown.json()["detail"]
    assert detail.replace(their_id, "ID") == expected.replace(fake_id, "ID"), (detail, expected)


def test_tenant_ids_are_a_hash_prefix_of_the_key_never_the_key() -> None:
    assert tenant_of(KEY_A) != tenant_of(KEY_B)
    assert len(tenant_of(KEY_A)) == 16 and int(tenant_of(KEY_A), 16) >= 0
    assert KEY_A not in tenant_of(KEY_A) and tenant_of(KEY_A) == tenant_of(KEY_A.encode())


def test_another_tenants_runs_and_checkpoints_are_not_listed(
    server: BackgroundServer, world: World, b_service: tinker.ServiceClient
) -> None:
    mine = world.rest.list_training_runs(limit=1000).result()
    assert world.training.model_id in [run.training_run_id for run in mine.training_runs]
    assert {world.state_path, world.sampler_path} <= {
        c.tinker_path for c in world.rest.list_user_checkpoints(limit=1000).result().checkpoints
    }

    b_training = b_service.create_lora_training_client(base_model=BASE, rank=4, seed=1).result()
    b_path = b_training.save_state("b-state").result().path
    b_rest = tinker.RestClient(base_url=server.url, api_key=KEY_B)
    runs = b_rest.list_training_runs(limit=1000).result()
    assert [run.training_run_id for run in runs.training_runs] == [b_training.model_id]
    assert runs.cursor is not None and runs.cursor.total_count == 1
    checkpoints = b_rest.list_user_checkpoints(limit=1000).result()
    assert [c.tinker_path for c in checkpoints.checkpoints] == [b_path]
    assert checkpoints.cursor is not None and checkpoints.cursor.total_count == 1
    # ... and A's listings do not show B's.
    assert b_training.model_id not in [
        run.training_run_id for run in world.rest.list_training_runs(limit=1000).result().training_runs
    ]
    with pytest.raises(tinker.NotFoundError):
        b_rest.get_training_run(world.training.model_id).result()
    with pytest.raises(tinker.NotFoundError):
        b_rest.list_checkpoints(world.training.model_id).result()


def test_another_tenants_ids_answer_exactly_as_unknown_ones(server: BackgroundServer, world: World) -> None:
    """Every route that takes an id, with B's key: A's id and an id that names nothing get one answer."""
    a_model, a_session = world.training.model_id, world.session_id
    store = state_of(server).store
    seq_before = store.max_seq_id(a_model)
    with http(server, KEY_A) as a:
        a_sample = a.post("/asample", json=sample_body(world.sampling_session_id, 1, 4)).json()["request_id"]
        result(a, a_sample)
    datum_json = {
        "model_input": {"chunks": [{"type": "encoded_text", "tokens": TOKENS[:-1]}]},
        "loss_fn_inputs": {"target_tokens": {"data": TOKENS[1:], "dtype": "int64"}},
    }
    with http(server, KEY_B) as b:
        b_session = b.post("/create_session", json={}).json()["session_id"]

        def on_model(route: str, **extra: Any) -> Build:
            return lambda model: ("POST", route, {"model_id": model, "seq_id": 1_000, **extra})

        def on_session(route: str, **extra: Any) -> Build:
            return lambda session: ("POST", route, {"session_id": session, **extra})

        def on_checkpoint(path: str, method: str, suffix: str = "", body: Any = None) -> Build:
            return lambda model: (method, checkpoint_route(path.replace(a_model, model), suffix), body)

        # For each route that takes an id: the request, given the id (A's, or one naming nothing).
        model_cases: list[Build] = [
            lambda model: ("POST", "/get_info", {"model_id": model}),
            on_model("/optim_step", adam_params={"learning_rate": 1e-2}),
            on_model("/save_weights", path="stolen"),
            on_model("/save_weights_for_sampler", path="stolen"),
            on_model("/load_weights", path=world.state_path),
            on_model(
                "/forward_backward", forward_backward_input={"data": [datum_json], "loss_fn": "cross_entropy"}
            ),
            on_model("/forward", forward_input={"data": [datum_json], "loss_fn": "cross_entropy"}),
            lambda model: ("GET", f"/training_runs/{model}", None),
            lambda model: ("GET", f"/training_runs/{model}/checkpoints", None),
            # B's own session, A's checkpoint
            lambda model: (
                "POST",
                "/create_sampling_session",
                {
                    "session_id": b_session,
                    "sampling_session_seq_id": 0,
                    "model_path": world.sampler_path.replace(a_model, model),
                },
            ),
            lambda model: (
                "POST",
                "/load_weights",
                {
                    "session_id": b_session,
                    "model_seq_id": 0,
                    "path": world.state_path.replace(a_model, model),
                },
            ),
        ]
        for path in (world.state_path, world.sampler_path):
            model_cases += [
                lambda model, path=path: (
                    "POST",
                    "/weights_info",
                    {"tinker_path": path.replace(a_model, model)},
                ),
                on_checkpoint(path, "GET", "archive"),
                on_checkpoint(path, "DELETE"),
                on_checkpoint(path, "POST", "publish"),
                on_checkpoint(path, "DELETE", "publish"),
                on_checkpoint(path, "PUT", "ttl", {"ttl_seconds": 1}),
            ]
        session_cases: list[Build] = [
            on_session("/session_heartbeat"),
            on_session("/create_model", model_seq_id=77, base_model=BASE, lora_config={"rank": 4}),
            on_session("/create_sampling_session", sampling_session_seq_id=77, base_model=BASE),
            on_session("/load_weights", model_seq_id=78, path=world.state_path),
            lambda session: ("POST", f"/sessions/{session}/finish", {"reason": {"type": "success"}}),
        ]
        sampler_cases: list[Build] = [
            lambda sampler: ("GET", f"/samplers/{sampler}", None),
            lambda sampler: ("POST", "/asample", sample_body(sampler, 50, 4)),
        ]
        future_cases: list[Build] = [
            lambda request_id, route=route: ("POST", route, {"request_id": request_id})
            for route in ("/retrieve_future", "/cancel_future")
        ]
        for cases, theirs_id, fake_id in (
            (model_cases, a_model, FAKE_MODEL),
            (session_cases, a_session, FAKE_SESSION),
            (sampler_cases, world.sampling_session_id, f"{FAKE_SESSION}:sample:900"),
            (future_cases, a_sample, FAKE_REQUEST),
        ):
            for build in cases:
                method, route, body = build(theirs_id)
                theirs = b.request(method, route, json=body)
                assert theirs.status_code == 404, (method, route, theirs.text)
                fake_method, fake_route, fake_body = build(fake_id)
                same_as_unknown(
                    theirs, b.request(fake_method, fake_route, json=fake_body), theirs_id, fake_id
                )
        # An invalid body naming A's model is a 422, as for a model that does not exist (no failed future
        # recorded on A's model, which would take A's next seq_id).
        bad = {"model_id": a_model, "seq_id": 1_001, "adam_params": {"learning_rate": "x"}}
        assert b.post("/optim_step", json=bad).status_code == 422

    # Nothing B sent reached A's model, session, futures or checkpoints.
    assert store.max_seq_id(a_model) == seq_before
    assert store.get(a_sample).status == "done" and store.get(a_sample).error is None
    listed = {c.tinker_path: c for c in world.rest.list_checkpoints(a_model).result().checkpoints}
    for path in (world.state_path, world.sampler_path):
        assert not listed[path].public and listed[path].expires_at is None
    assert not any("stolen" in path for path in listed)
    # A's own flow goes on, through the SDK: train, save, sample, list, retrieve.
    world.training.forward_backward([datum()], "cross_entropy")
    world.training.optim_step(ADAM).result()
    sampling = world.training.save_weights_and_get_sampling_client().result()
    assert len(sampling.sample(PROMPT, 1, PARAMS).result().sequences) == 1
    assert world.rest.get_training_run(a_model).result().training_run_id == a_model
    assert world.rest.get_weights_info_by_tinker_path(world.state_path).result().lora_rank == 4


def test_a_pending_future_of_another_tenant_can_be_neither_retrieved_nor_cancelled(
    server: BackgroundServer, world: World
) -> None:
    with http(server, KEY_A) as a, http(server, KEY_B) as b:
        long_sample = a.post("/asample", json=sample_body(world.sampling_session_id, 2, 300)).json()
        request_id = long_sample["request_id"]
        for route in ("/retrieve_future", "/cancel_future"):
            theirs = b.post(route, json={"request_id": request_id})
            unknown = b.post(route, json={"request_id": FAKE_REQUEST})
            same_as_unknown(theirs, unknown, request_id, FAKE_REQUEST)
        finished = result(a, request_id)
        assert "json" not in finished.headers["content-type"], finished.text  # done, not cancelled
        assert a.post("/cancel_future", json={"request_id": request_id}).status_code == 400  # A: finished


def test_a_published_checkpoint_is_read_only_for_others_and_gone_again_once_unpublished(
    server: BackgroundServer, world: World, b_service: tinker.ServiceClient
) -> None:
    b_rest = tinker.RestClient(base_url=server.url, api_key=KEY_B)
    sampler_path, state_path = world.sampler_path, world.state_path
    # Unpublished: nothing for B, through the SDK either.
    with pytest.raises(tinker.NotFoundError):
        b_service.create_sampling_client(model_path=sampler_path).result()
    with pytest.raises(tinker.NotFoundError):
        b_service.create_training_client_from_state(state_path).result()

    world.rest.publish_checkpoint_from_tinker_path(sampler_path).result()
    world.rest.publish_checkpoint_from_tinker_path(state_path).result()
    try:
        info = b_rest.get_weights_info_by_tinker_path(sampler_path).result()
        assert info.base_model == BASE and info.lora_rank == 4
        sampling = b_service.create_sampling_client(model_path=sampler_path).result()
        own = world.service.create_sampling_client(model_path=sampler_path).result()
        sequences = sampling.sample(PROMPT, 1, PARAMS).result().sequences
        assert [s.tokens for s in sequences] == [
            s.tokens for s in own.sample(PROMPT, 1, PARAMS).result().sequences
        ]
        loaded = b_service.create_training_client_from_state_with_optimizer(state_path).result()
        assert loaded.model_id.rpartition(":train:")[0] != world.session_id  # B's own model, in B's session
        loaded.forward_backward([datum()], "cross_entropy")
        loaded.optim_step(ADAM).result()  # B trains its copy; A's run is untouched
        with http(server, KEY_B) as b:
            link = b.get(checkpoint_route(sampler_path, "archive"))
            assert link.status_code == 200, link.text
            with urllib.request.urlopen(link.json()["url"], timeout=60) as download:
                assert download.status == 200 and download.read()
            # Read-only: the owner's operations stay the owner's.
            for method, route, body in (
                ("DELETE", checkpoint_route(sampler_path), None),
                ("DELETE", checkpoint_route(sampler_path, "publish"), None),
                ("PUT", checkpoint_route(sampler_path, "ttl"), {"ttl_seconds": 1}),
            ):
                refused = b.request(method, route, json=body)
                assert refused.status_code == 404 and "no checkpoint" in refused.json()["detail"], (
                    refused.text
                )
        # Published checkpoints of others are readable, not listed: a listing is what one owns.
        assert sampler_path not in [
            c.tinker_path for c in b_rest.list_user_checkpoints(limit=1000).result().checkpoints
        ]
        with pytest.raises(tinker.NotFoundError):
            b_rest.list_checkpoints(world.training.model_id).result()
    finally:
        world.rest.unpublish_checkpoint_from_tinker_path(sampler_path).result()
        world.rest.unpublish_checkpoint_from_tinker_path(state_path).result()

    # Unpublished again: B's sampling client, weights_info, loads and the link B was given all stop.
    with pytest.raises(tinker.NotFoundError):
        b_rest.get_weights_info_by_tinker_path(sampler_path).result()
    with pytest.raises(tinker.NotFoundError):
        b_service.create_sampling_client(model_path=sampler_path).result()
    with pytest.raises(tinker.NotFoundError):
        b_service.create_training_client_from_state(state_path).result()
    with pytest.raises(Exception, match="no checkpoint"):
        sampling.sample(PROMPT, 1, PARAMS).result(timeout=60)
    with pytest.raises(urllib.error.HTTPError) as refused_download:
        urllib.request.urlopen(link.json()["url"], timeout=60)
    assert refused_download.value.code == 403
    with http(server, KEY_B) as b:
        assert b.get(checkpoint_route(sampler_path, "archive")).status_code == 404
    # The owner's own sampling client and links are unaffected.
    assert len(own.sample(PROMPT, 1, PARAMS).result().sequences) == 1
    with http(server, KEY_A) as a:
        url = a.get(checkpoint_route(sampler_path, "archive")).json()["url"]
        with urllib.request.urlopen(url, timeout=60) as download:
            assert download.status == 200


@pytest.mark.parametrize(
    ("sample_rows", "worker"),
    [
        # The database's queue: one sample future with the engine at a time, so the rest wait pending.
        (256, WorkerConfig(max_sample_futures_in_flight=1)),
        # The engine's queue: room for every future, two rows, and a share of two sequences per tenant.
        (2, WorkerConfig(max_samples_in_flight_per_tenant=2)),
    ],
    ids=["pending", "engine"],
)
def test_one_tenants_backlog_of_samples_queues_no_other_tenants_sample_behind_it(
    tiny_model_dir: Path, tmp_path: Path, sample_rows: int, worker: WorkerConfig
) -> None:
    """B queues ten long samples, then A one short one: A's is served within B's first few, not after all
    of them. (Claimed oldest first, A's sample waited for every one of B's, which the earlier probe
    measured as over five minutes behind 200 samples; a tenant's backlog could also fill the engine's
    first-come queue.)"""
    config = service_config(tmp_path, tiny_model_dir, [KEY_A, KEY_B])
    compute = ServiceCompute(
        config.base_models,
        max_rank=config.max_lora_rank,
        config=ServiceComputeConfig(max_sample_rows=sample_rows),
    )
    with (
        BackgroundServer(create_app(config, compute=compute, worker_config=worker)) as server,
        http(server, KEY_A) as a,
        http(server, KEY_B) as b,
    ):

        def sampler(client: httpx.Client) -> str:
            session = client.post("/create_session", json={}).json()["session_id"]
            body = {"session_id": session, "sampling_session_seq_id": 0, "base_model": BASE}
            return client.post("/create_sampling_session", json=body).json()["sampling_session_id"]

        b_sampler, a_sampler = sampler(b), sampler(a)
        backlog = [
            b.post("/asample", json=sample_body(b_sampler, seq, 100)).json()["request_id"]
            for seq in range(10)
        ]
        mine = a.post("/asample", json=sample_body(a_sampler, 0, 1)).json()["request_id"]
        assert "json" not in result(a, mine).headers["content-type"]
        store = state_of(server).store
        unfinished = [r for r in backlog if not store.get(r).finished]
        assert len(unfinished) >= 6, f"A's sample waited for {10 - len(unfinished)} of B's 10"
        for request_id in unfinished:
            b.post("/cancel_future", json={"request_id": request_id})


def test_one_key_queues_at_most_its_limit_and_the_rest_fail_naming_it(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Nothing bounded how much one key queued: every pending sample is looked over by each claim of the
    worker (100,000 queued made a claim ~200 ms, for every tenant) and stays in the database. Past
    `max_queued_requests_per_tenant` a request is recorded as failed, naming the limit and the way on; the
    other key queues and is served as before, and a finished request makes room again."""
    config = service_config(tmp_path, tiny_model_dir, [KEY_A, KEY_B]).model_copy(
        update={"max_queued_requests_per_tenant": 3}
    )
    worker = WorkerConfig(max_sample_futures_in_flight=1)  # the rest wait pending, counted
    with (
        BackgroundServer(create_app(config, worker_config=worker)) as server,
        http(server, KEY_A) as a,
        http(server, KEY_B) as b,
    ):

        def sampler(client: httpx.Client) -> str:
            session = client.post("/create_session", json={}).json()["session_id"]
            body = {"session_id": session, "sampling_session_seq_id": 0, "base_model": BASE}
            return client.post("/create_sampling_session", json=body).json()["sampling_session_id"]

        b_sampler, a_sampler = sampler(b), sampler(a)
        sent = [b.post("/asample", json=sample_body(b_sampler, seq, 300)) for seq in range(5)]
        assert all(response.status_code == 200 for response in sent), [r.text for r in sent]
        backlog, refused = sent[:3], sent[3:]
        for response in refused:
            failed = result(b, response.json()["request_id"]).json()
            assert failed["category"] == "user", failed
            assert "already has 3 requests queued or running" in failed["error"], failed
            assert "max_queued_requests_per_tenant=3" in failed["error"], failed
        mine = a.post("/asample", json=sample_body(a_sampler, 0, 1)).json()["request_id"]
        assert "json" not in result(a, mine).headers["content-type"]
        first = backlog[0].json()["request_id"]
        b.post("/cancel_future", json={"request_id": first})
        result(b, first)
        again = b.post("/asample", json=sample_body(b_sampler, 5, 1)).json()["request_id"]
        store = state_of(server).store
        assert store.get(again).status != "failed", store.get(again).error
        for response in backlog[1:]:
            b.post("/cancel_future", json={"request_id": response.json()["request_id"]})


def test_one_training_request_holds_at_most_the_servers_tokens_per_pass(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """One key's forward_backward of a 64 MiB body (millions of tokens) held every other key's training for
    minutes. A request past `max_tokens_per_train_request` fails naming it, keeps its seq_id (the next
    request runs), and one within it trains as before."""
    config = service_config(tmp_path, tiny_model_dir, [KEY_A]).model_copy(
        update={"max_tokens_per_train_request": 16}
    )
    with BackgroundServer(create_app(config)) as server, http(server, KEY_A) as a:
        session_id = a.post("/create_session", json={}).json()["session_id"]
        body = {"session_id": session_id, "model_seq_id": 0, "base_model": BASE, "lora_config": {"rank": 4}}
        created = a.post("/create_model", json=body).json()
        assert "error" not in result(a, created["request_id"]).json()

        def forward_backward(seq_id: int, tokens: int) -> httpx.Response:
            datum = {
                "model_input": {"chunks": [{"type": "encoded_text", "tokens": list(range(5, 5 + tokens))}]},
                "loss_fn_inputs": {"target_tokens": {"data": list(range(6, 6 + tokens)), "dtype": "int64"}},
            }
            request = {"data": [datum, datum], "loss_fn": "cross_entropy"}
            sent = a.post(
                "/forward_backward",
                json={"model_id": created["model_id"], "seq_id": seq_id, "forward_backward_input": request},
            )
            return result(a, sent.json()["request_id"])

        refused = forward_backward(1, 9).json()
        assert refused["category"] == "user", refused
        assert "holds 18 tokens" in refused["error"] and "max_tokens_per_train_request=16" in refused["error"]
        assert "json" not in forward_backward(2, 8).headers["content-type"]  # 16 tokens: trained


def test_another_keys_forward_backward_finishes_while_a_large_one_runs(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A request within `max_tokens_per_train_request` used to run to its end before another key's next one;
    it now runs a slice of `max_train_tokens_per_round` tokens a round, and another key's request joins the
    next round. Driven by the SDK: B's forward_backward, sent once A's has started, is done while A's still
    runs, and A's answer lists every datum."""
    config = service_config(tmp_path, tiny_model_dir, [KEY_A, KEY_B]).model_copy(
        update={"max_train_tokens_per_round": 512}
    )
    with running(config) as server:
        store = state_of(server).store
        a = tinker.ServiceClient(base_url=server.url, api_key=KEY_A).create_lora_training_client(BASE, rank=4)
        b = tinker.ServiceClient(base_url=server.url, api_key=KEY_B).create_lora_training_client(BASE, rank=4)
        a, b = a.result(), b.result()
        b.forward_backward([datum()], "cross_entropy").result()  # warm: the race below is not a first call
        long_datum = types.Datum(
            model_input=types.ModelInput.from_ints([5 + i % 50 for i in range(255)]),
            loss_fn_inputs={"target_tokens": [6 + i % 50 for i in range(255)]},
        )
        large = a.forward_backward([long_datum] * 128, "cross_entropy")  # 32,640 tokens: 64 slices

        def a_running() -> bool:
            with store.db.read() as session:
                running = select(FutureRow.request_id).where(
                    FutureRow.tenant == tenant_of(KEY_A),
                    FutureRow.request_type == "forward_backward",
                    FutureRow.status == "running",
                )
                return session.execute(running).first() is not None

        deadline = time.monotonic() + 60
        while not a_running():
            assert time.monotonic() < deadline, "A's forward_backward never started"
            time.sleep(0.005)
        b.forward_backward([datum()], "cross_entropy").result()
        assert a_running(), "A's request finished first"
        assert len(large.result().loss_fn_outputs) == 128
        assert state_of(server).counters()["sliced_passes"] >= 1


def test_a_tenants_share_of_the_engine_is_by_default_the_rows_it_decodes_together(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The share was a fixed 256 sequences, the engine's default rows; an engine that decodes fewer (a
    larger model's K/V budget, or max_sample_rows) then took a tenant's whole share into its first-come
    queue past its rows. By default it is now the rows the engine decodes together."""
    config = service_config(tmp_path, tiny_model_dir, [KEY_A])
    compute = ServiceCompute(
        config.base_models, max_rank=config.max_lora_rank, config=ServiceComputeConfig(max_sample_rows=16)
    )
    with BackgroundServer(create_app(config, compute=compute)) as server:
        worker = state_of(server).wake_worker.__self__  # type: ignore[attr-defined]
        assert compute.sampling_config(BASE).max_batch_size == 16
        assert worker.config.max_samples_in_flight_per_tenant == 16


def test_one_key_cannot_fill_the_servers_memory_with_models(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Each model holds its adapter and optimizer state in memory until its session finishes: 200 rank-64
    models of one key took the server from 0.96 to 2.3 GB in 2.5 s, a rate that runs any machine out of
    memory under every tenant. Past `max_models_per_tenant` a key's create_model is a 400 naming the limit
    and the way out, the other key is unaffected, and a finished session's models make room again."""
    config = service_config(tmp_path, tiny_model_dir, [KEY_A, KEY_B]).model_copy(
        update={"max_models_per_tenant": 2}
    )
    worker = WorkerConfig(housekeeping_interval_s=0.1)
    with (
        BackgroundServer(create_app(config, worker_config=worker)) as server,
        http(server, KEY_A) as a,
        http(server, KEY_B) as b,
    ):

        def create(client: httpx.Client, session_id: str, model_seq_id: int) -> httpx.Response:
            body = {"session_id": session_id, "model_seq_id": model_seq_id, "base_model": BASE}
            return client.post("/create_model", json={**body, "lora_config": {"rank": 64}})

        b_session = b.post("/create_session", json={}).json()["session_id"]
        for model_seq_id in range(2):
            created = create(b, b_session, model_seq_id)
            assert "error" not in result(b, created.json()["request_id"]).json()
        refused = create(b, b_session, 2)
        assert refused.status_code == 400, refused.text
        assert "max_models_per_tenant=2" in refused.text and "finish" in refused.text
        assert create(b, b_session, 1).status_code == 200  # a retry of a model it has is no new model
        a_session = a.post("/create_session", json={}).json()["session_id"]
        assert "error" not in result(a, create(a, a_session, 0).json()["request_id"]).json()

        b.post(f"/sessions/{b_session}/finish", json={"reason": {"type": "success"}})
        b_next = b.post("/create_session", json={}).json()["session_id"]
        deadline = time.monotonic() + 30
        while (again := create(b, b_next, 0)).status_code == 400 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "error" not in result(b, again.json()["request_id"]).json()


def test_a_session_whose_client_went_silent_is_finished_and_its_models_unloaded(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A client that died without closing its session held its models in memory, and its key's
    models-per-key room, for good: a key whose scripts crashed 64 times was locked out. A session with no
    heartbeat and no request for `session_expiry_s` is now finished and its models unloaded; one that
    heartbeats, or one that only sends requests (raw HTTP), stays."""
    config = service_config(tmp_path, tiny_model_dir, [KEY_A]).model_copy(update={"max_models_per_tenant": 3})
    worker = WorkerConfig(session_expiry_s=3.0, housekeeping_interval_s=0.1)
    with BackgroundServer(create_app(config, worker_config=worker)) as server, http(server, KEY_A) as a:

        def create(session_id: str, model_seq_id: int = 0) -> httpx.Response:
            body = {"session_id": session_id, "model_seq_id": model_seq_id, "base_model": BASE}
            return a.post("/create_model", json={**body, "lora_config": {"rank": 4}})

        def new_model() -> tuple[str, str]:
            session_id = a.post("/create_session", json={}).json()["session_id"]
            created = create(session_id).json()
            assert "error" not in result(a, created["request_id"]).json()
            return session_id, created["model_id"]

        silent, heartbeating, busy = new_model(), new_model(), new_model()
        spare = a.post("/create_session", json={}).json()["session_id"]
        assert create(spare).status_code == 400  # the key's room is full

        def status(session_id: str) -> str:
            with state_of(server).db.read() as rows:
                row = rows.get(SessionRow, session_id)
                assert row is not None
                return row.status

        seq_id = 0
        deadline = time.monotonic() + 60
        while status(silent[0]) != "finished":
            assert time.monotonic() < deadline, "the silent session was never finished"
            a.post("/session_heartbeat", json={"session_id": heartbeating[0]})
            seq_id += 1
            step = {"model_id": busy[1], "seq_id": seq_id, "adam_params": {"learning_rate": 1e-3}}
            assert a.post("/optim_step", json=step).status_code == 200
            time.sleep(0.2)
        assert status(heartbeating[0]) == status(busy[0]) == "active"

        # Its model is unloaded: a request on it fails as the client's doing, saying why; the room is back
        # (in a new session: `spare`, silent too, has been finished as well).
        late = {"model_id": silent[1], "seq_id": 1, "adam_params": {"learning_rate": 1e-3}}
        failed = result(a, a.post("/optim_step", json=late).json()["request_id"]).json()
        assert failed.get("category") == "user" and "silent for 3 s" in failed["error"], failed
        deadline = time.monotonic() + 30  # `spare` went silent after `silent` (two model creations later)
        while status(spare) != "finished":
            assert time.monotonic() < deadline, "the spare session was never finished"
            time.sleep(0.1)
        fresh = a.post("/create_session", json={}).json()["session_id"]
        deadline = time.monotonic() + 30
        while (again := create(fresh)).status_code == 400 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "error" not in result(a, again.json()["request_id"]).json()


def test_a_finished_sessions_models_are_refused_as_the_clients_own_doing(server: BackgroundServer) -> None:
    """A finished session's models are unloaded (their memory is freed). A create_model in a finished
    session used to be accepted, build its adapter and then lose it, and every request on an unloaded
    model failed as the server's fault; now the create is a 400 and the requests fail as user errors, each
    naming the way on (a new session). So is a new sampling session in a finished session."""
    with http(server, KEY_B) as b:
        session_id = b.post("/create_session", json={}).json()["session_id"]
        body = {"session_id": session_id, "model_seq_id": 0, "base_model": BASE, "lora_config": {"rank": 4}}
        created = b.post("/create_model", json=body).json()
        model_id = created["model_id"]
        assert "error" not in result(b, created["request_id"]).json()
        b.post(f"/sessions/{session_id}/finish", json={"reason": {"type": "success"}})

        late = {**body, "model_seq_id": 1}
        sampler = {"session_id": session_id, "sampling_session_seq_id": 0, "base_model": BASE}
        for route, request in [
            ("/create_model", late),
            ("/load_weights", {**late, "path": f"tinker://{FAKE_MODEL}/weights/x"}),
            ("/create_sampling_session", sampler),
        ]:
            refused = b.post(route, json=request)
            assert refused.status_code == 400, (route, refused.text)
            assert "is finished" in refused.text and "new session" in refused.text

        def unloaded() -> bool:
            with state_of(server).db.read() as rows:
                row = rows.get(ModelRow, model_id)
                return row is not None and row.status == "unloaded"

        deadline = time.monotonic() + 30
        while not unloaded():
            assert time.monotonic() < deadline, "the finished session's model was never unloaded"
            time.sleep(0.1)
        step = {"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": 1e-2}}
        failed = result(b, b.post("/optim_step", json=step).json()["request_id"]).json()
        assert failed["category"] == "user" and "new session" in failed["error"], failed


def test_a_deleted_or_expired_checkpoint_samples_no_more_even_once_loaded(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The engine keeps a sampler checkpoint's weights once sampled. They used to be sampled after the
    owner deleted the checkpoint (by another tenant, for whom it had been published, too) or after it
    expired; now each sample checks the checkpoint again: 404 once deleted, a user error naming the
    expiry once expired, for every tenant."""
    with running(service_config(tmp_path, tiny_model_dir, [KEY_A, KEY_B])) as server:
        a_service = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
        b_service = tinker.ServiceClient(base_url=server.url, api_key=KEY_B)
        a_rest = tinker.RestClient(base_url=server.url, api_key=KEY_A)
        try:
            training = a_service.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
            deleted = training.save_weights_for_sampler("deleted").result().path
            a_rest.publish_checkpoint_from_tinker_path(deleted).result()
            samplers = [
                service.create_sampling_client(model_path=deleted).result()
                for service in (a_service, b_service)
            ]
            for sampler in samplers:  # loaded into the engine
                assert len(sampler.sample(PROMPT, 1, PARAMS).result().sequences) == 1
            a_rest.delete_checkpoint_from_tinker_path(deleted).result()
            for sampler in samplers:
                with pytest.raises(tinker.NotFoundError, match="never saved, or was deleted"):
                    sampler.sample(PROMPT, 1, PARAMS).result()

            expiring = training.save_weights_for_sampler("expiring").result().path
            sampler = a_service.create_sampling_client(model_path=expiring).result()
            assert len(sampler.sample(PROMPT, 1, PARAMS).result().sequences) == 1
            with http(server, KEY_A) as a:
                ttl = a.put(checkpoint_route(expiring, "ttl"), json={"ttl_seconds": 1})
                assert ttl.status_code == 200, ttl.text
            time.sleep(1.5)
            with pytest.raises(tinker.RequestFailedError, match="expired"):
                sampler.sample(PROMPT, 1, PARAMS).result()
        finally:
            a_service.close("success").result()
            b_service.close("success").result()


def test_the_engine_keeps_a_bounded_number_of_sampled_checkpoints(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Every sampler checkpoint ever sampled used to stay loaded in the engine (~2.7 MB each at rank 64 on
    the tiny model: 100 saved-and-sampled took the server from 1108 to 1335 MB), so one tenant could run
    the server out of memory. Now the least recently sampled leave past `max_checkpoint_adapters`, and
    sampling one again reads it back."""
    config = service_config(tmp_path, tiny_model_dir, [KEY_A])
    compute = load_compute(config)
    engine = compute.sampling_engines()[BASE][0]
    worker = WorkerConfig(max_checkpoint_adapters=2)
    with (
        pytest.MonkeyPatch.context() as mp,
        BackgroundServer(create_app(config, compute=compute, worker_config=worker)) as server,
    ):
        mp.setenv("TINKER_TELEMETRY", "0")
        service = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
        try:
            training = service.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
            paths = [training.save_weights_for_sampler(f"c{i}").result().path for i in range(4)]
            samplers = [service.create_sampling_client(model_path=path).result() for path in paths]
            first = samplers[0].sample(PROMPT, 1, PARAMS).result().sequences[0].tokens
            for sampler in samplers[1:]:
                sampler.sample(PROMPT, 1, PARAMS).result()
            assert set(engine.adapters()) & set(paths) == set(paths[2:])
            assert samplers[0].sample(PROMPT, 1, PARAMS).result().sequences[0].tokens == first
            assert set(engine.adapters()) & set(paths) == {paths[0], paths[3]}
        finally:
            service.close("success").result()


def test_without_keys_every_client_shares_one_namespace(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A loopback server without keys: whatever key a client sends is ignored, and everyone sees, samples
    and may delete everything (tenant ""), as before tenants existed."""
    with running(service_config(tmp_path, tiny_model_dir, [])) as server:
        one = tinker.ServiceClient(base_url=server.url, api_key=KEY_A)
        other = tinker.ServiceClient(base_url=server.url, api_key=KEY_B)
        try:
            training = one.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
            path = training.save_weights_for_sampler("shared").result().path
            rest = tinker.RestClient(base_url=server.url, api_key=KEY_B)
            assert training.model_id in [
                r.training_run_id for r in rest.list_training_runs().result().training_runs
            ]
            assert rest.get_weights_info_by_tinker_path(path).result().lora_rank == 4
            sampling = other.create_sampling_client(model_path=path).result()
            assert len(sampling.sample(PROMPT, 1, PARAMS).result().sequences) == 1
            with httpx.Client(base_url=f"{server.url}/api/v1", timeout=60) as anyone:
                body = {
                    "session_id": training.model_id.rpartition(":train:")[0],
                    "sampling_session_seq_id": 5,
                    "base_model": BASE,
                }
                sampler = anyone.post("/create_sampling_session", json=body).json()["sampling_session_id"]
                request_id = anyone.post("/asample", json=sample_body(sampler, 0, 4)).json()["request_id"]
                assert "json" not in result(anyone, request_id).headers["content-type"]
            rest.delete_checkpoint_from_tinker_path(path).result()
            assert path not in [c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints]
        finally:
            one.close("success").result()
            other.close("success").result()


def test_rows_from_before_tenants_belong_to_the_keyless_namespace(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A state directory written before tenants existed: its tables gain a `tenant` column (and its
    indexes) on open, every old row in tenant "": a keyless server still sees its runs, a key sees none."""
    with running(service_config(tmp_path, tiny_model_dir, [])) as server:
        service = tinker.ServiceClient(base_url=server.url, api_key="tml-ignored")
        try:
            old_run = service.create_lora_training_client(base_model=BASE, rank=4, seed=0).result().model_id
        finally:
            service.close("success").result()
    url = sqlite_url(tmp_path / "service.db")
    db = Database(url)
    tables = ("sessions", "models", "futures", "checkpoints", "sampling_sessions")
    with db.engine.begin() as connection:  # the tables as the version before tenants had them
        for table in tables:
            for index in inspect(connection).get_indexes(table):
                if "tenant" in index["column_names"]:
                    connection.exec_driver_sql(f"DROP INDEX {index['name']}")
            connection.exec_driver_sql(f"ALTER TABLE {table} DROP COLUMN tenant")
    db.close()

    reopened = Database(url)
    inspector = inspect(reopened.engine)
    for table in tables:
        assert "tenant" in {c["name"] for c in inspector.get_columns(table)}, table
    assert {"ix_models_tenant"} <= {i["name"] for i in inspector.get_indexes("models")}
    assert {"ix_checkpoints_tenant"} <= {i["name"] for i in inspector.get_indexes("checkpoints")}
    assert {"ix_futures_pending_tenant"} <= {i["name"] for i in inspector.get_indexes("futures")}
    with reopened.read() as session:
        row = session.get(ModelRow, old_run)
        assert row is not None and row.tenant == ""
    reopened.close()

    with running(service_config(tmp_path, tiny_model_dir, [KEY_A])) as server, http(server, KEY_A) as a:
        assert a.get("/training_runs").json()["training_runs"] == []
        assert a.get(f"/training_runs/{old_run}").status_code == 404
    with running(service_config(tmp_path, tiny_model_dir, [])) as server:
        runs = httpx.get(f"{server.url}/api/v1/training_runs").json()["training_runs"]
        assert [run["training_run_id"] for run in runs] == [old_run]
