"""tinker-cookbook 0.6.1's `sl_loop` and `rl_loop`, unmodified, learn against a live `inflight serve` on the
tiny model: sl_loop's train loss falls, and rl_loop's reward, from the recipe's own math grader, rises.

Reference: /work/shared/reference/tinker-api.md §14; the runs behind each margin are in docs/benchmarks.md,
"tinker-cookbook recipes against `inflight serve`: learning curves (issue 15 item 6)". As in
test_api_cookbook.py, the local tokenizer is registered under a cookbook model name and
`datasets.load_dataset` serves tables made here; nothing of either recipe is patched.

The RL task is gsm8k-shaped: the question is a keyword said 16 times ("one one ... one." with answer
"#### 1", or "two two ... two." with "#### 2"); said once, the tiny model did not learn it in 100
supervised steps. A random tiny model never writes `\\boxed`, so sl_loop first teaches the format on
conversations in rl_loop's prompt whose answer is right half the time, and rl_loop (its default loss,
stable_reinforce) resumes from that state through its own resume path, the `checkpoints.jsonl` in its
log_path. The reply format is `\\boxed 1`, which the recipe's grader accepts, and max_tokens=4 ends the
reply at the answer, so nothing after it is trained or graded (after `\\boxed{1}`, the text drifted under
RL, to `boxed{` and the like). Batches of 8 prompts: with 4, about one run in six settled on one answer for
both keywords, which no group's centred reward can move it from.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from statistics import mean
from typing import Any

import datasets
import pytest

from conftest import sdk_server
from inflight.api.app import BackgroundServer
from inflight.api.service import ServiceConfig, ServiceState

# The recipes leave their SDK clients open: `sdk_server` closes them when the module's server stops.
pytestmark = pytest.mark.slow

BASE = "meta-llama/Llama-3.2-1B"  # in the cookbook's registry: its role_colon renderer takes any tokenizer
SL_DATA, RL_DATA = "HuggingFaceH4/no_robots", "openai/gsm8k"  # the recipes' hard-coded datasets
# rl_loop's prompt, copied from tinker_cookbook/recipes/rl_loop.py (the warm-up must match it)
QUESTION_SUFFIX = " Provide a numerical answer without units, written inside \\boxed{}."
RL_PREFIX = [
    {"role": "user", "content": "How many r's are in strawberry?" + QUESTION_SUFFIX},
    {
        "role": "assistant",
        "content": "Let's spell the word out and number all the letters: 1) s 2) t 3) r 4) a 5) w 6) b "
        "7) e 8) r 9) r 10) y. We have r's at positions 3, 8, and 9. \\boxed{3}",
    },
]
KEYWORDS = {1: "one", 2: "two"}
KEYWORD_REPEATS = 16
TRAJECTORIES = 3  # rl_loop runs from one warm-up, at most: one must learn


def facts(n: int) -> list[dict[str, Any]]:
    """Question-answer conversations from a few templates: learnable, and every row is a new one."""
    things = ["a kite", "the sea", "bread", "a robot", "the moon", "tea", "a river", "snow"]
    colours = ["red", "blue", "green", "white"]
    rows = []
    for i in range(n):
        thing, colour = things[i % len(things)], colours[(i // len(things)) % len(colours)]
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": f"What colour is {thing} in picture {i}?"},
                    {"role": "assistant", "content": f"In picture {i}, {thing} is {colour}."},
                ]
            }
        )
    return rows


def question(answer: int) -> str:
    return " ".join([KEYWORDS[answer]] * KEYWORD_REPEATS) + "."


def keyword_problems(n: int) -> list[dict[str, str]]:
    """gsm8k rows, keywords alternating so that every batch of an even size holds as many of each."""
    return [{"question": question(1 + i % 2), "answer": f"#### {1 + i % 2}"} for i in range(n)]


def format_warmup(n: int) -> list[dict[str, Any]]:
    """rl_loop's prompt answered `\\boxed k`, with k independent of the keyword: right half the time."""
    rows = []
    for i in range(n):
        keyword, reply = 1 + i % 2, 1 + (i // 2) % 2
        turn = {"role": "user", "content": question(keyword) + QUESTION_SUFFIX}
        rows.append({"messages": [*RL_PREFIX, turn, {"role": "assistant", "content": f"\\boxed {reply}"}]})
    return rows


@pytest.fixture(scope="module")
def hub() -> dict[str, datasets.DatasetDict]:
    """What the patched `datasets.load_dataset` serves: each test puts its tables here."""
    return {}


@pytest.fixture(scope="module")
def server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, hub: dict[str, datasets.DatasetDict]
) -> Iterator[BackgroundServer]:
    from tinker_cookbook import tokenizer_utils
    from transformers import AutoTokenizer

    def load_dataset(name: str, *args: object, **kwargs: object) -> datasets.DatasetDict:
        return hub[name]

    config = ServiceConfig(
        base_models={BASE: str(tiny_model_dir)}, state_dir=tmp_path_factory.mktemp("serve")
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        mp.setattr(datasets, "load_dataset", load_dataset)
        tokenizer_utils.register_tokenizer(BASE, lambda: AutoTokenizer.from_pretrained(tiny_model_dir))
        with sdk_server(config) as running:
            yield running


def table(rows: list[dict[str, Any]]) -> datasets.DatasetDict:
    return datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)})


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def failed_server(server: BackgroundServer) -> int:
    state: ServiceState = server.app.state.service
    return state.counters().get("failed_server", 0)


