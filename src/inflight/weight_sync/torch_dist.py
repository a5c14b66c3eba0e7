"""torch.distributed weight sync (gloo on CPU): rank 0 (the trainer) broadcasts to inference ranks 1..N-1.

One publish, in order:
  1. announce  rank 0 writes `announce/<n>` = {version, layout id} to the TCP store (and the layout, a list
               of per-dtype buckets of (name, shape, offset), once per new layout); receivers poll for it,
               so no collective ever waits through a trainer step;
  2. header    broadcast [n, version, layout id, buckets] so every rank checks it joined the same publish;
  3. buckets   parameters packed into flat buffers of at most `bucket_mb` per dtype, one broadcast each;
               the next bucket is packed while the previous one is on the wire.
Receivers unpack in a background thread and expose whole updates only. The process group is built
directly on its own store (not the default group), so it coexists with a trainer's own DDP group.
It knows nothing of engines or trainers.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field

from inflight.types import WeightUpdate
from inflight.weight_sync.base import (
    PublishStats,
    WeightPublisher,
    WeightReceiver,
    check_version,
    state_nbytes,
)

_PREFIX = "inflight/weight_sync"
_CLOSE = "close"

Layout = list[dict[str, Any]]  # buckets: {"dtype": str, "numel": int, "params": [[name, shape, offset]]}


class TorchDistSyncConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"  # where rank 0's TCP store listens
    port: int = Field(ge=1, le=65535)
    world_size: int = Field(ge=2)  # the trainer plus the inference ranks
    bucket_mb: float = Field(default=256.0, gt=0)
    timeout_s: float = Field(default=300.0, gt=0)  # joining the group, and one publish's collectives
    poll_interval_s: float = Field(default=0.005, gt=0)  # receivers' polling of the store for announcements


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise RuntimeError(f"weight sync layout names an unknown dtype {name!r}")
    return dtype


def plan_buckets(state_dict: Mapping[str, torch.Tensor], bucket_bytes: int) -> Layout:
    """Group tensors by dtype (in state-dict order) into flat buckets of at most `bucket_bytes`; a tensor
    larger than that gets a bucket of its own. Pure: the same state dict shapes give the same layout."""
    buckets: Layout = []
    open_bucket: dict[torch.dtype, dict[str, Any]] = {}
    for name, tensor in state_dict.items():
        size = tensor.numel() * tensor.element_size()
        bucket = open_bucket.get(tensor.dtype)
        if bucket is None or (
            bucket["numel"] > 0 and (bucket["numel"] * tensor.element_size()) + size > bucket_bytes
        ):
            bucket = {"dtype": str(tensor.dtype).removeprefix("torch."), "numel": 0, "params": []}
            buckets.append(bucket)
            open_bucket[tensor.dtype] = bucket
        bucket["params"].append([name, list(tensor.shape), bucket["numel"]])
        bucket["numel"] += tensor.numel()
    return buckets


def _pack(state_dict: Mapping[str, torch.Tensor], bucket: dict[str, Any]) -> torch.Tensor:
    flat = torch.empty(bucket["numel"], dtype=_dtype(bucket["dtype"]))
    for name, _shape, offset in bucket["params"]:
        tensor = state_dict[name].detach()
        flat[offset : offset + tensor.numel()].copy_(tensor.reshape(-1))
    return flat


def _unpack(flat: torch.Tensor, bucket: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {}
    for name, shape, offset in bucket["params"]:
        numel = 1
        for d in shape:
            numel *= d
        out[name] = flat[offset : offset + numel].view(shape)  # views of a buffer this update owns alone
    return out


def listen(host: str, world_size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's store, listening on `host` at a port the OS assigns (`.port`, for the receivers' config),
    before any receiver is told where: no window in which another process takes a port probed free."""
    timeout = datetime.timedelta(seconds=timeout_s)
    return dist.TCPStore(host, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)


