"""The `inflight` command: run | model tiny | bench | plot.

Heavy imports (torch, transformers) happen inside the subcommands so `--help` is instant. Errors a
user can fix print one line and exit with code 2.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

from inflight.errors import UserError

BENCHMARKS = ("engine", "grpo")


def _cmd_run(args: argparse.Namespace) -> int:
    from inflight.config import apply_overrides, list_keys
    from inflight.recipes import get_recipe

    if args.list_keys:
        print("\n".join(list_keys()))
        return 0
    if not args.recipe:
        raise UserError("missing RECIPE: try `inflight run blackjack`")
    recipe = get_recipe(args.recipe)
    overrides = list(args.overrides)
    if args.run_dir:
        overrides.append(f"run_dir={json.dumps(args.run_dir)}")
    cfg = apply_overrides(recipe.preset(), overrides)
    summary = recipe.main(cfg)
    print(json.dumps(summary))
    return 0


def _cmd_model_tiny(args: argparse.Namespace) -> int:
    from inflight.models import build_tiny

    out = build_tiny(args.out, preset=args.preset, seed=args.seed)
    print(json.dumps({"model_dir": str(out), "preset": args.preset, "seed": args.seed}))
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    # Benchmarks live in the repository's benchmarks/ folder (next to src/), not in the package.
    root = Path(__file__).resolve().parents[2]
    if not (root / "benchmarks").is_dir():
        raise UserError(f"benchmarks/ not found next to {root / 'src'}: run from a source checkout")
    sys.path.insert(0, str(root))
    module = importlib.import_module(f"benchmarks.{args.name}")
    module.main(args.args)  # each benchmark prints its result as one JSON line, last
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    from inflight.metrics.plot import plot_run

    print(plot_run(args.run_dir, args.out))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inflight", description="Asynchronous RL for LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser(
        "run",
        help="train with a recipe",
        description="Train with a recipe, e.g. `inflight run blackjack grpo.steps=100 trainer.lr=3e-4`. "
        "Overrides are dotted config keys (see --list-keys). Prints one JSON summary line at the end.",
    )
    run.add_argument("recipe", nargs="?", help="recipe name: blackjack")
    run.add_argument("overrides", nargs="*", help="config overrides, key=value")
    run.add_argument("--run-dir", help="where metrics, checkpoints and plots go (default runs/RECIPE-TIME)")
    run.add_argument("--list-keys", action="store_true", help="print every config key and exit")
    run.set_defaults(func=_cmd_run)

    model = sub.add_parser("model", help="build models")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    tiny = model_sub.add_parser(
        "tiny", help="build a small Qwen2 model + tokenizer locally, deterministically"
    )
    tiny.add_argument("--out", required=True, help="output directory (a Hugging Face model directory)")
    tiny.add_argument(
        "--preset", choices=["tiny", "small"], default="tiny", help="tiny: <=5M params; small: ~20M"
    )
    tiny.add_argument("--seed", type=int, default=0, help="same seed -> byte-identical files")
    tiny.set_defaults(func=_cmd_model_tiny)

    bench = sub.add_parser("bench", help="run a benchmark; prints one JSON line last")
    bench.add_argument("name", choices=BENCHMARKS)
    bench.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the benchmark (see its --help)")
    bench.set_defaults(func=_cmd_bench)

    plot = sub.add_parser("plot", help="write a PNG of a run's reward and loss curves")
    plot.add_argument("run_dir")
    plot.add_argument("--out", help="PNG path (default RUN_DIR/curves.png)")
    plot.set_defaults(func=_cmd_plot)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except UserError as e:
        print(f"inflight: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("inflight: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
