"""`import inflight` sets libgomp's wait policy before torch loads it, and the user's own settings win."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PRINT = (
    "import json, os, inflight; "
    "print(json.dumps([os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY')]))"
)


def _env_after_import(given: dict[str, str]) -> list[str | None]:
    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run(
        [sys.executable, "-c", PRINT], env={**base, **given}, capture_output=True, text=True, check=True
    )
    return list(json.loads(out.stdout))


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ({}, ["3000", "ACTIVE"]),  # a bounded spin, and 1,000 (not 100) spins where two teams share cores
        ({"GOMP_SPINCOUNT": "50000"}, ["50000", "ACTIVE"]),
        ({"OMP_WAIT_POLICY": "PASSIVE"}, ["3000", "PASSIVE"]),
        ({"GOMP_SPINCOUNT": "1000", "OMP_WAIT_POLICY": "passive"}, ["1000", "passive"]),
        # No spin count to bound it: ACTIVE would spin for minutes, so it is left unset.
        ({"GOMP_SPINCOUNT": ""}, ["", None]),
    ],
)
def test_the_wait_policy_is_set_only_beside_a_spin_count_and_the_users_wins(
    given: dict[str, str], expected: list[str | None]
) -> None:
    assert _env_after_import(given) == expected
