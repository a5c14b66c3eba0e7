"""The engine as a service: `inflight serve-engine` replicas, the OpenAI-compatible routes (driven by the real
`openai` client), token-in/token-out /generate, in-flight weight updates over HTTP with both KV policies,
and the balanced client's failover (a replica killed with SIGKILL, one hung with SIGSTOP, one restarted).

References: OpenAI's completions/chat wire format (the `openai` SDK parses our answers), the in-process
BuiltinEngine (same seed, same tokens), and the new weights' full forward (`prompt_logprobs`) for the
"recompute" KV policy. Replicas are real subprocesses on free loopback ports; servers that a test must
stop, restart or configure differently run in-process (`ServerThread`). Adapters are held to PEFT's own
forward of a directory PEFT saved, and to the in-process engine with the same adapter.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
import transformers
from safetensors.torch import save, save_file

from inflight.inference import BuiltinEngine, BuiltinEngineConfig
from inflight.inference.adapter_files import write_adapter_dir
from inflight.inference.client import (
    BalancedClient,
    ClientConfig,
    EngineClient,
    EngineRequestError,
    NoReplicaAvailableError,
    ReplicaError,
    adapter_bytes,
)
from inflight.inference.engine_service import EngineServerConfig
from inflight.inference.server import ServerThread, create_app
from inflight.inference.wire import SetAdapterRawParams
from inflight.models import load_model, load_tokenizer
from inflight.models.chat_template import generation_stop_ids
from inflight.models.lora_adapter import peft_key
from inflight.orchestrator.remote_engine import RemoteEngines
from inflight.types import AdapterUpdate, Completion, SampleRequest, SamplingParams, WeightUpdate

STARTUP_TIMEOUT_S = 240.0  # importing torch + transformers on two shared, busy cores


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the servers in this process and the replicas share 2 cores
    yield
    torch.set_num_threads(threads)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Replica:
    url: str
    process: subprocess.Popen
    log: Path

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


def spawn_replica(model_dir: Path, log_dir: Path, name: str) -> Replica:
    port = free_port()
    log = log_dir / f"{name}.log"
    cmd = [sys.executable, "-m", "inflight.cli", "serve-engine", "--model", str(model_dir)]
    cmd += ["--port", str(port), "--max-batch-size", "8"]
    with log.open("wb") as out:
        process = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"}
        )
    return Replica(f"http://127.0.0.1:{port}", process, log)


def wait_healthy(replica: Replica, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if replica.process.poll() is not None:
            pytest.fail(
                f"replica {replica.url} exited with {replica.process.returncode}:\n{replica.log_tail()}"
            )
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{replica.url}/health", timeout=2.0).status_code == 200:
                return
        time.sleep(0.2)
    pytest.fail(f"replica {replica.url} was not healthy within {timeout_s:.0f} s:\n{replica.log_tail()}")


@pytest.fixture(scope="module")
def replicas(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Replica]]:
    """Three `inflight serve-engine` processes started together: a and b serve, the victim gets killed."""
    log_dir = tmp_path_factory.mktemp("replica-logs")
    started = {name: spawn_replica(tiny_model_dir, log_dir, name) for name in ("a", "b", "victim")}
    try:
        for replica in started.values():
            wait_healthy(replica)
        yield started
    finally:
        for replica in started.values():
            replica.process.kill()
            replica.process.wait(timeout=30)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def new_weights(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    """A perturbed copy of the tiny model's weights (version 1), in memory and as a safetensors file."""
    g = torch.Generator().manual_seed(7)
    state = load_model(tiny_model_dir).state_dict()
    new = {k: (v + 0.05 * torch.randn(v.shape, generator=g)).contiguous() for k, v in state.items()}
    path = tmp_path_factory.mktemp("weights") / "weights-00000001.safetensors"
    save_file(new, str(path))
    return new, path


def make_engine(model_dir: Path, **config) -> BuiltinEngine:
    """What `serve` builds: float32, a cache of 1024 positions, the engine's own tokenizer."""
    config = {"max_batch_size": 8, "max_seq_len_tokens": 1024, **config}
    return BuiltinEngine(load_model(model_dir), load_tokenizer(model_dir), BuiltinEngineConfig(**config))


class InProcessServer:
    """An engine server in a thread on a fixed free port; stop() and start() again to simulate an outage."""

    def __init__(self, make_app: Callable[[], object]) -> None:
        self.make_app, self.port = make_app, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread: ServerThread | None = None

    def start(self) -> InProcessServer:
        self._thread = ServerThread(self.make_app(), port=self.port).start()  # type: ignore[arg-type]
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._thread.stop()


@contextlib.contextmanager
def in_process(engine: BuiltinEngine, tokenizer, **config) -> Iterator[InProcessServer]:
    server = InProcessServer(lambda: create_app(engine, tokenizer, EngineServerConfig(**config))).start()
    try:
        yield server
    finally:
        server.stop()


async def wait_until(predicate: Callable[[], object], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout_s} s for {what}")
        await asyncio.sleep(0.02)


async def wait_generating(url: str, min_tokens: int, timeout_s: float = 60.0) -> None:
    """Until the server at `url` has generated min_tokens tokens (its requests are mid-generation)."""
    async with EngineClient(url) as client:
        deadline = time.monotonic() + timeout_s
        while (await client.metrics()).tokens_generated < min_tokens:
            if time.monotonic() > deadline:
                raise AssertionError(f"waited {timeout_s} s for {url} to generate {min_tokens} tokens")
            await asyncio.sleep(0.01)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, 2000, (int(k),), generator=g).tolist()
        for k in torch.randint(2, 12, (n,), generator=g)
    ]


def max_diff(a: list[float], b: list[float]) -> float:
    diff = torch.tensor(a) - torch.tensor(b)
    return diff.abs().max().item() if diff.numel() else 0.0


# -- the OpenAI-compatible routes and /generate -------------------------------------------------------


