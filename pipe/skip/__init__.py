"""Skip connections across partitions: ``@skippable`` layers stash and pop tensors.

Usage::

    from pipe.skip import Namespace, pop, skippable, stash, verify_skippables
"""
from pipe.skip.layout import SkipLayout, inspect_skip_layout
from pipe.skip.namespace import Namespace
from pipe.skip.skippable import Skippable, pop, skippable, stash, verify_skippables
from pipe.skip.tracker import SkipTracker, SkipTrackerThroughPortals, current_skip_tracker, use_skip_tracker

__all__ = [
    "skippable", "stash", "pop", "Namespace", "verify_skippables", "Skippable",
    "SkipLayout", "inspect_skip_layout",
    "SkipTracker", "SkipTrackerThroughPortals", "use_skip_tracker", "current_skip_tracker",
]
