"""Data-parallel training: 2 gloo ranks on the CPU make the update that one Trainer makes on the whole batch,
full-parameter and LoRA, with micro-batches, seq_mean and token_sum reductions, regularisers, and a rank
whose share is empty; ranks handed different steps or holding different weights fail loudly.

References: a single-process `Trainer` with the same config on the same global batches (its trained
parameters after two steps, its metrics); `shard_by_tokens` against its definition (every index once,
longest first onto the emptiest shard, the greedy bound).
"""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st

from inflight.models import load_model
from inflight.trainer import Trainer, TrainerConfig
from inflight.trainer.distributed import DataParallelTrainer, init_data_parallel, tcp_rendezvous
from inflight.trainer.micro_batches import shard_by_tokens
from inflight.types import TrainSample
from test_trainer import make_samples

VOCAB = 2048
WORLD = 2
STEPS = 2
LR = 1e-3
COLLECTIVE_TIMEOUT_S = 60  # joining the group and each collective: a dead or hung peer fails its rank
RUN_TIMEOUT_S = 300  # the whole 2-rank run, then the test kills the ranks and fails
TIMINGS = {"train_s", "train_tokens_per_s"}

# ---- the split of a step across ranks ------------------------------------------------------------------


def test_shard_by_tokens_puts_the_longest_first_onto_the_emptiest_shard() -> None:
    # 10 -> shard 0; 9 -> 1; 8 -> 1 (9 < 10 tokens); then each 1 onto shard 0 (10, 11, 12 < 17).
    assert shard_by_tokens([10, 9, 8, 1, 1, 1], 2) == [[0, 3, 4, 5], [1, 2]]
    assert shard_by_tokens([3, 3, 3, 3], 2) == [[0, 2], [1, 3]]  # ties: the lower shard, the lower index
    assert shard_by_tokens([5], 3) == [[0], [], []]  # fewer samples than ranks: empty shares
    assert shard_by_tokens([], 2) == [[], []]
    with pytest.raises(ValueError, match="num_shards"):
        shard_by_tokens([1], 0)


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 500), max_size=40), shards=st.integers(1, 6))
def test_shard_by_tokens_places_every_index_once_deterministically_and_balanced(
    lengths: list[int], shards: int
) -> None:
    split = shard_by_tokens(lengths, shards)
    assert len(split) == shards
    assert sorted(i for shard in split for i in shard) == list(range(len(lengths)))
    assert all(shard == sorted(shard) for shard in split)
    assert split == shard_by_tokens(list(lengths), shards)
    tokens = [sum(lengths[i] for i in shard) for shard in split]
    assert max(tokens) - min(tokens) <= max(lengths, default=0)


def test_a_data_parallel_trainer_without_a_process_group_says_what_to_call() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_data_parallel"):
        DataParallelTrainer(torch.nn.Linear(2, 2), TrainerConfig())


def test_a_tcp_rendezvous_listens_on_a_port_the_os_assigned_before_any_other_rank_is_told() -> None:
    """Rank 0's store binds port 0 itself, so no other process can take the port between choosing it and
    listening on it; a rank told that port reaches the same store."""
    master = tcp_rendezvous("127.0.0.1", 0, 0, 2, timeout_s=10.0)
    assert master.port > 0
    master.set("from-rank-0", "hello")
    other = tcp_rendezvous("127.0.0.1", master.port, 1, 2, timeout_s=10.0)
    assert other.get("from-rank-0") == b"hello"
    with socket.socket() as taken, pytest.raises(OSError):
        taken.bind(("127.0.0.1", master.port))


# ---- 2 ranks against 1 ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    config: dict[str, Any] = field(default_factory=dict)
    num_samples: int = 9

    def trainer_config(self) -> TrainerConfig:
        return TrainerConfig(**{"lr": LR, **self.config})

    def batch(self, step: int) -> list[TrainSample]:
        return make_samples(self.num_samples, VOCAB, seed=100 + step)


