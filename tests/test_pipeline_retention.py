"""Retention of the result stream: the pipeline trims the stream to the offset of each checkpoint once it is
saved, and a resume after that (or after a crash during the save, right before the trim, right after it,
or between two checkpoints) gets exactly what a run that never trims gets; the file log stays bounded over
many checkpoints.

Reference: a run with `trim` made a no-op (every record kept, the behaviour before retention), played the
same way and killed at the same point. The pipeline's own resume path runs (`_Pipeline.__init__`,
`checkpoint`, `drain`) on every backend (memory, file log, a real `redis-server`); the producer and the
trainer are hand-written fakes: `Run` admits problems and writes their groups as `produce` and
`rollout_group` do, and the trainer counts versions and writes its checkpoint as one JSON file, durable
once `save_checkpoint` returns (as `trainer/checkpoint.py`'s is).
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from inflight.buffer import TrimmedError, encode_group
from inflight.buffer.file_stream import FileStream
from inflight.buffer.memory_stream import MemoryStream, drop_memory_stream
from inflight.buffer.redis_stream import RedisStream
from inflight.config import RunConfig
from inflight.orchestrator.pipeline import _Pipeline
from inflight.orchestrator.rollout_group import group_record
from inflight.orchestrator.sync_loop import LoopParts
from inflight.types import Rollout, RolloutGroup

PER_STEP = 2  # groups a step trains on
CHECKPOINT_EVERY = 2  # steps
CRASH_STEP = 5  # after the checkpoints of steps 2 and 4; the one of step 6 is written at its end


class Crash(Exception):
    """Where the test kills the run: what was written stays, nothing else happens."""


class FakeTrainer:
    def __init__(self) -> None:
        self.version = 0
        self.crash_in_save = False

    def save_checkpoint(self, path: str | Path, extra: dict | None = None) -> Path:
        if self.crash_in_save:
            raise Crash
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        tmp = path / "state.json.tmp"
        tmp.write_text(json.dumps({"version": self.version, **(extra or {})}))
        os.replace(tmp, path / "state.json")
        return path

    def resume_checkpoint(self, path: str | Path) -> dict[str, Any]:
        try:
            meta = json.loads((Path(path) / "state.json").read_text())
        except FileNotFoundError:
            return {}
        self.version = int(meta["version"])
        return meta


def make_group(k: int, version: int) -> RolloutGroup:
    """Problem k's group, sampled at `version`; rewards differ (a group with signal)."""
    rollouts = [
        Rollout([k, k + 1, i], [False, True, True], [0.0, -0.5, -0.25 * i], [-1, version, version], i + k % 3)
        for i in range(2)
    ]
    for r in rollouts:
        r.group_id = str(k)
    return RolloutGroup(str(k), rollouts)


class Run:
    """One process of a pipeline run, driven step by step as its producer, reader and trainer would."""

    def __init__(self, run_dir: Path, stream_url: str) -> None:
        cfg = RunConfig()
        cfg.grpo.prompts_per_step, cfg.grpo.group_size = PER_STEP, 2
        cfg.pipeline.max_staleness_steps = None
        cfg.pipeline.active_sampling = False
        cfg.pipeline.stream_url = stream_url
        self.trainer = FakeTrainer()
        parts = LoopParts(None, self.trainer, None, None, None)  # type: ignore[arg-type]
        self.pipe = _Pipeline(parts, cfg, None, run_dir)  # type: ignore[arg-type]
        self.pending: list[tuple[int, int]] = []  # admitted, group not written yet: (problem, version)

    def admit(self) -> None:
        """One more problem starts, as `_Pipeline.produce` admits it (re-issued ones first)."""
        state = self.pipe.state
        with state.lock:
            assert self.pipe.buffer.admit(self.trainer.version, self.trainer.version)
            if state.reissue:
                k = state.reissue.pop(0)
            else:
                k, state.next_problem = state.next_problem, state.next_problem + 1
            state.in_flight.add(k)
        self.pending.append((k, self.trainer.version))

    def play(self, steps: range, crash: str | None = None, late: bool = False) -> list[list[bytes]]:
        """Each step: the next step's problems start, the oldest groups reach the stream, the reader moves
        them into the buffer, the trainer takes a batch; a checkpoint every CHECKPOINT_EVERY steps. Returns
        the batches (encoded groups). `crash` raises Crash at that point of step CRASH_STEP. `late`: before
        each checkpoint one more group reaches the stream after the reader's last look (past its offset)."""
        batches = []
        for step in steps:
            crash_here = crash if step == CRASH_STEP else None
            for _ in range(PER_STEP):
                self.admit()
            for k, version in self.pending[:PER_STEP]:
                self.pipe.stream.append(group_record(k, make_group(k, version)))
            del self.pending[:PER_STEP]
            if crash_here == "after_write":
                raise Crash
            self.pipe.drain()
            if crash_here == "after_drain":
                raise Crash
            batches.append([encode_group(g) for g in self.pipe.buffer.get_batch(self.trainer.version, 0.0)])
            self.trainer.version += 1
            self.pipe.buffer.step_done(self.trainer.version)
            if (step + 1) % CHECKPOINT_EVERY == 0:
                if late:
                    self.admit()
                    k, version = self.pending.pop()
                    self.pipe.stream.append(group_record(k, make_group(k, version)))
                self.trainer.crash_in_save = crash_here == "during_save"
                if crash_here == "before_trim":
                    self.pipe.stream.trim = _crash  # type: ignore[method-assign]
                self.pipe.checkpoint(step + 1)
                if crash_here == "after_trim":
                    raise Crash
        return batches

    def checkpoint_offset(self) -> int:
        """The stream offset in the checkpoint on disk."""
        meta = json.loads((self.pipe.run_dir / "checkpoint" / "state.json").read_text())
        return int(meta["pipeline"]["read_offset"])


