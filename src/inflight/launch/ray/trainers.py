"""Data-parallel trainer ranks: rank 0 in the run's actor (`RankedTrainer`, the trainer the run's loop
drives), the others in actors of their own (`TrainerRank`), stepping together over torch.distributed.
Knows the ranks' collectives, not where they are placed."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from inflight.config import RunConfig
from inflight.errors import UserError, describe

T = TypeVar("T")
COLLECTIVE_FAILURE_WAIT_S = 30.0  # after a collective broke here, how long the other ranks get to say why


class TrainerRank:
    """Data-parallel trainer rank k >= 1 on a bundle of its own: a `DataParallelTrainer` (or, with
    ray.trainer_sharding=fsdp, a `ShardedDataParallelTrainer`) over the run's warmed-up weights (sent by rank
    0), stepping on every batch rank 0 steps on, over its share of it."""

    def start(
        self, cfg: RunConfig, weights: dict[str, Any], rank: int, world_size: int, rendezvous: tuple[str, int]
    ) -> None:
        """Join rank 0's group at `rendezvous` (the host and port its store listens on)."""
        import torch

        from inflight.orchestrator.setup import load_policy, pad_id, run_trainer_config
        from inflight.trainer.distributed import init_data_parallel, tcp_rendezvous

        torch.set_num_threads(max(1, int(cfg.ray.trainer_cpus)))
        model, tokenizer = load_policy(cfg)
        model.load_state_dict(weights)
        config = run_trainer_config(cfg.trainer, cfg.grpo.steps)
        timeout_s = cfg.ray.trainer_collective_timeout_s
        store = tcp_rendezvous(*rendezvous, rank, world_size, timeout_s)
        group = init_data_parallel(rank, world_size, store, config.device, timeout_s)
        self.trainer = _rank_trainer(cfg, model, config, group, pad_id(tokenizer))

    def train_step(self, samples: list[Any]) -> int:
        self.trainer.train_step(samples)
        return self.trainer.version

    def resume_checkpoint(self, path: str) -> int:
        self.trainer.resume_checkpoint(path)
        return self.trainer.version

    def assert_in_sync(self) -> None:
        self.trainer.assert_replicas_in_sync()

    def join_weights(self) -> None:
        """This rank's side of rank 0's `weights()` under FSDP (the gathers of every shard)."""
        self.trainer.weights()

    def join_save(self, path: str) -> None:
        """This rank's side of rank 0's `save_checkpoint` under FSDP (gathers, then the barrier)."""
        self.trainer.save_checkpoint(path)


def _rank_trainer(cfg: RunConfig, model: Any, config: Any, group: Any, pad: int) -> Any:
    """One rank's trainer: a replica of the model (DataParallelTrainer), or its shards (FSDP2)."""
    if cfg.ray.trainer_sharding == "fsdp":
        from inflight.trainer.fsdp import ShardedDataParallelTrainer

        return ShardedDataParallelTrainer(model, config, group, pad)
    from inflight.trainer.distributed import DataParallelTrainer

    return DataParallelTrainer(model, config, group, pad)


