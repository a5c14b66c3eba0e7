"""What makes a write survive a power loss, shared by every writer that promises it (checkpoints, the
result stream's file log, weight files): a file's bytes, or a directory's names, fsynced."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: Path) -> None:
    """fsync `path`: a file's contents, or a directory's entries (a new, renamed or deleted name is durable
    only once its directory is synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
