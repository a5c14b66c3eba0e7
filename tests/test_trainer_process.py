"""The pipeline's trainer in a process of its own (`trainer/process.py`): the same steps as the Trainer in
this process, the weights shared in memory, checkpoints through the child, LoRA, and a child that fails
or dies reported in one line."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from inflight.config import RunConfig
from inflight.errors import UserError
from inflight.metrics.logger import MetricsLogger
from inflight.models import load_model, load_tokenizer
from inflight.orchestrator.pipeline import run_pipeline
from inflight.orchestrator.setup import (
    build_engine,
    build_loop_trainer,
    load_policy,
    pinned_trainer_cpus,
    wants_trainer_process,
)
from inflight.orchestrator.sync_loop import LoopParts
from inflight.orchestrator.target import resolve_target
from inflight.orchestrator.task import load_split
from inflight.rollouts.chat import ChatFormat
from inflight.trainer import LossConfig, Trainer, TrainerConfig
from inflight.trainer.process import TrainerProcess, TrainerProcessError, shared_memory_shortfall
from test_trainer import make_grouped_samples

VOCAB = 2048


def _config(lora_rank: int = 0) -> TrainerConfig:
    # The KL term exercises the child's own frozen reference; the entropy bonus one more path.
    loss = LossConfig(name="ppo", kl_coef=0.1, kl_estimator="exact_ref", entropy_coef=0.1)
    return TrainerConfig(lr=1e-3, lora_rank=lora_rank, loss=loss)


def _assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name, tensor in a.items():
        torch.testing.assert_close(b[name], tensor, rtol=0, atol=1e-6, msg=name)


@pytest.fixture
def one_thread() -> object:
    # The child runs one torch thread; this process too, so both compute the same sums in the same order.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_steps_in_a_child_equal_steps_here_and_the_weights_are_shared(
    tiny_model_dir: Path, one_thread: object
) -> None:
    samples = [make_grouped_samples(3, 4, VOCAB, seed=s) for s in range(3)]
    here = Trainer(load_model(tiny_model_dir), _config())
    model = load_model(tiny_model_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with TrainerProcess(model, _config(), threads=1) as child:
        for batch in samples:
            expected, got = here.train_step(batch), child.train_step(batch)
            for key in ("loss", "grad_norm", "kl", "entropy", "clip_fraction"):
                assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), key
        assert child.version == here.version == 3
        # This process's model *is* the child's: it moved, exactly as the in-process trainer's did.
        _assert_same_weights(here.weights(), {k: v for k, v in model.state_dict().items()})
        _assert_same_weights(here.weights(), child.weights())
        assert not torch.equal(before["lm_head.weight"], model.state_dict()["lm_head.weight"])


def test_a_checkpoint_written_by_the_child_resumes_with_its_optimizer(
    tiny_model_dir: Path, tmp_path: Path, one_thread: object
) -> None:
    first, second = make_grouped_samples(3, 4, VOCAB, seed=1), make_grouped_samples(3, 4, VOCAB, seed=2)
    with TrainerProcess(load_model(tiny_model_dir), _config(), threads=1) as child:
        child.train_step(first)
        child.save_checkpoint(tmp_path / "ckpt", extra={"step": 1})
        child.train_step(second)
        continued = child.weights()
        continued = {k: v.clone() for k, v in continued.items()}
    # Written in the checkpoint format the in-process trainer reads.
    here = Trainer(load_model(tiny_model_dir), _config())
    assert here.resume_checkpoint(tmp_path / "ckpt")["step"] == 1 and here.version == 1
    with TrainerProcess(load_model(tiny_model_dir), _config(), threads=1) as resumed:
        assert resumed.resume_checkpoint(tmp_path / "ckpt")["step"] == 1 and resumed.version == 1
        resumed.train_step(second)  # the same step as the first child's, optimizer moments included
        _assert_same_weights(continued, resumed.weights())
        assert resumed.resume_checkpoint(tmp_path / "absent") == {}


def test_lora_in_a_child_publishes_the_adapter_of_the_in_process_trainer(
    tiny_model_dir: Path, one_thread: object
) -> None:
    batch = make_grouped_samples(3, 4, VOCAB, seed=3)
    here = Trainer(load_model(tiny_model_dir), _config(lora_rank=4))
    model = load_model(tiny_model_dir)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    with TrainerProcess(model, _config(lora_rank=4), threads=1) as child:
        here.train_step(batch)
        child.train_step(batch)
        expected, got = here.adapter_update(), child.adapter_update()
        assert got.version == expected.version == 1 and got.name == expected.name
        _assert_same_weights(expected.tensors, got.tensors)
        _assert_same_weights(here.weights(), child.weights())  # merged, computed in the child
        _assert_same_weights(base, child.base_weights())  # the base stays frozen
        _assert_same_weights(base, {k: v for k, v in model.state_dict().items()})


def _parent_pid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_children_fork_from_one_server_in_the_parents_directory_and_take_paths_relative_to_it(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Forked from multiprocessing's fork server (which imported torch once), not spawned one by one, and
    each child where this process is when it starts; a relative checkpoint path is this process's."""
    with TrainerProcess(load_model(tiny_model_dir), _config(), threads=1) as first:
        assert first.pid is not None
        server = _parent_pid(first.pid)
        assert server != os.getpid()
        monkeypatch.chdir(tmp_path)
        first.save_checkpoint("first", extra={"step": 0})  # the child started elsewhere
    assert (tmp_path / "first").is_dir()
    with TrainerProcess(load_model(tiny_model_dir), _config(), threads=1) as second:
        assert second.pid is not None
        assert _parent_pid(second.pid) == server
        assert Path(f"/proc/{second.pid}/cwd").resolve() == tmp_path.resolve()