class RankedTrainer:
    """Rank 0 of `ray.num_trainer_ranks` data-parallel ranks, in the run's actor: the trainer the run's loop
    drives (`StepTrainer`). A step goes to every rank at once (the others are `TrainerRank` actors, each
    training its share and summing gradients with the rest over torch.distributed); weights, adapters and
    checkpoints are rank 0's, the replicas being equal, or under FSDP (ray.trainer_sharding=fsdp) gathered
    from every rank's shards to rank 0, the other ranks joining each gather. A rank that dies stops the run
    in one line that says how to resume (from the last checkpoint, `checkpoint_every_steps`)."""

    def __init__(self, cfg: RunConfig, model: Any, tokenizer: object, ranks: list[Any]) -> None:
        import ray

        from inflight.orchestrator.setup import pad_id, run_trainer_config
        from inflight.trainer.distributed import init_data_parallel, tcp_rendezvous

        self._ray, self._ranks, self._run_dir = ray, ranks, cfg.run_dir
        self._sharded = cfg.ray.trainer_sharding == "fsdp"
        world_size, timeout_s = len(ranks) + 1, cfg.ray.trainer_collective_timeout_s
        # Rank 0's store listens before any other rank is told where: on a port the OS assigned it.
        host = ray.util.get_node_ip_address()
        self._store = tcp_rendezvous(host, 0, 0, world_size, timeout_s)
        weights = ray.put({name: t.detach().cpu() for name, t in model.state_dict().items()})
        # The other ranks join first (asynchronously): joining the group waits for every rank.
        rendezvous = (host, self._store.port)
        started = [
            rank.start.remote(cfg, weights, k, world_size, rendezvous) for k, rank in enumerate(ranks, 1)
        ]
        config = run_trainer_config(cfg.trainer, cfg.grpo.steps)
        group = init_data_parallel(0, world_size, self._store, config.device, timeout_s)
        self._local = _rank_trainer(cfg, model, config, group, pad_id(tokenizer))
        self._get(started)
        self.config = config
        self.version = self._local.version

    def train_step(self, samples: Any) -> dict[str, float]:
        others = [rank.train_step.remote(list(samples)) for rank in self._ranks]
        return self._with_others(others, lambda: self._local.train_step(samples))

    def weights(self) -> dict[str, Any]:
        if not self._sharded:
            return self._local.weights()
        # Sharded, the weights are gathered: every rank joins (rank 0, the writer, keeps them).
        others = [rank.join_weights.remote() for rank in self._ranks]
        return self._with_others(others, self._local.weights)

    def base_weights(self) -> dict[str, Any]:
        return self.weights() if self._sharded else self._local.base_weights()  # no LoRA when sharded

    def adapter_update(self) -> Any:
        return self._local.adapter_update()

    def save_checkpoint(self, path: str | Path, extra: dict | None = None) -> Path:
        """Rank 0 writes, once every rank showed it holds the same weights (a fingerprint all-reduce): the
        checkpoint then stands for every replica."""
        others = [rank.assert_in_sync.remote() for rank in self._ranks]
        self._with_others(others, self._local.assert_replicas_in_sync)
        if not self._sharded:
            return self._local.save_checkpoint(path, extra)
        # Sharded, the checkpoint's full tensors are gathered from every rank as rank 0 writes them.
        others = [rank.join_save.remote(str(path)) for rank in self._ranks]
        return self._with_others(others, lambda: self._local.save_checkpoint(path, extra))

    def resume_checkpoint(self, path: str | Path) -> dict[str, Any]:
        # Every rank reads it (the run directory is on storage every node can read, as the model is).
        others = [rank.resume_checkpoint.remote(str(path)) for rank in self._ranks]
        return self._with_others(others, lambda: self._local.resume_checkpoint(path))

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

    def _with_others(self, others: list[Any], local: Callable[[], T]) -> T:
        """`local()` here while `others` (calls already sent) run on the other ranks; then wait for them. A
        collective broken here is reported with the cause the other ranks give (their error, or death)."""
        try:
            result = local()
        except RuntimeError:
            self._get(others, timeout_s=COLLECTIVE_FAILURE_WAIT_S)
            raise
        self._get(others)
        self.version = self._local.version
        return result

    def _get(self, refs: list[Any], timeout_s: float | None = None) -> list[Any]:
        exceptions = self._ray.exceptions
        try:
            return list(self._ray.get(refs, timeout=timeout_s))
        except exceptions.GetTimeoutError:
            return []
        except exceptions.RayTaskError as e:
            raise RuntimeError(f"a data-parallel trainer rank failed: {e}") from None
        except exceptions.RayActorError as e:
            raise UserError(
                f"a data-parallel trainer rank died ({describe(e)}); the run stopped. Run the same command "
                f"with run_dir={self._run_dir} to resume from its last checkpoint (checkpoint_every_steps)"
            ) from None
