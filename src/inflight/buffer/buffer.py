"""The version-aware rollout buffer: admission that bounds staleness, oldest-first batches, active sampling.

It sits between rollout workers (asyncio thread: `admit`, `cancel`, `put`) and the trainer thread
(`get_batch`). It knows versions and rewards, not engines, environments or streams.

Staleness bound by admission (k = max_staleness_steps, B = groups_per_step)
---------------------------------------------------------------------------
A prompt *admitted* while the engine runs version w yields tokens with versions >= w. The buffer
tracks `t`, the trainer version the next batch will be trained at (the largest trainer version it has
been told, and one past the last batch it handed out), and U, the groups not yet consumed (in flight +
buffered). Whatever order groups finish and are consumed in, each batch takes B of them, so every one of
them is consumed by version t + ceil(U / B) - 1. Hence the invariant

    (I)   t + ceil(U / B) - 1 <= F + k,    F = the lowest version floor among unconsumed groups

(an in-flight prompt's floor is the engine version it was admitted at; a buffered group's is the lowest
version of its generated tokens). `admit(w, trainer_version)` says yes exactly when (I) still holds with
U + 1 groups, F lowered to w and t raised to trainer_version. Everything else only keeps (I): `put`
keeps U, `cancel`/filters/drops lower U, a batch lowers U by B and raises t by 1. At consumption U >= B,
so (I) gives t <= F + k: no token trained at version t has a version below t - k.

Because `put` does not say which admission a group came from, in-flight floors are a multiset from which
`put`/`cancel` remove the largest: the remaining floors are then never above the true ones, so (I) on
them implies (I) on the truth. k = 0 is the synchronous loop: B prompts at version v, one batch, then
nothing is admitted until the engine runs v + 1. k = None lifts the bound (then only
`max_buffered_groups` limits how far generation runs ahead). Should a caller break (I) anyway (a trainer
version that jumps, groups recovered after a restart without admission), groups the bound no longer
allows are dropped when they arrive or fall due, and counted as `stale_dropped`. A step the trainer skips
(nothing informative to train on) leaves its version where it was: `step_done` says so, and t comes back
down (with k = 0 the engine would otherwise wait for a version that never comes).

Active sampling drops groups whose rewards are all equal (no GRPO signal) and keeps drawing. When a
policy gives no signal at all (a task too hard or too easy for it), drawing would never end: after
`max_filtered_per_batch` groups were filtered for one batch, uninformative groups are let through
(`filter_passed`), and the trainer skips or shrinks that step as the sync loop does.
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

from inflight.buffer.codec import decode_group, encode_group
from inflight.buffer.metrics import lag_histogram
from inflight.types import Rollout, RolloutGroup

_STATE_FORMAT = 1


@dataclass
class BufferCounters:
    """Cumulative counts since the start of the run (restored on resume). Nothing leaves unseen."""

    admitted: int = 0  # prompts admit() let start
    refused: int = 0  # admit() calls answered False (a gauge of back-pressure, counted per call)
    cancelled: int = 0  # admitted prompts that produced nothing (their rollout raised)
    put: int = 0  # groups delivered by put()
    filtered: int = 0  # groups dropped by active sampling: all rewards equal, no GRPO signal
    filter_passed: int = 0  # uninformative groups let through: the batch's filter budget was spent
    stale_dropped: int = 0  # groups too old for the staleness bound when they arrived or were due
    consumed: int = 0  # groups handed to the trainer in batches
    batches: int = 0
    lost_on_resume: int = 0  # prompts in flight when the state was saved (the pipeline re-issues them)


def _version_floor(group: RolloutGroup) -> int | None:
    """The oldest version among the group's generated tokens; None when it generated nothing."""
    versions = [r.min_version for r in group.rollouts if r.num_generated]
    return min(versions) if versions else None


