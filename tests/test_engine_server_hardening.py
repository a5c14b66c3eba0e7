"""`inflight serve-engine` against hostile or mistaken input: one request can fail only itself (never the
engine step the others share), bad fields get a 4xx naming them, options are checked before any weight is
read, and beyond loopback the server needs an API key, which the pipeline's clients send.

References: vLLM's OpenAI server (seeds bounded to int64; prompt + max_tokens beyond the context is a 400),
`inflight serve`'s key rule (`auth.py`, `tests/test_api_auth.py`), and `BuiltinEngine._non_finite`, the
pattern of a row that finishes alone with its error. Servers run in-process on free loopback ports.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from pydantic import ValidationError

from conftest import one_line_error
from inflight.inference import BuiltinEngine, BuiltinEngineConfig
from inflight.inference.access import API_KEY_ENV
from inflight.inference.client import EngineClient, EngineRequestError
from inflight.inference.engine_loop import EngineLoop
from inflight.inference.engine_loop import EngineRequestError as LoopRequestError
from inflight.inference.engine_service import EngineServerConfig
from inflight.inference.openai_api import CompletionRequest
from inflight.inference.server import ServerThread, create_app
from inflight.inference.wire import (
    MAX_BATCH_REQUESTS,
    GenerateBatchRequest,
    GenerateBatchResponse,
    GenerateRequest,
    GenerateResponse,
)
from inflight.models import load_model, load_tokenizer
from inflight.orchestrator.remote_engine import RemoteEngines
from inflight.types import Completion, SampleRequest, SamplingParams

KEY = "engine-test-key"
CONTEXT = 64  # the engines' max_seq_len_tokens here


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two shared cores
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return load_tokenizer(tiny_model_dir)


def make_engine(model_dir: Path) -> BuiltinEngine:
    config = BuiltinEngineConfig(max_batch_size=4, max_seq_len_tokens=CONTEXT)
    return BuiltinEngine(load_model(model_dir), load_tokenizer(model_dir), config)


@contextlib.contextmanager
def serving(model_dir: Path, tokenizer: Any, **config: Any) -> Iterator[str]:
    server = ServerThread(create_app(make_engine(model_dir), tokenizer, EngineServerConfig(**config))).start()
    try:
        yield server.url
    finally:
        server.stop()


def post(http: httpx.Client, path: str, body: dict[str, Any]) -> httpx.Response:
    """JSON as Python writes it: a lone surrogate escaped (\\ud800), NaN and Infinity as bare words."""
    return http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


def assert_still_serving(http: httpx.Client) -> None:
    health = http.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok", health.text
    served = http.post("/generate", json={"prompt_token_ids": [5, 6], "max_tokens": 2, "seed": 1})
    assert served.status_code == 200 and len(served.json()["token_ids"]) == 2, served.text
    assert http.get("/metrics").json()["requests_failed"] == 0


# -- one request fails only itself ------------------------------------------------------------------------


def test_a_seed_beyond_int64_is_refused_naming_it_and_the_engine_keeps_serving(
    tiny_model_dir: Path, tokenizer: Any
) -> None:
    """It used to reach torch.Generator.manual_seed in the engine's step: 503, and the engine loop dead for
    every client."""
    completion = {"prompt": "hi", "max_tokens": 1}
    cases = [
        ("/v1/completions", {**completion, "seed": 10**23}),
        ("/v1/completions", {**completion, "seed": -(2**63) - 1}),
        ("/v1/completions", {**completion, "seed": 2**63 - 1, "n": 2}),  # sample 1 would use 2**63
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "seed": 2**64}),
        ("/generate", {"prompt_token_ids": [5, 6], "max_tokens": 1, "seed": 2**64}),
        ("/generate_batch", {"requests": [{"prompt_token_ids": [5], "seed": 2**64}]}),
    ]
    with serving(tiny_model_dir, tokenizer) as url, httpx.Client(base_url=url, timeout=60) as http:
        for path, body in cases:
            reply = post(http, path, body)
            assert reply.status_code == 400 and "seed" in reply.json()["error"]["message"], (path, reply.text)
            assert_still_serving(http)
        edge = post(http, "/v1/completions", {**completion, "seed": 2**63 - 2, "n": 2})
        assert edge.status_code == 200, edge.text


def test_a_request_whose_own_setup_fails_in_the_step_fails_alone(tiny_model_dir: Path) -> None:
    """Defence in depth: a request that got past add_request's checks (here, with them switched off) and
    whose generator cannot be made fails alone at admission, like a row with non-finite logits; the request
    admitted in the same step gets exactly the tokens it gets alone, and the loop serves the next one."""
    checked = make_engine(tiny_model_dir)
    [alone] = checked.generate([SampleRequest([5, 6, 7], SamplingParams(max_tokens=4, seed=3))])
    for params, needle in [
        (SamplingParams(seed=2**64), "seed must lie in"),
        (SamplingParams(temperature=float("nan")), "temperature must be a finite number"),
        (SamplingParams(stop_token_ids=(-7,)), "stop_token_ids holds -7"),
    ]:
        with pytest.raises(ValueError, match=needle):  # in-process callers are told at add_request
            checked.add_request(SampleRequest([5], params))
    engine = make_engine(tiny_model_dir)
    engine._validate = lambda *args, **kwargs: None  # type: ignore[method-assign]
    engine.add_request(SampleRequest([5, 6], SamplingParams(max_tokens=4, seed=2**64), request_id="bad"))
    engine.add_request(SampleRequest([5, 6, 7], SamplingParams(max_tokens=4, seed=3), request_id="good"))
    finished = engine.step()  # both admitted in this step
    [failed] = [c for c in finished if c.request_id == "bad"]
    assert failed.finish_reason == "abort" and "Overflow" in (failed.error or "")
    done: dict[str, Any] = {}
    while engine.has_unfinished():
        done.update((c.request_id, c) for c in engine.step())
    assert (done["good"].token_ids, done["good"].logprobs) == (alone.token_ids, alone.logprobs)
    assert engine.metrics().admission_failures == 1
    loop = EngineLoop(engine).start()
    try:
        bad = loop.submit(SampleRequest([5], SamplingParams(max_tokens=2, seed=-(2**63) - 1)))
        with pytest.raises(LoopRequestError, match="Overflow"):
            bad.result(timeout=60)
        assert loop.submit(SampleRequest([5], SamplingParams(max_tokens=2))).result(timeout=60).token_ids
        assert loop.error is None and loop.running
    finally:
        loop.stop()


# -- fields refused with a 400 that names them -------------------------------------------------------------


def test_bad_fields_get_a_400_naming_them_and_the_server_keeps_serving(
    tiny_model_dir: Path, tokenizer: Any
) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    cases = [
        ("/v1/completions", {"prompt": "\ud800", "max_tokens": 1}, "prompt is not valid Unicode"),
        ("/v1/completions", {"prompt": ["ok", "a\udfffb"], "max_tokens": 1}, "prompt is not valid Unicode"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 10**9}, "max_tokens=1000000000"),
        ("/v1/completions", {"prompt": [5] * 10, "max_tokens": CONTEXT - 9}, "at most 54 tokens"),
        ("/v1/chat/completions", {**chat, "max_tokens": 10**9}, "max_tokens=1000000000"),
        ("/v1/chat/completions", {**chat, "max_completion_tokens": 10**9}, "max_completion_tokens=1000"),
        ("/v1/completions", {"prompt": "hi", "stop_token_ids": [-7]}, "stop_token_ids"),
        (
            "/v1/completions",
            {"prompt": "hi", "stop_token_ids": [123456789]},
            "stop_token_ids holds 123456789",
        ),
        ("/generate", {"prompt_token_ids": [5], "stop_token_ids": [-7]}, "stop_token_ids"),
        ("/generate", {"prompt_token_ids": [5], "stop_token_ids": [2, 123456789]}, "stop_token_ids holds"),
        (
            "/v1/completions",
            {"prompt": "hi", "temperature": float("nan")},
            "temperature: Input should be a finite",
        ),
        (
            "/v1/chat/completions",
            {**chat, "temperature": float("inf")},
            "temperature: Input should be a finite",
        ),
        (
            "/generate",
            {"prompt_token_ids": [5], "temperature": float("nan")},
            "temperature: Input should be a fin",
        ),
        ("/generate", {"prompt_token_ids": [5], "top_p": float("nan")}, "top_p: Input should be a finite"),
    ]
    with serving(tiny_model_dir, tokenizer) as url, httpx.Client(base_url=url, timeout=60) as http:
        for path, body, needle in cases:
            reply = post(http, path, body)
            assert reply.status_code == 400, (path, body, reply.text)
            assert needle in reply.json()["error"]["message"], (path, body, reply.text)
        assert_still_serving(http)
        # At the context exactly: served, and cut there ("length"), as vLLM serves it.
        full = http.post("/v1/completions", json={"prompt": [5] * 10, "max_tokens": CONTEXT - 10})
        assert full.status_code == 200 and full.json()["choices"][0]["finish_reason"] in ("length", "stop")
        # /generate keeps the Engine protocol's rule (the in-process engine's): cut at the context.
        cut = http.post("/generate", json={"prompt_token_ids": [5] * 10, "max_tokens": 10**9})
        assert cut.status_code == 200 and len(cut.json()["token_ids"]) <= CONTEXT - 10


# -- API keys ---------------------------------------------------------------------------------------------


def test_with_a_key_every_route_but_health_needs_it(tiny_model_dir: Path, tokenizer: Any) -> None:
    with serving(tiny_model_dir, tokenizer, api_keys=[KEY]) as url:
        app_paths = {"/generate", "/update_weights", "/update_weights_raw", "/set_adapter", "/metrics"}
        app_paths |= {"/v1/models", "/v1/completions", "/v1/chat/completions", "/adapters", "/docs"}
        with httpx.Client(base_url=url, timeout=60) as http:
            for path in sorted(app_paths):
                for headers in ({}, {"X-API-Key": ""}, {"X-API-Key": "wrong"}):
                    assert http.post(path, json={}, headers=headers).status_code == 401, (path, headers)
            assert http.get("/health").status_code == 200  # launchers and preflight probe without one
            keyed = http.post(
                "/generate", json={"prompt_token_ids": [5], "max_tokens": 1}, headers={"X-API-Key": KEY}
            )
            assert keyed.status_code == 200, keyed.text
            bearer = http.get("/metrics", headers={"Authorization": f"Bearer {KEY}"})
            assert bearer.status_code == 200
        # The openai client sends its api_key as a bearer token, as to vLLM's --api-key.
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
        assert client.completions.create(model="inflight", prompt="hi", max_tokens=1).choices[0].token_ids
        wrong = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError):
            wrong.completions.create(model="inflight", prompt="hi", max_tokens=1)


def test_the_pipelines_clients_send_the_key_from_the_environment(
    tiny_model_dir: Path, tokenizer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    request = SampleRequest([5, 6], SamplingParams(max_tokens=2, seed=1))

    async def remote_generate(url: str) -> list[int]:
        remote = RemoteEngines([url], tmp_path / "weights")  # what `pipeline.engine_urls` builds
        await remote.astart()
        try:
            return (await remote.generate(request, timeout_s=60)).token_ids
        finally:
            await remote.aclose()

    async def without_key(url: str) -> None:
        async with EngineClient(url) as client:
            await client.generate(request)

    with serving(tiny_model_dir, tokenizer, api_keys=[KEY]) as url:
        monkeypatch.delenv(API_KEY_ENV, raising=False)
        with pytest.raises(EngineRequestError, match="HTTP 401"):
            asyncio.run(without_key(url))
        monkeypatch.setenv(API_KEY_ENV, KEY)
        assert len(asyncio.run(remote_generate(url))) == 2


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--host", "0.0.0.0"], None, "refusing to serve the engine on '0.0.0.0' without an API key"),
        (["--host", "::", "--weights-dir", "."], None, "without an API key"),
        (["--host", "0.0.0.0", "--api-key", KEY], None, "without --weights-dir"),
        (["--host", "0.0.0.0"], KEY, "without --weights-dir"),
        (["--api-key", " "], None, "empty or blank"),
        ([], " ", f"{API_KEY_ENV} is set but blank"),
    ],
)
def test_serve_engine_refuses_a_public_host_without_a_key_in_one_line(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tiny_model_dir: Path,
    no_weights: None,
    args: list[str],
    env: str | None,
    message: str,
) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    if env is not None:
        monkeypatch.setenv(API_KEY_ENV, env)
    line = one_line_error(capsys, "serve-engine", "--model", str(tiny_model_dir), "--port", "0", *args)
    assert message in line, line


# -- serve-engine's options -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-batch-size", "0"], "--max-batch-size must be >= 1, got 0"),
        (["--max-seq-len-tokens", "1"], "--max-seq-len-tokens must be >= 2, got 1"),
        (
            ["--max-seq-len-tokens", "100000"],
            "--max-seq-len-tokens 100000 is more than the 2048 positions",
        ),
        (["--weights-dir", "/nonexistent"], "--weights-dir /nonexistent is not a directory"),
        (["--max-lora-rank", "8"], "--max-lora-rank is for --backend vllm only"),
        (["--max-logprobs", "5"], "--max-logprobs is for --backend vllm only"),
        (["--logprobs-kind", "raw"], "--logprobs-kind is for --backend vllm only"),
        (["--backend", "vllm", "--kv-policy", "recompute"], "--kv-policy is for --backend builtin only"),
        (["--backend", "vllm", "--device", "cpu"], "--device is for --backend builtin only"),
        (["--backend", "vllm", "--max-lora-rank", "0"], "--max-lora-rank must be >= 1, got 0"),
    ],
)
def test_serve_engine_options_are_checked_before_any_weight_is_read(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, no_weights: None, args: list[str], message: str
) -> None:
    line = one_line_error(capsys, "serve-engine", "--model", str(tiny_model_dir), "--port", "0", *args)
    assert message in line, line


def test_serve_engine_with_a_parent_pid_that_is_not_its_parent_says_what_the_flag_is_for(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, no_weights: None
) -> None:
    """--parent-pid is the launcher's own pid (`EngineProcess`): a wrong one named the problem, and now the
    fix too."""
    not_the_parent = str(os.getpid())  # serve-engine runs in this process, whose parent is another
    argv = ["serve-engine", "--model", str(tiny_model_dir), "--port", "0", "--parent-pid", not_the_parent]
    line = one_line_error(capsys, *argv)
    assert f"--parent-pid {not_the_parent} is not this process's parent ({os.getppid()})" in line, line
    assert "its own live pid" in line and "or drop --parent-pid" in line, line


# -- what the hostile-input pass found ---------------------------------------------------------------------


def test_paths_the_filesystem_cannot_look_up_are_a_400_and_outside_weights_dir_a_403_before_any_lookup(
    tiny_model_dir: Path, tokenizer: Any, tmp_path: Path
) -> None:
    """A name too long, a link loop and an unknown ~user were 500s with a traceback (Path.resolve raised).
    Outside weights_dir a path is refused as written, before resolve() reads the filesystem for it: a link
    loop out there used to answer differently (a 500) from any other path (a 403)."""
    weights_dir, outside = tmp_path / "weights", tmp_path / "outside"
    weights_dir.mkdir()
    outside.mkdir()
    for directory in (weights_dir, outside):
        (directory / "loop").symlink_to(directory / "loop")
    long_name = "x" * 300  # NAME_MAX is 255
    confined = [
        ("/update_weights", {"path": str(weights_dir / long_name), "version": 1}, 400, "cannot be looked up"),
        ("/update_weights", {"path": str(weights_dir / "loop"), "version": 1}, 400, "cannot be looked up"),
        ("/set_adapter", {"name": "a", "path": str(weights_dir / long_name), "version": 1}, 400, "looked up"),
        ("/update_weights", {"path": str(outside / "loop"), "version": 1}, 403, "outside"),
        (
            "/update_weights",
            {"path": str(weights_dir / ".." / "outside" / "loop"), "version": 1},
            403,
            "outside",
        ),
        ("/set_adapter", {"name": "a", "path": "~no-such-user-here/adapter", "version": 1}, 400, "looked up"),
    ]
    anywhere = [
        ("/update_weights", {"path": str(outside / "loop"), "version": 1}, 400, "cannot be looked up"),
        ("/set_adapter", {"name": "a", "path": "~no-such-user-here/adapter", "version": 1}, 400, "looked up"),
    ]
    for config, cases in (({"weights_dir": str(weights_dir)}, confined), ({}, anywhere)):
        with (
            serving(tiny_model_dir, tokenizer, **config) as url,
            httpx.Client(base_url=url, timeout=60) as http,
        ):
            for path, body, status, needle in cases:
                reply = http.post(path, json=body)
                assert reply.status_code == status and needle in reply.json()["error"]["message"], (
                    body,
                    reply.text,
                )
            assert_still_serving(http)


def test_a_prompt_longer_than_the_context_is_refused_from_its_beginning(
    tiny_model_dir: Path, tokenizer: Any
) -> None:
    """A text prompt was tokenized whole on the event loop before the engine refused it: a 20 MB one held
    every client's answers, /health's included, for 17 s. Now at most a few contexts' worth of it is."""
    text = "hello world " * 400_000  # 4.8 MB: ~4 s to tokenize whole on the test machine
    chat = {"messages": [{"role": "user", "content": text}], "max_tokens": 1}
    with serving(tiny_model_dir, tokenizer) as url, httpx.Client(base_url=url, timeout=60) as http:
        for path, body, field in [
            ("/v1/completions", {"prompt": text, "max_tokens": 1}, "prompt"),
            ("/v1/completions", {"prompt": ["hi", text], "max_tokens": 1}, "prompt"),
            ("/v1/chat/completions", chat, "messages"),
        ]:
            reply = http.post(path, json=body)
            message = reply.json()["error"]["message"]
            assert (
                reply.status_code == 400 and f"{field} is longer than this server's context of 64" in message
            )
            assert "characters alone are" in message, message
        fits = http.post("/v1/completions", json={"prompt": "hello world " * 4, "max_tokens": 1})
        assert fits.status_code == 200, fits.text
        assert_still_serving(http)


