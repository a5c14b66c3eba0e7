"""Sandbox throughput and verifier latency, per isolation mode, side by side in one run.

For each mode (bwrap where it works, and rlimit): executions/s of a trivial passing snippet through a
VerifierPool driven by --concurrency asyncio clients (closed loop: each client submits its next job when
its last one returns), the end-to-end latency of those calls (p50/p99, queueing included), and the
latency of one execution at a time. A bare `python -I -S -c` (no sandbox) is the baseline for the
overhead. The headline keys (`executions_per_s`, `latency_p50_ms`, `latency_p99_ms`) are for the mode
`auto` picks, named in `isolation`; `memory_bound` names how each job's memory was bounded as a whole
(a cgroup, or rlimit_split where none can be made). Prints one JSON line last.
Run: `inflight bench sandbox [--jobs N] [--concurrency 8]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time

from benchmarks import at_least

SNIPPET = "assert sum(range(10)) == 45\nprint('ok')"


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def _closed_loop(isolation: str, jobs: int, concurrency: int) -> dict[str, float]:
    from inflight.envs.sandbox import VerifierPool

    latencies_s: list[float] = []

    async def client(pool: VerifierPool, count: int) -> None:
        for _ in range(count):
            start = time.perf_counter()
            result = await pool.run(SNIPPET)
            latencies_s.append(time.perf_counter() - start)
            if not result.ok:
                raise RuntimeError(f"the benchmark snippet failed under {isolation}: {result}")

    async def main(pool: VerifierPool) -> float:
        per_client = [jobs // concurrency + (i < jobs % concurrency) for i in range(concurrency)]
        start = time.perf_counter()
        await asyncio.gather(*(client(pool, n) for n in per_client))
        return time.perf_counter() - start

    with VerifierPool(concurrency=concurrency, isolation=isolation) as pool:  # type: ignore[arg-type]
        pool.run_many([SNIPPET] * concurrency)  # warm-up: page cache, first-use probes
        elapsed_s = asyncio.run(main(pool))
    return {
        "executions_per_s": round(jobs / elapsed_s, 2),
        "latency_p50_ms": round(1000 * _percentile(latencies_s, 50), 1),
        "latency_p99_ms": round(1000 * _percentile(latencies_s, 99), 1),
    }


def _one_at_a_time_ms(run: object, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        run()  # type: ignore[operator]
        times.append(time.perf_counter() - start)
    return round(1000 * statistics.median(times[1:]), 1)  # the first run warms caches


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="inflight bench sandbox",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--jobs", type=at_least(1), default=160, help="executions per mode through the pool")
    parser.add_argument("--concurrency", type=at_least(1), default=8, help="pool workers and asyncio clients")
    parser.add_argument(
        "--sequential", type=at_least(1), default=20, help="one-at-a-time executions per mode"
    )
    args = parser.parse_args(argv)

    from inflight.envs.sandbox import bwrap_problem, detect_isolation, detect_memory_bound, run_python
    from inflight.envs.sandbox.capture import run_capped
    from inflight.envs.sandbox.command import minimal_env, python_argv
    from inflight.envs.sandbox.runner import _host_python

    modes = ["rlimit"] if bwrap_problem() else ["bwrap", "rlimit"]
    if os.geteuid() != 0 and "rlimit" in modes:
        modes.remove("rlimit")  # as non-root rlimit mode would run the code as ourselves: not measured
    by_mode: dict[str, dict[str, float]] = {}
    for mode in modes:
        stats = _closed_loop(mode, args.jobs, args.concurrency)
        stats["one_at_a_time_ms"] = _one_at_a_time_ms(
            lambda m=mode: run_python(SNIPPET, isolation=m), args.sequential
        )
        by_mode[mode] = stats

    def bare() -> None:
        argv = python_argv(_host_python(), SNIPPET)
        run_capped(argv, stdin=b"", wall_s=30, max_output_bytes=1 << 20, cwd=None, env=minimal_env("/tmp"))

    bare_ms = _one_at_a_time_ms(bare, args.sequential)
    isolation = detect_isolation()
    headline = by_mode.get(isolation, {})
    result = {
        "benchmark": "sandbox",
        "isolation": isolation,
        "memory_bound": detect_memory_bound(),
        "concurrency": args.concurrency,
        "jobs": args.jobs,
        "executions_per_s": headline.get("executions_per_s"),
        "latency_p50_ms": headline.get("latency_p50_ms"),
        "latency_p99_ms": headline.get("latency_p99_ms"),
        "one_at_a_time_ms": headline.get("one_at_a_time_ms"),
        "bare_python_ms": bare_ms,
        "overhead_ms": {mode: round(s["one_at_a_time_ms"] - bare_ms, 1) for mode, s in by_mode.items()},
        "by_isolation": by_mode,
        "cpus": os.cpu_count(),
    }
    print(json.dumps(result))
    return result