class RolloutBuffer:
    def __init__(
        self,
        groups_per_step: int,
        max_staleness_steps: int | None,
        active_sampling: bool = True,
        max_buffered_groups: int | None = None,
        max_filtered_per_batch: int | None = None,
    ) -> None:
        if groups_per_step < 1:
            raise ValueError(f"groups_per_step must be >= 1, got {groups_per_step}")
        if max_staleness_steps is not None and max_staleness_steps < 0:
            raise ValueError(
                f"max_staleness_steps must be >= 0 or None (unbounded), got {max_staleness_steps}"
            )
        if max_buffered_groups is not None and max_buffered_groups < groups_per_step:
            raise ValueError(
                f"max_buffered_groups={max_buffered_groups} < groups_per_step={groups_per_step}: a batch "
                "could never fill; raise max_buffered_groups or set it to None"
            )
        if max_filtered_per_batch is not None and max_filtered_per_batch < 0:
            raise ValueError(f"max_filtered_per_batch must be >= 0 or None, got {max_filtered_per_batch}")
        self.groups_per_step = groups_per_step
        self.max_staleness_steps = max_staleness_steps
        self.active_sampling = active_sampling
        self.max_buffered_groups = max_buffered_groups
        self.max_filtered_per_batch = max_filtered_per_batch  # None = filter forever
        self._filtered_this_batch = 0
        self._drawn: list[Rollout] = []  # every rollout put since the last take_drawn(), filtered too
        self.counters = BufferCounters()
        self._in_flight_floors: list[int] = []  # engine version at admission, one per prompt in flight
        # Oldest first: (version floor, arrival order, group); groups without generated tokens sort last.
        self._buffered: list[tuple[float, int, RolloutGroup]] = []
        self._arrival = itertools.count()
        self._next_version = 0  # `t` of the docstring: the trainer version of the next batch
        self._changed = threading.Condition()

    # -- rollout workers (non-blocking) ------------------------------------------------------------

    def admit(self, engine_version: int, trainer_version: int) -> bool:
        """May one more prompt start now, on an engine running `engine_version`? True counts it in flight."""
        with self._changed:
            t = max(self._next_version, trainer_version)
            unconsumed = len(self._in_flight_floors) + len(self._buffered)
            ok = self.max_buffered_groups is None or unconsumed < self.max_buffered_groups
            if ok and self.max_staleness_steps is not None:
                floor = min(engine_version, self._lowest_floor())
                ok = (
                    t + math.ceil((unconsumed + 1) / self.groups_per_step) - 1
                    <= floor + self.max_staleness_steps
                )
            if not ok:
                self.counters.refused += 1
                return False
            self._next_version = t
            self._in_flight_floors.append(engine_version)
            self.counters.admitted += 1
            return True

    def cancel(self) -> None:
        """An admitted prompt produced nothing (its rollout raised): it is no longer in flight."""
        with self._changed:
            self._pop_in_flight("cancel")
            self.counters.cancelled += 1
            self._changed.notify_all()

    def put(self, group: RolloutGroup) -> None:
        """Deliver the group of an admitted prompt. Uninformative groups (active sampling) and groups too
        stale for the bound are dropped here and counted."""
        with self._changed:
            self._pop_in_flight("put")
            self._accept(group)

    def put_if_filtered(self, group: RolloutGroup) -> bool:
        """Deliver the group of an admitted prompt now if `put` would filter it (active sampling, within the
        batch's budget), counted as `put` counts it; True if it did. A producer asks before it records the
        group anywhere (the result stream), so that a group nobody trains on is never written and read back:
        with the tiny model's BlackJack over half of the groups played."""
        with self._changed:
            if not self._filters(group):
                return False
            self._pop_in_flight("put")
            self._accept(group)
            return True

    def put_recovered(self, group: RolloutGroup) -> None:
        """After a restart: a group whose prompt was in flight when the state was saved (it is counted in
        `lost_on_resume`, not in flight). Same filters as `put`."""
        with self._changed:
            self.counters.lost_on_resume = max(0, self.counters.lost_on_resume - 1)
            self._accept(group)

    # -- trainer --------------------------------------------------------------------------------

    def get_batch(self, trainer_version: int, timeout_s: float) -> list[RolloutGroup]:
        """The groups_per_step oldest buffered groups (lowest token version first), for training at
        `trainer_version`. Waits up to timeout_s for enough; raises TimeoutError saying what was missing."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            self._next_version = max(self._next_version, trainer_version)
            while True:
                # Due groups that the bound no longer allows are dropped, counted (rare: see (I)).
                while self._buffered and self._too_stale(self._buffered[0][0], trainer_version):
                    heapq.heappop(self._buffered)
                    self.counters.stale_dropped += 1
                if len(self._buffered) >= self.groups_per_step:
                    batch = [heapq.heappop(self._buffered)[2] for _ in range(self.groups_per_step)]
                    self._next_version = max(self._next_version, trainer_version + 1)
                    self.counters.consumed += len(batch)
                    self.counters.batches += 1
                    self._filtered_this_batch = 0
                    self._changed.notify_all()
                    return batch
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(self._timeout_message(trainer_version, timeout_s))
                self._changed.wait(remaining)

    def step_done(self, trainer_version: int) -> None:
        """The trainer finished a step and is at `trainer_version` now: one more than at `get_batch`, or the
        same when it skipped the step. The next batch trains at that version (see the module docstring)."""
        with self._changed:
            self._next_version = trainer_version
            self._changed.notify_all()

    def wait_changed(self, timeout_s: float) -> None:
        """Block until a put/cancel/batch changes what admit() may answer, or timeout_s passes (no error:
        engine version bumps happen outside the buffer, so callers re-check admit() either way)."""
        with self._changed:
            self._changed.wait(timeout_s)

    def step_metrics(self, batch: list[RolloutGroup], trainer_version: int) -> dict[str, float]:
        """Per-token lag histogram of `batch` trained at `trainer_version`, and the buffer's counters."""
        lags = (
            trainer_version - v
            for group in batch
            for rollout in group.rollouts
            for v, m in zip(rollout.versions, rollout.loss_mask, strict=True)
            if m
        )
        out = lag_histogram(lags)
        with self._changed:
            out.update({f"buffer/{k}": float(v) for k, v in asdict(self.counters).items()})
            out["buffer/in_flight"] = float(len(self._in_flight_floors))
            out["buffer/buffered"] = float(len(self._buffered))
        return out

    def take_drawn(self) -> list[Rollout]:
        """Every rollout that arrived since the last call, filtered or not: what the policy did. (With
        active sampling a batch over-represents the groups whose rewards differ.)"""
        with self._changed:
            drawn, self._drawn = self._drawn, []
            return drawn

    # -- resume ---------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable: buffered groups (oldest first), counters and the next batch's version.
        Prompts in flight cannot be saved (their rollouts are running); their number is kept and counted
        as `lost_on_resume` when loaded, for the pipeline to re-issue them."""
        with self._changed:
            ordered = sorted(self._buffered, key=lambda item: item[:2])
            return {
                "format": _STATE_FORMAT,
                "next_version": self._next_version,
                "counters": asdict(self.counters),
                "in_flight": len(self._in_flight_floors),
                "buffered": [encode_group(g).decode() for _, _, g in ordered],
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("format") != _STATE_FORMAT:
            raise ValueError(
                f"buffer state format {state.get('format')!r}; this version reads {_STATE_FORMAT}"
            )
        with self._changed:
            if self._buffered or self._in_flight_floors:
                raise RuntimeError("load_state_dict needs an empty buffer (load before any admit/put)")
            self.counters = BufferCounters(**state["counters"])
            self.counters.lost_on_resume += int(state["in_flight"])
            self._next_version = int(state["next_version"])
            for text in state["buffered"]:
                group = decode_group(text)
                floor = _version_floor(group)
                heapq.heappush(
                    self._buffered, (math.inf if floor is None else floor, next(self._arrival), group)
                )
            self._changed.notify_all()

    # -- internals (caller holds self._changed) -------------------------------------------------

    def _filters(self, group: RolloutGroup) -> bool:
        """Would `_accept` drop this group as uninformative now (active sampling, the batch's budget left)?"""
        budget = self.max_filtered_per_batch
        return (
            self.active_sampling
            and not group.is_informative
            and (budget is None or self._filtered_this_batch < budget)
        )

    def _accept(self, group: RolloutGroup) -> None:
        self.counters.put += 1
        self._drawn.extend(group.rollouts)
        floor = _version_floor(group)
        if self._filters(group):
            self.counters.filtered += 1
            self._filtered_this_batch += 1
            self._changed.notify_all()
            return
        if self.active_sampling and not group.is_informative:
            self.counters.filter_passed += 1
        if self._too_stale(floor, self._next_version):
            self.counters.stale_dropped += 1
        else:
            key = math.inf if floor is None else floor
            heapq.heappush(self._buffered, (key, next(self._arrival), group))
        self._changed.notify_all()

    def _lowest_floor(self) -> float:
        floors = [*self._in_flight_floors, *(key for key, _, _ in self._buffered)]
        return min(floors, default=math.inf)

    def _pop_in_flight(self, what: str) -> None:
        if not self._in_flight_floors:
            raise RuntimeError(
                f"{what}() without a prompt in flight: every {what} must follow an admit() == True"
            )
        # The largest floor: see the docstring for why this keeps the bound safe.
        self._in_flight_floors.remove(max(self._in_flight_floors))

    def _too_stale(self, floor: float | None, trainer_version: int) -> bool:
        k = self.max_staleness_steps
        return k is not None and floor is not None and trainer_version - floor > k

    def shortfall(self, trainer_version: int) -> str:
        """What a batch at `trainer_version` waits for, and the counts that tell why it is not there (for the
        message of a wait that timed out)."""
        kind = "informative groups (active sampling)" if self.active_sampling else "groups"
        with self._changed:
            c = self.counters
            return (
                f"{self.groups_per_step} {kind} at trainer version {trainer_version}: {len(self._buffered)} "
                f"buffered, {len(self._in_flight_floors)} in flight; so far admitted={c.admitted} "
                f"refused={c.refused} filtered={c.filtered} stale_dropped={c.stale_dropped} "
                f"cancelled={c.cancelled}"
            )

    def _timeout_message(self, trainer_version: int, timeout_s: float) -> str:
        return (
            f"RolloutBuffer.get_batch waited {timeout_s:.1f}s for {self.shortfall(trainer_version)}. Are "
            "rollout workers running, and is the engine receiving new weights (admission waits for it)?"
        )
