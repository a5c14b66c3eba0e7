"""The asynchronous pipeline on BlackJack (tiny model, a short warm-up so that groups carry signal).

- at max_staleness_steps=0 it reproduces the sync loop step for step (same samples, same losses);
- with a bound k > 0 generation runs ahead, and no trained token is older than k steps; the final checkpoint
  trims the result stream to its offset;
- a rollout that raises is counted and the run goes on;
- groups played elsewhere (the `GroupPlayer` seam of rollout workers) enter the buffer once, failures counted;
- with `trainer.lora_rank=N` (both loops) only the adapter reaches the engine, and sampler and trainer agree.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from inflight.buffer.streams import TrimmedError, open_stream
from inflight.config import RunConfig
from inflight.inference.builtin import BuiltinEngine, BuiltinEngineConfig
from inflight.inference.engine_service import EngineServerConfig
from inflight.inference.server import ServerThread, create_app
from inflight.metrics.logger import MetricsLogger
from inflight.orchestrator.guard import RolloutGuard
from inflight.orchestrator.pipeline import run_pipeline
from inflight.orchestrator.publish import policy_engine
from inflight.orchestrator.remote_engine import RemoteEngines, weight_transport
from inflight.orchestrator.rollout_group import PlayedGroup, group_record, play_group
from inflight.orchestrator.run import train
from inflight.orchestrator.setup import build_engine, build_trainer, load_policy, pad_id
from inflight.orchestrator.sync_loop import LoopParts
from inflight.orchestrator.target import resolve_target
from inflight.orchestrator.task import Task, load_split
from inflight.orchestrator.warmup import format_warmup
from inflight.rollouts.chat import ChatFormat
from inflight.trainer.lora_policy import ADAPTER_NAME

BLACKJACK = resolve_target("blackjack")


def small_config(tmp_path: Path, **pipeline: Any) -> RunConfig:
    cfg = BLACKJACK.config()
    cfg.progress = False
    cfg.run_dir = str(tmp_path)
    cfg.grpo.steps, cfg.grpo.prompts_per_step, cfg.grpo.group_size = 6, 4, 4
    cfg.warmup.sft_steps = 30
    cfg.pipeline.active_sampling = False
    for key, value in pipeline.items():
        setattr(cfg.pipeline, key, value)
    return cfg


@pytest.fixture(scope="module")
def warmed(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path):
    """The tiny model after a short BlackJack warm-up: its state, tokenizer and chat format."""
    tmp = tmp_path_factory.mktemp("warmup")
    cfg = small_config(tmp)
    cfg.model.path = str(tiny_model_dir)
    model, tokenizer = load_policy(cfg)
    chat = ChatFormat(tokenizer)
    format_warmup(
        model, pad_id(tokenizer), chat, lambda: BLACKJACK.make_env(cfg, "train"), cfg, MetricsLogger(tmp)
    )
    return {k: v.clone() for k, v in model.state_dict().items()}, str(tiny_model_dir)


def parts_for(cfg: RunConfig, warmed, task: Task = BLACKJACK) -> LoopParts:
    state, model_dir = warmed
    cfg.model.path = model_dir
    model, tokenizer = load_policy(cfg)
    model.load_state_dict(state)
    return LoopParts(
        build_engine(cfg, model, tokenizer),
        build_trainer(model, tokenizer, cfg.trainer, cfg.grpo.steps),
        ChatFormat(tokenizer),
        task,
        load_split(task, "train"),
    )


def test_staleness_zero_reproduces_the_sync_loop(tmp_path: Path, warmed) -> None:
    histories = {}
    for mode in ("sync", "async"):
        cfg = small_config(tmp_path / mode, max_staleness_steps=0)
        cfg.mode = mode
        histories[mode] = train(parts_for(cfg, warmed), cfg, MetricsLogger(cfg.run_dir), cfg.run_dir)
    sync, pipe = histories["sync"], histories["async"]
    assert len(sync) == len(pipe) == 6
    assert any(h.get("loss", 0) != 0 for h in sync)  # the comparison covers real updates
    for s, p in zip(sync, pipe, strict=True):
        assert p["reward_mean"] == s["reward_mean"]
        assert p["generated_tokens"] == s["generated_tokens"]
        assert p.get("loss", 0.0) == pytest.approx(s.get("loss", 0.0), abs=1e-6)
        assert p["lag_steps_max"] == 0


def test_bounded_staleness_runs_ahead_but_never_past_the_bound(tmp_path: Path, warmed) -> None:
    # A segment per record: the trim at the checkpoint drops exactly the records before its offset.
    stream_url = f"file://{tmp_path / 'results'}?segment_bytes=1"
    cfg = small_config(tmp_path, max_staleness_steps=1, active_sampling=True, stream_url=stream_url)
    cfg.mode = "async"
    history = train(parts_for(cfg, warmed), cfg, MetricsLogger(tmp_path), tmp_path)
    assert len(history) == 6
    lags = [h["lag_steps_max"] for h in history]
    assert max(lags) <= 1
    assert max(lags) == 1  # generation did overlap training
    last = history[-1]
    assert last["buffer/consumed"] == 6 * 4
    # Every admitted prompt is accounted for: consumed, filtered, dropped, cancelled or still pending.
    pending = last["buffer/in_flight"] + last["buffer/buffered"]
    accounted = last["buffer/consumed"] + last["buffer/filtered"] + last["buffer/stale_dropped"]
    assert last["buffer/admitted"] == accounted + last["buffer/cancelled"] + pending
    for key in ("ess", "is_weight_mean", "lag_steps_frac/0", "lag_steps_frac/1", "trainer_idle_frac"):
        assert key in last
    # In-flight updates are measured: the initial weights and one version per step were published; when
    # the last step logs, its own update may still wait for the next decode step. Each install paused
    # generation a little (tokens on stale K/V are tested in test_kv_policy.py: BlackJack's one-token
    # replies rarely straddle a swap).
    assert last["engine/updates_received"] == 1 + 6
    assert 6 <= last["engine/updates_applied"] + last["engine/updates_superseded"] <= 7
    assert last["engine/update_pause_s_max"] >= last["engine/update_pause_s_mean"] > 0
    assert "engine/stale_kv_token_frac" in last
    saved = json.loads((tmp_path / "checkpoint" / "trainer_state.json").read_text())["pipeline"]
    # The groups active sampling filtered never reached the stream: it held (offsets 0..read_offset read)
    # exactly the groups put into the buffer less those.
    counters = saved["buffer"]["counters"]
    assert counters["filtered"] >= 1  # BlackJack's naturals alone make some groups flat
    assert saved["read_offset"] + 1 == counters["put"] - counters["filtered"]
    with open_stream(stream_url) as stream:  # the final checkpoint trimmed it to its offset
        with pytest.raises(TrimmedError):
            stream.read(saved["read_offset"] - 1, 1, 0.0)
        stream.read(saved["read_offset"], 1000, 0.0)  # what a resume reads is all there


def flaky(task: Task) -> Task:
    """Every third problem's first sample raises, as a buggy environment would."""

    async def generate_rollout(ctx, problem):  # type: ignore[no-untyped-def]
        if ctx.problem_index % 3 == 0 and ctx.sample_index == 0:
            raise RuntimeError("environment crashed")
        return await task.generate_rollout(ctx, problem)

    return dataclasses.replace(task, generate_rollout=generate_rollout)


