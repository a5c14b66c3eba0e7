"""Recipes: presets (Python functions returning a RunConfig) plus the recipe's own evaluation.

Each recipe module exposes `preset() -> RunConfig` and `main(cfg: RunConfig) -> dict`.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from inflight.errors import UserError

RECIPES: dict[str, str] = {
    "blackjack": "inflight.recipes.blackjack",
    "arithmetic": "inflight.recipes.arithmetic",
    "math": "inflight.recipes.math",
    "code": "inflight.recipes.code",
    "tools": "inflight.recipes.tools",
    "guess_number": "inflight.recipes.guess_number",
}


def get_recipe(name: str) -> ModuleType:
    if name not in RECIPES:
        known = ", ".join(sorted(RECIPES))
        raise UserError(f"unknown recipe {name!r}; known recipes: {known} (e.g. `inflight run blackjack`)")
    return importlib.import_module(RECIPES[name])
