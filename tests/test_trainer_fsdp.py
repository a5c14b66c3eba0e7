"""Sharded data-parallel training (FSDP2): 2 gloo ranks on the CPU, each holding half of every weight,
gradient and AdamW moment, make the update one Trainer makes on the whole batch (with micro-batches, with
gradient clipping and gradient checkpointing, with a rank whose share is empty, with tied embeddings),
publish the full weights from rank 0, and write a checkpoint that transformers loads and that resumes to
the uninterrupted run.

References: a single-process `Trainer` with the same config on the same global batches (its weights and
metrics after two steps; after one, and resumed from the sharded checkpoint, for the checkpoint);
`transformers.AutoModelForCausalLM.from_pretrained` for the checkpoint's files; the uninterrupted sharded
run for the resumed one.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

from inflight.errors import UserError
from inflight.models import load_model
from inflight.trainer import Trainer, TrainerConfig
from inflight.trainer.checkpoint import META
from inflight.trainer.distributed import init_data_parallel
from inflight.trainer.fsdp import ShardedDataParallelTrainer
from inflight.trainer.micro_batches import shard_by_tokens
from inflight.trainer.policy import MODEL_CONFIG, OPTIMIZER, WEIGHTS
from inflight.trainer.trainer import through_last_trained
from inflight.types import TrainSample
from test_trainer import make_samples
from test_trainer_distributed import rendezvous_at

VOCAB = 2048
WORLD = 2
STEPS = 2
LR = 1e-3
CLIP = 0.02  # below every step's gradient norm in the clipped case (checked)
COLLECTIVE_TIMEOUT_S = 60  # joining the group and each collective: a dead or hung peer fails its rank
RUN_TIMEOUT_S = 300  # the whole 2-rank run, then the test kills the ranks and fails
TIMINGS = {"train_s", "train_tokens_per_s"}


@dataclass(frozen=True)
class Case:
    config: dict[str, Any] = field(default_factory=dict)
    num_samples: int = 9
    tied: bool = False  # the tiny model with its LM head tied to the input embeddings
    uneven_passes: bool = False  # the ranks run different numbers of micro-batches (checked): idle passes

    def trainer_config(self, **overrides: Any) -> TrainerConfig:
        return TrainerConfig(**{"lr": LR, **self.config, **overrides})

    def batch(self, step: int) -> list[TrainSample]:
        return make_samples(self.num_samples, VOCAB, seed=100 + step)


CASES = {
    "ppo-micro-batches": Case({"micro_batch_size": 2, "loss": {"name": "ppo"}}, uneven_passes=True),
    "clipped-seq_mean-entropy-checkpointed": Case(
        {
            "max_grad_norm": CLIP,
            "gradient_checkpointing": True,
            "loss": {"name": "ppo", "reduction": "seq_mean", "entropy_coef": 0.01},
        }
    ),
    "one-sample-empty-rank": Case({"loss": {"name": "ppo"}}, num_samples=1, uneven_passes=True),
    "tied-embeddings-padded": Case({"micro_batch_size": 3, "packing": False}, tied=True),
}
CHECKPOINTED = "ppo-micro-batches"  # saved after its first step, then resumed by a fresh trainer


def _join(context: mp.ProcessContext, what: str) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not context.join(timeout=1.0):  # raises with the traceback of a rank that failed
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"{what} were still running after {RUN_TIMEOUT_S}s: one hung")


def _train(
    trainer: Trainer, case: Case, out: Path, tag: str, checkpoint: Path | None = None
) -> list[dict[str, float]]:
    """Train `case` for STEPS steps; with `checkpoint`, save one after the first and record the weights
    then as `{tag}.checkpointed.pt`. Records the metrics and final weights as `{tag}.pt`."""
    metrics = []
    for step in range(STEPS):
        metrics.append(trainer.train_step(case.batch(step)))
        if checkpoint is not None and step == 0:
            trainer.save_checkpoint(checkpoint, extra={"step": 1})
            torch.save(trainer.weights(), out / f"{tag}.checkpointed.pt")
    torch.save({"metrics": metrics, "weights": trainer.weights()}, out / f"{tag}.pt")
    return metrics


def _rank_main(rank: int, init_method: str, model_dirs: dict[bool, str], out_dir: str) -> None:
    torch.set_num_threads(1)
    group = init_data_parallel(rank, WORLD, init_method, timeout_s=COLLECTIVE_TIMEOUT_S)
    out = Path(out_dir)
    for name, case in CASES.items():
        trainer = ShardedDataParallelTrainer(
            load_model(Path(model_dirs[case.tied])), case.trainer_config(), group
        )
        _train(trainer, case, out, f"{name}.rank{rank}", out / "checkpoint" if name == CHECKPOINTED else None)

    # A fresh trainer resumes the checkpoint written after the first step and takes the second.
    case = CASES[CHECKPOINTED]
    trainer = ShardedDataParallelTrainer(load_model(Path(model_dirs[False])), case.trainer_config(), group)
    meta = trainer.resume_checkpoint(out / "checkpoint")
    version = trainer.version
    metrics = trainer.train_step(case.batch(1))
    torch.save(
        {"meta": meta, "version": version, "metrics": metrics, "weights": trainer.weights()},
        out / f"resumed.rank{rank}.pt",
    )

    # Ranks that loaded different weights: recorded for the parent (an exception would only say "failed").
    checks = {}
    model = load_model(Path(model_dirs[False]))
    if rank == 1:
        with torch.no_grad():
            next(model.parameters()).add_(1e-3)
    try:
        ShardedDataParallelTrainer(model, TrainerConfig(), group)
    except RuntimeError as e:
        checks["different_weights"] = str(e)
    (out / f"checks.rank{rank}.json").write_text(json.dumps(checks))
    dist.destroy_process_group()
    # Everything the parent checks is on disk. Skip the interpreter's teardown, which is not under test:
    # in one full run rank 0 aborted with "terminate called without an active exception" (a C++ thread
    # left joinable), where is not known; the file passed alone and in other full runs.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[bool, Path]:
    """By `Case.tied`: the tiny model, and the same with its LM head tied to the input embeddings."""
    model = load_model(tiny_model_dir)
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    tied = tmp_path_factory.mktemp("tiny-tied")
    model.save_pretrained(tied)
    return {False: tiny_model_dir, True: tied}


@pytest.fixture(scope="module")
def two_rank_runs(model_dirs: dict[bool, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every case trained by 2 sharded gloo ranks (one spawn for all: each costs seconds of imports)."""
    out = tmp_path_factory.mktemp("sharded")
    dirs = {tied: str(path) for tied, path in model_dirs.items()}
    context = mp.spawn(_rank_main, args=(rendezvous_at(out), dirs, str(out)), nprocs=WORLD, join=False)
    _join(context, "the sharded ranks")
    return out


def _without_timings(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if k not in TIMINGS}


def _assert_close_weights(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float, frac: float = 1e-4
) -> None:
    """Equal up to the order of float sums: within `atol` but for a `frac` of the elements. AdamW divides
    each gradient by its own root mean square, so where a gradient is near zero that rounding reaches the
    update: a few elements may differ by up to 5% of a step (lr), as in test_trainer_distributed.py."""
    assert set(got) == set(want)  # every Hugging Face name, a tied head's too
    got_N = torch.cat([got[k].reshape(-1) for k in sorted(want)])
    want_N = torch.cat([want[k].detach().cpu().reshape(-1) for k in sorted(want)])
    diff_N = (got_N - want_N).abs()
    assert float(diff_N.max()) <= 5e-2 * LR
    assert int((diff_N > atol).sum()) <= frac * diff_N.numel() + 2


def _passes(trainer: Trainer, batch: list[TrainSample]) -> list[int]:
    """The micro-batches each rank's share of `batch` makes."""
    lengths = [len(through_last_trained(s).token_ids) - 1 for s in batch]
    shares = shard_by_tokens(lengths, WORLD)
    return [len(trainer._micro_batches([through_last_trained(batch[i]) for i in share])) for share in shares]


@pytest.mark.parametrize("name", list(CASES))
def test_two_sharded_ranks_make_the_update_of_one_trainer_on_the_whole_batch(
    two_rank_runs: Path, model_dirs: dict[bool, Path], name: str
) -> None:
    case = CASES[name]
    single = Trainer(load_model(model_dirs[case.tied]), case.trainer_config())
    initial = {k: v.clone() for k, v in single.weights().items()}
    if case.uneven_passes:
        assert any(len(set(_passes(single, case.batch(step)))) > 1 for step in range(STEPS))
    expected = [single.train_step(case.batch(step)) for step in range(STEPS)]
    if "max_grad_norm" in case.config:
        assert all(m["grad_norm"] > CLIP for m in expected), "clipping must act in every step"
    ranks = [torch.load(two_rank_runs / f"{name}.rank{r}.pt") for r in range(WORLD)]

    # Rank 0 publishes the full weights; the other rank holds only its shards.
    assert ranks[1]["weights"] == {}
    want = single.weights()
    _assert_close_weights(ranks[0]["weights"], want, atol=1e-6)
    moved = max(float((want[k] - initial[k]).abs().max()) for k in want)
    assert moved > 0.5 * LR, "two steps must move the weights far beyond the tolerance"

    # The metrics are the whole step's, the same on every rank, and one trainer's.
    assert [_without_timings(m) for m in ranks[0]["metrics"]] == [
        _without_timings(m) for m in ranks[1]["metrics"]
    ]
    for step, (got, want_metrics) in enumerate(zip(ranks[0]["metrics"], expected, strict=True)):
        assert set(got) - {"dp_token_imbalance"} == set(want_metrics)
        for key in set(want_metrics) - TIMINGS:
            assert got[key] == pytest.approx(want_metrics[key], rel=1e-4, abs=1e-6), (step, key)