def test_the_handlers_tokenize_on_their_own_thread(tiny_model_dir: Path) -> None:
    """Off the event loop, and one thread only (a fast tokenizer object is not meant to be shared)."""
    seen: set[str] = set()
    handler_tokenizer = load_tokenizer(tiny_model_dir)
    for name in ("encode", "decode", "apply_chat_template"):
        original = getattr(handler_tokenizer, name)

        def recorded(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            seen.add(threading.current_thread().name)
            return _original(*args, **kwargs)

        setattr(handler_tokenizer, name, recorded)
    with serving(tiny_model_dir, handler_tokenizer) as url, httpx.Client(base_url=url, timeout=60) as http:
        seen.clear()  # create_app reads the template's end of turn, on the caller's thread
        completion = http.post(
            "/v1/completions", json={"prompt": ["hi", "there"], "max_tokens": 2, "logprobs": 1}
        )
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True}
        assert (
            completion.status_code == 200 and http.post("/v1/chat/completions", json=chat).status_code == 200
        )
    assert seen and all(name.startswith("tokenizer") for name in seen), seen


def test_one_request_asks_for_at_most_4096_sequences(tiny_model_dir: Path, tokenizer: Any) -> None:
    """5,000 prompts x n=64 queued 320,000 sequences from one request (/generate_batch takes 4,096)."""
    with serving(tiny_model_dir, tokenizer) as url, httpx.Client(base_url=url, timeout=60) as http:
        reply = http.post("/v1/completions", json={"prompt": [[5]] * 65, "n": 64, "max_tokens": 1})
        assert reply.status_code == 400, reply.text
        assert (
            "65 prompts x n=64 ask for 4160 sequences, more than the 4096" in reply.json()["error"]["message"]
        )
        assert (
            http.post("/v1/completions", json={"prompt": [[5]] * 64, "n": 64, "max_tokens": 1}).status_code
            == 200
        )
        assert_still_serving(http)