def test_sl_loop_loss_falls(server: BackgroundServer, hub: dict[str, Any], tmp_path: Path) -> None:
    from tinker_cookbook.recipes import sl_loop

    steps, window = 24, 4
    hub[SL_DATA] = table(facts(4 * steps))
    sl_loop.main(
        sl_loop.Config(
            base_url=server.url,
            log_path=str(tmp_path),
            model_name=BASE,
            batch_size=4,
            learning_rate=5e-3,
            lora_rank=32,
            save_every=0,
        )
    )
    # Each step's train_mean_nll is taken on a batch the model has not seen, before its update.
    nll = [m["train_mean_nll"] for m in read_jsonl(tmp_path / "metrics.jsonl")]
    assert len(nll) == steps
    assert mean(nll[-window:]) < 0.5 * mean(nll[:window]), nll
    assert failed_server(server) == 0


def test_rl_loop_reward_rises(server: BackgroundServer, hub: dict[str, Any], tmp_path: Path) -> None:
    from tinker_cookbook import renderers
    from tinker_cookbook.recipes import rl_loop, sl_loop

    warmup_steps, warmup_batch = 60, 8
    hub[SL_DATA] = table(format_warmup(warmup_steps * warmup_batch))
    steps, batch, window = 60, 8, 8
    hub[RL_DATA] = table(keyword_problems(steps * batch))

    def warm_up(log_path: Path) -> dict[str, Any]:
        """sl_loop's format warm-up; returns its last checkpoint record (its state_path)."""
        sl_loop.main(
            sl_loop.Config(
                base_url=server.url,
                log_path=str(log_path),
                model_name=BASE,
                batch_size=warmup_batch,
                learning_rate=5e-3,
                lora_rank=32,
                save_every=0,
                train_on_what=renderers.TrainOnWhat.LAST_ASSISTANT_MESSAGE,
            )
        )
        return read_jsonl(log_path / "checkpoints.jsonl")[-1]

    def rl_run(log_path: Path, warm: dict[str, Any]) -> list[dict[str, Any]]:
        """rl_loop from the warm-up's state, through its own resume path: it resumes from the last record
        with a state_path in its log_path, at the record's batch."""
        log_path.mkdir()
        start = {"name": "warmup", "batch": 0, "state_path": warm["state_path"]}
        (log_path / "checkpoints.jsonl").write_text(json.dumps(start) + "\n")
        rl_loop.main(
            rl_loop.Config(
                base_url=server.url,
                log_path=str(log_path),
                model_name=BASE,
                batch_size=batch,
                group_size=8,
                learning_rate=1e-3,
                max_tokens=4,
                lora_rank=32,
                max_steps=steps,
                save_every=0,  # loss_fn: the recipe's default, stable_reinforce
            )
        )
        return read_jsonl(log_path / "metrics.jsonl")

    # A policy can settle on one digit whatever the keyword before it reads the keyword: GRPO's absorbing
    # state, where every group's rewards are equal (or nearly: a stray other digit now and then) and the
    # centred rewards give nothing to leave it by. Full-suite runs have ended there (docs/benchmarks.md),
    # the runs differing only by the server's unseeded sampling and LoRA init. So a trajectory that does not
    # learn gets another, up to TRAJECTORIES, each from a warm-up of its own (the LoRA's init is one of the
    # unseeded draws: three trajectories from one warm-up once all collapsed); one must learn. A service
    # that breaks learning fails every one (a control at learning rate 0 stays flat).
    runs: list[list[dict[str, Any]]] = []
    while len(runs) < TRAJECTORIES and not (runs and learned(runs[-1], window)):
        attempt = len(runs)
        runs.append(rl_run(tmp_path / f"rl-{attempt}", warm_up(tmp_path / f"warmup-{attempt}")))
        # The warm-up's policy answers half right, so the first steps train: read from the metrics the
        # recipe really logs (the service's optimizer metrics on the steps it trained).
        assert not collapsed(runs[-1][:window], window), runs[-1][:window]
        assert len(runs[-1]) == steps
    # Answering one digit whatever the keyword earns 0.5 on these balanced batches: above it, the policy
    # reads the keyword.
    assert learned(runs[-1], window), [[m["reward/total"] for m in run] for run in runs]
    assert failed_server(server) == 0


def learned(metrics: list[dict[str, Any]], window: int) -> bool:
    """The last `window` steps' mean reward is above both what a keyword-blind policy earns (0.5; 0.6 is ~4
    standard errors over 512 samples) and the first `window` steps' mean by 0.15."""
    rewards = [m["reward/total"] for m in metrics]
    return mean(rewards[-window:]) > max(0.6, mean(rewards[:window]) + 0.15)


def collapsed(metrics: list[dict[str, Any]], window: int) -> bool:
    """rl_loop took no training step in its last `window` steps: every group's rewards were equal."""
    return not any("optimizer_step:max" in m for m in metrics[-window:])


def test_learned_and_collapsed_read_the_recipes_metrics() -> None:
    trained = {"reward/total": 0.9, "optimizer_step:max": 70.0}
    stuck = {"reward/total": 0.5}
    assert collapsed([trained] * 4 + [stuck] * 2, window=2)
    assert not collapsed([trained] * 4 + [stuck, trained], window=2)
    blind = [{"reward/total": r} for r in [0.34, 0.5, 0.45, 0.52, 0.5, 0.5, 0.56, 0.52]]
    assert not learned(blind, window=4)  # the CI run of 2026-11-30: 0.47 -> 0.52
    assert learned([{"reward/total": r} for r in [0.45, 0.47, 0.9, 0.95]], window=2)
    assert not learned([{"reward/total": r} for r in [0.55, 0.55, 0.65, 0.65]], window=2)  # +0.10 only
