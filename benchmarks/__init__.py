"""Benchmarks with recorded results; each module has `main(argv) -> dict` and prints one JSON line last.

Also what their option parsers share. Standard library only: the TRL side imports this package inside TRL's
own environment, where inflight is not installed.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse `type=` for a count: a whole number of at least `minimum`. Anything else is argparse's
    usage and one error line naming the option (exit 2), before the benchmark builds anything."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse
