"""A Trainer in a process of its own: the pipeline's trainer with its own interpreter, GIL and core.

Why: in one process the pipeline's engine thread, its rollouts' event loop and its trainer thread take
turns on one GIL, and on a 2-core machine the trainer then stepped ~1.3x slower than alone on one core
(0.158 s against 0.119 s on `inflight bench pipeline`'s BlackJack batch, docs/benchmarks.md). Here the
trainer steps in a child process while this process keeps the engine and the rollouts.

The child is forked from multiprocessing's fork server, never from this process (forking a process that
runs OpenMP threads is unsafe): a clean interpreter, started once per process, that imports torch, this
module and the model's family before it forks anything. Spawning an interpreter for each child cost ~7 s
of imports on a 2-core EPYC; a second run in one process (a benchmark's, a sweep's, a notebook's) now
starts its trainer in ~0.2 s. The child gets this process's working directory and environment as they
are when it starts, as a spawned one did, not the fork server's.

The weights are not copied between the two: the model's tensors are moved into shared memory before the
child starts, and the child trains that very storage in place. The parent reads them (`weights()`) only
between steps, while the child waits for its next batch, so the engine never copies a half-updated model.
Everything else (the optimizer's moments, the KL reference, a LoRA adapter) lives in the child, and the
calls that need it (`adapter_update`, checkpoints) travel over a pipe. A child that dies or fails is
reported in one line with its exit code or its error; no wait is unbounded.

`TrainerProcess` has the `Trainer` methods the loops use (`StepTrainer`); `pipeline.trainer_process` chooses
it (config.py).
"""

from __future__ import annotations

import contextlib
import multiprocessing.connection
import multiprocessing.resource_tracker
import multiprocessing.util
import os
import signal
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.multiprocessing as mp

from inflight.errors import UserError
from inflight.gc_tuning import freeze_long_lived
from inflight.trainer.config import TrainerConfig
from inflight.trainer.trainer import Trainer
from inflight.types import AdapterUpdate, TrainSample

# What the parent may ask of the child's Trainer (anything else is refused, never getattr'd blindly).
_CALLS = frozenset(
    {"train_step", "weights", "base_weights", "adapter_update", "save_checkpoint", "resume_checkpoint"}
)
_START_TIMEOUT_S = 300.0  # the fork server's start and imports, the first time (seconds on a quiet machine)
_POLL_S = 0.5  # how often a wait checks that the child is still alive
# A stop asked of the run: Ctrl-C, and SIGTERM from `timeout`, Slurm's scancel or `kill -- -PGID`, reach the
# whole process group. The parent coordinates the stop (orchestrator/stopping.py), whose last checkpoint is
# a call to this child; signalled too, the child would die first. The child ends when the parent asks or
# when the pipe's other end closes (the parent died).
_GROUP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


SHARED_MEMORY_DIR = "/dev/shm"  # where torch's file_descriptor strategy puts shared tensors on Linux


def shared_memory_shortfall(model: torch.nn.Module, directory: str = SHARED_MEMORY_DIR) -> str | None:
    """Why `model`'s tensors cannot move to shared memory here, or None when they can: a container's
    /dev/shm is often 64 MB (Docker's default), smaller than a model, and a write past it kills the run
    with a bus error instead of an exception."""
    needed = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    try:
        stat = os.statvfs(directory)
    except OSError:
        return f"{directory} is not there to hold the shared weights"
    free = stat.f_bavail * stat.f_frsize
    if free < needed * 1.25:  # headroom for the pieces torch allocates beside the tensors
        return (
            f"{directory} has {free / 2**20:.0f} MiB free, the model's weights need {needed / 2**20:.0f} MiB "
            "(a container's default is 64 MiB: `docker run --shm-size=...`)"
        )
    return None


class StepTrainer(Protocol):
    """What the training loops and `orchestrator/publish.py` ask of a trainer, in this process or not."""

    config: TrainerConfig
    version: int

    def train_step(self, samples: Sequence[TrainSample]) -> dict[str, float]: ...

    def weights(self) -> dict[str, torch.Tensor]: ...

    def base_weights(self) -> dict[str, torch.Tensor]: ...

    def adapter_update(self) -> AdapterUpdate: ...

    def save_checkpoint(self, path: str | Path, extra: dict | None = None) -> Path: ...

    def resume_checkpoint(self, path: str | Path) -> dict[str, Any]: ...