def test_a_rollout_that_raises_is_counted_and_the_run_goes_on(tmp_path: Path, warmed) -> None:
    cfg = small_config(tmp_path, max_staleness_steps=1)
    cfg.mode = "async"
    cfg.grpo.steps = 3
    parts = parts_for(cfg, warmed, flaky(BLACKJACK))
    history = run_pipeline(parts, cfg, MetricsLogger(tmp_path), tmp_path)
    assert len(history) == 3
    assert history[-1]["rollout_errors"] >= 1
    assert history[-1]["groups_dropped_errors"] == 0  # 3 of 4 samples survive: the group still trains


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_weights_go_by_the_filesystem_only_to_replicas_on_this_machine() -> None:
    local = ["http://127.0.0.1:8001", "http://localhost:8002", "http://[::1]:8003"]
    assert weight_transport("auto", local) == "filesystem"
    assert weight_transport("auto", [*local, "http://198.51.100.7:8001"]) == "http"  # another node
    assert weight_transport("auto", ["http://engine-0.cluster.invalid:8001"]) == "http"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        udp.connect(("192.0.2.1", 9))  # sends nothing: the kernel picks the interface it would use
        ours = udp.getsockname()[0]  # this machine's own address, as Ray names a node
    assert ours not in ("127.0.0.1", "0.0.0.0")
    assert weight_transport("auto", [f"http://{ours}:8001"]) == "filesystem"
    assert weight_transport("filesystem", ["http://198.51.100.7:8001"]) == "filesystem"  # a shared mount
    assert weight_transport("http", local) == "http"


