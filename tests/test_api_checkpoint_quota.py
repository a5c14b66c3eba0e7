"""One API key cannot fill the server's disk with checkpoints: a per-key quota on the recorded size of its
unexpired checkpoints, and a floor of free disk that no save may cross, whatever the key.

Reference: the security finding that save_state, save_weights and save_weights_for_sampler wrote checkpoint
directories under the state dir with no limit per key, so that one key could fill the disk, after which
every other key's saves failed and the SQLite futures database on that disk could no longer commit;
docs/security.md (per-key limits); /work/shared/reference/tinker-api.md §3 (a failed future's
`{"error", "category": "user"}`, raised by the SDK as RequestFailedError) and §9 (checkpoints, overwrite).
Through the unmodified `tinker` SDK against a live server on the tiny model; `CheckpointStore` directly for
the floor checked once a save is written, which a live disk cannot be made to hit on cue.
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import tinker
import torch

from conftest import sdk_server
from inflight.api.app import BackgroundServer
from inflight.api.checkpoints import CheckpointQuotaError, CheckpointStore, StorageLimits
from inflight.api.db import CheckpointRow, Database, ModelRow, SessionRow, sqlite_url, utcnow
from inflight.api.ids import checkpoint_path
from inflight.api.service import ServiceConfig, ServiceState
from inflight.api.worker import EngineWorker
from inflight.auth import tenant_of

pytestmark = pytest.mark.slow  # sdk_server closes the SDK clients the tests leave open
types = tinker.types

BASE = "tiny-base"
KEY_A, KEY_B = "tml-quota-a", "tml-quota-b"
RESULT_TIMEOUT_S = 120.0  # one SDK call on the tiny model takes well under a second
TOKENS = [5, 17, 3, 42, 8, 99, 23, 7, 61, 12]
MAKE_ROOM = ("delete checkpoints", "DELETE /api/v1/training_runs/", "ttl_seconds")


def config(state_dir: Path, tiny_model_dir: Path, **limits: int | None) -> ServiceConfig:
    """No disk floor unless asked: the quota tests must not depend on the test machine's free space."""
    return ServiceConfig(
        base_models={BASE: str(tiny_model_dir)},
        state_dir=state_dir,
        api_keys=[KEY_A, KEY_B],
        **{"min_free_disk_bytes": 0, **limits},
    )


def state_of(server: BackgroundServer) -> ServiceState:
    state: ServiceState = server.app.state.service
    return state


def worker_of(server: BackgroundServer) -> EngineWorker:
    worker: EngineWorker = state_of(server).wake_worker.__self__  # type: ignore[attr-defined]
    return worker


def training_client(server: BackgroundServer, key: str) -> tinker.TrainingClient:
    """A fresh rank-4 adapter, never stepped: every state checkpoint of it has the same size."""
    service = tinker.ServiceClient(base_url=server.url, api_key=key)
    return service.create_lora_training_client(base_model=BASE, rank=4, seed=0).result(RESULT_TIMEOUT_S)


def save(training: tinker.TrainingClient, name: str, *, overwrite: bool = False) -> str:
    return training.save_state(name, overwrite=overwrite).result(RESULT_TIMEOUT_S).path


def refused(training: tinker.TrainingClient, name: str, *, overwrite: bool = False) -> str:
    """The error of a save the server refuses: the client's to fix (category user), one line."""
    with pytest.raises(tinker.RequestFailedError) as failed:
        save(training, name, overwrite=overwrite)
    assert failed.value.category == types.RequestErrorCategory.User, failed.value
    message = str(failed.value)
    assert "\n" not in message.strip(), message
    return message


def sizes(server: BackgroundServer, key: str) -> dict[str, int]:
    """tinker path -> recorded size of every unexpired checkpoint of `key`, as its listing shows them."""
    rest = tinker.RestClient(base_url=server.url, api_key=key)
    listed = rest.list_user_checkpoints(limit=1000).result(RESULT_TIMEOUT_S).checkpoints
    return {c.tinker_path: c.size_bytes for c in listed if c.size_bytes is not None}


def staged(store: CheckpointStore) -> list[Path]:
    """What saves in progress have on the disk (the store's layout: `{root}/.staging/`)."""
    staging = store.root / ".staging"
    return sorted(staging.iterdir()) if staging.exists() else []


def datum() -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS[:-1]),
        loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)},
    )


def logprobs(training: tinker.TrainingClient) -> torch.Tensor:
    output = training.forward([datum()], "cross_entropy").result(RESULT_TIMEOUT_S)
    return torch.tensor(output.loss_fn_outputs[0]["logprobs"].tolist())


