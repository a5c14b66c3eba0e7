"""Weight-sync transports move the tiny model's weights exactly, tagged with the right version: in-process,
filesystem (a reader polling while another process publishes never sees a torn file) and torch.distributed
(gloo, 3 processes, buckets smaller than the model).

Reference: the tiny model's own `model.safetensors` (loaded directly) is the expected state dict; the
bucket plan is checked against its definition (every tensor exactly once, per dtype, within the size).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from inflight.types import WeightUpdate
from inflight.weight_sync import InProcessChannel
from inflight.weight_sync.filesystem import (
    LATEST,
    FilesystemPublisher,
    FilesystemReceiver,
    FilesystemSyncConfig,
    weights_path,
)
from inflight.weight_sync.torch_dist import (
    TorchDistPublisher,
    TorchDistReceiver,
    TorchDistSyncConfig,
    listen,
    plan_buckets,
)


def tiny_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


def perturbed(state: dict[str, torch.Tensor], version: int) -> dict[str, torch.Tensor]:
    """A different, deterministic set of weights per version (what training would produce)."""
    return {name: t + version * 0.125 if t.is_floating_point() else t for name, t in state.items()}


def mixed_dtypes() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "a.bf16": torch.randn(300, 7, generator=gen).to(torch.bfloat16),
        "b.fp32": torch.randn(1000, generator=gen),
        "c.steps": torch.arange(12, dtype=torch.int64).view(3, 4),
        "d.mask": torch.rand(17, generator=gen) > 0.5,
        "e.fp16": torch.randn(5, 5, 5, generator=gen).to(torch.float16),
        "f.scalar": torch.tensor(3.5),
    }


def assert_same(update: WeightUpdate | None, expected: dict[str, torch.Tensor], version: int) -> None:
    assert update is not None and update.version == version
    assert list(update.state_dict) == list(expected)
    for name, tensor in expected.items():
        got = update.state_dict[name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        assert torch.equal(got, tensor), name


def test_in_process_publishes_an_exact_snapshot(tiny_model_dir: Path) -> None:
    weights = tiny_weights(tiny_model_dir)
    channel = InProcessChannel()
    publisher, receiver = channel.publisher(), channel.receiver()
    assert receiver.poll() is None
    stats = publisher.publish(weights, version=1)
    expected = {k: v.clone() for k, v in weights.items()}
    for t in weights.values():
        t.add_(1.0)  # the trainer's next optimizer step must not reach the published version
    assert_same(receiver.poll(), expected, version=1)
    assert receiver.poll() is None  # each update once
    assert stats.num_bytes == sum(t.numel() * t.element_size() for t in weights.values())
    publisher.publish(mixed_dtypes(), version=2)
    assert_same(receiver.wait(min_version=2, timeout_s=5.0), mixed_dtypes(), version=2)
    with pytest.raises(TimeoutError, match="version >= 3"):
        receiver.wait(min_version=3, timeout_s=0.05)
    with pytest.raises(ValueError, match="versions must increase"):
        publisher.publish(weights, version=2)


def test_filesystem_moves_weights_exactly_and_keeps_the_last_versions(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = FilesystemSyncConfig(root=str(tmp_path / "sync"), keep_last=2)
    publisher, receiver = FilesystemPublisher(config), FilesystemReceiver(config)
    assert receiver.poll() is None  # nothing published yet: no error either
    weights = tiny_weights(tiny_model_dir)
    for version in (1, 2, 3):
        publisher.publish(perturbed(weights, version), version)
    assert_same(receiver.poll(), perturbed(weights, 3), version=3)  # the newest, skipping older ones
    assert receiver.poll() is None
    publisher.publish(mixed_dtypes(), version=4)
    assert_same(receiver.wait(min_version=4, timeout_s=5.0), mixed_dtypes(), version=4)
    names = sorted(p.name for p in (tmp_path / "sync").iterdir())
    assert names == [LATEST, weights_path("", 3).name, weights_path("", 4).name]  # no temp files left
    with pytest.raises(TimeoutError, match="version >= 5"):
        receiver.wait(min_version=5, timeout_s=0.05)


def test_filesystem_handles_tied_weights(tmp_path: Path) -> None:
    embed = torch.randn(10, 4)
    tied = {"embed.weight": embed, "lm_head.weight": embed}  # one storage, two names
    config = FilesystemSyncConfig(root=str(tmp_path / "sync"))
    FilesystemPublisher(config).publish(tied, version=0)
    assert_same(FilesystemReceiver(config).poll(), {k: v.clone() for k, v in tied.items()}, version=0)


FS_WRITER = """
import sys, torch
from inflight.weight_sync.filesystem import FilesystemPublisher, FilesystemSyncConfig
publisher = FilesystemPublisher(FilesystemSyncConfig(root=sys.argv[1], keep_last=2))
for version in range(1, int(sys.argv[2]) + 1):
    # Every value of version v is v: a file mixing two versions, or cut short, cannot pass for one.
    publisher.publish({f"layer{i}": torch.full((256, 512), float(version)) for i in range(8)}, version)
