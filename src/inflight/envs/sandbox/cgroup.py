"""Job cgroups: one per sandboxed run, holding all of its processes under one memory and process limit.

Owns finding where this process may create cgroups (v2 with the memory and pids controllers enabled
for its children, else v1's memory hierarchy, with pids and cpuacct where they exist), making one
group per job, reading what the job used, and removing the group. Knows nothing of Python, uids or
namespaces: the job joins its groups itself, by writing 0 to each of `procs_files` before it execs.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import itertools
import logging
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

log = logging.getLogger(__name__)

CgroupVersion = Literal["cgroup2", "cgroup1"]
GROUP_PREFIX = "inflight-sandbox-"
EMPTY_WAIT_S = 2.0  # after SIGKILL, how long to wait for the job's processes to leave before rmdir
_names = itertools.count()


@dataclass(frozen=True)
class CgroupLayout:
    """The directories job groups are created in: our own cgroup in each hierarchy used."""

    version: CgroupVersion
    memory: Path
    pids: Path | None  # cgroup1 without a pids hierarchy: processes are capped by RLIMIT_NPROC only
    cpu: Path | None  # cgroup1 cpuacct, or the same directory as `memory` on cgroup2


@dataclass(frozen=True)
class JobUsage:
    """What a job used, read after it ended. None where the layout cannot tell."""

    oom_kills: int  # processes of the job the kernel killed for memory
    cpu_s: float | None  # CPU time of all its processes together
    memory_peak_bytes: int | None  # its highest memory use, all processes together


@functools.cache
def cgroup_layout() -> CgroupLayout | str:
    """Where job groups can be made here (probed once), or why they cannot."""
    mounts = _cgroup_mounts()
    problems = []
    for find in (_v2_layout, _v1_layout):
        try:
            layout = find(mounts)
            _probe(layout)
            return layout
        except OSError as e:
            problems.append(str(e))
    return "; ".join(problems)


class JobCgroup:
    """One job's groups, created with its limits; the job's first process joins by `procs_files`."""

    def __init__(self, layout: CgroupLayout, *, memory_bytes: int, max_tasks: int) -> None:
        self.layout = layout
        name = f"{GROUP_PREFIX}{os.getpid()}-{next(_names)}"
        parents = dict.fromkeys(p for p in (layout.memory, layout.pids, layout.cpu) if p is not None)
        self.dirs = [parent / name for parent in parents]
        self._memory = layout.memory / name
        self._pids = layout.pids / name if layout.pids else None
        self._cpu = layout.cpu / name if layout.cpu else None
        try:
            for path in self.dirs:
                path.mkdir()
            _write_limits(layout.version, self._memory, self._pids, memory_bytes, max_tasks)
        except OSError:
            self.remove()
            raise

    @property
    def procs_files(self) -> list[str]:
        return [str(path / "cgroup.procs") for path in self.dirs]

    def kill(self) -> None:
        """SIGKILL every process in the job, including any that left the runner's process group."""
        kill_file = self._memory / "cgroup.kill"  # cgroup2, Linux >= 5.14: atomic against forks
        if self.layout.version == "cgroup2" and kill_file.exists():
            with contextlib.suppress(OSError):
                kill_file.write_text("1")
            return
        for pid in {pid for path in self.dirs for pid in _pids_in(path)}:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def usage(self) -> JobUsage:
        if self.layout.version == "cgroup2":
            events = _keyed(self._memory / "memory.events")
            peak = _read_int(self._memory / "memory.peak")  # Linux >= 5.19
            cpu_us = _keyed(self._memory / "cpu.stat").get("usage_usec")
            cpu_s = cpu_us / 1e6 if cpu_us is not None else None
        else:
            events = _keyed(self._memory / "memory.oom_control")
            peak = _read_int(self._memory / "memory.max_usage_in_bytes")
            cpu_ns = _read_int(self._cpu / "cpuacct.usage") if self._cpu else None
            cpu_s = cpu_ns / 1e9 if cpu_ns is not None else None
        return JobUsage(oom_kills=events.get("oom_kill", 0), cpu_s=cpu_s, memory_peak_bytes=peak)

    def remove(self) -> None:
        """Kill what is left of the job and delete its groups; one still busy after EMPTY_WAIT_S is
        left in place and logged."""
        deadline = time.monotonic() + EMPTY_WAIT_S
        pending = list(self.dirs)
        while True:
            if any(_pids_in(path) for path in pending):
                self.kill()
            else:  # rmdir can still find a group busy while its last processes finish exiting
                pending = [path for path in pending if not _removed(path)]
                if not pending:
                    return
            if time.monotonic() >= deadline:
                log.warning("sandbox cgroups still busy %g s after the job: %s", EMPTY_WAIT_S, pending)
                return
            time.sleep(0.005)