def test_openai_client_completions_and_chat(replicas, tokenizer) -> None:
    url = replicas["a"].url
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    [card] = client.models.list().data
    eos = tokenizer.eos_token_id

    async def same_on_generate(prompt: list[int], seed: int, max_tokens: int):
        async with EngineClient(url) as engine:
            return await engine.generate(
                SampleRequest(prompt, SamplingParams(max_tokens=max_tokens, seed=seed, stop_token_ids=[eos]))
            )

    out = client.completions.create(model=card.id, prompt="The game", max_tokens=12, n=2, seed=7, logprobs=1)
    assert [c.index for c in out.choices] == [0, 1]
    for i, choice in enumerate(out.choices):
        assert choice.prompt_token_ids == tokenizer.encode("The game")
        ref = asyncio.run(same_on_generate(choice.prompt_token_ids, 7 + i, 12))  # sample i uses seed + i
        assert (choice.token_ids, choice.text, choice.finish_reason) == (
            ref.token_ids,
            ref.text,
            ref.finish_reason,
        )
        assert max_diff(choice.logprobs.token_logprobs, ref.logprobs) < 1e-5
        assert choice.versions == [0] * len(ref.token_ids)
        assert choice.logprobs.tokens == [tokenizer.decode([t]) for t in ref.token_ids]
    assert out.usage.completion_tokens == sum(len(c.token_ids) for c in out.choices)
    assert out.choices[0].token_ids != out.choices[1].token_ids

    # Token-id prompts, and a stop string taken from a free run: the text is cut before it.
    ids = tokenizer.encode("Dealer shows")
    free = client.completions.create(
        model=card.id, prompt=ids, max_tokens=16, seed=3, extra_body={"ignore_eos": True}
    ).choices[0]
    assert len(free.token_ids) == 16 and free.finish_reason == "length"
    # An ASCII stop string: a prefix decoded mid-character ends in U+FFFD, which must not match early.
    stop = next(free.text[i : i + 2] for i in range(2, 14) if free.text[i : i + 2].isascii())
    cut = client.completions.create(
        model=card.id, prompt=ids, max_tokens=16, seed=3, stop=[stop], extra_body={"ignore_eos": True}
    ).choices[0]
    assert (cut.finish_reason, cut.text) == ("stop", free.text[: free.text.index(stop)])

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hit or stand?"}]
    chat = client.chat.completions.create(
        model=card.id, messages=messages, max_tokens=10, seed=1, logprobs=True, top_logprobs=1
    )
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat.prompt_token_ids == tokenizer.encode(rendered, add_special_tokens=False)
    [choice] = chat.choices
    ref = asyncio.run(same_on_generate(chat.prompt_token_ids, 1, 10))  # <|im_end|> is this tokenizer's EOS
    assert (choice.message.content, choice.token_ids) == (ref.text, ref.token_ids)
    assert max_diff([t.logprob for t in choice.logprobs.content], ref.logprobs) < 1e-5
    assert all(t.top_logprobs[0].token == t.token for t in choice.logprobs.content)

    with pytest.raises(openai.BadRequestError, match="top_logprobs=3"):
        client.chat.completions.create(model=card.id, messages=messages, logprobs=True, top_logprobs=3)
    with pytest.raises(openai.BadRequestError, match="stream=true is not supported"):
        client.completions.create(model=card.id, prompt="x", stream=True)
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.completions.create(model="gpt-4", prompt="x")


def test_generate_equals_the_in_process_engine(replicas, tiny_model_dir) -> None:
    """Seeded requests sent together (one running batch on the replica) equal the in-process engine's."""
    params = [
        SamplingParams(max_tokens=20, seed=1),
        SamplingParams(max_tokens=7, seed=2, temperature=0.7),
        SamplingParams(max_tokens=15, seed=3, top_k=20),
        SamplingParams(max_tokens=11, seed=4, top_p=0.8),
        SamplingParams(max_tokens=9, temperature=0.0),
    ]
    batch = list(zip(prompts(len(params)), params, strict=True))

    async def remote():
        async with EngineClient(replicas["b"].url) as client:
            return await asyncio.gather(*(client.generate(SampleRequest(p, sp)) for p, sp in batch))

    served = asyncio.run(remote())
    local = make_engine(tiny_model_dir).generate([SampleRequest(p, sp) for p, sp in batch])
    for s, ref in zip(served, local, strict=True):
        assert (s.token_ids, s.finish_reason, s.text) == (ref.token_ids, ref.finish_reason, ref.text)
        assert max_diff(s.logprobs, ref.logprobs) < 1e-5
        assert s.versions == ref.versions == [0] * len(ref.token_ids)


def test_generate_calls_made_together_travel_as_one_batch_request(replicas, tiny_model_dir) -> None:
    """EngineClient sends the calls of one event-loop turn as one /generate_batch (completions in order,
    equal to the in-process engine's); a call alone goes by /generate."""
    batch = [(p, SamplingParams(max_tokens=6, seed=10 + i)) for i, p in enumerate(prompts(6, seed=3))]
    paths: list[str] = []

    async def remote() -> tuple[list[Completion], Completion]:
        async with EngineClient(replicas["a"].url) as client:
            send = client._send

            async def spy(method: str, path: str, *args: Any, **kwargs: Any) -> Any:
                paths.append(path)
                return await send(method, path, *args, **kwargs)

            client._send = spy  # type: ignore[method-assign]
            together = await asyncio.gather(*(client.generate(SampleRequest(p, sp)) for p, sp in batch))
            alone = await client.generate(SampleRequest(*batch[0]))
            return list(together), alone

    together, alone = asyncio.run(remote())
    assert paths == ["/generate_batch", "/generate"]
    local = make_engine(tiny_model_dir).generate([SampleRequest(p, sp) for p, sp in batch])
    for got, want in zip(together, local, strict=True):
        assert got.token_ids == want.token_ids and max_diff(got.logprobs, want.logprobs) < 1e-5
    assert alone.token_ids == together[0].token_ids  # seeded: the same draw alone or in a batch


def test_generate_batch_checks_every_request_and_its_size(replicas) -> None:
    url = replicas["a"].url
    ok = {"prompt_token_ids": [5, 6, 7], "max_tokens": 2}
    cases = {  # the body -> the field the one-line message names
        "requests": {"requests": []},
        "requests.1.max_tokens": {"requests": [ok, {**ok, "max_tokens": 0}]},
        "requests:": {"requests": [ok] * 4097},  # too many
        "extra": {"requests": [ok], "extra": 1},
    }
    for field, body in cases.items():
        reply = httpx.post(f"{url}/generate_batch", json=body, timeout=60)
        assert reply.status_code == 400 and f"invalid request: {field}" in reply.text, (field, reply.text)
    unknown = httpx.post(
        f"{url}/generate_batch", json={"requests": [ok, {**ok, "adapter": "nope"}]}, timeout=60
    )
    assert unknown.status_code == 404 and "nope" in unknown.text
    reply = httpx.post(f"{url}/generate_batch", json={"requests": [ok, ok]}, timeout=60)
    assert reply.status_code == 200 and [len(c["token_ids"]) for c in reply.json()["completions"]] == [2, 2]


def test_malformed_requests_get_4xx_and_the_server_keeps_serving(replicas, tmp_path: Path) -> None:
    url = replicas["a"].url
    text_file = tmp_path / "not-weights.txt"
    text_file.write_text("hello")
    bogus = tmp_path / "bogus.safetensors"
    save_file({"model.bogus": torch.zeros(2)}, str(bogus))
    post_json = [
        ("/generate", {"prompt_token_ids": []}, "prompt_token_ids"),
        ("/generate", {"prompt_token_ids": "abc"}, "prompt_token_ids"),
        ("/generate", {"prompt_token_ids": [1, 2], "max_tokens": 0}, "max_tokens"),
        ("/generate", {"prompt_token_ids": [1, 2], "temperature": -1}, "temperature"),
        ("/generate", {"prompt_token_ids": [1, 2], "bogus": 1}, "bogus"),
        ("/generate", {"prompt_token_ids": [5000]}, "must lie in"),
        ("/generate", {"prompt_token_ids": [1] * 1024}, "max_seq_len_tokens"),
        ("/generate", {}, "prompt_token_ids"),
        ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
        ("/v1/completions", {"prompt": []}, "prompt is empty"),
        ("/v1/completions", {"prompt": "x", "logprobs": 5}, "logprobs=5"),
        ("/v1/completions", {"prompt": "x", "echo": True}, "echo"),
        ("/v1/completions", {"prompt": "x", "model": "other"}, "not served here"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "image_url",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{}]}, "tools"),
        ("/update_weights", {"path": str(tmp_path / "missing.safetensors"), "version": 1}, "does not exist"),
        ("/update_weights", {"path": str(text_file), "version": 1}, "safetensors"),
        ("/update_weights", {"path": str(bogus), "version": 1}, "missing names"),
        ("/update_weights", {"path": str(bogus), "version": -1}, "version"),
    ]
    with httpx.Client(base_url=url, timeout=60) as http:
        for path, body, needle in post_json:
            response = http.post(path, json=body)
            assert 400 <= response.status_code < 500, (path, body, response.text)
            assert needle in response.json()["error"]["message"], (path, body, response.text)
        for response in [
            http.post("/generate", content=b"{not json", headers={"content-type": "application/json"}),
            http.post("/generate", content=b"\xff\xfe", headers={"content-type": "application/json"}),
            http.post("/update_weights_raw", content=b"garbage", headers={"X-Weight-Version": "2"}),
            http.post("/update_weights_raw", content=b"", headers={"X-Weight-Version": "2"}),
            http.post("/update_weights_raw", content=save({"x": torch.zeros(1)})),  # no version header
            http.post("/update_weights_raw", content=b"x", headers={"X-Weight-Version": "two"}),
        ]:
            assert response.status_code == 400 and response.json()["error"]["message"], response.text
        assert http.get("/nowhere").status_code == 404
        assert http.get("/generate").status_code == 405
        health = http.get("/health").json()
        assert health["status"] == "ok" and health["version"] == 0  # no rejected update got through
        ok = http.post("/generate", json={"prompt_token_ids": [1, 2], "max_tokens": 3})
        assert ok.status_code == 200 and len(ok.json()["token_ids"]) == 3
        assert http.get("/metrics").json()["requests_rejected"] >= len(post_json)


def test_requests_of_a_client_that_left_or_timed_out_are_aborted(tiny_model_dir, tokenizer) -> None:
    engine = make_engine(tiny_model_dir)
    long = {"prompt_token_ids": [1, 2, 3], "max_tokens": 1020}  # seconds of decoding for this engine
    with (
        # 1,020 tokens take ~0.5-1 s at batch 1 here: the limits sit well below that.
        in_process(engine, tokenizer, disconnect_poll_s=0.02, request_timeout_s=0.25) as server,
        httpx.Client(base_url=server.url) as http,
    ):
        with pytest.raises(httpx.ReadTimeout):
            http.post("/generate", json=long, timeout=0.1)  # the client gives up
        asyncio.run(
            wait_until(lambda: engine.metrics().num_running == 0, 30, "the abandoned request aborted")
        )
        assert engine.metrics().tokens_generated < 1020  # stopped early, not decoded to the end
        timed_out = http.post("/generate", json=long, timeout=60)  # the server's own limit
        assert timed_out.status_code == 504 and "waited 0.25 s for 1 request(s)" in timed_out.text
        assert (
            http.post("/generate", json={"prompt_token_ids": [4], "max_tokens": 3}, timeout=60).status_code
            == 200
        )
        assert http.get("/health").json()["status"] == "ok" and engine.metrics().num_running == 0


def test_a_batch_whose_callers_all_stopped_waiting_is_aborted_on_the_server(
    tiny_model_dir, tokenizer
) -> None:
    """EngineClient sends two calls made together as one /generate_batch; cancelling both drops the HTTP
    request, and the server aborts both generations instead of decoding them to the end."""
    engine = make_engine(tiny_model_dir)
    long = SamplingParams(max_tokens=1020)  # seconds of decoding for this engine

    async def give_up(url: str) -> None:
        async with EngineClient(url) as client:
            calls = asyncio.gather(
                client.generate(SampleRequest([1, 2, 3], long)), client.generate(SampleRequest([4, 5], long))
            )
            await wait_until(lambda: engine.metrics().num_running == 2, 30, "both generating")
            calls.cancel()
            with pytest.raises(asyncio.CancelledError):
                await calls
            await wait_until(lambda: engine.metrics().num_running == 0, 30, "the abandoned batch aborted")

    with in_process(engine, tokenizer, disconnect_poll_s=0.02) as server:
        asyncio.run(give_up(server.url))
    assert engine.metrics().tokens_generated < 2 * 1020  # stopped early, not decoded to the end


def test_a_failed_engine_step_fails_requests_and_health_with_the_reason(tiny_model_dir, tokenizer) -> None:
    engine = make_engine(tiny_model_dir)

    def broken_step():
        raise RuntimeError("out of cache rows (injected)")

    engine.step = broken_step  # type: ignore[method-assign]
    with in_process(engine, tokenizer) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        failed = http.post("/generate", json={"prompt_token_ids": [1, 2], "max_tokens": 3})
        assert failed.status_code == 503 and "injected" in failed.json()["error"]["message"]
        health = http.get("/health")
        assert health.status_code == 503 and "injected" in health.json()["error"]
        again = http.post("/generate", json={"prompt_token_ids": [1, 2], "max_tokens": 3})
        assert again.status_code == 503 and "stopped after a failed step" in again.text


# -- in-flight weight updates over HTTP ----------------------------------------------------------------


def test_update_lands_in_flight_without_draining(tiny_model_dir, tokenizer, new_weights) -> None:
    """Four long requests are decoding when /update_weights arrives: it answers once version 1 generates,
    every request keeps going (tokens before the switch v0, after it v1) and none was drained."""
    _, path = new_weights
    max_tokens = 500

    async def main(url: str):
        async with EngineClient(url) as client:
            tasks = [
                asyncio.create_task(
                    client.generate(SampleRequest(p, SamplingParams(max_tokens=max_tokens, seed=i)))
                )
                for i, p in enumerate(prompts(4))
            ]
            await wait_generating(url, 4 * 20)
            reply = await client.update_weights(str(path), version=1)
            health = await client.health()
            return reply, health, await asyncio.gather(*tasks), await client.metrics()

    with in_process(make_engine(tiny_model_dir, max_seq_len_tokens=1024), tokenizer) as server:
        reply, health, outs, metrics = asyncio.run(main(server.url))
    assert (reply.version, reply.requested_version, reply.superseded) == (1, 1, False)
    assert reply.pause_s is not None and reply.load_s > 0 and reply.copy_s > 0
    assert health.version == 1
    after = []
    for out in outs:
        before = out.versions.count(0)
        assert out.finish_reason == "length" and len(out.token_ids) == max_tokens
        assert 0 < before < max_tokens and out.versions == [0] * before + [1] * (max_tokens - before)
        after.append(max_tokens - before)
    # "keep": every token after the switch of a request in flight reads K/V from version 0.
    assert metrics.tokens_on_stale_kv == sum(after)
    assert metrics.stale_kv_token_frac == pytest.approx(sum(after) / (4 * max_tokens))
    assert (metrics.updates_applied, len(metrics.recent_updates)) == (1, 1)
    assert metrics.weight_load_s_last == pytest.approx(reply.load_s)


