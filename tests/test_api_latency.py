"""What keeps one request's overhead small: the served socket sends without Nagle's algorithm, the worker is
woken where work is (no request waits for its idle poll), and a long-poll learns of its future's finish from
the board, in memory, after the commit.

Reference: issue 15's Benchmark clause (`api_overhead_ms` under 10 ms without giving up durability); the
measurements are `inflight bench serve` and docs/benchmarks.md. Driven by the unmodified `tinker` SDK against
a live server on the tiny model.
"""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import tinker

from conftest import sdk_server
from inflight.api.futures import Future, RequestType
from inflight.api.service import CompletionBoard, ServiceConfig
from inflight.api.worker import WorkerConfig
from inflight.preflight import bind_port

types = tinker.types
BASE = "tiny"


def test_served_connections_send_without_nagles_algorithm() -> None:
    """asyncio sets TCP_NODELAY only on connections of a socket whose proto is IPPROTO_TCP; without it a
    response written as headers then body waits ~40 ms for the client's delayed ACK."""

    async def accepted_nodelay() -> int:
        sock = bind_port("127.0.0.1", 0)
        nodelay: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                accepted = transport.get_extra_info("socket")
                nodelay.set_result(accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection(*sock.getsockname())
            value = await asyncio.wait_for(nodelay, 10)
            writer.close()
        return value

    assert asyncio.run(accepted_nodelay()) != 0


def test_the_board_knows_accepted_futures_until_their_finish() -> None:
    board = CompletionBoard()
    now = datetime.now(UTC)
    pending = Future("7", "s:train:0", 1, RequestType.FORWARD, "pending", b"", None, None, None, now, None)
    board.accepted(pending)
    assert board.pending("7") == pending and board.pending("8") is None

    async def long_poll() -> Future | None:
        with board.watch("7") as waiter:
            done = replace(pending, status="done", result_payload=b"r", finished_at=now)
            asyncio.get_running_loop().call_soon(board.notify, "7", done)
            await asyncio.wait_for(waiter.event.wait(), 10)
            return waiter.finished

    finished = asyncio.run(long_poll())
    assert finished is not None and finished.result_payload == b"r"
    assert board.pending("7") is None  # the next long-poll reads the row


@pytest.mark.slow
def test_requests_never_wait_for_the_idle_poll(tiny_model_dir: Path, tmp_path: Path) -> None:
    """With the worker's backstop poll at 60 s, pipelined training requests (the second queued behind the
    first), a sampler save and a sample still finish at once: each was woken where it waits."""
    config = ServiceConfig(base_models={BASE: str(tiny_model_dir)}, state_dir=tmp_path, dtype="float32")
    with sdk_server(config, worker_config=WorkerConfig(idle_poll_s=60.0)) as server:
        time.sleep(0.5)  # let the worker's first round (it looks everywhere at start) pass
        start = time.monotonic()
        service = tinker.ServiceClient(base_url=server.url)
        training = service.create_lora_training_client(base_model=BASE, rank=4, seed=0).result(timeout=30)
        tokens = list(range(10, 30))
        targets: Any = tokens[1:]  # the SDK turns plain lists into TensorData
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": targets}
        )
        futures = [
            training.forward_backward([datum], "cross_entropy"),
            training.optim_step(types.AdamParams(learning_rate=1e-3)),
            training.forward([datum], "cross_entropy"),
        ]
        for future in futures:
            future.result(timeout=30)
        sampler = training.save_weights_and_get_sampling_client().result(timeout=30)
        params = types.SamplingParams(max_tokens=4, temperature=1.0, stop=[], seed=0)
        sampled = sampler.sample(types.ModelInput.from_ints(tokens[:6]), 1, params).result(timeout=30)
        assert len(sampled.sequences[0].tokens) == 4
        assert time.monotonic() - start < 30, "a request waited for the 60 s idle poll"
        service.close("success").result(timeout=30)