"""


def test_filesystem_reader_never_sees_a_torn_file_while_another_process_publishes(tmp_path: Path) -> None:
    root, last = tmp_path / "sync", 30
    receiver = FilesystemReceiver(FilesystemSyncConfig(root=str(root)))
    writer = subprocess.Popen([sys.executable, "-c", FS_WRITER, str(root), str(last)])
    seen: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while (not seen or seen[-1] < last) and time.monotonic() < deadline:
            update = receiver.poll()
            if update is None:
                assert writer.poll() in (None, 0), "writer failed"
                continue
            seen.append(update.version)
            assert len(update.state_dict) == 8
            for name, tensor in update.state_dict.items():
                assert tensor.shape == (256, 512), name
                assert bool((tensor == update.version).all()), f"{name} of version {update.version} is torn"
    finally:
        assert writer.wait(timeout=120) == 0
    assert seen and seen[-1] == last, f"did not receive the last version within 120 s (saw {seen[-3:]})"
    assert seen == sorted(set(seen))  # strictly increasing: never an older version after a newer one


def test_bucket_plan_covers_every_tensor_once_per_dtype_within_the_size() -> None:
    state = {**mixed_dtypes(), "g.big": torch.zeros(5000), "h.fp32": torch.zeros(10)}
    bucket_bytes = 4096
    layout = plan_buckets(state, bucket_bytes)
    placed = [name for bucket in layout for name, _, _ in bucket["params"]]
    assert sorted(placed) == sorted(state)
    for bucket in layout:
        names = [name for name, _, _ in bucket["params"]]
        assert {str(state[n].dtype).removeprefix("torch.") for n in names} == {bucket["dtype"]}
        assert bucket["numel"] == sum(state[n].numel() for n in names)
        offsets = [offset for _, _, offset in bucket["params"]]
        assert offsets == [sum(state[n].numel() for n in names[:i]) for i in range(len(names))]
        size = bucket["numel"] * state[names[0]].element_size()
        assert size <= bucket_bytes or len(names) == 1  # only a tensor bigger than a bucket exceeds it


# -- torch.distributed (gloo): 3 processes --------------------------------------------------------

BUCKET_MB = 0.5  # the tiny model is ~6 MB of float32: about a dozen buckets


def _plan(model_dir: str) -> list[tuple[int, dict[str, torch.Tensor]]]:
    weights = tiny_weights(Path(model_dir))
    return [(1, weights), (2, perturbed(weights, 2)), (3, mixed_dtypes())]


def _gloo_receiver(index: int, config: dict[str, Any], model_dir: str) -> None:
    torch.set_num_threads(1)
    with TorchDistReceiver(TorchDistSyncConfig(**config), rank=index + 1) as receiver:
        for version, state in _plan(model_dir):
            # A slow receiver may skip to a newer version; here each is awaited in turn.
            assert_same(receiver.wait(min_version=version, timeout_s=60), state, version)


def test_gloo_broadcast_moves_weights_exactly_to_every_inference_rank(tiny_model_dir: Path) -> None:
    """The publisher here (its store listening, on a port the OS assigned, before the receivers are told
    it), two receivers in processes of their own."""
    store = listen("127.0.0.1", 3, timeout_s=60)
    config = TorchDistSyncConfig(port=store.port, world_size=3, bucket_mb=BUCKET_MB, timeout_s=60)
    receivers = mp.spawn(
        _gloo_receiver, args=(config.model_dump(), str(tiny_model_dir)), nprocs=2, join=False
    )
    with TorchDistPublisher(config, store) as publisher:
        for version, state in _plan(str(tiny_model_dir)):
            stats = publisher.publish(state, version)
            assert stats.version == version and stats.transfer_s > 0
            if version == 1:
                assert stats.num_buckets > 1, stats
    deadline = time.monotonic() + 120
    while not receivers.join(timeout=1.0):  # raises with the traceback of a receiver that failed
        assert time.monotonic() < deadline, "the receivers did not finish within 120 s"


def test_a_receiver_without_a_publisher_times_out_with_a_clear_message() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = TorchDistSyncConfig(port=port, world_size=2, timeout_s=1)
    with pytest.raises(RuntimeError, match="could not join the group"):
        TorchDistReceiver(config, rank=1)
    with pytest.raises(ValueError, match="rank 0 publishes"):
        TorchDistReceiver(config, rank=0)