class TrainerProcessError(RuntimeError):
    """The child failed a call (its traceback is in the message) or died."""


class TrainerProcess:
    """`Trainer(model, config, pad_id)` run in a child process; see the module docstring.

    `model` stays usable here and always holds the trainer's current weights between two calls; under
    LoRA the child wraps its own view of the layers, so here the model keeps the frozen base. `threads`:
    the child's torch threads; `cpus`: the CPUs the child is pinned to (None: wherever the OS puts it).
    Close it (or use it as a context manager) to stop the child.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: TrainerConfig,
        pad_id: int = 0,
        threads: int = 1,
        cpus: frozenset[int] | None = None,
    ) -> None:
        if any(p.device.type != "cpu" for p in model.parameters()):
            raise UserError(
                "pipeline.trainer_process shares CPU memory: set it to false to train a model on a GPU"
            )
        self.config = config
        self.version = 0
        self.cpus = cpus
        self._model = model
        model.share_memory()  # the child's parameters are these tensors, not a copy
        context = mp.get_context("forkserver")
        # What the fork server imports once, before its first fork (used only when it starts: the first
        # TrainerProcess of this process starts it, below, inside the blocked signals).
        context.set_forkserver_preload([__name__, type(model).__module__])
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(
            target=_serve,
            args=(model, config, pad_id, threads, cpus, dict(os.environ), child_conn),
            name="inflight-trainer",
            daemon=True,
        )
        # Blocked from the fork until the child ignores them (`_serve`): a stop during the child's start
        # cannot kill it; this process takes the signal when it unblocks it here, the child drops it
        # (multiprocessing starts its resource tracker so). The fork server, started here the first time,
        # keeps them blocked for good (the mask outlives exec) and ends with this process; its children
        # inherit the mask. The tracker first: starting it unblocks both signals outright instead of
        # restoring the mask.
        multiprocessing.resource_tracker.ensure_running()
        unblocked = signal.pthread_sigmask(signal.SIG_BLOCK, _GROUP_SIGNALS)
        try:
            self._process.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)
        child_conn.close()
        # At exit, before multiprocessing's own clean-up: its terminate() (a SIGTERM) no longer ends the
        # child, and its join() would then wait on a child that waits on this process's pipe.
        self._stop = multiprocessing.util.Finalize(
            self, _stop_child, args=(self._process, self._conn), exitpriority=0
        )
        try:
            self._wait("start", _START_TIMEOUT_S)
        except BaseException:  # the Trainer could not be built there (its error is raised): no child left
            self.close()
            raise

    @property
    def pid(self) -> int | None:
        return self._process.pid

    # -- the Trainer's methods ----------------------------------------------------------------------------
    def train_step(self, samples: Sequence[TrainSample]) -> dict[str, float]:
        metrics, self.version = self._call("train_step", list(samples))
        return metrics

    def weights(self) -> dict[str, torch.Tensor]:
        """The current full weights by Hugging Face name. Full-parameter training: the shared tensors
        themselves (no copy; valid until the next `train_step`); LoRA: the merged weights, computed there."""
        if self.config.lora_rank:
            return self._call("weights")[0]
        return {name: t.detach() for name, t in self._model.state_dict().items()}

    def base_weights(self) -> dict[str, torch.Tensor]:
        return self._call("base_weights")[0]

    def adapter_update(self) -> AdapterUpdate:
        return self._call("adapter_update")[0]

    def save_checkpoint(self, path: str | Path, extra: dict | None = None) -> Path:
        # Absolute here: this process's working directory may have changed since the child started.
        return self._call("save_checkpoint", Path(path).absolute(), extra)[0]

    def resume_checkpoint(self, path: str | Path) -> dict[str, Any]:
        meta, self.version = self._call("resume_checkpoint", Path(path).absolute())
        return meta

    # -- the pipe -----------------------------------------------------------------------------------------
    def _call(self, name: str, *args: Any) -> tuple[Any, int]:
        """(the child's return value, its trainer's version after the call)."""
        if not self._process.is_alive():
            raise TrainerProcessError(self._died(name, "before"))
        self._conn.send((name, args))
        return self._wait(name, None)

    def _wait(self, name: str, timeout_s: float | None) -> Any:
        """The child's answer to `name`. A training step has no deadline of its own (the pipeline's own
        bounds apply), but a dead child is noticed within _POLL_S."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._conn.poll(_POLL_S):
            if not self._process.is_alive():
                raise TrainerProcessError(self._died(name, "during"))
            if deadline is not None and time.monotonic() > deadline:
                self.close()
                raise TrainerProcessError(
                    f"the trainer process did not answer `{name}` within {timeout_s:.0f} s"
                )
        try:
            ok, value = self._conn.recv()
        except (EOFError, OSError):
            raise TrainerProcessError(self._died(name, "during")) from None
        if not ok:
            if isinstance(value, UserError):
                raise value
            raise TrainerProcessError(f"the trainer process failed `{name}`:\n{value}")
        return value

    def _died(self, call: str, when: str) -> str:
        self._process.join(timeout=1.0)
        code = self._process.exitcode
        why = (
            _unguarded_main_hint()
            if call == "start" and code == 1
            else "a negative code is the signal that killed it: -9 is often the kernel's out-of-memory killer"
        )
        pid = self._process.pid
        return f"the trainer process (pid {pid}) died {when} `{call}` with exit code {code} ({why})"

    def close(self) -> None:
        """Stop the child (it finishes the call it is in, if any, within a few seconds, or is killed)."""
        self._stop()

    def __enter__(self) -> TrainerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _unguarded_main_hint() -> str:
    """A child that exits with code 1 as it starts failed before `_serve` could report anything: its
    traceback is on stderr. The usual cause is Python's, and it has one fix: the fork server's child
    imports this program's main module again first, so a script whose top level starts a run starts one
    more there, which multiprocessing refuses ("bootstrapping phase")."""
    script = getattr(sys.modules.get("__main__"), "__file__", None)
    where = f" ({script})" if script else ""
    return (
        "its error is on stderr above; if it names multiprocessing's bootstrapping phase, the child imported "
        f"this program's main module{where} again and it started one more run there: keep a script's "
        'top-level code under `if __name__ == "__main__":`'
    )