def test_a_failing_call_raises_here_with_the_childs_traceback_and_the_child_goes_on(
    tiny_model_dir: Path,
) -> None:
    with TrainerProcess(load_model(tiny_model_dir), _config(), threads=1) as child:
        with pytest.raises(TrainerProcessError, match=r"failed `train_step`:\n(.|\n)*Traceback"):
            child.train_step(["not a sample"])  # type: ignore[list-item]
        assert child.version == 0
        metrics = child.train_step(make_grouped_samples(2, 2, VOCAB))
        assert child.version == 1 and metrics["num_samples"] == 6


def test_a_user_error_in_the_child_is_the_same_one_line(tiny_model_dir: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA (the error is trainer.device=cuda on a CPU machine)")
    config = TrainerConfig(device="cuda")
    with pytest.raises(UserError) as raised:
        Trainer(load_model(tiny_model_dir), config)
    with pytest.raises(UserError) as from_child:
        TrainerProcess(load_model(tiny_model_dir), config, threads=1)
    assert str(from_child.value) == str(raised.value)


def test_ctrl_c_leaves_the_child_to_the_parents_shutdown(tiny_model_dir: Path) -> None:
    with TrainerProcess(load_model(tiny_model_dir), _config(), threads=1) as child:
        os.kill(child._process.pid, signal.SIGINT)  # what Ctrl-C sends the whole process group
        child.train_step(make_grouped_samples(2, 2, VOCAB))  # still answers: the parent decides
        assert child.version == 1


def test_a_child_that_dies_is_reported_with_its_exit_code(tiny_model_dir: Path) -> None:
    child = TrainerProcess(load_model(tiny_model_dir), _config(), threads=1)
    try:
        os.kill(child._process.pid, signal.SIGKILL)  # as the kernel's out-of-memory killer would
        child._process.join(timeout=10)
        with pytest.raises(TrainerProcessError, match=r"died before `train_step` with exit code -9"):
            child.train_step(make_grouped_samples(2, 2, VOCAB))
    finally:
        child.close()


def test_a_script_without_a_main_guard_is_told_to_add_one(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The fork server's child imports the script again; unguarded, it starts one more trainer there,
    which multiprocessing refuses: the error here names the cause and the fix, not only exit code 1."""
    script = tmp_path / "unguarded.py"
    script.write_text(
        "from inflight.models import load_model\n"
        "from inflight.trainer import TrainerConfig\n"
        "from inflight.trainer.process import TrainerProcess, TrainerProcessError\n"
        "try:\n"
        f"    TrainerProcess(load_model({str(tiny_model_dir)!r}), TrainerConfig(), threads=1).close()\n"
        "except TrainerProcessError as exc:\n"
        "    print('ERROR', exc)\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("ERROR")]
    assert "died during `start` with exit code 1" in line
    assert f"main module ({script}) again" in line and 'if __name__ == "__main__":' in line
    assert "bootstrapping phase" in done.stderr  # Python's own message, which the line points to


def test_auto_gives_the_pipeline_a_trainer_process_on_a_multicore_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert wants_trainer_process(RunConfig(mode="async"))
    assert not wants_trainer_process(RunConfig(mode="sync"))  # the sync loop gives each phase both cores
    remote = RunConfig(mode="async", pipeline={"engine_urls": ["http://127.0.0.1:1"]})
    assert wants_trainer_process(remote)  # the rollouts' event loop would still share the trainer's GIL
    assert not wants_trainer_process(RunConfig(mode="async", pipeline={"trainer_process": False}))
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    assert not wants_trainer_process(RunConfig(mode="async"))
    assert wants_trainer_process(RunConfig(mode="async", pipeline={"trainer_process": True}))


def test_too_little_shared_memory_falls_back_to_a_thread_or_is_refused_when_asked_for(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    model = load_model(tiny_model_dir)
    assert shared_memory_shortfall(model) is None  # this machine's /dev/shm holds the tiny model

    class Small:  # a container's /dev/shm: 64 MiB, 1 MiB of it free
        f_bavail, f_frsize = 256, 4096

    monkeypatch.setattr(os, "statvfs", lambda path: Small())
    problem = shared_memory_shortfall(model)
    assert problem is not None and "1 MiB free" in problem and "--shm-size" in problem
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    tokenizer = load_tokenizer(tiny_model_dir)
    with caplog.at_level(logging.WARNING):
        trainer = build_loop_trainer(RunConfig(mode="async"), model, tokenizer)
    assert isinstance(trainer, Trainer) and "runs in a thread" in caplog.text
    asked = RunConfig(mode="async", pipeline={"trainer_process": True})
    with pytest.raises(UserError, match=r"pipeline.trainer_process=true: /dev/shm has 1 MiB free.*=false"):
        build_loop_trainer(asked, load_model(tiny_model_dir), tokenizer)


# ---- pinning (pipeline.pin_cpus) ------------------------------------------------------------------------


def test_pin_cpus_gives_the_trainer_the_last_cpus_where_the_stages_would_share_them(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def pinned(choice: object, cpus: set[int], threads: int = 1) -> frozenset[int] | None:
        cfg = RunConfig(mode="async", pipeline={"pin_cpus": choice, "torch_threads": threads})
        return pinned_trainer_cpus(cfg, frozenset(cpus))

    assert pinned("auto", {0, 1}) == {1}
    assert pinned("auto", {2, 5}) == {5}  # this process's CPUs, not 0..n-1
    assert pinned("auto", {0, 1, 2, 3}, threads=2) == {2, 3}
    assert pinned("auto", {0, 1, 2, 3}) is None  # room for both: the OS keeps them apart
    assert pinned("auto", {0}) is None
    assert pinned(True, {0, 1, 2, 3}) == {3}
    assert pinned(False, {0, 1}) is None
    with caplog.at_level(logging.WARNING):
        assert pinned(True, {0}) is None
    assert "pipeline.pin_cpus=true: 1 CPUs cannot give the engine and the trainer 1 each" in caplog.text


def test_a_pinned_trainer_leaves_the_other_cpus_to_the_engine_side_and_the_run_restores_them(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    available = os.sched_getaffinity(0)
    assert len(available) >= 2, "pinning needs 2 CPUs (this machine kind has them)"
    task = resolve_target("blackjack")
    cfg = task.config()
    cfg.mode, cfg.progress, cfg.run_dir = "async", False, str(tmp_path)
    cfg.model.path = str(tiny_model_dir)
    cfg.grpo.steps, cfg.grpo.prompts_per_step, cfg.grpo.group_size = 2, 2, 2
    cfg.pipeline.active_sampling, cfg.pipeline.pin_cpus = False, True
    model, tokenizer = load_policy(cfg)
    seen: set[frozenset[int]] = set()

    async def generate_rollout(ctx, problem):  # type: ignore[no-untyped-def]
        seen.add(frozenset(os.sched_getaffinity(0)))  # the rollouts' event loop: the engine's side
        return await task.generate_rollout(ctx, problem)

    trainer = build_loop_trainer(cfg, model, tokenizer)
    assert isinstance(trainer, TrainerProcess)
    try:
        assert trainer.cpus == {max(available)}
        assert os.sched_getaffinity(trainer.pid) == trainer.cpus
        spy = dataclasses.replace(task, generate_rollout=generate_rollout)
        parts = LoopParts(
            build_engine(cfg, model, tokenizer),
            trainer,
            ChatFormat(tokenizer),
            spy,
            load_split(task, "train"),
        )
        history = run_pipeline(parts, cfg, MetricsLogger(tmp_path), tmp_path)
    finally:
        trainer.close()
    assert len(history) == 2
    assert seen == {frozenset(available - trainer.cpus)}
    assert os.sched_getaffinity(0) == available  # what runs after the pipeline has every CPU again
