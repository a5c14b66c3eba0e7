"""Streams between pipeline stages: memory, file log and Redis through the same tests (retention by `trim`
included), plus crash safety of the file log (torn last record, a writer killed with SIGKILL mid-append, a
trim killed at any point), its size over many trims, and the RolloutGroup codec.

Reference: Kafka's log semantics (dense offsets, committed consumer positions, retention by deleting whole
segments); the Redis streams docs (XADD/XREAD, XTRIM MINID); a real `redis-server` started here on a free
loopback port.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from inflight.buffer import CodecError, TrimmedError, decode_group, encode_group, open_stream
from inflight.buffer.file_stream import (
    LEGACY_LOG_NAME,
    CorruptLogError,
    FileStream,
    FileStreamConfig,
    segment_name,
)
from inflight.buffer.memory_stream import drop_memory_stream
from inflight.errors import UserError
from inflight.types import Rollout, RolloutGroup


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(params=["memory", "file", "redis"])
def stream_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A URL naming one fresh stream per test; opening it again reopens the same stream."""
    name = f"t{uuid.uuid4().hex[:12]}"
    if request.param == "memory":
        yield f"memory://{name}"
        drop_memory_stream(name)
    elif request.param == "file":
        # Segments of a few records: reads, appends and trims cross segment boundaries.
        yield f"file://{tmp_path / name}?fsync=never&segment_bytes=64"
    else:
        port = request.getfixturevalue("redis_port")
        yield f"redis://127.0.0.1:{port}/0?key={name}"


def test_offsets_are_dense_and_reads_return_records_in_order(stream_url: str) -> None:
    records = [f"record-{i}".encode() * (i + 1) for i in range(20)] + [b""]
    with open_stream(stream_url) as stream:
        offsets = [stream.append(r) for r in records]
        assert offsets == list(range(len(records)))
        assert stream.read(-1, 1000, 0.0) == list(enumerate(records))
        assert stream.read(4, 3, 0.0) == [(5, records[5]), (6, records[6]), (7, records[7])]
        assert stream.read(len(records) - 1, 10, 0.0) == []


def test_read_waits_for_a_record_appended_later(stream_url: str) -> None:
    with open_stream(stream_url) as stream, open_stream(stream_url) as writer:
        stream.append(b"first")
        timer = threading.Timer(0.2, lambda: writer.append(b"late"))
        timer.start()
        try:
            assert stream.read(0, 10, timeout_s=20.0) == [(1, b"late")]
        finally:
            timer.join()
        assert stream.read(1, 10, timeout_s=0.05) == []  # a timeout returns nothing, not an error


def test_committed_offsets_and_records_survive_a_reopen(stream_url: str) -> None:
    with open_stream(stream_url) as stream:
        for i in range(10):
            stream.append(f"r{i}".encode())
        assert stream.committed("trainer") == -1
        stream.commit("trainer", 4)
        stream.commit("eval.v2", 9)
        stream.commit("trainer", 6)  # the latest commit wins
    with open_stream(stream_url) as reopened:
        position = reopened.committed("trainer")
        assert position == 6
        assert reopened.committed("eval.v2") == 9
        assert reopened.committed("never-committed") == -1
        assert reopened.read(position, 100, 0.0) == [(7, b"r7"), (8, b"r8"), (9, b"r9")]
        assert reopened.append(b"r10") == 10


