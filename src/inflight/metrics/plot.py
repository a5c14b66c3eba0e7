"""`inflight plot RUN_DIR`: a PNG of the reward and loss curves from the run's metrics.jsonl."""

from __future__ import annotations

from pathlib import Path

from inflight.metrics.logger import read_metrics

PLOT_FILE = "curves.png"


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    all_rows = read_metrics(run_dir)
    rows = [r for r in all_rows if r.get("phase") == "train"]
    evals = [r for r in all_rows if r.get("phase") == "eval"]
    out_path = Path(out) if out else Path(run_dir) / PLOT_FILE
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in (
        (axes[0], "reward_mean", "reward: training samples, held-out evaluations"),
        (axes[1], "loss", "loss"),
    ):
        points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        if points:
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, lw=0.8, alpha=0.5, label=key)
            window = max(1, len(ys) // 20)
            if window > 1:
                smooth = [
                    sum(ys[max(0, i - window + 1) : i + 1]) / len(ys[max(0, i - window + 1) : i + 1])
                    for i in range(len(ys))
                ]
                ax.plot(xs, smooth, lw=2, label=f"{key} (moving mean, {window} steps)")
        if key == "reward_mean":  # held-out evaluations, when the recipe logs them
            for eval_key, marker, name in (("return", "o", "sampled"), ("return_greedy", "s", "greedy")):
                pts = [(r["step"], r[eval_key]) for r in evals if r.get(eval_key) is not None]
                if pts:
                    ex, ey = zip(*pts, strict=True)
                    ax.plot(ex, ey, marker=marker, ls="--", label=f"held-out return ({name})")
        if ax.has_data():
            ax.legend(loc="best", fontsize=8)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(str(Path(run_dir).name))
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return out_path
