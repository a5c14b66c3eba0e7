"""Package exports that load on first use (PEP 562), so that importing a light module of a package (a
config, a constant) does not import the package's torch-heavy modules: `inflight.config` imports settings
from `inference/`, `trainer/` and `models/`, and the CLI must answer a typo without loading torch."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, where: dict[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` for `package`: attribute NAME is `where[NAME]`'s NAME (a module path relative
    to the package, e.g. ".loader"), imported the first time it is asked for."""

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module, package), name)

    return __getattr__