def test_concurrent_appends_get_unique_dense_offsets(stream_url: str) -> None:
    threads_n, per_thread = 4, 40
    got: dict[int, list[tuple[int, bytes]]] = {}
    with open_stream(stream_url) as stream:

        def writer(w: int) -> None:
            got[w] = []
            for i in range(per_thread):
                payload = f"w{w}-{i}".encode()
                got[w].append((stream.append(payload), payload))

        threads = [threading.Thread(target=writer, args=(w,)) for w in range(threads_n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        everything = stream.read(-1, 10_000, 0.0)
    appended = sorted(pair for pairs in got.values() for pair in pairs)
    assert [offset for offset, _ in appended] == list(range(threads_n * per_thread))
    assert everything == appended  # each record sits at the offset its append returned
    for pairs in got.values():  # one writer's records keep its order
        assert [o for o, _ in pairs] == sorted(o for o, _ in pairs)


def test_bad_arguments_fail_with_the_reason(stream_url: str) -> None:
    with open_stream(stream_url) as stream:
        stream.append(b"x")
        with pytest.raises(ValueError, match="offset must be in"):
            stream.commit("c", 5)
        with pytest.raises(ValueError, match="consumer name"):
            stream.commit("../etc/passwd", 0)
        with pytest.raises(ValueError, match="max_count"):
            stream.read(-1, 0, 0.0)
        with pytest.raises(ValueError, match="after"):
            stream.read(-2, 1, 0.0)


def test_trim_drops_the_records_before_its_offset_and_keeps_the_rest_where_they_were(stream_url: str) -> None:
    records = list(enumerate(f"record-{i}".encode() for i in range(30)))
    with open_stream(stream_url) as stream, open_stream(stream_url) as other:
        for _, r in records:
            stream.append(r)
        stream.trim(12)
        assert stream.read(11, 100, 0.0) == records[12:]
        for handle in (stream, other):  # the handle that trimmed, and one opened before the trim
            with pytest.raises(TrimmedError, match="were trimmed"):
                handle.read(-1, 100, 0.0)
        assert other.append(b"after") == 30  # appends go on at the next offset, whoever writes
        assert stream.read(29, 10, 0.0) == [(30, b"after")]
        stream.trim(5)  # an older offset than the last trim's: nothing changes
        assert stream.read(11, 100, 0.0) == [*records[12:], (30, b"after")]
    with open_stream(stream_url) as reopened:
        assert reopened.read(11, 100, 0.0) == [*records[12:], (30, b"after")]


def test_a_trim_past_the_last_record_empties_the_stream_and_offsets_go_on(stream_url: str) -> None:
    with open_stream(stream_url) as stream:
        for i in range(5):
            stream.append(f"x{i}".encode())
        stream.commit("trainer", 4)
        stream.trim(1000)
        assert stream.read(4, 10, 0.0) == []
        with pytest.raises(TrimmedError, match="offset 4: the records before offset 5"):
            stream.read(3, 10, 0.0)
        stream.commit("trainer", 4)  # positions are checked against the offsets written, not those kept
        with pytest.raises(ValueError, match="offset must be in"):
            stream.commit("trainer", 5)
    with open_stream(stream_url) as reopened:
        assert reopened.committed("trainer") == 4
        assert reopened.append(b"y") == 5
        assert reopened.read(4, 10, 0.0) == [(5, b"y")]


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("ftp://host/x", "unknown scheme"),
        ("file://relative/dir", "absolute path"),
        ("file:///tmp/x?fsync=sometimes", "fsync"),
        ("file:///tmp/x?speed=fast", "unknown option 'speed'"),
        ("memory://", "needs a name"),
        ("redis://127.0.0.1:1/0", "needs a key"),
        ("redis://127.0.0.1:1/zero?key=k", "database number"),
    ],
)
def test_bad_urls_name_the_problem(url: str, problem: str) -> None:
    with pytest.raises(UserError, match=problem):
        open_stream(url)


def test_unreachable_redis_is_a_clear_error() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0?key=k"
    with pytest.raises(UserError, match="cannot reach Redis"):
        open_stream(url)


# -- the file log after crashes -----------------------------------------------------------------


def segment_files(directory: Path) -> dict[int, Path]:
    """The log's segment files by the offset of their first record."""
    return {int(p.name[len("records-") : -len(".log")]): p for p in sorted(directory.glob("records-*.log"))}


def log_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in segment_files(directory).values())


def test_a_torn_last_record_is_truncated_at_every_cut_point(tmp_path: Path) -> None:
    source = tmp_path / "source"
    with FileStream(source) as stream:
        for r in (b"alpha", b"bravo" * 50, b"charlie" * 20):
            stream.append(r)
    log = (source / segment_name(0)).read_bytes()
    last_start = len(log) - (8 + len(b"charlie" * 20))
    for cut in range(last_start + 1, len(log)):
        case = tmp_path / f"cut{cut}"
        shutil.copytree(source, case)
        (case / segment_name(0)).write_bytes(log[:cut])
        with FileStream(case) as reopened:
            assert reopened.read(-1, 10, 0.0) == [(0, b"alpha"), (1, b"bravo" * 50)]
            assert (case / segment_name(0)).stat().st_size == last_start  # the torn bytes are gone
            assert reopened.append(b"delta") == 2
            assert reopened.read(1, 10, 0.0) == [(2, b"delta")]
        shutil.rmtree(case)