def _crash(before: int) -> None:
    raise Crash


@pytest.fixture(params=["memory", "file", "redis"])
def new_stream_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[], str]]:
    """Makes URLs of fresh streams of one backend. The file log's segments hold one record each here, so
    that a trim drops exactly the records before its offset on every backend."""
    names: list[str] = []
    port = request.getfixturevalue("redis_port") if request.param == "redis" else None

    def new() -> str:
        names.append(f"t{uuid.uuid4().hex[:12]}")
        if request.param == "memory":
            return f"memory://{names[-1]}"
        if request.param == "file":
            return f"file://{tmp_path / names[-1]}?fsync=never&segment_bytes=1"
        return f"redis://127.0.0.1:{port}/0?key={names[-1]}"

    yield new
    for name in names:
        drop_memory_stream(name)


def _keep_everything(stream: Any, before: int) -> None:
    pass


@pytest.mark.parametrize("crash", ["after_write", "after_drain", "during_save", "before_trim", "after_trim"])
def test_a_resume_after_trims_gets_what_a_run_without_them_gets(
    new_stream_url: Callable[[], str], crash: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    outcomes = {}
    for retention in (False, True):
        url, run_dir = new_stream_url(), tmp_path / f"retention-{retention}"
        with monkeypatch.context() as patch:
            if not retention:
                for backend in (MemoryStream, FileStream, RedisStream):
                    patch.setattr(backend, "trim", _keep_everything)
            run = Run(run_dir, url)
            for _ in range(PER_STEP):  # the first step's problems
                run.admit()
            with pytest.raises(Crash):
                run.play(range(10), crash)
            run.pipe.stream.close()  # writes nothing more (fsync=never): the stream is as the kill left it

            resumed = Run(run_dir, url)
            stream, state = resumed.pipe.stream, resumed.pipe.state
            if retention:  # up to the offset of the checkpoint it resumed from (a crash before the trim too)
                with pytest.raises(TrimmedError):
                    stream.read(resumed.checkpoint_offset() - 1, 1, 0.0)
            outcomes[retention] = {
                "step": resumed.pipe.start_step,
                "next_problem": state.next_problem,
                "reissue": list(state.reissue),
                "read_offset": state.read_offset,
                "resume_regenerated": state.resume_regenerated,
                "buffer": resumed.pipe.buffer.state_dict(),
                "batches": resumed.play(range(resumed.pipe.start_step, resumed.pipe.start_step + 3)),
            }
            saved_offset = resumed.checkpoint_offset()  # of the checkpoint the resumed run wrote
            if retention:  # the records up to its offset are gone
                with pytest.raises(TrimmedError):
                    stream.read(saved_offset - 1, 1, 0.0)
            else:
                assert stream.read(-1, 1, 0.0)
            after = [offset for offset, _ in stream.read(saved_offset, 1000, 0.0)]
            assert after == list(range(saved_offset + 1, state.read_offset + 1))  # and those after, all there
            stream.close()
    # The resume re-reads the records past the checkpoint (a crash before its trim: the older checkpoint's)
    assert outcomes[True]["read_offset"] > 0
    assert outcomes[True] == outcomes[False]


def test_the_file_stream_on_disk_stays_bounded_over_many_checkpoints(tmp_path: Path) -> None:
    segment_bytes = 4096
    stream_dir = tmp_path / "stream"
    run = Run(tmp_path / "run", f"file://{stream_dir}?fsync=never&segment_bytes={segment_bytes}")
    for _ in range(PER_STEP):
        run.admit()
    record_bytes = 8 + len(group_record(99_999, make_group(99_999, 99_999)))  # at most
    sizes = []
    for step in range(0, 400, CHECKPOINT_EVERY):  # 200 checkpoints, 1000 groups
        run.play(range(step, step + CHECKPOINT_EVERY), late=True)
        sizes.append(sum(p.stat().st_size for p in stream_dir.glob("records-*.log")))
    run.pipe.stream.close()
    # After each checkpoint: the group it had not read, and less than one segment before it.
    assert max(sizes) <= segment_bytes + record_bytes
    smallest = 8 + len(group_record(0, make_group(0, 0)))
    assert (run.pipe.state.read_offset + 1) * smallest > 20 * max(sizes)  # what it would hold without trims