def test_a_checkpoint_written_by_rank_0_loads_in_transformers_and_resumes_to_the_uninterrupted_run(
    two_rank_runs: Path, tiny_model_dir: Path
) -> None:
    case = CASES[CHECKPOINTED]
    checkpoint = two_rank_runs / "checkpoint"
    assert sorted(p.name for p in checkpoint.iterdir()) == sorted([WEIGHTS, MODEL_CONFIG, OPTIMIZER, META])

    # The files hold the full weights after the first step: transformers loads them as they were.
    after_first = torch.load(two_rank_runs / f"{CHECKPOINTED}.rank0.checkpointed.pt")
    loaded = AutoModelForCausalLM.from_pretrained(checkpoint).state_dict()
    assert set(loaded) == set(after_first)
    for key, tensor in after_first.items():
        assert torch.equal(loaded[key], tensor), key
    single = Trainer(load_model(tiny_model_dir), case.trainer_config())
    single.train_step(case.batch(0))
    _assert_close_weights(after_first, single.weights(), atol=1e-6)

    # A fresh sharded trainer resumes it and takes the second step: exactly the uninterrupted run.
    uninterrupted = torch.load(two_rank_runs / f"{CHECKPOINTED}.rank0.pt")
    resumed = [torch.load(two_rank_runs / f"resumed.rank{r}.pt") for r in range(WORLD)]
    for r in resumed:
        assert r["version"] == 1 and r["meta"]["step"] == 1
    assert resumed[1]["weights"] == {}
    assert set(resumed[0]["weights"]) == set(uninterrupted["weights"])
    for key, tensor in uninterrupted["weights"].items():
        assert torch.equal(resumed[0]["weights"][key], tensor), key
    assert _without_timings(resumed[0]["metrics"]) == _without_timings(uninterrupted["metrics"][1])

    # Its files are one trainer's (the optimizer state in torch's own layout): one trainer resumes them
    # and takes the second step as one trainer does.
    one = Trainer(load_model(tiny_model_dir), case.trainer_config())
    assert one.resume_checkpoint(checkpoint)["step"] == 1
    one.train_step(case.batch(1))
    single.train_step(case.batch(1))
    _assert_close_weights(one.weights(), single.weights(), atol=1e-6)


