"""Multi-tenancy: four SDK clients train four LoRA adapters on one server at once, and the worker batches
their requests across adapters without letting them interfere.

Reference: issue 4 items 3 and 6. The batching itself is checked on the worker with a hand-written fake
engine (one engine call per round and base model, per-model seq_id order); the live test checks that each
tenant learns and that its adapter ends exactly where training it alone would have.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tinker
import torch
from tinker.proto.request_conv import forward_backward_request_to_proto

from conftest import ready_models, sdk_server
from inflight.api.app import BackgroundServer
from inflight.api.checkpoints import CheckpointStore
from inflight.api.db import Database, SamplingSessionRow, sqlite_url
from inflight.api.futures import FutureStore, RequestType
from inflight.api.job_types import (
    ForwardBackwardJob,
    ForwardBackwardOutput,
    OptimStep,
    SampledSequence,
    SampleJob,
    SampleOutput,
)
from inflight.api.jobs import BaseModelLimits
from inflight.api.schemas import OptimStepRequest, SampleRequest
from inflight.api.service import ServiceConfig
from inflight.api.worker import EngineWorker

types = tinker.types

BASE = "tiny"
TENANTS = 4


class RecordingEngine:
    """Just enough of ServiceCompute to see which calls the worker makes, and with what."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[str]]] = []

    def has_adapter(self, model_id: str) -> bool:
        return True

    def forward_backward(self, jobs: list[ForwardBackwardJob]) -> list[ForwardBackwardOutput | Exception]:
        self.calls.append(("forward_backward", [job.model_id for job in jobs]))
        return [ForwardBackwardOutput([{"logprobs": [0.0]}], {"loss:sum": 0.0}) for _ in jobs]

    def optim_step(self, step: OptimStep) -> dict[str, float]:
        self.calls.append(("optim_step", [step.model_id]))
        return {}


class RecordingSampler:
    """Just enough of api.sampler.Sampler: each job is recorded and finished at once."""

    def __init__(self, calls: list[tuple[str, list[str]]]) -> None:
        self.calls = calls

    def submit(self, job: SampleJob, key: str | None = None) -> concurrent.futures.Future[SampleOutput]:
        self.calls.append(("sample", [str(job.weights)]))
        done: concurrent.futures.Future[SampleOutput] = concurrent.futures.Future()
        done.set_result(SampleOutput([SampledSequence([1], [-0.5], "length")]))
        return done


@pytest.fixture
def worker_setup(tmp_path: Path) -> Iterator[tuple[EngineWorker, FutureStore, RecordingEngine]]:
    db = Database(sqlite_url(tmp_path / "service.db"))
    store = ready_models(db, BASE, count=TENANTS)
    with db.write() as session:
        for i in range(2):
            session.add(
                SamplingSessionRow(
                    sampling_session_id=f"s:sample:{i}",
                    session_id="s",
                    sampling_session_seq_id=i,
                    base_model=BASE,
                )
            )
    engine = RecordingEngine()
    worker = EngineWorker(
        engine,  # type: ignore[arg-type]
        RecordingSampler(engine.calls),  # type: ignore[arg-type]
        db,
        CheckpointStore(db, tmp_path / "checkpoints"),
        limits={BASE: BaseModelLimits(vocab_size=100, max_context=64)},
    )
    yield worker, store, engine
    db.close()


def fwd_bwd_payload(model_id: str, seq_id: int) -> bytes:
    request = types.ForwardBackwardRequest(
        model_id=model_id,
        seq_id=seq_id,
        forward_backward_input=types.ForwardBackwardInput(
            data=[
                types.Datum(
                    model_input=types.ModelInput.from_ints([1]), loss_fn_inputs={"target_tokens": [2]}
                )
            ],
            loss_fn="cross_entropy",
        ),
    )
    return forward_backward_request_to_proto(request).SerializeToString()


