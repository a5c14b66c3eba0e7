"""Isolation between requests: one tenant's request never fails, stalls or changes another tenant's.

Three layers, each held here: (1) the edge refuses every out-of-bounds number the hostile-client tries found
(topk_prompt_logprobs = 10^12, top_k = 2^63, ...) with a 4xx naming the field, while valid samples of another
session complete; (2) a hostile payload that reached the futures table anyway (written there directly) is
failed by the worker's own checks as a user error, alone; (3) a fault inside a batched engine call (injected
by wrapping the real batched function) fails only the job that causes it, and the others' results (seeded
tokens, accumulated gradients) equal what they are when run alone; a round that dies outside any one request
leaves no future running.

Reference: the hardening issue, "Isolation between requests".
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from sqlalchemy.exc import OperationalError
from tinker.proto import tinker_public_pb2 as pb

from conftest import live_worker
from inflight.api import worker as worker_module
from inflight.api.app import BackgroundServer, create_app
from inflight.api.compute import ServiceCompute, ServiceComputeConfig
from inflight.api.db import Database, SamplingSessionRow, SessionRow, sqlite_url
from inflight.api.futures import FutureStore, RequestType
from inflight.api.job_types import Datum, ForwardBackwardJob, LoraSpec, SampleJob
from inflight.api.sampler import build_sampler
from inflight.api.service import ServiceConfig
from inflight.api.worker import ORPHANED_ERROR, EngineWorker, WorkerConfig

BASE = "tiny"
VOCAB = 2048
MARK = 7  # the prompt token that makes the injected fault fire for "its" job


def _engine(model_dir: Path) -> ServiceCompute:
    return ServiceCompute(
        {BASE: str(model_dir)}, max_rank=8, config=ServiceComputeConfig(seed=0, dtype="float32")
    )


def _sample_body(sampler_id: str, seq: int, **overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "sampling_session_id": sampler_id,
        "seq_id": seq,
        "num_samples": 2,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 9, 11]}]},
        "sampling_params": {"max_tokens": 4, "seed": 3},
    }
    for key, value in overrides.items():
        if key in ("top_k", "temperature", "max_tokens", "stop", "seed"):
            body["sampling_params"][key] = value
        else:
            body[key] = value
    return body


# The hostile requests the fuzzing found, and the neighbours of each: every numeric field far out of bounds.
HOSTILE: dict[str, dict[str, Any]] = {
    "topk_prompt_logprobs": {"topk_prompt_logprobs": 10**12, "prompt_logprobs": True},
    "topk_prompt_logprobs_over_vocab": {"topk_prompt_logprobs": VOCAB + 1},
    "top_k": {"top_k": 2**63},
    "num_samples": {"num_samples": 10**12},
    "max_tokens": {"max_tokens": 2**63},
    "prompt_logprobs_last_n": {"prompt_logprobs_last_n": 2**70},
    "prompt_tokens": {"prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2**63]}]}},
    "stop": {"stop": [str(i) for i in range(10_000)]},
    "stop_token": {"stop": [2**40]},
    "seed": {"seed": 2**80},
    "seq_id": {"seq_id": 2**64},
    "topk_sample_logprobs": {"topk_sample_logprobs": 10**12},
    "prompt_alt_tokens_k": {"prompt_alt_tokens_k": 10**6},
    # A sparse [2, 2^30] tensor of one cell: refused for its width before any [rows, K] table is built.
    "target_prompt_logprobs": {
        "target_prompt_logprobs": {
            "data": [1],
            "dtype": "int64",
            "shape": [2, 2**30],
            "sparse_crow_indices": [0, 1, 1],
            "sparse_col_indices": [2**30 - 1],
        }
    },
}


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    config = ServiceConfig(
        base_models={BASE: str(tiny_model_dir)}, state_dir=tmp_path_factory.mktemp("serve")
    )
    with BackgroundServer(create_app(config)) as server:
        yield server


def _session(http: httpx.Client) -> str:
    session_id = http.post("create_session", json={}).json()["session_id"]
    return http.post(
        "create_sampling_session",
        json={"session_id": session_id, "sampling_session_seq_id": 0, "base_model": BASE},
    ).json()["sampling_session_id"]


def _settle(http: httpx.Client, request_id: str, timeout_s: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        body = http.post("retrieve_future", json={"request_id": request_id})
        assert body.status_code == 200, body.text
        if body.headers.get("content-type", "").startswith("application/json"):
            answer = body.json()
            if answer.get("type") == "try_again":
                continue
            return answer
        return {"done": body.content}
    pytest.fail(f"future {request_id} still unfinished after {timeout_s} s")


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_a_hostile_sample_is_refused_naming_its_field_while_another_sessions_samples_complete(
    server: BackgroundServer, kind: str
) -> None:
    with httpx.Client(base_url=f"{server.url}/api/v1", timeout=60) as http:
        victim, attacker = _session(http), _session(http)
        valid = [
            http.post("asample", json=_sample_body(victim, seq)).json()["request_id"] for seq in range(3)
        ]
        hostile = http.post("asample", json=_sample_body(attacker, 0, **HOSTILE[kind]))
        valid += [http.post("asample", json=_sample_body(victim, 3)).json()["request_id"]]
        assert 400 <= hostile.status_code < 500, hostile.text
        field = kind.removesuffix("_over_vocab").removesuffix("_token").replace("prompt_tokens", "tokens")
        assert field in hostile.text, hostile.text
        for request_id in valid:
            assert "done" in _settle(http, request_id)
        stats = http.get("server_stats").json()
        assert stats.get("failed_server", 0) == 0 and stats.get("loop_errors", 0) == 0, stats


def test_top_k_beyond_the_vocabulary_samples_exactly_as_no_limit(server: BackgroundServer) -> None:
    with httpx.Client(base_url=f"{server.url}/api/v1", timeout=60) as http:
        sampler = _session(http)
        unlimited = http.post("asample", json=_sample_body(sampler, 0, top_k=-1)).json()
        beyond = http.post("asample", json=_sample_body(sampler, 1, top_k=VOCAB * 10)).json()
        # Batched or alone, seeded tokens are the same; log-probs agree to float rounding.
        one, other = (
            pb.SampleResponse.FromString(_settle(http, r["request_id"])["done"]) for r in (unlimited, beyond)
        )
        assert [s.tokens for s in one.sequences] == [s.tokens for s in other.sequences]
        for a, b in zip(one.sequences, other.sequences, strict=True):
            np.testing.assert_allclose(
                np.frombuffer(a.logprobs, "<f4"), np.frombuffer(b.logprobs, "<f4"), atol=1e-4
            )


# ---- the worker's own checks: hostile payloads that reached the futures table -------------------------


@pytest.fixture
def live(tiny_model_dir: Path, tmp_path: Path) -> Iterator[tuple[EngineWorker, FutureStore, ServiceCompute]]:
    """A real engine and futures database with the worker driven round by round (no HTTP)."""
    db = Database(sqlite_url(tmp_path / "service.db"))
    engine = _engine(tiny_model_dir)
    with db.write() as session:
        for tenant in ("victim", "attacker"):
            session.add(SessionRow(session_id=tenant))
            session.flush()
            session.add(
                SamplingSessionRow(
                    sampling_session_id=f"{tenant}:sample:0",
                    session_id=tenant,
                    sampling_session_seq_id=0,
                    base_model=BASE,
                )
            )
    config = WorkerConfig(housekeeping_interval_s=0.05, idle_poll_s=0.01)
    with live_worker(engine, db, tmp_path, config) as worker:
        yield worker, FutureStore(db), engine
    db.close()


def _rounds(worker: EngineWorker, store: FutureStore, request_ids: list[str], timeout_s: float = 60) -> None:
    """Worker rounds until every request is settled (samples come back from the engine's own thread)."""
    deadline = time.monotonic() + timeout_s
    while any(not store.get(r).finished for r in request_ids):
        assert time.monotonic() < deadline, [store.get(r) for r in request_ids]
        if not worker.run_once():
            time.sleep(0.01)


def _submit_raw(store: FutureStore, tenant: str, seq_id: int, **overrides: Any) -> str:
    """Straight into the futures table: past the route's checks, as an older or buggy server might have."""
    body = _sample_body(f"{tenant}:sample:0", seq_id, **overrides)
    return store.submit(
        body["sampling_session_id"], seq_id, RequestType.SAMPLE, json.dumps(body).encode()
    ).request_id


def test_hostile_payloads_in_the_queue_fail_alone_as_user_errors(live) -> None:
    worker, store, _ = live
    valid = [_submit_raw(store, "victim", seq) for seq in range(2)]
    hostile = [
        _submit_raw(store, "attacker", seq, **HOSTILE[kind])
        for seq, kind in enumerate(["topk_prompt_logprobs", "top_k", "num_samples", "stop"])
    ]
    valid.append(_submit_raw(store, "victim", 2))
    assert worker.run_once() == len(valid) + len(hostile)  # one claim: handed to the engine together
    _rounds(worker, store, valid + hostile)
    for request_id in valid:
        assert store.get(request_id).status == "done"
    for request_id in hostile:
        future = store.get(request_id)
        assert (future.status, future.error_category) == ("failed", "user"), future
    assert worker.stats().get("failed_server", 0) == 0


# ---- faults inside a batched engine call -------------------------------------------------------------


def _faulty(real: Any, fault: BaseException) -> Any:
    """The real batched function, failing for a batch that holds a job whose data has the MARK token."""

    def run(*args: Any) -> Any:
        result = real(*args)  # the work (and, for forward_backward, the gradients) happens first
        work = args[3]
        datums = [d.input_tokens for w in work if hasattr(w, "prepared") for d in w.prepared.job.data]
        if any(MARK in tokens for tokens in datums):
            raise fault
        return result

    return run


def test_a_fault_in_a_sampling_batch_fails_only_its_job(tiny_model_dir: Path) -> None:
    """A request whose prefill fails (a hostile prompt running the engine out of memory) fails alone: the
    requests it shared the step with go on exactly as they would alone, and the engine keeps serving."""
    engine = _engine(tiny_model_dir)
    jobs = [SampleJob(None, BASE, [5, 9, s], num_samples=2, max_tokens=5, seed=s) for s in range(3)]
    sampler = build_sampler(engine.sampling_engines()).start()
    try:
        alone = [sampler.submit(job).result(timeout=60) for job in jobs]
        runner = engine.sampling_engines()[BASE][0]._runner
        real_prefill = runner.prefill

        def prefill(prompts: list[list[int]], *args: Any) -> Any:
            if any(MARK in prompt for prompt in prompts):
                raise MemoryError("Unable to allocate 10.9 TiB")
            return real_prefill(prompts, *args)

        real_merged = runner.decode_and_prefill

        def decode_and_prefill(
            tokens: list[int], positions: list[int], prompts: list[list[int]], *args: Any
        ) -> Any:
            if any(MARK in prompt for prompt in prompts):  # a newcomer joining running rows: the same fault
                raise MemoryError("Unable to allocate 10.9 TiB")
            return real_merged(tokens, positions, prompts, *args)

        runner.prefill = prefill  # type: ignore[method-assign]
        runner.decode_and_prefill = decode_and_prefill  # type: ignore[method-assign]
        hostile = SampleJob(None, BASE, [5, MARK], max_tokens=3)
        futures = [sampler.submit(job) for job in (jobs[0], hostile, jobs[1], jobs[2])]
        with pytest.raises(Exception, match=r"10\.9 TiB"):
            futures[1].result(timeout=60)
        batched = [futures[i].result(timeout=60) for i in (0, 2, 3)]
        for got, want in zip(batched, alone, strict=True):  # the same samples as each alone (logprobs up
            for a, b in zip(got.sequences, want.sequences, strict=True):  # to a batch's float rounding)
                assert a.tokens == b.tokens and a.stop_reason == b.stop_reason
                np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
        assert engine.sampling_engines()[BASE][0].metrics().prefill_failures == 1
        again = sampler.submit(jobs[0]).result(timeout=60)  # still serving
        assert [q.tokens for q in again.sequences] == [q.tokens for q in alone[0].sequences]
    finally:
        sampler.stop()


def test_a_fault_in_a_training_batch_fails_only_its_job_and_takes_back_its_gradients(
    tiny_model_dir: Path, monkeypatch
) -> None:
    from inflight.trainer import tinker_pass

    def job(model_id: str, tokens: list[int]) -> ForwardBackwardJob:
        return ForwardBackwardJob(
            model_id, [Datum(tokens[:-1], {"target_tokens": tokens[1:]})], "cross_entropy"
        )

    reference, faulty = _engine(tiny_model_dir), _engine(tiny_model_dir)
    for engine in (reference, faulty):
        for model_id in ("a", "b", "evil"):
            engine.create_adapter(model_id, BASE, LoraSpec(rank=4, seed=len(model_id)))
    good = [job("a", [4, 5, 6, 8]), job("b", [9, 10, 11, 12, 13])]
    for item in good:  # a step already accumulated, then the batch: the restore must keep this share
        for engine in (reference, faulty):
            engine.forward_backward([item])
    expected = [reference.forward_backward([item])[0] for item in good]
    monkeypatch.setattr(
        "inflight.trainer.adapters.run_forward_backward",
        _faulty(tinker_pass.run_forward_backward, RuntimeError("injected")),
    )
    results = faulty.forward_backward([good[0], job("evil", [3, MARK, 4]), good[1]])
    assert isinstance(results[1], RuntimeError)
    assert [results[0].metrics, results[2].metrics] == [e.metrics for e in expected]
    for model_id in ("a", "b"):  # twice each job, never three times
        for key, grad in reference.adapter_gradients(model_id).items():
            torch.testing.assert_close(faulty.adapter_gradients(model_id)[key], grad, rtol=1e-6, atol=1e-9)
    assert faulty.counters["batches_split"] == 1


def test_a_failure_to_encode_one_result_fails_only_that_future(live, monkeypatch) -> None:
    worker, store, _ = live
    real = worker_module.encode_sample_output

    def encode(output: Any, **kwargs: Any) -> bytes:
        if kwargs["topk_prompt_logprobs"] == 3:  # the old path allocated [prompt, k] here for any k
            raise MemoryError("Unable to allocate 10.9 TiB")
        return real(output, **kwargs)

    monkeypatch.setattr(worker_module, "encode_sample_output", encode)
    valid = [_submit_raw(store, "victim", seq) for seq in range(2)]
    victim = _submit_raw(store, "attacker", 0, topk_prompt_logprobs=3, prompt_logprobs=True)
    _rounds(worker, store, [*valid, victim])
    assert [store.get(r).status for r in valid] == ["done", "done"]
    failed = store.get(victim)
    assert failed.status == "failed" and failed.error_category == "server"
    assert "MemoryError" in (failed.error or "")


def test_a_round_that_dies_leaves_no_future_running(live, monkeypatch) -> None:
    """The database refuses both the result and the failure of one request (a lost connection): the
    round dies, and the loop fails what it had claimed instead of leaving it running for good."""
    worker, store, _ = live
    calls = {"complete": 0, "fail": 0}
    for name in calls:
        real = getattr(worker.store, name)

        def flaky(*args: Any, _name: str = name, _real: Any = real) -> Any:
            calls[_name] += 1
            if calls[_name] == 1:
                raise OperationalError("UPDATE futures", {}, Exception("connection lost"))
            return _real(*args)

        monkeypatch.setattr(worker.store, name, flaky)
    submitted = [_submit_raw(store, "victim", seq) for seq in range(3)]
    worker.start()
    deadline = time.monotonic() + 30
    while any(store.get(r).status in ("pending", "running") for r in submitted):
        assert time.monotonic() < deadline, [store.get(r) for r in submitted]
        time.sleep(0.05)
    statuses = [store.get(r) for r in submitted]
    lost = [f for f in statuses if f.status == "failed"]
    assert lost and all(f.error == ORPHANED_ERROR and f.error_category == "server" for f in lost)
    stats = worker.stats()
    assert stats["loop_errors"] == 1 and stats["failed_orphaned"] == len(lost), stats


def test_a_tenants_diverged_adapter_fails_its_own_samples_and_no_one_elses(
    server: BackgroundServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The QA pass's poison, through the unmodified SDK: tenant A steps at lr 1e30 and samples 16 sequences
    from the result; that sample fails naming the non-finite logits, while tenant B's samples of the base
    model (before, in the rows A's left, and after) complete, and A's own base samples too."""
    import tinker
    from tinker import types

    tokens = list(range(5, 30))
    prompt = types.ModelInput.from_ints(tokens[:5])
    params = types.SamplingParams(max_tokens=4, seed=1)
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    a, b = (tinker.ServiceClient(base_url=server.url, api_key=f"tml-{tenant}") for tenant in "ab")
    try:
        training = a.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:]}
        )
        training.forward_backward([datum], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e30)).result()
        diverged = training.save_weights_and_get_sampling_client().result()
        base = b.create_sampling_client(base_model=BASE).result()
        reference = base.sample(prompt, 16, params).result().sequences
        with pytest.raises(Exception, match="not finite"):
            diverged.sample(prompt, 16, params).result(timeout=60)
        for client in (base, a.create_sampling_client(base_model=BASE).result()):
            again = client.sample(prompt, 16, params).result(timeout=60).sequences
            assert [s.tokens for s in again] == [s.tokens for s in reference]
        assert httpx.get(f"{server.url}/api/v1/healthz").status_code == 200
    finally:
        for client in (a, b):
            client.close("success").result()