@pytest.mark.parametrize(
    ("lora_rank", "transport"),
    [(0, "filesystem"), (8, "filesystem"), (0, "http"), (8, "http"), (0, "torch_dist"), (8, "torch_dist")],
)
def test_pipeline_with_an_engine_replica_over_http(
    tmp_path: Path, warmed, lora_rank: int, transport: str
) -> None:
    """The engine in its own process (`inflight serve-engine`); weights reach it by the filesystem, in the
    request bodies (`pipeline.weight_transport=http`: no file is written), or broadcast over a
    torch.distributed group (`torch_dist`: bucketed flat buffers over gloo, no file either). Under LoRA the
    replica gets the warmed-up base once, then only the adapter, and samples with it."""
    _, model_dir = warmed
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "inflight.cli", "serve-engine", "--model", model_dir, "--port", str(port)],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, server.stderr.read().decode()[-2000:] if server.stderr else ""
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "serve-engine did not answer /health within 300 s"
            time.sleep(0.2)
        cfg = small_config(tmp_path, max_staleness_steps=1, engine_urls=[url], weight_transport=transport)
        # Steps whose groups all have equal rewards train nothing (no active sampling here): 6 steps, so
        # that at least 2 updates happen (4 let a run with 3 such steps end at version 1).
        cfg.mode, cfg.grpo.steps = "async", 6
        cfg.trainer.lora_rank = lora_rank
        parts = parts_for(cfg, warmed)
        history = train(parts, cfg, MetricsLogger(tmp_path), tmp_path)
        served = httpx.get(f"{url}/adapters", timeout=10).json()
        received = httpx.get(f"{url}/metrics", timeout=10).json()["broadcast_updates_received"]
    finally:
        server.terminate()
        server.wait(30)
    assert len(history) == 6
    assert history[-1]["replicas/calls"] > 0
    # Lag <= 1 at trainer version >= 2 means the replica sampled with weights the trainer published.
    skips = [{k: v for k, v in h.items() if "skip" in k or k == "version"} for h in history]
    assert history[-1]["version"] >= 2 and history[-1]["lag_steps_max"] <= 1, skips
    weight_files = sorted(p.name for p in (tmp_path / "weights").glob("weights-*.safetensors"))
    parity = [h["logprob_parity_max_abs"] for h in history if h.get("logprob_parity_token_frac", 0) > 0]
    assert parity and max(parity) < 1e-3, parity  # the replica samples with the trainer's weights
    if lora_rank:
        assert served["adapters"] == {ADAPTER_NAME: parts.trainer.version}, served
    if transport == "torch_dist":
        sent = history[-1]["replicas/broadcast_updates"]
        assert history[-1]["replicas/broadcast_fallbacks"] == 0 and sent == received
        assert sent == 1 if lora_rank else sent >= 2  # under LoRA: the warmed-up base once
    else:
        assert received == 0
    if transport != "filesystem":
        assert not (tmp_path / "weights").exists() or not any((tmp_path / "weights").rglob("*.safetensors"))
    elif lora_rank:
        assert weight_files == ["weights-00000000.safetensors"]  # the warmed-up base, once
    else:
        assert weight_files


class TwiceWritingPlayer:
    """A `GroupPlayer` as `launch/ray/rollout_workers.py`'s workers are one, in this process: each group
    played against the replica with a client that follows the run's (`follows_others`), written to the shared
    result stream by the player itself (as a worker writes to Redis), and problem 2's group written twice,
    as a worker that died after writing it leaves it when its group is played again."""

    def __init__(self, cfg: RunConfig, task: Task, chat: ChatFormat, url: str, run_dir: Path) -> None:
        self.cfg, self.task, self.chat = cfg, task, chat
        self.engines = RemoteEngines([url], run_dir / "weights", follows_others=True)
        self.guard = RolloutGuard(cfg.rollout, 1)
        assert cfg.pipeline.stream_url
        self.stream = open_stream(cfg.pipeline.stream_url)
        self.played = 0

    async def play(self, problem_index: int, problem: dict) -> PlayedGroup:
        if not self.played:
            await self.engines.astart()
        self.played += 1

        async def generate(request):  # type: ignore[no-untyped-def]
            return await self.engines.generate(request, 60.0)

        group = await play_group(self.task, problem, problem_index, self.cfg, self.chat, generate, self.guard)
        for _ in range(2 if problem_index == 2 else 1):
            self.stream.append(group_record(problem_index, group))
        return PlayedGroup(problem_index, [], True, self.guard.take_counts())

    def metrics(self) -> dict[str, float]:
        return {"players/played": float(self.played)}