def _connect(
    config: TorchDistSyncConfig, rank: int, store: dist.TCPStore | None = None
) -> tuple[dist.PrefixStore, dist.ProcessGroupGloo]:
    timeout = datetime.timedelta(seconds=config.timeout_s)
    try:
        if store is None:
            store = dist.TCPStore(
                config.host, config.port, config.world_size, is_master=rank == 0, timeout=timeout
            )
        prefixed = dist.PrefixStore(_PREFIX, store)
        group = dist.ProcessGroupGloo(prefixed, rank, config.world_size, timeout)
    except (RuntimeError, dist.DistError) as e:
        raise RuntimeError(
            f"weight sync rank {rank}/{config.world_size} could not join the group at "
            f"{config.host}:{config.port} within {config.timeout_s:.0f}s "
            f"(are all {config.world_size} ranks started?): {e}"
        ) from e
    return prefixed, group


def _broadcast(group: Any, tensor: torch.Tensor) -> Any:
    # `group` is a ProcessGroupGloo: a c10d Backend whose type stubs omit the collectives.
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    # Bytes: gloo then carries any dtype (bf16, fp8, bool) the same way.
    return group.broadcast([tensor.view(torch.uint8)], opts)


class TorchDistPublisher(WeightPublisher):
    """Rank 0. Construct it at the same time as the receivers: joining the group waits for all ranks.
    `store`: the store `listen` opened at `config`'s host and port (else one is opened there now)."""

    def __init__(self, config: TorchDistSyncConfig, store: dist.TCPStore | None = None) -> None:
        self.config = config
        self._store, self._group = _connect(config, rank=0, store=store)
        self._seq = 0
        self._layouts: dict[str, int] = {}  # layout JSON -> id already in the store
        self._last_version: int | None = None
        self._closed = False

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> PublishStats:
        check_version(version, self._last_version)
        if self._closed:
            raise RuntimeError("publish() after close()")
        t0 = time.perf_counter()
        cpu = {name: t.detach().cpu() for name, t in state_dict.items()}
        layout = plan_buckets(cpu, int(self.config.bucket_mb * 2**20))
        layout_id = self._layout_id(list(cpu), layout)
        self._store.set(f"announce/{self._seq}", json.dumps({"version": version, "layout": layout_id}))
        header = torch.tensor([self._seq, version, layout_id, len(layout)], dtype=torch.int64)
        try:
            _broadcast(self._group, header).wait()
            in_flight = None
            for bucket in layout:
                flat = _pack(cpu, bucket)  # packed while the previous bucket is still being sent
                if in_flight is not None:
                    in_flight.wait()
                in_flight = _broadcast(self._group, flat)
            if in_flight is not None:
                in_flight.wait()
        except RuntimeError as e:
            raise RuntimeError(
                f"weight broadcast of version {version} to {self.config.world_size - 1} receivers failed "
                f"(did a receiver exit? timeout {self.config.timeout_s:.0f}s): {e}"
            ) from e
        self._seq += 1
        self._last_version = version
        self.last_stats = PublishStats(
            version, state_nbytes(cpu), len(cpu), time.perf_counter() - t0, num_buckets=len(layout)
        )
        return self.last_stats

    def _layout_id(self, order: list[str], layout: Layout) -> int:
        # The order lets receivers rebuild the state dict in the trainer's order (buckets group by dtype).
        text = json.dumps({"order": order, "buckets": layout})
        if text not in self._layouts:
            self._layouts[text] = len(self._layouts)
            self._store.set(f"layout/{self._layouts[text]}", text)
        return self._layouts[text]

    def close(self) -> None:
        """Tell receivers to stop, and wait (bounded) until they have: the store lives in this process."""
        if self._closed:
            return
        self._closed = True
        self._store.set(f"announce/{self._seq}", _CLOSE)
        deadline = time.monotonic() + self.config.timeout_s
        while self._store.add("closed", 0) < self.config.world_size - 1 and time.monotonic() < deadline:
            time.sleep(self.config.poll_interval_s)


