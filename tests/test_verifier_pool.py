"""The verifier pool: bounded concurrency, bounded waits, counters, and an async API that never blocks
the event loop. Real sandboxes throughout (bwrap where it works, as `auto` picks).

Reference: concurrent.futures and asyncio.wrap_future semantics (a cancelled future that has not
started never runs).
"""

from __future__ import annotations

import asyncio
import os

import pytest
from pydantic import ValidationError

from inflight.envs.sandbox import SandboxLimits, VerifierPool, bwrap_problem, default_pool


@pytest.fixture(autouse=True)
def _sandbox_works_here() -> None:
    if os.environ.get("CI") and (problem := bwrap_problem()):
        pytest.fail(f"bubblewrap must work in CI: {problem}")
    if os.geteuid() != 0 and bwrap_problem():
        pytest.skip("no bwrap and not root: rlimit mode would run code as the test runner")


def test_run_many_returns_results_in_input_order() -> None:
    with VerifierPool(concurrency=2) as pool:
        results = pool.run_many([f"print({i} * {i})" for i in range(6)])
        stats = pool.stats()
    assert [r.stdout for r in results] == [f"{i * i}\n" for i in range(6)]
    assert all(r.ok for r in results)
    assert (stats["submitted"], stats["completed"], stats["ok"], stats["failed"]) == (6, 6, 6, 0)


def test_no_more_than_concurrency_jobs_run_at_once() -> None:
    with VerifierPool(concurrency=2) as pool:
        results = pool.run_many(["import time; time.sleep(1)"] * 5)
        stats = pool.stats()
    assert all(r.ok for r in results)
    assert stats["max_in_flight"] == 2 and stats["in_flight"] == 0


def test_awaiting_a_job_leaves_the_event_loop_free() -> None:
    async def main(pool: VerifierPool) -> tuple[bool, list[int]]:
        job = asyncio.ensure_future(pool.run("import time; time.sleep(1); print('done')"))
        in_flight_seen = []
        while not job.done():  # this loop only runs if awaiting the job does not block the thread
            in_flight_seen.append(pool.stats()["in_flight"])
            await asyncio.sleep(0.02)
        return (await job).ok, in_flight_seen

    with VerifierPool(concurrency=1) as pool:
        ok, in_flight_seen = asyncio.run(main(pool))
    assert ok and 1 in in_flight_seen


def test_hostile_jobs_do_not_stall_the_others() -> None:
    async def main(pool: VerifierPool) -> list:
        hostile = [pool.run("while True: pass", limits=SandboxLimits(wall_s=3, cpu_s=60))]
        quick = [pool.run(f"print({i})") for i in range(6)]
        return await asyncio.gather(*hostile, *quick)

    with VerifierPool(concurrency=2) as pool:
        hostile, *quick = asyncio.run(main(pool))
        stats = pool.stats()
    assert (hostile.ok, hostile.reason) == (False, "timeout")
    assert [r.stdout for r in quick] == [f"{i}\n" for i in range(6)]
    assert (stats["timeouts"], stats["reason_timeout"], stats["ok"]) == (1, 1, 6)


def test_job_timeout_caps_every_wall_limit() -> None:
    with VerifierPool(concurrency=1, job_timeout_s=1.0) as pool:
        (result,) = pool.run_many(["import time; time.sleep(60)"], limits=SandboxLimits(wall_s=120))
    assert (result.ok, result.reason) == (False, "timeout")
    assert result.wall_s < 120  # the pool's cap applied, not the job's own 120 s


def test_a_job_that_waited_too_long_for_a_worker_is_not_run() -> None:
    with VerifierPool(concurrency=1, queue_timeout_s=0.5) as pool:
        slow, starved = pool.run_many(["import time; time.sleep(2)", "print('never')"])
        stats = pool.stats()
    assert slow.ok
    assert (starved.ok, starved.reason, starved.stdout) == (False, "timeout", "")
    assert "waited" in starved.stderr and "queue_timeout_s" in starved.stderr
    assert (stats["queue_timeouts"], stats["completed"]) == (1, 1)


def test_rlimit_pool_results_carry_the_warning() -> None:
    if os.geteuid() != 0:
        pytest.skip("rlimit mode needs root for its throwaway uids")
    with VerifierPool(concurrency=1, isolation="rlimit") as pool:
        (result,) = pool.run_many(["print('hi')"])
    assert result.ok and result.isolation == "rlimit" and result.warning and "no network" in result.warning


def test_bad_pool_config_is_a_clear_error() -> None:
    with pytest.raises(ValidationError, match="concurrency"):
        VerifierPool(concurrency=0)
    with pytest.raises(ValidationError, match="job_timeout_s"):
        VerifierPool(job_timeout_s=-1)


def test_default_pool_is_shared() -> None:
    pool = default_pool()
    assert pool is default_pool() and 1 <= pool.config.concurrency <= 8
