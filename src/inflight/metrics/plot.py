"""`inflight plot RUN_DIR`: a PNG of any run's curves from its metrics.jsonl (finished, running or resumed):
reward (training, and held-out evaluations however the task names them), loss, and the off-policy health
of the samples. A curve whose metric the run never logged is left out, never an error."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from inflight.metrics.logger import read_metrics

PLOT_FILE = "curves.png"

# Held-out evaluations: the built-in recipes' `return`/`return_greedy`, and `test/...` keys of tasks that
# evaluate on their test split.
EVAL_KEYS = (("return", "o", "held-out return (sampled)"), ("return_greedy", "s", "held-out return (greedy)"))
OFFPOLICY_KEYS = ("ess", "offpolicy_masked_frac", "logprob_diff_p99_abs")


def _points(rows: Sequence[dict[str, Any]], key: str) -> list[tuple[float, float]]:
    return [(r["step"], r[key]) for r in rows if isinstance(r.get(key), int | float)]


def _plot_smoothed(ax: Any, points: list[tuple[float, float]], label: str) -> None:
    xs, ys = zip(*points, strict=True)
    ax.plot(xs, ys, lw=0.8, alpha=0.5, label=label)
    window = max(1, len(ys) // 20)
    if window > 1:
        smooth = [
            sum(ys[max(0, i - window + 1) : i + 1]) / len(ys[max(0, i - window + 1) : i + 1])
            for i in range(len(ys))
        ]
        ax.plot(xs, smooth, lw=2, label=f"{label} (moving mean, {window} steps)")


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    all_rows = read_metrics(run_dir)
    # A run that only warmed up (or died before its first RL step) still has a loss curve.
    rows = [r for r in all_rows if r.get("phase") == "train"] or [
        r for r in all_rows if r.get("phase") == "warmup"
    ]
    evals = [r for r in all_rows if r.get("phase") in ("eval", "test")]
    out_path = Path(out) if out else Path(run_dir) / PLOT_FILE
    fig, (reward_ax, loss_ax, offpolicy_ax) = plt.subplots(1, 3, figsize=(16, 4))

    if points := _points(rows, "reward_mean"):
        _plot_smoothed(reward_ax, points, "reward_mean")
    test_keys = sorted(
        {k for r in evals for k in r if k.startswith("test/") and ("reward" in k or "return" in k)}
    )
    for key, marker, name in (*EVAL_KEYS, *((k, "d", k) for k in test_keys)):
        if pts := _points(evals, key):
            ex, ey = zip(*pts, strict=True)
            reward_ax.plot(ex, ey, marker=marker, ls="--", label=name)
    reward_ax.set_title("reward: training samples, held-out evaluations")

    if points := _points(rows, "loss"):
        _plot_smoothed(loss_ax, points, "loss")
    loss_ax.set_title("loss")

    for key in OFFPOLICY_KEYS:
        if pts := _points(rows, key):
            ox, oy = zip(*pts, strict=True)
            offpolicy_ax.plot(ox, oy, lw=1, label=key)
    offpolicy_ax.set_title("off-policy: ESS, masked fraction, |gap| p99")

    for ax in (reward_ax, loss_ax, offpolicy_ax):
        if ax.has_data():
            ax.legend(loc="best", fontsize=8)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(str(Path(run_dir).name))
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return out_path
