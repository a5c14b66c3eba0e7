"""Authentication that cannot be switched off by accident: a blank key is refused before anything starts,
the public-bind guard decides by what the host resolves to (loopback aliases pass, every other address
needs a key), and with a key every route but the ones the README lists as open answers 401.

Reference: the hardening issue, "Authentication that cannot be switched off by accident".
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from inflight.api.app import BackgroundServer, create_app
from inflight.api.service import ServiceConfig
from inflight.auth import OPEN_PATHS, ApiKeyMiddleware, check_api_keys, check_listening, is_loopback
from inflight.envs.openenv_server import OpenEnvServerConfig
from inflight.errors import UserError
from inflight.inference.engine_service import EngineServerConfig

README = Path(__file__).resolve().parents[1] / "README.md"
KEY = "tml-secret"


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.1", True),  # inet_aton's short form, as the bind itself reads it
        ("127.0.0.2", True),
        ("2130706433", True),
        ("::1", True),
        ("localhost", True),
        ("0.0.0.0", False),  # every interface
        ("::", False),
        ("", False),
        (" ", False),
        ("10.1.2.3", False),
        ("192.168.0.1", False),
        ("no-such-host.invalid", False),
    ],
)
def test_loopback_is_what_the_host_resolves_to(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


@pytest.mark.parametrize("keys", [[""], [" "], ["\t\n"], ["good", ""]])
def test_a_blank_key_is_refused_everywhere(keys: list[str], tmp_path: Path) -> None:
    with pytest.raises(UserError, match="empty or blank"):
        check_api_keys(keys)
    with pytest.raises(ValidationError, match="empty or blank"):
        ServiceConfig(base_models={"tiny": "unused"}, state_dir=tmp_path, api_keys=keys)
    with pytest.raises(UserError, match="empty or blank"):
        ApiKeyMiddleware(lambda *args: None, api_keys=keys)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--host", "127.1", "--api-key", ""], "empty or blank"),
        (["--host", "127.0.0.1", "--api-key", "   "], "e.g. `--api-key tml-$(openssl rand -hex 32)`"),
        # Every tinker SDK refuses an api_key without tml-: a server with such a key admits no SDK client.
        (["--api-key", "secret"], "API key #1 does not start with 'tml-'"),
        (["--api-key", KEY, "--api-key", "secret"], "pass `--api-key tml-$(openssl rand -hex 32)`"),
        (["--host", "0.0.0.0", "--api-key", "tml"], "API key #1 does not start with 'tml-'"),
        (["--host", "0.0.0.0"], "refusing to serve on '0.0.0.0'"),
        (["--host", "::"], "refusing to serve on '::'"),
    ],
)
def test_serve_refuses_in_one_line_before_loading_a_model(
    args: list[str], message: str, tmp_path: Path
) -> None:
    line = _serve_refusal(args, tmp_path)
    assert message in line, line


def _serve_refusal(args: list[str], tmp_path: Path, env_key: str | None = None) -> str:
    """The one line `inflight serve ARGS` refuses with (exit 2, no traceback), `env_key` in
    $INFLIGHT_SERVE_API_KEY (else unset). The model directory does not exist: a refusal of the keys or the
    host must come before anything reads it, and a run whose keys pass ends there."""
    env = {k: v for k, v in os.environ.items() if k != "INFLIGHT_SERVE_API_KEY"}
    if env_key is not None:
        env["INFLIGHT_SERVE_API_KEY"] = env_key
    model, state = f"tiny={tmp_path / 'nope'}", str(tmp_path / "state")
    argv = [sys.executable, "-m", "inflight.cli", "serve", "--base-model", model, *args, "--state-dir", state]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


@pytest.mark.parametrize(
    ("env_key", "args", "message"),
    [
        ("tml-secret", ["--host", "0.0.0.0"], "does not exist"),  # a key: the public bind is allowed
        ("secret", [], "does not start with 'tml-'"),
        (" ", [], "INFLIGHT_SERVE_API_KEY is set but blank"),
        ("secret", ["--api-key", KEY], "does not exist"),  # the flag wins over the variable
    ],
)
def test_serve_reads_its_key_from_the_environment(
    env_key: str, args: list[str], message: str, tmp_path: Path
) -> None:
    """Without --api-key, `inflight serve` takes $INFLIGHT_SERVE_API_KEY: a secret out of `ps` and shell
    history, checked as a flag's is. Each run ends at the first refusal: the key's, or else the missing
    model's (the key passed)."""
    line = _serve_refusal(args, tmp_path, env_key)
    assert message in line, line


def test_a_key_without_the_sdks_prefix_is_refused_by_the_service_only(tmp_path: Path) -> None:
    """Every tinker SDK refuses an api_key that lacks `tml-` before it sends anything, so `inflight serve`
    (its flag, its config) refuses such a key in one line naming the fix. The engine and env servers, whose
    clients are inflight's own and send any key, take one without it, through the same shared checks."""
    with pytest.raises(
        UserError, match=r"does not start with 'tml-'.*--api-key tml-\$\(openssl rand -hex 32\)"
    ):
        check_listening("127.0.0.1", ["secret"])
    with pytest.raises(ValidationError, match="does not start with 'tml-'"):
        ServiceConfig(base_models={"tiny": "unused"}, state_dir=tmp_path, api_keys=["secret"])
    assert check_listening("0.0.0.0", [KEY]) == [KEY]
    assert check_api_keys(["secret"]) == ["secret"]
    assert EngineServerConfig(api_keys=["secret"]).api_keys == ["secret"]
    assert OpenEnvServerConfig(api_keys=["secret"]).api_keys == ["secret"]
    ApiKeyMiddleware(lambda *args: None, api_keys=["secret"])  # type: ignore[arg-type]


def test_with_a_key_only_the_documented_routes_are_open(tiny_model_dir: Path, tmp_path: Path) -> None:
    documented = set(re.findall(r"`(/api/v1/[a-z_/]+)`", _readme_open_routes()))
    assert documented == set(OPEN_PATHS), "README's list of routes open without a key is out of date"
    config = ServiceConfig(base_models={"tiny": str(tiny_model_dir)}, state_dir=tmp_path, api_keys=[KEY])
    with BackgroundServer(create_app(config)) as server:
        gets = ["server_stats", "get_server_capabilities", "training_runs", "samplers/x", "healthz"]
        posts = ["client/config", "create_session", "asample", "retrieve_future", "telemetry"]
        for method, routes in (("GET", gets), ("POST", posts)):
            for route in routes:
                path = f"/api/v1/{route}"
                for headers in ({}, {"X-API-Key": ""}, {"X-API-Key": "tml-wrong"}):
                    status = httpx.request(method, server.url + path, json={}, headers=headers).status_code
                    assert (status != 401) is (path in OPEN_PATHS), (method, path, headers, status)
                keyed = httpx.request(method, server.url + path, json={}, headers={"X-API-Key": KEY})
                assert keyed.status_code != 401


def _readme_open_routes() -> str:
    """The README paragraph that names the routes served without a key."""
    text = README.read_text()
    match = re.search(r"^.*(?:open without|without a key).*$", text, flags=re.MULTILINE)
    assert match, "README does not say which routes are open without an API key"
    return match.group(0)
