"""Namespaces: keep the skip names of two copies of one block apart.

A block that stashes ``"skip"`` and pops it again can appear twice in a model
only if each copy's ``"skip"`` is a different skip. ``block.isolate(ns)`` puts
the names of a copy in a namespace of its own; skips match on
``(namespace, name)``. ``None`` is the default namespace.
"""
from __future__ import annotations

import uuid
from typing import Any, Optional

__all__: list[str] = []


class Namespace:
    """A unique namespace for skip names.

    Usage::

        ns1, ns2 = Namespace(), Namespace()
        model = nn.Sequential(Block().isolate(ns1), Block().isolate(ns2))

    Namespaces compare by identity of their id (which survives ``deepcopy``
    and pickling) and are ordered so that layouts can be sorted; the order
    itself means nothing.
    """

    __slots__ = ("id",)

    def __init__(self) -> None:
        self.id = uuid.uuid4()

    def __repr__(self) -> str:
        return f"<Namespace {str(self.id)[:8]}>"

    def __hash__(self) -> int:
        return hash(self.id)

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Namespace) and self.id == other.id

    def __lt__(self, other: Any) -> bool:
        if not isinstance(other, Namespace):
            return NotImplemented
        return self.id < other.id

    def __getstate__(self) -> uuid.UUID:
        return self.id

    def __setstate__(self, state: uuid.UUID) -> None:
        self.id = state


NamespaceOrNone = Optional[Namespace]

#: A skip is identified by its namespace (``None``: the default one) and its name.
SkipKey = tuple[NamespaceOrNone, str]
