"""Whether a model name is a local directory or a hub id: path checks only, no torch or transformers, so a
command given a missing model directory answers before anything heavy is imported.

Owns the reading of a name (local path or "org/name" hub id) and the one-line error for a missing path;
loading is `loader.py`'s.
"""

from __future__ import annotations

from pathlib import Path

from inflight.errors import UserError


def _looks_like_path(name_or_path: str | Path) -> bool:
    # Hub ids are "name" or "org/name"; anything absolute, relative-dotted, home-based, deeper or existing
    # on disk (a file given by mistake) is a path.
    if isinstance(name_or_path, Path):
        return True
    text = str(name_or_path)
    return text.startswith(("/", ".", "~")) or text.count("/") >= 2 or Path(text).exists()


def build_hint(path: str) -> str:
    return f"build one with `inflight model tiny --out {path}`"


def resolve(name_or_path: str | Path) -> str:
    """Return an existing local directory or a hub id; raise UserError for a path that is not a directory."""
    local = Path(name_or_path).expanduser()
    if local.is_dir():
        return str(local)
    if _looks_like_path(name_or_path):
        problem = "is not a directory" if local.exists() else "does not exist"
        raise UserError(f"model directory {str(local)!r} {problem}: {build_hint(str(local))}")
    return str(name_or_path)
