"""`EngineProcess`: an `inflight serve-engine` in a process of its own on a free loopback port, started,
waited for (bounded) and stopped by the caller; the vLLM backend's runs in the environment
`vllm_env.py` builds. Used where a run or a benchmark needs vLLM (`engine.backend=vllm`, `inflight bench
engine --backend vllm`) and by the tests that hold vLLM to the engine contract. Owns the command line, the
wait for /health and the server's log (its tail is the error message when it does not come up); knows
nothing of what is asked of the engine once it answers.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Literal

from inflight.errors import UserError

LOG_TAIL_CHARS = 3000


class EngineProcess:
    """One `serve-engine` process. `start()` returns once /health answers 200 (UserError with the log's
    tail when the process exits or `start_timeout_s` passes first); `stop()` terminates it (SIGKILL after
    `stop_timeout_s`). A context manager."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        backend: Literal["builtin", "vllm"] = "vllm",
        max_batch_size: int = 64,
        max_seq_len_tokens: int | None = None,
        start_timeout_s: float = 300.0,
        stop_timeout_s: float = 30.0,
        log_path: str | Path | None = None,
        threads: int | None = None,
        logprobs_kind: Literal["sampled", "raw"] = "sampled",
        max_lora_rank: int = 16,
        max_logprobs: int = 20,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.backend = backend
        self.max_batch_size = max_batch_size
        self.max_seq_len_tokens = max_seq_len_tokens
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.threads = threads  # OMP_NUM_THREADS of the server (None: inherited)
        self.logprobs_kind = logprobs_kind  # this and the two below: vLLM's only
        self.max_lora_rank = max_lora_rank
        self.max_logprobs = max_logprobs
        self._log_dir: tempfile.TemporaryDirectory[str] | None = None
        if log_path is None:
            self._log_dir = tempfile.TemporaryDirectory(prefix="inflight-engine-")
            log_path = Path(self._log_dir.name) / "server.log"
        self.log_path = Path(log_path)
        self._process: subprocess.Popen[bytes] | None = None
        self.url = ""

    def __enter__(self) -> EngineProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> EngineProcess:
        import httpx

        from inflight.preflight import bind_port

        python = self._python()
        with bind_port("127.0.0.1", 0) as sock:  # a free port, released for the server to take
            port = int(sock.getsockname()[1])
        command = [
            str(python), "-m", "inflight.cli", "serve-engine", "--backend", self.backend,
            "--model", str(self.model_dir), "--port", str(port), "--max-batch-size", str(self.max_batch_size),
        ]  # fmt: skip
        if self.backend == "vllm":
            command += ["--logprobs-kind", self.logprobs_kind, "--max-lora-rank", str(self.max_lora_rank)]
            command += ["--max-logprobs", str(self.max_logprobs)]
        if self.max_seq_len_tokens is not None:
            command += ["--max-seq-len-tokens", str(self.max_seq_len_tokens)]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:  # the child keeps its own descriptor
            self._process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=_child_env(self.threads),
                start_new_session=True,
            )
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if self._process.poll() is not None or time.monotonic() > deadline:
                why = (
                    f"exited with code {self._process.returncode}"
                    if self._process.poll() is not None
                    else f"did not answer /health within {self.start_timeout_s:g} s"
                )
                self.stop()
                raise UserError(
                    f"serve-engine --backend {self.backend} for {str(self.model_dir)!r} {why}; its log "
                    f"({self.log_path}) ends:\n{self.log_tail()}"
                )
            time.sleep(0.25)

    def stop(self) -> None:
        process, self._process = self._process, None
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
