"""The service's compute: batched multi-adapter forward_backward vs the same requests one by one, the
per-request overhead of the HTTP API (the unmodified `tinker` SDK against the service) over a direct
in-process engine call, and the cost of a checkpoint round trip through that server.

Batched vs serial: N adapters (LoRA rank R) each send one forward_backward job of K datums of T tokens.
"batched" runs all N jobs in one `ServiceCompute.forward_backward` call (one pass, each row with its own
adapter); "serial" makes one call per job. Same engine, same jobs, same total work; best of --repeats
after a warm-up, alternating. `ratio_batched_vs_serial` = serial seconds / batched seconds. The same
comparison for sampling (one job of --samples sequences per adapter, through the service's sampler: the
shared built-in engine on its own thread) is reported as `sample_ratio_batched_vs_serial`.
Checkpoint round trip (--checkpoint-round-trips, with the API part): a rank --rank adapter saved with the
SDK's `save_weights_for_sampler` (`checkpoint_save_ms`), its archive fetched as a user does (the archive
URL route, then a plain HTTP download and tar extraction: `checkpoint_download_ms`) and loaded with
`peft.PeftModel.from_pretrained` onto a base model loaded beforehand (`checkpoint_peft_load_ms`); medians
after a warm-up trip, and their sum `checkpoint_round_trip_ms`. Prints one JSON line last.
API overhead (--api-requests): one small `forward` through the SDK, `api_ms_per_request`, against the same
job as a direct engine call, `direct_ms_per_request`, alternating request by request so load hits both
alike (medians); `api_overhead_ms` is their difference. `api_floor_ms` is the same SDK call answered at
once by a stub in front of the server (no database, no worker, no compute): the SDK's and HTTP's own cost,
which no server can remove. --api-server picks the server: `thread` (default) is the app under uvicorn in
this process, so the SDK's threads share its interpreter; `process` is `inflight serve` in its own
process, as users run it (no floor then). --queue-history N times the worker's claim of a model's next
request on a fresh futures queue and after N earlier requests of that model (`claim_ms_fresh`,
`claim_ms_after_history`): the per-request cost must not grow over a long session; and its look for the
samples to claim with one pending, then behind another tenant's N pending (`sample_look_ms_fresh`,
`sample_look_ms_behind_backlog`): one tenant's backlog must not slow every claim. --behind-tokens N
times another key's small forward_backward (one datum of --tokens) submitted 0.5 s after one key's
forward_backward of N tokens (datums of 256), through the service's worker on its own thread, twice each
way, alternating: sliced as the service runs it (`wait_behind_large_s`, a slice of twice the compute's
micro-batch a round) and with slicing off, as before it (`wait_behind_large_unsliced_s`; medians).
Run: `inflight bench serve [--adapters 8 --datums 2 --tokens 64 --dtype auto]` (default model: the tiny
preset, built locally; dtype as `inflight serve --dtype`, reported in the JSON).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast, get_args

import torch

from benchmarks import at_least
from inflight.preflight import check_model_dir
from inflight.types import DtypeName


def _best_seconds(runs: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Best wall time per run after one warm-up each; repeats alternate so load hits all runs alike."""
    for fn in runs.values():
        fn()
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(repeats):
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def _check(results: list) -> None:
    failed = [r for r in results if isinstance(r, Exception)]
    if failed:
        raise RuntimeError(f"benchmark request failed: {failed[0]}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="inflight bench serve", description=__doc__)
    parser.add_argument("--adapters", type=at_least(1), default=8, help="adapters, one job each")
    parser.add_argument("--datums", type=at_least(1), default=2, help="datums per forward_backward job")
    parser.add_argument("--tokens", type=at_least(1), default=64, help="tokens per datum")
    parser.add_argument("--rank", type=at_least(1), default=32, help="LoRA rank of every adapter")
    parser.add_argument("--samples", type=at_least(1), default=4, help="sequences per sampling job")
    parser.add_argument("--sample-tokens", type=at_least(1), default=16, help="tokens generated per sequence")
    parser.add_argument(
        "--max-batch-tokens",
        type=at_least(1),
        default=None,
        help="engine micro-batch (padded tokens); default: the engine's",
    )
    parser.add_argument(
        "--dtype",
        choices=get_args(DtypeName),
        default="auto",
        help="base weights, as `inflight serve --dtype` (default: the service's, auto)",
    )
    parser.add_argument(
        "--repeats", type=at_least(1), default=3, help="timed runs of each, best kept (default %(default)s)"
    )
    parser.add_argument(
        "--threads", type=at_least(1), default=None, help="torch threads (default: torch's choice)"
    )
    parser.add_argument(
        "--api-requests",
        type=at_least(0),
        default=10,
        help="timed requests through the API (0 = skip the API part)",
    )
    parser.add_argument(
        "--api-server",
        choices=["thread", "process"],
        default="thread",
        help="the API part's server: the app in a thread of this process, or `inflight serve` in its own",
    )
    parser.add_argument(
        "--checkpoint-round-trips",
        type=at_least(0),
        default=3,
        help="timed checkpoint round trips (save, download, load into peft) through the API (0 = skip)",
    )
    parser.add_argument(
        "--queue-history",
        type=at_least(0),
        default=0,
        help="also time the futures queue's claim (SQLite) after this many earlier requests of one model "
        "against a fresh queue, and the look for samples behind another tenant's N pending: claim_ms_fresh, "
        "claim_ms_after_history, sample_look_ms_fresh, sample_look_ms_behind_backlog (0 = skip)",
    )
    parser.add_argument(
        "--behind-tokens",
        type=at_least(0),
        default=0,
        help="also time another key's small forward_backward behind one of N tokens, sliced and not: "
        "wait_behind_large_s, wait_behind_large_unsliced_s (0 = skip)",
    )
    parser.add_argument("--model", default=None, help="HF model dir or hub id (default: the tiny preset)")
    args = parser.parse_args(argv)
    if args.model:
        check_model_dir(args.model)  # what `inflight run` checks: one line for a path that holds no model
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    from inflight.api.compute import ServiceCompute, ServiceComputeConfig
    from inflight.api.job_types import Datum, ForwardBackwardJob, LoraSpec, SampleJob

    if args.model is None:
        from inflight.models import build_tiny

        args.model = str(build_tiny(tempfile.mkdtemp(prefix="inflight-bench-serve-"), preset="tiny"))
    config = ServiceComputeConfig(seed=0, max_batch_tokens=args.max_batch_tokens, dtype=args.dtype)
    compute = ServiceCompute({"bench": args.model}, max_rank=max(64, args.rank), config=config)
    vocab = compute.model_info("bench")["vocab_size"]
    generator = torch.Generator().manual_seed(1)
    jobs, sample_jobs = [], []
    for i in range(args.adapters):
        model_id = f"adapter-{i}"
        compute.create_adapter(model_id, "bench", LoraSpec(rank=args.rank, seed=i))
        data = []
        for _ in range(args.datums):
            tokens = torch.randint(0, vocab, (args.tokens + 1,), generator=generator).tolist()
            data.append(Datum(input_tokens=tokens[:-1], loss_fn_inputs={"target_tokens": tokens[1:]}))
        jobs.append(ForwardBackwardJob(model_id, data, "cross_entropy"))
        prompt = torch.randint(0, vocab, (16,), generator=generator).tolist()
        sample_jobs.append(
            SampleJob(
                model_id,
                "bench",
                prompt,
                num_samples=args.samples,
                max_tokens=args.sample_tokens,
                seed=i,
                stop=[],
            )
        )

    def batched() -> None:
        _check(compute.forward_backward(jobs))

    def serial() -> None:
        for job in jobs:
            _check(compute.forward_backward([job]))

    # Sampling runs as the service runs it: each job submitted to the base model's engine (its own thread,
    # continuous batching), the adapters registered as save_weights_for_sampler registers them.
    from inflight.api.sampler import build_sampler

    sampler = build_sampler(compute.sampling_engines()).start()
    for job in sample_jobs:
        sampler.set_adapter("bench", compute.sampler_update(job.weights, job.weights))

    def sample_batched() -> None:
        for future in [sampler.submit(job) for job in sample_jobs]:
            future.result(timeout=600)

    def sample_serial() -> None:
        for job in sample_jobs:
            sampler.submit(job).result(timeout=600)

    train = _best_seconds({"batched": batched, "serial": serial}, args.repeats)
    try:
        sampling = _best_seconds({"batched": sample_batched, "serial": sample_serial}, args.repeats)
    finally:
        sampler.stop()
    num_datums = args.adapters * args.datums
    result: dict[str, Any] = {
        "ratio_batched_vs_serial": round(train["serial"] / train["batched"], 2),
        "batched_ms_per_request": round(1000 * train["batched"] / args.adapters, 2),
        "serial_ms_per_request": round(1000 * train["serial"] / args.adapters, 2),
        "batched_tokens_per_s": round(num_datums * args.tokens / train["batched"], 1),
        "serial_tokens_per_s": round(num_datums * args.tokens / train["serial"], 1),
        "sample_ratio_batched_vs_serial": round(sampling["serial"] / sampling["batched"], 2),
        "sample_batched_tokens_per_s": round(
            args.adapters * args.samples * args.sample_tokens / sampling["batched"], 1
        ),
        "adapters": args.adapters,
        "datums_per_request": args.datums,
        "tokens_per_datum": args.tokens,
        "rank": args.rank,
        "max_batch_tokens": compute.max_batch_tokens,
        "dtype": compute.model_info("bench")["dtype"],
        "samples_per_request": args.samples,
        "threads": torch.get_num_threads(),
        "timing": f"best of {args.repeats} after a warm-up, batched and serial alternating",
    }
    if args.api_requests > 0:
        result.update(
            measure_api(
                compute,
                args.model,
                args.api_requests,
                args.checkpoint_round_trips,
                args.rank,
                server=args.api_server,
                dtype=args.dtype,
            )
        )
    if args.queue_history > 0:
        result.update(measure_queue_claims(args.queue_history))
    if args.behind_tokens > 0:
        result.update(measure_wait_behind_large(compute, args.behind_tokens, args.tokens))
    print(json.dumps(result))
    return result


def measure_queue_claims(history: int, samples: int = 50) -> dict[str, Any]:
    """Median ms of the worker's claim of a model's next request (`FutureStore.claim_ready`, SQLite in a
    temporary directory) on a fresh queue, then after `history` requests of that model were submitted,
    claimed and completed: a claim should not grow with a model's history. Then the worker's look for
    samples to claim (`pending_unordered_by_tenant`, each tenant's oldest 256) with one pending sample,
    and with `history` more of another tenant pending: it should not grow with one tenant's backlog."""
    from inflight.api.db import Database
    from inflight.api.futures import FIRST_SEQ_ID, FutureStore, RequestType

    with tempfile.TemporaryDirectory(prefix="inflight-bench-serve-queue-") as tmp:
        database = Database(f"sqlite:///{tmp}/state.db")
        store = FutureStore(database)
        seq_ids = iter(range(FIRST_SEQ_ID, FIRST_SEQ_ID + history + 2 * samples))

        def one(timed: list[float] | None) -> None:
            store.submit("model", next(seq_ids), RequestType.FORWARD_BACKWARD, b"request")
            start = time.perf_counter()
            [head] = store.claim_ready().futures
            if timed is not None:
                timed.append(1000 * (time.perf_counter() - start))
            store.complete(head.request_id, b"result")

        fresh: list[float] = []
        for _ in range(samples):
            one(fresh)
        for _ in range(history):
            one(None)
        later: list[float] = []
        for _ in range(samples):
            one(later)

        def look(timed: list[float]) -> None:
            start = time.perf_counter()
            store.pending_unordered_by_tenant(RequestType.SAMPLE, per_tenant=256)
            timed.append(1000 * (time.perf_counter() - start))

        store.submit("b:sample", FIRST_SEQ_ID, RequestType.SAMPLE, b"sample", tenant="b")
        alone: list[float] = []
        for _ in range(samples):
            look(alone)
        for seq_id in range(FIRST_SEQ_ID, FIRST_SEQ_ID + history):  # another tenant's backlog
            store.submit("a:sample", seq_id, RequestType.SAMPLE, b"sample", tenant="a")
        behind: list[float] = []
        for _ in range(samples):
            look(behind)
        database.close()
    return {
        "queue_history": history,
        "claim_ms_fresh": round(statistics.median(fresh), 3),
        "claim_ms_after_history": round(statistics.median(later), 3),
        "sample_look_ms_fresh": round(statistics.median(alone), 3),
        "sample_look_ms_behind_backlog": round(statistics.median(behind), 3),
    }


def measure_wait_behind_large(compute: Any, large_tokens: int, small_tokens: int) -> dict[str, Any]:
    """Seconds until another key's small forward_backward finishes when it was submitted 0.5 s after one
    key's large one, through `EngineWorker` on its own thread (SQLite in a temporary directory), sliced as
    the service runs it and with slicing off; two of each, alternating, medians."""
    from inflight.api.jobs import BaseModelLimits

    info = compute.model_info("bench")
    limits = {"bench": BaseModelLimits(int(info["vocab_size"]), int(info["max_context"]))}
    slice_tokens = 2 * compute.max_batch_tokens  # the service's default (api/app.py)
    waits: dict[str, list[float]] = {"sliced": [], "unsliced": []}
    large_s: list[float] = []
    for run, mode in enumerate(["sliced", "unsliced", "unsliced", "sliced"]):
        rounds = slice_tokens if mode == "sliced" else None
        with _worker_over(compute, limits, run, rounds) as (worker, models):
            large = _submit_forward_backward(worker, models[0], large_tokens)
            large_at = time.monotonic()
            time.sleep(0.5)
            small = _submit_forward_backward(worker, models[1], small_tokens)
            small_at = time.monotonic()
            done = _finish_times(worker, {"large": large.request_id, "small": small.request_id})
            waits[mode].append(done["small"] - small_at)
            large_s.append(done["large"] - large_at)
    return {
        "behind_tokens": large_tokens,
        "behind_slice_tokens": slice_tokens,
        "wait_behind_large_s": round(statistics.median(waits["sliced"]), 3),
        "wait_behind_large_unsliced_s": round(statistics.median(waits["unsliced"]), 3),
        "large_request_s": round(statistics.median(large_s), 3),
    }


@contextlib.contextmanager
def _worker_over(
    compute: Any, limits: dict[str, Any], run: int, slice_tokens: int | None
) -> Iterator[tuple[Any, list[str]]]:
    """A started worker over `compute` and a fresh futures database holding two ready models of one session
    (adapters made for them, removed after)."""
    from inflight.api.checkpoints import CheckpointStore
    from inflight.api.db import Database, ModelRow, SessionRow
    from inflight.api.futures import FIRST_SEQ_ID, RequestType
    from inflight.api.job_types import LoraSpec
    from inflight.api.sampler import build_sampler
    from inflight.api.worker import EngineWorker, WorkerConfig

    session_id = f"behind{run}"
    models = [f"{session_id}:train:0", f"{session_id}:train:1"]
    with tempfile.TemporaryDirectory(prefix="inflight-bench-serve-behind-") as tmp:
        database = Database(f"sqlite:///{tmp}/state.db")
        with database.write() as session:
            session.add(SessionRow(session_id=session_id))
            session.flush()
            for i, model_id in enumerate(models):
                row = ModelRow(
                    model_id=model_id,
                    session_id=session_id,
                    model_seq_id=i,
                    base_model="bench",
                    lora_rank=8,
                    lora_config={"rank": 8},
                    status="ready",
                )
                session.add(row)
        sampler = build_sampler(compute.sampling_engines()).start()
        config = WorkerConfig(max_train_tokens_per_round=slice_tokens)
        store = CheckpointStore(database, Path(tmp))
        worker = EngineWorker(compute, sampler, database, store, limits=limits, config=config)
        for model_id in models:
            compute.create_adapter(model_id, "bench", LoraSpec(rank=8, seed=0))
            created = worker.store.submit(model_id, FIRST_SEQ_ID, RequestType.CREATE_MODEL, b"{}")
            worker.store.claim_next(model_id)
            worker.store.complete(created.request_id, b"{}")
        worker.start()
        try:
            yield worker, models
        finally:
            worker.stop()
            sampler.stop()
            for model_id in models:
                compute.delete_adapter(model_id)
            database.close()


def _finish_times(worker: Any, request_ids: dict[str, str], timeout_s: float = 600) -> dict[str, float]:
    """time.monotonic() at which each request was seen finished; raises if one failed."""
    finished: dict[str, float] = {}
    deadline = time.monotonic() + timeout_s
    while len(finished) < len(request_ids):
        if time.monotonic() > deadline:
            raise TimeoutError(f"requests not finished within {timeout_s:g} s: {request_ids}")
        for name, request_id in request_ids.items():
            future = worker.store.get(request_id)
            if name not in finished and future.finished:
                if future.status != "done":
                    raise RuntimeError(f"the {name} request failed: {future.error}")
                finished[name] = time.monotonic()
        time.sleep(0.005)
    return finished


def _submit_forward_backward(worker: Any, model_id: str, tokens: int) -> Any:
    """A cross_entropy forward_backward of `tokens` tokens (datums of up to 256) as the routes queue it."""
    import tinker
    from tinker.proto.request_conv import forward_backward_request_to_proto

    from inflight.api.futures import FIRST_SEQ_ID, RequestType

    types = tinker.types
    lengths = [256] * (tokens // 256) + ([tokens % 256] if tokens % 256 else [])
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints([5 + j % 50 for j in range(n)]),
            loss_fn_inputs={"target_tokens": [6 + j % 50 for j in range(n)]},
        )
        for n in lengths
    ]
    request = types.ForwardBackwardRequest(
        model_id=model_id,
        seq_id=FIRST_SEQ_ID + 1,
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"),
    )
    payload = forward_backward_request_to_proto(request).SerializeToString()
    future = worker.store.submit(model_id, FIRST_SEQ_ID + 1, RequestType.FORWARD_BACKWARD, payload)
    worker.wake(RequestType.FORWARD_BACKWARD, future)
    return future