def test_a_client_that_leaves_costs_the_log_no_traceback(
    tiny_model_dir: Path, tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Each client that left mid-generation used to cost asyncio's "_GatheringFuture exception was never
    retrieved" and a CancelledError in the server's log."""
    batch = {"requests": [{"prompt_token_ids": [5], "max_tokens": CONTEXT - 2, "stop_token_ids": []}] * 256}
    with serving(tiny_model_dir, tokenizer) as url, httpx.Client(base_url=url, timeout=60) as http:
        for _ in range(2):
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{url}/generate_batch", json=batch, timeout=0.5)
            deadline = time.monotonic() + 30
            while http.get("/health").json()["num_running"] and time.monotonic() < deadline:
                time.sleep(0.05)  # the server aborted them once it saw the client gone
        assert_still_serving(http)
    gc.collect()  # asyncio logs a never-retrieved exception when its future is collected
    assert "never retrieved" not in caplog.text, caplog.text


class _Unwalkable(str):
    """A text prompt that fails the test if anything walks it character by character."""

    def __iter__(self) -> Iterator[str]:
        raise AssertionError("the text prompt was walked character by character")


def test_a_text_prompt_is_validated_without_walking_it() -> None:
    """The empty-prompt check walked a text prompt character by character, on the event loop: 2.2 s for
    20 MB here, every client's answers, /health's included, held meanwhile. Now only a list is walked."""
    request = CompletionRequest.model_construct(
        prompt=_Unwalkable("x" * 1000),
        max_tokens=1,
        logprobs=None,
        echo=False,
        suffix=None,
        best_of=None,
        n=1,
    )
    assert request._reject_unsupported_completion() is request
    for empty in ("", [], [""], [[]], ["ok", ""]):
        with pytest.raises(ValueError, match="prompt is empty"):
            CompletionRequest.model_validate({"prompt": empty})


def test_tiny_temperature_and_top_p_are_greedy_not_an_error(tiny_model_dir: Path, tokenizer: Any) -> None:
    """temperature=1e-300 (float32 rounds it to 0: the logits divided by it are infinite) and top_p=1e-300
    (the nucleus kept no token) made the row's logits NaN: a 422 blaming diverged weights. As vLLM (and
    `inflight serve`) do, a temperature below 1e-5 is greedy, reporting what temperature 0 reports; a top_p
    always keeps the top token, so a tiny one draws the argmax, whose sampled logprob is then log 1 = 0."""
    generate = {"prompt_token_ids": [5, 6, 7], "max_tokens": 6}
    with serving(tiny_model_dir, tokenizer) as url, httpx.Client(base_url=url, timeout=60) as http:
        greedy = http.post("/generate", json={**generate, "temperature": 0}).json()
        for tiny in (1e-300, 1e-6):
            reply = http.post("/generate", json={**generate, "temperature": tiny, "top_p": 0.5, "seed": 1})
            assert reply.status_code == 200, reply.text
            assert (reply.json()["token_ids"], reply.json()["logprobs"]) == (
                greedy["token_ids"],
                greedy["logprobs"],
            )
        nucleus = http.post("/generate", json={**generate, "top_p": 1e-300, "seed": 1})
        assert nucleus.status_code == 200, nucleus.text
        assert nucleus.json()["token_ids"] == greedy["token_ids"]
        assert nucleus.json()["logprobs"] == [0.0] * len(greedy["token_ids"])
        raw = http.post("/generate", json={**generate, "top_p": 1e-300, "logprobs_kind": "raw"}).json()
        assert raw["logprobs"] == pytest.approx(greedy["logprobs"], abs=1e-5)
        for body in ({"temperature": 1e-300}, {"top_p": 1e-300}):
            completion = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, **body})
            assert completion.status_code == 200, completion.text
        assert_still_serving(http)