def test_update_routes_refuse_files_outside_weights_dir_and_older_versions(
    tiny_model_dir, tokenizer, new_weights, tmp_path: Path
) -> None:
    new_state, path = new_weights
    allowed = tmp_path / "weights"
    allowed.mkdir()
    inside = allowed / "weights-00000002.safetensors"
    save_file(new_state, str(inside))

    async def main(url: str):
        async with EngineClient(url) as client:
            with pytest.raises(EngineRequestError, match=r"HTTP 403.*outside this server's weights_dir"):
                await client.update_weights(str(path), version=1)
            applied = await client.update_weights(str(inside), version=2)
            with pytest.raises(EngineRequestError, match=r"HTTP 409.*older than the engine's 2"):
                await client.update_weights_raw(save(new_state), version=1)
            return applied, await client.health()

    with in_process(make_engine(tiny_model_dir), tokenizer, weights_dir=str(allowed)) as server:
        applied, health = asyncio.run(main(server.url))
    assert (applied.version, health.version) == (2, 2)


@pytest.mark.parametrize("kv_policy", ["keep", "recompute"])
def test_kv_policy_over_http(kv_policy: str, tiny_model_dir, tokenizer, new_weights) -> None:
    """A greedy request gets version 1 pushed as raw safetensors bytes mid-generation. With "recompute" its
    continuation has exactly the new weights' logprobs over the whole prefix; with "keep" it does not, and
    every token after the switch is counted as generated on a stale prefix."""
    new_state, _ = new_weights
    prompt, max_tokens = prompts(1, seed=5)[0], 400

    async def main(url: str):
        async with EngineClient(url) as client:
            task = asyncio.create_task(
                client.generate(SampleRequest(prompt, SamplingParams(max_tokens=max_tokens, temperature=0)))
            )
            await wait_generating(url, 20)
            await client.update_weights_raw(save(new_state), version=1)
            return await task, await client.metrics()

    with in_process(make_engine(tiny_model_dir, kv_policy=kv_policy), tokenizer) as server:
        out, metrics = asyncio.run(main(server.url))
    k = out.versions.count(0)
    assert 0 < k < max_tokens and out.versions == [0] * k + [1] * (max_tokens - k)
    reference = make_engine(tiny_model_dir)
    reference.update_weights(WeightUpdate(1, new_state))
    reference.step()  # installs the pending update
    # Greedy logprobs are log_softmax of the raw logits: prompt_logprobs of the new weights, full forward.
    fresh = reference.prompt_logprobs(prompt + out.token_ids)[len(prompt) + k :]
    if kv_policy == "recompute":
        assert max_diff(out.logprobs[k:], fresh) < 1e-4
        assert (metrics.tokens_on_stale_kv, metrics.sequences_recomputed) == (0, 1)
        assert metrics.tokens_recomputed == len(prompt) + k - 1
    else:
        assert max_diff(out.logprobs[k:], fresh) > 1e-3
        assert metrics.tokens_on_stale_kv == max_tokens - k and metrics.sequences_recomputed == 0
    assert metrics.recent_updates[0].pause_s > 0


# -- the balanced client and faults --------------------------------------------------------------------


def test_balanced_client_spreads_load_and_passes_4xx_through(replicas) -> None:
    urls = [replicas["a"].url, replicas["b"].url]

    async def main():
        async with BalancedClient(urls) as client:
            outs = await asyncio.gather(
                *(client.generate(SampleRequest(p, SamplingParams(max_tokens=8))) for p in prompts(8))
            )
            chat = await client.chat(
                [{"role": "user", "content": "hi"}], SamplingParams(max_tokens=5, seed=0)
            )
            with pytest.raises(EngineRequestError, match="must lie in"):
                await client.generate(SampleRequest([99999], SamplingParams(max_tokens=2)))
            return outs, chat, await client.versions(), client.metrics()

    outs, chat, versions, metrics = asyncio.run(main())
    assert all(len(o.token_ids) == 8 for o in outs)
    assert chat.prompt_token_ids and len(chat.token_ids) == len(chat.logprobs) == len(chat.versions) <= 5
    assert versions == {url: 0 for url in urls}
    assert all(r.served > 0 and r.healthy for r in metrics.replicas)  # least outstanding: both got work
    assert (metrics.retries, metrics.replica_failures) == (0, 0)  # a 4xx is not the replica's fault


def test_all_replicas_down_names_them_after_the_outage_wait() -> None:
    urls = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]

    async def main():
        config = ClientConfig(connect_timeout_s=2, outage_wait_s=1.0, health_interval_s=0.2)
        async with BalancedClient(urls, config) as client:
            await client.generate(SampleRequest([1, 2], SamplingParams(max_tokens=2)))

    start = time.monotonic()
    with pytest.raises(NoReplicaAvailableError) as info:
        asyncio.run(main())
    assert time.monotonic() - start >= 1.0  # it waited for one to come back, as long as configured
    message = str(info.value)
    assert all(url in message for url in urls) and "ConnectError" in message


