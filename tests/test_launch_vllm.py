"""`inflight run TARGET engine.backend=vllm`: the run starts vLLM's engine (`serve-engine --backend vllm`, in
the environment `launch/vllm_env.py` builds) beside itself, samples every rollout from it and sends it
each step's weights or adapter. Held on BlackJack with on-policy steps (max_staleness_steps=0): the
sampler's logprobs, vLLM's, then equal the trainer's to float32 rounding, which holds only if every
update reached vLLM exactly and took effect before the next step's tokens.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import require_vllm_env
from inflight.cli import main

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def vllm_env() -> None:
    require_vllm_env()


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    capsys.readouterr()
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def vllm_children() -> list[int]:
    """The pids of this process's `serve-engine --backend vllm` children."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit():
                continue
            parent = int((entry / "stat").read_text().split(")")[-1].split()[1])
            if parent != os.getpid():
                continue
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
        if b"serve-engine" in argv and b"vllm" in argv:
            pids.append(int(entry.name))
    return pids


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora-killed"])
def test_blackjack_samples_from_vllm_on_the_trainers_weights(
    lora: bool, warm_tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Full weights; and a LoRA adapter with the vLLM process SIGKILLed after the first step: the run
    starts it again on its port (engine.max_restarts), waits out the outage and sends the new process the
    adapter, and every step still samples with the trainer's exact weights."""
    steps = 5
    killed: list[int] = []
    argvs: list[list[str]] = []

    def kill_the_engine_after_the_first_step() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not train_rows(tmp_path):
            time.sleep(0.1)
        killed.extend(vllm_children())
        for pid in killed:
            argvs.append((Path("/proc") / str(pid) / "cmdline").read_bytes().decode().split("\0"))
            os.kill(pid, signal.SIGKILL)

    if lora:
        threading.Thread(target=kill_the_engine_after_the_first_step, daemon=True).start()
    summary = run_cli(
        capsys, "run", "blackjack", "engine.backend=vllm", "progress=false",
        # 20 steps of the format warm-up in the model, 40 more here
        f"model.path={warm_tiny_model_dir}", "warmup.sft_steps=40", "warmup.sft_batch_size=32",
        f"grpo.steps={steps}", "grpo.prompts_per_step=8",
        "grpo.group_size=4", "eval.num_episodes=8", "pipeline.active_sampling=false",
        "pipeline.max_staleness_steps=0", f"trainer.lora_rank={8 if lora else 0}", "--run-dir", str(tmp_path),
    )  # fmt: skip
    assert summary["steps"] == steps and summary["eval_problems"] == 8
    train = train_rows(tmp_path)
    assert [r["version"] for r in train] == list(range(1, steps + 1))
    last = train[-1]
    assert last["replicas/calls"] > 0 and last["engine_replicas_up"] == 1
    if lora:
        assert len(killed) == 1, killed
        # The engine reads weights by path only from the run's weights directory.
        [argv] = argvs
        assert argv[argv.index("--weights-dir") + 1] == str((tmp_path / "weights").resolve()), argv
        assert last["engine_replica_restarts"] == 1 and last["replicas/recoveries"] >= 1, last
    else:
        assert last["replicas/replica_failures"] == 0 and last["engine_replica_restarts"] == 0
    assert last["rollout_errors"] == 0
    trained = [r for r in train if "logprob_diff_max_abs" in r]
    assert len(trained) >= 3, "most steps must have trained (groups with a reward spread)"
    # Measured 1.1e-6 to 2.5e-6 (float32 on both sides); a missed or late update is ~1e-1.
    assert max(r["logprob_diff_max_abs"] for r in trained) < 1e-4
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["engine"]["backend"] == "vllm" and config["pipeline"]["engine_urls"]
    assert not vllm_children(), "the run stopped its engine"


def train_rows(run_dir: Path) -> list[dict[str, Any]]:
    try:
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    except (OSError, json.JSONDecodeError):  # not written yet, or a line half written
        return []
    return [r for r in rows if r["phase"] == "train"]


def test_vllm_backend_refuses_what_it_cannot_serve_in_one_line(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for extra, message in (
        (["mode=sync"], "engine.backend=vllm serves the asynchronous pipeline"),
        (['pipeline.engine_urls=["http://127.0.0.1:9"]'], "unset one"),
    ):
        capsys.readouterr()
        code = main(
            ["run", "blackjack", "engine.backend=vllm", f"model.path={tiny_model_dir}", *extra,
             "--run-dir", str(tmp_path / "run")]
        )  # fmt: skip
        err = capsys.readouterr().err
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "run").exists()


def test_more_prompt_tokens_than_one_steps_budget_with_seeds(tiny_model_dir: Path) -> None:
    """48 seeded prompts of 100 tokens (4,800 prompt tokens against a step budget of 2,048): vLLM schedules
    whole prompts over several steps. Split prompts made vLLM rewind a CPU generator, which failed the
    engine ("CPU Generator does not use offset") in a BlackJack run of the default preset. Each completion
    equals the same request's alone, whatever else shared its steps."""
    from inflight.inference.http_engine import HttpEngine
    from inflight.launch.engine_process import EngineProcess
    from inflight.types import SampleRequest, SamplingParams

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 2000, (100,), generator=g).tolist() for _ in range(48)]
    requests = [SampleRequest(p, SamplingParams(max_tokens=4, seed=i)) for i, p in enumerate(prompts)]
    with (
        EngineProcess(tiny_model_dir, max_batch_size=64, max_seq_len_tokens=128) as server,
        HttpEngine([server.url]) as engine,
    ):
        together = engine.generate(requests)
        alone = [engine.generate([r])[0] for r in requests[:3]]
    assert all(c.finish_reason == "length" and len(c.token_ids) == 4 for c in together)
    assert [c.token_ids for c in alone] == [c.token_ids for c in together[:3]]
