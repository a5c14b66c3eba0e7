"""The version-aware buffer: staleness bound by admission (a hypothesis state machine drives a simulated
generator and trainer through arbitrary interleavings), active sampling, oldest-first batches, timeouts,
resume; and the pure lag / importance-weight metrics.

Reference: the admission rule in `inflight/buffer/buffer.py`'s docstring; OlmoRL's active sampling and
PipelineRL's admission control (/work/shared/reference/async-rl-prior-art.md §1.10, §2.4, §2.5); the
ESS definition (sum w)^2 / (N sum w^2) computed naively here.
"""

from __future__ import annotations

import json
import math
import threading
from dataclasses import asdict

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from inflight.buffer import RolloutBuffer, lag_histogram
from inflight.types import Rollout, RolloutGroup


def make_group(versions: list[list[int]], rewards: list[float], group_id: str = "g") -> RolloutGroup:
    """One rollout per entry: two prompt tokens, then generated tokens with the given versions."""
    rollouts = []
    for vs, reward in zip(versions, rewards, strict=True):
        n = 2 + len(vs)
        rollouts.append(
            Rollout(
                token_ids=list(range(n)),
                loss_mask=[False, False] + [True] * len(vs),
                logprobs=[0.0, 0.0] + [-0.5] * len(vs),
                versions=[-1, -1, *vs],
                reward=reward,
                group_id=group_id,
            )
        )
    return RolloutGroup(group_id, rollouts)


def informative(version: int, group_id: str = "g") -> RolloutGroup:
    return make_group([[version, version], [version]], [0.0, 1.0], group_id)


def admit_n(buffer: RolloutBuffer, n: int, engine_version: int, trainer_version: int) -> int:
    """How many of n admission requests in a row succeed."""
    return sum(buffer.admit(engine_version, trainer_version) for _ in range(n))


# -- admission ------------------------------------------------------------------------------------


def test_staleness_zero_is_the_synchronous_loop() -> None:
    b = 3
    buffer = RolloutBuffer(groups_per_step=b, max_staleness_steps=0)
    for version in range(3):
        # Exactly one batch of prompts runs on the weights the trainer has...
        assert admit_n(buffer, b + 5, engine_version=version, trainer_version=version) == b
        for i in range(b):
            buffer.put(informative(version, f"{version}-{i}"))
        assert buffer.get_batch(trainer_version=version, timeout_s=1.0)
        # ...and after the step nothing starts until the engine has the new weights.
        assert not buffer.admit(engine_version=version, trainer_version=version + 1)
    assert buffer.counters.stale_dropped == 0


@pytest.mark.parametrize("k", [1, 2, 3])
def test_generation_runs_at_most_k_steps_ahead(k: int) -> None:
    b = 2
    buffer = RolloutBuffer(groups_per_step=b, max_staleness_steps=k)
    # With the engine on the trainer's weights, prompts for the current step and k more may start.
    assert admit_n(buffer, 100, engine_version=0, trainer_version=0) == b * (k + 1)


def test_a_slow_old_prompt_holds_admission_after_younger_ones_finish() -> None:
    """An old prompt still in flight is due soon, whatever finishes before it: the buffer must keep
    counting it (its admission version) even though put() does not say which prompt a group is from."""
    buffer = RolloutBuffer(groups_per_step=2, max_staleness_steps=1)
    assert admit_n(buffer, 10, engine_version=0, trainer_version=0) == 4
    buffer.put(informative(0, "a"))
    buffer.put(informative(0, "b"))
    buffer.get_batch(trainer_version=0, timeout_s=1.0)
    buffer.cancel()  # one version-0 prompt failed; the other is still running
    assert buffer.admit(engine_version=1, trainer_version=1)
    buffer.put(informative(1, "young"))  # the young prompt overtakes the old one
    # The old prompt must be trained at version <= 1, in the next batch: no room for anything else.
    assert not buffer.admit(engine_version=1, trainer_version=1)
    buffer.put(informative(0, "old"))
    assert sorted(g.group_id for g in buffer.get_batch(trainer_version=1, timeout_s=1.0)) == ["old", "young"]
    assert buffer.counters.stale_dropped == 0