class TorchDistReceiver(WeightReceiver):
    """Rank `rank` (1..world_size-1). A background thread joins every publish; `poll`/`wait` hand out the
    newest whole update."""

    def __init__(self, config: TorchDistSyncConfig, rank: int) -> None:
        if not 1 <= rank < config.world_size:
            raise ValueError(
                f"receiver rank must be in [1, {config.world_size - 1}] (rank 0 publishes), got {rank}"
            )
        self.config = config
        self.rank = rank
        self._store, self._group = _connect(config, rank)
        self._latest: WeightUpdate | None = None
        self._version = -1
        self._error: BaseException | None = None
        self._stopped = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=f"weight-sync-recv-{rank}", daemon=True)
        self._thread.start()

    @property
    def latest_version(self) -> int:
        return self._version

    @property
    def stopped(self) -> bool:
        """The background thread has ended: the publisher closed the group, or a transfer failed."""
        return self._stopped

    def poll(self) -> WeightUpdate | None:
        with self._changed:
            return self._take()

    def wait(self, min_version: int, timeout_s: float) -> WeightUpdate:
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                if self._latest is not None and self._latest.version >= min_version:
                    update = self._take()
                    if update is not None:
                        return update
                self._raise_if_failed()
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._stopped:
                    raise TimeoutError(
                        f"TorchDistReceiver rank {self.rank}: no weights with version >= {min_version} after "
                        f"{timeout_s:.1f}s (latest received: {self._version}"
                        f"{', publisher closed' if self._stopped else ''})"
                    )
                self._changed.wait(remaining)

    def _take(self) -> WeightUpdate | None:
        self._raise_if_failed()
        latest = self._latest
        if latest is None or latest.version <= self._version:
            return None
        self._version = latest.version
        self._latest = None  # the engine copies what it keeps; do not hold a second copy here
        return latest

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(
                f"weight sync receiver rank {self.rank} failed: {self._error}"
            ) from self._error

    def _run(self) -> None:
        layouts: dict[int, dict[str, Any]] = {}
        seq = 0
        try:
            while not self._stopped:
                key = f"announce/{seq}"
                if not self._store.check([key]):
                    time.sleep(self.config.poll_interval_s)
                    continue
                announce = self._store.get(key).decode()
                if announce == _CLOSE:
                    break
                meta = json.loads(announce)
                layout_id = int(meta["layout"])
                if layout_id not in layouts:
                    layouts[layout_id] = json.loads(self._store.get(f"layout/{layout_id}"))
                update = self._receive(seq, int(meta["version"]), layout_id, layouts[layout_id])
                with self._changed:
                    self._latest = update
                    self._changed.notify_all()
                seq += 1
        except BaseException as e:  # a fault-tolerance boundary: surfaced by poll()/wait(), never lost
            self._error = e
        finally:
            with self._changed:
                self._stopped = True
                self._changed.notify_all()
            # Lets the publisher's close() return without waiting out its timeout; if the publisher (and
            # its store) is already gone there is no one to tell.
            with contextlib.suppress(RuntimeError, dist.DistError):
                self._store.add("closed", 1)

    def _receive(self, seq: int, version: int, layout_id: int, plan: dict[str, Any]) -> WeightUpdate:
        layout: Layout = plan["buckets"]
        header = torch.zeros(4, dtype=torch.int64)
        _broadcast(self._group, header).wait()
        if header.tolist() != [seq, version, layout_id, len(layout)]:
            raise RuntimeError(
                f"publish header {header.tolist()} != announced {[seq, version, layout_id, len(layout)]}"
            )
        state: dict[str, torch.Tensor] = {}
        for bucket in layout:
            flat = torch.empty(bucket["numel"], dtype=_dtype(bucket["dtype"]))
            _broadcast(self._group, flat).wait()
            state.update(_unpack(flat, bucket))
        return WeightUpdate(version, {name: state[name] for name in plan["order"]})

    def close(self) -> None:
        """Stop the background thread (it finishes the transfer it is in, bounded by timeout_s)."""
        with self._changed:
            self._stopped = True
        self._thread.join(timeout=self.config.timeout_s)
