"""The asynchronous GRPO pipeline: generation and training overlap, every token knows its weights.

Dataflow (the engine owns a thread, rollouts share an asyncio loop, the trainer is driven by a thread and by
default steps in a process of its own, `trainer/process.py`, training the shared weights in place):

    problems ──► admission ──► rollout workers (asyncio tasks, up to max_groups_in_flight groups; or
                 buffer.admit()    │  a GroupPlayer's workers elsewhere: launch/ray/rollout_workers.py)
                                   │  play_group: task.generate_rollout(ctx, problem) x group_size (guard.py)
                                   │        │ tokens  ▲
                                   │        ▼         │
                                   │   engine loop thread: continuous batching; new weights are
                                   │   applied between two decode steps (nothing drains)
                                   ▼                            ▲
                 result stream (file log | Redis | memory)      │ weight sync (publish: version v)
                                   │ reader                     │
                                   ▼                            │
                 buffer: staleness bound, active sampling ──► trainer thread: advantages -> loss ->
                 (oldest first, every filter/drop counted)     optimizer step -> checkpoint + offsets

Lag of a token = trainer version when it is trained - version of the weights that sampled it. The
buffer admits a prompt only while the bound `max_staleness_steps` can still hold, so nothing has to
be thrown away for being stale. With the bound at 0 and active sampling off, every batch is sampled
by the weights of the step that trains on it: the sync loop's samples, step for step.

A group is admitted once and enters the buffer once: a record for a problem no longer in flight (played
twice because its worker died after writing it) is skipped and counted (`stream_duplicates`). A group
played here that active sampling would filter goes to the buffer (to be counted) and not to the stream:
nobody trains on it, and writing it and reading it back cost more than half the stream's work on BlackJack.

Resume: a checkpoint holds trainer + optimizer + step, the result stream's read offset, the buffered
groups and the problems in flight. A restart with the same run directory re-reads the stream past the
offset, re-issues the problems whose results never reached it, and goes on. Once a checkpoint is saved,
the stream is trimmed to its offset (nothing resumes from an older one), so the stream holds what came
after the latest checkpoint, not the whole run.

Shutdown order: (1) stop admitting prompts; (2) the trainer finishes its last step and writes its
checkpoint; (3) cancel the rollouts still in flight (their problems are in the checkpoint and will be
re-issued on resume); (4) stop the engine loop (aborting its requests); (5) the final checkpoint, when
the trainer's last one was not of the last step; (6) close the stream.
It begins when the trainer is done, or asked to stop (a signal: `stopping.py`; the trainer's wait for a
batch looks every second), or when every engine replica stayed down past the client's outage bound
(`ReplicasDownError`, met by a rollout or by a weight update): the run then stops with a checkpoint and one
line naming the replicas and how to resume, rather than failing rollouts until the batch wait gives up.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from inflight.buffer.buffer import RolloutBuffer
from inflight.buffer.streams import open_stream
from inflight.config import RunConfig
from inflight.errors import UserError
from inflight.inference.client import ReplicasDownError
from inflight.inference.engine_loop import EngineLoop
from inflight.metrics.logger import MetricsLogger
from inflight.metrics.progress import StepProgress
from inflight.orchestrator.drivers import Driver, SubmitDriver
from inflight.orchestrator.guard import RolloutGuard
from inflight.orchestrator.publish import publish, publish_initial
from inflight.orchestrator.remote_engine import RemoteEngines, weight_transport
from inflight.orchestrator.rollout_group import (
    GroupPlayer,
    group_record,
    is_playable,
    parse_group_record,
    play_group,
)
from inflight.orchestrator.sync_loop import LoopParts, rollout_metrics, to_train_samples
from inflight.orchestrator.task import train_problem
from inflight.trainer.lora_policy import ADAPTER_NAME
from inflight.trainer.process import TrainerProcess
from inflight.types import Completion, RolloutGroup, SampleRequest


@dataclass
class _State:
    """What the producers, the reader and the trainer share (under `lock`)."""

    next_problem: int = 0
    reissue: list[int] = field(default_factory=list)  # problems to redo first (after a resume)
    in_flight: set[int] = field(default_factory=set)  # admitted, result not yet read from the stream
    read_offset: int = -1  # the last stream record put into the buffer
    groups_dropped_errors: int = 0
    stream_duplicates: int = 0  # records of a problem no longer in flight (played twice), skipped
    resume_regenerated: int = 0  # recovered groups sampled by weights lost in a crash: problem re-issued
    stopping: bool = False
    engines_down: ReplicasDownError | None = None  # every replica down past the outage bound: the run stops
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Pipeline:
    def __init__(
        self,
        parts: LoopParts,
        cfg: RunConfig,
        logger: MetricsLogger,
        run_dir: Path,
        launcher_metrics: Callable[[], dict[str, float]] | None = None,
        players: GroupPlayer | None = None,
    ) -> None:
        self.parts, self.cfg, self.logger, self.run_dir = parts, cfg, logger, run_dir
        self.launcher_metrics = launcher_metrics
        self.players = players
        p = cfg.pipeline
        per_step = cfg.grpo.prompts_per_step
        budget = p.active_sampling_max_filtered_batches * per_step or None  # None: filter forever
        self.buffer = RolloutBuffer(per_step, p.max_staleness_steps, p.active_sampling, None, budget)
        self.state = _State()
        self.guard = RolloutGuard(cfg.rollout, per_step * cfg.grpo.group_size)
        self.start_step = self._resume()
        self.stream = open_stream(p.stream_url or f"file://{(run_dir / 'streams' / 'results').resolve()}")
        self.stream.trim(before=self.state.read_offset + 1)  # if a crash came between a save and its trim
        self._recover()  # results that reached the stream before a crash, past the checkpoint's offset
        self.loop: Any = (
            RemoteEngines(
                cfg.pipeline.engine_urls,
                run_dir / "weights",
                policy_adapter=ADAPTER_NAME if cfg.trainer.lora_rank else None,
                transport=weight_transport(p.weight_transport, p.engine_urls),
            )
            if cfg.pipeline.engine_urls
            else EngineLoop(parts.engine)
        )
        self.history: list[dict[str, float]] = []

    # -- resume and checkpoints -------------------------------------------------------------------
    def _resume(self) -> int:
        """Restore the newest complete checkpoint if there is one; returns the step to start from."""
        meta = self.parts.trainer.resume_checkpoint(self.run_dir / "checkpoint")
        if not meta:
            return 0
        saved = meta.get("pipeline")
        if saved is None:  # a sync-loop checkpoint: continue from its weights and step
            return int(meta.get("step", 0))
        self.buffer.load_state_dict(saved["buffer"])
        self.state.next_problem = int(saved["next_problem"])
        self.state.read_offset = int(saved["read_offset"])
        self.state.reissue = sorted(int(k) for k in saved["in_flight"])
        return int(meta["step"])

    def _recover(self) -> None:
        """After a crash: take the groups the stream holds past the checkpoint's offset, and re-issue
        every problem admitted before the crash whose group is not there.

        A group sampled by weights newer than the restored trainer (made after the checkpoint, then
        lost with the crash) is not trained on: its problem is re-issued, and counted.
        """
        state, version = self.state, self.parts.trainer.version
        recovered: set[int] = set()
        highest = state.next_problem - 1
        while records := self.stream.read(after=state.read_offset, max_count=1024, timeout_s=0.0):
            for offset, record in records:
                k, group = parse_group_record(record)
                state.read_offset, highest = offset, max(highest, k)
                if max((r.max_version for r in group.rollouts), default=-1) > version:
                    state.resume_regenerated += 1
                    continue
                recovered.add(k)
                self.buffer.put_recovered(group)
        lost = set(state.reissue) | set(range(state.next_problem, highest + 1))
        state.reissue = sorted(lost - recovered)
        state.next_problem = highest + 1

    def checkpoint(self, step: int) -> None:
        """Trainer + optimizer + step + stream offset + buffered groups + problems in flight, atomically."""
        state = self.state
        with state.lock:  # the reader cannot move groups from the stream into the buffer meanwhile
            read_offset = state.read_offset
            saved = {
                "buffer": self.buffer.state_dict(),
                "next_problem": state.next_problem,
                "read_offset": read_offset,
                "in_flight": sorted(state.in_flight | set(state.reissue)),
            }
        self.parts.trainer.save_checkpoint(
            self.run_dir / "checkpoint", extra={"step": step, "pipeline": saved}
        )
        # Only once the checkpoint is durable: a crash before this line resumes from the previous one, whose
        # records are all still there. A resume from this one never reads the records up to its offset.
        self.stream.trim(before=read_offset + 1)

    # -- stream -> buffer ---------------------------------------------------------------------------
    def drain(self, timeout_s: float = 0.0) -> int:
        """Move the stream's new records into the buffer; returns how many."""
        state = self.state
        records = self.stream.read(after=state.read_offset, max_count=1024, timeout_s=timeout_s)
        for offset, record in records:
            k, group = parse_group_record(record)
            with state.lock:
                state.read_offset = offset
                if k not in state.in_flight and k not in state.reissue:  # played twice: in the buffer once
                    state.stream_duplicates += 1
                    continue
                self.buffer.put(group)
                state.in_flight.discard(k)
                if k in state.reissue:  # its result reached the stream before the crash
                    state.reissue.remove(k)
        return len(records)

    # -- rollout workers ----------------------------------------------------------------------------
    async def generate(self, request: SampleRequest) -> Completion:
        try:
            return await self.loop.generate(request, self.cfg.rollout.timeout_s)
        except ReplicasDownError as e:  # recorded here: the task may catch it, and the guard counts it
            self.state.engines_down = self.state.engines_down or e
            raise

    async def rollout_group(self, k: int) -> None:
        """Problem k's group, played here or by the players, into the stream. Failed rollouts are counted
        by the guard; a cancellation (shutting down) propagates: the problem stays in flight and is
        re-issued on resume."""
        parts, problem = self.parts, train_problem(self.parts.problems, k)
        if self.players is None:
            group = await play_group(parts.task, problem, k, self.cfg, parts.chat, self.generate, self.guard)
        else:
            played = await self.players.play(k, problem)
            self.guard.absorb(played.failures)
            if played.appended:  # the worker wrote it to the stream the reader reads
                return
            group = RolloutGroup(str(k), played.rollouts)
        with self.state.lock:
            if not is_playable(group):
                self.state.groups_dropped_errors += 1
                self.state.in_flight.discard(k)
                self.buffer.cancel()
                return
            if self.buffer.put_if_filtered(group):  # uninformative: never written to the stream, nor read
                self.state.in_flight.discard(k)
                return
        self.stream.append(group_record(k, group))

    async def produce(self, stop: asyncio.Event) -> None:
        """Admit problems while the staleness bound and the in-flight limit allow; one task per group."""
        state, tasks = self.state, set()
        failed: list[BaseException] = []

        def done(task: asyncio.Task[None]) -> None:
            tasks.discard(task)
            error = None if task.cancelled() else task.exception()
            if error is not None:  # e.g. no rollout worker could play its group
                failed.append(error)

        try:
            while not stop.is_set():
                if failed:
                    raise failed[0]
                if state.engines_down is not None:  # the rollouts would only fail: the run stops (`_run`)
                    raise state.engines_down
                self.guard.check()  # too many failed rollouts: the run stops, naming the most common error
                with state.lock:
                    room = len(state.in_flight) < self.cfg.pipeline.max_groups_in_flight
                    admitted = room and self.buffer.admit(self.loop.version, self.parts.trainer.version)
                    if admitted:
                        if state.reissue:
                            k = state.reissue.pop(0)
                        else:
                            k, state.next_problem = state.next_problem, state.next_problem + 1
                        state.in_flight.add(k)
                if not admitted:
                    await asyncio.sleep(0.002)
                    continue
                task = asyncio.create_task(self.rollout_group(k))
                tasks.add(task)
                task.add_done_callback(done)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # -- trainer --------------------------------------------------------------------------------------
    def next_batch(self) -> list[RolloutGroup]:
        """The buffer's next batch; waits at most batch_timeout_s, in slices of a second so that a shutdown,
        a stop request or engines that are gone end the wait (_Stopped)."""
        timeout_s, version = self.cfg.pipeline.batch_timeout_s, self.parts.trainer.version
        deadline = time.monotonic() + timeout_s
        while not self._stop_waiting():
            try:
                return self.buffer.get_batch(version, min(1.0, deadline - time.monotonic()))
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise UserError(
                        f"no full batch within pipeline.batch_timeout_s={timeout_s:g} s: the trainer waited "
                        f"for {self.buffer.shortfall(version)}. Failed rollouts are logged above and counted "
                        "(rollout_errors); if nearly every group is filtered, the policy's rewards never "
                        "differ within a group: warm it up, or set pipeline.active_sampling=false"
                    ) from None
        raise _Stopped

    def _stop_waiting(self) -> bool:
        stop, state = self.parts.stop, self.state
        return state.stopping or state.engines_down is not None or (stop is not None and stop.is_set())

    def train(self, evaluate: Callable[[], dict[str, Any]] | None) -> None:
        cfg, trainer, loop = self.cfg, self.parts.trainer, self.loop
        title = f"{cfg.recipe} (async GRPO)"
        every = cfg.metrics.print_every_steps
        with StepProgress(cfg.grpo.steps, title, enabled=cfg.progress, every_steps=every) as progress:
            for step in range(self.start_step, cfg.grpo.steps):
                t0 = time.perf_counter()
                batch = self.next_batch()
                t_wait = time.perf_counter() - t0
                batch.sort(key=lambda g: _problem_order(g.group_id))  # the sync loop's order: same sums
                trained = [r for g in batch for r in g.rollouts]
                # Rewards and env metrics of every rollout drawn since the last step, as in the sync loop.
                metrics = rollout_metrics(self.buffer.take_drawn() or trained)
                metrics["reward_mean_batch"] = statistics.fmean(r.reward for r in trained)
                with self.state.lock:
                    metrics.update(self.buffer.step_metrics(batch, trainer.version))
                    metrics.update(self.guard.metrics())
                    metrics["groups_dropped_errors"] = float(self.state.groups_dropped_errors)
                    metrics["resume_regenerated"] = float(self.state.resume_regenerated)
                    if self.players is not None:
                        metrics["stream_duplicates"] = float(self.state.stream_duplicates)
                informative = [g for g in batch if g.is_informative]
                metrics["groups_uninformative_frac"] = 1 - len(informative) / len(batch)
                samples = to_train_samples(informative, cfg.grpo.advantage)
                if samples:
                    metrics.update(trainer.train_step(samples))
                    t1 = time.perf_counter()
                    try:
                        publish(loop, trainer)  # in flight
                    except ReplicasDownError as e:  # the step stands: a resume sends its weights first
                        self.state.engines_down = self.state.engines_down or e
                    metrics["weight_publish_s"] = time.perf_counter() - t1
                else:
                    metrics["steps_skipped"] = 1.0  # nothing informative: no update, counted
                self.buffer.step_done(trainer.version)
                step_s = time.perf_counter() - t0
                metrics.update(
                    version=float(trainer.version),
                    trainer_wait_s=t_wait,
                    trainer_idle_frac=t_wait / step_s,
                    step_s=step_s,
                    engine_idle_frac=loop.idle_s / max(loop.idle_s + loop.busy_s, 1e-9),
                )
                metrics.update(loop.metrics())  # pause per update, transfer s, stale-KV tokens (or replicas')
                if self.launcher_metrics is not None:  # e.g. engine replicas restarted (launch/ray/)
                    metrics.update(self.launcher_metrics())
                if self.players is not None:  # e.g. groups lost with a rollout worker, played again
                    metrics.update(self.players.metrics())
                self.logger.log(step, metrics)
                self.logger.log_rollout_samples(step, trained, self.parts.chat.tokenizer.decode)  # every N
                self.history.append(metrics)
                progress.update(step + 1, metrics["reward_mean"])
                if cfg.checkpoint_every_steps and (step + 1) % cfg.checkpoint_every_steps == 0:
                    self.checkpoint(step + 1)
                due = cfg.eval.every_steps and (step + 1) % cfg.eval.every_steps == 0
                if evaluate and due and self.state.engines_down is None:  # (no engines: the run stops)
                    self.logger.log(step + 1, evaluate(), phase="eval")
                if self.parts.stop is not None and self.parts.stop.is_set():
                    return  # asked to stop (a signal): the shutdown below checkpoints this step

    # -- wiring ---------------------------------------------------------------------------------------
    def run(self, evaluate: Callable[[Driver], dict[str, Any]] | None) -> list[dict[str, float]]:
        # One core each for the engine thread and the trainer (torch's pool is process-wide: a trainer thread
        # here shares it, a trainer process has its own of the same size). Restored at the end: what runs
        # after the pipeline (the final evaluation) has the cores to itself again.
        # A trainer process pinned to its CPUs (pipeline.pin_cpus) leaves the others to the engine's side:
        # this thread, and the threads it starts (the engine's, the event loop's workers), which inherit it.
        threads, cpus = torch.get_num_threads(), os.sched_getaffinity(0)
        trainer = self.parts.trainer
        engine_cpus = cpus - trainer.cpus if isinstance(trainer, TrainerProcess) and trainer.cpus else None
        torch.set_num_threads(self.cfg.pipeline.torch_threads)
        if engine_cpus:
            os.sched_setaffinity(0, engine_cpus)
        try:
            return self._run(evaluate)
        finally:
            torch.set_num_threads(threads)
            if engine_cpus:
                os.sched_setaffinity(0, cpus)

    def _run(self, evaluate: Callable[[Driver], dict[str, Any]] | None) -> list[dict[str, float]]:
        loop, trainer = self.loop, self.parts.trainer
        remote = isinstance(loop, RemoteEngines)
        if not remote:
            loop.start()
            publish(loop, trainer)
        errors: list[BaseException] = []

        def train_thread() -> None:
            try:
                self.train((lambda: evaluate(SubmitDriver(loop.submit))) if evaluate else None)
            except _Stopped:
                pass
            except BaseException as e:
                errors.append(e)

        async def main() -> None:
            if remote:  # its client lives on this event loop; the replicas get the trainer's weights first
                await loop.astart()
                await asyncio.to_thread(publish_initial, loop, trainer)
            stop = asyncio.Event()
            producer = asyncio.create_task(self.produce(stop))
            thread = threading.Thread(target=train_thread, name="trainer", daemon=True)
            thread.start()
            try:
                while thread.is_alive():
                    if producer.done():
                        errors.append(producer.exception() or RuntimeError("the producer stopped"))
                        break
                    if not await asyncio.to_thread(self.drain, 0.05):
                        await asyncio.sleep(0.001)
            finally:
                self.state.stopping = True
                stop.set()  # (1) no more admissions
                await asyncio.to_thread(thread.join)  # (2) the trainer's last step and checkpoint
                (outcome,) = await asyncio.gather(producer, return_exceptions=True)  # (3) cancel the rollouts
                if isinstance(outcome, BaseException) and outcome not in errors:
                    errors.append(outcome)
                if remote:
                    await loop.aclose()  # (4) the replicas keep running: they are not ours to stop

        try:
            try:
                asyncio.run(main())
            finally:
                if not remote:
                    loop.stop()  # (4)
            down = self.state.engines_down
            failures = [e for e in errors if e is not down]  # the producer raises it to end the run: below
            if failures:
                raise failures[0]
            done = len(self.history) + self.start_step
            if not self.cfg.checkpoint_every_steps or done % self.cfg.checkpoint_every_steps:
                self.checkpoint(done)  # (5)
        finally:
            self.stream.close()  # (6): after the final checkpoint, which trims it
        if down is not None:
            replicas = ", ".join(f"{url} ({error})" for url, error in down.down.items())
            raise UserError(
                f"every engine replica stayed down for {down.waited_s:g} s (the engine client's "
                f"outage_wait_s): {replicas}. The run stopped after step {done} and saved its checkpoint: "
                "start the engine(s) again at the same URL(s) (pipeline.engine_urls), then run the same "
                f"command with run_dir={self.run_dir} to resume"
            )
        return self.history