def _stop_child(
    process: multiprocessing.process.BaseProcess, conn: multiprocessing.connection.Connection
) -> None:
    """`TrainerProcess.close`, without the object: also what runs at exit for one never closed."""
    if process.is_alive():
        with contextlib.suppress(OSError):
            conn.send(None)
        process.join(timeout=5.0)
        if process.is_alive():
            process.kill()  # SIGKILL: the child ignores SIGTERM
            process.join(timeout=5.0)
    conn.close()


def _serve(
    model: torch.nn.Module,
    config: TrainerConfig,
    pad_id: int,
    threads: int,
    cpus: frozenset[int] | None,
    environ: dict[str, str],
    conn: multiprocessing.connection.Connection,
) -> None:
    """The child: build the Trainer over the shared model, then answer calls until told to stop.
    `environ`: the parent's environment at the start (the fork server's is as old as the server)."""
    for signum in _GROUP_SIGNALS:  # the parent stops this child (see _GROUP_SIGNALS)
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _GROUP_SIGNALS)  # blocked since the fork: pending ones drop
    os.environ.clear()
    os.environ.update(environ)
    try:
        if cpus is not None:
            os.sched_setaffinity(0, cpus)  # before torch's threads start: they inherit it
        torch.set_num_threads(threads)
        trainer = Trainer(model, config, pad_id=pad_id)
    except BaseException as e:
        conn.send(_failure(e))
        return
    conn.send((True, None))
    freeze_long_lived()  # this process lives as long as the trainer (gc_tuning.py)
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        if message is None:
            return
        name, args = message
        try:
            if name not in _CALLS:
                raise ValueError(f"unknown call {name!r}")
            answer: tuple[bool, Any] = (True, (getattr(trainer, name)(*args), trainer.version))
        except BaseException as e:
            answer = _failure(e)
        try:
            conn.send(answer)
        except OSError:  # the parent died during the call
            return


def _failure(error: BaseException) -> tuple[bool, str | UserError]:
    """What the parent raises: a UserError as it is (its one line names the problem and the fix), anything
    else with the child's traceback."""
    return (False, error) if isinstance(error, UserError) else (False, traceback.format_exc())
