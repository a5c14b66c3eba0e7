"""`EngineProcess`: an `inflight serve-engine` in a process of its own, started, waited for (bounded),
restarted when it dies (if asked) and stopped by the caller; the vLLM backend's runs in the environment
`vllm_env.py` builds. Used where a run or a benchmark needs vLLM (`engine.backend=vllm` under either
launcher, `inflight serve --engine vllm`, `inflight bench engine --backend vllm`) and by the tests that
hold vLLM to the engine contract. Owns the command line, the wait for /health, the restarts and the
server's log (its tail is the error message when it does not come up); knows nothing of what is asked of
the engine once it answers.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Literal

from inflight.errors import UserError
from inflight.inference.backends import VllmOptions

LOG_TAIL_CHARS = 3000
WATCH_INTERVAL_S = 0.5  # how often a supervised process is checked for having exited


class EngineProcess:
    """One `serve-engine` process. `start()` returns once /health answers 200 (UserError with the log's
    tail when the process exits or `start_timeout_s` passes first); `stop()` terminates it (SIGKILL after
    `stop_timeout_s`). A context manager.

    It serves on `host`:`port` (default: loopback, a free port) and stops by itself when this process
    dies (`serve-engine --parent-pid`). With `max_restarts` (-1: always), a process that exits unasked is
    started again on the same port from a thread of this object, and `restarts` counts it: whoever calls
    it (the pipeline's client) routes around the outage and brings the new process up to date."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        backend: Literal["builtin", "vllm"] = "vllm",
        max_batch_size: int = 64,
        max_seq_len_tokens: int | None = None,
        vllm: VllmOptions | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        weights_dir: str | Path | None = None,
        threads: int | None = None,
        max_restarts: int = 0,
        start_timeout_s: float = 300.0,
        stop_timeout_s: float = 30.0,
        log_path: str | Path | None = None,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.backend = backend
        self.max_batch_size = max_batch_size
        self.max_seq_len_tokens = max_seq_len_tokens
        self.vllm = vllm or VllmOptions()
        self.host = host
        self.port = port  # None: a free one, chosen at start and kept for restarts
        self.weights_dir = weights_dir
        self.threads = threads  # OMP_NUM_THREADS of the server (None: inherited)
        self.max_restarts = max_restarts
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self._log_dir: tempfile.TemporaryDirectory[str] | None = None
        if log_path is None:
            self._log_dir = tempfile.TemporaryDirectory(prefix="inflight-engine-")
            log_path = Path(self._log_dir.name) / "server.log"
        self.log_path = Path(log_path)
        self.restarts = 0
        self._process: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()  # the process handle, between stop() and the restarting thread
        self._stopping = threading.Event()
        self._watch: threading.Thread | None = None
        self.url = ""

    def __enter__(self) -> EngineProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def pid(self) -> int | None:
        process = self._process
        return None if process is None else process.pid

    def alive(self) -> bool:
        process = self._process
        return process is not None and process.poll() is None

    def start(self) -> EngineProcess:
        from inflight.preflight import bind_port

        python = self._python()
        if self.port is None:
            with bind_port(self.host, 0) as sock:  # a free port, released for the server to take
                self.port = int(sock.getsockname()[1])
        self.url = f"http://{self.host}:{self.port}"
        self._stopping.clear()
        self._launch(python)
        why = self._wait_healthy()
        if why is not None:
            self.stop()
            raise self._failed(why)
        if self.max_restarts != 0 and self._watch is None:
            self._watch = threading.Thread(
                target=self._supervise, args=(python,), name="engine-process-watch", daemon=True
            )
            self._watch.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        with self._lock:
            process, self._process = self._process, None
        if self._watch is not None and self._watch is not threading.current_thread():
            self._watch.join(self.start_timeout_s + self.stop_timeout_s)
            self._watch = None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(self.stop_timeout_s)

    def close(self) -> None:
        """stop(), and the log directory this object made goes too."""
        self.stop()
        if self._log_dir is not None:
            self._log_dir.cleanup()

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
        except OSError:
            return "(no log)"

    def _python(self) -> Path:
        if self.backend == "builtin":
            return Path(sys.executable)
        from inflight.launch.vllm_env import VllmEnvError, vllm_python

        try:
            return vllm_python(log=True)
        except VllmEnvError as exc:
            raise UserError(
                f"the vLLM environment could not be built ({exc}); it needs PyPI and ~3.5 GB of disk: "
                "build it with `python -m inflight.launch.vllm_env`, or use the built-in engine"
            ) from None

    def _command(self, python: Path) -> list[str]:
        command = [
            str(python), "-m", "inflight.cli", "serve-engine", "--backend", self.backend,
            "--model", str(self.model_dir), "--host", self.host, "--port", str(self.port),
            "--max-batch-size", str(self.max_batch_size), "--parent-pid", str(os.getpid()),
        ]  # fmt: skip
        if self.backend == "vllm":
            command += ["--logprobs-kind", self.vllm.logprobs_kind]
            command += ["--max-lora-rank", str(self.vllm.max_lora_rank)]
            command += ["--max-logprobs", str(self.vllm.max_prompt_logprobs)]
        if self.max_seq_len_tokens is not None:
            command += ["--max-seq-len-tokens", str(self.max_seq_len_tokens)]
        if self.weights_dir is not None:
            # The run's weights directory, which its first update creates: serve-engine wants it to exist.
            Path(self.weights_dir).mkdir(parents=True, exist_ok=True)
            command += ["--weights-dir", str(self.weights_dir)]
        return command

    def _launch(self, python: Path) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            if self._stopping.is_set():
                return
            with open(self.log_path, "ab") as log:  # the child keeps its own descriptor
                self._process = subprocess.Popen(
                    self._command(python),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=_child_env(self.threads),
                    start_new_session=True,
                )

    def _wait_healthy(self) -> str | None:
        """None once /health answers 200; else why not (the process exited, or the wait timed out)."""
        import httpx

        deadline = time.monotonic() + self.start_timeout_s
        while not self._stopping.is_set():
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return None
            except httpx.TransportError:
                pass
            process = self._process
            if process is None or process.poll() is not None:
                return f"exited with code {None if process is None else process.returncode}"
            if time.monotonic() > deadline:
                return f"did not answer /health within {self.start_timeout_s:g} s"
            time.sleep(0.25)
        return "was stopped while starting"

    def _failed(self, why: str) -> UserError:
        return UserError(
            f"serve-engine --backend {self.backend} for {str(self.model_dir)!r} {why}; its log "
            f"({self.log_path}) ends:\n{self.log_tail()}"
        )

    def _supervise(self, python: Path) -> None:
        """Restart the process whenever it exits unasked, until `max_restarts` is spent or stop()."""
        while not self._stopping.wait(WATCH_INTERVAL_S):
            process = self._process
            if process is None or process.poll() is None:
                continue
            if 0 <= self.max_restarts <= self.restarts:
                print(
                    f"inflight: the {self.backend} engine at {self.url} exited (code {process.returncode}) "
                    f"after {self.restarts} restarts, the most allowed; not restarting it. Its log "
                    f"({self.log_path}) ends:\n{self.log_tail()}",
                    file=sys.stderr,
                    flush=True,
                )
                return
            self.restarts += 1
            print(
                f"inflight: the {self.backend} engine at {self.url} exited (code {process.returncode}); "
                f"restarting it on the same port (restart {self.restarts})",
                file=sys.stderr,
                flush=True,
            )
            self._launch(python)
            why = self._wait_healthy()
            if why is not None and not self._stopping.is_set():
                print(f"inflight: {self._failed(why)}", file=sys.stderr, flush=True)
                with self._lock:  # hung rather than exited: ended, so that the next check restarts it
                    if self._process is not None and self._process.poll() is None:
                        self._process.kill()


def check_vllm_model_dir(model: str) -> str:
    """`model`, when it is a local directory (vLLM loads a model from its files); else one line saying so."""
    if not os.path.isdir(model):
        raise UserError(
            f"engine.backend=vllm needs model.path to be a local model directory in safetensors, got "
            f"{model!r}: download it first (e.g. `huggingface-cli download ID --local-dir DIR`)"
        )
    return model


def _child_env(threads: int | None) -> dict[str, str]:
    """This process's environment, with this checkout's source first on the child's path: the vLLM
    environment's editable install names the checkout that built it, which need not be this one."""
    env = dict(os.environ)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    package_parent = Path(__file__).resolve().parents[2]  # .../src for a checkout
    if (package_parent.parent / "pyproject.toml").is_file():
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(package_parent), env.get("PYTHONPATH")]))
    return env