def test_ranks_that_loaded_different_weights_fail_before_sharding(two_rank_runs: Path) -> None:
    for rank in range(WORLD):
        checks = json.loads((two_rank_runs / f"checks.rank{rank}.json").read_text())
        assert "hold different weights" in checks.get("different_weights", ""), checks


def test_a_sharded_trainer_refuses_lora_and_kl_and_says_what_to_call_without_a_process_group() -> None:
    assert not dist.is_initialized()
    model = torch.nn.Linear(2, 2)
    with pytest.raises(UserError, match=r"lora_rank.*DataParallelTrainer"):
        ShardedDataParallelTrainer(model, TrainerConfig(lora_rank=4))
    with pytest.raises(UserError, match="kl_coef"):
        ShardedDataParallelTrainer(model, TrainerConfig(loss={"kl_coef": 0.1}))  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="init_data_parallel"):
        ShardedDataParallelTrainer(model, TrainerConfig())


# ---- NCCL on a GPU ---------------------------------------------------------------------------------------
# One GPU holds one NCCL rank, so this is the NCCL path of a world of one: the units sharded over a mesh of
# one CUDA rank (DTensors, reduce-scatters and all-gathers through NCCL), the shards placed on the device
# from a CPU model, and the full weights and checkpoint gathered back; the update must be the plain
# trainer's, and a resumed run the uninterrupted one.


def _nccl_rank_main(rank: int, init_method: str, model_dirs: dict[bool, str], out_dir: str) -> None:
    group = init_data_parallel(rank, 1, init_method, "cuda", timeout_s=COLLECTIVE_TIMEOUT_S)
    assert dist.get_backend(group) == "nccl"
    out = Path(out_dir)
    for name, case in CASES.items():
        model = load_model(Path(model_dirs[case.tied]))
        trainer = ShardedDataParallelTrainer(model, case.trainer_config(device="cuda"), group)
        _train(trainer, case, out, f"{name}.nccl", out / "checkpoint" if name == CHECKPOINTED else None)
    case = CASES[CHECKPOINTED]
    model = load_model(Path(model_dirs[False]))
    trainer = ShardedDataParallelTrainer(model, case.trainer_config(device="cuda"), group)
    trainer.resume_checkpoint(out / "checkpoint")
    trainer.train_step(case.batch(1))
    torch.save(trainer.weights(), out / "resumed.nccl.pt")
    dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_one_sharded_nccl_rank_on_cuda_makes_the_plain_trainers_update(
    model_dirs: dict[bool, Path], tmp_path: Path
) -> None:
    dirs = {tied: str(path) for tied, path in model_dirs.items()}
    context = mp.spawn(
        _nccl_rank_main, args=(rendezvous_at(tmp_path), dirs, str(tmp_path)), nprocs=1, join=False
    )
    _join(context, "the NCCL rank")
    for name, case in CASES.items():
        single = Trainer(load_model(model_dirs[case.tied]), case.trainer_config(device="cuda"))
        expected = [single.train_step(case.batch(step)) for step in range(STEPS)]
        got = torch.load(tmp_path / f"{name}.nccl.pt")
        # CUDA's atomic adds make backward sums order-dependent: a looser bound than on the CPU.
        _assert_close_weights(got["weights"], single.weights(), atol=1e-5, frac=1e-3)
        for step, (g, w) in enumerate(zip(got["metrics"], expected, strict=True)):
            for key in set(w) - TIMINGS:
                assert g[key] == pytest.approx(w[key], rel=1e-3, abs=1e-5), (name, step, key)
    uninterrupted = torch.load(tmp_path / f"{CHECKPOINTED}.nccl.pt")["weights"]
    _assert_close_weights(torch.load(tmp_path / "resumed.nccl.pt"), uninterrupted, atol=1e-5, frac=1e-3)