@contextlib.contextmanager
def job_cgroup(layout: CgroupLayout, *, memory_bytes: int, max_tasks: int) -> Iterator[JobCgroup]:
    group = JobCgroup(layout, memory_bytes=memory_bytes, max_tasks=max_tasks)
    try:
        yield group
    finally:
        group.remove()


def _write_limits(
    version: CgroupVersion, memory: Path, pids: Path | None, memory_bytes: int, max_tasks: int
) -> None:
    if version == "cgroup2":
        (memory / "memory.max").write_text(str(memory_bytes))
        if (memory / "memory.swap.max").exists():  # otherwise swap is not accounted, or there is none
            (memory / "memory.swap.max").write_text("0")
    else:
        (memory / "memory.limit_in_bytes").write_text(str(memory_bytes))
        if (memory / "memory.memsw.limit_in_bytes").exists():  # memory + swap; must come second
            (memory / "memory.memsw.limit_in_bytes").write_text(str(memory_bytes))
    if pids is not None:
        (pids / "pids.max").write_text(str(max_tasks))


def _v2_layout(mounts: dict[str, Path]) -> CgroupLayout:
    if "cgroup2" not in mounts:
        raise OSError("cgroup2 is not mounted")
    ours = mounts["cgroup2"]
    control = ours / "cgroup.subtree_control"
    if not {"memory", "pids"} <= set(control.read_text().split()):
        try:  # succeeds only where our cgroup holds no processes itself (e.g. the root cgroup)
            control.write_text("+memory +pids")
        except OSError as e:
            available = (ours / "cgroup.controllers").read_text().split()
            raise OSError(
                f"cgroup2 at {ours} does not give memory and pids to child groups (available: "
                f"{' '.join(available) or 'none'}; enabling them failed: {e.strerror})"
            ) from None
    return CgroupLayout("cgroup2", memory=ours, pids=ours, cpu=ours)


def _v1_layout(mounts: dict[str, Path]) -> CgroupLayout:
    if "memory" not in mounts:
        raise OSError("no cgroup1 memory hierarchy is mounted")
    return CgroupLayout(
        "cgroup1", memory=mounts["memory"], pids=mounts.get("pids"), cpu=mounts.get("cpuacct")
    )


def _probe(layout: CgroupLayout) -> None:
    """Raises OSError unless a job group can be created, limited and removed here."""
    group = JobCgroup(layout, memory_bytes=64 << 20, max_tasks=8)
    group.remove()
    if any(path.exists() for path in group.dirs):
        raise OSError(f"a probe cgroup under {layout.memory} could not be removed")


def _cgroup_mounts() -> dict[str, Path]:
    """Our own cgroup's directory per hierarchy: "cgroup2", and each cgroup1 controller by name."""
    ours: dict[str, str] = {}  # hierarchy key -> our path in it, from /proc/self/cgroup
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, our_path = line.split(":", 2)
        for key in controllers.split(",") if controllers else ["cgroup2"]:
            ours[key] = our_path
    found: dict[str, Path] = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields, _, tail = line.partition(" - ")
        root, mount_point = fields.split()[3:5]
        fstype, _, super_options = tail.split()[:3]
        keys = ["cgroup2"] if fstype == "cgroup2" else super_options.split(",") if fstype == "cgroup" else []
        for key in keys:
            path = ours.get(key)
            if key in found or path is None or not (path + "/").startswith(root.rstrip("/") + "/"):
                continue  # not our hierarchy, or a mount of a subtree we are not in
            found[key] = Path(mount_point) / path[len(root.rstrip("/")) :].lstrip("/")
    return found


def _pids_in(group: Path) -> list[int]:
    try:
        return [int(pid) for pid in (group / "cgroup.procs").read_text().split()]
    except FileNotFoundError:
        return []


def _removed(path: Path) -> bool:
    """rmdir `path`: True once it is gone (or cannot be removed at all, which is logged)."""
    try:
        path.rmdir()
    except FileNotFoundError:
        pass
    except OSError as e:
        if e.errno == errno.EBUSY:
            return False
        log.warning("could not remove the sandbox cgroup %s: %s", path, e)
    return True


def _keyed(path: Path) -> dict[str, int]:
    """A flat-keyed cgroup file (`key value` lines) as a dict; empty if the file does not exist."""
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return {}
    pairs = (line.split() for line in lines)
    return {p[0]: int(p[1]) for p in pairs if len(p) == 2 and p[1].lstrip("-").isdigit()}


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text())
    except (FileNotFoundError, ValueError):
        return None
