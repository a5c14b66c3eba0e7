"""Shared fixtures: one tiny model per test session, built locally (no hub) into a private temp dir."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from inflight.models import build_tiny

    return build_tiny(tmp_path_factory.mktemp("tiny-model"), preset="tiny", seed=0)


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    # Runs that build the tiny model cache it under INFLIGHT_CACHE: never the user's ~/.cache in tests.
    monkeypatch.setenv("INFLIGHT_CACHE", str(tmp_path_factory.getbasetemp() / "inflight-cache"))
