"""Skip connections across partitions: ``@skippable`` layers stash and pop tensors.

Usage::

    from pipe.skip import Namespace, pop, skippable, stash, verify_skippables
"""
from pipe.core.deprecation import moved
from pipe.skip.namespace import Namespace
from pipe.skip.skippable import pop, skippable, stash, verify_skippables

__all__ = ["skippable", "stash", "pop", "Namespace", "verify_skippables"]

# What the runners use, exported here before: importable for one release, with a warning.
_MOVED = {"Skippable": "pipe.skip.skippable", "SkipLayout": "pipe.skip.layout", "inspect_skip_layout": "pipe.skip.layout",
          "SkipTracker": "pipe.skip.tracker", "SkipTrackerThroughPortals": "pipe.skip.tracker",
          "use_skip_tracker": "pipe.skip.tracker", "current_skip_tracker": "pipe.skip.tracker"}
_getters = {name: moved(__name__, module, [name]) for name, module in _MOVED.items()}


def __getattr__(name: str) -> object:
    if name in _getters:
        return _getters[name](name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