def test_an_admitted_prompt_that_raises_is_cancelled_and_frees_its_slot() -> None:
    buffer = RolloutBuffer(groups_per_step=2, max_staleness_steps=0)
    assert admit_n(buffer, 3, 0, 0) == 2
    buffer.cancel()
    assert buffer.admit(0, 0)
    metrics = buffer.step_metrics([], trainer_version=0)
    assert metrics["buffer/cancelled"] == 1
    assert metrics["buffer/in_flight"] == 2


def test_max_buffered_groups_bounds_an_unbounded_buffer() -> None:
    buffer = RolloutBuffer(groups_per_step=2, max_staleness_steps=None, max_buffered_groups=5)
    assert admit_n(buffer, 50, 0, 0) == 5
    for i in range(5):
        buffer.put(informative(0, str(i)))
    assert not buffer.admit(0, 0)
    buffer.get_batch(0, timeout_s=1.0)
    assert admit_n(buffer, 50, 0, 1) == 2


def test_bad_use_fails_with_the_reason() -> None:
    with pytest.raises(ValueError, match="groups_per_step"):
        RolloutBuffer(groups_per_step=0, max_staleness_steps=0)
    with pytest.raises(ValueError, match="max_staleness_steps"):
        RolloutBuffer(groups_per_step=1, max_staleness_steps=-1)
    with pytest.raises(ValueError, match="could never fill"):
        RolloutBuffer(groups_per_step=4, max_staleness_steps=None, max_buffered_groups=3)
    buffer = RolloutBuffer(groups_per_step=1, max_staleness_steps=0)
    with pytest.raises(RuntimeError, match="without a prompt in flight"):
        buffer.put(informative(0))
    with pytest.raises(RuntimeError, match="without a prompt in flight"):
        buffer.cancel()