# ---- API overhead and checkpoint round trip -------------------------------------------------------------
# The per-request cost of going through the service (SDK -> HTTP -> routes -> futures table -> worker ->
# engine -> result -> long-poll) beyond the engine call itself: the same small forward request timed through
# the unmodified `tinker` SDK against a server on loopback, and as a direct engine call. The same server
# then serves the checkpoint round trips.

API_KEY = "tml-bench"


def measure_api(
    compute: Any,
    model_dir: str,
    requests: int,
    round_trips: int,
    rank: int,
    *,
    server: str = "thread",
    dtype: str = "auto",
) -> dict[str, Any]:
    """{"api_ms_per_request", "direct_ms_per_request", "api_overhead_ms"}, "api_floor_ms" with the thread
    server, and with round_trips > 0 the checkpoint_* keys; or {"api_error": why} in their place."""
    import tinker
    from tinker import types

    from inflight.api.job_types import Datum, ForwardBackwardJob, LoraSpec
    from inflight.api.proto import encode_forward_backward_output

    tokens = list(range(10, 42))
    compute.create_adapter("api-direct", "bench", LoraSpec(rank=8, seed=0))
    job = ForwardBackwardJob(
        "api-direct", [Datum(tokens[:-1], {"target_tokens": tokens[1:]})], "cross_entropy", backward=False
    )

    def direct() -> None:
        _check(compute.forward_backward([job]))

    result: dict[str, Any] = {"api_server": server}
    stub = _InstantForwards(encode_forward_backward_output(compute.forward_backward([job])[0]))
    try:
        with _service(model_dir, server, dtype, stub) as url:
            client = tinker.ServiceClient(base_url=url, api_key=API_KEY)
            training = client.create_lora_training_client(base_model="bench", rank=8, seed=0).result(
                timeout=120
            )
            # The SDK turns plain lists into TensorData (as the cookbook's datums rely on).
            targets: Any = tokens[1:]
            datum = types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": targets}
            )
            runs: dict[str, Callable[[], object]] = {
                "direct": direct,
                "api": lambda: training.forward([datum], "cross_entropy").result(timeout=60),
            }
            if server == "thread":  # a second model whose forwards the stub answers
                floor = client.create_lora_training_client(base_model="bench", rank=8, seed=0).result(
                    timeout=120
                )
                stub.model_id = floor.model_id
                runs["floor"] = lambda: floor.forward([datum], "cross_entropy").result(timeout=60)
            medians = _median_ms_alternating(runs, requests)
            result["direct_ms_per_request"] = round(medians["direct"], 2)
            result["api_ms_per_request"] = round(medians["api"], 2)
            result["api_overhead_ms"] = round(medians["api"] - medians["direct"], 2)
            if "floor" in medians:
                result["api_floor_ms"] = round(medians["floor"], 2)
            if round_trips > 0:
                adapter = client.create_lora_training_client(base_model="bench", rank=rank, seed=0).result(
                    timeout=120
                )
                result.update(measure_checkpoint_round_trip(adapter, url, model_dir, round_trips))
            client.close("success").result(timeout=60)  # its sessions' heartbeats stop with the server
    except Exception as exc:  # the service is optional here: report why instead of failing the benchmark
        result["api_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return result


def measure_checkpoint_round_trip(
    training: Any, url: str, model_dir: str, round_trips: int
) -> dict[str, Any]:
    """Median ms of each phase of save -> download -> load into peft, after one warm-up trip."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    phases: dict[str, list[float]] = {"save": [], "download": [], "peft_load": []}
    archive_bytes = 0
    base = AutoModelForCausalLM.from_pretrained(model_dir)  # the user's base model, loaded beforehand
    for trip in range(round_trips + 1):
        with tempfile.TemporaryDirectory(prefix="inflight-bench-serve-ckpt-") as into:
            start = time.perf_counter()
            path = training.save_weights_for_sampler(f"bench-{trip}").result(timeout=120).path
            saved = time.perf_counter()
            archive_bytes = _download_archive(url, path, Path(into))
            downloaded = time.perf_counter()
            adapted = PeftModel.from_pretrained(base, into)
            loaded = time.perf_counter()
            base = adapted.unload()  # the LoRA layers out again: the next trip starts from the bare base
        if trip > 0:  # the first trip warms the routes, the imports and the file cache
            phases["save"].append(1000 * (saved - start))
            phases["download"].append(1000 * (downloaded - saved))
            phases["peft_load"].append(1000 * (loaded - downloaded))
    medians = {name: sorted(times)[len(times) // 2] for name, times in phases.items()}
    return {
        "checkpoint_save_ms": round(medians["save"], 2),
        "checkpoint_download_ms": round(medians["download"], 2),
        "checkpoint_peft_load_ms": round(medians["peft_load"], 2),
        "checkpoint_round_trip_ms": round(sum(medians.values()), 2),
        "checkpoint_archive_bytes": archive_bytes,
        "checkpoint_round_trips": round_trips,
    }


def _download_archive(url: str, tinker_path: str, into: Path) -> int:
    """As a user fetches a checkpoint: GET its archive route (with the key) for a signed link, download that
    link with plain urllib (no key), extract the tar. Returns the archive's size in bytes."""
    import io
    import tarfile
    import urllib.request

    from tinker import types

    parsed = types.ParsedCheckpointTinkerPath.from_tinker_path(tinker_path)
    route = f"{url}/api/v1/training_runs/{parsed.training_run_id}/checkpoints/{parsed.checkpoint_id}/archive"
    request = urllib.request.Request(route, headers={"X-API-Key": API_KEY})
    with urllib.request.urlopen(request, timeout=60) as response:
        link = json.loads(response.read())["url"]
    with urllib.request.urlopen(link, timeout=60) as response:
        data = response.read()
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    return len(data)


def _median_ms_alternating(runs: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median ms per run after one warm-up each; the runs alternate call by call, so load hits all alike."""
    for fn in runs.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            times[name].append(1000 * (time.perf_counter() - start))
    return {name: sorted(values)[len(values) // 2] for name, values in times.items()}


class _InstantForwards:
    """ASGI in front of the service: answers the forward requests of one model (`model_id`, set once it
    exists) and the retrieves of their futures at once, with a stored result, and passes the rest on. What
    the SDK then spends on a forward is its own cost and HTTP's: the floor under any server."""

    _FIRST_ID = 10**15  # far above any request_id the database hands out

    def __init__(self, result: bytes) -> None:
        self.result = result
        self.model_id: str | None = None
        self.app: Any = None
        self._issued = 0

    @property
    def state(self) -> Any:
        """The app's: BackgroundServer reads its uvicorn protocol (`http_protocol`) there."""
        return self.app.state

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if (
            scope["type"] != "http"
            or self.model_id is None
            or not path.endswith(("/forward_backward", "/retrieve_future"))
        ):
            await self.app(scope, receive, send)
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        answer = self._answer(path, body)
        if answer is None:  # another model's request, or a real future: the service's
            await self.app(scope, _replay(body), send)
            return
        content_type, content = answer
        headers = [(b"content-type", content_type), (b"content-length", str(len(content)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": content})

    def _answer(self, path: str, body: bytes) -> tuple[bytes, bytes] | None:
        from tinker.proto import tinker_public_pb2 as pb

        if path.endswith("/retrieve_future"):
            request_id = int(json.loads(body)["request_id"])
            return (b"application/x-protobuf", self.result) if request_id >= self._FIRST_ID else None
        request = pb.ForwardBackwardRequest()
        request.ParseFromString(body)
        if request.model_id != self.model_id:
            return None
        self._issued += 1
        future = {"request_id": str(self._FIRST_ID + self._issued), "model_id": self.model_id}
        return b"application/json", json.dumps(future).encode()


def _replay(body: bytes) -> Callable[[], Any]:
    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    return receive


@contextlib.contextmanager
def _service(model_dir: str, server: str, dtype: str, stub: _InstantForwards) -> Iterator[str]:
    """`inflight serve`'s app on a loopback port, SQLite in a fresh state dir; yields its base URL. `thread`:
    the app (behind `stub`) in this process, bound as `inflight serve` binds; `process`: the command."""
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    state_dir = Path(tempfile.mkdtemp(prefix="inflight-bench-serve-api-"))
    try:
        if server == "thread":
            from inflight.api.app import BackgroundServer, create_app
            from inflight.api.service import ServiceConfig

            stub.app = create_app(
                ServiceConfig(base_models={"bench": model_dir}, state_dir=state_dir, dtype=cast(Any, dtype))
            )
            with BackgroundServer(cast(Any, stub)) as background:
                yield background.url
        else:
            with _served_process(model_dir, state_dir, dtype) as url:
                yield url
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)


@contextlib.contextmanager
def _served_process(model_dir: str, state_dir: Path, dtype: str) -> Iterator[str]:
    """`inflight serve` in a subprocess, its torch threads as this process's; its log in the state dir."""
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "inflight.cli", "serve", "--base-model", f"bench={model_dir}"]
    command += ["--state-dir", str(state_dir), "--port", str(port), "--dtype", dtype]
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    log_path = state_dir / "serve.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                with urllib.request.urlopen(f"{url}/api/v1/healthz", timeout=5):
                    break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"inflight serve did not start: {log_path.read_text()[-500:]}"
                    ) from None
                time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


if __name__ == "__main__":
    main()
