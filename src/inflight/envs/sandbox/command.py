"""The command lines that enforce SandboxLimits: job cgroup, namespaces, seccomp, throwaway uid, rlimits.

Owns argv and environment construction as pure functions of their inputs; starts no process (the
runner does). Layering, outermost first:

    sh (joins the job's cgroups, so everything below is in them; when the job has a cgroup)
      -> bwrap --seccomp FD (namespaces, mounts, the seccomp filter; bwrap mode)
         | python -c LOADER_CODE FD (the seccomp filter; rlimit mode)
        -> setpriv (drop to a throwaway uid, no new privileges; when the host runs as root)
          -> prlimit (RLIMIT_CPU/AS/NPROC/FSIZE/CORE)
            -> python -I -S -B -c CODE

Why a throwaway uid: RLIMIT_NPROC counts processes per real uid and is not enforced for root, and a
process may signal every process of its own uid (`kill -9 -1`). A uid used by nothing else makes the
process limit hold and confines signals to the sandbox. Why bwrap without a user namespace when root:
`--unshare-user` would map the sandbox's uid back to host root, which again exempts it from NPROC.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import PurePosixPath

from inflight.envs.sandbox.limits import SandboxLimits
from inflight.envs.sandbox.seccomp import LOADER_CODE

SANDBOX_HOME = "/tmp"  # inside bwrap: the private tmpfs, the only writable place; also HOME and cwd
# Read-only system paths bound into the sandbox; /usr holds the rest (merged-/usr distributions).
TOP_LEVEL_DIRS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC_FILES = (
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/localtime",
    "/etc/alternatives",
)


def minimal_env(home: str) -> dict[str, str]:
    """The whole environment of sandboxed code: nothing of the host's variables leaks in."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8"}


def python_argv(python: str, code: str) -> list[str]:
    # -I: no user site, no PYTHON* variables, no cwd on sys.path; -B: no .pyc writes; -S: no `site`,
    # so only the standard library is importable (the same on every machine, whatever the interpreter's
    # site-packages hold) and startup is 4x faster (`site` ran .pth hooks importing certifi here).
    # Without `site` the `exit()`/`quit()` helpers are undefined; `sys.exit()` works.
    return [python, "-I", "-S", "-B", "-c", code]


def enter_cgroup_argv(sh: str, procs_files: Iterable[str]) -> list[str]:
    """The job's first process writes 0 (itself) to each group's cgroup.procs, then execs the rest:
    everything it starts is born inside the groups, with no window in which a fork could escape."""
    files = list(procs_files)
    joins = "".join(f'echo 0 >"${i}" && ' for i in range(1, len(files) + 1))
    return [sh, "-c", f'{joins}shift {len(files)} && exec "$@"', "sh", *files]


def seccomp_loader_argv(python: str, seccomp_fd: int) -> list[str]:
    """Loads the seccomp program read from `seccomp_fd`, then execs the argv that follows."""
    return [python, "-I", "-S", "-B", "-c", LOADER_CODE, str(seccomp_fd)]


def limits_argv(prlimit: str, limits: SandboxLimits, *, max_tasks: int, address_space_mb: int) -> list[str]:
    """prlimit applies the rlimits to the sandboxed process only (never to bwrap or the host)."""
    mib = 1 << 20
    return [
        prlimit,
        # soft < hard: SIGXCPU at the soft limit (reported as "cpu"), SIGKILL one second later.
        f"--cpu={limits.cpu_s}:{limits.cpu_s + 1}",
        f"--as={address_space_mb * mib}",
        f"--nproc={max_tasks}",
        f"--fsize={limits.max_file_mb * mib}",
        "--core=0",
        "--",
    ]


def drop_uid_argv(setpriv: str, uid: int) -> list[str]:
    """setpriv switches to `uid` (also as gid), clears supplementary groups and forbids regaining
    privileges through setuid binaries or file capabilities."""
    return [
        setpriv,
        f"--reuid={uid}",
        f"--regid={uid}",
        "--clear-groups",
        "--inh-caps=-all",
        "--no-new-privs",
        "--",
    ]


def bwrap_argv(
    bwrap: str, limits: SandboxLimits, extra_ro_dirs: Iterable[str], *, as_root: bool, seccomp_fd: int
) -> list[str]:
    """bwrap's own options, up to and including `--`: the inner command follows.

    New pid, net, ipc and uts namespaces (no network: only a loopback nobody else is on), a read-only
    view of /usr, the top-level library links and `extra_ro_dirs` (the Python installation), a fresh
    /dev and /proc, and a size-limited private tmpfs at /tmp; host directories such as $HOME, /root,
    /home and the working tree are simply not there. The seccomp program read from `seccomp_fd` is
    loaded last, just before the inner command starts.
    """
    args = [bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    if not as_root:  # an unprivileged bwrap needs a user namespace to create the others
        args.append("--unshare-user")
    args += ["--die-with-parent", "--new-session", "--hostname", "sandbox", "--ro-bind", "/usr", "/usr"]
    for path in TOP_LEVEL_DIRS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    for path in ETC_FILES:
        args += ["--ro-bind-try", path, path]
    made: set[str] = set()
    for path in sorted(set(extra_ro_dirs)):
        if _under(path, "/usr"):
            continue
        # bwrap creates missing parents mode 0700, which the throwaway uid could not traverse.
        for parent in reversed(PurePosixPath(path).parents):
            if str(parent) != "/" and str(parent) not in made:
                made.add(str(parent))
                args += ["--perms", "0755", "--dir", str(parent)]
        args += ["--ro-bind", path, path]
    args += ["--dev", "/dev", "--proc", "/proc"]
    args += ["--perms", "1777", "--size", str(limits.tmpfs_mb << 20), "--tmpfs", SANDBOX_HOME]
    args += ["--chdir", SANDBOX_HOME, "--clearenv"]
    for key, value in minimal_env(SANDBOX_HOME).items():
        args += ["--setenv", key, value]
    if as_root:  # only setpriv uses them, to drop to the throwaway uid; they are gone after that
        args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    return [*args, "--seccomp", str(seccomp_fd), "--"]


def runnable_by_others(path: str) -> bool:
    """Whether an unprivileged uid can execute `path`: every directory on the way is world-searchable
    and the file world-executable (as root, os.access would answer for root, not for that uid)."""
    real = os.path.realpath(path)
    try:
        if not os.stat(real).st_mode & stat.S_IXOTH:
            return False
        return all(os.stat(parent).st_mode & stat.S_IXOTH for parent in PurePosixPath(real).parents)
    except OSError:
        return False


def _under(path: str, root: str) -> bool:
    return PurePosixPath(path) == PurePosixPath(root) or PurePosixPath(root) in PurePosixPath(path).parents