class StalenessMachine(RuleBasedStateMachine):
    """A generator (admit, finish a prompt with in-flight weight updates, cancel, publish) and a trainer
    (take a batch, step) in any order. Invariant: every token trained at version t has version >= t - k,
    and admission alone keeps it so (nothing is ever dropped as stale)."""

    @initialize(
        b=st.integers(1, 3),
        k=st.one_of(st.none(), st.integers(0, 2)),
        active=st.booleans(),
        cap=st.one_of(st.none(), st.integers(4, 12)),
    )
    def setup(self, b: int, k: int | None, active: bool, cap: int | None) -> None:
        self.b, self.k = b, k
        self.buffer = RolloutBuffer(
            b, k, active_sampling=active, max_buffered_groups=max(cap, b) if cap else None
        )
        self.trainer_version = 0
        self.engine_version = 0
        self.in_flight: list[int] = []  # engine version at admission, per prompt
        self.trained_tokens = 0
        self.seq = 0
        self.buffered: dict[str, int | None] = {}  # group id -> lowest token version, as the test put them

    @rule()
    def admit(self) -> None:
        if self.buffer.admit(self.engine_version, self.trainer_version):
            self.in_flight.append(self.engine_version)

    @rule()
    def admit_until_refused(self) -> None:
        """What a real pipeline does: start prompts while admission says yes (capped: an unbounded
        buffer always says yes)."""
        for _ in range(12):
            if not self.buffer.admit(self.engine_version, self.trainer_version):
                break
            self.in_flight.append(self.engine_version)

    @rule()
    def publish_weights(self) -> None:
        self.engine_version = self.trainer_version

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data(), which=st.sampled_from(["newest", "oldest", "any"]), all_equal=st.booleans())
    def finish_a_prompt(self, data: st.DataObject, which: str, all_equal: bool) -> None:
        # "newest" lets later prompts overtake older ones still in flight: the order that stresses the
        # bound most (an old prompt finishing after batches of younger ones).
        index = {"newest": -1, "oldest": 0}.get(which)
        if index is None:
            index = data.draw(st.integers(0, len(self.in_flight) - 1))
        start = self.in_flight.pop(index)
        versions = []
        for _ in range(data.draw(st.integers(1, 3))):  # rollouts of the group
            # Tokens are generated in order while weights may change in flight: non-decreasing versions
            # between the admission version and the engine's current one. The first token usually comes
            # from the admission version itself (the worst case for lag); an empty rollout is allowed.
            n = data.draw(st.integers(0, 3))
            vs = sorted(data.draw(st.lists(st.integers(start, self.engine_version), min_size=n, max_size=n)))
            if vs and data.draw(st.integers(0, 3)) > 0:
                vs[0] = start
            versions.append(vs)
        rewards = [1.0] * len(versions) if all_equal else [float(i) for i in range(len(versions))]
        self.seq += 1
        group = make_group(versions, rewards, f"p{self.seq}")
        self.buffer.put(group)
        if group.is_informative or not self.buffer.active_sampling:
            self.buffered[group.group_id] = min((v for vs in versions for v in vs), default=None)

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data())
    def cancel_a_prompt(self, data: st.DataObject) -> None:
        self.in_flight.pop(data.draw(st.integers(0, len(self.in_flight) - 1)))
        self.buffer.cancel()

    @rule(skipped=st.booleans())
    def train_step(self, skipped: bool) -> None:
        """`skipped`: the batch had nothing to train on (the trainer's version stays where it was)."""
        try:
            batch = self.buffer.get_batch(self.trainer_version, timeout_s=0.0)
        except TimeoutError:
            return
        assert len(batch) == self.b
        for group in batch:
            del self.buffered[group.group_id]
        for group in batch:
            for rollout in group.rollouts:
                for version, trained in zip(rollout.versions, rollout.loss_mask, strict=True):
                    if trained:
                        self.trained_tokens += 1
                        assert version <= self.trainer_version
                        if self.k is not None:
                            assert self.trainer_version - version <= self.k, (self.trainer_version, version)
        self.trainer_version += 0 if skipped else 1
        self.buffer.step_done(self.trainer_version)

    @invariant()
    def the_admission_invariant_holds_on_the_true_versions(self) -> None:
        """(I) of the buffer's docstring, with the admission versions only this simulation knows (the
        buffer keeps a conservative stand-in): every unconsumed prompt is due by version floor + k.
        Checked at every step, it catches a wrong admission long before a stale token is trained."""
        if self.k is None:
            return
        floors = self.in_flight + [f for f in self.buffered.values() if f is not None]
        unconsumed = len(self.in_flight) + len(self.buffered)
        if floors:
            assert self.trainer_version + math.ceil(unconsumed / self.b) - 1 <= min(floors) + self.k

    @invariant()
    def nothing_is_dropped_and_every_prompt_is_accounted_for(self) -> None:
        m = self.buffer.step_metrics([], self.trainer_version)
        assert m["buffer/stale_dropped"] == 0
        assert m["buffer/in_flight"] == len(self.in_flight)
        assert m["buffer/admitted"] == m["buffer/put"] + m["buffer/cancelled"] + m["buffer/in_flight"]
        assert m["buffer/put"] == m["buffer/filtered"] + m["buffer/consumed"] + m["buffer/buffered"]

    @invariant()
    def the_pipeline_can_always_make_progress(self) -> None:
        # Once the engine runs the trainer's weights and nothing is pending, a prompt may always start.
        if not self.in_flight and self.engine_version == self.trainer_version:
            m = self.buffer.step_metrics([], self.trainer_version)
            if m["buffer/buffered"] < self.b:
                probe = RolloutBuffer(self.b, self.k, max_buffered_groups=self.buffer.max_buffered_groups)
                probe.load_state_dict(self.buffer.state_dict())
                assert probe.admit(self.engine_version, self.trainer_version)