@pytest.fixture(scope="module")
def checkpoint_bytes(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> int:
    """The recorded size of one checkpoint of `training_client`'s adapter, measured on a server without
    a quota, so that the quotas below are exact multiples of it."""
    unlimited = config(tmp_path_factory.mktemp("measure"), tiny_model_dir, max_checkpoint_bytes_per_key=None)
    with sdk_server(unlimited) as server:
        path = save(training_client(server, KEY_A), "measure")
        return sizes(server, KEY_A)[path]


def test_a_save_over_the_keys_quota_fails_clearly_and_leaves_nothing_behind(
    tiny_model_dir: Path, tmp_path: Path, checkpoint_bytes: int
) -> None:
    """Room for three and a half checkpoints: the fourth is written, found not to fit, and refused with
    one line naming the usage, the quota and the ways out; its staged files are gone, the model and the
    client go on, the other key saves as before, and deleting a checkpoint makes room for the refused one."""
    quota = 3 * checkpoint_bytes + checkpoint_bytes // 2
    with sdk_server(config(tmp_path, tiny_model_dir, max_checkpoint_bytes_per_key=quota)) as server:
        store = state_of(server).checkpoints
        a = training_client(server, KEY_A)
        kept = [save(a, f"c{i}") for i in range(3)]
        assert set(sizes(server, KEY_A).values()) == {checkpoint_bytes}
        before = logprobs(a)

        message = refused(a, "c3")
        used, after = f"{3 * checkpoint_bytes:,} bytes used", f"to {4 * checkpoint_bytes:,} bytes"
        assert f"over its {quota:,} bytes quota" in message and used in message and after in message
        assert "--max-checkpoint-gib-per-key" in message
        assert all(part in message for part in MAKE_ROOM), message
        assert staged(store) == []
        assert not store.final_dir(checkpoint_path(a.model_id, "state", "c3")).exists()
        assert set(sizes(server, KEY_A)) == set(kept)
        assert store.bytes_used(tenant_of(KEY_A)) == 3 * checkpoint_bytes

        torch.testing.assert_close(logprobs(a), before, atol=0, rtol=0)  # the model is as it was
        b = training_client(server, KEY_B)  # its own quota: three more checkpoints' worth
        for i in range(2):
            save(b, f"b{i}")
        assert b.save_weights_for_sampler("b-sampler").result(RESULT_TIMEOUT_S).path

        rest = tinker.RestClient(base_url=server.url, api_key=KEY_A)
        rest.delete_checkpoint_from_tinker_path(kept[0]).result(RESULT_TIMEOUT_S)
        assert save(a, "c3") == f"tinker://{a.model_id}/weights/c3"
        assert staged(store) == []
        # The failed save left no hole in the client's request order: it trains on.
        a.forward_backward([datum()], "cross_entropy").result(RESULT_TIMEOUT_S)
        a.optim_step(types.AdamParams(learning_rate=1e-2)).result(RESULT_TIMEOUT_S)


def test_a_key_at_its_quota_is_refused_when_it_asks_and_may_still_overwrite(
    tiny_model_dir: Path, tmp_path: Path, checkpoint_bytes: int
) -> None:
    """At exactly its quota a key's next save is refused as it is submitted, before anything is written; an
    overwrite frees the bytes of the checkpoint it replaces, so saving one again in place still succeeds."""
    quota = 3 * checkpoint_bytes
    with sdk_server(config(tmp_path, tiny_model_dir, max_checkpoint_bytes_per_key=quota)) as server:
        store = state_of(server).checkpoints
        a = training_client(server, KEY_A)
        kept = [save(a, f"c{i}") for i in range(3)]
        assert store.bytes_used(tenant_of(KEY_A)) == quota

        refused_by_worker = worker_of(server).stats().get("failed_user", 0)
        message = refused(a, "c3")
        assert worker_of(server).stats().get("failed_user", 0) == refused_by_worker  # the route refused it
        assert f"checkpoints take {quota:,} bytes of its {quota:,} bytes quota" in message
        assert "--max-checkpoint-gib-per-key" in message
        assert all(part in message for part in MAKE_ROOM), message
        assert staged(store) == []

        assert save(a, "c1", overwrite=True) == kept[1]
        assert store.bytes_used(tenant_of(KEY_A)) == quota
        assert staged(store) == []


def test_a_save_that_would_leave_the_servers_disk_under_its_floor_is_refused(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The floor protects the database and every key when each key is within its quota: a save is refused,
    naming the server's disk, when the state dir's filesystem has less than the floor free. A sampling
    client made from the weights in memory writes nothing, so it is still served."""
    floor = shutil.disk_usage(tmp_path).free + 2**40
    with sdk_server(config(tmp_path, tiny_model_dir, min_free_disk_bytes=floor)) as server:
        store = state_of(server).checkpoints
        a = training_client(server, KEY_A)
        message = refused(a, "c0")
        assert "the server's disk has" in message and "keeps free" in message, message
        assert "free space on the server's disk" in message
        assert staged(store) == [] and sizes(server, KEY_A) == {}
        with pytest.raises(tinker.RequestFailedError, match="the server's disk"):
            a.save_weights_for_sampler("s0").result(RESULT_TIMEOUT_S)
        sampling = a.save_weights_and_get_sampling_client().result(RESULT_TIMEOUT_S)
        prompt = types.ModelInput.from_ints(TOKENS[:4])
        sample = sampling.sample(prompt, 1, types.SamplingParams(max_tokens=2, seed=0))
        assert len(sample.result(RESULT_TIMEOUT_S).sequences[0].tokens) == 2


def test_a_save_that_fails_while_it_is_written_leaves_no_staged_files(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk filling up under a save (ENOSPC halfway through its files) fails it as the server's error,
    and what it had written goes: staged files of failed saves used to stay until the next restart."""
    with sdk_server(config(tmp_path, tiny_model_dir)) as server:
        a = training_client(server, KEY_A)

        def disk_full(model_id: str, path: Path, include_optimizer: bool = True) -> int:
            path.mkdir(parents=True)
            (path / "adapter_model.safetensors").write_bytes(b"\0" * 1000)
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(worker_of(server).compute, "save_state", disk_full)
        with pytest.raises(tinker.RequestFailedError, match="No space left on device") as failed:
            save(a, "c0")
        assert failed.value.category == types.RequestErrorCategory.Server
        assert staged(state_of(server).checkpoints) == []
        monkeypatch.undo()
        assert save(a, "c0") == f"tinker://{a.model_id}/weights/c0"


# -- the check once a save is written, on the store alone ----------------------------------------------------

MODEL = "s:train:0"


@pytest.fixture
def store(tmp_path: Path) -> Iterator[CheckpointStore]:
    db = Database(sqlite_url(tmp_path / "service.db"))
    with db.write() as session:  # a checkpoint row references its model, and that its session
        session.add(SessionRow(session_id="s", tenant="t"))
        session.flush()  # no ORM relationship orders the two inserts
        session.add(
            ModelRow(
                model_id=MODEL,
                session_id="s",
                model_seq_id=0,
                base_model=BASE,
                lora_rank=4,
                lora_config={},
                tenant="t",
            )
        )
    yield CheckpointStore(db, tmp_path / "checkpoints")
    db.close()


def commit(
    store: CheckpointStore,
    name: str,
    n_bytes: int,
    *,
    ttl_seconds: int | None = None,
    overwrite: bool = False,
) -> None:
    """What the worker does: the engine writes `n_bytes` into a staging dir, then the store commits it."""
    staged_dir = store.staging_dir()
    staged_dir.mkdir()
    (staged_dir / "adapter_model.safetensors").write_bytes(b"\0" * n_bytes)
    path = checkpoint_path(MODEL, "state", name)
    store.commit(
        path, staged_dir, size_bytes=n_bytes, ttl_seconds=ttl_seconds, overwrite=overwrite, tenant="t"
    )


def test_the_floor_is_checked_once_the_save_is_on_the_disk_counting_what_an_overwrite_frees(
    store: CheckpointStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The state dir's disk as the store sees it once a save of 100 bytes is written (the staged files are
    on it already): 950 free under a floor of 1,000 refuses the save and removes its files; an overwrite
    of a 100-byte checkpoint frees those, which makes 1,050, and passes."""
    store.limits = StorageLimits(min_free_disk_bytes=1000)
    usage = shutil.disk_usage(store.root.parent)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=950))

    with pytest.raises(CheckpointQuotaError, match="would leave the server's disk 950 bytes free"):
        commit(store, "c0", 100)
    assert staged(store) == [] and not store.exists(checkpoint_path(MODEL, "state", "c0"))

    store.limits = StorageLimits()
    commit(store, "c0", 100)
    store.limits = StorageLimits(min_free_disk_bytes=1000)
    commit(store, "c0", 100, overwrite=True)
    assert store.bytes_used("t") == 100 and staged(store) == []


def test_expired_checkpoints_count_against_no_quota(store: CheckpointStore) -> None:
    """A TTL is one of the ways out the error names: once a checkpoint expires its bytes no longer count,
    even before the sweep deletes its files."""
    store.limits = StorageLimits(max_bytes_per_tenant=150)
    commit(store, "short", 100, ttl_seconds=3600)
    with pytest.raises(CheckpointQuotaError, match="over its 150 bytes quota"):
        commit(store, "kept", 100)
    assert staged(store) == []
    with store.db.write() as session:  # its TTL ran out, and the sweep has not come yet
        row = session.get(CheckpointRow, str(checkpoint_path(MODEL, "state", "short")))
        assert row is not None
        row.expires_at = utcnow()
    assert store.bytes_used("t") == 0
    commit(store, "kept", 100)
    assert store.bytes_used("t") == 100