def test_request_ids_and_broadcast_joins_are_refused_before_anything_runs(
    tiny_model_dir: Path, tokenizer: Any
) -> None:
    """A request_id holding a lone surrogate had its generation run, then a 400 when the answer that echoes
    it could not be encoded; one of 1 MB was taken and echoed. /weight_broadcast/join answered 200 to a
    world_size or timeout_s that torch cannot take (2**31, 1e300, Infinity), then failed in the background."""
    generate = {"prompt_token_ids": [5], "max_tokens": 1}
    join = {"host": "127.0.0.1", "port": 29500, "world_size": 2, "rank": 1}
    cases = [
        ("/generate", {**generate, "request_id": "a\ud800"}, "request_id: Value error, not valid Unicode"),
        (
            "/generate",
            {**generate, "request_id": "x" * 1_000_000},
            "request_id: String should have at most 256",
        ),
        (
            "/generate_batch",
            {"requests": [generate, {**generate, "request_id": "\udfff"}]},
            "requests.1.request_id",
        ),
        (
            "/weight_broadcast/join",
            {**join, "world_size": 2**31},
            "world_size: Input should be less than or equal to 1024",
        ),
        (
            "/weight_broadcast/join",
            {**join, "timeout_s": 1e300},
            "timeout_s: Input should be less than or equal to 3600",
        ),
        (
            "/weight_broadcast/join",
            {**join, "timeout_s": float("inf")},
            "timeout_s: Input should be a finite number",
        ),
        ("/weight_broadcast/join", {**join, "timeout_s": 0}, "timeout_s: Input should be greater than 0"),
        ("/weight_broadcast/join", {**join, "host": "\ud800"}, "host: Value error, not valid Unicode"),
        ("/weight_broadcast/join", {**join, "host": "h" * 300}, "host: String should have at most 253"),
        ("/weight_broadcast/join", {**join, "rank": 2}, "rank 2 is not a receiver of a group of 2"),
    ]
    with serving(tiny_model_dir, tokenizer) as url, httpx.Client(base_url=url, timeout=60) as http:
        for path, body, needle in cases:
            reply = post(http, path, body)
            assert reply.status_code == 400 and needle in reply.json()["error"]["message"], (path, reply.text)
        metrics = http.get("/metrics").json()
        assert metrics["requests_total"] == 0 and metrics["broadcast_error"] is None, metrics
        named = http.post("/generate", json={**generate, "request_id": "r" * 256})
        assert named.status_code == 200 and named.json()["request_id"] == "r" * 256
        assert_still_serving(http)