TestStalenessBound = StalenessMachine.TestCase
TestStalenessBound.settings = settings(max_examples=200, stateful_step_count=40, deadline=None, database=None)


# -- batches --------------------------------------------------------------------------------------


def test_active_sampling_keeps_only_informative_groups_and_counts_the_rest() -> None:
    buffer = RolloutBuffer(groups_per_step=2, max_staleness_steps=None)
    groups = [
        make_group([[0], [0]], [1.0, 1.0], "all-solved"),
        informative(0, "a"),
        make_group([[0], [0]], [0.0, 0.0], "all-failed"),
        make_group([[0]], [0.5], "single"),
        informative(0, "b"),
    ]
    for g in groups:
        assert buffer.admit(0, 0)
        buffer.put(g)
    batch = buffer.get_batch(0, timeout_s=1.0)
    assert [g.group_id for g in batch] == ["a", "b"]
    assert buffer.counters.filtered == 3
    # What the policy did is every rollout drawn (mean reward 4.5 / 9), not only the batch (2 / 4).
    drawn = buffer.take_drawn()
    assert sorted(r.group_id for r in drawn) == sorted(g.group_id for g in groups for _ in g.rollouts)
    assert buffer.take_drawn() == []  # nothing arrived since


def test_without_active_sampling_uninformative_groups_are_trained_on() -> None:
    buffer = RolloutBuffer(groups_per_step=2, max_staleness_steps=None, active_sampling=False)
    for g in (make_group([[0], [0]], [1.0, 1.0], "flat"), informative(0, "a")):
        buffer.admit(0, 0)
        buffer.put(g)
    assert [g.group_id for g in buffer.get_batch(0, timeout_s=1.0)] == ["flat", "a"]
    assert buffer.counters.filtered == 0


def test_active_sampling_lets_flat_groups_through_once_the_batch_budget_is_spent() -> None:
    """A policy whose groups never differ would make active sampling draw forever: the budget ends it."""
    buffer = RolloutBuffer(groups_per_step=2, max_staleness_steps=None, max_filtered_per_batch=3)
    for i in range(5):
        assert buffer.admit(0, 0)
        buffer.put(make_group([[0], [0]], [0.0, 0.0], f"flat-{i}"))
    assert buffer.counters.filtered == 3 and buffer.counters.filter_passed == 2
    assert [g.group_id for g in buffer.get_batch(0, timeout_s=1.0)] == ["flat-3", "flat-4"]
    # The next batch has a fresh budget.
    assert buffer.admit(0, 1)
    buffer.put(make_group([[0], [0]], [1.0, 1.0], "flat-5"))
    assert buffer.counters.filtered == 4 and buffer.counters.filter_passed == 2
    with pytest.raises(ValueError, match="max_filtered_per_batch"):
        RolloutBuffer(groups_per_step=2, max_staleness_steps=None, max_filtered_per_batch=-1)


def test_put_if_filtered_takes_only_what_put_would_filter_and_counts_it_as_put_does() -> None:
    """A producer asks before it records a group: the buffer takes (and counts) one that put() would
    filter, within the batch's budget, and leaves every other group to the stream and put()."""
    buffer = RolloutBuffer(groups_per_step=2, max_staleness_steps=None, max_filtered_per_batch=2)
    flat = [make_group([[0], [0]], [1.0, 1.0], f"flat-{i}") for i in range(3)]
    for _ in range(5):  # the three flat groups, "a" and "b"
        assert buffer.admit(0, 0)
    assert buffer.put_if_filtered(flat[0]) and buffer.put_if_filtered(flat[1])
    assert not buffer.put_if_filtered(informative(0, "a"))  # informative: for the stream, then put()
    assert not buffer.put_if_filtered(flat[2])  # the budget is spent: put() lets it through
    assert buffer.counters.filtered == 2 and buffer.counters.put == 2 and buffer.counters.filter_passed == 0
    assert len(buffer._in_flight_floors) == 3  # the two it took are no longer in flight
    for group in (flat[2], informative(0, "a"), informative(0, "b")):
        buffer.put(group)
    assert [g.group_id for g in buffer.get_batch(0, timeout_s=1.0)] == ["flat-2", "a"]
    assert buffer.counters.filter_passed == 1 and buffer.counters.put == 5
    # Every rollout drawn, taken early or put, is in the policy's reward mean.
    assert len(buffer.take_drawn()) == 5 * 2
    off = RolloutBuffer(groups_per_step=2, max_staleness_steps=None, active_sampling=False)
    assert off.admit(0, 0) and not off.put_if_filtered(flat[0])


