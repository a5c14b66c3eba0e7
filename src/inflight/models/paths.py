"""Whether a model name is a local directory or a hub id: path checks only, no torch or transformers, so a
command given a missing model directory answers before anything heavy is imported.

Owns the reading of a name (local path or "org/name" hub id) and the one-line error for a missing path;
loading is `loader.py`'s.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path

from inflight.errors import UserError

# What the Hugging Face hub accepts as a repository id: "name" or "org/name", each part letters, digits and
# ._- (not starting with . or -), no "--" or "..". A name outside this cannot be a hub id.
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")


def _looks_like_path(name_or_path: str | Path) -> bool:
    # Hub ids are "name" or "org/name"; anything absolute, relative-dotted, home-based, deeper, spelled in
    # characters a hub id cannot have, or existing on disk (a file given by mistake) is a path.
    if isinstance(name_or_path, Path):
        return True
    text = str(name_or_path)
    if text.startswith(("/", ".", "~")) or Path(text).exists():
        return True
    if not _HUB_ID.fullmatch(text) or "--" in text or ".." in text:
        return True
    # So is "a/b" whose first part is a directory here (`models/tinyy` beside ./models/): a misspelt local
    # path, far likelier than a hub org named like a local directory, which read as a hub id fails only
    # after a minute of download retries when offline. A hub id already in the Hugging Face cache stays one.
    first, sep, _ = text.partition("/")
    return bool(sep) and Path(first).is_dir() and not in_hub_cache(text)


def in_hub_cache(repo_id: str) -> bool:
    """Whether the Hugging Face cache holds (some revision of) the model `repo_id`; no network."""
    from huggingface_hub import constants  # paths and environment only: no HTTP client, no torch

    return (Path(constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}").is_dir()


def build_hint(path: str) -> str:
    return f"build one with `inflight model tiny --out {path}`"


def _missing(local: Path) -> str:
    """Why `local` is no model directory, and the fix: the directory a file is in, a close sibling's name."""
    if local.is_file():
        if (local.parent / "config.json").is_file():  # a file of a model directory: name the directory
            where = f"name its directory, {local.parent}"
            return f"model directory {str(local)!r} is a file, not a directory: {where}"
        return (
            f"model directory {str(local)!r} is a file, not a directory: name a Hugging Face model directory "
            "(config.json, weights and tokenizer files)"
        )
    if local.exists():
        return f"model directory {str(local)!r} is not a directory: name a Hugging Face model directory"
    siblings = [p.name for p in local.parent.iterdir()] if local.parent.is_dir() else []
    near = difflib.get_close_matches(local.name, siblings, n=1, cutoff=0.75)
    guess = f" (did you mean {str(local.parent / near[0])!r}?)" if near else ""
    return f"model directory {str(local)!r} does not exist{guess}: {build_hint(str(local))}"


def resolve(name_or_path: str | Path) -> str:
    """Return an existing local directory or a hub id; raise UserError for a path that is not a directory."""
    local = Path(name_or_path).expanduser()
    if local.is_dir():
        return str(local)
    if _looks_like_path(name_or_path):
        raise UserError(_missing(local))
    return str(name_or_path)
