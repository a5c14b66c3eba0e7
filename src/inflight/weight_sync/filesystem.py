"""Filesystem weight sync: one safetensors file per version in a shared directory, plus a `LATEST` pointer.

Both files are written under a temporary name and renamed into place, so a receiver (any process, any
host sharing the directory) sees a whole file or none. Old versions beyond `keep_last` are deleted; a
receiver that loses that race re-reads `LATEST`. It knows nothing of engines or trainers.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field
from safetensors import safe_open
from safetensors.torch import save_file

from inflight.durable import fsync_path
from inflight.types import WeightUpdate
from inflight.weight_sync.base import (
    PublishStats,
    WeightPublisher,
    WeightReceiver,
    check_version,
    state_nbytes,
)

LATEST = "LATEST"
_FILE = re.compile(r"^weights-(\d{8,})\.safetensors$")
_FORMAT = "inflight-weights-1"


def weights_path(root: str | Path, version: int) -> Path:
    return Path(root) / f"weights-{version:08d}.safetensors"


class FilesystemSyncConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    root: str
    keep_last: int = Field(default=2, ge=1)  # versions kept on disk; >= 2 gives slow readers some slack
    # Atomic rename alone already hides partial files from readers; fsync adds durability across a power
    # loss, which ephemeral sync files rarely need (trainer checkpoints are separate).
    fsync: bool = False


def _writable_copy(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous tensors with no shared storage (safetensors refuses tied weights: clone repeats)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in state_dict.items():
        t = tensor.detach().cpu().contiguous()
        ptr = t.untyped_storage().data_ptr()
        out[name] = t.clone() if ptr in seen else t
        seen.add(ptr)
    return out


class FilesystemPublisher(WeightPublisher):
    def __init__(self, config: FilesystemSyncConfig) -> None:
        self.config = config
        self.root = Path(config.root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._last_version: int | None = None

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> PublishStats:
        check_version(version, self._last_version)
        t0 = time.perf_counter()
        tensors = _writable_copy(state_dict)
        final = weights_path(self.root, version)
        tmp = self.root / f".{final.name}.{os.getpid()}.tmp"
        save_file(tensors, str(tmp), metadata={"version": str(version), "format": _FORMAT})
        self._place(tmp, final)
        pointer_tmp = self.root / f".{LATEST}.{os.getpid()}.tmp"
        pointer_tmp.write_text(f"{version}\n")
        # The pointer moves only after the file it names is in place: LATEST never names a missing file
        # (until garbage collection, which readers handle).
        self._place(pointer_tmp, self.root / LATEST)
        if self.config.fsync:
            fsync_path(self.root)
        self._collect_garbage(version)
        self._last_version = version
        self.last_stats = PublishStats(version, state_nbytes(tensors), len(tensors), time.perf_counter() - t0)
        return self.last_stats

    def _place(self, tmp: Path, final: Path) -> None:
        if self.config.fsync:
            fsync_path(tmp)
        os.replace(tmp, final)

    def _collect_garbage(self, newest: int) -> None:
        versions = sorted(int(m.group(1)) for p in self.root.iterdir() if (m := _FILE.match(p.name)))
        for old in [v for v in versions if v != newest][: max(0, len(versions) - self.config.keep_last)]:
            weights_path(self.root, old).unlink(missing_ok=True)


class FilesystemReceiver(WeightReceiver):
    """Polls `LATEST` (a tiny read) and loads the file it names when the version is new."""

    def __init__(self, config: FilesystemSyncConfig) -> None:
        self.root = Path(config.root)
        self._version = -1

    @property
    def latest_version(self) -> int:
        return self._version

    def poll(self) -> WeightUpdate | None:
        for _ in range(3):  # a publisher may delete the named file between our two reads: look again
            version = self._pointer()
            if version is None or version <= self._version:
                return None
            try:
                tensors = self._load(version)
            except FileNotFoundError:
                continue
            self._version = version
            return WeightUpdate(version, tensors)
        return None

    def _pointer(self) -> int | None:
        try:
            text = (self.root / LATEST).read_text()
        except FileNotFoundError:
            return None
        try:
            return int(text)
        except ValueError:
            raise RuntimeError(
                f"{self.root / LATEST}: expected a version number, found {text[:40]!r}"
            ) from None

    def _load(self, version: int) -> dict[str, torch.Tensor]:
        path = weights_path(self.root, version)
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("version") != str(version) or meta.get("format") != _FORMAT:
                raise RuntimeError(f"{path}: metadata {meta} does not describe version {version}")
            return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