def optim_payload(model_id: str, seq_id: int) -> bytes:
    return OptimStepRequest(model_id=model_id, seq_id=seq_id).model_dump_json().encode()


def sample_payload(session: str, seq_id: int) -> bytes:
    body: dict[str, Any] = {
        "sampling_session_id": session,
        "seq_id": seq_id,
        "prompt": {"chunks": [{"tokens": [1, 2]}]},
        "sampling_params": {"max_tokens": 2},
    }
    return SampleRequest.model_validate(body).model_dump_json().encode()


def test_one_engine_call_per_round_across_adapters_and_sessions(worker_setup) -> None:
    worker, store, engine = worker_setup
    for i in range(TENANTS):
        store.submit(f"s:train:{i}", 1, RequestType.FORWARD_BACKWARD, fwd_bwd_payload(f"s:train:{i}", 1))
    samples = [
        store.submit(f"s:sample:{i}", 0, RequestType.SAMPLE, sample_payload(f"s:sample:{i}", 0))
        for i in range(2)
    ]
    assert worker.run_once() == TENANTS + 2  # the passes settled, the samples handed to the sampler
    assert engine.calls == [
        ("forward_backward", [f"s:train:{i}" for i in range(TENANTS)]),
        ("sample", ["None"]),
        ("sample", ["None"]),
    ]
    assert worker.run_once() == 2  # the samples the sampler finished are settled in the next round
    assert [store.get(f.request_id).status for f in samples] == ["done", "done"]


def test_each_model_runs_in_seq_id_order_while_models_advance_together(worker_setup) -> None:
    worker, store, engine = worker_setup
    a, b = "s:train:0", "s:train:1"
    # Submitted out of order; b's queue has a gap at seq_id 2 until the end.
    store.submit(a, 3, RequestType.FORWARD_BACKWARD, fwd_bwd_payload(a, 3))
    store.submit(a, 2, RequestType.OPTIM_STEP, optim_payload(a, 2))
    store.submit(a, 1, RequestType.FORWARD_BACKWARD, fwd_bwd_payload(a, 1))
    store.submit(b, 1, RequestType.FORWARD_BACKWARD, fwd_bwd_payload(b, 1))
    store.submit(b, 3, RequestType.OPTIM_STEP, optim_payload(b, 3))
    while worker.run_once():
        pass
    assert engine.calls == [("forward_backward", [a, b]), ("optim_step", [a]), ("forward_backward", [a])]
    store.submit(b, 2, RequestType.FORWARD_BACKWARD, fwd_bwd_payload(b, 2))
    while worker.run_once():
        pass
    assert engine.calls[3:] == [("forward_backward", [b]), ("optim_step", [b])]


