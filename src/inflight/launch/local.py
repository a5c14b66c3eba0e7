"""The local launcher (`launcher=local`, the default): the run in this process, and with
`engine.backend=vllm` a vLLM engine process beside it (`engine_process.py`), started before the run and
stopped after it (and restarted when it dies, `engine.max_restarts`), which the pipeline reaches over
HTTP as it reaches `pipeline.engine_urls`. Owns only that placement; the run itself is
`orchestrator/run.py`'s.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from inflight.config import RunConfig

if TYPE_CHECKING:
    from inflight.orchestrator.stopping import StopRequest
    from inflight.orchestrator.task import Task


def run_local(cfg: RunConfig, task: Task, stop: StopRequest | None = None) -> dict[str, Any]:
    """`orchestrator.run.run(cfg, task)`, with the vLLM engine process when cfg.engine.backend is vllm;
    `stop` ends its training early (a signal). The engine starts once the run accepts its run directory
    (`run`'s `engines`): it reads weights from RUN_DIR/weights, which it creates, and a refused resume
    writes nothing there."""
    from inflight.orchestrator.run import run

    if cfg.engine.backend != "vllm":
        return run(cfg, task, stop=stop)
    assert not cfg.pipeline.engine_urls, "preflight.check_run refuses engine_urls with engine.backend=vllm"
    from inflight.launch.engine_process import EngineProcess, check_vllm_model_dir
    from inflight.orchestrator.setup import resolve_model, run_dir_path

    model_dir = check_vllm_model_dir(resolve_model(cfg))
    placed = cfg.model_copy(deep=True)
    placed.run_dir = str(run_dir_path(cfg).resolve())  # fixed now: the engine reads weights only there
    # Half the cores for the engine, the rest for the trainer: two processes each spinning OpenMP threads
    # on every core slow each other down many times over.
    threads = max(1, (os.cpu_count() or 2) // 2)
    engine = EngineProcess(
        model_dir,
        backend="vllm",
        max_batch_size=cfg.engine.max_batch_size,
        max_seq_len_tokens=cfg.engine.max_seq_len_tokens,
        threads=threads,
        max_restarts=cfg.engine.max_restarts,
        weights_dir=Path(placed.run_dir) / "weights",
    )

    @contextmanager
    def started(accepted: RunConfig) -> Iterator[RunConfig]:
        print(f"engine.backend=vllm: starting the vLLM engine for {model_dir} ...", file=sys.stderr)
        with engine:
            print(f"engine.backend=vllm: serving at {engine.url}", file=sys.stderr, flush=True)
            on_engine = accepted.model_copy(deep=True)
            on_engine.pipeline.engine_urls = [engine.url]
            yield on_engine

    def restarts() -> dict[str, float]:  # the keys launch/ray/replicas.py's ReplicaWatch logs
        up = float(engine.alive())
        return {"engine_replica_restarts": float(engine.restarts), "engine_replicas_up": up}

    return run(placed, task, launcher_metrics=restarts, stop=stop, engines=started)
