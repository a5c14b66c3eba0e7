"""tinker-cookbook 0.6.1's own `sl_loop` (including a resume from its checkpoint) and `rl_loop`
(loss_fn=importance_sampling), unmodified, against a live server on the tiny model.

Reference: /work/shared/reference/tinker-api.md §11 and §14 step 13. The recipes hard-code hub datasets and
tokenizers, so, as the spec describes, a small wrapper registers the local tokenizer under the model name
and patches `datasets.load_dataset` with small in-code datasets. rl_loop's math grader cannot reward a
random tiny model, so its reward is patched to alternate 1, 0 within each group: every group then carries
signal and forward_backward(importance_sampling) really runs.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import datasets
import pytest
from sqlalchemy import select

from inflight.api.app import BackgroundServer, create_app
from inflight.api.db import FutureRow
from inflight.api.schemas import LoadWeightsRequest
from inflight.api.service import ServiceConfig, ServiceState

# The recipes leave their SDK clients open: closed after each test, while the server runs.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("close_sdk_sessions")]

BASE = (
    "meta-llama/Llama-3.2-1B"  # in the cookbook's registry: the role_colon renderer works with any tokenizer
)


def conversations(n: int) -> list[dict[str, Any]]:
    topics = ["the sea", "a red kite", "bread", "winter", "a small robot", "the moon", "tea", "rivers"]
    return [
        {
            "messages": [
                {"role": "user", "content": f"Write one line about {topics[i % len(topics)]}."},
                {
                    "role": "assistant",
                    "content": f"Here is a line about {topics[i % len(topics)]}, number {i}.",
                },
            ]
        }
        for i in range(n)
    ]


def arithmetic(n: int) -> list[dict[str, str]]:
    return [
        {"question": f"What is {i} + {i + 1}?", "answer": f"{i} + {i + 1} = {2 * i + 1}\n#### {2 * i + 1}"}
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    from tinker_cookbook import tokenizer_utils
    from transformers import AutoTokenizer

    tables = {
        "HuggingFaceH4/no_robots": datasets.DatasetDict(
            {"train": datasets.Dataset.from_list(conversations(10))}
        ),
        "openai/gsm8k": datasets.DatasetDict({"train": datasets.Dataset.from_list(arithmetic(8))}),
    }

    def load_dataset(name: str, *args: object, **kwargs: object) -> Any:
        return tables[name]

    config = ServiceConfig(
        base_models={BASE: str(tiny_model_dir)}, state_dir=tmp_path_factory.mktemp("serve")
    )
    with pytest.MonkeyPatch.context() as mp:
        for key, value in {
            "TINKER_API_KEY": "tml-test",
            "TINKER_TELEMETRY": "0",
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
        }.items():
            mp.setenv(key, value)
        mp.setattr(datasets, "load_dataset", load_dataset)
        tokenizer_utils.register_tokenizer(BASE, lambda: AutoTokenizer.from_pretrained(tiny_model_dir))
        with BackgroundServer(create_app(config)) as running:
            yield running


def service_state(server: BackgroundServer) -> ServiceState:
    state: ServiceState = server.app.state.service
    return state


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_sl_loop_trains_saves_and_resumes(server: BackgroundServer, tmp_path: Path) -> None:
    import chz
    from tinker_cookbook.recipes import sl_loop

    log_path = tmp_path / "sl"
    config = sl_loop.Config(
        base_url=server.url,
        log_path=str(log_path),
        model_name=BASE,
        batch_size=2,
        learning_rate=1e-3,
        lora_rank=8,
        max_steps=3,
        save_every=2,
        max_length=256,
    )
    sl_loop.main(config)
    records = read_jsonl(log_path / "checkpoints.jsonl")
    assert [r["name"] for r in records] == ["000002", "final"]
    assert "sampler_path" in records[-1] and records[-1]["state_path"].endswith("/weights/final")
    steps = [m["step"] for m in read_jsonl(log_path / "metrics.jsonl")]
    assert steps == [0, 1, 2]

    # Pretend the run stopped after its step-2 checkpoint: the rerun must resume from it, with Adam state.
    resume_from = records[0]["state_path"]
    (log_path / "checkpoints.jsonl").write_text(json.dumps(records[0]) + "\n")
    sl_loop.main(chz.replace(config, max_steps=4))
    steps = [m["step"] for m in read_jsonl(log_path / "metrics.jsonl")]
    assert steps == [0, 1, 2, 2, 3]
    with service_state(server).db.read() as session:
        loads = session.scalars(select(FutureRow).where(FutureRow.request_type == "load_weights")).all()
        requests = [
            (LoadWeightsRequest.model_validate_json(row.request_payload), row.status) for row in loads
        ]
    assert [(r.path, r.optimizer, status) for r, status in requests] == [(resume_from, True, "done")]
    final = read_jsonl(log_path / "checkpoints.jsonl")[-1]
    assert final["name"] == "final" and final["state_path"] != records[-1]["state_path"]


def test_rl_loop_with_importance_sampling(
    server: BackgroundServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tinker_cookbook.recipes import rl_loop

    rewards = itertools.cycle([1.0, 0.0])
    monkeypatch.setattr(rl_loop, "get_reward", lambda response, answer: next(rewards))
    before = dict(service_state(server).counters())
    log_path = tmp_path / "rl"
    rl_loop.main(
        rl_loop.Config(
            base_url=server.url,
            log_path=str(log_path),
            model_name=BASE,
            loss_fn="importance_sampling",
            batch_size=2,
            group_size=2,
            max_tokens=8,
            max_steps=2,
            lora_rank=8,
            save_every=0,
        )
    )
    metrics = read_jsonl(log_path / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1]
    assert all("optim/lr" in m and "reward/total" in m for m in metrics)
    final = read_jsonl(log_path / "checkpoints.jsonl")[-1]
    assert final["name"] == "final" and {"state_path", "sampler_path"} <= set(final)
    after = service_state(server).counters()
    assert after.get("done_forward_backward", 0) - before.get("done_forward_backward", 0) == 2
    assert after.get("done_sample", 0) - before.get("done_sample", 0) == 4  # 2 steps x 2 prompts
    assert after.get("failed_server", 0) == 0