def test_engine_client_splits_a_turn_of_more_calls_than_a_batch_takes() -> None:
    """Every call of one event-loop turn went in one /generate_batch; past 4,096 (MAX_BATCH_REQUESTS) its
    schema (the client's, as the server's) refused them all. A fake server that validates the bodies as the
    real one does counts them."""
    sizes: list[int] = []

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        items = [GenerateRequest.model_validate(body)] if request.url.path == "/generate" else None
        if items is None:
            try:
                items = GenerateBatchRequest.model_validate(body).requests
            except ValidationError as exc:
                return httpx.Response(400, json={"error": {"message": str(exc)}})
        sizes.append(len(items))
        replies = [
            GenerateResponse(
                request_id=item.request_id or "",
                token_ids=[7],
                logprobs=[-0.5],
                versions=[0],
                finish_reason="length",
            )
            for item in items
        ]
        if request.url.path == "/generate":
            return httpx.Response(200, json=replies[0].model_dump())
        return httpx.Response(200, json=GenerateBatchResponse(completions=replies).model_dump())

    async def many(count: int) -> list[Completion]:
        async with EngineClient("http://engine.test") as client:
            await client._http.aclose()
            client._http = httpx.AsyncClient(base_url=client.url, transport=httpx.MockTransport(answer))
            params = SamplingParams(max_tokens=1)
            return await asyncio.gather(*(client.generate(SampleRequest([5], params)) for _ in range(count)))

    done = asyncio.run(many(2 * MAX_BATCH_REQUESTS + 1))
    assert sorted(sizes) == [1, MAX_BATCH_REQUESTS, MAX_BATCH_REQUESTS]
    assert len(done) == 2 * MAX_BATCH_REQUESTS + 1 and all(c.token_ids == [7] for c in done)