def test_a_skipped_step_lets_an_on_policy_buffer_admit_again() -> None:
    """With k = 0, a step that trained nothing leaves the trainer (and engine) at the same version."""
    buffer = RolloutBuffer(groups_per_step=2, max_staleness_steps=0, active_sampling=False)
    assert admit_n(buffer, 3, engine_version=0, trainer_version=0) == 2
    for i in range(2):
        buffer.put(make_group([[0], [0]], [1.0, 1.0], f"flat-{i}"))
    buffer.get_batch(trainer_version=0, timeout_s=1.0)
    assert not buffer.admit(engine_version=0, trainer_version=0)  # assumes the step trains: waits for v1
    buffer.step_done(trainer_version=0)  # it was skipped: the next batch trains at version 0 again
    assert admit_n(buffer, 3, engine_version=0, trainer_version=0) == 2


def test_batches_are_oldest_first_by_token_version_then_arrival() -> None:
    buffer = RolloutBuffer(groups_per_step=2, max_staleness_steps=None)
    for version, name in [(3, "v3"), (1, "v1-first"), (2, "v2"), (1, "v1-second")]:
        buffer.admit(version, 3)
        buffer.put(informative(version, name))
    assert [g.group_id for g in buffer.get_batch(3, 1.0)] == ["v1-first", "v1-second"]
    assert [g.group_id for g in buffer.get_batch(4, 1.0)] == ["v2", "v3"]


def test_groups_too_stale_for_the_bound_are_dropped_and_counted() -> None:
    buffer = RolloutBuffer(groups_per_step=1, max_staleness_steps=1)
    assert admit_n(buffer, 2, 0, 0) == 2
    buffer.put(informative(0, "due"))
    # The trainer jumps past what admission planned for (a caller bug, or a restore from elsewhere):
    # the due group is too old to train at version 3...
    with pytest.raises(TimeoutError):
        buffer.get_batch(trainer_version=3, timeout_s=0.0)
    # ...and so is one that arrives now.
    buffer.put(informative(0, "late"))
    assert buffer.counters.stale_dropped == 2
    assert buffer.step_metrics([], 3)["buffer/buffered"] == 0


def test_get_batch_times_out_naming_what_it_waited_for() -> None:
    buffer = RolloutBuffer(groups_per_step=4, max_staleness_steps=1)
    buffer.admit(0, 0)
    buffer.put(informative(0))
    buffer.admit(0, 0)
    with pytest.raises(TimeoutError, match=r"4 informative groups .* 1 buffered, 1 in flight"):
        buffer.get_batch(0, timeout_s=0.05)


def test_get_batch_wakes_up_when_the_last_group_arrives_from_another_thread() -> None:
    buffer = RolloutBuffer(groups_per_step=2, max_staleness_steps=0)
    assert admit_n(buffer, 2, 0, 0) == 2
    buffer.put(informative(0, "first"))
    timer = threading.Timer(0.1, lambda: buffer.put(informative(0, "second")))
    timer.start()
    try:
        assert [g.group_id for g in buffer.get_batch(0, timeout_s=30.0)] == ["first", "second"]
    finally:
        timer.join()


