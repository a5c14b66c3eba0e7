"""The engine as a service: `inflight serve-engine` replicas, the OpenAI-compatible routes (driven by the real
`openai` client), token-in/token-out /generate, in-flight weight updates over HTTP with both KV policies,
and the balanced client's failover (a replica killed with SIGKILL, one hung with SIGSTOP, one restarted).

References: OpenAI's completions/chat wire format (the `openai` SDK parses our answers), the in-process
BuiltinEngine (same seed, same tokens), and the new weights' full forward (`prompt_logprobs`) for the
"recompute" KV policy. Replicas are real subprocesses on free loopback ports; servers that a test must
stop, restart or configure differently run in-process under uvicorn.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import torch
import uvicorn
from safetensors.torch import save, save_file

from inflight.inference import BuiltinEngine, BuiltinEngineConfig
from inflight.inference.client import (
    BalancedClient,
    ClientConfig,
    EngineClient,
    EngineRequestError,
    NoReplicaAvailableError,
)
from inflight.inference.server import EngineServerConfig, create_app
from inflight.models import load_model, load_tokenizer
from inflight.types import SampleRequest, SamplingParams, WeightUpdate

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
    """uvicorn in a thread on a fixed free port; stop() and start() again to simulate an outage."""

    def __init__(self, make_app: Callable[[], object]) -> None:
        self.make_app, self.port = make_app, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> InProcessServer:
        config = uvicorn.Config(self.make_app(), host="127.0.0.1", port=self.port, log_level="warning")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                pytest.fail(f"in-process engine server on port {self.port} did not start within 60 s")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(60)
            assert not self._thread.is_alive(), f"in-process server on port {self.port} did not stop in 60 s"


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
                prompt, SamplingParams(max_tokens=max_tokens, seed=seed, stop_token_ids=[eos])
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
            return await asyncio.gather(*(client.generate(p, sp) for p, sp in batch))

    served = asyncio.run(remote())
    local = make_engine(tiny_model_dir).generate([SampleRequest(p, sp) for p, sp in batch])
    for s, ref in zip(served, local, strict=True):
        assert (s.token_ids, s.finish_reason, s.text) == (ref.token_ids, ref.finish_reason, ref.text)
        assert max_diff(s.logprobs, ref.logprobs) < 1e-5
        assert s.versions == ref.versions == [0] * len(ref.token_ids)


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
                asyncio.create_task(client.generate(p, SamplingParams(max_tokens=max_tokens, seed=i)))
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
                client.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0))
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
                *(client.generate(p, SamplingParams(max_tokens=8)) for p in prompts(8))
            )
            chat = await client.chat(
                [{"role": "user", "content": "hi"}], SamplingParams(max_tokens=5, seed=0)
            )
            with pytest.raises(EngineRequestError, match="must lie in"):
                await client.generate([99999], SamplingParams(max_tokens=2))
            return outs, chat, await client.versions(), client.metrics()

    outs, chat, versions, metrics = asyncio.run(main())
    assert all(len(o.token_ids) == 8 for o in outs)
    assert chat.prompt_token_ids and len(chat.token_ids) == len(chat.logprobs) == len(chat.versions) <= 5
    assert versions == {url: 0 for url in urls}
    assert all(r.served > 0 and r.healthy for r in metrics.replicas)  # least outstanding: both got work
    assert (metrics.retries, metrics.replica_failures) == (0, 0)  # a 4xx is not the replica's fault


def test_all_replicas_down_names_them() -> None:
    urls = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]

    async def main():
        async with BalancedClient(urls, ClientConfig(connect_timeout_s=2)) as client:
            await client.generate([1, 2], SamplingParams(max_tokens=2))

    with pytest.raises(NoReplicaAvailableError) as info:
        asyncio.run(main())
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
            tasks = [asyncio.create_task(client.generate(p, sp)) for p, sp in batch]
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
            tasks = [asyncio.create_task(client.generate(p, sp)) for p, sp in batch]
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
                *(client.generate(p, SamplingParams(max_tokens=4)) for p in prompts(3))
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
