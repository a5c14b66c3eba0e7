"""What a run tells the researcher about their task, end to end on the tiny model: the summary's counts (steps
that updated nothing, failed evaluation rollouts), the progress of every long phase, and a task's optional
function that fails (`summarize`, `warmup_reply`) in one line.

Reference: docs/bring-your-own-task.md ("Running it": the summary keys and each phase's progress; "Optional
functions": a failing one stops the command in one line, a failing `summarize` after the run's own summary
is written) and STYLE.md ("bad input gets one clear line ... nothing silently dropped"). A QA pass found
each of these silent or a traceback.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import textwrap
from pathlib import Path
from typing import Any

import pytest

from inflight.cli import main

pytestmark = pytest.mark.slow
SMALL = ["progress=false", "mode=sync", "grpo.prompts_per_step=2", "grpo.group_size=2", "eval.num_episodes=4"]
# Problem `i` of each split: one policy turn; `REWARD` makes the reward of a reply.
TASK = """
def load_problems(split):
    return [{"split": split, "i": i} for i in range(20 if split == "train" else 4)]

async def generate_rollout(ctx, problem):
    chat = ctx.chat()
    chat.user(f"Problem {problem['i']}.")
    reply = await chat.assistant()
    return chat.to_rollout(REWARD(problem, reply))

def REWARD(problem, reply):
    return float(len(reply) % 3)
"""


def write_task(directory: Path, name: str, body: str = "") -> str:
    path = directory / f"{name}.py"
    path.write_text(textwrap.dedent(TASK) + textwrap.dedent(body))
    return str(path)


def run(target: str, run_dir: Path, model_dir: Path, *overrides: str) -> int:
    return main(["run", target, *SMALL, f"model.path={model_dir}", *overrides, "--run-dir", str(run_dir)])


def said(err: str) -> list[str]:
    """inflight's own lines on stderr (transformers may draw its loading bar there too)."""
    return [line for line in err.splitlines() if line.startswith("inflight: ")]


def summary(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "summary.json").read_text())


# -- the summary's counts ---------------------------------------------------------------------------------