def test_groups_played_elsewhere_enter_the_buffer_once_with_their_failures_counted(
    tmp_path: Path, warmed, replica_url
) -> None:
    """The pipeline's `GroupPlayer` seam (rollout workers of their own): groups come through the stream
    the players write, a group written twice trains once (`stream_duplicates`), and the rollouts that
    failed in a player reach the run's guard (`rollout_errors`)."""
    url = replica_url
    cfg = small_config(tmp_path, max_staleness_steps=1, engine_urls=[url], stream_url="memory://played")
    cfg.mode, cfg.grpo.steps = "async", 4
    task = flaky(BLACKJACK)  # every third problem's first sample raises
    parts = parts_for(cfg, warmed, task)
    player = TwiceWritingPlayer(cfg, task, parts.chat, url, tmp_path)
    history = run_pipeline(parts, cfg, MetricsLogger(tmp_path), tmp_path, players=player)
    last = history[-1]
    assert len(history) == 4 and last["buffer/consumed"] == 4 * 4
    assert last["stream_duplicates"] == 1, last
    assert last["rollout_errors"] >= 1 and last["groups_dropped_errors"] == 0, last
    assert last["players/played"] >= 16
    pending = last["buffer/in_flight"] + last["buffer/buffered"]
    accounted = last["buffer/consumed"] + last["buffer/filtered"] + last["buffer/stale_dropped"]
    assert last["buffer/admitted"] == accounted + last["buffer/cancelled"] + pending
    parity = [h["logprob_parity_max_abs"] for h in history if h.get("logprob_parity_token_frac", 0) > 0]
    assert parity and max(parity) < 1e-3, parity  # the players sampled the trainer's weights


@pytest.fixture
def replica_url(warmed):  # type: ignore[no-untyped-def]
    """An engine replica serving the tiny model from disk in this process (the pipeline publishes the
    warmed-up weights to it first)."""
    _, model_dir = warmed
    model, tokenizer = load_policy(RunConfig.model_validate({"model": {"path": model_dir}}))
    engine = BuiltinEngine(model, tokenizer, BuiltinEngineConfig(max_batch_size=32))
    server = ServerThread(create_app(engine, tokenizer, EngineServerConfig())).start()
    try:
        yield server.url
    finally:
        server.stop()


# ---- LoRA RL (issue 12 item 3): the engine keeps its frozen base and receives only the adapter -------------


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_lora_rl_ships_only_the_adapter(tmp_path: Path, warmed, mode: str) -> None:
    cfg = small_config(tmp_path, max_staleness_steps=1)
    cfg.mode, cfg.grpo.steps = mode, 4
    cfg.trainer.lora_rank, cfg.trainer.lr = 8, 1e-2
    state, model_dir = warmed
    cfg.model.path = model_dir
    model, tokenizer = load_policy(cfg)
    model.load_state_dict(state)
    engine = build_engine(cfg, model, tokenizer)  # first: it copies the (warmed) base weights
    trainer = build_trainer(model, tokenizer, cfg.trainer, cfg.grpo.steps)
    problems, chat = load_split(BLACKJACK, "train"), ChatFormat(tokenizer)
    parts = LoopParts(policy_engine(engine, trainer), trainer, chat, BLACKJACK, problems)
    history = train(parts, cfg, MetricsLogger(tmp_path), tmp_path)

    assert len(history) == 4 and trainer.version >= 3  # a skipped (uninformative) step may not update
    metrics = engine.metrics()
    assert metrics.updates_received == 0  # the base never changed hands
    assert metrics.adapter_updates_received >= 1 + trainer.version  # the initial adapter and one per step
    assert engine.adapters() == {ADAPTER_NAME: trainer.version}
    assert max(h["lag_steps_max"] for h in history) <= (0 if mode == "sync" else 1)
    # Sampler and trainer agree on every token the current adapter sampled: the engine's adapter is the
    # trainer's (a stale or missing adapter would show the whole policy change here).
    parity = [h["logprob_parity_max_abs"] for h in history if h.get("logprob_parity_token_frac", 0) > 0]
    assert parity and max(parity) < 1e-3, parity
    # The adapter trained: its B left zero, and the frozen base did not move.
    update = trainer.adapter_update()
    assert any(t.abs().max() > 0 for name, t in update.tensors.items() if "lora_B" in name)
    base = trainer.policy.adapters.base_weights()  # type: ignore[attr-defined]
    assert base.keys() == state.keys() and all(torch.equal(base[k], state[k]) for k in state)