def test_threads_hammering_the_buffer_keep_the_bound() -> None:
    """Rollout workers and a trainer in real threads; lags checked on every trained token."""
    k, b, steps = 1, 3, 12
    buffer = RolloutBuffer(groups_per_step=b, max_staleness_steps=k)
    versions = {"trainer": 0, "engine": 0}
    lags: list[int] = []
    stop = threading.Event()

    def worker(w: int) -> None:
        n = 0
        while not stop.is_set():
            engine = versions["engine"]
            if not buffer.admit(engine, versions["trainer"]):
                buffer.wait_changed(0.01)
                continue
            n += 1
            if n % 7 == 0:
                buffer.cancel()
            else:
                buffer.put(
                    make_group([[engine, versions["engine"]], [engine]], [0.0, float(n % 3)], f"{w}-{n}")
                )

    workers = [threading.Thread(target=worker, args=(w,)) for w in range(3)]
    for t in workers:
        t.start()
    try:
        for step in range(steps):
            batch = buffer.get_batch(step, timeout_s=30.0)
            lags += [
                step - v
                for g in batch
                for r in g.rollouts
                for v, m in zip(r.versions, r.loss_mask, strict=True)
                if m
            ]
            versions["trainer"] = step + 1
            versions["engine"] = step + 1  # weights published after each step
    finally:
        stop.set()
        for t in workers:
            t.join()
    assert lags and max(lags) <= k
    assert buffer.counters.stale_dropped == 0


# -- resume ---------------------------------------------------------------------------------------


def test_state_dict_round_trips_buffered_groups_and_counters_through_json() -> None:
    buffer = RolloutBuffer(groups_per_step=2, max_staleness_steps=2)
    for i, g in enumerate(
        [informative(1, "a"), make_group([[1], [1]], [1.0, 1.0], "flat"), informative(0, "b")]
    ):
        assert buffer.admit(i // 2, 0)
        buffer.put(g)
    assert buffer.admit(1, 0)  # still in flight when the state is saved
    state = json.loads(json.dumps(buffer.state_dict()))

    restored = RolloutBuffer(groups_per_step=2, max_staleness_steps=2)
    restored.load_state_dict(state)
    expected = asdict(buffer.counters)
    expected["lost_on_resume"] = 1  # the in-flight prompt is counted, for the pipeline to re-issue
    assert asdict(restored.counters) == expected
    with pytest.raises(RuntimeError, match="empty buffer"):
        restored.load_state_dict(state)
    assert restored.get_batch(0, 1.0) == buffer.get_batch(0, 1.0)
    # The in-flight prompt's result reached a durable stream before the crash: recovered, not lost.
    restored.put_recovered(informative(1, "recovered"))
    assert restored.counters.lost_on_resume == 0
    assert restored.step_metrics([], 1)["buffer/buffered"] == 1


# -- metrics --------------------------------------------------------------------------------------


def test_step_metrics_histogram_of_per_token_lag() -> None:
    buffer = RolloutBuffer(groups_per_step=1, max_staleness_steps=None)
    batch = [make_group([[5, 5], [4, 1]], [0.0, 1.0])]  # at trainer version 5: lags 0, 0, 1, 4
    m = buffer.step_metrics(batch, trainer_version=5)
    assert m["lag_steps_frac/0"] == 0.5
    assert m["lag_steps_frac/1"] == 0.25
    assert m["lag_steps_frac/4-7"] == 0.25
    assert m["lag_steps_mean"] == (0 + 0 + 1 + 4) / 4
    assert m["lag_steps_max"] == 4
    assert m["lag_tokens"] == 4


def test_lag_histogram_fractions_sum_to_one_and_reject_negative_lags() -> None:
    m = lag_histogram([0, 3, 9, 100, 100, 2])
    assert math.isclose(sum(v for key, v in m.items() if key.startswith("lag_steps_frac/")), 1.0)
    assert m["lag_steps_frac/16+"] == 2 / 6
    with pytest.raises(ValueError, match="negative lag"):
        lag_histogram([1, -1])
