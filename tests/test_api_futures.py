"""The futures store (api/futures.py) and retrieve_future's wire answers (api/schemas.py), on SQLite files.

Reference: /work/shared/reference/tinker-api.md §3 (futures protocol), §7.1 (seq_id order and idempotency);
SkyRL's futures table (§12) is the design this follows, minus its 409 on seq reuse.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from inflight.api.db import Database, sqlite_url
from inflight.api.futures import (
    RESTART_ERROR,
    Future,
    FutureStateError,
    FutureStore,
    RequestType,
    SeqIdConflictError,
    UnknownFutureError,
)
from inflight.api.schemas import (
    RequestFailedResponse,
    TryAgainResponse,
    future_response,
    unfinished_or_failed,
)
from inflight.errors import UserError

FWD_BWD = RequestType.FORWARD_BACKWARD
M = "s1:train:0"


@pytest.fixture
def db(tmp_path: Path) -> Iterator[Database]:
    database = Database(sqlite_url(tmp_path / "service.db"))
    yield database
    database.close()


@pytest.fixture
def store(db: Database) -> FutureStore:
    return FutureStore(db)


def _claim_all(store: FutureStore, model_id: str = M) -> list[int | None]:
    claimed = []
    while (future := store.claim_next(model_id)) is not None:
        claimed.append(future.seq_id)
    return claimed


def test_submit_and_get(store: FutureStore) -> None:
    future = store.submit(M, 0, RequestType.CREATE_MODEL, b'{"rank": 8}')
    assert future.status == "pending" and future.request_id.isdigit()
    assert store.get(future.request_id) == future
    assert future_response(future).model_dump(exclude_none=True) == {
        "request_id": future.request_id,
        "model_id": M,
    }


def test_resubmission_is_idempotent_and_a_changed_request_is_refused(store: FutureStore) -> None:
    first = store.submit(M, 1, FWD_BWD, b"proto-1")
    assert store.submit(M, 1, FWD_BWD, b"proto-1").request_id == first.request_id
    store.claim_next(M)  # nothing with seq 0 yet: claims nothing, and a retry still dedupes
    assert store.submit(M, 1, FWD_BWD, b"proto-1") == first
    with pytest.raises(SeqIdConflictError, match="seq_id 1 of 's1:train:0' was already used"):
        store.submit(M, 1, FWD_BWD, b"proto-2")
    with pytest.raises(SeqIdConflictError):
        store.submit(M, 1, RequestType.OPTIM_STEP, b"proto-1")
    assert store.submit("s1:train:1", 1, FWD_BWD, b"proto-2").request_id != first.request_id


def test_claims_follow_seq_id_order_and_wait_at_a_gap(store: FutureStore) -> None:
    for seq in [3, 1, 0]:  # arrival order differs from seq order
        store.submit(M, seq, FWD_BWD, b"x%d" % seq)
    assert store.ready_model_ids() == [M]
    assert _claim_all(store) == [0, 1]  # 3 waits for the missing 2
    assert store.ready_model_ids() == []
    store.submit(M, 2, FWD_BWD, b"x2")
    assert _claim_all(store) == [2, 3]


def test_models_queue_independently(store: FutureStore) -> None:
    other = "s1:train:1"
    store.submit(M, 1, FWD_BWD, b"a")  # M waits for seq 0
    store.submit(other, 0, RequestType.CREATE_MODEL, b"b")
    assert store.ready_model_ids() == [other]
    assert store.claim_next(M) is None
    assert _claim_all(store, other) == [0]


def test_samples_are_listed_per_tenant_oldest_first_in_any_seq_order(store: FutureStore) -> None:
    sampler = "s1:sample:0"
    ids = [
        store.submit(sampler, seq, RequestType.SAMPLE, b"p%d" % seq).request_id for seq in [5, 1_000_000_000]
    ]
    legacy = [store.submit(sampler, None, RequestType.SAMPLE, b"same").request_id for _ in range(2)]
    assert legacy[0] != legacy[1]  # no seq_id: nothing to dedupe on
    other = store.submit("s2:sample:0", 1, RequestType.SAMPLE, b"q", tenant="b").request_id
    assert store.ready_model_ids() == []  # samples never enter the ordered queues
    assert store.claim_next(sampler) is None
    pending = store.pending_unordered_by_tenant(RequestType.SAMPLE, per_tenant=3)
    assert pending == {"": [*ids, legacy[0]], "b": [other]}  # each tenant's oldest 3
    claimed = store.claim(pending[""])
    assert [f.request_id for f in claimed] == [*ids, legacy[0]]
    assert all(f.status == "running" for f in claimed)
    assert store.pending_unordered_by_tenant(RequestType.SAMPLE, per_tenant=3) == {
        "": [legacy[1]],
        "b": [other],
    }
    with pytest.raises(ValueError, match="ordered"):
        store.pending_unordered_by_tenant(FWD_BWD, per_tenant=1)


def test_complete_and_fail_with_categories(store: FutureStore) -> None:
    for seq in range(3):
        store.submit(M, seq, FWD_BWD, b"%d" % seq)
    first = store.claim_next(M)
    assert first is not None
    done = store.complete(first.request_id, b"\x00result")
    assert done.status == "done" and done.result_payload == b"\x00result" and done.finished
    assert unfinished_or_failed(done) is None
    second = store.claim_next(M)
    assert second is not None
    failed = store.fail(second.request_id, "unsupported loss_fn 'dro'", "user")
    assert unfinished_or_failed(failed) == RequestFailedResponse(
        error="unsupported loss_fn 'dro'", category="user"
    )
    third = store.claim_next(M)  # a failed request does not poison the model's queue
    assert third is not None and third.seq_id == 2
    assert store.fail(third.request_id, "CUDA out of memory", "server").error_category == "server"


def test_illegal_transitions_and_bad_failures(store: FutureStore) -> None:
    pending = store.submit(M, 0, FWD_BWD, b"x")
    assert unfinished_or_failed(pending) == TryAgainResponse(request_id=pending.request_id)
    with pytest.raises(FutureStateError, match="it is pending, expected running"):
        store.complete(pending.request_id, b"")
    with pytest.raises(ValueError, match="category"):
        store.fail(pending.request_id, "boom", "unknown")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-empty"):
        store.fail(pending.request_id, "", "user")
    store.fail(pending.request_id, "cancelled", "user")  # a pending future may fail without running
    with pytest.raises(FutureStateError, match="it is failed"):
        store.fail(pending.request_id, "again", "user")


def test_a_rejected_request_keeps_its_seq_id(store: FutureStore) -> None:
    rejected = store.reject(M, 0, FWD_BWD, b"bad", "token id 99999 is outside the vocabulary (size 512)")
    assert rejected.status == "failed" and rejected.error_category == "user"
    assert store.reject(M, 0, FWD_BWD, b"bad", "same again") == rejected
    store.submit(M, 1, FWD_BWD, b"good")
    assert _claim_all(store) == [1]  # no hole at 0: the queue moves on


def test_out_of_order_failures_never_let_a_later_seq_id_jump_the_queue(store: FutureStore) -> None:
    store.submit(M, 0, FWD_BWD, b"0")
    store.reject(M, 3, FWD_BWD, b"3", "oversize request")  # rejected before 1 and 2 arrived
    cancelled = store.submit(M, 5, FWD_BWD, b"5")
    store.fail(cancelled.request_id, "cancelled", "user")
    store.submit(M, 4, FWD_BWD, b"4")
    assert _claim_all(store) == [0]  # 4 waits for 1 and 2 even though 3 and 5 are finished
    store.submit(M, 2, FWD_BWD, b"2")
    store.submit(M, 1, FWD_BWD, b"1")
    store.submit(M, 6, FWD_BWD, b"6")
    assert _claim_all(store) == [1, 2, 4, 6]


def test_bad_ids_and_seq_ids_give_clear_errors(store: FutureStore) -> None:
    for bad in ["999", "abc", "", "-1", "1.0", "\uff11", "9" * 40]:
        with pytest.raises(UnknownFutureError, match="unknown request_id"):
            store.get(bad)
    with pytest.raises(UnknownFutureError):
        store.complete("12345", b"")
    with pytest.raises(UserError, match=r"seq ids start at 0 \(its create_model\), its other requests. at 1"):
        store.submit(M, -1, FWD_BWD, b"x")
    with pytest.raises(ValueError, match="need a seq_id"):
        store.submit(M, None, FWD_BWD, b"x")
    assert str(UnknownFutureError("unknown request_id 'x'")) == "unknown request_id 'x'"


def test_restart_keeps_results_and_fails_running_futures(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path / "service.db")
    first = Database(url)
    store = FutureStore(first)
    futures = [store.submit(M, seq, FWD_BWD, b"%d" % seq) for seq in range(4)]
    assert _claim_all(store) == [0, 1, 2, 3]
    store.complete(futures[0].request_id, b"result-0")
    store.fail(futures[3].request_id, "loss is NaN", "user")
    first.close()  # the server dies with 1 and 2 running

    second = Database(url)
    reopened = FutureStore(second)
    assert reopened.get(futures[0].request_id).result_payload == b"result-0"
    recovered = reopened.recover()
    assert [f.seq_id for f in recovered] == [1, 2]
    assert all(
        f.status == "failed" and f.error == RESTART_ERROR and f.error_category == "server" for f in recovered
    )
    assert reopened.get(futures[3].request_id).error == "loss is NaN"
    assert reopened.recover() == []
    fresh = reopened.submit(M, 4, FWD_BWD, b"4")
    assert _claim_all(reopened) == [4]
    assert int(fresh.request_id) > max(int(f.request_id) for f in futures)
    second.close()


def test_an_accepted_request_and_a_result_are_committed_before_they_are_returned(tmp_path: Path) -> None:
    """What a route acknowledges (and what a long-poll is handed in memory) is already on disk: another
    connection sees it. `on_inserted` runs before the commit (the long-polls' board relies on that to learn
    of a future before anything can finish it), so it sees nothing yet."""
    url = sqlite_url(tmp_path / "service.db")
    writer, reader = Database(url), Database(url)
    store, other = FutureStore(writer), FutureStore(reader)
    seen_while_inserting: list[int] = []

    def on_inserted(future: Future) -> None:
        seen_while_inserting.append(other.unfinished_count(M))

    accepted = store.submit(M, 0, FWD_BWD, b"x", on_inserted=on_inserted)
    assert seen_while_inserting == [0]
    assert other.get(accepted.request_id) == accepted
    claimed = store.claim_next(M)
    assert claimed is not None and other.get(claimed.request_id).status == "running"
    done = store.complete(claimed.request_id, b"result")
    assert other.get(done.request_id) == done and done.result_payload == b"result"
    writer.close()
    reader.close()


def test_a_seq_id_far_ahead_is_refused_and_never_recorded(store: FutureStore) -> None:
    store.submit(M, 0, FWD_BWD, b"a", max_seq_ahead=4)
    with pytest.raises(UserError, match="seq_id 5 for 's1:train:0' is too far ahead"):
        store.submit(M, 5, FWD_BWD, b"b", max_seq_ahead=4)
    assert store.max_seq_id(M) == 0
    assert store.submit(M, 4, FWD_BWD, b"c", max_seq_ahead=4).seq_id == 4
    assert store.submit(M, 4, FWD_BWD, b"c", max_seq_ahead=0).seq_id == 4  # a retry is never "ahead"


def test_a_key_past_its_queue_limit_gets_failed_futures_and_other_keys_queue_on(store: FutureStore) -> None:
    sample, limit = RequestType.SAMPLE, 3

    def submit(model_id: str, seq_id: int, tenant: str, request_type: RequestType = sample) -> Future:
        payload = f"{seq_id}".encode()
        return store.submit(
            model_id, seq_id, request_type, payload, tenant=tenant, max_unfinished_of_tenant=limit
        )

    queued = [submit("s1:sample:0", n, "a") for n in (1, 2, 3)]
    assert [f.status for f in queued] == ["pending"] * 3
    over = submit("s1:sample:0", 4, "a")
    assert over.status == "failed" and over.error_category == "user"
    assert over.error is not None and "already has 3 requests queued or running" in over.error
    assert "max_queued_requests_per_tenant=3" in over.error
    assert submit("s1:sample:0", 1, "a") == queued[0]  # a retry of a queued request is answered as ever
    assert submit("s2:sample:0", 1, "b").status == "pending"  # another key has its own room
    running = store.claim([queued[0].request_id])
    assert submit("s1:sample:0", 5, "a").status == "failed"  # a running request still counts
    store.complete(running[0].request_id, b"")
    assert submit("s1:sample:0", 6, "a").status == "pending"  # a finished one frees its place
    # An ordered request past the limit keeps its seq_id, so the model's queue has no hole.
    store.complete(store.claim([queued[1].request_id])[0].request_id, b"")
    assert submit(M, 0, "a", FWD_BWD).status == "pending"
    assert submit(M, 1, "a", FWD_BWD).status == "failed"
    store.complete(store.claim([queued[2].request_id])[0].request_id, b"")
    assert submit(M, 2, "a", FWD_BWD).status == "pending"
    assert _claim_all(store) == [0, 2]


def test_a_claim_says_whether_more_is_queued_behind_its_heads(store: FutureStore) -> None:
    store.submit(M, 0, FWD_BWD, b"a")
    store.submit(M, 1, FWD_BWD, b"b")
    store.submit("s1:train:1", 0, FWD_BWD, b"c")
    first = store.claim_ready()
    assert [f.model_id for f in first.futures] == [M, "s1:train:1"] and first.more_queued
    store.complete(first.futures[0].request_id, b"")
    second = store.claim_ready()
    assert [f.seq_id for f in second.futures] == [1] and not second.more_queued
    assert store.claim_ready().futures == []


def test_fail_pending_drains_one_model(store: FutureStore) -> None:
    store.submit(M, 0, FWD_BWD, b"a")
    store.submit(M, 2, FWD_BWD, b"b")
    kept = store.submit("s1:train:1", 0, FWD_BWD, b"c")
    failed = store.fail_pending(M, "model s1:train:0 lost its weights in a restart", "server")
    assert [f.seq_id for f in failed] == [0, 2]
    assert store.get(kept.request_id).status == "pending"


def test_concurrent_submitters_and_an_engine_keep_order(store: FutureStore) -> None:
    n_per_thread = 25
    errors: list[BaseException] = []
    claimed: list[int | None] = []
    duplicate_ids: list[str] = []
    stop = threading.Event()

    def submitter(parity: int) -> None:
        try:
            for i in range(n_per_thread):
                seq = 2 * i + parity
                store.submit(M, seq, FWD_BWD, b"%d" % seq)
                # Both threads also race on one shared pair: only one row may come of it.
                duplicate_ids.append(store.submit("s1:train:9", 0, FWD_BWD, b"same").request_id)
        except BaseException as err:
            errors.append(err)

    def engine() -> None:
        try:
            while not stop.is_set() or M in store.ready_model_ids():
                future = store.claim_next(M)
                if future is None:
                    time.sleep(0.002)  # as the real loop does: poll, never spin
                    continue
                claimed.append(future.seq_id)
                store.complete(future.request_id, b"ok")
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=submitter, args=(p,)) for p in (0, 1)]
    runner = threading.Thread(target=engine)
    for thread in [*threads, runner]:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    stop.set()
    runner.join(timeout=60)
    assert not any(t.is_alive() for t in [*threads, runner]), "a thread hung"
    assert not errors, errors
    assert claimed == list(range(2 * n_per_thread))
    assert len(set(duplicate_ids)) == 1
