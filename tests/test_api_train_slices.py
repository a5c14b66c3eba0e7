"""A large forward_backward runs a slice of its datums per worker round, so another key's training waits for
one slice of it, not for all of it; and the sliced request's answer and gradients are the whole pass's.

Reference: the hardening work on isolation between keys ("a training request under the cap still runs to
its end before another key's", noticed in the twenty-sixth session). `split_job` is pure; the exactness
and the scheduling are held on the real compute over the tiny model, the worker driven round by round.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tinker
import torch
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto

from conftest import live_worker, ready_models
from inflight.api.compute import ServiceCompute, ServiceComputeConfig
from inflight.api.db import Database, sqlite_url
from inflight.api.futures import FutureStore, RequestType
from inflight.api.job_types import Datum, ForwardBackwardJob, ForwardBackwardOutput, LoraSpec
from inflight.api.proto import forward_backward_job, parse_forward_backward
from inflight.api.schemas import OptimStepRequest
from inflight.api.worker import EngineWorker, WorkerConfig
from inflight.trainer.job_slices import job_tokens, merge_outputs, split_job
from inflight.trainer.tinker_losses import prepare_job

types = tinker.types
BASE = "tiny"


def _datum(n: int) -> Datum:
    return Datum(list(range(1, n + 1)), {"target_tokens": list(range(2, n + 2))})


def _job(lengths: list[int]) -> ForwardBackwardJob:
    return ForwardBackwardJob("m", [_datum(n) for n in lengths], "cross_entropy", {}, backward=False)


# ---- split_job: pure ------------------------------------------------------------------------------------


def test_slices_hold_whole_datums_in_order_within_the_budget() -> None:
    job = _job([3, 4, 2, 6, 1, 1])
    slices = split_job(job, max_tokens=7)
    assert [[len(d.input_tokens) for d in s.data] for s in slices] == [[3, 4], [2], [6, 1], [1]]
    assert [d for s in slices for d in s.data] == job.data  # the same datums, in order
    for s in slices:
        assert (s.model_id, s.loss_fn, s.loss_fn_config, s.backward) == ("m", "cross_entropy", {}, False)


def test_a_datum_longer_than_the_budget_is_a_slice_of_its_own() -> None:
    slices = split_job(_job([2, 9, 2]), max_tokens=4)
    assert [[len(d.input_tokens) for d in s.data] for s in slices] == [[2], [9], [2]]


def test_a_job_within_the_budget_is_its_own_only_slice() -> None:
    job = _job([3, 4])
    assert [s.data for s in split_job(job, max_tokens=7)] == [job.data]
    assert job_tokens(job) == 7
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        split_job(job, max_tokens=0)


def test_merging_refuses_outputs_of_another_datum_count() -> None:
    prepared = prepare_job(_job([3, 4]), vocab_size=2048, max_tokens=64)
    part = ForwardBackwardOutput([{"logprobs": [0.0] * 3, "elementwise_loss": [0.0] * 3}], {})
    with pytest.raises(ValueError, match="1 datums, the job 2"):
        merge_outputs(prepared, [part])


# ---- exactness on the real compute -----------------------------------------------------------------------


def _compute(model_dir: Path) -> ServiceCompute:
    return ServiceCompute(
        {BASE: str(model_dir)}, max_rank=8, config=ServiceComputeConfig(seed=0, dtype="float32")
    )


def _ppo_job(model_id: str, lengths: list[int], seed: int) -> ForwardBackwardJob:
    """An RL job whose ratio statistics (clip fractions, ESS) depend on every token of the job."""
    rng = random.Random(seed)
    data = []
    for n in lengths:
        tokens = [rng.randrange(3, 2000) for _ in range(n + 1)]
        data.append(
            Datum(
                tokens[:-1],
                {
                    "target_tokens": tokens[1:],
                    "logprobs": [-rng.uniform(4.0, 11.0) for _ in range(n)],
                    "advantages": [rng.uniform(-1.0, 1.0) for _ in range(n)],
                },
            )
        )
    return ForwardBackwardJob(model_id, data, "ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})


def test_a_sliced_job_answers_and_trains_as_the_whole_pass(tiny_model_dir: Path) -> None:
    compute = _compute(tiny_model_dir)
    for model_id in ("whole", "sliced"):
        compute.create_adapter(model_id, BASE, LoraSpec(rank=4, seed=1))
    lengths = [17, 5, 40, 23, 8, 31, 12]
    whole = compute.forward_backward([_ppo_job("whole", lengths, seed=3)])[0]
    job = _ppo_job("sliced", lengths, seed=3)
    slices = split_job(job, max_tokens=45)
    assert len(slices) == 4
    parts = []
    for piece in slices:
        (out,) = compute.forward_backward([piece])
        assert isinstance(out, ForwardBackwardOutput)
        parts.append(out)
    info = compute.model_info(BASE)
    merged = merge_outputs(prepare_job(job, int(info["vocab_size"]), int(info["max_context"])), parts)
    assert isinstance(whole, ForwardBackwardOutput)
    assert len(merged.loss_fn_outputs) == len(lengths)
    for got, want in zip(merged.loss_fn_outputs, whole.loss_fn_outputs, strict=True):
        for key in ("logprobs", "elementwise_loss"):
            torch.testing.assert_close(torch.tensor(got[key]), torch.tensor(want[key]), rtol=1e-5, atol=1e-5)
    assert merged.metrics.keys() == whole.metrics.keys()
    for key, value in whole.metrics.items():
        assert merged.metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    # The job's statistics are over all of its tokens, not an average of the slices' own.
    ratio_keys = [key for key in whole.metrics if key.endswith(":mean") and "clip" in key]
    assert ratio_keys, whole.metrics
    sliced_means = [sum(p.metrics[k] for p in parts) / len(parts) for k in ratio_keys]
    assert [merged.metrics[k] for k in ratio_keys] != pytest.approx(sliced_means, rel=1e-6, abs=1e-9)
    whole_grads, sliced_grads = compute.adapter_gradients("whole"), compute.adapter_gradients("sliced")
    scale = max(float(grad.abs().max()) for grad in whole_grads.values())  # (LoRA's A has none at B = 0)
    assert scale > 0
    for key, grad in whole_grads.items():  # the same sums, added in another order
        torch.testing.assert_close(sliced_grads[key], grad, rtol=1e-4, atol=1e-5 * scale)


# ---- the worker: a large request runs over several rounds, another key's beside it -----------------------


def _fwd_bwd_payload(model_id: str, seq_id: int, lengths: list[int]) -> bytes:
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints(list(range(5, 5 + n))),
            loss_fn_inputs={"target_tokens": list(range(6, 6 + n))},
        )
        for n in lengths
    ]
    request = types.ForwardBackwardRequest(
        model_id=model_id,
        seq_id=seq_id,
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"),
    )
    return forward_backward_request_to_proto(request).SerializeToString()


@pytest.fixture
def live(tiny_model_dir: Path, tmp_path: Path) -> Iterator[tuple[EngineWorker, FutureStore, ServiceCompute]]:
    db = Database(sqlite_url(tmp_path / "service.db"))
    store = ready_models(db, BASE, count=3)
    compute = _compute(tiny_model_dir)
    for i in range(3):
        compute.create_adapter(f"s:train:{i}", BASE, LoraSpec(rank=4, seed=2))
    with live_worker(compute, db, tmp_path, WorkerConfig(max_train_tokens_per_round=64)) as worker:
        yield worker, store, compute
    db.close()


def test_another_keys_forward_backward_runs_beside_a_large_one_and_finishes_first(live) -> None:
    worker, store, compute = live
    lengths = [30, 30, 30, 30, 30, 30, 30, 30]  # 240 tokens: four slices of two datums at 64 a round
    payload = _fwd_bwd_payload("s:train:0", 1, lengths)
    big = store.submit("s:train:0", 1, RequestType.FORWARD_BACKWARD, payload)
    assert worker.run_once() == 1  # the first slice
    assert store.get(big.request_id).status == "running"
    # Handed over as the routes do: its predecessor was claimed here, which would let it skip the query.
    step_payload = OptimStepRequest(model_id="s:train:0", seq_id=2).model_dump_json().encode()
    step = store.submit("s:train:0", 2, RequestType.OPTIM_STEP, step_payload)
    worker.wake(RequestType.OPTIM_STEP, step)
    small = store.submit("s:train:1", 1, RequestType.FORWARD_BACKWARD, _fwd_bwd_payload("s:train:1", 1, [30]))
    worker.run_once()  # the big request's second slice, and the small request beside it
    assert store.get(small.request_id).status == "done"
    assert store.get(big.request_id).status == "running"
    assert store.get(step.request_id).status == "pending"  # the model's next request waits for the last slice
    rounds = 2
    while not store.get(step.request_id).finished:
        assert worker.run_once() or rounds > 10
        rounds += 1
    assert rounds == 5  # two more slices, then the optim_step
    assert store.get(big.request_id).status == "done"
    assert worker.stats()["sliced_passes"] == 1

    # The answer is the whole pass's: the same request run unsliced on an identical adapter.
    answer = parse_forward_backward_output(store.get(big.request_id).result_payload)
    message = parse_forward_backward(_fwd_bwd_payload("s:train:2", 1, lengths))
    (alone,) = compute.forward_backward([forward_backward_job(message, vocab_size=2048)])
    assert isinstance(alone, ForwardBackwardOutput)
    assert answer.metrics["loss:sum"] == pytest.approx(alone.metrics["loss:sum"], rel=1e-5)
    for got, want in zip(answer.loss_fn_outputs, alone.loss_fn_outputs, strict=True):
        torch.testing.assert_close(
            torch.tensor(got["logprobs"]), torch.tensor(want["logprobs"]), rtol=1e-5, atol=1e-5
        )


def parse_forward_backward_output(result: bytes | None) -> ForwardBackwardOutput:
    """The stored answer (one ArrayRecord: each field's float32 arrays back to back, byte offsets)."""
    assert result is not None
    message = pb.ForwardBackwardOutput.FromString(result)
    (record,) = message.loss_fn_outputs
    outputs: list[dict[str, list[float]]] = [{} for _ in range(record.num_datums)]
    for key, field in record.fields.items():
        data = np.frombuffer(field.data, dtype="<f4")
        offsets = np.frombuffer(field.offsets, dtype="<i8") // 4
        for i in range(record.num_datums):
            outputs[i][key] = data[offsets[i] : offsets[i + 1]].tolist()
    return ForwardBackwardOutput(outputs, dict(message.metrics))