def test_heads_accepted_here_are_claimed_by_id_in_seq_id_order(worker_setup, monkeypatch) -> None:
    """The fast claim (`EngineWorker._claim_heads`): a future the routes hand over whose predecessor this
    worker claimed skips the ready-heads query; everything else still goes through it, in seq_id order."""
    worker, store, engine = worker_setup
    queries: list[int] = []
    query = worker.store.claim_ready
    monkeypatch.setattr(worker.store, "claim_ready", lambda **kw: queries.append(1) or query(**kw))
    a, b = "s:train:0", "s:train:1"
    fb, opt = RequestType.FORWARD_BACKWARD, RequestType.OPTIM_STEP

    accepted: list[str] = []

    def accept(model_id: str, seq_id: int, request_type: RequestType) -> None:
        payload = (fwd_bwd_payload if request_type is fb else optim_payload)(model_id, seq_id)
        future = store.submit(model_id, seq_id, request_type, payload)
        accepted.append(future.request_id)
        worker.wake(request_type, future)

    accept(a, 1, fb)  # its predecessor (the creation) was not claimed by this worker: the query
    assert worker.run_once() == 1 and len(queries) == 1
    accept(a, 2, opt)  # this worker claimed seq_id 1: by id
    assert worker.run_once() == 1 and len(queries) == 1
    accept(a, 4, fb)  # accepted before its predecessor: one head per model per round, seq 3 first
    accept(a, 3, fb)
    assert worker.run_once() == 1 and len(queries) == 1
    assert worker.run_once() == 1 and len(queries) == 2  # seq 4 was left to the query
    # A predecessor that never ran (refused when it came) leaves its successor to the query's count.
    store.reject(a, 5, fb, fwd_bwd_payload(a, 5), "refused")
    accept(a, 6, opt)
    assert worker.run_once() == 1 and len(queries) == 3
    assert engine.calls == [
        ("forward_backward", [a]),
        ("optim_step", [a]),
        ("forward_backward", [a]),
        ("forward_backward", [a]),
        ("optim_step", [a]),
    ]
    # Queued by another process (no hand-over): found by the query, which runs at least every interval
    # even while the fast path has work.
    store.submit(b, 1, fb, fwd_bwd_payload(b, 1))
    accept(a, 7, fb)
    assert worker.run_once() == 1 and engine.calls[-1] == ("forward_backward", [a])
    worker.config.heads_query_interval_s = 1e-9  # (its minimum is above 0): the query every round
    accept(a, 8, fb)
    assert worker.run_once() == 2 and engine.calls[-1] == ("forward_backward", [a, b])
    assert [store.get(request_id).status for request_id in accepted] == ["done"] * len(accepted)


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    # float32: the test holds each tenant to where training it alone ends, exactly (bfloat16 batches round
    # by their composition).
    config = ServiceConfig(
        base_models={BASE: str(tiny_model_dir)}, state_dir=tmp_path_factory.mktemp("serve"), dtype="float32"
    )
    with sdk_server(config) as running:
        yield running


def tenant_datum(tenant: int) -> types.Datum:
    tokens = [(17 * tenant + 5 * i) % 300 + 10 for i in range(24)]  # a different sequence per tenant
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:]}
    )


def train(url: str, tenant: int, steps: int = 4) -> tuple[list[float], torch.Tensor]:
    """One tenant's whole run with its own SDK client: losses per step and its final logprobs."""
    service = tinker.ServiceClient(base_url=url)
    training = service.create_lora_training_client(base_model=BASE, rank=8, seed=100 + tenant).result()
    datum = tenant_datum(tenant)
    losses = []
    for _ in range(steps):
        fwd_bwd = training.forward_backward([datum], "cross_entropy")
        training.optim_step(types.AdamParams(learning_rate=5e-3))
        losses.append(fwd_bwd.result().metrics["loss:sum"])
    final = training.forward([datum], "cross_entropy").result()
    service.close("success").result()
    return losses, torch.tensor(final.loss_fn_outputs[0]["logprobs"].tolist())


def test_four_clients_train_four_adapters_at_once_without_interfering(server: BackgroundServer) -> None:
    results: dict[int, tuple[list[float], torch.Tensor]] = {}
    errors: list[BaseException] = []

    def run(tenant: int) -> None:
        try:
            results[tenant] = train(server.url, tenant)
        except BaseException as err:  # surfaced below: a thread's exception would otherwise vanish
            errors.append(err)

    threads = [threading.Thread(target=run, args=(tenant,)) for tenant in range(TENANTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)
    assert not errors, errors
    assert sorted(results) == list(range(TENANTS))
    for losses, _ in results.values():
        assert losses[-1] < losses[0]
    stats = server.app.state.service.counters()
    assert stats.get("done_forward_backward", 0) == TENANTS * 4 and stats.get("failed_server", 0) == 0
    # Alone, each tenant's adapter ends where it ended while sharing every batch with the others.
    for tenant in range(TENANTS):
        _, solo = train(server.url, tenant)
        torch.testing.assert_close(results[tenant][1], solo, atol=1e-4, rtol=0)