LORA = {"lora_rank": 4, "lora_alpha": 8.0}
CASES = {
    "full-ppo-token_mean-micro": Case({"micro_batch_size": 2, "loss": {"name": "ppo"}}),
    "full-ppo-seq_mean-kl-entropy": Case(
        {"loss": {"name": "ppo", "reduction": "seq_mean", "kl_coef": 0.1, "entropy_coef": 0.01}}
    ),
    "lora-ppo-seq_mean-micro": Case({**LORA, "micro_batch_size": 2, "loss": {"reduction": "seq_mean"}}),
    "lora-is-token_sum-padded": Case(
        {**LORA, "packing": False, "loss": {"name": "importance_sampling", "reduction": "token_sum"}}
    ),
    "full-one-sample-empty-rank": Case({"loss": {"name": "ppo"}}, num_samples=1),
}


def rendezvous_at(directory: Path) -> str:
    """A file the ranks meet at: no port to pick (a free port probed here can be taken by another process
    before rank 0 listens on it)."""
    return f"file://{directory / 'rendezvous'}"


def _rank_main(rank: int, init_method: str, model_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    group = init_data_parallel(rank, WORLD, init_method, timeout_s=COLLECTIVE_TIMEOUT_S)
    out = Path(out_dir)
    for name, case in CASES.items():
        trainer = DataParallelTrainer(load_model(Path(model_dir)), case.trainer_config(), group)
        metrics = [trainer.train_step(case.batch(step)) for step in range(STEPS)]
        trainer.assert_replicas_in_sync()
        trained = [p.detach() for p in trainer.policy.parameters()]
        torch.save({"metrics": metrics, "trained": trained}, out / f"{name}.rank{rank}.pt")

    # The failures, recorded for the parent to assert on (an exception here would only say "rank failed").
    checks = {}
    trainer = DataParallelTrainer(load_model(Path(model_dir)), TrainerConfig(), group)
    try:
        trainer.forward_backward(make_samples(4, VOCAB, seed=rank))  # each rank a different step
    except RuntimeError as e:
        checks["different_steps"] = str(e)
    if rank == 1:
        with torch.no_grad():
            trainer.policy.parameters()[0].add_(1e-3)
    try:
        trainer.assert_replicas_in_sync()
    except RuntimeError as e:
        checks["out_of_sync"] = str(e)
    (out / f"checks.rank{rank}.json").write_text(json.dumps(checks))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_rank_runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every case trained by 2 gloo ranks (one spawn for all: each costs seconds of imports)."""
    out = tmp_path_factory.mktemp("data-parallel")
    context = mp.spawn(
        _rank_main, args=(rendezvous_at(out), str(tiny_model_dir), str(out)), nprocs=WORLD, join=False
    )
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not context.join(timeout=1.0):  # raises with the traceback of a rank that failed
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the data-parallel ranks were still running after {RUN_TIMEOUT_S}s: one hung")
    return out


def _without_timings(metrics: list[dict[str, float]]) -> list[dict[str, float]]:
    return [{k: v for k, v in m.items() if k not in TIMINGS} for m in metrics]


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_make_the_update_of_one_trainer_on_the_whole_batch(
    two_rank_runs: Path, tiny_model_dir: Path, name: str
) -> None:
    case = CASES[name]
    single = Trainer(load_model(tiny_model_dir), case.trainer_config())
    initial = [p.detach().clone() for p in single.policy.parameters()]
    expected = [single.train_step(case.batch(step)) for step in range(STEPS)]
    ranks = [torch.load(two_rank_runs / f"{name}.rank{r}.pt") for r in range(WORLD)]

    # Same reduced gradients, same AdamW step: the replicas are bit-for-bit equal, metrics too.
    for a, b in zip(ranks[0]["trained"], ranks[1]["trained"], strict=True):
        assert torch.equal(a, b)
    assert _without_timings(ranks[0]["metrics"]) == _without_timings(ranks[1]["metrics"])

    # ... and equal to the one trainer's, up to the order of float sums: within float rounding (1e-6)
    # almost everywhere. AdamW divides each gradient by its own root mean square, so where a gradient is
    # near zero that rounding reaches the update: a few elements may differ by up to 5% of a step (lr).
    got_N = torch.cat([t.reshape(-1) for t in ranks[0]["trained"]])
    want_N = torch.cat([p.detach().reshape(-1) for p in single.policy.parameters()])
    diff_N = (got_N - want_N).abs()
    assert float(diff_N.max()) <= 5e-2 * LR
    assert int((diff_N > 1e-6).sum()) <= 1e-4 * diff_N.numel() + 2
    moved = float((want_N - torch.cat([t.reshape(-1) for t in initial])).abs().max())
    assert moved > 0.5 * LR, "two steps must move the weights far beyond the tolerance"

    for step, (got, want) in enumerate(zip(ranks[0]["metrics"], expected, strict=True)):
        assert set(got) - {"dp_token_imbalance"} == set(want)
        for key in set(want) - TIMINGS:
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (step, key)
        assert got["dp_token_imbalance"] >= 1.0
    if case.num_samples == 1:
        assert ranks[0]["metrics"][0]["dp_token_imbalance"] == pytest.approx(2.0)  # all on one of two


def test_ranks_handed_different_steps_or_holding_different_weights_fail_loudly(two_rank_runs: Path) -> None:
    for rank in range(WORLD):
        checks = json.loads((two_rank_runs / f"checks.rank{rank}.json").read_text())
        assert "handed different steps" in checks.get("different_steps", ""), checks
        assert "hold different weights" in checks.get("out_of_sync", ""), checks


# ---- NCCL on a GPU ---------------------------------------------------------------------------------------
# One GPU holds one NCCL rank (NCCL refuses two ranks on one device), so this is the NCCL path of a
# world of one: the group joined on the CUDA backend, the gradient buckets, the step's counts and the
# merged metrics all go through NCCL collectives on `cuda`, and the update must be the plain trainer's.


def _nccl_rank_main(rank: int, init_method: str, model_dir: str, out_dir: str) -> None:
    group = init_data_parallel(rank, 1, init_method, "cuda", timeout_s=COLLECTIVE_TIMEOUT_S)
    assert dist.get_backend(group) == "nccl"
    for name, case in CASES.items():
        config = TrainerConfig(**{"lr": LR, **case.config, "device": "cuda"})
        trainer = DataParallelTrainer(load_model(Path(model_dir)), config, group)
        metrics = [trainer.train_step(case.batch(step)) for step in range(STEPS)]
        trainer.assert_replicas_in_sync()
        trained = [p.detach().cpu() for p in trainer.policy.parameters()]
        torch.save({"metrics": metrics, "trained": trained}, Path(out_dir) / f"{name}.nccl.pt")
    dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_one_nccl_rank_on_cuda_makes_the_plain_trainers_update(tiny_model_dir: Path, tmp_path: Path) -> None:
    context = mp.spawn(
        _nccl_rank_main,
        args=(rendezvous_at(tmp_path), str(tiny_model_dir), str(tmp_path)),
        nprocs=1,
        join=False,
    )
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            context.processes[0].kill()
            pytest.fail(f"the NCCL rank was still running after {RUN_TIMEOUT_S}s")
    for name, case in CASES.items():
        config = TrainerConfig(**{"lr": LR, **case.config, "device": "cuda"})
        single = Trainer(load_model(tiny_model_dir), config)
        expected = [single.train_step(case.batch(step)) for step in range(STEPS)]
        got = torch.load(tmp_path / f"{name}.nccl.pt")
        got_N = torch.cat([t.reshape(-1) for t in got["trained"]])
        want_N = torch.cat([p.detach().cpu().reshape(-1) for p in single.policy.parameters()])
        diff_N = (got_N - want_N).abs()  # CUDA's atomic adds make backward sums order-dependent
        assert float(diff_N.max()) <= 5e-2 * LR, name
        assert int((diff_N > 1e-5).sum()) <= 1e-3 * diff_N.numel() + 2, name
        for step, (g, w) in enumerate(zip(got["metrics"], expected, strict=True)):
            assert g["dp_token_imbalance"] == pytest.approx(1.0), (name, step)
            for key in set(w) - TIMINGS:
                assert g[key] == pytest.approx(w[key], rel=1e-3, abs=1e-5), (name, step, key)