class _Stopped(Exception):
    pass


def _problem_order(group_id: str) -> tuple[Any, ...]:
    """Sort key of group ids: the problem index k ("7"), or "12-345" in streams of older runs; numbers
    compared as numbers."""
    try:
        return (0, *(int(x) for x in group_id.split("-")))
    except ValueError:
        return (1, group_id)


def run_pipeline(
    parts: LoopParts,
    cfg: RunConfig,
    logger: MetricsLogger,
    run_dir: str | Path,
    evaluate: Callable[[Driver], dict[str, Any]] | None = None,
    launcher_metrics: Callable[[], dict[str, float]] | None = None,
    players: GroupPlayer | None = None,
) -> list[dict[str, float]]:
    """Train up to cfg.grpo.steps steps (continuing a checkpoint in run_dir); returns this run's metrics.

    `evaluate(driver)` (the held-out evaluation) gets a driver into the engine loop (or the replicas),
    from the trainer's thread while the pipeline runs; its row (`run.eval_row`) is logged as phase=eval.
    `launcher_metrics()`: what the launcher counts (replica restarts, say), logged with every step.
    `players`: where the groups are played, when not on this process's event loop (a launcher's rollout
    workers).
    """
    return _Pipeline(parts, cfg, logger, Path(run_dir), launcher_metrics, players).run(evaluate)