def test_a_corrupt_record_in_the_middle_is_reported_not_truncated(tmp_path: Path) -> None:
    with FileStream(tmp_path / "s") as stream:
        for r in (b"alpha", b"bravo", b"charlie"):
            stream.append(r)
    path = tmp_path / "s" / segment_name(0)
    data = bytearray(path.read_bytes())
    data[8 + 5 + 8 + 2] ^= 0xFF  # flip a byte inside "bravo"
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptLogError, match=r"record 1 .* truncate the file to 13 bytes"):
        FileStream(tmp_path / "s")
    assert path.read_bytes() == bytes(data)  # nothing was thrown away


WRITER = """
import sys
from inflight.buffer.file_stream import FileStream, FileStreamConfig
from tests_payload import payload
stream = FileStream(sys.argv[1], FileStreamConfig(fsync="never"))
next_offset = len(stream.read(-1, 10**9, 0.0))  # the only writer: records land at these offsets
while True:
    assert stream.append(payload(next_offset)) == next_offset
    print(next_offset, flush=True)
    next_offset += 1
"""

PAYLOAD = """
def payload(offset: int) -> bytes:
    # 1-4 MiB, content determined by the offset: a large write is what a SIGKILL can cut in half.
    size = (1 + offset % 4) << 20
    return offset.to_bytes(8, "little") * (size // 8)
"""


def _payload(offset: int) -> bytes:
    size = (1 + offset % 4) << 20
    return offset.to_bytes(8, "little") * (size // 8)


def test_a_writer_killed_mid_append_leaves_a_log_that_reopens_with_every_acknowledged_record(
    tmp_path: Path,
) -> None:
    (tmp_path / "tests_payload.py").write_text(PAYLOAD)
    log_dir = tmp_path / "log"
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    acknowledged = 0
    torn_seen = 0
    for kill_delay_s in (0.008, 0.015, 0.025):  # each round: a new writer continues the log, then dies
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(log_dir)], stdout=subprocess.PIPE, env=env, text=True
        )
        assert proc.stdout is not None
        acks = 0
        try:
            deadline = time.monotonic() + 60
            while acks < 4 and time.monotonic() < deadline:
                line = proc.stdout.readline()
                assert line, f"writer exited early with code {proc.wait()}"
                acknowledged = int(line) + 1  # every offset up to this one was acknowledged
                acks += 1
        finally:
            # After the checksum of the next multi-megabyte record, inside its write (a few ms on
            # ext4): SIGKILL then cuts the write short. The kill lands wherever it lands; the
            # assertions below hold either way.
            time.sleep(kill_delay_s)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        assert acks == 4, "writer did not acknowledge 4 appends within 60 s"
        size_before = log_bytes(log_dir)  # 1-4 MiB records: a segment of its own each, mostly
        with FileStream(log_dir) as reopened:
            records = reopened.read(-1, 10**6, 0.0)
            torn_seen += log_bytes(log_dir) < size_before
        assert len(records) >= acknowledged  # an acknowledged append is never lost
        for offset, data in records:  # and nothing half-written comes back
            assert data == _payload(offset), f"record {offset} differs from what was written"
    # Not asserted (the kill's timing is up to the OS), but reported when the test is run with -s.
    print(f"torn tails truncated: {torn_seen} of 3 kills")


# -- the file log's retention ---------------------------------------------------------------------


def _record(offset: int) -> bytes:
    return f"record {offset} ".encode() * 10  # ~120 bytes, content determined by the offset


