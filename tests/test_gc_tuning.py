"""`long_lived_frozen`: within the block the objects alive at its start are out of the cyclic collector's
reach, objects made inside are collected as usual, and at its end everything is collected again (no cycle
kept past the block). Where runs, services and the trainer process enter it: gc_tuning.py's docstring."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from inflight.gc_tuning import freeze_long_lived, long_lived_frozen


class Node:
    """A weak-referenceable object that can sit in a reference cycle."""

    def __init__(self) -> None:
        self.other: Node | None = None


def cycle() -> weakref.ref[Node]:
    """A two-object reference cycle, no longer referenced from outside: garbage only the collector frees.
    Returns a weak reference to one of its objects (dead once collected)."""
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


@pytest.fixture(autouse=True)
def nothing_frozen_around() -> Iterator[None]:
    """Each test starts and ends with no object frozen, whatever the test before it did."""
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_objects_alive_at_the_start_are_frozen_until_the_end() -> None:
    kept = Node()
    with long_lived_frozen():
        assert gc.get_freeze_count() > 0
        assert not any(o is kept for o in gc.get_objects())  # in no generation the collector traces
    assert gc.get_freeze_count() == 0
    assert any(o is kept for o in gc.get_objects())  # back among the collector's objects


def test_garbage_made_inside_is_collected_inside() -> None:
    with long_lived_frozen():
        dead = cycle()
        gc.collect()
        assert dead() is None


def test_a_cycle_of_frozen_objects_dropped_inside_is_collected_once_the_block_ends() -> None:
    a, b = Node(), Node()
    a.other, b.other = b, a
    dead = weakref.ref(a)
    with long_lived_frozen():
        del a, b  # garbage now, but frozen: the collector does not see it
        gc.collect()
        assert dead() is not None
    gc.collect()
    assert dead() is None  # unfrozen at the end: no cycle outlives the block


def test_blocks_may_overlap_and_the_first_end_unfreezes_all() -> None:
    with long_lived_frozen(), long_lived_frozen():
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0


def test_freezing_for_good_keeps_the_objects_frozen() -> None:
    kept = Node()
    freeze_long_lived()
    assert gc.get_freeze_count() > 0
    assert not any(o is kept for o in gc.get_objects())