def test_a_request_id_in_flight_is_refused_without_touching_that_request(
    tiny_model_dir: Path, tokenizer: Any
) -> None:
    """A second request reusing the id of one in flight replaced its waiter in the engine loop, was refused
    by the engine, and its abort then stopped the first: its client heard nothing until the server's
    request timeout. Now the second is a 400 naming the id, and the first finishes as it would have."""
    body = {"prompt_token_ids": [5, 6, 7], "max_tokens": CONTEXT - 4, "request_id": "shared-id"}
    with (
        serving(tiny_model_dir, tokenizer, request_timeout_s=20) as url,
        httpx.Client(base_url=url, timeout=60) as http,
    ):
        for _ in range(20):  # until a second request lands while the first runs (it takes ~0.1 s)
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                first = pool.submit(http.post, "/generate", json=body)
                refused = []
                while not first.done():
                    second = http.post("/generate", json={**body, "max_tokens": 1})
                    if second.status_code == 400:
                        refused.append(second.json())
                reply = first.result()
            if reply.status_code == 400:  # the second's was in flight when the first came: the same rule
                assert "'shared-id' is already in flight" in reply.text, reply.text
                continue
            assert reply.status_code == 200, reply.text
            assert reply.json()["finish_reason"] in ("length", "stop"), reply.json()
            if refused:
                assert "'shared-id' is already in flight" in str(refused[0]), refused[0]
                break
            pytest.fail("no second request landed while the first ran, in 20 tries")
        assert_still_serving(http)


def test_stop_strings_are_bounded_in_number_and_length(tiny_model_dir: Path, tokenizer: Any) -> None:
    """Each stop string is matched against every new token on the engine's one thread: /generate and the
    OpenAI routes took any number of any length. Now at most 64 of at most 1,024 characters, as `inflight
    serve` takes, with a 400 naming the field."""
    generate = {"prompt_token_ids": [5, 6, 7], "max_tokens": 2}
    with serving(tiny_model_dir, tokenizer) as url, httpx.Client(base_url=url, timeout=60) as http:
        for stop in (["a"] * 65, ["a" * 1025]):
            refused = http.post("/generate", json={**generate, "stop": stop})
            assert refused.status_code == 400 and "stop" in refused.text, refused.text
            completion = {"prompt": [5, 6, 7], "max_tokens": 2, "stop": stop}
            refused = http.post("/v1/completions", json=completion)
            assert refused.status_code == 400 and "stop" in refused.text, refused.text
        assert http.post("/generate", json={**generate, "stop": ["a" * 1024] * 64}).status_code == 200
        assert (
            http.post("/v1/completions", json={"prompt": [5], "max_tokens": 2, "stop": "x"}).status_code
            == 200
        )