def test_a_run_whose_steps_updated_nothing_counts_them_and_says_why_that_happens(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every group's rewards equal (a constant reward): every step is skipped. Before, the summary said
    `"steps": 2` and nothing else."""
    target = write_task(tmp_path, "constant", "def REWARD(problem, reply):\n    return 1.0\n")
    run_dir = tmp_path / "run"
    assert run(target, run_dir, tiny_model_dir, "grpo.steps=2") == 0
    out, err = capsys.readouterr()
    first = json.loads(out.strip().splitlines()[-1])
    assert (first["steps"], first["steps_skipped"]) == (2, 2)
    [note] = said(err)
    assert note.startswith("inflight: 2 of the run's 2 steps updated nothing (steps_skipped): ")
    for cause in ("sampling.max_tokens_per_turn=", "warmup.sft_steps=0", "the reward is the same"):
        assert cause in note

    # A resume counts the steps skipped before it too (read from metrics.jsonl).
    assert run(target, run_dir, tiny_model_dir, "grpo.steps=3") == 0
    assert (summary(run_dir)["steps"], summary(run_dir)["steps_skipped"]) == (3, 3)


def test_the_summary_counts_the_evaluation_rollouts_that_failed(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Test problem 1 is one the task cannot play: the returns average the other 3 of `eval_problems`=4,
    and the summary says so (before: only `test/rollout_errors` in metrics.jsonl)."""
    body = """
    def REWARD(problem, reply):
        if problem["split"] == "test" and problem["i"] == 1:
            raise ValueError("too long for the context")
        return float(len(reply) % 3)
    """
    run_dir = tmp_path / "run"
    assert run(write_task(tmp_path, "one_bad", body), run_dir, tiny_model_dir, "grpo.steps=1") == 0
    got = summary(run_dir)
    assert got["eval_problems"] == got["eval_problems_sampled"] == 4
    errors = (
        "eval_errors_initial",
        "eval_errors_final",
        "eval_errors_initial_sampled",
        "eval_errors_final_sampled",
    )
    assert [got[key] for key in errors] == [1, 1, 1, 1]


# -- progress ---------------------------------------------------------------------------------------------


def test_the_warmup_and_the_evaluations_show_their_progress(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without a terminal (captured here), as the training does: a line at the first step (or episode), and
    the last; none with progress=false. Before, an 80 s warm-up and a 17 s evaluation printed nothing."""
    target = write_task(
        tmp_path, "shown", "def warmup_reply(seen, rng):\n    return rng.choice(['a', 'bb'])\n"
    )
    warm = ["grpo.steps=1", "warmup.sft_steps=2", "warmup.sft_batch_size=2"]
    assert run(target, tmp_path / "run", tiny_model_dir, *warm, "progress=true") == 0
    err = capsys.readouterr().err
    shown = [re.sub(r"  .*", "", line) for line in err.splitlines() if line.startswith("shown (")]
    assert shown == [
        "shown (warm-up): step 1/2",
        "shown (warm-up): step 2/2",
        "shown (initial evaluation, greedy): episode 1/4",
        "shown (initial evaluation, greedy): episode 4/4",
        "shown (initial evaluation, sampled): episode 1/4",
        "shown (initial evaluation, sampled): episode 4/4",
        "shown (sync GRPO): step 1/1",
        "shown (final evaluation, greedy): episode 1/4",
        "shown (final evaluation, greedy): episode 4/4",
        "shown (final evaluation, sampled): episode 1/4",
        "shown (final evaluation, sampled): episode 4/4",
    ], err

    assert run(target, tmp_path / "quiet", tiny_model_dir, *warm) == 0  # SMALL says progress=false
    assert not [line for line in capsys.readouterr().err.splitlines() if line.startswith("shown (")]


# -- a task's optional functions that fail ------------------------------------------------------------------

SUMMARIZE = {
    "raises": ("raise KeyError('solved')", "summarize(cfg, initial, final) raised KeyError: 'solved'"),
    "a_list": (
        "return [1, 2]",
        "summarize(cfg, initial, final) must return a dict of str keys to JSON values, not a list: [1, 2]",
    ),
    "built_in_keys": (
        "return {'steps': -1, 'return_final': 123.0, 'mine': 1}",
        "summarize(cfg, initial, final) returned keys the summary has already (return_final, steps): give "
        "them names of their own",
    ),
}


@pytest.mark.parametrize("case", sorted(SUMMARIZE))
def test_a_summarize_that_fails_is_one_line_after_the_runs_own_summary_is_written(
    case: str, tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    body, error = SUMMARIZE[case]
    target = write_task(tmp_path, "summ", f"def summarize(cfg, initial, final):\n    {body}\n")
    run_dir = tmp_path / "run"
    assert run(target, run_dir, tiny_model_dir, "grpo.steps=1") == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    [line] = said(err)
    assert line.startswith(
        f"inflight: error: summ: {error}; the run's own summary is in {run_dir / 'summary.json'}"
    )
    # Nothing of the run is lost: its own keys, as computed (not the task's), and its curves.
    written = summary(run_dir)
    assert written["steps"] == 1 and written["return_final"] is not None and written["return_final"] != 123.0
    assert written["summarize_error"] == f"summ: {error}" and "mine" not in written
    assert (run_dir / "curves.png").is_file()
    if case != "raises":
        return

    # Fixed, the same command evaluates the final policy again and adds the task's keys; then it is done.
    write_task(tmp_path, "summ", "def summarize(cfg, initial, final):\n    return {'mine': 1}\n")
    assert run(target, run_dir, tiny_model_dir, "grpo.steps=1") == 0
    fixed = summary(run_dir)
    assert fixed["mine"] == 1 and "summarize_error" not in fixed and fixed["steps"] == 1
    assert run(target, run_dir, tiny_model_dir, "grpo.steps=1") == 0
    assert "nothing to do" in capsys.readouterr().err


ENV_TASK = """
from typing import Any
from inflight.envs import Environment, State, TextAction, TextObservation

class Say(Environment[TextAction, TextObservation, State]):
    def reset(self, seed=None, episode_id=None, **kw: Any) -> TextObservation:
        return TextObservation(prompt="Say something.")

    def step(self, action: TextAction, timeout_s=None, **kw: Any) -> TextObservation:
        return TextObservation(prompt="", done=True, reward=float(len(action.text) % 2))

    @property
    def state(self) -> State:
        return State()
"""


@pytest.mark.parametrize(
    ("kind", "reply", "error"),
    [
        ("rollout", "return None", "warmup_reply(seen, rng) must return the reply as a str, not a NoneType"),
        ("rollout", "raise ValueError('no reply')", "warmup_reply(seen, rng) raised ValueError: no reply"),
        ("env", "return None", "warmup_reply(seen, rng) must return the reply as a str, not a NoneType"),
    ],
)
def test_a_warmup_reply_that_fails_is_one_line_naming_it(
    kind: str,
    reply: str,
    error: str,
    tiny_model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before: a None reply failed deep in the tokenizer (a ValueError traceback, or every warm-up rollout
    counted as failed); a raising one was counted as a failed rollout like the task's own failures."""
    hook = f"\ndef warmup_reply(seen, rng):\n    {reply}\n"
    path = tmp_path / "wu.py"
    path.write_text(textwrap.dedent(TASK if kind == "rollout" else ENV_TASK) + hook)
    run_dir = tmp_path / "run"
    overrides = ["grpo.steps=1", "warmup.sft_steps=2", "warmup.sft_batch_size=2"]
    with caplog.at_level(logging.WARNING, logger="inflight.orchestrator.guard"):
        assert run(str(path), run_dir, tiny_model_dir, *overrides) == 2
    err = capsys.readouterr().err
    # No rollout counted as failed. Only the guard's records count: a worker process running the whole
    # suite may hold another test's tinker SDK client whose heartbeat logs that its server has gone.
    guard = [r.getMessage() for r in caplog.records if r.name == "inflight.orchestrator.guard"]
    assert "Traceback" not in err and not guard, guard
    assert said(err) == [f"inflight: error: wu: {error}" + (" (None)" if "None" in error else "")]
    assert not run_dir.exists()  # it failed before its first step


def test_a_failed_warmup_rollout_names_the_warmup_and_its_train_problem(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: `rollout failed: problem 1027901637` (the warm-up's random draw, not a problem's index)."""
    body = """
    def REWARD(problem, reply):
        if problem["split"] == "train" and problem["i"] % 10 == 3:
            raise ValueError("bad problem")
        return float(len(reply) % 3)

    def warmup_reply(seen, rng):
        return "a"
    """
    overrides = [
        "grpo.steps=1",
        "warmup.sft_steps=3",
        "warmup.sft_batch_size=16",
        "rollout.max_failed_frac=1",
    ]
    with caplog.at_level(logging.WARNING, logger="inflight.orchestrator.guard"):
        assert run(write_task(tmp_path, "wu_fails", body), tmp_path / "run", tiny_model_dir, *overrides) == 0
    logged = [r.getMessage() for r in caplog.records if "(warm-up)" in r.getMessage()]
    assert logged, [r.getMessage() for r in caplog.records]
    for message in logged:
        problem = int(re.match(r"rollout failed \(warm-up\): problem (\d+), sample 0: ", message)[1])  # type: ignore[index]
        assert problem in (3, 13), message  # of the 20 train problems


# -- an environment that fails in the warm-up ---------------------------------------------------------------

FLAKY_ENV_TASK = """
from typing import Any
from inflight.envs import Environment, State, TextAction, TextObservation

class Flaky(Environment[TextAction, TextObservation, State]):
    failures = FAILURES  # how many steps raise: the process's first ones, the warm-up's

    def reset(self, seed=None, episode_id=None, **kw: Any) -> TextObservation:
        return TextObservation(prompt="Say something.")

    def step(self, action: TextAction, timeout_s=None, **kw: Any) -> TextObservation:
        if Flaky.failures > 0:
            Flaky.failures -= 1
            raise RuntimeError("env step exploded")
        return TextObservation(prompt="", done=True, reward=float(len(action.text) % 2))

    def warmup_reply(self, obs: TextObservation, rng: Any) -> str:
        return rng.choice(["a", "bb"])

    @property
    def state(self) -> State:
        return State()
"""
WARM = ["warmup.sft_steps=2", "warmup.sft_batch_size=4", "warmup.sft_group_size=2"]


def warmup_failures(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("rollout failed (warm-up)")]


def free_port() -> int:
    """A loopback port nothing listens on (bound and released at once)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_an_environment_that_fails_in_the_warm_up_stops_the_run_in_one_line(
    tiny_model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A QA pass: an Env's `step` that raises during the warm-up was a ~60-line traceback and exit 1 (a
    rollout function's warm-up already went through the guard). Now each failed episode is a log line, and
    past rollout.max_failed_frac the run stops in one line, exit 2, leaving no run directory."""
    path = tmp_path / "exploding.py"
    path.write_text(FLAKY_ENV_TASK.replace("FAILURES", "10**6"))
    run_dir = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="inflight.orchestrator.guard"):
        assert run(str(path), run_dir, tiny_model_dir, "grpo.steps=1", *WARM) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert said(err)[-1] == (
        "inflight: error: stopped: 4 of 4 warm-up rollouts failed, more than rollout.max_failed_frac=0.5; "
        "the most common error (4x): RuntimeError: env step exploded"
    )
    failures = warmup_failures(caplog)
    assert len(failures) == 4, failures
    for message in failures:  # the episode's seed (its problem), its place in its group of 2
        pattern = r"rollout failed \(warm-up\): problem \d+, sample [01]: RuntimeError: env step exploded"
        assert re.match(pattern, message), message
    assert not run_dir.exists()


def test_an_openenv_server_that_is_not_there_stops_the_warm_up_in_one_line(
    tiny_model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The QA pass's repro: `inflight run blackjack env.name=openenv:URL` with nothing at URL was
    OpenEnvError's traceback from the warm-up's first reset."""
    port = free_port()
    overrides = [f"env.name=openenv:http://127.0.0.1:{port}", "grpo.steps=2", *WARM]
    with caplog.at_level(logging.WARNING, logger="inflight.orchestrator.guard"):
        assert run("blackjack", tmp_path / "run", tiny_model_dir, *overrides) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert said(err)[-1].startswith(
        "inflight: error: stopped: 4 of 4 warm-up rollouts failed, more than rollout.max_failed_frac=0.5; "
        f"the most common error (4x): OpenEnvError: cannot open an OpenEnv session at ws://127.0.0.1:{port}/ws"
    ), err
    assert len(warmup_failures(caplog)) == 4


def test_a_warm_up_episode_whose_environment_fails_is_left_out_and_the_warm_up_goes_on(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """One failed episode of 8 (under rollout.max_failed_frac): counted, logged, left out of its step; both
    warm-up steps train and the run finishes."""
    path = tmp_path / "flaky_once.py"
    path.write_text(FLAKY_ENV_TASK.replace("FAILURES", "1"))
    run_dir = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="inflight.orchestrator.guard"):
        assert run(str(path), run_dir, tiny_model_dir, "grpo.steps=1", *WARM) == 0
    [failure] = warmup_failures(caplog)
    assert failure.endswith("RuntimeError: env step exploded")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["phase"] == "warmup"] == [0, 1]


# -- metrics.jsonl ------------------------------------------------------------------------------------------


def test_each_evaluation_row_says_which_evaluation_it_is_and_over_how_many_episodes(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A QA pass: at the last step metrics.jsonl held two `phase: eval` rows, the periodic evaluation over
    eval.num_episodes_during and the final one over eval.num_episodes, and nothing told them apart."""
    target = write_task(tmp_path, "evals")
    run_dir = tmp_path / "run"
    during = ["eval.every_steps=2", "eval.num_episodes_during=2"]
    assert run(target, run_dir, tiny_model_dir, "grpo.steps=2", *during) == 0  # SMALL: eval.num_episodes=4
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["eval"], r["episodes"]) for r in rows if r["phase"] == "eval"]
    assert evals == [(0, "initial", 4), (2, "during", 2), (2, "final", 4)]
    assert all("test/return_greedy" in r for r in rows if r["phase"] == "eval")
    # The summary's initial and final returns are those rows' (its final one, not the periodic one).
    [final] = [r for r in rows if r.get("eval") == "final"]
    assert summary(run_dir)["return_final"] == round(final["test/return_greedy"], 4)


def test_the_initial_evaluation_plays_the_first_num_episodes_initial_test_problems(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """eval.num_episodes_initial: the evaluation before training plays the first N of the final one's test
    problems (BlackJack's untrained policy made its 10,000 hands a run's costliest evaluation); 0 skips it.
    A test problem's reward is its index, so each return says which problems were played."""
    body = """
    def REWARD(problem, reply):
        return float(problem["i"]) if problem["split"] == "test" else float(len(reply) % 3)
    """
    target = write_task(tmp_path, "initial_share", body)
    run_dir = tmp_path / "run"
    assert run(target, run_dir, tiny_model_dir, "grpo.steps=1", "eval.num_episodes_initial=2") == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = {r["eval"]: r for r in rows if r["phase"] == "eval"}
    assert (evals["initial"]["episodes"], evals["final"]["episodes"]) == (2, 4)
    assert evals["initial"]["test/return_greedy"] == evals["initial"]["test/return"] == 0.5  # problems 0, 1
    got = summary(run_dir)
    assert (got["return_initial"], got["return_final"]) == (0.5, 1.5)  # the final one: problems 0-3
    assert (got["eval_problems_initial"], got["eval_problems"]) == (2, 4)

    skipped = tmp_path / "skipped"
    assert run(target, skipped, tiny_model_dir, "grpo.steps=1", "eval.num_episodes_initial=0") == 0
    rows = [json.loads(line) for line in (skipped / "metrics.jsonl").read_text().splitlines()]
    assert [r["eval"] for r in rows if r["phase"] == "eval"] == ["final"]
    got = summary(skipped)
    assert (got["return_initial"], got["return_final"], got["eval_problems_initial"]) == (None, 1.5, 0)