def test_the_file_log_deletes_just_the_segments_before_a_trim_and_stays_bounded_over_many(
    tmp_path: Path,
) -> None:
    """As the pipeline trims it: after each of 200 checkpoints, to an offset a few records behind the last."""
    config = FileStreamConfig(fsync="never", segment_bytes=4096)
    log_dir, in_flight, record_bytes = tmp_path / "log", 7, 8 + len(_record(9999))
    written = 0
    with FileStream(log_dir, config) as stream:
        offset = -1
        for _ in range(200):
            for _ in range(20):
                offset = stream.append(_record(offset + 1))
                written += 8 + len(_record(offset))
            before = offset + 1 - in_flight
            stream.trim(before)
            firsts = sorted(segment_files(log_dir))
            # Gone: only segments whose records all come before `before`; kept: the one holding it, and on.
            assert firsts[0] <= before < (firsts[1] if len(firsts) > 1 else math.inf)
            assert stream.read(before - 1, 1000, 0.0) == [(o, _record(o)) for o in range(before, offset + 1)]
            # What a resume needs, plus less than one segment of what it does not.
            assert log_bytes(log_dir) <= in_flight * record_bytes + config.segment_bytes
    assert written > 50 * log_bytes(log_dir)  # without the trims, all of it would still be there


@pytest.mark.parametrize("before", [12, 20])
def test_a_trim_killed_at_any_point_leaves_a_log_with_the_same_records_and_offsets(
    tmp_path: Path, before: int
) -> None:
    """A trim creates a new last segment when every record goes (before=20), then deletes oldest first:
    every prefix of those steps is a state a SIGKILL can leave."""
    config = FileStreamConfig(fsync="never", segment_bytes=64)
    source = tmp_path / "source"
    with FileStream(source, config) as stream:
        for i in range(20):
            stream.append(f"r{i:02d}".encode())  # 11 bytes with the header: 5 records a segment
    trimmed = tmp_path / "trimmed"
    shutil.copytree(source, trimmed)
    with FileStream(trimmed, config) as stream:
        stream.trim(before)
    old, new = segment_files(source), segment_files(trimmed)
    created = [first for first in new if first not in old]
    deleted = [first for first in old if first not in new]
    assert (created, deleted) == (([], [0, 5]) if before == 12 else ([20], [0, 5, 10, 15]))
    steps = [("create", first) for first in created] + [("delete", first) for first in deleted]
    for done in range(len(steps) + 1):
        case = tmp_path / f"killed-after-{done}"
        shutil.copytree(source, case)
        for action, first in steps[:done]:
            if action == "create":
                (case / segment_name(first)).touch()
            else:
                (case / segment_name(first)).unlink()
        with FileStream(case, config) as reopened:
            kept = [(o, f"r{o:02d}".encode()) for o in range(before, 20)]
            assert reopened.read(before - 1, 100, 0.0) == kept
            assert reopened.append(b"next") == 20
            reopened.trim(before)  # the next trim finishes the job
        firsts = sorted(segment_files(case))
        assert firsts[0] <= before < (firsts[1] if len(firsts) > 1 else math.inf)


def test_a_log_of_an_earlier_version_is_read_as_its_first_segment(tmp_path: Path) -> None:
    log_dir = tmp_path / "s"
    with FileStream(log_dir) as stream:
        for r in (b"alpha", b"bravo"):
            stream.append(r)
    (log_dir / segment_name(0)).rename(log_dir / LEGACY_LOG_NAME)  # the one file earlier versions wrote
    with FileStream(log_dir) as reopened:
        assert reopened.read(-1, 10, 0.0) == [(0, b"alpha"), (1, b"bravo")]
        assert reopened.append(b"charlie") == 2
    assert sorted(p.name for p in log_dir.glob("records*")) == [segment_name(0)]


MULTI_WRITER = """
import sys, time
from inflight.buffer.file_stream import FileStream, FileStreamConfig
stream = FileStream(sys.argv[1], FileStreamConfig(fsync="never", segment_bytes=256))
print("ready", flush=True)
for i in range(int(sys.argv[2])):
    print(stream.append(f"child-{i}".encode()), flush=True)
    time.sleep(0.002)  # paced, so that the other process rolls and trims between these appends
"""