def reference_outputs(model_dir: Path, batch: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
    return [c.token_ids for c in make_engine(model_dir).generate([SampleRequest(p, sp) for p, sp in batch])]


def test_killed_replica_requests_finish_on_the_other(replicas, tiny_model_dir) -> None:
    """kill -9 a replica while it decodes: its requests fail over to the survivor, which produces exactly
    the tokens the seeds call for; the retries and the failure are counted."""
    victim = replicas["victim"]
    batch = [(p, SamplingParams(max_tokens=300, seed=i)) for i, p in enumerate(prompts(8, seed=3))]

    async def main():
        config = ClientConfig(health_interval_s=0.5, health_timeout_s=2)
        async with BalancedClient([replicas["a"].url, victim.url], config) as client:
            tasks = [asyncio.create_task(client.generate(SampleRequest(p, sp))) for p, sp in batch]
            await wait_generating(victim.url, 20)
            on_victim = client.metrics().replicas[1].outstanding
            victim.process.send_signal(signal.SIGKILL)
            outs = await asyncio.wait_for(asyncio.gather(*tasks), 180)
            return on_victim, outs, client.metrics()

    on_victim, outs, metrics = asyncio.run(main())
    assert on_victim > 0
    assert [o.token_ids for o in outs] == reference_outputs(tiny_model_dir, batch)
    assert 1 <= metrics.retries <= on_victim and metrics.replica_failures == 1
    survivor, dead = metrics.replicas
    assert survivor.healthy and not dead.healthy and dead.last_error
    assert victim.process.wait(timeout=30) == -signal.SIGKILL


def test_hung_replica_is_found_by_the_health_check_and_its_calls_move(replicas, tiny_model_dir) -> None:
    """SIGSTOP a replica mid-generation: it accepts connections but never answers. The health check times
    out, marks it down and moves its calls to the other replica; after SIGCONT it is healthy again."""
    hung = replicas["b"]
    batch = [(p, SamplingParams(max_tokens=200, seed=10 + i)) for i, p in enumerate(prompts(6, seed=4))]

    async def main():
        config = ClientConfig(health_interval_s=0.3, health_timeout_s=1.0)
        async with BalancedClient([replicas["a"].url, hung.url], config) as client:
            tasks = [asyncio.create_task(client.generate(SampleRequest(p, sp))) for p, sp in batch]
            await wait_generating(hung.url, 20)
            hung.process.send_signal(signal.SIGSTOP)
            try:
                outs = await asyncio.wait_for(asyncio.gather(*tasks), 180)
                down = client.metrics()
            finally:
                hung.process.send_signal(signal.SIGCONT)
            await wait_until(
                lambda: client.metrics().replicas[1].healthy, 60, "the resumed replica to recover"
            )
            return outs, down, client.metrics()

    outs, down, after = asyncio.run(main())
    assert [o.token_ids for o in outs] == reference_outputs(tiny_model_dir, batch)
    assert not down.replicas[1].healthy and "health check failed" in (down.replicas[1].last_error or "")
    assert down.health_check_failures >= 1 and down.retries >= 1
    assert after.recoveries == 1 and after.replicas[1].healthy


def test_outage_and_recovery_replays_the_missed_update(tiny_model_dir, tokenizer, new_weights) -> None:
    """A replica that is down during a broadcast gets that update when it comes back, before serving."""
    _, path = new_weights
    servers = [
        InProcessServer(lambda: create_app(make_engine(tiny_model_dir), tokenizer)).start() for _ in range(2)
    ]
    urls = [s.url for s in servers]

    async def main():
        config = ClientConfig(health_interval_s=0.2, health_timeout_s=2)
        async with BalancedClient(urls, config) as client:
            servers[1].stop()
            await wait_until(
                lambda: not client.metrics().replicas[1].healthy, 30, "the stopped replica marked down"
            )
            failures = client.metrics().health_check_failures
            live = await client.update_weights(str(path), version=1)
            outs = await asyncio.gather(
                *(client.generate(SampleRequest(p, SamplingParams(max_tokens=4))) for p in prompts(3))
            )
            servers[1].start()  # a fresh engine at version 0 on the same port
            await wait_until(
                lambda: client.metrics().replicas[1].healthy, 30, "the restarted replica to recover"
            )
            return failures, live, outs, await client.versions(), client.metrics()

    try:
        failures, live, outs, versions, metrics = asyncio.run(main())
    finally:
        for server in servers:
            server.stop()
    assert failures == 1 and live == {urls[0]: 1}
    assert all(o.versions == [1] * 4 for o in outs)
    assert versions == {urls[0]: 1, urls[1]: 1}  # caught up on recovery
    assert (metrics.recoveries, metrics.replica_failures) == (1, 1)


def test_a_restarted_replica_gets_the_last_weights_even_at_its_own_version(
    tiny_model_dir, tokenizer, new_weights
) -> None:
    """Weights published as version 0 (a pipeline's warmed-up model, or LoRA's frozen base, before any
    step) and a replica restarted from the model on disk, also at version 0 (as `launch/ray/replicas.py`'s
    replicas are restarted by Ray): on recovery it gets the published weights, and serves what the other
    serves."""
    _, path = new_weights
    servers = [
        InProcessServer(lambda: create_app(make_engine(tiny_model_dir), tokenizer)).start() for _ in range(2)
    ]
    urls = [s.url for s in servers]
    greedy = SampleRequest(prompts(1, seed=3)[0], SamplingParams(max_tokens=6, temperature=0))

    async def main():
        config = ClientConfig(health_interval_s=0.2, health_timeout_s=2)
        async with BalancedClient(urls, config) as client:
            await client.update_weights(str(path), version=0)
            servers[1].stop()
            await wait_until(lambda: not client.metrics().replicas[1].healthy, 30, "the replica marked down")
            servers[1].start()  # a fresh engine, the weights on disk, version 0
            await wait_until(lambda: client.metrics().replicas[1].healthy, 30, "the replica to recover")
        outs = []
        for url in urls:
            async with EngineClient(url) as one:
                outs.append(await one.generate(greedy))
        return outs

    try:
        on_0, on_1 = asyncio.run(main())
    finally:
        for server in servers:
            server.stop()
    assert on_1.token_ids == on_0.token_ids and max_diff(on_1.logprobs, on_0.logprobs) < 1e-5


def test_a_following_client_takes_a_restarted_replica_back_only_once_the_publisher_synced_it(
    tiny_model_dir, tokenizer, new_weights
) -> None:
    """A rollout worker's client (`follows_others=True`) installs nothing: the run's client does. A replica
    restarted from the model on disk (version 0) must not serve the worker's calls until the run's client
    has given it the weights (version 1): until then it stays down in the worker's view ("catching up")."""
    _, path = new_weights
    servers = [
        InProcessServer(lambda: create_app(make_engine(tiny_model_dir), tokenizer)).start() for _ in range(2)
    ]
    urls = [s.url for s in servers]
    prompt = prompts(1, seed=3)[0]

    def greedy() -> SampleRequest:
        return SampleRequest(prompt, SamplingParams(max_tokens=6, temperature=0))

    async def main():
        # The publisher checks only when told to, so the replica stays behind as long as the test wants.
        publisher = BalancedClient(urls, ClientConfig(health_interval_s=3600, health_timeout_s=2))
        follower = BalancedClient(urls, ClientConfig(health_interval_s=0.1, health_timeout_s=2), True)
        async with publisher, follower:
            await publisher.update_weights(str(path), version=1)
            await wait_until(
                lambda: all(r.version == 1 for r in follower.metrics().replicas), 30, "the follower sees v1"
            )
            servers[1].stop()
            await wait_until(lambda: not follower.metrics().replicas[1].healthy, 30, "replica 1 down")
            servers[1].start()  # the model from disk, version 0
            await asyncio.sleep(1.0)  # ~10 of the follower's health checks
            behind = follower.metrics().replicas[1]
            outs = await asyncio.gather(*(follower.generate(greedy()) for _ in range(4)))
            await publisher.check_health()  # finds it behind and installs version 1
            await wait_until(lambda: follower.metrics().replicas[1].healthy, 30, "replica 1 caught up")
            served_before = follower.metrics().replicas[1].served
            later = await asyncio.gather(*(follower.generate(greedy()) for _ in range(6)))
            return behind, outs, later, served_before, follower.metrics()

    try:
        behind, outs, later, served_before, metrics = asyncio.run(main())
    finally:
        for server in servers:
            server.stop()
    assert not behind.healthy and behind.last_error == "catching up: weights version 0 < 1", behind
    assert all(o.versions == [1] * 6 for o in outs)  # every call served by the replica that was up to date
    assert all(o.versions == [1] * 6 and o.token_ids == outs[0].token_ids for o in later)
    assert metrics.replicas[1].served > served_before  # it serves again, with the publisher's weights
    assert metrics.recoveries == 1


# -- LoRA adapters over HTTP ------------------------------------------------------------------------

ADAPTED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def lora_shapes(tiny_model_dir: Path) -> dict[str, tuple[int, int]]:
    """The tiny model's adaptable linear layers: module name -> (in_features, out_features)."""
    model = load_model(tiny_model_dir)
    return {
        name: (m.in_features, m.out_features)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in ADAPTED
    }


def random_adapter(shapes: dict[str, tuple[int, int]], name: str, version: int, seed: int) -> AdapterUpdate:
    """Random A and B (B nonzero, so the adapter changes the tokens) on every adaptable layer."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (fan_in, fan_out) in shapes.items():
        tensors[peft_key(module, "A")] = torch.randn(4, fan_in, generator=g) * 0.3
        tensors[peft_key(module, "B")] = torch.randn(fan_out, 4, generator=g) * 0.3
    return AdapterUpdate(name=name, version=version, rank=4, scale=0.5, tensors=tensors)


def test_a_peft_adapter_over_http_matches_peft(tiny_model_dir, tokenizer, tmp_path: Path) -> None:
    """A directory PEFT saved (rsLoRA scaling, a subset of modules) served through /set_adapter: /generate's
    prompt logprobs, top-k prompt logprobs, greedy tokens and raw logprobs equal PEFT's own forward; the
    OpenAI routes serve it as `model`; once removed, it is refused by name."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(3)
    config = LoraConfig(
        r=4, lora_alpha=6, target_modules=["q_proj", "v_proj", "down_proj"], use_rslora=True,
        init_lora_weights=False,  # random B: a fresh adapter would equal the base model
    )  # fmt: skip
    peft_model = get_peft_model(load_model(tiny_model_dir), config).eval()
    peft_model.save_pretrained(str(tmp_path / "saved"))
    adapter_dir = tmp_path / "saved"
    prompt = tokenizer.encode("Dealer shows 7, you have 12")
    greedy = 6
    with torch.no_grad():
        ids = torch.tensor([prompt])
        for _ in range(greedy):  # PEFT's greedy continuation, one full forward per token
            ids = torch.cat([ids, peft_model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        ref = torch.log_softmax(peft_model(ids).logits[0].float(), -1)
    ref_tokens = ids[0, len(prompt) :].tolist()
    ref_prompt = ref[: len(prompt) - 1].gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
    ref_sampled = ref[len(prompt) - 1 : -1].gather(1, torch.tensor(ref_tokens)[:, None]).squeeze(1)

    with in_process(make_engine(tiny_model_dir), tokenizer, weights_dir=str(tmp_path)) as server:
        http = httpx.Client(base_url=server.url, timeout=120)
        reply = http.post("/set_adapter", json={"name": "coach", "path": str(adapter_dir), "version": 3})
        assert reply.status_code == 200, reply.text
        assert reply.json()["rank"] == 4 and abs(reply.json()["scale"] - 6 / 2) < 1e-9  # alpha / sqrt(r)
        body = {
            "prompt_token_ids": prompt, "max_tokens": greedy, "temperature": 0, "adapter": "coach",
            "logprobs_kind": "raw", "prompt_logprobs": True, "topk_prompt_logprobs": 3,
        }  # fmt: skip
        out = http.post("/generate", json=body).json()
        assert out["token_ids"] == ref_tokens and out["versions"] == [3] * greedy
        assert max_diff(out["logprobs"], ref_sampled.tolist()) < 1e-4
        assert out["prompt_logprobs"][0] is None  # NaN on the engine side; JSON has none
        assert max_diff(out["prompt_logprobs"][1:], ref_prompt.tolist()) < 1e-4
        best = ref[: len(prompt) - 1].topk(3, -1)
        assert out["topk_prompt_logprobs"][0] == []
        assert [[i for i, _ in pairs] for pairs in out["topk_prompt_logprobs"][1:]] == best.indices.tolist()
        base = http.post("/generate", json={**body, "adapter": None}).json()
        assert base["token_ids"] != ref_tokens and base["versions"] == [0] * greedy

        # vLLM's convention: the adapter is a model of its own on the OpenAI routes.
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["inflight", "coach"]
        completion = http.post(
            "/v1/completions",
            json={
                "model": "coach",
                "prompt": prompt,
                "max_tokens": greedy,
                "temperature": 0,
                "ignore_eos": True,
            },
        ).json()
        assert completion["model"] == "coach" and completion["choices"][0]["token_ids"] == ref_tokens
        assert http.get("/health").json()["adapters"] == {"coach": 3}

        assert http.post("/remove_adapter", json={"name": "coach"}).json() == {"name": "coach", "version": 3}
        refused = http.post("/generate", json=body)
        assert refused.status_code == 404 and "'coach'" in refused.text and "/set_adapter" in refused.text
        gone = http.post("/v1/completions", json={"model": "coach", "prompt": prompt, "max_tokens": 1})
        assert gone.status_code == 404 and "'coach'" in gone.text


def test_adapter_routes_refuse_bad_input_with_4xx_and_keep_serving(
    tiny_model_dir, tokenizer, lora_shapes, tmp_path: Path
) -> None:
    root = tmp_path / "served"
    good = random_adapter(lora_shapes, "good", version=2, seed=1)
    write_adapter_dir(root / "good", good)

    def variant(name: str, config: dict | None = None, tensors: dict | None = None, raw: bytes | None = None):
        """A copy of the good directory with its config patched, its tensors replaced or its file garbage."""
        path = root / name
        write_adapter_dir(path, good if tensors is None else AdapterUpdate("x", 0, 4, 0.5, tensors))
        if config is not None:
            text = json.loads((path / "adapter_config.json").read_text())
            (path / "adapter_config.json").write_text(json.dumps({**text, **config}))
        if raw is not None:
            (path / "adapter_model.safetensors").write_bytes(raw)
        return str(path)

    renamed = {
        k.replace("layers.0.self_attn.q_proj", "layers.0.self_attn.qq_proj"): v
        for k, v in good.tensors.items()
    }
    no_config = variant("no-config")
    (Path(no_config) / "adapter_config.json").unlink()
    outside = tmp_path / "outside"
    write_adapter_dir(outside, good)
    wrong_shape = dict(good.tensors)
    wrong_shape[peft_key("model.layers.1.mlp.down_proj", "B")] = torch.zeros(3, 4)
    cases = [
        ({"path": str(outside)}, 403, "outside this server's weights_dir"),
        ({"path": str(root / "missing")}, 400, "does not exist"),
        ({"path": no_config}, 400, "adapter_config.json"),
        ({"path": variant("no-r", {"r": None})}, 400, "'r' must be an integer"),
        ({"path": variant("patterns", {"rank_pattern": {"q_proj": 8}})}, 400, "rank_pattern"),
        ({"path": variant("dora", {"peft_type": "IA3"})}, 400, "only LORA"),
        ({"path": variant("garbage", raw=b"not safetensors")}, 400, "safetensors"),
        ({"path": variant("module", tensors=renamed)}, 400, "model.layers.0.self_attn.qq_proj"),
        ({"path": variant("shape", tensors=wrong_shape)}, 400, "model.layers.1.mlp.down_proj"),
        ({"path": variant("rank", {"r": 8})}, 400, "for rank 8"),
        ({"name": "two words"}, 400, "name"),
        ({"name": str(tiny_model_dir)}, 400, "base model's name"),
        ({"version": -1}, 400, "version"),
    ]
    with in_process(
        make_engine(tiny_model_dir), tokenizer, weights_dir=str(root), model_name=str(tiny_model_dir)
    ) as server:
        http = httpx.Client(base_url=server.url, timeout=120)
        ok = http.post("/set_adapter", json={"name": "good", "path": str(root / "good"), "version": 2})
        assert ok.status_code == 200, ok.text
        for patch, status, fragment in cases:
            body = {"name": "new", "path": str(root / "good"), "version": 1, **patch}
            reply = http.post("/set_adapter", json=body)
            assert (reply.status_code, fragment in reply.text) == (status, True), (patch, reply.text)
        older = http.post("/set_adapter", json={"name": "good", "path": str(root / "good"), "version": 1})
        assert older.status_code == 409 and "older" in older.text
        data = adapter_bytes(good)
        raw_cases: list[tuple[dict[str, str | int], bytes, str]] = [
            ({}, data, "name"),
            ({"name": "r", "version": 1, "rank": 4, "scale": "nan"}, data, "scale"),
            ({"name": "r", "version": 1, "rank": 4, "scale": 1, "extra": 1}, data, "extra"),
            ({"name": "r", "version": 1, "rank": 4, "scale": 1}, b"garbage", "safetensors"),
            ({"name": "r", "version": 1, "rank": 2, "scale": 1}, data, "for rank 2"),
        ]
        for query, content, fragment in raw_cases:
            reply = http.post("/set_adapter_raw", params=query, content=content)
            assert (reply.status_code, fragment in reply.text) == (400, True), (query, reply.text)
        generate = {"prompt_token_ids": [5, 6], "max_tokens": 1}
        generate_cases: list[tuple[dict[str, object], int, str]] = [
            ({"adapter": "nope"}, 404, "'nope'"),
            ({"logprobs_kind": "behaviour"}, 400, "logprobs_kind"),
            ({"topk_prompt_logprobs": 10**6}, 400, "topk_prompt_logprobs"),
        ]
        for patch, status, fragment in generate_cases:
            reply = http.post("/generate", json={**generate, **patch})
            assert (reply.status_code, fragment in reply.text) == (status, True), (patch, reply.text)
        assert http.post("/remove_adapter", json={"name": "nope"}).status_code == 404
        chat = {"model": "nope", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        assert http.post("/v1/chat/completions", json=chat).status_code == 404
        # Nothing refused was registered, and the server still serves the good one.
        assert http.get("/adapters").json() == {"adapters": {"good": 2}}
        served = http.post("/generate", json={**generate, "adapter": "good"})
        assert served.status_code == 200 and served.json()["versions"] == [2]
        assert http.get("/metrics").json()["requests_failed"] == 0


def test_adapter_replaced_and_removed_in_flight_over_http(tiny_model_dir, tokenizer, lora_shapes) -> None:
    """Requests decoding on adapters when one is replaced and the other removed over HTTP: the first switches
    to the new weights mid-completion (tokens stamped with the new version), the second finishes on its old
    weights, and a new request naming the removed one is refused. Tokens before and after the switch are
    the in-process engine's for the same adapter versions."""
    a1, a2 = (random_adapter(lora_shapes, "a", version=v, seed=v) for v in (1, 2))
    b1 = random_adapter(lora_shapes, "b", version=1, seed=5)
    on_a, on_b = prompts(2, seed=4)
    long = SamplingParams(max_tokens=600, temperature=0)

    async def main():
        async with EngineClient(server.url) as client:
            for update in (a1, b1):
                params = SetAdapterRawParams(name=update.name, version=update.version, rank=4, scale=0.5)
                await client.set_adapter_raw(adapter_bytes(update), params)
            running = [
                asyncio.create_task(client.generate(SampleRequest(p, long, adapter=n)))
                for p, n in ((on_a, "a"), (on_b, "b"))
            ]
            await wait_generating(server.url, min_tokens=20)
            params = SetAdapterRawParams(name="a", version=2, rank=4, scale=0.5)
            replaced = await client.set_adapter_raw(adapter_bytes(a2), params)
            removed = await client.remove_adapter("b")
            with pytest.raises(EngineRequestError, match="'b'") as refused:
                await client.generate(SampleRequest(on_b, long, adapter="b"))
            return replaced, removed, refused.value.status, await asyncio.gather(*running)

    with in_process(make_engine(tiny_model_dir), tokenizer) as server:
        replaced, removed, status, (a, b) = asyncio.run(main())
    assert (replaced.replaced, replaced.previous_version, removed.version, status) == (True, 1, 1, 404)
    switch = a.versions.index(2)
    assert 0 < switch < 600 and a.versions == [1] * switch + [2] * (600 - switch), "switched mid-completion"
    assert b.versions == [1] * 600 and b.finish_reason == "length"
    local = make_engine(tiny_model_dir)
    for update in (a1, b1):
        local.set_adapter(update)
    before, whole_b = local.generate(
        [SampleRequest(on_a, long, adapter="a"), SampleRequest(on_b, long, adapter="b")]
    )
    assert a.token_ids[:switch] == before.token_ids[:switch] and b.token_ids == whole_b.token_ids


def test_balanced_client_keeps_every_replica_on_the_same_adapters(
    tiny_model_dir, tokenizer, lora_shapes
) -> None:
    """Adapters set or removed while a replica is away reach it before it serves again: one restarted (a fresh
    engine, no adapters) gets those set meanwhile; one that missed a removal has it removed."""
    servers = [
        InProcessServer(lambda: create_app(make_engine(tiny_model_dir), tokenizer)).start() for _ in range(2)
    ]
    urls = [s.url for s in servers]
    old, a = random_adapter(lora_shapes, "old", 1, seed=1), random_adapter(lora_shapes, "a", 3, seed=2)

    async def adapters_of(url: str) -> dict[str, int]:
        async with EngineClient(url) as client:
            return await client.adapters()

    async def main():
        config = ClientConfig(health_interval_s=0.2, health_timeout_s=2)
        async with BalancedClient(urls, config) as client:
            assert await client.set_adapter_raw(old) == {urls[0]: 1, urls[1]: 1}
            servers[1].stop()
            await wait_until(lambda: not client.metrics().replicas[1].healthy, 30, "the stopped replica down")
            assert await client.set_adapter_raw(a) == {urls[0]: 3}
            servers[1].start()  # a fresh engine on the same port: no adapters at all
            await wait_until(lambda: client.metrics().replicas[1].healthy, 30, "the restarted replica up")
            restarted = await adapters_of(urls[1])

            # A removal that one replica misses (its call fails once): removed there on its recovery.
            replica = client._replicas[1].client
            real_remove = replica.remove_adapter

            async def fail_once(name: str):
                replica.remove_adapter = real_remove  # type: ignore[method-assign]
                raise ReplicaError(f"{replica.url}: injected failure")

            replica.remove_adapter = fail_once  # type: ignore[method-assign]
            assert await client.remove_adapter("old") == [urls[0]]
            assert not client.metrics().replicas[1].healthy
            await wait_until(
                lambda: client.metrics().replicas[1].healthy, 30, "the replica that missed it up"
            )
            outs = await asyncio.gather(
                *(
                    client.generate(SampleRequest(p, SamplingParams(max_tokens=3), adapter="a"))
                    for p in prompts(4)
                )
            )
            with pytest.raises(EngineRequestError, match="'old'"):
                await client.generate(SampleRequest([5, 6], adapter="old"))
            return restarted, [await adapters_of(u) for u in urls], outs, client.metrics()

    try:
        restarted, after, outs, metrics = asyncio.run(main())
    finally:
        for server in servers:
            server.stop()
    assert restarted == {"old": 1, "a": 3}  # caught up before serving
    assert after == [{"a": 3}, {"a": 3}]
    assert all(o.versions == [3] * 3 for o in outs)
    assert {r.url: r.served > 0 for r in metrics.replicas} == {urls[0]: True, urls[1]: True}


def test_removing_an_adapter_during_a_total_outage_succeeds_once_a_replica_is_back(
    tiny_model_dir, tokenizer, lora_shapes
) -> None:
    """Every replica down, then one back restarted (no adapters): removing an adapter this client set
    waits for it and succeeds (gone everywhere, as asked), rather than a 404 for a name it knows; a name
    it never set is still a 404."""
    server = InProcessServer(lambda: create_app(make_engine(tiny_model_dir), tokenizer)).start()
    adapter = random_adapter(lora_shapes, "gone", 1, seed=3)

    async def main():
        config = ClientConfig(health_interval_s=0.2, health_timeout_s=2, outage_wait_s=30)
        async with BalancedClient([server.url], config) as client:
            await client.set_adapter_raw(adapter)
            server.stop()
            await wait_until(lambda: not client.metrics().replicas[0].healthy, 30, "the replica down")
            restart = asyncio.get_running_loop().call_later(0.5, server.start)
            removed = await client.remove_adapter("gone")  # waits for the replica to come back
            restart.cancel()
            with pytest.raises(EngineRequestError, match="no replica has an adapter named 'never'"):
                await client.remove_adapter("never")
            return removed, client.metrics()

    try:
        removed, metrics = asyncio.run(main())
    finally:
        server.stop()
    assert removed == [] and metrics.replicas[0].healthy and metrics.recoveries == 1


def test_remote_engines_ship_an_adapter_as_a_peft_directory(
    tiny_model_dir, tokenizer, lora_shapes, tmp_path: Path
) -> None:
    """The pipeline's remote engines: set_adapter writes a PEFT directory under the run's weights dir (older
    versions collected) and every replica serves it; the tokens are the in-process engine's."""
    weights_dir = tmp_path / "weights"
    updates = [random_adapter(lora_shapes, "policy", version=v, seed=v) for v in (1, 2, 3)]
    prompt = prompts(1, seed=9)[0]
    greedy = SamplingParams(max_tokens=8, temperature=0)
    servers = [
        InProcessServer(
            lambda: create_app(
                make_engine(tiny_model_dir), tokenizer, EngineServerConfig(weights_dir=str(weights_dir))
            )
        ).start()
        for _ in range(2)
    ]
    remote = RemoteEngines([s.url for s in servers], weights_dir)

    async def main():
        await remote.astart()
        try:
            outs = []
            for update in updates:
                await asyncio.to_thread(remote.set_adapter, update)
                outs.append(await remote.generate(SampleRequest(prompt, greedy, adapter="policy"), 60))
            kept = sorted(p.name for p in weights_dir.glob("adapters/*/v*"))
            await asyncio.to_thread(remote.remove_adapter, "policy")
            with pytest.raises(EngineRequestError, match="'policy'"):
                await remote.generate(SampleRequest(prompt, greedy, adapter="policy"), 60)
            return outs, kept
        finally:
            await remote.aclose()

    try:
        outs, kept = asyncio.run(main())
    finally:
        for server in servers:
            server.stop()
    assert kept == ["v00000002", "v00000003"]
    local = make_engine(tiny_model_dir)
    for update, out in zip(updates, outs, strict=True):
        local.set_adapter(update)
        [expected] = local.generate([SampleRequest(prompt, greedy, adapter="policy")])
        assert (out.token_ids, out.versions) == (expected.token_ids, [update.version] * 8)
    assert outs[0].token_ids != outs[2].token_ids  # the versions differ, so the check above has teeth


# -- chat on a model's own end-of-turn token -------------------------------------------------------

LLAMA3_TEMPLATE = (  # Meta-Llama-3-8B-Instruct's chat template (as in tests/test_model_families.py)
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


def test_chat_stops_at_the_models_own_end_of_turn_token(tiny_model_dir) -> None:
    """A Llama 3 style model whose template ends a turn with <|eot_id|> while its generation config stops
    only at <|end_of_text|> (as Llama 3 base tokenizers ship): a chat reply ends at <|eot_id|>, which the
    server reads from the template; a completion, which has no turns, runs past it."""
    tokenizer = load_tokenizer(tiny_model_dir)
    tokenizer.add_special_tokens(
        {
            "bos_token": "<|begin_of_text|>",
            "eos_token": "<|end_of_text|>",
            "extra_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        }
    )
    tokenizer.chat_template = LLAMA3_TEMPLATE
    eot, end_of_text = (int(tokenizer.convert_tokens_to_ids(t)) for t in ("<|eot_id|>", "<|end_of_text|>"))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = end_of_text
    messages = [{"role": "user", "content": "hit or stand?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = tokenizer.encode(text, add_special_tokens=False)
    with torch.no_grad():  # make <|eot_id|> the greedy first reply token: twice the winner's (positive) row
        logits = model(torch.tensor([prompt])).logits[0, -1]
        assert logits.max() > 0
        model.lm_head.weight[eot] = 2 * model.lm_head.weight[int(logits.argmax())]
    engine = BuiltinEngine(model, copy.deepcopy(tokenizer), BuiltinEngineConfig(max_seq_len_tokens=128))
    app = create_app(engine, tokenizer, EngineServerConfig(), generation_stop_ids(model))
    server = ServerThread(app).start()
    try:
        http = httpx.Client(base_url=server.url, timeout=120)
        chat = http.post(
            "/v1/chat/completions", json={"messages": messages, "max_tokens": 6, "temperature": 0}
        )
        completion = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0})
    finally:
        server.stop()
    [reply] = chat.json()["choices"]
    assert chat.json()["prompt_token_ids"] == prompt
    assert (reply["token_ids"], reply["finish_reason"], reply["message"]["content"]) == ([eot], "stop", "")
    [free] = completion.json()["choices"]
    assert free["token_ids"][0] == eot and len(free["token_ids"]) == 6 and free["finish_reason"] == "length"
