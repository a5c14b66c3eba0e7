"""Who may call `inflight serve-engine`: its API keys (`--api-key`, else $INFLIGHT_ENGINE_API_KEY), the
refusal to listen beyond loopback without one, and the key check in front of its routes (`auth.py`'s
middleware, as `inflight serve` uses it). Light (no torch): the CLI checks before it imports the server.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from inflight.auth import ApiKeyMiddleware, is_loopback, keys_from
from inflight.errors import UserError

if TYPE_CHECKING:
    from fastapi import FastAPI

# The key in the environment rather than in a config: a run's config is saved as config.json in its run
# directory, and a process's arguments are readable by every local user (ps, /proc/PID/cmdline). The
# server takes it when no --api-key is given; the pipeline's clients (`client.EngineClient`) send it.
API_KEY_ENV = "INFLIGHT_ENGINE_API_KEY"
API_KEY_HEADER = "X-API-Key"
# Open without a key: launchers and `inflight run`'s preflight wait on it, as load balancers probe `serve`'s
# healthz. It tells the model name, the versions and the adapter names, nothing that changes the engine.
OPEN_PATHS = frozenset({"/health"})
# Where the key may also come as `Authorization: Bearer KEY`: what the `openai` client sends as its
# api_key (vLLM's --api-key reads it there), and Prometheus' scrape of /metrics.
BEARER_PATHS = frozenset({"/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions"})


def engine_api_keys(flags: Sequence[str]) -> list[str]:
    """The keys the server accepts: the --api-key flags, else the one in $INFLIGHT_ENGINE_API_KEY, else
    none (`auth.keys_from`)."""
    return keys_from(flags, API_KEY_ENV)


def client_api_key() -> str | None:
    """The key a client sends (from $INFLIGHT_ENGINE_API_KEY); None when unset or blank."""
    return os.environ.get(API_KEY_ENV, "").strip() or None


def check_engine_listening(host: str, api_keys: Sequence[str], weights_dir: str | None) -> None:
    """Beyond loopback, refuse to serve without a key (anyone reaching the port could replace the weights)
    and without --weights-dir: /update_weights and /set_adapter would otherwise read any file this process
    can read, and their answers would tell which paths exist and which tensors a file holds. Confined to a
    directory, a path outside it is refused before anything looks at it."""
    if is_loopback(host):
        return
    if not api_keys:
        raise UserError(
            f"refusing to serve the engine on {host!r} without an API key: anyone who can reach it could "
            f"replace its weights and sample. Set {API_KEY_ENV} (the pipeline's clients send it from there) "
            "or pass --api-key KEY, or bind 127.0.0.1"
        )
    if weights_dir is None:
        raise UserError(
            f"refusing to serve the engine on {host!r} without --weights-dir: weight and adapter updates by "
            "path would read any file this process can read. Pass --weights-dir DIR (the run's weights "
            "directory; any directory when updates come as bytes), or bind 127.0.0.1"
        )


def require_api_key(app: FastAPI, api_keys: Sequence[str]) -> None:
    """Every route but /health answers 401 without one of `api_keys` (none: every route open)."""
    if api_keys:
        app.add_middleware(
            ApiKeyMiddleware, api_keys=list(api_keys), open_paths=OPEN_PATHS, bearer_paths=BEARER_PATHS
        )
