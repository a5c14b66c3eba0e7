"""The service's compute: batched multi-adapter forward_backward vs the same requests one by one, the
per-request overhead of the HTTP API (the unmodified `tinker` SDK against an in-process server) over a
direct in-process engine call, and the cost of a checkpoint round trip through that server.

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
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, get_args

import torch

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
    parser.add_argument("--adapters", type=int, default=8, help="adapters, one job each")
    parser.add_argument("--datums", type=int, default=2, help="datums per forward_backward job")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per datum")
    parser.add_argument("--rank", type=int, default=32, help="LoRA rank of every adapter")
    parser.add_argument("--samples", type=int, default=4, help="sequences per sampling job")
    parser.add_argument("--sample-tokens", type=int, default=16, help="tokens generated per sequence")
    parser.add_argument(
        "--max-batch-tokens",
        type=int,
        default=None,
        help="engine micro-batch (padded tokens); default: the engine's",
    )
    parser.add_argument(
        "--dtype",
        choices=get_args(DtypeName),
        default="auto",
        help="base weights, as `inflight serve --dtype` (default: the service's, auto)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument(
        "--api-requests", type=int, default=10, help="timed requests through the API (0 = skip the API part)"
    )
    parser.add_argument(
        "--checkpoint-round-trips",
        type=int,
        default=3,
        help="timed checkpoint round trips (save, download, load into peft) through the API (0 = skip)",
    )
    parser.add_argument("--model", default=None, help="HF model dir or hub id (default: the tiny preset)")
    args = parser.parse_args(argv)
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
            measure_api(compute, args.model, args.api_requests, args.checkpoint_round_trips, args.rank)
        )
    print(json.dumps(result))
    return result


# ---- API overhead and checkpoint round trip -------------------------------------------------------------
# The per-request cost of going through the service (SDK -> HTTP -> routes -> futures table -> worker ->
# engine -> result -> long-poll) beyond the engine call itself: the same small forward request timed through
# the unmodified `tinker` SDK against an in-process uvicorn on loopback, and as a direct engine call. The
# same server then serves the checkpoint round trips.

API_KEY = "tml-bench"


def measure_api(compute: Any, model_dir: str, requests: int, round_trips: int, rank: int) -> dict[str, Any]:
    """{"api_ms_per_request", "direct_ms_per_request", "api_overhead_ms"} and, with round_trips > 0, the
    checkpoint_* keys; or {"api_error": why} in their place."""
    import tinker
    from tinker import types

    from inflight.api.job_types import Datum, ForwardBackwardJob, LoraSpec

    tokens = list(range(10, 42))
    compute.create_adapter("api-direct", "bench", LoraSpec(rank=8, seed=0))
    job = ForwardBackwardJob(
        "api-direct", [Datum(tokens[:-1], {"target_tokens": tokens[1:]})], "cross_entropy", backward=False
    )
    direct = _median_ms(lambda: _check(compute.forward_backward([job])), requests)
    result: dict[str, Any] = {"direct_ms_per_request": round(direct, 2)}
    try:
        with _in_process_service(model_dir) as url:
            client = tinker.ServiceClient(base_url=url, api_key=API_KEY)
            training = client.create_lora_training_client(base_model="bench", rank=8, seed=0).result(
                timeout=120
            )
            # The SDK turns plain lists into TensorData (as the cookbook's datums rely on).
            targets: Any = tokens[1:]
            datum = types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": targets}
            )
            api = _median_ms(lambda: training.forward([datum], "cross_entropy").result(timeout=60), requests)
            result["api_ms_per_request"] = round(api, 2)
            result["api_overhead_ms"] = round(api - direct, 2)
            if round_trips > 0:
                adapter = client.create_lora_training_client(base_model="bench", rank=rank, seed=0).result(
                    timeout=120
                )
                result.update(measure_checkpoint_round_trip(adapter, url, model_dir, round_trips))
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


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - start))
    return sorted(times)[len(times) // 2]


@contextlib.contextmanager
def _in_process_service(model_dir: str) -> Iterator[str]:
    """`inflight serve`'s app on a free loopback port (uvicorn in a thread, SQLite); yields its base URL."""
    import uvicorn

    from inflight.api.app import create_app
    from inflight.api.service import ServiceConfig

    os.environ.setdefault("TINKER_TELEMETRY", "0")
    state_dir = Path(tempfile.mkdtemp(prefix="inflight-bench-serve-api-"))
    app = create_app(ServiceConfig(base_models={"bench": model_dir}, state_dir=state_dir))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 120
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise TimeoutError("the in-process service did not start within 120 s")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        shutil.rmtree(state_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
