"""The supported `tinker` SDK range: one minimal walk, run by each SDK version in its own environment.

Reference: /work/shared/reference/tinker-api.md §2 (call order), §6 (protobuf) and §14 (acceptance walk);
the JSON-era request shapes come from the SDKs' own sources (0.22.7 and 0.24.1 send forward_backward and
forward as JSON; 0.25.0 on send protobuf). Each version is installed once into a cached virtual environment
(`$INFLIGHT_SDK_CACHE`, default `~/.cache/inflight/sdk-envs/tinker-VERSION`) and drives a server this test
starts on a loopback port. Every walk's numbers must equal those of the SDK pinned in this project's own
environment against the same server: the JSON and protobuf paths compute the same thing.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tinker

from inflight.api.app import BackgroundServer, create_app
from inflight.api.service import ServiceConfig
from inflight.launch.venv_cache import cached_venv

pytestmark = pytest.mark.slow

SDK_VERSIONS = ("0.22.7", "0.24.1", "0.25.0", "0.30.4", "0.38.0")
WITH_ARCHIVE_URL = {"0.22.7", "0.24.1", "0.25.0", "0.30.4"}  # RestClient.get_checkpoint_archive_url
BASE = "tiny-base"
API_KEY = "tml-sdk-range"
PIP_INSTALL_TIMEOUT_S = 900

# The walk a new user makes, written against the API every version in the range shares. Prints one JSON
# line of what it saw. Clients are futures from 0.38 on ("Backcompat...Future") and plain objects before.
WALK = textwrap.dedent(
    """
    import importlib.metadata, json, os, sys, tarfile, urllib.request
    import tinker
    from tinker import types

    base_url, base_model, archive_dir = sys.argv[1:4]

    def ready(value):
        return value.result() if "Future" in type(value).__name__ else value

    tokens = list(range(3, 19))
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [0.0] * 2 + [1.0] * 13},
    )
    service = tinker.ServiceClient(base_url=base_url)
    training = ready(service.create_lora_training_client(base_model=base_model, rank=4, seed=0))
    before = training.forward([datum], "cross_entropy").result()
    fwd_bwd = training.forward_backward([datum], "cross_entropy")
    step = training.optim_step(types.AdamParams(learning_rate=1e-2))
    fwd_bwd, step = fwd_bwd.result(), step.result()
    after = training.forward([datum], "cross_entropy").result()
    sampler = ready(training.save_weights_and_get_sampling_client())
    params = types.SamplingParams(max_tokens=5, temperature=1.0, seed=11, stop=[])
    sample = sampler.sample(types.ModelInput.from_ints(tokens[:4]), 2, params).result()
    state = training.save_state("walk").result()
    named = training.save_weights_for_sampler("walk").result()
    archive = None
    rest = service.create_rest_client()
    if hasattr(rest, "get_checkpoint_archive_url_from_tinker_path"):  # the SDKs before 0.34
        url = rest.get_checkpoint_archive_url_from_tinker_path(named.path).result().url
        with urllib.request.urlopen(url, timeout=60) as response:  # as `tinker checkpoint download`
            with tarfile.open(fileobj=response, mode="r|") as tar:
                tar.extractall(archive_dir)
        archive = {"url": url}
    if hasattr(service, "close"):  # 0.30 on: the session ends and its heartbeats stop
        service.close("success").result()
    print(json.dumps({
        "version": importlib.metadata.version("tinker"),
        "model_id": training.model_id,
        "loss_before": before.metrics["loss:sum"],
        "loss_fwd_bwd": fwd_bwd.metrics["loss:sum"],
        "loss_after": after.metrics["loss:sum"],
        "logprobs_after": after.loss_fn_outputs[0]["logprobs"].tolist(),
        "sample_tokens": [list(s.tokens) for s in sample.sequences],
        "sample_logprobs": [list(s.logprobs) for s in sample.sequences],
        "state_path": state.path,
        "sampler_path": named.path,
        "archive": archive,
    }), flush=True)
    # Past the walk, the interpreter's own shutdown is not under test: 0.38.0's walk aborted there (SIGABRT
    # after printing, nothing on stderr) in 2 of 19 runs of this file one morning, session closed or not.
    os._exit(0)
    """
)


def sdk_cache_dir() -> Path:
    configured = os.environ.get("INFLIGHT_SDK_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "inflight" / "sdk-envs"


def sdk_python(version: str) -> Path:
    """The interpreter of a virtual environment holding `tinker==version`, created once and then reused.

    Built beside its final place and renamed into it only when the install succeeded (`cached_venv`)."""

    def build(directory: Path) -> None:
        subprocess.run([sys.executable, "-m", "venv", str(directory)], check=True, capture_output=True)
        install = subprocess.run(
            [str(directory / "bin" / "python"), "-m", "pip", "install", "-q", f"tinker=={version}"],
            capture_output=True,
            text=True,
            timeout=PIP_INSTALL_TIMEOUT_S,
        )
        if install.returncode != 0:
            pytest.fail(f"pip install tinker=={version} failed:\n{install.stdout}\n{install.stderr}")

    return cached_venv(sdk_cache_dir() / f"tinker-{version}", build)


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    config = ServiceConfig(
        base_models={BASE: str(tiny_model_dir)},
        state_dir=tmp_path_factory.mktemp("serve"),
        api_keys=[API_KEY],
        dtype="float32",  # the numbers are compared across SDK versions: keep them exact
    )
    with BackgroundServer(create_app(config)) as running:
        yield running


def run_walk(python: Path, server: BackgroundServer, archive_dir: Path) -> dict:
    env = {
        **os.environ,
        "TINKER_API_KEY": API_KEY,
        "TINKER_TELEMETRY": "0",
        "HF_HUB_OFFLINE": "1",
        "PYTHONNOUSERSITE": "1",
    }
    env.pop("TINKER_BASE_URL", None)
    proc = subprocess.run(
        [str(python), "-c", WALK, server.url, BASE, str(archive_dir)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, f"the walk failed:\n{proc.stdout}\n{proc.stderr}"
    result: dict = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


@pytest.fixture(scope="module")
def walks(server: BackgroundServer, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict, Path]]:
    """Each version's walk and the directory its archive went to, plus "reference": the walk by the SDK of
    this project's own environment (the pinned 0.38.0). Environments are made one at a time; the walks,
    mostly interpreter start-up and imports, run at once."""
    pythons = {version: sdk_python(version) for version in SDK_VERSIONS}
    pythons["reference"] = Path(sys.executable)
    dirs = {name: tmp_path_factory.mktemp(f"archive-{name}") for name in pythons}
    with concurrent.futures.ThreadPoolExecutor(len(pythons)) as pool:
        results = {
            name: pool.submit(run_walk, python, server, dirs[name]) for name, python in pythons.items()
        }
        return {name: (future.result(), dirs[name]) for name, future in results.items()}


@pytest.mark.parametrize("version", SDK_VERSIONS)
def test_the_walk_runs_alike_on_every_sdk_in_the_range(
    version: str, server: BackgroundServer, walks: dict[str, tuple[dict, Path]]
) -> None:
    (walk, archive_dir), (reference, _) = walks[version], walks["reference"]
    assert (walk["version"], reference["version"]) == (version, "0.38.0")
    session_id, _, seq = walk["model_id"].rpartition(":train:")
    assert session_id and seq == "0"
    assert walk["state_path"] == f"tinker://{walk['model_id']}/weights/walk"
    assert walk["sampler_path"] == f"tinker://{walk['model_id']}/sampler_weights/walk"
    # forward_backward saw the weights forward saw; one step lowered the loss.
    assert walk["loss_fwd_bwd"] == pytest.approx(walk["loss_before"], rel=1e-6)
    assert walk["loss_after"] < walk["loss_before"]
    # JSON (before 0.25) and protobuf bodies are one computation: the same numbers as the pinned SDK's.
    for key in ("loss_before", "loss_after"):
        assert walk[key] == pytest.approx(reference[key], rel=1e-6), key
    assert walk["logprobs_after"] == pytest.approx(reference["logprobs_after"], abs=1e-6)
    assert walk["sample_tokens"] == reference["sample_tokens"]  # seeded: identical tokens
    assert all(len(tokens) == 5 for tokens in walk["sample_tokens"])
    assert [len(lp) for lp in walk["sample_logprobs"]] == [5, 5]
    assert (walk["archive"] is not None) is (version in WITH_ARCHIVE_URL)
    if walk["archive"] is not None:  # downloaded as `tinker checkpoint download` does: urllib, no key
        assert walk["archive"]["url"].startswith(server.url)
        assert {"adapter_model.safetensors", "adapter_config.json", "checkpoint_complete"} <= {
            p.name for p in archive_dir.iterdir()
        }


def test_json_bodies_are_checked_like_protobuf_ones(server: BackgroundServer) -> None:
    """What the JSON-era SDKs send, made hostile: a 4xx naming the field, or (once the seq_id is known) a
    future failed as the user's error that leaves no gap in the model's queue."""
    service = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
    model_id = service.create_lora_training_client(base_model=BASE, rank=4).result().model_id
    http = httpx.Client(base_url=f"{server.url}/api/v1", headers={"X-API-Key": API_KEY})

    def body(seq_id: int | None, **tensor: object) -> dict:
        targets = {"data": [4, 5, 6], "dtype": "int64", "shape": [3], **tensor}
        datum = {
            "model_input": {"chunks": [{"type": "encoded_text", "tokens": [3, 4, 5]}]},
            "loss_fn_inputs": {"target_tokens": targets},
        }
        request = {
            "forward_backward_input": {"data": [datum], "loss_fn": "cross_entropy"},
            "model_id": model_id,
        }
        return request if seq_id is None else {**request, "seq_id": seq_id}

    def outcome(response: httpx.Response) -> dict:
        assert response.status_code == 200, response.text
        request_id = response.json()["request_id"]
        while True:
            polled = http.post(
                "retrieve_future", json={"request_id": request_id}, headers={"Accept": "application/json"}
            )
            if polled.headers["content-type"].startswith("application/x-protobuf"):
                return {"done": True}
            if polled.json().get("type") != "try_again":
                result: dict = polled.json()
                return result

    plain = http.post("forward_backward", content=b"{}", headers={"Content-Type": "text/plain"})
    assert plain.status_code == 400 and "Content-Type" in plain.json()["detail"]
    missing = http.post("forward_backward", json=body(None))
    assert missing.status_code == 422 and ["body", "seq_id"] in [e["loc"] for e in missing.json()["detail"]]
    # A body that fails validation but names its seq_id: a failed future naming the field, not a 422.
    image = body(1)
    image["forward_backward_input"]["data"][0]["model_input"]["chunks"] = [{"type": "image", "data": "x"}]
    failed = outcome(http.post("forward_backward", json=image))
    assert failed["category"] == "user" and "body.forward_backward_input.data.0" in failed["error"], failed

    failures = {
        "not an integer": outcome(http.post("forward_backward", json=body(2, data=[4, 5.5, 6]))),
        "sparse": outcome(http.post("forward_backward", json=body(3, sparse_crow_indices=[0, 3]))),
        "outside the vocabulary": outcome(http.post("forward_backward", json=body(4, data=[4, 5, 10**9]))),
    }
    for words, failed in failures.items():
        assert failed["category"] == "user" and words in failed["error"], failed
        assert "loss_fn_inputs['target_tokens']" in failed["error"], failed
    # The queue went on: the next seq_ids run, as forward_backward and as the JSON-era /forward.
    assert outcome(http.post("forward_backward", json=body(5))) == {"done": True}
    forward = body(6)
    forward["forward_input"] = forward.pop("forward_backward_input")
    assert outcome(http.post("forward", json=forward)) == {"done": True}
    for seq_id, value in ((7, float("nan")), (8, 1e39)):  # NaN, and a number float32 cannot hold
        request = body(seq_id)
        request["forward_backward_input"]["data"][0]["loss_fn_inputs"]["weights"] = {
            "data": [value] * 3,
            "dtype": "float32",
        }
        content = json.dumps(request)  # writes NaN, which JSON parsers (pydantic's too) accept
        failed = outcome(
            http.post("forward_backward", content=content, headers={"Content-Type": "application/json"})
        )
        assert failed["category"] == "user" and "NaN or infinite" in failed["error"], failed
    # Closed while the server runs: the SDK stops its session's heartbeats (else they fail until exit).
    service.close("success").result()
