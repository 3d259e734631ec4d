"""Startup objects frozen out of the cyclic garbage collector: a full collection then walks only
what the process made since, and garbage made later is still collected."""
from __future__ import annotations

import gc
import weakref

from shared.startup_objects import freeze_startup_objects


class _Node:
    def __init__(self):
        self.other = self


def test_freezing_leaves_no_startup_object_for_a_collection_to_walk_and_later_cycles_still_go():
    kept = [_Node() for _ in range(1000)]  # startup state: alive, tracked, cyclic
    unreachable = _Node()
    gone = weakref.ref(unreachable)
    del unreachable  # startup garbage: the freeze collects it first
    try:
        frozen = freeze_startup_objects()
        assert gone() is None
        # Frozen objects can still be freed by their references dropping (a thread left by another test
        # may drop some meanwhile); nothing joins the permanent generation without a freeze.
        assert frozen >= len(kept) and len(kept) <= gc.get_freeze_count() <= frozen
        tracked = {id(o) for o in gc.get_objects()}
        assert not any(id(node) in tracked for node in kept)
        later = _Node()
        later_ref = weakref.ref(later)
        del later
        gc.collect()
        assert later_ref() is None  # a cycle made after the freeze is collected as before
        assert all(node.other is node for node in kept)  # frozen objects are untouched, not freed
    finally:
        gc.unfreeze()