def test_a_writer_in_another_process_appends_while_this_one_reads_and_trims(tmp_path: Path) -> None:
    """Segments roll and go under the other writer's feet: it never writes into a deleted one, and the
    reader here gets every record once, in offset order (a record lost in a deleted file would leave a
    gap, and this loop would time out)."""
    log_dir, n = tmp_path / "log", 300
    with FileStream(log_dir, FileStreamConfig(fsync="never", segment_bytes=256)) as stream:
        child = subprocess.Popen(
            [sys.executable, "-c", MULTI_WRITER, str(log_dir), str(n)], stdout=subprocess.PIPE, text=True
        )
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        seen: list[tuple[int, bytes]] = []
        appended, deadline = 0, time.monotonic() + 30
        while len(seen) < 2 * n:
            assert time.monotonic() < deadline, f"read {len(seen)} of {2 * n} records in 30 s"
            if appended < n:
                stream.append(f"parent-{appended}".encode())
                appended += 1
                time.sleep(0.002)
            seen += stream.read(seen[-1][0] if seen else -1, 1000, 0.05)
            if seen:
                stream.trim(seen[-1][0] + 1)  # every record read is no longer needed
        acked = [int(line) for line in child.stdout.read().split()]  # after "ready", read above
        assert child.wait(timeout=60) == 0
    assert [offset for offset, _ in seen] == list(range(2 * n))
    by_offset = dict(seen)
    assert [by_offset[offset] for offset in acked] == [f"child-{i}".encode() for i in range(n)]
    parents = [data for _, data in seen if data.startswith(b"parent")]
    assert parents == [f"parent-{i}".encode() for i in range(n)]
    assert list(segment_files(log_dir)) == [2 * n]  # the last trim took every record: one empty segment


# -- the codec ----------------------------------------------------------------------------------


def make_group(seed: int = 0) -> RolloutGroup:
    rollouts = []
    for i in range(3):
        n = 5 + i
        rollouts.append(
            Rollout(
                token_ids=[seed + t for t in range(n)],
                loss_mask=[t >= 2 for t in range(n)],
                logprobs=[0.0, 0.0] + [-1 / (t + 3) - 1e-17 * seed for t in range(n - 2)],
                versions=[-1, -1] + [seed + t // 2 for t in range(n - 2)],
                reward=[0.1, 1 / 3, -math.pi][i],
                group_id=f"g{seed}",
                finish_reason=("stop", "length", "abort")[i],
                metrics={"format_errors": float(i), "tiny": 5e-324},
            )
        )
    return RolloutGroup(f"g{seed}", rollouts)


def test_codec_round_trip_is_exact_through_every_stream(stream_url: str) -> None:
    group = make_group(7)
    group.rollouts[0].logprobs[3] = math.nextafter(-0.5, 0.0)  # floats that a lossy format would round
    group.rollouts[1].reward = float("nan")
    group.rollouts[2].metrics["inf"] = float("-inf")
    with open_stream(stream_url) as stream:
        stream.append(encode_group(group))
        [(_, data)] = stream.read(-1, 1, 0.0)
    back = decode_group(data)
    bits = [struct.pack("<d", x) for r in back.rollouts for x in r.logprobs]
    assert bits == [struct.pack("<d", x) for r in group.rollouts for x in r.logprobs]
    assert math.isnan(back.rollouts[1].reward)
    back.rollouts[1].reward = group.rollouts[1].reward = 0.0  # nan != nan: compare the rest as a whole
    assert back == group


@pytest.mark.parametrize(
    ("data", "field"),
    [
        (b'{"group_id": "g", "rollouts": [{"token_ids": [1.5]}]}', "token_ids"),
        (b'{"group_id": "g"}', "rollouts"),
        (b"not json", "json"),
    ],
)
def test_codec_rejects_malformed_records_naming_the_field(data: bytes, field: str) -> None:
    with pytest.raises(CodecError, match=field):
        decode_group(data)


def test_codec_rejects_rollouts_whose_lists_disagree_in_length() -> None:
    data = encode_group(make_group()).replace(b'"versions":[-1,-1,', b'"versions":[-1,', 1)
    with pytest.raises(CodecError, match="length"):
        decode_group(data)
